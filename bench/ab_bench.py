#!/usr/bin/env python3
"""Host benchmarks of two weightstream builds, interleaved in one run: a change's before and after.

Rows: host load --io pread, host load in place (default --io auto), layout tp 1 and tp 2 rank 1,
digest xxh64, S3 load (loopback nginx, as bench/s3_bench.py serves it). Each row runs the two
builds alternately, --runs times; GB/s is tensor bytes over wall seconds of the whole process.
Usage: bench/ab_bench.py BEFORE_CLI AFTER_CLI CHECKPOINT_DIR [--runs 5]   (S3 rows need nginx, as s3_bench.py)
"""
import argparse, os, json, signal, statistics, subprocess, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import s3_bench  # noqa: E402

def wall(cmd, env=None):
    start = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.monotonic() - start

def main():
    p = argparse.ArgumentParser()
    p.add_argument("before"); p.add_argument("after"); p.add_argument("checkpoint")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--s3-workdir", default=os.path.join(tempfile.gettempdir(), "ws-ab-bench"))
    a = p.parse_args()
    ck = a.checkpoint
    tensor_bytes = json.loads(subprocess.run([a.before, "load", ck, "--json", "--no-progress", "--io", "pread"],
                                             capture_output=True, text=True, check=True).stdout)["bytes"]
    rows = {
        "host load --io pread": lambda cli: wall([cli, "load", ck, "--no-progress", "--io", "pread"]),
        "host load in place (--io auto)": lambda cli: wall([cli, "load", ck, "--no-progress"]),
        "layout tp 1": lambda cli: wall([cli, "load", ck, "--no-progress", "--tp-size", "1", "--tp-rank", "0"]),
        "layout tp 2 rank 1": lambda cli: wall([cli, "load", ck, "--no-progress", "--tp-size", "2", "--tp-rank", "1"]),
        "digest xxh64": lambda cli: wall([cli, "digest", ck, "--no-progress", "--hash", "xxh64"]),
    }
    # S3: nginx on loopback serving a 1 GiB synth checkpoint, as bench/s3_bench.py does.
    work = Path(a.s3_workdir); root = work / "root"; root.mkdir(parents=True, exist_ok=True)
    s3ck = s3_bench.make_checkpoint(a.before, root, s3_bench.parse_size("1GiB"))
    s3_bench.write_listing(s3ck, work / "list.xml")
    port = s3_bench.free_port()
    nginx = s3_bench.start_nginx(work, root, work / "list.xml", port)
    endpoint = "http://127.0.0.1:%d" % port
    s3_bytes = s3_bench.run_weightstream(a.before, endpoint, 16)[1]["bytes"]
    rows["S3 load (loopback nginx)"] = lambda cli: s3_bench.run_weightstream(cli, endpoint, 16)[0]
    results = {name: {"before": [], "after": []} for name in rows}
    try:
        for name, run in rows.items():
            for cli in (a.before, a.after):
                run(cli)  # one warm-up each, untimed
            for r in range(a.runs):
                for label, cli in (("before", a.before), ("after", a.after)) if r % 2 == 0 else (("after", a.after), ("before", a.before)):
                    results[name][label].append(run(cli))
            print(name, {k: [round(x, 3) for x in v] for k, v in results[name].items()}, flush=True)
    finally:
        nginx.send_signal(signal.SIGQUIT); nginx.wait(timeout=20)
    print()
    print("| benchmark | before median s (GB/s) | after median s (GB/s) | after ÷ before (rate) | runs before / after (s) |")
    print("| --- | ---: | ---: | ---: | --- |")
    for name, r in results.items():
        b, af = statistics.median(r["before"]), statistics.median(r["after"])
        nbytes = s3_bytes if name.startswith("S3") else tensor_bytes
        print("| %s | %.3f (%.2f) | %.3f (%.2f) | %.3f | %s / %s |" % (name, b, nbytes / b / 1e9, af, nbytes / af / 1e9, b / af,
              ", ".join("%.3f" % x for x in r["before"]), ", ".join("%.3f" % x for x in r["after"])))

main()

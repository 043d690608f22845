#!/usr/bin/env python3
"""UCX into GPU memory (issue 34), two processes on one GPU: a peer pull straight into CUDA
parameters and a pushed update over UCX into CUDA parameters, against UCX's own
`ucx_perftest -m cuda` between two processes on the same GPU, in the same run.

Needs a CUDA-aware UCX (scripts/gpu.sh unpacks the libucx-cu13 wheel's build and puts its
ucx_perftest on PATH); UCX picks the transport (cuda_ipc between processes of one host).

Rows:
  perftest ucp_get / tag_bw   `ucx_perftest -m cuda,cuda` at --message-size, median of --repeats
  pull                        `serve CKPT --device D` in one process, `load peer://… --device D`
                              in another: bytes_from_peers / seconds, bytes_read 0, every byte
                              read in place; the served rank pulled to the host and exported
                              equals `weightstream export` of the checkpoint
  update                      `audit CKPT --reload CKPT2 --via ucx --device D --await-sender`,
                              `send CKPT2 --via ucx --device D`: clean, and the receiver's rate

Usage: bench/gpu_ucx_bench.py --cli build-gpu/weightstream --out OUT [--size 4GiB] [--dir /tmp/ws-ucx]
       [--device cuda:0] [--repeats 3]
Writes OUT/gpu_ucx.md and OUT/gpu_ucx.json; exits 1 when a check fails.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from bench_process import log, run

GB = 1e9
TOKEN = "t0ken"


def perftest(test, message_bytes, iterations, port):
    """ucx_perftest between two processes, both buffers in GPU memory; GB/s (1e9) overall."""
    server = subprocess.Popen(["ucx_perftest", "-p", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        time.sleep(1.0)
        out = run(["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", test, "-m", "cuda,cuda", "-s",
                   str(message_bytes), "-n", str(iterations)], timeout=60).stdout
    finally:
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:  # the client failed: the server waits for it forever
            server.kill()
            server.wait()
    final = [line for line in out.splitlines() if line.startswith("Final:")][-1].split()
    # Final: iterations, latency 50%ile, average, overall, bandwidth average, overall (MB/s,
    # ucx_perftest's MB being 2^20 bytes), message rate average, overall.
    return float(final[6]) * 1024 * 1024 / 1e9


class Server:
    """`weightstream serve` of one rank on the GPU; stopped on exit."""

    def __init__(self, cli, checkpoint, device):
        self.process = subprocess.Popen([cli, "serve", checkpoint, "--listen", "127.0.0.1:0", "--device", device,
                                         "--token-stdin", "--no-progress"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.process.stdin.write(TOKEN + "\n")
        self.process.stdin.close()
        line = self.process.stdout.readline()
        match = re.search(r"peer://(\S+)", line)
        if not match:
            self.process.kill()
            raise RuntimeError(f"serve printed {line!r}; stderr: {self.process.stderr.read()[-600:]}")
        self.address = match.group(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", default="/tmp/ws-ucx")
    parser.add_argument("--size", default="4GiB")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--message-size", type=int, default=8 << 20, help="ucx_perftest -s (the pull's read size)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"device": args.device, "rows": {}, "checks": {}}
    rows, checks = results["rows"], results["checks"]

    def save():
        with open(os.path.join(args.out, "gpu_ucx.json"), "w") as file:
            json.dump(results, file, indent=1)
        with open(os.path.join(args.out, "gpu_ucx.md"), "w") as file:
            file.write(report(results))

    first, second = os.path.join(args.dir, "a"), os.path.join(args.dir, "b")
    for path, seed in ((first, 1), (second, 2)):
        if not os.path.exists(os.path.join(path, "config.json")):
            run([args.cli, "synth", path, "--arch", "llama", "--size", args.size, "--hidden", "2048", "--shards", "4",
                 "--seed", str(seed)])
    log(f"ucx: {run(['ucx_info', '-v']).stdout.splitlines()[0]}")
    try:
        with Server(args.cli, first, args.device) as server:
            uri = f"peer://{server.address}"
            pulls = []
            for _ in range(args.repeats):
                out = json.loads(run([args.cli, "load", uri, "--device", args.device, "--token-stdin", "--json",
                                      "--no-progress"], input=TOKEN + "\n", timeout=600).stdout)
                pulls.append(out)
            seconds = [p["seconds"] for p in pulls]
            moved = pulls[0].get("bytes_from_peers", pulls[0].get("bytes"))
            rows["pull"] = {"seconds": statistics.median(seconds), "runs": [moved / t / GB for t in seconds], "bytes": moved,
                            "gbps": moved / statistics.median(seconds) / GB, "report": pulls[0]}
            checks["pull: bytes_read 0"] = all(p.get("bytes_read", 1) == 0 for p in pulls)
            checks["pull: every parameter read straight into device memory (bytes_in_place = all)"] = all(
                p.get("bytes_in_place") == p.get("bytes_from_peers") for p in pulls)
            log(f"pull into {args.device}: {rows['pull']['gbps']:.2f} GB/s ({moved / GB:.2f} GB, runs {seconds})")
            pulled, stored = os.path.join(args.dir, "pulled.safetensors"), os.path.join(args.dir, "stored.safetensors")
            # export pulls into host memory (from the server's GPU memory); the straight-into-GPU
            # path's bytes are compared by ctest's PeerTest.PullsIntoCudaParametersStraightFromAServerOnTheGpu
            run([args.cli, "export", uri, pulled, "--token-stdin", "--no-progress"], input=TOKEN + "\n", timeout=600)
            run([args.cli, "export", first, stored, "--no-progress"], timeout=600)
            digests = [run([args.cli, "digest", path, "--no-progress"]).stdout for path in (pulled, stored)]
            checks["pull: the pulled rank equals `export` of the checkpoint"] = digests[0] == digests[1] and \
                len(digests[0].splitlines()) > 0
            os.remove(pulled)
            os.remove(stored)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as error:
        rows["pull"] = {"error": str(error)[-600:]}
        checks["pull ran"] = False
        log(f"pull: failed: {error}")
    save()

    try:
        audit = subprocess.Popen([args.cli, "audit", first, "--reload", second, "--via", "ucx", "--device", args.device,
                                  "--listen", "127.0.0.1:0", "--await-sender", "--token-stdin", "--json",
                                  "--no-progress"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        audit.stdin.write(TOKEN + "\n")
        audit.stdin.close()
        line = audit.stderr.readline()
        match = re.search(r"awaiting a sender at (\S+)", line)
        if not match:
            audit.kill()
            raise RuntimeError(f"audit printed {line!r} {audit.stderr.read()[-600:]}")
        sent = json.loads(run([args.cli, "send", second, "--to", match.group(1), "--via", "ucx", "--device",
                               args.device, "--token-stdin", "--json", "--no-progress"], input=TOKEN + "\n",
                              timeout=600).stdout)
        audit.wait(timeout=600)
        audited = json.loads(audit.stdout.read())
        rows["update"] = {"seconds": sent["seconds"], "bytes": sent["bytes"], "gbps": sent["bytes"] / sent["seconds"] / GB,
                          "audit": audited}
        checks["update over ucx into CUDA parameters: audit clean"] = bool(audited.get("clean")) and \
            audited.get("mismatched") == 0 and audited.get("address_changes") == 0
        log(f"update over ucx into {args.device}: {rows['update']['gbps']:.2f} GB/s; audit {json.dumps(audited)[:300]}")
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as error:
        rows["update"] = {"error": str(error)[-600:]}
        checks["update ran"] = False
        log(f"update: failed: {error}")
    save()
    # The baseline last: in the 2026-12-05 run ucx_perftest -m cuda,cuda hung until its limit.
    for test, port in (("ucp_get", 13600), ("tag_bw", 13700)):
        try:
            runs = [perftest(test, args.message_size, 2000, port + i) for i in range(args.repeats)]  # stops at a failure
            rows[f"perftest {test}"] = {"gbps": statistics.median(runs), "runs": runs}
            log(f"ucx_perftest {test} -m cuda,cuda -s {args.message_size}: {statistics.median(runs):.2f} GB/s {runs}")
        except (RuntimeError, IndexError, subprocess.TimeoutExpired) as error:
            rows[f"perftest {test}"] = {"error": str(error)[-400:]}
            log(f"ucx_perftest {test}: failed: {error}")
        save()

    subprocess.run(["rm", "-rf", first, second])
    print(report(results))
    return 0 if checks and all(checks.values()) else 1


def report(results):
    rows, checks = results["rows"], results["checks"]
    lines = [f"UCX into GPU memory, two processes on {results['device']}", "", "| row | GB/s | runs (GB/s) | note |",
             "| --- | ---: | --- | --- |"]
    best = max((rows[k]["gbps"] for k in ("perftest ucp_get", "perftest tag_bw") if "gbps" in rows.get(k, {})),
               default=None)
    for key, row in rows.items():
        if "error" in row:
            lines.append(f"| {key} | failed | | {row['error'][:200]} |")
            continue
        runs = ", ".join(f"{r:.3f}" for r in row.get("runs", []))
        note = f"{row['gbps'] / best:.0%} of the better ucx_perftest" if best and not key.startswith("perftest") else ""
        lines.append(f"| {key} | {row['gbps']:.2f} | {runs} | {note} |")
    lines.append("")
    lines += [f"- {text}: {'yes' if ok else 'NO'}" for text, ok in checks.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

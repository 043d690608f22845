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
                              (the sender reads CKPT2 from the page cache: disk to GPU)
  update_gpu                  a trainer's push (issue 44): CKPT2 loaded onto the GPU first by a
                              sender process (bench/gpu_moe_bench.py --role gpu-sender, torch
                              tensors from weightstream.load), then pushed with
                              weightstream.UpdateSender over ucx, --updates times over one
                              connection, into `audit CKPT --reload CKPT2 --via ucx --device D
                              --await-sender --repeat N`: clean after the last update; the rate is
                              bytes / the sender's seconds (first send() to the end of finish()),
                              median of the updates after the first; placed_bytes (bucket bytes
                              that landed straight in the parameters) from the receiver's report.
                              Goal: >= 0.5 of perftest tag_bw at --message-size (8 MiB, the ucx
                              transport's piece size, src/update/ucx_transport.cpp kUcxPiece)

Usage: bench/gpu_ucx_bench.py --cli build-gpu/weightstream --out OUT [--size 4GiB] [--dir /tmp/ws-ucx]
       [--device cuda:0] [--repeats 3] [--updates 3] [--bucket-bytes 268435456] [--python-site DIR]
--python-site is the weightstream package update_gpu's sender imports (default: python-site
next to --cli); the sender runs under this Python, which needs torch.
Writes OUT/gpu_ucx.md and OUT/gpu_ucx.json; exits 1 when a check fails.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
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


def awaiting_audit(cli, first, second, device, repeat=1, bucket_size="256MiB"):
    """`audit FIRST --reload SECOND --via ucx --await-sender` on DEVICE, taking REPEAT updates
    from one sender over one connection; returns the process (the token already written) and
    the address it awaits a sender at. Its stderr after that line is drained by a thread (kept
    in process.stderr_tail) so that it never blocks on a full pipe."""
    audit = subprocess.Popen([cli, "audit", first, "--reload", second, "--via", "ucx", "--device", device,
                              "--listen", "127.0.0.1:0", "--await-sender", "--repeat", str(repeat), "--bucket-size",
                              bucket_size, "--token-stdin", "--json", "--no-progress"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    audit.stdin.write(TOKEN + "\n")
    audit.stdin.close()
    line = audit.stderr.readline()
    match = re.search(r"awaiting a sender at (\S+)", line)
    if not match:
        audit.kill()
        raise RuntimeError(f"audit printed {line!r} {audit.stderr.read()[-600:]}")
    audit.stdout_text, audit.stderr_tail = [], []
    audit.drains = [threading.Thread(target=lambda: audit.stdout_text.extend(audit.stdout), daemon=True),
                    threading.Thread(target=lambda: audit.stderr_tail.extend(audit.stderr), daemon=True)]
    for drain in audit.drains:
        drain.start()
    return audit, match.group(1)


def audit_report(audit, timeout):
    """The awaiting audit's JSON, once it exits (killed after TIMEOUT seconds)."""
    try:
        audit.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        audit.kill()
        audit.wait()
        raise
    for drain in audit.drains:
        drain.join(timeout=10)
    out = "".join(audit.stdout_text)
    try:
        return json.loads(out)
    except json.JSONDecodeError as error:
        raise RuntimeError(f"audit exited {audit.returncode} with {out[-300:]!r}; stderr "
                           f"{''.join(audit.stderr_tail)[-600:]}") from error


def update_gpu_row(args, first, second, rows, checks):
    """update_gpu: CKPT2 on the sender's GPU (bench/gpu_moe_bench.py --role gpu-sender) pushed
    over ucx `--updates` times over one connection into an awaiting audit of CKPT's layout on
    the device. A failure is recorded in the row and the checks, not raised."""
    row = {"transport": "ucx", "updates": args.updates, "bucket_bytes": args.bucket_bytes,
           "message_size": args.message_size}
    rows["update_gpu"] = row
    site = args.python_site or os.path.join(os.path.dirname(os.path.abspath(args.cli)), "python-site")
    environment = dict(os.environ, PYTHONUNBUFFERED="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])))
    audit = process = None
    try:
        if not os.path.isdir(os.path.join(site, "weightstream")):
            raise RuntimeError(f"no weightstream package in {site} (scripts/gpu.sh python builds it; --python-site)")
        audit, address = awaiting_audit(args.cli, first, second, args.device, repeat=args.updates,
                                        bucket_size=str(args.bucket_bytes))
        command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_moe_bench.py"),
                   "--role", "gpu-sender", "--bf16", second, "--to", address, "--transport", "ucx", "--device",
                   args.device, "--updates", str(args.updates), "--bucket-bytes", str(args.bucket_bytes)]
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=environment)
        ready = process.stdout.readline().strip()  # CKPT2 is on the sender's GPU
        if ready != "READY":
            out, err = process.communicate(timeout=60)
            raise RuntimeError(f"sender said {ready!r}, not READY: {out[-300:]} {err[-600:]}")
        out, err = process.communicate(TOKEN + "\n", timeout=900)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        sender = json.loads(lines[-1]) if lines else {"error": f"printed no report (exit {process.returncode})"}
        if err.strip():
            row["sender_stderr"] = err.strip()[-2000:]
        if sender.get("error") or process.returncode != 0:
            raise RuntimeError(f"sender (exit {process.returncode}): {sender.get('error', '')} {err.strip()[-600:]}")
        audited = audit_report(audit, timeout=900)
    except (RuntimeError, OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as error:
        for child in (process, audit):  # a receiver still awaiting its updates waits forever
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()
        row["error"] = f"{type(error).__name__}: {error}"[-1200:]
        checks["update_gpu ran"] = False
        log(f"update_gpu: failed: {row['error']}")
        return
    runs = [u["seconds"] for u in sender["updates"]]
    later = runs[1:] or runs
    moved = sender["bytes"]
    reports = [u.get("report", {}) for u in sender["updates"]]
    row.update({"seconds": statistics.median(later), "bytes": moved, "gbps": moved / statistics.median(later) / GB,
                "seconds_clock": "sender: first send() to the end of finish(), median of the updates after the first",
                "runs": [moved / t / GB for t in runs], "run_seconds": runs, "first_seconds": runs[0],
                "first_gbps": moved / runs[0] / GB, "tensors_sent": sender["tensors"],
                "sender_load_seconds": sender["load_seconds"], "sender_connect_seconds": sender["connect_seconds"],
                "placed_bytes": [r.get("placed_bytes") for r in reports],
                "received_bytes": [r.get("bytes") for r in reports],
                "receiver_seconds": audited.get("update_seconds_each"), "sender": sender["updates"], "audit": audited})
    checks["update_gpu over ucx from GPU memory into CUDA parameters: audit clean"] = bool(audited.get("clean")) and \
        audited.get("mismatched") == 0 and audited.get("address_changes") == 0
    checks["update_gpu: the receiver took every update"] = len(audited.get("update_seconds_each") or []) == args.updates
    placed = ", ".join(f"{p / GB:.2f}" if isinstance(p, (int, float)) else "?" for p in row["placed_bytes"])
    log(f"update_gpu over ucx from {args.device} into {args.device}: {row['gbps']:.2f} GB/s ({moved / GB:.2f} GB in "
        f"{row['seconds']:.3f} s, sender, median of updates 2 to {len(runs)}; first {runs[0]:.3f} s = "
        f"{row['first_gbps']:.2f} GB/s; runs {', '.join(f'{t:.3f}' for t in runs)}); placed straight in the "
        f"parameters (GB per update): {placed}; audit {json.dumps(audited)[:300]}")


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
    parser.add_argument("--message-size", type=int, default=8 << 20,
                        help="ucx_perftest -s (the pull's read size, and the ucx update transport's piece size)")
    parser.add_argument("--updates", type=int, default=3, help="update_gpu's updates over one connection")
    parser.add_argument("--bucket-bytes", type=int, default=256 << 20, help="update_gpu's bucket size")
    parser.add_argument("--python-site", help="the weightstream package update_gpu's sender imports")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    results = {"device": args.device, "message_size": args.message_size, "rows": {}, "checks": {}}
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
        audit, address = awaiting_audit(args.cli, first, second, args.device)
        try:
            sent = json.loads(run([args.cli, "send", second, "--to", address, "--via", "ucx", "--device",
                                   args.device, "--token-stdin", "--json", "--no-progress"], input=TOKEN + "\n",
                                  timeout=600).stdout)
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError):
            audit.kill()  # it awaits a sender that will not come
            audit.wait()
            raise
        audited = audit_report(audit, timeout=600)
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
    update_gpu_row(args, first, second, rows, checks)
    save()
    # The baseline last: in the 2026-12-05 run ucx_perftest -m cuda,cuda hung until its limit.
    for test, port in (("ucp_get", 13600), ("tag_bw", 13700)):
        try:
            runs = [perftest(test, args.message_size, 2000, port + i) for i in range(args.repeats)]  # stops at a failure
            rows[f"perftest {test}"] = {"gbps": statistics.median(runs), "runs": runs, "message_size": args.message_size}
            log(f"ucx_perftest {test} -m cuda,cuda -s {args.message_size}: {statistics.median(runs):.2f} GB/s {runs}")
        except (RuntimeError, IndexError, subprocess.TimeoutExpired) as error:
            rows[f"perftest {test}"] = {"error": str(error)[-400:], "message_size": args.message_size}
            log(f"ucx_perftest {test}: failed: {error}")
        save()

    results["goal"] = goal(results)
    save()
    subprocess.run(["rm", "-rf", first, second])
    print(report(results))
    return 0 if checks and all(checks.values()) else 1


def goal(results):
    """Issue 44's goal: update_gpu's rate >= 0.5 of `ucx_perftest -t tag_bw -m cuda,cuda` at the
    update's message size (the ucx transport's 8 MiB pieces); None until both rows have a rate."""
    rows = results["rows"]
    update, tag_bw = rows.get("update_gpu", {}), rows.get("perftest tag_bw", {})
    if "gbps" not in update or "gbps" not in tag_bw:
        return None
    fraction = update["gbps"] / tag_bw["gbps"]
    return {"fraction": fraction, "first_fraction": update["first_gbps"] / tag_bw["gbps"], "met": fraction >= 0.5,
            "message_size": tag_bw.get("message_size", results.get("message_size"))}


def report(results):
    rows, checks = results["rows"], results["checks"]
    lines = [f"UCX into GPU memory, two processes on {results['device']}", "", "| row | GB/s | runs (GB/s) | note |",
             "| --- | ---: | --- | --- |"]
    best = max((rows[k]["gbps"] for k in ("perftest ucp_get", "perftest tag_bw") if "gbps" in rows.get(k, {})),
               default=None)
    tag_bw = rows.get("perftest tag_bw", {}).get("gbps")
    for key, row in rows.items():
        if "error" in row:
            lines.append(f"| {key} | failed | | {row['error'][:200]} |")
            continue
        runs = ", ".join(f"{r:.3f}" for r in row.get("runs", []))
        notes = [f"{row['gbps'] / best:.0%} of the better ucx_perftest"] if best and not key.startswith("perftest") else []
        if key.startswith("perftest"):
            notes.append(f"-s {row.get('message_size', results.get('message_size'))}")
        if key == "update_gpu":
            notes.insert(0, f"sender's seconds, median of updates 2 to {len(row['run_seconds'])}; first update "
                            f"{row['first_gbps']:.2f} GB/s")
            if tag_bw:
                notes.append(f"{row['gbps'] / tag_bw:.2f} of tag_bw (first {row['first_gbps'] / tag_bw:.2f})")
            placed = [p for p in row.get("placed_bytes", []) if isinstance(p, (int, float))]
            if placed:
                notes.append(f"placed in the parameters {min(placed) / GB:.2f} of {row['bytes'] / GB:.2f} GB")
        lines.append(f"| {key} | {row['gbps']:.2f} | {runs} | {'; '.join(notes)} |")
    lines.append("")
    lines += [f"- {text}: {'yes' if ok else 'NO'}" for text, ok in checks.items()]
    reached = goal(results)
    size = results.get("message_size", 8 << 20)
    if reached:
        lines.append(f"\nGoal, update_gpu >= 0.5 of perftest tag_bw (-m cuda,cuda -s {size}): "
                     f"{'met' if reached['met'] else 'MISSED'} ({reached['fraction']:.2f}; first update "
                     f"{reached['first_fraction']:.2f})")
    else:
        lines.append(f"\nGoal, update_gpu >= 0.5 of perftest tag_bw (-m cuda,cuda -s {size}): MISSED (not measured: "
                     f"{'update_gpu' if 'gbps' not in rows.get('update_gpu', {}) else 'perftest tag_bw'} has no rate)")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    sys.exit(main())

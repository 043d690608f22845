#!/usr/bin/env python3
"""Peers across two network namespaces (issue 31): a peer pull of one rank and pushed
updates over UCX, against UCX's own ucx_perftest (tag_bw and ucp_get at the same message
size: the pull's host read piece, 512 KiB, for the pull rows; the update's piece, 8 MiB, for
the update rows) and against the home-made TCP update transport, all between the same
namespaces in one run. The pull and the UCX update run twice: as the library picks (over tcp, rendezvous
messages: the server's tagged sends, the sender's active messages) and forced to one-sided
get/put (WEIGHTSTREAM_UCX_PATH=rma), so both paths are measured in one run; ucx_perftest's
ucp_am_bw is shown beside the update. Each update row runs --updates updates from one
sender over one connection: the row is the first (both processes' buffers still fresh), the
steady row the median of the later ones (a trainer pushes every step over one connection).

Two namespaces joined by a veth pair (192.0.2.1 serves, 192.0.2.2 pulls), loopback up in
each; UCX_TLS picks UCX's transports (default "tcp": the bytes cross the veth as they would
cross hosts; "auto" leaves UCX to pick, which finds shared memory and cma between namespaces
of one host). Needs root. Prints a Markdown table (and --json); the namespaces are removed at
the end.

    python3 bench/peer_bench.py --cli build/weightstream --checkpoint /tmp/peer1g --repeat 3
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import uuid

SERVER, PULLER = "192.0.2.1", "192.0.2.2"
TOKEN = uuid.uuid4().hex


def run(*arguments, check=True, **kwargs):
    return subprocess.run(list(arguments), check=check, capture_output=True, text=True, **kwargs)


class Namespaces:
    def __init__(self):
        tag = f"wb{os.getpid() % 100000}"
        self.server, self.puller = f"{tag}s", f"{tag}p"
        run("ip", "netns", "add", self.server)
        run("ip", "netns", "add", self.puller)
        run("ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        run("ip", "link", "set", f"{tag}a", "netns", self.server)
        run("ip", "link", "set", f"{tag}b", "netns", self.puller)
        run("ip", "-n", self.server, "addr", "add", f"{SERVER}/24", "dev", f"{tag}a")
        run("ip", "-n", self.puller, "addr", "add", f"{PULLER}/24", "dev", f"{tag}b")
        for namespace, device in ((self.server, f"{tag}a"), (self.puller, f"{tag}b")):
            run("ip", "-n", namespace, "link", "set", device, "up")
            run("ip", "-n", namespace, "link", "set", "lo", "up")

    def close(self):
        for namespace in (self.server, self.puller):
            run("ip", "netns", "del", namespace, check=False)


def busy_core_seconds():
    """CPU seconds every core of this machine has spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as file:
        ticks = [int(value) for value in file.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


CPU = {}  # row -> [busy core-seconds, bytes] summed over its runs: what a GB costs this machine's cores


def size_text(size):
    return f"{size >> 20} MiB" if size % (1 << 20) == 0 else f"{size >> 10} KiB"


def count_cpu(row, seconds, size):
    spent = CPU.setdefault(row, [0.0, 0])
    spent[0] += seconds
    spent[1] += size


def environment(tls):
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    if tls != "auto":
        env["UCX_TLS"] = tls
    else:
        env.pop("UCX_TLS", None)
    return env


def perftest(ns, test, message_bytes, iterations, env, port):
    """ucx_perftest between the namespaces; GB/s (1e9) of its overall bandwidth."""
    server = subprocess.Popen(["ip", "netns", "exec", ns.server, "ucx_perftest", "-p", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        time.sleep(1.0)
        busy = busy_core_seconds()
        out = run("ip", "netns", "exec", ns.puller, "ucx_perftest", SERVER, "-p", str(port), "-t", test, "-s",
                  str(message_bytes), "-n", str(iterations), env=env, timeout=300).stdout
        count_cpu(f"ucx_perftest {test}, {size_text(message_bytes)}", busy_core_seconds() - busy, message_bytes * iterations)
    finally:
        server.wait(timeout=60)
    final = [line for line in out.splitlines() if line.startswith("Final:")][-1].split()
    # Final: iterations, latency 50%ile, average, overall, bandwidth average, overall (MB/s,
    # ucx_perftest's MB being 2^20 bytes), message rate average, overall.
    return float(final[6]) * 1024 * 1024 / 1e9


def pull_once(ns, cli, address, env):
    result = run("ip", "netns", "exec", ns.puller, cli, "load", f"peer://{address}", "--json", "--token-stdin",
                 "--no-progress", input=TOKEN + "\n", env=env, timeout=600)
    report = json.loads(result.stdout)
    assert report["bytes_read"] == 0, report
    return report


def warm_pull_once(ns, cli, address, env):
    """Pulls into a layout already pulled once (`audit peer:// --repeat 2`: the reloads' bytes
    over their seconds): the destination's pages are touched, as ucx_perftest's one reused
    buffer is; a cold pull also pays the first touch of its fresh memory."""
    result = run("ip", "netns", "exec", ns.puller, cli, "audit", f"peer://{address}", "--repeat", "2", "--json",
                 "--token-stdin", "--no-progress", input=TOKEN + "\n", env=env, timeout=600)
    report = json.loads(result.stdout)
    assert report["clean"], report
    return report["reload_bytes"] / report["reload_seconds"] / 1e9


def update_once(ns, cli, checkpoint, via, bucket, env, updates=1, row=None):
    """`updates` pushed updates of the whole checkpoint across the namespaces, one after
    another from one sender over one connection (as a trainer pushes every step); the
    receiver's audit report (update_seconds_each: each update's seconds)."""
    audit = subprocess.Popen(
        ["ip", "netns", "exec", ns.server, cli, "audit", checkpoint, "--via", via, "--listen", f"{SERVER}:0",
         "--await-sender", "--token-stdin", "--bucket-size", bucket, "--repeat", str(updates), "--json", "--no-progress"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    audit.stdin.write(TOKEN + "\n")
    audit.stdin.close()
    line = audit.stderr.readline()
    address = re.search(r"awaiting a sender at (\S+)", line).group(1)
    busy = busy_core_seconds()
    run("ip", "netns", "exec", ns.puller, cli, "send", checkpoint, "--to", address, "--via", via, "--bucket-size", bucket,
        "--repeat", str(updates), "--token-stdin", "--no-progress", input=TOKEN + "\n", env=env, timeout=600)
    busy = busy_core_seconds() - busy
    audit.wait(timeout=600)
    report = json.loads(audit.stdout.read())
    assert report["clean"], report
    if row:
        count_cpu(row, busy, report["reload_bytes"])
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli", default="build/weightstream")
    parser.add_argument("--checkpoint", default="/tmp/weightstream-peer-bench")
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pull-message-size", type=int, default=512 << 10,
                        help="ucx_perftest -s for the pull rows: the pull's read piece into host memory (512 KiB)")
    parser.add_argument("--update-message-size", type=int, default=8 << 20,
                        help="ucx_perftest -s for the update rows: the ucx update's piece (8 MiB)")
    parser.add_argument("--tls", default="tcp", help="UCX_TLS for every UCX row: tcp (default) or auto")
    parser.add_argument("--bucket-size", default="64MiB")
    parser.add_argument("--updates", type=int, default=4,
                        help="updates per sender connection: the first pays the fresh buffers of both processes, "
                             "the later ones are the steady rate (default 4)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cli = os.path.abspath(args.cli)
    if not os.path.exists(os.path.join(args.checkpoint, "config.json")):
        run(cli, "synth", args.checkpoint, "--arch", "llama", "--size", args.size, "--shards", "4", "--hidden", "1024")
    env = environment(args.tls)
    ns = Namespaces()
    rows = {}
    phases = {}  # per update row: each run's update_phases
    try:
        port = 13400
        for kind, size in (("pull", args.pull_message_size), ("update", args.update_message_size)):
            iterations = max(16, (4 << 30) // size)  # 4 GiB: the CPU counts see little of the start
            for test in ("tag_bw", "ucp_get") + (("ucp_am_bw",) if kind == "update" else ()):
                rows[f"ucx_perftest {test}, {size_text(size)}"] = [
                    perftest(ns, test, size, iterations, env, port + i) for i in range(args.repeat)]
                port += 100
        rma = dict(env, WEIGHTSTREAM_UCX_PATH="rma")
        server = subprocess.Popen(
            ["ip", "netns", "exec", ns.server, cli, "serve", args.checkpoint, "--listen", f"{SERVER}:0", "--token-stdin",
             "--no-progress"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        server.stdin.write(TOKEN + "\n")
        server.stdin.close()
        address = re.search(r"peer://(\S+)", server.stdout.readline()).group(1)
        try:
            pulls = [pull_once(ns, cli, address, env) for _ in range(args.repeat)]
            rma_pulls = [pull_once(ns, cli, address, rma) for _ in range(args.repeat)]
            warm_pulls = [warm_pull_once(ns, cli, address, env) for _ in range(args.repeat)]
            warm_rma_pulls = [warm_pull_once(ns, cli, address, rma) for _ in range(args.repeat)]
        finally:
            server.terminate()
            server.wait(timeout=60)
        path = pulls[0]["peers"][0].get("ucx_path", "?")
        rows[f"peer pull (load peer://), one rank, {path}"] = [p["gbps"] for p in pulls]
        rows["peer pull, one rank, rma (forced)"] = [p["gbps"] for p in rma_pulls]
        rows[f"peer pull into a warm layout, {path}"] = warm_pulls
        rows["peer pull into a warm layout, rma (forced)"] = warm_rma_pulls
        for name, via, update_env in (("pushed update, ucx", "ucx", env), ("pushed update, ucx, rma (forced)", "ucx", rma),
                                      ("pushed update, tcp (home-made)", "tcp", env)):
            reports = [update_once(ns, cli, args.checkpoint, via, args.bucket_size, update_env, args.updates, name)
                       for _ in range(args.repeat)]
            each = [(report["reload_bytes"] / args.updates, report["update_seconds_each"]) for report in reports]
            rows[name] = [size / seconds[0] / 1e9 for size, seconds in each]
            phases[name] = [{phase: seconds / args.updates for phase, seconds in report.get("update_phases", {}).items()}
                            for report in reports]
            if args.updates > 1:
                rows[f"{name}, steady (updates 2-{args.updates} of a connection)"] = [
                    size / statistics.median(seconds[1:]) / 1e9 for size, seconds in each]
    finally:
        ns.close()
    medians = {name: statistics.median(values) for name, values in rows.items()}
    # Each row against the better of tag_bw and ucp_get at its own message size.
    best = {kind: max(medians[f"ucx_perftest tag_bw, {size_text(size)}"], medians[f"ucx_perftest ucp_get, {size_text(size)}"])
            for kind, size in (("pull", args.pull_message_size), ("update", args.update_message_size))}

    def baseline(name):
        if name.startswith("ucx_perftest"):
            return best["pull" if name.endswith(size_text(args.pull_message_size)) else "update"]
        return best["pull" if "pull" in name else "update"]

    cpu = {row: seconds / size * 1e9 for row, (seconds, size) in CPU.items()}
    result = {"tls": args.tls, "pull_message_bytes": args.pull_message_size,
              "update_message_bytes": args.update_message_size, "bytes": pulls[0]["bytes_from_peers"],
              "rows": rows, "medians": medians, "best_perftest": best, "update_phases": phases,
              "cpu_core_seconds_per_gb": cpu, "cores": os.cpu_count()}
    if args.json:
        print(json.dumps(result, indent=2))
    print(f"UCX_TLS={args.tls}, {pulls[0]['bytes_from_peers'] / 1e9:.2f} GB rank; perftest messages: "
          f"pull rows {size_text(args.pull_message_size)}, update rows {size_text(args.update_message_size)}")
    print("| row | median GB/s | runs | ÷ best perftest at its size | ÷ tcp update |")
    print("| --- | ---: | --- | ---: | ---: |")
    tcp = medians["pushed update, tcp (home-made)"]
    for name, values in rows.items():
        runs = ", ".join(f"{v:.3f}" for v in values)
        print(f"| {name} | {medians[name]:.3f} | {runs} | {medians[name] / baseline(name):.0%} | {medians[name] / tcp:.2f}× |")
    # Where each update's receiver spent its seconds (the run of the median rate; per update).
    for name, reports in phases.items():
        median_run = sorted(range(len(rows[name])), key=lambda i: rows[name][i])[len(rows[name]) // 2]
        spent = ", ".join(f"{phase} {seconds:.3f}" for phase, seconds in reports[median_run].items()
                          if seconds >= 0.001 and phase != "first_bucket")
        print(f"{name}: receiver's seconds: {spent}")
    # What a GB costs this machine's cores (every core, busy time from /proc/stat: the two
    # namespaces share them), and the rate that cost allows with every core busy.
    cores = os.cpu_count()
    for row, seconds in cpu.items():
        print(f"CPU: {row}: {seconds:.2f} core-seconds per GB; {cores} cores allow {cores / seconds:.2f} GB/s")


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The peer pull rows of peer_bench.py for two or more weightstream builds, interleaved in one
run (a change's before and after), against UCX's own tag_bw measured in the same rounds.

Two network namespaces joined by a veth pair, UCX over tcp (as peer_bench.py). Each round runs
`ucx_perftest` tag_bw at the pull's 512 KiB read piece, then, for each build in turn (the order
rotating between rounds), a cold pull (`load peer://`) and a pull into a warm layout
(`audit peer:// --repeat 2`: the reloads' bytes over their seconds), both from one `serve` of
that build. Prints each row's runs and median, and the median over tag_bw's median. Needs root.

    python3 bench/peer_ab_bench.py before=BEFORE_CLI after=AFTER_CLI --checkpoint /tmp/peer1g --rounds 5
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_bench  # noqa: E402
from peer_bench import SERVER, TOKEN  # noqa: E402


def serve(ns, cli, checkpoint, env):
    server = subprocess.Popen(
        ["ip", "netns", "exec", ns.server, cli, "serve", checkpoint, "--listen", f"{SERVER}:0", "--token-stdin",
         "--no-progress"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    server.stdin.write(TOKEN + "\n")
    server.stdin.close()
    address = re.search(r"peer://(\S+)", server.stdout.readline()).group(1)
    return server, address


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("builds", nargs="+", help="NAME=CLI (or CLI, named by its path), two or more")
    parser.add_argument("--checkpoint", default="/tmp/weightstream-peer-bench")
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--message-size", type=int, default=512 << 10, help="ucx_perftest -s (the pull's read piece)")
    parser.add_argument("--tls", default="tcp")
    parser.add_argument("--cold", action="store_true", help="also time cold pulls (load peer://)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    builds = {}
    for build in args.builds:
        name, _, path = build.rpartition("=")
        builds[name or path] = os.path.abspath(path)
    first = next(iter(builds.values()))
    if not os.path.exists(os.path.join(args.checkpoint, "config.json")):
        peer_bench.run(first, "synth", args.checkpoint, "--arch", "llama", "--size", args.size, "--shards", "4",
                       "--hidden", "1024")
    env = peer_bench.environment(args.tls)
    ns = peer_bench.Namespaces()
    rows = {"tag_bw": []}
    port = 15400
    try:
        for round_index in range(args.rounds):
            iterations = max(16, (4 << 30) // args.message_size)
            rows["tag_bw"].append(peer_bench.perftest(ns, "tag_bw", args.message_size, iterations, env, port))
            port += 1
            order = list(builds.items())
            shift = round_index % len(order)
            for name, cli in order[shift:] + order[:shift]:
                server, address = serve(ns, cli, args.checkpoint, env)
                try:
                    if args.cold:
                        rows.setdefault(f"{name}: cold pull", []).append(peer_bench.pull_once(ns, cli, address, env)["gbps"])
                    rows.setdefault(f"{name}: pull into a warm layout", []).append(
                        peer_bench.warm_pull_once(ns, cli, address, env))
                finally:
                    server.terminate()
                    server.wait(timeout=60)
            print(f"round {round_index + 1}: " + ", ".join(f"{row} {values[-1]:.3f}" for row, values in rows.items()),
                  file=sys.stderr)
    finally:
        ns.close()
    tag_bw = statistics.median(rows["tag_bw"])
    result = {row: {"runs": values, "median": statistics.median(values), "of_tag_bw": statistics.median(values) / tag_bw}
              for row, values in rows.items()}
    if args.json:
        print(json.dumps(result, indent=2))
    print(f"UCX_TLS={args.tls}; tag_bw at {args.message_size >> 10} KiB; {args.rounds} rounds, builds alternating")
    print("| row | median GB/s | runs | ÷ tag_bw median |")
    print("| --- | ---: | --- | ---: |")
    for row, r in result.items():
        print(f"| {row} | {r['median']:.3f} | {', '.join(f'{v:.3f}' for v in r['runs'])} | {r['of_tag_bw']:.2f}× |")


if __name__ == "__main__":
    sys.exit(main())

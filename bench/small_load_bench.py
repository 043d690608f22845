#!/usr/bin/env python3
"""Small-load floor benchmark (issue 20): many loads of a small checkpoint, in-process time.

RL reloads and per-layer updates call the load path again and again, so a fixed cost per
load (the streamer's progress loop used to sleep 100 ms per pass) is paid every time. This
writes a 30 MiB checkpoint with `weightstream synth`, runs `weightstream load --json` on it
--runs times (page cache warm) with progress off and with progress forced on, and prints,
for each, the in-process seconds that `load` reports, their median and how many runs stayed
under --under-ms. It is a benchmark row, not a timed test: run it on a quiet machine.

    python3 bench/small_load_bench.py --cli build/weightstream [--runs 20] [--under-ms 20]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def load_seconds(cli, checkpoint, progress_flag):
    # --progress draws on stderr; it goes to a pipe here, so the non-terminal mode is measured.
    out = subprocess.run([cli, "load", checkpoint, "--json", progress_flag], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)["seconds"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli", default="build/weightstream")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--under-ms", type=float, default=20.0)
    parser.add_argument("--size", default="30MiB")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = os.path.join(scratch, "small")
        subprocess.run([args.cli, "synth", checkpoint, "--arch", "llama", "--size", args.size, "--hidden", "512",
                        "--json"], check=True, capture_output=True)
        load_seconds(args.cli, checkpoint, "--no-progress")  # warm the page cache
        print(f"| mode | runs | under {args.under_ms:g} ms | median ms | max ms |")
        print("| --- | ---: | ---: | ---: | ---: |")
        failed = False
        for flag in ("--no-progress", "--progress"):
            times = [load_seconds(args.cli, checkpoint, flag) * 1e3 for _ in range(args.runs)]
            under = sum(t < args.under_ms for t in times)
            failed |= under != args.runs
            print(f"| load {flag} | {args.runs} | {under} | {statistics.median(times):.2f} | {max(times):.2f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

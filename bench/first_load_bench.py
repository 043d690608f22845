#!/usr/bin/env python3
"""First loads of fresh memory on the host: weightstream against the Run:ai engine.

A back-to-back benchmark (bench/cpu_bench.py) lets each process reuse memory the previous one
just freed. This one writes a fresh checkpoint for every round (`weightstream synth`, then one
read into the page cache) and runs the two loaders alternately, first one then the other,
so each round shows a first load of fresh memory and a load right after another process.

Usage: bench/first_load_bench.py --cli build/weightstream --runai-site SITE [--rounds 2] [--dir DIR]
(SITE: `pip install --no-deps --target SITE runai-model-streamer==0.17.1`, as for cpu_bench.py)
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_bench  # noqa: E402


def fresh_checkpoint(cli, directory):
    shutil.rmtree(directory, ignore_errors=True)
    subprocess.run([cli, "synth", directory, "--arch", "llama", "--size", "1GiB", "--shards", "4", "--hidden", "1024",
                    "--dtype", "f16"], check=True, capture_output=True)
    files = cpu_bench.shard_files(directory)
    cpu_bench.warm(files)
    return files


def weightstream_seconds(cli, directory):
    out = subprocess.run([cli, "load", directory, "--raw", "--json", "--no-progress"], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)["seconds"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", required=True)
    parser.add_argument("--runai-site", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ws-first-load"))
    args = parser.parse_args()
    print("| order | first | second | third | fourth |")
    print("| --- | --- | --- | --- | --- |")
    for round_index in range(args.rounds):
        for first in ("runai", "weightstream"):
            files = fresh_checkpoint(args.cli, args.dir)
            second = "weightstream" if first == "runai" else "runai"
            cells = []
            for who in (first, second, first, second):
                seconds = (cpu_bench.run_runai_engine(args.runai_site, files, 16) if who == "runai"
                           else weightstream_seconds(args.cli, args.dir))
                cells.append(f"{'Run:ai' if who == 'runai' else 'weightstream'} {seconds:.2f} s")
            print(f"| {'Run:ai' if first == 'runai' else 'weightstream'} first | " + " | ".join(cells) + " |", flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

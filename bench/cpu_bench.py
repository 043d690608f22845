#!/usr/bin/env python3
"""Host-memory load benchmark (issue 2): one checkpoint, page cache warm, in one run.

Compares `weightstream load` against
  * the read limit of this machine: `dd` of every shard to /dev/null with 16 MiB blocks
    (all shards in parallel, as a loader may read them),
  * the Python `safetensors` package: safe_open + get_tensor for every tensor (numpy),
  * the Run:ai model streamer (`runai-model-streamer`, SafetensorsStreamer to CPU), when it
    is importable (it needs PyTorch, so on these machines it runs on the GPU machine),
and prints GB/s and the ratios as a markdown table (also written to --out as JSON and MD).

Each contender runs --repeat times; the median is reported. Run under `taskset -c 0,1`
to measure a 2-core machine. `weightstream load` runs at the default `--io auto` (local
tensors handed out in place, copy-on-write views of the page cache) and, as a second row, at
`--io pread` (every tensor copied into fresh memory). With --cold the page cache of the shards
is dropped before every run (posix_fadvise DONTNEED per file, and /proc/sys/vm/drop_caches
where writable) and `dd` reads with O_DIRECT.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from gpu_bench import drop_cache  # the same eviction as the GPU benchmark's cold rows


def shard_files(checkpoint):
    files = sorted(f for f in os.listdir(checkpoint) if f.endswith(".safetensors"))
    return [os.path.join(checkpoint, f) for f in files]


def tensor_bytes(cli, checkpoint):
    out = subprocess.run([cli, "inspect", checkpoint, "--json"], check=True, capture_output=True, text=True).stdout
    return json.loads(out)["bytes"]


def warm(files):
    for path in files:
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def run_dd(files, direct=False):
    start = time.perf_counter()
    flags = ["iflag=direct"] if direct else []
    procs = [subprocess.Popen(["dd", f"if={p}", "of=/dev/null", "bs=16M", *flags], stderr=subprocess.DEVNULL)
             for p in files]
    for proc in procs:
        if proc.wait() != 0:
            raise RuntimeError("dd failed")
    return time.perf_counter() - start


def run_weightstream(cli, checkpoint, extra):
    out = subprocess.run([cli, "load", checkpoint, "--json", "--no-progress", *extra], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)["seconds"]


# Each Python contender runs in a fresh interpreter, like `weightstream load` does: on VMs
# whose memory is backed lazily, touching fresh pages dominates, and an in-process loop
# would reuse pages the previous repeat already touched. Timing starts after the imports.
SAFETENSORS_PROGRAM = """
import sys, time
from safetensors import safe_open
start = time.perf_counter()
keep = []
for path in sys.argv[1:]:
    with safe_open(path, framework="np") as f:
        for name in f.keys():
            keep.append(f.get_tensor(name))
print(time.perf_counter() - start)
"""

RUNAI_PROGRAM = """
import sys, time
from runai_model_streamer import SafetensorsStreamer
start = time.perf_counter()
keep = []
with SafetensorsStreamer() as streamer:
    streamer.stream_files(sys.argv[1:])
    for _name, tensor in streamer.get_tensors():
        keep.append(tensor.clone())
print(time.perf_counter() - start)
"""


# Without torch the Run:ai package's wrapper cannot be imported; its native engine
# (libstreamer) can, through the package's own ctypes layer, as the wrapper drives it. This
# reads every tensor's byte range into numpy buffers, which is what its wrapper does before
# handing out tensors (it then wraps them, without a copy).
RUNAI_ENGINE_PROGRAM = """
import json, os, sys, time, types
site = sys.argv[1]
sys.path.insert(0, site)
package = types.ModuleType("runai_model_streamer")
package.__path__ = [os.path.join(site, "runai_model_streamer")]
sys.modules["runai_model_streamer"] = package
import numpy as np
from runai_model_streamer.libstreamer import libstreamer as ls
jobs = json.loads(sys.argv[2])
start = time.perf_counter()
streamer = ls.runai_start()
keep, paths, counts, offsets, sizes, dsts = [], [], [], [], [], []
for path, ranges in jobs:
    buffer = np.empty(sum(size for _, size in ranges), dtype=np.uint8)
    keep.append(buffer)
    address, position = buffer.ctypes.data, 0
    paths.append(path); counts.append(len(ranges))
    for offset, size in ranges:
        offsets.append(offset); sizes.append(size); dsts.append(address + position); position += size
ls.runai_request(streamer, paths, counts, offsets, sizes, dsts)
for _ in range(len(sizes)):
    response = ls.runai_response(streamer, 600000)
    if response is None or response[0] != 0:
        sys.exit("runai engine error")
ls.runai_end(streamer)
print(time.perf_counter() - start)
"""


def tensor_ranges(path):
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    base = 8 + length
    ranges = [(base + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
              for k, v in header.items() if k != "__metadata__"]
    return sorted(r for r in ranges if r[1] > 0)


def run_runai_engine(site, files, concurrency):
    jobs = [[os.path.abspath(p), tensor_ranges(p)] for p in files]
    env = dict(os.environ, RUNAI_STREAMER_CONCURRENCY=str(concurrency), RUNAI_STREAMER_LOG_LEVEL="WARNING")
    out = subprocess.run([sys.executable, "-c", RUNAI_ENGINE_PROGRAM, site, json.dumps(jobs)], check=True,
                         capture_output=True, text=True, env=env).stdout
    return float(out.strip().splitlines()[-1])


def run_program(program, files):
    out = subprocess.run([sys.executable, "-c", program, *files], check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def run_safetensors(files):
    return run_program(SAFETENSORS_PROGRAM, files)


def run_runai(files):
    return run_program(RUNAI_PROGRAM, files)


def run_weightstream_digest(cli, checkpoint):
    """Streams every byte through bounded staging and hashes it: the loader without the
    cost of first-touching a destination the size of the model."""
    start = time.perf_counter()
    subprocess.run([cli, "digest", checkpoint, "--hash", "xxh64", "--no-progress"], check=True, capture_output=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="directory of a checkpoint (e.g. from weightstream synth --size 2GiB)")
    parser.add_argument("--cli", default=os.environ.get("WS_CLI", "build/weightstream"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--weightstream-args", default="", help="extra flags for weightstream load")
    parser.add_argument("--out", default=None, help="folder for results.json and results.md")
    parser.add_argument("--runai-site", default=None,
                        help="folder where `pip install --no-deps --target` put runai-model-streamer: drive its "
                             "engine directly when its torch wrapper cannot be imported")
    parser.add_argument("--cold", action="store_true",
                        help="drop the shards from the page cache before every run; dd reads with O_DIRECT")
    args = parser.parse_args()

    files = shard_files(args.checkpoint)
    total = tensor_bytes(args.cli, args.checkpoint)
    file_bytes = sum(os.path.getsize(p) for p in files)
    if args.cold:
        print(f"cold: page cache dropped before every run (drop_caches "
              f"{'written' if drop_cache(files) else 'not writable: posix_fadvise only'})", file=sys.stderr)
    else:
        warm(files)

    extra = args.weightstream_args.split()
    contenders = {
        f"read limit (parallel dd{' O_DIRECT' if args.cold else ''}, 16 MiB blocks)": (
            lambda: run_dd(files, direct=args.cold), file_bytes),
        "weightstream load": (lambda: run_weightstream(args.cli, args.checkpoint, extra), total),
        "weightstream load --io pread (copies into fresh memory)": (
            lambda: run_weightstream(args.cli, args.checkpoint, ["--io", "pread", *extra]), total),
        "weightstream digest --hash xxh64 (bounded staging, whole process)": (
            lambda: run_weightstream_digest(args.cli, args.checkpoint), total),
        "safetensors safe_open + get_tensor (numpy)": (lambda: run_safetensors(files), total),
    }
    try:
        import runai_model_streamer  # noqa: F401
        contenders["Run:ai SafetensorsStreamer (CPU)"] = (lambda: run_runai(files), total)
    except Exception as error:  # the wrapper needs torch
        if args.runai_site:
            contenders["Run:ai streamer engine (libstreamer, 16 workers)"] = (
                lambda: run_runai_engine(args.runai_site, files, 16), total)
        else:
            print(f"Run:ai streamer not measured: {error}", file=sys.stderr)

    results = {}
    for name, (run, nbytes) in contenders.items():
        times = []
        for _ in range(args.repeat):
            if args.cold:
                drop_cache(files)
            times.append(run())
        seconds = statistics.median(times)
        results[name] = {"seconds": seconds, "bytes": nbytes, "gbps": nbytes / seconds / 1e9, "runs": times}
        print(f"{name}: {results[name]['gbps']:.2f} GB/s (median of {args.repeat})", file=sys.stderr)

    ours = results["weightstream load"]["gbps"]
    lines = ["| contender | median GB/s (runs) | weightstream ÷ contender |", "| --- | ---: | ---: |"]
    for name, result in results.items():
        ratio = ours / result["gbps"] if name != "weightstream load" else 1.0
        runs = ", ".join(f"{result['bytes'] / s / 1e9:.2f}" for s in result["runs"])
        lines.append(f"| {name} | {result['gbps']:.2f} ({runs}) | {ratio:.2f}× |")
    limit = next(result["gbps"] for name, result in results.items() if name.startswith("read limit"))
    lines.append("")
    lines.append(f"weightstream reaches {100 * ours / limit:.0f}% of the read limit; "
                 f"checkpoint {total / 1e9:.2f} GB in {len(files)} shards; cpus {len(os.sched_getaffinity(0))}.")
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cpu_results.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.out, "cpu_results.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()

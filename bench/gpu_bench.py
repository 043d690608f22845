#!/usr/bin/env python3
"""GPU load benchmark (issue 4), one run on a GPU machine.

Synthesizes a bf16 checkpoint of at least 16 GB, then measures with a warm and a cold page
cache: `weightstream load --device cuda:0` by each GPU path and a few reader counts,
`safetensors.torch.load_file(..., device="cuda:0")`, and in the same run the two ceilings:
the pinned host-to-device copy rate (torch, timed with CUDA events) and the O_DIRECT disk
read rate (dd). Prints a markdown table with ratios and writes it, with every raw number,
under --out. Deletes the checkpoint at the end unless --keep.

Usage: bench/gpu_bench.py --cli build-gpu/weightstream --out OUT [--size 16GiB] [--dir DIR]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

GB = 1e9
REPEATS = 2  # warm runs per configuration (the device lease is short)


def log(*args):
    print(*args, flush=True)


def parse_size(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "GB": 10**9}
    for unit, scale in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def shard_files(directory):
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))


def drop_cache(files):
    """Evicts the checkpoint from the page cache: per file, then system-wide where allowed."""
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_timed(command):
    """Runs a command; returns (stdout, wall seconds)."""
    start = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}): {process.stderr.strip()[-2000:]}")
    return process.stdout, wall


def synthesize(cli, directory, size, shards):
    os.makedirs(directory, exist_ok=True)
    start = time.perf_counter()
    try:
        subprocess.run([cli, "synth", directory, "--arch", "llama", "--size", size, "--shards", str(shards)],
                       check=True, capture_output=True, text=True, timeout=90)
        how = "weightstream synth"
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError) as error:
        log(f"weightstream synth failed ({error}); writing with the Python generator")
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)
        python_synthesize(directory, parse_size(size), shards)
        how = "python generator"
    os.sync()
    files = shard_files(directory)
    total = sum(os.path.getsize(f) for f in files)
    log(f"checkpoint: {len(files)} shards, {total / GB:.2f} GB by {how} in {time.perf_counter() - start:.1f} s")
    return files, total, how


def python_synthesize(directory, size, shards):
    """bf16 tensors of 8192x8192 (128 MiB) with pseudo-random bytes, `shards` files."""
    import numpy as np

    tensor_bytes = 8192 * 8192 * 2
    count = max(shards, -(-size // tensor_bytes))
    block = np.random.default_rng(0).integers(0, 256, tensor_bytes, dtype=np.uint8)
    per_shard = -(-count // shards)
    for shard in range(shards):
        names = [f"model.layers.{i}.weight" for i in range(shard * per_shard, min(count, (shard + 1) * per_shard))]
        header = {"__metadata__": {"format": "pt"}}
        for k, name in enumerate(names):
            header[name] = {"dtype": "BF16", "shape": [8192, 8192], "data_offsets": [k * tensor_bytes, (k + 1) * tensor_bytes]}
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path = os.path.join(directory, f"model-{shard + 1:05d}-of-{shards:05d}.safetensors")
        with open(path, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            for k in range(len(names)):
                block[:8] = np.frombuffer((shard * per_shard + k).to_bytes(8, "little"), dtype=np.uint8)
                f.write(block.tobytes())


# How loads are driven: "cli" (`weightstream load`), or "test" where the CLI does not yet
# reach the GPU paths: the disabled test CudaLoadBench in test_stream calls the library's
# load_checkpoint_cuda with the same options, given as WEIGHTSTREAM_* variables.
DRIVER = {"kind": "cli", "test_binary": None}
FLAG_VARIABLES = {"--memory-limit": "WEIGHTSTREAM_MEMORY_LIMIT", "--io": "WEIGHTSTREAM_LOCAL_IO"}


def weightstream_load(cli, directory, path, concurrency, extra=()):
    if DRIVER["kind"] == "cli":
        command = [cli, "load", directory, "--device", "cuda:0", "--json", "--no-progress", "--gpu-path", path,
                   "--concurrency", str(concurrency), *extra]
        out, wall = run_timed(command)
        result = json.loads(out)
    else:
        env = dict(os.environ, WS_TEST_GPU_CHECKPOINT=directory, WEIGHTSTREAM_GPU_PATH=path,
                   WEIGHTSTREAM_CONCURRENCY=str(concurrency))
        for flag, value in zip(extra[::2], extra[1::2]):
            env[FLAG_VARIABLES[flag]] = value
        start = time.perf_counter()
        process = subprocess.run([DRIVER["test_binary"], "--gtest_also_run_disabled_tests",
                                  "--gtest_filter=CudaLoadBench.*"], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        lines = [l for l in process.stdout.splitlines() if l.startswith("WS_GPU_LOAD_JSON ")]
        if process.returncode != 0 or not lines:
            raise RuntimeError(f"CudaLoadBench failed ({process.returncode}): {process.stdout[-2000:]}{process.stderr[-1000:]}")
        result = json.loads(lines[-1].split(" ", 1)[1])
    result["wall_seconds"] = wall
    return result


def peak_rss_of(command):
    """Peak resident set of one command, in bytes. Linux carries a process's peak RSS across
    fork and exec, so a child of this (torch-sized) process would report this process's RSS:
    the command is started from a small fresh interpreter instead."""
    launcher = ("import resource, subprocess, sys; "
                "code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode; "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")
    process = subprocess.run([sys.executable, "-c", launcher, *command], capture_output=True, text=True)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode})")
    return int(process.stdout.split()[-1]) * 1024


def safetensors_load(files, torch, load_file):
    torch.cuda.synchronize()
    start = time.perf_counter()
    tensors = [load_file(f, device="cuda:0") for f in files]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    total = sum(t.numel() * t.element_size() for shard in tensors for t in shard.values())
    del tensors
    torch.cuda.empty_cache()
    return total / seconds / GB, seconds


def pinned_copy_rate(torch, size=4 << 30, repeats=5):
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)  # contents do not change a copy's rate; random_ would cost seconds
    device = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    pageable = torch.empty(size, dtype=torch.uint8)
    pageable.fill_(7)
    rates = {}
    for name, source in (("pinned", host), ("pageable", pageable)):
        device.copy_(source, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            device.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        rates[name] = size / statistics.median(times) / GB
    del host, device, pageable
    torch.cuda.empty_cache()
    return rates


def odirect_rate(files, parallel):
    """dd with O_DIRECT over every shard, one at a time or all at once."""
    total = sum(os.path.getsize(f) for f in files)
    commands = [["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"] for f in files]
    start = time.perf_counter()
    if parallel:
        processes = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands]
        codes = [p.wait() for p in processes]
    else:
        codes = [subprocess.run(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode for c in commands]
    seconds = time.perf_counter() - start
    if any(codes):
        raise RuntimeError(f"dd iflag=direct failed: {codes}")
    return total / seconds / GB


def digest_check(cli, directory):
    """xxh64 digests landed on the GPU (each path) equal the host digests."""
    def digest(*extra):
        out = subprocess.run([cli, "digest", directory, "--hash", "xxh64", "--no-progress", *extra], check=True,
                             capture_output=True, text=True).stdout
        return out
    host = digest("--device", "cpu")
    return {path: digest("--device", "cuda:0", "--gpu-path", path) == host for path in ("staged", "mapped")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli", required=True, help="the weightstream binary")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for results")
    parser.add_argument("--dir", default="/tmp/ws-gpu-bench", help="where the checkpoint is written")
    parser.add_argument("--size", default="16GiB")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint")
    parser.add_argument("--load-driver", default="cli", metavar="cli|TEST_BINARY",
                        help="drive loads by `weightstream load` (default) or by this test_stream binary")
    args = parser.parse_args()
    if args.load_driver != "cli":
        DRIVER.update(kind="test", test_binary=os.path.abspath(args.load_driver))
    os.makedirs(args.out, exist_ok=True)
    cli = os.path.abspath(args.cli)

    import torch
    from safetensors.torch import load_file

    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": [],
               "load_driver": "weightstream load" if DRIVER["kind"] == "cli" else "load_checkpoint_cuda (test_stream)"}
    shutil.rmtree(args.dir, ignore_errors=True)
    try:
        files, total, how = synthesize(cli, args.dir, args.size, args.shards)
        results.update(checkpoint_bytes=total, shards=len(files), synthesized_by=how)

        copy = pinned_copy_rate(torch)
        results["pinned_h2d_gbps"], results["pageable_h2d_gbps"] = copy["pinned"], copy["pageable"]
        log(f"pinned H2D {copy['pinned']:.1f} GB/s, pageable H2D {copy['pageable']:.1f} GB/s")

        def record(name, cache, gbps, **extra):
            results["runs"].append({"name": name, "cache": cache, "gbps": gbps, **extra})
            log(f"{cache:5s} {name:40s} {gbps:6.2f} GB/s {extra if extra else ''}")

        configs = [("staged", 16, ()), ("staged", 8, ()), ("staged", 16, ("--memory-limit", "256MiB")),
                   ("staged", 16, ("--memory-limit", "4GiB")), ("mapped", 8, ()), ("mapped", 16, ())]
        # Warm: the checkpoint was just written, and fits in memory; read it once to be sure.
        for path in files:
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass
        for path, concurrency, extra in configs:
            runs = [weightstream_load(cli, args.dir, path, concurrency, extra) for _ in range(REPEATS)]
            best = max(runs, key=lambda r: r["gbps"])
            record(f"weightstream {path} c={concurrency} {' '.join(extra)}".strip(), "warm", statistics.median(r["gbps"] for r in runs),
                   best=best["gbps"], wall_s=best["wall_seconds"], peak_staging=best["peak_staging_bytes"])
        if DRIVER["kind"] == "cli":
            rss_command = lambda p: [cli, "load", args.dir, "--device", "cuda:0", "--no-progress", "--gpu-path", p]
        else:
            rss_command = lambda p: ["env", f"WS_TEST_GPU_CHECKPOINT={args.dir}", f"WEIGHTSTREAM_GPU_PATH={p}",
                                     DRIVER["test_binary"], "--gtest_also_run_disabled_tests",
                                     "--gtest_filter=CudaLoadBench.*"]
        rss = {p: peak_rss_of(rss_command(p)) for p in ("staged", "mapped")}
        results["peak_rss_bytes"] = rss
        log(f"peak RSS of a load: {', '.join(f'{p} {v / 2**20:.0f} MiB' for p, v in rss.items())}")
        load_file(files[0], device="cuda:0")  # warm-up of the library and the CUDA context
        gbps, seconds = safetensors_load(files, torch, load_file)
        record("safetensors.torch.load_file", "warm", gbps, seconds=seconds)

        # Cold: evict before every run.
        dropped = drop_cache(files)
        results["drop_caches"] = dropped
        for path, concurrency, extra in [("staged", 16, ()), ("staged", 32, ("--io", "direct")), ("mapped", 16, ())]:
            drop_cache(files)
            r = weightstream_load(cli, args.dir, path, concurrency, extra)
            record(f"weightstream {path} c={concurrency} {' '.join(extra)}".strip(), "cold", r["gbps"],
                   wall_s=r["wall_seconds"])
        drop_cache(files)
        gbps, seconds = safetensors_load(files, torch, load_file)
        record("safetensors.torch.load_file", "cold", gbps, seconds=seconds)
        drop_cache(files)
        results["odirect_serial_gbps"] = odirect_rate(files, parallel=False)
        results["odirect_parallel_gbps"] = odirect_rate(files, parallel=True)
        log(f"O_DIRECT dd: serial {results['odirect_serial_gbps']:.2f} GB/s, "
            f"{len(files)} at once {results['odirect_parallel_gbps']:.2f} GB/s")

        results["digest_equal"] = digest_check(cli, args.dir)
        log(f"digests on cuda:0 equal the host's: {results['digest_equal']}")
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)

    table = markdown(results)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write(table)
    print(table)


def markdown(results):
    copy = results["pinned_h2d_gbps"]
    disk = max(results["odirect_serial_gbps"], results["odirect_parallel_gbps"])
    lines = [
        f"GPU {results['gpu']}, checkpoint {results['checkpoint_bytes'] / GB:.1f} GB in {results['shards']} shards "
        f"({results['synthesized_by']}), torch {results['torch']}; drop_caches allowed: {results['drop_caches']}; "
        f"weightstream loads driven by {results['load_driver']}.",
        "",
        f"Ceilings measured in the same run: pinned host-to-device copy **{copy:.1f} GB/s** "
        f"(pageable {results['pageable_h2d_gbps']:.1f}); O_DIRECT read (dd bs=16M) **{disk:.2f} GB/s** "
        f"(serial {results['odirect_serial_gbps']:.2f}, all shards at once {results['odirect_parallel_gbps']:.2f}).",
        "",
        "| loader | cache | GB/s | vs pinned copy | vs O_DIRECT disk | vs safetensors |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    reference = {r["cache"]: r["gbps"] for r in results["runs"] if r["name"].startswith("safetensors")}
    for r in results["runs"]:
        ratio_copy = f"{r['gbps'] / copy:.0%}" if r["cache"] == "warm" else ""
        ratio_disk = f"{r['gbps'] / disk:.0%}" if r["cache"] == "cold" else ""
        versus = f"{r['gbps'] / reference[r['cache']]:.1f}x" if r["cache"] in reference else ""
        lines.append(f"| {r['name']} | {r['cache']} | {r['gbps']:.2f} | {ratio_copy} | {ratio_disk} | {versus} |")
    rss = results.get("peak_rss_bytes", {})
    lines += ["", f"Warm weightstream rows are the median of {REPEATS} runs; cold rows one run each after evicting the cache.",
              "Peak RSS of a whole `weightstream load` process (default 1 GiB memory limit): " +
              ", ".join(f"{p} {v / 2**20:.0f} MiB" for p, v in rss.items()) + ".",
              f"Digests (xxh64) landed on cuda:0 equal the host digests: {results.get('digest_equal')}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Where the time of a Python `Checkpoint.stream()` onto a GPU goes (issue 19: the stream
should reach the load's rate). In one process, after torch made its CUDA context: the
seconds of `weightstream.load`, then of streams at a few memory limits, each split into
the call that starts the stream, the wait for the first tensor, and the rest; the longest
waits between two tensors and the tensor that ended each; and what a cudaMalloc of each of
the checkpoint's tensor sizes costs alone (through CuPy's runtime bindings, no pool), since
the stream allocates one buffer per tensor where the load allocates one arena.

    python3 bench/stream_timeline.py CHECKPOINT_DIR [--device cuda:0] [--limits 1GiB,4GiB]
"""
import argparse
import statistics
import time


def stream_once(weightstream, torch, path, device, limit):
    checkpoint = weightstream.open(path)
    sizes = {info.name: info.bytes for info in checkpoint.tensors}
    held, arrivals = [], []
    start = time.perf_counter()
    stream = checkpoint.stream(device=device, framework="torch", **({"memory_limit": limit} if limit else {}))
    started = time.perf_counter()
    for name, tensor in stream:
        arrivals.append((time.perf_counter(), name))
        held.append(tensor)
    torch.cuda.synchronize()
    end = time.perf_counter()
    gaps = sorted(((arrivals[i][0] - arrivals[i - 1][0], arrivals[i][1]) for i in range(1, len(arrivals))), reverse=True)
    total = sum(sizes.values())
    return {"seconds": end - start, "call": started - start, "first": arrivals[0][0] - started,
            "gbps": total / (end - start) / 1e9, "peak_queued": stream.peak_queued_bytes,
            "gaps": [(round(g * 1e3, 2), n, sizes[n] >> 20) for g, n in gaps[:5]]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--limits", default="default,4GiB", help="memory limits of the streams ('default': none given)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch
    import weightstream

    torch.ones(1, device=args.device)
    torch.cuda.synchronize()
    checkpoint = weightstream.open(args.checkpoint)
    total = checkpoint.nbytes
    for _ in range(args.repeats):
        start = time.perf_counter()
        loaded = weightstream.load(args.checkpoint, device=args.device, framework="torch")
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(f"load: {seconds:.3f} s, {total / seconds / 1e9:.2f} GB/s")
        del loaded
    for limit in args.limits.split(","):
        for _ in range(args.repeats):
            r = stream_once(weightstream, torch, args.checkpoint, args.device, None if limit == "default" else limit)
            print(f"stream (memory_limit {limit}): {r['seconds']:.3f} s, {r['gbps']:.2f} GB/s; call {r['call'] * 1e3:.1f} ms, "
                  f"first tensor {r['first'] * 1e3:.1f} ms; peak queued {r['peak_queued'] >> 20} MiB; longest waits "
                  f"(ms, tensor, MiB): {r['gaps']}")
    try:
        import cupy
    except ImportError:
        print("cudaMalloc: no cupy here")
        return
    sizes = [info.bytes for info in checkpoint.tensors if info.bytes]
    costs = []
    for size in sizes:
        start = time.perf_counter()
        pointer = cupy.cuda.runtime.malloc(size)
        costs.append(time.perf_counter() - start)
        cupy.cuda.runtime.free(pointer)
    start = time.perf_counter()
    pointer = cupy.cuda.runtime.malloc(sum(sizes))
    arena = time.perf_counter() - start
    cupy.cuda.runtime.free(pointer)
    print(f"cudaMalloc of each of the {len(sizes)} tensor sizes: {sum(costs) * 1e3:.1f} ms in all, median "
          f"{statistics.median(costs) * 1e6:.0f} us, largest {max(costs) * 1e3:.2f} ms; one arena of all: {arena * 1e3:.1f} ms")


if __name__ == "__main__":
    main()

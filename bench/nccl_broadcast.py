#!/usr/bin/env python3
"""NCCL's own broadcast of one buffer from cuda:0 to cuda:1 (torch.distributed, one process
per GPU): the baseline that issue 9's update broadcast is measured against, in the same run.
Usage: bench/nccl_broadcast.py [--bytes 16GiB] [--repeat 3]   (needs two GPUs and torch)"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_size(text):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def rank_main(rank, size, repeat, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device(f"cuda:{rank}"))
    buffer = torch.empty(size, dtype=torch.uint8, device=f"cuda:{rank}")
    if rank == 0:
        buffer.fill_(7)
    dist.broadcast(buffer, src=0)  # warm-up: connections and NCCL's own buffers
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        dist.broadcast(buffer, src=0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if rank == 1:
        assert int(buffer[-1]) == 7, "the broadcast did not arrive"
        results.put(statistics.median(times))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bytes", default="16GiB")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    size = parse_size(args.bytes)
    context = mp.get_context("spawn")
    results = context.Queue()
    port = 29500 + os.getpid() % 1000
    mp.start_processes(rank_main, args=(size, args.repeat, port, results), nprocs=2, start_method="spawn")
    seconds = results.get()
    print(f"| NCCL broadcast, one buffer, cuda:0 -> cuda:1 | {seconds:.4f} | {size / seconds / 1e9:.2f} | 100% |")


if __name__ == "__main__":
    main()

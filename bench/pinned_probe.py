#!/usr/bin/env python3
"""How long pinning host memory takes on this machine, each way the loader could do it.

The staged GPU path allocates pinned staging buffers inside the timed load, so their cost
is part of every load. Compares, for the same size: cudaHostAlloc (torch's pin_memory),
and memory the host allocator maps with transparent huge pages, touched and then
registered with cudaHostRegister (what weightstream's Buffer does). Needs torch and a GPU.
Usage: bench/pinned_probe.py [GiB]
"""
import ctypes
import mmap
import sys
import time

import torch

GIB = 1 << 30


def timed(function):
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def main():
    size = int(float(sys.argv[1]) * GIB) if len(sys.argv) > 1 else GIB
    torch.ones(1, device="cuda:0")  # the CUDA context is not part of the timing
    cudart = torch.cuda.cudart()
    rows = []

    seconds, pinned = timed(lambda: torch.empty(size, dtype=torch.uint8, pin_memory=True))
    rows.append(("cudaHostAlloc (torch pin_memory)", seconds))
    del pinned

    for huge in (False, True):
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            region.madvise(mmap.MADV_HUGEPAGE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        seconds, code = timed(lambda: int(cudart.cudaHostRegister(address, size, 1)))  # 1: portable
        if code != 0:
            raise RuntimeError(f"cudaHostRegister failed: error {code}")
        rows.append((f"mmap{' + MADV_HUGEPAGE' if huge else ''} + cudaHostRegister", seconds))
        seconds, _ = timed(lambda: cudart.cudaHostUnregister(address))
        rows.append((f"  cudaHostUnregister of that", seconds))
        del address
        region.close()

    for name, seconds in rows:
        print(f"pinned probe, {size / GIB:.1f} GiB: {name}: {seconds:.3f} s ({size / seconds / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()

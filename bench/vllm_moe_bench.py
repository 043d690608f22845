#!/usr/bin/env python3
"""One tensor-parallel rank of an FP8 MoE model with expert parallelism, loaded into vLLM's
own model (vLLM 0.33's Qwen3MoeForCausalLM on the CPU) by vLLM's default loader and by
weightstream's (``--load-format weightstream``), and weightstream's own host load of that
rank's bytes (``weightstream load --tp-size 2 --tp-rank 0 --ep-size 2 --ep-rank 0``), in one
run, page cache warm.

Two processes make vLLM's tp-2 group (gloo); rank 0 is timed while rank 1 waits at a barrier,
so the timed load has the machine to itself. The model is built once per round (outside the
timing, alike for both loaders); each loader's load_weights is timed. Rounds alternate the
order of the contenders; the median of ``--rounds`` is reported with the ratios.

Usage: python bench/vllm_moe_bench.py --cli build/weightstream --checkpoint DIR [--size 1GiB]
(DIR is written by ``weightstream synth --arch qwen3_moe --quantize fp8-block`` when missing).
Needs vLLM (scripts/vllm-test.sh's environment) and the Python package on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))


def warm(folder: str) -> None:
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as file:
            while file.read(64 << 20):
                pass


def rank_main(rank: int, port: int, checkpoint: str, rounds: int, out: str) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch.distributed as dist

    import vllm_models
    import weightstream.vllm as ws_vllm
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    ws_vllm.register()
    vllm_models.register_cpu_fp8_kernel()
    times = {"vllm": [], "weightstream": []}
    last = {}
    with vllm_models.parallel_state(2, rank, port):
        for round_index in range(rounds):
            order = ["vllm", "weightstream"] if round_index % 2 == 0 else ["weightstream", "vllm"]
            for contender in order:
                load_format = "safetensors" if contender == "vllm" else "weightstream"
                config = vllm_models.vllm_config(checkpoint, 2, True, load_format)
                with set_current_vllm_config(config):
                    model = initialize_model(vllm_config=config, model_config=config.model_config)
                    loader = get_model_loader(config.load_config)
                    warm(checkpoint)
                    dist.barrier()
                    if rank == 0:
                        started = time.perf_counter()
                        loader.load_weights(model, config.model_config)
                        times[contender].append(time.perf_counter() - started)
                        if contender == "weightstream":
                            last = dict(loader.last_load)
                    dist.barrier()
                    if rank == 1:
                        loader.load_weights(model, config.model_config)
                    dist.barrier()
                # vLLM's model holds reference cycles: without a collection each round's model
                # stays resident and every later load allocates fresh pages (both loaders ran
                # 2-4x slower from the third model on). Collected, every round starts alike.
                del model
                gc.collect()
    if rank == 0:
        with open(out, "w") as file:
            json.dump({"times": times, "last_load": last}, file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cli", required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.checkpoint, args.rounds, args.out)
        return
    if not os.path.exists(os.path.join(args.checkpoint, "config.json")):
        subprocess.run([args.cli, "synth", args.checkpoint, "--arch", "qwen3_moe", "--quantize", "fp8-block",
                        "--size", args.size, "--hidden", "1024", "--experts", "16", "--seed", "7"], check=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = os.path.join(args.checkpoint, "..", "vllm_moe_bench.json")
    ranks = [subprocess.Popen([sys.executable, __file__, "--cli", args.cli, "--checkpoint", args.checkpoint,
                               "--rounds", str(args.rounds), "--rank", str(rank), "--port", str(port), "--out", out])
             for rank in (0, 1)]
    for process in ranks:
        if process.wait() != 0:
            sys.exit("a rank failed")
    with open(out) as file:
        measured = json.load(file)
    raw = []
    flags = ["--tp-size", "2", "--tp-rank", "0", "--ep-size", "2", "--ep-rank", "0", "--device", "cpu"]
    for _ in range(args.rounds):
        warm(args.checkpoint)
        result = subprocess.run([args.cli, "load", args.checkpoint, *flags, "--json", "--no-progress"],
                                check=True, capture_output=True, text=True)
        raw.append(json.loads(result.stdout))
    checkpoint_bytes = sum(os.path.getsize(os.path.join(args.checkpoint, f)) for f in os.listdir(args.checkpoint)
                           if f.endswith(".safetensors"))
    vllm_s = statistics.median(measured["times"]["vllm"])
    ours_s = statistics.median(measured["times"]["weightstream"])
    raw_s = statistics.median(r["seconds"] for r in raw)
    rank_bytes = measured["last_load"]["bytes_read"]
    rows = [
        ("vLLM default loader (safetensors) into vLLM's model", vllm_s),
        ("weightstream loader into vLLM's model", ours_s),
        ("weightstream host load of the rank's layout (`load --tp-size 2 --ep-size 2`)", raw_s),
    ]
    print(f"checkpoint {checkpoint_bytes / 2**30:.2f} GiB, rank 0 of tp 2 with EP reads "
          f"{rank_bytes / 2**30:.2f} GiB; medians of {args.rounds} rounds")
    print("| contender | seconds | rank GB/s |\n| --- | ---: | ---: |")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {rank_bytes / seconds / 1e9:.2f} |")
    print(f"\nweightstream / vLLM default: {vllm_s / ours_s:.2f}x (target >= 2x); "
          f"weightstream in vLLM / its own host load: {raw_s / ours_s:.2f}x (target >= 0.9x)")
    print(json.dumps({"vllm": measured["times"]["vllm"], "weightstream": measured["times"]["weightstream"],
                      "raw": [r["seconds"] for r in raw], "rank_bytes": rank_bytes,
                      "checkpoint_bytes": checkpoint_bytes}))


if __name__ == "__main__":
    main()

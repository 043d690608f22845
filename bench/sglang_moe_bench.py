#!/usr/bin/env python3
"""One tensor-parallel rank of an FP8 MoE model with expert parallelism, loaded into SGLang's
own model (SGLang 0.5.23's DeepseekV3ForCausalLM on the CPU) by SGLang's DefaultModelLoader
and by weightstream's (``--load-format weightstream``), and weightstream's own host load of
that rank's bytes (``weightstream load --tp-size 2 --tp-rank 0 --ep-size 2 --ep-rank 0``), in
one run, page cache warm.

Two processes make SGLang's tp-2 group with EP 2 (gloo, the CPU recipe of
tests/python/sglang_models.py); rank 0 is timed while rank 1 waits at a barrier. Each round's
model is built by SGLang (outside the timing, alike for both loaders) and each loader's load
step (``load_weights_and_postprocess``: the load and SGLang's post-processing) is timed.
Rounds alternate the order; the median of ``--rounds`` is reported with the ratios. The
weightstream step is also split into weightstream's load into SGLang's parameters (binding
and the stream: ``last_load["seconds"]``) and what SGLang runs after it (DeepSeek's
``post_load_weights``, which requantizes every layer's FP8 kv_b_proj into w_kc and w_vc, and
``process_weights_after_loading``), which SGLang's own loader runs inside its
``load_weights`` too and the host load has no counterpart of; the model's
``post_load_weights`` is timed in both contenders' steps (wrapped on the model instance), and
each contender's minor page faults are counted (getrusage), the host load's as a child
process's.

Usage: python bench/sglang_moe_bench.py --cli build/weightstream --checkpoint DIR [--size 1GiB]
(DIR is written by ``weightstream synth --arch deepseek_v3 --quantize fp8-block`` when missing,
and given the yarn rope scaling SGLang's CPU engine needs). Needs SGLang
(scripts/sglang-test.sh's environment, its sgl_kernel stub on PYTHONPATH) and the Python
package on PYTHONPATH.
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
import resource
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))


def warm(folder: str) -> None:
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as file:
            while file.read(64 << 20):
                pass


def minor_faults(who: int) -> int:
    """Minor page faults so far of this process (RUSAGE_SELF) or its waited-for children."""
    return resource.getrusage(who).ru_minflt


def time_post_load_weights(model, seconds: list) -> None:
    """Records in ``seconds`` how long each call of the model's post_load_weights takes (SGLang's
    loader calls it inside the model's load_weights, weightstream's after its load)."""
    original = model.post_load_weights

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    object.__setattr__(model, "post_load_weights", timed)


def rank_main(rank: int, port: int, checkpoint: str, rounds: int, out: str) -> None:
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    import sglang_models

    sglang_models.prepare_sglang(2)
    import torch
    import torch.distributed as dist
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import (
        DefaultModelLoader,
        _get_quantization_config,
        _initialize_model,
        get_model_loader,
        set_default_torch_dtype,
    )

    # SGLang's runner (its groups, its config), loaded once by its default loader.
    runner = sglang_models.build(checkpoint, 2, rank, True, "auto", port)
    model_config = runner.model_config
    device = torch.device("cpu")
    times = {"sglang": [], "weightstream": []}
    faults = {"sglang": [], "weightstream": []}
    ours_load = []  # weightstream's part of its step: binding and the stream
    post_load = {"sglang": [], "weightstream": []}  # SGLang's post_load_weights in each step
    last = {}
    for round_index in range(rounds):
        order = ["sglang", "weightstream"] if round_index % 2 == 0 else ["weightstream", "sglang"]
        for contender in order:
            load_config = LoadConfig(load_format="auto" if contender == "sglang" else "weightstream")
            loader = get_model_loader(load_config, model_config)
            with set_default_torch_dtype(model_config.dtype):
                with device:
                    model = _initialize_model(model_config, load_config,
                                              _get_quantization_config(model_config, load_config))
                if contender == "weightstream":
                    loader._model_config = model_config
                weights = loader._get_all_weights(model_config, model) if contender == "sglang" else None
                warm(checkpoint)
                dist.barrier()
                for timed in (0, 1):
                    if rank == timed:
                        post_seconds = []
                        time_post_load_weights(model, post_seconds)
                        faulted = minor_faults(resource.RUSAGE_SELF)
                        started = time.perf_counter()
                        loader.load_weights_and_postprocess(model, weights, device)
                        if rank == 0:
                            times[contender].append(time.perf_counter() - started)
                            faults[contender].append(minor_faults(resource.RUSAGE_SELF) - faulted)
                            post_load[contender].append(sum(post_seconds))
                            if contender == "weightstream":
                                last = dict(loader.last_load)
                                ours_load.append(last["seconds"])
                    dist.barrier()
            assert isinstance(loader, DefaultModelLoader)
            del model, weights, loader
            gc.collect()
    if rank == 0:
        with open(out, "w") as file:
            json.dump({"times": times, "faults": faults, "ours_load": ours_load, "post_load": post_load,
                       "last_load": last}, file)


def write_checkpoint(cli: str, folder: str, size: str) -> None:
    subprocess.run([cli, "synth", folder, "--arch", "deepseek_v3", "--quantize", "fp8-block", "--size", size,
                    "--hidden", "1024", "--experts", "16", "--mtp-layers", "0", "--seed", "7"], check=True)
    path = os.path.join(folder, "config.json")
    with open(path) as file:
        config = json.load(file)
    # SGLang's CPU engine builds DeepSeek's rotary embedding from yarn rope scaling, which real
    # DeepSeek-V3 configs have (factor 1: the plain rotary embedding).
    config["rope_scaling"] = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    with open(path, "w") as file:
        json.dump(config, file, indent=2)


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
        write_checkpoint(args.cli, args.checkpoint, args.size)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = os.path.join(args.checkpoint, "..", "sglang_moe_bench.json")
    ranks = [subprocess.Popen([sys.executable, __file__, "--cli", args.cli, "--checkpoint", args.checkpoint,
                               "--rounds", str(args.rounds), "--rank", str(rank), "--port", str(port), "--out", out])
             for rank in (0, 1)]
    for process in ranks:
        if process.wait() != 0:
            sys.exit("a rank failed")
    with open(out) as file:
        measured = json.load(file)
    raw = []
    raw_faults = []
    flags = ["--tp-size", "2", "--tp-rank", "0", "--ep-size", "2", "--ep-rank", "0", "--device", "cpu"]
    for _ in range(args.rounds):
        warm(args.checkpoint)
        faulted = minor_faults(resource.RUSAGE_CHILDREN)
        result = subprocess.run([args.cli, "load", args.checkpoint, *flags, "--json", "--no-progress"],
                                check=True, capture_output=True, text=True)
        raw_faults.append(minor_faults(resource.RUSAGE_CHILDREN) - faulted)
        raw.append(json.loads(result.stdout))
    checkpoint_bytes = sum(os.path.getsize(os.path.join(args.checkpoint, f)) for f in os.listdir(args.checkpoint)
                           if f.endswith(".safetensors"))
    sglang_s = statistics.median(measured["times"]["sglang"])
    ours_s = statistics.median(measured["times"]["weightstream"])
    raw_s = statistics.median(r["seconds"] for r in raw)
    ours_load_s = statistics.median(measured["ours_load"])
    after_s = statistics.median(total - load for total, load in
                                zip(measured["times"]["weightstream"], measured["ours_load"]))
    post_load = {name: statistics.median(seconds) for name, seconds in measured["post_load"].items()}
    rank_bytes = measured["last_load"]["bytes_read"]
    faults = measured["faults"]
    rows = [
        ("SGLang's DefaultModelLoader into SGLang's model, the whole step", sglang_s, faults["sglang"]),
        ("- of it SGLang's post_load_weights (inside the model's load_weights)", post_load["sglang"], None),
        ("weightstream loader into SGLang's model, the whole step", ours_s, faults["weightstream"]),
        ("- of it weightstream's load (binding and the stream into SGLang's parameters)", ours_load_s, None),
        ("- of it SGLang's post-processing after the load (post_load_weights, process_weights_after_loading)",
         after_s, None),
        ("-- of that SGLang's post_load_weights", post_load["weightstream"], None),
        ("weightstream host load of the rank's layout (`load --tp-size 2 --ep-size 2`)", raw_s, raw_faults),
    ]
    print(f"checkpoint {checkpoint_bytes / 2**30:.2f} GiB, rank 0 of tp 2 with EP reads "
          f"{rank_bytes / 2**30:.2f} GiB; medians of {args.rounds} rounds")
    print("| contender | seconds | rank GB/s | minor faults |\n| --- | ---: | ---: | ---: |")
    for name, seconds, counted in rows:
        fault_text = "" if counted is None else f"{statistics.median(counted):,.0f}"
        print(f"| {name} | {seconds:.3f} | {rank_bytes / seconds / 1e9:.2f} | {fault_text} |")
    # Rounds whose model's pages were mostly never touched (the allocator handed out fresh
    # pages: at least half the rank's 4 KiB pages faulted in during the step) and the others
    # (pages a collected model left behind), as vllm_moe_bench.py reports its fresh-page rounds.
    fresh_faults = rank_bytes // resource.getpagesize() // 2
    for label, fresh in (("into mostly fresh pages", True), ("into mostly touched pages", False)):
        picked = [load for load, faulted in zip(measured["ours_load"], faults["weightstream"])
                  if (faulted >= fresh_faults) == fresh]
        if picked:
            print(f"weightstream's load {label}: median {statistics.median(picked):.3f} s of {len(picked)} rounds")
    print(f"\nweightstream / SGLang default: {sglang_s / ours_s:.2f}x (target >= 2x); "
          f"weightstream in SGLang / its own host load: {raw_s / ours_s:.2f}x (target >= 0.9x); "
          f"weightstream's load alone / its own host load: {raw_s / ours_load_s:.2f}x")
    print(json.dumps({"sglang": measured["times"]["sglang"], "weightstream": measured["times"]["weightstream"],
                      "weightstream_load": measured["ours_load"], "raw": [r["seconds"] for r in raw],
                      "post_load_weights": measured["post_load"], "faults": faults, "raw_faults": raw_faults,
                      "rank_bytes": rank_bytes, "checkpoint_bytes": checkpoint_bytes}))


if __name__ == "__main__":
    main()

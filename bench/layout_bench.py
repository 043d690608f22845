#!/usr/bin/env python3
"""Engine-layout loads against the raw load on a GPU (issue 16), one run.

Writes a checkpoint shaped like Llama-3-8B in BF16 (16.06 GB) with the `safetensors`
package (random values made on the GPU, `save_file` in shards, an index and a config.json),
reads it once so the page cache is warm, then times, each in a fresh process, median of
--repeats:
  - `weightstream load --raw` (the identity layout),
  - the engine layout at tp 1, tp 2 rank 1 and tp 8 rank 3 (`--tp-size T --tp-rank R`),
  - a reload in 8 shuffled batches (`audit --batches 8 --order shuffled`, its reload_seconds),
  - Python `LoadSession.load_checkpoint` at tp 1 and tp 2 rank 1,
and the pinned host-to-device copy rate in the same run. Prints a markdown table with the
targets of issue 16: tp 1 >= 90% of raw GB/s; tp 2 and tp 8 time <= 1.25 x raw time x
(bytes the rank reads / checkpoint bytes); reload >= 80% of the raw rate.

Usage: bench/layout_bench.py --cli build-gpu/weightstream --out OUT [--dir DIR] [--repeats 3]
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
LLAMA3_8B = {"hidden": 4096, "intermediate": 14336, "layers": 32, "heads": 32, "kv_heads": 8, "vocab": 128256}


def log(*args):
    print(*args, flush=True)


def write_checkpoint(directory, shard_bytes=5 * 10**9):
    import torch
    from safetensors.torch import save_file

    c = LLAMA3_8B
    head_dim = c["hidden"] // c["heads"]
    shapes = [("model.embed_tokens.weight", [c["vocab"], c["hidden"]])]
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", [c["hidden"]]),
                   (p + "self_attn.q_proj.weight", [c["heads"] * head_dim, c["hidden"]]),
                   (p + "self_attn.k_proj.weight", [c["kv_heads"] * head_dim, c["hidden"]]),
                   (p + "self_attn.v_proj.weight", [c["kv_heads"] * head_dim, c["hidden"]]),
                   (p + "self_attn.o_proj.weight", [c["hidden"], c["heads"] * head_dim]),
                   (p + "post_attention_layernorm.weight", [c["hidden"]]),
                   (p + "mlp.gate_proj.weight", [c["intermediate"], c["hidden"]]),
                   (p + "mlp.up_proj.weight", [c["intermediate"], c["hidden"]]),
                   (p + "mlp.down_proj.weight", [c["hidden"], c["intermediate"]])]
    shapes += [("model.norm.weight", [c["hidden"]]), ("lm_head.weight", [c["vocab"], c["hidden"]])]
    os.makedirs(directory, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, shape in shapes:
        tensor = torch.randn(shape, dtype=torch.bfloat16, device="cuda:0").cpu()
        current[name] = tensor
        size += tensor.numel() * 2
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file
            total += tensor.numel() * 2
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c["hidden"],
              "intermediate_size": c["intermediate"], "num_hidden_layers": c["layers"],
              "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"], "vocab_size": c["vocab"],
              "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "max_position_embeddings": 8192}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    del shards
    os.sync()
    return total


def warm(directory):
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            while f.read(64 << 20):
                pass


def pinned_copy_rate():
    """The pinned host-to-device rate, measured as gpu_bench.py measures it."""
    import torch
    from gpu_bench import pinned_copy_rate as copy_rates  # bench/ is this script's folder

    return copy_rates(torch)["pinned"]


def run_json(command, env=None):
    process = subprocess.run(command, capture_output=True, text=True, env=env)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}): {process.stderr.strip()[-2000:]}")
    return json.loads(process.stdout[process.stdout.index("{"):])  # one JSON object, perhaps over several lines


PYTHON_LOAD = r"""
import json, sys, time, weightstream
uri, tp, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
checkpoint = weightstream.open(uri)
layout = weightstream.model_layout(checkpoint, tp_size=tp, tp_rank=rank, device="cuda:0")
session = weightstream.LoadSession(layout)
start = time.perf_counter()
session.begin("cold")
stats = session.load_checkpoint(checkpoint)
session.finish()
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "bytes": stats["bytes"], "bytes_read": stats.get("bytes_read", stats["bytes"])}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli", required=True)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--dir", default="/tmp/ws-layout-bench")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--python-site", default=None, help="PYTHONPATH holding the built package (Python rows)")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    cli = os.path.abspath(args.cli)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    results = {"rows": rows}
    shutil.rmtree(args.dir, ignore_errors=True)
    try:
        start = time.perf_counter()
        total = write_checkpoint(args.dir)
        log(f"checkpoint: {total / GB:.2f} GB by safetensors.save_file in {time.perf_counter() - start:.0f} s")
        results["checkpoint_bytes"] = total
        warm(args.dir)
        results["pinned_h2d_gbps"] = pinned_copy_rate()
        log(f"pinned H2D {results['pinned_h2d_gbps']:.1f} GB/s")

        def measure(name, command, seconds_key="seconds", bytes_key="bytes", env=None):
            runs = [run_json(command, env) for _ in range(args.repeats)]
            seconds = statistics.median(r[seconds_key] for r in runs)
            payload = runs[0].get(bytes_key) or 0
            read = runs[0].get("bytes_read") or payload
            row = {"name": name, "seconds": seconds, "bytes": payload, "bytes_read": read,
                   "all_seconds": [r[seconds_key] for r in runs]}
            rows.append(row)
            log(f"{name:42s} {seconds:7.3f} s  {payload / GB:6.2f} GB  read {read / GB:6.2f} GB  "
                f"({payload / seconds / GB:5.1f} GB/s)  runs {row['all_seconds']}")
            return row

        base = [cli, "load", args.dir, "--device", "cuda:0", "--json", "--no-progress"]
        raw = measure("load --raw", base + ["--raw"])
        measure("load --raw --gpu-path mapped", base + ["--raw", "--gpu-path", "mapped"])
        tp1 = measure("layout tp 1", base + ["--tp-size", "1", "--tp-rank", "0"], bytes_key="parameter_bytes")
        tp2 = measure("layout tp 2 rank 1", base + ["--tp-size", "2", "--tp-rank", "1"], bytes_key="parameter_bytes")
        tp8 = measure("layout tp 8 rank 3", base + ["--tp-size", "8", "--tp-rank", "3"], bytes_key="parameter_bytes")
        reload = measure("reload, 8 shuffled batches (audit)",
                         [cli, "audit", args.dir, "--device", "cuda:0", "--json", "--no-progress", "--batches", "8",
                          "--order", "shuffled"], seconds_key="reload_seconds", bytes_key="reload_bytes")
        python_rows = []
        if args.python_site:
            env = dict(os.environ, PYTHONPATH=args.python_site)
            for tp, rank in ((1, 0), (2, 1)):
                python_rows.append(measure(f"Python load_checkpoint tp {tp} rank {rank}",
                                           [sys.executable, "-c", PYTHON_LOAD, args.dir, str(tp), str(rank)], env=env))
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)

    raw_rate = raw["bytes"] / raw["seconds"]
    lines = [f"Checkpoint {results['checkpoint_bytes'] / GB:.2f} GB (Llama-3-8B shape, BF16, safetensors.save_file), "
             f"warm page cache; pinned host-to-device copy {results['pinned_h2d_gbps']:.1f} GB/s in the same run; "
             f"median of {args.repeats} runs, each a fresh process.", "",
             "| load | seconds | GB of parameters | GB read | GB/s | vs raw | target |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        rate = row["bytes"] / row["seconds"] if row["seconds"] else 0
        share = row["bytes_read"] / results["checkpoint_bytes"]
        bound = 1.25 * raw["seconds"] * share
        if row["name"].startswith("layout tp 1") or row["name"].startswith("Python load_checkpoint tp 1"):
            target = f"GB/s >= 90% of raw: {'met' if rate >= 0.9 * raw_rate else 'MISSED'}"
        elif "tp 2" in row["name"] or "tp 8" in row["name"]:
            target = f"time <= {bound:.3f} s: {'met' if row['seconds'] <= bound else 'MISSED'}"
        elif row["name"].startswith("reload"):
            target = f"GB/s >= 80% of raw: {'met' if rate >= 0.8 * raw_rate else 'MISSED'}"
        else:
            target = ""
        lines.append(f"| {row['name']} | {row['seconds']:.3f} | {row['bytes'] / GB:.2f} | {row['bytes_read'] / GB:.2f} | "
                     f"{rate / GB:.1f} | {rate / raw_rate:.2f} | {target} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "layout_bench.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "layout_bench.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    sys.exit(main())

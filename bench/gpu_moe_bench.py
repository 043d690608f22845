#!/usr/bin/env python3
"""FP8 block-scaled MoE into CUDA parameters (issue 34): bound loads at tp 2 and tp 2 with
EP, and a BF16 update quantized into the FP8 parameters in place over CUDA IPC.

vLLM does not install on the GPU machine, so the engine is a torch module that carries vLLM
0.33's parameter names, dtypes and shapes (`experts.routed_experts.w13_weight`, FP8
`weight` + `weight_scale_inv`, fused `qkv_proj` and `gate_up_proj`), built from the layout and
bound by the same code the vLLM loader binds with (weightstream.vllm._model.bind_model). Its
parameters are filled with junk first, as an engine's are before loading.

Rows, all in one run and one process (the CLI runs as subprocesses):
  raw       `weightstream load --raw --device D` of the whole FP8 checkpoint, warm: the rate
            the bound loads are held against (goal: each rank >= 85% of it)
  tp2 r0/r1 a bound tp-2 rank (experts divided by TP), cold LoadSession.load_checkpoint
  ep r0/r1  a bound tp-2 rank with EP 2 (whole experts, half of them per rank)
  tp2 r0 / ep r0 host  the same ranks bound into host memory: the reads and host copies
            without the device, which tells a slow rank's bound apart
  check     every bound parameter of the tp-2 rank 0 and the EP rank 0 equals a host load of
            the same rank
  update    checkpoint B in BF16 pushed by `weightstream send --via cuda-ipc` into the bound EP
            rank 0: data_ptr() unchanged, a CUDA graph captured before the update reads the new
            values, every parameter equals a host load of B into the same FP8 layout, the
            experts' codes and scales equal a torch quantization of B (128 x 128 blocks,
            amax / 448), and the update rate against a device-to-device copy of the same bytes;
            the BF16 is quantized on the GPU, in place (src/device/quantize_kernels.cu)
  update_local  the same update in process: B read from the page cache by LoadSession
            (update mode) into the bound EP rank 0, staged on the GPU and quantized there,
            without a transport; timed as the bound loads are, equal to a host load of B
  audit     `weightstream audit FP8 --reload BF16 --via cuda-ipc --ep-size 2` (compared all,
            mismatched 0, address_changes 0, hook once)

Usage: bench/gpu_moe_bench.py --cli build-gpu/weightstream --out OUT [--size 8GiB] [--hidden 2048]
       [--dir /tmp/ws-moe] [--device cuda:0] [--transport cuda-ipc] [--repeats 3] [--keep]
Writes OUT/gpu_moe.md and OUT/gpu_moe.json; exits 1 when a check fails.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import weightstream
from weightstream.vllm._model import Parallel, bind_model, model_candidates

from bench_process import log, run

GB = 1e9
TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}


def synchronize(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def synth_pair(cli, directory, size, hidden):
    """Checkpoint A: FP8 block-scaled qwen3_moe of about `size`; B: the same model in BF16,
    another seed (what a trainer pushes). Returns (A, B, config)."""
    fp8, bf16 = os.path.join(directory, "fp8"), os.path.join(directory, "bf16")
    if not os.path.exists(os.path.join(fp8, "config.json")):
        run([cli, "synth", fp8, "--arch", "qwen3_moe", "--quantize", "fp8-block", "--size", size, "--hidden",
             str(hidden), "--experts", "16", "--shards", "8", "--seed", "1"])
    with open(os.path.join(fp8, "config.json")) as file:
        config = json.load(file)
    if not os.path.exists(os.path.join(bf16, "config.json")):
        run([cli, "synth", bf16, "--arch", "qwen3_moe", "--block-aligned", "--layers", str(config["num_hidden_layers"]),
             "--hidden", str(config["hidden_size"]), "--experts", str(config["num_experts"]), "--shards", "8",
             "--seed", "2"])
    with open(os.path.join(bf16, "config.json")) as file:
        other = json.load(file)
    for key in ("num_hidden_layers", "hidden_size", "moe_intermediate_size", "intermediate_size", "head_dim",
                "num_attention_heads", "num_key_value_heads", "num_experts", "vocab_size"):
        assert other[key] == config[key], f"B's {key} {other[key]} differs from A's {config[key]}"
    return fp8, bf16, config


def vllm_like_module(config, parallel, device):
    """A torch module with vLLM 0.33's names, dtypes and shapes for this rank, junk-filled."""
    layout = weightstream.model_layout(config, tp_size=parallel.tp_size, tp_rank=parallel.tp_rank,
                                       ep_size=parallel.ep_size, ep_rank=parallel.ep_rank, dtype="BF16")
    root = torch.nn.Module()
    for name in layout.parameter_names:
        info = layout.parameter_info(name)
        target = model_candidates(name, "target", config["model_type"])[0]
        *path, leaf = target.split(".")
        node = root
        for part in path:
            if part not in node._modules:
                node.add_module(part, torch.nn.Module())
            node = node._modules[part]
        data = torch.empty(info["shape"], dtype=TORCH_DTYPES[info["dtype"]], device=device)
        data.view(torch.uint8).fill_(0x3B)  # junk, never zeros
        node.register_parameter(leaf, torch.nn.Parameter(data, requires_grad=False))
    return root


def bound_rank(config, parallel, device):
    model = vllm_like_module(config, parallel, device)
    bound = bind_model(model, config, "target", torch.bfloat16, parallel)
    assert not bound.unbound, f"parameters left unbound: {list(bound.unbound.items())[:3]}"
    assert bound.layout.allocated_bytes == 0, "the layout allocated memory of its own"
    return model, bound


def timed_load(bound, uri, device, mode="cold"):
    session = weightstream.LoadSession(bound.layout)
    synchronize(device)
    start = time.perf_counter()
    session.begin(mode)
    counters = session.load_checkpoint(uri)
    session.finish()
    synchronize(device)
    return time.perf_counter() - start, counters


def host_reference(config, parallel, uri):
    """This rank's parameters as a host load writes them (by layout name): the oracle."""
    layout = weightstream.model_layout(config, tp_size=parallel.tp_size, tp_rank=parallel.tp_rank,
                                       ep_size=parallel.ep_size, ep_rank=parallel.ep_rank, dtype="BF16", device="cpu")
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(uri)
    session.finish()
    return {name: torch.from_dlpack(layout.tensor(name)).view(torch.uint8).clone() for name in layout.parameter_names}


def differing(model, bound, reference):
    tensors = dict(model.named_parameters())
    bad = []
    for layout_name, target in bound.bound.items():
        mine = tensors[target].detach().view(torch.uint8).cpu().reshape(-1)
        if not torch.equal(mine, reference[layout_name].reshape(-1)):
            bad.append(target)
    return bad


def torch_block_quantize(weight, block=128):
    """Codes and scales of a 2-D float weight by 128 x 128 blocks, amax / 448, as FP8
    block-scaled checkpoints are made (the oracle for the in-place quantization)."""
    rows, columns = weight.shape
    values = weight.float()
    block_rows, block_columns = -(-rows // block), -(-columns // block)
    scales = torch.empty(block_rows, block_columns, dtype=torch.float32, device=weight.device)
    codes = torch.empty(rows, columns, dtype=torch.float8_e4m3fn, device=weight.device)
    for i in range(block_rows):
        for j in range(block_columns):
            tile = values[i * block:(i + 1) * block, j * block:(j + 1) * block]
            amax = tile.abs().max()
            scale = amax / 448.0 if amax > 0 else torch.ones((), device=weight.device)
            scales[i, j] = scale
            codes[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale).to(torch.float8_e4m3fn)
    return codes, scales


def median_row(times, counters):
    seconds = statistics.median(times)
    return {"seconds": seconds, "runs": times, "bytes_read": counters.get("bytes_read"),
            "gbps": counters.get("bytes_read", 0) / seconds / GB}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dir", default="/tmp/ws-moe")
    parser.add_argument("--size", default="8GiB")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden_size (layers grow to reach --size)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--transport", default="cuda-ipc")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.dir, exist_ok=True)
    device = args.device
    results = {"device": device, "size": args.size, "rows": {}, "checks": {}}
    rows, checks = results["rows"], results["checks"]

    def save():
        with open(os.path.join(args.out, "gpu_moe.json"), "w") as file:
            json.dump(results, file, indent=1)
        with open(os.path.join(args.out, "gpu_moe.md"), "w") as file:
            file.write(report(results))

    start = time.perf_counter()
    fp8, bf16, config = synth_pair(args.cli, args.dir, args.size, args.hidden)
    log(f"checkpoints: {fp8} (FP8), {bf16} (BF16), {config['num_hidden_layers']} layers, hidden "
        f"{config['hidden_size']}, {config['num_experts']} experts ({time.perf_counter() - start:.0f} s)")
    for path in (fp8, bf16):  # warm the page cache: every row reads from memory
        subprocess.run(["cat"] + [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")],
                       stdout=subprocess.DEVNULL, check=True)

    # raw: the whole checkpoint's bytes onto the device, the rate the ranks are held against
    raw = []
    for _ in range(args.repeats):
        out = json.loads(run([args.cli, "load", fp8, "--raw", "--device", device, "--json", "--no-progress"]).stdout)
        raw.append(out["seconds"])
    rows["raw"] = {"seconds": statistics.median(raw), "runs": raw, "bytes_read": out["bytes"],
                   "gbps": out["bytes"] / statistics.median(raw) / GB}
    results["checkpoint_bytes"] = out["bytes"]
    log(f"raw: {rows['raw']['gbps']:.2f} GB/s ({out['bytes'] / GB:.2f} GB, runs {raw})")
    save()

    kept = {}
    for key, parallel in (("tp2_r0", Parallel(2, 0)), ("tp2_r1", Parallel(2, 1)),
                          ("ep_r0", Parallel(2, 0, 2, 0)), ("ep_r1", Parallel(2, 1, 2, 1))):
        model, bound = bound_rank(config, parallel, device)
        times = []
        for _ in range(args.repeats):
            seconds, counters = timed_load(bound, fp8, device)
            times.append(seconds)
        row = median_row(times, counters)
        row["parameter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        row["of_raw"] = row["gbps"] / rows["raw"]["gbps"]
        rows[key] = row
        log(f"{key}: {row['seconds']:.3f} s, {row['bytes_read'] / GB:.2f} GB read, {row['gbps']:.2f} GB/s = "
            f"{row['of_raw']:.0%} of raw (runs {times})")
        if key == "tp2_r0":  # its experts' w2 are column slices: narrow rows onto the device
            checks["tp2_r0 equals a host load of A"] = not differing(model, bound, host_reference(config, parallel, fp8))
        if key == "ep_r0":
            kept = {"model": model, "bound": bound, "parallel": parallel}
        else:
            del model, bound
        save()

    # The same ranks bound into host memory: what the reads and the host copies cost without
    # the device, which tells a slow rank's bound apart (the strided reads or the copies into
    # the device)
    if device != "cpu":
        for key, parallel in (("tp2_r0_host", Parallel(2, 0)), ("ep_r0_host", Parallel(2, 0, 2, 0))):
            host_model, host_bound = bound_rank(config, parallel, "cpu")
            times = []
            for _ in range(args.repeats):
                seconds, counters = timed_load(host_bound, fp8, "cpu")
                times.append(seconds)
            row = median_row(times, counters)
            row["of_raw"] = row["gbps"] / rows["raw"]["gbps"]
            rows[key] = row
            log(f"{key}: {row['seconds']:.3f} s, {row['gbps']:.2f} GB/s into host memory (runs {times})")
            del host_model, host_bound
            save()

    model, bound, parallel = kept["model"], kept["bound"], kept["parallel"]
    bad = differing(model, bound, host_reference(config, parallel, fp8))
    checks["ep_r0 equals a host load of A"] = not bad
    log(f"check ep r0 against a host load: {'equal' if not bad else f'{len(bad)} differ: {bad[:3]}'}")
    save()

    # update: B in BF16, quantized into the FP8 parameters in place
    tensors = dict(model.named_parameters())
    pointers = {name: tensor.data_ptr() for name, tensor in tensors.items()}
    watched = [name for name in tensors if name.endswith("routed_experts.w2_weight")][:1] + \
        [name for name in tensors if name.endswith("routed_experts.w2_weight_scale_inv")][:1] + \
        [name for name in tensors if name.endswith("qkv_proj.weight")][:1]
    seen = {name: torch.empty_like(tensors[name]) for name in watched}
    graph = None
    if device.startswith("cuda"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for name in watched:
                seen[name].copy_(tensors[name])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for name in watched:
                seen[name].copy_(tensors[name])
    hook_runs = []
    bound.layout.add_hook("count", lambda: hook_runs.append(1))
    receiver = weightstream.UpdateReceiver(bound.layout, transport=args.transport, token="t0ken", device=device)
    reports = []
    thread = threading.Thread(target=lambda: reports.append(receiver.receive(accept_timeout=300.0)))
    thread.start()
    start = time.perf_counter()
    sent = run([args.cli, "send", bf16, "--to", receiver.address, "--via", args.transport, "--bucket-size", "1GiB",
                "--device", device, "--token-stdin", "--json"], input="t0ken\n", timeout=600)
    thread.join(timeout=600)
    synchronize(device)
    wall = time.perf_counter() - start
    assert reports, "the receiver reported nothing"
    sender = json.loads(sent.stdout)
    landed = sum(t.numel() * t.element_size() for t in tensors.values())
    copy_seconds = d2d_copy_seconds(landed, device)
    rows["update"] = {"seconds": sender["seconds"], "wall_seconds": wall, "bytes_sent": sender["bytes"],
                      "bytes_landed": landed, "receiver": {k: v for k, v in reports[0].items()
                                                           if isinstance(v, (int, float, str))},
                      "d2d_copy_seconds": copy_seconds}
    log(f"update: {sender['bytes'] / GB:.2f} GB BF16 sent in {sender['seconds']:.3f} s (wall {wall:.3f} s), "
        f"{landed / GB:.2f} GB of FP8 parameters and scales landed; a device-to-device copy of those bytes "
        f"{copy_seconds * 1e3:.2f} ms")
    checks["update: data_ptr unchanged"] = {n: t.data_ptr() for n, t in tensors.items()} == pointers
    reference = host_reference(config, parallel, bf16)
    bad = differing(model, bound, reference)
    checks["update: every parameter equals a host load of B"] = not bad
    if graph is not None:
        graph.replay()
        synchronize(device)
    target_to_layout = {target: name for name, target in bound.bound.items()}
    if graph is not None:  # a CUDA graph exists on CUDA only
        checks["update: the CUDA graph captured before reads the new values"] = all(
            torch.equal(seen[name].view(torch.uint8).cpu().reshape(-1), reference[target_to_layout[name]].reshape(-1))
            for name in watched)
    checks["update: the model hook ran once"] = hook_runs == [1]
    checks["update: experts equal a torch quantization of B"] = experts_match_torch(tensors, bf16, config, parallel,
                                                                                   device)
    for text, ok in checks.items():
        log(f"{text}: {'yes' if ok else 'NO'}")
    receiver = None
    save()

    # update_local: the quantizing path alone, without the transport's sender and buckets
    times = []
    for _ in range(args.repeats):
        seconds, counters = timed_load(bound, bf16, device, mode="update")
        times.append(seconds)
    row = median_row(times, counters)
    row["bytes_landed"] = landed
    row["d2d_copy_seconds"] = copy_seconds
    rows["update_local"] = row
    log(f"update_local: {row['seconds']:.3f} s for {row['bytes_read'] / GB:.2f} GB of BF16 read, "
        f"{row['gbps']:.2f} GB/s (runs {times}); a device-to-device copy of the landed bytes "
        f"{copy_seconds * 1e3:.2f} ms")
    bad = differing(model, bound, reference)
    checks["update_local: every parameter equals a host load of B"] = not bad
    checks["update_local: data_ptr unchanged"] = {n: t.data_ptr() for n, t in tensors.items()} == pointers
    log(f"update_local check: {'equal' if not bad else f'{len(bad)} differ: {bad[:3]}'}")
    save()

    # audit: the CLI's own audit of the BF16 -> FP8 update over the transport
    audit = subprocess.run([args.cli, "audit", fp8, "--reload", bf16, "--via", args.transport, "--device", device,
                            "--tp-size", "2", "--tp-rank", "0", "--ep-size", "2", "--ep-rank", "0", "--json",
                            "--no-progress"], capture_output=True, text=True, input="", timeout=600)
    try:
        audited = json.loads(audit.stdout)
    except json.JSONDecodeError:
        audited = {"error": audit.stderr.strip()[-400:]}
    rows["audit"] = audited
    checks["audit clean"] = audit.returncode == 0 and audited.get("mismatched") == 0 and \
        audited.get("address_changes") == 0
    log(f"audit: rc {audit.returncode} {json.dumps(audited)[:400]}")
    save()
    if not args.keep:
        subprocess.run(["rm", "-rf", fp8, bf16])
    print(report(results))
    return 0 if all(checks.values()) else 1


def d2d_copy_seconds(nbytes, device):
    if not device.startswith("cuda"):
        return float("nan")
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    destination = torch.empty_like(source)
    destination.copy_(source)
    times = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        destination.copy_(source)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3)
    del source, destination
    torch.cuda.empty_cache()
    return statistics.median(times)


def experts_match_torch(tensors, bf16, config, parallel, device):
    """EP rank r holds experts [r E/ep, (r+1) E/ep) whole: each w2 (down_proj) must be the
    torch quantization of B's down_proj of that expert, codes and scales, in layer 1 (the
    first MoE layer: mlp_only_layers [0])."""
    experts = config["num_experts"] // parallel.ep_size
    first = parallel.ep_rank * experts
    checkpoint = weightstream.open(bf16)
    layer = next(i for i in range(config["num_hidden_layers"]) if i not in config.get("mlp_only_layers", []))
    prefix = f"model.layers.{layer}.mlp.experts"
    codes = tensors[f"{prefix}.routed_experts.w2_weight"]
    scales = tensors[f"{prefix}.routed_experts.w2_weight_scale_inv"]
    for local in (0, experts - 1):
        name = f"{prefix}.{first + local}.down_proj.weight"
        weight = next(iter(checkpoint.stream(device=device, framework="torch", names=[name])))[1].clone()
        # The oracle runs on the CPU: on CUDA torch divides by a CPU scalar as a multiplication
        # by its reciprocal, so amax / 448.0 differs in the last bit for some amax and so can
        # the codes (src/device/e4m3_rule.hpp); torch on the CPU divides, as the rule does.
        want_codes, want_scales = torch_block_quantize(weight.cpu())
        if not (torch.equal(codes[local].cpu().view(torch.uint8), want_codes.view(torch.uint8)) and
                torch.equal(scales[local].cpu(), want_scales)):
            log(f"expert {first + local} of layer {layer}: differs from the torch quantization")
            return False
    return True


def report(results):
    rows, checks = results["rows"], results["checks"]
    lines = [f"FP8 block-scaled qwen3_moe ({results.get('checkpoint_bytes', 0) / GB:.2f} GB) on {results['device']}",
             "", "| row | median s | runs (s) | bytes read (GB) | GB/s | of raw |", "| --- | ---: | --- | ---: | ---: | ---: |"]
    for key in ("raw", "tp2_r0", "tp2_r1", "ep_r0", "ep_r1", "tp2_r0_host", "ep_r0_host"):
        if key in rows:
            row = rows[key]
            lines.append(f"| {key} | {row['seconds']:.3f} | {', '.join(f'{t:.3f}' for t in row['runs'])} | "
                         f"{row['bytes_read'] / GB:.2f} | {row['gbps']:.2f} | "
                         f"{row.get('of_raw', 1.0):.0%} |")
    ranks = [rows[k]["of_raw"] for k in ("tp2_r0", "tp2_r1", "ep_r0", "ep_r1") if k in rows]
    if ranks:
        lines.append(f"\nGoal, each bound rank >= 85% of raw: {'met' if min(ranks) >= 0.85 else 'MISSED'} "
                     f"(lowest {min(ranks):.0%})")
    if "update" in rows:
        u = rows["update"]
        lines.append(f"\nUpdate: {u['bytes_sent'] / GB:.2f} GB of BF16 sent, {u['bytes_landed'] / GB:.2f} GB landed as "
                     f"FP8 codes and scales in {u['seconds']:.3f} s (sender), {u['wall_seconds']:.3f} s wall; a "
                     f"device-to-device copy of the landed bytes takes {u['d2d_copy_seconds'] * 1e3:.2f} ms "
                     f"({u['d2d_copy_seconds'] / u['seconds']:.1%} of the update)")
    if "update_local" in rows:
        u = rows["update_local"]
        lines.append(f"\nUpdate in process (LoadSession, no transport): {u['bytes_read'] / GB:.2f} GB of BF16 read and "
                     f"quantized on the device in {u['seconds']:.3f} s ({u['gbps']:.2f} GB/s; runs "
                     f"{', '.join(f'{t:.3f}' for t in u['runs'])}); of raw "
                     f"{u['gbps'] / rows['raw']['gbps']:.0%}; a device-to-device copy of the "
                     f"{u['bytes_landed'] / GB:.2f} GB landed takes {u['d2d_copy_seconds'] * 1e3:.2f} ms")
    lines.append("")
    lines += [f"- {text}: {'yes' if ok else 'NO'}" for text, ok in checks.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

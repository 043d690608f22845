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
  update_gpu  the trainer's push: checkpoint B loaded onto the GPU first by a sender process
            (`--role gpu-sender`, weightstream.load into one arena, as a trainer's flat buffer),
            then pushed with weightstream.UpdateSender from GPU memory over cuda-ipc (read in place
            by the receiver) into the bound EP rank 0, reloaded with A before, `--updates` times
            over one connection: the transport's rate without the sender's reads, held against a
            device-to-device copy of the BF16 bytes the rank takes (goal: >= 0.25 of it), with the
            checks of `update`
  update_local  the same update in process: B read from the page cache by LoadSession
            (update mode) into the bound EP rank 0, staged on the GPU and quantized there,
            without a transport; timed as the bound loads are, equal to a host load of B
  audit     `weightstream audit FP8 --reload BF16 --via cuda-ipc --ep-size 2` (compared all,
            mismatched 0, address_changes 0, hook once)

Usage: bench/gpu_moe_bench.py --cli build-gpu/weightstream --out OUT [--size 8GiB] [--hidden 2048]
       [--dir /tmp/ws-moe] [--device cuda:0] [--transport cuda-ipc] [--repeats 3] [--updates 3] [--keep]
       [--rows raw,tp2,ep,host,update,update_gpu,update_local,audit] [--skip ROWS]
--rows picks the rows that run (default all; tp2 and ep are the r0 and r1 rows and their checks,
host the *_host rows); --skip leaves some out. The update rows bind and load the EP rank 0 even
when ep is not among them.
Writes OUT/gpu_moe.md and OUT/gpu_moe.json; exits 1 when a check fails.
(--role gpu-sender is the update_gpu row's sender process, started by the bench itself.)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
    return host_load(config, parallel, uri)[0]


def host_load(config, parallel, uri):
    """host_reference's parameters, and the counters of that load (bytes_read, bytes_applied:
    the bytes of the checkpoint this rank takes)."""
    layout = weightstream.model_layout(config, tp_size=parallel.tp_size, tp_rank=parallel.tp_rank,
                                       ep_size=parallel.ep_size, ep_rank=parallel.ep_rank, dtype="BF16", device="cpu")
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    counters = dict(session.load_checkpoint(uri))
    session.finish()
    counters.update({k: v for k, v in dict(session.counters).items() if k not in counters})
    return ({name: torch.from_dlpack(layout.tensor(name)).view(torch.uint8).clone()
             for name in layout.parameter_names}, counters)


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


ROWS = ("raw", "tp2", "ep", "host", "update", "update_gpu", "update_local", "audit")
TOKEN = "t0ken"


def selected_rows(rows, skip):
    wanted = [row.strip() for row in rows.split(",") if row.strip()] if rows else list(ROWS)
    unwanted = [row.strip() for row in skip.split(",") if row.strip()] if skip else []
    unknown = sorted(set(wanted + unwanted) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows/--skip: unknown rows {', '.join(unknown)} (rows: {', '.join(ROWS)})")
    return {row for row in wanted if row not in unwanted}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli")
    parser.add_argument("--out")
    parser.add_argument("--dir", default="/tmp/ws-moe")
    parser.add_argument("--size", default="8GiB")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden_size (layers grow to reach --size)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--transport", default="cuda-ipc")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--updates", type=int, default=3, help="update_gpu's updates over one connection")
    parser.add_argument("--rows", default="", help=f"comma-separated rows to run (default all: {','.join(ROWS)})")
    parser.add_argument("--skip", default="", help="comma-separated rows to leave out")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--role", choices=("bench", "gpu-sender"), default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", help=argparse.SUPPRESS)
    parser.add_argument("--to", help=argparse.SUPPRESS)
    parser.add_argument("--bucket-bytes", type=int, default=1 << 30, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "gpu-sender":
        return gpu_sender(args)
    if not args.cli or not args.out:
        parser.error("--cli and --out are required")
    wanted = selected_rows(args.rows, args.skip)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.dir, exist_ok=True)
    device = args.device
    results = {"device": device, "size": args.size, "rows_run": [row for row in ROWS if row in wanted], "rows": {},
               "checks": {}}
    rows, checks = results["rows"], results["checks"]

    def save():
        with open(os.path.join(args.out, "gpu_moe.json"), "w") as file:
            json.dump(results, file, indent=1)
        with open(os.path.join(args.out, "gpu_moe.md"), "w") as file:
            file.write(report(results))

    start = time.perf_counter()
    fp8, bf16, config = synth_pair(args.cli, args.dir, args.size, args.hidden)
    log(f"checkpoints: {fp8} (FP8), {bf16} (BF16), {config['num_hidden_layers']} layers, hidden "
        f"{config['hidden_size']}, {config['num_experts']} experts ({time.perf_counter() - start:.0f} s); rows "
        f"{', '.join(results['rows_run'])}")
    for path in (fp8, bf16):  # warm the page cache: every row reads from memory
        subprocess.run(["cat"] + [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")],
                       stdout=subprocess.DEVNULL, check=True)
    results["checkpoint_bytes"] = sum(info.bytes for info in weightstream.open(fp8).tensors)

    # raw: the whole checkpoint's bytes onto the device, the rate the ranks are held against
    if "raw" in wanted:
        raw = []
        for _ in range(args.repeats):
            out = json.loads(run([args.cli, "load", fp8, "--raw", "--device", device, "--json",
                                  "--no-progress"]).stdout)
            raw.append(out["seconds"])
        rows["raw"] = {"seconds": statistics.median(raw), "runs": raw, "bytes_read": out["bytes"],
                       "gbps": out["bytes"] / statistics.median(raw) / GB}
        results["checkpoint_bytes"] = out["bytes"]
        log(f"raw: {rows['raw']['gbps']:.2f} GB/s ({out['bytes'] / GB:.2f} GB, runs {raw})")
        save()

    def of_raw(row):
        if "raw" in rows:
            row["of_raw"] = row["gbps"] / rows["raw"]["gbps"]
        return f" = {row['of_raw']:.0%} of raw" if "of_raw" in row else ""

    kept = {}
    for key, parallel in (("tp2_r0", Parallel(2, 0)), ("tp2_r1", Parallel(2, 1)),
                          ("ep_r0", Parallel(2, 0, 2, 0)), ("ep_r1", Parallel(2, 1, 2, 1))):
        if key.split("_")[0] not in wanted:
            continue
        model, bound = bound_rank(config, parallel, device)
        times = []
        for _ in range(args.repeats):
            seconds, counters = timed_load(bound, fp8, device)
            times.append(seconds)
        row = median_row(times, counters)
        row["parameter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        rows[key] = row
        log(f"{key}: {row['seconds']:.3f} s, {row['bytes_read'] / GB:.2f} GB read, {row['gbps']:.2f} GB/s"
            f"{of_raw(row)} (runs {times})")
        if key == "tp2_r0":  # its experts' w2 are column slices: narrow rows onto the device
            checks["tp2_r0 equals a host load of A"] = not differing(model, bound, host_reference(config, parallel, fp8))
        if key == "ep_r0":
            kept = {"model": model, "bound": bound, "parallel": parallel}
            bad = differing(model, bound, host_reference(config, parallel, fp8))
            checks["ep_r0 equals a host load of A"] = not bad
            log(f"check ep r0 against a host load: {'equal' if not bad else f'{len(bad)} differ: {bad[:3]}'}")
        else:
            del model, bound
        save()

    # The same ranks bound into host memory: what the reads and the host copies cost without
    # the device, which tells a slow rank's bound apart (the strided reads or the copies into
    # the device)
    if device != "cpu" and "host" in wanted:
        for key, parallel in (("tp2_r0_host", Parallel(2, 0)), ("ep_r0_host", Parallel(2, 0, 2, 0))):
            host_model, host_bound = bound_rank(config, parallel, "cpu")
            times = []
            for _ in range(args.repeats):
                seconds, counters = timed_load(host_bound, fp8, "cpu")
                times.append(seconds)
            row = median_row(times, counters)
            rows[key] = row
            log(f"{key}: {row['seconds']:.3f} s, {row['gbps']:.2f} GB/s into host memory{of_raw(row)} (runs {times})")
            del host_model, host_bound
            save()

    if wanted & {"update", "update_gpu", "update_local"}:
        if not kept:  # the update rows write into the EP rank 0 loaded with A, as the ep row leaves it
            parallel = Parallel(2, 0, 2, 0)
            model, bound = bound_rank(config, parallel, device)
            timed_load(bound, fp8, device)
            kept = {"model": model, "bound": bound, "parallel": parallel}
        model, bound, parallel = kept["model"], kept["bound"], kept["parallel"]
        update_rows(args, results, save, config, fp8, bf16, model, bound, parallel, wanted)

    # audit: the CLI's own audit of the BF16 -> FP8 update over the transport
    if "audit" in wanted:
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


class UpdateWatch:
    """What the update rows check besides equality: the parameters' addresses before any
    update, and a CUDA graph captured before any update that copies a few of them (an expert's
    w2 codes and scales, a qkv_proj) into buffers of its own, replayed after each update."""

    def __init__(self, model, bound, device):
        self.tensors = dict(model.named_parameters())
        self.pointers = {name: tensor.data_ptr() for name, tensor in self.tensors.items()}
        tensors = self.tensors
        self.watched = [name for name in tensors if name.endswith("routed_experts.w2_weight")][:1] + \
            [name for name in tensors if name.endswith("routed_experts.w2_weight_scale_inv")][:1] + \
            [name for name in tensors if name.endswith("qkv_proj.weight")][:1]
        self.seen = {name: torch.empty_like(tensors[name]) for name in self.watched}
        self.target_to_layout = {target: name for name, target in bound.bound.items()}
        self.device = device
        self.graph = None
        if device.startswith("cuda"):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for name in self.watched:
                    self.seen[name].copy_(tensors[name])
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                for name in self.watched:
                    self.seen[name].copy_(tensors[name])
        self.hook_runs = []
        bound.layout.add_hook("count", lambda: self.hook_runs.append(1))

    def pointers_unchanged(self):
        return {n: t.data_ptr() for n, t in self.tensors.items()} == self.pointers

    def graph_reads(self, reference):
        """Whether the graph, replayed now, copies the values of `reference` (by layout name);
        None without a graph (CUDA only)."""
        if self.graph is None:
            return None
        self.graph.replay()
        synchronize(self.device)
        return all(torch.equal(self.seen[name].view(torch.uint8).cpu().reshape(-1),
                               reference[self.target_to_layout[name]].reshape(-1)) for name in self.watched)


def update_rows(args, results, save, config, fp8, bf16, model, bound, parallel, wanted):
    """The rows update, update_gpu and update_local, into the bound EP rank 0 loaded with A."""
    rows, checks = results["rows"], results["checks"]
    device = args.device
    watch = UpdateWatch(model, bound, device)
    tensors = watch.tensors
    reference, b_counters = host_load(config, parallel, bf16)
    landed = sum(t.numel() * t.element_size() for t in tensors.values())
    copy_seconds = None

    # update: B in BF16 from the CLI's sender (reading it from the page cache), quantized into
    # the FP8 parameters in place
    if "update" in wanted:
        receiver = weightstream.UpdateReceiver(bound.layout, transport=args.transport, token=TOKEN, device=device)
        reports = []
        thread = threading.Thread(target=lambda: reports.append(receiver.receive(accept_timeout=300.0)), daemon=True)
        thread.start()
        start = time.perf_counter()
        try:
            sent = run([args.cli, "send", bf16, "--to", receiver.address, "--via", args.transport, "--bucket-size",
                        "1GiB", "--device", device, "--token-stdin", "--json"], input=TOKEN + "\n", timeout=600)
            thread.join(timeout=600)
            failure = None if reports else "the receiver reported nothing"
        except Exception as error:  # recorded, and the other rows still run
            failure = f"{type(error).__name__}: {error}"
        if failure:
            receiver.cancel()
            thread.join(timeout=60)
            rows["update"] = {"error": failure[-1000:]}
            checks["update: the sender and the receiver finished"] = False
            log(f"update: FAILED: {failure}")
        else:
            synchronize(device)
            wall = time.perf_counter() - start
            sender = json.loads(sent.stdout)
            copy_seconds = d2d_copy_seconds(landed, device)
            rows["update"] = {"seconds": sender["seconds"], "wall_seconds": wall, "bytes_sent": sender["bytes"],
                              "bytes_landed": landed, "receiver": scalars(reports[0]),
                              "d2d_copy_seconds": copy_seconds}
            log(f"update: {sender['bytes'] / GB:.2f} GB BF16 sent in {sender['seconds']:.3f} s (wall {wall:.3f} s), "
                f"{landed / GB:.2f} GB of FP8 parameters and scales landed; a device-to-device copy of those bytes "
                f"{copy_seconds * 1e3:.2f} ms")
            checks["update: data_ptr unchanged"] = watch.pointers_unchanged()
            checks["update: every parameter equals a host load of B"] = not differing(model, bound, reference)
            graph = watch.graph_reads(reference)
            if graph is not None:  # a CUDA graph exists on CUDA only
                checks["update: the CUDA graph captured before reads the new values"] = graph
            checks["update: the model hook ran once"] = watch.hook_runs == [1]
            checks["update: experts equal a torch quantization of B"] = experts_match_torch(tensors, bf16, config,
                                                                                           parallel, device)
        for text, ok in checks.items():
            if text.startswith("update:"):
                log(f"{text}: {'yes' if ok else 'NO'}")
        receiver = None
        save()

    if "update_gpu" in wanted:
        try:
            update_gpu_row(args, results, config, fp8, bf16, model, bound, parallel, watch, reference, b_counters)
        except Exception as error:  # recorded, and the other rows still run
            results["rows"].setdefault("update_gpu", {})["error"] = f"{type(error).__name__}: {error}"[-1000:]
            checks["update_gpu: the sender and the receiver finished"] = False
            log(f"update_gpu: FAILED: {type(error).__name__}: {error}")
        save()

    # update_local: the quantizing path alone, without the transport's sender and buckets
    if "update_local" in wanted:
        if copy_seconds is None:
            copy_seconds = d2d_copy_seconds(landed, device)
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
        checks["update_local: data_ptr unchanged"] = watch.pointers_unchanged()
        log(f"update_local check: {'equal' if not bad else f'{len(bad)} differ: {bad[:3]}'}")
        save()


def scalars(report):
    """A transfer report's numbers and words, and its phases (the rest is lists)."""
    kept = {k: v for k, v in report.items() if isinstance(v, (int, float, str))}
    for phases in ("phases", "sender_phases"):
        if isinstance(report.get(phases), dict):
            kept[phases] = dict(report[phases])
    return kept


def update_gpu_row(args, results, config, fp8, bf16, model, bound, parallel, watch, reference, b_counters):
    """update_gpu: B pushed from GPU memory (a sender process that loaded it into one arena
    first, as a trainer holds its flat parameter buffer) over the transport into the bound EP
    rank 0, reloaded with A first so that the update has something to change. `--updates`
    updates over one connection; the rate is the sender's, from its first send() to the end of
    finish(), against a device-to-device copy of the BF16 bytes this rank takes."""
    rows, checks = results["rows"], results["checks"]
    device = args.device
    # Back to A, in place (a reload), so that the parameters differ from B before the update.
    timed_load(bound, fp8, device, mode="reload")
    # (the synthetic A and B share their block scales: the codes tell them apart)
    checks["update_gpu: the parameters held A again before the update"] = not all(
        torch.equal(watch.tensors[name].detach().view(torch.uint8).cpu().reshape(-1),
                    reference[watch.target_to_layout[name]].reshape(-1)) for name in watch.watched)
    watch.graph_reads(reference)  # replayed once on A: the graph's copies run before and after the update
    hooks_before = len(watch.hook_runs)
    # The BF16 bytes this rank takes: what a load of B into this rank's layout applies (every
    # byte of the tensors and parts it keeps; the other EP rank's experts are not read).
    bf16_bytes = b_counters.get("bytes_applied") or b_counters.get("bytes_read")
    row = {"transport": args.transport, "updates": args.updates, "bf16_bytes_read": bf16_bytes,
           "bf16_counters": {k: b_counters[k] for k in ("bytes_read", "bytes_applied") if k in b_counters}}
    rows["update_gpu"] = row
    receiver = weightstream.UpdateReceiver(bound.layout, transport=args.transport, token=TOKEN, device=device)
    reports, failures = [], []

    def receive():
        try:
            for _ in range(args.updates):
                reports.append(receiver.receive(accept_timeout=600.0))
        except Exception as error:
            failures.append(f"receiver: {type(error).__name__}: {error}")

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    command = [sys.executable, os.path.abspath(__file__), "--role", "gpu-sender", "--bf16", bf16, "--to",
               receiver.address, "--transport", args.transport, "--device", device, "--updates", str(args.updates),
               "--bucket-bytes", str(1 << 30)]
    sender = None
    with tempfile.TemporaryFile(mode="w+") as errors:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True)
        watchdog = threading.Timer(900.0, process.kill)
        watchdog.start()
        try:
            ready = process.stdout.readline().strip()  # B is on the sender's GPU: the clock starts now
            start = time.perf_counter()
            out, _ = process.communicate(TOKEN + "\n", timeout=600) if ready == "READY" else \
                process.communicate(timeout=60)
            if ready != "READY" or process.returncode != 0:
                receiver.cancel()  # a sender that failed may never connect: stop waiting for it
            thread.join(timeout=120)
            synchronize(device)
            row["wall_seconds"] = time.perf_counter() - start
            if ready != "READY":
                failures.append(f"sender: said {ready!r}, not READY")
            if process.returncode != 0:
                failures.append(f"sender: exit code {process.returncode}")
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if lines:
                sender = json.loads(lines[-1])
            elif not failures:
                failures.append("sender: printed no report")
        except Exception as error:
            failures.append(f"{type(error).__name__}: {error}")
            process.kill()
            process.wait()
        finally:
            watchdog.cancel()
        errors.seek(0)
        stderr = errors.read().strip()
    if thread.is_alive():
        receiver.cancel()
        thread.join(timeout=60)
        failures.append(f"receiver: {len(reports)} of {args.updates} updates received; cancelled")
    receiver = None
    if sender and sender.get("error"):
        failures.append(f"sender: {sender['error']}")
    if stderr:
        row["sender_stderr"] = stderr[-2000:]
    row["receiver"] = [scalars(r) for r in reports]
    if failures or not sender or len(reports) != args.updates:
        row["error"] = "; ".join(failures) + (f"; sender stderr: {stderr[-600:]}" if stderr else "")
        checks["update_gpu: the sender and the receiver finished"] = False
        log(f"update_gpu: FAILED: {row['error']}")
        return
    runs = [u["seconds"] for u in sender["updates"]]
    later = runs[1:] or runs
    row.update({"seconds": statistics.median(later), "seconds_clock": "sender: first send() to the end of finish(), "
                "median of the updates after the first", "first_seconds": runs[0], "runs": runs,
                "receiver_runs": [r["seconds"] for r in reports], "bytes_sent": sender["bytes"],
                "tensors_sent": sender["tensors"], "sender_load_seconds": sender["load_seconds"],
                "sender_connect_seconds": sender["connect_seconds"], "sender": sender["updates"]})
    copy_seconds = d2d_copy_seconds(bf16_bytes, device)
    row["d2d_copy_seconds"] = copy_seconds
    # (bytes / seconds) / (bytes / d2d seconds): the update's rate as a fraction of a plain copy's
    row["d2d_rate_fraction"] = copy_seconds / row["seconds"]
    row["first_d2d_rate_fraction"] = copy_seconds / runs[0]
    log(f"update_gpu: {sender['bytes'] / GB:.2f} GB of BF16 sent from GPU memory over {args.transport}, "
        f"{bf16_bytes / GB:.2f} GB of it this rank's, in {row['seconds']:.3f} s (sender, median of updates 2 to "
        f"{len(runs)}; first {runs[0]:.3f} s; runs {', '.join(f'{t:.3f}' for t in runs)}; receiver "
        f"{', '.join(f'{t:.3f}' for t in row['receiver_runs'])}); a device-to-device copy of the rank's BF16 bytes "
        f"{copy_seconds * 1e3:.2f} ms = {row['d2d_rate_fraction']:.1%} of the copy's rate")
    last = sender["updates"][-1]["report"]
    log("update_gpu: the last update's sender phases " +
        ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in last.get("sender_phases", {}).items()) + "; receiver phases " +
        ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in last.get("phases", {}).items()))
    checks["update_gpu: data_ptr unchanged"] = watch.pointers_unchanged()
    bad = differing(model, bound, reference)
    checks["update_gpu: every parameter equals a host load of B"] = not bad
    graph = watch.graph_reads(reference)
    if graph is not None:
        checks["update_gpu: the CUDA graph captured before reads the new values"] = graph
    checks["update_gpu: the model hook ran once per update"] = len(watch.hook_runs) - hooks_before == args.updates
    checks["update_gpu: experts equal a torch quantization of B"] = experts_match_torch(watch.tensors, bf16, config,
                                                                                       parallel, device)
    for text, ok in checks.items():
        if text.startswith("update_gpu:"):
            log(f"{text}: {'yes' if ok else 'NO'}")


def gpu_sender(args):
    """The update_gpu row's sender, a trainer holding B on its GPU: loads B into one arena on
    the device, prints READY, reads the token from stdin, then pushes B `--updates` times over
    one connection and prints one JSON line (its log goes to stderr)."""
    try:
        start = time.perf_counter()
        weights = weightstream.load(args.bf16, device=args.device, framework="torch")
        synchronize(args.device)
        load_seconds = time.perf_counter() - start
        print("READY", flush=True)
        token = sys.stdin.readline().strip()
        start = time.perf_counter()
        sender = weightstream.UpdateSender(args.to, transport=args.transport, token=token, device=args.device,
                                           bucket_bytes=args.bucket_bytes)
        connect_seconds = time.perf_counter() - start
        updates = []
        for _ in range(args.updates):
            start = time.perf_counter()
            report = sender.update(weights)
            updates.append({"seconds": time.perf_counter() - start, "report": scalars(report)})
            print(f"gpu-sender: update {len(updates)} in {updates[-1]['seconds']:.3f} s", file=sys.stderr, flush=True)
        print(json.dumps({"load_seconds": load_seconds, "connect_seconds": connect_seconds, "tensors": len(weights),
                          "bytes": sum(t.numel() * t.element_size() for t in weights.values()),
                          "updates": updates}), flush=True)
        return 0
    except Exception as error:
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}), flush=True)
        return 1


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


def of_raw_text(key, row):
    if key == "raw":
        return "100%"
    return f"{row['of_raw']:.0%}" if "of_raw" in row else "-"


def report(results):
    rows, checks = results["rows"], results["checks"]
    lines = [f"FP8 block-scaled qwen3_moe ({results.get('checkpoint_bytes', 0) / GB:.2f} GB) on {results['device']}",
             "", "| row | median s | runs (s) | bytes read (GB) | GB/s | of raw |", "| --- | ---: | --- | ---: | ---: | ---: |"]
    for key in ("raw", "tp2_r0", "tp2_r1", "ep_r0", "ep_r1", "tp2_r0_host", "ep_r0_host"):
        if key in rows:
            row = rows[key]
            lines.append(f"| {key} | {row['seconds']:.3f} | {', '.join(f'{t:.3f}' for t in row['runs'])} | "
                         f"{row['bytes_read'] / GB:.2f} | {row['gbps']:.2f} | "
                         f"{of_raw_text(key, row)} |")
    ranks = [rows[k]["of_raw"] for k in ("tp2_r0", "tp2_r1", "ep_r0", "ep_r1") if "of_raw" in rows.get(k, {})]
    if ranks:
        lines.append(f"\nGoal, each bound rank >= 85% of raw: {'met' if min(ranks) >= 0.85 else 'MISSED'} "
                     f"(lowest {min(ranks):.0%})")
    for key in ("update", "update_gpu"):
        if "error" in rows.get(key, {}):
            lines.append(f"\n{key} failed: {rows[key]['error'][:600]}")
    if "update" in rows and "error" not in rows["update"]:
        u = rows["update"]
        lines.append(f"\nUpdate: {u['bytes_sent'] / GB:.2f} GB of BF16 sent, {u['bytes_landed'] / GB:.2f} GB landed as "
                     f"FP8 codes and scales in {u['seconds']:.3f} s (sender), {u['wall_seconds']:.3f} s wall; a "
                     f"device-to-device copy of the landed bytes takes {u['d2d_copy_seconds'] * 1e3:.2f} ms "
                     f"({u['d2d_copy_seconds'] / u['seconds']:.1%} of the update)")
    if "update_gpu" in rows and "error" not in rows["update_gpu"]:
        u = rows["update_gpu"]
        lines.append(f"\nUpdate from GPU memory (update_gpu, {u['transport']}): {u['bytes_sent'] / GB:.2f} GB of BF16 "
                     f"sent, {u['bf16_bytes_read'] / GB:.2f} GB of it read by this rank, in {u['seconds']:.3f} s "
                     f"(sender's clock, first send() to the end of finish(), median of updates 2 to {len(u['runs'])}; "
                     f"first {u['first_seconds']:.3f} s; runs {', '.join(f'{t:.3f}' for t in u['runs'])}; receiver "
                     f"{', '.join(f'{t:.3f}' for t in u['receiver_runs'])}; read in place by the receiver "
                     f"{u['receiver'][-1].get('shared_bytes', 0) / GB:.2f} GB, through buckets "
                     f"{u['receiver'][-1].get('bytes', 0) / GB:.2f} GB), "
                     f"{u['bf16_bytes_read'] / u['seconds'] / GB:.2f} GB/s of the rank's BF16; a device-to-device "
                     f"copy of those bytes takes {u['d2d_copy_seconds'] * 1e3:.2f} ms "
                     f"({u['bf16_bytes_read'] / u['d2d_copy_seconds'] / GB:.0f} GB/s)")
    if "update_gpu" in rows:
        u = rows["update_gpu"]
        fraction = u.get("d2d_rate_fraction", float("nan"))
        verdict = "MISSED (the row failed)" if "error" in u else \
            "n/a (no device)" if fraction != fraction else \
            f"{'met' if fraction >= 0.25 else 'MISSED'} ({fraction:.1%}; first update " \
            f"{u['first_d2d_rate_fraction']:.1%})"
        lines.append(f"\nGoal, update_gpu >= 0.25 of a device-to-device copy of the BF16 bytes read: {verdict}")
    if "update_local" in rows:
        u = rows["update_local"]
        of = f"; of raw {u['gbps'] / rows['raw']['gbps']:.0%}" if "raw" in rows else ""
        lines.append(f"\nUpdate in process (LoadSession, no transport): {u['bytes_read'] / GB:.2f} GB of BF16 read and "
                     f"quantized on the device in {u['seconds']:.3f} s ({u['gbps']:.2f} GB/s; runs "
                     f"{', '.join(f'{t:.3f}' for t in u['runs'])}){of}; a device-to-device copy of the "
                     f"{u['bytes_landed'] / GB:.2f} GB landed takes {u['d2d_copy_seconds'] * 1e3:.2f} ms")
    lines.append("")
    lines += [f"- {text}: {'yes' if ok else 'NO'}" for text, ok in checks.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

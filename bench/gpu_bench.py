#!/usr/bin/env python3
"""The GPU load benchmark (issues 4, 16 and 19): every row in one run, ratios against
baselines measured in the same run.

Checkpoint: shaped like Llama-3-8B in BF16 (16.06 GB at --scale 1), written by the
`safetensors` package (`save_file` in 4 shards, random values made on the GPU, an index and a
real config.json). Every contender runs in a FRESH process (this script never imports torch
itself); each row is the median of --repeats runs of the in-process time (the load call to the
last byte on the device, after imports and CUDA initialisation), and the process's wall time
is recorded beside it.

Sections (--sections, comma-separated, default all; run them as separate invocations with
--keep so that each stays under a time limit; the checkpoint and the results so far persist
in --dir and DIR.results.json between invocations):
  write      write the checkpoint (starts a new set of results)
  baselines  pinned (and pageable) host-to-device copy rate (torch, CUDA events), checkpoint bytes
  warm       `weightstream load --raw --json` by the default path (auto), --gpu-path staged, mapped,
             and both (staged and mapped at once) with 0.3, 0.4 and 0.5 of the bytes mapped
  layout     engine layout tp 1, tp 2 rank 1, tp 8 rank 3; reload (`audit --batches 8 --order shuffled`)
  python     `LoadSession.load_checkpoint` tp 1, tp 2 rank 1, tp 8 rank 3; `weightstream.load`;
             `Checkpoint.stream()` onto the device, every tensor taken
  peers      safetensors, Run:ai streamer, fastsafetensors, InstantTensor, each at its defaults and
             at its documented warm-cache settings (--peers narrows them: NAME or NAME:SETTING)
  interleaved  raw, layout tp 1, the Python session, load and stream, and the three closest peer
             settings again, round-robin (run k of each after run k of the one before), replacing
             those rows: their ratios then hold while the machine drifts within a call
  cold       parallel O_DIRECT `dd` of every shard against `weightstream load --raw`, the page
             cache dropped before each run (posix_fadvise DONTNEED per file + drop_caches)
Every invocation prints each row as it is measured and rewrites OUT/gpu_bench.json and
OUT/gpu_bench.md (all rows so far, with the goals of issues 16 and 34), so a time limit loses
nothing measured. A contender that fails or is not installed records "failed: <reason>".

Usage:
  bench/gpu_bench.py --cli build-gpu/weightstream --out OUT [--sections write,baselines,...]
      [--dir /tmp/ws-gpu-bench] [--keep] [--python-site SITE] [--peer-site /tmp/peer-site]
      [--repeats 3] [--cold-repeats 3] [--scale 1] [--device cuda:0]
"""
import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time

GB = 1e9
SECTIONS = ["write", "baselines", "warm", "layout", "python", "peers", "interleaved", "cold"]
LLAMA3_8B = {"hidden": 4096, "intermediate": 14336, "layers": 32, "heads": 32, "kv_heads": 8, "vocab": 128256}
RESULT_PREFIX = "WS_BENCH_RESULT "


def log(*args):
    print(*args, flush=True)


# ---------------------------------------------------------------------------------------------
# The checkpoint


def llama_config(scale):
    """Llama-3-8B's dimensions divided by `scale` (a power of two up to 32; 1 is the real shape).
    Heads stay 32 and 8 so that every tensor-parallel split of the real model stays valid."""
    if scale not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"--scale {scale}: expected 1, 2, 4, 8, 16 or 32")
    c = dict(LLAMA3_8B)
    for key in ("hidden", "intermediate", "vocab"):
        c[key] //= scale
    c["layers"] = max(1, c["layers"] // scale)
    return c


def llama_shapes(c):
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
    return shapes


def shape_bytes(shape):
    count = 2  # BF16
    for n in shape:
        count *= n
    return count


def write_checkpoint(directory, scale, device):
    """Writes the checkpoint with the safetensors package (runs in a worker process: torch)."""
    import torch
    from safetensors.torch import save_file

    c = llama_config(scale)
    shapes = llama_shapes(c)
    full_size = sum(shape_bytes(s) for _, s in llama_shapes(llama_config(1)))
    shard_bytes = 5 * 10**9 * sum(shape_bytes(s) for _, s in shapes) // full_size  # 4 shards at any scale
    make_on = device if device.startswith("cuda") else "cpu"
    os.makedirs(directory, exist_ok=True)
    shards, current, size = [], {}, 0
    for name, shape in shapes:
        current[name] = torch.randn(shape, dtype=torch.bfloat16, device=make_on).cpu()
        size += shape_bytes(shape)
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
            total += tensor.numel() * tensor.element_size()
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    head_dim = c["hidden"] // c["heads"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c["hidden"],
              "intermediate_size": c["intermediate"], "num_hidden_layers": c["layers"],
              "num_attention_heads": c["heads"], "num_key_value_heads": c["kv_heads"], "vocab_size": c["vocab"],
              "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "max_position_embeddings": 8192}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    count = len(shards)
    del shards
    os.sync()
    return {"bytes": total, "shards": count, "torch": torch.__version__}


def shard_files(directory):
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))


def checkpoint_facts(directory):
    """Tensor count and bytes from the shards' headers (no torch, no weightstream)."""
    tensors, nbytes = 0, 0
    for path in shard_files(directory):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                tensors += 1
                nbytes += info["data_offsets"][1] - info["data_offsets"][0]
    return {"tensors": tensors, "bytes": nbytes, "shards": len(shard_files(directory)),
            "file_bytes": sum(os.path.getsize(p) for p in shard_files(directory))}


def warm(directory):
    """Reads every file once so the page cache holds it; returns the read rate."""
    start, total = time.perf_counter(), 0
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            while True:
                block = f.read(64 << 20)
                if not block:
                    break
                total += len(block)
    return total / (time.perf_counter() - start) / GB


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


def odirect_rate(files):
    """dd with O_DIRECT over every shard, all at once: (seconds, bytes)."""
    total = sum(os.path.getsize(f) for f in files)
    commands = [["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"] for f in files]
    start = time.perf_counter()
    processes = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for c in commands]
    errors = [p.communicate()[1] for p in processes]
    seconds = time.perf_counter() - start
    if any(p.returncode for p in processes):
        raise RuntimeError(f"dd iflag=direct failed: {[e.strip()[-200:] for e in errors if e.strip()]}")
    return seconds, total


# ---------------------------------------------------------------------------------------------
# Workers: each contender runs in a fresh process (`gpu_bench.py --worker NAME PARAMS`), prints
# one RESULT_PREFIX line of JSON. Times are in-process: from the load call to the last byte on
# the device (torch.cuda.synchronize), after imports and CUDA initialisation.


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


def _torch_ready(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.init()
        torch.empty(1, device=device)
        torch.cuda.synchronize()
    return torch


def _sync(torch, device):
    if torch is not None and device.startswith("cuda"):
        torch.cuda.synchronize()


class Tally:
    """Holds every tensor a contender delivered (so none is freed before the clock stops) and
    counts tensors, bytes and the devices they are on."""

    def __init__(self):
        self.held, self.tensors, self.bytes, self.devices = [], 0, 0, set()

    def add(self, tensor):
        self.held.append(tensor)
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        self.devices.add(str(tensor.device))

    def result(self, seconds, **extra):
        return {"seconds": seconds, "tensors": self.tensors, "bytes": self.bytes,
                "devices": sorted(self.devices), **extra}


def worker_write(p):
    return write_checkpoint(p["dir"], p["scale"], p["device"])


def worker_pinned(p):
    torch = _torch_ready(p["device"])
    if not p["device"].startswith("cuda"):
        raise RuntimeError("the pinned host-to-device copy needs a CUDA device")
    rates = pinned_copy_rate(torch)
    return {"pinned_gbps": rates["pinned"], "pageable_gbps": rates["pageable"],
            "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}


def worker_safetensors(p):
    torch = _torch_ready(p["device"])
    import safetensors
    from safetensors.torch import load_file

    tally = Tally()
    start = time.perf_counter()
    for path in p["files"]:
        for tensor in load_file(path, device=p["device"]).values():
            tally.add(tensor)
    _sync(torch, p["device"])
    return tally.result(time.perf_counter() - start, version=safetensors.__version__)


def worker_runai(p):
    torch = _torch_ready(p["device"])
    from runai_model_streamer import SafetensorsStreamer

    tally = Tally()
    start = time.perf_counter()
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(p["files"], device=p["device"])
        for _, tensor in streamer.get_tensors():
            tally.add(tensor)
    _sync(torch, p["device"])
    return tally.result(time.perf_counter() - start)


def worker_fastsafetensors(p):
    torch = _torch_ready(p["device"])
    import fastsafetensors
    from fastsafetensors import fastsafe_open

    tally = Tally()
    start = time.perf_counter()
    with fastsafe_open(p["files"], framework="pt", device=p["device"], nogds=True) as f:
        copier = type(f.loader).__name__ + "/" + getattr(f.loader, "copier_class", type(None)).__name__
        for name in f.keys():
            tally.add(f.get_tensor(name))
        _sync(torch, p["device"])
        seconds = time.perf_counter() - start
    return tally.result(seconds, copier=copier, version=fastsafetensors.__version__)


def worker_instanttensor(p):
    torch = _torch_ready(p["device"])
    from instanttensor import safe_open

    tally = Tally()
    start = time.perf_counter()
    with safe_open(p["files"], framework="pt", device=p["device"]) as f:
        backend = f.backend.name
        for _, tensor in f.tensors():
            tally.add(tensor)
    _sync(torch, p["device"])
    return tally.result(time.perf_counter() - start, backend=backend)


def _ws_torch(device):
    """torch where the machine has it (for synchronize), else None: weightstream needs no torch."""
    try:
        return _torch_ready(device)
    except ImportError:
        return None


def worker_ws_session(p):
    torch = _ws_torch(p["device"])
    import weightstream

    checkpoint = weightstream.open(p["dir"])
    layout = weightstream.model_layout(checkpoint, tp_size=p["tp"], tp_rank=p["rank"], device=p["device"])
    session = weightstream.LoadSession(layout)
    start = time.perf_counter()
    session.begin("cold")
    stats = session.load_checkpoint(checkpoint)
    streamed = time.perf_counter()
    session.finish()
    _sync(torch, p["device"])
    seconds = time.perf_counter() - start
    # The rank's parameters (computed after the clock stops), as `weightstream load --json` reports them.
    parameter_bytes = sum(layout.parameter_info(name)["bytes"] for name in layout.parameter_names)
    # Where the time went: the stream as the library timed it, the call around it, finish().
    return {"seconds": seconds, "bytes": parameter_bytes, "bytes_read": stats.get("bytes_read", stats["bytes"]),
            "tensors": stats.get("tensors"), "stream_seconds": stats.get("seconds"),
            "call_seconds": streamed - start, "finish_seconds": time.perf_counter() - streamed}


def worker_ws_load(p):
    torch = _ws_torch(p["device"])
    import weightstream

    start = time.perf_counter()
    loaded = weightstream.load(p["dir"], device=p["device"], framework="torch" if torch else None)
    _sync(torch, p["device"])
    seconds = time.perf_counter() - start
    if torch is None:
        return {"seconds": seconds, "tensors": len(loaded), "bytes": sum(t.nbytes for t in loaded.values())}
    tally = Tally()
    for tensor in loaded.values():
        tally.add(tensor)
    return tally.result(seconds)


def worker_ws_stream(p):
    torch = _ws_torch(p["device"])
    import weightstream

    checkpoint = weightstream.open(p["dir"])
    tally = Tally()
    start = time.perf_counter()
    for _, tensor in checkpoint.stream(device=p["device"], framework="torch" if torch else None):
        tally.add(tensor)
    _sync(torch, p["device"])
    return tally.result(time.perf_counter() - start)


WORKERS = {"write": worker_write, "pinned": worker_pinned, "safetensors": worker_safetensors, "runai": worker_runai,
           "fastsafetensors": worker_fastsafetensors, "instanttensor": worker_instanttensor,
           "ws_session": worker_ws_session, "ws_load": worker_ws_load, "ws_stream": worker_ws_stream}


def run_worker(name, params):
    result = WORKERS[name](params)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# Contenders


class Failed(Exception):
    pass


def reason_of(process):
    lines = [l.strip() for l in (process.stderr or "").splitlines() if l.strip()]
    return (lines[-1] if lines else f"exit code {process.returncode}, nothing on stderr")[:300]


def run_process(command, env, timeout):
    start = time.perf_counter()
    try:
        process = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Failed(f"no result within {timeout} s")
    except OSError as error:
        raise Failed(str(error))
    return process, time.perf_counter() - start


def run_cli(command, timeout, seconds_key="seconds", bytes_key="bytes"):
    process, wall = run_process(command, None, timeout)
    if process.returncode != 0:
        raise Failed(reason_of(process))
    try:
        out = json.loads(process.stdout[process.stdout.index("{"):])  # one JSON object, perhaps over several lines
    except ValueError:
        raise Failed(f"no JSON from {command[1]}: {process.stdout[-200:]!r}")
    return {"seconds": out[seconds_key], "bytes": out.get(bytes_key) or 0,
            "bytes_read": out.get("bytes_read") or out.get(bytes_key) or 0, "wall_seconds": wall}


def run_python(worker, params, env_extra, pythonpath, timeout):
    env = dict(os.environ, **env_extra)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    command = [sys.executable, os.path.abspath(__file__), "--worker", worker, json.dumps(params)]
    process, wall = run_process(command, env, timeout)
    lines = [l for l in process.stdout.splitlines() if l.startswith(RESULT_PREFIX)]
    if process.returncode != 0 or not lines:
        raise Failed(reason_of(process))
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    result["wall_seconds"] = wall
    return result


class Bench:
    def __init__(self, args):
        self.args = args
        self.cli = os.path.abspath(args.cli)
        self.dir = os.path.abspath(args.dir)
        self.state_path = self.dir.rstrip("/") + ".results.json"
        self.state = {"rows": {}, "meta": {}}
        if os.path.exists(self.state_path):
            with open(self.state_path) as f:
                self.state = json.load(f)
        os.makedirs(args.out, exist_ok=True)

    # ---- results ----
    @property
    def meta(self):
        return self.state["meta"]

    def save(self):
        with open(self.state_path + ".tmp", "w") as f:
            json.dump(self.state, f, indent=1)
        os.replace(self.state_path + ".tmp", self.state_path)
        with open(os.path.join(self.args.out, "gpu_bench.json"), "w") as f:
            json.dump(self.state, f, indent=1)
        with open(os.path.join(self.args.out, "gpu_bench.md"), "w") as f:
            f.write(markdown(self.state))

    def record(self, key, row, started=False):
        """Keeps a row and prints it (the rest of its line, where measure() has begun it)."""
        self.state["rows"][key] = row
        self.save()
        if not started:
            print(f"  {row['contender']:44s} {row['setting'][:40]:40s} {row['cache']:4s}", end="")
        if "error" in row:
            log(f" failed: {row['error']}")
        else:
            gbps = row["bytes"] / row["seconds"] / GB if row["seconds"] else 0
            log(f" -> median {row['seconds']:.3f} s, {gbps:.2f} GB/s (wall {row['wall_seconds']:.1f} s)"
                f"{'  ' + row['note'] if row.get('note') else ''}")

    def measure(self, key, contender, setting, cache, run, repeats, expect=None, before=None):
        """Runs `run` `repeats` times (each a fresh process), records the median row. Each run's
        seconds are printed as it ends, so a time limit loses no more than the run it cut."""
        runs = []
        row = {"contender": contender, "setting": setting, "cache": cache}
        print(f"  {contender:44s} {setting[:40]:40s} {cache:4s} runs", end="", flush=True)
        try:
            for _ in range(repeats):
                if before:
                    before()
                result = run()
                if expect:
                    expect(result)
                runs.append(result)
                print(f" {result['seconds']:.3f}", end="", flush=True)
        except Failed as error:
            row["error"] = str(error)
            if runs:
                row["error"] += f" (after {len(runs)} good runs)"
            self.record(key, row, started=True)
            return None
        return self.record_runs(key, row, runs)

    def measure_interleaved(self, contenders, repeats):
        """Like measure() for several contenders at once, round-robin: run k of each follows run
        k of the one before it, so a machine that drifts during the section (seen: 15-20% within
        one call) moves every contender alike and their ratios hold. `contenders`: (key,
        contender, setting, run, expect) each."""
        runs = {c[0]: [] for c in contenders}
        failed = {}
        for index in range(repeats):
            for key, contender, setting, run, expect in contenders:
                if key in failed:
                    continue
                try:
                    result = run()
                    if expect:
                        expect(result)
                    runs[key].append(result)
                    log(f"  round {index + 1}: {contender} {setting[:50]}: {result['seconds']:.3f} s")
                except Failed as error:
                    failed[key] = f"{error} (after {len(runs[key])} good runs)"
                    log(f"  round {index + 1}: {contender} {setting[:50]}: failed: {error}")
        for key, contender, setting, _, _ in contenders:
            row = {"contender": contender, "setting": setting + " [round-robin]", "cache": "warm", "interleaved": True}
            if key in failed:
                self.record(key, dict(row, error=failed[key]))
            else:
                self.record_runs(key, row, runs[key], started=False)

    def record_runs(self, key, row, runs, started=True):
        """Records the median row of a contender's runs (`started`: measure() printed its line's start)."""
        seconds = statistics.median(r["seconds"] for r in runs)
        row.update(seconds=seconds, runs=[r["seconds"] for r in runs],
                   wall_seconds=statistics.median(r["wall_seconds"] for r in runs),
                   bytes=runs[0].get("bytes") or 0, bytes_read=runs[0].get("bytes_read") or runs[0].get("bytes") or 0)
        notes = [f"{k} {runs[0][k]}" for k in ("backend", "copier", "version") if runs[0].get(k)]
        # A breakdown a worker reports (the Python session's stream, call and finish), as medians.
        notes += [f"{k} {statistics.median(r[k] for r in runs):.3f}"
                  for k in ("stream_seconds", "call_seconds", "finish_seconds") if runs[0].get(k) is not None]
        if notes:
            row["note"] = ", ".join(notes)
        self.record(key, row, started=started)
        return row

    def expect_whole(self, result):
        """Every tensor of the checkpoint, every byte, on the benchmark's device."""
        facts = self.meta["checkpoint"]
        device = self.args.device
        if result.get("tensors") != facts["tensors"] or result.get("bytes") != facts["bytes"]:
            raise Failed(f"delivered {result.get('tensors')} of {facts['tensors']} tensors, "
                         f"{result.get('bytes')} of {facts['bytes']} bytes")
        if "devices" in result and result["devices"] != [device]:
            raise Failed(f"tensors on {result['devices']}, not {device}")

    # ---- sections ----
    def checkpoint_ready(self):
        return os.path.isdir(self.dir) and shard_files(self.dir) and os.path.exists(os.path.join(self.dir, "config.json"))

    def ensure_checkpoint(self):
        if not self.checkpoint_ready():
            log(f"no checkpoint in {self.dir}: writing it first")
            self.section_write()
        if "checkpoint" not in self.meta or self.meta["checkpoint"].get("dir") != self.dir:
            self.meta["checkpoint"] = dict(checkpoint_facts(self.dir), dir=self.dir)
            self.save()

    def section_write(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        self.state = {"rows": {}, "meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}
        start = time.perf_counter()
        params = {"dir": self.dir, "scale": self.args.scale, "device": self.args.device}
        try:
            result = run_python("write", params, {}, None, max(self.args.run_timeout, 600))
        except Failed as error:
            raise SystemExit(f"gpu_bench: writing the checkpoint in {self.dir} failed: {error}")
        facts = dict(checkpoint_facts(self.dir), dir=self.dir)
        self.meta.update(checkpoint=facts, written_by="safetensors.torch.save_file", scale=self.args.scale,
                         write_seconds=time.perf_counter() - start, torch=result.get("torch"))
        self.save()
        log(f"checkpoint: {facts['bytes'] / GB:.2f} GB of tensors ({facts['tensors']} tensors, {facts['shards']} "
            f"shards, Llama-3-8B shape / {self.args.scale}) by safetensors.save_file in "
            f"{self.meta['write_seconds']:.0f} s")

    def section_baselines(self):
        facts = self.meta["checkpoint"]
        log(f"checkpoint bytes: {facts['bytes']} ({facts['bytes'] / GB:.2f} GB, {facts['tensors']} tensors)")
        try:
            result = run_python("pinned", {"device": self.args.device}, {}, None, self.args.run_timeout)
            self.meta.update(pinned_gbps=result["pinned_gbps"], pageable_gbps=result["pageable_gbps"],
                             gpu=result["gpu"], torch=result["torch"])
            log(f"  pinned host-to-device copy {result['pinned_gbps']:.1f} GB/s (pageable {result['pageable_gbps']:.1f}), "
                f"4 GiB, torch, CUDA events, median of 5; {result['gpu']}")
        except Failed as error:
            self.meta["pinned_error"] = str(error)
            log(f"  pinned host-to-device copy failed: {error}")
        self.save()

    def cli_load(self, *flags):
        return [self.cli, "load", self.dir, "--device", self.args.device, "--json", "--no-progress", *flags]

    # ---- contenders: (key, contender, setting, run, expect), measured alone or round-robin ----
    def raw_contender(self, key, setting, flags=()):
        command = self.cli_load("--raw", *flags)
        return (key, "weightstream load --raw (CLI)", setting, lambda: run_cli(command, self.args.run_timeout),
                self.expect_cli_whole)

    def layout_contender(self, key, tp, rank):
        command = self.cli_load("--tp-size", str(tp), "--tp-rank", str(rank))
        return (key, f"weightstream load tp {tp} rank {rank} (CLI)", f"--tp-size {tp} --tp-rank {rank}",
                lambda: run_cli(command, self.args.run_timeout, bytes_key="parameter_bytes"), None)

    def python_site_missing(self):
        """Why the Python rows cannot run, or None."""
        site = self.args.python_site
        if not site or not os.path.isdir(os.path.join(site, "weightstream")):
            return f"no weightstream package under --python-site {site!r}"
        return None

    def python_contenders(self):
        """The Python rows: LoadSession at tp 1, 2 and 8, weightstream.load, Checkpoint.stream()."""
        params = dict(dir=self.dir, device=self.args.device)
        site, timeout = self.args.python_site, self.args.run_timeout

        def contender(key, name, setting, worker, extra, expect):
            return (key, name, setting, lambda: run_python(worker, dict(params, **extra), {}, site, timeout), expect)

        rows = [contender(key, f"Python LoadSession.load_checkpoint tp {tp} rank {rank}",
                          f"model_layout(tp_size={tp}, tp_rank={rank})", "ws_session", {"tp": tp, "rank": rank}, None)
                for key, tp, rank in (("py_session_tp1", 1, 0), ("py_session_tp2", 2, 1), ("py_session_tp8", 8, 3))]
        rows.append(contender("py_load", "Python weightstream.load", "framework='torch'", "ws_load", {},
                              self.expect_whole))
        rows.append(contender("py_stream", "Python Checkpoint.stream()", "framework='torch', every tensor held",
                              "ws_stream", {}, self.expect_whole))
        return rows

    def peer_contender(self, key, contender, setting, worker, env):
        files = shard_files(self.dir)
        site = self.args.peer_site if self.args.peer_site and os.path.isdir(self.args.peer_site) else None
        params = {"files": files, "device": self.args.device}
        return (key, contender, setting, lambda: run_python(worker, params, env, site, self.args.run_timeout),
                self.expect_whole)

    def measure_contender(self, contender, repeats=None):
        key, name, setting, run, expect = contender
        self.measure(key, name, setting, "warm", run, repeats or self.args.repeats, expect)

    # ---- sections ----
    def section_warm(self):
        self.measure_contender(self.raw_contender("ws_raw", "default (--gpu-path auto)"))
        for path in ("staged", "mapped"):
            self.measure_contender(self.raw_contender(f"ws_raw_{path}", f"--gpu-path {path}", ("--gpu-path", path)))
        for share in (0.3, 0.4, 0.5):
            self.measure_contender(self.raw_contender(f"ws_raw_both_{share}", f"--gpu-path both --mapped-share {share}",
                                                      ("--gpu-path", "both", "--mapped-share", str(share))))

    def expect_cli_whole(self, result):
        facts = self.meta["checkpoint"]
        if result["bytes"] != facts["bytes"]:
            raise Failed(f"loaded {result['bytes']} of {facts['bytes']} bytes")

    def section_layout(self):
        for key, tp, rank in (("layout_tp1", 1, 0), ("layout_tp2", 2, 1), ("layout_tp8", 8, 3)):
            self.measure_contender(self.layout_contender(key, tp, rank))
        command = [self.cli, "audit", self.dir, "--device", self.args.device, "--json", "--no-progress",
                   "--batches", "8", "--order", "shuffled"]
        self.measure("reload", "weightstream reload (audit, its reload s)", "--batches 8 --order shuffled", "warm",
                     lambda: run_cli(command, self.args.run_timeout, seconds_key="reload_seconds",
                                     bytes_key="reload_bytes"), self.args.repeats)

    def section_python(self):
        missing = self.python_site_missing()
        for contender in self.python_contenders():
            if missing:
                key, name, setting = contender[:3]
                self.record(key, {"contender": name, "setting": setting, "cache": "warm", "error": missing})
            else:
                self.measure_contender(contender)

    def section_interleaved(self):
        """The rows whose ratios issue 19 asks for, measured round-robin (see
        measure_interleaved): the raw load, layout tp 1, the Python session, load and stream,
        and the peers closest to weightstream. They replace those rows of earlier sections."""
        contenders = [self.raw_contender("ws_raw", "default (--gpu-path auto)"),
                      self.layout_contender("layout_tp1", 1, 0)]
        if not self.python_site_missing():
            contenders += [c for c in self.python_contenders() if c[0] in ("py_session_tp1", "py_load", "py_stream")]
        contenders += [self.peer_contender(*setting) for setting in self.peer_settings()
                       if setting[0] in ("peer_instanttensor_mmap", "peer_instanttensor_buffered",
                                         "peer_fastsafetensors_buffered")]
        self.measure_interleaved(contenders, self.args.repeats)

    def peer_settings(self):
        """(key, contender, setting, worker, environment): defaults first, then the documented
        warm-cache settings."""
        return [
            ("peer_safetensors", "safetensors.torch.load_file", "defaults (every shard)", "safetensors", {}),
            ("peer_runai", "Run:ai streamer 0.17.1", "defaults (no RUNAI_STREAMER_* set; memory limit 40 GB in 0.17.1)",
             "runai", {}),
            ("peer_runai_c32", "Run:ai streamer 0.17.1", "RUNAI_STREAMER_CONCURRENCY=32 RUNAI_STREAMER_MEMORY_LIMIT=-1",
             "runai", {"RUNAI_STREAMER_CONCURRENCY": "32", "RUNAI_STREAMER_MEMORY_LIMIT": "-1"}),
            ("peer_runai_c64", "Run:ai streamer 0.17.1", "RUNAI_STREAMER_CONCURRENCY=64 RUNAI_STREAMER_MEMORY_LIMIT=-1",
             "runai", {"RUNAI_STREAMER_CONCURRENCY": "64", "RUNAI_STREAMER_MEMORY_LIMIT": "-1"}),
            ("peer_fastsafetensors", "fastsafetensors 0.5.0", "defaults, nogds=True (nogds copier, O_DIRECT reads)",
             "fastsafetensors", {}),
            ("peer_fastsafetensors_buffered", "fastsafetensors 0.5.0",
             "nogds copier, FASTSAFETENSORS_ODIRECT=0 (buffered reads)", "fastsafetensors",
             {"FASTSAFETENSORS_ODIRECT": "0"}),
            ("peer_fastsafetensors_unified", "fastsafetensors 0.5.0",
             "unified copier (mmap + pin + async copy), FASTSAFETENSORS_UNIFIED_MEM=1", "fastsafetensors",
             {"FASTSAFETENSORS_UNIFIED_MEM": "1"}),
            ("peer_instanttensor", "InstantTensor 0.2.2", "defaults (URING, AIO: O_DIRECT)", "instanttensor", {}),
            ("peer_instanttensor_mmap", "InstantTensor 0.2.2", "INSTANTTENSOR_BACKEND=MMAP", "instanttensor",
             {"INSTANTTENSOR_BACKEND": "MMAP"}),
            ("peer_instanttensor_buffered", "InstantTensor 0.2.2", "INSTANTTENSOR_BACKEND=BUFFERED", "instanttensor",
             {"INSTANTTENSOR_BACKEND": "BUFFERED"}),
        ]

    def wanted_peers(self):
        wanted = [w.strip() for w in self.args.peers.split(",") if w.strip()] if self.args.peers else None
        for setting in self.peer_settings():
            key, worker = setting[0], setting[3]
            short = key[len("peer_"):]
            if wanted is None or worker in wanted or short in wanted or key in wanted:
                yield setting

    def section_peers(self):
        for setting in self.wanted_peers():
            self.measure_contender(self.peer_contender(*setting), self.args.peer_repeats)

    def section_cold(self):
        files = shard_files(self.dir)
        self.meta["drop_caches"] = drop_cache(files)
        log(f"  page cache dropped before every run: posix_fadvise(DONTNEED) per file; /proc/sys/vm/drop_caches "
            f"{'written' if self.meta['drop_caches'] else 'not writable here (per-file advice only)'}")

        def dd():
            seconds, nbytes = odirect_rate(files)
            return {"seconds": seconds, "bytes": nbytes, "wall_seconds": seconds}

        def timed_dd():
            try:
                return dd()
            except RuntimeError as error:
                raise Failed(str(error))

        repeats = self.args.cold_repeats
        self.measure("cold_dd", "dd iflag=direct bs=16M, every shard at once", f"{len(files)} dd processes",
                     "cold", timed_dd, repeats, before=lambda: drop_cache(files))
        command = self.cli_load("--raw")
        self.measure("cold_ws_raw", "weightstream load --raw (CLI)", "default (--gpu-path auto)", "cold",
                     lambda: run_cli(command, self.args.run_timeout), repeats, self.expect_cli_whole,
                     before=lambda: drop_cache(files))

    # ---- estimates ----
    def estimate(self, section):
        size = self.meta.get("checkpoint", {}).get("bytes") or (16.06e9 / self.args.scale ** 2)
        r, gb = self.args.repeats, size / GB
        if section == "write":
            return 15 + gb / 0.3
        if section == "baselines":
            return 20
        if section == "warm":
            return 3 * r * (1.5 + gb / 20)
        if section == "layout":
            return 3 * r * (1.5 + gb / 25) + r * (3 + 3 * gb / 20)
        if section == "python":
            return 5 * r * (6 + gb / 15)
        if section == "peers":
            rates = {"safetensors": 4.5, "runai": 2, "runai_c32": 2.5, "runai_c64": 2.5, "fastsafetensors": 1.6,
                     "fastsafetensors_buffered": 4, "fastsafetensors_unified": 8, "instanttensor": 1.3,
                     "instanttensor_mmap": 30, "instanttensor_buffered": 18}
            repeats = self.args.peer_repeats or r
            return sum(repeats * (7 + gb / rates.get(k[len("peer_"):], 2)) for k, *_ in self.wanted_peers())
        if section == "interleaved":
            return r * (2 * (1.5 + gb / 40) + 3 * (6 + gb / 40) + 3 * (6 + gb / 30))
        if section == "cold":
            return self.args.cold_repeats * 2 * (4 + gb / 1.1)
        return 0

    def run(self, sections):
        total = 0
        for section in sections:
            total += self.estimate(section)
        log(f"sections {', '.join(sections)}: expected about {total:.0f} s in all "
            f"({', '.join(f'{s} ~{self.estimate(s):.0f} s' for s in sections)})")
        if "write" in sections:
            self.run_section("write")
        self.ensure_checkpoint()
        if any(s in sections for s in ("baselines", "warm", "layout", "python", "peers", "interleaved")):
            log(f"warming the page cache: read every file at {warm(self.dir):.1f} GB/s")
        for section in sections:
            if section != "write":
                self.run_section(section)

    def run_section(self, section):
        log(f"== {section} (expected about {self.estimate(section):.0f} s)")
        start = time.perf_counter()
        getattr(self, f"section_{section}")()
        self.meta.setdefault("section_seconds", {})[section] = time.perf_counter() - start
        self.save()
        log(f"== {section}: {time.perf_counter() - start:.0f} s")


# ---------------------------------------------------------------------------------------------
# The table

ROW_ORDER = ["ws_raw", "ws_raw_staged", "ws_raw_mapped", "layout_tp1", "layout_tp2", "layout_tp8", "reload",
             "py_session_tp1", "py_session_tp2", "py_session_tp8", "py_load", "py_stream",
             "peer_safetensors", "peer_runai", "peer_runai_c32", "peer_runai_c64", "peer_fastsafetensors",
             "peer_fastsafetensors_buffered", "peer_fastsafetensors_unified", "peer_instanttensor",
             "peer_instanttensor_mmap", "peer_instanttensor_buffered", "cold_dd", "cold_ws_raw"]

PEER_KEYS = [k for k in ROW_ORDER if k.startswith("peer_")]


def rate(row):
    return row["bytes"] / row["seconds"] if row and "error" not in row and row.get("seconds") else None


def verdict(ok):
    return "met" if ok else "MISSED"


def markdown(state):
    meta, rows = state["meta"], state["rows"]
    facts = meta.get("checkpoint", {})
    total = facts.get("bytes") or 0
    pinned = meta.get("pinned_gbps")
    raw, cold_dd = rows.get("ws_raw"), rows.get("cold_dd")
    raw_rate, dd_rate = rate(raw), rate(cold_dd)
    lines = [
        f"GPU {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}; checkpoint {total / GB:.2f} GB of BF16 tensors "
        f"({facts.get('tensors', '?')} tensors, {facts.get('shards', '?')} shards, Llama-3-8B shape"
        f"{'' if meta.get('scale', 1) == 1 else ' / ' + str(meta.get('scale'))}, {meta.get('written_by', '?')}); "
        f"started {meta.get('started', '?')}.",
        "",
        "Baselines in the same run: pinned host-to-device copy "
        + (f"**{pinned:.1f} GB/s** (pageable {meta['pageable_gbps']:.1f}; 4 GiB, torch, CUDA events)" if pinned
           else f"not measured ({meta.get('pinned_error', 'baselines section not run')})")
        + "; O_DIRECT `dd` of every shard at once, cold: "
        + (f"**{dd_rate / GB:.2f} GB/s**" if dd_rate else "not measured") + ".",
        "",
        "Each row: the median of its runs, each run a fresh process; seconds are in-process (load call to the last "
        "byte on the device; weightstream's rows report its own `seconds`, from the arena allocation to the last copy, "
        "opening the checkpoint's headers (milliseconds) outside; for the reload, audit's reload seconds); wall is the "
        "whole process, imports and CUDA start included. GB/s is of the bytes placed (a tp rank's parameters). "
        "`raw ÷ this` is weightstream `load --raw` GB/s (warm, or cold for cold rows) over the row's.",
        "",
        "| contender | setting | cache | seconds | runs | wall s | GB placed | GB read | GB/s | vs pinned copy / vs dd | raw ÷ this |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key in ROW_ORDER + sorted(set(rows) - set(ROW_ORDER)):
        row = rows.get(key)
        if row is None:
            continue
        if "error" in row:
            lines.append(f"| {row['contender']} | {row['setting']} | {row['cache']} | failed: {row['error']} "
                         f"| | | | | | | |")
            continue
        r = rate(row)
        base = pinned if row["cache"] == "warm" else (dd_rate / GB if dd_rate else None)
        versus = f"{r / GB / base:.0%}" if base and key != "cold_dd" else ""
        cold_raw = rate(rows.get("cold_ws_raw"))
        reference = raw_rate if row["cache"] == "warm" else cold_raw
        partial = key in ("layout_tp2", "layout_tp8", "py_session_tp2", "py_session_tp8")
        ratio = f"{reference / r:.2f}x" if reference and not partial and key not in ("ws_raw", "cold_ws_raw") else ""
        setting = row["setting"] + (f" ({row['note']})" if row.get("note") else "")
        lines.append(f"| {row['contender']} | {setting} | {row['cache']} | {row['seconds']:.3f} | "
                     f"{', '.join(f'{s:.3f}' for s in row['runs'])} | {row['wall_seconds']:.1f} | "
                     f"{row['bytes'] / GB:.2f} | {row['bytes_read'] / GB:.2f} | {r / GB:.2f} | {versus} | {ratio} |")
    if any(k.startswith("peer_fastsafetensors") for k in rows):
        lines += ["", "fastsafetensors' other copier types need what this machine lacks: `gds` (cuFile; without it "
                  "the loader falls back to `nogds`), `fgds` (libfgds), `3fs` (a 3FS mount), `dstorage` (Windows)."]
    not_run = [k for k in ROW_ORDER if k not in rows]
    if not_run:
        lines += ["", f"Not run yet: {', '.join(not_run)}."]
    lines += ["", "### Targets", ""] + targets(state)
    return "\n".join(lines) + "\n"


def targets(state):
    meta, rows = state["meta"], state["rows"]
    total = meta.get("checkpoint", {}).get("bytes") or 1
    pinned = meta.get("pinned_gbps")
    raw = rows.get("ws_raw")
    raw_rate = rate(raw)
    out = []

    def line(issue, text, ok, detail):
        if ok is None:
            out.append(f"- issue {issue}: {text}: not measured ({detail})")
        else:
            out.append(f"- issue {issue}: {text}: **{verdict(ok)}** ({detail})")

    def missing(*keys):
        bad = [k for k in keys if rate(rows.get(k)) is None]
        return ", ".join(f"{k} {'failed' if k in rows else 'not run'}" for k in bad) if bad else None

    def ratio_target(issue, text, key, reference_key, reference_rate, floor):
        gap = missing(key, reference_key) if reference_key else missing(key)
        if gap or not reference_rate:
            line(issue, text, None, gap or "no baseline")
            return
        value = rate(rows[key]) / reference_rate
        line(issue, text, value >= floor, f"{value:.0%}" + ("" if value >= floor else f", short by {floor - value:.0%}"))

    # issue 34 (the GPU run's goals)
    if raw_rate and pinned:
        value = raw_rate / GB / pinned
        line(34, "warm `load --raw` >= 90% of the pinned copy", value >= 0.9,
             f"{raw_rate / GB:.2f} of {pinned:.1f} GB/s = {value:.0%}" + ("" if value >= 0.9 else f", short by {0.9 - value:.0%}"))
    else:
        line(34, "warm `load --raw` >= 90% of the pinned copy", None, missing("ws_raw") or "no pinned copy rate")
    ratio_target(34, "layout tp 1 >= 95% of the raw load", "layout_tp1", "ws_raw", raw_rate, 0.95)
    ratio_target(34, "Python `Checkpoint.stream()` >= 90% of the load", "py_stream", "ws_raw", raw_rate, 0.9)
    ratio_target(34, "cold `load --raw` >= 150% of O_DIRECT dd", "cold_ws_raw", "cold_dd", rate(rows.get("cold_dd")), 1.5)
    peers = [k for k in ROW_ORDER if k.startswith("peer_") and k in rows]
    lead = 1.15
    if not raw_rate:
        line(34, f"weightstream ahead of every peer setting by >= {lead:.2f}x", None, missing("ws_raw"))
    elif not peers:
        line(34, f"weightstream ahead of every peer setting by >= {lead:.2f}x", None, "peers section not run")
    else:
        out.append(f"- issue 34: weightstream `load --raw` ({raw_rate / GB:.2f} GB/s warm) against every peer "
                   f"setting, by ratio (the goal: >= {lead:.2f}x each):")
        ahead = True
        for k in peers:
            row = rows[k]
            r = rate(row)
            if r is None:
                out.append(f"  - {row['contender']}, {row['setting']}: failed ({row['error']}), not compared")
                continue
            ahead &= raw_rate >= lead * r
            out.append(f"  - {row['contender']}, {row['setting']}: {r / GB:.2f} GB/s, weightstream "
                       f"{raw_rate / r:.2f}x: {'met' if raw_rate >= lead * r else 'SHORT'}")
        failed = [k for k in peers if rate(rows[k]) is None]
        unmeasured = len(failed) + len(PEER_KEYS) - len(peers)
        detail = (f"{len(peers) - len(failed)} of {len(PEER_KEYS)} settings measured"
                  + (f", {len(failed)} failed" if failed else "")
                  + (f", {len(PEER_KEYS) - len(peers)} not run" if len(peers) < len(PEER_KEYS) else ""))
        closest = min((raw_rate / rate(rows[k]) for k in peers if rate(rows[k])), default=None)
        closest_text = f"closest {closest:.2f}x; " if closest is not None else "none measured yet; "
        if not ahead:
            line(34, f"weightstream ahead of every peer setting by >= {lead:.2f}x", False,
                 closest_text + detail)
        else:
            line(34, f"weightstream ahead of every peer setting by >= {lead:.2f}x", None if unmeasured else True,
                 closest_text + detail)
    # issue 16
    for key, label in (("layout_tp2", "layout tp 2 rank 1"), ("layout_tp8", "layout tp 8 rank 3"),
                       ("py_session_tp2", "Python LoadSession tp 2 rank 1"),
                       ("py_session_tp8", "Python LoadSession tp 8 rank 3")):
        text = f"{label}: time <= 1.25 x raw time x (bytes read / checkpoint bytes)"
        gap = missing(key, "ws_raw")
        if gap:
            line(16, text, None, gap)
            continue
        row = rows[key]
        bound = 1.25 * raw["seconds"] * row["bytes_read"] / total
        line(16, text, row["seconds"] <= bound, f"{row['seconds']:.3f} s against 1.25 x {raw['seconds']:.3f} x "
             f"{row['bytes_read'] / GB:.2f}/{total / GB:.2f} = {bound:.3f} s")
    ratio_target(16, "reload (audit, 8 shuffled batches) >= 80% of the raw rate", "reload", "ws_raw", raw_rate, 0.8)
    ratio_target(16, "Python LoadSession tp 1 >= 90% of the raw load's GB/s", "py_session_tp1", "ws_raw", raw_rate, 0.9)
    return out


# ---------------------------------------------------------------------------------------------


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        if len(sys.argv) != 4 or sys.argv[2] not in WORKERS:
            raise SystemExit(f"usage: gpu_bench.py --worker {{{','.join(WORKERS)}}} PARAMS_JSON")
        run_worker(sys.argv[2], json.loads(sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli", required=True, help="the weightstream binary")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for gpu_bench.json and .md")
    parser.add_argument("--dir", default="/tmp/ws-gpu-bench", help="the checkpoint (results so far: DIR.results.json)")
    parser.add_argument("--sections", default="all", help=f"comma-separated: {','.join(SECTIONS)} (default all)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (for a later invocation)")
    parser.add_argument("--python-site", default=None, help="PYTHONPATH holding the built weightstream package")
    parser.add_argument("--peer-site", default="/tmp/peer-site", help="PYTHONPATH of the peers' wheels (peers only)")
    parser.add_argument("--peers", default=None, help="only these peers: NAME (safetensors, runai, fastsafetensors, "
                        "instanttensor) or NAME_SETTING (runai_c64, instanttensor_mmap, ...), comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs per warm row (default 3)")
    parser.add_argument("--peer-repeats", type=int, default=None, help="runs per peer row (default --repeats)")
    parser.add_argument("--cold-repeats", type=int, default=3, help="runs per cold row (default 3)")
    parser.add_argument("--run-timeout", type=int, default=180, help="seconds one contender's process may take")
    parser.add_argument("--scale", type=int, default=1, help="divide the Llama-3-8B dimensions by this (1, 2, ... 32)")
    parser.add_argument("--device", default="cuda:0", help="where tensors go (cpu exercises the host paths)")
    args = parser.parse_args()
    sections = SECTIONS if args.sections == "all" else [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {', '.join(unknown)} (expected {', '.join(SECTIONS)} or all)")
    llama_config(args.scale)  # validates --scale
    sections = [s for s in SECTIONS if s in sections]  # in their order
    bench = Bench(args)
    try:
        bench.run(sections)
    finally:
        if not args.keep:
            shutil.rmtree(bench.dir, ignore_errors=True)
    bench.save()
    log(f"\nAll rows so far: {os.path.join(args.out, 'gpu_bench.md')} (and gpu_bench.json).\n")
    log("\n".join(targets(bench.state)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

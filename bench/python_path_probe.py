#!/usr/bin/env python3
"""Where the Python front ends' time goes against `weightstream load --raw` (issue 44).

Three contenders, each run in a FRESH process, interleaved (round k of each after round k of
the one before) over --rounds:
  cli      `weightstream load DIR --raw --device D --json`: the seconds it reports (arena
           allocation to last byte landed; the Checkpoint open and CUDA context are outside)
  load     weightstream.load(DIR, device=D, framework="torch"), as open() + Checkpoint.load()
  session  identity_layout(DIR, device=D) + LoadSession begin / load_checkpoint / finish, then
           a torch tensor per parameter (layout.tensors("torch"), one call into the core)
In `load` and `session`, torch is imported and CUDA initialised (gpu_bench's _torch_ready)
before the clock; it stops after torch.cuda.synchronize(). Phases (medians, seconds):
  load     open | core (the compiled load call, seen from Python) | core_lib (the library's
           own seconds inside it, as the CLI reports them; core - core_lib is what the call
           pays outside that timer: the library's first CUDA calls in the process, the list of
           tensors) | present (tensors to torch) | sync | again (a second whole load in the
           same process: what the first pays once per process)
  session  open | layout | begin (arena allocation and zeroing) | stream | finish | present | sync

Usage:
  bench/python_path_probe.py DIR --cli build-gpu/weightstream [--python-site build-gpu/python-site]
      [--rounds 5] [--device cuda:0] [--out out/gpu/python_path_probe.json]
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as gb  # noqa: E402 - the GPU bench's process and torch helpers
from bench_process import log  # noqa: E402

CONTENDERS = ("cli", "load", "session")
PHASES = {"cli": [], "load": ["open", "core", "core_lib", "present", "sync", "again"],
          "session": ["open", "layout", "begin", "stream", "finish", "present", "sync"]}


class TimedCore:
    """Stands in for a Checkpoint's compiled core: times its load() call and keeps the
    library's own stats where the core returns them (older cores return the list alone)."""

    def __init__(self, core):
        self.core, self.seconds, self.library_seconds = core, None, None

    def load(self, *args):
        start = time.perf_counter()
        result = self.core.load(*args)
        self.seconds = time.perf_counter() - start
        if isinstance(result, tuple):
            self.library_seconds = result[1].get("seconds")
        return result

    def __len__(self):
        return len(self.core)

    def __getattr__(self, name):
        return getattr(self.core, name)


def worker_load(p):
    torch = gb._torch_ready(p["device"])
    import weightstream

    marks = [time.perf_counter()]
    checkpoint = weightstream.open(p["dir"])
    marks.append(time.perf_counter())
    checkpoint._core = core = TimedCore(checkpoint._core)
    tensors = checkpoint.load(device=p["device"], framework="torch")
    marks.append(time.perf_counter())
    gb._sync(torch, p["device"])
    marks.append(time.perf_counter())
    count, size = len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())
    del tensors, checkpoint, core.core
    gc.collect()
    start = time.perf_counter()
    again = weightstream.load(p["dir"], device=p["device"], framework="torch")
    gb._sync(torch, p["device"])
    again_seconds = time.perf_counter() - start
    return {"seconds": marks[3] - marks[0], "tensors": count, "bytes": size, "open": marks[1] - marks[0],
            "core": core.seconds, "core_lib": core.library_seconds,
            "present": marks[2] - marks[1] - core.seconds, "sync": marks[3] - marks[2], "again": again_seconds}


def worker_session(p):
    torch = gb._torch_ready(p["device"])
    import weightstream
    marks = [time.perf_counter()]
    checkpoint = weightstream.open(p["dir"])
    marks.append(time.perf_counter())
    layout = weightstream.identity_layout(checkpoint, device=p["device"])
    marks.append(time.perf_counter())
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    marks.append(time.perf_counter())
    session.load_checkpoint(checkpoint)
    marks.append(time.perf_counter())
    session.finish()
    marks.append(time.perf_counter())
    tensors = layout.tensors("torch")
    marks.append(time.perf_counter())
    gb._sync(torch, p["device"])
    marks.append(time.perf_counter())
    phases = dict(zip(PHASES["session"], (b - a for a, b in zip(marks, marks[1:]))))
    return dict(phases, seconds=marks[-1] - marks[0], tensors=len(tensors),
                bytes=sum(t.numel() * t.element_size() for t in tensors.values()))


WORKERS = {"load": worker_load, "session": worker_session}


def run_contender(name, args):
    if name == "cli":
        command = [args.cli, "load", args.dir, "--raw", "--device", args.device, "--json", "--no-progress"]
        return gb.run_cli(command, args.timeout)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if args.python_site:
        env["PYTHONPATH"] = args.python_site
    params = json.dumps({"dir": args.dir, "device": args.device})
    process, wall = gb.run_process([sys.executable, os.path.abspath(__file__), "--worker", name, params], env,
                                   args.timeout)
    lines = [l for l in process.stdout.splitlines() if l.startswith(gb.RESULT_PREFIX)]
    if process.returncode != 0 or not lines:
        raise gb.Failed(gb.reason_of(process))
    return dict(json.loads(lines[-1][len(gb.RESULT_PREFIX):]), wall_seconds=wall)


def median(runs, key):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def markdown(summary):
    phases = list(dict.fromkeys(p for name in CONTENDERS for p in PHASES[name]))
    lines = ["| contender | seconds (median) | runs | " + " | ".join(phases) + " |",
             "|---|---|---|" + "---|" * len(phases)]
    for name in CONTENDERS:
        row = summary.get(name)
        if row is None or "error" in row:
            lines.append(f"| {name} | failed: {row and row['error']} | |" + " |" * len(phases))
            continue
        cells = [f"{row[p]:.4f}" if row.get(p) is not None else "" for p in phases]
        runs = " ".join(f"{s:.3f}" for s in row["runs"])
        lines.append(f"| {name} | {row['seconds']:.4f} | {runs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        print(gb.RESULT_PREFIX + json.dumps(WORKERS[sys.argv[2]](json.loads(sys.argv[3]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="the checkpoint directory (bench/gpu_bench.py's write section makes one)")
    parser.add_argument("--cli", required=True, help="the weightstream binary")
    parser.add_argument("--python-site", default=None, help="PYTHONPATH holding the built weightstream package")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each contender, interleaved (default 5)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--timeout", type=int, default=180, help="seconds one process may take")
    parser.add_argument("--out", default="python_path_probe.json", help="where the JSON goes")
    args = parser.parse_args()
    runs, failed = {name: [] for name in CONTENDERS}, {}
    for index in range(args.rounds):
        for name in CONTENDERS:
            if name in failed:
                continue
            try:
                result = run_contender(name, args)
            except gb.Failed as error:
                failed[name] = str(error)
                log(f"  round {index + 1}: {name}: failed: {error}")
                continue
            runs[name].append(result)
            phases = ", ".join(f"{p} {result[p]:.4f}" for p in PHASES[name] if result.get(p) is not None)
            log(f"  round {index + 1}: {name}: {result['seconds']:.4f} s ({result.get('bytes', 0) / 1e9:.2f} GB)"
                + (f"; {phases}" if phases else ""))
    summary = {}
    for name in CONTENDERS:
        if name in failed and not runs[name]:
            summary[name] = {"error": failed[name]}
            continue
        summary[name] = {"seconds": median(runs[name], "seconds"), "runs": [r["seconds"] for r in runs[name]],
                         "bytes": runs[name][0].get("bytes"), **{p: median(runs[name], p) for p in PHASES[name]}}
    table = markdown(summary)
    log("\n" + table)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as file:
        json.dump({"device": args.device, "dir": args.dir, "rounds": args.rounds, "summary": summary, "runs": runs,
                   "failed": failed, "markdown": table}, file, indent=1)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Delta updates against full updates of the same change, measured in one run (issue 46).

Writes a synthetic llama A of --size with `weightstream synth`, then B (A with a random
--changed fraction of every tensor's elements moved by one bit, scattered) and C (every element
of A changed), and for each transport runs, on a warm page cache:

  audit A --reload B --via T --json            the full update of B (the default)
  audit A --reload B --via T --delta --json    the delta A -> B (send --delta-from A)
  audit A --reload C --via T [--delta] --json  100% changed: the delta falls back to dense

Each audit compares every parameter with a cold load of its reload (must be clean). Reported:
the bytes the update moved (`reload_bytes`), the receiver's update time (START to REPORT,
`update_seconds`) and the whole exchange (`reload_seconds`: from spawning the sender, which
loads both checkpoints and hashes them for their content digests, to the receiver's end), with
each delta's ratio to the full update of the same checkpoint in the same run: medians of --runs
rounds, the four audits of a round run one after another (interleaved), and the load average.
A benchmark row, not a timed test: run it on a quiet machine.

    python3 bench/delta_bench.py --cli build/weightstream [--size 1GiB] [--changed 0.01] [--transports shm,tcp] [--runs 5]
"""
import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import tempfile

import numpy

ELEMENT_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}


def change_elements(directory, fraction, seed):
    """Flips the lowest bit of a random `fraction` of the elements of every tensor (every
    element when fraction is 1) in the shards of `directory`, in place."""
    random = numpy.random.default_rng(seed)
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(directory, name)
        with open(path, "rb") as file:
            (header_bytes,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(header_bytes))
        data = numpy.memmap(path, dtype=numpy.uint8, mode="r+")
        start = 8 + header_bytes
        for tensor, info in header.items():
            if tensor == "__metadata__":
                continue
            element = ELEMENT_BYTES[info["dtype"]]
            begin, end = info["data_offsets"]
            elements = (end - begin) // element
            if fraction >= 1:
                indices = numpy.arange(elements, dtype=numpy.int64)
            else:
                indices = random.choice(elements, int(elements * fraction), replace=False)
            data[start + begin + indices * element] ^= 1
        data.flush()
        del data


def audit(cli, base, reload, via, delta):
    command = [cli, "audit", base, "--reload", reload, "--via", via, "--json", "--no-progress"]
    if delta:
        command.append("--delta")
    report = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    assert report["clean"], report
    return report


def median_report(reports):
    """The reports' medians of the timed fields (bytes and tensors are the same in every run)."""
    result = dict(reports[0])
    for key in ("update_seconds", "reload_seconds"):
        result[key] = statistics.median(report[key] for report in reports)
    return result


def phases_line(label, via, reports):
    """The medians of where the receiver's update time went (UpdatePhases), over `reports`."""
    names = [name for name in reports[0]["update_phases"] if name != "first_bucket"]
    medians = {name: statistics.median(report["update_phases"][name] for report in reports) for name in names}
    shown = ", ".join(f"{name} {seconds:.3f}" for name, seconds in medians.items() if seconds >= 0.0005)
    checked = reports[0].get("checked_tensors")
    return f"- {label} via {via}: {shown} s" + (f"; {checked} tensors checked after it" if checked is not None else "")


def row(label, via, report, full):
    ratio = lambda key: report[key] / full[key] if full[key] else float("nan")  # noqa: E731
    how = f"{report.get('sparse_tensors', 0)} sparse / {report.get('dense_tensors', '-')} dense"
    return (f"| {label} | {via} | {report['reload_bytes'] / 1e6:.1f} MB ({ratio('reload_bytes'):.3f}x) | "
            f"{report['update_seconds']:.3f} s ({ratio('update_seconds'):.3f}x) | "
            f"{report['reload_seconds']:.3f} s ({ratio('reload_seconds'):.3f}x) | {how} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cli", default="build/weightstream")
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--changed", type=float, default=0.01)
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--scratch", default=None, help="folder for the three checkpoints (default: a temporary one)")
    args = parser.parse_args()
    scratch = args.scratch or tempfile.mkdtemp(prefix="delta-bench-")
    try:
        a, b, c = (os.path.join(scratch, name) for name in ("a", "b", "c"))
        subprocess.run([args.cli, "synth", a, "--arch", "llama", "--size", args.size, "--seed", "46"], check=True,
                       capture_output=True)
        for target, fraction in ((b, args.changed), (c, 1.0)):
            shutil.copytree(a, target)
            change_elements(target, fraction, 46)
        print(f"llama of {args.size}, {args.changed:.2%} of the elements changed (B) and all of them (C); "
              f"medians of {args.runs} interleaved rounds; ratios to the full update of the same checkpoint, same run; "
              f"load average before: {os.getloadavg()[0]:.2f}")
        print("| update | via | bytes moved | receiver's update time | whole exchange | tensors |")
        print("| --- | --- | ---: | ---: | ---: | --- |")
        phases = []
        for via in args.transports.split(","):
            rounds = {key: [] for key in ("full_b", "delta_b", "full_c", "delta_c")}
            for _ in range(args.runs):
                rounds["full_b"].append(audit(args.cli, a, b, via, delta=False))
                rounds["delta_b"].append(audit(args.cli, a, b, via, delta=True))
                rounds["full_c"].append(audit(args.cli, a, c, via, delta=False))
                rounds["delta_c"].append(audit(args.cli, a, c, via, delta=True))
            full_b, delta_b, full_c, delta_c = (median_report(rounds[key]) for key in rounds)
            print(row("full, B", via, full_b, full_b))
            print(row(f"delta, B ({args.changed:.0%} changed)", via, delta_b, full_b))
            print(row("full, C", via, full_c, full_c))
            print(row("delta, C (100% changed)", via, delta_c, full_c))
            phases += [phases_line("full, B", via, rounds["full_b"]), phases_line("delta, B", via, rounds["delta_b"])]
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        print("Where the receiver's update time went (medians, seconds):")
        print("\n".join(phases))
    finally:
        if not args.scratch:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()

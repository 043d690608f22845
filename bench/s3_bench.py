#!/usr/bin/env python3
"""S3 read throughput: `weightstream load s3://...` against the Run:ai model streamer and
against raw parallel `curl` range requests, on one checkpoint served on loopback, in one run.

The server is nginx serving the checkpoint's files on a path-style URL
(http://127.0.0.1:PORT/bench/ckpt/FILE), with a static ListObjectsV2 document for the
bucket; nginx ignores signatures, so it measures the clients, not an S3 implementation
(moto's server is far slower than any client and is used by the tests for correctness).

  raw curl       one curl process with N transfers in parallel (--parallel), one 16 MiB
                 range each, bodies discarded: the endpoint's rate with no checkpoint logic.
  curl kept      the same, each body written to a file in a fresh tmpfs folder (/dev/shm),
                 timed until the folder is removed again: what curl pays to keep the bytes
                 in fresh memory and give it back, as a loader's arena does.
  weightstream   `weightstream load s3://bench/ckpt --json`: list, read the headers, stream
                 every tensor into host memory (wall time of the whole command); and
                 `weightstream digest --hash xxh64`, which streams through the bounded staging
                 pool instead of landing in a fresh 1 GiB arena (no page faults to pay).
  runai          the Run:ai streamer's native engine (libstreamer with its S3 plugin, from
                 the PyPI wheels runai-model-streamer and runai-model-streamer-s3) reading
                 every tensor's bytes into host memory. Its Python wrapper imports torch,
                 which this machine lacks, so the wheels are installed with --no-deps and
                 the engine is driven through its ctypes layer, as its wrapper does.

Usage: python3 bench/s3_bench.py [--size 1GiB] [--cli build/weightstream] [--runs 3]
                                 [--concurrency 16] [--results bench/HISTORY.md]
Needs: nginx (Debian nginx-light), curl; pip wheels as above (installed into
WORKDIR/site with --no-deps on first use, unless --skip-runai).
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


def make_checkpoint(cli, root, size):
    ckpt = root / "bench" / "ckpt"
    marker = ckpt / ".size"
    if marker.exists() and marker.read_text() == str(size):
        return ckpt
    shutil.rmtree(ckpt, ignore_errors=True)
    subprocess.run([cli, "synth", str(ckpt), "--size", str(size), "--shards", "4", "--seed", "1"], check=True,
                   stdout=subprocess.DEVNULL)
    marker.write_text(str(size))
    return ckpt


def write_listing(ckpt, path):
    files = sorted(p for p in ckpt.iterdir() if not p.name.startswith("."))
    contents = "".join("<Contents><Key>ckpt/%s</Key><Size>%d</Size></Contents>" % (p.name, p.stat().st_size)
                       for p in files)
    path.write_text('<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>bench</Name>'
                    "<Prefix>ckpt/</Prefix><IsTruncated>false</IsTruncated>%s</ListBucketResult>" % contents)
    return files


def start_nginx(workdir, root, listing, port):
    conf = workdir / "nginx.conf"
    user = "user root;\n" if os.geteuid() == 0 else ""
    conf.write_text(f"""{user}worker_processes 2;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  sendfile on;
  tcp_nopush on;
  keepalive_requests 1000000;
  client_body_temp_path {workdir}/tmp-body;
  proxy_temp_path {workdir}/tmp-proxy;
  fastcgi_temp_path {workdir}/tmp-fastcgi;
  uwsgi_temp_path {workdir}/tmp-uwsgi;
  scgi_temp_path {workdir}/tmp-scgi;
  server {{
    listen 127.0.0.1:{port};
    root {root};
    location = /bench {{ default_type application/xml; alias {listing}; }}
    location / {{ default_type application/octet-stream; }}
  }}
}}
""")
    process = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(workdir)], stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    sys.exit("nginx did not start (see %s/nginx-error.log)" % workdir)


def tensor_ranges(path):
    """(offset, size) of every tensor of a safetensors file."""
    with open(path, "rb") as f:
        header_length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_length))
    header.pop("__metadata__", None)
    base = 8 + header_length
    return sorted((base + e["data_offsets"][0], e["data_offsets"][1] - e["data_offsets"][0]) for e in header.values())


def run_raw_curl(endpoint, files, concurrency, workdir, keep_in=None):
    """One curl process, `concurrency` transfers at once (--parallel), one 16 MiB range each;
    bodies discarded, or kept as files in a fresh folder under `keep_in` (a tmpfs), removed
    again inside the timing."""
    keep = Path(tempfile.mkdtemp(prefix="ws-s3-bench-", dir=keep_in)) if keep_in else None
    entries = []
    for path in files:
        size = path.stat().st_size
        for offset in range(0, size, REQUEST):
            output = keep / ("%s-%d" % (path.name, offset)) if keep else "/dev/null"
            entries.append('url = "%s/bench/ckpt/%s"\nrange = "%d-%d"\noutput = "%s"\nfail\n' % (
                endpoint, path.name, offset, min(size, offset + REQUEST) - 1, output))
    config = workdir / ("curl-kept.conf" if keep else "curl-ranges.conf")
    config.write_text("next\n".join(entries))
    start = time.monotonic()
    try:
        subprocess.run(["curl", "--parallel", "--parallel-immediate", "--parallel-max", str(concurrency), "-s", "-K",
                        str(config)], check=True)
    finally:
        if keep:
            shutil.rmtree(keep)
    return time.monotonic() - start


def memory_folder():
    """/dev/shm where it is a tmpfs with room for the bodies, else None (the row is skipped)."""
    try:
        with open("/proc/mounts") as mounts:
            return "/dev/shm" if any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts) else None
    except OSError:
        return None


def run_weightstream(cli, endpoint, concurrency):
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, WEIGHTSTREAM_S3_UNSIGNED="1", AWS_REGION="us-east-1",
               WEIGHTSTREAM_CONCURRENCY=str(concurrency), WEIGHTSTREAM_S3_CONNECTIONS=str(max(concurrency, 16)))
    start = time.monotonic()
    result = subprocess.run([cli, "load", "s3://bench/ckpt", "--json", "--no-progress"], env=env, check=True,
                            capture_output=True, text=True)
    elapsed = time.monotonic() - start
    return elapsed, json.loads(result.stdout)


def run_weightstream_digest(cli, endpoint, concurrency):
    """Streams every tensor through the bounded staging pool into xxh64: no arena to fault in."""
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, WEIGHTSTREAM_S3_UNSIGNED="1", AWS_REGION="us-east-1",
               WEIGHTSTREAM_CONCURRENCY=str(concurrency), WEIGHTSTREAM_S3_CONNECTIONS=str(max(concurrency, 16)))
    start = time.monotonic()
    subprocess.run([cli, "digest", "s3://bench/ckpt", "--hash", "xxh64", "--no-progress"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return time.monotonic() - start


RUNAI_DRIVER = r"""
import os, sys, time, types, json
site = sys.argv[1]
sys.path.insert(0, site)
# The package's __init__ imports torch (absent here); load its engine modules without it.
package = types.ModuleType("runai_model_streamer")
package.__path__ = [os.path.join(site, "runai_model_streamer")]
sys.modules["runai_model_streamer"] = package
import numpy as np
from runai_model_streamer.libstreamer import libstreamer as ls
from runai_model_streamer.s3_utils.s3_utils import S3Credentials
jobs = json.loads(sys.argv[2])  # [[uri, [[offset, size], ...]], ...]
start = time.monotonic()
streamer = ls.runai_start()
ls.runai_set_credentials(streamer, S3Credentials("bench", "bench", None, "us-east-1", os.environ["AWS_ENDPOINT_URL"]))
buffers, paths, counts, offsets, sizes, dsts = [], [], [], [], [], []
for uri, ranges in jobs:
    total = sum(size for _, size in ranges)
    buffer = np.empty(total, dtype=np.uint8)
    buffers.append(buffer)
    address, position = buffer.ctypes.data, 0
    paths.append(uri)
    counts.append(len(ranges))
    for offset, size in ranges:
        offsets.append(offset); sizes.append(size); dsts.append(address + position); position += size
ls.runai_request(streamer, paths, counts, offsets, sizes, dsts)
done = 0
while done < len(sizes):
    response = ls.runai_response(streamer, 600000)
    if response is None:
        break
    if response[0] != 0:
        sys.exit("runai streamer error: " + ls.runai_response_str(response[0]))
    done += 1
elapsed = time.monotonic() - start
ls.runai_end(streamer)
print(json.dumps({"seconds": elapsed, "ranges": done, "bytes": int(sum(sizes))}))
"""


def ensure_runai(site):
    if (site / "runai_model_streamer" / "libstreamer" / "lib" / "libstreamers3.so").exists():
        return True
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                             "--target", str(site), "runai-model-streamer==0.17.1",
                             "runai-model-streamer-s3==0.17.1"])
    return result.returncode == 0


def run_runai(site, endpoint, files, concurrency):
    jobs = [["s3://bench/ckpt/" + p.name, tensor_ranges(p)] for p in files if p.suffix == ".safetensors"]
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
               AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
               RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0", RUNAI_STREAMER_CONCURRENCY=str(concurrency),
               RUNAI_STREAMER_LOG_LEVEL="WARNING")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", RUNAI_DRIVER, str(site), json.dumps(jobs)], env=env,
                            capture_output=True, text=True)
    elapsed = time.monotonic() - start
    if result.returncode != 0:
        raise RuntimeError("runai driver failed: " + (result.stderr or result.stdout)[-2000:])
    return elapsed, json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description="S3 read throughput on loopback")
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--cli", default=str(ROOT / "build" / "weightstream"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ws-s3-bench"))
    parser.add_argument("--skip-runai", action="store_true")
    parser.add_argument("--results", help="append the table to this Markdown file")
    args = parser.parse_args()

    workdir = Path(args.workdir)
    root = workdir / "root"
    root.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(args.cli, root, parse_size(args.size))
    files = write_listing(ckpt, workdir / "list.xml")
    total = sum(p.stat().st_size for p in files)
    tensor_bytes = sum(size for p in files if p.suffix == ".safetensors" for _, size in tensor_ranges(p))
    port = free_port()
    nginx = start_nginx(workdir, root, workdir / "list.xml", port)
    endpoint = "http://127.0.0.1:%d" % port
    site = workdir / "site"
    have_runai = not args.skip_runai and ensure_runai(site)
    rows = {"raw parallel curl": [], "parallel curl, bodies kept in tmpfs": [], "weightstream load": [],
            "weightstream digest (xxh64)": [], "runai streamer": []}
    keep_in = memory_folder()
    try:
        # Correctness first: the digests over S3 equal those of the local files.
        env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, WEIGHTSTREAM_S3_UNSIGNED="1")
        s3_digest = subprocess.run([args.cli, "digest", "s3://bench/ckpt", "--hash", "xxh64"], env=env,
                                   capture_output=True, text=True, check=True).stdout
        local_digest = subprocess.run([args.cli, "digest", str(ckpt), "--hash", "xxh64"], capture_output=True,
                                      text=True, check=True).stdout
        assert sorted(s3_digest.splitlines()) == sorted(local_digest.splitlines()), "digests over S3 differ"
        for run in range(args.runs):
            # Interleaved, so that a slow moment of this shared machine hits every client alike.
            rows["raw parallel curl"].append(total / run_raw_curl(endpoint, files, args.concurrency, workdir))
            if keep_in:
                rows["parallel curl, bodies kept in tmpfs"].append(
                    total / run_raw_curl(endpoint, files, args.concurrency, workdir, keep_in))
            seconds, report = run_weightstream(args.cli, endpoint, args.concurrency)
            assert report["bytes"] == tensor_bytes
            rows["weightstream load"].append(tensor_bytes / seconds)
            rows["weightstream digest (xxh64)"].append(
                tensor_bytes / run_weightstream_digest(args.cli, endpoint, args.concurrency))
            if have_runai:
                seconds, report = run_runai(site, endpoint, files, args.concurrency)
                assert report["bytes"] == tensor_bytes
                rows["runai streamer"].append(tensor_bytes / seconds)
    finally:
        nginx.send_signal(signal.SIGQUIT)
        nginx.wait(timeout=20)

    curl = statistics.median(rows["raw parallel curl"])
    lines = ["| client | median GB/s | runs (GB/s) | vs raw curl | vs runai |", "| --- | --- | --- | --- | --- |"]
    runai = statistics.median(rows["runai streamer"]) if rows["runai streamer"] else None
    for name, rates in rows.items():
        if not rates:
            lines.append("| %s | not run | | | |" % name)
            continue
        median = statistics.median(rates)
        lines.append("| %s | %.2f | %s | %.0f%% | %s |" % (
            name, median / 1e9, ", ".join("%.2f" % (r / 1e9) for r in rates), 100 * median / curl,
            "%.2fx" % (median / runai) if runai else "-"))
    header = ("checkpoint: %s in %d files (%s of tensors), nginx on loopback, concurrency %d, %d runs, %s" % (
        args.size, len(files), "%.2f GB" % (tensor_bytes / 1e9), args.concurrency, args.runs,
        time.strftime("%Y-%m-%d")))
    print(header)
    print("\n".join(lines))
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n### %s\n\n%s\n\n%s\n" % (time.strftime("%Y-%m-%d %H:%M"), header, "\n".join(lines)))


if __name__ == "__main__":
    main()

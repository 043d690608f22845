#!/usr/bin/env python3
"""A legitimate pull while strangers hold a serving peer's listener (issue 45): the time of
`load peer://` from a `weightstream serve` in another network namespace, undisturbed, and
then while another process holds 200 idle connections (connected, silent) and 65 half-open
ones (a frame header cut short, then silence) to the same listener, each reopened as soon as
the server drops it. Goal: the disturbed pull within 2x of the undisturbed one. Runs are
interleaved (undisturbed, disturbed, ...); the table gives each run and the medians.

Two namespaces joined by a veth pair (192.0.2.1 serves, 192.0.2.2 pulls and abuses), UCX
held to tcp, as bench/peer_bench.py. Needs root.

    python3 bench/listener_abuse_bench.py --cli build/weightstream --checkpoint /tmp/peer1g --repeat 3
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_bench import SERVER, Namespaces, run  # noqa: E402

TOKEN = uuid.uuid4().hex

# Runs in the pulling namespace: holds `idle` silent connections and `partial` ones that sent
# 6 bytes of a 16-byte frame header, reopening each one the server closes, until SIGTERM.
ABUSER = r"""
import selectors, socket, sys, time
host, port, idle, partial = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
selector = selectors.DefaultSelector()
opened = dropped = 0
def open_one(kind):
    global opened
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            time.sleep(0.01)
    if kind == "partial":
        sock.sendall(b"WSPE\x01\x00")
    sock.setblocking(False)
    selector.register(sock, selectors.EVENT_READ, kind)
    opened += 1
for kind, count in (("idle", idle), ("partial", partial)):
    for _ in range(count):
        open_one(kind)
print("holding", flush=True)
while True:
    for key, _ in selector.select(timeout=1):
        try:
            data = key.fileobj.recv(4096)
        except OSError:
            data = b""
        if not data:
            selector.unregister(key.fileobj)
            key.fileobj.close()
            dropped += 1
            open_one(key.data)
"""


def pull_seconds(namespace, cli, address, env):
    started = time.monotonic()
    result = subprocess.run(["ip", "netns", "exec", namespace, cli, "load", f"peer://{address}", "--json",
                             "--no-progress", "--token-stdin"], input=TOKEN + "\n", capture_output=True,
                            text=True, env=env, timeout=600)
    elapsed = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"pull failed: {result.stderr}")
    report = json.loads(result.stdout)
    return elapsed, report["bytes_from_peers"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cli", default="build/weightstream")
    parser.add_argument("--checkpoint", default="/tmp/ws-listener-abuse")
    parser.add_argument("--size", default="1GiB", help="synth size when --checkpoint does not exist")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--idle", type=int, default=200)
    parser.add_argument("--partial", type=int, default=65)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cli = os.path.abspath(args.cli)
    if not os.path.exists(os.path.join(args.checkpoint, "config.json")):
        run(cli, "synth", args.checkpoint, "--arch", "llama", "--size", args.size, "--shards", "2", "--seed", "1")
    env = dict(os.environ, UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n")
    namespaces = Namespaces()
    server = None
    abuser = None
    try:
        server = subprocess.Popen(
            ["ip", "netns", "exec", namespaces.server, cli, "serve", args.checkpoint, "--listen", f"{SERVER}:0",
             "--token-stdin", "--no-progress"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        server.stdin.write(TOKEN + "\n")
        server.stdin.close()
        line = server.stdout.readline()
        address = line.split("peer://")[1].split()[0]
        port = address.rsplit(":", 1)[1]
        rows = {"undisturbed": [], "disturbed": []}
        size = 0
        pull_seconds(namespaces.puller, cli, address, env)  # warm: page cache, first connection
        for _ in range(args.repeat):
            seconds, size = pull_seconds(namespaces.puller, cli, address, env)
            rows["undisturbed"].append(seconds)
            abuser = subprocess.Popen(["ip", "netns", "exec", namespaces.puller, sys.executable, "-c", ABUSER, SERVER,
                                       port, str(args.idle), str(args.partial)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if abuser.stdout.readline().strip() != "holding":
                raise SystemExit(f"the abusing process did not start: {abuser.stderr.read()}")
            seconds, _ = pull_seconds(namespaces.puller, cli, address, env)
            rows["disturbed"].append(seconds)
            abuser.send_signal(signal.SIGTERM)
            abuser.wait()
            abuser = None
        undisturbed = statistics.median(rows["undisturbed"])
        disturbed = statistics.median(rows["disturbed"])
        result = {"bytes": size, "idle": args.idle, "partial": args.partial, "runs": rows,
                  "undisturbed_median_s": undisturbed, "disturbed_median_s": disturbed,
                  "ratio": disturbed / undisturbed, "goal": 2.0}
        if args.json:
            print(json.dumps(result, indent=2))
        print(f"| pull of {size / 1e9:.2f} GB | runs (s) | median s | GB/s |")
        print("| --- | --- | ---: | ---: |")
        for name, label in (("undisturbed", "undisturbed"),
                            ("disturbed", f"{args.idle} idle + {args.partial} half-open connections held")):
            median = statistics.median(rows[name])
            print(f"| {label} | {', '.join(f'{s:.3f}' for s in rows[name])} | {median:.3f} | {size / median / 1e9:.2f} |")
        print(f"\ndisturbed / undisturbed: {disturbed / undisturbed:.2f}x (goal <= 2x: "
              f"{'met' if disturbed / undisturbed <= 2 else 'missed'})")
    finally:
        if abuser is not None:
            abuser.kill()
            abuser.wait()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
        namespaces.close()


if __name__ == "__main__":
    main()

"""Peers across two network namespaces (issue 31): `weightstream serve` ranks in one
namespace, `export peer://...` in the other, joined by a veth pair with addresses from the
documentation range 192.0.2.0/24. UCX is held to its tcp transport (UCX_TLS=tcp), so the
bytes cross the veth as they would cross hosts. Needs root and network namespaces; skips
with a one-line reason otherwise. The namespaces get unique names and are removed at the end.
"""
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import time
import uuid

import pytest
from conftest import CLI, cold_load, parameter_bytes, requires_cli

pytestmark = requires_cli

SERVER_ADDRESS = "192.0.2.1"
PULLER_ADDRESS = "192.0.2.2"
TOKEN = "peer-token-" + uuid.uuid4().hex[:12]
ENV = dict(os.environ, UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n")


def run(*arguments, check=True):
    return subprocess.run(list(arguments), check=check, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def namespaces():
    if os.geteuid() != 0:
        pytest.skip("network namespace tests need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's ip command is not installed")
    tag = f"ws{os.getpid() % 100000}{uuid.uuid4().hex[:3]}"
    server, puller = f"{tag}s", f"{tag}p"
    try:
        run("ip", "netns", "add", server)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"the kernel refuses network namespaces: {error.stderr.strip()}")
    try:
        run("ip", "netns", "add", puller)
        run("ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        run("ip", "link", "set", f"{tag}a", "netns", server)
        run("ip", "link", "set", f"{tag}b", "netns", puller)
        run("ip", "-n", server, "addr", "add", f"{SERVER_ADDRESS}/24", "dev", f"{tag}a")
        run("ip", "-n", puller, "addr", "add", f"{PULLER_ADDRESS}/24", "dev", f"{tag}b")
        for namespace, device in ((server, f"{tag}a"), (puller, f"{tag}b")):
            run("ip", "-n", namespace, "link", "set", device, "up")
            run("ip", "-n", namespace, "link", "set", "lo", "up")
        yield server, puller
    finally:
        for namespace in (server, puller):
            run("ip", "netns", "del", namespace, check=False)


def in_namespace(namespace):
    """The command prefix that runs in `namespace` (None: this one, on loopback)."""
    return ["ip", "netns", "exec", namespace] if namespace else []


class Server:
    """A `weightstream serve` process in a namespace (None: on loopback here); stopped on exit."""

    def __init__(self, namespace, checkpoint, *flags, token=TOKEN):
        host = SERVER_ADDRESS if namespace else "127.0.0.1"
        self.process = subprocess.Popen(
            [*in_namespace(namespace), CLI, "serve", str(checkpoint), "--listen", f"{host}:0",
             "--token-stdin", "--no-progress", *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        self.process.stdin.write(token + "\n")
        self.process.stdin.close()
        line = self.process.stdout.readline()
        match = re.search(r"peer://(\S+)", line)
        if not match and self.process.wait(timeout=60) != 0:
            err = self.process.stderr.read()
            if "build with UCX" in err:
                pytest.skip("this build has no UCX (WS_WITH_UCX)")
        assert match, f"serve printed {line!r}; stderr: {self.process.stderr.read()}"
        self.line = line
        self.address = match.group(1)

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return self.line + self.process.stdout.read() + self.process.stderr.read()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def pull(namespace, uri, output, *flags, token=TOKEN, env=ENV):
    return subprocess.run(
        [*in_namespace(namespace), CLI, "export", uri, str(output), "--json", "--token-stdin", "--no-progress",
         "--peer-timeout", "20", *flags],
        input=token + "\n", capture_output=True, text=True, env=env, timeout=300)


def digests(path):
    return run(CLI, "digest", str(path), "--hash", "xxh64").stdout


def expected_export(checkpoint, output, *flags):
    run(CLI, "export", str(checkpoint), str(output), "--no-progress", *flags)
    return digests(output)


def synth(path, *flags):
    run(CLI, "synth", str(path), *flags)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("peers") / "llama", "--arch", "llama", "--layers", "2", "--hidden", "256",
                 "--seed", "3")


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """A llama whose embeddings (16 MiB, 32 digest pieces) are more than the sockets buffer:
    the pull's test hook pauses in the middle of reading them, the peer still sending."""
    return synth(tmp_path_factory.mktemp("peers") / "wide-llama", "--arch", "llama", "--layers", "1", "--hidden",
                 "512", "--vocab", "16384", "--seed", "3")


def tp_flags(size, rank):
    return ["--tp-size", str(size), "--tp-rank", str(rank)]


def test_serving_tp2_feeds_a_tp2_puller_across_namespaces(namespaces, llama, tmp_path):
    server_ns, puller_ns = namespaces
    with Server(server_ns, llama, *tp_flags(2, 0)) as rank0, Server(server_ns, llama, *tp_flags(2, 1)) as rank1:
        assert rank0.address.startswith(SERVER_ADDRESS + ":")
        uri = f"peer://{rank0.address},{rank1.address}"
        for rank in range(2):
            result = pull(puller_ns, uri, tmp_path / f"pulled{rank}.safetensors", *tp_flags(2, rank))
            assert result.returncode == 0, result.stderr
            report = json.loads(result.stdout)
            assert report["bytes_read"] == 0
            assert report["bytes_from_peers"] >= report["bytes"] > 0
            assert report["bytes_in_place"] > 0
            assert report["source"] == uri
            assert digests(tmp_path / f"pulled{rank}.safetensors") == \
                expected_export(llama, tmp_path / f"expected{rank}.safetensors", *tp_flags(2, rank))
            assert TOKEN not in result.stdout + result.stderr
        audit = subprocess.run(
            ["ip", "netns", "exec", puller_ns, CLI, "audit", uri, "--json", "--token-stdin", "--no-progress",
             *tp_flags(2, 1)], input=TOKEN + "\n", capture_output=True, text=True, env=ENV, timeout=300)
        assert audit.returncode == 0, audit.stderr
        report = json.loads(audit.stdout)
        assert report["clean"] is True and report["mismatched"] == 0 and report["address_changes"] == 0
        logs = rank0.stop() + rank1.stop()
    assert TOKEN not in logs


def test_serving_tp4_feeds_a_tp2_puller(namespaces, llama, tmp_path):
    server_ns, puller_ns = namespaces
    servers = [Server(server_ns, llama, *tp_flags(4, rank)) for rank in range(4)]
    try:
        uri = "peer://" + ",".join(server.address for server in servers)
        for rank in range(2):
            result = pull(puller_ns, uri, tmp_path / f"pulled{rank}.safetensors", *tp_flags(2, rank))
            assert result.returncode == 0, result.stderr
            assert json.loads(result.stdout)["bytes_read"] == 0
            assert digests(tmp_path / f"pulled{rank}.safetensors") == \
                expected_export(llama, tmp_path / f"expected{rank}.safetensors", *tp_flags(2, rank))
    finally:
        for server in servers:
            server.stop()


def test_fp8_block_moe_at_tp2_with_ep(namespaces, tmp_path):
    server_ns, puller_ns = namespaces
    checkpoint = synth(tmp_path / "moe", "--arch", "deepseek_v3", "--layers", "2", "--hidden", "256",
                       "--quantize", "fp8-block", "--experts", "4", "--seed", "5")
    layouts = [["--tp-size", "2", "--tp-rank", str(rank), "--ep-size", "2", "--ep-rank", str(rank)] for rank in range(2)]
    servers = [Server(server_ns, checkpoint, *flags) for flags in layouts]
    try:
        uri = "peer://" + ",".join(server.address for server in servers)
        for rank, flags in enumerate(layouts):
            result = pull(puller_ns, uri, tmp_path / f"pulled{rank}.safetensors", *flags)
            assert result.returncode == 0, result.stderr
            assert json.loads(result.stdout)["bytes_read"] == 0
            assert digests(tmp_path / f"pulled{rank}.safetensors") == \
                expected_export(checkpoint, tmp_path / f"expected{rank}.safetensors", *flags)
    finally:
        for server in servers:
            server.stop()


def test_a_wrong_token_is_refused_and_never_printed(namespaces, llama, tmp_path):
    server_ns, puller_ns = namespaces
    with Server(server_ns, llama) as server:
        result = pull(puller_ns, f"peer://{server.address}", tmp_path / "out.safetensors", token="wrong-" + TOKEN[::-1])
        logs = server.stop()
    assert result.returncode == 1
    # The server proves first: the puller finds it cannot, and sends nothing derived from its token.
    assert f"peer {server.address} could not prove the token" in result.stderr
    assert TOKEN not in result.stdout + result.stderr + logs
    assert TOKEN[::-1] not in result.stdout + result.stderr + logs


# The peer protocol's handshake (src/net/handshake.hpp), written again from its
# description: the server proves the token first, then this side; the token is never sent.
HANDSHAKE = (
    "token = sys.argv[2].encode()\n"
    "label = b'weightstream peer protocol 6\\0'\n"
    "client_nonce = os.urandom(32)\n"
    "frame(0x4801, client_nonce)\n"
    "challenge = answer()\n"
    "server_nonce, server_proof = challenge[1:33], challenge[33:65]\n"
    "mac = lambda role: hmac.new(token, label + client_nonce + server_nonce + role, hashlib.sha256).digest()\n"
    "assert challenge[0] == 0 and hmac.compare_digest(server_proof, mac(b'server')), 'the server cannot prove it'\n"
    "frame(0x4803, mac(b'client'))\n"
    "assert answer()[0] == 1, 'refused'\n")


def manifest_of(namespace, address):
    """The manifest a server publishes, fetched over its control protocol from `namespace`."""
    script = (
        "import hashlib, hmac, json, os, socket, struct, sys\n"
        "host, port = sys.argv[1].rsplit(':', 1)\n"
        "s = socket.create_connection((host, int(port)), timeout=20)\n"
        "def exact(n):\n"
        "    data = b''\n"
        "    while len(data) < n:\n"
        "        chunk = s.recv(n - len(data))\n"
        "        assert chunk\n"
        "        data += chunk\n"
        "    return data\n"
        "def frame(kind, body):\n"
        "    s.sendall(struct.pack('<IHHQ', 0x45505357, 6, kind, len(body)) + body)\n"
        "def answer():\n"
        "    magic, version, kind, length = struct.unpack('<IHHQ', exact(16))\n"
        "    return exact(length)\n"
        + HANDSHAKE +
        "frame(1, b'{}')\n"
        "sys.stdout.write(answer().decode())\n")
    out = subprocess.run(["ip", "netns", "exec", namespace, "python3", "-c", script, address, TOKEN],
                         check=True, capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)


def test_a_flipped_byte_in_a_served_parameter_fails_the_pull_naming_it(namespaces, llama, tmp_path):
    server_ns, puller_ns = namespaces
    with Server(server_ns, llama) as server:
        manifest = manifest_of(puller_ns, server.address)
        target = next(p for p in manifest["parameters"] if p["name"] == "model.layers.1.mlp.down_proj.weight")
        # The serve process's own memory, changed behind its back (as root, through /proc).
        serve_pid = int(run("pgrep", "-P", str(server.process.pid)).stdout.split()[0]) \
            if run("pgrep", "-P", str(server.process.pid), check=False).stdout.strip() else server.process.pid
        with open(f"/proc/{serve_pid}/mem", "r+b", buffering=0) as memory:
            memory.seek(target["remote_address"] + 100)
            byte = memory.read(1)
            memory.seek(target["remote_address"] + 100)
            memory.write(bytes([byte[0] ^ 0x01]))
        result = pull(puller_ns, f"peer://{server.address}", tmp_path / "out.safetensors")
    assert result.returncode == 1
    assert "model.layers.1.mlp.down_proj.weight" in result.stderr
    assert "does not match its digest" in result.stderr
    assert server.address in result.stderr


def test_a_peer_killed_while_a_pull_waits_for_its_manifest_falls_back_or_fails_in_time(namespaces, llama, tmp_path):
    server_ns, puller_ns = namespaces
    expected = expected_export(llama, tmp_path / "expected.safetensors")
    for fallback in (True, False):
        server = Server(server_ns, llama)
        # Stopped, it accepts the puller's connection (the kernel does) but never answers:
        # the pull is then under way, waiting on the peer, when the peer is killed.
        server.process.send_signal(signal.SIGSTOP)
        for child in run("pgrep", "-P", str(server.process.pid), check=False).stdout.split():
            os.kill(int(child), signal.SIGSTOP)
        flags = ["--fallback", str(llama)] if fallback else []
        started = time.monotonic()
        puller = subprocess.Popen(
            ["ip", "netns", "exec", puller_ns, CLI, "export", f"peer://{server.address}", str(tmp_path / "out.safetensors"),
             "--json", "--token-stdin", "--no-progress", "--peer-timeout", "20", *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        puller.stdin.write(TOKEN + "\n")
        puller.stdin.close()
        port = server.address.rsplit(":", 1)[1]
        for _ in range(600):  # until the puller's connection is established (bounded)
            if f":{port}" in run("ip", "netns", "exec", server_ns, "ss", "-tn", "state", "established").stdout:
                break
            time.sleep(0.05)
        for child in run("pgrep", "-P", str(server.process.pid), check=False).stdout.split():
            os.kill(int(child), signal.SIGKILL)
        server.process.kill()
        server.process.wait()
        puller.wait(timeout=120)
        out, err = puller.stdout.read(), puller.stderr.read()
        elapsed = time.monotonic() - started
        if fallback:
            assert puller.returncode == 0, err
            report = json.loads(out)
            assert report["bytes_read"] > 0 and report["bytes_from_peers"] == 0
            assert "peer_failure" in report and server.address in report["peer_failure"]
            assert digests(tmp_path / "out.safetensors") == expected
        else:
            assert puller.returncode == 1
            assert server.address in err and "no storage fallback given" in err
            assert elapsed < 60
        (tmp_path / "out.safetensors").unlink(missing_ok=True)


def test_a_peer_killed_mid_transfer_falls_back_to_storage_or_fails_naming_it(namespaces, wide_llama, tmp_path):
    """The server is killed while the bytes move: the puller stops itself in the middle of
    reading the embeddings, one piece landed and the others in flight
    (WEIGHTSTREAM_TEST_PULL_STOP_AFTER, a test hook), the test sees it stopped (waitpid WUNTRACED: no timing), kills the server
    with SIGKILL and lets the puller go on into a dead peer."""
    server_ns, puller_ns = namespaces
    expected = expected_export(wide_llama, tmp_path / "expected.safetensors")
    for fallback in (True, False):
        server = Server(server_ns, wide_llama)
        flags = ["--fallback", str(wide_llama)] if fallback else []
        puller = subprocess.Popen(
            ["ip", "netns", "exec", puller_ns, CLI, "export", f"peer://{server.address}", str(tmp_path / "out.safetensors"),
             "--json", "--token-stdin", "--no-progress", "--peer-timeout", "20", *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(ENV, WEIGHTSTREAM_TEST_PULL_STOP_AFTER="1"))
        try:
            puller.stdin.write(TOKEN + "\n")
            puller.stdin.close()
            _, status = os.waitpid(puller.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status), f"the puller ended before the transfer was under way: {puller.stderr.read()}"
            server.process.kill()
            server.process.wait()
            resumed = time.monotonic()
            os.kill(puller.pid, signal.SIGCONT)
            puller.wait(timeout=120)
            out, err = puller.stdout.read(), puller.stderr.read()
        finally:
            if puller.poll() is None:
                puller.kill()
                puller.wait()
            server.stop()
        if fallback:
            assert puller.returncode == 0, err
            report = json.loads(out)
            assert report["bytes_read"] > 0 and report["bytes_from_peers"] == 0
            assert server.address in report["peer_failure"]
            assert "peers failed" in err and str(wide_llama) in err
            assert digests(tmp_path / "out.safetensors") == expected
        else:
            assert puller.returncode == 1, out
            assert f"cannot load from peer://{server.address}" in err and "no storage fallback given" in err
            assert f"peer {server.address}" in err
            # UCX reports the dead peer at once; --peer-timeout (20 s) bounds a silent one.
            assert time.monotonic() - resumed < 60
        assert TOKEN not in out + err
        (tmp_path / "out.safetensors").unlink(missing_ok=True)


def test_a_peer_frozen_mid_transfer_ends_in_an_error_or_the_fallback_never_an_abort(namespaces, wide_llama, tmp_path):
    """The server freezes (SIGSTOP: its connections stay open, nothing answers) while the
    bytes move, as the killed peer above: the puller stops itself in the middle of reading
    the embeddings (WEIGHTSTREAM_TEST_PULL_STOP_AFTER), the test freezes the server and lets
    the puller go on. UCX requests to the frozen peer never end; the pull must fail within
    --peer-timeout with a clear error (or fall back), where it used to abort inside UCX
    (ucp_ep.c `proto_reqs` assertion, exit 134)."""
    server_ns, puller_ns = namespaces
    expected = expected_export(wide_llama, tmp_path / "expected.safetensors")
    for fallback in (True, False):
        server = Server(server_ns, wide_llama)
        flags = ["--fallback", str(wide_llama)] if fallback else []
        puller = subprocess.Popen(
            ["ip", "netns", "exec", puller_ns, CLI, "export", f"peer://{server.address}", str(tmp_path / "out.safetensors"),
             "--json", "--token-stdin", "--no-progress", "--peer-timeout", "3", *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(ENV, WEIGHTSTREAM_TEST_PULL_STOP_AFTER="1"))
        frozen = [server.process.pid] + [
            int(child) for child in run("pgrep", "-P", str(server.process.pid), check=False).stdout.split()]
        try:
            puller.stdin.write(TOKEN + "\n")
            puller.stdin.close()
            _, status = os.waitpid(puller.pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status), f"the puller ended before the transfer was under way: {puller.stderr.read()}"
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            os.kill(puller.pid, signal.SIGCONT)
            puller.wait(timeout=120)
            out, err = puller.stdout.read(), puller.stderr.read()
        finally:
            if puller.poll() is None:
                puller.kill()
                puller.wait()
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
            server.stop()
        assert "Assertion" not in err and "backtrace" not in err, err
        # The frozen server is found stalled by UCX (reads in flight without progress) or, when
        # every read it owed had reached the puller's socket before the freeze, silent on the
        # control connection afterwards: either way within the peer timeout, naming it.
        stalled = (f"peer {server.address}", "without progress")
        silent = (f"timed out after 3 s of silence from serving peer {server.address}",)
        if fallback:
            assert puller.returncode == 0, err
            report = json.loads(out)
            failure = report["peer_failure"]
            assert all(text in failure for text in stalled) or all(text in failure for text in silent), failure
            assert "peers failed" in err and str(wide_llama) in err
            assert digests(tmp_path / "out.safetensors") == expected
        else:
            assert puller.returncode == 1, err
            assert f"cannot load from peer://{server.address}" in err and "no storage fallback given" in err
            assert all(text in err for text in stalled) or all(text in err for text in silent), err
        (tmp_path / "out.safetensors").unlink(missing_ok=True)


def test_manifests_of_different_checkpoints_are_refused(namespaces, llama, tmp_path):
    server_ns, puller_ns = namespaces
    # Another checkpoint of the model (its config.json and index differ: another vocabulary).
    other = synth(tmp_path / "other", "--arch", "llama", "--layers", "2", "--hidden", "256", "--seed", "3",
                  "--vocab", "2048")
    with Server(server_ns, llama, *tp_flags(2, 0)) as first, Server(server_ns, other, *tp_flags(2, 1)) as second:
        result = pull(puller_ns, f"peer://{first.address},{second.address}", tmp_path / "out.safetensors",
                      *tp_flags(2, 0))
    assert result.returncode == 1
    assert "disagree on the checkpoint" in result.stderr
    assert first.address in result.stderr and second.address in result.stderr


@pytest.mark.parametrize("path", ["rendezvous", "rma"])
def test_a_pull_across_the_namespaces_takes_either_ucx_path(namespaces, llama, tmp_path, path):
    """Over tcp the library picks rendezvous (the server's tagged sends); rma (emulated
    one-sided gets) is forced here with WEIGHTSTREAM_UCX_PATH. Both land the same bytes."""
    server_ns, puller_ns = namespaces
    env = dict(ENV, WEIGHTSTREAM_UCX_PATH=path)
    with Server(server_ns, llama) as server:
        result = subprocess.run(
            ["ip", "netns", "exec", puller_ns, CLI, "export", f"peer://{server.address}",
             str(tmp_path / "pulled.safetensors"), "--json", "--token-stdin", "--no-progress"],
            input=TOKEN + "\n", capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, result.stderr
        peer = json.loads(result.stdout)["peers"][0]
        assert peer["ucx_path"] == path and peer["ucx_transports"].startswith("tcp/"), peer
        default = pull(puller_ns, f"peer://{server.address}", tmp_path / "default.safetensors")
        assert json.loads(default.stdout)["peers"][0]["ucx_path"] == "rendezvous"  # tcp has no native RMA
    assert digests(tmp_path / "pulled.safetensors") == expected_export(llama, tmp_path / "expected.safetensors")


@pytest.mark.parametrize("path", ["auto", "rma"])
def test_a_pushed_update_crosses_the_namespaces_over_ucx_and_audits_clean(namespaces, llama, tmp_path, path):
    server_ns, trainer_ns = namespaces
    reload = synth(tmp_path / "reload", "--arch", "llama", "--layers", "2", "--hidden", "256", "--seed", "9")
    audit = subprocess.Popen(
        ["ip", "netns", "exec", server_ns, CLI, "audit", str(llama), "--reload", str(reload), "--via", "ucx",
         "--listen", f"{SERVER_ADDRESS}:0", "--await-sender", "--token-stdin", "--bucket-size", "1MiB", "--json",
         "--no-progress", *tp_flags(2, 1)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    audit.stdin.write(TOKEN + "\n")
    audit.stdin.close()
    try:
        line = audit.stderr.readline()
        match = re.search(r"awaiting a sender at (\S+)", line)
        assert match, line
        assert match.group(1).startswith(SERVER_ADDRESS + ":")
        sender = subprocess.run(
            ["ip", "netns", "exec", trainer_ns, CLI, "send", str(reload), "--to", match.group(1), "--via", "ucx",
             "--bucket-size", "1MiB", "--token-stdin", "--no-progress", "--json"],
            input=TOKEN + "\n", capture_output=True, text=True, env=dict(ENV, WEIGHTSTREAM_UCX_PATH=path), timeout=120)
        assert sender.returncode == 0, sender.stderr
        # tcp has no native RMA: auto sends the buckets as rendezvous messages, its large
        # tensors received straight into their parameters; rma forces puts into the buffer.
        sent = json.loads(sender.stdout)
        [taken] = sent["paths"]
        assert taken.startswith(("rendezvous" if path == "auto" else "rma") + " (tcp/"), taken
        if path == "auto":
            assert 0 < sent["placed_bytes"] < sent["bytes"], sent
        else:
            assert sent["placed_bytes"] == 0, sent
        audit.wait(timeout=120)
        out, err = audit.stdout.read(), audit.stderr.read()
    finally:
        if audit.poll() is None:
            audit.kill()
            audit.wait()
    assert audit.returncode == 0, err
    report = json.loads(out)
    assert report["via"] == "ucx" and report["clean"] is True
    assert report["compared"] > 10 and report["mismatched"] == 0
    assert report["address_changes"] == 0 and report["model_hook_runs_per_load"] == 1
    assert TOKEN not in out + err + sender.stdout + sender.stderr


def test_ends_whose_ucx_segments_differ_are_refused_before_a_byte_moves(namespaces, llama, tmp_path):
    """UCX's tcp sends a rendezvous message in fragments of the sender's receive segment, and
    UCX 1.13 aborts a process sent fragments larger than its own: a pull from a server, and an
    update into a receiver, whose UCX_TCP_RX_SEG_SIZE differs from this end's are refused by
    name before their endpoints connect (weightstream's default is 1m)."""
    server_ns, puller_ns = namespaces
    small = dict(ENV, UCX_TCP_RX_SEG_SIZE="64k")
    with Server(server_ns, llama) as server:
        result = pull(puller_ns, f"peer://{server.address}", tmp_path / "out.safetensors", env=small)
        assert server.process.poll() is None  # the server lives on
    assert result.returncode == 1, result.stderr
    assert (f"peer {server.address} receives UCX tcp segments of 1048576 bytes and this process 65536: UCX aborts "
            "a process sent fragments larger than its segments, so both ends need the same UCX_TCP_RX_SEG_SIZE") \
        in result.stderr
    audit = subprocess.Popen(
        ["ip", "netns", "exec", server_ns, CLI, "audit", str(llama), "--via", "ucx", "--listen", f"{SERVER_ADDRESS}:0",
         "--await-sender", "--token-stdin", "--no-progress"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=small)
    audit.stdin.write(TOKEN + "\n")
    audit.stdin.close()
    try:
        match = re.search(r"awaiting a sender at (\S+)", audit.stderr.readline())
        assert match
        sender = subprocess.run(
            ["ip", "netns", "exec", puller_ns, CLI, "send", str(llama), "--to", match.group(1), "--via", "ucx",
             "--token-stdin", "--no-progress"],
            input=TOKEN + "\n", capture_output=True, text=True, env=ENV, timeout=120)
    finally:
        audit.kill()
        audit.wait()
    assert sender.returncode == 1, sender.stderr
    assert "receives UCX tcp segments of 65536 bytes and this process 1048576" in sender.stderr


def test_python_pulls_a_rank_from_peers_into_a_load_session(llama, tmp_path):
    """Python: model_layout from the peers' config.json, LoadSession.load_checkpoint("peer://...")
    (loopback: no namespaces needed)."""
    weightstream = pytest.importorskip("weightstream")
    pytest.importorskip("numpy")
    if not hasattr(weightstream, "peer_config"):
        pytest.skip("the installed weightstream package predates peers")
    servers = []
    try:
        for rank in range(2):
            process = subprocess.Popen(
                [CLI, "serve", str(llama), "--token-stdin", "--no-progress", *tp_flags(2, rank)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
            process.stdin.write(TOKEN + "\n")
            process.stdin.close()
            line = process.stdout.readline()
            if "peer://" not in line:
                err = process.stderr.read()
                if "build with UCX" in err:
                    pytest.skip("this build has no UCX (WS_WITH_UCX)")
                raise AssertionError(line + err)
            servers.append((process, re.search(r"peer://(\S+)", line).group(1)))
        uri = "peer://" + ",".join(address for _, address in servers)
        config = weightstream.peer_config(uri, token=TOKEN)
        assert json.loads(config)["model_type"] == "llama"
        layout = weightstream.model_layout(config, tp_size=2, tp_rank=1, device="cpu")
        report = cold_load(layout, uri, token=TOKEN)
        assert report["bytes_read"] == 0 and report["bytes_from_peers"] > 0
        expected = weightstream.model_layout(str(llama), tp_size=2, tp_rank=1, device="cpu")
        cold_load(expected, str(llama))
        assert parameter_bytes(layout) == parameter_bytes(expected)
        with pytest.raises(weightstream.Error, match="could not prove the token"):
            weightstream.peer_config(uri, token="not-" + TOKEN)
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(timeout=30)


def test_python_serves_a_loaded_layout_and_another_layout_pulls_it(llama):
    """weightstream.serve / layout.serve: a layout loaded in Python is published; a layout at
    another tp size pulls from it; after close() the address is gone (loopback)."""
    weightstream = pytest.importorskip("weightstream")
    pytest.importorskip("numpy")
    if not hasattr(weightstream, "serve"):
        pytest.skip("the installed weightstream package predates layout.serve")
    served = weightstream.model_layout(str(llama), device="cpu")
    cold_load(served, str(llama))
    try:
        server = served.serve(str(llama), token=TOKEN)
    except weightstream.Error as error:
        if "build with UCX" in str(error):
            pytest.skip("this build has no UCX (WS_WITH_UCX)")
        raise
    with server:
        assert server.serving and server.version == 1 and server.address.startswith("127.0.0.1:")
        uri = f"peer://{server.address}"
        pulled = weightstream.model_layout(weightstream.peer_config(uri, token=TOKEN), tp_size=2, tp_rank=1,
                                           device="cpu")
        report = cold_load(pulled, uri, token=TOKEN)
        assert report["bytes_read"] == 0 and report["bytes_from_peers"] > 0
        expected = weightstream.model_layout(str(llama), tp_size=2, tp_rank=1, device="cpu")
        cold_load(expected, str(llama))
        assert parameter_bytes(pulled) == parameter_bytes(expected)
        server.begin_update()
        server.end_update()
        assert server.version == 3
    assert not server.serving
    with pytest.raises(weightstream.Error, match=f"cannot reach peer {re.escape(server.address)}"):
        weightstream.peer_config(uri, token=TOKEN, timeout=5)
    with pytest.raises(weightstream.Error, match="has not been loaded"):
        weightstream.serve(weightstream.model_layout(str(llama), device="cpu"), str(llama))


def test_a_reload_from_a_peer_with_a_flipped_byte_leaves_every_parameter_as_it_was(llama, tmp_path):
    """Issue 45: a layout reloaded with LoadSession.begin("reload") and load_checkpoint("peer://...")
    from a server with one flipped byte is refused, naming the parameter, and every parameter
    keeps its old bytes: the default commit of a reload is "layer", and a reload reads nothing
    into a live parameter before its digest is checked, with commit="arrival" too (loopback)."""
    weightstream = pytest.importorskip("weightstream")
    np = pytest.importorskip("numpy")
    import ctypes  # noqa: PLC0415

    other = synth(tmp_path / "other", "--arch", "llama", "--layers", "2", "--hidden", "256", "--seed", "4")
    served = weightstream.model_layout(str(other), device="cpu")
    cold_load(served, str(other))
    victim = "model.layers.1.mlp.down_proj.weight"
    try:
        server = served.serve(str(other), token=TOKEN)
    except weightstream.Error as error:
        if "build with UCX" in str(error):
            pytest.skip("this build has no UCX (WS_WITH_UCX)")
        raise
    with server:
        # One byte of the served parameter, changed behind the server's back (after it hashed it).
        address = np.from_dlpack(served.tensor(victim)).ctypes.data + 100
        flipped = ctypes.c_uint8.from_address(address)
        flipped.value ^= 0x01
        uri = f"peer://{server.address}"
        for commit in (None, "arrival"):
            layout = weightstream.model_layout(str(llama), device="cpu")
            cold_load(layout, str(llama))
            before = parameter_bytes(layout)
            assert len(before) == 15
            session = weightstream.LoadSession(layout)
            if commit is None:
                session.begin("reload")
                assert session.commit == "layer"
            else:
                session.begin("reload", commit=commit)
                assert session.commit == "arrival"
            with pytest.raises(weightstream.Error) as refused:
                session.load_checkpoint(uri, token=TOKEN)
            assert f"parameter {victim} read from peer {server.address}" in str(refused.value)
            assert "does not match its digest" in str(refused.value)
            after = parameter_bytes(layout)
            assert [name for name in before if after[name] != before[name]] == [], commit


def test_a_reload_from_peers_stages_within_its_memory_limit_and_equals_the_served_checkpoint(llama, tmp_path):
    """A reload from peers reads through staging it keeps bounded (memory_limit: three buffers
    of at most a third of it, or of the largest serving parameter where one is larger), batch
    by batch, and ends equal to the served checkpoint; the report says what it staged
    (loopback)."""
    weightstream = pytest.importorskip("weightstream")
    pytest.importorskip("numpy")
    other = synth(tmp_path / "other", "--arch", "llama", "--layers", "4", "--hidden", "256", "--vocab", "1024",
                  "--seed", "5")
    served = weightstream.model_layout(str(other), device="cpu")
    cold_load(served, str(other))
    try:
        server = served.serve(str(other), token=TOKEN)
    except weightstream.Error as error:
        if "build with UCX" in str(error):
            pytest.skip("this build has no UCX (WS_WITH_UCX)")
        raise
    with server:
        mine = synth(tmp_path / "mine", "--arch", "llama", "--layers", "4", "--hidden", "256", "--vocab", "1024",
                     "--seed", "6")
        layout = weightstream.model_layout(str(mine), device="cpu")
        cold_load(layout, str(mine))
        expected = parameter_bytes(served)
        largest = max(len(value) for value in expected.values())
        limit = 1 << 20
        session = weightstream.LoadSession(layout)
        session.begin("reload")
        report = session.load_checkpoint(f"peer://{server.address}", token=TOKEN, memory_limit=limit)
        session.finish()
        assert report["bytes_in_place"] == 0
        assert 0 < report["staging_bytes"] <= max(limit, 3 * (largest + 64)), report
        assert report["staging_bytes"] < sum(len(value) for value in expected.values()) / 2, report
        assert parameter_bytes(layout) == expected


def content_digest(path):
    """The content digest `weightstream digest` prints last."""
    last = digests(path).splitlines()[-1]
    match = re.fullmatch(r"content digest ([0-9a-f]{16}) \(xxh64 over .*\)", last)
    assert match, last
    return match.group(1)


def test_peers_serving_other_content_are_refused_before_a_byte_naming_each(llama, tmp_path):
    """Issue 45, as filed: `serve` ranks 0 and 1 of two checkpoints of one config (seeds 1 and 2)
    publish one checkpoint identity; `export peer://A,B` is refused naming both peers and the
    content digest each serves, and writes nothing (loopback)."""
    first = synth(tmp_path / "one", "--arch", "llama", "--layers", "2", "--hidden", "256", "--seed", "1")
    second = synth(tmp_path / "two", "--arch", "llama", "--layers", "2", "--hidden", "256", "--seed", "2")
    with Server(None, first, *tp_flags(2, 0)) as a, Server(None, second, *tp_flags(2, 1)) as b:
        assert f"content digest {content_digest(first)}) at peer://" in a.line
        assert f"content digest {content_digest(second)}) at peer://" in b.line
        result = pull(None, f"peer://{a.address},{b.address}", tmp_path / "out.safetensors")
    assert result.returncode == 1, result.stdout
    assert (f"disagree on the checkpoint's content: {a.address} serves {content_digest(first)}, "
            f"{b.address} serves {content_digest(second)}; refusing to mix them") in result.stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_expect_digest_pins_the_content_a_pull_accepts(llama, tmp_path):
    """One checkpoint at two ranks: accepted, and accepted with its digest pinned; another
    digest is refused naming the peers, the expected and the served digest (loopback)."""
    digest = content_digest(llama)
    with Server(None, llama, *tp_flags(2, 0)) as a, Server(None, llama, *tp_flags(2, 1)) as b:
        assert f"content digest {digest})" in a.line and f"content digest {digest})" in b.line
        uri = f"peer://{a.address},{b.address}"
        result = pull(None, uri, tmp_path / "out.safetensors", "--expect-digest", digest)
        assert result.returncode == 0, result.stderr
        assert [peer["content_digest"] for peer in json.loads(result.stdout)["peers"]] == [digest, digest]
        wrong = "0" * 16
        result = pull(None, uri, tmp_path / "wrong.safetensors", "--expect-digest", wrong)
    assert result.returncode == 1
    assert (f"do not serve the expected content digest {wrong}: {a.address} serves {digest}, "
            f"{b.address} serves {digest}; refusing to pull from them") in result.stderr
    assert not (tmp_path / "wrong.safetensors").exists()


def test_python_pins_the_content_and_a_pulled_layout_serves_its_peers_digest(llama):
    """LoadSession.load_checkpoint(expect_digest=...) and serve(): a layout served from a
    checkpoint publishes its content digest, one pulled from peers republishes theirs, an
    update makes it unknown (loopback)."""
    weightstream = pytest.importorskip("weightstream")
    pytest.importorskip("numpy")
    digest = content_digest(llama)
    served = weightstream.model_layout(str(llama), device="cpu")
    cold_load(served, str(llama))
    try:
        server = served.serve(str(llama), token=TOKEN)
    except weightstream.Error as error:
        if "build with UCX" in str(error):
            pytest.skip("this build has no UCX (WS_WITH_UCX)")
        raise
    with server:
        assert server.content_digest == digest
        uri = f"peer://{server.address}"
        config = weightstream.peer_config(uri, token=TOKEN)
        pulled = weightstream.model_layout(config, device="cpu")
        cold_load(pulled, uri, token=TOKEN, expect_digest=digest.upper())
        with weightstream.serve(pulled, uri, token=TOKEN, expect_digest=digest) as relay:
            assert relay.content_digest == digest
        refused = weightstream.model_layout(config, device="cpu")
        with pytest.raises(weightstream.Error, match=f"do not serve the expected content digest {'1' * 16}: "
                                                     f"{re.escape(server.address)} serves {digest}"):
            cold_load(refused, uri, token=TOKEN, expect_digest="1" * 16)
        with pytest.raises(weightstream.Error, match="expect_digest pins what a layout pulled from peers serves"):
            weightstream.serve(pulled, str(llama), token=TOKEN, expect_digest=digest)
        server.begin_update()
        server.end_update()
        assert server.content_digest == ""
        with pytest.raises(weightstream.Error, match=re.escape(f"{server.address} serves unknown content (updated "
                                                               "since it was loaded)")):
            cold_load(weightstream.model_layout(config, device="cpu"), uri, token=TOKEN, expect_digest=digest)

"""Issue 45: no listener starts without a token unless asked to in so many words, and the
token is proven, never sent. On loopback: `serve` and `audit --await-sender` with an empty
token line, `serve --open-without-token` (warned about, once), a puller with a wrong token
and one without, Python's serve() and UpdateReceiver, and the peer handshake written again
from its description (src/net/handshake.hpp) against a real `serve`."""
import hashlib
import hmac
import os
import re
import signal
import socket
import struct
import subprocess

import pytest
from conftest import CLI, requires_cli, cold_load

pytestmark = requires_cli

TOKEN = "listener-token-" + os.urandom(6).hex()
ENV = {key: value for key, value in os.environ.items() if key != "WEIGHTSTREAM_PEER_TOKEN"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama") / "llama"
    subprocess.run([CLI, "synth", str(directory), "--arch", "llama", "--layers", "2", "--seed", "3"], check=True,
                   capture_output=True)
    return directory


class Serve:
    """`weightstream serve` on loopback; `token` None: --open-without-token."""

    def __init__(self, checkpoint, token):
        flags = ["--open-without-token"] if token is None else ["--token-stdin"]
        self.process = subprocess.Popen([CLI, "serve", str(checkpoint), "--listen", "127.0.0.1:0", "--no-progress",
                                         *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=ENV)
        if token is not None:
            self.process.stdin.write(token + "\n")
        self.process.stdin.close()
        self.line = self.process.stdout.readline()
        match = re.search(r"peer://(\S+)", self.line)
        if not match:
            err = self.process.stderr.read()
            if "build with UCX" in err or "UCX" in err and "not" in err:
                pytest.skip("this build has no UCX (WS_WITH_UCX)")
            raise AssertionError(f"serve printed {self.line!r}; stderr: {err}")
        self.address = match.group(1)

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)
        return self.process.stderr.read()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def run(arguments, stdin=""):
    return subprocess.run([CLI, *arguments], input=stdin, capture_output=True, text=True, env=ENV, timeout=120)


@pytest.mark.parametrize("stdin", ["", "\n"])
def test_an_empty_token_line_is_refused_by_every_listener(llama, stdin):
    for arguments in (["serve", str(llama), "--listen", "127.0.0.1:0", "--token-stdin", "--no-progress"],
                      ["audit", str(llama), "--via", "tcp", "--await-sender", "--token-stdin", "--no-progress"]):
        result = run(arguments, stdin)
        assert result.returncode != 0, arguments
        assert "the token read from stdin is empty" in result.stderr, result.stderr
        assert "awaiting a sender" not in result.stderr and "serving" not in result.stdout


def test_serve_without_any_token_refuses_to_start(llama):
    result = run(["serve", str(llama), "--listen", "127.0.0.1:0", "--no-progress"])
    assert result.returncode != 0
    assert "refuses to start without a token" in result.stderr
    assert "--open-without-token" in result.stderr


def test_an_open_server_is_asked_for_warns_once_and_serves_a_puller_without_a_token(llama, tmp_path):
    with Serve(llama, None) as server:
        pulled = run(["export", f"peer://{server.address}", str(tmp_path / "out.safetensors"), "--no-progress"])
        assert pulled.returncode == 0, pulled.stderr
        # A puller that holds a token does not trust a server that proves none.
        trusting = run(["export", f"peer://{server.address}", str(tmp_path / "again.safetensors"), "--token-stdin",
                        "--no-progress"], TOKEN + "\n")
        assert trusting.returncode != 0
        assert "could not prove the token: it says it listens without one" in trusting.stderr
        err = server.stop()
    warnings = [line for line in err.splitlines() if "listens without a token" in line]
    assert warnings == [f"weightstream: warning: peer server on {server.address} listens without a token "
                        f"(open_without_token): anyone who can reach it is accepted"]


def test_pullers_with_a_wrong_token_or_none_fail_clearly(llama, tmp_path):
    with Serve(llama, TOKEN) as server:
        wrong = run(["export", f"peer://{server.address}", str(tmp_path / "a.safetensors"), "--token-stdin",
                     "--no-progress"], "wrong-" + TOKEN[::-1] + "\n")
        none = run(["export", f"peer://{server.address}", str(tmp_path / "b.safetensors"), "--no-progress"])
        logs = server.stop()
    assert wrong.returncode != 0
    assert f"peer {server.address} could not prove the token" in wrong.stderr
    assert none.returncode != 0
    assert f"peer {server.address} requires a token, and this side has none" in none.stderr
    for text in (wrong.stdout, wrong.stderr, none.stderr, logs):
        assert TOKEN not in text and TOKEN[::-1] not in text


def exact(connection, count):
    data = b""
    while len(data) < count:
        chunk = connection.recv(count - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


def test_the_peer_handshake_written_from_its_description_is_accepted_and_a_replay_is_not(llama):
    label = b"weightstream peer protocol 6\0"

    def frame(connection, kind, body):
        connection.sendall(struct.pack("<IHHQ", 0x45505357, 6, kind, len(body)) + body)

    def answer(connection):
        magic, version, kind, length = struct.unpack("<IHHQ", exact(connection, 16))
        assert (magic, version) == (0x45505357, 6)
        return kind, exact(connection, length)

    with Serve(llama, TOKEN) as server:
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=20) as connection:
            client_nonce = os.urandom(32)
            frame(connection, 0x4801, client_nonce)
            kind, challenge = answer(connection)
            assert kind == 0x4802 and challenge[0] == 0
            server_nonce = challenge[1:33]

            def mac(role):
                return hmac.new(TOKEN.encode(), label + client_nonce + server_nonce + role, hashlib.sha256).digest()

            assert hmac.compare_digest(challenge[33:65], mac(b"server"))
            proof = mac(b"client")
            frame(connection, 0x4803, proof)
            assert answer(connection) == (0x4804, b"\x01\x00\x00")
            frame(connection, 1, b"{}")  # HELLO
            kind, manifest = answer(connection)
            assert kind == 2 and b'"parameters"' in manifest
        # The same nonce and proof on a new connection: the server's nonce differs.
        with socket.create_connection((host, int(port)), timeout=20) as connection:
            frame(connection, 0x4801, client_nonce)
            answer(connection)
            frame(connection, 0x4803, proof)
            kind, result = answer(connection)
            assert kind == 0x4804 and result[0] == 0
            assert b"the puller could not prove the token" in result


def test_python_listeners_refuse_an_empty_token_and_open_only_when_asked(llama, capfd, monkeypatch):
    weightstream = pytest.importorskip("weightstream")
    monkeypatch.delenv("WEIGHTSTREAM_PEER_TOKEN", raising=False)
    layout = weightstream.model_layout(str(llama), device="cpu")
    cold_load(layout, str(llama))
    for token in (None, ""):
        with pytest.raises(weightstream.Error, match="refuses to start without a token"):
            weightstream.serve(layout, str(llama), token=token)
        with pytest.raises(weightstream.Error, match="refuses to start without a token"):
            weightstream.UpdateReceiver(layout, transport="tcp", **({} if token is None else {"token": token}))
    capfd.readouterr()
    try:
        server = weightstream.serve(layout, str(llama), open_without_token=True)
    except weightstream.Error as error:
        if "UCX" in str(error):
            pytest.skip("this build has no UCX (WS_WITH_UCX)")
        raise
    with server:
        assert "listens without a token" in capfd.readouterr().err
        config = weightstream.peer_config(f"peer://{server.address}", token="")
        assert '"llama"' in config


def test_an_awaiting_audit_survives_garbage_and_a_wrong_token_and_audits_the_real_sender(llama, tmp_path):
    """A bad client harms no one: `audit --await-sender` logs each bad connection once and
    goes on to the sender that proves the token."""
    reload = tmp_path / "reload"
    subprocess.run([CLI, "synth", str(reload), "--arch", "llama", "--layers", "2", "--seed", "4"], check=True,
                   capture_output=True)
    audit = subprocess.Popen([CLI, "audit", str(llama), "--reload", str(reload), "--via", "tcp", "--listen",
                              "127.0.0.1:0", "--await-sender", "--token-stdin", "--json", "--no-progress"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    audit.stdin.write(TOKEN + "\n")
    audit.stdin.close()
    try:
        match = re.search(r"awaiting a sender at (\S+)", audit.stderr.readline())
        assert match
        host, port = match.group(1).rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=20) as garbage:
            try:
                garbage.sendall(os.urandom(100 << 10))
            except OSError:
                pass  # refused at its first bytes and closed: the rest cannot be sent
            garbage.settimeout(20)
            try:
                assert garbage.recv(1) == b""  # closed by the receiver
            except ConnectionResetError:
                pass
        wrong = run(["send", str(reload), "--to", match.group(1), "--via", "tcp", "--token-stdin", "--no-progress"],
                    "wrong-" + TOKEN + "\n")
        assert wrong.returncode != 0 and "could not prove the token" in wrong.stderr
        sender = run(["send", str(reload), "--to", match.group(1), "--via", "tcp", "--token-stdin", "--no-progress"],
                     TOKEN + "\n")
        assert sender.returncode == 0, sender.stderr
        audit.wait(timeout=120)
        out, err = audit.stdout.read(), audit.stderr.read()
    finally:
        if audit.poll() is None:
            audit.kill()
            audit.wait()
    assert audit.returncode == 0, err
    assert re.search(r'"clean":\s*true', out), out
    assert err.count("weightstream: refused a connection from 127.0.0.1:") == 2, err
    assert "does not speak the weightstream update protocol (bad magic)" in err
    assert TOKEN not in out + err + wrong.stderr + sender.stderr

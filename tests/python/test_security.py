"""Security checks of the `weightstream` command (issue 7):

- certificate verification is on by default: an HTTPS endpoint with a self-signed
  certificate is refused, with advice, and nothing is read from it;
- the secret key never appears on stdout or stderr of failing S3 calls, with or without
  --json (refused connection, failed TLS handshake, and every subcommand that touches S3).

tests/python/test_s3_cli.py greps the output of the calls it makes against moto and the
fault proxy (403, 503 storms, faults) the same way; these cases need no S3 server.
"""

import os
import socket
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import CLI, requires_cli

SECRET = "wsSecuritySecret/NeverShowMe+1234567890abcdefgh"

pytestmark = requires_cli


def cli_env(endpoint):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WEIGHTSTREAM_", "CURL_", "SSL_"))}
    env.update({
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "AKIASECURITYTEST",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": "us-east-1",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
        "WEIGHTSTREAM_S3_MAX_ATTEMPTS": "2",
        "WEIGHTSTREAM_S3_RETRY_BASE": "0.01",
        "WEIGHTSTREAM_S3_TIMEOUT": "5",
    })
    return env


def run(args, endpoint):
    result = subprocess.run([CLI, *args], capture_output=True, text=True, env=cli_env(endpoint), timeout=120)
    assert SECRET not in result.stdout + result.stderr, "the secret key was printed by: weightstream " + " ".join(args)
    # Parts of it would be as bad (a message that cut it, or its URL-encoded form).
    assert SECRET[:16] not in result.stdout + result.stderr
    assert SECRET.replace("/", "%2F").replace("+", "%2B") not in result.stdout + result.stderr
    return result


class _Handler(BaseHTTPRequestHandler):
    requests_served = 0

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).requests_served += 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def self_signed_endpoint(tmp_path_factory):
    """An HTTPS server on a loopback port whose certificate no CA signed."""
    directory = tmp_path_factory.mktemp("tls")
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    # Failed handshakes are the point of the test; keep them off the output.
    server.handle_error = lambda *args: None
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield "https://127.0.0.1:%d" % server.server_address[1]
    server.shutdown()
    server.server_close()


def closed_port_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return "http://127.0.0.1:%d" % s.getsockname()[1]


def test_a_self_signed_certificate_is_refused_by_default(self_signed_endpoint):
    _Handler.requests_served = 0
    result = run(["inspect", "s3://bucket-tls/models/tiny"], self_signed_endpoint)
    assert result.returncode != 0 and result.returncode < 128
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightstream: error: "), result.stderr
    assert "s3://bucket-tls/models/tiny" in result.stderr
    assert "certificate" in result.stderr.lower()
    assert "warning" not in result.stderr
    assert _Handler.requests_served == 0  # no request got past the handshake


@pytest.mark.parametrize("args", [
    ["inspect", "s3://bucket-sec/models/tiny"],
    ["inspect", "s3://bucket-sec/models/tiny", "--json"],
    ["load", "s3://bucket-sec/models/tiny", "--json", "--no-progress"],
    ["digest", "s3://bucket-sec/models/tiny", "--json"],
    ["digest", "s3://bucket-sec/models/tiny/model.safetensors", "--json"],
    ["plan", "s3://bucket-sec/models/tiny", "--json"],
])
@pytest.mark.parametrize("where", ["closed-port", "self-signed"])
def test_failing_s3_calls_never_print_the_secret(args, where, self_signed_endpoint):
    endpoint = closed_port_endpoint() if where == "closed-port" else self_signed_endpoint
    result = run(args, endpoint)
    assert result.returncode != 0 and result.returncode < 128
    assert "s3://bucket-sec/models/tiny" in result.stderr
    assert "AKIASECURITYTEST" not in result.stdout  # nothing about credentials in --json output either


def test_presign_prints_a_signature_not_the_secret():
    result = run(["s3", "presign", "s3://bucket-sec/models/tiny/model.safetensors"], closed_port_endpoint())
    if result.returncode != 0:
        pytest.skip("weightstream s3 presign is not available: " + result.stderr.strip())
    assert "X-Amz-Signature=" in result.stdout

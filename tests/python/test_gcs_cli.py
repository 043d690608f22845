"""End-to-end: `weightstream inspect|load|digest|export` and the Python package against the
real GCS emulator fake-gcs-server (started by scripts/test.sh, named by WS_TEST_GCS_ENDPOINT),
directly and through the fault-injecting proxy of tests/tools/fault_proxy.py.

Checkpoints come from `weightstream synth` with fixed seeds and are uploaded through the JSON
API; every gs:// result is compared with the same command run on the local copy. Errors (a
missing object, key files that cannot be used, a token endpoint that refuses, a killed
server) name the object and the cause, and no private key or token appears in any output.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from conftest import CLI, ROOT, requires_cli

ENDPOINT = os.environ.get("WS_TEST_GCS_ENDPOINT")
SERVER_BINARY = os.environ.get("WS_FAKE_GCS_SERVER")

pytestmark = [
    pytest.mark.skipif(not ENDPOINT, reason="WS_TEST_GCS_ENDPOINT is not set: no GCS emulator for this run "
                                            "(scripts/test.sh starts fake-gcs-server, which scripts/install-deps.sh "
                                            "installs)"),
    requires_cli,
]


def cli_env(endpoint=None, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "WEIGHTSTREAM_", "GOOGLE_", "STORAGE_EMULATOR", "GCE_"))}
    if endpoint is not False:
        env["STORAGE_EMULATOR_HOST"] = endpoint or ENDPOINT
    env.update({"WEIGHTSTREAM_S3_RETRY_BASE": "0.01", "WEIGHTSTREAM_S3_TIMEOUT": "2"})
    env.update(extra)
    return env


def run(*args, env=None, check=True, secrets=()):
    result = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, env=env or cli_env(), timeout=300)
    if check and result.returncode != 0:
        raise AssertionError("weightstream %s failed (%d): %s" % (" ".join(map(str, args)), result.returncode,
                                                                 result.stderr))
    for secret in secrets:
        assert secret not in result.stdout + result.stderr
    return result


def upload(endpoint, bucket, name, data):
    url = "%s/upload/storage/v1/b/%s/o?uploadType=media&name=%s" % (endpoint, bucket, urllib.parse.quote(name, safe=""))
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(request, timeout=60).read()


def create_bucket(endpoint, bucket):
    request = urllib.request.Request(endpoint + "/storage/v1/b?project=weightstream-test",
                                     data=json.dumps({"name": bucket}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=60).read()


def upload_checkpoint(endpoint, bucket, local, prefix):
    create_bucket(endpoint, bucket)
    for path in sorted(local.iterdir()):
        upload(endpoint, bucket, prefix + path.name, path.read_bytes())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A synthetic 2-shard checkpoint, locally and under gs://BUCKET/models/tiny/."""
    local = tmp_path_factory.mktemp("ckpt") / "tiny"
    run("synth", local, "--seed", 11, "--shards", 2, "--layers", 2)
    bucket = "cli-%d" % random.randrange(10**9)
    upload_checkpoint(ENDPOINT, bucket, local, "models/tiny/")
    return {"local": local, "bucket": bucket, "uri": "gs://%s/models/tiny" % bucket}


@pytest.fixture(scope="module")
def private_key(tmp_path_factory):
    """A fresh RSA key (PEM) and the body lines that no output may show."""
    path = tmp_path_factory.mktemp("key") / "key.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(path)],
                   check=True, capture_output=True)
    pem = path.read_text()
    return pem, [line for line in pem.splitlines() if not line.startswith("-----") and len(line) > 20]


def digest_lines(result):
    return sorted(result.stdout.splitlines())


def test_inspect_load_and_digest_match_the_local_copy(checkpoint):
    local, uri = checkpoint["local"], checkpoint["uri"]
    local_inspect = json.loads(run("inspect", local, "--json").stdout)
    gcs_inspect = json.loads(run("inspect", uri, "--json").stdout)
    assert gcs_inspect["uri"] == uri
    assert gcs_inspect["tensors"] == local_inspect["tensors"]
    assert gcs_inspect["has_index"] and gcs_inspect["has_config"]

    loaded = json.loads(run("load", uri, "--json").stdout)
    assert loaded["bytes"] == local_inspect["bytes"]
    assert loaded["tensors"] == local_inspect["tensor_count"]

    assert digest_lines(run("digest", uri)) == digest_lines(run("digest", local))
    name = "model-00002-of-00002.safetensors"
    assert digest_lines(run("digest", uri + "/" + name)) == digest_lines(run("digest", local / name))


def test_small_requests_and_few_connections_still_match(checkpoint):
    env = cli_env(WEIGHTSTREAM_S3_REQUEST_SIZE="64KiB", WEIGHTSTREAM_S3_CONNECTIONS="2")
    assert digest_lines(run("digest", checkpoint["uri"], env=env)) == digest_lines(run("digest", checkpoint["local"]))


def exported_layout(path):
    """(header without the recorded source, tensor bytes) of a file `weightstream export` wrote."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    source = header["__metadata__"].pop("source")
    return header, data[8 + length:], source


def test_a_tensor_parallel_layout_equals_the_local_one(checkpoint, tmp_path):
    for rank in (0, 1):
        exported = {}
        for source in ("local", "uri"):
            out = tmp_path / ("%s-%d.safetensors" % (source, rank))
            run("export", checkpoint[source], out, "--tp-size", 2, "--tp-rank", rank)
            exported[source] = exported_layout(out)
        assert exported["uri"][2] == checkpoint["uri"]
        assert exported["uri"][0] == exported["local"][0], "rank %d" % rank
        assert exported["uri"][1] == exported["local"][1], "rank %d" % rank
        loads = [json.loads(run("load", checkpoint[s], "--tp-size", 2, "--tp-rank", rank, "--json").stdout)
                 for s in ("local", "uri")]
        assert loads[0]["bytes"] == loads[1]["bytes"] > 0


def test_the_python_package_loads_the_same_tensors(checkpoint):
    pytest.importorskip("weightstream")
    script = ("import sys, weightstream\n"
              "a = weightstream.load(sys.argv[1], framework='numpy')\n"
              "b = weightstream.load(sys.argv[2], framework='numpy')\n"
              "assert sorted(a) == sorted(b), (sorted(a), sorted(b))\n"
              "assert all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes() for k in a)\n"
              "print(len(a))\n")
    result = subprocess.run([sys.executable, "-c", script, checkpoint["uri"], str(checkpoint["local"])],
                            capture_output=True, text=True, env=cli_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) > 0


def test_a_missing_object_names_it_and_the_cause(checkpoint):
    uri = checkpoint["uri"] + "/absent.safetensors"
    result = run("digest", uri, check=False)
    assert result.returncode != 0
    assert "gs://%s/models/tiny/absent.safetensors" % checkpoint["bucket"] in result.stderr
    assert "HTTP 404" in result.stderr
    result = run("load", "gs://%s-absent/models/tiny" % checkpoint["bucket"], check=False)
    assert result.returncode != 0
    assert "no bucket gs://%s-absent" % checkpoint["bucket"] in result.stderr


def key_file(tmp_path, pem, token_uri):
    path = tmp_path / "key.json"
    path.write_text(json.dumps({"type": "service_account", "project_id": "weightstream-test",
                                "private_key_id": "0123abcd", "private_key": pem,
                                "client_email": "loader@weightstream-test.iam.gserviceaccount.com",
                                "token_uri": token_uri}))
    return path


def test_a_malformed_key_file_is_named_and_its_key_never_shown(checkpoint, private_key, tmp_path):
    pem, lines = private_key
    text = key_file(tmp_path, pem, "https://oauth2.googleapis.com/token").read_text()
    bad = tmp_path / "bad.json"
    bad.write_text(text[: len(text) // 2])  # cut in the middle of the key
    env = cli_env(False, GOOGLE_APPLICATION_CREDENTIALS=str(bad))
    for command in ("inspect", "load", "digest"):
        result = run(command, checkpoint["uri"], env=env, check=False, secrets=lines)
        assert result.returncode != 0
        assert "cannot open %s" % checkpoint["uri"] in result.stderr
        assert "%s (GOOGLE_APPLICATION_CREDENTIALS) is not a JSON object" % bad in result.stderr


def test_a_token_endpoint_that_refuses_is_a_clear_error(checkpoint, private_key, tmp_path):
    pem, lines = private_key
    # The emulator has no OAuth endpoint: as a token_uri it refuses every exchange (HTTP 404).
    path = key_file(tmp_path, pem, ENDPOINT + "/token")
    env = cli_env(False, GOOGLE_APPLICATION_CREDENTIALS=str(path))
    result = run("digest", checkpoint["uri"], env=env, check=False, secrets=lines)
    assert result.returncode != 0
    message = result.stderr
    assert "gs://%s/models/tiny" % checkpoint["bucket"] in message
    assert "cannot get an access token for service account loader@weightstream-test.iam.gserviceaccount.com" in message
    assert "HTTP 404" in message and "the token endpoint refused" in message
    assert "assertion=" not in message and "eyJ" not in message  # no part of the signed JWT


def test_no_metadata_server_is_explained(checkpoint):
    env = cli_env(False, GCE_METADATA_HOST="127.0.0.1:9")
    result = run("inspect", checkpoint["uri"], env=env, check=False)
    assert result.returncode != 0
    assert "the metadata server http://127.0.0.1:9" in result.stderr
    assert "set GOOGLE_APPLICATION_CREDENTIALS" in result.stderr


class Proxy:
    """tests/tools/fault_proxy.py in front of the emulator, answering as GCS does."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "tools" / "fault_proxy.py"), "--upstream", ENDPOINT,
             "--flavor", "gcs", "--stall", "10", "--lifetime", "600", "--watch-stdin"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        assert line.startswith("PORT "), line
        self.endpoint = "http://127.0.0.1:%d" % int(line.split()[1])

    def control(self, path):
        with urllib.request.urlopen(self.endpoint + path, timeout=10) as response:
            return json.loads(response.read())

    def arm(self, mode, count, method="GET"):
        self.control("/__fault__/plan?mode=%s&count=%d%s" % (mode, count, "&method=" + method if method else ""))

    def stats(self):
        return self.control("/__fault__/stats")

    def close(self):
        self.process.stdin.close()
        self.process.terminate()
        self.process.wait(timeout=10)


@pytest.fixture
def proxy():
    p = Proxy()
    yield p
    p.close()


@pytest.mark.parametrize("mode", ["reset", "truncate", "overlong", "badrange", "503", "429", "500", "stall"])
def test_digests_survive_faults_within_the_attempt_bound(checkpoint, proxy, mode):
    proxy.arm(mode, 3)
    result = run("digest", checkpoint["uri"], "--concurrency", 2, env=cli_env(proxy.endpoint))
    assert digest_lines(result) == digest_lines(run("digest", checkpoint["local"]))
    assert proxy.stats()["faults"] == 3


def test_a_storm_of_backend_errors_ends_in_one_clear_error(checkpoint, proxy):
    proxy.arm("503", 1000)
    env = cli_env(proxy.endpoint, WEIGHTSTREAM_S3_MAX_ATTEMPTS="3")
    result = run("digest", checkpoint["uri"], "--concurrency", 1, env=env, check=False)
    assert result.returncode != 0
    assert "gs://%s/models/tiny/" % checkpoint["bucket"] in result.stderr
    assert "HTTP 503 backendError" in result.stderr and "after 3 attempts" in result.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not SERVER_BINARY, reason="WS_FAKE_GCS_SERVER is not set (scripts/fake-gcs-server.sh sets it)")
def test_a_killed_server_is_a_clear_error_naming_the_object(checkpoint, tmp_path):
    port = free_port()
    endpoint = "http://127.0.0.1:%d" % port
    server = subprocess.Popen([SERVER_BINARY, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                               "-backend", "memory", "-log-level", "error"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(endpoint + "/storage/v1/b", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        upload_checkpoint(endpoint, checkpoint["bucket"], checkpoint["local"], "models/tiny/")
        env = cli_env(endpoint)
        assert digest_lines(run("digest", checkpoint["uri"], env=env)) == digest_lines(run("digest", checkpoint["local"]))
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=10)
    result = run("digest", checkpoint["uri"], env=env, check=False)
    assert result.returncode != 0
    assert "gs://%s/models/tiny" % checkpoint["bucket"] in result.stderr
    assert "curl error 7" in result.stderr and str(port) in result.stderr

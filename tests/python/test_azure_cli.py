"""End-to-end: `weightstream` with az:// URIs.

Without an emulator (always): credentials that cannot be used (a malformed connection string, a
key that is not base64, a SAS without a signature, another account's key, a SAS URL pasted
whole), no managed-identity endpoint, and a server that is not there each give a clear error
naming the object or the variable, and no key, SAS signature or token appears in any output.

With a Blob emulator (WS_TEST_AZURE_CONNECTION_STRING, set by scripts/azurite.sh where
azurite-blob is installed; none installs from PyPI or Debian, docs/AZURE.md): checkpoints from
`weightstream synth` with fixed seeds are uploaded with Microsoft's SDK (azure-storage-blob),
and every az:// result is compared with the same command on the local copy; a missing blob,
a wrong key and faults through tests/tools/fault_proxy.py --flavor azure each end as the
docs say.
"""

import json
import os
import random
import socket
import subprocess
import sys
import urllib.request

import pytest
from conftest import CLI, ROOT, requires_cli

CONNECTION_STRING = os.environ.get("WS_TEST_AZURE_CONNECTION_STRING")
# The emulator's well-known key (public: Microsoft's docs give it).
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
SAS_SIG = "wsSecretSig0123456789abcdef%2B%2F%3D"
SAS = "sv=2021-08-06&ss=b&srt=co&sp=rl&se=2030-01-01T00%3A00%3A00Z&sig=" + SAS_SIG
SECRETS = (DEV_KEY, SAS_SIG, "wsSecretSig0123456789abcdef+/=")

pytestmark = [requires_cli]
requires_emulator = pytest.mark.skipif(
    not CONNECTION_STRING,
    reason="WS_TEST_AZURE_CONNECTION_STRING is not set: no Azure Blob emulator for this run (Azurite needs npm; "
           "scripts/azurite.sh starts azurite-blob where it is installed)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env(connection_string=None, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "WEIGHTSTREAM_", "GOOGLE_", "STORAGE_EMULATOR", "GCE_", "AZURE_", "IDENTITY_",
                                "MSI_"))}
    if connection_string:
        env["AZURE_STORAGE_CONNECTION_STRING"] = connection_string
    # Never the real IMDS from a test: a closed loopback port stands for "off Azure".
    env["AZURE_POD_IDENTITY_AUTHORITY_HOST"] = "http://127.0.0.1:%d" % free_port()
    env.update({"WEIGHTSTREAM_S3_RETRY_BASE": "0.01", "WEIGHTSTREAM_S3_TIMEOUT": "2"})
    env.update(extra)
    return env


def run(*args, env=None, check=True, secrets=SECRETS):
    result = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True,
                            env=env if env is not None else cli_env(CONNECTION_STRING), timeout=300)
    if check and result.returncode != 0:
        raise AssertionError("weightstream %s failed (%d): %s" % (" ".join(map(str, args)), result.returncode,
                                                                 result.stderr))
    for secret in secrets:
        assert secret not in result.stdout + result.stderr
    return result


def digest_lines(result):
    return sorted(result.stdout.splitlines())


# ---- without an emulator -----------------------------------------------------------------


@pytest.mark.parametrize("variables, expected", [
    ({"AZURE_STORAGE_CONNECTION_STRING": "AccountName=myaccount;" + DEV_KEY},
     "AZURE_STORAGE_CONNECTION_STRING: part 2 is not a setting of a connection string"),
    ({"AZURE_STORAGE_KEY": "not base64! " + SAS_SIG}, "the AZURE_STORAGE_KEY is not base64"),
    ({"AZURE_STORAGE_SAS_TOKEN": "sv=2021-08-06&sp=r"}, "AZURE_STORAGE_SAS_TOKEN is not a SAS token"),
    ({"AZURE_STORAGE_ACCOUNT": "otheraccount", "AZURE_STORAGE_KEY": DEV_KEY},
     "AZURE_STORAGE_KEY is the key of account 'otheraccount' (AZURE_STORAGE_ACCOUNT), not of 'myaccount'"),
    ({"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"},
     "AZURE_STORAGE_CONNECTION_STRING is for account 'devstoreaccount1', not 'myaccount'"),
    ({"WEIGHTSTREAM_AZURE_ANONYMOUS": "maybe"}, "WEIGHTSTREAM_AZURE_ANONYMOUS='maybe'"),
])
def test_credentials_that_cannot_be_used_are_named_and_never_shown(variables, expected):
    result = run("inspect", "az://myaccount/models/tiny", env=cli_env(**variables), check=False)
    assert result.returncode == 1, result.stderr
    assert expected in result.stderr


def test_a_sas_url_pasted_whole_is_refused_without_repeating_it():
    result = run("inspect", "https://myaccount.blob.core.windows.net/models/tiny?" + SAS, env=cli_env(), check=False)
    assert result.returncode != 0
    assert "give the SAS token in AZURE_STORAGE_SAS_TOKEN" in result.stderr


def test_no_managed_identity_off_azure_is_explained():
    env = cli_env()
    result = run("inspect", "az://myaccount/models/tiny", env=env, check=False)
    assert result.returncode == 1
    assert "az://myaccount/models/tiny" in result.stderr
    assert "cannot get an access token from the managed identity of the machine (IMDS at %s)" % (
        env["AZURE_POD_IDENTITY_AUTHORITY_HOST"]) in result.stderr
    assert "set AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_KEY" in result.stderr


def test_a_server_that_is_not_there_is_a_clear_error_naming_the_object():
    port = free_port()
    connection = "AccountName=devstoreaccount1;AccountKey=%s;BlobEndpoint=http://127.0.0.1:%d/devstoreaccount1" % (
        DEV_KEY, port)
    result = run("digest", "az://devstoreaccount1/models/tiny/model.safetensors",
                 env=cli_env(connection, WEIGHTSTREAM_S3_MAX_ATTEMPTS="2"), check=False)
    assert result.returncode == 1
    assert "az://devstoreaccount1/models/tiny/model.safetensors" in result.stderr
    assert "curl error 7" in result.stderr and str(port) in result.stderr


# ---- with an emulator ---------------------------------------------------------------------


def upload_checkpoint(connection_string, container, local, prefix):
    blob = pytest.importorskip("azure.storage.blob", reason="azure-storage-blob uploads the test checkpoints")
    service = blob.BlobServiceClient.from_connection_string(connection_string)
    client = service.get_container_client(container)
    client.create_container()
    for path in sorted(local.iterdir()):
        client.upload_blob(prefix + path.name, path.read_bytes(), overwrite=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A synthetic 2-shard checkpoint, locally and under az://ACCOUNT/CONTAINER/models/tiny/."""
    if not CONNECTION_STRING:
        pytest.skip("no Azure Blob emulator for this run")
    local = tmp_path_factory.mktemp("ckpt") / "tiny"
    run("synth", local, "--seed", 11, "--shards", 2, "--layers", 2)
    container = "cli-%d" % random.randrange(10**9)
    upload_checkpoint(CONNECTION_STRING, container, local, "models/tiny/")
    account = dict(part.split("=", 1) for part in CONNECTION_STRING.split(";") if "=" in part)["AccountName"]
    return {"local": local, "container": container, "account": account,
            "uri": "az://%s/%s/models/tiny" % (account, container)}


@requires_emulator
def test_inspect_load_and_digest_match_the_local_copy(checkpoint):
    local, uri = checkpoint["local"], checkpoint["uri"]
    local_inspect = json.loads(run("inspect", local, "--json").stdout)
    azure_inspect = json.loads(run("inspect", uri, "--json").stdout)
    assert azure_inspect["uri"] == uri
    assert azure_inspect["tensors"] == local_inspect["tensors"]
    loaded = json.loads(run("load", uri, "--json").stdout)
    assert loaded["bytes"] == local_inspect["bytes"]
    assert digest_lines(run("digest", uri)) == digest_lines(run("digest", local))
    env = cli_env(CONNECTION_STRING, WEIGHTSTREAM_S3_REQUEST_SIZE="64KiB", WEIGHTSTREAM_S3_CONNECTIONS="2")
    assert digest_lines(run("digest", uri, env=env)) == digest_lines(run("digest", local))


@requires_emulator
def test_tensor_parallel_loads_read_the_same_bytes(checkpoint):
    for rank in (0, 1):
        loads = [json.loads(run("load", checkpoint[s], "--tp-size", 2, "--tp-rank", rank, "--json").stdout)
                 for s in ("local", "uri")]
        assert loads[0]["bytes"] == loads[1]["bytes"] > 0


@requires_emulator
def test_the_python_package_loads_the_same_tensors(checkpoint):
    pytest.importorskip("weightstream")
    script = ("import sys, weightstream\n"
              "a = weightstream.load(sys.argv[1], framework='numpy')\n"
              "b = weightstream.load(sys.argv[2], framework='numpy')\n"
              "assert sorted(a) == sorted(b)\n"
              "assert all(a[k].tobytes() == b[k].tobytes() for k in a)\n"
              "print(len(a))\n")
    result = subprocess.run([sys.executable, "-c", script, checkpoint["uri"], str(checkpoint["local"])],
                            capture_output=True, text=True, env=cli_env(CONNECTION_STRING), timeout=300)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) > 0


@requires_emulator
def test_a_missing_blob_and_a_wrong_key_name_the_object_and_the_cause(checkpoint):
    result = run("digest", checkpoint["uri"] + "/absent.safetensors", check=False)
    assert result.returncode != 0
    assert checkpoint["uri"] + "/absent.safetensors" in result.stderr and "HTTP 404" in result.stderr
    wrong = ("B" if DEV_KEY[0] == "A" else "A") + DEV_KEY[1:]
    connection = ";".join("AccountKey=" + wrong if part.startswith("AccountKey=") else part
                          for part in CONNECTION_STRING.split(";"))
    result = run("inspect", checkpoint["uri"], env=cli_env(connection), check=False, secrets=SECRETS + (wrong,))
    assert result.returncode != 0
    assert "HTTP 403" in result.stderr and "a credential problem" in result.stderr


class Proxy:
    """tests/tools/fault_proxy.py in front of the emulator, answering as the Blob service does."""

    def __init__(self, upstream):
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "tools" / "fault_proxy.py"), "--upstream", upstream,
             "--flavor", "azure", "--stall", "10", "--lifetime", "600", "--watch-stdin"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        assert line.startswith("PORT "), line
        self.endpoint = "http://127.0.0.1:%d" % int(line.split()[1])

    def arm(self, mode, count):
        urllib.request.urlopen(self.endpoint + "/__fault__/plan?mode=%s&count=%d&method=GET" % (mode, count),
                               timeout=10).read()

    def faults(self):
        with urllib.request.urlopen(self.endpoint + "/__fault__/stats", timeout=10) as response:
            return json.loads(response.read())["faults"]

    def close(self):
        self.process.stdin.close()
        self.process.terminate()
        self.process.wait(timeout=10)


def via(endpoint):
    """CONNECTION_STRING with its BlobEndpoint's host and port replaced by `endpoint`."""
    parts = []
    for part in CONNECTION_STRING.split(";"):
        if part.startswith("BlobEndpoint="):
            url = part[len("BlobEndpoint="):]
            path = url[url.index("/", url.index("://") + 3):] if "/" in url[url.index("://") + 3:] else ""
            part = "BlobEndpoint=" + endpoint + path
        parts.append(part)
    return ";".join(parts)


@pytest.fixture
def proxy():
    blob_endpoint = [p for p in CONNECTION_STRING.split(";") if p.startswith("BlobEndpoint=")][0][len("BlobEndpoint="):]
    upstream = blob_endpoint[:blob_endpoint.index("/", blob_endpoint.index("://") + 3)]
    p = Proxy(upstream)
    yield p
    p.close()


@requires_emulator
@pytest.mark.parametrize("mode", ["reset", "truncate", "overlong", "badrange", "503", "429", "500", "stall"])
def test_digests_survive_faults_within_the_attempt_bound(checkpoint, proxy, mode):
    proxy.arm(mode, 3)
    result = run("digest", checkpoint["uri"], "--concurrency", 2, env=cli_env(via(proxy.endpoint)))
    assert digest_lines(result) == digest_lines(run("digest", checkpoint["local"]))
    assert proxy.faults() == 3


@requires_emulator
def test_a_killed_server_is_a_clear_error_naming_the_object(checkpoint, proxy):
    env = cli_env(via(proxy.endpoint))
    assert digest_lines(run("digest", checkpoint["uri"], env=env)) == digest_lines(run("digest", checkpoint["local"]))
    proxy.close()
    result = run("digest", checkpoint["uri"], env=env, check=False)
    assert result.returncode != 0
    assert checkpoint["uri"] in result.stderr and "curl error 7" in result.stderr

"""End-to-end: `weightstream inspect|load|digest|s3 presign` against a real S3-compatible
server (moto's, started by scripts/test.sh, named by WS_TEST_S3_ENDPOINT), directly and
through the fault-injecting proxy of tests/tools/fault_proxy.py.

Checkpoints come from `weightstream synth` with fixed seeds and are uploaded with boto3;
every S3 result is compared with the same command run on the local copy.
"""

import json
import os
import random
import subprocess
import sys
import urllib.request

import pytest
from conftest import CLI, ROOT, requires_cli

ENDPOINT = os.environ.get("WS_TEST_S3_ENDPOINT")
# A secret no message may ever show; the tests grep every output for it.
SECRET = "wsCliSecret/NeverPrintMe+9876543210zyxwvu"

pytestmark = [
    pytest.mark.skipif(not ENDPOINT, reason="WS_TEST_S3_ENDPOINT is not set: no S3 server for this run "
                                            "(scripts/test.sh starts moto_server)"),
    requires_cli,
]

boto3 = pytest.importorskip("boto3")


def cli_env(endpoint=None, **extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "WEIGHTSTREAM_"))}
    env.update({
        "AWS_ENDPOINT_URL": endpoint or ENDPOINT,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_REGION": "us-east-1",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
        "WEIGHTSTREAM_S3_RETRY_BASE": "0.01",
        "WEIGHTSTREAM_S3_TIMEOUT": "2",
    })
    env.update(extra)
    return env


def run(*args, env=None, check=True):
    result = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, env=env or cli_env(), timeout=300)
    if check and result.returncode != 0:
        raise AssertionError("weightstream %s failed (%d): %s" % (" ".join(map(str, args)), result.returncode,
                                                                 result.stderr))
    assert SECRET not in result.stdout + result.stderr
    return result


def s3_client():
    return boto3.client("s3", endpoint_url=ENDPOINT, aws_access_key_id="testing", aws_secret_access_key="testing",
                        region_name="us-east-1")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A synthetic 2-shard checkpoint, locally and under s3://BUCKET/models/tiny/."""
    local = tmp_path_factory.mktemp("ckpt") / "tiny"
    run("synth", local, "--seed", 11, "--shards", 2, "--layers", 2)
    bucket = "cli-%d" % random.randrange(10**9)
    client = s3_client()
    client.create_bucket(Bucket=bucket)
    for path in sorted(local.iterdir()):
        client.upload_file(str(path), bucket, "models/tiny/" + path.name)
    client.put_object(Bucket=bucket, Key="models/tiny-public/" + "model.safetensors",
                      Body=(local / "model-00001-of-00002.safetensors").read_bytes(), ACL="public-read")
    return {"local": local, "bucket": bucket, "uri": "s3://%s/models/tiny" % bucket}


class Proxy:
    """tests/tools/fault_proxy.py in front of the test server."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "tools" / "fault_proxy.py"), "--upstream", ENDPOINT,
             "--stall", "10", "--lifetime", "600", "--watch-stdin"],
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


def digest_lines(result):
    return sorted(result.stdout.splitlines())


def test_inspect_load_and_digest_match_the_local_copy(checkpoint):
    local, uri = checkpoint["local"], checkpoint["uri"]
    local_inspect = json.loads(run("inspect", local, "--json").stdout)
    s3_inspect = json.loads(run("inspect", uri, "--json").stdout)
    assert s3_inspect["uri"] == uri
    assert s3_inspect["tensors"] == local_inspect["tensors"]
    assert s3_inspect["has_index"] and s3_inspect["has_config"]

    loaded = json.loads(run("load", uri, "--json").stdout)
    assert loaded["bytes"] == local_inspect["bytes"]
    assert loaded["tensors"] == local_inspect["tensor_count"]

    assert digest_lines(run("digest", uri)) == digest_lines(run("digest", local))


def test_a_single_object_uri(checkpoint):
    name = "model-00002-of-00002.safetensors"
    s3 = run("digest", checkpoint["uri"] + "/" + name)
    assert digest_lines(s3) == digest_lines(run("digest", checkpoint["local"] / name))


def test_small_requests_and_few_connections_still_match(checkpoint):
    env = cli_env(WEIGHTSTREAM_S3_REQUEST_SIZE="64KiB", WEIGHTSTREAM_S3_CONNECTIONS="2")
    assert digest_lines(run("digest", checkpoint["uri"], env=env)) == digest_lines(run("digest", checkpoint["local"]))


@pytest.mark.parametrize("mode", ["reset", "truncate", "overlong", "badrange", "503", "500", "stall"])
def test_digests_survive_faults_within_the_attempt_bound(checkpoint, proxy, mode):
    proxy.arm(mode, 3)
    result = run("digest", checkpoint["uri"], "--concurrency", 2, env=cli_env(proxy.endpoint))
    assert digest_lines(result) == digest_lines(run("digest", checkpoint["local"]))
    stats = proxy.stats()
    assert stats["faults"] == 3
    tensors = len(json.loads(run("inspect", checkpoint["local"], "--json").stdout)["tensors"])
    # Each spoiled GET costs exactly one more attempt; nothing else is retried.
    assert stats["by_method"]["GET"] <= tensors + 8 + 3


def test_a_storm_of_slowdowns_ends_in_one_clear_error(checkpoint, proxy):
    proxy.arm("503", 1000)
    env = cli_env(proxy.endpoint, WEIGHTSTREAM_S3_MAX_ATTEMPTS="3")
    result = run("digest", checkpoint["uri"], "--concurrency", 1, env=env, check=False)
    assert result.returncode != 0
    message = result.stderr
    assert "s3://%s/models/tiny/" % checkpoint["bucket"] in message
    assert "HTTP 503 SlowDown" in message and "request id FAULTPROXY" in message
    assert "after 3 attempts" in message
    assert proxy.stats()["by_method"].get("GET", 0) + proxy.stats()["by_method"].get("HEAD", 0) <= 3 * 4


def test_forbidden_says_what_to_check_and_hides_the_secret(checkpoint, proxy):
    proxy.arm("403", 1000, method="")
    for args in (("inspect", checkpoint["uri"]), ("load", checkpoint["uri"], "--json"),
                 ("digest", checkpoint["uri"], "--json")):
        result = run(*args, env=cli_env(proxy.endpoint), check=False)
        assert result.returncode != 0
        assert "HTTP 403" in result.stderr
        assert "check the credentials" in result.stderr and "region (us-east-1" in result.stderr
        assert "after 1 attempt" in result.stderr
        assert SECRET not in result.stdout + result.stderr


def test_missing_bucket_and_prefix_are_explained(checkpoint):
    result = run("inspect", "s3://no-such-bucket-%d/models" % random.randrange(10**9), check=False)
    assert result.returncode != 0
    assert "NoSuchBucket" in result.stderr and "check the bucket name" in result.stderr
    result = run("inspect", "s3://%s/models/absent-prefix" % checkpoint["bucket"], check=False)
    assert result.returncode != 0
    assert "s3://%s/models/absent-prefix" % checkpoint["bucket"] in result.stderr
    result = run("digest", checkpoint["uri"] + "/absent.safetensors", check=False)
    assert result.returncode != 0
    assert "absent.safetensors" in result.stderr


def test_missing_credentials_are_explained(checkpoint):
    env = cli_env()
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    result = run("inspect", checkpoint["uri"], env=env, check=False)
    assert result.returncode != 0
    assert "no S3 credentials" in result.stderr and "AWS_ACCESS_KEY_ID" in result.stderr


def test_credentials_from_a_shared_file_profile(checkpoint, tmp_path):
    credentials = tmp_path / "credentials"
    credentials.write_text("[default]\naws_access_key_id = wrong\naws_secret_access_key = wrong\n\n"
                           "[loader]\naws_access_key_id = testing\naws_secret_access_key = %s\n" % SECRET)
    env = cli_env(AWS_SHARED_CREDENTIALS_FILE=str(credentials), AWS_PROFILE="loader")
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    assert digest_lines(run("digest", checkpoint["uri"], env=env)) == digest_lines(run("digest", checkpoint["local"]))
    env["AWS_PROFILE"] = "absent"
    result = run("inspect", checkpoint["uri"], env=env, check=False)
    assert result.returncode != 0 and "'absent'" in result.stderr


def test_unsigned_requests_read_a_public_object(checkpoint):
    env = cli_env(WEIGHTSTREAM_S3_UNSIGNED="1")
    del env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    uri = "s3://%s/models/tiny-public/model.safetensors" % checkpoint["bucket"]
    assert digest_lines(run("digest", uri, env=env)) == \
        digest_lines(run("digest", checkpoint["local"] / "model-00001-of-00002.safetensors"))


def test_presign_matches_the_aws_example():
    env = cli_env(AWS_ACCESS_KEY_ID="AKIAIOSFODNN7EXAMPLE", AWS_SECRET_ACCESS_KEY="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    del env["AWS_ENDPOINT_URL"]
    result = run("s3", "presign", "s3://examplebucket/test.txt", "--expires", 86400, "--date", "20130524T000000Z",
                 env=env)
    assert result.stdout.strip() == (
        "https://examplebucket.s3.amazonaws.com/test.txt?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request"
        "&X-Amz-Date=20130524T000000Z&X-Amz-Expires=86400&X-Amz-SignedHeaders=host"
        "&X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404")
    assert "wJalrXUtnFEMI" not in result.stdout


def test_presign_refuses_bad_input():
    for args in (("--date", "2013-05-24"), ("--expires", "0"), ("--expires", "604801")):
        result = run("s3", "presign", "s3://bucket/key", *args, check=False)
        assert result.returncode != 0, args
    result = run("s3", "presign", "s3://bucket-only", check=False)
    assert result.returncode != 0 and "s3://BUCKET/KEY" in result.stderr


def test_a_presigned_url_fetches_the_object(checkpoint):
    result = run("s3", "presign", checkpoint["uri"] + "/config.json", "--expires", 600)
    url = result.stdout.strip()
    assert url.startswith(ENDPOINT + "/" + checkpoint["bucket"] + "/models/tiny/config.json?")
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.read() == (checkpoint["local"] / "config.json").read_bytes()


def test_a_load_counts_the_retries_its_faults_cost_in_its_report_and_its_metrics(checkpoint, proxy):
    """Three spoiled GETs: three retries, in `load --json` and in weightstream_storage_retries_total
    of the load's metrics, scraped while the load lingers (docs/METRICS.md)."""
    import signal
    import re

    pytest.importorskip("prometheus_client.parser", reason="prometheus_client is not installed (pip)")
    from prometheus_scrape import parse, scrape_text, value
    proxy.arm("503", 3)
    process = subprocess.Popen([CLI, "load", checkpoint["uri"], "--json", "--no-progress", "--concurrency", "2",
                                "--metrics-listen", "127.0.0.1:0", "--metrics-linger", "600"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=cli_env(proxy.endpoint))
    try:
        address = None
        for line in process.stderr:
            if "built without prometheus-cpp" in line:
                pytest.skip("this build has no prometheus-cpp (WS_WITH_PROMETHEUS)")
            found = re.search(r"metrics stay at http://(\S+)/metrics", line)
            if found:
                address = found.group(1)
                break
        assert address, "the load never said its metrics were up"
        text = scrape_text(address)
        process.send_signal(signal.SIGTERM)
        report = json.loads(process.stdout.read())
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    forwarded = proxy.stats()
    assert forwarded["faults"] == 3
    samples, _ = parse(text)
    # The metrics count every request of the load, the opening's (headers, index) included;
    # the report's counters are the stream's own, a part of them.
    assert value(samples, "weightstream_storage_retries_total", source="s3") == 3
    requests = value(samples, "weightstream_storage_requests_total", source="s3")
    assert requests == forwarded["requests"]  # every attempt the proxy forwarded, spoiled ones included
    assert report["storage_retries"] <= 3 and report["storage_checksum_failures"] == 0
    assert 0 < report["storage_requests"] <= requests
    assert value(samples, "weightstream_load_digest_failures_total", source="s3") == 0
    assert value(samples, "weightstream_load_read_bytes_total", source="s3") == report["bytes_read"]
    assert SECRET not in text

"""Prometheus metrics (issue 47, docs/METRICS.md): a running `serve` and an update receiver
(`audit --via tcp --await-sender`) scraped over HTTP while they run, each series checked
against what the test made them do; the scrapes are parsed by prometheus_client's parser,
so the exposition is checked too. Every port is picked by the kernel (port 0) and read back
from stderr. What a server or receiver counts on its own threads is awaited by scraping
again until it shows, never by sleeping a fixed time.
"""
import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid

import pytest
from conftest import CLI, requires_cli

pytest.importorskip("prometheus_client.parser", reason="prometheus_client is not installed (pip)")
from prometheus_scrape import scrape, scrape_text, value  # noqa: E402

pytestmark = requires_cli

TOKEN = "metrics-token-" + uuid.uuid4().hex[:12]
# UCX's tcp transport: rendezvous pulls, whose bytes the server sends and counts.
ENV = dict(os.environ, UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n", WEIGHTSTREAM_UCX_PATH="rendezvous")
WITHOUT_PROMETHEUS = "built without prometheus-cpp"
PATIENCE_SECONDS = 120  # how long a count made on another thread may take to show


def run(*arguments, stdin=None):
    return subprocess.run([CLI, *arguments], input=stdin, capture_output=True, text=True, env=ENV, timeout=300)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("metrics") / "llama"
    result = run("synth", str(path), "--arch", "llama", "--layers", "2", "--hidden", "256", "--seed", "5")
    assert result.returncode == 0, result.stderr
    return path


def checkpoint_bytes(path):
    return sum(entry.stat().st_size for entry in path.glob("*.safetensors"))


def scrape_until(address, done):
    """Scrapes until done(samples) holds; fails after PATIENCE_SECONDS."""
    deadline = time.monotonic() + PATIENCE_SECONDS
    while True:
        samples, _ = scrape(address)
        if done(samples):
            return samples
        assert time.monotonic() < deadline, f"the scrape never showed what was awaited: {samples}"
        time.sleep(0.05)


def read_stderr_until(process, pattern):
    """Lines of the process's stderr up to the first that matches `pattern`; its match."""
    seen = []
    for line in process.stderr:
        seen.append(line)
        if WITHOUT_PROMETHEUS in line:
            pytest.skip("this build has no prometheus-cpp (WS_WITH_PROMETHEUS)")
        match = re.search(pattern, line)
        if match:
            return match
    pytest.fail(f"stderr ended without {pattern!r}: {''.join(seen)}")


class Running:
    """A command started with a token on stdin; killed on exit if it still runs."""

    def __init__(self, *arguments):
        self.process = subprocess.Popen([CLI, *arguments], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=ENV)
        self.process.stdin.write(TOKEN + "\n")
        self.process.stdin.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def test_a_running_serve_shows_its_load_its_pullers_and_the_bytes_it_sent(llama, tmp_path):
    with Running("serve", str(llama), "--listen", "127.0.0.1:0", "--token-stdin", "--no-progress",
                 "--metrics-listen", "127.0.0.1:0") as serve:
        metrics = read_stderr_until(serve.process, r"metrics at http://(\S+)/metrics").group(1)
        assert metrics.startswith("127.0.0.1:") and not metrics.endswith(":0")
        line = serve.process.stdout.readline()
        ready = re.search(r"content digest ([0-9a-f]{16})\) at peer://(\S+)", line)
        if not ready and "build with UCX" in serve.process.stderr.read():
            pytest.skip("this build has no UCX (WS_WITH_UCX)")
        assert ready, line
        digest, address = ready.groups()

        samples, types = scrape(metrics)
        assert value(samples, "weightstream_load_read_bytes_total", source="file") >= checkpoint_bytes(llama) * 0.9
        assert value(samples, "weightstream_load_duration_seconds", source="file") > 0
        served = value(samples, "weightstream_peer_served_bytes")
        assert 0 < served <= checkpoint_bytes(llama)
        assert value(samples, "weightstream_peer_served_parameters") > 10
        assert value(samples, "weightstream_peer_content_info", content_digest=digest) == 1
        assert value(samples, "weightstream_peer_version") == 1
        assert value(samples, "weightstream_peer_updating") == 0
        assert value(samples, "weightstream_peer_pullers_accepted_total") == 0
        assert value(samples, "weightstream_peer_sent_bytes_total") == 0
        # prometheus_client names a counter's family without its _total.
        assert types["weightstream_peer_sent_bytes"] == "counter"
        assert types["weightstream_peer_pullers_connected"] == "gauge"

        pulled = run("load", f"peer://{address}", "--json", "--token-stdin", "--no-progress", stdin=TOKEN + "\n")
        assert pulled.returncode == 0, pulled.stderr
        assert json.loads(pulled.stdout)["peers"][0]["ucx_path"] == "rendezvous"
        samples, _ = scrape(metrics)
        assert value(samples, "weightstream_peer_pullers_accepted_total") == 1
        assert value(samples, "weightstream_peer_manifests_sent_total") == 1
        assert value(samples, "weightstream_peer_pulls_completed_total") == 1
        assert value(samples, "weightstream_peer_sent_bytes_total") >= served  # every parameter, whole
        assert value(samples, "weightstream_peer_connections_refused_total") == 0
        # The puller has gone: the server sees its connection close on its own thread.
        scrape_until(metrics, lambda s: value(s, "weightstream_peer_pullers_connected") == 0)

        refused = run("load", f"peer://{address}", "--token-stdin", "--no-progress", "--peer-timeout", "30",
                      stdin="another-token\n")
        assert refused.returncode != 0
        samples = scrape_until(metrics, lambda s: value(s, "weightstream_peer_connections_refused_total") >= 1)
        assert value(samples, "weightstream_peer_pullers_accepted_total") == 1
        assert TOKEN not in scrape_text(metrics)
        # It stops cleanly with its endpoint (a sanitizer build fails the exit on a leak).
        serve.process.send_signal(signal.SIGTERM)
        assert serve.process.wait(timeout=60) == 0, serve.process.stderr.read()


def test_a_receiver_shows_each_update_it_applied_while_it_awaits_the_next(llama, tmp_path):
    with Running("audit", str(llama), "--via", "tcp", "--await-sender", "--token-stdin", "--repeat", "2",
                 "--bucket-size", "1MiB", "--json", "--no-progress", "--metrics-listen", "0") as audit:
        metrics = read_stderr_until(audit.process, r"metrics at http://(\S+)/metrics").group(1)
        assert metrics.startswith("127.0.0.1:")  # a bare port listens on loopback
        receiver = read_stderr_until(audit.process, r"awaiting a sender at (\S+)").group(1)

        samples, types = scrape(metrics)
        assert value(samples, "weightstream_load_read_bytes_total", source="file") > 0
        for name in ("weightstream_updates_completed_total", "weightstream_updates_started_total",
                     "weightstream_update_senders_accepted_total", "weightstream_update_in_progress",
                     "weightstream_update_duration_seconds_count"):
            assert value(samples, name, transport="tcp") == 0, name
        assert types["weightstream_update_duration_seconds"] == "histogram"

        def send(token=TOKEN):
            return run("send", str(llama), "--to", receiver, "--via", "tcp", "--bucket-size", "1MiB",
                       "--token-stdin", "--no-progress", "--json", stdin=token + "\n")

        assert send("another-token").returncode != 0
        scrape_until(metrics, lambda s: value(s, "weightstream_update_connections_refused_total", transport="tcp") == 1)
        sent = send()
        assert sent.returncode == 0, sent.stderr
        first = json.loads(sent.stdout)
        # The receiver records an update once its receive() returns, after it answered the
        # sender: awaited, then checked whole while the receiver waits for the second.
        samples = scrape_until(metrics, lambda s: value(s, "weightstream_updates_completed_total", transport="tcp") == 1)
        assert value(samples, "weightstream_update_received_bytes_total", transport="tcp") == first["bytes"]
        assert first["bytes"] >= checkpoint_bytes(llama) * 0.9
        assert value(samples, "weightstream_update_tensors_total", transport="tcp") == first["tensors"]
        assert value(samples, "weightstream_update_duration_seconds_count", transport="tcp") == 1
        assert value(samples, "weightstream_update_duration_seconds_sum", transport="tcp") > 0
        assert value(samples, "weightstream_update_duration_seconds_bucket", transport="tcp", le="+Inf") == 1
        assert value(samples, "weightstream_update_phase_seconds_total", transport="tcp", phase="finishing") > 0
        assert abs(value(samples, "weightstream_update_last_completed_timestamp_seconds", transport="tcp")
                   - time.time()) < 3600
        assert value(samples, "weightstream_updates_started_total", transport="tcp") == 1
        assert value(samples, "weightstream_updates_failed_total", transport="tcp") == 0
        assert value(samples, "weightstream_update_senders_accepted_total", transport="tcp") == 1
        assert value(samples, "weightstream_update_in_progress", transport="tcp") == 0
        assert value(samples, "weightstream_update_connections_refused_total", transport="tcp") == 1

        assert send().returncode == 0
        audit.process.wait(timeout=300)
        out, err = audit.process.stdout.read(), audit.process.stderr.read()
        assert audit.process.returncode == 0, err
        report = json.loads(out)
        assert report["clean"] is True and report["repeat"] == 2


def free_port_held():
    """A loopback socket listening on a port the kernel picked: that port is in use."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder


def test_a_metrics_port_in_use_fails_before_the_load_naming_it(llama):
    with free_port_held() as holder:
        port = holder.getsockname()[1]
        result = run("serve", str(llama), "--open-without-token", "--no-progress", "--metrics-listen",
                     f"127.0.0.1:{port}")
    if WITHOUT_PROMETHEUS in result.stderr:
        pytest.skip("this build has no prometheus-cpp (WS_WITH_PROMETHEUS)")
    assert result.returncode == 1, result.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port} (--metrics-listen): Address already in use" in result.stderr
    assert "serving" not in result.stdout


@pytest.mark.parametrize("text, needle", [
    ("abc", "--metrics-listen 'abc' is not HOST:PORT or PORT with a port from 0 to 65535"),
    ("127.0.0.1:65536", "--metrics-listen '127.0.0.1:65536' is not HOST:PORT or PORT with a port from 0 to 65535"),
    (":9400", "--metrics-listen ':9400' is not HOST:PORT"),
    ("::1:9400", "(an IPv6 host goes in brackets: [::1]:PORT)"),
])
def test_a_malformed_metrics_address_is_a_usage_error(llama, text, needle):
    result = run("serve", str(llama), "--open-without-token", "--no-progress", "--metrics-listen", text)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr


def test_the_receivers_metrics_need_via(llama):
    result = run("audit", str(llama), "--metrics-listen", "0", "--no-progress")
    assert result.returncode == 2, result.stderr
    assert "--metrics-listen requires --via" in result.stderr


# ---- a plain `load` (and its layout, peer and export paths) ------------------------------

LINGER = "600"  # far longer than any test: SIGTERM ends the wait


def load_with_metrics(*arguments, command="load", stdin=""):
    """Runs `command ... --metrics-listen 127.0.0.1:0 --metrics-linger 600`, scrapes once the
    command says its final values are up, then ends the wait with SIGTERM. Returns the scrape
    ({(name, labels): value}, {family: type}), what the command printed (JSON) and its stderr."""
    process = subprocess.Popen([CLI, command, *arguments, "--json", "--no-progress", "--metrics-listen", "127.0.0.1:0",
                                "--metrics-linger", LINGER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        process.stdin.write(stdin)
        process.stdin.close()
        address = read_stderr_until(process, r"metrics at http://(\S+)/metrics").group(1)
        lingering = read_stderr_until(process, r"metrics stay at http://(\S+)/metrics for 600 s")
        assert lingering.group(1) == address
        samples, types = scrape(address)
        process.send_signal(signal.SIGTERM)
        out, err = process.stdout.read(), process.stderr.read()  # both small: neither pipe fills
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    assert "metrics endpoint closed by SIGTERM" in err
    return samples, types, json.loads(out)


def tensor_bytes(path):
    result = run("inspect", str(path), "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["bytes"]


def test_a_load_shows_what_it_read_its_phases_and_its_link_efficiency(llama):
    samples, types, report = load_with_metrics(str(llama), "--link-rate", "2.5")
    read = value(samples, "weightstream_load_read_bytes_total", source="file")
    assert read == report["bytes_read"] == tensor_bytes(llama)  # every tensor, once
    seconds = value(samples, "weightstream_load_duration_seconds", source="file")
    assert seconds == pytest.approx(report["seconds"]) and seconds > 0
    for phase in ("read", "deliver", "staging_wait"):
        assert value(samples, "weightstream_load_phase_seconds", source="file", phase=phase) == \
            pytest.approx(report[phase + "_seconds"])
    assert value(samples, "weightstream_load_phase_seconds", source="file", phase="deliver") >= 0
    # Local files send no requests: nothing to retry, no stored checksum to miss.
    assert value(samples, "weightstream_storage_requests_total", source="file") == 0
    assert value(samples, "weightstream_storage_retries_total", source="file") == 0
    assert value(samples, "weightstream_load_digest_failures_total", source="file") == 0
    assert value(samples, "weightstream_load_link_rate_bytes_per_second", source="file") == 2.5e9
    assert value(samples, "weightstream_load_link_efficiency", source="file") == pytest.approx(read / seconds / 2.5e9)
    assert types["weightstream_load_read_bytes"] == "counter"
    assert types["weightstream_load_link_efficiency"] == "gauge"
    # The progress a scrape during the load sees, at its final values.
    assert value(samples, "weightstream_load_progress_bytes") == value(samples, "weightstream_load_planned_bytes") \
        == report["bytes"]
    assert not any(name.startswith("weightstream_load_peer") for name, _ in samples)


def test_a_layout_load_shows_the_bytes_of_its_rank(llama):
    samples, _, report = load_with_metrics(str(llama), "--tp-size", "2", "--tp-rank", "1")
    read = value(samples, "weightstream_load_read_bytes_total", source="file")
    assert read == report["bytes_read"] and 0 < read < tensor_bytes(llama)  # this rank's ranges only
    assert value(samples, "weightstream_load_progress_bytes") == value(samples, "weightstream_load_planned_bytes") > 0
    assert value(samples, "weightstream_load_duration_seconds", source="file") == pytest.approx(report["seconds"])
    # Without --link-rate there is no rate to compare with.
    assert ("weightstream_load_link_efficiency", (("source", "file"),)) not in samples


def test_an_export_shows_its_load(llama, tmp_path):
    samples, _, report = load_with_metrics(str(llama), str(tmp_path / "rank.safetensors"), command="export")
    assert value(samples, "weightstream_load_read_bytes_total", source="file") == tensor_bytes(llama)
    assert report["tensors"] > 10


def test_a_load_from_a_peer_shows_the_bytes_by_peer_and_transport(llama):
    with Running("serve", str(llama), "--listen", "127.0.0.1:0", "--token-stdin", "--no-progress") as serve:
        line = serve.process.stdout.readline()
        ready = re.search(r"at peer://(\S+)", line)
        if not ready and "build with UCX" in serve.process.stderr.read():
            pytest.skip("this build has no UCX (WS_WITH_UCX)")
        assert ready, line
        address = ready.group(1)
        samples, _, report = load_with_metrics(f"peer://{address}", "--token-stdin", stdin=TOKEN + "\n")
    pulled = report["bytes_from_peers"]
    assert pulled > 0
    assert value(samples, "weightstream_load_read_bytes_total", source="peer") == pulled
    assert value(samples, "weightstream_load_duration_seconds", source="peer") > 0
    transports = report["peers"][0]["ucx_transports"]
    assert value(samples, "weightstream_load_peer_read_bytes_total", peer=address, transport=transports) == pulled
    assert value(samples, "weightstream_load_digest_failures_total", source="peer") == 0


def test_a_pull_that_fails_over_to_storage_shows_the_fallbacks_load(llama):
    with socket.socket() as closed:  # bound, never listening: a connect is refused at once
        closed.bind(("127.0.0.1", 0))
        address = "127.0.0.1:%d" % closed.getsockname()[1]
        samples, _, report = load_with_metrics(f"peer://{address}", "--fallback", str(llama), "--token-stdin",
                                               stdin=TOKEN + "\n")
    assert "peer_failure" in report and report["bytes_from_peers"] == 0
    assert value(samples, "weightstream_load_read_bytes_total", source="file") == report["bytes_read"] > 0
    assert not any(name == "weightstream_load_read_bytes_total" and labels == (("source", "peer"),)
                   for name, labels in samples)


def test_without_linger_the_load_ends_at_once_and_its_endpoint_with_it(llama):
    result = run("load", str(llama), "--no-progress", "--metrics-listen", "127.0.0.1:0")
    if WITHOUT_PROMETHEUS in result.stderr:
        pytest.skip("this build has no prometheus-cpp (WS_WITH_PROMETHEUS)")
    assert result.returncode == 0, result.stderr
    assert "metrics at http://127.0.0.1:" in result.stderr and "metrics stay" not in result.stderr


@pytest.mark.parametrize("arguments, needle", [
    (["--link-rate", "0"], "--link-rate: '0' is not a number above 0 (GB/s)"),
    (["--link-rate", "-3"], "--link-rate: '-3' is not a number above 0 (GB/s)"),
    (["--link-rate", "fast"], "--link-rate: 'fast' is not a number above 0 (GB/s)"),
    (["--metrics-linger", "-1"], "--metrics-linger: '-1' is not a number of at least 0 (seconds)"),
    (["--metrics-listen", "x"], "--metrics-listen 'x' is not HOST:PORT or PORT with a port from 0 to 65535"),
])
def test_bad_load_metrics_flags_are_usage_errors(llama, arguments, needle):
    if "--metrics-listen" not in arguments:
        arguments = [*arguments, "--metrics-listen", "0"]
    result = run("load", str(llama), "--no-progress", *arguments)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    assert "loaded" not in result.stdout


@pytest.mark.parametrize("flag, value_text", [("--link-rate", "1"), ("--metrics-linger", "5")])
def test_the_load_metrics_flags_need_an_endpoint(llama, flag, value_text):
    result = run("load", str(llama), "--no-progress", flag, value_text)
    assert result.returncode == 2, result.stderr
    assert f"{flag} requires --metrics-listen" in result.stderr


def test_a_load_whose_metrics_port_is_in_use_fails_before_it_reads(llama):
    with free_port_held() as holder:
        port = holder.getsockname()[1]
        result = run("load", str(llama), "--no-progress", "--metrics-listen", f"127.0.0.1:{port}")
    if WITHOUT_PROMETHEUS in result.stderr:
        pytest.skip("this build has no prometheus-cpp (WS_WITH_PROMETHEUS)")
    assert result.returncode == 1, result.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port} (--metrics-listen): Address already in use" in result.stderr
    assert result.stdout == ""

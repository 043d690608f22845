"""Prometheus metrics from Python (issue 47, docs/METRICS.md): weightstream.metrics serves
the series of the command under the same names, here from an UpdateReceiver given
``metrics=``, scraped over HTTP and parsed with prometheus_client's parser. Every port is
picked by the kernel; nothing waits on a timer: each scrape follows what it checks (an
update returned, a sender refused and joined)."""
import gc
import socket
import threading
import time

import pytest
from conftest import cold_layout, requires_cli

weightstream = pytest.importorskip("weightstream")
pytest.importorskip("prometheus_client.parser", reason="prometheus_client is not installed (pip)")
from prometheus_scrape import scrape, scrape_text, value  # noqa: E402
from test_transfer import synth  # noqa: E402

pytestmark = requires_cli


@pytest.fixture
def metrics():
    endpoint = weightstream.metrics.serve("127.0.0.1:0")
    yield endpoint
    endpoint.close()


def test_a_receiver_with_metrics_shows_its_refusals_and_each_update_it_applied(tmp_path, metrics):
    old, new = synth(tmp_path / "old", 1), synth(tmp_path / "new", 2)
    receiver = weightstream.UpdateReceiver(cold_layout(old), transport="tcp", token="s3cret", timeout=30.0,
                                           metrics=metrics)
    assert metrics.address.startswith("127.0.0.1:") and not metrics.address.endswith(":0")
    samples, types = scrape(metrics.address)
    assert value(samples, "weightstream_updates_completed_total", transport="tcp") == 0
    assert value(samples, "weightstream_update_in_progress", transport="tcp") == 0
    assert value(samples, "weightstream_update_duration_seconds_count", transport="tcp") == 0
    assert types["weightstream_update_duration_seconds"] == "histogram"
    assert types["weightstream_update_connections_refused"] == "counter"

    reports, errors = [], []

    def receive():
        try:
            reports.append(receiver.receive(accept_timeout=60.0))
        except weightstream.Error as error:
            errors.append(str(error))

    thread = threading.Thread(target=receive)
    thread.start()
    with pytest.raises(weightstream.Error, match="could not prove the token"):
        weightstream.UpdateSender(receiver.address, transport="tcp", token="wrong")
    sender = weightstream.UpdateSender(receiver.address, transport="tcp", token="s3cret", bucket_bytes=1 << 20)
    echoed = sender.update({name: tensor for name, tensor in new.stream(framework="numpy")})
    thread.join(timeout=60)
    assert not thread.is_alive() and reports and not errors
    started = time.time()

    samples, _ = scrape(metrics.address)
    assert value(samples, "weightstream_updates_completed_total", transport="tcp") == 1
    assert value(samples, "weightstream_update_received_bytes_total", transport="tcp") == reports[0]["bytes"] \
        == echoed["bytes"] > 0
    assert value(samples, "weightstream_update_tensors_total", transport="tcp") == reports[0]["tensors"]
    assert value(samples, "weightstream_update_duration_seconds_count", transport="tcp") == 1
    assert value(samples, "weightstream_update_duration_seconds_sum", transport="tcp") == \
        pytest.approx(reports[0]["seconds"])
    assert value(samples, "weightstream_update_phase_seconds_total", transport="tcp", phase="checking") > 0
    assert abs(value(samples, "weightstream_update_last_completed_timestamp_seconds", transport="tcp") - started) < 3600
    # The receiver's own counters, read from it at the scrape.
    assert value(samples, "weightstream_update_senders_accepted_total", transport="tcp") == 1
    assert value(samples, "weightstream_updates_started_total", transport="tcp") == 1
    assert value(samples, "weightstream_updates_failed_total", transport="tcp") == 0
    assert value(samples, "weightstream_update_in_progress", transport="tcp") == 0
    assert receiver.stats["updates_completed"] == 1
    # The wrong token's connection was refused by the time the good sender was accepted:
    # the receiver serves one connection at a time.
    assert value(samples, "weightstream_update_connections_refused_total", transport="tcp") == 1
    assert "s3cret" not in scrape_text(metrics.address)

    # A receiver gone (one a step, say): what it counted stays, as counters must.
    del receiver, receive
    gc.collect()
    assert not metrics._receivers._watched, "the receiver was not collected"  # else this checks nothing
    after, _ = scrape(metrics.address)
    for name in ("weightstream_update_senders_accepted_total", "weightstream_update_connections_refused_total",
                 "weightstream_updates_started_total", "weightstream_updates_completed_total"):
        assert value(after, name, transport="tcp") == value(samples, name, transport="tcp"), name


def test_a_load_recorded_shows_under_the_commands_names(metrics):
    metrics.record_load({"source": "s3://bucket/model", "bytes_read": 4_000_000_000, "seconds": 2.0,
                         "stream": {"read_seconds": 3.5, "deliver_seconds": 0.5, "staging_wait_seconds": 0.25,
                                    "storage_requests": 70, "storage_retries": 3, "storage_checksum_failures": 1}},
                        link_rate=4.0)
    samples, types = scrape(metrics.address)
    assert value(samples, "weightstream_load_read_bytes_total", source="s3") == 4e9
    assert value(samples, "weightstream_load_duration_seconds", source="s3") == 2.0
    assert value(samples, "weightstream_load_phase_seconds", source="s3", phase="read") == 3.5
    assert value(samples, "weightstream_storage_requests_total", source="s3") == 70
    assert value(samples, "weightstream_storage_retries_total", source="s3") == 3
    assert value(samples, "weightstream_load_digest_failures_total", source="s3") == 1
    assert value(samples, "weightstream_load_link_efficiency", source="s3") == pytest.approx(0.5)  # 2 of 4 GB/s
    assert types["weightstream_storage_retries"] == "counter"


@pytest.mark.parametrize("listen, message", [
    ("abc", "metrics_listen 'abc' is not HOST:PORT or PORT with a port from 0 to 65535"),
    ("127.0.0.1:70000", "metrics_listen '127.0.0.1:70000' is not HOST:PORT or PORT with a port from 0 to 65535"),
    (":9400", "metrics_listen ':9400' is not HOST:PORT"),
])
def test_a_malformed_address_is_refused_naming_it(listen, message):
    with pytest.raises(ValueError) as refused:
        weightstream.metrics.serve(listen)
    assert message in str(refused.value)


def test_a_port_in_use_is_refused_naming_the_address():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(weightstream.Error) as refused:
            weightstream.metrics.serve(f"127.0.0.1:{port}")
    assert f"cannot serve metrics on 127.0.0.1:{port} (metrics_listen): Address already in use" in str(refused.value)

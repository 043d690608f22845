"""weightstream.sglang's Prometheus metrics (issue 47, docs/METRICS.md) against the real SGLang
on the CPU: ``metrics_listen`` in ``--model-loader-extra-config`` makes the rank serve the load
series, and those of the updates it receives through SGLang's update API, under the names the
command uses. SGLang's own ModelRunner (tests/python/sglang_models.py) loads a small Llama in a
process of its own, which scrapes its endpoint once the load returned and once an update did.
Runs under scripts/sglang-test.sh; skipped where SGLang is not installed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (scripts/sglang-test.sh installs it)")
pytest.importorskip("prometheus_client.parser", reason="prometheus_client is not installed (pip)")
from prometheus_scrape import parse, value  # noqa: E402

HERE = Path(__file__).resolve().parent

# One rank: SGLang's load with weightstream and metrics_listen, then a scrape of this process.
RANK = """
import glob, json, os, sys
from safetensors.torch import load_file
import prometheus_scrape, sglang_models, weightstream.metrics
sglang_models.prepare_sglang(1)
runner = sglang_models.build(sys.argv[1], 1, 0, False, "weightstream", int(sys.argv[2]),
                             {"metrics_listen": "127.0.0.1:0", "link_rate": 1.0})
address = weightstream.metrics.serve_once("127.0.0.1:0").address
loaded = prometheus_scrape.scrape_text(address)
tensors = {}
for file in sorted(glob.glob(os.path.join(sys.argv[1], "*.safetensors"))):
    tensors.update(load_file(file))
report = sglang_models.update(runner, sorted(tensors.items()), "shm", 1, 0)
print(json.dumps({"load": runner.model._weightstream_last_load, "loaded": loaded,
                  "updated": prometheus_scrape.scrape_text(address)}))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_sglang_load_and_update_show_in_its_metrics(tmp_path):
    sys.path.insert(0, str(HERE))
    from sglang_models import write_sglang_checkpoint

    folder = write_sglang_checkpoint("llama", str(tmp_path / "llama"), 1)
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", RANK, folder, str(free_port())], capture_output=True, text=True,
                            env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    load = outcome["load"]
    samples, _ = parse(outcome["loaded"])

    assert load["path"] == "layout"
    read = value(samples, "weightstream_load_read_bytes_total", source="file")
    assert read == load["bytes_read"] > 0
    seconds = value(samples, "weightstream_load_duration_seconds", source="file")
    assert seconds == pytest.approx(load["seconds"]) and seconds > 0
    assert value(samples, "weightstream_load_phase_seconds", source="file", phase="read") >= 0
    assert value(samples, "weightstream_storage_retries_total", source="file") == 0
    assert value(samples, "weightstream_load_link_efficiency", source="file") == pytest.approx(read / seconds / 1e9)

    # SGLang's update API makes a receiver an update: what it counted stays once it is gone.
    updated, _ = parse(outcome["updated"])
    assert value(updated, "weightstream_updates_completed_total", transport="shm") == 1
    assert value(updated, "weightstream_update_received_bytes_total", transport="shm") > 0
    assert value(updated, "weightstream_update_senders_accepted_total", transport="shm") == 1
    assert value(updated, "weightstream_updates_started_total", transport="shm") == 1
    assert value(updated, "weightstream_updates_failed_total", transport="shm") == 0

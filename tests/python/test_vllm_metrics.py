"""weightstream.vllm's Prometheus metrics (issue 47, docs/METRICS.md) against the real vLLM on
the CPU: ``metrics_listen`` in ``--model-loader-extra-config`` makes each rank serve the load
series (and, through the weight-transfer backend, the update series) under the names the
command uses. Each rank scrapes its own endpoint after its load returned and after its update
was applied. Runs under scripts/vllm-test.sh; skipped where vLLM is not installed."""

from __future__ import annotations

import os
import threading

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/vllm-test.sh installs it)")
torch = pytest.importorskip("torch")
pytest.importorskip("prometheus_client.parser", reason="prometheus_client is not installed (pip)")

import weightstream  # noqa: E402
import weightstream.vllm as ws_vllm  # noqa: E402
from prometheus_scrape import scrape, value  # noqa: E402
from test_vllm import checkpoints, model_config, run_ranks  # noqa: E402,F401 - the module's fixture
from vllm_tiny_llama import CONFIG, TinyLlama, distributed  # noqa: E402


EXTRA = {"metrics_listen": "127.0.0.1:0", "link_rate": 1.0}


def _load_then_update(tp_size, rank, port, paths):
    """Loads with metrics_listen, scrapes, pushes an update over shm, scrapes again."""
    with distributed(tp_size, rank, port) as vllm_config:
        ws_vllm.register()
        from vllm.config import LoadConfig
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
        from vllm.model_executor.model_loader import get_model_loader

        load_config = LoadConfig(load_format="weightstream", model_loader_extra_config=dict(EXTRA))
        vllm_config.load_config = load_config
        loader = get_model_loader(load_config)
        model = TinyLlama(CONFIG)
        loader.load_weights(model, model_config(paths[1]))
        # Port 0: each rank's endpoint took a free port; the process holds one per address.
        address = weightstream.metrics.serve_once("127.0.0.1:0").address
        loaded, _ = scrape(address)
        last_load = dict(loader.last_load)

        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="weightstream"), vllm_config,
                                                           torch.device("cpu"), model)
        engine.init_transfer_engine(engine.parse_init_info({"transport": "shm", "token": "secret"}))
        from safetensors.torch import load_file

        tensors = {}
        for file in sorted(os.listdir(paths[2])):
            if file.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(paths[2], file)))

        def trainer():
            weightstream.UpdateSender(engine.address, transport="shm", token="secret").update(sorted(tensors.items()))

        thread = threading.Thread(target=trainer)
        thread.start()
        engine.receive_weights(engine.parse_update_info({"accept_timeout": 60.0}))
        thread.join()
        updated, _ = scrape(address)
        report = dict(engine.last_report)
        engine.shutdown()
        return {"loaded": loaded, "last_load": last_load, "updated": updated, "report": report}


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_vllm_load_and_update_show_in_each_ranks_metrics(checkpoints, tp_size):  # noqa: F811
    for rank, outcome in enumerate(run_ranks(_load_then_update, tp_size, checkpoints)):
        loaded, last_load = outcome["loaded"], outcome["last_load"]
        read = value(loaded, "weightstream_load_read_bytes_total", source="file")
        assert read == last_load["bytes_read"] > 0, f"rank {rank}"
        seconds = value(loaded, "weightstream_load_duration_seconds", source="file")
        assert seconds == pytest.approx(last_load["seconds"]) and seconds > 0
        for phase in ("read", "deliver", "staging_wait"):
            assert value(loaded, "weightstream_load_phase_seconds", source="file", phase=phase) >= 0
        assert value(loaded, "weightstream_storage_retries_total", source="file") == 0
        assert value(loaded, "weightstream_load_digest_failures_total", source="file") == 0
        assert value(loaded, "weightstream_load_link_efficiency", source="file") == pytest.approx(read / seconds / 1e9)
        # No receiver yet: the update series come with the weight-transfer backend's.
        assert not any(name.startswith("weightstream_update") for name, _ in loaded)

        updated, report = outcome["updated"], outcome["report"]
        assert value(updated, "weightstream_updates_completed_total", transport="shm") == 1
        assert value(updated, "weightstream_update_received_bytes_total", transport="shm") == \
            report["bytes"] + report["shared_bytes"] > 0
        assert value(updated, "weightstream_update_senders_accepted_total", transport="shm") == 1
        assert value(updated, "weightstream_update_connections_refused_total", transport="shm") == 0
        assert value(updated, "weightstream_update_duration_seconds_count", transport="shm") == 1


@pytest.mark.parametrize("extra, message", [
    ({"metrics_listen": "nowhere"}, "metrics_listen 'nowhere' is not HOST:PORT or PORT"),
    ({"metrics_listen": "0", "link_rate": 0}, "link_rate must be GB/s above 0, got 0"),
    ({"metrics_listen": "0", "link_rate": -2.5}, "link_rate must be GB/s above 0, got -2.5"),
    ({"link_rate": 1}, "link_rate is shown in the metrics: it needs metrics_listen"),
])
def test_bad_metrics_keys_fail_when_the_loader_is_made(extra, message):
    ws_vllm.register()
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    with pytest.raises(ValueError) as refused:
        get_model_loader(LoadConfig(load_format="weightstream", model_loader_extra_config=extra))
    assert message in str(refused.value)

"""weightstream.sglang's registration and its checks of bad input, against the real SGLang
0.5.23 (scripts/sglang-test.sh); SGLang's own model classes are tests/python/test_sglang_models.py."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (scripts/sglang-test.sh installs it)")
torch = pytest.importorskip("torch")

import weightstream.sglang as ws_sglang  # noqa: E402


@pytest.fixture(scope="module")
def plugins():
    """SGLang's own plugin loading, as every SGLang process runs it: weightstream's entry point."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return True


def test_the_entry_point_adds_the_load_format_and_its_loader(plugins):
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat
    from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader

    assert ws_sglang.supported(ws_sglang.sglang_version())
    assert "weightstream" in LOAD_FORMAT_CHOICES
    config = LoadConfig(load_format="weightstream")
    assert config.load_format is ws_sglang.WeightstreamModelLoader
    loader = get_model_loader(config)
    assert isinstance(loader, ws_sglang.WeightstreamModelLoader) and isinstance(loader, DefaultModelLoader)
    # DefaultModelLoader's own methods then see SGLang's default format.
    assert config.load_format == LoadFormat.AUTO
    # Every other format is still SGLang's.
    assert LoadConfig(load_format="safetensors").load_format == LoadFormat.SAFETENSORS
    with pytest.raises(ValueError, match="'nonsense' is not a valid LoadFormat"):
        LoadConfig(load_format="nonsense")


def test_an_unknown_extra_config_key_fails_when_the_loader_is_made(plugins):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader

    config = LoadConfig(load_format="weightstream", model_loader_extra_config={"memory_limit": "64MiB", "nope": 1})
    with pytest.raises(ValueError, match=r"--model-loader-extra-config for --load-format weightstream: unknown "
                                         r"key\(s\) nope \(accepted: concurrency"):
        get_model_loader(config)
    with pytest.raises(ValueError, match="serve must be HOST:PORT"):
        get_model_loader(LoadConfig(load_format="weightstream", model_loader_extra_config={"serve": "nowhere"}))
    loader = get_model_loader(LoadConfig(load_format="weightstream",
                                         model_loader_extra_config={"memory_limit": "64MiB"}))
    assert loader.options.stream == {"memory_limit": "64MiB"}


def test_an_update_request_round_trips_and_other_tensors_are_refused_by_name():
    from weightstream.sglang._update import _parse_request

    request = ws_sglang.update_request(["/tmp/a.sock", "/tmp/b.sock"], "shm", "secret", 10, 20)
    assert [name for name, _ in request] == ["weightstream.update_request"]
    assert _parse_request(request) == {"addresses": ["/tmp/a.sock", "/tmp/b.sock"], "transport": "shm",
                                       "token": "secret", "timeout": 10.0, "accept_timeout": 20.0,
                                       "draft_addresses": None}
    # An engine with a speculative draft: its runner's receivers listen at their own addresses.
    with_draft = ws_sglang.update_request(["/tmp/a.sock"], draft_addresses=["/tmp/draft-a.sock"])
    assert _parse_request(with_draft)["draft_addresses"] == ["/tmp/draft-a.sock"]
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"weightstream.sglang.receive_update takes the one tensor "
                                         r"weightstream.sglang.update_request makes \(weightstream.update_request\); "
                                         r"got 1 tensors: model.layers.0.weight"):
        ws_sglang.receive_update(model, [("model.layers.0.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match="is not a request update_request made"):
        ws_sglang.receive_update(model, [("weightstream.update_request", torch.zeros(3, dtype=torch.uint8))])
    # Every transport of the library's UpdateSender: ucx's receivers listen at HOST:PORT, as tcp's.
    from weightstream._push import free_addresses

    listen = free_addresses("ucx", 2)
    assert all(re.fullmatch(r"127\.0\.0\.1:\d+", address) for address in listen), listen
    assert _parse_request(ws_sglang.update_request(listen, "ucx"))["transport"] == "ucx"
    with pytest.raises(ValueError, match="transport 'carrier-pigeon' is not one of shm, tcp, cuda-ipc, nccl, ucx$"):
        ws_sglang.update_request(["/tmp/a.sock"], "carrier-pigeon")


def test_sglang_serves_command_line_takes_the_load_format_and_the_update_loader(plugins, tmp_path):
    """What a user types, through SGLang's own parser (launch_server runs load_plugins first)."""
    import json

    from sglang.srt.server_args import prepare_server_args

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    args = prepare_server_args(["--model-path", str(tmp_path), "--load-format", "weightstream",
                                "--model-loader-extra-config", '{"memory_limit": "2GiB", "concurrency": 32}',
                                "--custom-weight-loader", ws_sglang.UPDATE_LOADER])
    assert args.load_format == "weightstream"
    assert ws_sglang.UPDATE_LOADER in args.custom_weight_loader

"""weightstream.vllm against the real vLLM (0.33.0 here), on the CPU, mocking nothing of vLLM:
its loader registry and transfer-engine factory return ours, and a small Llama made of
vLLM's own parallel layers (tests/python/vllm_tiny_llama.py) at tensor-parallel size 1 and
2 (two gloo processes) is loaded, reloaded and updated through weightstream and compared
tensor by tensor with the same layers filled by their own weight_loader.

Skipped where vLLM is not installed; scripts/vllm-test.sh makes an environment with it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
import traceback

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (scripts/vllm-test.sh installs it)")
torch = pytest.importorskip("torch")

import weightstream  # noqa: E402
import weightstream.vllm as ws_vllm  # noqa: E402
from vllm_tiny_llama import CONFIG, TinyLlama, distributed, write_checkpoint  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three checkpoints of one small Llama (seeds 1, 2, 3): load, reload, update."""
    root = tmp_path_factory.mktemp("vllm")
    paths = {seed: str(root / f"seed-{seed}") for seed in (1, 2, 3)}
    for seed, path in paths.items():
        write_checkpoint(path, CONFIG, seed)
    return paths


def model_config(path: str):
    """vLLM's own ModelConfig of a checkpoint folder, in float32 on the CPU."""
    from vllm.config import ModelConfig

    return ModelConfig(model=path, dtype="float32", skip_tokenizer_init=True)


def run_ranks(scenario, tp_size: int, *args):
    """Runs ``scenario(tp_size, rank, port, *args)`` in one spawned process per rank (vLLM's
    parallel state is per process) and fails with the first rank's traceback."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank_main, args=(scenario, tp_size, rank, port, args, results))
                 for rank in range(tp_size)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    failures = [text for ok, text in outcomes if not ok]
    assert not failures, "\n".join(failures)
    return [text for _, text in outcomes]


def _rank_main(scenario, tp_size, rank, port, args, results):
    try:
        results.put((True, scenario(tp_size, rank, port, *args)))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((False, f"rank {rank}:\n{traceback.format_exc()}"))


# ---- registration ------------------------------------------------------------------------

def test_the_entry_point_registers_the_loader_and_the_backend():
    from importlib.metadata import entry_points

    plugins = {entry.name: entry.value for entry in entry_points(group="vllm.general_plugins")}
    assert plugins.get("weightstream") == "weightstream.vllm:register"
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    assert type(get_model_loader(LoadConfig(load_format="weightstream"))).__name__ == "WeightstreamModelLoader"


def test_vllm_registry_returns_our_loader_with_our_options():
    assert ws_vllm.register()
    assert ws_vllm.register()  # a second call (every process calls it) is harmless
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from weightstream.vllm._loader import WeightstreamModelLoader

    loader = get_model_loader(LoadConfig(load_format="weightstream",
                                         model_loader_extra_config={"memory_limit": "64MiB", "concurrency": 4}))
    assert isinstance(loader, WeightstreamModelLoader)
    assert loader.options.stream == {"memory_limit": "64MiB", "concurrency": 4}
    # Every stream option of the Python API is a key here, as docs/VLLM.md lists them.
    loader = get_model_loader(LoadConfig(load_format="weightstream",
                                         model_loader_extra_config={"mapped_share": 0.25, "prefetchers": 0}))
    assert loader.options.stream == {"mapped_share": 0.25, "prefetchers": 0}


def test_unknown_or_malformed_extra_config_fails_when_the_loader_is_made():
    ws_vllm.register()
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    with pytest.raises(ValueError, match="unknown key.*memory_limt.*accepted: concurrency, memory_limit"):
        get_model_loader(LoadConfig(load_format="weightstream", model_loader_extra_config={"memory_limt": "1GiB"}))
    with pytest.raises(weightstream.Error, match="12XB"):
        get_model_loader(LoadConfig(load_format="weightstream", model_loader_extra_config={"memory_limit": "12XB"}))


def test_peer_keys_of_the_extra_config_are_checked_when_the_loader_is_made():
    ws_vllm.register()
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from weightstream.vllm._model import serve_address

    def loader(extra):
        return get_model_loader(LoadConfig(load_format="weightstream", model_loader_extra_config=extra))

    options = loader({"model_uri": "peer://10.0.0.5:7000,10.0.0.5:7001", "serve": "0.0.0.0:7100",
                      "peer_timeout": 5, "peer_token": "secret"}).options
    assert options.model_uri == "peer://10.0.0.5:7000,10.0.0.5:7001" and options.peer_timeout == 5.0
    assert options.peer_token == "secret" and options.serve == "0.0.0.0:7100"
    assert loader({}).options.peer_token is None  # WEIGHTSTREAM_PEER_TOKEN, read by the core
    assert serve_address("0.0.0.0:7100", 3) == "0.0.0.0:7103"
    assert serve_address("127.0.0.1:0", 3) == "127.0.0.1:0"
    with pytest.raises(ValueError, match="serve must be HOST:PORT"):
        loader({"serve": "7100"})
    with pytest.raises(ValueError, match="rank 1 would serve at port 65536"):
        serve_address("h:65535", 1)
    with pytest.raises(ValueError, match="peer_timeout must be seconds above 0"):
        loader({"peer_timeout": 0})
    with pytest.raises(weightstream.Error, match="peer://10.0.0.5:7000,"):
        loader({"model_uri": "peer://10.0.0.5:7000,"})
    with pytest.raises(ValueError, match="peer_token must be a string") as error:
        loader({"peer_token": 1234})
    assert "1234" not in str(error.value)
    pinned = loader({"model_uri": "peer://10.0.0.5:7000", "peer_expect_digest": "5F0E1C2D3B4A6978"}).options
    assert pinned.peer_expect_digest == "5F0E1C2D3B4A6978" and loader({}).options.peer_expect_digest is None
    with pytest.raises(ValueError, match="peer_expect_digest must be a content digest of 16 hex digits .* got '5f0e'"):
        loader({"model_uri": "peer://10.0.0.5:7000", "peer_expect_digest": "5f0e"})
    with pytest.raises(ValueError, match="peer_expect_digest pins what the peers of a peer:// model_uri serve, "
                                         "and model_uri is '/models/llama'"):
        loader({"model_uri": "/models/llama", "peer_expect_digest": "5f0e1c2d3b4a6978"})


def test_vllm_factory_creates_our_transfer_engine():
    ws_vllm.register()
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from weightstream.vllm._transfer import WeightstreamWeightTransferEngine

    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="weightstream"),
                                                       VllmConfig(device_config=DeviceConfig(device="cpu")),
                                                       torch.device("cpu"), torch.nn.Linear(2, 2))
    assert isinstance(engine, WeightstreamWeightTransferEngine)
    info = engine.parse_init_info({"transport": "shm", "token": "t"})
    assert info.transport == "shm" and info.addresses == []
    with pytest.raises(ValueError, match="Invalid init_info"):
        engine.parse_init_info({"transprt": "shm"})


def test_an_unsupported_vllm_release_is_refused():
    assert ws_vllm.supported("0.33.0") and ws_vllm.supported("0.34.1") and ws_vllm.supported("0.34")
    assert not ws_vllm.supported("0.35.0") and not ws_vllm.supported("0.3") and not ws_vllm.supported(None)


def test_hub_ids_are_told_from_paths_and_uris(tmp_path):
    from weightstream.vllm._model import is_hub_id

    assert is_hub_id("meta-llama/Llama-3.1-8B") and is_hub_id("gpt2")
    assert not is_hub_id("s3://bucket/model") and not is_hub_id(str(tmp_path)) and not is_hub_id("/models/x")
    assert not is_hub_id("") and not is_hub_id("./model")


# ---- the model loader against vLLM's layers ---------------------------------------------

def _state(model):
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _assert_same(model, reference, what):
    ours, theirs = _state(model), _state(reference)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), f"{what}: {name} differs from vLLM's weight_loader"


def _reference(path):
    """The small Llama filled by its layers' own weight_loader from the checkpoint at path."""
    from safetensors.torch import load_file

    reference = TinyLlama(CONFIG)
    tensors = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, file)))
    reference.load_weights(sorted(tensors.items()))
    return reference, tensors


def _load_reload_update(tp_size, rank, port, paths):
    """Cold load (seed 1), reload (seed 2), pushed update over shm (seed 3), each compared
    with vLLM's weight_loader; addresses unchanged throughout."""
    with distributed(tp_size, rank, port) as vllm_config:
        ws_vllm.register()
        from vllm.config import LoadConfig
        from vllm.config.weight_transfer import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
        from vllm.model_executor.model_loader import get_model_loader

        loader = get_model_loader(LoadConfig(load_format="weightstream"))
        model = TinyLlama(CONFIG)
        loader.load_weights(model, model_config(paths[1]))
        assert loader.last_load["path"] == "layout" and loader.last_load["mode"] == "cold"
        assert "llama" in loader.last_load["layout"]
        # Only this rank's bytes were read: at tp 2 each rank streams less than the checkpoint.
        total = sum(os.path.getsize(os.path.join(paths[1], f)) for f in os.listdir(paths[1])
                    if f.endswith(".safetensors"))
        if tp_size > 1:
            assert loader.last_load["bytes_streamed"] < total * 0.75
        _assert_same(model, _reference(paths[1])[0], "cold load")
        addresses = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}

        loader.load_weights(model, model_config(paths[2]))
        assert loader.last_load["mode"] == "reload"
        _assert_same(model, _reference(paths[2])[0], "reload")
        assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == addresses

        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="weightstream"), vllm_config,
                                                           torch.device("cpu"), model)
        engine.init_transfer_engine(engine.parse_init_info({"transport": "shm", "token": "secret"}))
        reference, tensors = _reference(paths[3])
        report = {}

        def trainer():
            sender = weightstream.UpdateSender(engine.address, transport="shm", token="secret")
            report.update(sender.update(sorted(tensors.items())))

        thread = threading.Thread(target=trainer)
        thread.start()
        engine.receive_weights(engine.parse_update_info({"accept_timeout": 60.0}))
        thread.join()
        assert report["bytes"] > 0
        _assert_same(model, reference, "pushed update")
        assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == addresses
        engine.shutdown()
        return loader.last_load["bytes_streamed"]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_load_reload_and_update_write_into_vllm_layers_in_place(checkpoints, tp_size):
    streamed = run_ranks(_load_reload_update, tp_size, checkpoints)
    assert len(streamed) == tp_size


def _bind_module_directly(tp_size, rank, port, paths):
    """layout.bind_module on the vLLM layers, then a session: the same bytes as weight_loader."""
    with distributed(tp_size, rank, port):
        model = TinyLlama(CONFIG)
        layout = weightstream.model_layout(os.path.join(paths[1], "config.json"), tp_size=tp_size, tp_rank=rank,
                                           dtype="F32")
        layout.bind_module(model)
        assert layout.unbound_names == []
        session = weightstream.LoadSession(layout)
        session.begin("cold")
        session.load_checkpoint(paths[1])
        session.finish()
        _assert_same(model, _reference(paths[1])[0], "bind_module")
        return "ok"


def test_bind_module_on_vllm_layers_at_tp_2(checkpoints):
    run_ranks(_bind_module_directly, 2, checkpoints)


def _loaded_with_a_worker_engine(vllm_config, path):
    """The small Llama loaded from ``path`` with --load-format weightstream, and the
    weightstream weight-transfer backend's worker engine of it."""
    from vllm.config import LoadConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader import get_model_loader

    model = TinyLlama(CONFIG)
    get_model_loader(LoadConfig(load_format="weightstream")).load_weights(model, model_config(path))
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="weightstream"), vllm_config,
                                                       torch.device("cpu"), model)
    return model, engine


def _weight_sync_client(engine, calls):
    """The four calls of vLLM's VLLMWeightSyncClient protocol, calling the worker ``engine`` as
    vLLM's weight-sync routes do; each call's name is appended to ``calls``."""

    class Client:
        def init_weight_transfer_engine(self, init_info):
            calls.append("init")
            engine.init_transfer_engine(engine.parse_init_info(init_info))

        def start_weight_update(self):
            calls.append("start")
            engine.start_weight_update()

        def update_weights(self, update_info):
            calls.append("update")
            engine.receive_weights(engine.parse_update_info(update_info))

        def finish_weight_update(self):
            calls.append("finish")
            engine.finish_weight_update()

    return Client()


def _trainer_engine(tp_size, rank, port, paths):
    """vLLM's trainer interface: trainer_init then send_weights, through a client that calls the
    worker engine as vLLM's weight-sync routes do."""
    with distributed(tp_size, rank, port) as vllm_config:
        ws_vllm.register()
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from weightstream.vllm import WeightstreamTrainerEngine, WeightstreamTrainerInitInfo

        model, engine = _loaded_with_a_worker_engine(vllm_config, paths[1])
        addresses = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
        calls = []

        # vLLM's own trainer factory and ModuleSource over a trainer module with the checkpoint's names.
        reference, tensors = _reference(paths[3])
        trainer = WeightTransferTrainerFactory.trainer_init(
            WeightstreamTrainerInitInfo(rank=0, transport="tcp", tp_size=1, token="t"),
            client=_weight_sync_client(engine, calls), source=ModuleSource(_module_of(tensors)))
        assert isinstance(trainer, WeightstreamTrainerEngine)
        trainer.send_weights()
        _assert_same(model, reference, "trainer update")
        reference, tensors = _reference(paths[2])
        trainer.source = sorted(tensors.items())  # a plain list of (name, tensor) serves too
        trainer.send_weights()  # the second update reuses the connection
        _assert_same(model, reference, "second trainer update")
        assert calls == ["init", "start", "update", "finish", "start", "update", "finish"]
        assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == addresses
        return "ok"


def test_trainer_engine_pushes_updates_through_the_client(checkpoints):
    run_ranks(_trainer_engine, 1, checkpoints)


def _one_step(tensors, seed):
    """``tensors`` after one step: 1% of each floating-point tensor's elements scaled by 0.9."""
    generator = torch.Generator().manual_seed(seed)
    stepped = {}
    for name, tensor in sorted(tensors.items()):
        mask = torch.rand(tensor.shape, generator=generator) < 0.01
        stepped[name] = torch.where(mask, (tensor.float() * 0.9).to(tensor.dtype), tensor).contiguous()
    return stepped


def _trainer_engine_delta(tp_size, rank, port, paths):
    """WeightstreamTrainerEngine with delta=True through vLLM's trainer factory: the first
    update goes whole naming its version, each next one only the elements that changed since,
    checked by the worker after it; every update equals vLLM's weight_loader of the same
    tensors, in place."""
    with distributed(tp_size, rank, port) as vllm_config:
        ws_vllm.register()
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from weightstream.vllm import WeightstreamTrainerInitInfo

        model, engine = _loaded_with_a_worker_engine(vllm_config, paths[1])
        addresses = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
        client = _weight_sync_client(engine, [])

        _, step0 = _reference(paths[2])
        step1 = _one_step(step0, 1)
        step2 = _one_step(step1, 2)
        trainer = WeightTransferTrainerFactory.trainer_init(
            WeightstreamTrainerInitInfo(rank=0, transport="tcp", tp_size=1, token="t", delta=True), client=client,
            source=sorted(step0.items()))
        reports = []
        for step, version in ((step0, None), (step1, None), (step2, "step-2")):
            trainer.source = sorted(step.items())
            trainer.send_weights(version=version)
            reference = TinyLlama(CONFIG)
            reference.load_weights(sorted(step.items()))
            _assert_same(model, reference, f"trainer delta update to {trainer.version}")
            assert engine.last_report is not None and trainer.version == engine._receiver(model).version
            reports.append(trainer.last_reports[0])
        assert trainer.version == "step-2"
        full, *deltas = reports
        assert full["sparse_tensors"] == 0 and full["checked_tensors"] == 0
        for delta in deltas:
            assert delta["sparse_tensors"] > 0 and delta["checked_tensors"] == delta["sparse_tensors"], delta
            assert 0 < delta["bytes"] < full["bytes"] / 5, (delta["bytes"], full["bytes"])
        assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == addresses
        with pytest.raises(ValueError, match="a delta update travels in checkpoint format over shm or tcp, not "
                                             "engine format over tcp"):
            WeightTransferTrainerFactory.trainer_init(
                WeightstreamTrainerInitInfo(rank=0, transport="tcp", token="t", format="engine", delta=True),
                client=client)
        return "ok"


def test_trainer_engine_sends_only_the_changes_with_delta(checkpoints):
    run_ranks(_trainer_engine_delta, 1, checkpoints)


# ---- bad input ---------------------------------------------------------------------------

class _Renamed(torch.nn.Module):
    """A module whose names match nothing of the layout."""

    def __init__(self):
        super().__init__()
        self.transformer = torch.nn.Linear(64, 64, bias=False)

    def load_weights(self, weights):
        raise AssertionError("not reached")


def _names_match_nothing(tp_size, rank, port, paths):
    with distributed(tp_size, rank, port):
        ws_vllm.register()
        from vllm.config import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader

        loader = get_model_loader(LoadConfig(load_format="weightstream"))
        with pytest.raises(weightstream.Error) as raised:
            loader.load_weights(_Renamed(), model_config(paths[1]))
        message = str(raised.value)
        assert "no parameter of the vLLM model matches llama" in message
        assert "model.embed_tokens.weight" in message and "transformer.weight" in message
        return message


def test_a_model_whose_names_match_nothing_gets_an_error_listing_both_sides(checkpoints):
    run_ranks(_names_match_nothing, 1, checkpoints)


def _no_table(tp_size, rank, port, folder):
    with distributed(tp_size, rank, port):
        ws_vllm.register()
        from vllm.config import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader

        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("vllm.weightstream").addHandler(handler)
        loader = get_model_loader(LoadConfig(load_format="weightstream"))
        for _ in range(2):
            model = TinyLlama(CONFIG)
            loader.load_weights(model, model_config(folder))
            assert loader.last_load["path"] == "load_weights"
            _assert_same(model, _reference(folder)[0], "fallback through load_weights")
        said = [r.getMessage() for r in records if "no layout for TinyLlama" in r.getMessage()]
        assert len(said) == 1, said
        assert "model_type 'mistral'" in said[0] and "load_weights" in said[0]
        return said[0]


def test_an_architecture_without_a_table_loads_through_load_weights_and_says_so_once(tmp_path):
    # vLLM serves "mistral" with its Llama code; weightstream has no table for it.
    write_checkpoint(str(tmp_path), dict(CONFIG, model_type="mistral", architectures=["MistralForCausalLM"]), 1)
    run_ranks(_no_table, 1, str(tmp_path))


# ---- the MTP draft -----------------------------------------------------------------------

def _module_of(tensors):
    """A torch module with a parameter of each name, holding the tensor (nested as the dots say)."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def _draft_from_the_checkpoint_uri(tp_size, rank, port, checkpoint, snapshot):
    """vLLM's draft ModelConfig (its own MTP config override) of a folder of config files only;
    the draft's weights come from WEIGHTSTREAM_MODEL_URI, into the draft module as built."""
    os.environ.pop("WEIGHTSTREAM_MODEL_URI", None)
    os.environ.pop("MX_MODEL_URI", None)
    with distributed(tp_size, rank, port):
        ws_vllm.register()
        from vllm.config import LoadConfig, ModelConfig
        from vllm.config.speculative import SpeculativeConfig
        from vllm.model_executor.model_loader import get_model_loader
        from weightstream.vllm._model import model_parameter_name

        draft_config = ModelConfig(model=snapshot, dtype="float32", skip_tokenizer_init=True,
                                   hf_overrides=SpeculativeConfig.hf_config_override)
        assert draft_config.hf_config.model_type == "deepseek_mtp"
        layout = weightstream.model_layout(os.path.join(snapshot, "config.json"), dtype="F32", modules="draft",
                                           device="cpu")
        shapes = {model_parameter_name(n, "draft", "deepseek_v3"): tuple(layout.parameter_info(n)["shape"])
                  for n in layout.parameter_names}
        assert any(".mtp_block." in name for name in shapes) and "model.embed_tokens.weight" in shapes
        draft = _module_of({name: torch.zeros(shape) for name, shape in shapes.items()})
        addresses = {name: p.data_ptr() for name, p in draft.named_parameters()}
        loader = get_model_loader(LoadConfig(load_format="weightstream"))
        with pytest.raises(weightstream.Error) as raised:  # no checkpoint URI: one error naming every source
            loader.load_weights(draft, draft_config)
        assert (f"Cannot find any safetensors model weights for the draft: model_weights: not set; model {snapshot}: "
                f"no *.safetensors files; WEIGHTSTREAM_MODEL_URI: not set") in str(raised.value)
        os.environ["WEIGHTSTREAM_MODEL_URI"] = checkpoint
        loader.load_weights(draft, draft_config)
        assert loader.last_load["role"] == "draft" and loader.last_load["path"] == "layout"
        assert loader.last_load["source"] == checkpoint and loader.last_load["field"] == "WEIGHTSTREAM_MODEL_URI"
        assert loader.last_load["passed_over"] == ["model_weights: not set",
                                                   f"model {snapshot}: no *.safetensors files"]
        # The bytes of weightstream's own load of the draft layout, in the module vLLM built.
        session = weightstream.LoadSession(layout)
        session.begin("cold")
        session.load_checkpoint(checkpoint)
        session.finish()
        for name in layout.parameter_names:
            expected = torch.from_dlpack(layout.tensor(name))
            got = draft.get_parameter(model_parameter_name(name, "draft", "deepseek_v3"))
            assert torch.equal(got, expected), name
        assert {name: p.data_ptr() for name, p in draft.named_parameters()} == addresses
        return "ok"


def test_the_mtp_draft_loads_from_the_checkpoint_uri_into_the_existing_module(tmp_path):
    import shutil
    import subprocess

    from conftest import CLI

    if not os.path.exists(CLI):
        pytest.skip(f"the weightstream CLI is not built at {CLI} (it writes the deepseek_v3 checkpoint)")
    checkpoint = tmp_path / "checkpoint"
    result = subprocess.run([CLI, "synth", str(checkpoint), "--arch", "deepseek_v3", "--layers", "2", "--hidden", "64",
                             "--shards", "3", "--dtype", "f32", "--seed", "3"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    shutil.copy(checkpoint / "config.json", snapshot / "config.json")
    run_ranks(_draft_from_the_checkpoint_uri, 1, str(checkpoint), str(snapshot))

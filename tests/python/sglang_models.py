"""SGLang 0.5.23's real model classes on the CPU, for the SGLang stage
(tests/python/test_sglang_models.py).

- ``build``: SGLang's own ModelRunner, made as ``sglang.bench_one_batch`` makes it (the
  recipe of issue 49: the CPU engine, torch_native attention, gloo), loading the checkpoint
  with the ``--load-format`` given: ``weightstream`` (weightstream.sglang, through SGLang's
  plugin entry point) or SGLang's default.
- ``default_load``: a second model of the same class, built and filled by SGLang's own
  DefaultModelLoader (the oracle).
- ``write_sglang_checkpoint``: engine_checkpoints' families with the configs SGLang's CPU
  engine takes (vocabularies of a multiple of 64; DeepSeek-V3's yarn rope scaling and
  moe_layer_freq).
- Through SGLang's own HookRegistry, for the CPU only: no PyNccl communicator for gloo groups
  (it needs CUDA), and SGLang's FP8 methods' AMX repack (which refuses a CPU without AMX) a
  no-op for both loads. Nothing else of SGLang is replaced.
- updates through SGLang's WeightUpdater of the runner: ``begin_weight_update()``,
  ``update_weights_from_tensor(request, load_format=weightstream.sglang.UPDATE_LOADER)``,
  ``end_weight_update()``, fed by weightstream.UpdateSender.

Run as a script it is one rank of a scenario run (``python sglang_models.py run ...``): every
scenario of a plan in one process (SGLang builds its parallel groups once a process), one
JSON result per scenario; tests/python/test_sglang_models.py starts the ranks and asserts on
the results.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Tuple

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import torch  # noqa: E402

from engine_checkpoints import checkpoint_tensors, rank_bytes, write_checkpoint  # noqa: E402

#: transformers' DeepSeek-V3 config as SGLang's CPU engine takes it: yarn rope scaling (real
#: DeepSeek-V3 configs have it) and moe_layer_freq, which transformers 5 no longer writes.
_YARN = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
         "mscale": 1.0, "mscale_all_dim": 1.0}
#: Per family: (the transformers config's changes, config.json's). Every vocabulary is a
#: multiple of 64, which SGLang pads its embedding to (rows no checkpoint fills); SGLang's
#: Qwen3-MoE makes every layer sparse (it ignores mlp_only_layers).
SGLANG_CONFIGS = {
    "llama": ({"vocab_size": 1024}, {}),
    "qwen3_moe": ({"vocab_size": 1024, "mlp_only_layers": []}, {}),
    "deepseek_v3": ({"vocab_size": 1024, "rope_scaling": _YARN}, {"moe_layer_freq": 1, "rope_scaling": _YARN}),
    "glm4_moe": ({"vocab_size": 1024}, {}),
}


def write_fallback_checkpoint(folder: str, seed: int) -> str:
    """A small Qwen2 (a model_type weightstream has no table for), written by transformers'
    save_pretrained: SGLang's Qwen2ForCausalLM loads it entirely through load_weights."""
    import transformers  # noqa: PLC0415

    config = transformers.Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="2MB")
    return folder


def write_sglang_checkpoint(family: str, folder: str, seed: int, fp8: bool = False, mtp: bool = False) -> str:
    """engine_checkpoints.write_checkpoint with the family's config as SGLang takes it (``mtp``:
    with its MTP layer)."""
    config, saved = SGLANG_CONFIGS[family]
    return write_checkpoint(family, folder, seed, fp8=fp8, mtp=mtp, config_overrides=config, saved_overrides=saved)

UPDATE_TOKEN = "update-secret"


#: SGLang's arguments for an MTP draft of the target's own checkpoint (--speculative-algorithm
#: NEXTN, one step).
SPECULATIVE = dict(speculative_algorithm="NEXTN", speculative_num_steps=1, speculative_eagle_topk=1,
                   speculative_num_draft_tokens=2)


def server_args(path: str, tp_size: int, ep: bool, load_format: str, port: int,
                extra: Dict[str, Any] = None, speculative: bool = False) -> Any:
    from sglang.srt.server_args import ServerArgs  # noqa: PLC0415

    import weightstream.sglang as ws_sglang  # noqa: PLC0415

    draft = dict(SPECULATIVE, speculative_draft_model_path=path) if speculative else {}
    return ServerArgs(model_path=path, device="cpu", attention_backend="torch_native", sampling_backend="pytorch",
                      max_total_tokens=512, mem_fraction_static=0.9, tp_size=tp_size, ep_size=tp_size if ep else 1,
                      load_format=load_format, model_loader_extra_config=json.dumps(extra or {}),
                      skip_tokenizer_init=True, dtype="bfloat16", dist_init_addr=f"127.0.0.1:{port}",
                      custom_weight_loader=[ws_sglang.UPDATE_LOADER], disable_cuda_graph=True,
                      disable_custom_all_reduce=True, **draft)


_parallel_ready = False


def build(path: str, tp_size: int, rank: int, ep: bool, load_format: str, port: int,
          extra: Dict[str, Any] = None, speculative: bool = False) -> Any:
    """SGLang's ModelRunner of the checkpoint at ``path``, its model loaded with
    ``load_format``, as bench_one_batch's load_model makes it (``speculative``: with SPECULATIVE's
    MTP draft of the same checkpoint configured, which sglang_drafts.build_draft builds)."""
    global _parallel_ready
    from sglang.benchmark.one_batch import _init_process_global_configs  # noqa: PLC0415
    from sglang.srt.configs.model_config import ModelConfig  # noqa: PLC0415
    from sglang.srt.distributed import bootstrap  # noqa: PLC0415
    from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: PLC0415
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank  # noqa: PLC0415

    args = server_args(path, tp_size, ep, load_format, port, extra, speculative)
    args.resolve_once()
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=spawn_world_rank(args, tp_rank=rank, pp_rank=0),
                                                     gpu_id=0))
    _init_process_global_configs()
    model_config = ModelConfig.from_server_args(args)
    if not _parallel_ready:
        _parallel_ready = True  # SGLang refuses a second try in one process
        bootstrap.init_parallel_runtime(server_args=args, device="cpu", dist_port=port + 1)
    bootstrap.init_layer_runtime(model_config=model_config)
    # SGLang keeps one MoE expert placement a process (one engine); each scenario's model is
    # a new engine here, built after the last one is done with.
    from sglang.srt.eplb.expert_location import set_global_expert_location_metadata  # noqa: PLC0415

    set_global_expert_location_metadata(None, allow_overwrite=True)
    return ModelRunner(model_config=model_config, mem_fraction_static=0.9, gpu_id=0, nccl_port=port + 1,
                       server_args=args)


def default_load(runner: Any) -> torch.nn.Module:
    """A second model of the runner's class, built and filled by SGLang's DefaultModelLoader."""
    from sglang.srt.configs.device_config import DeviceConfig  # noqa: PLC0415
    from sglang.srt.configs.load_config import LoadConfig  # noqa: PLC0415
    from sglang.srt.model_loader.loader import DefaultModelLoader  # noqa: PLC0415

    loader = DefaultModelLoader(LoadConfig(load_format="auto"))
    return loader.load_model(model_config=runner.model_config, device_config=DeviceConfig("cpu", 0))


def state_of(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter of the model, by name, and every tensor its modules keep as a plain
    attribute (what post-load steps derive: DeepSeek's w_kc and w_vc); FP8 viewed as bytes,
    so equality is bitwise."""
    state = dict(model.named_parameters())
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not name.startswith("_"):
                state.setdefault(f"{prefix}.{name}" if prefix else name, value)
    return {name: (tensor.detach().view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor.detach())
            for name, tensor in state.items()}


def differences(model: torch.nn.Module, reference: torch.nn.Module) -> List[str]:
    """Parameters whose bytes differ between two models of one class (or that one lacks)."""
    ours, theirs = state_of(model), state_of(reference)
    different = sorted(set(ours) ^ set(theirs))
    for name in sorted(set(ours) & set(theirs)):
        a, b = ours[name], theirs[name]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            different.append(name)
    return different


def addresses(model: torch.nn.Module) -> Dict[str, int]:
    return {name: tensor.data_ptr() for name, tensor in model.named_parameters()}


class LogRecorder(logging.Handler):
    """Keeps the messages of weightstream's SGLang logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def recorded(scenario: Dict[str, Any], body: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    """Runs ``body(result)`` with weightstream's SGLang log recorded (from INFO) into
    result["log"]; then result["ok"], or result["error"], the traceback of what it raised."""
    recorder = LogRecorder()
    logger = logging.getLogger("sglang.weightstream")
    logger.addHandler(recorder)
    logger.setLevel(logging.INFO)
    result: Dict[str, Any] = {"scenario": scenario}
    try:
        body(result)
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the test
        result["ok"] = False
        result["error"] = traceback.format_exc()
    finally:
        logger.removeHandler(recorder)
        result["log"] = [message for message in recorder.messages if "weightstream" in message]
    return result


def through_load_weights(model: torch.nn.Module) -> List[str]:
    """Wraps the model's load_weights so that every tensor it is given is recorded."""
    seen: List[str] = []
    original = model.load_weights

    def recording(weights: Any) -> Any:
        def names() -> Any:
            for name, tensor in weights:
                seen.append(name)
                yield name, tensor
        return original(names())

    object.__setattr__(model, "load_weights", recording)
    return seen


def rank_addresses(transport: str, tp_size: int, rank: int) -> List[str]:
    """One listen address per rank, this rank's its own: a trainer beside each rank pushes to
    its own receiver (the other ranks' addresses are theirs to choose)."""
    import socket  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    if transport in ("tcp", "ucx"):  # ucx's receiver listens on tcp, then moves bytes by UCX's lanes
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            mine = f"127.0.0.1:{probe.getsockname()[1]}"
        return [mine if r == rank else "127.0.0.1:0" for r in range(tp_size)]
    global _SOCKET_FOLDERS  # noqa: PLW0603 - one per process, removed when it exits
    if _SOCKET_FOLDERS is None:
        _SOCKET_FOLDERS = tempfile.TemporaryDirectory(prefix="ws-sglang-")
    folder = tempfile.mkdtemp(prefix=f"rank{rank}-", dir=_SOCKET_FOLDERS.name)
    return [os.path.join(folder, f"rank-{r}.sock") for r in range(tp_size)]


_SOCKET_FOLDERS = None  # this process's folder of the ranks' socket folders


def update(runner: Any, tensors: List[Tuple[str, torch.Tensor]], transport: str, tp_size: int,
           rank: int, **options: Any) -> Dict[str, Any]:
    """One update pushed by weightstream's sender through SGLang's update API of the runner,
    by a trainer beside this rank (each rank's process pushes to its own receiver); ``options``:
    push_update's (a delta's versions, the senders' device)."""
    import weightstream.sglang as ws_sglang  # noqa: PLC0415

    addresses = rank_addresses(transport, tp_size, rank)
    updater = runner.weight_updater
    updater.begin_weight_update()
    try:
        return ws_sglang.push_update(updater.update_weights_from_tensor, tensors, transport=transport,
                                     token=UPDATE_TOKEN, addresses=addresses, ranks=[rank], bucket_bytes=1 << 20,
                                     accept_timeout=120.0, **options)
    finally:
        updater.end_weight_update(run_post_load=False)


def run_scenario(scenario: Dict[str, Any], tp_size: int, rank: int, port: int, paths: Dict[str, str]) -> Dict[str, Any]:
    """One family and parallelism on this rank: weightstream's load against SGLang's default
    loader on checkpoint A, then (when asked) updates and a refused update."""
    family, ep = scenario["family"], scenario["ep"]
    kind = "fp8" if scenario.get("fp8") else "bf16"
    a, b = paths[f"{family}-{kind}-a"], paths[f"{family}-{kind}-b"]

    def body(result: Dict[str, Any]) -> None:
        runner = build(a, tp_size, rank, ep, "weightstream", port)
        ours = runner.model
        reference_a = default_load(runner)
        result["class"] = type(ours).__name__
        result["load_differences"] = differences(ours, reference_a)
        result["parameters"] = len(state_of(ours))
        result["dtypes"] = sorted({str(t.dtype) for t in ours.parameters()})
        bound = getattr(ours, "_weightstream_binding", None)
        result["bound"] = bound is not None
        if bound is not None:
            result["unbound"] = dict(bound.unbound)
            result["layout_allocated_bytes"] = bound.layout.allocated_bytes
            result["by_load_weights"] = list(bound.by_load_weights)
            result["share"], result["planned"] = rank_bytes(bound.layout, a)
            result["other_experts"] = [name for name in checkpoint_tensors_names(a)
                                       if bound.layout.route(name)[0] == "skipped" and
                                       "expert-parallel rank" in bound.layout.route(name)[2]]
            result["layout"] = bound.description
        result["load"] = dict(getattr(ours, "_weightstream_last_load", {}))
        result["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(a, f)) for f in os.listdir(a)
                                         if f.endswith(".safetensors"))
        if scenario.get("update"):
            result["updates"] = updates(runner, family, kind, paths, reference_a, tp_size, rank)
            result["refused"] = refused_update(runner, b, reference_a, tp_size, rank)
            if kind == "bf16":
                result["delta"] = delta_update(runner, b, paths[f"{family}-bf16-b1"], tp_size, rank)

    return recorded(scenario, body)


def updates(runner: Any, family: str, kind: str, paths: Dict[str, str], reference_a: torch.nn.Module,
            tp_size: int, rank: int) -> List[Dict[str, Any]]:
    """Checkpoint B over shm (for FP8: B's BF16 weights, quantized in place by the receiver as
    the checkpoint was), then back to A over tcp (for FP8: A's codes, then their scales), then
    B over ucx (as its checkpoint holds it: FP8 codes beside their scales), then A again
    through SGLang's update_weights_from_disk; each compared with SGLang's default load of the
    same checkpoint."""
    ours = runner.model
    before = addresses(ours)
    a, b = paths[f"{family}-{kind}-a"], paths[f"{family}-{kind}-b"]
    reference_b = default_load_of(runner, b)
    seen = through_load_weights(ours)
    a_tensors = checkpoint_tensors(a)
    pushes = (("shm", sorted(checkpoint_tensors(paths[f"{family}-bf16-b"] if kind == "fp8" else b).items()),
               reference_b),
              ("tcp", sorted((n, t) for n, t in a_tensors.items() if not n.endswith("_scale_inv")) +
               sorted((n, t) for n, t in a_tensors.items() if n.endswith("_scale_inv")), reference_a),
              ("ucx", sorted(checkpoint_tensors(b).items()), reference_b))
    results = []
    for transport, tensors, reference in pushes:
        seen.clear()
        report = update(runner, tensors, transport, tp_size, rank)
        results.append({"transport": transport, "bytes": report["senders"][0].get("bytes"),
                        "differences": differences(ours, reference), "addresses_unchanged": addresses(ours) == before,
                        "through_load_weights": list(seen),
                        "received": dict(getattr(ours, "_weightstream_last_update", {}))})
    # SGLang's update_weights_from_disk with the server's format: its own iterator of A.
    seen.clear()
    succeeded, message = runner.weight_updater.update_weights_from_disk(a, load_format="weightstream")
    results.append({"transport": "disk", "succeeded": succeeded, "message": message,
                    "differences": differences(ours, reference_a), "addresses_unchanged": addresses(ours) == before,
                    "through_load_weights": list(seen)})
    return results


def delta_update(runner: Any, b: str, b1: str, tp_size: int, rank: int) -> Dict[str, Any]:
    """Issue 46 through SGLang's update API: a full update of B naming its version, then the
    delta B -> B1 (1% of the elements changed) from that version, each rank receiving only the
    changed elements it holds; compared with SGLang's default load of B1."""
    ours = runner.model
    before = addresses(ours)
    b_tensors = checkpoint_tensors(b)
    full = update(runner, sorted(b_tensors.items()), "tcp", tp_size, rank, target="b" * 16)
    changed = update(runner, sorted(checkpoint_tensors(b1).items()), "tcp", tp_size, rank, target="b1" * 8,
                     base="b" * 16, base_tensors=b_tensors)
    report = changed["senders"][0]
    return {"full_bytes": full["senders"][0].get("bytes"), "bytes": report.get("bytes"),
            "sparse_tensors": report.get("sparse_tensors"), "checked_tensors": report.get("checked_tensors"),
            "version": getattr(ours, "_weightstream_version", None),
            "differences": differences(ours, default_load_of(runner, b1)), "addresses_unchanged": addresses(ours) == before}


PEER_TOKEN = "peer-secret"


def run_peer_scenario(scenario: Dict[str, Any], tp_size: int, rank: int, port: int,
                      paths: Dict[str, str]) -> Dict[str, Any]:
    """Instance A loads checkpoint A with weightstream and serves its bound parameters
    (extra-config ``serve``, a free port a rank, the ranks' addresses gathered over gloo);
    instance B, whose model folder holds config.json only, loads with ``model_uri`` the
    ``peer://`` URI of A's ranks, A's content digest pinned. B must equal SGLang's default load
    of the checkpoint, reading nothing from storage."""
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    family, ep = scenario["family"], scenario["ep"]
    a = paths[f"{family}-bf16-a"]
    result: Dict[str, Any] = {"scenario": scenario}
    config_only = tempfile.mkdtemp(prefix="ws-sglang-peer-config-")
    shutil.copy(os.path.join(a, "config.json"), config_only)
    try:
        served = build(a, tp_size, rank, ep, "weightstream", port,
                       {"serve": "127.0.0.1:0", "peer_token": PEER_TOKEN}).model
        result["serving"] = served._weightstream_last_load.get("serving")
        digest = served._weightstream_server.content_digest
        addresses: List[Any] = [None] * tp_size
        dist.all_gather_object(addresses, result["serving"])  # every rank of A serves before B pulls
        result["uri"] = "peer://" + ",".join(addresses)
        runner = build(config_only, tp_size, rank, ep, "weightstream", port,
                       {"model_uri": result["uri"], "peer_token": PEER_TOKEN, "peer_expect_digest": digest})
        result["load"] = dict(runner.model._weightstream_last_load)
        result["load_differences"] = differences(runner.model, default_load_of(runner, a))
        result["parameters"] = len(state_of(runner.model))
        result["unbound"] = dict(runner.model._weightstream_binding.unbound)
        dist.barrier()  # every rank is done with A's servers
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the test
        result["ok"] = False
        result["error"] = traceback.format_exc()
    finally:
        shutil.rmtree(config_only, ignore_errors=True)
    return result


def run_fallback_scenario(scenario: Dict[str, Any], tp_size: int, rank: int, port: int,
                          paths: Dict[str, str]) -> Dict[str, Any]:
    """A model weightstream has no layout for: it loads through SGLang's load_weights, fed by
    weightstream's streamer, equal to SGLang's default load; a pushed update is refused."""
    path = paths["fallback"]

    def body(result: Dict[str, Any]) -> None:
        runner = build(path, tp_size, rank, False, "weightstream", port)
        result["class"] = type(runner.model).__name__
        result["load"] = dict(runner.model._weightstream_last_load)
        result["load_differences"] = differences(runner.model, default_load(runner))
        try:
            update(runner, sorted(checkpoint_tensors(path).items()), "shm", tp_size, rank)
            result["update_error"] = ""
        except Exception as error:  # noqa: BLE001 - its text is the result
            result["update_error"] = str(error)

    return recorded(scenario, body)


def run_replaced_scenario(scenario: Dict[str, Any], tp_size: int, rank: int, port: int,
                          paths: Dict[str, str]) -> Dict[str, Any]:
    """A bound parameter the model replaced with new storage (as a post-processing step that
    transforms a weight does): an update is refused before its first byte, naming it, the
    model unchanged, the trainer told why."""
    result: Dict[str, Any] = {"scenario": scenario}
    try:
        runner = build(paths["llama-bf16-a"], tp_size, rank, False, "weightstream", port)
        model = runner.model
        target = next(name for name in dict(model.named_parameters()) if name.endswith("o_proj.weight"))
        module_name, _, attribute = target.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attribute, torch.nn.Parameter(getattr(module, attribute).detach().clone(),
                                                      requires_grad=False))
        before = {name: tensor.clone() for name, tensor in state_of(model).items()}
        try:
            update(runner, sorted(checkpoint_tensors(paths["llama-bf16-b"]).items()), "shm", tp_size, rank)
            result["error"] = ""
        except Exception as error:  # noqa: BLE001 - its text is the result
            result["error"] = str(error)
        after = state_of(model)
        result["parameter"] = target
        result["unchanged"] = all(torch.equal(after[name], before[name]) for name in before)
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the test
        result["ok"] = False
        result["error"] = traceback.format_exc()
    return result


def run_cuda_ipc_scenario(scenario: Dict[str, Any], tp_size: int, rank: int, port: int,
                          paths: Dict[str, str]) -> Dict[str, Any]:
    """An update over CUDA IPC (where a GPU is): the trainer's tensors of checkpoint B on
    cuda:0, pushed through SGLang's update API by the same push_update (its senders on the
    GPU: device "cuda:0") and received by the same UpdateReceiver as every transport; equal to
    SGLang's default load of B, every address unchanged, nothing through load_weights. The
    model is SGLang's CPU engine's, as in every scenario here: the receiver maps the trainer's
    GPU buckets (CUDA IPC) and copies from them into the host parameters."""
    family = scenario["family"]
    a, b = paths[f"{family}-bf16-a"], paths[f"{family}-bf16-b"]

    def body(result: Dict[str, Any]) -> None:
        runner = build(a, tp_size, rank, False, "weightstream", port)
        ours = runner.model
        before = addresses(ours)
        seen = through_load_weights(ours)
        tensors = sorted((name, tensor.to("cuda:0")) for name, tensor in checkpoint_tensors(b).items())
        report = update(runner, tensors, "cuda-ipc", tp_size, rank, device="cuda:0")
        result["bytes"] = report["senders"][0].get("bytes")
        result["received"] = dict(getattr(ours, "_weightstream_last_update", {}))
        result["differences"] = differences(ours, default_load_of(runner, b))
        result["addresses_unchanged"] = addresses(ours) == before
        result["through_load_weights"] = list(seen)

    return recorded(scenario, body)


def run_s3_scenario(scenario: Dict[str, Any], tp_size: int, rank: int, port: int,
                    paths: Dict[str, str]) -> Dict[str, Any]:
    """SGLang's model folder holds config.json only; weightstream finds the weights at the
    checkpoint URI (extra-config model_uri, an s3:// prefix), equal to SGLang's default load of
    the local copy, reading only this rank's share."""
    a = paths[f"{scenario['family']}-bf16-a"]
    result: Dict[str, Any] = {"scenario": scenario}
    try:
        runner = build(scenario["config_folder"], tp_size, rank, False, "weightstream", port,
                       {"model_uri": scenario["uri"]})
        bound = runner.model._weightstream_binding
        result["load"] = dict(runner.model._weightstream_last_load)
        result["load_differences"] = differences(runner.model, default_load_of(runner, a))
        result["share"] = rank_bytes(bound.layout, a)[0]
        result["unbound"] = dict(bound.unbound)
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the test
        result["ok"] = False
        result["error"] = traceback.format_exc()
    return result


def checkpoint_tensors_names(folder: str) -> List[str]:
    from engine_checkpoints import _checkpoint_itemsizes  # noqa: PLC0415

    return list(_checkpoint_itemsizes(folder))


def default_load_of(runner: Any, path: str) -> torch.nn.Module:
    """SGLang's DefaultModelLoader's model of another checkpoint of the same architecture."""
    saved = runner.model_config.model_path
    runner.model_config.model_path = path
    try:
        return default_load(runner)
    finally:
        runner.model_config.model_path = saved


def refused_update(runner: Any, b: str, reference: torch.nn.Module, tp_size: int, rank: int) -> Dict[str, Any]:
    """An update (of checkpoint B) whose last tensor has a wrong shape: refused before its
    first byte, the model still equal to ``reference`` (SGLang's default load of what it holds:
    A, which the updates before it left)."""
    import weightstream  # noqa: PLC0415

    tensors = sorted(checkpoint_tensors(b).items())
    last_name, last = tensors[-1]
    wrong = tensors[:-1] + [(last_name, torch.zeros(*last.shape[:-1], last.shape[-1] + 1, dtype=last.dtype))]
    outcome: Dict[str, Any] = {"last": last_name}
    try:
        update(runner, wrong, "shm", tp_size, rank)
        outcome["error"] = ""
    except weightstream.Error as error:
        outcome["error"] = str(error)
    outcome["differences"] = differences(runner.model, reference)
    return outcome


def _without_pynccl(*args: Any, **kwargs: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
    if backend == "gloo":
        kwargs["use_pynccl"] = False
    return args, kwargs


def _no_amx_repack(method: Any, layer: torch.nn.Module) -> None:
    """SGLang's FP8 methods' process_weights_after_loading on a CPU without AMX: nothing."""


def prepare_sglang(tp_size: int) -> None:
    """What a process of the CPU recipe does before it builds a model: SGLang's plugins loaded
    (weightstream's entry point among them) and, through SGLang's HookRegistry, the two CPU
    stand-ins below."""
    # SGLang's CPU engine binds each rank's OpenMP threads to a NUMA node, or to the cores
    # named here: one core a rank (the cores shared when there are fewer).
    cores = os.cpu_count() or 1
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(rank % cores) for rank in range(tp_size)))
    from sglang.srt.plugins import load_plugins  # noqa: PLC0415
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: PLC0415

    # SGLang gives every process group of more than one rank a PyNccl communicator, which
    # needs CUDA; over gloo on the CPU there is none to give (through SGLang's own hooks).
    HookRegistry.register("sglang.srt.distributed.parallel_state.init_model_parallel_group", _without_pynccl,
                          HookType.BEFORE)
    # SGLang's CPU FP8 methods repack weights for AMX, and refuse a CPU without it: there,
    # both loads leave the FP8 weights as loaded (the comparison stays exact).
    for method in ("Fp8LinearMethod", "Fp8MoEMethod"):
        HookRegistry.register(f"sglang.srt.layers.quantization.fp8.{method}.process_weights_after_loading",
                              _no_amx_repack, HookType.REPLACE)
    load_plugins()  # as every SGLang process does: weightstream's entry point registers its load format


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one rank of a scenario plan")
    run.add_argument("--tp", type=int, required=True)
    run.add_argument("--rank", type=int, required=True)
    run.add_argument("--port", type=int, required=True)
    run.add_argument("--plan", required=True, help="JSON: {scenarios: [...], paths: {...}}")
    run.add_argument("--out", required=True, help="folder for the per-scenario results")
    args = parser.parse_args()
    prepare_sglang(args.tp)
    with open(args.plan) as file:
        plan = json.load(file)
    os.makedirs(args.out, exist_ok=True)
    for index, scenario in enumerate(plan["scenarios"]):
        started = time.perf_counter()
        from sglang_drafts import run_draft_scenario  # noqa: PLC0415 - it imports this module

        run = {"peer": run_peer_scenario, "fallback": run_fallback_scenario, "replaced": run_replaced_scenario,
               "s3": run_s3_scenario, "draft": run_draft_scenario,
               "cuda-ipc": run_cuda_ipc_scenario}.get(scenario.get("special", ""), run_scenario)
        result = run(scenario, args.tp, args.rank, args.port, plan["paths"])
        result["seconds"] = time.perf_counter() - started
        with open(os.path.join(args.out, f"{index}-rank{args.rank}.json"), "w") as file:
            json.dump(result, file)


if __name__ == "__main__":
    # As the module sglang_drafts imports, so that both see one set of its globals.
    import sglang_models  # noqa: PLW0406

    sys.exit(sglang_models.main())

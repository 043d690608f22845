"""vLLM 0.33's real model classes on the CPU, for the vLLM stage (tests/python/test_vllm_models.py)
and bench/vllm_moe_bench.py.

- ``write_checkpoint`` (from engine_checkpoints, shared with the SGLang stage): a small model
  of each family weightstream binds, written by transformers' ``save_pretrained``, BF16 or
  FP8 block-scaled.
- ``build``: vLLM's own ``initialize_model`` inside ``set_current_vllm_config``, filled by a
  loader's ``load_weights``: vLLM's default loader (the oracle) or weightstream's.
- ``register_cpu_fp8_kernel``: vLLM's torch FP8 block kernel admitted on the CPU platform and
  registered through vLLM's own ``register_linear_kernel`` (vLLM picks no FP8 block kernel on
  a CPU without AMX). Nothing else of vLLM is replaced.

Run as a script it is one rank of a scenario run (``python vllm_models.py run ...``): it sets
up vLLM's parallel state over gloo and runs every scenario of a plan, writing one JSON result
per scenario; tests/python/test_vllm_models.py starts the ranks and asserts on the results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any, Dict, Iterator, List, Optional, Tuple

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402

from engine_checkpoints import (  # noqa: E402,F401 - the checkpoints every engine's stage writes
    FAMILIES,
    FP8_QUANTIZATION,
    MOE_FAMILIES,
    MTP_FAMILIES,
    _checkpoint_itemsizes,
    checkpoint_tensors,
    quantize_blocks,
    quantized_name,
    rank_bytes,
    write_checkpoint,
)


# ---- vLLM ------------------------------------------------------------------------------

_kernel_registered = False


def register_cpu_fp8_kernel() -> None:
    """Registers vLLM's torch FP8 block kernel for the CPU platform with vLLM's own API."""
    global _kernel_registered
    if _kernel_registered:
        return
    from vllm.model_executor.kernels.linear import register_linear_kernel  # noqa: PLC0415
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import (  # noqa: PLC0415
        BlockWiseTorchFP8ScaledMMLinearKernel,
    )
    from vllm.platforms import PlatformEnum  # noqa: PLC0415

    class CpuBlockWiseTorchFP8Kernel(BlockWiseTorchFP8ScaledMMLinearKernel):
        """The torch FP8 block kernel, admitted on the CPU (forward is never run here)."""

        @classmethod
        def is_supported(cls, compute_capability: Optional[int] = None) -> Tuple[bool, Optional[str]]:
            return True, None

    register_linear_kernel(CpuBlockWiseTorchFP8Kernel, PlatformEnum.CPU, "fp8_block")
    _kernel_registered = True


@contextlib.contextmanager
def parallel_state(tp_size: int, rank: int, port: int) -> Iterator[None]:
    """vLLM's distributed state over gloo for one rank of ``tp_size``."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: PLC0415
    from vllm.distributed import parallel_state as state  # noqa: PLC0415

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        state.init_distributed_environment(world_size=tp_size, rank=rank,
                                           distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank,
                                           backend="gloo")
        state.initialize_model_parallel(tp_size, 1)
    try:
        yield
    finally:
        state.destroy_model_parallel()
        state.destroy_distributed_environment()


def vllm_config(path: str, tp_size: int, expert_parallel: bool, load_format: str,
                extra: Optional[Dict[str, Any]] = None, draft: bool = False) -> Any:
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig  # noqa: PLC0415
    from vllm.config.speculative import SpeculativeConfig  # noqa: PLC0415

    model_config = ModelConfig(model=path, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True)
    parallel_config = ParallelConfig(tensor_parallel_size=tp_size, enable_expert_parallel=expert_parallel)
    speculative_config = None
    if draft:
        # As vLLM makes a draft: its speculative config derives the draft's model config.
        speculative_config = SpeculativeConfig(method="mtp", num_speculative_tokens=1, target_model_config=model_config,
                                               target_parallel_config=parallel_config)
        model_config = speculative_config.draft_model_config
    return VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                      parallel_config=parallel_config, speculative_config=speculative_config,
                      load_config=LoadConfig(load_format=load_format, model_loader_extra_config=extra or {}))


def build(path: str, tp_size: int, expert_parallel: bool, load_format: str,
          extra: Optional[Dict[str, Any]] = None, draft: bool = False,
          model_dtype: bool = False) -> Tuple[torch.nn.Module, Any, Any]:
    """vLLM's model of the checkpoint at ``path``, built by initialize_model and filled by the
    loader of ``load_format`` ("safetensors": vLLM's default loader; "weightstream");
    returns (model, loader, vllm_config). With ``draft``, the model is vLLM's MTP draft of the
    checkpoint (its model config made with vLLM's own speculative hf_config_override, as
    vLLM makes a draft's). process_weights_after_loading is not run (it needs vLLM's
    compiled CPU ops). With ``model_dtype``, the model is built and loaded in the model
    config's dtype (BF16) as vLLM's loader does it (set_default_torch_dtype); without, its
    unquantized parameters are torch's default F32."""
    from vllm.config import set_current_vllm_config  # noqa: PLC0415
    from vllm.model_executor.model_loader import get_model_loader  # noqa: PLC0415
    from vllm.model_executor.model_loader.utils import initialize_model  # noqa: PLC0415
    from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: PLC0415

    register_cpu_fp8_kernel()
    config = vllm_config(path, tp_size, expert_parallel, load_format, extra, draft)
    dtype = config.model_config.dtype if model_dtype else torch.get_default_dtype()
    with set_current_vllm_config(config), set_default_torch_dtype(dtype):
        model = initialize_model(vllm_config=config, model_config=config.model_config)
        loader = get_model_loader(config.load_config)
        loader.load_weights(model, config.model_config)
    return model, loader, config


def state_of(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every parameter of the model, by name (FP8 viewed as bytes, so equality is bitwise)."""
    state = {}
    for name, tensor in model.named_parameters():
        data = tensor.detach()
        state[name] = data.view(torch.uint8) if data.dtype == torch.float8_e4m3fn else data
    return state


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
    """Keeps the messages of weightstream's vLLM logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# ---- scenarios (one rank) ----------------------------------------------------------------

def push(engine: Any, tensors: List[Tuple[str, torch.Tensor]], transport: str, bucket_bytes: int) -> Dict[str, Any]:
    """One update pushed by a trainer thread into ``engine`` (this rank's receiver)."""
    import weightstream  # noqa: PLC0415

    report: Dict[str, Any] = {}
    failure: List[BaseException] = []

    def trainer() -> None:
        try:
            sender = weightstream.UpdateSender(engine.address, transport=transport, token="secret",
                                               bucket_bytes=bucket_bytes)
            report.update(sender.update([(name, tensor.contiguous()) for name, tensor in tensors]))
        except BaseException as error:  # noqa: BLE001 - reported below
            failure.append(error)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        engine.receive_weights(engine.parse_update_info({"accept_timeout": 120.0}))
    finally:
        thread.join()
    if failure:
        raise failure[0]
    return report


def push_with(engine: Any, send: Any) -> Tuple[Dict[str, Any], str, str]:
    """One update that ``send(sender)`` makes from a trainer thread over tcp into ``engine``:
    (the sender's report, the trainer's error, the worker's error)."""
    import weightstream  # noqa: PLC0415

    report: Dict[str, Any] = {}
    errors = {"trainer": "", "worker": ""}

    def trainer() -> None:
        try:
            sender = weightstream.UpdateSender(engine.address, transport="tcp", token="secret", bucket_bytes=1 << 20)
            report.update(send(sender))
        except Exception as error:  # noqa: BLE001 - the error is the result (a TypeError too)
            errors["trainer"] = f"{type(error).__name__}: {error}" if not isinstance(error, weightstream.Error) \
                else str(error)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        engine.receive_weights(engine.parse_update_info({"accept_timeout": 120.0}))
    except Exception as raised:  # noqa: BLE001 - the error is the result
        errors["worker"] = str(raised)
    finally:
        thread.join()
    return report, errors["trainer"], errors["worker"]


#: The versions a delta scenario names: A (its checkpoint) and A1 (A after one step).
VERSION_A, VERSION_A1, VERSION_OTHER = "a" * 16, "a1" * 8, "0f" * 8


def whole_delta_bytes(a: str, base: Dict[str, torch.Tensor], changed: Dict[str, torch.Tensor]) -> int:
    """The bytes of the delta A -> A1 into one receiver holding all of A (weightstream's own tp-1
    host layout of it): what every rank received before each got only the elements it holds."""
    import weightstream  # noqa: PLC0415

    checkpoint = weightstream.open(a)
    layout = weightstream.model_layout(checkpoint, device="cpu")
    session = weightstream.LoadSession(layout)
    session.begin("cold")
    session.load_checkpoint(checkpoint)
    session.finish()
    receiver = weightstream.UpdateReceiver(layout, token="secret")
    receiver.version = VERSION_A
    thread = threading.Thread(target=receiver.receive, kwargs={"accept_timeout": 120.0})
    thread.start()
    try:
        sender = weightstream.UpdateSender(receiver.address, token="secret", bucket_bytes=1 << 20)
        return sender.update_changes(base, changed, base=VERSION_A, target=VERSION_A1)["bytes"]
    finally:
        thread.join()


def delta_updates(tp_size: int, ep: bool, a: str, a1: str, trainer_a1: str) -> Dict[str, Any]:
    """Issue 46 in vLLM's own classes, built and loaded in BF16 as vLLM's loader builds them (a
    delta lands in parameters of the tensors' own dtype): the model, loaded from A with
    ``--load-format weightstream``, holds A; a full update of A names its version,
    a delta from another version is refused before its first byte, then the delta A -> A1 (A1:
    1% of the elements changed; for FP8 the trainer holds A1 in BF16 and the sender quantizes
    it, sending only the codes and scales that changed) lands in place. Each step is compared
    with vLLM's default load of the checkpoint it should leave."""
    reference_a, _, _ = build(a, tp_size, ep, "safetensors", model_dtype=True)
    reference_a1, _, _ = build(a1, tp_size, ep, "safetensors", model_dtype=True)
    model, _, config = build(a, tp_size, ep, "weightstream", model_dtype=True)
    base = dict(sorted(checkpoint_tensors(a).items()))
    changed = dict(sorted(checkpoint_tensors(trainer_a1).items()))
    before = addresses(model)
    result: Dict[str, Any] = {"before_differences": differences(model, reference_a),
                              "dtypes": sorted({str(t.dtype) for t in model.parameters()})}
    engine = transfer_engine(model, config, "tcp")
    try:
        def full(sender: Any) -> Dict[str, Any]:
            sender.start("checkpoint", [(n, t.dtype, tuple(t.shape)) for n, t in base.items()], target=VERSION_A)
            for name, tensor in base.items():
                sender.send(name, tensor)
            return sender.finish()

        report, trainer, worker = push_with(engine, full)
        result["full"] = {"bytes": report.get("bytes"), "trainer": trainer, "worker": worker,
                          "differences": differences(model, reference_a)}
        report, trainer, worker = push_with(
            engine, lambda sender: sender.update_changes(base, changed, base=VERSION_OTHER, target=VERSION_A1))
        result["wrong_base"] = {"trainer": trainer, "worker": worker, "differences": differences(model, reference_a)}
        report, trainer, worker = push_with(
            engine, lambda sender: sender.update_changes(base, changed, base=VERSION_A, target=VERSION_A1))
        result["delta"] = {"bytes": report.get("bytes"), "sparse_tensors": report.get("sparse_tensors"),
                           "checked_tensors": report.get("checked_tensors"),
                           "dense_tensors": report.get("dense_tensors"), "trainer": trainer, "worker": worker,
                           "differences": differences(model, reference_a1), "addresses_unchanged": addresses(model) == before,
                           "whole_bytes": whole_delta_bytes(a, base, changed)}
    finally:
        engine.shutdown()
    return result


def refused_push(engine: Any, tensors: List[Tuple[str, torch.Tensor]]) -> Dict[str, str]:
    """An update the receiver must refuse: the trainer's error and the worker's."""
    import weightstream  # noqa: PLC0415

    errors = {"trainer": "", "worker": ""}

    def trainer() -> None:
        try:
            sender = weightstream.UpdateSender(engine.address, transport="tcp", token="secret", bucket_bytes=1 << 20)
            sender.update(tensors)
        except weightstream.Error as error:
            errors["trainer"] = str(error)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        engine.receive_weights(engine.parse_update_info({"accept_timeout": 120.0}))
    except Exception as raised:  # noqa: BLE001 - the error is the result
        errors["worker"] = str(raised)
    finally:
        thread.join()
    return errors


def refused_manifests(model: torch.nn.Module, config: Any, reference: torch.nn.Module, b: str) -> Dict[str, Any]:
    """Updates of checkpoint B (FP8 codes with their scales) that the manifest check refuses
    before their first byte: a last tensor of an unknown name, a last tensor of a wrong shape,
    FP8 codes without their scale, a scale without its codes. After each, every parameter
    must still equal vLLM's default load of A."""
    tensors = sorted(checkpoint_tensors(b).items())
    last_name, last = tensors[-1]
    codes = next(name for name, tensor in tensors if tensor.dtype == torch.float8_e4m3fn and ".experts." in name)
    cases = {
        "unknown_last": tensors + [("model.layers.0.mlp.experts.0.rotary_blob.weight", torch.zeros(4, 4))],
        "wrong_shape_last": tensors[:-1] + [(last_name, torch.zeros(*last.shape[:-1], last.shape[-1] + 1,
                                                                    dtype=last.dtype))],
        "codes_without_scale": [(n, t) for n, t in tensors if n != codes + "_scale_inv"],
        "scale_without_codes": [(n, t) for n, t in tensors if n != codes],
    }
    results: Dict[str, Any] = {"codes": codes, "last": last_name, "parameters": len(state_of(model))}
    engine = transfer_engine(model, config, "tcp")
    try:
        for case, pushed in cases.items():
            errors = refused_push(engine, pushed)
            results[case] = dict(errors, differences=differences(model, reference))
    finally:
        engine.shutdown()
    return results


def transfer_engine(model: torch.nn.Module, config: Any, transport: str) -> Any:
    from vllm.config import set_current_vllm_config  # noqa: PLC0415
    from vllm.config.weight_transfer import WeightTransferConfig  # noqa: PLC0415
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: PLC0415

    with set_current_vllm_config(config):
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="weightstream"), config,
                                                           torch.device("cpu"), model)
        engine.init_transfer_engine(engine.parse_init_info({"transport": transport, "token": "secret"}))
    return engine


def run_scenario(scenario: Dict[str, Any], tp_size: int, rank: int, paths: Dict[str, str]) -> Dict[str, Any]:
    """One family, dtype and parallelism on this rank: weightstream's load against vLLM's
    default loader on checkpoint A, then (when asked) updates pushed over shm, tcp and ucx."""
    import weightstream.vllm as ws_vllm  # noqa: PLC0415

    ws_vllm.register()
    family, fp8, ep = scenario["family"], scenario["fp8"], scenario["ep"]
    kind = "fp8" if fp8 else "bf16"
    a, b = paths[f"{family}-{kind}-a"], paths[f"{family}-{kind}-b"]
    recorder = LogRecorder()
    logging.getLogger("vllm.weightstream").addHandler(recorder)
    logging.getLogger("vllm.weightstream").setLevel(logging.INFO)
    result: Dict[str, Any] = {"scenario": scenario}
    try:
        reference_a, _, _ = build(a, tp_size, ep, "safetensors")
        ours, loader, config = build(a, tp_size, ep, "weightstream")
        result["load"] = dict(loader.last_load)
        result["load_differences"] = differences(ours, reference_a)
        result["parameters"] = len(state_of(ours))
        result["dtypes"] = sorted({str(t.dtype) for t in ours.parameters()})
        bound = ours._weightstream_binding
        result["unbound"] = dict(bound.unbound)
        layout = bound.layout
        result["layout_allocated_bytes"] = layout.allocated_bytes
        parallel = ws_vllm._model.parallel_ranks(ours)
        result["parallel"] = [parallel.tp_size, parallel.tp_rank, parallel.ep_size, parallel.ep_rank]
        # This rank's share (the bytes of the slices its parameters take) and what the plan reads.
        result["share"], result["planned"] = rank_bytes(layout, a)
        itemsizes = _checkpoint_itemsizes(a)
        result["checkpoint_bytes"] = sum(os.path.getsize(os.path.join(a, f)) for f in os.listdir(a)
                                         if f.endswith(".safetensors"))
        result["other_experts"] = [name for name in itemsizes if layout.route(name)[0] == "skipped" and
                                   "expert-parallel rank" in layout.route(name)[2]]
        if scenario.get("update"):
            before = addresses(ours)
            reference_b, _, _ = build(b, tp_size, ep, "safetensors")
            updates = []
            # shm: checkpoint B (for FP8, B's BF16 weights, quantized by the receiver);
            # tcp: back to A (for FP8, its codes, then their scales in later buckets);
            # ucx: B again, over the UCX transport (its tcp lane on loopback here).
            if fp8:
                first = sorted(checkpoint_tensors(paths[f"{family}-bf16-b"]).items())
                a_tensors = checkpoint_tensors(a)
                second = sorted((n, t) for n, t in a_tensors.items() if not n.endswith("_scale_inv")) + \
                    sorted((n, t) for n, t in a_tensors.items() if n.endswith("_scale_inv"))
            else:
                first = sorted(checkpoint_tensors(b).items())
                second = sorted(checkpoint_tensors(a).items())
            for transport, tensors, reference in (("shm", first, reference_b), ("tcp", second, reference_a),
                                                  ("ucx", first, reference_b)):
                engine = transfer_engine(ours, config, transport)
                report = push(engine, tensors, transport, bucket_bytes=1 << 20)
                engine.shutdown()
                updates.append({"transport": transport, "bytes": report.get("bytes"),
                                "differences": differences(ours, reference),
                                "addresses_unchanged": addresses(ours) == before})
            result["updates"] = updates
        if scenario.get("delta"):
            a1 = paths[f"{family}-{kind}-a1"]
            result["delta"] = delta_updates(tp_size, ep, a, a1, a1 + "-bf16" if fp8 else a1)
        if scenario.get("refused_update"):
            result["refused_update"] = refused_update(ours, config)
        if scenario.get("refused_manifests"):
            result["refused_manifests"] = refused_manifests(ours, config, reference_a, b)
        result["log"] = [m for m in recorder.messages if "weightstream" in m]
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the test
        result["ok"] = False
        result["error"] = traceback.format_exc()
    finally:
        logging.getLogger("vllm.weightstream").removeHandler(recorder)
    return result


PEER_TOKEN = "peer-secret"


def run_peer_scenario(scenario: Dict[str, Any], tp_size: int, rank: int, paths: Dict[str, str]) -> Dict[str, Any]:
    """Instance A loads checkpoint A with weightstream and serves its bound parameters
    (extra-config ``serve``, port + rank); instance B, whose model folder holds config.json
    only, loads with ``model_uri=peer://`` A's ranks. B must equal vLLM's default load of the
    checkpoint, reading nothing from storage. Then a wrong token is refused, and once A's
    model is dropped its servers are gone."""
    import gc  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415
    import weightstream.vllm as ws_vllm  # noqa: PLC0415

    ws_vllm.register()
    family, ep = scenario["family"], scenario["ep"]
    a = paths[f"{family}-bf16-a"]
    base = scenario["port"]
    uri = "peer://" + ",".join(f"127.0.0.1:{base + r}" for r in range(tp_size))
    result: Dict[str, Any] = {"scenario": scenario, "uri": uri}
    config_only = tempfile.mkdtemp(prefix="ws-peer-config-")
    with open(os.path.join(a, "config.json")) as source, open(os.path.join(config_only, "config.json"), "w") as copy:
        copy.write(source.read())

    def failure(extra: Dict[str, Any]) -> str:
        try:
            build(config_only, tp_size, ep, "weightstream", extra)
        except Exception as error:  # noqa: BLE001 - its text is the result
            return str(error)
        return ""

    try:
        reference, _, _ = build(a, tp_size, ep, "safetensors")
        served, serving_loader, _ = build(a, tp_size, ep, "weightstream",
                                          {"serve": f"127.0.0.1:{base}", "peer_token": PEER_TOKEN})
        result["serving"] = serving_loader.last_load.get("serving")
        result["served_differences"] = differences(served, reference)
        result["content_digest"] = served._weightstream_server.content_digest
        dist.barrier()  # every rank of A serves before a rank of B pulls
        pulled, loader, _ = build(config_only, tp_size, ep, "weightstream",
                                  {"model_uri": uri, "peer_token": PEER_TOKEN,
                                   "peer_expect_digest": result["content_digest"]})
        result["load"] = dict(loader.last_load)
        result["load_differences"] = differences(pulled, reference)
        result["parameters"] = len(state_of(pulled))
        result["unbound"] = dict(pulled._weightstream_binding.unbound)
        result["wrong_token"] = failure({"model_uri": uri, "peer_token": "not-" + PEER_TOKEN})
        result["wrong_digest"] = failure({"model_uri": uri, "peer_token": PEER_TOKEN, "peer_expect_digest": "0" * 16})
        dist.barrier()  # every rank is done with A's servers
        del served, serving_loader
        gc.collect()
        dist.barrier()
        result["after_stop"] = failure({"model_uri": uri, "peer_token": PEER_TOKEN, "peer_timeout": 10})
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the test
        result["ok"] = False
        result["error"] = traceback.format_exc()
    finally:
        shutil.rmtree(config_only, ignore_errors=True)
    return result


def run_draft_scenario(scenario: Dict[str, Any], paths: Dict[str, str]) -> Dict[str, Any]:
    """A checkpoint with its MTP layer: the target (which must not read them) and vLLM's MTP
    draft module, each loaded by weightstream and by vLLM's default loader, compared."""
    import weightstream.vllm as ws_vllm  # noqa: PLC0415

    ws_vllm.register()
    family, kind = scenario["family"], "fp8" if scenario["fp8"] else "bf16"
    path = paths[f"{family}-{kind}-mtp"]
    # From S3: vLLM's model folder holds config.json only; weightstream finds the weights at
    # the checkpoint URI (model_uri), vLLM's default loader reads the local copy.
    model_path, extra = (scenario["config_folder"], {"model_uri": scenario["s3_uri"]}) if scenario.get("s3_uri") \
        else (path, {})
    result: Dict[str, Any] = {"scenario": scenario}
    try:
        modules = {}
        for role, draft in (("target", False), ("draft", True)):
            reference, _, _ = build(path, 1, False, "safetensors", draft=draft)
            ours, loader, _ = build(model_path, 1, False, "weightstream", extra, draft=draft)
            layout = ours._weightstream_binding.layout
            modules[role] = {
                "class": type(ours).__name__, "load": dict(loader.last_load), "differences": differences(ours, reference),
                "parameters": len(state_of(ours)), "unbound": dict(ours._weightstream_binding.unbound),
                "layout_allocated_bytes": layout.allocated_bytes,
                "share": rank_bytes(layout, path)[0]}
        result["modules"] = modules
        result["ok"] = True
    except BaseException:  # noqa: BLE001 - reported to the test
        result["ok"] = False
        result["error"] = traceback.format_exc()
    return result


def refused_update(model: torch.nn.Module, config: Any) -> Dict[str, Any]:
    """Replaces one bound parameter as vLLM's process_weights_after_loading does where it
    transforms a weight (replace_parameter with another layout: new storage), then asks for an
    update: it must fail before the trainer's first byte is applied, every parameter as it was."""
    from vllm.model_executor.utils import replace_parameter  # noqa: PLC0415

    target = next(name for name in dict(model.named_parameters()) if name.endswith("o_proj.weight"))
    module_name, _, attribute = target.rpartition(".")
    module = model.get_submodule(module_name)
    # Column-major, as kernels that want the transposed weight hold it: new storage.
    replace_parameter(module, attribute, getattr(module, attribute).detach().t().contiguous().t())
    before = {name: tensor.clone() for name, tensor in state_of(model).items()}
    import weightstream  # noqa: PLC0415

    engine = transfer_engine(model, config, "tcp")
    tensors = [(name, torch.zeros_like(tensor)) for name, tensor in sorted(
        checkpoint_tensors(config.model_config.model).items())]

    trainer_error: List[str] = []

    def trainer() -> None:
        try:
            sender = weightstream.UpdateSender(engine.address, transport="tcp", token="secret", bucket_bytes=1 << 20)
            sender.update(tensors)
        except weightstream.Error as refused:
            trainer_error.append(str(refused))

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        engine.receive_weights(engine.parse_update_info({"accept_timeout": 120.0}))
        error = ""
    except Exception as raised:  # noqa: BLE001 - the error is the result
        error = str(raised)
    finally:
        engine.shutdown()  # the receiver closes: the trainer's send fails
        thread.join()
    after = state_of(model)
    return {"parameter": target, "error": error, "trainer_error": "".join(trainer_error),
            "unchanged": all(torch.equal(after[name], before[name]) for name in before)}


def _free_port() -> int:
    import socket  # noqa: PLC0415

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one rank of a scenario plan")
    run.add_argument("--tp", type=int, required=True)
    run.add_argument("--rank", type=int, required=True)
    run.add_argument("--port", type=int, required=True)
    run.add_argument("--plan", required=True, help="JSON: {scenarios: [...], paths: {...}}")
    run.add_argument("--out", required=True, help="folder for the per-scenario results")
    peak = sub.add_parser("peak", help="peak resident memory of one load into vLLM's model (tp 1)")
    peak.add_argument("--path", required=True)
    peak.add_argument("--load-format", required=True)
    peak.add_argument("--extra", default="{}", help="JSON model_loader_extra_config")
    write = sub.add_parser("write", help="write the checkpoints of a plan")
    write.add_argument("--root", required=True)
    write.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    if args.command == "write":
        paths = {}
        for family in args.families.split(","):
            for kind in ("bf16", "fp8"):
                for seed_name, seed in (("a", 1), ("b", 2)):
                    folder = os.path.join(args.root, f"{family}-{kind}-{seed_name}")
                    write_checkpoint(family, folder, seed, fp8=kind == "fp8")
                    paths[f"{family}-{kind}-{seed_name}"] = folder
        print(json.dumps(paths))
        return
    if args.command == "peak":
        import resource  # noqa: PLC0415

        import weightstream.vllm as ws_vllm  # noqa: PLC0415

        ws_vllm.register()
        with parallel_state(1, 0, _free_port()):
            model, loader, _ = build(args.path, 1, False, args.load_format, json.loads(args.extra))
            through = getattr(loader, "last_load", {}).get("tensors_through_load_weights")
            print(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                              "parameter_bytes": sum(t.numel() * t.element_size() for t in model.parameters()),
                              "tensors_through_load_weights": through}))
        return
    with open(args.plan) as file:
        plan = json.load(file)
    os.makedirs(args.out, exist_ok=True)
    with parallel_state(args.tp, args.rank, args.port):
        for index, scenario in enumerate(plan["scenarios"]):
            started = time.perf_counter()
            if scenario.get("draft"):
                result = run_draft_scenario(scenario, plan["paths"])
            elif scenario.get("peer"):
                result = run_peer_scenario(scenario, args.tp, args.rank, plan["paths"])
            else:
                result = run_scenario(scenario, args.tp, args.rank, plan["paths"])
            result["seconds"] = time.perf_counter() - started
            with open(os.path.join(args.out, f"{index}-rank{args.rank}.json"), "w") as file:
                json.dump(result, file)


if __name__ == "__main__":
    sys.exit(main())

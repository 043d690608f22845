"""SGLang 0.5.23's MTP draft on the CPU, for the SGLang stage (tests/python/test_sglang_models.py).

A DeepSeek-V3 checkpoint with its MTP layer (model.layers.{num_hidden_layers}.*) serves
SGLang's target (``--speculative-algorithm NEXTN``, the draft's path the target's own) and
its draft: SGLang's ModelRunner with ``is_draft_worker=True`` and the draft's ModelConfig
(``is_draft_model``: DeepseekV3ForCausalLMNextN), built inside the scopes SGLang's
EagleDraftWorker builds it in, loaded with the server's ``--load-format``. The oracle is a
second draft module built and filled by SGLang's DefaultModelLoader in the same scopes.

SGLang's EAGLE worker then gives the draft the target's embedding and lm_head
(``set_embed_and_head``, which calls torch.cuda.synchronize() and so cannot run on a CPU);
its NextN load_weights skips the MTP layer's own copies. Neither loader fills the draft's two,
so the comparison leaves them out and checks that weightstream wrote neither.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

import torch

from engine_checkpoints import checkpoint_tensors, rank_bytes
from sglang_models import (
    UPDATE_TOKEN,
    addresses,
    build,
    differences,
    rank_addresses,
    recorded,
    state_of,
    through_load_weights,
)

#: The draft's parameters SGLang gives the target's tensors after the load.
FROM_TARGET = ("model.embed_tokens.weight", "lm_head.weight")


@contextlib.contextmanager
def draft_scope(target: Any) -> Iterator[None]:
    """The scopes SGLang's EagleDraftWorker builds its draft's TpModelWorker in: the draft's
    tensor-parallel placement, a one-stage pipeline, the speculative MoE backend and the
    draft's construction settings."""
    from sglang.srt.layers.moe.utils import draft_model_build_scope, speculative_moe_backend_context  # noqa: PLC0415
    from sglang.srt.runtime_context import get_spec  # noqa: PLC0415
    from sglang.srt.speculative.draft_parallel import (  # noqa: PLC0415
        model_draft_parallel_spec,
        resolve_draft_parallel_layout,
    )
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: PLC0415
    from sglang.srt.speculative.spec_utils import draft_pp_context, draft_tp_context  # noqa: PLC0415

    algorithm = SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm)
    layout = resolve_draft_parallel_layout(
        model_draft_parallel_spec(target.spec_aux_config.draft_model_config, spec_algorithm=algorithm))
    with draft_tp_context(layout), draft_pp_context(), speculative_moe_backend_context(), draft_model_build_scope():
        yield


def build_draft(target: Any, port: int) -> Any:
    """SGLang's draft ModelRunner beside ``target`` (built with ``speculative``), as its
    TpModelWorker(is_draft_worker=True) makes it: the draft's ModelConfig, loaded with the
    server's --load-format."""
    from sglang.srt.configs.model_config import ModelConfig  # noqa: PLC0415
    from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: PLC0415
    from sglang.srt.runtime_context import get_spec  # noqa: PLC0415

    config = ModelConfig.from_server_args(target.server_args, model_path=get_spec().speculative_draft_model_path,
                                          is_draft_model=True, context_length=target.model_config.context_len)
    with draft_scope(target):
        return ModelRunner(model_config=config, mem_fraction_static=0.9, gpu_id=0, nccl_port=port + 1,
                           server_args=target.server_args, is_draft_worker=True)


def default_draft(target: Any, draft: Any, path: str) -> torch.nn.Module:
    """A second draft module of the checkpoint at ``path``, built and filled by SGLang's
    DefaultModelLoader in the draft's scopes."""
    from sglang.srt.configs.device_config import DeviceConfig  # noqa: PLC0415
    from sglang.srt.configs.load_config import LoadConfig  # noqa: PLC0415
    from sglang.srt.model_loader.loader import DefaultModelLoader  # noqa: PLC0415

    saved = draft.model_config.model_path
    draft.model_config.model_path = path
    try:
        with draft_scope(target):
            return DefaultModelLoader(LoadConfig(load_format="auto")).load_model(
                model_config=draft.model_config, device_config=DeviceConfig("cpu", 0))
    finally:
        draft.model_config.model_path = saved


def default_target(target: Any, path: str) -> torch.nn.Module:
    from sglang_models import default_load_of  # noqa: PLC0415

    return default_load_of(target, path)


def draft_differences(ours: torch.nn.Module, reference: torch.nn.Module) -> List[str]:
    """differences() but for the two tensors SGLang gives the draft from its target."""
    return [name for name in differences(ours, reference) if name not in FROM_TARGET]


def mtp_tensors(path: str, num_hidden_layers: int) -> List[Tuple[str, torch.Tensor]]:
    """The MTP layer's checkpoint tensors: what a trainer pushes to the draft."""
    prefix = f"model.layers.{num_hidden_layers}."
    return sorted((name, tensor) for name, tensor in checkpoint_tensors(path).items() if name.startswith(prefix))


def push_to_target_and_draft(target: Any, draft: Any, tensors: List[Tuple[str, torch.Tensor]],
                             draft_tensors: Any, tp_size: int, rank: int) -> Dict[str, Any]:
    """One update through SGLang's update API, as its scheduler runs update_weights_from_tensor
    for the selector "all": begin_weight_update on both runners, the target's runner then the
    draft's called with the same request, end_weight_update on both; over shm, by a trainer
    beside this rank."""
    import weightstream.sglang as ws_sglang  # noqa: PLC0415

    runners = (target, draft)

    def update_weights_from_tensor(named_tensors: Any, load_format: str) -> Tuple[bool, str]:
        success, message = True, "Success"
        for runner in runners:
            success, message = runner.weight_updater.update_weights_from_tensor(named_tensors=named_tensors,
                                                                                load_format=load_format)
            if not success:
                break
        return success, message

    for runner in runners:
        runner.weight_updater.begin_weight_update()
    try:
        return ws_sglang.push_update(update_weights_from_tensor, tensors, token=UPDATE_TOKEN, bucket_bytes=1 << 20,
                                     accept_timeout=120.0, addresses=rank_addresses("shm", tp_size, rank),
                                     ranks=[rank], draft_tensors=draft_tensors,
                                     draft_addresses=rank_addresses("shm", tp_size, rank))
    finally:
        for runner in runners:
            runner.weight_updater.end_weight_update(run_post_load=False)


def run_draft_scenario(scenario: Dict[str, Any], tp_size: int, rank: int, port: int,
                       paths: Dict[str, str]) -> Dict[str, Any]:
    """The target and its NextN draft loaded by weightstream from one checkpoint with its MTP
    layer, against SGLang's default loader; then checkpoint B pushed into both (FP8: B's BF16
    weights, quantized in place), against SGLang's default load of B; then an update whose
    request names no draft receivers, refused by the draft."""
    kind = "fp8" if scenario.get("fp8") else "bf16"
    family = scenario["family"]
    a, b = paths[f"{family}-{kind}-mtp-a"], paths[f"{family}-{kind}-mtp-b"]

    def body(result: Dict[str, Any]) -> None:
        target = build(a, tp_size, rank, bool(scenario.get("ep")), "weightstream", port, speculative=True)
        draft = build_draft(target, port)
        result["class"] = type(draft.model).__name__
        result["modules"] = {}
        for role, runner, reference in (("target", target, default_target(target, a)),
                                        ("draft", draft, default_draft(target, draft, a))):
            bound = runner.model._weightstream_binding
            result["modules"][role] = {
                "load": dict(runner.model._weightstream_last_load), "share": rank_bytes(bound.layout, a)[0],
                "differences": (draft_differences if role == "draft" else differences)(runner.model, reference),
                "parameters": len(state_of(runner.model)), "unbound": dict(bound.unbound),
                "layout_allocated_bytes": bound.layout.allocated_bytes}
        # The two the draft takes from its target are bound to nothing, read by no one.
        result["bound_from_target"] = [name for name in draft.model._weightstream_binding.bound.values()
                                       if name in FROM_TARGET]
        result["update"] = draft_update(target, draft, paths[f"{family}-bf16-mtp-b"], b,
                                        target.model_config.hf_config.num_hidden_layers, tp_size, rank)

    return recorded(scenario, body)


def draft_update(target: Any, draft: Any, pushed: str, b: str, layers: int, tp_size: int,
                 rank: int) -> Dict[str, Any]:
    """Checkpoint B pushed into the target and the draft (over shm, B's BF16 weights for FP8),
    compared with SGLang's default loads of B; then a request without draft receivers."""
    import weightstream.sglang as ws_sglang  # noqa: PLC0415

    before = {"target": addresses(target.model), "draft": addresses(draft.model)}
    seen = {"target": through_load_weights(target.model), "draft": through_load_weights(draft.model)}
    report = push_to_target_and_draft(target, draft, sorted(checkpoint_tensors(pushed).items()),
                                      mtp_tensors(pushed, layers), tp_size, rank)
    outcome: Dict[str, Any] = {
        "engine": list(report["engine"]),
        "draft_bytes": report["draft_senders"][0].get("bytes"),
        "received": dict(getattr(draft.model, "_weightstream_last_update", {})),
        "target_differences": differences(target.model, default_target(target, b)),
        "draft_differences": draft_differences(draft.model, default_draft(target, draft, b)),
        "addresses_unchanged": {role: addresses(runner.model) == before[role]
                                for role, runner in (("target", target), ("draft", draft))},
        "through_load_weights": {role: list(names) for role, names in seen.items()},
    }
    try:
        ws_sglang.receive_update(draft.model, ws_sglang.update_request(rank_addresses("shm", tp_size, rank),
                                                                        token=UPDATE_TOKEN))
        outcome["refused"] = ""
    except ValueError as error:
        outcome["refused"] = str(error)
    return outcome

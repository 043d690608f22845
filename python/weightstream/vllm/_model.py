"""What the vLLM loader and the transfer engine share: vLLM's names for a layout's
parameters, where a vLLM model's weights are, and this rank's ModelLayout bound to the vLLM
model's own parameters. The engine-neutral parts (options, binding, one load of the bound
layout) are weightstream._engine's, shared with the SGLang plugin.

Imports torch, never vLLM at module level: the functions that need vLLM import it when called.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .. import _core
from .._api import Checkpoint
from .._engine.renames import engine_names
from .._engine import (  # noqa: F401 - re-exported: the vLLM plugin's names since before _engine
    BY_LOAD_WEIGHTS,
    EXTRA_CONFIG_KEYS,
    STREAM_OPTIONS,
    BoundModel,
    CheckpointAhead,
    LoaderOptions,
    ModelTensors,
    NoMappingTable,
    Parallel,
    bind_layout,
    check_in_place,
    device_name,
    first_names,
    is_hub_id,
    route_checkpoint,
    safetensors_dtype,
    serve_address,
    serving_peer,
    store_binding,
    stored_binding,
)
from .._engine import first_weights_source as _first_weights_source
from .._engine import log_once as _log_once
from .._engine import model_tensors as _model_tensors
from .._engine import resolve_module_source as _resolve_module_source

logger = logging.getLogger("vllm.weightstream")

#: vLLM quantization methods a layout binds: none, and FP8 (block-scaled checkpoints are
#: held as Fp8LinearMethod holds them; an FP8 model without weight_block_size is refused by
#: the layout, and loads through load_weights).
BOUND_QUANTIZATIONS = (None, "fp8")

_first_names = first_names


def log_once(level: int, message: str, *args: Any) -> None:
    """Logs to vLLM's weightstream logger the first time a message's text is seen."""
    _log_once(logger, level, message, *args)


def local_source(value: str, model_config: Any, load_config: Any) -> str:
    """``value`` as weightstream reads it: a URI or a path as it is; a Hub id through vLLM's
    own download (its cache, revision and ignore patterns), as the folder it landed in."""
    if not is_hub_id(value):
        return value
    from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf  # noqa: PLC0415

    return download_weights_from_hf(value, load_config.download_dir, ["*.safetensors", "*.json"],
                                    getattr(model_config, "revision", None),
                                    ignore_patterns=getattr(load_config, "ignore_patterns", None))


@dataclass
class ModelSources:
    """Where a vLLM model names its weights, Hub ids already downloaded."""

    model: str
    model_weights: str

    @classmethod
    def of(cls, model_config: Any, load_config: Any) -> "ModelSources":
        model = str(getattr(model_config, "model", "") or "")
        weights = str(getattr(model_config, "model_weights", "") or "")
        return cls(model=local_source(model, model_config, load_config),
                   model_weights=local_source(weights, model_config, load_config))


def config_dict(sources: ModelSources, model_config: Any) -> Dict[str, Any]:
    """The model's config.json: from the model's folder when it has one (vLLM 0.34 points
    ``model`` at a folder of JSON files for an s3:// model), else beside the weights, else
    vLLM's parsed Hugging Face config."""
    for place in (sources.model, sources.model_weights):
        if place and os.path.isfile(os.path.join(place, "config.json")):
            with open(os.path.join(place, "config.json")) as file:
                return json.load(file)
    for place in (sources.model_weights, sources.model):
        if place and "://" in place:
            try:
                config = Checkpoint(place).config
            except _core.Error:
                continue
            if config is not None:
                return config
    return model_config.hf_config.to_dict()


def model_parameter_name(layout_name: str, role: str, model_type: str) -> str:
    """The vLLM name of a layout parameter before its experts' submodule: the target's are
    the layout's, a draft's as vLLM's MTP modules name them (the "draft" stage of
    weightstream._engine.renames)."""
    return engine_names("vllm", layout_name, role, model_type, stages=("draft",))[0]


def model_candidates(layout_name: str, role: str, model_type: str) -> List[str]:
    """The names a vLLM model may give a layout parameter, the likeliest first
    (weightstream._engine.renames)."""
    return engine_names("vllm", layout_name, role, model_type)


def is_routed_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of vLLM's RoutedExperts (a MoE layer's stacked experts)."""
    return hasattr(module, "expert_map_manager") and hasattr(module, "global_num_experts")


def model_tensors(model: torch.nn.Module) -> ModelTensors:
    """The vLLM model's tensors from one walk, its RoutedExperts modules under ``experts``."""
    return _model_tensors(model, is_routed_experts)


def parallel_ranks(model: Optional[torch.nn.Module] = None, walked: Optional[ModelTensors] = None) -> Parallel:
    """This process's tensor-parallel rank in vLLM, and, for a MoE model whose experts vLLM
    divides by expert parallelism, its expert-parallel rank (``walked``: the model's tensors
    when walked already). Raises NoMappingTable for an expert placement other than vLLM's
    linear one (whole experts in order, as many on each rank), which the layout does not
    describe."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size  # noqa: PLC0415

    parallel = Parallel(tp_size=get_tensor_model_parallel_world_size(), tp_rank=get_tensor_model_parallel_rank())
    if walked is None and model is not None:
        walked = model_tensors(model)
    for experts in walked.experts if walked is not None else []:
        config = experts.moe_config.moe_parallel_config
        if not config.use_ep:
            return parallel
        total, local = int(experts.global_num_experts), int(experts.local_num_experts)
        ep_size, ep_rank = int(config.ep_size), int(config.ep_rank)
        expected = torch.full((total,), -1, dtype=torch.int32)
        if local * ep_size == total:
            expected[ep_rank * local:(ep_rank + 1) * local] = torch.arange(local, dtype=torch.int32)
        expert_map = getattr(experts, "_expert_map", None)
        linear = (local * ep_size == total and expert_map is not None and
                  torch.equal(expert_map.to("cpu", torch.int32), expected))
        if not linear:
            raise NoMappingTable(f"expert placement '{getattr(experts, 'expert_placement_strategy', '?')}' of "
                                 f"{total} experts over {ep_size} expert-parallel ranks ({local} here); weightstream "
                                 f"binds vLLM's linear placement of whole experts, as many on each rank")
        parallel.ep_size, parallel.ep_rank = ep_size, ep_rank
        return parallel
    return parallel


def bind_model(model: torch.nn.Module, config: Dict[str, Any], role: str, dtype: torch.dtype,
               parallel: Optional[Parallel] = None) -> BoundModel:
    """This rank's layout of ``config`` bound to the vLLM model's own parameters (vLLM's
    names: renamed for a draft, experts under routed_experts), as weightstream._engine's
    bind_layout binds them. ``parallel``: this process's ranks (read from vLLM and the model
    when None). Raises NoMappingTable for an architecture, quantization or dtype weightstream
    has no table for, and weightstream.Error when nothing binds."""
    model_type = str(config.get("model_type", ""))
    walked = model_tensors(model)
    if parallel is None:
        parallel = parallel_ranks(walked=walked)
    return bind_layout(walked, config, role, dtype, parallel,
                       lambda name, module_role: model_candidates(name, module_role, model_type), "vLLM", logger)


def resolve_module_source(sources: ModelSources, role: str, layout: Any, options: LoaderOptions, method: str = "",
                          ahead: Optional[CheckpointAhead] = None) -> Dict[str, Any]:
    """weightstream._engine.resolve_module_source of a vLLM model's sources."""
    return _resolve_module_source(sources.model, sources.model_weights, role, layout, options, method, ahead)


def first_weights_source(sources: ModelSources, options: LoaderOptions) -> str:
    """weightstream._engine.first_weights_source of a vLLM model's sources."""
    return _first_weights_source(sources.model, sources.model_weights, options)

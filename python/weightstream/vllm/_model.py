"""What the vLLM loader and the transfer engine share: weightstream's options from
``--model-loader-extra-config``, where a vLLM model's weights are, and this rank's
ModelLayout bound to the vLLM model's own parameters.

Imports torch, never vLLM at module level: the functions that need vLLM import it when called.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch

from .. import _core
from .._api import Checkpoint, resolve_options
from .._model import ModelLayout, model_layout

logger = logging.getLogger("vllm.weightstream")

#: weightstream's stream options, as weightstream.stream takes them.
STREAM_OPTIONS = ("concurrency", "memory_limit", "chunk_size", "io", "gpu_path", "mapped_share", "prefetchers")
#: Every key ``--model-loader-extra-config`` takes.
EXTRA_CONFIG_KEYS = STREAM_OPTIONS + ("model_uri",)

#: The reason given to the layout for a checkpoint tensor it leaves to the model.
BY_LOAD_WEIGHTS = "loaded by the model's load_weights"

_TORCH_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
}

_once: Set[str] = set()


def log_once(level: int, message: str, *args: Any) -> None:
    """Logs a message the first time its text is seen in this process."""
    text = message % args if args else message
    if text in _once:
        return
    _once.add(text)
    logger.log(level, "%s", text)


@dataclass
class LoaderOptions:
    """weightstream's options from ``--model-loader-extra-config``."""

    stream: Dict[str, Any] = field(default_factory=dict)
    #: The checkpoint URI a draft (or a target) falls back to; WEIGHTSTREAM_MODEL_URI or
    #: MX_MODEL_URI when empty.
    model_uri: str = ""

    @classmethod
    def from_extra_config(cls, extra_config: Optional[Mapping[str, Any]]) -> "LoaderOptions":
        """Checks the keys and values at once, so a typo fails when vLLM starts, not mid-load.
        Raises ValueError naming an unknown key and the accepted ones, weightstream.Error for
        a malformed value."""
        extra = dict(extra_config or {})
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"--model-loader-extra-config for --load-format weightstream: unknown key(s) "
                             f"{', '.join(unknown)} (accepted: {', '.join(EXTRA_CONFIG_KEYS)})")
        stream = {key: extra[key] for key in STREAM_OPTIONS if key in extra}
        resolve_options(**stream)  # raises for a malformed value
        model_uri = extra.get("model_uri") or ""
        if not isinstance(model_uri, str):
            raise ValueError(f"--model-loader-extra-config: model_uri must be a string, got {model_uri!r}")
        return cls(stream=stream, model_uri=model_uri)


# A Hugging Face Hub id: "org/name" or "name", no scheme, not a path on this machine.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def is_hub_id(value: str) -> bool:
    """Whether ``value`` names a model on the Hugging Face Hub rather than a URI or a path."""
    return bool(value) and "://" not in value and not os.path.exists(value) and bool(_HUB_ID.match(value))


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


def safetensors_dtype(dtype: torch.dtype) -> Optional[str]:
    """The safetensors name of a torch dtype vLLM builds parameters in, or None."""
    return _TORCH_DTYPES.get(dtype)


def model_parameter_name(layout_name: str, role: str, model_type: str) -> str:
    """The vLLM name of a layout parameter. The target's names are vLLM's. A draft's are
    renamed as vLLM's MTP modules name them: DeepSeek-V3's MTP layer keeps enorm, hnorm,
    eh_proj and shared_head and nests the decoder layer under mtp_block, and its embedding is
    the draft's model.embed_tokens; Qwen3-Next's mtp.* lives under model.*."""
    if role != "draft":
        return layout_name
    if layout_name.startswith("mtp."):
        return "model." + layout_name[len("mtp."):]
    match = re.match(r"^model\.layers\.(\d+)\.(.*)$", layout_name)
    if match and model_type in ("deepseek_v3", "deepseek_v2", "deepseek_mtp"):
        rest = match.group(2)
        if rest.startswith("embed_tokens."):
            return "model." + rest
        if not rest.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.")):
            return f"model.layers.{match.group(1)}.mtp_block.{rest}"
    return layout_name


def device_name(tensor: torch.Tensor) -> str:
    """"cpu" or "cuda:N", as weightstream names devices."""
    if tensor.device.type == "cuda":
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return "cpu"


def _first_names(names: Iterable[str], count: int = 5) -> str:
    names = list(names)
    shown = ", ".join(names[:count])
    return shown + (f", ... ({len(names)} in all)" if len(names) > count else "")


class NoMappingTable(Exception):
    """The model's architecture has no weightstream table: it loads through load_weights."""


@dataclass
class BoundModel:
    """A vLLM model's parameters bound to this rank's layout."""

    layout: ModelLayout
    role: str
    #: Layout parameter name to the model's parameter name, for every bound parameter.
    bound: Dict[str, str]
    #: Layout parameters the model has no matching tensor for (name: why), allocated by
    #: the layout; the checkpoint tensors that fill them also go through load_weights.
    unbound: Dict[str, str]
    device: str
    description: str

    @property
    def filled_model_names(self) -> Set[str]:
        """The model's parameters a complete load of the layout fills."""
        return set(self.bound.values())


def parallel_ranks() -> Tuple[int, int]:
    """(tp_size, tp_rank) of this process in vLLM's tensor-parallel group."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size  # noqa: PLC0415

    return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()


def bind_model(model: torch.nn.Module, config: Dict[str, Any], role: str, dtype: torch.dtype,
               tp_size: int, tp_rank: int) -> BoundModel:
    """Builds this rank's layout of ``config`` (the target without MTP layers, or the draft's
    MTP layers) and binds every layout parameter to the model's parameter or buffer of the
    same name (renamed for a draft), dtype and shape; what is left unbound the layout
    allocates. Raises NoMappingTable for an architecture weightstream has no table for (or
    a dtype it does not build), and weightstream.Error when no name matches at all, listing
    the first names on each side."""
    model_type = str(config.get("model_type", ""))
    name = safetensors_dtype(dtype)
    if name is None:
        raise NoMappingTable(f"parameters of dtype {dtype}")
    modules = "draft" if role == "draft" else "target"
    try:
        layout = model_layout(config, tp_size=tp_size, tp_rank=tp_rank, dtype=name, modules=modules)
    except _core.Error as error:
        if "has no mapping table" in str(error):
            raise NoMappingTable(f"model_type '{model_type}'") from error
        raise
    tensors: Dict[str, torch.Tensor] = {}
    for tensor_name, tensor in model.named_parameters(remove_duplicate=False):
        tensors.setdefault(tensor_name, tensor)
    for tensor_name, tensor in model.named_buffers(remove_duplicate=False):
        tensors.setdefault(tensor_name, tensor)
    layout_names = list(layout.parameter_names)
    bound: Dict[str, str] = {}
    unbound: Dict[str, str] = {}
    owners: Dict[Tuple[int, Tuple[int, ...], torch.dtype], str] = {}
    device = "cpu"
    # A tied lm_head comes after the embedding in the layout: it finds it bound already.
    for layout_name in layout_names:
        target = model_parameter_name(layout_name, role, model_type)
        info = layout.parameter_info(layout_name)
        tensor = tensors.get(target)
        key = None if tensor is None else (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if key is not None and key in owners:
            # The model ties it to a tensor bound already (lm_head to the embedding): share it.
            layout.share_storage(layout_name, owners[key], f"the model's {target} is its {bound[owners[key]]}")
            bound[layout_name] = target
            continue
        if tensor is None:
            unbound[layout_name] = f"the model has no tensor {target}"
            continue
        if tuple(tensor.shape) != tuple(info["shape"]) or safetensors_dtype(tensor.dtype) != info["dtype"]:
            unbound[layout_name] = (f"{target} is {tensor.dtype} {list(tensor.shape)}, the layout's "
                                    f"{info['dtype']} {list(info['shape'])}")
            continue
        if not tensor.is_contiguous():
            unbound[layout_name] = f"{target} is not contiguous"
            continue
        layout.bind(layout_name, tensor)
        bound[layout_name] = target
        owners[key] = layout_name
        device = device_name(tensor)
    if not bound:
        raise _core.Error(
            f"no parameter of the vLLM model matches {layout.description}: the layout has "
            f"{_first_names(model_parameter_name(n, role, model_type) for n in layout_names)}; the model has "
            f"{_first_names(tensors)}")
    if unbound:
        layout.allocate(device)
        log_once(logging.WARNING, "weightstream: %d parameters of %s are not the vLLM model's (%s); they load "
                 "through the model's load_weights", len(unbound), layout.description,
                 _first_names(f"{n}: {why}" for n, why in unbound.items()))
    return BoundModel(layout=layout, role=role, bound=bound, unbound=unbound, device=device,
                      description=layout.description)


def route_checkpoint(bound: BoundModel, checkpoint: Checkpoint) -> List[str]:
    """The checkpoint tensors that must go through the model's load_weights: those the
    layout has no parameter or ignore rule for (marked skipped in the layout, so that its
    load leaves them alone), and those that fill a parameter left unbound."""
    by_load_weights = []
    unbound = set(bound.unbound)
    for name in checkpoint.names:
        kind, parameters, reason = bound.layout.route(name)
        if kind == "unmatched":
            bound.layout.add_skipped_tensor(name, BY_LOAD_WEIGHTS)
            by_load_weights.append(name)
        elif kind == "skipped" and reason == BY_LOAD_WEIGHTS:  # marked by an earlier load
            by_load_weights.append(name)
        elif kind == "parameter" and unbound.intersection(parameters):
            by_load_weights.append(name)
    return by_load_weights


def stored_binding(model: torch.nn.Module) -> Optional[BoundModel]:
    """The binding a previous load made for ``model``, or None."""
    return getattr(model, "_weightstream_binding", None)


def store_binding(model: torch.nn.Module, bound: BoundModel) -> None:
    """Keeps the binding (and with it the layout) as long as the model lives."""
    object.__setattr__(model, "_weightstream_binding", bound)


def resolve_module_source(sources: ModelSources, role: str, layout: ModelLayout, options: LoaderOptions,
                          method: str = "") -> Dict[str, Any]:
    """Where a module's weights come from, as ``weightstream resolve`` decides: model_weights,
    then model, then the checkpoint URI (extra-config model_uri, else WEIGHTSTREAM_MODEL_URI
    or MX_MODEL_URI). Raises weightstream.Error naming every source passed over."""
    return _core.resolve_source(sources.model, sources.model_weights, role, layout, method, options.model_uri,
                                options.stream)


def first_weights_source(sources: ModelSources, options: LoaderOptions) -> str:
    """For a model without a layout: the first of model_weights, model and the checkpoint URI
    that holds safetensors files. Raises FileNotFoundError naming each."""
    tried: List[str] = []
    model_uri, uri_field = _core.checkpoint_uri(options.model_uri)
    for label, place in (("model_weights", sources.model_weights), ("model", sources.model), (uri_field, model_uri)):
        if not place:
            tried.append(f"{label}: not set")
            continue
        try:
            checkpoint = Checkpoint(place, **options.stream)
        except _core.Error as error:
            tried.append(f"{label} {place}: {error}")
            continue
        if len(checkpoint):
            return place
        tried.append(f"{label} {place}: no tensors")
    raise FileNotFoundError("Cannot find any safetensors model weights: " + "; ".join(tried))


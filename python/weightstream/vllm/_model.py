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
import threading
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
EXTRA_CONFIG_KEYS = STREAM_OPTIONS + ("model_uri", "peer_token", "peer_timeout", "peer_expect_digest", "serve")

#: vLLM quantization methods a layout binds: none, and FP8 (block-scaled checkpoints are
#: held as Fp8LinearMethod holds them; an FP8 model without weight_block_size is refused by
#: the layout, and loads through load_weights).
BOUND_QUANTIZATIONS = (None, "fp8")

#: The reason given to the layout for a checkpoint tensor it leaves to the model.
BY_LOAD_WEIGHTS = "loaded by the model's load_weights"

_TORCH_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
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
    #: MX_MODEL_URI when empty. A ``peer://HOST:PORT[,...]`` URI is pulled from first, before
    #: the model's own sources (which are then the fallback).
    model_uri: str = ""
    #: The token serving peers require and this instance's server requires of pullers;
    #: None: WEIGHTSTREAM_PEER_TOKEN (which keeps it off vLLM's command line).
    peer_token: Optional[str] = None
    #: Seconds a peer's connect, message or read may go without progress.
    peer_timeout: float = 30.0
    #: The checkpoint content digest (16 hex digits, as ``weightstream digest --hash xxh64``
    #: prints it) every peer of a peer:// model_uri must serve; None: any one content that
    #: all the peers agree on. A peer serving another or unknown (updated) content is
    #: refused before a byte lands, and the model's own sources are loaded instead.
    peer_expect_digest: Optional[str] = None
    #: "HOST:PORT": after its load each rank serves its bound parameters to pullers
    #: (peer://) at HOST, port PORT + its rank in vLLM's world (PORT 0: a free port each).
    serve: str = ""

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
        if model_uri.startswith("peer://"):
            _core.peer_addresses(model_uri)  # raises naming a malformed address
        peer_token = extra.get("peer_token")
        if peer_token is not None and not isinstance(peer_token, str):
            raise ValueError("--model-loader-extra-config: peer_token must be a string")  # never echoed
        peer_timeout = extra.get("peer_timeout", 30.0)
        if isinstance(peer_timeout, bool) or not isinstance(peer_timeout, (int, float)) or peer_timeout <= 0:
            raise ValueError(f"--model-loader-extra-config: peer_timeout must be seconds above 0, got {peer_timeout!r}")
        peer_expect_digest = extra.get("peer_expect_digest")
        if peer_expect_digest is not None:
            if not isinstance(peer_expect_digest, str) or not re.fullmatch(r"[0-9a-fA-F]{16}", peer_expect_digest):
                raise ValueError(f"--model-loader-extra-config: peer_expect_digest must be a content digest of 16 hex "
                                 f"digits (as `weightstream digest --hash xxh64` prints it), got {peer_expect_digest!r}")
            if not model_uri.startswith("peer://"):
                raise ValueError("--model-loader-extra-config: peer_expect_digest pins what the peers of a peer:// "
                                 f"model_uri serve, and model_uri is {model_uri!r}")
        serve = extra.get("serve") or ""
        if serve:
            serve_address(serve, 0)  # raises for a malformed HOST:PORT
        return cls(stream=stream, model_uri=model_uri, peer_token=peer_token, peer_timeout=float(peer_timeout),
                   peer_expect_digest=peer_expect_digest, serve=serve)


def serve_address(serve: str, rank: int) -> str:
    """The address rank ``rank`` serves at for the extra-config key ``serve`` "HOST:PORT":
    PORT + rank (PORT 0: a free port). Raises ValueError for a malformed value or a port
    past 65535."""
    host, colon, port = serve.rpartition(":") if isinstance(serve, str) else ("", "", "")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--model-loader-extra-config: serve must be HOST:PORT (PORT + rank for each rank, 0 for "
                         f"free ports), got {serve!r}")
    number = int(port) + rank if int(port) else 0
    if number > 65535:
        raise ValueError(f"--model-loader-extra-config: serve {serve}: rank {rank} would serve at port {number}, "
                         f"past 65535")
    return f"{host}:{number}"


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
    renamed as vLLM's MTP modules name them: DeepSeek-V3's (and GLM-4.5's) MTP layer keeps enorm, hnorm,
    eh_proj and shared_head and nests the decoder layer under mtp_block, and its embedding is
    the draft's model.embed_tokens; Qwen3-Next's mtp.* lives under model.*."""
    if role != "draft":
        return layout_name
    if layout_name.startswith("mtp."):
        return "model." + layout_name[len("mtp."):]
    match = re.match(r"^model\.layers\.(\d+)\.(.*)$", layout_name)
    if match and model_type in ("deepseek_v3", "deepseek_v2", "deepseek_mtp", "kimi_k2", "glm4_moe", "glm4_moe_mtp"):
        rest = match.group(2)
        if rest.startswith("embed_tokens."):
            return "model." + rest
        if not rest.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.")):
            return f"model.layers.{match.group(1)}.mtp_block.{rest}"
    return layout_name


# vLLM 0.33's FusedMoE keeps its stacked expert weights (and their scales) in a
# RoutedExperts submodule: X.experts.routed_experts.w13_weight where the layout says
# X.experts.w13_weight.
_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(w13_weight|w2_weight)(.*)$")


def model_candidates(layout_name: str, role: str, model_type: str) -> List[str]:
    """The names a vLLM model may give a layout parameter, the likeliest first."""
    name = model_parameter_name(layout_name, role, model_type)
    match = _FUSED_EXPERTS.match(name)
    if match:
        return [f"{match.group(1)}.routed_experts.{match.group(2)}{match.group(3)}", name]
    return [name]


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
class Parallel:
    """Where this process sits: vLLM's tensor-parallel rank, and its expert-parallel rank
    when the model's MoE layers divide their experts (enable_expert_parallel)."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0


@dataclass
class BoundModel:
    """A vLLM model's parameters bound to this rank's layout."""

    layout: ModelLayout
    role: str
    #: Layout parameter name to the model's parameter name, for every bound parameter.
    bound: Dict[str, str]
    #: Parameters of the layout the model holds otherwise (name: why): removed from the
    #: layout (never allocated), filled through the model's load_weights.
    unbound: Dict[str, str]
    device: str
    description: str
    #: The model's tensor each bound parameter was bound to, (address, shape, dtype), so an
    #: update can tell when the model's storage is no longer the one bound.
    addresses: Dict[str, Tuple[int, Tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    #: Checkpoint tensors that fill an unbound parameter (they go through load_weights).
    unbound_tensors: Set[str] = field(default_factory=set)
    #: Checkpoint tensors the last load sent through the model's load_weights.
    by_load_weights: List[str] = field(default_factory=list)
    #: The model's parameters no layout parameter is bound to (a Qwen3-Next draft's own
    #: embed_tokens and lm_head, which the layout leaves to the target).
    model_only: Set[str] = field(default_factory=set)

    @property
    def filled_model_names(self) -> Set[str]:
        """The model's parameters a complete load of the layout fills."""
        return set(self.bound.values())


@dataclass
class ModelTensors:
    """A vLLM model's tensors, from one walk of its modules."""

    #: Every parameter, then every buffer, by name (the first name of a tensor reached twice
    #: comes first), as named_parameters(remove_duplicate=False) and named_buffers name them.
    tensors: Dict[str, torch.Tensor]
    #: The parameters as named_parameters() names them: each tensor once, at its first name.
    parameter_names: List[str]
    #: vLLM's RoutedExperts modules (the stacked experts of each MoE layer), in module order.
    routed_experts: List[torch.nn.Module]


def model_tensors(model: torch.nn.Module) -> ModelTensors:
    """Walks ``model``'s modules once (torch's named_parameters, named_buffers and modules
    would walk them three times, which costs milliseconds on a MoE model of thousands of
    modules)."""
    parameters: Dict[str, torch.Tensor] = {}
    buffers: Dict[str, torch.Tensor] = {}
    parameter_names: List[str] = []
    seen: Set[int] = set()
    experts: List[torch.nn.Module] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, parameter in module._parameters.items():
            if parameter is None:
                continue
            parameters.setdefault(dot + name, parameter)
            if id(parameter) not in seen:
                seen.add(id(parameter))
                parameter_names.append(dot + name)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                buffers.setdefault(dot + name, buffer)
        if hasattr(module, "expert_map_manager") and hasattr(module, "global_num_experts") and \
                all(module is not other for other in experts):
            experts.append(module)
    for name, buffer in buffers.items():
        parameters.setdefault(name, buffer)
    return ModelTensors(tensors=parameters, parameter_names=parameter_names, routed_experts=experts)


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
    for experts in walked.routed_experts if walked is not None else []:
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


def parameter_dtype(tensors: Mapping[str, torch.Tensor], role: str, model_type: str,
                    fallback: torch.dtype) -> torch.dtype:
    """The dtype vLLM built the model's unquantized parameters in, read from its embedding
    (vLLM's CPU platform builds float32 parameters where bfloat16 was asked for); the
    model config's dtype when the model has none."""
    for layout_name in ("model.embed_tokens.weight", "lm_head.weight"):
        for name in model_candidates(layout_name, role, model_type):
            tensor = tensors.get(name)
            if tensor is not None and tensor.is_floating_point() and tensor.element_size() > 1:
                return tensor.dtype
    return fallback


def _mismatch(target: str, tensor: Optional[torch.Tensor], dtype: str, shape: Tuple[int, ...]) -> Optional[str]:
    """Why the model's tensor cannot be bound to a layout parameter of ``dtype`` and
    ``shape``, or None."""
    if tensor is None:
        return f"the model has no tensor {target}"
    if tensor.shape != shape or _TORCH_DTYPES.get(tensor.dtype) != dtype:
        return f"{target} is {tensor.dtype} {list(tensor.shape)}, the layout's {dtype} {list(shape)}"
    if not tensor.is_contiguous():
        return f"{target} is not contiguous"
    return None


def bind_model(model: torch.nn.Module, config: Dict[str, Any], role: str, dtype: torch.dtype,
               parallel: Optional[Parallel] = None) -> BoundModel:
    """Builds this rank's layout of ``config`` (the target without MTP layers, or the draft's
    MTP layers) in the dtype of the model's own parameters, and binds every layout parameter
    to the model's parameter or buffer of the same name (vLLM's names: renamed for a draft,
    experts under routed_experts), dtype and shape, in one call. A layout parameter the model
    holds otherwise is removed from the layout, never allocated: the checkpoint tensors that
    fill it go through the model's load_weights. ``parallel``: this process's ranks (read
    from vLLM and the model when None). Raises NoMappingTable for an architecture,
    quantization or dtype weightstream has no table for, and weightstream.Error when nothing
    binds, saying why for the first parameters."""
    model_type = str(config.get("model_type", ""))
    walked = model_tensors(model)
    tensors = walked.tensors
    if parallel is None:
        parallel = parallel_ranks(walked=walked)
    dtype = parameter_dtype(tensors, role, model_type, dtype)
    name = safetensors_dtype(dtype)
    if name is None:
        raise NoMappingTable(f"parameters of dtype {dtype}")
    modules = "draft" if role == "draft" else "target"
    try:
        layout = model_layout(config, tp_size=parallel.tp_size, tp_rank=parallel.tp_rank, ep_size=parallel.ep_size,
                              ep_rank=parallel.ep_rank, dtype=name, modules=modules)
    except _core.Error as error:
        if "has no mapping table" in str(error):
            raise NoMappingTable(f"model_type '{model_type}'") from error
        if "quantization_config" in str(error):
            raise NoMappingTable(str(error)) from error
        raise
    matched: Dict[str, Tuple[str, torch.Tensor]] = {}
    unbound: Dict[str, str] = {}
    for layout_name, layout_dtype, shape in layout.parameters:
        candidates = model_candidates(layout_name, role, model_type)
        target = next((candidate for candidate in candidates if candidate in tensors), candidates[0])
        tensor = tensors.get(target)
        why = _mismatch(target, tensor, layout_dtype, shape)
        if why is None:
            matched[layout_name] = (target, tensor)
        else:
            unbound[layout_name] = why
    if not matched:
        raise _core.Error(
            f"no parameter of the vLLM model matches {layout.description}: "
            f"{_first_names(f'{n}: {why}' for n, why in unbound.items())}; the model has "
            f"{_first_names(f'{n} {t.dtype} {list(t.shape)}' for n, t in tensors.items())}")
    unbound_tensors: Set[str] = set()
    for layout_name in unbound:
        unbound_tensors.update(part["tensor"] for part in layout.parameter_info(layout_name)["parts"])
        layout.remove_parameter(layout_name, BY_LOAD_WEIGHTS)
    bound: Dict[str, str] = {}
    owners: Dict[Tuple[int, Tuple[int, ...], torch.dtype], str] = {}
    addresses: Dict[str, Tuple[int, Tuple[int, ...], torch.dtype]] = {}
    to_bind: List[Tuple[str, torch.Tensor]] = []
    shared: List[Tuple[str, str, str]] = []
    device = "cpu"
    # A tied lm_head comes after the embedding in the layout: it finds it bound already.
    for layout_name, (target, tensor) in matched.items():
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        bound[layout_name] = target
        addresses[layout_name] = key
        owner = owners.get(key)
        if owner is not None:
            # The model ties it to a tensor bound already (lm_head to the embedding): share it.
            shared.append((layout_name, owner, f"the model's {target} is its {bound[owner]}"))
            continue
        to_bind.append((layout_name, tensor))
        owners[key] = layout_name
        device = device_name(tensor)
    layout.bind_many(to_bind)
    for layout_name, owner, reason in shared:
        layout.share_storage(layout_name, owner, reason)
    if unbound:
        log_once(logging.WARNING, "weightstream: %d of %d parameters of %s are held otherwise by the vLLM model; "
                 "they load through its load_weights, the rest in place: %s", len(unbound),
                 len(unbound) + len(bound), layout.description,
                 _first_names(f"{n}: {why}" for n, why in unbound.items()))
    model_only = set(walked.parameter_names) - set(bound.values())
    return BoundModel(layout=layout, role=role, bound=bound, unbound=unbound, device=device,
                      description=layout.description, addresses=addresses, unbound_tensors=unbound_tensors,
                      model_only=model_only)


def check_in_place(model: torch.nn.Module, bound: BoundModel, through_load_weights: bool = False) -> None:
    """Raises weightstream.Error, before an update writes anything, when it could not land
    every byte in the model's own memory: parameters the layout does not hold (they load
    through load_weights), checkpoint tensors the last load sent through load_weights, or a
    bound parameter whose storage the model replaced since it was bound (vLLM's
    process_weights_after_loading does that where it transforms a weight). A reload from a
    checkpoint (``through_load_weights``) sends the first two through load_weights again."""
    problems: List[str] = []
    if bound.unbound and not through_load_weights:
        problems.append("parameters held otherwise by the model, loaded through its load_weights: " +
                        _first_names(f"{n} ({why})" for n, why in bound.unbound.items()))
    if bound.by_load_weights and not through_load_weights:
        problems.append("checkpoint tensors loaded through the model's load_weights: " +
                        _first_names(bound.by_load_weights))
    tensors = model_tensors(model).tensors
    replaced = []
    for layout_name, target in bound.bound.items():
        tensor = tensors.get(target)
        now = None if tensor is None else (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if now != bound.addresses.get(layout_name):
            replaced.append(target if tensor is None else
                            f"{target} (now {tensor.dtype} {list(tensor.shape)} at another address)")
    if replaced:
        problems.append("parameters the model replaced since they were bound (vLLM's "
                        "process_weights_after_loading transforms them): " + _first_names(replaced))
    if problems:
        raise _core.Error(f"cannot update {bound.description} in place: " + "; ".join(problems) +
                          "; nothing was written. Reload the model from a checkpoint instead")


def route_checkpoint(bound: BoundModel, checkpoint: Checkpoint) -> List[str]:
    """The checkpoint tensors that must go through the model's load_weights, in file order:
    those the layout has no parameter or ignore rule for (marked skipped in the layout, so
    that its load leaves them alone), and those that fill a parameter the model holds
    otherwise. Recorded in ``bound.by_load_weights``."""
    # The layout routes every tensor in one call; the few names the model holds otherwise
    # are looked at one by one.
    chosen = set(bound.layout.skip_unmatched(checkpoint._core, BY_LOAD_WEIGHTS))
    chosen.update(name for name in bound.unbound_tensors if name in checkpoint)  # also fills a kept parameter
    chosen.update(name for name in bound.model_only  # the other module's, and this model's too
                  if name in checkpoint and bound.layout.route(name)[0] == "skipped")
    core = checkpoint._core
    by_load_weights = sorted(chosen, key=core.find)
    bound.by_load_weights = by_load_weights
    return by_load_weights


def serving_peer(model: torch.nn.Module) -> Optional[Any]:
    """The PeerServer a load started for ``model`` (extra-config ``serve``), while it serves."""
    server = getattr(model, "_weightstream_server", None)
    return server if server is not None and server.serving else None


def stored_binding(model: torch.nn.Module) -> Optional[BoundModel]:
    """The binding a previous load made for ``model``, or None."""
    return getattr(model, "_weightstream_binding", None)


def store_binding(model: torch.nn.Module, bound: BoundModel) -> None:
    """Keeps the binding (and with it the layout) as long as the model lives."""
    object.__setattr__(model, "_weightstream_binding", bound)


class CheckpointAhead:
    """Opens, on a thread of its own, the source resolution tries first (model_weights, else
    model) while the loader binds the model: reading the index and shard headers of a MoE
    checkpoint (thousands of tensors) is C++ that runs without the GIL, binding is Python, so
    on two cores the two overlap. Resolution still decides: it takes this checkpoint when it
    chooses that source (one that holds a tensor the module wants) and opens what it chooses
    otherwise; a source that cannot be opened here gets its reason from resolution."""

    def __init__(self, sources: ModelSources, options: LoaderOptions) -> None:
        self.uri = sources.model_weights or sources.model
        self._stream = dict(options.stream)
        self._opened: Optional[Any] = None
        self._thread: Optional[threading.Thread] = None
        if self.uri:
            self._thread = threading.Thread(target=self._open, name="weightstream-open", daemon=True)
            self._thread.start()

    def _open(self) -> None:
        try:
            self._opened = _core.Checkpoint(self.uri, self._stream)
        except _core.Error:
            pass  # resolution probes the source again and names why it cannot be opened

    def result(self) -> Optional[Tuple[str, Any]]:
        """(uri, the compiled checkpoint), or None when nothing was opened."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return None if self._opened is None else (self.uri, self._opened)


def resolve_module_source(sources: ModelSources, role: str, layout: ModelLayout, options: LoaderOptions,
                          method: str = "", ahead: Optional[CheckpointAhead] = None) -> Dict[str, Any]:
    """Where a module's weights come from, as ``weightstream resolve`` decides: model_weights,
    then model, then the checkpoint URI (extra-config model_uri, else WEIGHTSTREAM_MODEL_URI
    or MX_MODEL_URI). The chosen source's checkpoint, opened once (by ``ahead`` when it
    opened that source, else by the resolution itself), is under "checkpoint". Raises
    weightstream.Error naming every source passed over."""
    resolution = _core.resolve_source(sources.model, sources.model_weights, role, layout, method, options.model_uri,
                                      options.stream, open_checkpoint=True,
                                      opened=ahead.result() if ahead is not None else None)
    resolution["checkpoint"] = Checkpoint._of(resolution["checkpoint"])
    return resolution


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


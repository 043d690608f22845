"""What every engine plugin (weightstream.vllm, weightstream.sglang) shares: weightstream's
options from ``--model-loader-extra-config``, an engine model's parameters bound to this
rank's ModelLayout (its own tensors, written in place, never a shadow copy), where a
module's weights are, and one load of the bound layout from a checkpoint or from peers.

The engine plugins say only what differs between engines: how their parameters are named,
where they keep their parallel ranks, and which of their modules hold stacked experts.
Imports torch, never an engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Set, Tuple, Union

import torch

from . import _core, metrics
from ._api import Checkpoint, resolve_options
from ._model import LoadSession, ModelLayout, model_layout, serve

#: weightstream's stream options, as weightstream.stream takes them.
STREAM_OPTIONS = ("concurrency", "memory_limit", "chunk_size", "io", "gpu_path", "mapped_share", "prefetchers")
#: Every key ``--model-loader-extra-config`` takes.
EXTRA_CONFIG_KEYS = STREAM_OPTIONS + ("model_uri", "peer_token", "peer_timeout", "peer_expect_digest", "serve",
                                      "metrics_listen", "link_rate")

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


def log_once(logger: logging.Logger, level: int, message: str, *args: Any) -> None:
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
    #: None: WEIGHTSTREAM_PEER_TOKEN (which keeps it off the engine's command line).
    peer_token: Optional[str] = None
    #: Seconds a peer's connect, message or read may go without progress.
    peer_timeout: float = 30.0
    #: The checkpoint content digest (16 hex digits, as ``weightstream digest --hash xxh64``
    #: prints it) every peer of a peer:// model_uri must serve; None: any one content that
    #: all the peers agree on. A peer serving another or unknown (updated) content is
    #: refused before a byte lands, and the model's own sources are loaded instead.
    peer_expect_digest: Optional[str] = None
    #: "HOST:PORT": after its load each rank serves its bound parameters to pullers
    #: (peer://) at HOST, port PORT + its rank in the engine's world (PORT 0: a free port each).
    serve: str = ""
    #: "HOST:PORT" (or "PORT", on loopback): each rank serves Prometheus metrics of its loads
    #: (docs/METRICS.md) at HOST, port PORT + its rank in the engine's world (PORT 0: a free port each).
    metrics_listen: str = ""
    #: GB/s the rank's link (NIC, disk, bucket) is stated to carry: the metrics show the loads'
    #: achieved rate against it (weightstream_load_link_efficiency).
    link_rate: Optional[float] = None

    @classmethod
    def from_extra_config(cls, extra_config: Optional[Mapping[str, Any]]) -> "LoaderOptions":
        """Checks the keys and values at once, so a typo fails when the engine starts, not
        mid-load. Raises ValueError naming an unknown key and the accepted ones,
        weightstream.Error for a malformed value."""
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
        metrics_listen = str(extra.get("metrics_listen") or "")
        if metrics_listen:
            metrics.listen_address(metrics_listen, "--model-loader-extra-config: metrics_listen")
        link_rate = extra.get("link_rate")
        if link_rate is not None:
            if isinstance(link_rate, bool) or not isinstance(link_rate, (int, float)) or not 0 < link_rate < math.inf:
                raise ValueError(f"--model-loader-extra-config: link_rate must be GB/s above 0, got {link_rate!r}")
            if not metrics_listen:
                raise ValueError("--model-loader-extra-config: link_rate is shown in the metrics: it needs "
                                 "metrics_listen")
        return cls(stream=stream, model_uri=model_uri, peer_token=peer_token, peer_timeout=float(peer_timeout),
                   peer_expect_digest=peer_expect_digest, serve=serve, metrics_listen=metrics_listen,
                   link_rate=None if link_rate is None else float(link_rate))


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


def safetensors_dtype(dtype: torch.dtype) -> Optional[str]:
    """The safetensors name of a torch dtype an engine builds parameters in, or None."""
    return _TORCH_DTYPES.get(dtype)


def device_name(tensor: torch.Tensor) -> str:
    """"cpu" or "cuda:N", as weightstream names devices."""
    if tensor.device.type == "cuda":
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return "cpu"


def first_names(names: Iterable[str], count: int = 5) -> str:
    """The first ``count`` names, and how many there are in all when more."""
    names = list(names)
    shown = ", ".join(names[:count])
    return shown + (f", ... ({len(names)} in all)" if len(names) > count else "")


class NoMappingTable(Exception):
    """The model's architecture has no weightstream table: it loads through load_weights."""


@dataclass
class Parallel:
    """Where this process sits: the engine's tensor-parallel rank, and its expert-parallel
    rank when the model's MoE layers divide their experts."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0


@dataclass
class BoundModel:
    """An engine model's parameters bound to this rank's layout."""

    layout: ModelLayout
    role: str
    #: Layout parameter name to the model's parameter name, for every bound parameter.
    bound: Dict[str, str]
    #: Parameters of the layout the model holds otherwise (name: why): removed from the
    #: layout (never allocated), filled through the model's load_weights.
    unbound: Dict[str, str]
    device: str
    description: str
    #: The engine's name in messages ("vLLM", "SGLang").
    engine: str
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
    """An engine model's tensors, from one walk of its modules."""

    #: Every parameter, then every buffer, by name (the first name of a tensor reached twice
    #: comes first), as named_parameters(remove_duplicate=False) and named_buffers name them.
    tensors: Dict[str, torch.Tensor]
    #: The parameters as named_parameters() names them: each tensor once, at its first name.
    parameter_names: List[str]
    #: The modules ``is_experts`` picked (the stacked experts of each MoE layer), in module order.
    experts: List[torch.nn.Module]


def model_tensors(model: torch.nn.Module,
                  is_experts: Optional[Callable[[torch.nn.Module], bool]] = None) -> ModelTensors:
    """Walks ``model``'s modules once (torch's named_parameters, named_buffers and modules
    would walk them three times, which costs milliseconds on a MoE model of thousands of
    modules); ``is_experts`` picks the engine's fused-experts modules."""
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
        if is_experts is not None and is_experts(module) and all(module is not other for other in experts):
            experts.append(module)
    for name, buffer in buffers.items():
        parameters.setdefault(name, buffer)
    return ModelTensors(tensors=parameters, parameter_names=parameter_names, experts=experts)


#: An engine's names for a layout parameter, the likeliest first: (layout name, role) -> names.
Candidates = Callable[[str, str], List[str]]


def parameter_dtype(tensors: Mapping[str, torch.Tensor], role: str, candidates: Candidates,
                    fallback: torch.dtype) -> torch.dtype:
    """The dtype the engine built the model's unquantized parameters in, read from its
    embedding (CPU platforms build float32 where bfloat16 was asked for); ``fallback`` when
    the model has none."""
    for layout_name in ("model.embed_tokens.weight", "lm_head.weight"):
        for name in candidates(layout_name, role):
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


def _held_wider(tensor: Optional[torch.Tensor], dtype: str, shape: Tuple[int, ...]) -> bool:
    """Whether the model holds in F32, contiguous, a parameter the layout has in BF16 or F16."""
    return tensor is not None and tensor.dtype == torch.float32 and dtype in ("BF16", "F16") and \
        tuple(tensor.shape) == tuple(shape) and tensor.is_contiguous()


def bind_layout(walked: ModelTensors, config: Dict[str, Any], role: str, dtype: torch.dtype, parallel: Parallel,
                candidates: Candidates, engine: str, logger: logging.Logger,
                from_target: Iterable[str] = (), wider_floats: bool = False) -> BoundModel:
    """Builds this rank's layout of ``config`` (the target without MTP layers, or the draft's
    MTP layers) in the dtype of the model's own parameters, and binds every layout parameter
    to the model's parameter or buffer of the same name (``candidates``: the engine's names),
    dtype and shape, in one call. A layout parameter the model holds otherwise is removed from
    the layout, never allocated: the checkpoint tensors that fill it go through the model's
    load_weights. ``from_target``: the draft model's parameters its engine gives the target's
    tensors after the load (SGLang's NextN draft takes the target's embedding and lm_head):
    the layout parameters they would bind are removed, their checkpoint tensors read by no
    one, and nothing loads them. ``wider_floats``: a parameter the model holds in F32 where the
    layout's is BF16 or F16 (SGLang keeps GLM-4.5's MoE router so) is held in F32 by the
    layout too (ModelLayout.hold_as), its checkpoint values widened as they are written.
    Raises NoMappingTable for an architecture, quantization or dtype weightstream has no table
    for, and weightstream.Error when nothing binds, saying why for the first parameters."""
    model_type = str(config.get("model_type", ""))
    tensors = walked.tensors
    dtype = parameter_dtype(tensors, role, candidates, dtype)
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
    from_target = set(from_target)
    for layout_name, layout_dtype, shape in layout.parameters:
        names = candidates(layout_name, role)
        target = next((candidate for candidate in names if candidate in tensors), names[0])
        if target in from_target:
            layout.remove_parameter(layout_name, f"the target's: the {engine} draft's {target} is its target's")
            continue
        tensor = tensors.get(target)
        why = _mismatch(target, tensor, layout_dtype, shape)
        if why is not None and wider_floats and _held_wider(tensor, layout_dtype, shape):
            try:
                layout.hold_as(layout_name, "F32")
                why = None
            except _core.Error as error:  # an FP8 block-scaled weight or its scales: held otherwise
                why = f"{why} ({error})"
        if why is None:
            matched[layout_name] = (target, tensor)
        else:
            unbound[layout_name] = why
    if not matched:
        raise _core.Error(
            f"no parameter of the {engine} model matches {layout.description}: "
            f"{first_names(f'{n}: {why}' for n, why in unbound.items())}; the model has "
            f"{first_names(f'{n} {t.dtype} {list(t.shape)}' for n, t in tensors.items())}")
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
        log_once(logger, logging.WARNING, "weightstream: %d of %d parameters of %s are held otherwise by the %s "
                 "model; they load through its load_weights, the rest in place: %s", len(unbound),
                 len(unbound) + len(bound), layout.description, engine,
                 first_names(f"{n}: {why}" for n, why in unbound.items()))
    model_only = set(walked.parameter_names) - set(bound.values()) - from_target
    return BoundModel(layout=layout, role=role, bound=bound, unbound=unbound, device=device,
                      description=layout.description, engine=engine, addresses=addresses,
                      unbound_tensors=unbound_tensors, model_only=model_only)


def check_in_place(model: torch.nn.Module, bound: BoundModel, through_load_weights: bool = False) -> None:
    """Raises weightstream.Error, before an update writes anything, when it could not land
    every byte in the model's own memory: parameters the layout does not hold (they load
    through load_weights), checkpoint tensors the last load sent through load_weights, or a
    bound parameter whose storage the model replaced since it was bound (an engine's
    process_weights_after_loading does that where it transforms a weight). A reload from a
    checkpoint (``through_load_weights``) sends the first two through load_weights again."""
    problems: List[str] = []
    if bound.unbound and not through_load_weights:
        problems.append("parameters held otherwise by the model, loaded through its load_weights: " +
                        first_names(f"{n} ({why})" for n, why in bound.unbound.items()))
    if bound.by_load_weights and not through_load_weights:
        problems.append("checkpoint tensors loaded through the model's load_weights: " +
                        first_names(bound.by_load_weights))
    tensors = model_tensors(model).tensors
    replaced = []
    for layout_name, target in bound.bound.items():
        tensor = tensors.get(target)
        now = None if tensor is None else (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
        if now != bound.addresses.get(layout_name):
            replaced.append(target if tensor is None else
                            f"{target} (now {tensor.dtype} {list(tensor.shape)} at another address)")
    if replaced:
        problems.append(f"parameters the model replaced since they were bound ({bound.engine}'s "
                        "process_weights_after_loading transforms them): " + first_names(replaced))
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
    """Opens, on a thread of its own, the source resolution tries first while the loader
    binds the model: reading the index and shard headers of a MoE checkpoint (thousands of
    tensors) is C++ that runs without the GIL, binding is Python, so on two cores the two
    overlap. Resolution still decides: it takes this checkpoint when it chooses that source
    (one that holds a tensor the module wants) and opens what it chooses otherwise; a source
    that cannot be opened here gets its reason from resolution."""

    def __init__(self, uri: str, options: LoaderOptions) -> None:
        self.uri = uri
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


def resolve_module_source(model: str, model_weights: str, role: str, layout: ModelLayout, options: LoaderOptions,
                          method: str = "", ahead: Optional[CheckpointAhead] = None) -> Dict[str, Any]:
    """Where a module's weights come from, as ``weightstream resolve`` decides: model_weights,
    then model, then the checkpoint URI (extra-config model_uri, else WEIGHTSTREAM_MODEL_URI
    or MX_MODEL_URI). The chosen source's checkpoint, opened once (by ``ahead`` when it
    opened that source, else by the resolution itself), is under "checkpoint". Raises
    weightstream.Error naming every source passed over."""
    resolution = _core.resolve_source(model, model_weights, role, layout, method, options.model_uri,
                                      options.stream, open_checkpoint=True,
                                      opened=ahead.result() if ahead is not None else None)
    resolution["checkpoint"] = Checkpoint._of(resolution["checkpoint"])
    return resolution


def first_weights_source(model: str, model_weights: str, options: LoaderOptions) -> str:
    """For a model without a layout: the first of model_weights, model and the checkpoint URI
    that holds safetensors files. Raises FileNotFoundError naming each."""
    tried: List[str] = []
    model_uri, uri_field = _core.checkpoint_uri(options.model_uri)
    for label, place in (("model_weights", model_weights), ("model", model), (uri_field, model_uri)):
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


def load_layout(model: torch.nn.Module, bound: BoundModel, resolution: Dict[str, Any], mode: str, started: float,
                logger: logging.Logger) -> Tuple[Dict[str, Any], Optional[Set[str]]]:
    """One load of the bound layout from the resolved checkpoint: this rank's byte ranges
    streamed into the model's own parameters, and the checkpoint tensors the layout leaves to
    the model through its load_weights. Returns (what the load did, the model's parameters it
    filled: None when load_weights reports nothing)."""
    checkpoint = resolution["checkpoint"]
    by_load_weights = route_checkpoint(bound, checkpoint)
    session = LoadSession(bound.layout)
    session.begin(mode)
    stats = session.load_checkpoint(checkpoint)
    session.finish()
    loaded: Optional[Set[str]] = set(bound.filled_model_names)
    through_model = 0
    if by_load_weights:
        from_model = model.load_weights(checkpoint.stream(framework="torch", names=by_load_weights))
        through_model = len(by_load_weights)
        loaded = None if from_model is None else loaded | set(from_model)
    last_load = {"path": "layout", "mode": mode, "role": bound.role, "source": resolution["uri"],
                 "field": resolution["field"], "passed_over": resolution["passed_over"],
                 "layout": bound.description, "tensors_streamed": stats["tensors"],
                 "bytes_streamed": stats["bytes"], "bytes_read": stats["bytes_read"],
                 "shards_read": stats["shards_read"], "parameters_bound": len(bound.bound),
                 "parameters_through_load_weights": len(bound.unbound),
                 "tensors_through_load_weights": through_model,
                 "seconds": time.perf_counter() - started, "stream": stats}
    through = ("nothing through load_weights" if not by_load_weights else
               f"{through_model} checkpoint tensors through load_weights ({first_names(by_load_weights)})")
    logger.info("weightstream: %s load of the %s (%s) from %s (%s): %d parameters bound in place, %d tensors, "
                "%d bytes streamed into them (%d read), %s, %.2f s", mode, bound.role, bound.description,
                resolution["uri"], resolution["field"], len(bound.bound), stats["tensors"], stats["bytes"],
                stats["bytes_read"], through, last_load["seconds"])
    return last_load, loaded


def pull_layout(bound: BoundModel, uri: str, options: LoaderOptions, mode: str, started: float,
                logger: logging.Logger) -> Dict[str, Any]:
    """Pulls the bound layout from the serving peers of ``uri``, straight into the model's
    parameters where the layouts agree; returns what the load did. Raises weightstream.Error
    when the model holds some of the layout's parameters otherwise, or the pull fails."""
    if bound.unbound:
        raise _core.Error(f"cannot pull {bound.description} from {uri}: the {bound.engine} model holds "
                          f"{len(bound.unbound)} of its parameters otherwise, and those load through its "
                          f"load_weights from a checkpoint: {first_names(bound.unbound)}")
    session = LoadSession(bound.layout)
    session.begin(mode)
    report = session.load_checkpoint(uri, token=options.peer_token, timeout=options.peer_timeout,
                                     memory_limit=resolve_options(**options.stream)["memory_limit"],
                                     expect_digest=options.peer_expect_digest)
    session.finish()
    bound.by_load_weights = []
    last_load = {"path": "layout", "mode": mode, "role": bound.role, "source": uri, "field": "model_uri",
                 "passed_over": [], "layout": bound.description, "tensors_streamed": report["tensors"],
                 "bytes_streamed": report["bytes_from_peers"], "bytes_read": 0,
                 "bytes_from_peers": report["bytes_from_peers"], "bytes_in_place": report["bytes_in_place"],
                 "shards_read": 0, "parameters_bound": len(bound.bound), "parameters_through_load_weights": 0,
                 "tensors_through_load_weights": 0, "seconds": time.perf_counter() - started,
                 "peers": report["peers"], "digest_failures": report["digest_failures"]}
    logger.info("weightstream: %s load of the %s (%s) from %s: %d parameters bound in place, %d bytes from peers "
                "(%d in place, 0 read from storage), nothing through load_weights, %.2f s", mode, bound.role,
                bound.description, uri, len(bound.bound), report["bytes_from_peers"], report["bytes_in_place"],
                last_load["seconds"])
    return last_load


#: What a load of the layout from storage does: (options, the peers' failure or "") ->
#: (the checkpoint loaded, what the load did).
StorageLoad = Callable[[LoaderOptions, str], Tuple[Checkpoint, Dict[str, Any]]]


def load_from_peers_or_storage(bound: BoundModel, mode: str, started: float, options: LoaderOptions,
                               load_storage: StorageLoad,
                               logger: logging.Logger) -> Tuple[Union[str, Checkpoint], Dict[str, Any]]:
    """Peers first when model_uri is a peer:// URI (the target only: peers serve targets),
    then the model's own sources through ``load_storage``; returns what the layout was loaded
    from (a peer:// URI or the checkpoint, for its server) and what the load did. Raises
    weightstream.Error naming both failures when neither serves."""
    uri = options.model_uri
    if not uri.startswith("peer://"):
        return load_storage(options, "")
    storage = dataclasses.replace(options, model_uri="")
    if bound.role != "target":
        return load_storage(storage, "")
    try:
        return uri, pull_layout(bound, uri, options, mode, started, logger)
    except _core.Error as error:
        failure = str(error)
    logger.warning("weightstream: cannot load %s from %s (%s); loading it from the model's own sources",
                   bound.description, uri, failure)
    try:
        return load_storage(storage, failure)
    except (_core.Error, FileNotFoundError) as error:
        raise _core.Error(f"cannot load {bound.description} from any source: {uri}: {failure}; "
                          f"the model's own sources: {error}") from error


def metrics_endpoint(metrics_listen: str, rank: int, logger: logging.Logger) -> Optional[metrics.Metrics]:
    """This rank's Prometheus endpoint for the extra-config key ``metrics_listen``, at PORT +
    ``rank`` (started by the first call, which logs its address); None without the key."""
    if not metrics_listen:
        return None
    host, port = metrics.listen_address(metrics_listen)
    endpoint = metrics.serve_once(serve_address(f"{host}:{port}", rank))
    log_once(logger, logging.INFO, "weightstream: metrics at http://%s/metrics", endpoint.address)
    return endpoint


def record_load_metrics(model: torch.nn.Module, options: LoaderOptions, last_load: Mapping[str, Any], rank: int,
                        logger: logging.Logger) -> None:
    """Records a load of ``model`` in this rank's Prometheus metrics (metrics_endpoint), where
    the updates it receives are recorded too (model_metrics); nothing without ``metrics_listen``."""
    endpoint = metrics_endpoint(options.metrics_listen, rank, logger)
    if endpoint is not None:
        endpoint.record_load(last_load, options.link_rate)
    object.__setattr__(model, "_weightstream_metrics", endpoint)


def model_metrics(model: torch.nn.Module) -> Optional[metrics.Metrics]:
    """The Prometheus endpoint the model's loads are recorded in (the updates it receives go
    there too); None when its loader had no ``metrics_listen``."""
    return getattr(model, "_weightstream_metrics", None)


@contextlib.contextmanager
def pulls_refused(model: torch.nn.Module) -> Iterator[None]:
    """While a served model reloads or updates: pullers that overlap are refused, and the
    server rehashes (a new version) at the end."""
    server = serving_peer(model)
    if server is not None:
        server.begin_update()
    try:
        yield
    finally:
        if server is not None:
            server.end_update()


def serve_model(model: torch.nn.Module, bound: BoundModel, source: Union[str, Checkpoint], options: LoaderOptions,
                rank: int, logger: logging.Logger) -> str:
    """Serves the bound layout (extra-config ``serve``, at PORT + ``rank``) while the model
    lives: the server closes when the model is collected or at the interpreter's exit,
    whichever is first. Returns the address it serves at."""
    address = serve_address(options.serve, rank)
    # A layout pulled from peers serves what they serve: the same digest is pinned again.
    pinned = options.peer_expect_digest if isinstance(source, str) else None
    server = serve(bound.layout, source, listen=address, token=options.peer_token, timeout=options.peer_timeout,
                   expect_digest=pinned)
    object.__setattr__(model, "_weightstream_server", server)
    weakref.finalize(model, server.close)
    logger.info("weightstream: serving %s at peer://%s", bound.description, server.address)
    return server.address

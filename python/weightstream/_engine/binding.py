"""An engine model's parameters bound to this rank's ModelLayout: its own tensors, written in
place, never a shadow copy; what the layout leaves to the model's load_weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

import torch

from .. import _core
from .._api import Checkpoint
from .._model import ModelLayout, model_layout
from .naming import _TORCH_DTYPES, device_name, first_names, safetensors_dtype
from .options import log_once


#: The reason given to the layout for a checkpoint tensor it leaves to the model.
BY_LOAD_WEIGHTS = "loaded by the model's load_weights"


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


def stored_binding(model: torch.nn.Module) -> Optional[BoundModel]:
    """The binding a previous load made for ``model``, or None."""
    return getattr(model, "_weightstream_binding", None)


def store_binding(model: torch.nn.Module, bound: BoundModel) -> None:
    """Keeps the binding (and with it the layout) as long as the model lives."""
    object.__setattr__(model, "_weightstream_binding", bound)

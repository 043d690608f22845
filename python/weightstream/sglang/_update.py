"""Pushed updates into a running SGLang through its own update API.

SGLang's ``update_weights_from_tensor(named_tensors, load_format=<a dotted path listed in
--custom-weight-loader>)`` hands ``named_tensors`` to that function on every rank, between
its ``begin_weight_update()`` and ``end_weight_update()``. weightstream's custom weight
loader, :func:`receive_update`, takes one small tensor there, the request
:func:`update_request` makes (the transport, one listen address per tensor-parallel rank,
the token), opens a weightstream.UpdateReceiver on the rank's bound layout at its address
and receives the update the trainer's UpdateSender pushes: every byte lands in the model's
own parameters, in place, or the update is refused before its first byte.

The trainer side, :func:`push_update`, makes the request, calls the engine's update on a
thread of its own and pushes the tensors to every rank's receiver.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _core
from .._engine import check_in_place, model_metrics, store_binding, stored_binding
from .._push import check_transport, free_addresses, host_copies, make_senders, send_deltas, send_update
from .._receiver import UpdateReceiver
from . import UPDATE_LOADER, logger

#: The name of the one tensor update_request makes: the request, as UTF-8 JSON bytes.
REQUEST_NAME = "weightstream.update_request"

#: Every key of a request, and the defaults of those that have one ("draft_addresses": none,
#: an update of the target only).
_REQUEST_DEFAULTS: Dict[str, Any] = {"transport": "shm", "token": "", "timeout": 30.0, "accept_timeout": 600.0,
                                     "draft_addresses": None}


def update_request(addresses: Sequence[str], transport: str = "shm", token: str = "", timeout: float = 30.0,
                   accept_timeout: float = 600.0,
                   draft_addresses: Optional[Sequence[str]] = None) -> List[Tuple[str, torch.Tensor]]:
    """The ``named_tensors`` to give SGLang's ``update_weights_from_tensor`` with
    ``load_format=weightstream.sglang.UPDATE_LOADER``: one listen address per
    tensor-parallel rank (a Unix socket path for shm and cuda-ipc, "HOST:PORT" for tcp, nccl
    and ucx), the transport, the token the trainer's sender proves, the seconds a message may take and
    the seconds a rank waits for the trainer. ``draft_addresses``: one per rank for the
    speculative draft's receivers (SGLang calls the custom weight loader for the target, then
    for the draft, with the same request); None for an engine without a draft, or an update
    of the target only (selector "target")."""
    check_transport(transport)
    request = {"addresses": list(addresses), "transport": transport, "token": token, "timeout": float(timeout),
               "accept_timeout": float(accept_timeout),
               "draft_addresses": list(draft_addresses) if draft_addresses is not None else None}
    data = torch.frombuffer(bytearray(json.dumps(request).encode()), dtype=torch.uint8)
    return [(REQUEST_NAME, data)]


def _parse_request(named_tensors: Any) -> Dict[str, Any]:
    """The request update_request made, or ValueError saying what was given instead."""
    items = list(named_tensors or [])
    names = [item[0] for item in items if isinstance(item, (tuple, list)) and item]
    if len(items) != 1 or names != [REQUEST_NAME]:
        raise ValueError(f"{UPDATE_LOADER} takes the one tensor weightstream.sglang.update_request makes "
                         f"({REQUEST_NAME}); got {len(items)} tensors: {', '.join(map(str, names[:5])) or 'none'}")
    tensor = items[0][1]
    try:
        request = json.loads(bytes(tensor.detach().to("cpu", torch.uint8).numpy()).decode())
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{UPDATE_LOADER}: {REQUEST_NAME} is not a request update_request made: {error}") from None
    unknown = sorted(set(request) - set(_REQUEST_DEFAULTS) - {"addresses"})
    draft = request.get("draft_addresses")
    if unknown or not isinstance(request.get("addresses"), list) or not (draft is None or isinstance(draft, list)):
        raise ValueError(f"{UPDATE_LOADER}: {REQUEST_NAME} is not a request update_request made (keys "
                         f"{', '.join(sorted(request))})")
    check_transport(request.get("transport", "shm"))
    return {**_REQUEST_DEFAULTS, **request}


def _binding(model: torch.nn.Module) -> Any:
    """The binding of the weightstream load, or a new one for a model SGLang loaded otherwise
    (a draft when the model is SGLang's draft module)."""
    bound = stored_binding(model)
    if bound is not None:
        return bound
    from sglang.srt.runtime_context import get_model  # noqa: PLC0415

    from ._loader import NoMappingTable, bind_model, is_draft_module  # noqa: PLC0415

    try:
        # The dtype is read from the model's own embedding; bfloat16 only when it has none.
        bound = bind_model(model, model.config.to_dict(), getattr(get_model(), "quantization", None), torch.bfloat16,
                           "draft" if is_draft_module(model) else "target")
    except NoMappingTable as reason:
        raise _core.Error(f"weightstream updates need a model weightstream has a layout for "
                          f"({_core.supported_model_types()}); {type(model).__name__} has none ({reason})") from None
    store_binding(model, bound)
    return bound


def receive_update(model: torch.nn.Module, named_tensors: Any) -> Dict[str, Any]:
    """Receives one pushed update into ``model``'s bound parameters on this rank; returns the
    receiver's report (also kept as ``model._weightstream_last_update``). Raises
    weightstream.Error, the trainer told why before its first byte, when the update could not
    land every byte in place (a parameter the model holds otherwise or replaced, an unknown
    tensor, a wrong shape); nothing is then written."""
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank  # noqa: PLC0415

    request = _parse_request(named_tensors)
    rank = get_tensor_model_parallel_rank()
    bound = _binding(model)
    addresses = request["draft_addresses"] if bound.role == "draft" else request["addresses"]
    if addresses is None:
        raise ValueError(f"{UPDATE_LOADER}: SGLang hands the update to the speculative draft "
                         f"({type(model).__name__}) too, and the request names no receivers for it: push the "
                         f"draft's tensors with push_update(draft_tensors=...), or begin the update with "
                         f"selector 'target'")
    if len(addresses) <= rank:
        raise ValueError(f"{UPDATE_LOADER}: {len(addresses)} addresses for the {bound.role}'s tensor-parallel rank "
                         f"{rank} (one for each rank)")
    receiver = UpdateReceiver(bound.layout, request["transport"], addresses[rank], request["token"],
                              request["timeout"], bound.device, metrics=model_metrics(model))
    try:
        check_in_place(model, bound)
    except _core.Error as unfit:
        try:
            receiver.refuse(str(unfit), accept_timeout=request["accept_timeout"])  # the trainer's start() raises it
        except _core.Error:
            pass  # refuse() always raises; the engine's own reason is the one to report
        raise unfit
    # The version the model holds (what the last update named), for a delta's check at START:
    # a receiver lives for one update, the model for all of them.
    receiver.version = getattr(model, "_weightstream_version", "")
    try:
        report = receiver.receive(accept_timeout=request["accept_timeout"])
    finally:
        object.__setattr__(model, "_weightstream_version", receiver.version)
    # What the model's load_weights would run at its end (DeepSeek's w_kc and w_vc from
    # kv_b_proj); SGLang's end_weight_update leaves it to the load.
    from sglang.srt.model_loader.loader import post_load_weights  # noqa: PLC0415

    post_load_weights(model)
    object.__setattr__(model, "_weightstream_last_update", report)
    logger.info("weightstream: rank %d received an update of %s over %s: %d tensors, %d bytes, in place", rank,
                bound.description, request["transport"], report.get("tensors", 0), report.get("bytes", 0))
    return report


def _connect(addresses: List[str], transport: str, token: str, device: str, bucket_bytes: Optional[int],
             timeout: float, engine: threading.Thread, deadline: float, one_each: bool = False) -> Optional[List[Any]]:
    """The senders of ``addresses``, once every rank's receiver listens: the engine opens
    them when its update call reaches the custom weight loader. None when the engine's call
    returned first (its failure is the one to report); the last connect error at ``deadline``."""
    while True:
        try:
            return make_senders(addresses, transport, token, device, bucket_bytes, timeout, one_each=one_each)
        except _core.Error as error:
            if "cannot connect" not in str(error) or time.monotonic() > deadline:
                raise
            if not engine.is_alive():
                return None
        time.sleep(0.05)


def push_update(update_weights_from_tensor: Callable[..., Any], tensors: Sequence[Tuple[str, torch.Tensor]], *,
                tp_size: int = 1, transport: str = "shm", token: str, addresses: Optional[Sequence[str]] = None,
                ranks: Optional[Sequence[int]] = None, format: str = "checkpoint", device: str = "cpu",
                bucket_bytes: Optional[int] = None, timeout: float = 30.0,
                accept_timeout: float = 600.0, target: str = "", base: str = "",
                base_tensors: Optional[Dict[str, torch.Tensor]] = None,
                draft_tensors: Optional[Sequence[Tuple[str, torch.Tensor]]] = None,
                draft_addresses: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """One update of ``tensors`` into a running SGLang: ``update_weights_from_tensor`` is
    called (on a thread of its own) as SGLang's Engine takes it, with ``named_tensors`` the
    request and ``load_format`` UPDATE_LOADER; the tensors are pushed to every rank's
    receiver meanwhile. Call it between the engine's ``begin_weight_update()`` and
    ``end_weight_update()``. ``addresses``: one per tensor-parallel rank (fresh ones when
    None); ``ranks``: the ranks this trainer pushes to (all when None; a trainer process
    beside each rank pushes to its own). ``device``: the senders' (as the vLLM backend's
    trainer takes it): where their bucket buffers lie, for cuda-ipc the GPU the trainer's
    tensors are on ("cpu" there means cuda:0); tensors on a GPU travel from there over any
    transport.

    An engine with a speculative draft (``--speculative-algorithm NEXTN`` or EAGLE with an MTP
    draft) hands the same request to the draft's runner after the target's: ``draft_tensors``
    are pushed to the draft's receivers then (``draft_addresses``, one per rank; fresh ones
    when None), the MTP layer's checkpoint tensors (DeepSeek-V3's model.layers.{N}.*, N its
    num_hidden_layers). Without them a draft refuses the update, naming why.

    Returns {"engine": what the engine's call returned, "senders": each sender's report,
    "draft_senders": the draft's}. Raises the first failure of either side: a refused
    update raises weightstream.Error with the engine's reason; an engine call that fails before
    its receivers listen raises its own error, or weightstream.Error with the message of the
    (False, message) SGLang answered.

    ``target`` names the version the ranks hold after the update (docs/DELTA.md). With
    ``base`` (the version they hold now) and ``base_tensors`` (its host tensors, by name), a
    delta update: only the elements that changed since then travel, each rank receiving only
    those it holds, through ``UpdateSender.update_changes`` (checkpoint format, host tensors;
    shm, tcp or ucx).
    A draft's tensors always travel whole."""
    if base and (base_tensors is None or format != "checkpoint"):
        raise ValueError("weightstream push_update: a delta (base=...) needs base_tensors, in checkpoint format")
    addresses = list(addresses) if addresses else free_addresses(transport, tp_size)
    if draft_tensors is not None:
        draft_addresses = list(draft_addresses) if draft_addresses else free_addresses(transport, tp_size)
    request = update_request(addresses, transport, token, timeout, accept_timeout,
                             draft_addresses if draft_tensors is not None else None)
    outcome: Dict[str, Any] = {}

    def engine_update() -> None:
        try:
            outcome["engine"] = update_weights_from_tensor(named_tensors=request, load_format=UPDATE_LOADER)
        except BaseException as error:  # noqa: BLE001 - raised on the calling thread
            outcome["failure"] = error

    engine = threading.Thread(target=engine_update, name="weightstream-sglang-update", daemon=True)
    engine.start()
    deadline = time.monotonic() + accept_timeout

    def push(to: List[str], listed: Sequence[Tuple[str, torch.Tensor]], delta: bool) -> Optional[List[Dict[str, Any]]]:
        pushed = [to[rank] for rank in ranks] if ranks is not None else to
        senders = _connect(pushed, transport, token, device, bucket_bytes, timeout, engine, deadline, one_each=delta)
        if senders is None:
            return None
        if delta:
            return send_deltas(senders, base_tensors, host_copies(list(listed)), base, target)
        listed = list(listed)  # references: the manifest is declared before the first byte
        return [send_update(sender, listed, format, target) for sender in senders]

    try:
        outcome["senders"] = push(addresses, tensors, delta=bool(base))
        if draft_tensors is not None and outcome["senders"] is not None:
            # SGLang's draft runner comes second; its tensors travel whole.
            outcome["draft_senders"] = push(draft_addresses, draft_tensors, delta=False)
    finally:
        engine.join(timeout=accept_timeout)
    if "failure" in outcome:
        raise outcome["failure"]
    answer = outcome.get("engine")
    if isinstance(answer, tuple) and len(answer) == 2 and answer[0] is False:
        # SGLang's Engine answers (success, message): a refused update is not a silent one.
        raise _core.Error(f"SGLang's update_weights_from_tensor failed: {answer[1]}")
    return outcome

"""The ``weightstream`` weight-transfer backend: vLLM's WeightTransferEngine on each
worker, receiving pushed updates with weightstream.UpdateReceiver straight into the
parameters the layout is bound to (in place: addresses never change), and the trainer's
TrainerWeightTransferEngine that pushes them with weightstream.UpdateSender.

One update, as vLLM drives it: the trainer calls ``start_weight_update`` on the engine, then
``update_weights`` (each worker's receive_weights blocks in UpdateReceiver.receive while the
trainer sends, on a thread of its own), then ``finish_weight_update``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .. import _core
from .._engine import model_metrics
from .._push import TRANSPORTS  # noqa: F401 - the vLLM plugin's name since before _push
from .._push import check_transport as _check_transport
from .._push import free_addresses  # noqa: F401 - the trainer's, as before _push
from .._push import make_senders as _make_senders
from .._push import send_update as _send
from .._receiver import UpdateReceiver
from ._model import (
    BOUND_QUANTIZATIONS,
    BoundModel,
    ModelSources,
    NoMappingTable,
    bind_model,
    check_in_place,
    config_dict,
    logger,
    parallel_ranks,
    serving_peer,
    store_binding,
    stored_binding,
)


@dataclass
class WeightstreamInitInfo(WeightTransferInitInfo):
    """What each worker needs to receive: the transport, one listen address per
    tensor-parallel rank ("HOST:PORT" for tcp and nccl, a Unix socket path for shm and
    cuda-ipc; the trainer picks them), the shared token and the per-message timeout."""

    addresses: List[str] = field(default_factory=list)
    transport: str = "tcp"
    token: str = ""
    timeout: float = 30.0


@dataclass
class WeightstreamUpdateInfo(WeightTransferUpdateInfo):
    """One update: how long a worker waits for the trainer to start sending."""

    accept_timeout: float = 600.0


class WeightstreamWeightTransferEngine(WeightTransferEngine):
    """Worker side: receives pushed updates into the model's bound parameters.

    The model's binding is the one its load made (``--load-format weightstream``); a model
    loaded otherwise is bound here, from its config.json. Updates are received in the
    trainer's chosen format ("checkpoint": Hugging Face names, mapped, sliced for this rank
    and fused as a load does; "engine": the layout's parameter names). Model hooks run once
    per update, at its end. process_weights_after_loading is not rerun: the parameters
    receive their final bytes in place.
    """

    init_info_cls = WeightstreamInitInfo
    update_info_cls = WeightstreamUpdateInfo
    # The trainer addresses one receiver per rank, the target's; a draft reloads from the
    # checkpoint (--load-format weightstream) instead.
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._receivers: Dict[int, Any] = {}  # id(model) -> UpdateReceiver
        self._init_info: Optional[WeightstreamInitInfo] = None
        self.last_report: Optional[Dict[str, Any]] = None

    def _binding(self, model: torch.nn.Module) -> BoundModel:
        bound = stored_binding(model)
        if bound is not None:
            return bound
        model_config = self.model_config
        load_config = getattr(self.vllm_config, "load_config", None)
        sources = ModelSources.of(model_config, load_config)
        try:
            quantization = getattr(model_config, "quantization", None)
            if quantization not in BOUND_QUANTIZATIONS:
                raise NoMappingTable(f"quantization '{quantization}'")
            bound = bind_model(model, config_dict(sources, model_config), "target", model_config.dtype)
        except NoMappingTable as reason:
            raise _core.Error(f"the weightstream weight-transfer backend needs a model weightstream has a layout "
                              f"for ({_core.supported_model_types()}); {type(model).__name__} has none "
                              f"({reason})") from None
        store_binding(model, bound)
        return bound

    def init_transfer_engine(self, init_info: WeightstreamInitInfo) -> None:
        _check_transport(init_info.transport)
        tp_size = parallel_ranks().tp_size
        if init_info.addresses and len(init_info.addresses) != tp_size:
            raise ValueError(f"weightstream weight transfer: {len(init_info.addresses)} addresses for {tp_size} "
                             f"tensor-parallel ranks (one each)")
        self._init_info = init_info
        self._receiver(self.model)

    def _receiver(self, model: torch.nn.Module) -> Any:
        receiver = self._receivers.get(id(model))
        if receiver is not None:
            return receiver
        if self._init_info is None:
            raise RuntimeError("weightstream weight transfer: init_transfer_engine was not called")
        info = self._init_info
        bound = self._binding(model)
        tp_rank = parallel_ranks().tp_rank
        listen = info.addresses[tp_rank] if info.addresses else ""
        receiver = UpdateReceiver(bound.layout, info.transport, listen, info.token, info.timeout, bound.device,
                                  metrics=model_metrics(model))
        self._receivers[id(model)] = receiver
        logger.info("weightstream: rank %d receives updates of %s over %s at %s", tp_rank, bound.description,
                    info.transport, receiver.address)
        return receiver

    @property
    def address(self) -> str:
        """The address this worker's receiver of the current target listens at."""
        return self._receiver(self.model).address

    def start_weight_update(self) -> None:
        # Bytes land in place in the bound parameters: no layerwise reload to set up.
        pass

    def receive_weights(self, update_info: WeightstreamUpdateInfo) -> None:
        receiver = self._receiver(self.model)
        # Every named byte lands in the model's own memory, or nothing does: refused here,
        # before the trainer's first bucket is accepted, and the trainer is told why.
        try:
            check_in_place(self.model, self._binding(self.model))
        except _core.Error as unfit:
            try:
                # Answers the trainer's update with this reason (its start() raises it).
                receiver.refuse(str(unfit), accept_timeout=update_info.accept_timeout)
            except _core.Error:
                pass  # refuse() always raises; the engine's own reason is the one to report
            raise unfit
        server = serving_peer(self.model)
        if server is not None:
            server.begin_update()  # a peer pull that overlaps the update is refused
        try:
            self.last_report = receiver.receive(accept_timeout=update_info.accept_timeout)
        finally:
            if server is not None:
                server.end_update()

    def finish_weight_update(self) -> None:
        # The receiver's session ran the model hooks once, at the end of the update.
        pass

    def shutdown(self) -> None:
        self._receivers.clear()

    @staticmethod
    def trainer_send_weights(iterator: Iterable[Tuple[str, torch.Tensor]], trainer_args: Any) -> None:
        """Sends one update from the trainer without the control plane: ``trainer_args`` is
        a dict with ``addresses`` (or ``address``), and optionally ``transport``, ``token``,
        ``format``, ``bucket_bytes``, ``device``."""
        args = dict(trainer_args or {})
        addresses = args.get("addresses") or [args["address"]]
        transport = args.get("transport", "tcp")
        _check_transport(transport)
        senders = _make_senders(addresses, transport, args.get("token", ""), args.get("device", "cpu"),
                                args.get("bucket_bytes"))
        tensors = list(iterator)  # references: the manifest is declared before the first byte
        for sender in senders:
            _send(sender, tensors, args.get("format", "checkpoint"))


def register_transfer_engines() -> None:
    """Registers the worker engine with vLLM's WeightTransferEngineFactory (and the trainer
    engine with its trainer factory where the release has one); harmless when done already."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: PLC0415

    from . import NAME  # noqa: PLC0415

    if NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(NAME, WeightstreamWeightTransferEngine)
    from . import _trainer  # noqa: PLC0415

    _trainer.register_trainer_engine()

"""The trainer's side of the ``weightstream`` weight-transfer backend: vLLM's
TrainerWeightTransferEngine, pushing the trainer's weights with weightstream.UpdateSender
to every worker's UpdateReceiver, driving the engine through vLLM's weight-sync client."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from ._transfer import _check_transport, _make_senders, _send, free_addresses


@dataclass
class WeightstreamTrainerInitInfo(TrainerInitInfo):
    """The trainer's choices: the transport, the engine's tensor-parallel size, the
    workers' listen addresses (free loopback ports or fresh Unix sockets when empty; give
    "HOST:PORT" of the engine's host for tcp or nccl across hosts), the shared token, the
    wire format ("checkpoint": Hugging Face names; "engine": the layout's parameter names)
    and the sender's options. ``rank`` (keyword-only, from vLLM's TrainerInitInfo) is this
    trainer process's rank: rank 0 sends, the others only iterate the source."""

    backend: ClassVar[str] = "weightstream"

    transport: str = "tcp"
    tp_size: int = 1
    addresses: List[str] = field(default_factory=list)
    token: str = ""
    format: str = "checkpoint"
    device: str = "cpu"
    bucket_bytes: Optional[int] = None
    timeout: float = 30.0
    accept_timeout: float = 600.0


class WeightstreamTrainerEngine(TrainerWeightTransferEngine):
    """Pushes ``source`` (vLLM's WeightSource, such as ModuleSource; a torch module; or a
    list of (name, tensor)) to the engine on every send_weights()."""

    init_info_cls = WeightstreamTrainerInitInfo

    def __init__(self, init_info: WeightstreamTrainerInitInfo, *, client: Any, source: Any = None) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        self.init_info = init_info
        self._senders: Optional[List[Any]] = None
        self.last_reports: List[Dict[str, Any]] = []

    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> "WeightstreamTrainerEngine":
        """Picks the workers' addresses when none were given and has every worker open its
        receiver there (``client.init_weight_transfer_engine``, on the sender only).
        ``init_info`` is a WeightstreamTrainerInitInfo or a dict of its fields (``rank``
        defaults to 0 there)."""
        if isinstance(init_info, dict):
            fields = dict(init_info)
            fields.setdefault("rank", 0)
            init_info = WeightstreamTrainerInitInfo(**fields)
        _check_transport(init_info.transport)
        if not init_info.addresses:
            init_info.addresses = free_addresses(init_info.transport, init_info.tp_size)
        engine = cls(init_info, client=client, source=source)
        if engine.is_sender:
            client.init_weight_transfer_engine({"addresses": list(init_info.addresses),
                                                "transport": init_info.transport, "token": init_info.token,
                                                "timeout": init_info.timeout})
        return engine

    def _tensors(self) -> List[Tuple[str, torch.Tensor]]:
        source = self.source
        if source is None:
            raise ValueError("weightstream trainer engine: no source to send (pass source= to trainer_init)")
        if isinstance(source, torch.nn.Module):
            return list(source.named_parameters())
        if hasattr(source, "iter_full"):
            return list(source.iter_full())  # vLLM's WeightSource: full tensors (FSDP gathers here)
        return list(iter(source))

    def send_weights(self) -> None:
        """One update: start_weight_update, then update_weights on a thread of its own (each
        worker blocks receiving) while the senders push every tensor, then
        finish_weight_update. Every rank iterates the source; only rank 0 sends. Raises the
        first failure of either side."""
        tensors = self._tensors()
        if not self.is_sender:
            return
        info = self.init_info
        self.client.start_weight_update()
        failure: List[BaseException] = []

        def update() -> None:
            try:
                self.client.update_weights({"accept_timeout": info.accept_timeout})
            except BaseException as error:  # noqa: BLE001 - re-raised on the calling thread
                failure.append(error)

        thread = threading.Thread(target=update, name="weightstream-update-weights", daemon=True)
        thread.start()
        try:
            if self._senders is None:
                self._senders = _make_senders(info.addresses, info.transport, info.token, info.device,
                                              info.bucket_bytes)
            self.last_reports = [_send(sender, tensors, info.format) for sender in self._senders]
        except BaseException:
            self._senders = None  # a failed sender is unusable; the next update connects anew
            thread.join(timeout=info.timeout)
            raise
        thread.join()
        if failure:
            raise failure[0]
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self._senders = None


def register_trainer_engine() -> None:
    """Registers the trainer engine where vLLM has a trainer factory."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: PLC0415
    except ImportError:
        return
    from . import NAME  # noqa: PLC0415

    if NAME not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(NAME, WeightstreamTrainerEngine)

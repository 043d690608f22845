"""The trainer's side of the ``weightstream`` weight-transfer backend: vLLM's
TrainerWeightTransferEngine, pushing the trainer's weights with weightstream.UpdateSender
to every worker's UpdateReceiver, driving the engine through vLLM's weight-sync client."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from .._push import host_copies, send_deltas
from ._transfer import _check_transport, _make_senders, _send, free_addresses


@dataclass
class WeightstreamTrainerInitInfo(TrainerInitInfo):
    """The trainer's choices: the transport, the engine's tensor-parallel size, the
    workers' listen addresses (free loopback ports or fresh Unix sockets when empty; give
    "HOST:PORT" of the engine's host for tcp or nccl across hosts), the shared token, the
    wire format ("checkpoint": Hugging Face names; "engine": the layout's parameter names)
    and the sender's options. ``rank`` (keyword-only, from vLLM's TrainerInitInfo) is this
    trainer process's rank: rank 0 sends, the others only iterate the source. ``delta``: each
    update after the first sends only the elements that changed since the one before it, each
    rank only those it holds (docs/DELTA.md; checkpoint format, host transports; the trainer
    keeps a host copy of what it last sent)."""

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
    delta: bool = False


class WeightstreamTrainerEngine(TrainerWeightTransferEngine):
    """Pushes ``source`` (vLLM's WeightSource, such as ModuleSource; a torch module; or a
    list of (name, tensor)) to the engine on every send_weights()."""

    init_info_cls = WeightstreamTrainerInitInfo

    def __init__(self, init_info: WeightstreamTrainerInitInfo, *, client: Any, source: Any = None) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)
        self.init_info = init_info
        self._senders: Optional[List[Any]] = None
        self.last_reports: List[Dict[str, Any]] = []
        # delta=True: host copies of the last update sent, and the version it left the workers at.
        self._base: Optional[Dict[str, torch.Tensor]] = None
        self.version = ""

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
        if init_info.delta and (init_info.format != "checkpoint" or init_info.transport not in ("shm", "tcp")):
            raise ValueError(f"weightstream trainer engine: a delta update travels in checkpoint format over shm or "
                             f"tcp, not {init_info.format} format over {init_info.transport}")
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

    def send_weights(self, version: Optional[str] = None) -> None:
        """One update: start_weight_update, then update_weights on a thread of its own (each
        worker blocks receiving) while the senders push every tensor, then
        finish_weight_update. Every rank iterates the source; only rank 0 sends. Raises the
        first failure of either side. With ``delta``: the first update, and the one after a
        failure, goes whole; each after it sends the changes since the last, from that
        update's version to ``version`` (a fresh one when None; kept as ``self.version``)."""
        tensors = self._tensors()
        if not self.is_sender:
            return
        info = self.init_info
        if info.delta:
            self._send_delta(tensors, version or secrets.token_hex(8))
            return
        self._push(lambda senders: [_send(sender, tensors, info.format) for sender in senders])

    def _send_delta(self, tensors: List[Tuple[str, torch.Tensor]], version: str) -> None:
        """send_weights() with ``delta``: the changes since the last update sent, or the whole
        (naming ``version``) when there is none; what it sent is the next one's base."""
        sent = host_copies(tensors)
        base, self._base = self._base, None  # a failed update leaves the workers' version unknown
        info = self.init_info

        def send(senders: List[Any]) -> List[Dict[str, Any]]:
            if base is None:
                return [_send(sender, list(sent.items()), info.format, target=version) for sender in senders]
            return send_deltas(senders, base, sent, self.version, version)

        self._push(send, one_each=True)
        self._base, self.version = sent, version

    def _push(self, send: Any, one_each: bool = False) -> None:
        """Drives one update through the engine while ``send(senders)`` pushes it."""
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
                                              info.bucket_bytes, one_each=one_each)
            self.last_reports = send(self._senders)
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

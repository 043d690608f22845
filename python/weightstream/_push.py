"""The trainer's side of a pushed update, shared by the engine plugins (weightstream.vllm,
weightstream.sglang): the receivers' listen addresses, one weightstream.UpdateSender per
receiver or per update, and one update of named tensors, its manifest declared first."""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import _core

#: The transports an engine's receivers take: shm and cuda-ipc listen on a Unix socket, tcp,
#: nccl and ucx on "HOST:PORT" (ucx's bytes then move by UCX's own lanes: RDMA, shared
#: memory, cma or tcp, as UCX_TLS allows).
TRANSPORTS = ("shm", "tcp", "cuda-ipc", "nccl", "ucx")


def check_transport(transport: str) -> None:
    """Raises ValueError for a transport other than TRANSPORTS."""
    if transport not in TRANSPORTS:
        raise ValueError(f"weightstream weight transfer: transport '{transport}' is not one of {', '.join(TRANSPORTS)}")


def make_senders(addresses: List[str], transport: str, token: str, device: str,
                 bucket_bytes: Optional[int], timeout: Optional[float] = None, one_each: bool = False) -> List[Any]:
    """The senders that feed ``addresses``: one for all of them over tcp, nccl and ucx, one each
    over shm and cuda-ipc (which take one receiver per sender), and one each with
    ``one_each`` (a delta: each rank's sender sends only the elements that rank holds)."""
    options: Dict[str, Any] = {"transport": transport, "token": token, "device": device}
    if bucket_bytes:
        options["bucket_bytes"] = int(bucket_bytes)
    if timeout is not None:
        options["timeout"] = float(timeout)
    if one_each or transport in ("shm", "cuda-ipc"):
        return [_core.UpdateSender(address, **options) for address in addresses]
    return [_core.UpdateSender(list(addresses) if len(addresses) > 1 else addresses[0], **options)]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, an FSDP DTensor gathered, contiguous."""
    tensor = tensor.detach()
    full = getattr(tensor, "full_tensor", None)  # an FSDP DTensor gathers here
    if callable(full):
        tensor = full()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def send_update(sender: Any, tensors: List[Tuple[str, torch.Tensor]], format: str, target: str = "") -> Dict[str, Any]:
    """One update of ``tensors``: their manifest (name, dtype, shape; an FSDP DTensor's are its
    full tensor's) declared first, then each tensor gathered and sent in turn. ``target``: the
    version the receivers hold after it (docs/DELTA.md; empty: unknown)."""
    sender.start(format, [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors], target=target)
    for name, tensor in tensors:
        sender.send(name, _full(tensor))
    return sender.finish()


def host_copies(tensors: List[Tuple[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Host copies of ``tensors`` (gathered, contiguous), by name: what a delta compares on the
    host, kept as the base of the next one."""
    return {name: _full(tensor).to("cpu", copy=True) for name, tensor in tensors}


def send_deltas(senders: List[Any], base_tensors: Dict[str, torch.Tensor], tensors: Dict[str, torch.Tensor],
                base: str, target: str) -> List[Dict[str, Any]]:
    """One delta update (``UpdateSender.update_changes``: the changes of ``tensors`` since
    ``base_tensors``, the version ``base``, leaving version ``target``) through each sender at
    once, each on a thread of its own; every sender's report, or the first failure raised."""
    if len(senders) == 1:
        return [senders[0].update_changes(base_tensors, tensors, base=base, target=target)]
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    with ThreadPoolExecutor(max_workers=len(senders), thread_name_prefix="weightstream-delta") as pool:
        running = [pool.submit(sender.update_changes, base_tensors, tensors, base=base, target=target)
                   for sender in senders]
        return [future.result() for future in running]


def free_addresses(transport: str, count: int, host: str = "127.0.0.1") -> List[str]:
    """``count`` listen addresses the trainer can hand to the workers: free loopback ports
    for tcp, nccl and ucx (the host given for a remote engine), fresh Unix socket paths for
    shm and cuda-ipc."""
    check_transport(transport)
    if transport in ("shm", "cuda-ipc"):
        folder = tempfile.mkdtemp(prefix="weightstream-update-")
        return [os.path.join(folder, f"rank-{rank}.sock") for rank in range(count)]
    addresses = []
    sockets = []
    for _ in range(count):
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        probe.bind((host, 0))
        sockets.append(probe)
        addresses.append(f"{host}:{probe.getsockname()[1]}")
    for probe in sockets:
        probe.close()
    return addresses

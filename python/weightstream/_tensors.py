"""How tensors cross from the compiled core into Python frameworks.

The core hands every tensor over as a ``nanobind.nb_ndarray``: an object with
``__dlpack__``, ``__dlpack_device__`` and (on the host) the buffer protocol, which owns
the tensor's memory. Dtypes numpy can hold keep their dtype there. Dtypes it cannot hold
(BF16 and the F8 kinds) cross as raw bytes: ``uint8`` of shape ``[*shape, itemsize]``;
the sub-byte kinds (F4, F6_*) as flat ``uint8`` of the tensor's byte size. Here those raw
bytes are reinterpreted, without a copy, as torch's own dtype where torch has one.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

# safetensors dtypes that cross as raw bytes, and the torch dtype each is viewed as.
_TORCH_DTYPE_NAMES = {
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}
_RAW_DTYPES = frozenset(_TORCH_DTYPE_NAMES) | {"F4", "F6_E2M3", "F6_E3M2"}

FRAMEWORKS = (None, "torch", "numpy")

_torch_module: Any = None
_torch_checked = False


def is_raw_dtype(dtype: str) -> bool:
    """Whether tensors of safetensors dtype ``dtype`` cross as raw uint8 bytes."""
    return dtype in _RAW_DTYPES


def torch_or_none():
    """The torch module when it can be imported, else None (checked once)."""
    global _torch_module, _torch_checked
    if not _torch_checked:
        _torch_checked = True
        try:
            import torch  # noqa: PLC0415 - optional, and slow to import
        except ImportError:
            _torch_module = None
        else:
            _torch_module = torch
    return _torch_module


def require_torch(needed_by: str = "framework='torch'"):
    """The torch module, or ImportError saying what needs it (``needed_by``)."""
    torch = torch_or_none()
    if torch is None:
        raise ImportError(f"weightstream: {needed_by} needs PyTorch, which cannot be imported here")
    return torch


def check_framework(framework: Optional[str]) -> None:
    """Raises ValueError for a framework other than None, "torch" or "numpy"."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be None, 'torch' or 'numpy', not {framework!r}")
    if framework == "torch":
        require_torch()


def core_torch_tensors(framework: Optional[str], dtypes: Iterable[str]) -> str:
    """Which tensors the compiled core should hand over as torch.Tensor itself (made from
    a bare DLPack capsule in one call, BF16 in torch's dtype) for ``framework``, given the
    checkpoint's safetensors ``dtypes``: "all" for framework="torch", "bf16" for the default
    framework when there is BF16 and torch imports, else "none". present() passes those
    through and makes the others."""
    if framework == "torch":
        return "all"
    if framework is None and "BF16" in dtypes and torch_or_none() is not None:
        return "bf16"
    return "none"


def to_torch(array: Any, dtype: str, shape: Sequence[int]):
    """A torch.Tensor over ``array``'s memory with the checkpoint's dtype and shape."""
    torch = require_torch()
    tensor = torch.from_dlpack(array)
    if dtype in _RAW_DTYPES:
        torch_name = _TORCH_DTYPE_NAMES.get(dtype)
        torch_dtype = getattr(torch, torch_name, None) if torch_name else None
        if torch_dtype is None:
            raise TypeError(f"torch {torch.__version__} has no dtype for safetensors {dtype}")
        # [*shape, itemsize] uint8 -> [*shape, 1] of the real dtype -> shape; all views.
        tensor = tensor.view(torch_dtype).reshape(tuple(shape))
    return tensor


def to_numpy(array: Any):
    """A numpy.ndarray over ``array``'s memory (host tensors only)."""
    import numpy  # noqa: PLC0415 - optional dependency

    device_type, _ = array.__dlpack_device__()
    if device_type != 1:
        raise ValueError("framework='numpy' needs device='cpu': numpy cannot hold device memory")
    return numpy.from_dlpack(array)


def present(array: Any, dtype: str, shape: Sequence[int], framework: Optional[str]):
    """The object a caller receives for one tensor, as the ``framework`` rule says:
    None keeps the DLPack array except that raw-byte dtypes become torch tensors when
    torch is importable; "torch" always gives torch.Tensor; "numpy" numpy.ndarray. A
    torch.Tensor the core made already (core_torch_tensors) is returned as it is."""
    if _torch_module is not None and framework != "numpy" and isinstance(array, _torch_module.Tensor):
        return array
    if framework == "torch":
        return to_torch(array, dtype, shape)
    if framework == "numpy":
        return to_numpy(array)
    if dtype in _TORCH_DTYPE_NAMES:
        torch = torch_or_none()
        # An older torch without this float8 kind keeps the raw bytes.
        if torch is not None and hasattr(torch, _TORCH_DTYPE_NAMES[dtype]):
            return to_torch(array, dtype, shape)
    return array

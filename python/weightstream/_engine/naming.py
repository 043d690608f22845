"""Names the engine plugins give in messages and layouts: torch dtypes as safetensors names,
a tensor's device, the first few of many names."""

from __future__ import annotations

from typing import Iterable, Optional

import torch


_TORCH_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


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

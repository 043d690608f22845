"""weightstream: stream safetensors checkpoints from local disks or S3 into host or GPU
memory, fast and in bounded memory, as DLPack tensors that torch, numpy and cupy take
without a copy.

    import weightstream
    for name, tensor in weightstream.stream("/models/llama", device="cuda:0", memory_limit="2GiB"):
        ...

The package carries the compiled C++ library (weightstream._core); it never runs the
``weightstream`` command. Errors raise weightstream.Error (a RuntimeError) with the
library's message and a ``.code`` such as "not_found", "format" or "invalid_argument".
"""

import atexit as _atexit

# torch, where it is installed, is imported before the compiled core: on an H100 (CUDA 13,
# torch 2.11, the core built with a CUDA-aware UCX) `import weightstream, torch` died of
# SIGSEGV inside torch's own import (its operator registry), while torch imported first
# worked, so the package itself takes that order (bench/HISTORY.md, session 24).
try:
    import torch as _torch  # noqa: F401
except ImportError:
    pass

from ._api import (
    Checkpoint,
    Error,
    TensorInfo,
    TensorIterator,
    digest,
    load,
    open,
    resolve_options,
    stream,
)
from . import _core
from ._core import UpdateSender, cuda_compiled, cuda_device_count, peer_config
from ._receiver import UpdateReceiver
from . import metrics
from ._model import LoadSession, ModelLayout, PeerServer, identity_layout, model_layout, serve
from ._weights_iterator import safetensors_weights_iterator

# Hooks of module-level layouts refer to their module: freed at exit, not leaked.
_atexit.register(_core._release_python_hooks)
# Registered last, so run first: a thread left waiting in UpdateReceiver.receive() is
# stopped before the interpreter finalizes (which would otherwise abort the process).
_atexit.register(_core._stop_receivers_at_exit)

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "Error",
    "LoadSession",
    "ModelLayout",
    "PeerServer",
    "TensorInfo",
    "TensorIterator",
    "UpdateReceiver",
    "UpdateSender",
    "cuda_compiled",
    "cuda_device_count",
    "digest",
    "load",
    "model_layout",
    "identity_layout",
    "open",
    "peer_config",
    "resolve_options",
    "safetensors_weights_iterator",
    "serve",
    "stream",
]

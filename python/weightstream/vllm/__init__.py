"""weightstream inside vLLM: a model loader (``--load-format weightstream``), a
weight-transfer backend (``weightstream``) and the MTP draft's load.

vLLM imports this module in every process through the ``vllm.general_plugins`` entry point
of weightstream's pyproject.toml and calls :func:`register`. Without vLLM (or with a vLLM
this module was not written for) importing it is harmless: :func:`register` does nothing
and returns False. The loader and the engines live in submodules that import vLLM, so
``import weightstream.vllm`` never does.

See docs/VLLM.md for the ``vllm serve`` flags, the extra-config keys and the RL update flow.
"""

from __future__ import annotations

import logging
from typing import Optional, Tuple

#: The ``--load-format`` and ``weight_transfer_config.backend`` name.
NAME = "weightstream"

#: vLLM releases whose loader and weight-transfer interfaces this module was written
#: against (their base_loader.py and weight_transfer/base.py agree).
SUPPORTED_VLLM_VERSIONS: Tuple[str, ...] = ("0.33", "0.34")

logger = logging.getLogger("vllm.weightstream")


def vllm_version() -> Optional[str]:
    """The installed vLLM's version, or None when vLLM is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415
    except ImportError:  # pragma: no cover - Python 3.8
        return None
    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def supported(version: Optional[str]) -> bool:
    """Whether ``version`` is one of SUPPORTED_VLLM_VERSIONS (any patch release)."""
    if not version:
        return False
    return any(version == release or version.startswith(release + ".") for release in SUPPORTED_VLLM_VERSIONS)


_registered = False


def register() -> bool:
    """Registers the model loader under ``--load-format weightstream`` and the transfer
    engines under the backend name ``weightstream``; vLLM calls it in every process.
    Returns False (and registers nothing) without vLLM, and for a vLLM release other than
    SUPPORTED_VLLM_VERSIONS, saying so once in the log. Calling it again is harmless.
    """
    global _registered
    if _registered:
        return True
    version = vllm_version()
    if version is None:
        return False
    if not supported(version):
        logger.warning("weightstream: vLLM %s is not one of the supported releases (%s); the weightstream loader "
                       "and weight-transfer backend are not registered", version,
                       ", ".join(release + ".x" for release in SUPPORTED_VLLM_VERSIONS))
        return False
    from vllm.model_executor.model_loader import register_model_loader  # noqa: PLC0415

    from ._loader import WeightstreamModelLoader  # noqa: PLC0415
    from ._transfer import register_transfer_engines  # noqa: PLC0415

    register_model_loader(NAME)(WeightstreamModelLoader)
    register_transfer_engines()
    _registered = True
    return True


# The classes, imported (with vLLM) only when asked for: weightstream.vllm.WeightstreamTrainerEngine.
_LAZY = {
    "WeightstreamModelLoader": "._loader",
    "WeightstreamWeightTransferEngine": "._transfer",
    "WeightstreamInitInfo": "._transfer",
    "WeightstreamUpdateInfo": "._transfer",
    "WeightstreamTrainerEngine": "._trainer",
    "WeightstreamTrainerInitInfo": "._trainer",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NAME", "SUPPORTED_VLLM_VERSIONS", "register", "supported", "vllm_version", *_LAZY]

"""weightstream inside SGLang: a model loader (``--load-format weightstream``) and a custom
weight loader for SGLang's ``update_weights_from_tensor`` that receives an update pushed
by a trainer's ``weightstream.UpdateSender`` straight into the model's parameters.

SGLang runs :func:`register` in every process through the ``sglang.srt.plugins`` entry
point of weightstream's pyproject.toml. It adds ``weightstream`` to SGLang's load-format
choices (``add_load_format_choices``, SGLang's documented hook) and, through SGLang's
``HookRegistry``, lets ``LoadConfig`` take that name for the loader class
(``LoadConfig`` checks the name against a closed enum; ``get_model_loader`` takes a loader
class as its load format). No SGLang file is patched.

Without SGLang (or with a release this module was not written for) importing it is
harmless: :func:`register` does nothing and returns False. The loader lives in a submodule
that imports SGLang, so ``import weightstream.sglang`` never does.

See docs/SGLANG.md for the flags, the extra-config keys and the update flow.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

#: The ``--load-format`` name.
NAME = "weightstream"

#: The dotted path to give ``--custom-weight-loader`` and ``update_weights_from_tensor``'s
#: ``load_format``: the custom weight loader that receives a pushed update.
UPDATE_LOADER = "weightstream.sglang.receive_update"

#: SGLang releases whose loader, plugin and update interfaces this module was written against.
SUPPORTED_SGLANG_VERSIONS: Tuple[str, ...] = ("0.5.23",)

#: The method of SGLang's LoadConfig that turns the load-format name into its enum.
_VERIFY_LOAD_FORMAT = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"

#: The method of SGLang's model runners that calls a custom weight loader.
_UPDATE_WEIGHTS_FROM_TENSOR = ("sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater."
                               "update_weights_from_tensor")

logger = logging.getLogger("sglang.weightstream")


def sglang_version() -> Optional[str]:
    """The installed SGLang's version, or None when SGLang is not installed."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def supported(version: Optional[str]) -> bool:
    """Whether ``version`` is one of SUPPORTED_SGLANG_VERSIONS (any post release)."""
    if not version:
        return False
    return any(version == release or version.startswith(release + ".") for release in SUPPORTED_SGLANG_VERSIONS)


def _verify_load_format(original: Any, load_config: Any) -> None:
    """Around SGLang's LoadConfig._verify_load_format: the name ``weightstream`` becomes the
    loader class (which get_model_loader instantiates); every other name is SGLang's."""
    load_format = load_config.load_format
    if isinstance(load_format, str) and load_format.lower() == NAME:
        from ._loader import WeightstreamModelLoader  # noqa: PLC0415

        load_config.load_format = WeightstreamModelLoader
        return None
    return original(load_config)


def _update_weights_from_tensor(original: Any, *args: Any, **kwargs: Any) -> Any:
    """Around SGLang's WeightUpdater.update_weights_from_tensor: an update through
    UPDATE_LOADER that fails returns (False, why), as SGLang's own update paths report a
    failure to the Engine's caller. SGLang 0.5.23 catches nothing a custom weight loader
    raises: the exception ends the scheduler process and the Engine's call never returns.
    Every other load format is SGLang's alone."""
    load_format = kwargs.get("load_format", args[2] if len(args) > 2 else None)
    if load_format != UPDATE_LOADER:
        return original(*args, **kwargs)
    try:
        return original(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - reported to the Engine's caller, as SGLang reports its own
        logger.error("weightstream: the update through %s failed: %s", UPDATE_LOADER, error)
        return False, f"{UPDATE_LOADER} failed: {error}"


_registered = False


def register() -> bool:
    """Adds ``weightstream`` to SGLang's load formats, and makes a failed update through
    UPDATE_LOADER SGLang's (False, why) rather than the end of its scheduler; SGLang's
    load_plugins() calls it in every process and applies the hooks after. Returns False (and registers nothing) without
    SGLang, and for an SGLang release other than SUPPORTED_SGLANG_VERSIONS, saying so once
    in the log. Calling it again is harmless."""
    global _registered
    if _registered:
        return True
    version = sglang_version()
    if version is None:
        return False
    if not supported(version):
        logger.warning("weightstream: SGLang %s is not one of the supported releases (%s); --load-format "
                       "weightstream is not registered", version, ", ".join(SUPPORTED_SGLANG_VERSIONS))
        return False
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices  # noqa: PLC0415
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: PLC0415

    if NAME not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([NAME])
    HookRegistry.register(_VERIFY_LOAD_FORMAT, _verify_load_format, HookType.AROUND)
    HookRegistry.register(_UPDATE_WEIGHTS_FROM_TENSOR, _update_weights_from_tensor, HookType.AROUND)
    _registered = True
    return True


def receive_update(model: Any, named_tensors: Any) -> None:
    """SGLang's custom weight loader for ``update_weights_from_tensor`` (list this path,
    UPDATE_LOADER, in ``--custom-weight-loader``): receives the update a trainer pushes with
    weightstream.UpdateSender into the model's bound parameters. ``named_tensors`` is what
    :func:`weightstream.sglang.update_request` made."""
    from ._update import receive_update as receive  # noqa: PLC0415

    receive(model, named_tensors)


# The classes and helpers, imported (with SGLang or torch) only when asked for.
_LAZY = {
    "WeightstreamModelLoader": "._loader",
    "update_request": "._update",
    "push_update": "._update",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib  # noqa: PLC0415

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NAME", "SUPPORTED_SGLANG_VERSIONS", "UPDATE_LOADER", "receive_update", "register", "sglang_version",
           "supported", *_LAZY]

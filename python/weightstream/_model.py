"""Engines' side of weightstream: a ModelLayout (an engine's parameters on one rank) and
the LoadSession that applies named tensors to it: cold load, reload or update, with
per-layer processing and model hooks that run once per finish()."""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

from . import _core
from ._api import Checkpoint
from ._tensors import check_framework, present

ModelLayout = _core.ModelLayout


def _error(message: str, code: str) -> Exception:
    """A weightstream.Error with ``.code``, as the compiled core raises them."""
    error = _core.Error(message)
    error.code = code
    return error


_OS_ERROR_CODES = {FileNotFoundError: "not_found", NotADirectoryError: "not_found", PermissionError: "permission"}


def _model_config(config: Union[Dict[str, Any], str, os.PathLike, Checkpoint]) -> Tuple[str, Any]:
    """Where ``config`` says the model's config.json is: ("text", (text, the compiled checkpoint
    it came from or None)) for a dict, JSON text, a config.json file or an open Checkpoint;
    ("source", uri) for a checkpoint directory or a URI, whose source the library opens. Raises
    weightstream.Error naming what is wrong."""
    if isinstance(config, dict):
        return "text", (json.dumps(config), None)
    if isinstance(config, str) and config.lstrip().startswith("{"):
        return "text", (config, None)
    if isinstance(config, Checkpoint):
        text = config._core.config_json
        if text is None:
            raise _error(f"{config.uri} has no config.json beside its shards (model_layout needs the model's config)",
                         "not_found")
        return "text", (text, config._core)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"model_layout: config must be a dict, JSON text, a path, a URI or a Checkpoint, "
                        f"not {type(config).__name__}")
    path = os.fspath(config)
    if "://" in path or os.path.isdir(path):
        return "source", path  # a checkpoint or serving peers (token: WEIGHTSTREAM_PEER_TOKEN)
    try:
        with open(path, encoding="utf-8") as file:
            return "text", (file.read(), None)
    except OSError as error:
        code = next((c for kind, c in _OS_ERROR_CODES.items() if isinstance(error, kind)), "io")
        raise _error(f"cannot read model config {path}: {error.strerror or error}", code) from None
    except UnicodeDecodeError as error:
        raise _error(f"model config {path} is not UTF-8 text: {error}", "format") from None


def identity_layout(checkpoint: Union[str, os.PathLike, Checkpoint], *, device: Optional[str] = None) -> ModelLayout:
    """The identity layout of a checkpoint: one parameter per tensor, with the tensor's name,
    dtype and shape (what an engine whose parameters carry the checkpoint's names binds, a
    transformers model for instance, and what ``weightstream.load`` loads). With ``device``
    the parameters left unbound are allocated on it at the first load."""
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = Checkpoint(os.fspath(checkpoint))
    layout = _core.ModelLayout.identity(checkpoint._core)
    if device is not None:
        layout.allocate_at_first_load(device)
    return layout


def model_layout(config: Union[Dict[str, Any], str, os.PathLike, Checkpoint], *, tp_size: int = 1, tp_rank: int = 0,
                 ep_size: int = 1, ep_rank: int = 0, dtype: Optional[str] = None, quantize: str = "none",
                 modules: str = "target", device: Optional[str] = None,
                 hooks: bool = False) -> Union[ModelLayout, Tuple[ModelLayout, ModelLayout]]:
    """Builds the layout of a model of a supported architecture (llama, qwen3, qwen3_moe,
    mixtral, deepseek_v3, kimi_k2, glm4_moe, qwen3_next) for one rank from its Hugging Face
    config: a dict, JSON text, a path to config.json, a checkpoint directory or URI
    (file://, s3://, gs://, az://: its config.json), or an open Checkpoint. ``dtype`` is the parameters'
    safetensors dtype (default: the config's torch_dtype); ``quantize`` "fp8" quantizes
    linear weights per tensor once a layer is complete (an FP8 block-quantized checkpoint's
    weights are held as shipped, with their ``weight_scale_inv`` blocks); ``modules``
    "target" (layers 0 to num_hidden_layers - 1, as vLLM's target models), "draft" (only the
    MTP layers) or "all": the two modules, a ``(target, draft)`` tuple of layouts.

    Storage: bind the engine's own tensors with ``layout.bind(name, tensor)`` or
    ``layout.bind_module(module)``; loads then write into them in place. With ``device``
    ("cpu", "cuda:N") the parameters left unbound are allocated on it at the first load (or
    the first ``layout.tensor()``), and binds must be on it; without, call
    ``layout.allocate(device)`` after binding. ``layout.tensor(name)`` is a DLPack view of a
    parameter's storage.
    The layout is the library's engine_layout, the one ``weightstream plan`` and ``load`` build:
    a config from a checkpoint is first checked against its tensors. ``hooks=True`` registers
    the model hooks ``weightstream load`` registers (a tied lm_head, a fused K/V buffer; the
    layout's ``hooks`` names them): the layout is then allocated on ``device`` at once, as
    the hooks' derived buffers are, so it takes no binds. An engine that keeps that derived
    state in its own model leaves it False: the hooks' buffers would copy its memory.
    Raises weightstream.Error for anything bad: code "model" for an unsupported model or a
    bad division, "not_found" for a missing file or config.json, "format" for malformed JSON.
    """
    where, given = _model_config(config)
    built = ("target", "draft") if modules == "all" else (modules,)
    rank = dict(tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank, dtype=dtype, quantize=quantize)
    if where == "source":
        layouts = _core.ModelLayout.from_source(given, modules=list(built), device=device, hooks=hooks, **rank)
    else:
        text, checkpoint = given
        layouts = [_core.ModelLayout.from_config(text, modules=module, checkpoint=checkpoint, device=device,
                                                 hooks=hooks, **rank) for module in built]
    for layout in layouts:
        if device is not None and not hooks:
            layout.allocate_at_first_load(device)
    return tuple(layouts) if modules == "all" else layouts[0]


class LoadSession:
    """One load of a ModelLayout: ``begin(mode)``, ``load(batch)`` any number of times,
    ``finish()``. Modes: "cold" (every parameter must be filled by finish()), "reload" and
    "update" (layers left out keep their values). A batch is an iterable of
    ``(name, tensor)`` or ``(name, tensor, dtype)``: any contiguous DLPack tensor on the host
    or the layout's device (torch, numpy, cupy, or what weightstream.stream yields); the
    safetensors ``dtype`` name is needed for the raw uint8 bytes weightstream gives for BF16
    and F8 when torch is absent. Parts of one parameter (q, k, v) may come in any order and
    in different batches. Every tensor of a batch is checked before a byte is written;
    errors raise weightstream.Error naming the tensor, the parameter and the rule.
    """

    def __init__(self, layout: ModelLayout) -> None:
        self._core = _core.LoadSession(layout)
        self.layout = layout

    def begin(self, mode: str = "cold", format: str = "checkpoint", commit: Optional[str] = None) -> None:
        """Starts a load; ``format`` "engine" takes parameter names and kernel-format bytes.
        ``commit`` "layer" writes a layer only once all of its tensors have arrived, so a load
        that fails midway leaves every unfinished layer with its old values; the default of
        "reload" and "update". ``commit`` "arrival", the default of "cold" and the fastest,
        writes each tensor as it arrives (sources may read straight into the parameters): on
        a reload or update, a load that fails midway (a truncated shard, a sender that dies)
        leaves the layers it was writing with a mix of old and new values. In either mode,
        bytes pulled from peers are checked against their digests before any reaches a
        reloaded parameter."""
        self._core.begin(mode, format, commit)

    def load(self, batch: Iterable[Tuple[Any, ...]]) -> None:
        """Applies one batch of named tensors."""
        self._core.load(list(batch))

    def load_checkpoint(self, checkpoint: Union[str, Checkpoint], **options: Any) -> Dict[str, Any]:
        """Streams the tensors this rank needs from a checkpoint straight into the session
        (contiguous slices read as their own byte ranges); returns the stream's counters.
        A ``peer://HOST:PORT[,HOST:PORT...]`` URI pulls them from serving peers over UCX
        instead (docs/PEERS.md; options ``token``, ``timeout`` in seconds, ``memory_limit``
        in bytes, ``expect_digest``; the token defaults to WEIGHTSTREAM_PEER_TOKEN): the
        counters then have ``bytes_from_peers`` and ``bytes_read`` 0. ``expect_digest`` (16 hex
        digits, as ``weightstream digest --hash xxh64`` prints the content digest) pins the
        checkpoint content every peer must serve; a peer serving another or unknown (updated)
        content is refused before a byte lands. Without it, several peers must all serve the
        same known content."""
        if isinstance(checkpoint, Checkpoint):
            return self._core.stream_checkpoint(checkpoint._core, options)
        return self._core.load_source(os.fspath(checkpoint), options)

    def finish(self) -> None:
        """Ends the load: completeness checks, pending layer processing, then every model
        hook exactly once."""
        self._core.finish()

    @property
    def counters(self) -> Dict[str, int]:
        """tensors_applied, bytes_applied, tensors_skipped, parameters_completed,
        layer_processing_runs, model_hook_runs of the current or last load."""
        return self._core.counters

    @property
    def mode(self) -> str:
        """"cold", "reload" or "update"."""
        return self._core.mode

    @property
    def commit(self) -> str:
        """"arrival" or "layer": the commit of the current or last load."""
        return self._core.commit

    @property
    def completed_layers(self) -> List[int]:
        """Layers whose every part arrived in this load, ascending."""
        return self._core.completed_layers


PeerServer = _core.PeerServer


def serve(layout: ModelLayout, checkpoint: Union[str, os.PathLike, Checkpoint], *, listen: str = "127.0.0.1:0",
          token: Optional[str] = None, timeout: float = 30.0, open_without_token: bool = False,
          expect_digest: Optional[str] = None) -> PeerServer:
    """Publishes a loaded layout's parameters to pullers (``peer://``, docs/PEERS.md), as
    ``weightstream serve`` does: each parameter is registered with UCX and hashed (xxh64),
    and a manifest names the layout (its tp and ep ranks, dtype, quantization) and the
    ``checkpoint`` it was loaded from (its config.json and tensors, which pullers build their
    layouts from; a layout pulled from peers names their ``peer://`` URI instead). ``listen`` is "HOST:PORT" (port 0: a free one; ``server.address`` says
    which); ``token`` is what pullers must prove they know (proven both ways, never sent;
    default WEIGHTSTREAM_PEER_TOKEN). Without a non-empty token the server refuses to start,
    unless ``open_without_token=True`` asks for one that serves any puller (warned about on
    stderr). The server runs on threads of its own until ``server.close()`` or until it
    is collected; it keeps the layout alive. The layout's parameters must not change while
    it serves, except inside ``server.begin_update()`` / ``server.end_update()``.
    ``server.content_digest`` is the checkpoint's content digest it publishes (a checkpoint
    source is read whole once more to compute it; a ``peer://`` source's peers publish it,
    and ``expect_digest`` pins it as for ``LoadSession.load_checkpoint``); it is empty
    (unknown) from the first ``begin_update()`` on.
    Raises weightstream.Error for a layout not yet loaded, one on a GPU in a build whose UCX
    cannot serve it, a build without UCX, or an address it cannot listen on."""
    source = checkpoint._core if isinstance(checkpoint, Checkpoint) else os.fspath(checkpoint)
    return _core.PeerServer(layout, source, listen, token, float(timeout),
                            open_without_token=bool(open_without_token), expect_digest=expect_digest)


def _serve_method(self: ModelLayout, checkpoint: Union[str, os.PathLike, Checkpoint], **options: Any) -> PeerServer:
    return serve(self, checkpoint, **options)


_serve_method.__doc__ = "``weightstream.serve(layout, checkpoint, ...)``: " + (serve.__doc__ or "")
_serve_method.__name__ = "serve"
ModelLayout.serve = _serve_method


def _tensor_method(self: ModelLayout, name: str, framework: Optional[str] = None) -> Any:
    """A view of parameter ``name``'s storage, valid while the layout lives: a DLPack array
    (``framework=None``; raw bytes as ``[*shape, itemsize]`` uint8 for dtypes DLPack lacks), a
    ``torch.Tensor`` in the parameter's dtype and shape (``"torch"``, made by the core in one
    call where it can), or a ``numpy.ndarray`` (``"numpy"``, host layouts)."""
    check_framework(framework)
    view = self._view(name, "all" if framework == "torch" else "none")
    return view if framework is None else _as_framework(self, name, view, framework)


def _tensors_method(self: ModelLayout, framework: Optional[str] = None) -> Dict[str, Any]:
    """Every parameter's view (see ``tensor``), by name, in layout order: one call into the
    core for the whole layout."""
    check_framework(framework)
    views = self._views("all" if framework == "torch" else "none")
    if framework is None:
        return views
    return {name: _as_framework(self, name, view, framework) for name, view in views.items()}


def _as_framework(layout: ModelLayout, name: str, view: Any, framework: str) -> Any:
    """``view`` as ``framework`` asks: a torch.Tensor the core made already is kept; raw bytes
    take the parameter's dtype and shape."""
    if framework == "torch" and type(view).__module__.startswith("torch"):
        return view
    info = layout.parameter_info(name)
    return present(view, info["dtype"], info["shape"], framework)


_tensor_method.__name__ = "tensor"
_tensors_method.__name__ = "tensors"
ModelLayout.tensor = _tensor_method
ModelLayout.tensors = _tensors_method

"""Where a module's weights come from: the library's source resolution, the checkpoint opened
ahead while the model is bound, and whether model_uri names serving peers (the library's
open_source tells the kinds of source apart)."""

from __future__ import annotations

import os
import re
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from .. import _core
from .._api import Checkpoint
from .._model import ModelLayout

if TYPE_CHECKING:
    from .options import LoaderOptions


# A Hugging Face Hub id: "org/name" or "name", no scheme, not a path on this machine.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def is_hub_id(value: str) -> bool:
    """Whether ``value`` names a model on the Hugging Face Hub rather than a URI or a path."""
    return bool(value) and "://" not in value and not os.path.exists(value) and bool(_HUB_ID.match(value))


class CheckpointAhead:
    """Opens, on a thread of its own, the source resolution tries first while the loader
    binds the model: reading the index and shard headers of a MoE checkpoint (thousands of
    tensors) is C++ that runs without the GIL, binding is Python, so on two cores the two
    overlap. Resolution still decides: it takes this checkpoint when it chooses that source
    (one that holds a tensor the module wants) and opens what it chooses otherwise; a source
    that cannot be opened here gets its reason from resolution."""

    def __init__(self, uri: str, options: LoaderOptions) -> None:
        self.uri = uri
        self._stream = dict(options.stream)
        self._opened: Optional[Any] = None
        self._thread: Optional[threading.Thread] = None
        if self.uri:
            self._thread = threading.Thread(target=self._open, name="weightstream-open", daemon=True)
            self._thread.start()

    def _open(self) -> None:
        try:
            self._opened = _core.Checkpoint(self.uri, self._stream)
        except _core.Error:
            pass  # resolution probes the source again and names why it cannot be opened

    def result(self) -> Optional[Tuple[str, Any]]:
        """(uri, the compiled checkpoint), or None when nothing was opened."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return None if self._opened is None else (self.uri, self._opened)


def resolve_module_source(model: str, model_weights: str, role: str, layout: ModelLayout, options: LoaderOptions,
                          method: str = "", ahead: Optional[CheckpointAhead] = None) -> Dict[str, Any]:
    """Where a module's weights come from, as ``weightstream resolve`` decides: model_weights,
    then model, then the checkpoint URI (extra-config model_uri, else WEIGHTSTREAM_MODEL_URI
    or MX_MODEL_URI). The chosen source's checkpoint, opened once (by ``ahead`` when it
    opened that source, else by the resolution itself), is under "checkpoint". Raises
    weightstream.Error naming every source passed over."""
    resolution = _core.resolve_source(model, model_weights, role, layout, method, options.model_uri,
                                      options.stream, open_checkpoint=True,
                                      opened=ahead.result() if ahead is not None else None)
    resolution["checkpoint"] = Checkpoint._of(resolution["checkpoint"])
    return resolution


def first_weights_source(model: str, model_weights: str, options: LoaderOptions) -> str:
    """For a model without a layout: the first of model_weights, model and the checkpoint URI
    that holds safetensors files. Raises FileNotFoundError naming each."""
    tried: List[str] = []
    model_uri, uri_field = _core.checkpoint_uri(options.model_uri)
    for label, place in (("model_weights", model_weights), ("model", model), (uri_field, model_uri)):
        if not place:
            tried.append(f"{label}: not set")
            continue
        try:
            checkpoint = Checkpoint(place, **options.stream)
        except _core.Error as error:
            tried.append(f"{label} {place}: {error}")
            continue
        if len(checkpoint):
            return place
        tried.append(f"{label} {place}: no tensors")
    raise FileNotFoundError("Cannot find any safetensors model weights: " + "; ".join(tried))


def names_peers(uri: str) -> bool:
    """Whether ``uri`` names serving peers (the library's open_source tells the kinds of
    source apart): a model_uri of peers is pulled from first, any other is a checkpoint that
    source resolution tries last."""
    return bool(uri) and _core.source_kind(uri) == "peer"


def checkpoint_ahead(uri: str, options: LoaderOptions) -> Optional[CheckpointAhead]:
    """The checkpoint ``uri``, opened ahead while the model is bound (CheckpointAhead); None
    when the load pulls from peers first (they serve no headers)."""
    return None if names_peers(options.model_uri) else CheckpointAhead(uri, options)

"""One load of a bound layout: from the resolved checkpoint (and the model's load_weights for
what the layout leaves to it), or pulled from serving peers with the library's one fallback
to the model's own sources."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Dict, Optional, Set, Tuple, Union

import torch

from .. import _core
from .._api import Checkpoint, resolve_options
from .._model import LoadSession
from .binding import BoundModel, route_checkpoint
from .naming import first_names
from .options import LoaderOptions
from .sources import names_peers


def load_layout(model: torch.nn.Module, bound: BoundModel, resolution: Dict[str, Any], mode: str, started: float,
                logger: logging.Logger) -> Tuple[Dict[str, Any], Optional[Set[str]]]:
    """One load of the bound layout from the resolved checkpoint: this rank's byte ranges
    streamed into the model's own parameters, and the checkpoint tensors the layout leaves to
    the model through its load_weights. Returns (what the load did, the model's parameters it
    filled: None when load_weights reports nothing)."""
    checkpoint = resolution["checkpoint"]
    by_load_weights = route_checkpoint(bound, checkpoint)
    session = LoadSession(bound.layout)
    session.begin(mode)
    stats = session.load_checkpoint(checkpoint)
    session.finish()
    loaded: Optional[Set[str]] = set(bound.filled_model_names)
    through_model = 0
    if by_load_weights:
        from_model = model.load_weights(checkpoint.stream(framework="torch", names=by_load_weights))
        through_model = len(by_load_weights)
        loaded = None if from_model is None else loaded | set(from_model)
    last_load = {"path": "layout", "mode": mode, "role": bound.role, "source": resolution["uri"],
                 "field": resolution["field"], "passed_over": resolution["passed_over"],
                 "layout": bound.description, "tensors_streamed": stats["tensors"],
                 "bytes_streamed": stats["bytes"], "bytes_read": stats["bytes_read"],
                 "shards_read": stats["shards_read"], "parameters_bound": len(bound.bound),
                 "parameters_through_load_weights": len(bound.unbound),
                 "tensors_through_load_weights": through_model,
                 "seconds": time.perf_counter() - started, "stream": stats}
    through = ("nothing through load_weights" if not by_load_weights else
               f"{through_model} checkpoint tensors through load_weights ({first_names(by_load_weights)})")
    logger.info("weightstream: %s load of the %s (%s) from %s (%s): %d parameters bound in place, %d tensors, "
                "%d bytes streamed into them (%d read), %s, %.2f s", mode, bound.role, bound.description,
                resolution["uri"], resolution["field"], len(bound.bound), stats["tensors"], stats["bytes"],
                stats["bytes_read"], through, last_load["seconds"])
    return last_load, loaded


def pull_layout(bound: BoundModel, uri: str, options: LoaderOptions, mode: str, started: float,
                logger: logging.Logger) -> Dict[str, Any]:
    """Pulls the bound layout from the serving peers of ``uri``, straight into the model's
    parameters where the layouts agree; returns what the load did. Raises weightstream.Error
    when the model holds some of the layout's parameters otherwise, or the pull fails."""
    if bound.unbound:
        raise _core.Error(f"cannot pull {bound.description} from {uri}: the {bound.engine} model holds "
                          f"{len(bound.unbound)} of its parameters otherwise, and those load through its "
                          f"load_weights from a checkpoint: {first_names(bound.unbound)}")
    session = LoadSession(bound.layout)
    session.begin(mode)
    report = session.load_checkpoint(uri, token=options.peer_token, timeout=options.peer_timeout,
                                     memory_limit=resolve_options(**options.stream)["memory_limit"],
                                     expect_digest=options.peer_expect_digest)
    session.finish()
    bound.by_load_weights = []
    last_load = {"path": "layout", "mode": mode, "role": bound.role, "source": uri, "field": "model_uri",
                 "passed_over": [], "layout": bound.description, "tensors_streamed": report["tensors"],
                 "bytes_streamed": report["bytes_from_peers"], "bytes_read": 0,
                 "bytes_from_peers": report["bytes_from_peers"], "bytes_in_place": report["bytes_in_place"],
                 "shards_read": 0, "parameters_bound": len(bound.bound), "parameters_through_load_weights": 0,
                 "tensors_through_load_weights": 0, "seconds": time.perf_counter() - started,
                 "peers": report["peers"], "digest_failures": report["digest_failures"]}
    logger.info("weightstream: %s load of the %s (%s) from %s: %d parameters bound in place, %d bytes from peers "
                "(%d in place, 0 read from storage), nothing through load_weights, %.2f s", mode, bound.role,
                bound.description, uri, len(bound.bound), report["bytes_from_peers"], report["bytes_in_place"],
                last_load["seconds"])
    return last_load


#: What a load of the layout from storage does: (options, the peers' failure or "") ->
#: (the checkpoint loaded, what the load did).
StorageLoad = Callable[[LoaderOptions, str], Tuple[Checkpoint, Dict[str, Any]]]


def load_from_peers_or_storage(bound: BoundModel, mode: str, started: float, options: LoaderOptions,
                               load_storage: StorageLoad,
                               logger: logging.Logger) -> Tuple[Union[str, Checkpoint], Dict[str, Any]]:
    """Peers first when model_uri names them (the target only: peers serve targets), then,
    through the library's one fallback (fallback_source), the model's own sources through
    ``load_storage``; returns what the layout was loaded from (the peers' URI or the
    checkpoint, for its server) and what the load did. Raises weightstream.Error naming both
    failures when neither serves."""
    uri = options.model_uri
    if not names_peers(uri):
        return load_storage(options, "")
    storage = dataclasses.replace(options, model_uri="")
    if bound.role != "target":
        return load_storage(storage, "")
    loaded: Dict[str, Tuple[Union[str, Checkpoint], Dict[str, Any]]] = {}
    failure = ""

    def pull() -> None:
        nonlocal failure
        try:
            loaded["pull"] = uri, pull_layout(bound, uri, options, mode, started, logger)
        except _core.Error as error:
            failure = str(error)
            raise

    def own_sources() -> None:
        loaded["storage"] = load_storage(storage, failure)

    if _core.load_with_fallback(bound.layout, uri, pull, "the model's own sources", own_sources):
        return loaded["storage"]
    return loaded["pull"]

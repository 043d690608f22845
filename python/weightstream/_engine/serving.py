"""A loaded model served to pullers (extra-config ``serve``), its reloads fenced off from
them, and the Prometheus endpoint its loads and updates are recorded in."""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterator, Mapping, Optional, Union

import torch

from .. import metrics
from .._api import Checkpoint
from .._model import serve
from .binding import BoundModel
from .options import LoaderOptions, log_once, serve_address


def serving_peer(model: torch.nn.Module) -> Optional[Any]:
    """The PeerServer a load started for ``model`` (extra-config ``serve``), while it serves."""
    server = getattr(model, "_weightstream_server", None)
    return server if server is not None and server.serving else None


def metrics_endpoint(metrics_listen: str, rank: int, logger: logging.Logger) -> Optional[metrics.Metrics]:
    """This rank's Prometheus endpoint for the extra-config key ``metrics_listen``, at PORT +
    ``rank`` (started by the first call, which logs its address); None without the key."""
    if not metrics_listen:
        return None
    host, port = metrics.listen_address(metrics_listen)
    endpoint = metrics.serve_once(serve_address(f"{host}:{port}", rank))
    log_once(logger, logging.INFO, "weightstream: metrics at http://%s/metrics", endpoint.address)
    return endpoint


def record_load_metrics(model: torch.nn.Module, options: LoaderOptions, last_load: Mapping[str, Any], rank: int,
                        logger: logging.Logger) -> None:
    """Records a load of ``model`` in this rank's Prometheus metrics (metrics_endpoint), where
    the updates it receives are recorded too (model_metrics); nothing without ``metrics_listen``."""
    endpoint = metrics_endpoint(options.metrics_listen, rank, logger)
    if endpoint is not None:
        endpoint.record_load(last_load, options.link_rate)
    object.__setattr__(model, "_weightstream_metrics", endpoint)


def model_metrics(model: torch.nn.Module) -> Optional[metrics.Metrics]:
    """The Prometheus endpoint the model's loads are recorded in (the updates it receives go
    there too); None when its loader had no ``metrics_listen``."""
    return getattr(model, "_weightstream_metrics", None)


@contextlib.contextmanager
def pulls_refused(model: torch.nn.Module) -> Iterator[None]:
    """While a served model reloads or updates: pullers that overlap are refused, and the
    server rehashes (a new version) at the end."""
    server = serving_peer(model)
    if server is not None:
        server.begin_update()
    try:
        yield
    finally:
        if server is not None:
            server.end_update()


def serve_model(model: torch.nn.Module, bound: BoundModel, source: Union[str, Checkpoint], options: LoaderOptions,
                rank: int, logger: logging.Logger) -> str:
    """Serves the bound layout (extra-config ``serve``, at PORT + ``rank``) while the model
    lives: the server closes when the model is collected or at the interpreter's exit,
    whichever is first. Returns the address it serves at."""
    address = serve_address(options.serve, rank)
    # A layout pulled from peers serves what they serve: the same digest is pinned again.
    pinned = options.peer_expect_digest if isinstance(source, str) else None
    server = serve(bound.layout, source, listen=address, token=options.peer_token, timeout=options.peer_timeout,
                   expect_digest=pinned)
    object.__setattr__(model, "_weightstream_server", server)
    weakref.finalize(model, server.close)
    logger.info("weightstream: serving %s at peer://%s", bound.description, server.address)
    return server.address

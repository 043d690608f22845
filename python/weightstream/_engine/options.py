"""weightstream's options from an engine's ``--model-loader-extra-config``, checked when the
engine starts, and the one logger helper the engine plugins share."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Set

from .. import _core, metrics
from .._api import resolve_options
from .sources import names_peers


#: weightstream's stream options, as weightstream.stream takes them.
STREAM_OPTIONS = ("concurrency", "memory_limit", "chunk_size", "io", "gpu_path", "mapped_share", "prefetchers")


#: Every key ``--model-loader-extra-config`` takes.
EXTRA_CONFIG_KEYS = STREAM_OPTIONS + ("model_uri", "peer_token", "peer_timeout", "peer_expect_digest", "serve",
                                      "metrics_listen", "link_rate")


_once: Set[str] = set()


def log_once(logger: logging.Logger, level: int, message: str, *args: Any) -> None:
    """Logs a message the first time its text is seen in this process."""
    text = message % args if args else message
    if text in _once:
        return
    _once.add(text)
    logger.log(level, "%s", text)


@dataclass
class LoaderOptions:
    """weightstream's options from ``--model-loader-extra-config``."""

    stream: Dict[str, Any] = field(default_factory=dict)
    #: The checkpoint URI a draft (or a target) falls back to; WEIGHTSTREAM_MODEL_URI or
    #: MX_MODEL_URI when empty. A ``peer://HOST:PORT[,...]`` URI is pulled from first, before
    #: the model's own sources (which are then the fallback).
    model_uri: str = ""
    #: The token serving peers require and this instance's server requires of pullers;
    #: None: WEIGHTSTREAM_PEER_TOKEN (which keeps it off the engine's command line).
    peer_token: Optional[str] = None
    #: Seconds a peer's connect, message or read may go without progress.
    peer_timeout: float = 30.0
    #: The checkpoint content digest (16 hex digits, as ``weightstream digest --hash xxh64``
    #: prints it) every peer of a peer:// model_uri must serve; None: any one content that
    #: all the peers agree on. A peer serving another or unknown (updated) content is
    #: refused before a byte lands, and the model's own sources are loaded instead.
    peer_expect_digest: Optional[str] = None
    #: "HOST:PORT": after its load each rank serves its bound parameters to pullers
    #: (peer://) at HOST, port PORT + its rank in the engine's world (PORT 0: a free port each).
    serve: str = ""
    #: "HOST:PORT" (or "PORT", on loopback): each rank serves Prometheus metrics of its loads
    #: (docs/METRICS.md) at HOST, port PORT + its rank in the engine's world (PORT 0: a free port each).
    metrics_listen: str = ""
    #: GB/s the rank's link (NIC, disk, bucket) is stated to carry: the metrics show the loads'
    #: achieved rate against it (weightstream_load_link_efficiency).
    link_rate: Optional[float] = None

    @classmethod
    def from_extra_config(cls, extra_config: Optional[Mapping[str, Any]]) -> "LoaderOptions":
        """Checks the keys and values at once, so a typo fails when the engine starts, not
        mid-load. Raises ValueError naming an unknown key and the accepted ones,
        weightstream.Error for a malformed value."""
        extra = dict(extra_config or {})
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"--model-loader-extra-config for --load-format weightstream: unknown key(s) "
                             f"{', '.join(unknown)} (accepted: {', '.join(EXTRA_CONFIG_KEYS)})")
        stream = {key: extra[key] for key in STREAM_OPTIONS if key in extra}
        resolve_options(**stream)  # raises for a malformed value
        model_uri = extra.get("model_uri") or ""
        if not isinstance(model_uri, str):
            raise ValueError(f"--model-loader-extra-config: model_uri must be a string, got {model_uri!r}")
        if model_uri:
            _core.source_kind(model_uri)  # raises naming a malformed URI or peer address
        peer_token = extra.get("peer_token")
        if peer_token is not None and not isinstance(peer_token, str):
            raise ValueError("--model-loader-extra-config: peer_token must be a string")  # never echoed
        peer_timeout = extra.get("peer_timeout", 30.0)
        if isinstance(peer_timeout, bool) or not isinstance(peer_timeout, (int, float)) or peer_timeout <= 0:
            raise ValueError(f"--model-loader-extra-config: peer_timeout must be seconds above 0, got {peer_timeout!r}")
        peer_expect_digest = extra.get("peer_expect_digest")
        if peer_expect_digest is not None:
            if not isinstance(peer_expect_digest, str) or not re.fullmatch(r"[0-9a-fA-F]{16}", peer_expect_digest):
                raise ValueError(f"--model-loader-extra-config: peer_expect_digest must be a content digest of 16 hex "
                                 f"digits (as `weightstream digest --hash xxh64` prints it), got {peer_expect_digest!r}")
            if not names_peers(model_uri):
                raise ValueError("--model-loader-extra-config: peer_expect_digest pins what the peers of a peer:// "
                                 f"model_uri serve, and model_uri is {model_uri!r}")
        serve = extra.get("serve") or ""
        if serve:
            serve_address(serve, 0)  # raises for a malformed HOST:PORT
        metrics_listen = str(extra.get("metrics_listen") or "")
        if metrics_listen:
            metrics.listen_address(metrics_listen, "--model-loader-extra-config: metrics_listen")
        link_rate = extra.get("link_rate")
        if link_rate is not None:
            if isinstance(link_rate, bool) or not isinstance(link_rate, (int, float)) or not 0 < link_rate < math.inf:
                raise ValueError(f"--model-loader-extra-config: link_rate must be GB/s above 0, got {link_rate!r}")
            if not metrics_listen:
                raise ValueError("--model-loader-extra-config: link_rate is shown in the metrics: it needs "
                                 "metrics_listen")
        return cls(stream=stream, model_uri=model_uri, peer_token=peer_token, peer_timeout=float(peer_timeout),
                   peer_expect_digest=peer_expect_digest, serve=serve, metrics_listen=metrics_listen,
                   link_rate=None if link_rate is None else float(link_rate))


def serve_address(serve: str, rank: int) -> str:
    """The address rank ``rank`` serves at for the extra-config key ``serve`` "HOST:PORT":
    PORT + rank (PORT 0: a free port). Raises ValueError for a malformed value or a port
    past 65535."""
    host, colon, port = serve.rpartition(":") if isinstance(serve, str) else ("", "", "")
    if not colon or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--model-loader-extra-config: serve must be HOST:PORT (PORT + rank for each rank, 0 for "
                         f"free ports), got {serve!r}")
    number = int(port) + rank if int(port) else 0
    if number > 65535:
        raise ValueError(f"--model-loader-extra-config: serve {serve}: rank {rank} would serve at port {number}, "
                         f"past 65535")
    return f"{host}:{number}"

"""Prometheus metrics of a Python process that loads or receives weights with weightstream
(docs/METRICS.md): the series ``weightstream load --metrics-listen`` and ``audit --via``
show, under the same names and labels, served by prometheus_client from a registry of their
own (an engine's own metrics, on its own port, are left alone).

    metrics = weightstream.metrics.serve("127.0.0.1:9400")   # or "9400": loopback only
    receiver = weightstream.UpdateReceiver(layout, "tcp", token=token, metrics=metrics)
    receiver.receive()   # each update applied shows in weightstream_update_*

The vLLM and SGLang loaders take ``metrics_listen`` (and ``link_rate``) in
``--model-loader-extra-config`` and record every load there (docs/VLLM.md).
"""

from __future__ import annotations

import itertools
import re
import threading
import time
import weakref
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from . import _core

#: Upper bounds of weightstream_update_duration_seconds' buckets, as the command's.
UPDATE_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: The readers' phases of a load (StreamStats), as weightstream_load_phase_seconds labels them.
LOAD_PHASES = ("read", "deliver", "staging_wait")


def listen_address(text: str, what: str = "metrics_listen") -> Tuple[str, int]:
    """(host, port) of ``HOST:PORT`` or a bare ``PORT`` (loopback: 127.0.0.1); port 0 picks a
    free one. Raises ValueError naming ``what`` and the text for anything else."""
    text = str(text)
    host, _, port = text.rpartition(":") if ":" in text else ("127.0.0.1", "", text)
    if ":" in text and not host:
        raise ValueError(f"{what} {text!r} is not HOST:PORT")
    if ":" in host:
        raise ValueError(f"{what} {text!r} is not HOST:PORT (an IPv6 address is not served from Python)")
    if not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
        raise ValueError(f"{what} {text!r} is not HOST:PORT or PORT with a port from 0 to 65535")
    return host, int(port)


def storage_kind(uri: str) -> str:
    """The ``source`` label of a checkpoint URI: file, s3, gs, az or peer."""
    for scheme in ("s3", "gs", "az", "peer"):
        if uri.startswith(scheme + "://"):
            return scheme
    if re.match(r"https://[^/]+\.blob\.core\.windows\.net/", uri):
        return "az"
    return "file"


def _import_prometheus() -> Any:
    try:
        import prometheus_client  # noqa: PLC0415
    except ImportError as error:
        raise _core.Error("weightstream.metrics needs prometheus_client (pip install prometheus_client)") from error
    return prometheus_client


class _ReceiverSeries:
    """The counters of the receivers watched (UpdateReceiver.stats), read at each scrape."""

    _SERIES = (
        ("weightstream_update_senders_accepted", "counter", "senders_accepted",
         "Senders that proved the token and were welcomed"),
        ("weightstream_update_connections_refused", "counter", "connections_refused",
         "Peers refused or dropped before an update"),
        ("weightstream_updates_started", "counter", "updates_started", "Updates whose START arrived"),
        ("weightstream_updates_failed", "counter", "updates_failed",
         "Updates started that failed, were cancelled or refused"),
        ("weightstream_update_in_progress", "gauge", "updating",
         "1 while an update is under way (START arrived, not ended)"),
    )

    def __init__(self) -> None:
        # Reentrant: a receiver collected while it is held retires itself on the same thread.
        self._lock = threading.RLock()
        #: Per receiver watched: a weak reference, its transport, and its counters when last read.
        self._watched: Dict[int, Tuple[weakref.ReferenceType, str, Dict[str, float]]] = {}
        #: Per transport: the counters of the receivers gone (a counter never goes back).
        self._retired: Dict[str, Dict[str, float]] = {}
        self._keys = itertools.count()

    def watch(self, receiver: Any, transport: str) -> int:
        """Watches ``receiver``; returns the key read() takes."""
        key = next(self._keys)
        with self._lock:
            self._watched[key] = (weakref.ref(receiver), transport, {})
        weakref.finalize(receiver, self._retire, key)
        return key

    def read(self, key: int) -> None:
        """Reads the receiver's counters now (it calls this as each receive() or refuse()
        ends, the only calls that change them): what it counted outlives it."""
        with self._lock:
            entry = self._watched.get(key)
            receiver = entry[0]() if entry is not None else None
            if receiver is not None:
                entry[2].update({name: float(value) for name, value in receiver.stats.items()})

    def _retire(self, key: int) -> None:
        with self._lock:
            entry = self._watched.pop(key, None)
            if entry is None:
                return
            _, transport, last = entry
            retired = self._retired.setdefault(transport, {})
            for _, kind, name, _ in self._SERIES:
                if kind == "counter":
                    retired[name] = retired.get(name, 0.0) + last.get(name, 0.0)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415

        with self._lock:
            for key in list(self._watched):
                self.read(key)
            totals = {transport: dict(values) for transport, values in self._retired.items()}
            for _, transport, last in list(self._watched.values()):
                by_transport = totals.setdefault(transport, {})
                for name, value in last.items():
                    by_transport[name] = by_transport.get(name, 0.0) + value
        for name, kind, key, help_text in self._SERIES:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_text,
                                                                                      labels=["transport"])
            for transport, values in totals.items():
                family.add_metric([transport], values.get(key, 0.0))
            yield family


class Metrics:
    """A ``/metrics`` endpoint of this process: prometheus_client's HTTP server on ``listen``
    (``HOST:PORT``, or a bare ``PORT`` on loopback; port 0 picks a free one) with the
    weightstream series. Raises ValueError for a malformed address, weightstream.Error naming
    the address when it cannot listen there (a port in use)."""

    def __init__(self, listen: str) -> None:
        prometheus = _import_prometheus()
        host, port = listen_address(listen)
        self.registry = prometheus.CollectorRegistry()
        try:
            self._server, self._thread = prometheus.start_http_server(port, addr=host, registry=self.registry)
        except OSError as error:
            raise _core.Error(f"cannot serve metrics on {host}:{port} (metrics_listen): {error.strerror or error}") \
                from error
        #: "HOST:PORT" it listens on (the port picked for port 0).
        self.address = f"{host}:{self._server.server_port}"
        self._lock = threading.Lock()
        self._receivers = _ReceiverSeries()
        self.registry.register(self._receivers)
        self._define_load_series(prometheus)
        self._define_update_series(prometheus)

    def _define_load_series(self, prometheus: Any) -> None:
        registry = self.registry
        source = ["source"]
        self._load_bytes = prometheus.Counter("weightstream_load_read_bytes", "Bytes the loads read from their source "
                                              "(storage or peers)", source, registry=registry)
        self._load_seconds = prometheus.Gauge("weightstream_load_duration_seconds", "Seconds the last load took",
                                              source, registry=registry)
        self._load_phases = prometheus.Gauge("weightstream_load_phase_seconds", "Seconds the last load's readers "
                                             "spent in each phase, summed over the reader threads",
                                             ["source", "phase"], registry=registry)
        self._storage_requests = prometheus.Counter("weightstream_storage_requests", "Requests the loads sent to "
                                                    "their object store", source, registry=registry)
        self._storage_retries = prometheus.Counter("weightstream_storage_retries", "Requests sent again after a "
                                                   "retryable failure", source, registry=registry)
        self._digest_failures = prometheus.Counter("weightstream_load_digest_failures", "Bytes that did not match "
                                                   "their digest or stored checksum", source, registry=registry)
        self._peer_bytes = prometheus.Counter("weightstream_load_peer_read_bytes", "Bytes the loads read from each "
                                              "serving peer", ["peer", "transport"], registry=registry)
        self._link_rate = prometheus.Gauge("weightstream_load_link_rate_bytes_per_second", "The rate the load's "
                                           "link is stated to carry (link_rate)", source, registry=registry)
        self._link_efficiency = prometheus.Gauge("weightstream_load_link_efficiency", "The last load's achieved "
                                                 "rate against the stated link rate", source, registry=registry)

    def _define_update_series(self, prometheus: Any) -> None:
        registry = self.registry
        transport = ["transport"]
        self._updates_completed = prometheus.Counter("weightstream_updates_completed", "Pushed updates applied whole",
                                                     transport, registry=registry)
        self._update_bytes = prometheus.Counter("weightstream_update_received_bytes", "Tensor bytes of the updates "
                                                "applied", transport, registry=registry)
        self._update_tensors = prometheus.Counter("weightstream_update_tensors", "Tensors of the updates applied",
                                                  transport, registry=registry)
        self._update_seconds = prometheus.Histogram("weightstream_update_duration_seconds", "Seconds from an "
                                                    "update's START to its end of finish()", transport,
                                                    buckets=UPDATE_SECONDS_BUCKETS, registry=registry)
        self._update_phases = prometheus.Counter("weightstream_update_phase_seconds", "Seconds the updates applied "
                                                 "spent in each phase", ["transport", "phase"], registry=registry)
        self._update_last = prometheus.Gauge("weightstream_update_last_completed_timestamp_seconds", "Unix time the "
                                             "last update was applied (0: none yet)", transport, registry=registry)

    def record_load(self, load: Mapping[str, Any], link_rate: Optional[float] = None) -> None:
        """Records one load from what it reported: ``source`` (its URI), ``seconds``,
        ``bytes_read`` or ``bytes_from_peers``, and where present ``stream`` (the stream's
        counters: the phases, storage requests, retries and checksum failures) and ``peers``
        (bytes from each peer). ``link_rate`` (GB/s) adds the achieved rate against it."""
        source = storage_kind(str(load.get("source", "")))
        stream: Mapping[str, Any] = load.get("stream") or {}
        read = int(load.get("bytes_from_peers" if source == "peer" else "bytes_read") or 0)
        seconds = float(load.get("seconds", 0.0))
        with self._lock:
            self._load_bytes.labels(source).inc(read)
            self._load_seconds.labels(source).set(seconds)
            if stream:
                for phase in LOAD_PHASES:
                    self._load_phases.labels(source, phase).set(float(stream.get(phase + "_seconds", 0.0)))
            self._storage_requests.labels(source).inc(int(stream.get("storage_requests", 0)))
            self._storage_retries.labels(source).inc(int(stream.get("storage_retries", 0)))
            self._digest_failures.labels(source).inc(int(stream.get("storage_checksum_failures", 0)) +
                                                     int(load.get("digest_failures", 0)))
            for peer in load.get("peers") or []:
                self._peer_bytes.labels(peer["address"], peer["transports"]).inc(int(peer["bytes"]))
            if link_rate:
                stated = float(link_rate) * 1e9
                self._link_rate.labels(source).set(stated)
                self._link_efficiency.labels(source).set(read / seconds / stated if seconds > 0 else 0.0)

    def watch_receiver(self, receiver: Any, transport: str) -> int:
        """Shows the receiver's own counters (senders, refusals, updates started and failed,
        one under way) at every scrape; once it is gone, what it counted stays in the totals.
        Returns the key of receiver_counted()."""
        with self._lock:
            for series in (self._updates_completed, self._update_bytes, self._update_tensors, self._update_last):
                series.labels(transport)
            self._update_seconds.labels(transport)
        return self._receivers.watch(receiver, transport)

    def receiver_counted(self, key: int) -> None:
        """Reads a watched receiver's counters now (UpdateReceiver calls it as each receive()
        and refuse() ends), so that they outlive it."""
        self._receivers.read(key)

    def update_completed(self, report: Mapping[str, Any], transport: str) -> None:
        """Records one update applied whole, from its report (UpdateReceiver.receive())."""
        with self._lock:
            self._updates_completed.labels(transport).inc()
            self._update_bytes.labels(transport).inc(int(report["bytes"]) + int(report.get("shared_bytes", 0)))
            self._update_tensors.labels(transport).inc(int(report["tensors"]))
            self._update_seconds.labels(transport).observe(float(report["seconds"]))
            for phase, seconds in (report.get("phases") or {}).items():
                self._update_phases.labels(transport, phase).inc(float(seconds))
            self._update_last.labels(transport).set(time.time())

    def close(self) -> None:
        """Stops the HTTP server; the address is free again."""
        self._server.shutdown()
        self._server.server_close()


def serve(listen: str) -> Metrics:
    """Starts a ``/metrics`` endpoint on ``listen`` (see Metrics)."""
    return Metrics(listen)


_by_listen: Dict[str, Metrics] = {}
_by_listen_lock = threading.Lock()


def serve_once(listen: str) -> Metrics:
    """The endpoint this process serves on ``listen``, started by the first call (an engine's
    loader records every load of the process, target and draft, in one place)."""
    with _by_listen_lock:
        if listen not in _by_listen:
            _by_listen[listen] = Metrics(listen)
        return _by_listen[listen]

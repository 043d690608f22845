"""weightstream.UpdateReceiver: the compiled receiver, with a ``metrics`` option."""

from __future__ import annotations

from typing import Any, Dict, Optional

from . import _core


class UpdateReceiver(_core.UpdateReceiver):
    """Listens (loopback by default) and applies pushed updates to a ModelLayout.

    A non-empty token (which senders must prove, never sent) is required;
    open_without_token=True accepts any sender instead (warned about on stderr). With
    ``metrics`` (a weightstream.metrics.Metrics), its counters show at every scrape and each
    update receive() applies is recorded there (weightstream_update_*, docs/METRICS.md).
    """

    def __init__(self, layout: Any, transport: str = "tcp", listen: str = "", token: str = "", timeout: float = 30.0,
                 device: str = "cpu", handshake_timeout: float = 3.0, *, open_without_token: bool = False,
                 metrics: Optional[Any] = None) -> None:
        super().__init__(layout, transport, listen, token, timeout, device, handshake_timeout,
                         open_without_token=open_without_token)
        self._transport = transport
        self._metrics = metrics
        self._metrics_key = metrics.watch_receiver(self, transport) if metrics is not None else None

    def receive(self, accept_timeout: float = 600.0) -> Dict[str, Any]:
        try:
            report = super().receive(accept_timeout)
        finally:
            self._counted()
        if self._metrics is not None:
            self._metrics.update_completed(report, self._transport)
        return report

    def refuse(self, reason: str, accept_timeout: float = 600.0) -> None:
        try:
            super().refuse(reason, accept_timeout)
        finally:
            self._counted()

    def _counted(self) -> None:
        if self._metrics is not None:
            self._metrics.receiver_counted(self._metrics_key)

"""JSONL span exporter: one JSON object per finished span, attributes flat."""

from __future__ import annotations

import json
import threading
from typing import IO, Any, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from tracer.privacy import open_private


def _hex(v: int | None, width: int) -> str | None:
    return None if v is None else format(v, f"0{width}x")


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """The JSONL form of a span (also used by tests and `report`)."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": _hex(ctx.trace_id, 32),
        "span_id": _hex(ctx.span_id, 16),
        "parent_span_id": _hex(parent.span_id, 16) if parent is not None else None,
        "kind": span.kind.name,
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "status": span.status.status_code.name,
        "status_message": span.status.description,
        "attributes": {k: (list(v) if isinstance(v, tuple) else v)
                       for k, v in (span.attributes or {}).items()},
        "events": [
            {"name": e.name, "time_unix_nano": e.timestamp,
             "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "resource": dict(span.resource.attributes) if span.resource else {},
    }


class JsonlSpanExporter(SpanExporter):
    """Writes spans to a file (or stream), one line each, flushed per batch."""

    def __init__(self, out: str | IO[str], flames: dict[int, Any] | None = None) -> None:
        """``out``: a path (created 0600: spans carry what clients sent) or a stream.
        ``flames``: span id -> its launch-site stacks (``ExportContext.flames``), written
        as the span's ``flame`` object (``tokentrace flame`` reads them back)."""
        self._own = isinstance(out, str)
        self.flames = flames
        self._f: IO[str] = (open_private(out, "w", encoding="utf-8") if isinstance(out, str)
                            else out)
        self._lock = threading.Lock()
        self.count = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            for s in spans:
                d = span_to_dict(s)
                if self.flames is not None:
                    flame = self.flames.pop(s.get_span_context().span_id, None)
                    if flame is not None:
                        d["flame"] = flame
                self._f.write(json.dumps(d, separators=(",", ":")) + "\n")
                self.count += 1
            self._f.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._own and not self._f.closed:
                self._f.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if not self._f.closed:
                self._f.flush()
        return True

"""Flame stacks from what a run left: a span JSONL file (``--jsonl`` of a run or replay
with stack sampling; each request span carries its stacks in a ``flame`` object) or a
capture, which is replayed here through the same analysis as ``tokentrace replay``."""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass, field
from typing import Any, Iterator

from tracer.correlate.stacks import from_json
from tracer.flame.model import Stack, merge


class FlameInputError(Exception):
    """The input cannot give the asked-for flame graph; the message says why."""


@dataclass
class Selection:
    """The stacks of the chosen spans, and what was chosen."""

    stacks: list[Stack] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    services: set[str] = field(default_factory=set)  # every service seen
    spans_with_flame: int = 0


def _is_capture(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(2)
        if head != b"\x1f\x8b":
            return False
        with gzip.open(path, "rb") as g:
            return b"tokentrace-capture" in g.readline(4096)
    except OSError as e:
        raise FlameInputError(f"cannot read {path}: {e.strerror or e}") from None


def spans_of(path: str) -> Iterator[dict[str, Any]]:
    """The span objects of a JSONL file, or of a capture replayed."""
    if _is_capture(path):
        yield from _replayed(path)
        return
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except OSError as e:
        raise FlameInputError(f"cannot read {path}: {e.strerror or e}") from None
    with f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "trace_id" in obj:
                yield obj


def _replayed(path: str) -> list[dict[str, Any]]:
    """Replay a capture (as ``tokentrace replay --jsonl``) into span objects."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from tracer.correlate.connections import TrackerOptions
    from tracer.events import capture
    from tracer.export.context import ExportContext
    from tracer.export.jsonl import JsonlSpanExporter
    from tracer.export.spans import SpanBuilder
    from tracer.pipeline import Pipeline

    try:
        reader = capture.CaptureReader(path)
    except (capture.CaptureError, OSError) as e:
        raise FlameInputError(str(e)) from None
    ctx = ExportContext(capture_id=str(reader.header.get("capture_id", "")),
                        host=str(reader.header.get("host", "")))
    ctx.flames = {}
    ctx.flame_source = path
    out = io.StringIO()
    sink = SpanBuilder(ctx, [SimpleSpanProcessor(JsonlSpanExporter(out, ctx.flames))])
    options = TrackerOptions(tenant_salt=capture.tenant_salt(reader.header),
                             secrets_masked=reader.header.get("secrets_masked") is True)
    pipeline = Pipeline([sink], ctx, options)
    try:
        for item in reader:
            pipeline.feed(item)
    finally:
        pipeline.close()
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


def select(path: str, request: str | None = None, service: str | None = None) -> Selection:
    """The stacks of the request whose trace (or span) id is ``request``, or of every
    request span of service ``service``."""
    sel = Selection()
    want = request.lower() if request else None
    for span in spans_of(path):
        svc = str((span.get("resource") or {}).get("service.name", ""))
        if svc:
            sel.services.add(svc)
        flame = span.get("flame")
        if flame is not None:
            sel.spans_with_flame += 1
        if want is not None:
            if want not in (span.get("trace_id"), span.get("span_id")):
                continue
        elif service is not None and (svc != service or span.get("kind") != "SERVER"):
            continue
        if flame is None:
            continue
        try:
            sel.stacks.extend(from_json(flame))
        except ValueError as e:
            raise FlameInputError(f"span {span.get('span_id')}: {e}") from None
        sel.spans.append(span)
    sel.stacks = merge(sel.stacks)
    if not sel.spans:
        if not sel.spans_with_flame:
            raise FlameInputError(
                f"{path}: no span carries launch-site stacks: trace with `--stacks` (and "
                "`--jsonl`), or give the capture of such a run")
        what = (f"request {request}" if request else f"service {service!r} (services: "
                + ", ".join(sorted(sel.services)) + ")")
        raise FlameInputError(f"{path}: no span with stacks for {what}")
    return sel

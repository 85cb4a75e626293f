"""Read a span JSONL file (``tokentrace run/replay --jsonl``) into report rows.

A bad line is counted and skipped, with its number and why (the first few are kept for
the message); the file as a whole fails only when it cannot be read or holds no span
at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tracer.report.rows import RowBuilder, is_request_span

MAX_EXAMPLES = 5


class ReportInputError(Exception):
    """The span file cannot be used at all (missing, unreadable, or not spans)."""


@dataclass
class LoadResult:
    """The rows of the request spans, and what was skipped on the way."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    lines: int = 0  # non-blank lines read
    spans: int = 0  # lines that were spans
    child_spans: int = 0  # queue/prefill/decode and other INTERNAL spans, skipped
    bad_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)  # "line N: why"
    bad_values: int = 0  # attribute values of the wrong type, left empty

    def bad(self, lineno: int, why: str) -> None:
        self.bad_lines += 1
        if len(self.bad_examples) < MAX_EXAMPLES:
            self.bad_examples.append(f"line {lineno}: {why}")

    def counts(self) -> dict[str, Any]:
        """The counters, for the JSON summary and the page."""
        return {"lines": self.lines, "spans": self.spans, "requests": len(self.rows),
                "child_spans_skipped": self.child_spans, "bad_lines": self.bad_lines,
                "bad_line_examples": list(self.bad_examples), "bad_values": self.bad_values}


def _why_not_a_span(obj: Any) -> str | None:
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not a span object"
    if not isinstance(obj.get("attributes"), dict):
        return "no 'attributes' object: not a span"
    for key in ("trace_id", "span_id"):
        if not isinstance(obj.get(key), str):
            return f"no '{key}': not a span"
    return None


def load_spans(path: str) -> LoadResult:
    """Rows for every request span in the JSONL file at ``path``."""
    out = LoadResult()
    builder = RowBuilder()
    try:
        f = open(path, encoding="utf-8", errors="replace")
    except OSError as e:
        raise ReportInputError(f"cannot read {path}: {e.strerror or e}") from None
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                out.lines += 1
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    out.bad(lineno, f"not JSON ({e.msg} at column {e.colno})")
                    continue
                why = _why_not_a_span(obj)
                if why:
                    out.bad(lineno, why)
                    continue
                out.spans += 1
                if not is_request_span(obj):
                    out.child_spans += 1
                    continue
                out.rows.append(builder.row(obj))
        except OSError as e:
            raise ReportInputError(f"cannot read {path}: {e.strerror or e}") from None
    out.bad_values = builder.bad_values
    if out.lines and not out.spans:
        raise ReportInputError(
            f"{path}: none of its {out.lines} line(s) is a span "
            f"({'; '.join(out.bad_examples)}); give the file written by "
            "`tokentrace run/replay --jsonl FILE` (a .ttcap capture needs `tokentrace "
            "replay CAPTURE --jsonl FILE` first)")
    return out

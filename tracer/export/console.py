"""The live console table: one row per finished request, a summary at exit."""

from __future__ import annotations

import statistics
import sys
import time
from typing import IO

from tracer.correlate.records import RequestRecord
from tracer.export.context import ExportContext

COLUMNS = (
    ("TIME", 12), ("PID", 7), ("TID", 7), ("REQUEST", 28), ("MODEL", 14), ("ST", 4),
    ("IN", 6), ("OUT", 6), ("TTFT", 9), ("TPOT", 9), ("DUR", 9),
)


def _ms(ns: float | None) -> str:
    if ns is None:
        return "-"
    ms = ns / 1e6
    return f"{ms:.1f}ms" if ms < 1000 else f"{ms / 1000:.2f}s"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


class ConsoleTable:
    """Prints requests as they finish. Plain fixed-width text: works in any terminal,
    pipe or log file."""

    def __init__(self, ctx: ExportContext, out: IO[str] | None = None) -> None:
        self.ctx = ctx
        self.out = out or sys.stdout
        self.rows = 0
        self._ttfts: list[float] = []
        self._durs: list[float] = []
        self._failed = 0
        self._tokens = 0

    def _line(self, cells: list[str]) -> str:
        return " ".join(_cut(c, w).ljust(w) for c, (_, w) in zip(cells, COLUMNS)).rstrip()

    def on_record(self, rec: RequestRecord) -> None:
        if self.rows == 0:
            self.out.write(self._line([name for name, _ in COLUMNS]) + "\n")
        self.rows += 1
        wall = (rec.end_ns + self.ctx.clock_offset_ns) / 1e9
        stamp = time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall * 1000) % 1000:03d}"
        q, r = rec.llm_request, rec.llm_response
        model = (q.model if q else None) or (r.model if r else None) or "-"
        status = str(rec.status) if rec.status is not None else "ERR"
        if rec.error:
            status = "ERR" if rec.status is None else f"{rec.status}!"
        cells = [
            stamp, str(rec.pid), str(rec.tids[0]) if rec.tids else "-",
            f"{rec.method} {rec.target.split('?', 1)[0]}", model, status,
            str(r.input_tokens) if r and r.input_tokens is not None else "-",
            str(r.output_tokens) if r and r.output_tokens is not None else "-",
            _ms(rec.ttft_ns), _ms(rec.tpot_ns), _ms(rec.end_ns - rec.start_ns),
        ]
        self.out.write(self._line(cells) + "\n")
        self.out.flush()
        if rec.ttft_ns is not None:
            self._ttfts.append(rec.ttft_ns / 1e6)
        self._durs.append((rec.end_ns - rec.start_ns) / 1e6)
        self._failed += rec.failed
        self._tokens += (r.output_tokens or 0) if r else 0

    def summary(self) -> str:
        if not self.rows:
            return "no requests seen"
        parts = [f"{self.rows} requests", f"{self._failed} failed",
                 f"{self._tokens} output tokens"]
        if self._ttfts:
            q = statistics.quantiles(self._ttfts, n=10) if len(self._ttfts) > 1 else [self._ttfts[0]] * 9
            parts.append(f"TTFT p50 {statistics.median(self._ttfts):.1f}ms p90 {q[8]:.1f}ms")
        parts.append(f"duration p50 {statistics.median(self._durs):.1f}ms")
        return ", ".join(parts)

    def close(self) -> None:
        self.out.flush()

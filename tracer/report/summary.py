"""Per-model and per-tenant summaries of report rows, and the price override.

Each statistic is over the rows that have the values it needs (a request without a
TTFT does not pull the percentiles to zero); when no row has them it is ``None``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import numpy as np

from tracer.correlate.cost import GpuPricing

SUMMARY_COLUMNS: dict[str, str] = {
    "requests": "request spans",
    "errors": "of them failed",
    "prompt_tokens": "sum of prompt tokens (requests that report them)",
    "output_tokens": "sum of output tokens",
    "ttft_p50_ms": "median time to first token of streamed requests, ms",
    "ttft_p95_ms": "95th percentile time to first token of streamed requests, ms",
    "whole_p50_ms": "median latency of non-streamed requests (their first token is the "
                    "whole reply), ms",
    "whole_p95_ms": "95th percentile latency of non-streamed requests, ms",
    "socket_wait_p50_ms": "median time requests waited in the socket before being read, ms",
    "socket_wait_p95_ms": "95th percentile of it (a saturated server: large), ms",
    "socket_wait_max_ms": "the longest of it, ms",
    "syscall_timed": "requests timed by the server's syscalls only (socket not seen)",
    "tls": "requests that came over TLS (read through the TLS probes)",
    "gpu_ms": "sum of GPU-ms charged",
    "gpu_ms_per_output_token": "GPU-ms / output tokens, over requests with both",
    "cost_usd_total": "sum of cost_usd",
    "cost_usd_mean": "mean cost_usd of the requests that have one",
    "priced_requests": "requests with a cost_usd",
}


def _values(rows: Iterable[dict[str, Any]], col: str) -> list[float]:
    return [r[col] for r in rows if r.get(col) is not None]


def _sum(vals: list[float]) -> float | None:
    return sum(vals) if vals else None  # ints stay ints (token counts)


def _percentiles(vals: list[float]) -> tuple[float | None, float | None]:
    return tuple(np.percentile(vals, [50, 95]).tolist()) if vals else (None, None)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``SUMMARY_COLUMNS`` statistics of ``rows``."""
    # a non-streamed request's "first token" is its whole reply: never mixed in with
    # streamed TTFTs (a request whose streaming is unknown counts as streamed)
    p50, p95 = _percentiles(_values((r for r in rows if r.get("stream") is not False), "ttft_ms"))
    w50, w95 = _percentiles(_values((r for r in rows if r.get("stream") is False), "e2e_ms"))
    both = [r for r in rows if r.get("gpu_ms") is not None and r.get("output_tokens")]
    out_tok = sum(r["output_tokens"] for r in both)
    cost = _values(rows, "cost_usd")
    waits = _values(rows, "socket_wait_ms")
    s50, s95 = _percentiles(waits)
    return {
        "requests": len(rows),
        "errors": sum(1 for r in rows if r.get("status") == "error"),
        "prompt_tokens": _sum(_values(rows, "prompt_tokens")),
        "output_tokens": _sum(_values(rows, "output_tokens")),
        "ttft_p50_ms": None if p50 is None else round(p50, 3),
        "ttft_p95_ms": None if p95 is None else round(p95, 3),
        "whole_p50_ms": None if w50 is None else round(w50, 3),
        "whole_p95_ms": None if w95 is None else round(w95, 3),
        "socket_wait_p50_ms": None if s50 is None else round(s50, 3),
        "socket_wait_p95_ms": None if s95 is None else round(s95, 3),
        "socket_wait_max_ms": round(max(waits), 3) if waits else None,
        "syscall_timed": sum(1 for r in rows if r.get("network_timing") == "syscall"),
        "tls": sum(1 for r in rows if r.get("tls") is not None),
        "gpu_ms": _sum(_values(rows, "gpu_ms")),
        "gpu_ms_per_output_token":
            round(sum(r["gpu_ms"] for r in both) / out_tok, 6) if out_tok else None,
        "cost_usd_total": _sum(cost),
        "cost_usd_mean": float(np.mean(cost)) if cost else None,
        "priced_requests": len(cost),
    }


def summarise_by(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """One summary per value of column ``key`` (``None`` is its own group), the most
    expensive group first, then the busiest."""
    groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r.get(key)].append(r)
    out = [{key: k, **summarise(g)} for k, g in groups.items()]
    out.sort(key=lambda s: (-(s["cost_usd_total"] or 0.0), -s["requests"], str(s[key])))
    return out


def reprice(rows: list[dict[str, Any]], pricing: GpuPricing) -> int:
    """Recompute the cost of every row with GPU-ms at ``pricing``; rows without GPU-ms
    are left as they are. Returns how many rows were repriced."""
    n = 0
    for r in rows:
        if r.get("gpu_ms") is None:
            continue
        r["price_per_gpu_hour"] = pricing.usd_per_gpu_hour
        r["price_source"] = f"report:{pricing.source}"
        r["gpu_model"] = pricing.model or r.get("gpu_model")
        r["cost_usd"] = round(pricing.cost_usd(r["gpu_ms"]), 9)
        n += 1
    return n

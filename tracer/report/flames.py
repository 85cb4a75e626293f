"""The report's flame graphs: where each service's GPU work was launched from, and the
requests that cost the most.

For span files whose request spans carry launch-site stacks (``run --stacks``), the
report writes next to report.html, under ``flame/``, one flame graph per service (the
sum of its requests) and one per most expensive request (by GPU time), each as HTML
(interactive), folded stacks and pprof; report.html shows them in frames (it keeps no
script of its own).
"""

from __future__ import annotations

import os
from typing import Any

TOP_FLAMES = 3  # requests drawn, by GPU time


def write_flames(spans_path: str, rows: list[dict[str, Any]], out_dir: str
                 ) -> list[dict[str, Any]]:
    """Write the flame graphs; returns what was drawn ({title, html, stacks, launches}),
    services first. Empty when no span carries stacks."""
    from tracer.correlate.stacks import from_json
    from tracer.flame.cli import write
    from tracer.flame.load import spans_of
    from tracer.flame.model import merge, totals

    by_service: dict[str, list[Any]] = {}
    flames: dict[str, list[Any]] = {}
    for span in spans_of(spans_path):
        flame = span.get("flame")
        if flame is None or span.get("kind") != "SERVER":
            continue
        try:
            stacks = from_json(flame)
        except ValueError:
            continue
        svc = str((span.get("resource") or {}).get("service.name", "?"))
        by_service.setdefault(svc, []).extend(stacks)
        # a trace with two GPU SERVER spans (a proxy and its engine) draws both
        flames.setdefault(str(span.get("trace_id")), []).extend(stacks)
    if not flames:
        return []
    out = os.path.join(out_dir, "flame")
    drawn = []
    for i, (svc, stacks) in enumerate(sorted(by_service.items())):
        merged = merge(stacks)
        files = write(out, f"service-{i}", merged, f"service {svc}")
        drawn.append({"title": f"service {svc}", "html": os.path.relpath(files["html"], out_dir),
                      "stacks": len(merged), **totals(merged)})
    top = sorted((r for r in rows if r.get("trace_id") in flames and r.get("gpu_ms")),
                 key=lambda r: -r["gpu_ms"])[:TOP_FLAMES]
    for r in top:
        tid = r["trace_id"]
        files = write(out, f"request-{tid[:16]}", flames[tid],
                      f"request {tid} ({r['gpu_ms']:.3f} GPU-ms)")
        drawn.append({"title": f"request {tid} ({r['gpu_ms']:.3f} GPU-ms)",
                      "html": os.path.relpath(files["html"], out_dir),
                      "stacks": len(flames[tid]), **totals(flames[tid])})
    return drawn

"""`tokentrace flame`: flame graphs of the code paths that launched GPU work, for one
request or for a whole service."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Draw the launch-site stacks of one request (--request TRACE_ID, or its span id) or of
every request of a service (--service NAME): Python frames (root first), the native
frames down to the CUDA or NCCL call, a '--' separator, and the kernel (or copy, NCCL
call, CUDA graph) on top, as wide as its GPU calls or its estimated GPU time. A request
gets the stacks of exactly the GPU work it was charged for (its share of each batched
step), so a service's flame graph is the sum of its requests'.

Input: the span JSONL of a run or replay made with --stacks, or its capture (replayed
here). Output, in DIR: NAME.folded (GPU calls), NAME.gpu_time.folded (ns),
NAME.samples.folded (Brendan Gregg's folded stacks), NAME.pb.gz (pprof: go tool pprof,
Parca, Pyroscope, Grafana), NAME.html (interactive: search, click to zoom) and NAME.json
(totals and stacks). See docs/flame.md.
"""
EPILOG = """\
examples:
  sudo tokentrace run --port 8000 --stacks --jsonl spans.jsonl --record cap.ttcap
  tokentrace flame spans.jsonl --request 4bf92f3577b34da6a3ce929d0e0e4736 -o slow-req
  tokentrace flame spans.jsonl --service transformers -o svc
  tokentrace flame cap.ttcap --service transformers -o svc    # the same, from the capture
  go tool pprof -http=: svc/flame.pb.gz
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("flame", help="flame graphs of the code that launched GPU work",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", metavar="SPANS-or-CAPTURE",
                   help="span JSONL (run/replay --jsonl with --stacks) or a capture file")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--request", metavar="TRACE_ID",
                   help="one request: its trace id (32 hex digits) or span id (16)")
    g.add_argument("--service", metavar="NAME", help="every request span of service NAME")
    p.add_argument("-o", "--output", default="flame", metavar="DIR",
                   help="directory for the files, created if needed (default: flame)")
    p.add_argument("--name", default="flame", metavar="NAME",
                   help="file name stem (default: flame)")
    p.add_argument("--metric", choices=("launches", "gpu_time", "samples"), default="launches",
                   help="the width the HTML page opens with (default: launches)")
    p.set_defaults(func=main)
    return p


def write(out_dir: str | Path, name: str, stacks: list[Any], title: str, meta: str = "",
          metric: str = "launches") -> dict[str, str]:
    """Every output file of one flame graph; returns kind -> path."""
    from tracer.flame import html, pprof
    from tracer.flame.model import folded, label, totals
    from tracer.privacy import open_private

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"folded": out / f"{name}.folded",
             "folded_gpu_time": out / f"{name}.gpu_time.folded",
             "folded_samples": out / f"{name}.samples.folded",
             "pprof": out / f"{name}.pb.gz", "html": out / f"{name}.html",
             "json": out / f"{name}.json"}
    for key, m in (("folded", "launches"), ("folded_gpu_time", "gpu_time"),
                   ("folded_samples", "samples")):
        with open_private(paths[key], "w") as f:
            f.write(folded(stacks, m))
    with open_private(paths["pprof"], "wb") as f:
        f.write(pprof.encode(stacks, comment=title))
    with open_private(paths["html"], "w", encoding="utf-8") as f:
        f.write(html.page(stacks, title, meta, metric))
    doc = {"title": title, "totals": totals(stacks),
           "stacks": [{"frames": [label(fr) for fr in frames], "launches": round(n, 4),
                       "gpu_time_ns": round(t, 1), "samples": round(s, 4)}
                      for frames, n, t, s in sorted(stacks, key=lambda st: -st[1])]}
    with open_private(paths["json"], "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return {k: str(v) for k, v in paths.items()}


def main(args: argparse.Namespace) -> int:
    from tracer.flame.load import FlameInputError, select

    os.umask(0o077)
    try:
        sel = select(args.input, request=args.request, service=args.service)
    except FlameInputError as e:
        print(f"tokentrace flame: error: {e}", file=sys.stderr)
        return 1
    if args.request:
        span = sel.spans[0]
        svc = (span.get("resource") or {}).get("service.name", "?")
        title = f"request {args.request} ({span.get('name', '')}, {svc})"
    else:
        title = f"service {args.service}: {len(sel.spans)} requests"
    files = write(args.output, args.name, sel.stacks, title, metric=args.metric)
    from tracer.flame.model import totals

    t = totals(sel.stacks)
    print(f"tokentrace flame: {title}: {len(sel.stacks)} stacks, {t['launches']:,.0f} GPU "
          f"calls, {t['gpu_time_ns'] / 1e6:,.3f} ms GPU time, {t['samples']:,.0f} samples",
          file=sys.stderr)
    for path in files.values():
        print(path)
    return 0

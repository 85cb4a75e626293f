"""`tokentrace report`: the command line (also ``python -m tracer.report``).

Heavy imports (numpy, matplotlib) wait until the command runs, so that
``tokentrace --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

FORMATS = ("csv", "json", "html")

DESCRIPTION = (
    "Per-request cost report from a span JSONL file (`tokentrace run/replay --jsonl`): "
    "one row per request (tokens, TTFT, GPU work, GPU-ms, cost) to requests.csv and "
    "requests.json, summaries by model and by tenant (by_model.csv, by_tenant.csv, "
    "summary.json), and report.html, a self-contained page with plots. With --summary "
    "(the file `run/replay --summary` wrote for the same run), a reconciliation per GPU "
    "process: its GPU time over the window, priced, against the requests' costs plus "
    "the unattributed and idle rest (reconciliation.csv/json and a table on the page). "
    "Child spans (queue, prefill, decode) are skipped; malformed lines are counted and "
    "skipped.")
EPILOG = """\
examples:
  tokentrace report spans.jsonl
  tokentrace report spans.jsonl -o out/report --format html
  tokentrace report spans.jsonl --summary summary.json   # does it add up to the GPU?
  tokentrace report spans.jsonl --gpu-price 2.10     # reprice at what you pay
  tokentrace report spans.jsonl --gpu-model a100-80gb
"""


def _formats(text: str) -> set[str]:
    got = {f.strip().lower() for f in text.split(",") if f.strip()}
    bad = got - set(FORMATS)
    if bad or not got:
        raise argparse.ArgumentTypeError(
            f"formats are a comma-separated list of {', '.join(FORMATS)}; got {text!r}")
    return got


def _price(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (v >= 0 and v != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0: {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `report` (shared by the subcommand and ``-m tracer.report``)."""
    p.add_argument("spans", metavar="SPANS.jsonl", help="span file from `run/replay --jsonl`")
    p.add_argument("-o", "--output", default="report", metavar="DIR",
                   help="directory for the report files, created if needed (default: report)")
    p.add_argument("--format", type=_formats, default=set(FORMATS), metavar="LIST",
                   help="comma-separated subset of csv,json,html (default: all)")
    p.add_argument("--summary", metavar="SUMMARY.json",
                   help="the run's --summary file: add the GPU reconciliation")
    g = p.add_argument_group("pricing (default: the cost on each span, as the tracer set it)")
    g.add_argument("--gpu-price", type=_price, metavar="USD",
                   help="recompute every cost at USD per GPU-hour")
    g.add_argument("--gpu-model", metavar="NAME",
                   help="recompute every cost at the default price of this GPU model "
                        "(e.g. h100-sxm, a100-80gb, l4; see docs/report.md)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `report` to the `tokentrace` subcommands; it runs ``main(args)``."""
    p = subparsers.add_parser("report", help="per-request cost report (CSV, JSON, HTML)",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=main)
    return p


def _say(msg: str) -> None:
    print(f"tokentrace report: {msg}", file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    """Run the report; 0 on success, 1 when the input cannot be used."""
    from tracer.correlate.cost import GpuDetection, GpuPricing
    from tracer.report.load import ReportInputError, load_spans
    from tracer.report.summary import reprice, summarise, summarise_by
    from tracer.report.tables import write_tables

    try:
        loaded = load_spans(args.spans)
    except ReportInputError as e:
        _say(f"error: {e}")
        return 1
    if loaded.bad_lines:
        _say(f"warning: skipped {loaded.bad_lines} malformed line(s) of {loaded.lines}: "
             + "; ".join(loaded.bad_examples)
             + ("; ..." if loaded.bad_lines > len(loaded.bad_examples) else ""))
    if loaded.bad_values:
        _say(f"warning: {loaded.bad_values} attribute value(s) of the wrong type left empty")
    if not loaded.rows:
        _say(f"warning: no request spans in {args.spans} "
             f"({loaded.spans} span(s), {loaded.child_spans} of them child spans)")
    meta: dict[str, Any] = {"source": os.path.basename(args.spans),
                            "input": loaded.counts(), "pricing": None}
    if args.gpu_price is not None or args.gpu_model:
        # the GPU of the machine making the report is not the one that served
        pricing = GpuPricing.resolve(price=args.gpu_price, model=args.gpu_model,
                                     detect=lambda: GpuDetection())
        n = reprice(loaded.rows, pricing)
        meta["pricing"] = pricing.describe()
        _say(f"repriced {n} request(s) with GPU time at {pricing.describe()}")
    rows = loaded.rows
    by_model, by_tenant = summarise_by(rows, "model"), summarise_by(rows, "tenant")
    totals = summarise(rows)
    recon: list[dict[str, Any]] | None = None
    if getattr(args, "summary", None):
        from tracer.report.reconcile import SummaryError, load_summary, reconcile_rows
        try:
            recon = reconcile_rows(load_summary(args.summary), rows, args.gpu_price,
                                   args.gpu_model if args.gpu_price is not None else None)
        except SummaryError as e:
            _say(f"error: {e}")
            return 1
        meta["reconciliation"] = recon
    try:
        os.makedirs(args.output, exist_ok=True)
        written = write_tables(args.output, rows, by_model, by_tenant, totals, meta,
                               args.format)
        if recon is not None:
            written += _write_reconciliation(args.output, recon, args.format)
        if "html" in args.format:
            from tracer.report.flames import write_flames
            from tracer.report.page import render

            meta["flames"] = write_flames(args.spans, rows, args.output)

            path = os.path.join(args.output, "report.html")
            with open(path, "w", encoding="utf-8") as f:
                f.write(render(rows, by_model, by_tenant, totals, meta))
            written.append(path)
    except OSError as e:
        _say(f"error: cannot write the report to {args.output}: {e}")
        return 1
    cost = totals["cost_usd_total"]
    wait = totals["socket_wait_p95_ms"]
    _say(f"{len(rows)} request(s), {loaded.child_spans} child span(s) skipped"
         + (f", total cost ${cost:.6f}" if cost is not None else ", no costs on the spans")
         + (f", socket wait p95 {wait:.1f} ms" if wait is not None else "")
         + (f", {totals['syscall_timed']} timed by syscalls only"
            if totals["syscall_timed"] else "")
         + (f", {totals['tls']} over TLS" if totals.get("tls") else "")
         + f"; wrote {', '.join(written)}")
    return 0


def _write_reconciliation(out_dir: str, recon: list[dict[str, Any]], formats: set[str]
                          ) -> list[str]:
    from tracer.report.reconcile import RECON_COLUMNS
    from tracer.report.tables import write_csv, write_json
    written = []
    if "csv" in formats:
        path = os.path.join(out_dir, "reconciliation.csv")
        write_csv(path, recon, list(RECON_COLUMNS))
        written.append(path)
    if "json" in formats:
        path = os.path.join(out_dir, "reconciliation.json")
        write_json(path, recon)
        written.append(path)
    return written


def standalone(argv: list[str] | None = None) -> int:
    """``python -m tracer.report``: the same command without the `tokentrace` front."""
    p = argparse.ArgumentParser(prog="tokentrace report", description=DESCRIPTION,
                                epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    try:
        return main(p.parse_args(argv))
    except BrokenPipeError:
        return 0

"""report.html: one self-contained page, plots as inline SVG (matplotlib), no scripts
no styles or fonts fetched from anywhere (text in the plots is drawn as paths)."""

from __future__ import annotations

import html
import io
import re
from collections import defaultdict
from typing import Any, Callable

from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from tracer.report.summary import SUMMARY_COLUMNS

MAX_SERIES = 8  # models in a legend; the rest are drawn as "other"
MAX_BARS = 15  # tenants in the bar chart; the rest are summed as "other"
# Above this many points a scatter is embedded as a PNG inside the SVG (a data: URI,
# still self-contained): as vectors, 50,000 points make an 11 MB page.
RASTER_ABOVE = 2000
NONE_LABEL = "(none)"
TOP_REQUESTS = 10
_TOP_COLUMNS = {"trace_id": "find it in Jaeger", "model": "", "tenant": "",
                "prompt_tokens": "", "output_tokens": "", "ttft_ms": "", "e2e_ms": "",
                "gpu_ms": "", "cost_usd": "", "attribution": ""}


def _label(v: Any) -> str:
    return NONE_LABEL if v is None or v == "" else str(v)


def _top_keys(rows: list[dict[str, Any]], key: str, n: int) -> set[str]:
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        counts[_label(r.get(key))] += 1
    return set(sorted(counts, key=lambda k: (-counts[k], k))[:n])


def _series(rows: list[dict[str, Any]], x: str, y: str) -> dict[str, tuple[list, list]]:
    """Per model (top MAX_SERIES, then "other"): the (x, y) points of rows having both."""
    top = _top_keys(rows, "model", MAX_SERIES)
    out: dict[str, tuple[list, list]] = {}
    for r in rows:
        if r.get(x) is None or r.get(y) is None:
            continue
        m = _label(r.get("model"))
        xs, ys = out.setdefault(m if m in top else "other", ([], []))
        xs.append(r[x])
        ys.append(r[y])
    return out


def _scatter(ax: Axes, series: dict[str, tuple[list, list]]) -> None:
    raster = sum(len(xs) for xs, _ in series.values()) > RASTER_ABOVE
    for m, (xs, ys) in sorted(series.items()):
        ax.scatter(xs, ys, s=14, label=m, rasterized=raster)
    ax.legend(fontsize="small")


def _empty(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no request has {what}", ha="center", va="center",
            transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def plot_cost_per_request(ax: Axes, rows: list[dict[str, Any]]) -> None:
    """Cost of each request over time, one colour per model."""
    t0 = min((r["start_time_unix_nano"] for r in rows if r.get("start_time_unix_nano")),
             default=0)
    pts = [dict(r, t_s=(r["start_time_unix_nano"] - t0) / 1e9)
           for r in rows if r.get("start_time_unix_nano")]
    series = _series(pts, "t_s", "cost_usd")
    if not series:
        return _empty(ax, "a cost (tokentrace.cost.usd)")
    _scatter(ax, series)
    ax.set_xlabel("request start, s after the first")
    ax.set_ylabel("cost, USD")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))


def plot_ttft_vs_prompt(ax: Axes, rows: list[dict[str, Any]]) -> None:
    """Time to first token of streamed requests against prompt length, one colour per
    model (a non-streamed request's first token is its whole reply)."""
    series = _series([r for r in rows if r.get("stream") is not False],
                     "prompt_tokens", "ttft_ms")
    if not series:
        return _empty(ax, "both a TTFT and a prompt token count")
    _scatter(ax, series)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, ms")


def plot_gpu_ms_per_token(ax: Axes, rows: list[dict[str, Any]]) -> None:
    """Distribution of GPU-ms per output token, one box per model."""
    series = _series(rows, "gpu_ms_per_output_token", "gpu_ms_per_output_token")
    if not series:
        return _empty(ax, "GPU-ms and output tokens")
    names = sorted(series)
    ax.boxplot([series[m][0] for m in names])
    ax.set_xticks(range(1, len(names) + 1), names, rotation=20, ha="right")
    ax.set_ylabel("GPU-ms per output token")


def plot_cost_by_tenant(ax: Axes, by_tenant: list[dict[str, Any]]) -> None:
    """Total cost per tenant, largest first (the rest summed as "other")."""
    priced = [s for s in by_tenant if s.get("cost_usd_total") is not None]
    if not priced:
        return _empty(ax, "a cost (tokentrace.cost.usd)")
    bars = [(_label(s["tenant"]), s["cost_usd_total"]) for s in priced[:MAX_BARS]]
    rest = sum(s["cost_usd_total"] for s in priced[MAX_BARS:])
    if rest:
        bars.append(("other", rest))
    bars.reverse()  # barh draws bottom-up: largest on top
    ax.barh([b[0] for b in bars], [b[1] for b in bars])
    ax.set_xlabel("total cost, USD")
    ax.ticklabel_format(axis="x", style="sci", scilimits=(-3, 3))


def svg_of(name: str, draw: Callable[[Axes], None]) -> str:
    """A figure drawn by ``draw`` as an inline ``<svg>`` element (no XML prolog,
    DOCTYPE or metadata; ids salted with ``name`` so several plots share a page)."""
    with rc_context({"svg.fonttype": "path", "svg.hashsalt": f"tokentrace-{name}"}):
        fig = Figure(figsize=(7, 4), layout="constrained")
        draw(fig.add_subplot())
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    return re.sub(r"\s*<metadata>.*?</metadata>", "", svg, flags=re.S)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.1f}"
        # small costs matter: keep 4 significant digits below 1
        return f"{v:,.3f}".rstrip("0").rstrip(".") if abs(v) >= 1 else f"{v:.4g}"
    return str(v)


def _table(rows: list[dict[str, Any]], columns: dict[str, str],
           titles: dict[str, str] | None = None) -> str:
    """An HTML table of ``rows``; ``columns``: name -> header tooltip; ``titles``: a
    tooltip for the first cell of a row, by its value."""
    head = "".join(f'<th title="{html.escape(d)}">{html.escape(c)}</th>'
                   for c, d in columns.items())

    def first(r: dict[str, Any], c: str) -> str:
        v = _label(r.get(c))
        tip = (titles or {}).get(str(r.get(c)))
        return (f'<td title="{html.escape(tip)}">{html.escape(v)}</td>' if tip
                else f"<td>{html.escape(v)}</td>")
    body = "".join(
        "<tr>" + "".join(first(r, c) if i == 0 else f"<td>{html.escape(_fmt(r.get(c)))}</td>"
                         for i, c in enumerate(columns)) + "</tr>\n"
        for r in rows)
    return (f'<div class="scroll"><table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n'
            f"{body}</tbody>\n</table></div>")


# Wide tables scroll inside their own box (never the page), headers wrap, and the first
# column (the row's name) stays in view while scrolling sideways.
_STYLE = """body{font-family:sans-serif;margin:2em auto;max-width:1100px;padding:0 1em}
.scroll{overflow-x:auto;max-width:100%;margin:1em 0;border:1px solid #eee}
table{border-collapse:collapse;font-size:90%}td,th{border:1px solid #ccc;padding:3px 6px;
text-align:right;white-space:nowrap}th{white-space:normal;overflow-wrap:anywhere;
min-width:5em;max-width:9em;vertical-align:bottom;background:#f6f6f6}td:first-child,th:first-child{text-align:left;
font-family:monospace;position:sticky;left:0;background:#fff;max-width:22em;
overflow:hidden;text-overflow:ellipsis}th:first-child{background:#f6f6f6}
tr.bad td{background:#fde8e8}figure{margin:1em 0}svg{max-width:100%;height:auto}
.note{color:#555}"""


def _flames(flames: list[dict[str, Any]]) -> str:
    """The launch-site flame graphs (``tracer/report/flames.py``), each in a frame: the
    flame graph pages are scripts of their own, this page stays without."""
    if not flames:
        return ""
    parts = ['<h2>Where the GPU work was launched from</h2>\n<p class="note">Python and '
             "native frames, then the kernel (or copy, NCCL call) on top, as wide as its GPU "
             "calls; each request gets the stacks of the work it was charged for. Click to "
             "zoom, search by name; files beside this page (folded stacks, pprof).</p>"]
    for f in flames:
        src = html.escape(f["html"])
        parts.append(f'<h3>{html.escape(f["title"])}: {f["launches"]:,.0f} GPU calls, '
                     f'{f["gpu_time_ns"] / 1e6:,.3f} ms</h3>\n<p><a href="{src}">open</a></p>\n'
                     f'<iframe src="{src}" title="{html.escape(f["title"])}" '
                     'style="width:100%;height:520px;border:1px solid #ccc"></iframe>')
    return "\n".join(parts)


def render(rows: list[dict[str, Any]], by_model: list[dict[str, Any]],
           by_tenant: list[dict[str, Any]], totals: dict[str, Any],
           meta: dict[str, Any]) -> str:
    """The whole report page."""
    plots = [
        ("cost-per-request", "Cost per request", lambda ax: plot_cost_per_request(ax, rows)),
        ("ttft-vs-prompt", "Time to first token vs prompt length (streamed requests)",
         lambda ax: plot_ttft_vs_prompt(ax, rows)),
        ("gpu-ms-per-token", "GPU-ms per output token by model",
         lambda ax: plot_gpu_ms_per_token(ax, rows)),
        ("cost-by-tenant", "Cost by tenant", lambda ax: plot_cost_by_tenant(ax, by_tenant)),
    ]
    figures = "\n".join(
        f'<figure id="{pid}">\n{svg_of(pid, draw)}\n'
        f"<figcaption>{html.escape(title)}</figcaption>\n</figure>"
        for pid, title, draw in plots)
    counts = meta["input"]
    notes = [f"{counts['requests']} requests from {html.escape(meta['source'])}; "
             f"{counts['child_spans_skipped']} child spans skipped"]
    if counts["bad_lines"]:
        notes.append(f"{counts['bad_lines']} malformed line(s) skipped: "
                     + html.escape("; ".join(counts["bad_line_examples"])))
    if counts["bad_values"]:
        notes.append(f"{counts['bad_values']} attribute value(s) of the wrong type left empty")
    if meta.get("pricing"):
        notes.append("costs recomputed at " + html.escape(meta["pricing"]))
    total_cols = {"": "all requests", **SUMMARY_COLUMNS}
    recon = meta.get("reconciliation")
    if recon is None:
        recon_html = ('<p class="note">Run <code>tokentrace run/replay --summary FILE</code> '
                      "and pass <code>--summary FILE</code> to reconcile the requests' costs "
                      "with the GPU time observed.</p>")
    else:
        from tracer.report.reconcile import RECON_COLUMNS
        # one column per GPU process, one row per figure: it reads down like a bill
        rows_t = [{"": k, **{f"pid {r.get('pid')}": r.get(k) for r in recon}}
                  for k in RECON_COLUMNS if k != "pid"]
        cols = {"": "", **{f"pid {r.get('pid')}": "GPU process" for r in recon}}
        recon_html = ('<p class="note">Per GPU process over its window: window = requests '
                      "+ unattributed + idle, in GPU time and in money; a balance other "
                      "than 0 means the span file is not the whole run.</p>"
                      + _table(rows_t, cols, titles={k: v for k, v in RECON_COLUMNS.items()}))
    top = sorted((r for r in rows if r.get("cost_usd") is not None),
                 key=lambda r: -r["cost_usd"])[:TOP_REQUESTS]
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>tokentrace cost report</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>tokentrace cost report</h1>
{"".join(f'<p class="note">{n}</p>' for n in notes)}
<h2>All requests</h2>
{_table([{"": "all", **totals}], total_cols)}
<h2>Reconciliation with the GPU</h2>
{recon_html}
<h2>Plots</h2>
{figures}
<h2>By model</h2>
{_table(by_model, {"model": "gen_ai.request.model", **SUMMARY_COLUMNS})}
<h2>By tenant</h2>
{_table(by_tenant, {"tenant": "hashed API key", **SUMMARY_COLUMNS})}
<h2>Most expensive requests</h2>
{_table(top, _TOP_COLUMNS)}
{_flames(meta.get("flames") or [])}
</body>
</html>
"""

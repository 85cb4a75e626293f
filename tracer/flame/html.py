"""A self-contained interactive flame graph page, drawn by d3-flame-graph.

d3 and d3-flame-graph (from the npm registry, licenses in ``vendor/``) are inlined, so
the page works offline and can be mailed or attached to a ticket. It shows one width at
a time (GPU calls, estimated GPU time, or raw samples; a selector switches), searches
frames by text (matches highlighted, their share shown), zooms on click, and colours
frames by kind: Python, native, the separator, and the GPU work on top.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from typing import Any, Iterable

from tracer.flame.model import METRICS, Stack, totals, tree

VENDOR = ("d3.v7.9.2.min.js", "d3-flamegraph.v5.0.0.umd.min.js")

_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{title}</title>
<style>
body {{ font-family: Verdana, sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 18px; margin: 0 0 4px 0; }}
.meta {{ font-size: 12px; color: #555; margin-bottom: 8px; }}
.bar {{ font-size: 13px; margin: 8px 0; }}
.bar input, .bar select, .bar button {{ font-size: 13px; margin-right: 6px; }}
.legend span {{ display: inline-block; padding: 1px 6px; margin-right: 6px; border-radius: 3px;
  font-size: 12px; }}
#details {{ font-size: 12px; min-height: 18px; color: #333; white-space: pre-wrap; }}
#chart {{ width: 100%; }}
</style>
{scripts}
</head><body>
<h1>{title}</h1>
<div class="meta">{meta}</div>
<div class="bar">
 width: <select id="metric">{options}</select>
 <input id="term" type="text" placeholder="search frames" size="30">
 <button id="search">search</button><button id="clear">clear</button>
 <button id="reset">reset zoom</button>
 <span class="legend"><span style="background:#9ecae1">Python</span><span
  style="background:#fdae6b">native</span><span style="background:#d9d9d9">separator</span><span
  style="background:#74c476">GPU work</span></span>
</div>
<div id="details"></div>
<div id="chart"></div>
<script>
const TREES = {trees};
const UNITS = {units};
const COLORS = {{py: "#9ecae1", native: "#fdae6b", sep: "#d9d9d9", gpu: "#74c476",
                 root: "#bdbdbd"}};
let chart = null;
function fmt(x) {{ return (Math.round(x * 1000) / 1000).toLocaleString(); }}
function describe(d) {{
  const w = d.data.w || [0, 0, 0];
  return d.data.name + "\\n" + fmt(w[0]) + " GPU calls, " + fmt(w[1]) + " ms GPU time, "
    + fmt(w[2]) + " samples";
}}
function draw(metric) {{
  document.getElementById("chart").innerHTML = "";
  const width = Math.max(600, document.getElementById("chart").clientWidth);
  chart = flamegraph.default().width(width).cellHeight(18).minFrameSize(1)
    .transitionDuration(300).sort(true).title("")
    .setColorMapper((d, original) => d.highlight ? "#e600e6" : (COLORS[d.data.k] || original))
    .setLabelHandler(describe)
    .setDetailsElement(document.getElementById("details"));
  const tip = flamegraph.tooltip.defaultFlamegraphTooltip().text(describe);
  chart.tooltip(tip);
  d3.select("#chart").datum(TREES[metric]).call(chart);
  const d = document.getElementById("details");
  d.textContent = "total: " + fmt(TREES[metric].value) + " " + UNITS[metric];
}}
document.getElementById("metric").addEventListener("change", e => draw(e.target.value));
document.getElementById("search").addEventListener("click",
  () => chart.search(document.getElementById("term").value));
document.getElementById("term").addEventListener("keyup", e => {{
  if (e.key === "Enter") chart.search(e.target.value); }});
document.getElementById("clear").addEventListener("click", () => {{
  document.getElementById("term").value = ""; chart.clear(); }});
document.getElementById("reset").addEventListener("click", () => chart.resetZoom());
draw("{first}");
</script>
</body></html>
"""


def _vendor(name: str) -> str:
    return resources.files("tracer.flame").joinpath("vendor", name).read_text(encoding="utf-8")


def _json(obj: Any) -> str:
    """JSON safe inside a <script> element."""
    return (json.dumps(obj, separators=(",", ":")).replace("</", "<\\/")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def page(stacks: Iterable[Stack], title: str, meta: str = "",
         metric: str = "launches") -> str:
    """The HTML document."""
    stacks = list(stacks)
    t = totals(stacks)
    trees = {m: tree(stacks, m, root="all") for m in METRICS}
    units = {"launches": "GPU calls", "gpu_time": "ms of estimated GPU time",
             "samples": "stack samples"}
    # d3-flame-graph draws values as given: GPU time in ms reads better than ns
    _scale(trees["gpu_time"], 1e-6)
    labels = {"launches": "GPU calls (launches, copies, NCCL)",
              "gpu_time": "estimated GPU time", "samples": "stack samples"}
    options = "".join(f'<option value="{m}"{" selected" if m == metric else ""}>{labels[m]}'
                      "</option>" for m in METRICS)
    scripts = "".join(f"<script>{_vendor(v)}</script>\n" for v in VENDOR)
    summary = (f"{t['launches']:,.0f} GPU calls, {t['gpu_time_ns'] / 1e6:,.3f} ms estimated "
               f"GPU time, {t['samples']:,.0f} stack samples")
    return _PAGE.format(title=html.escape(title), meta=html.escape(
        summary + (". " + meta if meta else "")), scripts=scripts, options=options,
        trees=_json(trees), units=_json(units), first=metric)


def _scale(node: dict, by: float) -> None:
    node["value"] = node["value"] * by
    for c in node.get("children", ()):
        _scale(c, by)

"""The flame graph's data: stacks of frames with three widths, and their labels.

A stack is (frames root first, launches, GPU time ns, samples). Frames are
(kind, name, file, line) with kind ``py`` (a Python function), ``native`` (a native
function, file = its library), ``sep`` (the separator between the CPU code path and
the GPU work) or ``gpu`` (the kernel, or ``[memcpy DtoH]``, ``[nccl allreduce]``...).
``launches`` counts GPU calls: kernel and graph launches, copies, NCCL calls.
"""

from __future__ import annotations

import re
from typing import Iterable

Frame = tuple[str, str, str, int]
Stack = tuple[tuple[Frame, ...], float, float, float]
METRICS = {"launches": 1, "gpu_time": 2, "samples": 3}
METRIC_UNITS = {"launches": "GPU calls", "gpu_time": "ns of GPU time", "samples": "samples"}
_SITE = re.compile(r"/(?:site|dist)-packages/(.+)$")
_STDLIB = re.compile(r"/lib/python3\.\d+/(.+)$")


def short_path(path: str) -> str:
    """A file as a person recognises it: the package path under site-packages (or the
    standard library), else its last two components."""
    for pattern in (_SITE, _STDLIB):
        m = pattern.search(path)
        if m:
            return m.group(1)
    parts = path.rsplit("/", 2)
    return "/".join(parts[-2:]) if len(parts) > 2 else path


def label(frame: Frame) -> str:
    """One frame as a flame graph names it."""
    kind, name, file, line = frame
    if kind == "py":
        where = short_path(file) + (f":{line}" if line else "")
        return f"{name} ({where})"
    if kind == "native":
        if not file or name.startswith(file) or name.startswith("["):
            return name
        return f"{name} ({file})"
    return name


def merge(stacks: Iterable[Stack]) -> list[Stack]:
    """Identical stacks added up (order of first appearance kept)."""
    out: dict[tuple[Frame, ...], list[float]] = {}
    for frames, n, t, s in stacks:
        cur = out.setdefault(tuple(tuple(f) for f in frames), [0.0, 0.0, 0.0])  # type: ignore[misc]
        cur[0] += n
        cur[1] += t
        cur[2] += s
    return [(k, v[0], v[1], v[2]) for k, v in out.items()]


def totals(stacks: Iterable[Stack]) -> dict[str, float]:
    n = t = s = 0.0
    for _f, a, b, c in stacks:
        n += a
        t += b
        s += c
    return {"launches": n, "gpu_time_ns": t, "samples": s}


def tree(stacks: Iterable[Stack], metric: str = "launches", root: str = "all") -> dict:
    """The d3-flame-graph hierarchy: {name, value, k (frame kind), children}, where a
    node's value is its stacks' total of ``metric``; every node also carries all three
    widths (``w``: launches, GPU ms, samples) for the tooltip."""
    idx = METRICS[metric]
    top: dict = {"name": root, "value": 0.0, "k": "root", "w": [0.0, 0.0, 0.0], "c": {}}
    for st in stacks:
        frames = st[0]
        v = st[idx]
        w = (st[1], st[2] / 1e6, st[3])
        node = top
        node["value"] += v
        node["w"] = [a + b for a, b in zip(node["w"], w)]
        for f in frames:
            name = label(f)
            child = node["c"].get(name)
            if child is None:
                child = node["c"][name] = {"name": name, "value": 0.0, "k": f[0],
                                           "w": [0.0, 0.0, 0.0], "c": {}}
            child["value"] += v
            child["w"] = [a + b for a, b in zip(child["w"], w)]
            node = child

    def finish(node: dict) -> dict:
        kids = [finish(c) for c in node.pop("c").values() if c["value"] > 0]
        node["value"] = round(node["value"], 6)
        node["w"] = [round(x, 6) for x in node["w"]]
        if kids:
            node["children"] = kids
        return node

    return finish(top)


def folded(stacks: Iterable[Stack], metric: str = "launches") -> str:
    """Brendan Gregg's folded format: ``frame;frame;...;kernel WIDTH`` per line. Widths
    are whole numbers where they are (shares of a shared step are fractions, kept to
    3 decimals: flamegraph.pl, speedscope and inferno read them)."""
    idx = METRICS[metric]
    lines = []
    for st in merge(stacks):
        v = st[idx]
        if v <= 0:
            continue
        names = ";".join(label(f).replace(";", ":") for f in st[0])
        text = str(int(round(v))) if abs(v - round(v)) < 1e-6 else f"{v:.3f}"
        lines.append(f"{names} {text}")
    lines.sort()
    return "\n".join(lines) + ("\n" if lines else "")

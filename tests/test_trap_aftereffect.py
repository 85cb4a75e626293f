"""bench/trap_aftereffect.py on a real uprobe: the probe fires once per call of its
target in the traced slices (twice with the return probe) and never in the untraced
ones, and the per-call numbers come out of the pairs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import trap_aftereffect as ta

pytestmark = pytest.mark.bpf


def test_the_probe_fires_per_call_in_traced_slices_only(tmp_path: Path) -> None:
    out = tmp_path / "trap.json"
    assert ta.main(["--slices", "2", "--slice-s", "0.3", "--settle-s", "0.05",
                    "--work-objs", "40", "--set-objs", "2000", "--cpu", "1",
                    "--modes", "uprobe,uretprobe", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for mode, per_call in (("uprobe", 1.0), ("uretprobe", 2.0)):
        r = doc["modes"][mode]
        assert r["pairs"] == 2
        # iterations and hits are read a moment apart: within a few calls of exact
        assert r["hits_per_call"] == pytest.approx(per_call, rel=0.02), r
        assert r["untraced_iteration_us"] > 0
        assert all(math.isfinite(r[k][e]) for k in ("wall_us", "cpu_us", "sys_us", "user_us")
                   for e in ("mean", "lo", "hi")), r
    untraced = [s for s in doc["slices"] if s["mode"] == "off"]
    assert len(untraced) == 4 and all(s["hits"] == 0 and s["iters"] > 0 for s in untraced)

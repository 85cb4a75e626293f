"""A recorded capture with launch-site stacks, replayed without BPF: HF ``transformers
serve --continuous-batching`` on a CPU with its PyTorch ops calling the stand-in
libcuda (``bench/flame.py --device cpu``, samples/hf/cudashim), attached after start.
Its requests share every engine step, so each request's stacks are its share of the
steps it was in; the service's flame graph is their sum, and HF's own modeling
functions carry the kernels their ops launched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tracer.correlate.stacks import from_json
from tracer.flame.load import select, spans_of

CAPTURE = Path(__file__).resolve().parents[1] / "samples" / "captures" / "hf-cb-cpu-stacks.ttcap"


@pytest.fixture(scope="module")
def spans():
    return list(spans_of(str(CAPTURE)))


def test_requests_carry_their_share_of_the_shared_steps(spans):
    reqs = [s for s in spans if s["kind"] == "SERVER" and "flame" in s]
    assert len(reqs) >= 50
    for s in reqs:
        stacks = from_json(s["flame"])
        a = s["attributes"]
        kernels = sum(n for f, n, _t, _s in stacks if not f[-1][1].startswith("[memcpy"))
        assert kernels == pytest.approx(a["tokentrace.gpu.kernel_launches"], rel=1e-6, abs=1e-3)
        assert a["tokentrace.gpu.attribution"] in ("step_model", "step_equal")
        assert sum(t for _f, _n, t, _s in stacks) == pytest.approx(
            a["tokentrace.gpu.time_ms"] * 1e6, rel=1e-3)


def test_hf_modeling_functions_launch_the_named_kernels(spans):
    svc = select(str(CAPTURE), service="transformers.cli.transformers")
    tops: dict[str, set[str]] = {}
    for frames, n, _t, _s in svc.stacks:
        for f in frames:
            if f[0] == "py" and f[2].endswith("models/llama/modeling_llama.py"):
                tops.setdefault(f[1], set()).add(frames[-1][1])
    assert {"gemm_kernel", "attention_kernel"} <= tops["LlamaAttention.forward"]
    assert {"gemm_kernel", "silu_kernel"} <= tops["LlamaMLP.forward"]
    assert tops["LlamaRMSNorm.forward"] == {"rmsnorm_kernel"}
    # the service's flame holds the kernel launches its requests were charged by the
    # GPU ledger (a number the flames do not make)
    charged = sum(s["attributes"].get("tokentrace.gpu.kernel_launches", 0) for s in spans
                  if s["kind"] == "SERVER" and "flame" in s)
    drawn = sum(n for f, n, _t, _s in svc.stacks if not f[-1][1].startswith("[memcpy"))
    assert drawn == pytest.approx(charged, rel=1e-6)


def test_report_draws_the_service_and_the_costliest_requests(spans, tmp_path):
    f = tmp_path / "spans.jsonl"
    f.write_text("".join(json.dumps(s) + "\n" for s in spans))
    r = subprocess.run([sys.executable, "-m", "tracer", "report", str(f), "-o",
                        str(tmp_path / "rep"), "--format", "html"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "rep" / "report.html").read_text()
    frames = [x for x in page.split('<iframe src="')[1:]]
    assert len(frames) == 4  # the service and the 3 requests with the most GPU time
    for x in frames:
        target = tmp_path / "rep" / x.split('"', 1)[0]
        assert target.exists() and "flamegraph.default()" in target.read_text()
    assert (tmp_path / "rep" / "flame" / "service-0.pb.gz").exists()

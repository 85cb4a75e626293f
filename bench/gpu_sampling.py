"""Tracing overhead on a real GPU decode loop, full and with --gpu-sample, in one run
(run on the GPU machine as root, after `eval "$(.gpu/setup-bcc.sh)"`).

The PyTorch eager decode loop of samples/gpu/torch_workload.py (one sync per token, a
few hundred kernel launches per token) is run in alternating untraced and traced
rounds in the same process:

- full tracing: tokens/s and median token time, traced over untraced, per pair and
  as the median of the pairs (the loop's speed drifts by +-20 % between rounds on a
  shared host, so only ratios of neighbouring rounds mean anything);
- each --mode FRACTION:PERIOD of --gpu-sample: the same ratios, the launch estimate
  against the exact count (from a fully traced round of the same length), the
  estimate's method, what attaching and detaching cost the agent, and whether the
  target stalls at the switches (token times within 20 ms of a switch against the
  rest), and the median token time while the launch probes were on against while
  they were off in the same run (drift-free: they alternate every few seconds).

    python3 bench/gpu_sampling.py OUT_DIR [--pairs 6] [--tokens 3000]
                                  [--mode 0.1:2 0.25:2] [--periods 4]

Writes OUT_DIR/gpu-sampling.json and prints it. Uses only the capture half of
tokentrace, like bench/gpu_validate.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))
from gpu_validate import Tracer, Workload, totals  # noqa: E402
from tracer.correlate.gpu import GpuLedger  # noqa: E402


def traced_round(w: Workload, tokens: int, **config) -> dict:
    """One decode round under a tracer: the workload's answer, the ledger, the tracer."""
    led = GpuLedger()
    tr = Tracer([w.p.pid], led, None, **config)
    got = w.ask(f"decode_timed {tokens}")
    tr.settle()
    t0 = time.perf_counter()
    drops = tr.stop()
    return {"decode": got, "ledger": led, "drops": drops, "attach_s": tr.attach_s,
            "stop_s": time.perf_counter() - t0}


def pair_ratio(untraced: dict, traced: dict) -> dict:
    return {"untraced_tokens_per_s": round(untraced["tokens_per_s"], 1),
            "traced_tokens_per_s": round(traced["tokens_per_s"], 1),
            "tokens_per_s_ratio": traced["tokens_per_s"] / untraced["tokens_per_s"],
            "median_token_time_ratio": traced["median_token_us"] / untraced["median_token_us"],
            "untraced_cpu_us_per_token": round(untraced["cpu_us_per_token"], 2),
            "traced_cpu_us_per_token": round(traced["cpu_us_per_token"], 2),
            "cpu_per_token_ratio": traced["cpu_us_per_token"] / untraced["cpu_us_per_token"]}


def summarise(pairs: list[dict]) -> dict:
    rates = [p["tokens_per_s_ratio"] for p in pairs]
    times = [p["median_token_time_ratio"] for p in pairs]
    cpu = [p["cpu_per_token_ratio"] for p in pairs]
    return {"pairs": pairs,
            "median_tokens_per_s_ratio": statistics.median(rates),
            "median_token_time_ratio": statistics.median(times),
            "median_cpu_per_token_ratio": statistics.median(cpu),
            "range_tokens_per_s_ratio": [min(rates), max(rates)],
            "range_cpu_per_token_ratio": [min(cpu), max(cpu)]}


def full_tracing(w: Workload, pairs: int, tokens: int) -> tuple[dict, int]:
    out = []
    exact = None
    for i in range(pairs):
        order = ("untraced", "traced") if i % 2 == 0 else ("traced", "untraced")
        got = {}
        for phase in order:
            if phase == "untraced":
                got[phase] = w.ask(f"decode {tokens}")
            else:
                r = traced_round(w, tokens)
                got[phase] = r["decode"]
                launches = totals(r["ledger"], w.p.pid)["launches"]
                exact = launches if exact is None else exact
                got["launches"], got["lost_gpu"] = launches, r["drops"].get("lost_gpu")
                got["stop_s"] = r["stop_s"]
        out.append({"order": order, **pair_ratio(got["untraced"], got["traced"]),
                    "launches": got["launches"], "lost_gpu": got["lost_gpu"],
                    "stop_s": round(got["stop_s"], 2)})
    return summarise(out), exact or 0


def switch_stalls(token_ends: list[int], switches: list[tuple[int, bool]],
                  window_ns: int = 20_000_000) -> dict:
    """Token times (us) that end within ``window_ns`` after a switch, against the rest."""
    near, rest = [], []
    ts = [s for s, _ in switches]
    j = 0
    for a, b in zip(token_ends, token_ends[1:]):
        while j < len(ts) and ts[j] + window_ns < b:
            j += 1
        hit = j < len(ts) and ts[j] <= b
        (near if hit else rest).append((b - a) / 1e3)
    return {"tokens_near_switches": len(near),
            "median_us_near_switches": statistics.median(near) if near else None,
            "max_us_near_switches": max(near) if near else None,
            "median_us_elsewhere": statistics.median(rest) if rest else None}


def on_off_token_times(token_ends: list[int], sampling, settle_ns: int = 20_000_000) -> dict:
    """Median token time while the launch probes were on against while they were off,
    in one run: the two alternate every few seconds, so the host's drift cancels and
    the ratio is what the launch probes cost a token. Tokens within ``settle_ns`` of a
    switch are left out."""
    if sampling is None:
        return {}
    on, off = [], []
    starts = [t for t, _ in sampling.switches]
    for a, b in zip(token_ends, token_ends[1:]):
        if any(a - settle_ns <= t <= b for t in starts):
            continue
        (on if sampling.counted(a, b) else off).append((b - a) / 1e3)
    if not on or not off:
        return {}
    m_on, m_off = statistics.median(on), statistics.median(off)
    return {"tokens_on": len(on), "tokens_off": len(off), "median_us_on": m_on,
            "median_us_off": m_off, "on_over_off": m_on / m_off}


def sampled(w: Workload, fraction: float, period: float, tokens: int, pairs: int) -> dict:
    exact_round = traced_round(w, tokens)
    exact = totals(exact_round["ledger"], w.p.pid)["launches"]
    out = []
    for i in range(pairs):
        order = ("untraced", "sampled") if i % 2 == 0 else ("sampled", "untraced")
        got: dict = {}
        for phase in order:
            if phase == "untraced":
                got[phase] = w.ask(f"decode {tokens}")
                continue
            r = traced_round(w, tokens, gpu_sample=fraction, gpu_sample_period_s=period)
            got[phase] = r["decode"]
            doc = r["ledger"].summary()
            (proc,) = [p for p in doc["processes"] if p["pid"] == w.p.pid] or [{}]
            methods = sorted({t.get("launch_estimate", {}).get("method", "")
                              for t in proc.get("threads", {}).values()} - {""})
            s = doc.get("launch_sampling", {})
            got["est"] = {
                "launches_estimated": proc.get("kernel_launches", 0),
                "launches_seen": proc.get("kernel_launches_seen", 0),
                "error": (proc.get("kernel_launches", 0) - exact) / exact if exact else None,
                "methods": methods, "switches": s.get("switches"),
                "measured_on_share": s.get("measured_on_share"),
                "attach_ms": s.get("attach_ms"), "detach_ms": s.get("detach_ms"),
                "lost_gpu": r["drops"].get("lost_gpu"),
                "stalls": switch_stalls(r["decode"]["token_end_ns"],
                                        r["ledger"].sampling.switches
                                        if r["ledger"].sampling else []),
                "probes_on_vs_off": on_off_token_times(r["decode"]["token_end_ns"],
                                                       r["ledger"].sampling)}
        out.append({"order": order, **pair_ratio(got["untraced"], got["sampled"]),
                    **got["est"]})
    return {"fraction": fraction, "period_s": period, "tokens": tokens,
            "exact_launches": exact, **summarise(out),
            "errors": [p["error"] for p in out]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="out")
    ap.add_argument("--pairs", type=int, default=6, help="untraced/traced pairs (default 6)")
    ap.add_argument("--tokens", type=int, default=3000, help="tokens per full-tracing round")
    ap.add_argument("--mode", nargs="*", default=["0.1:5", "0.25:5"],
                    help="--gpu-sample FRACTION:PERIOD pairs to measure")
    ap.add_argument("--periods", type=float, default=4,
                    help="sampled rounds last this many periods (default 4)")
    ap.add_argument("--sampled-pairs", type=int, default=2)
    ap.add_argument("--cpu", type=int, default=None,
                    help="pin the workload to this CPU (less drift between rounds)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    w = Workload({args.cpu} if args.cpu is not None else None)
    res: dict = {"init": w.ask("init")}
    warm = w.ask("decode 500")
    res["warm_tokens_per_s"] = warm["tokens_per_s"]
    t0 = time.perf_counter()
    res["full"], res["exact_launches_per_round"] = full_tracing(w, args.pairs, args.tokens)
    res["full"]["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"full": res["full"]}, default=str)[:3000], file=sys.stderr, flush=True)
    res["sampled"] = []
    for m in args.mode:
        f, p = (float(x) for x in m.split(":"))
        tokens = int(args.periods * p * warm["tokens_per_s"])
        res["sampled"].append(sampled(w, f, p, tokens, args.sampled_pairs))
        print(json.dumps(res["sampled"][-1], default=str)[:3000], file=sys.stderr, flush=True)
    w.quit()
    (out / "gpu-sampling.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str)[:8000])


if __name__ == "__main__":
    main()

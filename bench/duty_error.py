"""What ``tokentrace run --duty-cycle`` costs the numbers a user reads: each estimate
from the sampled spans against the load generator's own count of every request.

One server (``bench/real_server.py``'s, on CPU 0 with its load generator, the agent on
CPU 1), kept saturated at ``--concurrency``; one agent kept running, its duty cycle
set by its control socket for stretches of ``--stretch-s`` in the order ``--modes``
gives (each mode twice, the second time in reverse order, so a drift of the host's
weighs on every mode alike). For each stretch, from the spans that started in it:

- requests a second: spans with a response (whole, or cut by a window's end), scaled
  by 1/F, against the requests the client sent;
- tokens a second: the spans' output tokens (a cut span's as far as it got) scaled by
  1/F, against the tokens the client received; ``tokens_per_s_weighted``: from the
  whole spans alone, each weighted by the odds of a request that long being whole
  (``weighted_tokens``);
- TTFT p50 and p99: over the spans with a first token, against the client's TTFTs of
  every request it sent;
- ``whole``: the share of the spans seen that no window's end cut;
- ``ttft_over_300ms``: spans and client requests with a TTFT over 300 ms, and the
  spans' socket waits (a stall at a switch shows in both; a timing artefact only in
  the spans).

``full`` (every request traced) is the control: its errors are the tracer's own
(clocks, the request that straddles a stretch's edge), not the sampling's.

    python bench/duty_error.py [--server batching|grpc] [--modes full,0.5/10,0.2/10]
                               [--stretch-s 60] [--out bench/results/duty_error.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.real_server import Agent, Client, Server, pct  # noqa: E402
from tracer.duty import parse as parse_duty  # noqa: E402


def weighted_tokens(spans: list[dict[str, Any]], fraction: float, period_s: float) -> float:
    """The tokens of every request, estimated from the whole spans alone: a request of
    duration d is wholly inside a window of W = F x PERIOD with odds (W - d) / PERIOD,
    so each whole span stands for PERIOD / (W - d) requests like it (Horvitz-Thompson;
    the long requests a window's end cuts more often weigh more)."""
    if fraction >= 1.0:
        return sum(s["attributes"].get("gen_ai.usage.output_tokens") or 0 for s in spans)
    window = fraction * period_s
    total = 0.0
    for s in spans:
        if s.get("status_message"):
            continue  # cut or failed: its tokens are not all seen
        d = (s["end_time_unix_nano"] - s["start_time_unix_nano"]) / 1e9
        total += (s["attributes"].get("gen_ai.usage.output_tokens") or 0) * period_s / max(
            window - d, 0.05 * window)
    return total


def stretch_estimates(spans: list[dict[str, Any]], fraction: float, seconds: float,
                      truth: dict[str, Any], period_s: float = 10.0) -> dict[str, Any]:
    """One stretch's estimates from ``spans`` (those that started in it) against the
    client's ``truth`` (``Load.slice``: tokens, requests, ttft_ms)."""
    llm = [s for s in spans if "gen_ai.usage.output_tokens" in s["attributes"]
           or "tokentrace.time_to_first_token" in s["attributes"]]
    cut = [s for s in llm if s.get("status_message") and "duty cycle" in s["status_message"]]
    ttft = [s["attributes"]["tokentrace.time_to_first_token"] * 1e3 for s in llm
            if s["attributes"].get("tokentrace.time_to_first_token") is not None]
    tokens = sum(s["attributes"].get("gen_ai.usage.output_tokens") or 0 for s in llm)
    true_ttft = truth["ttft_ms"]
    est = {"requests_per_s": len(llm) / fraction / seconds,
           "tokens_per_s": tokens / fraction / seconds,
           "tokens_per_s_weighted": weighted_tokens(llm, fraction, period_s) / seconds,
           "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99)}
    real = {"requests_per_s": truth["requests"] / seconds,
            "tokens_per_s": truth["tokens"] / seconds,
            "tokens_per_s_weighted": truth["tokens"] / seconds,
            "ttft_p50_ms": pct(true_ttft, 0.5), "ttft_p99_ms": pct(true_ttft, 0.99)}
    slow = [s for s in llm if (s["attributes"].get("tokentrace.time_to_first_token") or 0) > 0.3]
    return {"spans": len(llm), "cut": len(cut), "whole": 1 - len(cut) / max(1, len(llm)),
            "ttft_over_300ms": {"spans": len(slow), "client": sum(t > 300 for t in true_ttft),
                                "spans_socket_wait_s": sorted(round(s["attributes"].get(
                                    "tokentrace.network.socket_wait") or 0, 3) for s in slow)},
            "client_requests": truth["requests"], "estimate": est, "truth": real,
            "error": {k: (round(est[k] / real[k] - 1, 4) if est[k] and real[k] else None)
                      for k in est}}


def summarise(stretches: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: each error's mean and its worst stretch."""
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(s["mode"] for s in stretches):
        mine = [s for s in stretches if s["mode"] == mode]
        errs: dict[str, Any] = {}
        for k in mine[0]["error"]:
            xs = [s["error"][k] for s in mine if s["error"][k] is not None]
            if xs:
                errs[k] = {"mean": round(statistics.fmean(xs), 4),
                           "worst": max(xs, key=abs)}
        out[mode] = {"stretches": len(mine), "whole": round(statistics.fmean(
            s["whole"] for s in mine), 4), "spans": sum(s["spans"] for s in mine),
            "client_requests": sum(s["client_requests"] for s in mine), "error": errs}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="batching", choices=("batching", "grpc"))
    ap.add_argument("--modes", default="full,0.5/10,0.2/10",
                    help="full, or F/PERIOD (--duty-cycle), comma-separated")
    ap.add_argument("--stretch-s", type=float, default=60.0,
                    help="seconds a stretch: a whole number of periods")
    ap.add_argument("--settle-s", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=32, help="requests in the mix")
    ap.add_argument("--max-tokens", default="16:48", metavar="LO:HI")
    ap.add_argument("--out", default=str(ROOT / "bench/results/duty_error.json"))
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    plan = modes + modes[::-1]
    work = Path(tempfile.mkdtemp(prefix="duty-error-"))
    client_args = argparse.Namespace(requests=args.requests, concurrency=args.concurrency,
                                     max_tokens=args.max_tokens)
    server = Server(args.server, "cpu", work, {0})
    client = agent = None
    marks: list[tuple[str, float, float, int, int]] = []
    try:
        client = Client(server, client_args, {0})
        client.ask("start")
        client.first_tokens()
        agent = Agent(server, work, {1}, ["--gpu-sample", "auto"])
        for mode in plan:
            agent.ctl("duty-cycle off" if mode == "full" else f"duty-cycle {mode}")
            time.sleep(args.settle_s)
            t0, w0 = time.monotonic(), time.time_ns()
            time.sleep(args.stretch_s)
            t1, w1 = time.monotonic(), time.time_ns()
            marks.append((mode, t0, t1, w0, w1))
            print(f"{mode}: {args.stretch_s:g} s", file=sys.stderr, flush=True)
        agent.ctl("duty-cycle off")
        truths = [client.slice(t0, t1) for _, t0, t1, _, _ in marks]
    finally:
        summary = agent.stop() if agent is not None else {}
        if client is not None:
            client.ask("stop")
            client.close()
        server.stop()
    spans = [json.loads(line) for line in agent.jsonl.read_text().splitlines()]
    stretches = []
    for (mode, t0, t1, w0, w1), truth in zip(marks, truths):
        mine = [s for s in spans if w0 <= s["start_time_unix_nano"] < w1]
        fraction, period = (1.0, 10.0) if mode == "full" else parse_duty(mode)
        stretches.append({"mode": mode, "wall_ns": [w0, w1],
                          **stretch_estimates(mine, fraction, t1 - t0, truth, period)})
    result = {"server": args.server, "stretch_s": args.stretch_s,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "modes": summarise(stretches), "stretches": stretches,
              "agent_report": {k: v for k, v in summary.get("report", {}).items()
                               if "duty" in k or "pause" in k}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["modes"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

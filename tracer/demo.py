"""`tokentrace demo`: trace the sample OpenAI server end to end.

Starts ``samples/openai_server.py`` (a tiny PyTorch GPT) as its own process, attaches
the tracer to it by port, sends real requests with the official ``openai`` client
(streamed and not, chat and completions, a few at once, and one error), and prints
the per-request table. Spans go to ``<out>/demo-spans.jsonl`` and the raw capture to
``<out>/demo.ttcap`` (try ``tokentrace replay`` on it).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _say(msg: str) -> None:
    print(f"tokentrace demo: {msg}", file=sys.stderr, flush=True)


def _send_requests(base_url: str, n: int) -> dict[str, int]:
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="sk-demo", max_retries=0)
    counts = {"ok": 0, "errors": 0}

    def chat_stream(i: int) -> None:
        s = client.chat.completions.create(
            model="tiny-gpt", messages=[{"role": "user", "content": f"Tell me a story, #{i}"}],
            max_tokens=8 + i % 8, stream=True, stream_options={"include_usage": True})
        for _ in s:
            pass

    def chat(i: int) -> None:
        client.chat.completions.create(
            model="tiny-gpt", messages=[{"role": "user", "content": f"Summarise item {i}."}],
            max_tokens=4 + i % 6)

    def completion_stream(i: int) -> None:
        for _ in client.completions.create(model="tiny-gpt", prompt=f"Once upon {i}",
                                           max_tokens=6, stream=True):
            pass

    jobs = [(chat_stream, i) for i in range(n)] + [(chat, i) for i in range(n)]
    jobs += [(completion_stream, i) for i in range(max(1, n // 4))]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for fut in [pool.submit(fn, i) for fn, i in jobs]:
            fut.result()
            counts["ok"] += 1
    try:
        client.chat.completions.create(model="no-such-model",
                                       messages=[{"role": "user", "content": "hi"}])
    except openai.NotFoundError:
        counts["errors"] += 1
    return counts


def run_demo(requests: int = 8, out_dir: str = "out", port: int = 8765) -> int:
    if not (ROOT / "samples" / "openai_server.py").exists():
        _say(f"the samples/ directory is not next to the tracer package ({ROOT}); "
             "run the demo from a source checkout")
        return 1
    sys.path.insert(0, str(ROOT))
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from samples.launch import SampleServer
    from tracer.correlate.connections import TrackerOptions
    from tracer.export.console import ConsoleTable, ring_at_loss_text, skipped_runs_text
    from tracer.export.context import ExportContext
    from tracer.export.jsonl import JsonlSpanExporter
    from tracer.export.spans import SpanBuilder
    from tracer.probes.loader import ProbeSetupError
    from tracer.probes.session import CaptureConfig
    from tracer.runner import TraceRun

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spans_path, cap_path = out / "demo-spans.jsonl", out / "demo.ttcap"
    _say(f"starting the sample server (tiny PyTorch GPT) on port {port}")
    server = SampleServer(port=port, args=["--token-rate", "200"], log=out / "demo-server.log")
    server.start()
    try:
        ctx = ExportContext()
        console = ConsoleTable(ctx)
        spans = SpanBuilder(ctx, [SimpleSpanProcessor(JsonlSpanExporter(str(spans_path)))])
        run = TraceRun(CaptureConfig(ports=[port]), [console, spans], TrackerOptions(),
                       record=str(cap_path), ctx=ctx)
        try:
            run.start()
        except ProbeSetupError as e:
            _say(f"cannot trace: {e}")
            return 1
        _say(f"attached to pid {server.pid}; sending requests with the openai client")
        t0 = time.monotonic()
        counts = _send_requests(server.base_url, requests)
        time.sleep(0.3)  # let the last close records arrive
        report = run.stop()
        elapsed = time.monotonic() - t0
    finally:
        server.stop()
    lost = {k: v for k, v in report.items() if k.startswith("capture.lost") and v}
    _say(f"client: {counts['ok']} requests ok, {counts['errors']} error(s) expected, "
         f"in {elapsed:.1f}s")
    _say(console.summary())
    _say(f"spans: {spans_path} ({run.pipeline.records} requests); capture: {cap_path}; "
         + ("lost: " + ", ".join(f"{k}={v}" for k, v in lost.items()) if lost
            else "no events lost") + skipped_runs_text(report)
         + ring_at_loss_text(report))
    expected = counts["ok"] + counts["errors"]
    if run.pipeline.records != expected:
        _say(f"MISMATCH: the client made {expected} requests, the tracer saw "
             f"{run.pipeline.records}")
        return 1
    return 0

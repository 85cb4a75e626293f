"""Launch-site flame graphs of HF ``transformers serve --continuous-batching`` (a server
nobody here wrote), attached after start with stack sampling on, and what sampling costs.

One command, a few minutes:

    sudo python3 bench/flame.py OUT_DIR --device cuda     # H100/H200 host (run as root)
    sudo .venv/bin/python bench/flame.py OUT_DIR --device cpu   # any machine (dev VM)

1. Builds a tiny Llama offline (``samples/hf/model.py``), starts ``transformers serve
   MODEL --continuous-batching --device DEVICE`` and warms it up (engine built, kernels
   loaded) before anything is traced. On ``--device cpu`` nothing reaches a CUDA driver,
   so the server gets ``samples/hf/cudashim`` on its PYTHONPATH: HF's PyTorch ops also
   call the stand-in ``libcuda.so.1`` (one kernel per op) and each engine step ends with
   a device-to-host copy and a sync, from the same Python frames as on a GPU.
2. Attaches ``tokentrace`` (all GPU probes, sockets, ``stack_every``), records a
   capture, and drives the server with ``--concurrency`` threads of the official
   ``openai`` client (streamed chat completions, 16-64 tokens, prompts of 5-120 words).
3. Alternates windows of ``--window-s`` seconds with stack sampling on and paused (a
   paused call pays one array read in the probe), ``--windows`` in all, in the order
   off, on, on, off, ... (a drift in the load cancels out), after 8 s of load, and counts
   the streamed tokens per window: tokens/s with / without sampling, and the tracer's
   CPU per window.
4. Writes, from the spans the run exported: the service's flame graph and one request's
   (``flame-service.*``, ``flame-request.*``: folded, pprof, HTML, JSON), the spans
   (``spans.jsonl``), the capture (``flame.ttcap``) and the server's log, all packed in
   ``flame-files.tgz`` (a device tool brings back few files), the service's HTML page
   beside it (``flame-service.html``, for a picture), and ``flame.json``: whether HF's
   Python functions that launch the model's kernels (``LlamaAttention.forward``,
   ``LlamaMLP.forward`` in ``modeling_llama.py``) appear with named kernels on top, the
   overhead, the interpreter found (and how its layout was checked), how far native
   unwinding got, the sampler's counters, and what was lost.

Exits 1 (listing ``problems`` in the JSON) when something that must hold does not: no
request span, HF's attention or MLP forward not in the flame graph, records lost,
reconciliation off.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracer.privacy import open_private  # noqa: E402 (after the path)

WORDS = "the model reads a prompt then writes one token at a time while others share".split()
SETTLE_S = 8.0  # load before the first window
HF_FUNCTIONS = ("LlamaAttention.forward", "LlamaMLP.forward", "LlamaDecoderLayer.forward",
                "LlamaRMSNorm.forward", "LlamaModel.forward", "LlamaForCausalLM.forward")


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``transformers serve`` in its own process group (no truth recorder here: its
    profiler would change what is measured)."""

    def __init__(self, model: Path, device: str, log: Path, libcuda: Path | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONUNBUFFERED="1")
        if libcuda is not None:
            env["TT_HF_LIBCUDA"] = str(libcuda)
            env["TT_HF_SHIM_WAIT"] = "1"  # GPU calls start at SIGUSR2, after the attach
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [
                str(ROOT / "samples" / "hf" / "cudashim"), os.environ.get("PYTHONPATH")]))
        cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model),
               "--device", device, "--port", str(self.port), "--host", "127.0.0.1",
               "--continuous-batching"]
        self.log = open_private(log)  # the server's own log: may name what it served
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, text=True)

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"transformers serve did not start (see {self.log.name})")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


class Load:
    """``threads`` clients of the official openai SDK, streaming chat completions until
    stopped; every text chunk's arrival time is kept."""

    def __init__(self, url: str, model: str, threads: int, seed: int = 0) -> None:
        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key="sk-bench", max_retries=0,
                                    timeout=120)
        self.model = model
        self.stop_at = 0.0
        self.chunks: list[float] = []
        self.errors: Counter[str] = Counter()
        self.requests = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(seed + i,), daemon=True)
                        for i in range(threads)]

    def one(self, rng: random.Random) -> None:
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120)))
        stream = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": words}],
            max_tokens=rng.randint(16, 64), stream=True)
        got = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(time.monotonic())
        with self.lock:
            self.chunks.extend(got)
            self.requests += 1

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.stop_at:
            try:
                self.one(rng)
            except Exception as e:  # counted: the bench says how many failed
                with self.lock:
                    self.errors[type(e).__name__] += 1
                time.sleep(0.2)

    def start(self, seconds: float) -> None:
        self.stop_at = time.monotonic() + seconds
        for t in self.threads:
            t.start()

    def join(self) -> None:
        for t in self.threads:
            t.join(180)

    def tokens_between(self, a: float, b: float) -> int:
        with self.lock:
            return sum(1 for t in self.chunks if a <= t < b)


def load_process(url: str, model: str, threads: int, seconds: float, out: Path
                 ) -> subprocess.Popen[str]:
    """The load in a process of its own: in the tracer's process its client threads
    would share the interpreter lock with the tracer's own Python, and tokens/s would
    measure that, not the server."""
    return subprocess.Popen([sys.executable, __file__, str(out), "--load-only", url, model,
                             str(threads), str(seconds)], cwd=ROOT)


def run_load_only(argv: list[str]) -> int:
    """``flame.py OUT --load-only URL MODEL THREADS SECONDS``: drive, then write the
    chunk times (CLOCK_MONOTONIC, comparable across processes) to OUT."""
    out, _flag, url, model, threads, seconds = argv
    load = Load(url, model, int(threads))
    load.start(float(seconds))
    load.join()
    Path(out).write_text(json.dumps({"chunks": load.chunks, "requests": load.requests,
                                     "errors": dict(load.errors)}))
    return 0


def hf_check(stacks: list[Any]) -> dict[str, Any]:
    """Which of HF's modeling functions the flame graph shows, with the GPU work on top
    of stacks through them (launches) and whether those kernels are named."""
    out: dict[str, Any] = {}
    for fn in HF_FUNCTIONS:
        through = [st for st in stacks
                   if any(f[0] == "py" and f[1] == fn and f[2].endswith("modeling_llama.py")
                          for f in st[0])]
        tops: Counter[str] = Counter()
        for st in through:
            tops[st[0][-1][1]] += st[1]
        launches = sum(tops.values())
        unnamed = sum(n for k, n in tops.items() if k.startswith("unknown@"))
        out[fn] = {"present": bool(through), "launches": round(launches, 1),
                   "named_share": round(1 - unnamed / launches, 4) if launches else None,
                   "top": [[k, round(n, 1)] for k, n in tops.most_common(8)]}
    return out


def native_summary(frames: dict[tuple[int, int], Any]) -> dict[str, Any]:
    """How far native unwinding got, over every stack the run resolved."""
    stops: Counter[str] = Counter(f.native_stop or "?" for f in frames.values())
    depth = [len(f.native) for f in frames.values()]
    py = [len(f.python) for f in frames.values()]
    libs: Counter[str] = Counter()
    for f in frames.values():
        for x in f.native:
            libs[x.split("\t", 1)[1].split("+", 1)[0]] += 1
    return {"stacks": len(frames), "native_stop": dict(stops.most_common()),
            "native_frames_median": statistics.median(depth) if depth else None,
            "python_frames_median": statistics.median(py) if py else None,
            "native_frames_by_library": dict(libs.most_common(15))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output directory")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--windows", type=int, default=8, help="alternating windows (even)")
    ap.add_argument("--window-s", type=float, default=15.0)
    ap.add_argument("--stack-every", type=int, default=None,
                    help="mean calls between a thread's samples (default: the tracer's)")
    ap.add_argument("--layers", type=int, default=2, help="tiny Llama's layers")
    args = ap.parse_args()
    from samples.hf.model import build as build_model
    from tracer.correlate.stacks import from_json
    from tracer.flame.cli import write
    from tracer.flame.model import merge, totals
    from tracer.probes.stacks import DEFAULT_EVERY

    every = args.stack_every or DEFAULT_EVERY
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)
    t_start = time.monotonic()
    model = build_model(work / "tiny-llama", layers=args.layers)
    libcuda = None
    if args.device == "cpu":
        from samples.gpu.build import build as build_standins
        libcuda = build_standins(work / "gpu")["libcuda"]
    server = Server(model, args.device, out / "server.log", libcuda)
    result: dict[str, Any] = {"device": args.device, "concurrency": args.concurrency,
                              "stack_every": every, "window_s": args.window_s}
    problems: list[str] = []
    try:
        server.wait_ready()
        warm = Load(server.url, str(model), 4, seed=99)
        warm.start(8.0)
        warm.join()
        result["warm_up_requests"] = warm.requests
        windows = []
        run, spans_out = start_tracer(server.proc.pid, every, out / "flame.ttcap")
        try:
            gpu = run.session.gpu
            if gpu is not None and gpu.prenames is not None:
                # kernels resolved before attach are named from the libraries (~10 s
                # on an H100 host, on a thread of its own): wait, so that the first
                # requests' flame graphs have their kernels' names too
                result["naming_wait_s"] = _timed(lambda: gpu.prenames.wait_idle(90))
            t_attached = time.monotonic()
            if libcuda is not None:
                os.kill(server.proc.pid, signal.SIGUSR2)  # the shim's GPU calls begin
            sampler = run.session.stacks
            sampler.enable(False)
            load_file = work / "load.json"
            loader = load_process(server.url, str(model), args.concurrency,
                                  args.windows * args.window_s + SETTLE_S, load_file)
            time.sleep(SETTLE_S)  # the load settles (first requests, batches filling up)
            for i in range(args.windows):
                on = i % 4 in (1, 2)  # off, on, on, off, ...: a drift cancels out
                sampler.enable(on)
                a, cpu_a = time.monotonic(), time.process_time()
                time.sleep(args.window_s)
                b, cpu_b = time.monotonic(), time.process_time()
                # this process is the tracer (the load runs in its own)
                windows.append({"stacks": on, "start_s": round(a - t_attached, 2),
                                "seconds": round(b - a, 3),
                                "tracer_cpu_share": round((cpu_b - cpu_a) / (b - a), 4)})
            sampler.enable(True)
            loader.wait(300)
            load = json.loads(load_file.read_text())
            result["python"] = sampler.describe()
            time.sleep(1.5)  # the last steps' bursts and the hold window
        finally:
            run_report = run.stop()
        result["resolver_seconds"] = round(sampler.resolver.seconds, 3)
        for w, (a, b) in zip(windows, _bounds(windows, t_attached)):
            w["tokens"] = sum(1 for t in load["chunks"] if a <= t < b)
            w["tokens_per_s"] = round(w["tokens"] / w["seconds"], 2)
        on = [w["tokens_per_s"] for w in windows if w["stacks"]]
        off = [w["tokens_per_s"] for w in windows if not w["stacks"]]
        result["windows"] = windows
        result["overhead"] = {
            "tokens_per_s_with_stacks_median": statistics.median(on) if on else None,
            "tokens_per_s_without_median": statistics.median(off) if off else None,
            "ratio_with_over_without": (round(statistics.median(on) / statistics.median(off), 4)
                                        if on and off and statistics.median(off) else None),
            "pairs": [round(a / b, 4) for a, b in zip(on, off) if b],
            "tracer_cpu_share_with_stacks": [w["tracer_cpu_share"] for w in windows
                                             if w["stacks"]],
            "tracer_cpu_share_without": [w["tracer_cpu_share"] for w in windows
                                         if not w["stacks"]]}
        result["requests"] = load["requests"]
        result["client_errors"] = load["errors"]
    finally:
        server.stop()
    spans = [json.loads(x) for x in spans_out.getvalue().splitlines() if x.strip()]
    write_spans(out / "spans.jsonl", spans)
    reqs = [s for s in spans if s.get("kind") == "SERVER" and "flame" in s]
    result["request_spans"] = sum(1 for s in spans if s.get("kind") == "SERVER")
    result["request_spans_with_stacks"] = len(reqs)
    if not reqs:
        problems.append("no request span carries stacks")
    else:
        service = merge(st for s in reqs for st in from_json(s["flame"]))
        svc = reqs[0]["resource"].get("service.name", "?")
        result["service"] = {"name": svc, "stacks": len(service), **totals(service),
                             "files": write(out, "flame-service", service,
                                            f"service {svc}: {len(reqs)} requests")}
        # one request: the median by GPU calls, among those with samples of their own
        # (taken while sampling was on) where there are any
        own = [s for s in reqs if sum(st[3] for st in from_json(s["flame"]))] or reqs
        own.sort(key=lambda s: sum(st[1] for st in from_json(s["flame"])))
        one = own[len(own) // 2]
        stacks = from_json(one["flame"])
        result["request"] = {"trace_id": one["trace_id"], "stacks": len(stacks),
                             **totals(stacks), "attributes": {
                                 k: v for k, v in one["attributes"].items()
                                 if k.startswith("tokentrace.gpu.") or k.startswith("gen_ai.usage")},
                             "files": write(out, "flame-request", stacks,
                                            f"request {one['trace_id']}")}
        check = hf_check(service)
        result["hf_functions"] = check
        for fn in ("LlamaAttention.forward", "LlamaMLP.forward"):
            row = check[fn]
            if not row["present"]:
                problems.append(f"{fn} (modeling_llama.py) is not in the service flame graph")
            elif row["named_share"] is not None and row["named_share"] < 0.9:
                problems.append(f"kernels on top of {fn}: only {row['named_share']:.0%} named")
    result["native"] = native_summary(run.pipeline.stacks.frames)
    result["counters"] = {k: v for k, v in run_report.items() if "stack" in k or "lost" in k}
    lost = {k: v for k, v in run_report.items() if k.startswith("capture.lost") and v}
    if lost:
        problems.append(f"records lost: {lost}")
    if not run.pipeline.reconciliation().get("balanced", True):
        problems.append("GPU reconciliation does not balance")
    result["seconds"] = round(time.monotonic() - t_start, 1)
    result["problems"] = problems
    pack(out)
    with open_private(out / "flame.json") as f:
        f.write(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 1 if problems else 0


def start_tracer(pid: int, every: int, capture: Path) -> tuple[Any, Any]:
    """tokentrace on ``pid`` (every probe, stack sampling), spans with their stacks to an
    in-memory JSONL; returns the running TraceRun and that buffer."""
    import io

    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from tracer.correlate.connections import TrackerOptions
    from tracer.export.context import ExportContext
    from tracer.export.jsonl import JsonlSpanExporter
    from tracer.export.spans import SpanBuilder
    from tracer.probes.session import CaptureConfig
    from tracer.runner import TraceRun

    ctx = ExportContext()
    ctx.flames = {}
    ctx.flame_source = str(capture)
    buf = io.StringIO()
    spans = SpanBuilder(ctx, [SimpleSpanProcessor(JsonlSpanExporter(buf, ctx.flames))])
    run = TraceRun(CaptureConfig(pids=[pid], stack_every=every), [spans], TrackerOptions(),
                   record=str(capture), ctx=ctx)
    run.start()
    return run, buf


def write_spans(path: Path, spans: list[dict[str, Any]]) -> None:
    """The spans as JSONL, 0600 like every file tokentrace writes (they carry request
    attributes; the benchmark runs as root)."""
    with open_private(path) as f:
        for s in spans:
            f.write(json.dumps(s) + "\n")


def pack(out: Path) -> None:
    """Everything but flame.json and the service's page into flame-files.tgz (0600:
    it holds the spans and the capture)."""
    import shutil
    import tarfile

    keep = {"flame.json", "flame-service.html", "flame-files.tgz"}
    files = [p for p in sorted(out.iterdir()) if p.is_file() and p.name not in keep]
    with open_private(out / "flame-files.tgz", "wb") as raw, \
            tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for p in files + ([out / "flame-service.html"] if (out / "flame-service.html").exists()
                          else []):
            tar.add(p, arcname=p.name)
    for p in files:
        p.unlink()
    shutil.rmtree(out / "work", ignore_errors=True)


def _timed(fn: Any) -> float:
    t0 = time.monotonic()
    fn()
    return round(time.monotonic() - t0, 2)


def _bounds(windows: list[dict[str, Any]], t0: float) -> list[tuple[float, float]]:
    return [(t0 + w["start_s"], t0 + w["start_s"] + w["seconds"]) for w in windows]


if __name__ == "__main__":
    if "--load-only" in sys.argv:
        sys.exit(run_load_only(sys.argv[1:]))
    sys.exit(main())

"""Per-request attribution accuracy against servers' own ground truth.

Servers: the three layouts of ``samples.batching.server`` (engine thread, engine
process, two tensor-parallel ranks; stand-in libcuda/libnccl on the CPU, the real tiny
GPT with ``--device cuda``), optionally with a step cost per member
(``--step-cost FIXED,PER_MEMBER,PER_PREFILL``: e.g. 6,4,25 makes a prefilling member
cost 29 launches and a decoding one 4); and HF ``transformers serve`` (``--server
hf-cb`` with continuous batching, ``hf-plain`` without), a server nobody here wrote,
whose truth a harness-only ``sitecustomize`` records inside it (``samples/hf``).

Each case serves requests from the ``openai`` client under the tracer (real probes);
the server writes, per engine step, which requests were in it (phase, query tokens),
its launches and its GPU time. A request's true share of a step is what it made the
step cost (``samples.scoring``): the engine's own per-member launches where it knows
them, otherwise the step-cost model fitted to the truth's own exact steps. Reported
per case: kernel-share error (MAE over the mean true launches, mean and p95 of the
relative error), GPU-time-share error (the same over each request's fraction of the
total), requests whose step count differs from the truth, chunked-prefill requests,
charged/observed launches (conservation: 1 minus the unattributed part), and TTFT
against the server's and the client's own stamps.

    python bench/accuracy.py [--layouts thread,process,tp2] [--concurrency 1,8,32]
        [--requests 64] [--step-cost 6,4,25] [--device cpu|cuda]
        [--out bench/results/accuracy.json]
    python bench/accuracy.py --server hf-cb --concurrency 32,8,1 --requests 384,128,48 \\
        --device cuda --keep OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from samples.gpu.build import build  # noqa: E402
from samples.scoring import score  # noqa: E402
from tests.live import traced  # noqa: E402


def start_server(layout: str, device: str, truth: Path, libs: dict[str, Path] | None,
                 max_batch: int, log: Path) -> tuple[subprocess.Popen[str], int]:
    cmd = [sys.executable, "-m", "samples.batching.server", "--port", "0", "--layout", layout,
           "--device", device, "--truth", str(truth), "--max-batch", str(max_batch)]
    if libs is not None:
        cmd += ["--libcuda", str(libs["libcuda"])]
        if layout == "tp2":
            cmd += ["--libnccl", str(libs["libnccl"])]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=open(log, "w"),
                         text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = p.stdout.readline() if p.stdout else ""
        if line.startswith("ready"):
            return p, int(line.split()[1])
        if not line and p.poll() is not None:
            break
    p.kill()
    raise RuntimeError(f"{layout} server did not start: {log.read_text()[-2000:]}")


def stop_server(p: subprocess.Popen[str]) -> None:
    import signal
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(p.pid, signal.SIGKILL)


def run_case(layout: str, concurrency: int, requests: int, device: str,
             libs: dict[str, Path] | None, work: Path, max_batch: int,
             keep_spans: bool = False, pricing: Any = None,
             step_cost: str | None = None, record: Path | None = None,
             while_loading: Callable[[Any], None] | None = None,
             **config: Any) -> dict[str, Any]:
    """Serve ``requests`` at ``concurrency`` under the tracer and score the spans.
    ``step_cost`` (FIXED,PER_MEMBER,PER_PREFILL) shapes the stand-in's launches;
    ``record`` keeps the capture; ``while_loading`` runs on a thread of its own during
    the load, given the TraceRun (its control commands); ``config``: more capture
    options (``gpu_sample``)."""
    name = f"{layout}-c{concurrency}" + (f"-cost{step_cost.replace(',', '_')}" if step_cost else "")
    truth_path = work / f"truth-{name}.jsonl"
    truth_path.unlink(missing_ok=True)
    old = os.environ.get("TT_STEP_COST")
    if step_cost:
        os.environ["TT_STEP_COST"] = step_cost
    try:
        p, port = start_server(layout, device, truth_path, libs, max_batch,
                               work / f"server-{name}.log")
    finally:
        if step_cost:
            os.environ.pop("TT_STEP_COST") if old is None else os.environ.update(TT_STEP_COST=old)
    try:
        client_out = work / f"client-{name}.json"
        with traced(pids=[p.pid], settle=1.0, pricing=pricing,
                    record=str(record) if record else None, **config) as got:
            aside = (threading.Thread(target=while_loading, args=(got.run,), daemon=True)
                     if while_loading is not None else None)
            if aside is not None:
                aside.start()
            subprocess.run([sys.executable, "-m", "samples.batching.load",
                            "--url", f"http://127.0.0.1:{port}", "--requests", str(requests),
                            "--concurrency", str(concurrency), "--out", str(client_out),
                            "--seed", str(concurrency)], cwd=ROOT, check=True, timeout=600)
            time.sleep(0.5)  # the last steps' bursts and the hold window
            if aside is not None:
                aside.join(30)
    finally:
        stop_server(p)
    lines = truth_path.read_text().splitlines()
    # GPU time: CUDA events on a GPU; on the CPU the stand-in's modelled kernel time
    # (each member's known part of it: tokens x launches x TT_STANDIN_KERNEL_NS)
    out = {"layout": layout, "concurrency": concurrency, "device": device,
           "step_cost": step_cost,
           **score(lines, got.spans, got.report, time="gpu_ns"),
           # the same split against the engine's stamps around each step: what the
           # tracer measures (occupancy), so this isolates the split from the
           # stand-in's host-bound gaps between its modelled kernels
           "gpu_time_share_wall": score(lines, got.spans, time="wall")["gpu_time_share"],
           **ttft_errors(lines, got.spans, json.loads(client_out.read_text()))}
    if keep_spans:
        out["spans"] = got.spans
    return out


def ttft_errors(lines: list[str], spans: list[dict[str, Any]], client: dict[str, Any]
                ) -> dict[str, Any]:
    """|tracer TTFT - server TTFT| and |tracer TTFT - client TTFT| for streamed requests."""
    from samples.scoring import parse, request_spans
    _, reqs = parse(lines)
    got = request_spans(spans)
    seen = client.get("requests", {})
    srv, cli = [], []
    for rid, a in got.items():
        t = a.get("tokentrace.time_to_first_token")
        if t is None or not seen.get(rid, {}).get("streamed"):
            continue
        r = reqs.get(rid)
        if r and r.get("arrival_ns") and r.get("first_token_ns"):
            srv.append(abs(t * 1e9 - (r["first_token_ns"] - r["arrival_ns"])) / 1e6)
        if seen[rid].get("ttft_ns"):
            cli.append(abs(t * 1e9 - seen[rid]["ttft_ns"]) / 1e6)

    def stat(x: list[float]) -> dict[str, float | None]:
        return {"mean": round(statistics.fmean(x), 3) if x else None,
                "max": round(max(x), 3) if x else None}
    return {"ttft_abs_err_ms": stat(srv), "ttft_abs_err_vs_client_ms": stat(cli)}


def sampling(sample: str, period_s: float | None = None) -> dict[str, Any]:
    """``--gpu-sample`` as `tokentrace run` takes it: ``auto`` (its policy,
    tracer/autosample.py), a fraction, or 1 (every launch counted); ``period_s``: its
    ``--gpu-sample-period`` (default: the agent's)."""
    period = {"gpu_sample_period_s": period_s} if period_s else {}
    if sample == "auto":
        from tracer.autosample import AutoSample
        return {"auto_sample": AutoSample(), **period}
    f = float(sample)
    return {"gpu_sample": f, **period} if f < 1.0 else {}


def run_hf_case(continuous: bool, concurrency: int, requests: int, device: str, work: Path,
                model: Path, keep: Path | None = None, pricing: Any = None,
                sample: str = "1", period_s: float | None = None) -> dict[str, Any]:
    """HF ``transformers serve`` (a server nobody here wrote) under the tracer: its
    truth comes from ``samples/hf/truth`` inside the server, never from the tracer.
    With ``keep``, the capture, truth and client results are copied there. ``sample``:
    the tracer's ``--gpu-sample``."""
    from samples.hf.serve import HfServer

    name = f"hf-{'cb' if continuous else 'plain'}-c{concurrency}"
    truth_path, cap = work / f"{name}.truth.jsonl", work / f"{name}.ttcap"
    truth_path.unlink(missing_ok=True)
    server = HfServer(model, truth_path, work / f"{name}.log", continuous, device)
    try:
        server.wait_ready()
        server.warm_up()
        client_out = work / f"{name}.client.json"
        config = sampling(sample, period_s)
        with traced(pids=[server.pid], settle=1.0, pricing=pricing, record=str(cap),
                    **config) as got:
            subprocess.run([sys.executable, "-m", "samples.batching.load", "--url", server.url,
                            "--requests", str(requests), "--concurrency", str(concurrency),
                            "--out", str(client_out), "--seed", str(concurrency),
                            "--model", str(model), "--max-tokens", "24:150",
                            "--words", "5:300", "--stream-share", "0.75",
                            "--usage-share", "1.0"], cwd=ROOT, check=True, timeout=900)
            time.sleep(0.5)
        server.flush_truth()
    finally:
        server.stop()
    if keep is not None:  # one file per case: the device tool brings back few files
        import tarfile
        keep.mkdir(parents=True, exist_ok=True)
        with tarfile.open(keep / f"{name}.tgz", "w:gz") as tar:
            for f in (cap, truth_path, client_out, work / f"{name}.log"):
                tar.add(f, arcname=f.name)
    lines = truth_path.read_text().splitlines()
    return {"server": name, "concurrency": concurrency, "device": device,
            **score(lines, got.spans, got.report),
            **ttft_errors(lines, got.spans, json.loads(client_out.read_text())),
            "kernel_names": {**kernel_names(got.gpu, lines),
                             "naming": (got.naming or {}).get("before_attach")},
            "gpu_sample": sample, "gpu_sample_period_s": period_s,
            "launch_sampling": got.gpu.get("launch_sampling"),
            **({"auto_sample": {"state": config["auto_sample"].state,
                                "reason": config["auto_sample"].reason}}
               if "auto_sample" in config else {})}


def kernel_names(gpu: dict[str, Any], lines: list[str]) -> dict[str, Any]:
    """How many of the server's launches the tracer named (attached after warm-up), by
    source, and its top 10 kernels against the profiler's (names shortened alike)."""
    from tracer.correlate.kernelnames import readable, shorten
    procs = gpu.get("processes", [])
    launches = sum(p.get("kernel_launches", 0) for p in procs)
    by_source: dict[str, int] = {}
    for p in procs:
        for src, row in (p.get("kernel_names") or {}).items():
            if isinstance(row, dict):
                by_source[src] = by_source.get(src, 0) + int(row.get("launches", 0))
    tracer_top = [readable(k["name"]) for p in procs for k in p.get("top_kernels", [])][:10]
    prof = next((json.loads(x)["launches"] for x in lines if '"kernel_names"' in x), {})
    prof_top = [shorten(n) for n in list(prof)[:10]]
    return {"launches": launches, "by_source": by_source,
            "named_share": round(1 - by_source.get("unknown", 0) / launches, 4) if launches else None,
            "top10_tracer": tracer_top, "top10_profiler": prof_top,
            "top10_same_set": sorted(tracer_top) == sorted(prof_top)}


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| server | conc. | requests | kernel share MAE/mean | p95 rel. "
            "| GPU time share MAE/mean (vs kernel time / vs step wall) "
            "| charged/observed launches | TTFT err mean / max (ms) |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        k, g, t = r["kernel_share"], r["gpu_time_share"], r["ttft_abs_err_ms"]
        w = r.get("gpu_time_share_wall")
        wall = f" / {w['mae_over_mean']}" if w else ""
        name = r.get("server") or r["layout"] + (f" cost {r['step_cost']}" if r.get("step_cost") else "")
        rows.append(f"| {name} | {r['concurrency']} | {r['requests_traced']}/"
                    f"{r['requests_truth']} | {k['mae_over_mean']} | {k['p95_rel']} | "
                    f"{g['mae_over_mean']}{wall} | {r.get('charged_over_observed')} | "
                    f"{t['mean']} / {t['max']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="batching", choices=("batching", "hf-cb", "hf-plain"),
                    help="our batching samples (--layouts) or HF transformers serve")
    ap.add_argument("--keep", type=Path, help="keep captures and truths here")
    ap.add_argument("--layouts", default="thread,process,tp2")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", default="64",
                    help="requests per case, or one count per concurrency (hf: 48,128,384)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--step-cost", help="FIXED,PER_MEMBER,PER_PREFILL launches per step "
                    "(batching stand-in; default 6,1,2)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--gpu-sample", default="1", metavar="FRACTION|auto",
                    help="hf: the tracer's --gpu-sample (default 1: every launch counted, "
                         "NOT the tracer's own default; auto measures what it does)")
    ap.add_argument("--gpu-sample-period", type=float, metavar="S",
                    help="hf: the tracer's --gpu-sample-period (default: its own, 1 s "
                         "through uprobe_multi links, else 5 s)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/accuracy.json"))
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tt-accuracy-"))
    results = []
    if args.server.startswith("hf-"):
        from samples.hf.model import build as build_model
        model = build_model(work / "tiny-llama")
        conc = [int(x) for x in args.concurrency.split(",")]
        counts = [int(x) for x in args.requests.split(",")]
        for c, n in zip(conc, counts * len(conc) if len(counts) == 1 else counts):
            results.append(run_hf_case(args.server == "hf-cb", c, n, args.device, work, model,
                                       args.keep, sample=args.gpu_sample,
                                       period_s=args.gpu_sample_period))
            print(json.dumps(results[-1]), flush=True)
        return finish(args, results, server=args.server)
    libs = build(work / "gpu") if args.device == "cpu" else None
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    for layout in args.layouts.split(","):
        for c in (int(x) for x in args.concurrency.split(",")):
            keep = args.keep / f"{layout}-c{c}" if args.keep is not None else None
            results.append(run_case(layout, c, int(args.requests.split(",")[0]), args.device,
                                    libs, work, args.max_batch, step_cost=args.step_cost,
                                    record=keep.with_suffix(".ttcap") if keep else None))
            if keep is not None:
                name = f"{layout}-c{c}" + (f"-cost{args.step_cost.replace(',', '_')}"
                                          if args.step_cost else "")
                shutil.copy(work / f"truth-{name}.jsonl", keep.with_suffix(".truth.jsonl"))
            print(json.dumps(results[-1]), flush=True)
    return finish(args, results, max_batch=args.max_batch)


def finish(args: argparse.Namespace, results: list[dict[str, Any]], **meta: Any) -> int:
    """Write the results JSON and print the table."""
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**meta, "device": args.device,
                                          "requests": args.requests,
                                          "results": results}, indent=1) + "\n")
    print(table(results))
    return 0

if __name__ == "__main__":
    sys.exit(main())

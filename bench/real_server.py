"""What tracing costs a real server, to 1% where the host allows: many short windows,
traced and untraced, in one run, with the agent kept running and only its probes
taken out and put back (`tokentrace run --control`, docs of `tokentrace ctl`).

    python bench/real_server.py [--servers hf-cb,hf-plain,batching,grpc] [--device cpu]
        [--requests 32] [--concurrency 8] [--max-tokens 16:48] [--min-pairs 8]
        [--max-pairs 40] [--target 0.01] [--budget-s 240] [--breakdown]
        [--breakdown-every N] [--out bench/results/real_server.json]

On an H100/H200 host (after `eval "$(.gpu/setup-bcc.sh)"`, as bench/accuracy.py runs
there), one command, under 7 minutes, writes OUT_DIR/real_server.json:

    python3 bench/real_server.py --servers hf-cb --device cuda --requests 96 \\
        --concurrency 32 --max-tokens 24:150 --min-pairs 6 --max-pairs 60 --budget-s 270 \\
        --breakdown --breakdown-every 3 --out OUT_DIR/real_server-hf-cb-h100.json

Servers: HF ``transformers serve`` with ``--continuous-batching`` (``hf-cb``) and
without (``hf-plain``) on a tiny Llama built offline (a server nobody here wrote); the
continuous-batching sample (``batching``: engine thread, stand-in libcuda on the CPU so
its GPU probes fire); the KServe gRPC sample (``grpc``, streamed ModelStreamInfer
calls). The server, the load generator and the agent run on separate CPUs where the
host has them (on 2 CPUs: the agent alone on one, server and client on the other).

A window sends the same fixed mix (``--requests`` at ``--concurrency``, the same
prompts and max_tokens every window) and measures, client side, output tokens/s and
each streamed request's TTFT; and from /proc, the CPU seconds the server and the agent
used. Windows come in pairs, one traced and one untraced, the order alternating (ABBA)
so drift cancels; per pair the ratio traced/untraced. Pairs are added until the 95%
interval of the mean ratio (t over the pairs' log ratios) is narrower than
``--target`` either side, or ``--max-pairs`` / ``--budget-s`` run out: the interval is
reported either way. Reported per server: tokens/s ratio, p50 and p99 TTFT ratios
(pooled; interval by resampling pairs), server CPU per output token ratio (probe work
runs in the server's own CPU time: robust to a busy host), agent CPU per 1k requests
and per 1M kernel launches, records the agent read per second, and the switch times.

``--breakdown`` adds windows with one part of the tracer off while the rest traces
(payload copies: capture-limit 1 byte; the agent's analysis: records read and
dropped; on GPU servers the kernel-launch uprobes, the stub-naming window, and
``--burst-min-us 1000``), and reports each part's share of the server's added CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLK = os.sysconf("SC_CLK_TCK")


# ---- processes ------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / CLK


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
                todo += [int(k) for k in kids]
        except OSError:
            pass
    return out


def tree_cpu(pid: int) -> float:
    return sum(cpu_seconds(p) for p in tree(pid))


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` and of its descendants onto ``cpus``."""
    for p in tree(pid):
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                try:
                    os.sched_setaffinity(int(t), cpus)
                except OSError:
                    pass
        except OSError:
            pass


def plan_cpus(n: int | None = None) -> dict[str, set[int]]:
    """Agent, server and client CPUs: apart where the host has enough."""
    cpus = sorted(os.sched_getaffinity(0)) if n is None else list(range(n))
    if len(cpus) >= 6:
        return {"agent": {cpus[0]}, "client": set(cpus[1:3]), "server": set(cpus[3:])}
    if len(cpus) >= 3:
        return {"agent": {cpus[0]}, "client": {cpus[1]}, "server": set(cpus[2:])}
    if len(cpus) == 2:
        return {"agent": {cpus[1]}, "client": {cpus[0]}, "server": {cpus[0]}}
    return {"agent": set(cpus), "client": set(cpus), "server": set(cpus)}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill_group(p: subprocess.Popen[Any]) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
        except ProcessLookupError:
            pass


def wait_http(url: str, proc: subprocess.Popen[Any], log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"server did not start: {log.read_text()[-3000:]}")


class Server:
    """One server process (group), its URL or gRPC target, and how to load it."""

    def __init__(self, kind: str, device: str, work: Path, cpus: set[int]) -> None:
        self.kind = kind
        self.log = work / f"{kind}.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.port = free_port()
        self.model = "tiny-gpt"
        if kind in ("hf-cb", "hf-plain"):
            from samples.hf.model import build
            self.model = str(build(work / "tiny-llama"))
            cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model,
                   "--device", device, "--port", str(self.port), "--host", "127.0.0.1",
                   *(["--continuous-batching"] if kind == "hf-cb" else [])]
        elif kind == "batching":
            from samples.gpu.build import build as build_gpu
            cmd = [sys.executable, "-m", "samples.batching.server", "--port", str(self.port),
                   "--layout", "thread", "--device", device, "--truth", str(work / "truth.jsonl"),
                   "--max-batch", "16"]
            if device == "cpu":
                cmd += ["--libcuda", str(build_gpu(work / "gpu")["libcuda"])]
        elif kind == "grpc":
            cmd = [sys.executable, "-m", "samples.kserve_grpc_server", "--port", str(self.port),
                   "--device", device]
        else:
            raise SystemExit(f"unknown server {kind}")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        self.url = f"http://127.0.0.1:{self.port}"
        if kind == "grpc":
            from samples.launch_grpc import GrpcSampleServer
            probe = GrpcSampleServer(port=self.port)
            deadline = time.monotonic() + 120
            while not probe._healthy():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"grpc server did not start: {self.log.read_text()[-2000:]}")
                time.sleep(0.3)
        else:
            wait_http(self.url + ("/health" if kind != "batching" else "/v1/models"), self.proc,
                      self.log)
        self.cpus = cpus

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        kill_group(self.proc)


# ---- the load generator (its own process) -----------------------------------------------


def client_main(args: argparse.Namespace) -> int:
    """``--client``: one window per line on stdin ("window"), one JSON line back."""
    from samples.batching.load import Mix, make_jobs
    lo, hi = (int(x) for x in args.max_tokens.split(":"))
    jobs = make_jobs(args.requests, 7, Mix(model=args.model, max_tokens=(lo, hi),
                                           words=(5, 60), stream_share=1.0, usage_share=1.0,
                                           chat_share=0.5))
    if args.client_kind == "grpc":
        one = _grpc_sender(args.url)
    else:
        one = _openai_sender(args.url, args.model)
    for line in sys.stdin:
        if line.strip() != "window":
            continue
        results: list[tuple[float | None, int]] = []
        errors = [0]
        lock = threading.Lock()
        queue = list(jobs)

        def worker() -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    job = queue.pop()
                try:
                    r = one(job)
                except Exception:  # counted: a window with errors is reported as such
                    with lock:
                        errors[0] += 1
                    continue
                with lock:
                    results.append(r)

        t0 = time.monotonic()
        threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        print(json.dumps({"wall_s": wall, "requests": len(results), "errors": errors[0],
                          "tokens": sum(n for _, n in results),
                          "ttft_ms": [round(t * 1e3, 3) for t, _ in results if t is not None]}),
              flush=True)
    return 0


def _openai_sender(url: str, model: str) -> Any:
    import openai

    from samples.batching.load import send
    local = threading.local()

    def one(job: Any) -> tuple[float | None, int]:
        if not hasattr(local, "client"):
            local.client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none",
                                         max_retries=0, timeout=300)
        _, seen = send(local.client, job, model)
        return (seen.ttft_ns / 1e9 if seen.ttft_ns else None), seen.tokens
    return one


def _grpc_sender(url: str) -> Any:
    import grpc

    from protocols.proto import grpc_predict_v2_pb2 as pb
    from protocols.proto import grpc_predict_v2_pb2_grpc as pbg
    from samples.kserve_grpc_server import bytes_tensor
    import struct
    target = url.replace("http://", "")
    local = threading.local()

    def one(job: Any) -> tuple[float | None, int]:
        if not hasattr(local, "stub"):
            local.stub = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(target))
        req = pb.ModelInferRequest(model_name="tiny-gpt", id=f"r{random.getrandbits(32)}")
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        req.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
        req.raw_input_contents.append(bytes_tensor([job.prompt.encode()]))
        req.raw_input_contents.append(struct.pack("<i", job.max_tokens))
        t0 = time.monotonic()
        first, n = None, 0
        for resp in local.stub.ModelStreamInfer(iter([req]), timeout=300):
            if resp.error_message:
                raise RuntimeError(resp.error_message)
            if resp.infer_response.raw_output_contents:
                n += 1
                if first is None:
                    first = time.monotonic() - t0
        return first, n  # read to its end: leaving early would cancel (reset) the stream
    return one


class Client:
    def __init__(self, server: Server, args: argparse.Namespace, cpus: set[int]) -> None:
        cmd = [sys.executable, str(Path(__file__)), "--client", server.url,
               "--client-kind", "grpc" if server.kind == "grpc" else "openai",
               "--model", server.model, "--requests", str(args.requests),
               "--concurrency", str(args.concurrency), "--max-tokens", args.max_tokens]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cpus))

    def window(self) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("window\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the load generator died")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(30)


# ---- the agent ---------------------------------------------------------------------------


class Agent:
    """`tokentrace run --pid SERVER --control SOCK` on its own CPU, kept running."""

    def __init__(self, server: Server, work: Path, cpus: set[int], extra: list[str]) -> None:
        from tracer.control import send
        self.send = send
        self.sock = str(work / "agent.sock")
        self.summary = work / "summary.json"
        self.jsonl = work / "spans.jsonl"
        cmd = [sys.executable, "-m", "tracer", "run", "--pid", str(server.pid),
               "--control", self.sock, "--quiet", "--jsonl", str(self.jsonl),
               "--summary", str(self.summary), *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, cpus))
        assert self.proc.stderr is not None
        self.lines: list[str] = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("tokentrace run exited:\n" + "".join(self.lines))
            self.lines.append(line)
            if "attached" in line:
                break
        self.stderr = ""

    def ctl(self, command: str) -> str:
        reply = self.send(self.sock, command, timeout=120)
        if not reply.startswith("ok"):
            raise RuntimeError(f"{command}: {reply}")
        return reply

    def records(self) -> int:
        reply = self.ctl("status")
        return int(reply.rsplit("records=", 1)[1].split()[0])

    @property
    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> dict[str, Any]:
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=300)
        self.stderr = "".join(self.lines) + err
        try:
            return json.loads(self.summary.read_text())
        except (OSError, ValueError):
            return {}


# ---- windows and statistics ------------------------------------------------------------


MODES = {  # name -> control commands that set it up from "full" (the default tracing)
    "untraced": ["pause"],
    "full": [],
    "no-payload": ["capture-limit 1"],  # socket probes without their payload copies
    "no-analysis": ["analysis off"],  # the agent reads the records and drops them
    "no-launch-probes": ["gpu-launch off"],  # the kernel-launch uprobes out
    "burst-min-1ms": ["burst-min-us 1000"],  # a burst record per ms, not per sync
    "stub-naming-open": ["stub-naming on"],  # the runtime's launch probes in (at attach)
}
UNDO = {"untraced": ["resume"], "full": [], "no-payload": ["capture-limit 262144"],
        "no-analysis": ["analysis on"], "no-launch-probes": ["gpu-launch on"],
        "burst-min-1ms": ["burst-min-us 0"], "stub-naming-open": ["stub-naming off"]}


def t975(df: int) -> float:
    """The t distribution's 97.5% point (Cornish-Fisher; within 0.5% for df >= 3)."""
    z = 1.959964
    if df <= 0:
        return float("inf")
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    return z + g1 / df + g2 / df ** 2 + g3 / df ** 3


def ratio_ci(ratios: list[float]) -> dict[str, Any]:
    """Geometric mean of per-pair ratios and its 95% interval (t over log ratios)."""
    logs = [math.log(r) for r in ratios if r > 0]
    n = len(logs)
    if n < 2:
        return {"pairs": n, "ratio": ratios[0] if ratios else None, "ci95": None}
    m, sd = statistics.fmean(logs), statistics.stdev(logs)
    h = t975(n - 1) * sd / math.sqrt(n)
    return {"pairs": n, "ratio": round(math.exp(m), 4),
            "ci95": [round(math.exp(m - h), 4), round(math.exp(m + h), 4)],
            "half_width": round(math.exp(h) - 1, 4)}


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ttft_ratios(pairs: list[tuple[dict[str, Any], dict[str, Any]]], q: float,
                rng: random.Random, rounds: int = 400) -> dict[str, Any]:
    """Pooled TTFT quantile ``q`` traced / untraced, and a 95% interval from resampling
    the pairs."""
    def ratio(sample: list[tuple[dict[str, Any], dict[str, Any]]]) -> float | None:
        t = [x for tr, _ in sample for x in tr["ttft_ms"]]
        u = [x for _, un in sample for x in un["ttft_ms"]]
        a, b = pct(t, q), pct(u, q)
        return a / b if a and b else None

    point = ratio(pairs)
    boot = sorted(r for r in (ratio([rng.choice(pairs) for _ in pairs])
                              for _ in range(rounds)) if r is not None)
    ci = [round(pct(boot, 0.025), 4), round(pct(boot, 0.975), 4)] if boot else None
    return {"ratio": round(point, 4) if point else None, "ci95": ci}


def run_server(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    cpus = plan_cpus()
    server = Server(kind, args.device, work, cpus["server"])
    client = agent = None
    out: dict[str, Any] = {"server": kind, "device": args.device,
                           "cpus": {k: sorted(v) for k, v in cpus.items()},
                           "requests_per_window": args.requests,
                           "concurrency": args.concurrency, "max_tokens": args.max_tokens}
    try:
        client = Client(server, args, cpus["client"])
        for _ in range(args.warmup):
            client.window()  # the engine built, kernels loaded, caches warm
        agent = Agent(server, work, cpus["agent"], args.agent_args.split())
        pin(server.pid, cpus["server"])  # threads the server started since
        gpu = int(agent.ctl("status").rsplit("gpu_libs=", 1)[1].split()[0]) > 0
        if gpu:  # the window kernel naming opens at attach closes by itself once naming
            agent.ctl("stub-naming off")  # is quiet: closed now, "full" is the steady
            # state, and the window's cost a mode of its own
        modes = ["untraced", "full"]
        if args.breakdown:
            modes += ["no-payload", "no-analysis"]
            if gpu:
                modes += ["no-launch-probes", "burst-min-1ms", "stub-naming-open"]
        windows: list[dict[str, Any]] = []
        switches: list[float] = []
        t_start = time.monotonic()
        order = 0
        while True:
            # one round: untraced and full in alternating order (ABBA), the parts after
            rnd = ["untraced", "full"] if order % 2 == 0 else ["full", "untraced"]
            if order % args.breakdown_every == 0:
                rnd += [m for m in modes if m not in ("untraced", "full")]
            order += 1
            for mode in rnd:
                for cmd in MODES[mode]:
                    reply = agent.ctl(cmd)
                    if cmd in ("pause", "resume"):
                        switches.append(float(reply.split()[-1].rstrip("s")))
                time.sleep(args.settle_s)
                a0, s0, r0 = agent.cpu, tree_cpu(server.pid), agent.records()
                w = client.window()
                w.update(mode=mode, round=order, agent_cpu_s=agent.cpu - a0,
                         server_cpu_s=tree_cpu(server.pid) - s0,
                         agent_records=agent.records() - r0)
                windows.append(w)
                for cmd in UNDO[mode]:
                    reply = agent.ctl(cmd)
                    if cmd in ("pause", "resume"):
                        switches.append(float(reply.split()[-1].rstrip("s")))
            stats = summarise(windows, modes)
            elapsed = time.monotonic() - t_start
            hw = stats["tokens_per_s"].get("half_width")
            print(f"{kind}: round {order}, {elapsed:.0f}s: tokens/s ratio "
                  f"{stats['tokens_per_s'].get('ratio')} +-{hw}; server CPU/token ratio "
                  f"{stats['server_cpu_per_token'].get('ratio')} "
                  f"+-{stats['server_cpu_per_token'].get('half_width')}", file=sys.stderr,
                  flush=True)
            per_round = elapsed / order
            if order >= args.min_pairs and hw is not None and hw <= args.target:
                break
            if order >= args.max_pairs or elapsed + per_round > args.budget_s:
                break
        out.update(stats)
        out["windows"] = windows
        out["switch_s"] = {"max": max(switches, default=0.0),
                           "mean": round(statistics.fmean(switches), 4) if switches else 0.0}
    finally:
        summary = agent.stop() if agent is not None else {}
        if client is not None:
            client.close()
        server.stop()
    out["agent_report_tail"] = agent.stderr.strip().splitlines()[-3:] if agent else []
    launches = sum(p.get("kernel_launches", 0) for p in summary.get("gpu", {}).get("processes", []))
    traced = [w for w in out.get("windows", []) if w["mode"] != "untraced"]
    cpu_traced = sum(w["agent_cpu_s"] for w in traced)
    out["agent"] = {
        "cpu_per_1k_requests_s": round(1000 * cpu_traced / max(1, sum(w["requests"] for w in traced)), 4),
        "cpu_per_1m_launches_s": round(1e6 * cpu_traced / launches, 3) if launches else None,
        "launches_traced": launches,
        "cpu_untraced_windows_s": round(sum(w["agent_cpu_s"] for w in out.get("windows", [])
                                            if w["mode"] == "untraced"), 3),
        "records_per_s": round(sum(w["agent_records"] for w in traced)
                               / max(1e-9, sum(w["wall_s"] for w in traced)), 1),
        "report": summary.get("report", {}),
    }
    return out


def summarise(windows: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per round, each mode against that round's untraced window."""
    rounds: dict[int, dict[str, dict[str, Any]]] = {}
    for w in windows:
        rounds.setdefault(w["round"], {})[w["mode"]] = w
    full = [(r["full"], r["untraced"]) for r in rounds.values() if "full" in r and "untraced" in r]

    def tps(w: dict[str, Any]) -> float:
        return w["tokens"] / w["wall_s"] if w["wall_s"] else 0.0

    def cpt(w: dict[str, Any]) -> float:
        return w["server_cpu_s"] / max(1, w["tokens"])

    rng = random.Random(0)
    out: dict[str, Any] = {
        "tokens_per_s": ratio_ci([tps(t) / tps(u) for t, u in full if tps(u)]),
        "ttft_p50": ttft_ratios(full, 0.5, rng) if full else {},
        "ttft_p99": ttft_ratios(full, 0.99, rng) if full else {},
        "server_cpu_per_token": ratio_ci([cpt(t) / cpt(u) for t, u in full if cpt(u)]),
        "tokens_per_s_untraced": round(statistics.fmean(tps(u) for _, u in full), 1) if full else None,
        "errors": sum(w["errors"] for w in windows),
    }
    parts = {}
    for m in modes:
        if m in ("untraced", "full"):
            continue
        rows = [(r[m], r["full"], r["untraced"]) for r in rounds.values()
                if m in r and "full" in r and "untraced" in r]
        if not rows:
            continue
        # what the mode saves (or, stub-naming-open, adds) of the server CPU per token
        # full tracing adds over untraced: a part's share of the overhead
        added = [cpt(f) - cpt(u) for _, f, u in rows]
        saved = [cpt(f) - cpt(p) for p, f, _ in rows]
        parts[m] = {"tokens_per_s_vs_untraced": ratio_ci([tps(p) / tps(u) for p, _, u in rows]),
                    "server_cpu_per_token_vs_untraced": ratio_ci([cpt(p) / cpt(u) for p, _, u in rows]),
                    "server_cpu_per_token_vs_full": ratio_ci([cpt(p) / cpt(f) for p, f, _ in rows]),
                    "share_of_added_server_cpu": round(statistics.fmean(saved) / statistics.fmean(added), 3)
                    if statistics.fmean(added) > 0 else None,
                    "agent_cpu_per_1k_requests_s": round(1000 * sum(p["agent_cpu_s"] for p, _, _ in rows)
                                                         / max(1, sum(p["requests"] for p, _, _ in rows)), 4)}
    if parts:
        out["breakdown"] = parts
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="hf-cb,hf-plain,batching,grpc")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--requests", type=int, default=32, help="requests per window")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", default="16:48", metavar="LO:HI")
    ap.add_argument("--warmup", type=int, default=2, help="windows before the agent starts")
    ap.add_argument("--min-pairs", type=int, default=8)
    ap.add_argument("--max-pairs", type=int, default=40)
    ap.add_argument("--target", type=float, default=0.01,
                    help="stop once the tokens/s ratio's 95%% interval is this narrow either side")
    ap.add_argument("--budget-s", type=float, default=240.0, help="seconds of windows per server")
    ap.add_argument("--settle-s", type=float, default=0.3, help="pause after each switch")
    ap.add_argument("--breakdown", action="store_true", help="also each part off in turn")
    ap.add_argument("--breakdown-every", type=int, default=1, metavar="N",
                    help="the parts' windows in every Nth round only (more pairs for the "
                         "headline ratio in the same time)")
    ap.add_argument("--agent-args", default="", help="more `tokentrace run` options")
    ap.add_argument("--out", default=str(ROOT / "bench/results/real_server.json"))
    # the load generator's own process
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--client-kind", default="openai", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="tiny-gpt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        args.url = args.client
        return client_main(args)
    if os.geteuid() != 0:
        raise SystemExit("needs root (BPF)")
    results = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tt-real-") as tmp:
        for kind in args.servers.split(","):
            work = Path(tmp, kind)
            work.mkdir()
            results.append(run_server(kind, args, work))
            r = results[-1]
            print(json.dumps({k: r.get(k) for k in ("server", "tokens_per_s", "ttft_p50",
                                                   "ttft_p99", "server_cpu_per_token",
                                                   "agent", "breakdown")}, default=str),
                  file=sys.stderr, flush=True)
    doc = {"host_cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0],
           "seconds": round(time.monotonic() - t0, 1), "args": vars(args), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    for r in results:
        print(f"{r['server']}: tokens/s {r['tokens_per_s']}  TTFT p50 {r['ttft_p50']}  "
              f"p99 {r['ttft_p99']}  server CPU/token {r['server_cpu_per_token']}  "
              f"agent {json.dumps({k: v for k, v in r['agent'].items() if k != 'report'})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

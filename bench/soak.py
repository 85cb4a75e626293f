"""Soak: a live tracer under hostile load stays alive and within a memory bound.

A real server (an asyncio HTTP server here, answering chat requests as JSON or SSE
streams and anything else with a 400) is traced by `tokentrace run --pid` as a user
runs it. While ``--idle`` keep-alive connections sit open (each after one real
request), worker threads send ``--megabytes`` of traffic: real requests mutated by the
fuzzers' operations (tests/fuzz_targets.py), requests with large bodies, HTTP/2 and
gRPC conversations fuzzed the same way, and real streamed (SSE) requests. The agent's
RSS is sampled twice a second; at the end it is stopped with SIGINT and its exit report
is kept (drops, parser errors, evictions).

    python bench/soak.py [--idle 10000] [--megabytes 1024] [--workers 8]
        [--growth-bound-mb 64] [--out bench/results/soak.json]

Exit status 1 when the agent died, printed a traceback, or its RSS grew more than
``--growth-bound-mb`` over its first sample after attach (the compiled BPF programs
and the interpreter are the baseline; what a stranger's traffic adds must stay bounded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SSE_CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


# ---- the traced server ------------------------------------------------------------

async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One connection: HTTP/1.1 requests answered until the peer goes away."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    try:
                        length = min(int(line.split(b":", 1)[1]), 64 << 20)
                    except ValueError:
                        length = -1
            if length < 0 or not head.startswith((b"POST ", b"GET ")):
                writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
                return
            body = await reader.readexactly(length) if length else b""
            if b'"stream": true' in body or b'"stream":true' in body:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                for _ in range(20):
                    writer.write(b"%x\r\n%s\r\n" % (len(SSE_CHUNK), SSE_CHUNK))
                    await writer.drain()
                done = b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            else:
                reply = (b'{"id":"x","object":"chat.completion","choices":[{"index":0,'
                         b'"message":{"role":"assistant","content":"ok"}}],"usage":'
                         b'{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}')
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(reply), reply))
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
            ValueError):
        pass
    finally:
        writer.close()


def serve(port_file: str) -> None:
    raise_nofile()

    async def main() -> None:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0, limit=1 << 20, backlog=4096)
        Path(port_file).write_text(str(srv.sockets[0].getsockname()[1]))
        await srv.serve_forever()

    asyncio.run(main())


# ---- the load ---------------------------------------------------------------------

def chat(stream: bool, size: int = 0) -> bytes:
    body = json.dumps({"model": "m", "stream": stream, "max_tokens": 20,
                       "messages": [{"role": "user", "content": "x" * size or "hi"}]}).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


def one(port: int, payload: bytes, read: bool = True) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            if read:
                while s.recv(65536):
                    pass
    except OSError:
        pass


def worker(port: int, budget: list[int], lock: threading.Lock, seed: int,
           sent: list[int]) -> None:
    from tests import fuzz_targets as ft
    rng = random.Random(seed)
    http1 = [c for c, _ in ft.http1_corpus()]
    h2 = [b"".join(d for inbound, d in conv if inbound) for conv in ft.h2_corpus()]
    while True:
        r = rng.random()
        if r < 0.05:
            payload = chat(stream=True)
        elif r < 0.25:
            payload = chat(stream=False, size=rng.randint(1 << 16, 1 << 20))  # large bodies
        elif r < 0.40:
            payload = ft.apply_ops(rng.choice(h2), ft.random_case(rng, 1)[1])
        else:
            payload = ft.apply_ops(rng.choice(http1), ft.random_case(rng, 1)[1])
        with lock:
            if budget[0] <= 0:
                return
            budget[0] -= len(payload)
            sent[0] += len(payload)
        one(port, payload)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=int, default=10000)
    ap.add_argument("--megabytes", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--growth-bound-mb", type=float, default=64.0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/soak.json"))
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    nofile = raise_nofile()
    if nofile < args.idle + 1000:
        raise SystemExit(f"RLIMIT_NOFILE hard limit {nofile} is below --idle {args.idle}")
    work = Path(f"/tmp/tt-soak-{os.getpid()}")
    work.mkdir()
    port_file = work / "port"
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)])
    agent = None
    idle: list[socket.socket] = []
    samples: list[tuple[float, float]] = []
    try:
        while not port_file.exists():
            time.sleep(0.1)
        port = int(port_file.read_text())
        agent = subprocess.Popen([sys.executable, "-m", "tracer", "run", "--pid", str(server.pid),
                                  "--summary", str(work / "summary.json"), "--quiet"],
                                 stderr=subprocess.PIPE, text=True, cwd=ROOT)
        err_lines = []
        while True:
            line = agent.stderr.readline()
            if not line:
                raise SystemExit("the agent exited before attaching:\n" + "".join(err_lines))
            err_lines.append(line)
            if "attached" in line:
                break
        t0 = time.monotonic()
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                v = rss_mb(agent.pid)
                if v is not None:
                    samples.append((round(time.monotonic() - t0, 2), round(v, 1)))
                time.sleep(0.5)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        # idle keep-alive connections, each after one real request
        request = chat(stream=False)
        for _ in range(args.idle):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(request)
            s.recv(65536)
            idle.append(s)
        t_idle = time.monotonic() - t0
        budget, sent, lock = [args.megabytes << 20], [0], threading.Lock()
        threads = [threading.Thread(target=worker, args=(port, budget, lock, i, sent))
                   for i in range(args.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_load = time.monotonic() - t0 - t_idle
        time.sleep(2)
        stop.set()
        sampler.join()
        agent_alive = agent.poll() is None
        for s in idle:
            s.close()
        agent.send_signal(signal.SIGINT)
        _, rest = agent.communicate(timeout=120)
        stderr = "".join(err_lines) + rest
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
        server.terminate()
        server.wait(10)
    summary = json.loads((work / "summary.json").read_text()) if (work / "summary.json").exists() else {}
    report = summary.get("report", {})
    peak = max((v for _, v in samples), default=None)
    result: dict[str, Any] = {
        "idle_connections": args.idle, "megabytes_sent": round(sent[0] / 2**20, 1),
        "workers": args.workers, "seconds_idle_setup": round(t_idle, 1),
        "seconds_load": round(t_load, 1),
        "agent_alive_at_end": agent_alive, "agent_exit_code": agent.returncode,
        "traceback": "Traceback" in stderr,
        "rss_mb": {"first": samples[0][1] if samples else None, "peak": peak,
                   "last": samples[-1][1] if samples else None,
                   "growth": round(peak - samples[0][1], 1) if samples else None,
                   "growth_bound": args.growth_bound_mb},
        "rss_samples": samples[:: max(1, len(samples) // 60)],
        "report": {k: v for k, v in report.items()
                   if v and (k.startswith(("capture.", "parser_errors", "connections"))
                             or k.endswith(("_evicted", "_over_budget", "_dropped")))},
        "exit_report": [ln for ln in stderr.splitlines() if ln.startswith("tokentrace:")][-4:],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=1))
    ok = agent_alive and agent.returncode == 0 and not result["traceback"] and (
        peak is not None and peak - samples[0][1] <= args.growth_bound_mb)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The agent's memory over a steady run: `tokentrace run` on a real server under a
steady streamed load for ``--minutes``, its RSS sampled every ``--every`` seconds.

    python bench/agent_memory.py [--minutes 10] [--every 5] [--rate 20]
        [--out bench/results/agent_memory.json]

The server is the stdlib sample (``samples/stdlib_server.py``, a thread per
connection, chunked SSE streams of ``--tokens`` tokens); the load a separate process
keeping ``--concurrency`` keep-alive connections busy at about ``--rate`` requests/s,
every ``--churn``-th request on a new connection (so connections come and go as
well). The agent exports spans to a JSONL file, as in production. Reported: the RSS
samples (seconds, MB, requests so far), the RSS at the end of the first minute and at
the end, the least-squares slope over the second half (MB per minute), spans exported
and what the agent reported lost.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def load_main(args: argparse.Namespace) -> int:
    """``--load PORT``: steady streamed requests until stdin closes; prints the count."""
    done = [0]
    stop = threading.Event()
    body = json.dumps({"model": "m", "stream": True, "max_tokens": args.tokens,
                       "messages": [{"role": "user", "content": "steady " * 20}]})
    gap = args.concurrency / args.rate

    def worker(i: int) -> None:
        conn = None
        n = 0
        next_at = time.monotonic() + gap * i / args.concurrency
        while not stop.is_set():
            if conn is None or n % args.churn == 0:
                if conn is not None:
                    conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", args.load, timeout=30)
            try:
                conn.request("POST", "/v1/chat/completions", body,
                             {"Content-Type": "application/json", "Authorization": "Bearer k"})
                r = conn.getresponse()
                r.read()
                done[0] += 1
            except OSError:
                conn = None
            n += 1
            next_at += gap
            time.sleep(max(0.0, next_at - time.monotonic()))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True)
               for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for line in sys.stdin:
        print(done[0], flush=True)
    stop.set()
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=20.0, help="requests/s")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--churn", type=int, default=10, help="a new connection every N requests")
    ap.add_argument("--out", default=str(ROOT / "bench/results/agent_memory.json"))
    ap.add_argument("--load", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.load:
        return load_main(args)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="tt-mem-") as tmp:
        server = subprocess.Popen([sys.executable, "-m", "samples.stdlib_server", "--port",
                                   str(port), "--token-ms", "2"], cwd=ROOT, env=env,
                                  start_new_session=True, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        time.sleep(1.5)
        jsonl = Path(tmp, "spans.jsonl")
        agent = subprocess.Popen([sys.executable, "-m", "tracer", "run", "--pid", str(server.pid),
                                  "--quiet", "--jsonl", str(jsonl)], cwd=ROOT,
                                 stderr=subprocess.PIPE, text=True)
        assert agent.stderr is not None
        while "attached" not in (line := agent.stderr.readline()):
            if not line:
                raise SystemExit("tokentrace run exited")
        load = subprocess.Popen([sys.executable, __file__, "--load", str(port), "--rate",
                                 str(args.rate), "--concurrency", str(args.concurrency),
                                 "--tokens", str(args.tokens), "--churn", str(args.churn)],
                                cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        samples: list[dict[str, Any]] = []
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < args.minutes * 60:
                time.sleep(args.every)
                assert load.stdin is not None and load.stdout is not None
                load.stdin.write("n\n")
                load.stdin.flush()
                n = int(load.stdout.readline())
                samples.append({"s": round(time.monotonic() - t0, 1),
                                "rss_mb": round(rss_mb(agent.pid), 2), "requests": n})
                print(json.dumps(samples[-1]), flush=True)
        finally:
            if load.stdin:
                load.stdin.close()
            load.wait(30)
            time.sleep(1)
            agent.send_signal(signal.SIGINT)
            _, err = agent.communicate(timeout=120)
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(10)
        spans = sum(1 for _ in jsonl.open())
    half = [s for s in samples if s["s"] >= samples[-1]["s"] / 2]
    first_min = [s for s in samples if s["s"] <= 60]
    doc = {
        "minutes": args.minutes, "rate": args.rate, "concurrency": args.concurrency,
        "tokens": args.tokens, "churn": args.churn,
        "requests": samples[-1]["requests"], "spans": spans,
        "rss_mb_after_1min": first_min[-1]["rss_mb"] if first_min else None,
        "rss_mb_end": samples[-1]["rss_mb"],
        "rss_mb_max": max(s["rss_mb"] for s in samples),
        "second_half_slope_mb_per_min": round(60 * slope([s["s"] for s in half],
                                                          [s["rss_mb"] for s in half]), 3),
        "second_half_range_mb": round(max(s["rss_mb"] for s in half)
                                      - min(s["rss_mb"] for s in half), 2),
        "agent_report": next((x for x in err.splitlines() if "requests exported" in x), ""),
        "samples": samples,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({k: v for k, v in doc.items() if k != "samples"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

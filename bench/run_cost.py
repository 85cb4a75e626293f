"""What a streamed token's write costs the traced process, with and without token runs
(bpf/sockets.c): a record per write, or staged in the kernel once the connection is
armed. Measured in the process's own CPU time (getrusage).

    python bench/run_cost.py [--calls 20000] [--rounds 8] [--cpu 1]
        [--out bench/results/run_cost.json]

A small C program holds a TCP connection to itself (loopback) and, per window, writes
``--calls`` token chunks as HF ``transformers serve`` writes them (chunked framing
around an SSE event: 83 bytes before the token's JSON string, 196 after, ~290 in all)
on one end and reads them on the other. The probes are loaded in this process (a
``CaptureSession``; the records are read and dropped) and switched, window by window
in rotating order, between: untraced (paused), traced with a record per write
(``one-record``: the connection not armed), traced with runs (``runs``: armed with the
chunks' template, as the agent arms a response it has read). Per mode: CPU per write
(and its read), the difference from untraced with a 95% interval over the rounds,
and what the kernel sent.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEAD = b'data: {"id":"69c0ff2c-4975-4cef-bd97-b12474db7dde","choices":[{"delta":{"content":'
TAIL = (b'},"index":0}],"created":1795623972,"model":"/tmp/pytest-of-root/pytest-374/'
        b'test_hf_transformers_serve_str0/tiny-llama","object":"chat.completion.chunk",'
        b'"system_fingerprint":""}\n\n')

PROG = r"""
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

static double cpu(void) {
    struct rusage r; getrusage(RUSAGE_SELF, &r);
    return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

int main(int argc, char **argv) {
    const char *chunk = argv[1];
    long size = strlen(chunk);
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    bind(l, (struct sockaddr *)&a, sizeof a); listen(l, 1); getsockname(l, (struct sockaddr *)&a, &al);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    connect(c, (struct sockaddr *)&a, sizeof a);
    int s = accept(l, NULL, NULL);
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    static char buf[1 << 16];
    printf("ready %d\n", c); fflush(stdout);
    long n;
    while (scanf("%ld", &n) == 1) {
        double t0 = cpu();
        for (long i = 0; i < n; i++) {
            if (write(c, chunk, size) != size) return 1;
            for (long got = 0; got < size;) {
                long r = read(s, buf, size - got);
                if (r <= 0) return 1;
                got += r;
            }
        }
        printf("%.6f\n", cpu() - t0); fflush(stdout);
    }
    return 0;
}
"""


def chunk(text: bytes = b'"tok"') -> bytes:
    body = HEAD + text + TAIL
    return b"%x\r\n" % len(body) + body + b"\r\n"


def t975(n: int) -> float:
    table = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31,
             9: 2.26, 10: 2.23, 15: 2.13, 20: 2.09, 30: 2.04}
    return table.get(n, table[min((k for k in table if k >= n), default=30)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000, help="writes per window")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cpu", type=int, default=1, help="the CPU the writer runs on")
    ap.add_argument("--out", default=str(ROOT / "bench/results/run_cost.json"))
    args = ap.parse_args(argv)
    from tracer.probes.session import CaptureConfig, CaptureSession

    sent: dict[int, int] = {}

    def sink(item: Any) -> None:
        if isinstance(item, bytes):
            k = int.from_bytes(item[:4], "little")
            sent[k] = sent.get(k, 0) + 1

    data = chunk()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "blast.c")
        src.write_text(PROG)
        subprocess.run(["gcc", "-O2", "-o", str(Path(tmp, "blast")), str(src)], check=True)
        proc = subprocess.Popen([str(Path(tmp, "blast")), data.decode()], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: os.sched_setaffinity(0, {args.cpu}))
        assert proc.stdin is not None and proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[0] == "ready"
        fd = int(line[1])
        session = CaptureSession(CaptureConfig(pids=[proc.pid], concerns=("process", "sockets"),
                                               net_timing="syscall"), sink)
        session.start()
        key = proc.pid << 32 | fd

        def window(mode: str) -> float:
            if mode == "untraced":
                session.pause()
            elif mode == "runs":  # the socket's conn_id is new after each resume
                conn_id = next(v.conn_id for k, v in session.bpf[b"conns"].items()
                               if k.value == key)
                session.arm_runs([((proc.pid, fd, conn_id), HEAD, TAIL)])
            proc.stdin.write(f"{args.calls}\n")
            proc.stdin.flush()
            took = float(proc.stdout.readline())
            session.poll(0)
            if mode == "untraced":
                session.resume()
                session.poll(0)
            elif mode == "runs":
                session.bpf[b"run_arms"].clear()
            return took / args.calls * 1e6

        modes = ("untraced", "one-record", "runs")
        per: dict[str, list[float]] = {m: [] for m in modes}
        window("one-record")  # warm up
        for r in range(args.rounds):
            for m in modes[r % 3:] + modes[:r % 3]:
                per[m].append(window(m))
        counters = session.kernel_counters()
        session.stop()
        proc.stdin.close()
        proc.wait(10)
    base = per["untraced"]
    out: dict[str, Any] = {"calls": args.calls, "rounds": args.rounds, "write_bytes": len(data),
                           "modes": {}, "kernel": {"run_writes": counters.get("run_writes", 0),
                                                   "lost_run": counters.get("lost_run", 0),
                                                   "records": sent}}
    for m in modes:
        diffs = [a - b for a, b in zip(per[m], base)]
        sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        half = t975(len(diffs) - 1) * sd / math.sqrt(len(diffs)) if len(diffs) > 1 else None
        out["modes"][m] = {"us_per_write": round(statistics.median(per[m]), 3),
                           "over_untraced_us": round(statistics.mean(diffs), 3),
                           "ci95_half_us": round(half, 3) if half is not None else None,
                           "windows": [round(x, 3) for x in per[m]]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What each part of the socket tracing costs the traced process, per syscall, measured
in the process's own CPU time (getrusage: robust on a busy host, unlike wall clock).

    python bench/probe_costs.py [--sizes 200,4096,65536] [--calls 20000] [--rounds 8]
        [--out bench/results/probe_costs.json]

A small C program holds a TCP connection to itself (loopback) and, per window, makes
``--calls`` write() of SIZE bytes on one end and read()s of them on the other, and
reports the CPU it used (user + system). One `tokentrace run --pid --control` agent is
kept running beside it on another CPU and switched, window by window in rotating
order, between: untraced (``pause``: no probe in), full tracing, the socket probes
without their payload copies (``capture-limit 1``), and full tracing with the agent
reading the records but not analysing them (``analysis off``). Per size and mode: CPU
per syscall (write or read), its difference from untraced with a 95% interval over the
rounds, and the agent's CPU per record. Sizes: a streamed token's chunk (~200 B), a
request with a long prompt (4 KiB), a large body (64 KiB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real_server import Agent, cpu_seconds, t975  # noqa: E402

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
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    bind(l, (struct sockaddr *)&a, sizeof a); listen(l, 1); getsockname(l, (struct sockaddr *)&a, &al);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    connect(c, (struct sockaddr *)&a, sizeof a);
    int s = accept(l, NULL, NULL);
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    static char buf[1 << 20];
    memset(buf, 'x', sizeof buf);
    if (argc > 1) {  /* the bytes every write starts with (a token's chunk) */
        size_t n = strlen(argv[1]);
        memcpy(buf, argv[1], n < sizeof buf ? n : sizeof buf);
    }
    printf("ready %d\n", c); fflush(stdout);
    long n, size;
    while (scanf("%ld %ld", &n, &size) == 2) {
        double t0 = cpu();
        for (long i = 0; i < n; i++) {
            if (write(c, buf, size) != size) return 1;
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

MODES = {"untraced": (["pause"], ["resume"]), "full": ([], []),
         "no-payload": (["capture-limit 1"], ["capture-limit 262144"]),
         "no-analysis": (["analysis off"], ["analysis on"])}


class Blaster:
    """The C program above on ``cpu``; ``head``: the bytes every write starts with
    (else ``x``s). ``fd``: its writing socket."""

    def __init__(self, work: Path, cpu: int, head: bytes = b"") -> None:
        src = work / "blast.c"
        src.write_text(PROG)
        subprocess.run(["gcc", "-O2", "-o", str(work / "blast"), str(src)], check=True)
        self.proc = subprocess.Popen([str(work / "blast"), *([head.decode()] if head else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline().split()
        assert ready[0] == "ready", ready
        self.fd = int(ready[1])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self, n: int, size: int) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{n} {size}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="200,4096,65536")
    ap.add_argument("--calls", type=int, default=20000, help="writes per window (as many reads)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench/results/probe_costs.json"))
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    work_cpu, agent_cpu = cpus[0], cpus[-1]
    results: dict[str, Any] = {"calls": args.calls, "rounds": args.rounds,
                               "cpus": {"blaster": work_cpu, "agent": agent_cpu}, "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        blaster = Blaster(Path(tmp), work_cpu)

        class Srv:
            pid = blaster.pid
        agent = Agent(Srv(), Path(tmp), {agent_cpu}, [])  # type: ignore[arg-type]
        try:
            blaster.run(2000, 200)  # warm
            for size in (int(x) for x in args.sizes.split(",")):
                n = max(200, min(args.calls, args.calls * 4096 // max(size, 4096)))
                cpu: dict[str, list[float]] = {m: [] for m in MODES}
                agent_cpu_s: dict[str, list[float]] = {m: [] for m in MODES}
                records: dict[str, list[int]] = {m: [] for m in MODES}
                for r in range(args.rounds):
                    order = list(MODES)[r % len(MODES):] + list(MODES)[:r % len(MODES)]
                    for mode in order:
                        on, off = MODES[mode]
                        for c in on:
                            agent.ctl(c)
                        time.sleep(0.05)
                        a0, r0 = cpu_seconds(agent.proc.pid), agent.records()
                        cpu[mode].append(blaster.run(n, size))
                        time.sleep(0.1)  # the agent drains what the window sent
                        agent_cpu_s[mode].append(cpu_seconds(agent.proc.pid) - a0)
                        records[mode].append(agent.records() - r0)
                        for c in off:
                            agent.ctl(c)
                row: dict[str, Any] = {"writes_per_window": n}
                base = cpu["untraced"]
                for mode in MODES:
                    per = [1e6 * c / (2 * n) for c in cpu[mode]]  # us per syscall (write or read)
                    d = [1e6 * (c - b) / (2 * n) for c, b in zip(cpu[mode], base)]
                    m = statistics.fmean(d)
                    h = t975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else None
                    recs = sum(records[mode])
                    row[mode] = {"us_per_syscall": round(statistics.median(per), 3),
                                 "added_us_per_syscall": round(m, 3),
                                 "added_ci95": [round(m - h, 3), round(m + h, 3)] if h is not None else None,
                                 "records_per_syscall": round(recs / (2 * n * args.rounds), 3),
                                 "agent_us_per_record": round(1e6 * sum(agent_cpu_s[mode]) / recs, 2)
                                 if recs else None}
                results["sizes"][str(size)] = row
                print(json.dumps({size: row}), file=sys.stderr, flush=True)
        finally:
            agent.stop()
            blaster.close()
    results["agent_report"] = agent.stderr.strip().splitlines()[-1:] if agent.stderr else []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

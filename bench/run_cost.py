"""What a streamed token's write costs the traced process, with and without token runs
(bpf/sockets.c): a record per write, or staged in the kernel once the connection is
armed. Measured in the process's own CPU time (getrusage).

    python bench/run_cost.py [--calls 20000] [--rounds 8] [--cpu 1] [--stats] [--netwait]
        [--out bench/results/run_cost.json]

``bench/probe_costs.py``'s C program holds a TCP connection to itself (loopback) and,
per window, writes ``--calls`` token chunks as HF ``transformers serve`` writes them (chunked framing
around an SSE event: 83 bytes before the token's JSON string, 196 after, ~290 in all)
on one end and reads them on the other. The probes are loaded in this process (a
``CaptureSession``; the records are read and dropped) and switched, window by window
in rotating order, between: untraced (paused), traced with a record per write
(``one-record``: the connection not armed), traced with runs (``runs``: armed with the
chunks' template, as the agent arms a response it has read). Per mode: CPU per write
(and its read), the difference from untraced with a 95% interval over the rounds,
and what the kernel sent. ``--stats``: the kernel's run counts and run time per BPF
program on (``tokentrace ctl SOCK probe-stats on``: two clock reads more a run), and
per mode the BPF time of the write's exit (``sys_exit_write`` and the ``run_exit`` it
tail-calls) per write, and with its entry: the probes' own time, without the noise of
the window's wall clock (the netwait mode's from its own session, which has the TLS
probes' code in the socket probes as the agent does by default).
``--netwait``: one mode more, ``netwait``: a record per write from a second session
loaded with the socket-level timing (``--net-timing auto``, bpf/netwait.c: its TCP
tracepoints, ``tcp_probe`` on every segment the listening end receives, and its work
in the syscall exits), the first one paused meanwhile. Against ``one-record`` in the
same rounds: what timing requests as clients see them adds to each write and its read.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEAD = b'data: {"id":"69c0ff2c-4975-4cef-bd97-b12474db7dde","choices":[{"delta":{"content":'
TAIL = (b'},"index":0}],"created":1795623972,"model":"/tmp/pytest-of-root/pytest-374/'
        b'test_hf_transformers_serve_str0/tiny-llama","object":"chat.completion.chunk",'
        b'"system_fingerprint":""}\n\n')

def chunk(text: bytes = b'"tok"') -> bytes:
    body = HEAD + text + TAIL
    return b"%x\r\n" % len(body) + body + b"\r\n"


def paired(xs: list[float], base: list[float]) -> tuple[float, float | None]:
    """The mean difference of ``xs`` from ``base``, window by window, and its 95%
    interval's half width (None below two windows), both rounded to 3 places."""
    from bench.real_server import t975
    diffs = [a - b for a, b in zip(xs, base)]
    half = (t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
            if len(diffs) > 1 else None)
    return round(statistics.mean(diffs), 3), round(half, 3) if half is not None else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000, help="writes per window")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--cpu", type=int, default=1, help="the CPU the writer runs on")
    ap.add_argument("--stats", action="store_true",
                    help="per mode, the write exit's BPF run time per write (probe-stats)")
    ap.add_argument("--netwait", action="store_true",
                    help="a netwait mode: the socket-level timing's probes too")
    ap.add_argument("--out", default=str(ROOT / "bench/results/run_cost.json"))
    args = ap.parse_args(argv)
    from bench.probe_costs import Blaster
    from tracer.probes.bpfstats import ProgramCost, parse_costs
    from tracer.probes.session import CaptureConfig, CaptureSession

    sent: dict[int, int] = {}

    def sink(item: Any) -> None:
        if isinstance(item, bytes):
            k = int.from_bytes(item[:4], "little")
            sent[k] = sent.get(k, 0) + 1

    data = chunk()
    with tempfile.TemporaryDirectory() as tmp:
        blaster = Blaster(Path(tmp), args.cpu, data)
        proc, fd = blaster.proc, blaster.fd
        session = CaptureSession(CaptureConfig(pids=[proc.pid], concerns=("process", "sockets"),
                                               net_timing="syscall"), sink)
        session.start()
        timed = None  # the second session, with netwait: paused but in its windows
        if args.netwait:
            # as the agent runs by default: the TLS probes' code in the socket probes too
            timed = CaptureSession(CaptureConfig(pids=[proc.pid],
                                                 concerns=("process", "sockets", "tls"),
                                                 net_timing="auto"), sink)
            timed.start()
            if timed.net_timing.mode != "socket":
                raise SystemExit(f"netwait cannot run here: {timed.net_timing.reason}")
            timed.pause()
        key = proc.pid << 32 | fd
        if args.stats:
            session.control("probe-stats on")
            if timed is not None:
                timed.control("probe-stats on")
        exit_ns: dict[str, list[float]] = {}
        write_ns: dict[str, list[float]] = {}

        exits = ("tracepoint__syscalls__sys_exit_write", "run_exit")
        entry = "tracepoint__syscalls__sys_enter_write"

        def bpf_ns(s: CaptureSession) -> tuple[int, int]:
            """The write exit's BPF nanoseconds so far in session ``s``, and with its
            entry."""
            costs = parse_costs(s.control("probe-stats"))
            none = ProgramCost(0, 0)
            exit_ = sum(costs.get(n, none).run_ns for n in exits)
            return exit_, exit_ + costs.get(entry, none).run_ns

        def window(mode: str) -> float:
            s = timed if mode == "netwait" and timed is not None else session
            ns0, w0 = bpf_ns(s) if args.stats else (0, 0)
            if mode in ("untraced", "netwait"):
                session.pause()
            if mode == "netwait" and timed is not None:
                timed.resume()
                time.sleep(1.2)  # its listening-port scan (each second) finds the port
                timed.poll(0)
            elif mode == "runs":  # the socket's conn_id is new after each resume
                conn_id = next(v.conn_id for k, v in session.bpf[b"conns"].items()
                               if k.value == key)
                session.arm_runs([((proc.pid, fd, conn_id), HEAD, TAIL)])
            took = blaster.run(args.calls, len(data))
            if args.stats:
                ns1, w1 = bpf_ns(s)
                exit_ns.setdefault(mode, []).append((ns1 - ns0) / args.calls)
                write_ns.setdefault(mode, []).append((w1 - w0) / args.calls)
            session.poll(0)
            if mode == "netwait" and timed is not None:
                timed.poll(0)
                timed.pause()
                timed.poll(0)
            if mode in ("untraced", "netwait"):
                session.resume()
                session.poll(0)
            elif mode == "runs":
                session.bpf[b"run_arms"].clear()
            return took / args.calls * 1e6

        modes = ("untraced", "one-record", "runs") + (("netwait",) if timed else ())
        per: dict[str, list[float]] = {m: [] for m in modes}
        window("one-record")  # warm up
        for r in range(args.rounds):
            k = r % len(modes)
            for m in modes[k:] + modes[:k]:
                per[m].append(window(m))
        counters = session.kernel_counters()
        if timed is not None:
            nw = timed.kernel_counters()
            timed.stop()
        session.stop()
        blaster.close()
    base = per["untraced"]
    out: dict[str, Any] = {"calls": args.calls, "rounds": args.rounds, "write_bytes": len(data),
                           "modes": {}, "kernel": {"run_writes": counters.get("run_writes", 0),
                                                   "lost_run": counters.get("lost_run", 0),
                                                   "records": sent}}
    if timed is not None:
        out["kernel"]["netwait_lost"] = nw.get("lost_netwait", 0)
        mean, half = paired(per["netwait"], per["one-record"])
        out["netwait_over_one_record_us"] = {"mean": mean, "ci95_half": half}
    for m in modes:
        mean, half = paired(per[m], base)
        out["modes"][m] = {"us_per_write": round(statistics.median(per[m]), 3),
                           "over_untraced_us": mean, "ci95_half_us": half,
                           "windows": [round(x, 3) for x in per[m]]}
        if exit_ns.get(m):
            out["modes"][m]["exit_bpf_ns_per_write"] = round(statistics.median(exit_ns[m]), 1)
            out["modes"][m]["enter_exit_bpf_ns_per_write"] = round(
                statistics.median(write_ns[m]), 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

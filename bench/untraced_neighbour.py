"""What an agent tracing other processes costs a process it does not trace.

    python bench/untraced_neighbour.py [--gpu] [--pairs 30] [--slice-s 2] [--settle-s 0.3]
        [--out bench/results/untraced_neighbour[-gpu].json]

The socket and TCP tracepoints are global: every process's read, write and close runs
their programs, which return at once for a process not traced (``is_traced``), and
while any syscall tracepoint is attached every syscall takes the kernel's slow path.
``bench/real_server.py --design crossover`` measures each traced half against the
other, untraced half in the same time slice, so that tax on the untraced half is left
out of its ratio; this bench sizes it. A worker process (on a CPU of its own) sends
64-byte messages over a loopback TCP connection to itself, a write and a read a
message (the hooked syscalls HF serve makes ~1.7k a second of); an agent (`tokentrace
run --pid OTHER`, its default options) traces another process, a `sleep`. Time slices
alternate in ABBA order between the agent paused (no program of ours attached) and
tracing that other process. Per pair: the worker's messages per second, and its CPU
(all, and system) per message; the intervals are t-intervals over the pairs.

``--gpu``: the worker calls the stand-in libcuda's ``cuLaunchKernel`` (samples/gpu) in
a loop instead (a "message" is a call), and the traced process maps the same file.
Before the GPU probes were limited to the traced processes this cost the worker 1.34
us of system time a call on the dev VM (its copy of the library's code held the
traced process's breakpoints); now nothing.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real_server import Agent, cpu_times, mean_half_width, ratio_ci  # noqa: E402

MESSAGE = b"x" * 64


def gpu_worker(count: Any, cpu: int, libcuda: str) -> None:
    """Call the stand-in libcuda's cuLaunchKernel forever (its simulated kernel time 0);
    ``count`` is raised every 256 calls."""
    import ctypes
    os.sched_setaffinity(0, {cpu})
    lib = ctypes.CDLL(libcuda)
    launch = lib.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    n = 0
    while True:
        launch(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        n += 1
        if n % 256 == 0:
            with count.get_lock():
                count.value += 256


def worker(count: Any, cpu: int) -> None:
    """Write and read MESSAGE over a loopback TCP connection, forever; ``count`` is
    raised every 256 messages."""
    os.sched_setaffinity(0, {cpu})
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    n = 0
    while True:
        a.send(MESSAGE)
        got = 0
        while got < len(MESSAGE):
            got += len(b.recv(len(MESSAGE) - got))
        n += 1
        if n % 256 == 0:
            with count.get_lock():
                count.value += 256


class Sleeper:
    """The process the agent traces: it does nothing (with ``libcuda``: it maps that
    library, so the agent attaches its GPU probes, and does nothing)."""

    def __init__(self, libcuda: str | None = None) -> None:
        cmd = (["sleep", "3600"] if libcuda is None else
               [sys.executable, "-c", "import ctypes, sys, time; ctypes.CDLL(sys.argv[1]); "
                "print('ready', flush=True); time.sleep(3600)", libcuda])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if libcuda else None)
        if libcuda is not None:
            assert self.proc.stdout is not None
            self.proc.stdout.readline()
        self.pid = self.proc.pid


def mean_ci(xs: list[float]) -> dict[str, Any]:
    """Mean and its 95% t-interval."""
    m, h = mean_half_width(xs)
    h = h or 0
    return {"n": len(xs), "mean": round(m, 2), "ci95": [round(m - h, 2), round(m + h, 2)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=30, help="pairs of slices (default 30)")
    ap.add_argument("--slice-s", type=float, default=2.0, help="seconds a slice")
    ap.add_argument("--settle-s", type=float, default=0.3, help="wait after each switch")
    ap.add_argument("--gpu", action="store_true",
                    help="the worker calls cuLaunchKernel of the stand-in libcuda "
                         "(samples/gpu) in a loop, the traced process maps the same file")
    ap.add_argument("--out", default=None,
                    help="default bench/results/untraced_neighbour[-gpu].json")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("needs root (BPF)")
    out_path = args.out or str(ROOT / "bench/results" / (
        "untraced_neighbour-gpu.json" if args.gpu else "untraced_neighbour.json"))
    cpus = sorted(os.sched_getaffinity(0))
    mine, theirs = {cpus[0]}, cpus[-1]
    count = mp.Value("q", 0)
    libcuda = None
    if args.gpu:
        from samples.gpu.build import build
        libcuda = str(build(Path(tempfile.mkdtemp(prefix="tt-neighbour-gpu-")))["libcuda"])
        os.environ["TT_STANDIN_KERNEL_NS"] = "0"
    w = (mp.Process(target=gpu_worker, args=(count, theirs, libcuda), daemon=True)
         if libcuda else mp.Process(target=worker, args=(count, theirs), daemon=True))
    w.start()
    other = Sleeper(libcuda)
    agent = None
    slices: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="tt-neighbour-") as tmp:
            agent = Agent(other, Path(tmp), mine, [])  # type: ignore[arg-type]
            state = "traced"
            for i in range(2 * args.pairs):
                mode = ("paused", "traced", "traced", "paused")[i % 4]
                if mode != state:
                    agent.ctl("pause" if mode == "paused" else "resume")
                    state = mode
                    time.sleep(args.settle_s)
                assert w.pid is not None
                c0, (u0, s0), t0 = count.value, cpu_times(w.pid), time.monotonic()
                time.sleep(args.slice_s)
                c1, (u1, s1), t1 = count.value, cpu_times(w.pid), time.monotonic()
                slices.append({"mode": mode, "pair": i // 2, "messages": c1 - c0,
                               "wall_s": t1 - t0, "cpu_s": (u1 + s1) - (u0 + s0),
                               "sys_s": s1 - s0})
            summary = agent.stop()
            agent = None
    finally:
        if agent is not None:
            agent.stop()
        other.proc.kill()
        w.kill()
    pairs: dict[int, dict[str, dict[str, Any]]] = {}
    for s in slices:
        pairs.setdefault(s["pair"], {})[s["mode"]] = s
    full = [p for p in pairs.values() if len(p) == 2 and p["paused"]["messages"]]

    def per_msg(s: dict[str, Any], key: str) -> float:
        return 1e9 * s[key] / max(1, s["messages"])

    out = {
        "args": vars(args), "host_cpus": len(cpus),
        "messages_per_s_paused": round(statistics.fmean(
            p["paused"]["messages"] / p["paused"]["wall_s"] for p in full), 1),
        # the neighbour's rate, agent tracing another process / agent paused
        "messages_per_s_ratio": ratio_ci([(p["traced"]["messages"] / p["traced"]["wall_s"])
                                          / (p["paused"]["messages"] / p["paused"]["wall_s"])
                                          for p in full]),
        # ns of the worker's CPU a message (a write, a read, their TCP segments) added
        "cpu_ns_per_message_added": mean_ci([per_msg(p["traced"], "cpu_s")
                                             - per_msg(p["paused"], "cpu_s") for p in full]),
        "sys_ns_per_message_added": mean_ci([per_msg(p["traced"], "sys_s")
                                             - per_msg(p["paused"], "sys_s") for p in full]),
        "cpu_ns_per_message_paused": round(statistics.fmean(per_msg(p["paused"], "cpu_s")
                                                            for p in full), 1),
        # launches the agent counted: the traced process makes none, so any are the
        # untraced worker's, seen by the probes and dropped (is_traced)
        "agent_launches": sum(p.get("kernel_launches", 0) for p in
                              summary.get("gpu", {}).get("processes", [])),
        "slices": slices,
    }
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "slices"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How long `tokentrace ctl pause` takes, and why: tracepoint detaches, one by one or at once.

    python bench/pause_switch.py [--cycles 5] [--out bench/results/pause_switch.json]

Every pause takes the agent's tracepoints out (the socket and TCP ones; the process
lifecycle ones stay) and each detach waits out the kernel's tracepoint grace period.
Two measurements: the agent's own pause and resume (`tokentrace run --pid P --control
SOCK`, P a `sleep`; the reply's seconds, ``--cycles`` times), and the mechanism alone:
do-nothing programs on the same tracepoints, detached one after the other and from a
thread each, alternately, ``--cycles`` times each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real_server import Agent  # noqa: E402
from bench.untraced_neighbour import Sleeper  # noqa: E402


def agent_switches(cycles: int) -> dict[str, Any]:
    """The agent's pause and resume times (its replies' seconds)."""
    other = Sleeper()
    try:
        with tempfile.TemporaryDirectory(prefix="tt-pause-") as tmp:
            agent = Agent(other, Path(tmp), set(os.sched_getaffinity(0)), [])  # type: ignore[arg-type]
            try:
                pause, resume = [], []
                for _ in range(cycles):
                    pause.append(float(agent.ctl("pause").split()[-1].rstrip("s")))
                    resume.append(float(agent.ctl("resume").split()[-1].rstrip("s")))
                    time.sleep(0.5)
            finally:
                agent.stop()
    finally:
        other.proc.kill()
    return {"pause_s": pause, "resume_s": resume,
            "median_pause_s": round(statistics.median(pause), 3),
            "median_resume_s": round(statistics.median(resume), 3)}


def tracepoints() -> list[str]:
    """The tracepoints the agent's socket and TCP concerns attach (bpf/*.c)."""
    import re
    names = []
    for f in ("sockets.c", "netwait.c"):
        text = (ROOT / "bpf" / f).read_text()
        names += [f"{a}:{b}" for a, b in re.findall(r"TRACEPOINT_PROBE\((\w+), (\w+)\)", text)]
    return sorted(set(names))


def detach_times(cycles: int) -> dict[str, Any]:
    """Do-nothing programs on ``tracepoints()``, detached serially and in threads."""
    from bcc import BPF  # type: ignore[import-not-found]
    tps = [tp for tp in tracepoints() if BPF.tracepoint_exists(*tp.split(":"))]
    bpf = BPF(text="int nothing(void *ctx) { return 0; }")
    out: dict[str, list[float]] = {"serial": [], "threads": []}
    for _ in range(cycles):
        for how in ("serial", "threads"):
            for tp in tps:
                bpf.attach_tracepoint(tp=tp, fn_name=b"nothing")
            t0 = time.perf_counter()
            keys = [tp.encode() for tp in tps]
            if how == "serial":
                for k in keys:
                    bpf.detach_tracepoint(k)
            else:
                with ThreadPoolExecutor(max_workers=len(keys)) as pool:
                    list(pool.map(bpf.detach_tracepoint, keys))
            out[how].append(round(time.perf_counter() - t0, 3))
    bpf.cleanup()
    return {"tracepoints": len(tps), **out,
            "median_serial_s": statistics.median(out["serial"]),
            "median_threads_s": statistics.median(out["threads"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=5, help="pauses (and detach rounds)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/pause_switch.json"))
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("needs root (BPF)")
    doc = {"host_cpus": os.cpu_count(), "kernel": os.uname().release,
           "agent": agent_switches(args.cycles), "detach": detach_times(args.cycles)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The overhead meter (tracer/overhead.py) on a real server with a real client: the
kernel's counts of the probes' runs in a measured window hold at least one run for
every socket syscall the probes sent a record of in it, and the budget, set far
below what the probes cost, puts the duty cycle in force and takes the probes out."""

from __future__ import annotations

import threading
import time

import pytest

from samples.launch import SampleServer
from tests.conftest import free_port
from tests.live import traced
from tests.test_metrics import scrape
from tracer.events import capture, schema
from tracer.export.metrics import PrometheusSink
from tracer.overhead import KEEP, MIN_FRACTION
from tracer.probes.bpfstats import HIT_NS

pytestmark = pytest.mark.bpf


def test_the_meter_counts_the_probes_runs_and_the_budget_cycles_them(tmp_path):
    from tests.test_live_duty import streamed

    port = free_port()
    cap = tmp_path / "run.ttcap"
    stop = threading.Event()
    sent: list[dict] = []

    def client() -> None:
        i = 0
        while not stop.is_set():
            sent.append(streamed(port, 2 + i % 4))
            i += 1

    with SampleServer("samples.stdlib_server", port=port, health="/") as server:
        t = threading.Thread(target=client)
        # every socket syscall its own record (no token runs), so records count syscalls
        with traced(pids=[server.pid], record=str(cap), token_runs=False, meter_every_s=0.5,
                    meter_window_s=1.0, max_overhead=1e-6) as c:
            t.start()
            run = c.run
            deadline = time.monotonic() + 30
            while run.budget.fraction == 1.0 and time.monotonic() < deadline:
                time.sleep(0.1)
            first = [run.meter.last]  # an estimate the budget took with the probes in
            while not run.session.paused and time.monotonic() < deadline:
                time.sleep(0.1)
            paused = run.session.paused
            time.sleep(0.5)
            stop.set()
            t.join()
            # the agent's health at a scrape: the meter's estimate and the losses
            prom = PrometheusSink(0, "127.0.0.1", ctx=run.pipeline.ctx)
            time.sleep(1.2)  # a counter report after the last estimate
            try:
                scraped = scrape(prom.port)
            finally:
                prom.close()
    assert len(sent) > 20
    rep = c.report
    # three windows (KEEP) before the budget decided, each with an estimate
    assert rep["capture.probe_cpu_estimates"] >= KEEP, rep
    est = first[0]
    assert est is not None and rep["capture.probe_cpu_ppm_max"] >= est.ppm > 0
    # the sums over the windows: every process's part is the programs' time and the
    # entries; the traced server's, less the client's runs (this process: not traced),
    # each an entry and an early exit as measured on this host before the first window
    assert (rep["capture.probe_cpu_host_probe_ns"] == rep["capture.probe_cpu_program_ns"]
            + HIT_NS["tracepoint"] * rep["capture.probe_cpu_tracepoint_runs"]
            + HIT_NS["uprobe"] * rep.get("capture.probe_cpu_uprobe_runs", 0))
    early = rep["capture.probe_cpu_early_exit_ns"]
    assert 5 <= early <= 2_000, early
    assert rep["capture.probe_cpu_others_runs"] > 0, rep
    assert (rep["capture.probe_cpu_probe_ns"] == rep["capture.probe_cpu_host_probe_ns"]
            - (HIT_NS["tracepoint"] + early) * rep["capture.probe_cpu_others_runs"])
    assert rep["capture.probe_cpu_traced_ns"] >= est.traced_cpu_ns
    # the budget (a millionth of the CPU) is far under the estimate: the least share
    assert run.budget.fraction == MIN_FRACTION and rep["capture.overhead_budget_changes"] == 1
    assert f"tracing {MIN_FRACTION:g} of the time" in run.budget.reason
    assert paused, "the duty cycle the budget set never took the probes out"
    assert scraped[("tokentrace_probe_cpu_ratio", ())] * 1e6 == pytest.approx(
        rep["capture.probe_cpu_ppm"], abs=1)  # no estimate after the probes went out
    assert scraped[("tokentrace_probe_cpu_seconds_total", ())] * 1e9 == pytest.approx(
        rep["capture.probe_cpu_probe_ns"], rel=1e-6)
    assert scraped[("tokentrace_records_lost_total", (("counter", "lost_data"),))] == \
        rep.get("capture.lost_data", 0)

    # the kernel's counts against the records the probes sent in the same window: a
    # socket syscall's record means its exit program ran (and its entry's, before)
    lo, hi = int(est.start * 1e9), int((est.start + est.seconds) * 1e9)
    syscalls, pauses = set(), []
    for item in capture.CaptureReader(str(cap)):
        if isinstance(item, bytes):
            try:
                item = schema.decode(item)
            except schema.WireError:  # a kind decoded elsewhere (GPU, runs): not DATA
                continue
        if isinstance(item, schema.DataEvent) and item.pid == server.pid and lo <= item.ts_exit <= hi:
            syscalls.add((item.tid, item.ts_exit, item.direction))
        elif isinstance(item, schema.TracingPaused) and item.paused:
            pauses.append(item)
    print(f"\nwindow {est.seconds:.2f} s: {est.probes.hits} runs, {est.probes.program_ns} ns "
          f"in the programs, {est.probes.total_ns} ns with their entries; "
          f"{est.probes.traced_tracepoint_runs} tracepoint runs for the server, "
          f"{est.probes.others_runs} elsewhere at {est.early_exit_ns} ns: {est.probe_ns} ns "
          f"against {est.traced_cpu_ns} ns of the server's CPU: {est.ppm} ppm "
          f"({est.host_share * 1e6:.0f} with the others' runs); {len(syscalls)} socket "
          f"syscalls recorded")
    assert len(syscalls) > 20, len(syscalls)
    assert est.probes.hits["tracepoint"] >= len(syscalls), (est, len(syscalls))
    # the server's own: an entry and an exit run for each syscall recorded, and the
    # client's many more, each socket syscall of its own (the client is this process)
    traced_runs = est.probes.traced_tracepoint_runs
    assert 2 * len(syscalls) <= traced_runs <= est.probes.hits["tracepoint"], (est, len(syscalls))
    assert est.probes.others_runs >= len(syscalls), est
    assert 0 < est.probe_ns < est.probes.total_ns and est.share < est.host_share
    assert est.probes.program_ns > 0 and est.traced_cpu_ns > 0
    assert pauses and pauses[-1].duty == MIN_FRACTION


THREADS = 200
_THREADS_CHILD = f"""
import sys, threading
sys.stdin.readline()  # attached
for _ in range({THREADS}):
    t = threading.Thread(target=int)
    t.start()
    t.join()
print("done", flush=True)
sys.stdin.readline()
"""


def test_a_traced_processs_threads_count_as_traced_runs_at_start_and_exit():
    """Each thread a traced process starts and ends runs the fork and the exit program
    for that process: both are its runs (``traced_tp_runs``), not the others' that the
    meter prices at an early exit."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", _THREADS_CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        with traced(pids=[child.pid]) as c:
            before = c.run.session.traced_tracepoint_runs()
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "done"
            after = c.run.session.traced_tracepoint_runs()
            child.stdin.write("end\n")
            child.stdin.flush()
            child.wait(timeout=10)
    finally:
        child.kill()
    # a fork and an exit a thread; a socket syscall or a few of the interpreter's besides
    assert 2 * THREADS <= after - before <= 2 * THREADS + 20, after - before

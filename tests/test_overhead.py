"""The overhead meter and budget (tracer/overhead.py), the kernel-time sums they rest on
(tracer/probes/bpfstats.py), a process's CPU time (procfs.cpu_ns), and their words in
the CLI and the exit report. Live measurement on a real server: test_live_overhead.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tracer.cli import build_parser
from tracer.export.console import probe_cost_text
from tracer.overhead import (KEEP, MAX_FRACTION, MIN_FRACTION, Budget, Estimate, Meter,
                             parse_budget)
from tracer.probes import procfs
from tracer.probes.bpfstats import HIT_NS, ProbeTime, ProgramCost, hit_kind, probe_time


def est(share: float, cpu_ns: int = 1_000_000_000) -> Estimate:
    """An estimate whose probes took ``share`` of ``cpu_ns`` in program time alone."""
    return Estimate(0.0, 2.0, ProbeTime(round(share * cpu_ns), {}), cpu_ns)


# ---- the kernel's counts, summed --------------------------------------------------


def test_probe_time_takes_each_programs_runs_and_time_between_two_reads():
    before = {"tracepoint__syscalls__sys_exit_write": ProgramCost(100, 50_000),
              "tt_launch_arg1": ProgramCost(10, 4_000),
              "gone": ProgramCost(5, 500)}
    after = {"tracepoint__syscalls__sys_exit_write": ProgramCost(160, 80_000),
             "tt_launch_arg1": ProgramCost(14, 5_600),
             "tt_sync_stream_session": ProgramCost(3, 900)}  # loaded since: from zero
    t = probe_time(before, after)
    assert t.program_ns == 30_000 + 1_600 + 900
    assert t.hits == {"tracepoint": 60, "uprobe": 7}
    assert t.total_ns == 32_500 + 60 * HIT_NS["tracepoint"] + 7 * HIT_NS["uprobe"]
    assert (t + t).hits == {"tracepoint": 120, "uprobe": 14}
    assert (t + t).total_ns == 2 * t.total_ns


def test_the_runs_in_processes_not_traced_are_left_out_each_its_entry_and_early_exit():
    before = {"tracepoint__syscalls__sys_enter_write": ProgramCost(0, 0),
              "tracepoint__tcp__tcp_probe": ProgramCost(0, 0), "tt_launch": ProgramCost(0, 0)}
    after = {"tracepoint__syscalls__sys_enter_write": ProgramCost(1_000, 300_000),
             "tracepoint__tcp__tcp_probe": ProgramCost(50, 10_000),
             "tt_launch": ProgramCost(10, 4_000)}
    t = probe_time(before, after, traced_tracepoint_runs=450)
    assert t.hits["tracepoint"] == 1_050 and t.others_runs == 600
    tp, up = HIT_NS["tracepoint"], HIT_NS["uprobe"]
    assert t.total_ns == 314_000 + 1_050 * tp + 10 * up  # every run, as before
    # 600 runs elsewhere at 100 ns and their entries off; the traced and uprobe runs stay
    assert t.traced_ns(100) == 314_000 - 60_000 + 450 * tp + 10 * up
    # early exits dearer than all the program time: none of it left, the entries kept
    assert t.traced_ns(10_000) == 450 * tp + 10 * up
    # not counted by the probes (an older build's capture): every run counts
    assert probe_time(before, after).others_runs == 0
    assert probe_time(before, after).traced_ns(100) == t.total_ns
    assert (t + t).others_runs == 1_200 and (t + t).traced_tracepoint_runs == 900
    assert (t + probe_time(before, after)).traced_tracepoint_runs is None


def test_early_exit_ns_times_the_callers_own_writes_with_the_least_of_its_tries():
    from tracer.probes.bpfstats import EARLY_EXIT_PROGRAMS, early_exit_ns

    # the two write probes' runs and run time, summed, at each read: 2,000 writes are
    # 4,000 runs; the second try had a traced process's dearer writes in it
    reads = iter([(0, 0), (4_000, 320_000), (4_000, 320_000), (8_500, 860_000),
                  (8_500, 860_000), (12_500, 1_160_000)])

    def programs():
        runs, ns = next(reads)
        return {p: ProgramCost(runs // 2, ns // 2) for p in EARLY_EXIT_PROGRAMS}

    assert early_exit_ns(programs, calls=2_000, tries=3) == 75  # 80, 120, 75 ns a run
    assert early_exit_ns(lambda: {}, calls=10) is None  # the write probes not loaded
    still = {p: ProgramCost(5, 500) for p in EARLY_EXIT_PROGRAMS}
    assert early_exit_ns(lambda: still, calls=10) is None  # statistics off: no runs counted


def test_hit_kinds_follow_bccs_names():
    assert hit_kind("tracepoint__tcp__tcp_probe") == "tracepoint"
    assert hit_kind("tt_copy_d2h_arg3") == "uprobe"


def test_cpu_ns_reads_a_process_whose_name_has_spaces_and_parentheses():
    child = subprocess.Popen([sys.executable, "-c",
                              "open('/proc/self/comm', 'w').write('a) b (c')\n"
                              "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\n"
                              "print('done', flush=True)\ntime.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        assert procfs.comm(child.pid) == "a) b (c"
        ns = procfs.cpu_ns(child.pid)
        assert ns is not None and 0.3e9 <= ns < 5e9, ns
    finally:
        child.kill()
        child.wait()
    assert procfs.cpu_ns(child.pid) is None
    assert procfs.cpu_ns(os.getpid()) > 0


# ---- the meter's windows -------------------------------------------------------------


class FakeHost:
    """Programs that run and processes that use CPU as a clock says, and the
    statistics switch the meter holds."""

    def __init__(self, runs_per_s: float, ns_per_run: int, cpu_share: float) -> None:
        self.now = 0.0
        self.runs_per_s, self.ns_per_run, self.cpu_share = runs_per_s, ns_per_run, cpu_share
        self.stats = False
        self.switched: list[bool] = []
        self.gone: set[int] = set()
        self._runs = 0.0  # counted only while the statistics are on, as the kernel does
        self._last = 0.0

    def advance(self, dt: float) -> None:
        if self.stats:
            self._runs += self.runs_per_s * dt
        self.now += dt

    def stats_on(self, on: bool) -> None:
        assert on != self.stats, "statistics switched twice the same way"
        self.stats = on
        self.switched.append(on)

    def programs(self) -> dict[str, ProgramCost]:
        runs = int(self._runs)
        return {"tracepoint__syscalls__sys_exit_write": ProgramCost(runs, runs * self.ns_per_run)}

    def cpu_ns(self, pids: set[int]) -> dict[int, int]:
        return {p: int(self.now * self.cpu_share * 1e9) for p in pids if p not in self.gone}


def run_meter(host: FakeHost, meter: Meter, seconds: float, probes_in=lambda t: True,
              switches=lambda t: 0, room=lambda t: float("inf"), pids=frozenset({1})):
    out = []
    while host.now < seconds:
        e = meter.tick(host.now, probes_in(host.now), switches(host.now), set(pids),
                       room(host.now))
        if e is not None:
            out.append(e)
        host.advance(0.02)
    return out


def test_a_window_measures_the_probes_time_against_the_traced_cpu():
    # 10,000 runs/s at 400 ns (+115 each to enter) against 0.5 of a core: 1.03%
    host = FakeHost(10_000, 400, 0.5)
    meter = Meter(host.stats_on, host.programs, host.cpu_ns, every_s=5, window_s=2)
    ests = run_meter(host, meter, 20)
    assert len(ests) == 3  # at 0.2-2.2 s, 7.2-9.2 s, 14.2-16.2 s
    for e in ests:
        assert e.seconds == pytest.approx(2.0, abs=0.03)
        assert e.share == pytest.approx(10_000 * (400 + HIT_NS["tracepoint"]) / 0.5e9, rel=0.02)
        assert e.ppm == pytest.approx(10_300, rel=0.02)
    assert not host.stats and host.switched == [True, False] * 3  # on only inside windows


def test_a_switch_drops_the_open_piece_and_the_meter_waits_for_the_probes_to_settle():
    host = FakeHost(10_000, 400, 0.5)
    meter = Meter(host.stats_on, host.programs, host.cpu_ns, every_s=5, window_s=2,
                  settle_s=0.5)
    # a pause at 1 s, a resume at 3 s: the first piece (0.5-1 s) is dropped
    ests = run_meter(host, meter, 6.0, probes_in=lambda t: not 1.0 <= t < 3.0,
                     switches=lambda t: 0 if t < 1.0 else 1 if t < 3.0 else 2)
    assert meter.dropped == 1 and len(ests) == 1
    assert ests[0].start == pytest.approx(3.5, abs=0.03)  # settled after the resume
    assert not host.stats


def test_under_a_duty_cycle_a_measurement_gathers_pieces_of_several_windows():
    # the probes in for 1 s of every 10 (0.1): each piece closes just before the pause
    host = FakeHost(10_000, 400, 0.5)
    meter = Meter(host.stats_on, host.programs, host.cpu_ns, every_s=5, window_s=2,
                  settle_s=0.2)
    inside = lambda t: t % 10 < 1.0  # noqa: E731
    ests = run_meter(host, meter, 35.0, probes_in=inside,
                     switches=lambda t: 2 * int(t // 10) + (0 if inside(t) else 1),
                     room=lambda t: 1.0 - t % 10 if inside(t) else 0.0)
    assert len(ests) == 1 and meter.dropped == 0
    e = ests[0]
    assert 2.0 <= e.seconds < 2.8  # three pieces of ~0.7 s
    assert e.share == pytest.approx(10_000 * (400 + HIT_NS["tracepoint"]) / 0.5e9, rel=0.05)
    assert not host.stats


def test_the_meter_leaves_out_the_runs_of_processes_not_traced():
    # 10,000 runs/s, a quarter of them in the traced server at 400 ns, the rest a load
    # generator's, exiting early at 100 ns: its runs are not the server's cost
    host = FakeHost(10_000, 175, 0.5)  # 175 ns: the mean of 400 and 100 weighted 1:3
    traced = lambda: int(host._runs) // 4  # noqa: E731
    calls = []
    meter = Meter(host.stats_on, host.programs, host.cpu_ns, every_s=5, window_s=2,
                  traced_runs=traced, early_exit=lambda: calls.append(host.stats) or 100)
    ests = run_meter(host, meter, 10)
    assert calls == [True]  # measured once, with the statistics on
    assert len(ests) == 2 and meter.early_exit_ns == 100
    for e in ests:
        assert e.early_exit_ns == 100 and e.probes.others_runs == pytest.approx(15_000, rel=0.02)
        assert e.share == pytest.approx(2_500 * (400 + HIT_NS["tracepoint"]) / 0.5e9, rel=0.02)
        assert e.host_share == pytest.approx(10_000 * (175 + HIT_NS["tracepoint"]) / 0.5e9,
                                             rel=0.02)


def test_an_idle_server_or_one_that_exited_gives_no_estimate():
    host = FakeHost(10, 400, 0.001)  # 1 ms of CPU a second
    meter = Meter(host.stats_on, host.programs, host.cpu_ns, every_s=5, window_s=2)
    assert run_meter(host, meter, 10) == [] and meter.dropped == 2
    host = FakeHost(10_000, 400, 0.5)
    meter = Meter(host.stats_on, host.programs, host.cpu_ns, every_s=5, window_s=2)
    host.gone = {2}  # pid 2 exits before the first window closes: only pid 1's CPU
    ests = run_meter(host, meter, 3, pids={1, 2})
    assert len(ests) == 1 and ests[0].traced_cpu_ns == pytest.approx(1e9, rel=0.02)
    assert run_meter(host, Meter(host.stats_on, host.programs, host.cpu_ns), 3,
                     pids=set()) == []  # nothing traced: no window opens
    assert not host.stats


# ---- the budget ------------------------------------------------------------------------


@pytest.mark.parametrize("share,fraction", [
    (0.004, 1.0), (0.01, 1.0), (0.0101, 0.9), (0.017, 0.5), (0.03, 0.3), (0.05, 0.2),
    (0.5, MIN_FRACTION)])
def test_the_budget_traces_the_share_that_brings_the_estimate_under_it(share, fraction):
    assert Budget(0.01).target(share) == fraction
    assert MIN_FRACTION <= fraction <= 1.0 and (fraction == 1.0 or fraction <= MAX_FRACTION)
    if MIN_FRACTION < fraction < 1.0:
        assert share * fraction <= 0.01 + 1e-12


def test_the_budget_decides_on_the_median_of_its_last_estimates_and_raises_with_margin():
    b = Budget(0.01)
    assert [b.add(est(0.03)) for _ in range(KEEP - 1)] == [None] * (KEEP - 1)  # too few
    assert b.fraction == 1.0
    b = Budget(0.01)
    assert [b.add(est(s)) for s in (0.03, 0.02, 0.001)] == [None, None, 0.5]  # median 0.02
    assert b.fraction == 0.5 and "tracing 0.5 of the time" in b.reason
    # the load falls: 0.0105 would allow 0.9, but 0.9 x 0.0105 is over 0.9 x the budget
    assert [b.add(est(0.0105)) for _ in range(KEEP)] == [None] * KEEP and b.fraction == 0.5
    # ...0.009 allows all the time (0.009 <= 0.9 x 0.01), once it is the median
    assert [b.add(est(0.009)) for _ in range(KEEP)] == [None, 1.0, None]
    assert b.fraction == 1.0 and "tracing all the time" in b.reason


def test_parse_budget_and_the_cli():
    assert parse_budget("1") == 0.01 and parse_budget("0.5%") == 0.005
    for bad in ("0", "100", "-1", "x"):
        with pytest.raises(ValueError):
            parse_budget(bad)
    p = build_parser()
    assert p.parse_args(["run", "--pid", "1", "--max-overhead", "2"]).max_overhead == 0.02
    assert p.parse_args(["run", "--pid", "1"]).no_overhead_meter is False
    with pytest.raises(SystemExit):  # one or the other
        p.parse_args(["run", "--pid", "1", "--max-overhead", "1", "--duty-cycle", "0.5"])
    with pytest.raises(SystemExit):
        p.parse_args(["run", "--pid", "1", "--max-overhead", "150"])


def test_the_exit_report_says_the_estimate_and_what_the_budget_did():
    assert probe_cost_text({}) == ""
    rep = {"capture.probe_cpu_estimates": 12, "capture.probe_cpu_ppm": 8_400,
           "capture.probe_cpu_ppm_max": 9_100}
    text = probe_cost_text(rep)
    assert "0.84% of the traced processes' CPU at the last of 12" in text
    assert "0.91% at most;" in text and "--max-overhead" not in text
    rep.update({"capture.probe_cpu_probe_ns": 87, "capture.probe_cpu_traced_ns": 10_000})
    assert "0.91% at most, 0.87% over all of them;" in probe_cost_text(rep)
    rep.update({"capture.overhead_budget_changes": 2,
                "capture.overhead_budget_fraction_pct": 50})
    assert "changed the share traced 2 times, to 50% of the time last" in probe_cost_text(rep)


# ---- without CAP_SYS_ADMIN ------------------------------------------------------------


def test_stats_sysctl_on_reads_the_nodes_setting(tmp_path):
    from tracer.probes.bpfstats import stats_sysctl_on

    f = tmp_path / "bpf_stats_enabled"
    f.write_text("1\n")
    assert stats_sysctl_on(str(f))
    f.write_text("0\n")
    assert not stats_sysctl_on(str(f))
    assert not stats_sysctl_on(str(tmp_path / "missing"))


def test_a_meter_refused_the_statistics_reads_the_nodes_or_stops_and_says_why(monkeypatch):
    """The DaemonSet grants CAP_BPF and CAP_PERFMON, not CAP_SYS_ADMIN, which
    BPF_ENABLE_STATS takes: the meter reads the statistics the node keeps on, or stops."""
    from tracer.probes import bpfstats
    from tracer.probes.session import CaptureConfig
    from tracer.runner import TraceRun

    class Refused:
        def enable(self) -> None:
            raise OSError(1, "BPF_ENABLE_STATS: Operation not permitted")

        def disable(self) -> None:
            pass

    run = TraceRun(CaptureConfig(pids=[os.getpid()]), [], max_overhead=0.01)
    run._meter_stats = Refused()
    monkeypatch.setattr(bpfstats, "stats_sysctl_on", lambda: True)
    run._meter_stats_on(True)
    assert run.meter is not None and not run.meter_error  # the node's are read
    monkeypatch.setattr(bpfstats, "stats_sysctl_on", lambda: False)
    run._meter_stats_on(True)
    assert run.meter is None
    assert "Operation not permitted" in run.meter_error
    assert "kernel.bpf_stats_enabled=1" in run.meter_error
    assert run.session.user_counters["probe_cpu_unmeasured"] == 1
    assert "not measured" in probe_cost_text({"capture.probe_cpu_unmeasured": 1})

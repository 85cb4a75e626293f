"""What the probes cost the traced processes, measured while tracing, and
``tokentrace run --max-overhead PCT``: the duty cycle that keeps it under a budget.

**The estimate.** Every ``EVERY_S`` the agent opens a window of ``WINDOW_S`` with the
kernel's run-time statistics on (``bpfstats.ProgramStats``: two clock reads a program
run, so they are on only inside windows) and every probe in. Over the window it takes
each program's runs and run time (``bpfstats.probe_time``: the programs' own time plus
each run's entry, a tracepoint's or a uprobe's trap, at costs measured on our hosts)
against the CPU time the traced processes used (``/proc/PID/stat``). Their ratio is
``probe_cpu_ppm``: the probes' kernel time per million nanoseconds of the traced
processes' CPU, an estimate of what full tracing costs them now.

The kernel counts a program's runs in every process: a syscall probe runs (and stops
at the pid filter) in processes nobody traces too, and a TCP probe for every
connection (stopping at the port filter), which costs them, not the traced ones. The
probes count their tracepoint runs for traced processes (the kernel counter
``traced_tp_runs``), so the estimate leaves the others' out: each its entry and an
early exit, whose cost the meter measures on the host before its first window
(``bpfstats.early_exit_ns``: the agent, never traced, writes to /dev/null).
``host_share`` keeps every run.

It is not a bound either way. Two costs are not in it,
and there it errs low: the syscall slow path every syscall takes while a syscall
tracepoint is attached (~84 ns a syscall on the 2-vCPU VM), and what a trap leaves
behind in the traced thread's own user time (its caches; about as much again as the
trap, ``bench/trap_aftereffect.py``). How it compares with the tokens/s the servers
lost in ``bench/real_server.py`` runs: docs/overhead.md, "the probes' cost, measured
live".

A window in which the probes were taken out or put back (a pause, a duty cycle's
switch) is dropped: it would not measure full tracing. So is one in which the traced
processes used less than ``MIN_TRACED_CPU_S`` of CPU: an idle server has no cost to
protect and gives a ratio of noise.

**The budget.** With ``--max-overhead PCT`` the median of the last ``KEEP`` estimates
decides: at or under the budget, trace all the time; over it, trace the share F of
every duty-cycle period that brings the estimate times F under it (in steps of
``STEP``, at least ``MIN_FRACTION``: a window must be a second long). A share is
raised only when the estimate times the new share is under ``RAISE_MARGIN`` of the
budget, so an estimate on a step's edge does not switch back and forth. What the
duty cycle gives up is in tracer/duty.py.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping

from tracer.duty import DEFAULT_PERIOD_S, MIN_WINDOW_S
from tracer.probes.bpfstats import ProgramCost, ProbeTime, probe_time

EVERY_S = 20.0  # a window opens this long after the last one closed...
WINDOW_S = 2.0  # ...and measures this long: statistics on 10% of the time
SETTLE_S = 0.2  # probes in this long before a window opens
MIN_PIECE_S = 0.3  # a piece opens only with this long left before a duty cycle's pause...
CLOSE_BEFORE_S = 0.1  # ...and closes this long before it (polls come every ~20 ms)
MIN_TRACED_CPU_S = 0.05  # less CPU than this in a window: no estimate
KEEP = 3  # estimates the budget's decision takes the median of
STEP = 0.1
MIN_FRACTION = MIN_WINDOW_S / DEFAULT_PERIOD_S  # a window of a second
MAX_FRACTION = 1.0 - MIN_WINDOW_S / DEFAULT_PERIOD_S  # a pause of a second
RAISE_MARGIN = 0.9


@dataclass(frozen=True)
class Estimate:
    """One window's measurement: the probes' time against the traced processes' CPU."""

    start: float  # monotonic seconds
    seconds: float
    probes: ProbeTime
    traced_cpu_ns: int
    early_exit_ns: int = 0  # a syscall probe's run in a process not traced

    @property
    def probe_ns(self) -> int:
        """The probes' kernel time in the traced processes."""
        return self.probes.traced_ns(self.early_exit_ns)

    @property
    def share(self) -> float:
        """The probes' kernel time in the traced processes over their CPU time."""
        return self.probe_ns / self.traced_cpu_ns if self.traced_cpu_ns else 0.0

    @property
    def host_share(self) -> float:
        """Every run's time, in every process, over the traced processes' CPU time:
        what the estimate was before the runs were told apart."""
        return self.probes.total_ns / self.traced_cpu_ns if self.traced_cpu_ns else 0.0

    @property
    def ppm(self) -> int:
        return round(self.share * 1e6)


class Meter:
    """The windows: ``tick`` at every poll; an ``Estimate`` when ``window_s`` of
    measurement is in. Under a duty cycle whose windows are shorter, a measurement
    gathers pieces from several of them, each closed just before its pause.

    I/O is passed in: ``stats_on(bool)`` turns the kernel's statistics on or off,
    ``programs()`` reads every program's runs and run time, ``cpu_ns(pids)`` the CPU
    time of each pid that still exists; ``traced_runs()`` the probes' count of their
    tracepoint runs for traced processes, and ``early_exit()`` (called once, statistics
    on) what a run costs a process not traced. Without them every run counts."""

    def __init__(self, stats_on: Callable[[bool], None],
                 programs: Callable[[], Mapping[str, ProgramCost]],
                 cpu_ns: Callable[[set[int]], dict[int, int]],
                 every_s: float = EVERY_S, window_s: float = WINDOW_S,
                 settle_s: float = SETTLE_S, min_cpu_s: float = MIN_TRACED_CPU_S,
                 traced_runs: Callable[[], int] | None = None,
                 early_exit: Callable[[], int | None] | None = None) -> None:
        self._stats_on, self._programs, self._cpu_ns = stats_on, programs, cpu_ns
        self._traced_runs, self._early_exit = traced_runs, early_exit
        self.early_exit_ns: int | None = None  # measured before the first window
        self.every_s, self.window_s, self.settle_s = every_s, window_s, settle_s
        self.min_cpu_ns = int(min_cpu_s * 1e9)
        self._next = 0.0  # when the next measurement may start
        self._in_since: float | None = None  # probes in, whole, since then
        self._switches = -1  # the session's pause/resume count at the last tick
        # the open piece: its start, the programs', the traced runs' and the
        # processes' counts then
        self._open: tuple[float, dict[str, ProgramCost], int | None,
                          dict[int, int]] | None = None
        self._sum = self._empty()  # the measurement's pieces so far
        self._sum_cpu = 0
        self._sum_s = 0.0
        self._first = 0.0  # when its first piece opened
        self.dropped = 0  # pieces cut by a switch, measurements of an idle server
        self.last: Estimate | None = None

    def tick(self, now: float, probes_in: bool, switches: int, pids: set[int],
             room_s: float = math.inf) -> Estimate | None:
        """Open or close a piece. ``switches`` counts the probes' pauses and resumes (a
        change drops the open piece: it did not measure full tracing); ``room_s``: how
        long the probes stay in from now (until a duty cycle's pause)."""
        if switches != self._switches or not probes_in:
            self._switches = switches
            self._in_since = now if probes_in else None
            if self._open is not None:
                self._close()
                self.dropped += 1
        if not probes_in or self._in_since is None:
            return None
        if self._open is None:
            if (now >= self._next and now - self._in_since >= self.settle_s
                    and room_s > MIN_PIECE_S and pids):
                self._stats_on(True)
                if self.early_exit_ns is None and self._early_exit is not None:
                    self.early_exit_ns = self._early_exit() or 0
                self._open = (now, dict(self._programs()), self._traced(), self._cpu_ns(pids))
                if self._sum_s == 0.0:
                    self._first = now
            return None
        start, before, traced_before, cpu_before = self._open
        if now - start < self.window_s - self._sum_s and room_s > CLOSE_BEFORE_S:
            return None
        after, traced_after = self._programs(), self._traced()
        cpu_after = self._cpu_ns(set(cpu_before))
        self._close()
        # processes that lived through the piece: one that exited took its CPU along
        self._sum_cpu += sum(cpu_after[p] - cpu_before[p] for p in cpu_after if p in cpu_before)
        traced = (None if traced_before is None or traced_after is None
                  else max(0, traced_after - traced_before))
        self._sum = self._sum + probe_time(before, after, traced)
        self._sum_s += now - start
        if self._sum_s < self.window_s:
            return None
        est = Estimate(self._first, self._sum_s, self._sum, self._sum_cpu,
                       self.early_exit_ns or 0)
        self._sum, self._sum_cpu, self._sum_s = self._empty(), 0, 0.0
        self._next = now + self.every_s
        if est.traced_cpu_ns < self.min_cpu_ns:
            self.dropped += 1
            return None
        self.last = est
        return est

    def _empty(self) -> ProbeTime:
        return ProbeTime(0, {}, None if self._traced_runs is None else 0)

    def _traced(self) -> int | None:
        return None if self._traced_runs is None else self._traced_runs()

    def _close(self) -> None:
        self._open = None
        self._stats_on(False)

    def close(self) -> None:
        """Statistics off, whatever is open."""
        if self._open is not None:
            self._close()


class Budget:
    """``--max-overhead``: the duty-cycle share that keeps the probes' estimated cost
    under ``budget`` (a share of the traced processes' CPU)."""

    def __init__(self, budget: float) -> None:
        if not 0.0 < budget < 1.0:
            raise ValueError(f"the overhead budget must be between 0 and 100%, not {budget:%}")
        self.budget = budget
        self.fraction = 1.0  # in force: 1, all the time
        self._shares: deque[float] = deque(maxlen=KEEP)
        self.reason = "not measured yet"

    def add(self, est: Estimate) -> float | None:
        """Take a window's estimate; the new share to trace, or None for no change."""
        self._shares.append(est.share)
        if len(self._shares) < KEEP:
            return None
        share = statistics.median(self._shares)
        target = self.target(share)
        if target == self.fraction:
            return None
        if target > self.fraction and share * target > RAISE_MARGIN * self.budget:
            return None
        self.fraction = target
        self.reason = (f"the probes cost an estimated {share:.2%} of the traced processes' "
                       f"CPU (median of {KEEP} windows), budget {self.budget:.2%}: "
                       + ("tracing all the time" if target >= 1.0 else
                          f"tracing {target:g} of the time"))
        return target

    def target(self, share: float) -> float:
        """The share of the time to trace at a full-tracing cost of ``share``."""
        if share <= self.budget:
            return 1.0
        steps = math.floor(self.budget / share / STEP + 1e-9)
        return round(min(MAX_FRACTION, max(MIN_FRACTION, steps * STEP)), 3)


def parse_budget(text: str) -> float:
    """``--max-overhead``'s ``PCT`` (``1``, ``0.5%``): a share (0.01, 0.005)."""
    value = float(text.strip().removesuffix("%"))
    if not 0.0 < value < 100.0:
        raise ValueError(f"--max-overhead takes a percentage between 0 and 100, not {text}")
    return value / 100.0

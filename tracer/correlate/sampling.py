"""Launch-count estimates under ``--gpu-sample``: the launch probes are attached for a
share of each period, the copy, memset and sync probes all the time.

The estimate is a ratio over steps. A thread's step ends where its work is known to be
done (a burst flushed by a synchronisation or a query that found the work finished);
steps are counted exactly, sampled or not. A step that lies wholly inside one window
in which the launch probes were on is a sample: its launches were all seen. The
thread's launches are then

    launches seen in sampled steps / sampled steps x all steps

so the estimate does not depend on how fast the thread ran while the probes were on
(attaching and detaching can slow or stall the target, which made the older
time-share estimate 90 % low on a real GPU). A thread with too few sampled steps (one
that never synchronises, or a short capture) falls back to the time share: launches
seen divided by the share of its active span the probes were on; ``method`` says which.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

# fewer sampled steps than this and the step ratio is too noisy: use the time share
MIN_SAMPLED_STEPS = 8

STEP_ENDS = frozenset({"sync", "query", "exit", "drain"})


@dataclass
class LaunchSampling:
    """The on/off switches of the launch probes, in order, and what each cost."""

    fraction: float  # configured share of each period
    switches: list[tuple[int, bool]] = field(default_factory=list)  # (ts, on)
    attach_s: list[float] = field(default_factory=list)
    detach_s: list[float] = field(default_factory=list)

    _ts: list[int] = field(default_factory=list)  # the switches' times, for bisect

    def switch(self, ts: int, on: bool, attach_s: float = 0.0, detach_s: float = 0.0) -> None:
        self.switches.append((ts, on))
        self._ts.append(ts)
        if on and attach_s:
            self.attach_s.append(attach_s)
        if detach_s:
            self.detach_s.append(detach_s)

    def on_share(self, a: int, b: int) -> float:
        """The share of [a, b] the launch probes were on (1.0 for an empty span)."""
        if b <= a:
            return 1.0
        on = 0
        since: int | None = None
        for ts, enabled in self.switches:
            if enabled and since is None:
                since = ts
            elif not enabled and since is not None:
                on += max(0, min(ts, b) - max(since, a))
                since = None
        if since is not None:
            on += max(0, b - max(since, a))
        return on / (b - a)

    def wholly_on(self, a: int, b: int) -> bool:
        """Whether the probes were on for all of [a, b]: the last switch at or before
        ``a`` turned them on and none came in between. Switches are stamped by the agent
        before a detach and after an attach, so an "on" span is never wider than the
        time the probes really counted."""
        # once per step, so by bisection: a long sampled run has thousands of switches
        i = bisect_right(self._ts, a)  # switches at or before a
        if i == 0 or not self.switches[i - 1][1]:
            return False
        return bisect_right(self._ts, b) == i  # and none in (a, b]

    def summary(self) -> dict[str, Any]:
        sw = self.switches
        out: dict[str, Any] = {
            "estimated": True, "fraction": self.fraction, "switches": len(sw),
            "measured_on_share": round(self.on_share(sw[0][0], sw[-1][0]), 6) if sw else 0.0,
        }
        for name, xs in (("attach_ms", self.attach_s), ("detach_ms", self.detach_s)):
            if xs:
                out[name] = {"mean": round(1e3 * sum(xs) / len(xs), 3),
                             "max": round(1e3 * max(xs), 3)}
        return out


@dataclass
class StepSample:
    """One thread's steps under sampling: how many there were, and the launches of those
    wholly inside an "on" window."""

    steps: int = 0
    sampled_steps: int = 0
    # launches the thread made before sampling began (``--control gpu-sample`` while
    # running): all counted, so exact, and outside the steps above
    exact_launches: int = 0
    exact_graph_launches: int = 0
    sampled_launches: int = 0
    sampled_graph_launches: int = 0
    # the step being built: bursts since the last step end (interval flushes split one)
    _start: int = 0
    _launches: int = 0
    _graphs: int = 0

    def add(self, reason: str, first_ts: int, last_ts: int, launches: int,
            graph_launches: int, sampling: LaunchSampling) -> None:
        if not self._start:
            self._start = first_ts
        self._launches += launches
        self._graphs += graph_launches
        if reason not in STEP_ENDS:
            return
        self.steps += 1
        if sampling.wholly_on(self._start, last_ts):
            self.sampled_steps += 1
            self.sampled_launches += self._launches
            self.sampled_graph_launches += self._graphs
        # the next step starts where this one ended: a launch before the next burst
        # opens would otherwise be missed by the "wholly on" test
        self._start = last_ts
        self._launches = self._graphs = 0

    def scale(self) -> float | None:
        """The factor from launches in sampled steps to all launches (all steps /
        sampled steps); None when too few steps were sampled."""
        if self.sampled_steps < MIN_SAMPLED_STEPS:
            return None
        return self.steps / self.sampled_steps


def estimate(seen: float, sampled: float, sample: StepSample | None,
             sampling: LaunchSampling, first_ts: int, last_ts: int,
             exact: float = 0.0) -> tuple[float, str]:
    """(estimated count, method) for a thread that saw ``seen`` launches of which
    ``sampled`` fell in sampled steps and ``exact`` came before sampling began."""
    factor = sample.scale() if sample is not None else None
    if factor is not None:
        return exact + sampled * factor, "steps"
    if exact and sampling.switches:
        first_ts = max(first_ts, sampling.switches[0][0])
    share = sampling.on_share(first_ts, last_ts)
    rest = seen - exact
    return exact + (rest / share if share > 0 else rest), "time_share"

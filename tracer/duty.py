"""``tokentrace run --duty-cycle F``: trace for F of every period, paused the rest.

The cheaper mode where full tracing costs a server more than it can pay. Paused, the
agent holds no syscall, socket or GPU probe (``CaptureSession.pause``): the server
runs as untraced, without even the kernel's syscall slow path, which a tracepoint kept
attached but idle would still cost it. So what the mode costs scales with F, plus the
switches (docs/overhead.md, "the duty cycle").

What it gives up, in the spans:

- requests that arrive while paused are not seen at all;
- requests open when a window closes end there, incomplete, and are counted in
  ``requests_cut_by_duty_cycle``; a long request is the likelier to be cut, so a
  window should be many requests long (the default period is 10 s);
- at each resume, a server thread already blocked in a read on a keep-alive connection
  is not seen for that read (as at attach): its first request there is missed.

A request wholly inside a window is traced as it would be without the mode: its span's
numbers are exact. Sampled spans say the share (``tokentrace.duty_cycle``), so a reader
can scale counts by 1/F. The cycle's phase is the run's clock (from the first cycle
set): a pause by hand (SIGUSR1, ``ctl pause``) holds the probes out until the resume,
which gives them back to the cycle where its phase is (out until the next window, if
it is past this one); ``ctl duty-cycle`` changes the share or the period on that phase.
So windows fall at all phases of a caller's own periodic work alike.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PERIOD_S = 10.0
# a switch takes ~0.9 s to detach the tracepoints on a 2-vCPU VM (their grace periods,
# overlapped): windows shorter than a few of those are mostly switching
MIN_WINDOW_S = 1.0


@dataclass
class DutyCycle:
    """When to pause and resume: ``fraction`` of every ``period_s`` traced, a window
    opening at ``start`` and every period after."""

    fraction: float
    period_s: float = DEFAULT_PERIOD_S
    start: float = 0.0

    def __post_init__(self) -> None:
        check(self.fraction, self.period_s)

    @property
    def window_s(self) -> float:
        return self.fraction * self.period_s

    def in_window(self, now: float) -> bool:
        return self.fraction >= 1.0 or self.room(now) > 0

    def room(self, now: float) -> float:
        """How long the window ``now`` is in has left (zero or less between windows)."""
        return self.window_s - (now - self.start) % self.period_s

    def next_window(self, now: float) -> float:
        """When the next window opens (``now`` inside one: the one after)."""
        return now + self.period_s - (now - self.start) % self.period_s

    def due(self, now: float, paused: bool) -> str | None:
        """``"pause"`` or ``"resume"`` where the probes should switch at ``now``, else
        None. A switch that came late (a slow poll, a long pause) keeps the phase."""
        want_paused = not self.in_window(now)
        if want_paused and not paused:
            return "pause"
        if not want_paused and paused:
            return "resume"
        return None

    def describe(self) -> str:
        return (f"tracing {self.fraction:g} of every {self.period_s:g} s "
                f"({self.window_s:g}-s windows)")


def check(fraction: float, period_s: float) -> None:
    """Raise ValueError unless ``fraction`` and ``period_s`` make a usable cycle."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the duty cycle's fraction must be in (0, 1], not {fraction:g}")
    if not period_s > 0 or (fraction < 1.0 and fraction * period_s < MIN_WINDOW_S):
        raise ValueError(f"the duty cycle's window ({fraction:g} of {period_s:g} s) must be "
                         f"at least {MIN_WINDOW_S:g} s: a switch takes most of a second")
    if fraction < 1.0 and period_s - fraction * period_s < MIN_WINDOW_S:
        raise ValueError(f"the duty cycle's pause ({1 - fraction:g} of {period_s:g} s) must be "
                         f"at least {MIN_WINDOW_S:g} s")


def parse(text: str) -> tuple[float, float]:
    """``F`` or ``F/PERIOD`` (``--duty-cycle``, ``ctl duty-cycle``): fraction, period."""
    frac, _, period = text.partition("/")
    f, p = float(frac), float(period) if period else DEFAULT_PERIOD_S
    check(f, p)
    return f, p

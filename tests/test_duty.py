"""``--duty-cycle``'s phase (tracer/duty.py): when the probes go out and back, what a
pause by hand does to it, and the cycles it refuses."""

from __future__ import annotations

import re

import pytest

from tracer.duty import DutyCycle, parse


def test_windows_open_and_close_on_the_cycles_phase():
    d = DutyCycle(0.25, 8.0, start=100.0)  # traced 100-102, paused 102-108, ...
    assert d.due(101.9, paused=False) is None
    assert d.due(102.0, paused=False) == "pause"
    assert d.due(107.9, paused=True) is None
    assert d.due(108.0, paused=True) == "resume"
    # a switch that came late (a slow poll, a long pause) keeps the phase: at 113 the
    # window of 108-110 is long closed and the next opens at 116
    assert d.due(113.0, paused=False) == "pause"
    assert d.due(115.9, paused=True) is None and d.due(116.1, paused=True) == "resume"


def test_the_next_window_is_on_the_phase():
    d = DutyCycle(0.5, 4.0, start=10.0)
    assert d.in_window(11.9) and not d.in_window(12.0)
    assert d.next_window(13.0) == 14.0 and d.next_window(14.5) == 18.0


def test_everything_traced_is_no_cycle():
    assert DutyCycle(1.0, 10.0).due(1e6, paused=False) is None


@pytest.mark.parametrize("text, why", [("0", "in (0, 1]"), ("1.5", "in (0, 1]"),
                                       ("0.05", "window"), ("0.95", "pause"),
                                       ("0.5/1", "window"), ("x", "could not convert")])
def test_cycles_that_cannot_work_are_refused(text, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        parse(text)


def test_the_period_defaults_to_ten_seconds():
    assert parse("0.3") == (0.3, 10.0) and parse("0.5/4") == (0.5, 4.0)

"""tracer/probes/bpfstats.py: fdinfo parsing and the ctl answer's format."""

from __future__ import annotations

import os

from tracer.probes.bpfstats import ProgramCost, fdinfo, format_costs, parse_costs


def test_format_and_parse_round_trip_busiest_first():
    costs = {"a": ProgramCost(10, 500), "b": ProgramCost(3, 9000), "idle": ProgramCost(0, 0)}
    text = format_costs(costs)
    assert text == "b=3/9000 a=10/500"  # what never ran is left out
    assert parse_costs("ok probe-stats " + text + " junk x=1 y=/2") == {
        "b": ProgramCost(3, 9000), "a": ProgramCost(10, 500)}


def test_fdinfo_reads_key_value_lines():
    r, w = os.pipe()
    try:
        info = fdinfo(r)
        assert info["flags"].isdigit() and "pos" in info
    finally:
        os.close(r)
        os.close(w)
    assert fdinfo(10 ** 6) == {}  # no such descriptor: nothing, no error

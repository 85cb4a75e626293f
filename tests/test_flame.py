"""Launch-site stacks without probes: line tables, interpreter layouts, the split of a
step's calls among its stacks and its requests, and the output formats."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import types
from collections import Counter

import pytest

from tests.test_attribution import Harness, burst, rec
from tracer.correlate.stacks import (GRAPH, KERNEL, OVERFLOW, Flame, StackBook, from_json,
                                     resolve, to_json)
from tracer.events import wire
from tracer.events.stacks import StackCounts, StackFrames
from tracer.flame import html, pprof
from tracer.flame.model import folded, label, short_path, tree
from tracer.probes import pystacks
from tracer.probes.pylines import line_310, line_311, ranges_310

C = wire.CONSTANTS
D2H = C["STK_COPY"] + C["COPY_D2H"]


# ---- line tables ------------------------------------------------------------------------

def _codes(c: types.CodeType):
    yield c
    for k in c.co_consts:
        if isinstance(k, types.CodeType):
            yield from _codes(k)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.11+ location tables")
def test_311_lines_match_the_interpreters_own_positions():
    checked = 0
    for name in ("json.decoder", "email.parser", "inspect", "tracer.correlate.attribution"):
        mod = importlib.import_module(name)
        with open(mod.__file__) as f:
            top = compile(f.read(), mod.__file__, "exec")
        for c in _codes(top):
            for unit, (line, *_rest) in enumerate(c.co_positions()):
                assert line_311(c.co_linetable, c.co_firstlineno, unit) == line, (c, unit)
                checked += 1
    assert checked > 10_000


def _encode_310(lines: list[tuple[int, int, int | None]], firstlineno: int) -> bytes:
    """A 3.10 line table for (start byte, end byte, line) ranges, written the way
    CPython 3.10's compiler writes one (``assemble_line_range`` in Python/compile.c):
    line deltas over 127 as (0, 127) pairs first, ranges over 254 bytes in 254-byte
    chunks whose line delta after the first is 0 (or -128: no line)."""
    out = bytearray()
    prev = firstlineno
    for start, end, line in lines:
        bdelta = end - start
        if bdelta == 0:
            continue
        if line is None:
            ldelta = -128
        else:
            ldelta, prev = line - prev, line
            while ldelta > 127:
                out += bytes([0, 127])
                ldelta -= 127
            while ldelta < -127:
                out += bytes([0, 256 - 127])
                ldelta += 127
        while bdelta > 254:
            out += bytes([254, ldelta & 0xFF])
            ldelta = -128 if line is None else 0
            bdelta -= 254
        out += bytes([bdelta, ldelta & 0xFF])
    return bytes(out)


def _merged(ranges) -> list[tuple[int, int, int | None]]:
    out: list[list] = []
    for start, end, line in ranges:
        if end <= start:
            continue
        if out and out[-1][1] == start and out[-1][2] == line:
            out[-1][1] = end
        else:
            out.append([start, end, line])
    return [tuple(r) for r in out]


def test_310_line_table_pairs_are_each_a_range():
    """Every (bytecode delta, line delta) pair is a range, a line delta of 0 included
    (CPython 3.10's advance() in Objects/codeobject.c): a one-line body, the 254-byte
    chunks of a long range."""
    assert list(ranges_310(bytes([8, 0]), 5)) == [(0, 8, 5)]
    assert list(ranges_310(bytes([254, 2, 254, 0, 10, 0]), 7)) == [
        (0, 254, 9), (254, 508, 9), (508, 518, 9)]
    assert line_310(bytes([254, 2, 254, 0, 10, 0]), 7, 400) == 9
    # [0, 6) line 10, [6, 10) 12, [10, 14) no line, [14, 20) 9, [20, 22) 9, [22, 24) 10;
    # a pair with no bytes only moves the line
    table = bytes([6, 10, 4, 2, 4, 0x80, 6, 256 - 3, 2, 0, 0, 5, 2, 256 - 4])
    assert list(ranges_310(table, 0)) == [(0, 6, 10), (6, 10, 12), (14, 20, 9), (20, 22, 9),
                                          (22, 24, 10)]
    assert line_310(table, 0, 4) == 10 and line_310(table, 0, 8) == 12
    assert line_310(table, 0, 12) is None and line_310(table, 0, 21) == 9
    assert line_310(table, 7, -2) == 7  # f_lasti -1: not started, the first line


@pytest.mark.skipif(sys.version_info < (3, 10), reason="co_lines")
def test_310_decoder_reads_what_the_310_compiler_writes_for_real_line_ranges():
    """Real code objects' line ranges (this interpreter's ``co_lines``), written as
    CPython 3.10's compiler writes them, read back range for range: long ranges, big
    line jumps and line-less ranges included."""
    checked = long = jumps = 0
    tops = []
    for name in ("json.decoder", "email.parser", "inspect", "tracer.correlate.attribution",
                 "argparse"):
        mod = importlib.import_module(name)
        with open(mod.__file__) as f:
            tops.append(compile(f.read(), mod.__file__, "exec"))
    # a one-line body; one line of 400 calls (a range of thousands of bytes); a jump of
    # 300 lines
    tops.append(compile("def one(): return 1\n"
                        "def wide(f):\n    return [" + ", ".join(["f()"] * 400) + "]\n"
                        + "\n" * 300 + "x = 1\n", "<synthetic>", "exec"))
    for top in tops:
        for c in _codes(top):
            want = _merged(c.co_lines())
            table = _encode_310(want, c.co_firstlineno)
            got = _merged((s, e, ln) for s, e, ln in ranges_310(table, c.co_firstlineno))
            assert got == [r for r in want if r[2] is not None], c
            checked += len(want)
            long += sum(1 for s, e, _ in want if e - s > 254)
            prev = c.co_firstlineno
            for _s, _e, ln in want:
                if ln is not None:
                    jumps += abs(ln - prev) > 127
                    prev = ln
    assert checked > 5_000 and long > 0 and jumps > 0, (checked, long, jumps)


# ---- interpreter layouts ------------------------------------------------------------------

def test_accessor_loads_are_read_from_machine_code():
    endbr = b"\xf3\x0f\x1e\xfa"
    assert pystacks._disp_load(b"\x48\x8b\x47\x10\xc3") == ("rdi", 16)
    assert pystacks._disp_load(endbr + b"\x48\x8b\x87\x48\x00\x00\x00\xc3") == ("rdi", 72)
    # direct: address of the next instruction + displacement, from the function start
    assert pystacks._disp_load(b"\x48\x8b\x05\x10\x00\x00\x00\xc3") == ("rip", 0x17)
    # through the GOT (a shared libpython): the offset is the second load's
    assert pystacks._disp_load(b"\x48\x8b\x05\xc9\xde\x1a\x00\x48\x8b\x40\x28\xc3") == ("got", 40)
    assert pystacks._disp_load(b"\x55\x48\x89\xe5") is None


def _debug_block(free_threaded: bool, interp_fields: int) -> bytes:
    w = [0x6F67756265647878, 0x030D00F0]  # "xdebugpy" cookie, 3.13.0
    w[0] = int.from_bytes(b"xdebugpy", "little")
    if free_threaded:
        w.append(0)
    w += [2000, 16, 40]  # runtime: size, finalizing, interpreters_head
    w += [9000, 8, 0, 72] + [100 + i for i in range(interp_fields - 4)]
    w += [400, 0, 8, 16, 72, 136, 144, 152, 160]  # thread state
    w += [88, 8, 0, 56, 80, 70]  # interpreter frame
    w += [200, 112, 120, 128, 136, 68, 52, 96, 104, 192]  # code object
    w += [0] * 40
    return struct.pack(f"<{len(w)}Q", *w)


@pytest.mark.parametrize("free_threaded,fields", [(True, 13), (False, 11), (True, 14)])
def test_debug_offsets_variants_are_told_apart(free_threaded, fields):
    class Mem:
        def read(self, addr: int, n: int) -> bytes:
            return _debug_block(free_threaded, fields)[:n]

    got = pystacks._debug_offsets(Mem(), 0x1000)  # type: ignore[arg-type]
    assert got is not None
    assert (got["interp_head"], got["threads_head"], got["ts_tid"], got["ts_frame"]) == (
        40, 72, 144, 72)
    assert (got["fr_prev"], got["fr_code"], got["fr_instr"], got["fr_owner"]) == (8, 0, 56, 70)
    assert got["code_units"] == 192 and got["cstack_owner"] == 3


def _sleeper(python: str) -> subprocess.Popen:
    p = subprocess.Popen([python, "-c", "import sys, threading, time; "
                          "t = threading.Thread(target=time.sleep, args=(30,)); t.start(); "
                          "print('up', flush=True); time.sleep(30)"],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    return p


@pytest.mark.parametrize("python", [sys.executable, "/usr/bin/python3.11"])
def test_the_running_interpreter_is_found_and_checked(python):
    """The project's Python (pyenv: shared libpython) and Debian's (libpython linked
    into the executable), both 3.11 on this machine."""
    if not os.path.exists(python):
        pytest.fail(f"{python} is not installed: deploy/setup-host.sh (make setup) "
                    "installs Debian's python3.11")
    p = _sleeper(python)
    try:
        lay = pystacks.find_interpreter(p.pid)
    finally:
        p.kill()
    want = sys.version_info[:2] if python == sys.executable else (3, 11)
    assert lay.version == want
    assert any("agree with the interpreter's accessors" in c for c in lay.checks)
    assert any("2 of 2 thread states name its threads" in c for c in lay.checks)
    assert lay.code_fields["co_filename"] and lay.code_units


LATE_CODE = r"""
import ctypes, sys
print("up", flush=True)
sys.stdin.readline()
ctypes.CDLL(None).mallopt(-3, 65536)  # M_MMAP_THRESHOLD: big blocks get mappings of their own
ns = {}
exec(compile("def lazily_imported():\n" + "    x = 1\n" * 20000, "/models/late.py", "exec"), ns)
print(hex(id(ns["lazily_imported"].__code__)), flush=True)
sys.stdin.readline()
"""


def test_code_objects_in_memory_mapped_after_the_first_read_are_named():
    """A model imported on the first request: its code objects live in memory the
    process mapped after the agent first read its mappings."""
    from tracer.probes.pycode import MAPS_REFRESH_S, CodeReader

    p = subprocess.Popen([sys.executable, "-c", LATE_CODE], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        reader = CodeReader(p.pid, pystacks.find_interpreter(p.pid))
        assert reader.frame(0x10, 0) is None  # a first stack's read, before the import
        p.stdin.write("go\n")
        p.stdin.flush()
        addr = int(p.stdout.readline(), 16)
        snapshot = reader.mem.mem.ranges
        assert not any(lo <= addr < hi for lo, hi in snapshot)  # the case at hand
        time.sleep(MAPS_REFRESH_S)
        assert reader.frame(addr, 0) == ("lazily_imported", "/models/late.py", 1)
        assert reader.mem.mem.refreshes >= 1
    finally:
        p.kill()


PRIVATE_CODE = r"""
import sys
def handler(): pass
text = "what is my password? " + sys.argv[1]
told = handler.__code__.replace(co_filename=text)  # a live str of a request's shape
gone = compile("def freed(): pass", "/srv/app.py", "exec").co_consts[0]
print(hex(id(handler.__code__)), hex(id(told)), hex(id(gone)), flush=True)
sys.stdin.readline()
del gone  # freed: its memory keeps the type pointer, its names point at live strings
print("freed", flush=True)
sys.stdin.readline()
"""


def test_frames_never_carry_text_that_is_not_a_name_or_a_path():
    """A code object whose file name slot points at request-like text, and one freed
    before the resolver read it: neither puts its strings into a frame (V1)."""
    from tracer.probes.pycode import CodeReader, safe_name, safe_path

    p = subprocess.Popen([sys.executable, "-c", PRIVATE_CODE, "x" * 40], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        ok, told, gone = (int(x, 16) for x in p.stdout.readline().split())
        lay = pystacks.find_interpreter(p.pid)
        assert lay.str_type and lay.bytes_type
        reader = CodeReader(p.pid, lay)
        assert reader.frame(ok, 0)[:2] == ("handler", "<string>")
        assert reader.frame(gone, 0)[:2] == ("freed", "/srv/app.py")  # alive, so far
        assert reader.frame(told, 0)[:2] == ("handler", "?") and reader.rejected == 1
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "freed"
        assert CodeReader(p.pid, lay).frame(gone, 0) is None
    finally:
        p.kill()
    assert safe_path("/usr/lib/python3.12/site-packages/transformers/models/llama/"
                     "modeling_llama.py") and safe_path("<frozen importlib._bootstrap>")
    assert safe_path("<eval_with_key>.12") and not safe_path("what is my password?")
    assert not safe_path("/a/" + "b" * 300) and not safe_path("a\nb")
    assert safe_name("Model.forward.<locals>.<lambda>") and safe_name("LlamaAttention.forward")
    assert not safe_name("my password is hunter2") and not safe_name("")


def test_a_processs_code_objects_are_kept_within_a_byte_budget():
    """R2: the code objects kept per process are bounded by their bytes (a line table
    can be 1 MiB), the least recently used let go and counted."""
    from tracer.probes.pycode import CodeReader

    p = subprocess.Popen([sys.executable, "-c", "import sys, json, inspect, email.parser\n"
                          "fs = [f for m in (json, inspect, email.parser) for f in vars(m).values()"
                          " if inspect.isfunction(f)]\n"
                          "print(' '.join(hex(id(f.__code__)) for f in fs), flush=True)\n"
                          "sys.stdin.readline()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        codes = [int(x, 16) for x in p.stdout.readline().split()]
        reader = CodeReader(p.pid, pystacks.find_interpreter(p.pid), max_bytes=8192)
        names = [reader.frame(c, 0) for c in codes]
        assert len(codes) > 50 and all(n is not None and n[0] != "?" for n in names)
        assert reader.bytes <= 8192 and reader.evicted >= len(codes) - 8192 // 200
        reads = reader.reads
        assert reader.frame(codes[0], 0) == names[0]  # let go: read again when needed
        assert reader.reads == reads + 1
    finally:
        p.kill()


def test_a_process_without_python_says_why():
    p = subprocess.Popen(["sleep", "5"])
    try:
        with pytest.raises(pystacks.PyLayoutError, match="_PyRuntime|no libpython"):
            pystacks.find_interpreter(p.pid)
    finally:
        p.kill()


BAD_LIB = r"""
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
print("up", flush=True)
sys.stdin.readline()
"""


def test_a_damaged_interpreter_file_is_a_reason_off_the_consumers_thread(tmp_path, monkeypatch):
    """A process mapping a damaged file named like libpython (pyelftools raises
    ValueError on it) gets native frames only, with the reason; the interpreter is
    looked for on the resolver's thread, never the ring buffer consumer's (R1)."""
    from tracer.probes import stacks as probe_stacks

    python = "/usr/bin/python3.11"  # maps no libpython of its own (static interpreter)
    if not os.path.exists(python):
        pytest.fail(f"{python} is not installed: deploy/setup-host.sh (make setup) "
                    "installs Debian's python3.11")
    bad = tmp_path / "libpython3.11.so.1.0"
    data = bytearray(open("/bin/true", "rb").read())
    struct.pack_into("<Q", data, 32, 1 << 63)  # e_phoff: out of any offset's range
    bad.write_bytes(bytes(data))
    p = subprocess.Popen([python, "-c", BAD_LIB, str(bad)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        why = probe_stacks.scan_interpreter(p.pid)
        assert isinstance(why, str) and "ValueError" in why, why
        threads = []
        real = probe_stacks.find_interpreter

        def spy(pid: int):
            threads.append(threading.current_thread().name)
            return real(pid)

        monkeypatch.setattr(probe_stacks, "find_interpreter", spy)
        resolver = probe_stacks.StackResolver()
        resolver.scan(p.pid, 7)
        assert resolver.wait_idle(30)
        (found,) = resolver.found()
        assert (found.pid, found.generation, found.layout, found.why) == (p.pid, 7, None, why)
        assert threads == ["tt-stacks"]
    finally:
        p.kill()


# ---- the split ----------------------------------------------------------------------------

def counts(pid: int, tid: int, burst_ts: int, *entries: tuple[int, int, int, int]) -> StackCounts:
    return StackCounts(pid=pid, tid=tid, burst_ts=burst_ts, samples=0, entries=entries)


def test_a_units_exact_calls_are_split_by_the_stacks_sampled_in_the_step():
    book = StackBook()
    units = Counter({(KERNEL, 0xA): 10, (KERNEL, 0xB): 4, (GRAPH, 0): 2, (D2H, 0): 1})
    samples = Counter({(11, (KERNEL, 0xA)): 3, (12, (KERNEL, 0xA)): 1, (13, (D2H, 0)): 1})
    book.pids.add(1)
    w = book.weights(1, units, samples, time_ns=1700.0)
    assert w[(1, 11, KERNEL, 0xA)] == [7.5, 750.0, 3.0]
    assert w[(1, 12, KERNEL, 0xA)] == [2.5, 250.0, 1.0]
    assert w[(1, 0, KERNEL, 0xB)] == [4.0, 400.0, 0.0]  # never sampled: no stack
    assert w[(1, 0, GRAPH, 0)] == [2.0, 200.0, 0.0]
    assert w[(1, 13, D2H, 0)] == [1.0, 100.0, 1.0]
    assert sum(v[0] for v in w.values()) == sum(units.values())
    # a later step with no sample of 0xA: split like the process's samples of it so far
    book.counts(counts(1, 5, 0, (11, KERNEL, 0xA, 3), (12, KERNEL, 0xA, 1)))
    w2 = book.weights(1, Counter({(KERNEL, 0xA): 8}), Counter(), time_ns=0.0)
    assert w2 == {(1, 11, KERNEL, 0xA): [6.0, 0.0, 0.0], (1, 12, KERNEL, 0xA): [2.0, 0.0, 0.0]}


def test_launches_past_the_slots_go_to_the_sampled_kernels_not_in_them():
    book = StackBook()
    units = Counter({(KERNEL, 0xA): 4, OVERFLOW: 6})
    samples = Counter({(21, (KERNEL, 0xC)): 1, (22, (KERNEL, 0xD)): 2})
    w = book.weights(1, units, samples, time_ns=0.0)
    assert w[(1, 21, KERNEL, 0xC)][0] == 2.0 and w[(1, 22, KERNEL, 0xD)][0] == 4.0
    assert w[(1, 0, KERNEL, 0xA)][0] == 4.0


def test_counts_for_a_burst_that_never_came_are_dropped_and_counted():
    book = StackBook()
    book.counts(counts(1, 5, 111, (11, KERNEL, 0xA, 2)))
    book.counts(counts(1, 5, 222, (12, KERNEL, 0xA, 1)))
    got = book.take(burst(1, 5, 222, 230, 1))
    assert got == Counter({(12, (KERNEL, 0xA)): 1})
    assert book.stats["stack_counts_without_burst"] == 2


def test_launches_past_full_slots_are_split_like_the_kernels_the_slots_do_not_hold():
    """A burst with its 16 kernel slots full counts further launches without a handle. If
    none was sampled in that step, they are split like the process's earlier samples of
    the kernels not in its slots (labelled with those kernels); a burst with no slots at
    all (no handles known) keeps them unsampled."""
    book = StackBook()
    book.counts(counts(1, 7, 0, (51, KERNEL, 0x50, 3), (52, KERNEL, 0x60, 1),
                       (53, KERNEL, 0x1, 5)))
    slots = Counter({(KERNEL, h): 1 for h in range(1, 17)})
    w = book.weights(1, slots + Counter({OVERFLOW: 8}), Counter(), time_ns=0.0)
    assert w[(1, 51, KERNEL, 0x50)][0] == 6.0 and w[(1, 52, KERNEL, 0x60)][0] == 2.0
    assert w[(1, 53, KERNEL, 0x1)][0] == 1.0  # its own slot, by its own samples
    assert (1, 0, KERNEL, 0) not in w
    bare = book.weights(1, Counter({OVERFLOW: 8}), Counter(), time_ns=0.0)
    assert bare == {(1, 0, KERNEL, 0): [8.0, 0.0, 0.0]}


def test_requests_share_a_steps_stacks_as_they_share_its_launches():
    """An engine thread's step served two requests: each gets the step's stacks in the
    proportion it got the launches, and together they get all of them."""
    h = Harness()
    h.a.stacks = book = StackBook()
    a, b = rec(1, 5, 10, 0, 100), rec(1, 6, 11, 0, 100)
    h.open += [a, b]
    book.counts(counts(1, 99, 30, (41, KERNEL, 0xA, 2), (42, KERNEL, 0xB, 1)))
    step = burst(1, 99, 30, 40, 9)
    step = type(step)(**{**{f: getattr(step, f) for f in step.__slots__},
                         "handle_counts": {0xA: 6, 0xB: 3}})
    h.a.burst(step)
    h.a.burst(burst(1, 10, 50, 60, 5))  # a's own thread: whole, no stacks sampled
    h.finish(a)
    h.finish(b)
    h.a.close()
    got = {r.fd: r for r in h.out}
    fa, fb = got[5].flame, got[6].flame
    la, lb = got[5].gpu["gpu.kernel_launches"], got[6].gpu["gpu.kernel_launches"]
    step_a = fa[(1, 41, KERNEL, 0xA)][0] + fa[(1, 42, KERNEL, 0xB)][0]
    step_b = fb[(1, 41, KERNEL, 0xA)][0] + fb[(1, 42, KERNEL, 0xB)][0]
    assert step_a == pytest.approx(la - 5) and step_b == pytest.approx(lb)
    assert step_a + step_b == pytest.approx(9)
    assert fa[(1, 41, KERNEL, 0xA)][0] + fb[(1, 41, KERNEL, 0xA)][0] == pytest.approx(6)
    assert fa[(1, 0, KERNEL, 0)][0] == 5  # its own burst: launches, no stack sampled


def test_a_stack_that_fails_to_resolve_is_named_as_such(monkeypatch):
    """The resolver's failure on one stack is a frame that says so (C4): records using
    it do not wait for a name that will not come."""
    from tracer.events.stacks import StackDef
    from tracer.probes.stacks import StackResolver

    r = StackResolver()

    def broken(d, stop_at):
        raise ValueError("bad unwind table")

    monkeypatch.setattr(r, "_native", broken)
    d = StackDef(pid=1, tid=1, stack_id=0x41, what=KERNEL, handle=0xA, flags=0, ts=0, ip=0,
                 sp=0, bp=0, python=(), slice=b"")
    r.put(d)
    assert r.wait_idle(10)
    (got,) = r.take()
    assert (got.pid, got.stack_id, got.what, got.handle) == (1, 0x41, KERNEL, 0xA)
    assert got.native == ("[unresolved: ValueError]\t",) and r.unresolved == 1


def test_an_idle_services_last_records_leave_on_the_counter_reports_clock():
    """A record waiting for its stacks' names leaves once the wait is over, on stream
    time that the periodic counter report moves on an idle service (every second, live
    and in the capture), or at once when its stack is named."""
    from tracer.events.schema import DropReport
    from tracer.pipeline import FLAME_WAIT_NS, Pipeline

    out = []

    class Sink:
        def on_record(self, r):
            out.append(r)

        def close(self):
            pass

    p = Pipeline([Sink()])
    waiting, named = rec(1, 5, 5, 0, 10), rec(1, 6, 6, 0, 10)
    waiting.flame = Flame({(1, 0x99, KERNEL, 0xA): [1.0, 0.0, 1.0]})
    named.flame = Flame({(1, 0x98, KERNEL, 0xA): [1.0, 0.0, 1.0]})
    p._export_now(waiting)
    p._export_now(named)
    p.feed(StackFrames(pid=1, stack_id=0x98, what=KERNEL, handle=0xA, python=(), native=()))
    assert out == [named]
    for s in range(1, FLAME_WAIT_NS // 10**9 + 2):
        p.feed(DropReport(ts=s * 10**9, counters={}))
    assert out == [named, waiting] and p.stats["flame_stacks_unresolved_at_export"] == 1


def test_an_exited_processs_stacks_are_forgotten_once_nothing_can_need_them():
    """R2: what the book keeps per process goes once the process exited and its records
    are out; a process that shows up again under the pid keeps its own."""
    from tracer.events.schema import DropReport, ProcEvent
    from tracer.pipeline import STACKS_KEPT_AFTER_EXIT_NS, Pipeline

    p = Pipeline([])
    for pid in (1, 2):
        p.feed(counts(pid, pid, 0, (0x41, KERNEL, 0xA, 2)))
        p.feed(StackFrames(pid=pid, stack_id=0x41, what=KERNEL, handle=0xA, python=(), native=()))
        p.feed(ProcEvent(pid=pid, tid=pid, ppid=0, ts=10**9, op=C["PROC_EXIT"], exit_code=0,
                         comm="x"))
    p.feed(counts(2, 7, 0, (0x55, KERNEL, 0xB, 1)))  # pid 2 again: a new process
    book = p.stacks
    assert {k[0] for k in book.frames} == {1, 2}
    p.feed(DropReport(ts=10**9 + STACKS_KEPT_AFTER_EXIT_NS - 1, counters={}))
    assert (1, 0x41) in book.frames  # not yet
    p.feed(DropReport(ts=10**9 + STACKS_KEPT_AFTER_EXIT_NS, counters={}))
    assert not [k for d in (book.frames, book.by_unit, book.pending) for k in d if k[0] == 1]
    assert 1 not in book.pids and 1 not in book.kernel_handles
    assert (2, 0x41) in book.frames and (2, (KERNEL, 0xB)) in book.by_unit
    assert book.stats["stack_processes_pruned"] == 1


def test_frames_are_joined_root_first_with_the_kernel_on_top():
    book = StackBook()
    book.define(StackFrames(pid=1, stack_id=41, what=KERNEL, handle=0xA,
                            python=("main\t/app/srv.py\t3", "Attn.forward\t/x/site-packages/m/"
                                    "modeling.py\t88"),
                            native=("at::linear\tlibtorch_cpu.so", "\tlibcudart.so+0x40"),
                            native_stop="interpreter"))
    flame = Flame({(1, 41, KERNEL, 0xA): [3.0, 30.0, 1.0], (1, 77, KERNEL, 0xA): [1.0, 0, 0]})
    got = {fr: (n, t, s) for fr, n, t, s in resolve(flame, book, lambda pid, h: "gemm")}
    frames = next(f for f in got if f[0][1] == "main")
    assert [label(f) for f in frames] == [
        "main (app/srv.py:3)", "Attn.forward (m/modeling.py:88)",
        "at::linear (libtorch_cpu.so)", "libcudart.so+0x40", "--", "gemm"]
    assert any(f[0][1].startswith("[stack 0x4d not resolved]") for f in got)
    assert from_json(json.loads(json.dumps(to_json(resolve(flame, book, lambda p, h: "g"))))
                     ) == resolve(flame, book, lambda p, h: "g")


# ---- output formats -------------------------------------------------------------------------

STACKS = [((("py", "main", "/a/b/app.py", 3), ("py", "f", "/a/b/app.py", 9), ("sep", "--", "", 0),
            ("gpu", "gemm", "", 0)), 3.0, 3e6, 1.0),
          ((("py", "main", "/a/b/app.py", 3), ("native", "g;h", "libx.so", 0),
            ("sep", "--", "", 0), ("gpu", "[memcpy DtoH]", "", 0)), 0.5, 1e6, 0.0)]


def test_folded_stacks_are_brendan_greggs_format():
    text = folded(STACKS)
    assert text.splitlines() == [
        "main (b/app.py:3);f (b/app.py:9);--;gemm 3",
        "main (b/app.py:3);g:h (libx.so);--;[memcpy DtoH] 0.500"]
    assert folded(STACKS, "samples").splitlines() == ["main (b/app.py:3);f (b/app.py:9);--;gemm 1"]
    assert short_path("/usr/lib/python3.12/site-packages/transformers/x.py") == "transformers/x.py"


def test_pprof_round_trips_through_the_protobuf_runtime():
    prof = pprof.decode(pprof.encode(STACKS, comment="t"))
    st = list(prof.string_table)
    assert st[0] == "" and st[prof.default_sample_type] == "launches"
    assert sorted(tuple(s.value) for s in prof.sample) == [(1, 1_000_000, 0), (3, 3_000_000, 1)]
    loc = {l.id: l for l in prof.location}
    fn = {f.id: f for f in prof.function}
    leaf_first = [st[fn[loc[i].line[0].function_id].name] for i in prof.sample[0].location_id]
    assert leaf_first[0] in ("gemm", "[memcpy DtoH]") and leaf_first[-1] == "main"
    assert {st[f.filename] for f in prof.function} >= {"/a/b/app.py", "libx.so"}
    assert pprof._rounded([0.4, 0.4, 0.4, 1.8]) == [1, 0, 0, 2]  # largest remainders
    assert gzip.decompress(pprof.encode(STACKS))  # gzipped, as pprof tools expect


def test_the_html_page_is_self_contained_and_carries_every_width():
    page = html.page(STACKS, "request </script><b>x")
    assert "&lt;/script&gt;" in page and "<\\/script>" not in page.split("TREES")[0]
    assert "flamegraph.default()" in page and page.count("<script>") >= 3
    assert "http://" not in page.split("<style>")[0] and "cdn" not in page.lower()
    t = tree(STACKS, "gpu_time")
    assert t["value"] == 4e6 and t["children"][0]["name"] == "main (b/app.py:3)"


def test_the_gpu_benchs_spans_and_tarball_are_private(tmp_path):
    """bench/flame.py runs as root: its spans and the tarball that packs them are 0600
    (V2)."""
    import tarfile

    from bench.flame import pack, write_spans

    write_spans(tmp_path / "spans.jsonl", [{"trace_id": "a" * 32, "attributes": {}}])
    (tmp_path / "server.log").write_text("log")
    pack(tmp_path)
    tgz = tmp_path / "flame-files.tgz"
    assert oct(tgz.stat().st_mode & 0o777) == "0o600"
    with tarfile.open(tgz) as tar:
        assert oct(tar.getmember("spans.jsonl").mode) == "0o600"
        assert json.loads(tar.extractfile("spans.jsonl").read())["trace_id"] == "a" * 32


def test_flame_of_spans_without_stacks_says_how_to_get_them(tmp_path):
    f = tmp_path / "spans.jsonl"
    f.write_text(json.dumps({"trace_id": "a" * 32, "span_id": "b" * 16, "kind": "SERVER",
                             "attributes": {}, "resource": {"service.name": "s"}}) + "\n")
    r = subprocess.run([sys.executable, "-m", "tracer", "flame", str(f), "--service", "s"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "--stacks" in r.stderr

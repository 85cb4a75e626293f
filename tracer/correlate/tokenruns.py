"""Token writes the kernel staged into runs (tracer/events/runs.py): asking for them,
and taking them as the writes they stand for.

Asking: when a streamed response's token chunk was read through its template (the
follower knows the bytes around every token's text), the connection is put on the
list of connections to arm (``requests``); the live agent writes them to the kernel
and says so in a ``RunArmed`` event, which is what the connection's later runs are
read with, live and in a replay alike. A response is asked for once, and again only
if a plain token chunk still came as its own record well after the arm (the kernel
disarmed: some write of the response did not fit), at most ``MAX_ASKS`` times.

Taking: a run's writes have the same effects as the DATA records they replace
(``ConnectionTracker.stream_write``): the chunked body's framing, the connection's
offsets, the exchange's thread and bytes, the follower's chunk and token counts and
times. In the common case all at once; else each write goes the general way, with
its bytes rebuilt from the template (its text replaced by as many ``x``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from tracer.events import runs, schema, wire
from tracer.events.runs import RunArmed, TokenRun

C = wire.CONSTANTS
_DIR_OUT = C["DIR_OUT"]
MAX_ASKS = 4  # arms asked per response
ARMS_KEPT = 4  # templates remembered per connection
REARM_AFTER_NS = 50_000_000  # a token chunk this long after the arm: the kernel disarmed
ArmRequest = tuple[tuple[int, int, int], bytes, bytes]  # (pid, fd, conn_id), head, tail


class ConnRuns:
    """One connection's arms: what the kernel was told, and what was asked."""

    __slots__ = ("arms", "asked_for", "asks", "armed_ts")

    def __init__(self) -> None:
        self.arms: dict[int, tuple[bytes, bytes]] = {}  # RunArmed.arm -> head, tail
        self.asked_for = -1  # the exchange last asked for
        self.asks = 0  # ...how many times
        self.armed_ts = 0  # when its latest arm was written (RunArmed.ts)


class TokenRuns:
    """A tracker's arming. ``arming``: collect ``requests`` (set by a live run with a
    kernel to arm; a replay reads the ``RunArmed`` events the live run wrote). Each
    connection's own state is its ``runs`` (``ConnRuns``), gone with it."""

    def __init__(self, stats: Counter[str]) -> None:
        self.stats = stats
        self.arming = False
        self.requests: list[ArmRequest] = []

    def take_requests(self) -> list[ArmRequest]:
        out, self.requests = self.requests, []
        return out

    def token_chunk(self, c: Any, exchange: int, follower: Any, ts: int, body: bytes) -> None:
        """A token chunk of ``exchange`` came as a DATA record on connection ``c`` and
        was read through the follower's template: ask for the kernel to take the next
        ones, if not yet."""
        cr = c.runs
        if cr is None:
            cr = c.runs = ConnRuns()
        if cr.asked_for == exchange:
            if cr.asks >= MAX_ASKS or not cr.armed_ts or ts < cr.armed_ts + REARM_AFTER_NS:
                return
        else:
            cr.asked_for, cr.asks, cr.armed_ts = exchange, 0, 0
        tb = follower.template_bytes
        if tb is None:
            return
        if len(tb[0]) > C["RUN_HEAD"] or len(tb[1]) > C["RUN_TAIL"]:
            # the kernel compares no more: a record per token
            self.stats["token_run_templates_too_long"] += 1
            return
        cr.asks += 1
        self.requests.append((c.key, tb[0], tb[1]))


def armed(c: Any, ev: RunArmed) -> None:
    """Connection ``c``'s kernel arm ``ev.arm`` is this template."""
    cr = c.runs
    if cr is None:
        cr = c.runs = ConnRuns()
    cr.arms[ev.arm] = (ev.head.encode(), ev.tail.encode())
    cr.armed_ts = ev.ts
    while len(cr.arms) > ARMS_KEPT:
        del cr.arms[next(iter(cr.arms))]


def take_run(c: Any, run: TokenRun, head: bytes, tail: bytes,
             general: Callable[[schema.DataEvent], None], stats: Counter[str]) -> None:
    """Apply ``run`` to connection ``c``: all at once where the connection stands where
    the run starts, in a chunked body followed through this template; else write by
    write through ``general`` (the tracker's ``data_event``)."""
    lens = run.lens
    off = run.stream_off
    start = 0
    expected = c.expected[False]
    while start < len(lens) and off + lens[start] <= expected:  # read out twice (stop)
        off += lens[start]
        start += 1
    if start:
        stats["token_run_writes_seen_twice"] += start
        if start == len(lens):
            return
        lens = lens[start:]
    ts = run.ts[start:] if start else run.ts
    if not _take_all(c, run.tid, off, ts, lens, head, tail):
        stats["token_runs_taken_write_by_write"] += 1
        for at, n in zip(ts, lens):
            payload = runs.chunk(head, tail, n)
            if payload is None:
                raise ValueError(f"a run's write of {n} bytes fits no chunk of its template")
            general(schema.DataEvent(run.pid, run.tid, run.fd, run.conn_id, at, at, n, 0,
                                     C["SYS_WRITE"], _DIR_OUT, C["FLAG_LAST"], payload, off))
            off += n


def _take_all(c: Any, tid: int, off: int, ts: tuple[int, ...], lens: tuple[int, ...],
              head: bytes, tail: bytes) -> bool:
    if (c.stream_dir != _DIR_OUT or off != c.expected[False] or not c.ipc_quiet[False]
            or c.tls is not None):
        return False
    http = c.http
    d = http._server if http is not None else None
    if d is None or d.msg is None or not d.at_chunk_start:
        return False
    ex = c.exchanges.get(d.msg.exchange)
    f = ex.follower if ex is not None else None
    if f is None:
        return False
    sizes = [runs.chunk_size(n) for n in lens]
    around = len(head) + len(tail)
    texts = [size - around > 2 for size in sizes]
    if min(sizes) < around + 2:
        return False
    # the follower first: it checks the template and changes nothing when it says no
    if not f.template_events(head, tail, ts, texts):
        return False
    d.take_chunks(sizes, ts[-1])  # at a chunk's start, every size > 0: taken
    c.last_ts = ts[-1]
    c.expected[False] = off + sum(lens)
    rec = ex.rec
    if tid and tid not in rec.tids:
        rec.tids.append(tid)
    rec.response_bytes += sum(sizes)
    return True

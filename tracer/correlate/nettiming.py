"""Requests timed as the client sees them: from the arrival of their bytes at the
server's socket to the departure of the response's bytes (bpf/netwait.c).

The syscall probes time a request from the server's read to its writes. What the
kernel held in between is added here, per connection, from ``NetWait`` records:

- arrival: each read that began an arrival burst comes with the time its oldest bytes
  reached the socket; a later read without a record drew from the same burst. A
  request starts when the bytes of the read that carried its first byte arrived; the
  gap is its ``socket_wait`` (listen backlog, receive queue, the server busy).
- departure: a write's bytes left when it returned, unless a hold covers its last byte
  (an ACK found them unsent): then when the hold ended. The longest such wait among a
  response's writes is its ``send_hold``, with its cause (``nagle``, ...).

TLS (bpf/tls.c): a request read through the TLS library is timed by its ciphertext.
Its arrival is the arrival of the ciphertext the plaintext read drew from (the last
read of the socket before it returned: inside SSL_read on a socket BIO, just before it
on a memory BIO); each plaintext write departs with the ciphertext write that carried
it: the last one inside the SSL_write (socket BIO), else the socket's first write after
it returned (memory BIO: the event loop sends what the SSL object produced), within
``TLS_CARRY_NS``. A plaintext write with no such ciphertext write keeps its own time
(counted: ``netwait_tls_unmapped``).

An ACK the probe was not run for (bpf/netwait.c, UNSEEN) leaves the departure of the
bytes sent around it unknown between two of the socket's probes: such a write departs
at the earliest time it can have, and ``unseen_ns`` says how much later it may have
left (counted: ``net_timing.departure_unknown``).

A finished record is held until its last write can no longer be found held: a hold is
only seen at the peer's next ACK, so a record waits ``wait_ns`` of capture time after
its last write, and, if a hold covers one of its writes, until that hold ends (at most
``hold_max_ns``). The capture's clock (the last event's time) drives the waiting, so a
replay decides exactly as the live run did. Connections without records (timing off,
opened before attach, a client socket) keep syscall times, and say so.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from tracer.correlate.records import NetTiming, RequestRecord
from tracer.events import schema, wire
from tracer.events.netwait import NetTimingMode, NetWait
from tracer.events.runs import TokenRun

Emit = Callable[[RequestRecord], None]
_DIR_IN = wire.CONSTANTS["DIR_IN"]
_DIR_OUT = wire.CONSTANTS["DIR_OUT"]
_FLAG_LAST = wire.CONSTANTS["FLAG_LAST"]
_FLAG_TLS = wire.CONSTANTS["FLAG_TLS"]
WAIT_NS = 250_000_000  # a peer ACKs within its delayed-ACK time (40-200 ms on Linux)
HOLD_MAX_NS = 2_000_000_000
MAX_LOG = 8192  # writes and arrivals remembered per connection
MAX_EARLY = 65536  # connections whose last write is kept before their first ARRIVAL
# ...forgotten this many at a time once over: a busy keep-alive connection writes every
# token, and dropping one entry off the front of an 8,192-long list per write would
# move the whole list each time
LOG_TRIM = 1024
TLS_CARRY_NS = 100_000_000  # a memory BIO's ciphertext is sent right after SSL_write
KEEP_CLOSED_NS = 120 * 10**9  # a closed connection's log, for records still on their way
KEEP_IDLE_NS = 15 * 60 * 10**9  # a connection whose close was lost


@dataclass
class Hold:
    """Written bytes ``[start, end)`` an ACK found unsent at ``seen_ns``."""

    start: int
    end: int
    seen_ns: int
    cause: str | None
    left_ns: int | None = None  # from the DEPARTURE record


@dataclass
class Unseen:
    """Bytes ``[start, end)`` left between the socket's probes at ``after_ns`` and
    ``by_ns``, around an ACK the probe did not see."""

    start: int
    end: int
    after_ns: int
    by_ns: int


@dataclass
class ConnLog:
    """What one followed connection's socket did."""

    anchored: bool = False  # departures measurable
    estab_ns: int = 0
    accept_ns: int = 0
    first_read_ns: int = 0  # ref_ts of the owner's first ARRIVAL record
    arrival_refs: list[int] = field(default_factory=list)  # reads (ts_exit), ascending
    arrivals: list[int] = field(default_factory=list)  # their arrival (0: unseen)
    # LATER records: bytes from this stream offset on (ascending) reached the socket at
    later_offs: list[int] = field(default_factory=list)
    later_ts: list[int] = field(default_factory=list)  # this time
    writes: dict[int, int] = field(default_factory=dict)  # write ts_exit -> end offset
    write_ts: list[int] = field(default_factory=list)  # the same ts_exit, ascending
    tls_writes: dict[int, int] = field(default_factory=dict)  # TLS plaintext: exit -> entry
    holds: list[Hold] = field(default_factory=list)
    unseen: list[Unseen] = field(default_factory=list)
    last_ns: int = 0  # its last record
    closed_ns: int = 0
    # the server wrote on it after the first ARRIVAL's oldest bytes came and before
    # that read: a read the probes did not see (one begun before attach or a resume)
    # took them and was answered, so that arrival is not the next request's
    first_stale: bool = False


class NetTimer:
    """Finished records in, records with ``net`` timing out (through ``emit``)."""

    def __init__(self, emit: Emit, stats: Counter[str], wait_ns: int = WAIT_NS,
                 hold_max_ns: int = HOLD_MAX_NS) -> None:
        self.emit = emit
        self.stats = stats
        self.wait_ns = wait_ns
        self.hold_max_ns = hold_max_ns
        self.mode: NetTimingMode | None = None
        self.conns: dict[tuple[int, int, int], ConnLog] = {}
        self.accepts: dict[tuple[int, int, int], int] = {}
        # the last write of each connection with no log yet (before its first ARRIVAL)
        self.early_writes: dict[tuple[int, int, int], int] = {}
        self._pending: list[tuple[int, int, RequestRecord]] = []
        self._seq = itertools.count()
        self.now = 0
        self._next_prune = 0

    @property
    def socket_mode(self) -> bool:
        return self.mode is not None and self.mode.mode == "socket"

    # ---- events ---------------------------------------------------------------------

    def set_mode(self, mode: NetTimingMode) -> None:
        """The capture's timing mode: at its start, and at each switch while running
        (``--control net-timing``). A switch times the records held so far under the
        mode they were made in, with what is known, and forgets every connection's log:
        the kernel's per-socket state went with the switch, and a connection is met
        again as at attach."""
        if self.mode is not None and mode.mode != self.mode.mode:
            self.close()
            self.conns.clear()
            self.accepts.clear()
            self.early_writes.clear()
            self.stats["net_timing_switches"] += 1
        self.mode = mode

    def conn(self, ev: schema.ConnEvent) -> None:
        from tracer.events import wire
        if not self.socket_mode:
            return
        if ev.op == wire.CONSTANTS["CONN_ACCEPT"]:
            self.accepts[ev.key] = ev.ts
        elif ev.op == wire.CONSTANTS["CONN_CLOSE"]:
            self.accepts.pop(ev.key, None)
            self.early_writes.pop(ev.key, None)
            c = self.conns.get(ev.key)
            if c is not None:  # kept a while: its last records may still be on their way
                c.closed_ns = ev.ts

    def data(self, ev: schema.DataEvent) -> None:
        """Remember where each write of a followed connection ended (for TLS: when each
        plaintext write was made; its ciphertext's writes are the socket's)."""
        self.write(ev.key, ev.ts_exit, ev.direction, ev.flags, ev.ret, ev.stream_off,
                   ev.ts_enter)

    def token_run(self, run: TokenRun) -> None:
        """``data`` of each write of a RUN record (tracer/events/runs.py)."""
        if not self.conns:
            return
        c = self.conns.get(run.key)
        if c is None or not c.anchored or not run.ts:
            return
        ts = run.ts
        # the usual run: later than every write logged, in order, none empty: logged
        # at once (what ``write`` does one by one)
        if (c.write_ts and ts[0] <= c.write_ts[-1]) or 0 in run.lens or any(
                a >= b for a, b in zip(ts, ts[1:])):
            off = run.stream_off
            for t, n in zip(ts, run.lens):
                self.write(run.key, t, _DIR_OUT, _FLAG_LAST, n, off)
                off += n
            return
        c.last_ns = max(c.last_ns, ts[-1])
        ends = itertools.accumulate(run.lens, initial=run.stream_off)
        next(ends)  # the first write's start
        c.writes.update(zip(ts, ends))
        c.write_ts.extend(ts)
        self._trim(c)

    def write(self, key: tuple[int, int, int], ts_exit: int, direction: int, flags: int,
              ret: int, stream_off: int, ts_enter: int | None = None) -> None:
        """``data`` of a DATA record's fields (``key``: its (pid, fd, conn_id)).
        ``Pipeline.feed``'s fast path calls it, then perhaps ``data`` with the same
        record: taken once."""
        if direction == _DIR_IN or not flags & _FLAG_LAST or ret <= 0:
            return
        c = self.conns.get(key)
        if c is None:
            if self.socket_mode and not flags & _FLAG_TLS:
                if len(self.early_writes) >= MAX_EARLY and key not in self.early_writes:
                    self.early_writes.clear()  # connections that never got a log
                self.early_writes[key] = ts_exit
            return
        if not c.anchored:
            return
        if ts_exit > c.last_ns:
            c.last_ns = ts_exit
        if flags & _FLAG_TLS:
            if ts_enter is not None:
                c.tls_writes[ts_exit] = ts_enter
                if len(c.tls_writes) > MAX_LOG:
                    del c.tls_writes[next(iter(c.tls_writes))]
            return
        if ts_exit in c.writes:
            return
        c.writes[ts_exit] = stream_off + ret
        if not c.write_ts or ts_exit >= c.write_ts[-1]:
            c.write_ts.append(ts_exit)
        else:
            bisect.insort(c.write_ts, ts_exit)
        self._trim(c)

    @staticmethod
    def _trim(c: ConnLog) -> None:
        """Forget a long-lived connection's oldest writes, a block at a time."""
        while len(c.write_ts) > MAX_LOG + LOG_TRIM:
            for old in c.write_ts[:LOG_TRIM]:
                del c.writes[old]
            del c.write_ts[:LOG_TRIM]

    def netwait(self, ev: NetWait) -> None:
        self.stats[f"netwait_{ev.op}"] += 1
        c = self.conns.get(ev.key)
        if c is None:
            if not ev.first or ev.op != "arrival":
                self.stats["netwait_unowned"] += 1
                return
            c = self.conns[ev.key] = ConnLog(anchored=ev.anchored, estab_ns=ev.estab_ts,
                                             accept_ns=self.accepts.pop(ev.key, 0),
                                             first_read_ns=ev.ref_ts)
            c.first_stale = 0 < ev.ts < self.early_writes.pop(ev.key, 0) <= ev.ref_ts
        c.last_ns = max(c.last_ns, ev.ts, ev.ref_ts)
        if ev.op == "arrival":
            c.anchored = c.anchored or ev.anchored  # late: anchored after attach
            if not _log_pair(c.arrival_refs, c.arrivals, ev.ref_ts, ev.ts, ties=True):
                self.stats["netwait_out_of_order"] += 1
        elif ev.op == "later":
            if not _log_pair(c.later_offs, c.later_ts, ev.stream_off, ev.ts, ties=False):
                self.stats["netwait_out_of_order"] += 1
        elif ev.op == "unseen":
            c.unseen.append(Unseen(ev.sent_from, ev.stream_off, ev.ref_ts, ev.ts))
            if len(c.unseen) > MAX_LOG + LOG_TRIM:
                del c.unseen[:LOG_TRIM]
        elif ev.op == "hold":
            c.holds.append(Hold(ev.held_from, ev.stream_off, ev.ts, ev.cause))
            if len(c.holds) > MAX_LOG + LOG_TRIM:
                del c.holds[:LOG_TRIM]
        else:
            for h in reversed(c.holds):
                if h.left_ns is None and h.start == ev.held_from:
                    h.end, h.left_ns, h.cause = ev.stream_off, ev.ts, ev.cause
                    break
            else:  # its HOLD was lost: the departure alone says as much
                c.holds.append(Hold(ev.held_from, ev.stream_off, ev.ts, ev.cause, ev.ts))
            self._recheck(ev.key)

    # ---- records ----------------------------------------------------------------------

    def finished(self, rec: RequestRecord) -> None:
        """A record from the correlator: timed now, or held until its writes are known."""
        c = self.conns.get(rec.key[:3]) if self.socket_mode else None
        if c is None or not c.anchored:
            self._out(rec)
            return
        heapq.heappush(self._pending, (rec.end_ns + self.wait_ns, next(self._seq), rec))
        self.advance(self.now)

    def _recheck(self, key: tuple[int, int, int]) -> None:
        """A hold ended: records of ``key`` waiting on one are due once past their
        own wait."""
        changed = False
        for i, (due, seq, rec) in enumerate(self._pending):
            if rec.key[:3] == key and due > rec.end_ns + self.wait_ns:
                self._pending[i] = (rec.end_ns + self.wait_ns, seq, rec)
                changed = True
        if changed:
            heapq.heapify(self._pending)

    @property
    def wake_ns(self) -> int:
        """Before this time ``advance`` only notes the time."""
        return min(self._next_prune, self._pending[0][0]) if self._pending else self._next_prune

    def advance(self, now: int) -> None:
        """The capture's clock reached ``now``: time the records that are due."""
        self.now = max(self.now, now)
        if self.now >= self._next_prune:
            self._prune()
        while self._pending and self._pending[0][0] <= self.now:
            due, _, rec = heapq.heappop(self._pending)
            open_hold = self._open_hold(rec)
            if open_hold is not None and self.now < open_hold.seen_ns + self.hold_max_ns:
                heapq.heappush(self._pending, (open_hold.seen_ns + self.hold_max_ns,
                                               next(self._seq), rec))
                continue
            self._out(rec)

    def _prune(self) -> None:
        """Forget connections closed long ago or idle past the tracker's timeout."""
        self._next_prune = self.now + 10**10
        busy = {r.key[:3] for _, _, r in self._pending}
        for key in [k for k, c in self.conns.items() if k not in busy and (
                (c.closed_ns and c.closed_ns + KEEP_CLOSED_NS < self.now)
                or c.last_ns + KEEP_IDLE_NS < self.now)]:
            del self.conns[key]
        for key in [k for k, ts in self.accepts.items() if ts + KEEP_IDLE_NS < self.now]:
            del self.accepts[key]

    def close(self) -> None:
        """End of the capture: time every held record with what is known."""
        while self._pending:
            self._out(heapq.heappop(self._pending)[2])

    def _out(self, rec: RequestRecord) -> None:
        try:
            rec.net = self.timing(rec)
        except Exception:  # never lose a record over its network timing
            self.stats["netwait_timing_errors"] += 1
            rec.net = NetTiming(timing="syscall", reason="tracer error")
        self.stats[f"net_timing.{rec.net.timing}"] += 1
        self.emit(rec)

    def _open_hold(self, rec: RequestRecord) -> Hold | None:
        c = self.conns.get(rec.key[:3])
        if c is None or not c.holds:
            return None
        times = _write_times(rec)
        if _untouched(c, times):
            return None
        for ts in times:
            if ts not in c.writes and ts in c.tls_writes:  # TLS: its ciphertext's write
                ts = _tls_carrier(c, c.tls_writes[ts], ts) or ts
            h = _hold_of(c, c.writes.get(ts))
            if h is not None and h.left_ns is None:
                return h
        return None

    def timing(self, rec: RequestRecord) -> NetTiming:
        """``rec``'s times at the socket, or why it keeps its syscall times."""
        if self.mode is None:
            return NetTiming(timing="syscall", reason="capture without socket timing")
        if self.mode.mode != "socket":
            return NetTiming(timing="syscall", reason=self.mode.reason or "off")
        c = self.conns.get(rec.key[:3])
        if c is None:
            return NetTiming(timing="syscall", reason="connection not seen at its socket")
        if not c.anchored:
            return NetTiming(timing="syscall", reason="connection opened before attach")
        arrival = _arrival(c, rec.start_ns)
        if not arrival:
            return NetTiming(timing="syscall", reason="arrival not seen")
        later = _later(c, rec.start_off, rec.start_ns)
        # it drew from the connection's first burst (an arrival was found: the log holds
        # a read at or before it)
        first_burst = c.arrival_refs[bisect.bisect_right(c.arrival_refs, rec.start_ns) - 1] \
            == c.first_read_ns
        if c.first_stale and later <= arrival and first_burst:
            self.stats["net_timing.first_arrival_stale"] += 1
            return NetTiming(timing="syscall", reason="the first arrival seen on the "
                             "connection was an earlier request's, read before the probes "
                             "were in (attach, resume)")
        if later > arrival:
            self.stats["net_timing.arrival_later"] += 1
            arrival = later
        # the request message cannot have come before its stream's first bytes
        llm_arrival = (max(_arrival(c, rec.llm_start_ns), arrival) if rec.llm_start_ns
                       else arrival)
        n = NetTiming(timing="socket", arrival_ns=arrival, llm_arrival_ns=llm_arrival)
        if c.estab_ns and first_burst:
            n.estab_ns = c.estab_ns  # the connection's first request: its setup counts
            n.accept_ns = c.accept_ns or None
        times = _write_times(rec)
        if _untouched(c, times):  # every write left when it returned
            return n
        worst = (0, None)
        for ts in times:
            if ts not in c.writes and ts in c.tls_writes and \
                    _tls_carrier(c, c.tls_writes[ts], ts) is None:
                n.tls_unmapped += 1
            left, hold, latest = self._departure(c, ts)
            n.departures[ts] = left
            if left - ts > worst[0]:
                worst = (left - ts, hold.cause if hold else None)
            n.unseen_ns = max(n.unseen_ns, latest - left)
        n.send_hold_ns, n.send_hold_cause = worst
        if n.unseen_ns:
            self.stats["net_timing.departure_unknown"] += 1
        return n

    def _departure(self, c: ConnLog, ts: int) -> tuple[int, Hold | None, int]:
        """When the bytes of the write that returned at ``ts`` left: the time, its hold,
        and the latest they may have left (the time itself unless an unseen ACK hides
        it)."""
        if ts not in c.writes and ts in c.tls_writes:
            carrier = _tls_carrier(c, c.tls_writes[ts], ts)
            if carrier is None:
                self.stats["netwait_tls_unmapped"] += 1
                return ts, None, ts
            left, hold, latest = self._departure(c, carrier)
            return max(left, ts), hold, max(latest, ts)
        end = c.writes.get(ts)
        h = _hold_of(c, end)
        left = ts if h is None else max(h.left_ns if h.left_ns is not None else h.seen_ns, ts)
        u = _unseen_of(c, end)
        if u is None:
            return left, h, left
        # not sent at the probe before the unseen ACK, sent by the one after it
        left = max(left, u.after_ns)
        return left, h, max(left, u.by_ns)


def _log_pair(keys: list[int], values: list[int], key: int, value: int, ties: bool
              ) -> bool:
    """Add ``key -> value`` to a connection's two parallel logs (``keys`` ascending),
    forgetting the oldest a block at a time; False, and nothing added, if ``key`` goes
    back (or repeats the last, unless ``ties``)."""
    if keys and (key < keys[-1] or (key == keys[-1] and not ties)):
        return False
    keys.append(key)
    values.append(value)
    if len(keys) > MAX_LOG + LOG_TRIM:
        del keys[:LOG_TRIM], values[:LOG_TRIM]
    return True


def _arrival(c: ConnLog, read_ts: int) -> int:
    """When the bytes of the read that returned at ``read_ts`` reached the socket
    (0: not known): its own ARRIVAL record, or the burst of the last one before it."""
    i = bisect.bisect_right(c.arrival_refs, read_ts) - 1
    if i < 0:
        return 0
    ts = c.arrivals[i]
    return ts if 0 < ts <= read_ts else 0


def _later(c: ConnLog, off: int | None, read_ts: int) -> int:
    """When the segment that the byte at stream offset ``off`` came in, or one before
    it, reached the socket, as LATER records tell (0: none does). A byte arrives no
    earlier than any byte before it, so this bounds its arrival from below, as the
    burst's oldest byte does: the later of the two is the nearer."""
    if off is None or not c.later_offs:
        return 0
    i = bisect.bisect_right(c.later_offs, off) - 1
    if i < 0:
        return 0
    ts = c.later_ts[i]
    return ts if ts <= read_ts else 0


def _tls_carrier(c: ConnLog, enter: int, exit_: int) -> int | None:
    """The ciphertext write (its ts_exit) that carried a TLS plaintext write made from
    ``enter`` to ``exit_``: the last socket write inside it, else the first after it
    (within TLS_CARRY_NS), else None."""
    i = bisect.bisect_right(c.write_ts, exit_)
    if i > 0 and c.write_ts[i - 1] >= enter:
        return c.write_ts[i - 1]
    if i < len(c.write_ts) and c.write_ts[i] - exit_ <= TLS_CARRY_NS:
        return c.write_ts[i]
    return None


def _untouched(c: ConnLog, times: list[int]) -> bool:
    """No hold, unseen ACK or TLS record bears on the writes that returned at
    ``times``: each left as it returned (holds and unseen spans are in stream order, so
    the last of each ends the furthest)."""
    if c.tls_writes:
        return False
    if not c.holds and not c.unseen:
        return True
    ends = [e for e in map(c.writes.get, times) if e is not None]
    if not ends:
        return True
    lo = min(ends)
    return (not c.holds or c.holds[-1].end < lo) and (not c.unseen or c.unseen[-1].end < lo)


def _hold_of(c: ConnLog, end: int | None) -> Hold | None:
    """The hold that found the last byte of a write ending at ``end`` unsent."""
    if end is None:
        return None
    for h in reversed(c.holds):
        if h.start < end <= h.end:
            return h
        if h.end < end and h.left_ns is not None:
            break  # holds are in stream order: older ones end before this
    return None


def _unseen_of(c: ConnLog, end: int | None) -> Unseen | None:
    """The span of unseen ACKs in which the last byte of a write ending at ``end``
    left, if it did in one."""
    if end is None:
        return None
    for u in reversed(c.unseen):
        if u.start < end <= u.end:
            return u
        if u.end < end:
            break  # in stream order: older ones end before this
    return None


def _write_times(rec: RequestRecord) -> list[int]:
    """The writes that a client's view of ``rec`` depends on: the response head, the
    first chunk, every token, the last byte."""
    out = [t for t in (rec.response_start_ns, rec.end_ns) if t]
    r = rec.llm_response
    if r is not None:
        out += [t for t in (r.first_chunk_ts, r.first_token_ts) if t]
        out += list(r.token_ts)
    return sorted(set(out))

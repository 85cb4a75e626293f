"""tracer.correlate.nettiming without BPF: NETWAIT records and socket events fed through
the pipeline, as a replay would."""

from __future__ import annotations

from collections import Counter

from tracer.correlate.nettiming import NetTimer
from tracer.correlate.records import RequestRecord
from tracer.events import schema, wire
from tracer.events.netwait import NetTimingMode, NetWait

C = wire.CONSTANTS
KEY = (10, 5, 1000)
MS = 1_000_000


def nw(op: str, ts: int, ref: int, off: int, aux: int = 0, cause: str | None = None,
       first: bool = False, anchored: bool = True) -> NetWait:
    return NetWait(pid=10, tid=11, fd=5, conn_id=1000, op=op, cause=cause, first=first,
                   anchored=anchored, ts=ts, ref_ts=ref, stream_off=off, aux=aux)


def write(ts: int, off: int, n: int) -> schema.DataEvent:
    return schema.DataEvent(pid=10, tid=11, fd=5, conn_id=1000, ts_enter=ts - 1000,
                            ts_exit=ts, ret=n, offset=0, syscall=C["SYS_WRITE"],
                            direction=C["DIR_OUT"], flags=C["FLAG_LAST"], payload=b"x" * n,
                            stream_off=off)


def rec(start: int, head: int, end: int) -> RequestRecord:
    return RequestRecord(pid=10, fd=5, conn_id=1000, exchange=0, role="server",
                         start_ns=start, response_start_ns=head, end_ns=end)


def timer(out: list) -> NetTimer:
    t = NetTimer(out.append, Counter())
    t.mode = NetTimingMode(ts=0, mode="socket")
    return t


def test_nagle_held_body_waits_for_its_departure_and_names_it():
    out: list[RequestRecord] = []
    t = timer(out)
    t.netwait(nw("arrival", 100 * MS, 103 * MS, 0, aux=99 * MS, first=True))
    t.data(write(104 * MS, 0, 112))  # head: sent at once
    t.data(write(105 * MS, 112, 14))  # body: Nagle holds it behind the head
    t.finished(rec(103 * MS, 104 * MS, 105 * MS))
    t.advance(200 * MS)
    assert out == []  # a hold may still show up (the client's delayed ACK)
    t.netwait(nw("hold", 145 * MS, 105 * MS, 126, aux=112, cause="nagle"))
    t.advance(360 * MS)
    assert out == []  # held: waits for the departure
    t.netwait(nw("departure", 145 * MS, 105 * MS, 126, aux=112, cause="nagle"))
    t.advance(361 * MS)
    (r,) = out
    n = r.net
    assert n.timing == "socket" and n.arrival_ns == 100 * MS and n.estab_ns == 99 * MS
    assert r.socket_wait_ns == 3 * MS
    assert n.send_hold_ns == 40 * MS and n.send_hold_cause == "nagle"
    assert r.client_end_ns - r.client_start_ns == 45 * MS
    assert t.stats["net_timing.socket"] == 1


def test_an_unseen_ack_bounds_the_departures_it_hides_and_says_by_how_much():
    """The kernel skipped the probe for the ACK that released a Nagle-held body (a
    delayed-ACK timer landing in another BPF program). The socket's next probe sees
    snd_una past what the last probe seen had sent: UNSEEN. The body left between
    them; it departs at the earliest it can have, with how much later it may have."""
    out: list[RequestRecord] = []
    t = timer(out)
    t.netwait(nw("arrival", 100 * MS, 103 * MS, 0, aux=99 * MS, first=True))
    t.data(write(104 * MS, 0, 112))  # head: sent at once
    t.data(write(105 * MS, 112, 14))  # body: held, its release unseen
    t.finished(rec(103 * MS, 104 * MS, 105 * MS))
    # last probe seen at 104.5 ms had sent 112 bytes; the next, at 146 ms, 126
    t.netwait(nw("unseen", 146 * MS, 104 * MS + MS // 2, 126, aux=112))
    t.advance(105 * MS + t.wait_ns)
    (r,) = out
    n = r.net
    assert n.timing == "socket" and n.send_hold_ns == 0
    assert n.departures[105 * MS] == 105 * MS and n.unseen_ns == 41 * MS
    assert n.departures.get(104 * MS, 104 * MS) == 104 * MS  # the head's bytes: not in it
    assert t.stats["net_timing.departure_unknown"] == 1 and t.stats["netwait_unseen"] == 1


def test_an_unseen_ack_after_a_seen_hold_moves_its_departure_to_the_earliest_possible():
    """The hold was seen (an ACK found the body unsent at 110 ms), the ACK that let it
    go was not: its DEPARTURE carries the last ACK seen, 110 ms; it left by 150 ms."""
    out: list[RequestRecord] = []
    t = timer(out)
    t.netwait(nw("arrival", 100 * MS, 103 * MS, 0, first=True))
    t.data(write(104 * MS, 0, 112))
    t.data(write(105 * MS, 112, 14))
    t.finished(rec(103 * MS, 104 * MS, 105 * MS))
    t.netwait(nw("hold", 110 * MS, 105 * MS, 126, aux=112, cause="cwnd"))
    t.netwait(nw("departure", 110 * MS, 105 * MS, 126, aux=112, cause="cwnd"))
    t.netwait(nw("unseen", 150 * MS, 110 * MS, 126, aux=112))
    t.close()
    n = out[0].net
    assert n.departures[105 * MS] == 110 * MS and n.send_hold_cause == "cwnd"
    assert n.send_hold_ns == 5 * MS and n.unseen_ns == 40 * MS


def test_no_hold_releases_after_the_wait_and_reads_share_their_burst():
    out: list[RequestRecord] = []
    t = timer(out)
    t.netwait(nw("arrival", 10 * MS, 12 * MS, 0, first=True))
    t.data(write(20 * MS, 0, 50))
    t.finished(rec(12 * MS, 20 * MS, 20 * MS))
    t.advance(20 * MS + t.wait_ns)
    (r,) = out
    assert r.net.send_hold_ns == 0 and r.client_end_ns == 20 * MS
    # a second request read later with no record of its own: same burst (pipelined)
    t.data(write(31 * MS, 50, 50))
    t.finished(rec(30 * MS, 31 * MS, 31 * MS))
    t.close()
    assert out[1].net.arrival_ns == 10 * MS and out[1].socket_wait_ns == 20 * MS


def test_a_request_read_with_older_bytes_arrives_with_its_own_segment():
    """An HTTP/2 client's WINDOW_UPDATE (13 bytes) waited unread from 100 ms; its next
    request came at 103 ms in a segment of its own; one read at 104 ms took both. The
    burst's oldest byte is the WINDOW_UPDATE's: the request's arrival is its segment's
    (LATER), where the parser says where it began; before that offset, or where no
    offset is known, the oldest byte's as before."""
    out: list[RequestRecord] = []
    t = timer(out)
    t.netwait(nw("arrival", 100 * MS, 104 * MS, 0, first=True))
    t.netwait(nw("later", 103 * MS, 104 * MS, 13))
    for off in (13, 40, 5, None):
        r = rec(104 * MS, 105 * MS, 106 * MS)
        r.start_off = off
        t.finished(r)
    t.close()
    assert [r.net.arrival_ns for r in out] == [103 * MS, 103 * MS, 100 * MS, 100 * MS]
    assert [r.socket_wait_ns for r in out] == [MS, MS, 4 * MS, 4 * MS]
    assert t.stats["net_timing.arrival_later"] == 2
    # a LATER out of order (an offset not past the last) is counted and left out
    t.netwait(nw("later", 103 * MS, 104 * MS, 13))
    assert t.stats["netwait_out_of_order"] == 1
    # the next burst's own ARRIVAL bounds its requests as before; the old LATER, below
    # it, changes nothing
    t.netwait(nw("arrival", 200 * MS, 201 * MS, 500))
    r = rec(201 * MS, 202 * MS, 203 * MS)
    r.start_off = 500
    t.finished(r)
    t.close()
    assert out[-1].net.arrival_ns == 200 * MS


def test_syscall_timing_when_off_unseen_or_unanchored_and_it_says_why():
    out: list[RequestRecord] = []
    t = NetTimer(out.append, Counter())
    t.finished(rec(1, 2, 3))  # a capture from before socket timing
    t.mode = NetTimingMode(ts=0, mode="syscall", reason="asked for")
    t.finished(rec(1, 2, 3))
    t.mode = NetTimingMode(ts=0, mode="socket")
    t.finished(rec(1, 2, 3))  # no record for the connection
    t.netwait(nw("arrival", 1, 2, 0, first=True, anchored=False))
    t.finished(rec(2, 3, 4))
    t.netwait(nw("arrival", 0, 9, 10))  # anchored since; this arrival unseen
    assert t.conns[KEY].anchored is True
    t.finished(rec(9, 10, 11))
    t.close()
    reasons = [r.net.reason for r in out]
    assert [r.net.timing for r in out] == ["syscall"] * 5
    assert reasons[:3] == ["capture without socket timing", "asked for",
                           "connection not seen at its socket"]
    assert reasons[3:] == ["connection opened before attach", "arrival not seen"]
    assert all(r.ttft_ns == r.client_ttft_ns for r in out)


def test_records_from_other_owners_and_bad_order_are_counted_not_fatal():
    out: list[RequestRecord] = []
    t = timer(out)
    t.netwait(nw("hold", 5, 4, 10, aux=0))  # no arrival yet for this owner
    t.netwait(nw("arrival", 10, 20, 0, first=True))
    t.netwait(nw("arrival", 5, 15, 0))  # older read after a newer one
    assert t.stats["netwait_unowned"] == 1 and t.stats["netwait_out_of_order"] == 1


def test_netwait_record_round_trips_the_wire():
    raw = wire.NETWAIT.pack(pid=7, tid=8, fd=3, conn_id=9, op=C["NW_HOLD"],
                            cause=C["NW_CAUSE_NAGLE"], flags=C["NW_FLAG_ANCHORED"], ts=5,
                            ref_ts=4, stream_off=126, aux=112)
    assert len(raw) == wire.NETWAIT.size == 64
    ev = schema.decode(raw)
    assert (ev.op, ev.cause, ev.anchored, ev.first, ev.held_from) == ("hold", "nagle", True,
                                                                      False, 112)
    unseen = schema.decode(wire.NETWAIT.pack(pid=7, fd=3, conn_id=9, op=C["NW_UNSEEN"],
                                             ts=50, ref_ts=10, stream_off=300, aux=200))
    assert (unseen.op, unseen.sent_from, unseen.held_from) == ("unseen", 200, 0)
    bad = wire.NETWAIT.pack(op=99)
    try:
        schema.decode(bad)
    except schema.WireError:
        pass
    else:
        raise AssertionError("an unknown op must not decode")


def test_a_long_lived_connection_keeps_a_bounded_log_in_step_and_times_its_holds():
    """A keep-alive connection that wrote far more than the log holds: the oldest
    writes are forgotten a block at a time (not one per write), the log and its index
    stay in step, and a hold on a recent write is still found."""
    from tracer.correlate.nettiming import LOG_TRIM, MAX_LOG

    out: list[RequestRecord] = []
    t = timer(out)
    t.netwait(nw("arrival", 1 * MS, 2 * MS, 0, first=True))
    n = 3 * MAX_LOG
    for i in range(n):
        t.data(write(3 * MS + i * 1000, 10 * i, 10))
    c = t.conns[KEY]
    assert MAX_LOG <= len(c.write_ts) <= MAX_LOG + LOG_TRIM
    assert sorted(c.writes) == c.write_ts and c.write_ts[-1] == 3 * MS + (n - 1) * 1000
    last = 3 * MS + (n - 1) * 1000
    t.netwait(nw("hold", last + 40 * MS, last, 10 * n, aux=10 * (n - 1), cause="nagle"))
    t.netwait(nw("departure", last + 40 * MS, last, 10 * n, aux=10 * (n - 1), cause="nagle"))
    t.finished(rec(2 * MS, last, last))
    t.close()
    (r,) = out
    assert r.net.send_hold_ns == 40 * MS and r.net.send_hold_cause == "nagle"


def test_a_token_run_is_logged_at_once_as_its_writes_would_be_one_by_one():
    from tracer.events.runs import TokenRun
    cases = [((101 * MS, 102 * MS, 103 * MS), (40, 41, 42)),  # after every write: at once
             ((99 * MS, 102 * MS), (40, 41)),  # one before the last write logged
             ((104 * MS, 104 * MS), (40, 41))]  # two at one time: the first kept
    for ts, lens in cases:
        logs = []
        for at_once in (True, False):
            out: list = []
            t = timer(out)
            t.netwait(nw("arrival", 95 * MS, 95 * MS + 10_000, 0, first=True))
            t.data(write(100 * MS, 0, 200))
            run = TokenRun(pid=10, tid=11, fd=5, conn_id=1000, stream_off=200, arm=1,
                           ts=ts, lens=lens)
            if at_once:
                t.token_run(run)
            else:
                off = 200
                for at, n in zip(ts, lens):
                    t.write(KEY, at, C["DIR_OUT"], C["FLAG_LAST"], n, off)
                    off += n
            c = t.conns[KEY]
            logs.append((dict(c.writes), list(c.write_ts), c.last_ns))
        assert logs[0] == logs[1], (ts, lens)


def test_a_switch_while_running_times_held_records_in_their_mode_and_forgets_the_logs():
    """``--control net-timing``: a record held for its departures when the timing is
    switched off is timed at the socket with what was known; one made after the switch
    keeps syscall times and says why; switched back on, the connection's old log is
    gone (the kernel's state went too), so it is met again as at attach."""
    out: list[RequestRecord] = []
    t = timer(out)
    t.set_mode(NetTimingMode(ts=0, mode="socket"))  # the same mode: nothing happens
    t.netwait(nw("arrival", 100 * MS, 103 * MS, 0, aux=99 * MS, first=True))
    t.data(write(104 * MS, 0, 112))
    t.finished(rec(103 * MS, 104 * MS, 104 * MS))
    assert out == [] and t.stats["net_timing_switches"] == 0
    off = NetTimingMode(ts=110 * MS, mode="syscall", reason="switched off while running")
    t.set_mode(off)
    (r,) = out
    assert r.net.timing == "socket" and r.net.arrival_ns == 100 * MS
    assert t.conns == {} and t.stats["net_timing_switches"] == 1
    t.finished(rec(120 * MS, 121 * MS, 122 * MS))
    assert out[1].net.timing == "syscall"
    assert out[1].net.reason == "switched off while running"
    t.set_mode(NetTimingMode(ts=130 * MS, mode="socket"))
    # the kernel's first record for the socket after the switch: not anchored yet
    t.netwait(nw("arrival", 140 * MS, 141 * MS, 200, first=True, anchored=False))
    t.finished(rec(141 * MS, 142 * MS, 143 * MS))
    assert out[2].net.timing == "syscall"
    assert out[2].net.reason == "connection opened before attach"
    assert t.stats["net_timing_switches"] == 2


def test_a_first_arrival_an_unseen_read_took_and_was_answered_is_not_the_next_requests():
    """A keep-alive connection met at a resume (or attach) with its server thread
    already in a read: request 1's bytes came at 10 ms, that read was not seen, its
    response was (20 ms). Request 2 came at 40 ms; its read, the first seen, carries
    the burst's oldest arrival, request 1's: taken, request 2 would have waited 32 ms
    in the socket. Its timing stays the syscall's, and says why; a later request on
    the connection, with an ARRIVAL of its own, is timed at the socket again. Where
    nothing was written in between, the oldest arrival is the request's own."""
    out: list[RequestRecord] = []
    t = timer(out)
    t.data(write(20 * MS, 0, 300))  # request 1's response; no log for the connection yet
    t.netwait(nw("arrival", 10 * MS, 42 * MS, 120, first=True))
    t.finished(rec(42 * MS, 43 * MS, 44 * MS))
    t.netwait(nw("arrival", 60 * MS, 61 * MS, 240))
    t.finished(rec(61 * MS, 62 * MS, 63 * MS))
    t.close()
    assert out[0].net.timing == "syscall" and "earlier request" in out[0].net.reason
    assert out[1].net.timing == "socket" and out[1].net.arrival_ns == 60 * MS
    assert t.stats["net_timing.first_arrival_stale"] == 1
    t2 = timer(out := [])
    t2.netwait(nw("arrival", 10 * MS, 42 * MS, 0, first=True))  # the server was busy
    t2.finished(rec(42 * MS, 43 * MS, 44 * MS))
    t2.close()
    assert out[0].net.timing == "socket" and out[0].net.arrival_ns == 10 * MS

"""Requests timed as the client sees them (bpf/netwait.c): real probes on real servers,
against raw-socket clients timed by their sockets' kernel stamps (``tests/kstamps.py``:
the request's departure, the arrival of the segments holding the first token and the
last byte); the clients' own waits for a CPU are measured and reported apart.

- stdlib ``http.server`` with TCP_NODELAY off: the body's write waits for the client's
  delayed ACK (Nagle); the spans show it as ``send_hold`` (``nagle``).
- a single-threaded server with 6 clients at once: the connections wait in the listen
  backlog and receive queue; ``socket_wait`` is that wait.
- gRPC (HTTP/2) on the KServe sample, over a connection opened before attach.
- a server busy while its client sends twice: one read of both tells when the second
  send came (LATER), for a request sent after bytes that waited unread.
- forced off: the spans keep syscall times and say so.
- switched off and back on while running (``--control net-timing``): the same, for the
  stretch it was off, with the tracepoints out; a replay times every span as live.
"""

from __future__ import annotations

import gc
import json
import re
import socket
import subprocess
import sys
import time

import pytest

from samples.launch import SampleServer
from tests.conftest import free_port
from tests.kstamps import StampedSocket, drive, realtime_thread
from tests.live import off_by, spans_by_response_id, traced, traced_cli
from tracer.control import send as ctl_send
from tracer.probes.bpfstats import parse_costs

pytestmark = pytest.mark.bpf

FIRST_TEXT = re.compile(rb'"content": ?"tok0')
ID = re.compile(rb'"id": ?"(chatcmpl-[0-9-]+)"')
ANY_TEXT = re.compile(rb'"content": ?"(?:[^"\\]|\\.)')  # the first generated character
ANY_ID = re.compile(rb'"id": ?"([^"]+)"')


class RawClient:
    """One keep-alive connection, timed by its socket's kernel stamps
    (``tests/kstamps.py``): from the request's departure to the arrival of the segment
    that holds the first token, and of the one that holds the response's last byte.
    The client's own waits for a CPU (its clock after the send and recv calls minus
    the kernel's stamps) are not in those times; they are kept apart.

    ``begin`` sends a request and ``step`` handles what the socket has, returning the
    result once the response is whole (``tests/kstamps.drive`` runs many clients from
    one thread); ``chat`` does both."""

    def __init__(self, port: int, model: str = "stdlib-gpt", first_text: re.Pattern = FIRST_TEXT,
                 id_re: re.Pattern = ID) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ssock = StampedSocket(self.sock)
        self.model, self.first_text, self.id_re = model, first_text, id_re
        self.cur: dict | None = None

    def begin(self, stream: bool, max_tokens: int, content: str = "hi") -> None:
        body = json.dumps({"model": self.model, "stream": stream, "max_tokens": max_tokens,
                           "messages": [{"role": "user", "content": content}]}).encode()
        req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
        sent, sent_user = self.ssock.send(req)
        self.cur = {"stream": stream, "sent": sent, "sent_user": sent_user, "buf": b"",
                    "first": None, "waits": []}

    def step(self) -> dict | None:
        c = self.cur
        assert c is not None
        peeked, _ = self.ssock.peek()
        assert peeked, "server closed"
        if c["first"] is None:
            m = self.first_text.search(c["buf"] + peeked)
            if m:  # the segment holding the token's first bytes
                _, c["first"] = self.ssock.peek(m.end() - len(c["buf"]))
        data, last, user = self.ssock.recv(len(peeked))
        assert last is not None, "no RX timestamp"
        c["waits"].append(user - last)
        c["buf"] += data
        if not _complete(c["buf"]):
            return None
        rid = self.id_re.search(c["buf"])
        assert rid, c["buf"][:300]
        self.cur = None
        sent = c["sent"]
        # no first text: a reply of random weights can be all end-of-text
        ttft = (c["first"] - sent) / 1e9 if c["first"] is not None else None
        return {"id": rid.group(1).decode(), "ttft": ttft,
                "duration": (last - sent) / 1e9, "stream": c["stream"],
                "client_wait": max(c["waits"]) / 1e9,
                "send_wait": (sent - c["sent_user"]) / 1e9}

    def chat(self, stream: bool, max_tokens: int, content: str = "hi") -> dict:
        self.begin(stream, max_tokens, content)
        while (r := self.step()) is None:
            pass
        return r

    def close(self) -> None:
        self.sock.close()


def _complete(buf: bytes) -> bool:
    head, sep, rest = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    m = re.search(rb"content-length: *(\d+)", head, re.I)
    if m:
        return len(rest) >= int(m.group(1))
    return rest.endswith(b"0\r\n\r\n")


def _compare(calls: list[dict], spans: dict[str, dict]) -> tuple[list[float], list[float]]:
    """|span - client| for TTFT and duration, seconds."""
    ttft, dur = [], []
    for c in calls:
        s = spans[c["id"]]
        a = s["attributes"]
        assert a["tokentrace.network.timing"] == "socket", a
        if c["ttft"] is None:  # a reply with no text has no TTFT on either side
            assert "tokentrace.time_to_first_token" not in a, (c, a)
        else:
            ttft.append(off_by(a["tokentrace.time_to_first_token"], c["ttft"], a))
        dur.append(off_by((s["end_time_unix_nano"] - s["start_time_unix_nano"]) / 1e9,
                          c["duration"], a))
    return ttft, dur


def _client_waits(calls: list[dict]) -> None:
    """Say how long the client itself waited for a CPU: kept out of its truth."""
    recv = [c["client_wait"] for c in calls]
    send = [c["send_wait"] for c in calls]
    print(f"client's own waits, apart: after a segment's arrival until its recv() returned "
          f"max {max(recv) * 1e3:.2f} ms ({sum(w > 0.002 for w in recv)} over 2 ms); "
          f"before its send() reached the wire max {max(send) * 1e3:.2f} ms")


def _bar(name: str, diffs: list[float]) -> None:
    """The issue's bar: >= 98% within 2 ms, none over 10 ms."""
    within = sum(d < 0.002 for d in diffs)
    print(f"{name}: {within}/{len(diffs)} within 2 ms, max {max(diffs) * 1e3:.2f} ms, "
          f"mean {sum(diffs) / len(diffs) * 1e3:.3f} ms")
    assert within >= 0.98 * len(diffs) and max(diffs) < 0.010, sorted(diffs)[-5:]


def _plain_and_streamed(port: int, n: int) -> list[dict]:
    """``n`` requests back to back on one keep-alive connection, plain and streamed in
    turn (the client soon delays its ACKs: the stdlib server's second write waits)."""
    client = RawClient(port)
    calls = [client.chat(stream=i % 2 == 1, max_tokens=3) for i in range(n)]
    client.close()
    return calls


def _as_the_client_saw(calls: list[dict], spans: dict[str, dict]) -> list[float]:
    """The spans' TTFT and duration against the client's kernel stamps, to the bar;
    the TTFT differences (replies with text)."""
    ttft, dur = _compare(calls, spans)
    _client_waits(calls)
    _bar("TTFT", ttft)
    _bar("duration", dur)
    return ttft


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()  # a collection between recv() and the clock read is not the server's
    yield
    gc.enable()


def test_nagle_hold_of_stdlib_http_server_is_in_the_span_and_named(tmp_path, no_gc):
    with SampleServer("samples.stdlib_server", port=free_port(), log=tmp_path / "s.log") as srv:
        with traced_cli(["--pid", str(srv.pid)], str(tmp_path / "spans.jsonl")) as got:
            calls = _plain_and_streamed(srv.port, 24)
    spans = spans_by_response_id(got.spans)
    assert len(spans) == 24, got.stderr
    _as_the_client_saw(calls, spans)
    held = [spans[c["id"]]["attributes"] for c in calls]
    nagle = [a for a in held if a.get("tokentrace.network.send_hold.cause") == "nagle"
             and a["tokentrace.network.send_hold"] > 0.020]
    # back-to-back requests put the client in delayed-ACK mode: the body waits ~40 ms
    assert len(nagle) >= 6, [a.get("tokentrace.network.send_hold") for a in held]
    # ...which the server's own syscalls do not see
    gap = [a["tokentrace.time_to_first_token"] - a["tokentrace.server.time_to_first_token"]
           for a in nagle]
    assert min(gap) > 0.020, gap
    assert "requests timed at the socket;" in got.stderr
    assert got.returncode == 0 and "no events lost" in got.stderr, got.stderr


def test_acks_the_kernel_did_not_probe_are_found_counted_and_bound_the_times(tmp_path, no_gc):
    """A tracepoint's program is not run while another BPF program runs on the same
    CPU. Here two untraced processes write as fast as they can (each write runs the
    agent's own syscall programs, for the pid check), so a client's delayed-ACK timer
    often fires inside one, and tcp_probe never sees the ACK that lets a Nagle-held
    body go (CI hit this: a 40 ms TTFT timed as 1 ms). The socket's next probe finds
    the ACK by its sequence numbers (UNSEEN); the request's times are then the
    earliest possible, with how much later they may be: the client's own time must
    lie in between. The kernel's count of skipped runs is in the report."""
    storm = [subprocess.Popen(["nice", "-n", "19", "dd", "if=/dev/zero", "of=/dev/null", "bs=1"],
                              stderr=subprocess.DEVNULL)
             for _ in range(2)]
    summary, sock = tmp_path / "summary.json", str(tmp_path / "ctl.sock")
    try:
        with SampleServer("samples.stdlib_server", port=free_port(),
                          log=tmp_path / "s.log") as srv:
            with traced_cli(["--pid", str(srv.pid), "--summary", str(summary),
                             "--control", sock], str(tmp_path / "spans.jsonl")) as got:
                calls: list[dict] = []
                # a skipped run needs the timer to land in a BPF program: batches until
                # the kernel has skipped tcp_probe's (the agent's counters, asked while
                # it runs: other programs' skipped runs stopped it early once, with
                # none of tcp_probe's), at most 20 batches (8 went by with none in one
                # run of three, on the development VM, before and after the socket
                # probes got shorter)
                while len(calls) < 240 and (len(calls) < 24 or _skipped(sock) < 1):
                    calls += _plain_and_streamed(srv.port, 12)
    finally:
        for p in storm:
            p.kill()
            p.wait()
    spans = spans_by_response_id(got.spans)
    assert len(spans) == len(calls) and got.returncode == 0, got.stderr
    rep = json.loads(summary.read_text())["report"]
    print(f"\n{len(calls)} requests; probe runs skipped: {rep.get('capture.probe_runs_missed', 0)}; ACKs found "
          f"unseen: {rep.get('netwait_unseen', 0)}; requests bounded: "
          f"{rep.get('net_timing.departure_unknown', 0)}")
    assert rep["capture.probe_runs_missed.tcp:tcp_probe"] >= 1
    assert rep["netwait_unseen"] >= 1 and rep["net_timing.departure_unknown"] >= 1
    assert "the kernel skipped" in got.stderr and "departures bounded" in got.stderr
    ttft, dur = _compare(calls, spans)
    # the bound holds for every request, bounded or timed (the client's own waits aside)
    assert max(ttft) < 0.003 and max(dur) < 0.003, (sorted(ttft)[-3:], sorted(dur)[-3:])


def _skipped(sock: str) -> int:
    """The runs of tcp_probe's program the kernel skipped so far, as the agent at
    control socket ``sock`` counts them (``tokentrace ctl SOCK counters``)."""
    reply = ctl_send(sock, "counters")
    assert reply.startswith("ok {"), reply
    return json.loads(reply[3:]).get("probe_runs_missed.tcp:tcp_probe", 0)


def test_an_agent_late_after_its_drain_keeps_the_holds_it_has_not_read_yet(
        tmp_path, monkeypatch, no_gc):
    """The agent's periodic counters report is the stream's clock while a server idles,
    and a finished request is timed once that clock is ``WAIT_NS`` past its last write.
    The report must not be stamped later than the drain before it: an agent held off
    the CPU in between (``--sched-idle`` on a busy host) moved the clock past records
    still in the ring, and a request was timed before its Nagle hold was read (CI: a
    TTFT 43.7 ms short). Here every drain is followed by 0.3 s of sleep."""
    from tracer.probes import ringbuf

    for cls in (ringbuf.RingReader, ringbuf.BccReader):
        def late(self, *budget, _real=cls.consume):
            n = _real(self, *budget)
            time.sleep(0.3)
            return n
        monkeypatch.setattr(cls, "consume", late)
    with SampleServer("samples.stdlib_server", port=free_port(), log=tmp_path / "s.log") as srv:
        with traced(pids=[srv.pid], counters_interval_s=0.05) as got:
            calls = _plain_and_streamed(srv.port, 16)
    spans = spans_by_response_id(got.spans)
    assert len(spans) == 16, got.report
    _as_the_client_saw(calls, spans)
    held = [spans[c["id"]]["attributes"].get("tokentrace.network.send_hold", 0) for c in calls]
    assert sum(h > 0.020 for h in held) >= 4, held


WAVES = 9


def test_single_threaded_server_backlog_is_socket_wait(tmp_path, no_gc):
    """Six new connections at once to a server that serves one at a time, nine waves.
    One real-time thread drives the six (``drive``): with a thread each, a client that
    waited for a CPU read its first token late, TCP had merged the next token's segment
    into the first's by then, and the stamp was the next token's (on the loaded VM: a
    client's TTFT one or two tokens, 2.1-4.5 ms, later than the span's). It still
    happens, rarely (CI: 1 of 18, 2.49 ms): nine waves, so that the bar's 98% allows
    one such request, as it says, rather than none (three waves of 18 did)."""
    with SampleServer("samples.stdlib_server", port=free_port(), log=tmp_path / "s.log",
                      args=["--single", "--prefill-ms", "40", "--token-ms", "2"]) as srv:
        results: list[dict] = []

        def begin(i: int, k: int, c: RawClient) -> None:
            c.begin(stream=True, max_tokens=4)

        with traced_cli(["--pid", str(srv.pid)], str(tmp_path / "spans.jsonl")) as got:
            for _ in range(WAVES):
                # a new connection each: the listen backlog counts; each closed once
                # answered (the server serves a keep-alive connection until it closes)
                clients = [RawClient(srv.port) for _ in range(6)]
                with realtime_thread():
                    results += drive(clients, begin, per_client=1, finished=RawClient.close)
    spans = spans_by_response_id(got.spans)
    assert len(results) == 6 * WAVES and len(spans) == 6 * WAVES, got.stderr
    ttft, _ = _compare(results, spans)
    _client_waits(results)
    _bar("TTFT", ttft)
    waits, errs = [], []
    for r in results:
        a = spans[r["id"]]["attributes"]
        queued = r["ttft"] - a["tokentrace.server.time_to_first_token"]  # client's view
        waits.append(a["tokentrace.network.socket_wait"])
        errs.append(abs(a["tokentrace.network.socket_wait"] - queued))
    print("socket waits (ms):", sorted(round(w * 1e3, 1) for w in waits))
    # 6 at once, ~50 ms each, one at a time: the last of each wave waited ~200 ms
    assert max(waits) > 0.150 and max(r["ttft"] for r in results) > 0.200
    _bar("socket_wait vs client queueing", errs)
    assert got.returncode == 0 and "no events lost" in got.stderr, got.stderr


SLOW_READER = """
import socket, sys, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0))
srv.listen(8)
print(srv.getsockname()[1], flush=True)
while True:
    c, _ = srv.accept()
    want = int(c.recv(1))  # a first read: the owner's, its own burst
    time.sleep(0.3)  # busy: the client's next two sends wait unread
    got = b""
    while len(got) < want:
        got += c.recv(4096)
    c.sendall(b"k")
    c.close()
"""


def test_a_read_of_two_sends_tells_when_the_later_one_came(tmp_path):
    """A server busy while its client sends twice, 40 ms apart, then one read takes
    both: the ARRIVAL is the first send's (the burst's oldest byte), and a LATER record
    says where the second began in the stream and when it came (bpf/netwait.c), so
    that a request sent after bytes that waited unread (an HTTP/2 WINDOW_UPDATE) is
    timed from its own arrival. Against the client's own send stamps, on loopback."""
    from tracer.events import capture, wire
    from tracer.events.netwait import DECODERS

    srv = subprocess.Popen([sys.executable, "-c", SLOW_READER], stdout=subprocess.PIPE,
                           text=True)
    try:
        port = int(srv.stdout.readline())
        cap = tmp_path / "cap.ttcap"
        sends = []
        with traced_cli(["--pid", str(srv.pid), "--record", str(cap)],
                        str(tmp_path / "spans.jsonl")) as got:
            time.sleep(1.5)  # the listener scan: the port traced at its socket
            for _ in range(4):  # the first may come before that scan: not compared
                c = socket.create_connection(("127.0.0.1", port))
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                c.sendall(b"9")  # 9 bytes to come; read at once
                time.sleep(0.05)
                t0 = time.monotonic_ns()
                c.sendall(b"AAAA")
                time.sleep(0.04)
                t1 = time.monotonic_ns()
                c.sendall(b"BBBBB")
                assert c.recv(1) == b"k"
                c.close()
                sends.append((t0, t1))
        assert got.returncode == 0, got.stderr
    finally:
        srv.kill()
        srv.wait()
    recs = [DECODERS[wire.kind_of(b)](b) for b in capture.CaptureReader(cap)
            if isinstance(b, bytes) and wire.kind_of(b) == wire.CONSTANTS["KIND_NETWAIT"]]
    recs = [r for r in recs if r.pid == srv.pid and r.op in ("arrival", "later")]
    per_conn: list[list] = []
    for r in recs:  # in capture order; a connection's first read is flagged
        if r.first:
            per_conn.append([])
        assert per_conn, r
        per_conn[-1].append(r)
    assert len(per_conn) >= 3, recs
    for (t0, t1), rs in zip(sends[-3:], per_conn[-3:]):
        ops = [(r.op, r.stream_off) for r in rs]
        # the 1-byte read alone; then one read of both sends: its oldest byte at 1,
        # the second send's first at 5
        assert ops == [("arrival", 0), ("arrival", 1), ("later", 5)], ops
        _, first, later = rs
        assert later.ref_ts == first.ref_ts  # the same read
        assert 0 <= first.ts - t0 < 2_000_000 and 0 <= later.ts - t1 < 2_000_000, \
            (first.ts - t0, later.ts - t1)
        assert later.ts - first.ts > 30_000_000


def test_forced_off_spans_keep_syscall_times_and_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENTRACE_NET_TIMING", "syscall")
    with SampleServer("samples.stdlib_server", port=free_port(), log=tmp_path / "s.log") as srv:
        with traced(pids=[srv.pid]) as got:
            client = RawClient(srv.port)
            calls = [client.chat(stream=True, max_tokens=2) for _ in range(4)]
            client.close()
    spans = spans_by_response_id(got.spans)
    assert len(spans) == 4
    for c in calls:
        a = spans[c["id"]]["attributes"]
        assert a["tokentrace.network.timing"] == "syscall"
        assert "TOKENTRACE_NET_TIMING" in a["tokentrace.network.timing_reason"]
        assert "tokentrace.network.socket_wait" not in a
        assert a["tokentrace.time_to_first_token"] == a["tokentrace.server.time_to_first_token"]
    assert got.report["net_timing.syscall"] == 4
    jsonl = tmp_path / "spans.jsonl"
    jsonl.write_text("".join(json.dumps(s) + "\n" for s in got.spans))
    out = subprocess.run([sys.executable, "-m", "tracer", "report", str(jsonl), "-o",
                          str(tmp_path / "rep"), "--format", "json"],
                         capture_output=True, text=True, check=True)
    assert "4 timed by syscalls only" in out.stderr, out.stderr
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    assert summary["totals"]["syscall_timed"] == 4, summary


def test_switched_off_and_back_on_while_running(tmp_path, no_gc):
    """``tokentrace ctl SOCK net-timing syscall|socket`` (so that bench/real_server.py
    can pair what the socket-level timing costs in one run): while it is off, its
    softirq tracepoint runs for no segment and the spans keep syscall times, saying
    why; switched back on, a new connection is timed at the socket again, Nagle's holds
    in it; the recorded capture replays to the same spans."""
    sock, cap = str(tmp_path / "ctl.sock"), tmp_path / "cap.ttcap"
    live, again = tmp_path / "spans.jsonl", tmp_path / "replay.jsonl"

    def tcp_probe_runs() -> int:
        costs = parse_costs(ctl_send(sock, "probe-stats").removeprefix("ok probe-stats"))
        return sum(c.runs for n, c in costs.items() if "tcp_probe" in n)

    with SampleServer("samples.stdlib_server", port=free_port(), log=tmp_path / "s.log") as srv:
        with traced_cli(["--pid", str(srv.pid), "--control", sock, "--record", str(cap)],
                        str(live)) as got:
            assert ctl_send(sock, "probe-stats on") == "ok probe-stats on"
            before = _plain_and_streamed(srv.port, 16)
            reply = ctl_send(sock, "net-timing syscall")
            assert reply.startswith("ok net-timing syscall"), reply
            assert ctl_send(sock, "net-timing syscall") == "ok net-timing syscall 0.000s"
            runs = tcp_probe_runs()
            off = _plain_and_streamed(srv.port, 16)
            assert tcp_probe_runs() == runs  # detached: run for none of those segments
            reply = ctl_send(sock, "net-timing socket")
            assert reply.startswith("ok net-timing socket"), reply
            after = _plain_and_streamed(srv.port, 16)
            assert tcp_probe_runs() > runs
            assert ctl_send(sock, "net-timing on").startswith("error: unknown command")
    assert got.returncode == 0 and "no events lost" in got.stderr, got.stderr
    spans = spans_by_response_id([json.loads(x) for x in live.read_text().splitlines()])
    assert len(spans) == 48, got.stderr
    for calls in (before, after):
        held = [spans[c["id"]]["attributes"] for c in calls]
        assert all(a["tokentrace.network.timing"] == "socket" for a in held), held
        nagle = [a for a in held if a.get("tokentrace.network.send_hold.cause") == "nagle"]
        assert len(nagle) >= 3, [a.get("tokentrace.network.send_hold") for a in held]
    for c in off:
        a = spans[c["id"]]["attributes"]
        assert a["tokentrace.network.timing"] == "syscall", a
        assert "switched off while running" in a["tokentrace.network.timing_reason"]
        assert "tokentrace.network.send_hold" not in a
        assert a["tokentrace.time_to_first_token"] == a["tokentrace.server.time_to_first_token"]
    r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(cap), "--jsonl",
                        str(again), "--quiet"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(json.dumps(s, sort_keys=True) for s in spans.values()) == sorted(
        json.dumps(s, sort_keys=True) for s in spans_by_response_id(
            [json.loads(x) for x in again.read_text().splitlines()]).values())


def test_hf_transformers_serve_at_concurrency_32(tmp_path, no_gc):
    """A server nobody here wrote: HF ``transformers serve --continuous-batching`` (a
    tiny Llama built offline, on the CPU), 32 raw clients at once on keep-alive
    connections (one real-time thread drives them all), streamed and whole replies,
    attached after the server started."""
    from samples.hf.model import build
    from samples.hf.serve import HfServer
    model = build(tmp_path / "tiny-llama")
    srv = HfServer(model, tmp_path / "truth.jsonl", tmp_path / "hf.log", continuous=True)
    try:
        srv.wait_ready()
        srv.warm_up()
        with traced_cli(["--pid", str(srv.pid)], str(tmp_path / "spans.jsonl")) as got:
            clients = [RawClient(srv.port, str(model), ANY_TEXT, ANY_ID) for _ in range(32)]

            def begin(i: int, k: int, c: RawClient) -> None:
                c.begin(stream=(i + k) % 3 != 0, max_tokens=6 + (i * 7 + k) % 19,
                        content=" ".join(["the model reads a prompt"] * (1 + i % 9)))

            with realtime_thread():
                results = drive(clients, begin, per_client=2)
            for c in clients:
                c.close()
    finally:
        srv.stop()
    spans = spans_by_response_id(got.spans)
    assert len(results) == 64 and set(spans) >= {r["id"] for r in results}, got.stderr
    assert len(_as_the_client_saw(results, spans)) >= 56, "most replies have text"
    waits = sorted(spans[r["id"]]["attributes"]["tokentrace.network.socket_wait"] for r in results)
    print(f"socket waits: p50 {waits[32] * 1e3:.2f} ms, max {waits[-1] * 1e3:.2f} ms")
    assert got.returncode == 0 and "no events lost" in got.stderr, got.stderr

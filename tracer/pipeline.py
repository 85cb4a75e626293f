"""Capture items to exported requests: the one analysis path for `run` and `replay`.

``Pipeline.feed`` takes what a capture produces, raw ring-buffer records or user-space
events, in order; nothing here touches BPF, /proc or the clock, so a replayed capture
produces exactly what the live run produced.
"""

from __future__ import annotations

import struct
from collections import Counter, deque
from typing import Any, Protocol

from tracer.correlate.attribution import MAX_SETTLE_LAG_NS, GpuAttribution, Pricing
from tracer.correlate.connections import (MAX_SOCKET_THREADS, ConnectionTracker,
                                          TrackerOptions, count_parser_error)
from tracer.correlate.gpu import GpuLedger
from tracer.correlate.ipc import IpcGraph
from tracer.correlate.nettiming import NetTimer
from tracer.correlate.records import RequestRecord
from tracer.correlate.stacks import Flame, StackBook, resolve
from tracer.events import gpu, schema, stacks, wire
from tracer.events.netwait import NetTimingMode, NetWait
from tracer.events.runs import RunArmed, TokenRun
from tracer.events.tls import TlsEvent, TlsLibrary
from tracer.export.context import ExportContext

C = wire.CONSTANTS
EXPIRE_EVERY_NS = 60 * 10**9
_DATA_KIND = struct.pack("<I", C["KIND_DATA"])
_UNPACK_DATA = wire.DATA.header.unpack_from
_DATA_HDR = wire.DATA.header_size
# A record whose launch-site stacks are not all resolved yet (the agent unwinds and names
# each new stack on a thread of its own; a library's first stack reads its .eh_frame,
# seconds for libtorch) waits for them this long in stream time.
FLAME_WAIT_NS = 15 * 10**9
# An exited process's stacks are forgotten once its last steps are settled (at most
# MAX_SETTLE_LAG_NS) and the records using them waited for their names.
STACKS_KEPT_AFTER_EXIT_NS = MAX_SETTLE_LAG_NS + FLAME_WAIT_NS + 10 * 10**9


class RecordSink(Protocol):
    def on_record(self, rec: RequestRecord) -> None: ...

    def close(self) -> None: ...


class Pipeline:
    def __init__(self, sinks: list[Any], ctx: ExportContext | None = None,
                 options: TrackerOptions | None = None, pricing: Pricing | None = None
                 ) -> None:
        self.ctx = ctx or ExportContext()
        self.sinks = list(sinks)
        self.stats: Counter[str] = Counter()
        self.ipc = IpcGraph(self.stats)
        self.tracker = ConnectionTracker(self._emit, options, self.ctx.processes, self.ipc)
        self.last_ts = 0
        self._next_expire = 0
        # before this stream time, a tick has nothing to do but move the clocks
        # (``_tick``; 0: tick in full, something may be due)
        self._wake = 0
        self.records = 0
        self.gpu = GpuLedger()
        self.pricing = pricing
        # after the GPU attribution (which times by syscalls): the client's view
        self.net = NetTimer(self._export_now, self.stats)
        self.stacks = StackBook()
        # records waiting for their stacks' names, in deadline order
        # (deadline, record, the (pid, stack id) it still waits for)
        self._flame_wait: deque[tuple[int, RequestRecord, set[tuple[int, int]]]] = deque()
        self._named = False  # a stack was named since the waiting records were checked
        self.attribution = GpuAttribution(self._export, self.tracker.open_of, self.stats,
                                          ipc=self.ipc, pricing=pricing,
                                          kernel_name=self._kernel_name, stacks=self.stacks,
                                          open_check=self.tracker.is_open,
                                          serves=self._serves,
                                          earliest_open=self.tracker.arrivals.earliest)
        # under --gpu-sample the summary reports engine threads' launches as their steps
        # were booked (the same estimates the requests were charged)
        self.gpu.step_totals = self.attribution.step_totals
        self.gpu.same_thread = self.attribution.same_thread
        self.ctx.flame_resolver = self.resolve_flame
        self.tls_libraries: list[TlsLibrary] = []  # found in traced processes
        self.duty_cycle = 0.0  # run --duty-cycle's fraction in force (TracingPaused)
        self._tls_paths: dict[int, set[str]] = {}

    def _emit(self, rec: RequestRecord) -> None:
        """A finished record: held by the GPU attribution until its bursts are in."""
        self._wake = 0
        rec.duty_cycle = self.duty_cycle
        self.attribution.finished(rec)

    def _kernel_name(self, pid: int, handle: int) -> str:
        """A readable name for a launched kernel handle of process ``pid``."""
        from tracer.correlate.kernelnames import readable
        proc = self.gpu.processes.get(pid)
        return readable(proc.name_of(handle)) if proc is not None else f"unknown@{handle:#x}"

    def resolve_flame(self, flame: Flame) -> list[Any]:
        """A request's (or service's) stack weights as frames, kernels named."""
        return resolve(flame, self.stacks, self._kernel_name)

    def _serves(self, pid: int, tid: int) -> bool:
        threads = self.tracker.socket_threads
        return threads is None or (pid, tid) in threads

    def _export(self, rec: RequestRecord) -> None:
        """An attributed record: timed at the socket, then exported."""
        self.net.finished(rec)

    def _export_now(self, rec: RequestRecord) -> None:
        """Export, once the record's stacks are named (or have waited FLAME_WAIT_NS):
        driven by the stream's own order and time, so a replay waits alike."""
        missing = self._unnamed(rec) if rec.flame else None
        if missing:
            self._flame_wait.append((self.last_ts + FLAME_WAIT_NS, rec, missing))
            return
        self._sink_record(rec)

    def _unnamed(self, rec: RequestRecord) -> set[tuple[int, int]]:
        """The (pid, stack id) of the record's stacks not named yet."""
        frames = self.stacks.frames
        return {(pid, sid) for pid, sid, _w, _h in rec.flame if sid and (pid, sid) not in frames}

    def _release_flames(self, final: bool = False) -> None:
        """Export the waiting records whose stacks are all named now, or whose wait is
        over. All of them are looked at only when a stack was named since the last
        look; otherwise only those whose deadline passed (the oldest first)."""
        if final or self._named:
            self._named = False
            frames = self.stacks.frames
            keep: deque[tuple[int, RequestRecord, set[tuple[int, int]]]] = deque()
            for deadline, rec, missing in self._flame_wait:
                missing.difference_update([k for k in missing if k in frames])
                if final or deadline <= self.last_ts or not missing:
                    self._release(rec, missing)
                else:
                    keep.append((deadline, rec, missing))
            self._flame_wait = keep
            return
        while self._flame_wait and self._flame_wait[0][0] <= self.last_ts:
            _, rec, missing = self._flame_wait.popleft()
            self._release(rec, {k for k in missing if k not in self.stacks.frames})

    def _release(self, rec: RequestRecord, missing: set[tuple[int, int]]) -> None:
        if missing:
            self.stats["flame_stacks_unresolved_at_export"] += 1
        self._sink_record(rec)

    def _sink_record(self, rec: RequestRecord) -> None:
        self.records += 1
        for s in self.sinks:
            s.on_record(rec)

    def feed(self, item: bytes | Any) -> None:
        """One capture item. Never raises on what the item holds: a failure is counted
        in ``parser_errors`` (the tracker contains its own per connection)."""
        if type(item) is bytes and item[:4] == _DATA_KIND and self._stream_write(item):
            return
        if isinstance(item, (bytes, bytearray)):
            try:
                ev = schema.decode(bytes(item))
            except schema.WireError:
                self.stats["undecodable_records"] += 1
                return
            except Exception as e:  # a decoder bug on a malformed record
                self.stats["undecodable_records"] += 1
                count_parser_error(self.stats, e)
                return
        else:
            ev = item
        try:
            self.handle(ev)
        except Exception as e:
            count_parser_error(self.stats, e)

    def _stream_write(self, buf: bytes) -> bool:
        """A DATA record that is one token's write of a streamed response, taken from
        its fields without building the event (``ConnectionTracker.stream_write``), the
        most frequent record of a busy server: exactly what ``handle`` does with it.
        False: not that case, nothing done but what ``handle`` will do again."""
        if len(buf) < _DATA_HDR:
            return False
        (_, pid, tid, fd, conn_id, ts_enter, ts, ret, offset, n, _, direction, flags, _,
         stream_off) = _UNPACK_DATA(buf, 0)
        t = self.tracker
        key = (pid, fd, conn_id)
        c = t.conns.get(key)
        if c is None or c.stream_dir != direction or len(buf) < _DATA_HDR + n:
            return False
        if ts > self.last_ts:
            self.last_ts = ts
        self.net.write(key, ts, direction, flags, ret, stream_off, ts_enter)
        threads = t.socket_threads
        if threads is not None:
            threads.add((pid, tid))
            if len(threads) > MAX_SOCKET_THREADS:
                t.socket_threads = None
        try:
            if not t.stream_write(c, tid, ts, direction, flags, offset, ret,
                                  buf[_DATA_HDR:_DATA_HDR + n], stream_off):
                return False
        except Exception as e:  # as data_event would: this connection only
            t.contain(c, e, ts)
        now = self.last_ts
        if now < self._wake:  # the clocks move, nothing is due (``_tick``)
            a, net = self.attribution, self.net
            if now > a.now:
                a.now = now
            if now > net.now:
                net.now = now
        else:
            self._tick()
        return True

    def handle(self, ev: Any) -> None:
        t = self.tracker
        if type(ev) is schema.DataEvent:  # most records: tested first, exactly
            if ev.ts_exit > self.last_ts:
                self.last_ts = ev.ts_exit
            self.net.data(ev)
            t.data_event(ev)
        elif type(ev) is TokenRun:  # a streamed response's token writes, many in one
            if ev.ts[-1] > self.last_ts:
                self.last_ts = ev.ts[-1]
            self.net.token_run(ev)
            t.token_run(ev)
        elif isinstance(ev, gpu.GpuEvent):
            self.gpu.handle(ev)
            if isinstance(ev, gpu.KernelBurst):
                self.attribution.burst(ev)
            elif isinstance(ev, gpu.NcclEvent):
                self.attribution.nccl(ev)
            elif isinstance(ev, gpu.GpuSampling):
                self.attribution.sampling = self.gpu.sampling
        elif isinstance(ev, NetWait):
            self.net.netwait(ev)
        elif isinstance(ev, TlsEvent):
            self.last_ts = max(self.last_ts, ev.ts)
            t.tls_event(ev)
        elif isinstance(ev, TlsLibrary):
            self._tls_library(ev)
        elif isinstance(ev, schema.ConnEvent):
            self.last_ts = max(self.last_ts, ev.ts)
            self.net.conn(ev)
            t.conn_event(ev)
        elif isinstance(ev, schema.SocketInfo):
            t.socket_info(ev)
        elif isinstance(ev, schema.ProcEvent):
            self.last_ts = max(self.last_ts, ev.ts)
            if ev.op == C["PROC_EXIT"]:
                t.process_exit(ev.pid, ev.ts)
                self.stacks.exit(ev.pid, ev.ts, STACKS_KEPT_AFTER_EXIT_NS)
        elif isinstance(ev, stacks.StackCounts):
            self.stacks.counts(ev)
        elif isinstance(ev, stacks.StackFrames):
            self.stacks.define(ev)
            self._named = True
        elif isinstance(ev, stacks.StackSampling):
            self.stacks.enabled = True
        elif isinstance(ev, schema.ProcessInfo):
            self.ctx.processes[ev.pid] = ev
        elif isinstance(ev, schema.ClockSync):
            self.ctx.clock_offset_ns = ev.offset_ns
        elif isinstance(ev, NetTimingMode):
            self.net.set_mode(ev)
        elif isinstance(ev, schema.TracingPaused):
            self.last_ts = max(self.last_ts, ev.ts)
            self.gpu.paused(ev.ts, ev.paused)
            self.duty_cycle = ev.duty
            if ev.paused:
                t.pause(ev.ts, sampled=ev.duty > 0)
        elif isinstance(ev, schema.DropReport):
            self.last_ts = max(self.last_ts, ev.ts)
            self.ctx.drops = dict(ev.counters)
        elif isinstance(ev, RunArmed):
            t.run_armed(ev)
        self._tick()

    def _tick(self) -> None:
        """After every event: the stream's clock moves the correlators on. Then the
        time of the next thing due, so that the most frequent record (a streamed
        token's write, ``_stream_write``) moves only the clocks until then; whatever
        can bring a deadline closer (a record finished, any other event) resets it."""
        self.attribution.advance(self.last_ts)
        self.net.advance(self.last_ts)
        if self._flame_wait:
            self._release_flames()
        if self.stacks.exited:
            self.stacks.prune(self.last_ts)
        if self.last_ts >= self._next_expire:
            if self._next_expire:
                self.tracker.expire(self.last_ts)
            self._next_expire = self.last_ts + EXPIRE_EVERY_NS
        self._wake = 0 if self._flame_wait or self.stacks.exited else min(
            self.attribution.wake_ns, self.net.wake_ns, self._next_expire)

    def _tls_library(self, lib: TlsLibrary) -> None:
        """A TLS library found in a traced process: counted by what it is."""
        self.tls_libraries.append(lib)
        if lib.status == "probed":
            self.stats["tls_libraries_probed"] += 1
        else:
            self.stats["tls_libraries_not_probed"] += 1
            self.stats[f"tls_libraries_not_probed.{lib.status}"] += 1
        paths = self._tls_paths.setdefault(lib.pid, set())
        paths.add(lib.path)
        if len(paths) == 2:
            self.stats["tls_processes_with_two_libraries"] += 1

    def close(self) -> None:
        """End of the event stream: count what is still open and flush the sinks."""
        self.tracker.finish(self.last_ts)
        self.attribution.close()
        self.net.close()
        self._release_flames(final=True)
        for s in self.sinks:
            s.close()

    def gpu_threads(self) -> dict[tuple[int, int], tuple[int, int]]:
        """Per launching thread (pid, tid): launches seen and engine steps closed so
        far (``--gpu-sample auto`` decides on these, tracer/autosample.py)."""
        steps = self.attribution.step_totals
        out: dict[tuple[int, int], tuple[int, int]] = {}
        for pid, proc in self.gpu.processes.items():
            for tid, t in proc.threads.items():
                if t.kernel_launches:
                    s = steps.get((pid, tid))
                    out[(pid, tid)] = (t.kernel_launches, s.steps if s is not None else 0)
        return out

    def step_intervals(self) -> dict[tuple[int, int], int | None]:
        """Per engine step thread (pid, tid): the mean of its latest steps' intervals,
        end to end, in ns (``StepTotals.interval_ns``; ``--gpu-sample auto`` sizes its
        windows by them)."""
        return {k: s.interval_ns() for k, s in self.attribution.step_totals.items()}

    def reconciliation(self) -> dict[str, Any]:
        """Per GPU process and quantity: observed = charged to requests + unattributed,
        with GPU time and its cost over each process's window (``cost.reconcile``)."""
        from tracer.correlate.cost import Window, reconcile
        recon = self.attribution.reconciliation()
        windows: dict[int, Window] = {}
        for pid, p in self.gpu.processes.items():
            spans = [(t.first_ts, t.last_ts) for t in p.threads.values() if t.bursts]
            if spans:
                windows[pid] = Window(first=min(a for a, _ in spans),
                                      last=max(b for _, b in spans),
                                      stream_ns=sum(max(0, b - a) for a, b in spans),
                                      streams=len(spans))
        return {**recon, "cost": reconcile(recon, windows, self.pricing)}

    def report(self) -> dict[str, int]:
        """Counters worth showing a user: loss first, then volume."""
        out: dict[str, int] = {}
        for k, v in sorted(self.ctx.drops.items()):
            out[f"capture.{k}"] = v
        extra = getattr(self.ctx.identity, "stats", None) or {}
        for k, v in sorted((self.tracker.stats + self.stats + Counter(extra)
                            + self.stacks.stats).items()):
            out[k] = v
        return out

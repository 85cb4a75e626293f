"""GPU work to requests: same thread, engine steps, and across processes.

``GpuAttribution`` is fed in stream order with ``KernelBurst``s, ``NcclEvent``s and
finished ``RequestRecord``s, and decides which GPU work each request caused.

* Same thread: a burst on a thread that served exactly one request in flight (a
  synchronous server reads, computes and answers on one thread) is that request's,
  whole ("same_thread").
* Engine steps: any other burst belongs to its thread's ``StepLog`` (see
  ``tracer.correlate.steps``): an engine thread, in this process or in another one
  linked to it (``IpcGraph.serving_group``: unix sockets, loopback TCP). When a request
  is released, its steps are found by aligning its output tokens with the step ends
  (``request_range``), and each step is shared equally among the requests observably
  in it: those whose own ranges cover it, finished or still streaming ("step_share").
  Queued requests are in no step yet, so they are not charged. A request's first step
  is its prefill, the rest decode; both are reported, as child spans too.
* GPU time: a step's or burst's span from first launch to the end of its wait
  (``gpu.time_method``), shared like the launches; cost = GPU time x price.

A finished record is held until its GPU work can no longer arrive: for step sharing,
until the stream's clock passes ``end_ns + hold_ns`` (the other members' token writes
trail the steps by the engine-to-API hand-off); for same-thread work, until its process
launches a burst that starts after the record ended.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

from tracer.correlate.ipc import IpcGraph
from tracer.correlate.records import ChildSpan, RequestRecord
from tracer.correlate.steps import (MAX_STEPS, Step, StepLog, collective_offset,
                                    request_range)
from tracer.events.gpu import COPY_KINDS, KernelBurst, NcclEvent

Key = tuple[int, int, int, int]
COLLECTIVES = frozenset({"allreduce", "allgather", "reducescatter", "broadcast", "reduce"})
DEFAULT_HOLD_NS = 200_000_000  # > the burst flush interval and the API's hand-off lag
SCAN_EVERY_NS = 1_000_000  # held records are checked at most this often (stream time)
MAX_HOLD_NS = 5 * 10**9  # a trailing rank is not waited for longer than this
KEEP_RELEASED_NS = 120 * 10**9  # released records still counted as members of steps
KEEP_STEPS_NS = 600 * 10**9


class Pricing(Protocol):
    """What the correlator needs of the price configuration (``cost.GpuPricing``)."""

    def attributes(self, gpu_ms: float | None) -> dict[str, Any]: ...


@dataclass
class GpuShare:
    """What one request was charged: sums of its (shares of) bursts and steps."""

    kernel_launches: float = 0.0
    graph_launches: float = 0.0
    memcpy_bytes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COPY_KINDS, 0.0))
    sync_wait_ns: float = 0.0
    time_ns: float = 0.0
    nccl_ops: float = 0.0
    nccl_bytes: float = 0.0
    bursts: int = 0
    steps: int = 0
    prefill_launches: float = 0.0
    decode_launches: float = 0.0
    whole: bool = True  # every burst or step it was charged it had alone
    methods: set[str] = field(default_factory=set)

    def add(self, b: KernelBurst, fraction: float) -> None:
        """Charge ``fraction`` of burst ``b`` (same-thread work)."""
        self.bursts += 1
        self.kernel_launches += b.launches * fraction
        self.graph_launches += b.graph_launches * fraction
        for k in COPY_KINDS:
            self.memcpy_bytes[k] += b.copy_bytes.get(k, 0) * fraction
        self.sync_wait_ns += b.sync_wait_ns * fraction
        self.time_ns += max(0, b.last_ts - b.first_ts) * fraction
        self.whole = self.whole and fraction == 1.0
        self.methods.add("same_thread")

    def add_step(self, s: Step, fraction: float, prefill: bool, method: str,
                 rank: int = 0) -> None:
        """Charge ``fraction`` of engine step ``s`` (``method``: how its steps were
        found: "step_share" from its tokens, "time_share" from its lifetime)."""
        if rank == 0:  # other tensor-parallel ranks' steps are the same steps
            self.steps += 1
        self.bursts += s.bursts
        launches = s.launches * fraction
        self.kernel_launches += launches
        if prefill:
            self.prefill_launches += launches
        else:
            self.decode_launches += launches
        self.graph_launches += s.graph_launches * fraction
        for k in COPY_KINDS:
            self.memcpy_bytes[k] += s.copy_bytes.get(k, 0) * fraction
        self.sync_wait_ns += s.sync_wait_ns * fraction
        self.time_ns += s.span_ns * fraction
        s.charged += fraction
        self.nccl_ops += s.nccl_ops * fraction
        self.nccl_bytes += s.nccl_bytes * fraction
        self.whole = self.whole and fraction == 1.0
        self.methods.add(method)

    def attributes(self, pricing: Pricing | None) -> dict[str, Any]:
        """Attribute name suffixes (``tokentrace.<suffix>`` on the span) -> values."""

        def count(x: float) -> float | int:
            return round(x) if self.whole else round(x, 3)

        step = bool(self.methods - {"same_thread"})
        out: dict[str, Any] = {
            "gpu.kernel_launches": count(self.kernel_launches),
            "gpu.graph_launches": count(self.graph_launches),
            "gpu.sync_wait_ms": round(self.sync_wait_ns / 1e6, 3),
            "gpu.time_ms": round(self.time_ns / 1e6, 4),
            "gpu.time_method": "step_span" if step else "burst_span",
            "gpu.bursts": self.bursts,
            "gpu.attribution": ("step_share" if "step_share" in self.methods else
                                "time_share" if step else "same_thread"),
        }
        if step:
            out["gpu.steps"] = self.steps
            out["gpu.prefill_launches"] = count(self.prefill_launches)
            out["gpu.decode_launches"] = count(self.decode_launches)
        if self.nccl_ops:
            out["gpu.nccl_ops"] = count(self.nccl_ops)
            out["gpu.nccl_bytes"] = count(self.nccl_bytes)
        for k in COPY_KINDS:
            if self.memcpy_bytes[k]:
                out[f"gpu.memcpy_bytes.{k}"] = count(self.memcpy_bytes[k])
        if pricing is not None:
            out.update(pricing.attributes(self.time_ns / 1e6))
        return out


@dataclass
class _Released:
    rec: RequestRecord
    ranges: dict[tuple[int, int], tuple[int, int, str] | None] = field(default_factory=dict)


class GpuAttribution:
    """Charges bursts and steps to requests and holds records until they are due."""

    def __init__(self, emit: Callable[[RequestRecord], None],
                 open_records: Callable[[int], Iterable[RequestRecord]],
                 stats: Counter[str] | None = None, hold_ns: int = DEFAULT_HOLD_NS,
                 ipc: IpcGraph | None = None, pricing: Pricing | None = None) -> None:
        self.emit = emit
        self.open_records = open_records
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.hold_ns = hold_ns
        self.max_hold_ns = max(hold_ns, MAX_HOLD_NS)
        self.ipc = ipc or IpcGraph(self.stats)
        self.pricing = pricing
        self.held: dict[int, list[RequestRecord]] = {}
        self.shares: dict[Key, GpuShare] = {}
        self.released: dict[int, list[_Released]] = {}  # pid -> recently released
        self.released_end: dict[int, int] = {}  # pid -> latest end_ns released
        self.gpu_pids: set[int] = set()  # processes seen on the GPU
        self.logs: dict[tuple[int, int], StepLog] = {}
        self.comms: dict[tuple[int, int], tuple[int, int]] = {}  # (pid, comm) -> (id, rank)
        self.shifts: dict[tuple[tuple[int, int], tuple[int, int]],
                          tuple[int, int | None]] = {}
        self.capacity: dict[tuple[int, int], int] = {}  # log -> most requests seen in a step
        self.now = 0
        self._next_scan = 0

    # ---- GPU side -------------------------------------------------------------------

    def burst(self, b: KernelBurst) -> None:
        """A burst: taken whole by the one request on its thread, else a step's part."""
        self.stats["gpu_bursts"] += 1
        self.gpu_pids.add(b.pid)
        if self.released_end.get(b.pid, -1) >= b.first_ts:
            self.stats["gpu_bursts_late"] += 1
        mine = [r for r in self._in_flight(b.pid, b.first_ts, b.last_ts) if b.tid in r.tids]
        if len(mine) == 1:
            self._share(mine[0]).add(b, 1.0)
            self.stats["gpu_bursts_same_thread"] += 1
        else:
            log = self._log(b.pid, b.tid)
            step = log.add_burst(b)
            if step is not None:
                self._closed(log, step)
        # work its own thread did is complete once its process launches after its end
        self._release(b.pid, lambda r: r.end_ns < b.first_ts and self._served_alone(r))

    def _served_alone(self, rec: RequestRecord) -> bool:
        s = self.shares.get(rec.key)
        return s is not None and s.methods == {"same_thread"}


    def nccl(self, ev: NcclEvent) -> None:
        """An NCCL call: its bytes go with the step of its thread; a collective's
        order on its communicator is what joins tensor-parallel ranks' steps."""
        if ev.op == "comm_init":
            if ev.ret == 0:
                self.comms[(ev.pid, ev.comm)] = (ev.comm_id, ev.peer)
            return
        log = self._log(ev.pid, ev.tid)
        comm = self.comms.get((ev.pid, ev.comm))
        if comm is not None and ev.op in COLLECTIVES:
            log.comm_id, log.rank = comm
        log.add_nccl(ev)

    # ---- request side ---------------------------------------------------------------

    def finished(self, rec: RequestRecord) -> None:
        """A finished record: held until its GPU work can no longer arrive (emitted at
        once if no process it is linked to has been seen on the GPU)."""
        self.held.setdefault(rec.pid, []).append(rec)
        self._next_scan = min(self._next_scan, rec.end_ns + self.hold_ns)
        if not (self.ipc.serving_group(rec.pid) & self.gpu_pids):
            self._release(rec.pid, lambda r: True)

    def advance(self, now_ns: int) -> None:
        """The stream's clock: release records that ended more than ``hold_ns`` ago,
        once every tensor-parallel rank linked to them has reported the collectives of
        their steps (a rank can trail the one that answers), or ``max_hold_ns`` after
        their end in any case."""
        self.now = max(self.now, now_ns)
        if now_ns < self._next_scan:
            return
        self._next_scan = now_ns + SCAN_EVERY_NS
        for pid in list(self.held):
            self._release(pid, lambda r: r.end_ns + self.hold_ns <= now_ns and (
                r.end_ns + self.max_hold_ns <= now_ns or self._ranks_caught_up(r)))
            for r in self.held.get(pid, ()):
                self._next_scan = min(self._next_scan,
                                      max(r.end_ns + self.hold_ns, now_ns + SCAN_EVERY_NS))

    def _ranks_caught_up(self, rec: RequestRecord) -> bool:
        logs = self._group_logs(rec.pid)
        leaders, followers = self._ranks(rec.pid, logs)
        if not followers:
            return True
        lead = leaders[0]
        step = lead.get(lead.last_ended_by(rec.end_ns))
        while step is not None and step.signature is None and step.index > lead.base:
            step = lead.get(step.index - 1)
        if step is None or step.signature is None:
            return True
        for f in followers:
            shift = self._shift(lead, f)
            if shift is not None and f.step_of_collective(step.coll_seq + shift) is None:
                return False
        return True

    def _shift(self, lead: StepLog, f: StepLog) -> int | None:
        """``collective_offset`` of two ranks, recomputed as their sequences grow."""
        key = (lead.key, f.key)
        n = len(lead.coll_sigs) + lead.coll_base
        cached = self.shifts.get(key)
        if cached is None or n - cached[0] >= 16 or cached[1] is None:
            cached = self.shifts[key] = (n, collective_offset(lead, f))
        return cached[1]

    def close(self) -> None:
        """End of the stream: release everything held, in end order."""
        for log in self.logs.values():
            step = log.finish()
            if step is not None:
                self._closed(log, step)
        for pid in list(self.held):
            self._release(pid, lambda r: True)
        for log in self.logs.values():
            self._retire(log.prune(log.ends[-1] + 1 if log.ends else 0))

    # ---- internals ------------------------------------------------------------------

    def _log(self, pid: int, tid: int) -> StepLog:
        log = self.logs.get((pid, tid))
        if log is None:
            log = self.logs[(pid, tid)] = StepLog(pid, tid)
            self.stats["gpu_step_threads"] += 1
        return log

    def _closed(self, log: StepLog, step: Step) -> None:
        """A step of ``log`` ended: count it, and keep the log bounded."""
        self.stats["gpu_steps"] += 1
        self.stats["gpu_step_launches"] += step.launches
        if len(log.steps) > MAX_STEPS:
            self._retire(log.prune(log.steps[-MAX_STEPS].end_ts))

    def _in_flight(self, pid: int, first_ts: int, last_ts: int) -> list[RequestRecord]:
        out = [r for r in self.open_records(pid) if r.start_ns <= last_ts]
        out += [r for r in self.held.get(pid, ())
                if r.start_ns <= last_ts and r.end_ns >= first_ts]
        return out

    def _share(self, rec: RequestRecord) -> GpuShare:
        s = self.shares.get(rec.key)
        if s is None:
            s = self.shares[rec.key] = GpuShare()
        return s

    def _group_logs(self, pid: int) -> list[StepLog]:
        group = self.ipc.serving_group(pid)
        return [log for k, log in self.logs.items() if k[0] in group and log.steps]

    def _members(self, rec: RequestRecord, group: frozenset[int]
                 ) -> Iterable[tuple[RequestRecord, bool, _Released | None]]:
        """Every other request of the group that may share steps with ``rec``."""
        for pid in group:
            for r in self.held.get(pid, ()):
                if r is not rec:
                    yield r, True, None
            for rel in self.released.get(pid, ()):
                yield rel.rec, True, rel
            for r in self.open_records(pid):
                yield r, False, None

    def _charge_steps(self, rec: RequestRecord) -> _Released:
        """Share the steps ``rec`` was in; returns its ranges for later members.

        A tensor-parallel rank other than the leader is not aligned by itself: each of
        its steps is joined to the leader's step that issued the same collective (same
        place in the two ranks' collective sequences, see ``collective_offset``) and is
        shared the same way."""
        mine = _Released(rec)
        logs = self._group_logs(rec.pid)
        if not logs:
            return mine
        leaders, follower_logs = self._ranks(rec.pid, logs)
        followers = [(f, self._shift(leaders[0], f)) for f in follower_logs]
        others = list(self._members(rec, self.ipc.serving_group(rec.pid)))
        primary: tuple[StepLog, int, int, int] | None = None
        for log in logs:
            if log in follower_logs:
                continue
            rng = request_range(rec, log, finished=True)
            if rng is None:
                mine.ranges[log.key] = None
                continue
            first, last, how = rng
            self.stats[f"gpu_step_ranges_{how}"] += 1
            ranges = self._ranges(rec, first, last, how, log, others)
            begin = ranges[0][0]
            mine.ranges[log.key] = (begin, last, how)
            fractions = self._fractions(begin, last, ranges[1:])
            method = "time_share" if how == "time" else "step_share"
            share = self._share(rec)
            for i, frac in zip(range(begin, last + 1), fractions):
                step = log.get(i)
                if step is None:
                    self.stats["gpu_steps_missing"] += 1
                    continue
                prefill = how != "time" and i <= first
                share.add_step(step, frac, prefill=prefill, method=method)
                self.stats["gpu_step_launches_charged"] += step.launches * frac
                if log in leaders and step.signature is not None:
                    for f, shift in followers:
                        fstep = (f.step_of_collective(step.coll_seq + shift)
                                 if shift is not None else None)
                        if fstep is None or fstep.signature != step.signature:
                            self.stats["gpu_steps_unjoined"] += 1
                            continue
                        share.add_step(fstep, frac, prefill=prefill, method=method,
                                       rank=f.rank or 1)
                        self.stats["gpu_steps_joined_nccl"] += 1
                        self.stats["gpu_step_launches_charged"] += fstep.launches * frac
            if primary is None or last - begin > primary[3] - primary[1]:
                primary = (log, begin, first, last)
        if primary is not None:
            self._phases(rec, *primary)
        return mine

    def _ranges(self, rec: RequestRecord, first: int, last: int, how: str, log: StepLog,
                others: list[tuple[RequestRecord, bool, _Released | None]]
                ) -> list[tuple[int, int]]:
        """Step ranges on ``log`` of ``rec`` (first) and of the others that overlap it,
        each widened back over its prefill.

        A request's tokens show the step of its first token; a long prompt's prefill
        (chunked) began steps earlier, without a trace outside the process. A request
        that had arrived is taken to be prefilling in every step before its first
        token that had a free slot, i.e. fewer token-emitting requests than the most
        this engine was ever seen to run at once (its batch capacity); in a full step
        it was queued, and queued requests are not charged."""
        spans: list[tuple[int, int, int, bool]] = []  # (arrival step, first, last, tokens)
        own_lower = log.first_started_after(rec.request_end_ns or rec.start_ns)
        spans.append((own_lower, first, last, how != "time", rec.request_end_ns or rec.start_ns))
        for r, finished, rel in others:
            if rel is not None and log.key in rel.ranges:
                orng = rel.ranges[log.key]
                if orng is not None:
                    spans.append((orng[0], orng[0], orng[1], False, 0))  # already widened
                continue
            orng = request_range(r, log, finished=finished)
            if orng is None or orng[1] < own_lower:
                continue
            lower = log.first_started_after(r.request_end_ns or r.start_ns)
            spans.append((lower, orng[0], orng[1], orng[2] != "time",
                          r.request_end_ns or r.start_ns))
        lo = min(x[0] for x in spans)
        hi = max(last, max(x[1] for x in spans))
        emitting = [0] * (hi - lo + 2)
        for _, f, la, _tok, _arr in spans:
            if la >= lo:
                emitting[max(f, lo) - lo] += 1
                emitting[min(la, hi) - lo + 1] -= 1
        counts, n = [], 0
        for d in emitting[:-1]:
            n += d
            counts.append(n)
        cap = self.capacity[log.key] = max(self.capacity.get(log.key, 1), max(counts))
        # first come, first served: earlier arrivals take the free slots first, and a
        # prefilling request holds its slot like an emitting one
        out = [(f, la) for _, f, la, _tok, _arr in spans]
        for i in sorted(range(len(spans)), key=lambda i: spans[i][4]):
            lower, f, la, tokens, _ = spans[i]
            if not tokens:
                continue
            a = f
            while a - 1 >= max(lower, lo) and counts[a - 1 - lo] < cap:
                a -= 1
            for j in range(a, f):
                counts[j - lo] += 1
            out[i] = (a, la)
        return out

    def _ranks(self, pid: int, logs: list[StepLog]) -> tuple[list[StepLog], list[StepLog]]:
        """Tensor-parallel leaders (rank 0) and the other ranks among ``logs``.

        Ranks are known from communicator init when the tracer saw it; otherwise the
        rank whose process talks to the request's process (or is it) leads, and the
        other logs that run collectives follow."""
        coll = [lg for lg in logs if lg.has_collectives]
        if len(coll) < 2:
            return [], []
        leaders = [lg for lg in coll if lg.rank == 0]
        if not leaders:
            near = {pid} | (set(self.ipc.graph.neighbors(pid)) if pid in self.ipc.graph else set())
            leaders = [lg for lg in coll if lg.pid in near][:1]
        if not leaders:
            return [], []
        return leaders, [lg for lg in coll if lg not in leaders]

    @staticmethod
    def _fractions(first: int, last: int, others: list[tuple[int, int]]) -> list[float]:
        """For each step first..last: 1 / (requests in it), counting this one."""
        sharers = [0] * (last - first + 2)
        for ofirst, olast in others:
            if olast < first or ofirst > last:
                continue
            sharers[max(ofirst, first) - first] += 1
            sharers[min(olast, last) - first + 1] -= 1
        out, n = [], 0
        for i in range(last - first + 1):
            n += sharers[i]
            out.append(1.0 / (n + 1))
        return out

    def _phases(self, rec: RequestRecord, log: StepLog, begin: int, first: int,
                last: int) -> None:
        """Queue, prefill and decode child spans from the request's steps and tokens."""
        s0, s1 = log.get(begin), log.get(first)
        if s0 is None or s1 is None:
            return
        arrival = rec.request_end_ns or rec.start_ns
        r = rec.llm_response
        first_token = (r.first_token_ts if r is not None and r.first_token_ts else s1.end_ts)
        last_token = (r.token_ts[-1] if r is not None and r.token_ts else rec.end_ns)
        share = self.shares.get(rec.key)
        if s0.first_ts > arrival:
            rec.children.append(ChildSpan("queue", arrival, s0.first_ts,
                                          {"tokentrace.phase": "queue"}))
        rec.children.append(ChildSpan("prefill", s0.first_ts, max(first_token, s1.end_ts), {
            "tokentrace.phase": "prefill",
            "tokentrace.gpu.steps": first - begin + 1,
            "tokentrace.gpu.kernel_launches": round(share.prefill_launches, 3) if share else None,
        }))
        if last > first and last_token > first_token:
            rec.children.append(ChildSpan("decode", first_token, last_token, {
                "tokentrace.phase": "decode",
                "tokentrace.gpu.steps": last - first,
                "tokentrace.gpu.kernel_launches":
                    round(share.decode_launches, 3) if share else None,
            }))

    def _release(self, pid: int, due: Callable[[RequestRecord], bool]) -> None:
        held = self.held.get(pid)
        if not held:
            return
        for rec in sorted(held, key=lambda r: r.end_ns):
            if not due(rec):
                continue
            held.remove(rec)  # from here on it is a released member, not a held one
            rel = self._charge_steps(rec)
            share = self.shares.pop(rec.key, None)
            if share is not None:
                rec.gpu.update(share.attributes(self.pricing))
            self.released_end[pid] = max(self.released_end.get(pid, 0), rec.end_ns)
            self.released.setdefault(pid, []).append(rel)
            self.emit(rec)
        if not held:
            del self.held[pid]
        self._forget(pid)

    def _retire(self, steps: list[Step]) -> None:
        """Steps forgotten: count those no request was charged."""
        for st in steps:
            if st.charged == 0:
                self.stats["gpu_steps_unattributed"] += 1
                self.stats["gpu_launches_unattributed"] += st.launches

    def _forget(self, pid: int) -> None:
        """Drop released records and steps too old to matter."""
        rel = self.released.get(pid)
        if rel and rel[0].rec.end_ns + KEEP_RELEASED_NS < self.now:
            self.released[pid] = [x for x in rel if x.rec.end_ns + KEEP_RELEASED_NS >= self.now]
        if self.now > KEEP_STEPS_NS:
            for log in self.logs.values():
                if log.pid == pid and log.steps and log.ends[0] < self.now - KEEP_STEPS_NS:
                    self._retire(log.prune(self.now - KEEP_STEPS_NS))

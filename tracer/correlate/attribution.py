"""GPU work to requests: the correlator's driver, from bursts to charged records.

``GpuAttribution`` is fed in stream order with ``KernelBurst``s, ``NcclEvent``s and
finished ``RequestRecord``s. Work flows one way:

1. bursts -> engine steps (``steps.StepLog``): a burst on a thread that served exactly
   one request in flight is that request's, whole ("same_thread": a synchronous server
   reads, computes and answers on one thread); any other burst joins its thread's steps.
2. finished requests -> step membership (``membership``): once a request's last token
   is in (``hold_ns`` after its end), its tokens are aligned with the steps of every
   engine thread of its process group (``IpcGraph.serving_group``), an ``Occupancy``.
3. steps are *settled* in order, each once, when no request that could still be in it
   is unfinished: then its members are final (``Membership.members``) and its work is
   split among them by what each made it cost (``costmodel``: a fixed part shared
   equally plus each member's marginal part, learned online from the engine's own
   steps; equal shares while the model is not trusted). A step with no members is left
   unattributed. Tensor-parallel ranks' steps are joined to rank 0's through their
   collectives (``steps.collective_offset``) and split the same way.
4. a record is released, with its charges as span attributes and queue/prefill/decode
   child spans, when every step it was in is settled.

Every amount is booked once in the ``Ledger``: observed when a step closes (or a
same-thread burst arrives), then charged or left unattributed, so charged plus
unattributed equals observed for every process and quantity.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Callable, Iterable, Protocol

from tracer.correlate.arrivals import Arrivals
from tracer.correlate.costmodel import Learner, StepModel, split_fractions
from tracer.correlate.ipc import IpcGraph
from tracer.correlate.ledger import (
    EVICTED,
    NO_REQUEST,
    UNJOINED_RANK,
    Ledger,
    estimated_quantities,
)
from tracer.correlate.membership import (Membership, Occupancy, StepMembers, arrival_ns,
                                         request_range)
from tracer.correlate.records import ChildSpan, RequestRecord
from tracer.correlate.sampling import LaunchSampling, StepEstimates
from tracer.correlate.stacks import Flame, StackBook, burst_units, step_units
from tracer.correlate.steps import MAX_STEPS, Step, StepLog, StepTotals, collective_offset
from tracer.correlate.tally import Run, Tally
from tracer.correlate.work import KERNEL_QUANTITIES, Work
from tracer.events.gpu import COPY_KINDS, KernelBurst, NcclEvent

Key = tuple[int, int, int, int]
LogKey = tuple[int, int]
COLLECTIVES = frozenset({"allreduce", "allgather", "reducescatter", "broadcast", "reduce"})
DEFAULT_HOLD_NS = 200_000_000  # > the burst flush interval and the API's hand-off lag
SCAN_EVERY_NS = 1_000_000  # held records and steps are looked at most this often
MAX_HOLD_NS = 5 * 10**9  # a trailing rank is not waited for longer than this
# A step is settled at the latest this long after it ended, even if a request that
# may have been in it is still running (a stream can last minutes): that request is
# then counted in by the tokens it has written so far.
MAX_SETTLE_LAG_NS = 60 * 10**9
KEEP_SETTLED_NS = 10 * 10**9  # settled steps kept for requests that arrived before them
MAX_PENDING_NS = 10 * 10**9  # decided steps wait this long for a usable model...
# ...then take a provisional one (fitted on fewer steps), or wait for one up to this
MAX_PENDING_HARD_NS = 60 * 10**9
TOP_KERNELS = 5  # kernels named on a span, by its share of their launches
# requests whose steps tell --gpu-sample auto how many steps a request is in (the
# memsets' error over runs that long: tracer/correlate/sampling.py RUN_LENGTHS), and
# how many must have been released before it is told
REQUEST_STEPS_HISTORY = 256
REQUEST_STEPS_MIN = 8


class Pricing(Protocol):
    """What the correlator needs of the price configuration (``cost.GpuPricing``)."""

    def attributes(self, gpu_ms: float | None) -> dict[str, Any]: ...


@dataclass
class GpuShare:
    """What one request was charged: sums of its (shares of) bursts and steps.

    A request is a member of hundreds of steps, each split among dozens of members: a
    step's part is only noted when the step is split (``add_part``) and folded into the
    sums when they are read (``fold``), in the same order, so the sums are the same."""

    work: Work = field(default_factory=Work)
    bursts: int = 0
    steps: int = 0
    steps_estimated: int = 0  # --gpu-sample: steps whose launches and span are estimates
    prefill_launches: float = 0.0
    decode_launches: float = 0.0
    whole: bool = True  # every burst or step it was charged it had alone
    methods: set[str] = field(default_factory=set)
    models: set[str] = field(default_factory=set)
    kernels: dict[tuple[int, int], float] = field(default_factory=dict)  # (pid, handle)
    flame: Flame | None = None  # its share of the launch-site stacks (stacks.py)
    # steps' parts not yet folded in: (step, launch fraction, time fraction, prefill, rank)
    parts: list[tuple[Step, float, float, bool, int]] = field(default_factory=list)
    # its decoding steps, as runs of each log's running sums (tally.py): the open run
    # per log, and runs a gap ended
    runs: dict[LogKey, Run] = field(default_factory=dict)
    ended: list[Run] = field(default_factory=list)

    def add_flame(self, flame: Flame, calls: float, time: float) -> None:
        if self.flame is None:
            self.flame = Flame()
        self.flame.add(flame, calls, time)

    def add_burst(self, work: Work, pid: int, kernels: dict[int, int]) -> None:
        """A burst of its own thread, whole (same-thread work)."""
        self.fold()
        self.bursts += 1
        self.work.add(work)
        self.methods.add("same_thread")
        self._add_kernels(pid, kernels, 1.0)

    def _add_kernels(self, pid: int, kernels: dict[int, int], fraction: float) -> None:
        for h, n in kernels.items():
            self.kernels[(pid, h)] = self.kernels.get((pid, h), 0.0) + n * fraction

    def add_part(self, step: Step, fk: float, ft: float, whole: bool, prefill: bool,
                 method: str, rank: int = 0) -> None:
        """Its part of engine step ``step``: ``fk`` of its launches (graph launches
        too), ``ft`` of the rest (time, bytes, collectives)."""
        self.parts.append((step, fk, ft, prefill, rank))
        self.whole = self.whole and whole
        self.methods.add(method)

    def fold(self) -> None:
        """Add the parts noted since the last fold to the sums (a request's share of
        each of its steps: one part per decode step, so this loop is per token)."""
        if self.runs:
            self._fold_runs()
        if not self.parts:
            return
        work = self.work
        mixes: dict[tuple[int, tuple[tuple[int, int], ...]], float] = {}
        steps = estimated = bursts = 0
        prefill_launches = decode_launches = 0.0
        for step, fk, ft, prefill, rank in self.parts:
            _, _, kl, nl, mix_key = step._settled or step.settled_work()
            step.add_share(work, fk, ft)
            launches = kl * fk
            if nl:
                mixes[mix_key] = mixes.get(mix_key, 0.0) + launches / nl
            if step.flame is not None:  # its stacks' share (attribution._step_flame)
                self.add_flame(step.flame, fk, ft)  # type: ignore[arg-type]
            if rank == 0:  # other tensor-parallel ranks' steps are the same steps
                steps += 1
                estimated += step.estimated
            bursts += step.bursts
            if prefill:
                prefill_launches += launches
            else:
                decode_launches += launches
        self.steps += steps
        self.steps_estimated += estimated
        self.bursts += bursts
        self.prefill_launches += prefill_launches
        self.decode_launches += decode_launches
        self.parts = []
        for (pid, mix), f in mixes.items():  # each step's kernels times its share, summed
            self._add_kernels(pid, dict(mix), f)

    def _fold_runs(self) -> None:
        for run in [*self.ended, *self.runs.values()]:
            launches, steps, estimated, bursts = run.fold_into(self.work, self.kernels)
            self.decode_launches += launches
            self.steps += steps
            self.steps_estimated += estimated
            self.bursts += bursts
        self.ended = []

    def attributes(self, pricing: Pricing | None,
                   kernel_name: Callable[[int, int], str] | None = None) -> dict[str, Any]:
        """Attribute name suffixes (``tokentrace.<suffix>`` on the span) -> values.
        ``kernel_name(pid, handle)``: a readable kernel name, for ``gpu.top_kernels``."""

        self.fold()

        def count(x: float) -> float | int:
            return round(x) if self.whole else round(x, 3)

        w = self.work
        step = bool(self.methods - {"same_thread"})
        method = next((m for m in ("step_model", "step_equal", "time_share")
                       if m in self.methods), "same_thread")
        out: dict[str, Any] = {
            "gpu.kernel_launches": count(w.get("kernel_launches", 0.0)),
            "gpu.graph_launches": count(w.get("graph_launches", 0.0)),
            "gpu.sync_wait_ms": round(w.get("sync_wait_ns", 0.0) / 1e6, 3),
            "gpu.time_ms": round(w.get("gpu_time_ns", 0.0) / 1e6, 4),
            "gpu.time_method": "step_span" if step else "burst_span",
            "gpu.bursts": self.bursts,
            "gpu.attribution": method,
        }
        if step:
            out["gpu.steps"] = self.steps
            if self.steps_estimated:
                out["gpu.steps_estimated"] = self.steps_estimated
            out["gpu.prefill_launches"] = count(self.prefill_launches)
            out["gpu.decode_launches"] = count(self.decode_launches)
        if self.models:
            out["gpu.cost_model"] = "; ".join(sorted(self.models))
        if w.get("nccl_ops"):
            out["gpu.nccl_ops"] = count(w["nccl_ops"])
            out["gpu.nccl_bytes"] = count(w.get("nccl_bytes", 0.0))
        for k in COPY_KINDS:
            if w.get(f"memcpy_bytes.{k}"):
                out[f"gpu.memcpy_bytes.{k}"] = count(w[f"memcpy_bytes.{k}"])
        if w.get("memset_bytes"):
            out["gpu.memset_bytes"] = count(w["memset_bytes"])
        if pricing is not None:
            out.update(pricing.attributes(w.get("gpu_time_ns", 0.0) / 1e6))
        kernels = self.kernels
        if kernel_name is not None and kernels:
            by_name: dict[str, float] = {}
            for (pid, h), n in kernels.items():
                name = kernel_name(pid, h)
                by_name[name] = by_name.get(name, 0.0) + n
            top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
            out["gpu.top_kernels"] = [f"{name}: {count(n)}" for name, n in top]
        return out


@dataclass
class _Ready:
    """A finished request whose occupancies are known, waiting for its steps to settle."""

    rec: RequestRecord
    logs: list[LogKey] = field(default_factory=list)
    seq: int = 0  # order of becoming ready (ties in end order are released in it)


def models_for(kernel: Learner, time: Learner, waited_ns: int, now: bool
               ) -> tuple[StepModel, StepModel, bool] | None:
    """The (launch, time) models to split steps with that have waited ``waited_ns`` for
    usable ones, and whether one is provisional; None: wait longer. ``now``: the
    stream ends or a step is forced, so no more waiting.

    Usable models are used at once. Otherwise steps wait up to MAX_PENDING_NS; then a
    learner that has not had its full fit yet (an engine whose first steps take seconds)
    offers a model fitted on the steps so far, and the steps wait for one that passes
    the fit tests up to MAX_PENDING_HARD_NS. A learner whose full fit found no usable
    model is not waited for: equal shares."""
    kmodel, tmodel = kernel.model, time.model
    if kmodel.usable and tmodel.usable:
        return kmodel, tmodel, False
    if not now and waited_ns < MAX_PENDING_NS:
        return None
    kp = None if kernel.fitted else kernel.provisional()
    tp = None if time.fitted else time.provisional()
    young = [m for m in (kp, tp) if m is not None]
    if not now and waited_ns < MAX_PENDING_HARD_NS and not all(m.usable for m in young):
        return None
    return (kp if kp is not None and kp.usable else kmodel,
            tp if tp is not None and tp.usable else tmodel,
            any(m.usable for m in young))


class GpuAttribution:
    """Charges bursts and steps to requests and holds records until they are due."""

    def __init__(self, emit: Callable[[RequestRecord], None],
                 open_records: Callable[[int], Iterable[RequestRecord]],
                 stats: Counter[str] | None = None, hold_ns: int = DEFAULT_HOLD_NS,
                 ipc: IpcGraph | None = None, pricing: Pricing | None = None,
                 kernel_name: Callable[[int, int], str] | None = None,
                 stacks: StackBook | None = None,
                 open_check: Callable[[RequestRecord], bool] | None = None,
                 serves: Callable[[int, int], bool] | None = None,
                 earliest_open: Callable[[int], RequestRecord | None] | None = None
                 ) -> None:
        """``open_records(pid)``: the requests of ``pid`` still being served;
        ``open_check(rec)``: whether ``rec`` is one (default: looked for among them);
        ``earliest_open(pid)``: the one that arrived first (default: looked for);
        ``serves(pid, tid)``: whether that thread ever moved a request's bytes, i.e.
        could be among a request's ``tids`` (default: looked for in each)."""
        self.emit = emit
        self.stacks = stacks  # launch-site stacks, joined to bursts and steps
        self.kernel_name = kernel_name
        self.open_records = open_records
        self.stats: Counter[str] = stats if stats is not None else Counter()
        self.hold_ns = hold_ns
        self.max_hold_ns = max(hold_ns, MAX_HOLD_NS)
        self.ipc = ipc or IpcGraph(self.stats)
        self.pricing = pricing
        self.ledger = Ledger()
        # pid -> finished records whose tokens may not all be in yet, by key
        self.held: dict[int, dict[Key, RequestRecord]] = {}
        self.ready: dict[Key, _Ready] = {}
        self.shares: dict[Key, GpuShare] = {}
        self.tallies: dict[LogKey, Tally] = {}  # decoding members' running sums per log
        self.released_end: dict[int, int] = {}  # pid -> latest end_ns released
        self.gpu_pids: set[int] = set()  # processes seen on the GPU
        # the engine steps each of the latest requests released was in
        self.request_steps: deque[int] = deque(maxlen=REQUEST_STEPS_HISTORY)
        self.request_pids: set[int] = set()  # processes that answered requests
        self.logs: dict[LogKey, StepLog] = {}
        self.members: dict[LogKey, Membership] = {}
        self.learners: dict[LogKey, tuple[Learner, Learner]] = {}
        self.decided: dict[LogKey, int] = {}  # log -> next step whose members to decide
        self.pending: dict[LogKey, list[Any]] = {}  # decided, not yet split
        self.settled: dict[LogKey, int] = {}  # log -> steps before this are split
        self.comms: dict[tuple[int, int], tuple[int, int]] = {}  # (pid, comm) -> (id, rank)
        self.shifts: dict[tuple[LogKey, LogKey], tuple[int, int | None]] = {}
        self.now = 0
        self._next_scan = 0
        # held records by when their hold ends: (end + hold_ns, order held, record)
        self._held_due: list[tuple[int, int, RequestRecord]] = []
        self._held_seq = itertools.count()
        self._alone_pids: set[int] = set()  # processes with a burst charged same-thread
        self._held_arrivals = Arrivals(  # held records by arrival
            self._is_held, lambda pid: list(self.held.get(pid, {}).values()))
        self._recheck: set[Key] = set()  # ready records that may have become due
        self._waits: dict[LogKey, list[tuple[int, int, Key]]] = {}  # (last step, seq, key)
        self._ready_seq = 0
        # per process group: the request that was its frontier when last computed
        self._frontier_rec: dict[frozenset[int], RequestRecord | None] = {}
        self._open_check = open_check
        self._earliest_open = earliest_open or (
            lambda pid: min(self.open_records(pid), key=arrival_ns, default=None))
        self._serves = serves
        # --gpu-sample: the launch probes' switches (set by the pipeline from the
        # GpuLedger's), and the estimates for steps they did not see whole
        self.sampling: LaunchSampling | None = None
        self.estimates = StepEstimates()
        self._prev_end: dict[LogKey, int] = {}  # each log's last closed step's end
        # per thread, its steps' launches as booked, and the threads that also had
        # bursts taken whole by one request (GpuLedger.summary reads both)
        self.step_totals: defaultdict[LogKey, StepTotals] = defaultdict(StepTotals)
        self.same_thread: set[LogKey] = set()

    # ---- GPU side -------------------------------------------------------------------

    def burst(self, b: KernelBurst) -> None:
        """A burst: taken whole by the one request on its thread, else a step's part."""
        self.stats["gpu_bursts"] += 1
        self.gpu_pids.add(b.pid)
        if self.released_end.get(b.pid, -1) >= b.first_ts:
            self.stats["gpu_bursts_late"] += 1
        book = self.stacks
        samples = book.take(b) if book is not None and book.pending else None
        if self._serves is not None and not self._serves(b.pid, b.tid):
            mine = []  # a thread that never moved a request's bytes (an engine's)
        else:
            mine = [r for r in self._in_flight(b.pid, b.first_ts, b.last_ts) if b.tid in r.tids]
        if len(mine) == 1:
            work = Work.of_burst(b)
            self.ledger.observe(b.pid, work)
            self.ledger.charge(b.pid, work)
            share = self._share(mine[0])
            share.add_burst(work, b.pid, b.handle_counts)
            if book is not None and (samples or book.sampled(b.pid)):
                share.add_flame(book.weights(b.pid, burst_units(b), samples or Counter(),
                                             work.get("gpu_time_ns", 0.0)), 1.0, 1.0)
            self.stats["gpu_bursts_same_thread"] += 1
            self.same_thread.add((b.pid, b.tid))
            self._alone_pids.add(b.pid)
        else:
            log = self._log(b.pid, b.tid)
            step = log.add_burst(b, samples)
            if step is not None:
                self._closed(log, step)
        # work its own thread did is complete once its process launches after its end
        done = [r for r in self.held.get(b.pid, {}).values()
                if r.end_ns < b.first_ts and self._served_alone(r)] \
            if b.pid in self._alone_pids else []
        for r in done:
            self._ready(r)
        if done:
            self._release_due()

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
        self.request_pids.add(rec.pid)
        if not (self.ipc.serving_group(rec.pid) & self.gpu_pids):
            share = self.shares.pop(rec.key, None)
            if share is not None:
                rec.gpu.update(share.attributes(self.pricing, self.kernel_name))
                rec.flame = share.flame
            self.emit(rec)
            return
        self.held.setdefault(rec.pid, {})[rec.key] = rec
        due = rec.end_ns + self.hold_ns
        heapq.heappush(self._held_due, (due, next(self._held_seq), rec))
        self._held_arrivals.add(rec)
        self._next_scan = min(self._next_scan, due)

    def typical_request_steps(self) -> float | None:
        """The median of the engine steps the latest requests released were each in
        (None before ``REQUEST_STEPS_MIN`` of them)."""
        if len(self.request_steps) < REQUEST_STEPS_MIN:
            return None
        return float(median(self.request_steps))

    @property
    def wake_ns(self) -> int:
        """Before this stream time ``advance`` only notes the time."""
        return self._next_scan

    def advance(self, now_ns: int) -> None:
        """The stream's clock: records whose tokens are all in become members of their
        steps, steps whose members are final are settled, records whose steps are all
        settled are released."""
        self.now = max(self.now, now_ns)
        if now_ns < self._next_scan:
            return
        self._next_scan = now_ns + SCAN_EVERY_NS
        # held records past their hold, in the order they are held in (by process,
        # then as they finished); one whose trailing ranks are yet to catch up is
        # looked at again next time
        due: list[tuple[int, RequestRecord]] = []
        heap = self._held_due
        while heap and heap[0][0] <= now_ns:
            _, seq, r = heapq.heappop(heap)
            held = self.held.get(r.pid)
            if held is not None and held.get(r.key) is r:
                due.append((seq, r))
        if due:
            order = {pid: i for i, pid in enumerate(self.held)}
            due.sort(key=lambda e: (order[e[1].pid], e[0]))
        for seq, r in due:
            if r.end_ns + self.max_hold_ns <= now_ns or self._ranks_caught_up(r):
                self._ready(r)
            else:
                heapq.heappush(heap, (now_ns + SCAN_EVERY_NS, seq, r))
        self._settle_all(force_before=now_ns - MAX_SETTLE_LAG_NS)
        self._release_due()

    def close(self) -> None:
        """End of the stream: settle and release everything, in order."""
        for log in self.logs.values():
            step = log.finish()
            if step is not None:
                self._closed(log, step)
        for pid in list(self.held):
            for r in sorted(self.held.get(pid, {}).values(), key=lambda r: r.end_ns):
                self._ready(r)
        self._settle_all(force_before=None, final=True)
        self._release_due(final=True)
        for log in self.logs.values():
            self._retire(log, log.prune(log.ends[-1] + 1 if log.ends else 0))

    def reconciliation(self) -> dict[str, Any]:
        """Per GPU process: observed = charged + unattributed, per quantity."""
        return self.ledger.reconciliation()

    # ---- steps ----------------------------------------------------------------------

    def _log(self, pid: int, tid: int) -> StepLog:
        log = self.logs.get((pid, tid))
        if log is None:
            log = self.logs[(pid, tid)] = StepLog(pid, tid)
            self.members[log.key] = Membership(log)
            self.learners[log.key] = (Learner(), Learner())
            self.settled[log.key] = self.decided[log.key] = 0
            self.pending[log.key] = []
            self.stats["gpu_step_threads"] += 1
        return log

    def _closed(self, log: StepLog, step: Step) -> None:
        """A step of ``log`` ended: book it, and keep the log bounded."""
        self.stats["gpu_steps"] += 1
        prev_end = self._prev_end.get(log.key)
        self._prev_end[log.key] = step.end_ts
        if self.sampling is not None:
            self._sampled(step, prev_end, self.sampling)
        else:  # every launch counted: the step is its shape's reference for a later
            # --gpu-sample (auto's switch, or ctl's), which then estimates from its start
            self._learn(step, prev_end)
        self.step_totals[log.key].book(step, prev_end)
        self.stats["gpu_step_launches"] += step.launches
        self.ledger.observe(step.pid, step.work, estimated=step.estimated,
                            copies_estimated=step.copies_estimated,
                            memsets_estimated=step.memsets_estimated)
        if len(log.steps) > MAX_STEPS:
            self._retire(log, log.prune(log.steps[-MAX_STEPS].end_ts))

    def _sampled(self, step: Step, prev_end: int | None, sampling: LaunchSampling) -> None:
        """--gpu-sample: a step whose launches were all counted becomes its shape's
        reference; any other takes its estimates from one."""
        start = step.first_ts if prev_end is None else prev_end
        if sampling.counted(start, step.end_ts):  # as counted, if not a reference
            self._learn(step, prev_end)
            self.stats["gpu_steps_counted"] += 1
        elif self.estimates.fill(step, prev_end, sampling.copies_at(step.end_ts),
                                 sampling.memsets_at(step.end_ts)):
            self.stats["gpu_steps_estimated"] += 1
        else:  # no reference yet: tried again when its members are decided
            step.unestimated_after = start
            self.stats["gpu_steps_unestimated"] += 1

    def _learn(self, step: Step, prev_end: int | None) -> None:
        """``step`` was counted whole: its shape's reference from now on, unless its
        end went unseen (``Step.end_unseen``). Inside a counted span that is a step whose
        result copy came just before an off switch and its sync just after, or one cut
        at a pause: learnt, the first would teach its shape no sync, and every step of
        that shape in the off window would take none (7% of the syncs short in one
        test run); the second, fewer launches than its shape makes. Either keeps its
        own counts."""
        if step.end_unseen:
            self.stats["gpu_steps_end_unseen"] += 1
            return
        if self.estimates.learn(step, prev_end):
            self.stats["gpu_step_gaps_idle"] += 1

    def _estimate_late(self, step: Step) -> None:
        """A step closed before its thread had a step counted whole: estimated now if
        one has been since, the difference booked as observed."""
        copies = self.sampling is not None and self.sampling.copies_at(step.end_ts)
        memsets = self.sampling is not None and self.sampling.memsets_at(step.end_ts)
        quantities = estimated_quantities(copies, memsets)
        seen = Work({q: step.work.get(q, 0.0) for q in quantities})
        seen_counts = step.counts()  # fill() gives the step a new Counter of kernels
        if not self.estimates.fill(step, step.unestimated_after, copies, memsets):
            return
        self.step_totals[(step.pid, step.tid)].revise(step, seen_counts)
        step.unestimated_after = None
        estimate = Work({q: step.work.get(q, 0.0) for q in quantities})
        self.ledger.revise(step.pid, seen, estimate)
        self.stats["gpu_step_launches"] += step.launches - seen_counts.launches
        self.stats["gpu_steps_unestimated"] -= 1
        self.stats["gpu_steps_estimated_late"] += 1

    def _retire(self, log: StepLog, steps: list[Step]) -> None:
        """Steps forgotten: those never settled are left unattributed."""
        follower = self._is_follower(log)
        for st in steps:
            if st.settled:
                continue
            st.settled = True
            self._left_flame(st)
            reason = UNJOINED_RANK if follower else EVICTED
            self.ledger.leave(st.pid, reason, st.work)
            self.stats["gpu_steps_unattributed"] += 1
            self.stats["gpu_launches_unattributed"] += st.launches
        self._settled_to(log.key, max(self.settled[log.key], log.base))
        self.decided[log.key] = max(self.decided[log.key], log.base)

    def _is_follower(self, log: StepLog) -> bool:
        return log in self._group_ranks(self.ipc.serving_group(log.pid))[1]

    def _group_ranks(self, group: frozenset[int]) -> tuple[list[StepLog], list[StepLog]]:
        """``_ranks`` of a process group, led from a process that answered requests."""
        logs = [lg for lg in self.logs.values() if lg.pid in group and lg.steps]
        for pid in sorted(group & self.request_pids):
            leaders, followers = self._ranks(pid, logs)
            if leaders:
                return leaders, followers
        return [], []

    def _settle_all(self, force_before: int | None, final: bool = False) -> None:
        """Settle every log's steps as far as their members are final."""
        frontiers: dict[frozenset[int], int | None] = {}
        for log in list(self.logs.values()):
            first = log.get(max(self.decided[log.key], log.base))
            if first is None and not self.pending[log.key]:
                continue  # no closed step to decide, none waiting to be split
            group = self.ipc.serving_group(log.pid)
            leaders, followers = self._group_ranks(group)
            if log in followers:
                continue
            if final:
                frontier = None
            elif group in frontiers:
                frontier = frontiers[group]
            else:
                frontier = self._blocked(group, first, force_before)
                if frontier is None:
                    frontier = frontiers[group] = self._frontier(group)
            self._settle(log, frontier, force_before,
                         [(f, self._shift(leaders[0], f)) for f in followers] if leaders else [],
                         final)

    def _blocked(self, group: frozenset[int], first: Step | None, force_before: int | None
                 ) -> int | None:
        """The arrival of a request of ``group`` still unfinished that arrived no later
        than step ``first`` started, if the last frontier's request is one: then the
        frontier (which is no later) stops ``first`` too, and ``_settle`` does exactly
        what it would with it, without looking at every open request. None: compute it."""
        rec = self._frontier_rec.get(group)
        if (rec is None or first is None
                or (force_before is not None and first.end_ts < force_before)):
            return None
        if rec.end_ns:  # finished: a frontier while it is held
            held = self.held.get(rec.pid)
            if held is None or held.get(rec.key) is not rec:
                return None
        elif not self._still_open(rec):
            return None
        a = arrival_ns(rec)
        return a if a <= first.first_ts else None

    def _is_held(self, rec: RequestRecord) -> bool:
        held = self.held.get(rec.pid)
        return held is not None and held.get(rec.key) is rec

    def _still_open(self, rec: RequestRecord) -> bool:
        return any(r is rec for r in self.open_records(rec.pid)) if self._open_check is None \
            else self._open_check(rec)

    def _frontier(self, group: frozenset[int]) -> int | None:
        """The earliest arrival of a request of ``group`` that is not yet a member of its
        steps (still open, or its last tokens may still come): steps that started before
        it can be settled. None: no such request."""
        out: int | None = None
        at: RequestRecord | None = None
        for pid in group:
            r = self._earliest_open(pid)
            if r is not None:
                a = arrival_ns(r)
                if out is None or a < out:
                    out, at = a, r
            r = self._held_arrivals.earliest(pid)
            if r is not None:
                a = arrival_ns(r)
                if out is None or a < out:
                    out, at = a, r
        self._frontier_rec[group] = at
        return out

    def _settle(self, log: StepLog, frontier: int | None, force_before: int | None,
                followers: list[tuple[StepLog, int | None]], final: bool) -> None:
        """Decide the members of ``log``'s steps in order, as far as they are final,
        then split the decided steps among them."""
        i = max(self.decided[log.key], log.base)
        forced_any = False
        while True:
            step = log.get(i)
            if step is None:
                break
            forced = force_before is not None and step.end_ts < force_before
            if frontier is not None and step.first_ts >= frontier and not forced:
                break
            if not (final or forced) and not self._known_up_to(
                    log, self.members[log.key].horizon(i), frontier):
                break  # a request's prefill is decided with all steps to its first token
            fsteps = self._follower_steps(step, followers)
            if fsteps is None and not final and step.end_ts + self.max_hold_ns > self.now:
                break  # a trailing rank has not reported this step's collective yet
            if (step.unestimated_after is not None and not (final or forced)
                    and not self.estimates.knows(step.pid, step.tid)
                    and step.end_ts + self.max_hold_ns > self.now):
                break  # --gpu-sample: its thread's first step seen whole is yet to come
            if forced and frontier is not None and step.first_ts >= frontier:
                self.stats["gpu_steps_settled_early"] += 1
                self._count_in_open(log, step)
            forced_any = forced_any or forced
            self._decide(log, step, fsteps or [])
            i += 1
        self.decided[log.key] = i
        self._allocate(log, final or forced_any)
        if not final:
            self._prune_settled(log)

    def _decide(self, log: StepLog, step: Step, fsteps: list[tuple[StepLog, Step]]) -> None:
        """Fix ``step``'s members (and teach the step-cost models what it cost); it is
        split among them by ``_allocate``."""
        members = self.members[log.key].members(step.index)
        if step.unestimated_after is not None:
            self._estimate_late(step)
        if fsteps:
            self.stats["gpu_steps_joined_nccl"] += len(fsteps)
        if members and not step.estimated:  # an estimate would teach the model itself
            kernel, time = self.learners[log.key]
            row = members.features()
            kernel.learn_row(row, step.work.get("kernel_launches", 0.0))
            time.learn_row(row, step.work.get("gpu_time_ns", 0.0))
        self.pending[log.key].append((step, fsteps, members))

    def _allocate(self, log: StepLog, now: bool) -> None:
        """Split the decided steps among their members, once the step-cost models are
        fitted and usable (or ``now``: the stream ends, a step is forced, or the oldest
        waits too long)."""
        pending = self.pending[log.key]
        if not pending:
            return
        kernel, time = self.learners[log.key]
        # a first fit on an engine's first steps can find them all alike (a cold start:
        # all prefilling, or all decoding): those steps wait for a model that can tell
        # their members apart, up to MAX_PENDING_NS
        chosen = models_for(kernel, time, self.now - pending[0][0].end_ts, now)
        if chosen is None:
            return
        kmodel, tmodel, provisional = chosen
        if provisional:
            self.stats["gpu_steps_provisional_model"] += len(pending)
        for step, fsteps, members in pending:
            self._split(step, fsteps, members, kmodel, tmodel)
        self._settled_to(log.key, pending[-1][0].index + 1)
        pending.clear()

    def _split(self, step: Step, fsteps: list[tuple[StepLog, Step]],
               members: StepMembers, kmodel: StepModel, tmodel: StepModel
               ) -> None:
        """Split ``step`` (and its other ranks' steps) among its members, once."""
        steps = [(step, 0)] + [(s, f.rank or 1) for f, s in fsteps]
        if not members:
            for st, _ in steps:
                st.settled = True
                self._left_flame(st)
                self.ledger.leave(st.pid, NO_REQUEST, st.work)
                self.stats["gpu_steps_unattributed"] += 1
                self.stats["gpu_launches_unattributed"] += st.launches
            return
        # decoding members all cost the same (costmodel.member_costs): one fraction for
        # all of them, summed per step by the log's Tally; the others (prefilling) get
        # a part each
        decoding, others = members.decoding, members.others
        method = ("step_model" if kmodel.usable or tmodel.usable else "step_equal") \
            if members.by_tokens else "time_share"
        described = f"launches: {kmodel.describe()}; time: {tmodel.describe()}"
        whole = len(members) == 1
        feats = [m for _, m in others]
        fk_d, kf = split_fractions(len(decoding), feats, kmodel)
        ft_d, tf = split_fractions(len(decoding), feats, tmodel)
        sum_k = fk_d * len(decoding) + sum(kf)
        sum_t = ft_d * len(decoding) + sum(tf)
        for st, rank in steps:
            st.settled = True
            flame = self._step_flame(st)  # once; decoding shares take theirs now, parts at fold
            # booked whole: what its members were charged adds up to the step times the
            # sums of their fractions (1 each, but for rounding)
            charged = self.ledger.charged[st.pid]
            for q, v in st.work.items():
                x = v * (sum_k if q in KERNEL_QUANTITIES else sum_t)
                if x:
                    charged[q] = charged.get(q, 0) + x
            for (o, m), fk, ft in zip(others, kf, tf):
                share = o.share or self._owner(o)  # type: ignore[assignment]
                share.add_part(st, fk, ft, whole, m.prefill,
                               method if o.by_tokens else "time_share", rank)
                if method == "step_model":
                    share.models.add(described)
            if decoding:
                self._decoding(st, rank, fk_d, ft_d, decoding, whole, flame, method,
                               described if method == "step_model" else None)
            self.stats["gpu_step_launches_charged"] += st.launches

    def _decoding(self, st: Step, rank: int, fk: float, ft: float,
                  members: list[Occupancy], whole: bool, flame: Flame | None,
                  method: str, described: str | None) -> None:
        """Step ``st``'s decoding members each charged ``fk`` of its launches and ``ft``
        of the rest: the log's running sums move once, each member's run to them."""
        lk = (st.pid, st.tid)
        tally = self.tallies.get(lk)
        if tally is None:
            tally = self.tallies[lk] = Tally()
        before = tally.sums
        after = tally.add(st, fk, ft, rank)
        # a member that was in the last step was told what it says of the step (method,
        # model, whether had alone) then; if this step says the same, only new members
        # and members back from a gap need telling
        label = (method, described, whole)
        same = label == tally.label
        tally.label = label
        for o in members:
            share: GpuShare = o.share or self._owner(o)  # type: ignore[assignment]
            run = share.runs.get(lk)
            if run is not None and run.end is before:
                run.end = after
                if same:
                    if flame is not None:
                        share.add_flame(flame, fk, ft)
                    continue
            else:
                if run is not None:  # it was out of the steps in between
                    share.ended.append(run)
                share.runs[lk] = Run(before, after)
            share.methods.add(method if o.by_tokens else "time_share")
            if not whole:
                share.whole = False
            if described is not None:
                share.models.add(described)
            if flame is not None:
                share.add_flame(flame, fk, ft)

    def _step_flame(self, st: Step) -> Flame | None:
        """The step's calls split among the stacks sampled in it (once; None without
        stack sampling for its process)."""
        book = self.stacks
        if book is None or not (st.stack_samples or book.sampled(st.pid)):
            return None
        if st.flame is None:
            st.flame = book.weights(st.pid, step_units(st), st.stack_samples or Counter(),
                                    st.work.get("gpu_time_ns", 0.0))
        return st.flame  # type: ignore[return-value]

    def _left_flame(self, st: Step) -> None:
        """A step no request was charged: its stacks stay with the process."""
        flame = self._step_flame(st)
        if flame is not None and self.stacks is not None:
            self.stacks.unattributed[st.pid].add(flame)

    @staticmethod
    def _known_up_to(log: StepLog, h: int, frontier: int | None) -> bool:
        """Every member of steps up to ``h`` of ``log`` is known."""
        step = log.get(h)
        return step is not None and (frontier is None or step.first_ts < frontier)

    def _follower_steps(self, step: Step, followers: list[tuple[StepLog, int | None]]
                        ) -> list[tuple[StepLog, Step]] | None:
        """The other ranks' steps joined to leader step ``step`` (None: one is not in yet)."""
        out = []
        if step.signature is None:
            return out
        for f, shift in followers:
            fstep = f.step_of_collective(step.coll_seq + shift) if shift is not None else None
            if fstep is None and shift is not None and step.coll_seq + shift >= (
                    f.coll_base + len(f.coll_sigs)):
                return None
            if fstep is None or fstep.signature != step.signature or fstep.settled:
                self.stats["gpu_steps_unjoined"] += 1
                continue
            out.append((f, fstep))
        return out

    def _count_in_open(self, log: StepLog, step: Step) -> None:
        """A step settled while requests that may have been in it run on: each open
        streamed request is made a member by the tokens it has written so far."""
        group = self.ipc.serving_group(log.pid)
        ms = self.members[log.key]
        for pid in group:
            for r in list(self.open_records(pid)) + list(self.held.get(pid, {}).values()):
                if r.key in ms.occupancies:
                    continue
                occ = request_range(r, log, ms.ratio.value, finished=False)
                if occ is not None and occ.first <= step.index:
                    ms.add(occ)
                    rd = self._ready_entry(r)
                    rd.logs.append(log.key)
                    self._watch(rd, log.key)

    def _prune_settled(self, log: StepLog) -> None:
        """Forget settled steps no request can still need: older than the earliest
        step a member still holds, and than ``KEEP_SETTLED_NS``."""
        if not log.steps or log.steps[0].end_ts >= self.now - KEEP_SETTLED_NS:
            return  # nothing old enough to go, whatever the members still hold
        ms = self.members[log.key]
        keep = min((o.start for o in ms.occupancies.values()), default=self.settled[log.key])
        keep = min(keep, self.settled[log.key])
        cut = log.get(keep)
        before = min(cut.first_ts if cut is not None else self.now, self.now - KEEP_SETTLED_NS)
        if log.steps and log.steps[0].end_ts < before:
            self._retire(log, log.prune(before))

    # ---- records --------------------------------------------------------------------

    def _ready(self, rec: RequestRecord) -> None:
        """``rec``'s tokens are all in: it becomes a member of the steps it was in."""
        held = self.held.get(rec.pid)
        if held is None or held.get(rec.key) is not rec:
            return
        del held[rec.key]
        if not held:
            del self.held[rec.pid]
        ready = self._ready_entry(rec)
        self._recheck.add(rec.key)
        ready.rec = rec
        share = self.shares.get(rec.key)
        followers = self._ranks(rec.pid, self._group_logs(rec.pid))[1]
        for log in self._group_logs(rec.pid):
            if log in followers:
                continue
            if share is not None and share.methods == {"same_thread"} and log.tid in rec.tids:
                continue  # its own thread's other work was not its
            ms = self.members[log.key]
            ms.ratio.learn(rec, log)
            occ = request_range(rec, log, ms.ratio.value, lag_ns=ms.lag.value)
            if occ is None:
                continue
            if ms.ratio.value == 1:
                ms.lag.learn(occ, log)
            self.stats[f"gpu_step_ranges_{occ.how}"] += 1
            if occ.first < self.decided[log.key]:
                self.stats["gpu_ranges_partly_settled"] += 1
            ms.add(occ)
            self._watch(ready, log.key)
            if log.key not in ready.logs:
                ready.logs.append(log.key)

    def _release_due(self, final: bool = False) -> None:
        """Release ready records whose steps are all settled, in end order. Only the
        records that became ready, or whose last step in a log was settled, since the
        last call are looked at (``_recheck``): nothing else makes one due."""
        if final:
            keys: Iterable[Key] = list(self.ready)
        else:
            keys, self._recheck = self._recheck, set()
        due = []
        for key in keys:
            rd = self.ready.get(key)
            if rd is None:
                continue
            if rd.rec.key in self.held.get(rd.rec.pid, {}):
                continue  # counted in early while still held: not finished being held
            if final or all(self._settled_past(lk, key) for lk in rd.logs):
                due.append(rd)
        for rd in sorted(due, key=lambda rd: (rd.rec.end_ns, rd.seq)):
            self._release(rd)

    def _ready_entry(self, rec: RequestRecord) -> _Ready:
        rd = self.ready.get(rec.key)
        if rd is None:
            rd = self.ready[rec.key] = _Ready(rec, seq=self._ready_seq)
            self._ready_seq += 1
        return rd

    def _watch(self, rd: _Ready, lk: LogKey) -> None:
        """Look at ``rd`` again once log ``lk`` is settled past its last step there."""
        occ = self.members[lk].occupancies.get(rd.rec.key)
        if occ is None or occ.last < self.settled[lk]:
            self._recheck.add(rd.rec.key)
        else:
            heapq.heappush(self._waits.setdefault(lk, []), (occ.last, rd.seq, rd.rec.key))

    def _settled_to(self, lk: LogKey, index: int) -> None:
        """Log ``lk``'s steps before ``index`` are settled: records waiting on them are
        looked at again."""
        self.settled[lk] = index
        waits = self._waits.get(lk)
        while waits and waits[0][0] < index:
            self._recheck.add(heapq.heappop(waits)[2])

    def _settled_past(self, lk: LogKey, key: Key) -> bool:
        occ = self.members[lk].occupancies.get(key)
        return occ is None or occ.last < self.settled[lk]

    def _release(self, rd: _Ready) -> None:
        rec = rd.rec
        del self.ready[rec.key]
        primary: tuple[StepLog, Occupancy] | None = None
        for lk in rd.logs:
            occ = self.members[lk].remove(rec.key)
            if occ is not None and occ.by_tokens and (
                    primary is None or occ.last - occ.start > primary[1].last - primary[1].start):
                primary = (self.logs[lk], occ)
        share = self.shares.pop(rec.key, None)
        if share is not None:
            rec.gpu.update(share.attributes(self.pricing, self.kernel_name))
            rec.flame = share.flame
            if share.steps:
                self.request_steps.append(share.steps)
            if primary is not None:
                self._phases(rec, *primary, share)
        self.released_end[rec.pid] = max(self.released_end.get(rec.pid, 0), rec.end_ns)
        self.emit(rec)

    def _phases(self, rec: RequestRecord, lg: StepLog, occ: Occupancy, share: GpuShare
                ) -> None:
        """Queue, prefill and decode child spans from the request's steps and tokens."""
        s0, s1 = lg.get(occ.start), lg.get(occ.first)
        if s0 is None or s1 is None:
            return
        arrival = arrival_ns(rec)
        r = rec.llm_response
        first_token = (r.first_token_ts if r is not None and r.first_token_ts else s1.end_ts)
        last_token = (r.token_ts[-1] if r is not None and r.token_ts else rec.end_ns)
        if s0.first_ts > arrival:
            rec.children.append(ChildSpan("queue", arrival, s0.first_ts,
                                          {"tokentrace.phase": "queue"}))
        rec.children.append(ChildSpan("prefill", s0.first_ts, max(first_token, s1.end_ts), {
            "tokentrace.phase": "prefill",
            "tokentrace.gpu.steps": occ.first - occ.start + 1,
            "tokentrace.gpu.kernel_launches": round(share.prefill_launches, 3),
        }))
        if occ.last > occ.first and last_token > first_token:
            rec.children.append(ChildSpan("decode", first_token, last_token, {
                "tokentrace.phase": "decode",
                "tokentrace.gpu.steps": occ.last - occ.first,
                "tokentrace.gpu.kernel_launches": round(share.decode_launches, 3),
            }))

    # ---- helpers --------------------------------------------------------------------

    def _in_flight(self, pid: int, first_ts: int, last_ts: int) -> list[RequestRecord]:
        out = [r for r in self.open_records(pid) if r.start_ns <= last_ts]
        out += [r for r in self.held.get(pid, {}).values()
                if r.start_ns <= last_ts and r.end_ns >= first_ts]
        return out

    def _owner(self, occ: Occupancy) -> GpuShare:
        """``occ``'s request's share, kept on it for its next steps."""
        occ.share = share = self._share(occ.rec)
        return share

    def _share(self, rec: RequestRecord) -> GpuShare:
        s = self.shares.get(rec.key)
        if s is None:
            s = self.shares[rec.key] = GpuShare()
        return s

    def _group_logs(self, pid: int) -> list[StepLog]:
        group = self.ipc.serving_group(pid)
        return [log for k, log in self.logs.items() if k[0] in group and log.steps]

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

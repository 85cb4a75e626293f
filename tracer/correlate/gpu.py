"""The GPU ledger: per process and per thread totals of what the CUDA, NCCL and ibverbs
probes saw, with kernel handles resolved to names. It consumes the GPU events in order
(live or replayed) and never sees a single launch or post: only bursts and counters
summed in the kernel.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Iterator, Mapping

from tracer.correlate.kernelnames import readable
from tracer.correlate.sampling import (LaunchSampling, StepSample, estimate,
                                      sampled_copy_counts)
from tracer.correlate.steps import StepTotals
from tracer.events import wire
from tracer.events.gpu import (COPY_KINDS, LIVE_NAME_SOURCES, NAME_SOURCES, SAMPLED_COPIES,
                               SAMPLED_COPY_KINDS, GpuSampling, KernelBurst, KernelCounts,
                               KernelName, KernelStub,
                               MemEvent, NcclEvent, VerbsContext, VerbsCounts, VerbsMr, VerbsQp)

HOST_STUB = wire.CONSTANTS["NAME_HOST_STUB"]
# kernel_names rows: live names, then each route for handles resolved before attach
NAME_ROWS = ("live", "host_stub", "registered_stub", "stub_slot", "driver_object",
             "driver_string", "unknown")


def name_row(source: int | None) -> str:
    """The kernel_names row of a NAME_* source (None: not named)."""
    if source is None:
        return "unknown"
    if source in LIVE_NAME_SOURCES:
        return "live"
    return NAME_SOURCES.get(source, "unknown")


@dataclass
class VerbsTotals:
    """ibverbs data path of one thread (or, summed, one process)."""

    wrs: Counter[str] = field(default_factory=Counter)  # posted, by verb (recv: "recv")
    wr_bytes: Counter[str] = field(default_factory=Counter)
    sges: Counter[str] = field(default_factory=Counter)
    post_calls: Counter[str] = field(default_factory=Counter)  # post_send / post_recv
    chains_cut: int = 0
    completions: Counter[str] = field(default_factory=Counter)  # by wc opcode, "error"
    completion_errors: int = 0
    completion_bytes: int = 0
    polls: int = 0
    empty_polls: int = 0
    poll_errors: int = 0
    qps: dict[int, Counter[str]] = field(default_factory=dict)  # qp_num -> counts

    def add(self, ev: VerbsCounts) -> None:
        if ev.op == "poll":
            self.polls += ev.count
            self.empty_polls += ev.extra
            self.poll_errors += ev.errors
            return
        if ev.op in ("post_send_call", "post_recv_call"):
            self.post_calls[ev.op[:-5]] += ev.count
            self.chains_cut += ev.extra
            return
        qp = self.qps.get(ev.qp_num)
        if qp is None:
            qp = self.qps[ev.qp_num] = Counter()
        if ev.op in ("send", "recv"):
            verb = ev.opcode if ev.op == "send" else "recv"
            self.wrs[verb] += ev.count
            self.wr_bytes[verb] += ev.bytes
            self.sges[verb] += ev.extra
            qp[f"{ev.op}_wrs"] += ev.count
            qp[f"{ev.op}_bytes"] += ev.bytes
        elif ev.op == "cqe":
            self.completions[ev.opcode] += ev.count
            self.completion_errors += ev.errors
            self.completion_bytes += ev.bytes
            qp["completions"] += ev.count
            qp["completion_errors"] += ev.errors
            qp["completion_bytes"] += ev.bytes

    def merge(self, o: "VerbsTotals") -> None:
        for name in ("wrs", "wr_bytes", "sges", "post_calls", "completions"):
            getattr(self, name).update(getattr(o, name))
        for name in ("chains_cut", "completion_errors", "completion_bytes", "polls",
                     "empty_polls", "poll_errors"):
            setattr(self, name, getattr(self, name) + getattr(o, name))
        for qp, c in o.qps.items():
            self.qps.setdefault(qp, Counter()).update(c)

    def summary(self) -> dict[str, Any]:
        return {
            "posted": {v: {"wrs": n, "bytes": self.wr_bytes[v], "sges": self.sges[v]}
                       for v, n in sorted(self.wrs.items())},
            "post_send_calls": self.post_calls["post_send"],
            "post_recv_calls": self.post_calls["post_recv"],
            "chains_cut": self.chains_cut,
            "completions": dict(sorted(self.completions.items())),
            "completion_errors": self.completion_errors,
            "completion_bytes": self.completion_bytes,
            "polls": self.polls,
            "empty_polls": self.empty_polls,
            "poll_errors": self.poll_errors,
            "qps": {str(q): dict(sorted(c.items())) for q, c in sorted(self.qps.items())},
        }


@dataclass
class ThreadTotals:
    """What one thread (or, summed, one process) did on the GPU."""

    kernel_launches: int = 0
    graph_launches: int = 0
    memcpy_bytes: Counter[str] = field(default_factory=Counter)
    memcpy_calls: Counter[str] = field(default_factory=Counter)
    memset_bytes: int = 0
    memset_calls: int = 0
    sync_calls: int = 0
    sync_wait_ns: int = 0
    query_polls: int = 0
    bursts: int = 0
    nccl_ops: Counter[str] = field(default_factory=Counter)
    nccl_bytes: Counter[str] = field(default_factory=Counter)
    kernels: Counter[int] = field(default_factory=Counter)  # handle -> launches
    verbs: VerbsTotals = field(default_factory=VerbsTotals)
    first_ts: int = 0  # first burst's first call
    last_ts: int = 0  # last burst's end
    sample: StepSample | None = None  # steps seen under --gpu-sample

    def add_burst(self, b: KernelBurst) -> None:
        if not self.bursts or b.first_ts < self.first_ts:
            self.first_ts = b.first_ts
        self.last_ts = max(self.last_ts, b.last_ts)
        # once per burst: plain dict updates that skip zeros (Counter.update costs a
        # Python-level loop with type checks per call, most of this method's time)
        self.bursts += 1
        self.kernel_launches += b.launches
        self.graph_launches += b.graph_launches
        if any(b.copy_calls.values()):
            for into, src in ((self.memcpy_bytes, b.copy_bytes),
                              (self.memcpy_calls, b.copy_calls)):
                for k, n in src.items():
                    if n:
                        into[k] = into.get(k, 0) + n
        self.memset_bytes += b.memset_bytes
        self.memset_calls += b.memset_calls
        self.sync_calls += b.sync_calls
        self.sync_wait_ns += b.sync_wait_ns
        self.query_polls += b.query_polls
        kernels = self.kernels
        get = kernels.get
        for h, n in b.handle_counts.items():
            kernels[h] = get(h, 0) + n

    def add_nccl(self, ev: NcclEvent) -> None:
        self.nccl_ops[ev.op] += 1
        self.nccl_bytes[ev.op] += ev.bytes


@dataclass
class ProcessGpu:
    pid: int
    threads: dict[int, ThreadTotals] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # handle -> kernel name
    name_sources: dict[int, int] = field(default_factory=dict)  # handle -> NAME_* source
    host_stubs: int = 0  # handles whose host stub the runtime probes learnt (KSTUB)
    name_records: int = 0  # KernelName records received (names and aliases)
    live_bytes: int = 0
    peak_bytes: int = 0
    allocs: int = 0
    frees: int = 0
    frees_of_unknown: int = 0  # allocated before the tracer attached: size unknown
    communicators: list[dict[str, int]] = field(default_factory=list)
    verbs_contexts: int = 0
    mrs: dict[int, int] = field(default_factory=dict)  # live ibv_mr -> bytes registered
    mr_stats: Counter[str] = field(default_factory=Counter)
    qps: dict[int, dict[str, Any]] = field(default_factory=dict)  # qp_num -> state

    def verbs_event(self, ev: Any) -> None:
        """A VerbsContext, VerbsMr or VerbsQp event of this process."""
        if isinstance(ev, VerbsContext):
            self.verbs_contexts += 1
        elif isinstance(ev, VerbsMr):
            st = self.mr_stats
            if ev.op == "reg":
                if ev.ret != 0 or not ev.mr:
                    st["reg_failed"] += 1
                    return
                st["reg"] += 1
                st["reg_bytes"] += ev.length
                self.mrs[ev.mr] = ev.length
            else:
                st["dereg"] += 1
                if ev.ret != 0:
                    st["dereg_failed"] += 1
                    return
                if self.mrs.pop(ev.mr, None) is None:
                    st["dereg_of_unknown"] += 1  # registered before the tracer attached
            live = sum(self.mrs.values())
            st["peak_registered_bytes"] = max(st["peak_registered_bytes"], live)
        elif isinstance(ev, VerbsQp):
            q = self.qps.setdefault(ev.qp_num, {"state": "", "dest_qp_num": -1,
                                                "transitions": [], "errors": 0})
            if ev.ret != 0:
                q["errors"] += 1
                return
            if ev.state:
                q["state"] = ev.state
                q["transitions"].append(ev.state)
            if ev.dest_qp_num >= 0:
                q["dest_qp_num"] = ev.dest_qp_num

    def verbs_summary(self, totals: VerbsTotals) -> dict[str, Any]:
        st = self.mr_stats
        return {
            **totals.summary(),
            "contexts": self.verbs_contexts,
            "registered_memory": {
                "live_bytes": sum(self.mrs.values()), "live_regions": len(self.mrs),
                "peak_bytes": st["peak_registered_bytes"], "reg_mr": st["reg"],
                "reg_bytes": st["reg_bytes"], "reg_failed": st["reg_failed"],
                "dereg_mr": st["dereg"], "dereg_failed": st["dereg_failed"],
                "dereg_of_unknown": st["dereg_of_unknown"]},
            "qp_states": {str(q): v for q, v in sorted(self.qps.items())},
        }

    def thread(self, tid: int) -> ThreadTotals:
        t = self.threads.get(tid)
        if t is None:
            t = self.threads[tid] = ThreadTotals()
        return t

    def name_of(self, handle: int) -> str:
        return self.names.get(handle) or f"unknown@{handle:#x}"

    def add_name(self, ev: KernelName) -> None:
        """Name a handle; a name seen live by the driver's probes is never replaced by
        one symbolised from a host stub (it is the driver's own word)."""
        name = ev.name if ev.name else self.names.get(ev.alias_of, "")
        if not name:
            return
        if (ev.source not in LIVE_NAME_SOURCES
                and self.name_sources.get(ev.handle) in LIVE_NAME_SOURCES):
            return
        self.names[ev.handle] = name
        self.name_sources[ev.handle] = ev.source

    def unnamed_handles(self) -> set[int]:
        """Handles this process launched that have no name."""
        out: set[int] = set()
        for t in self.threads.values():
            out.update(h for h in t.kernels if h not in self.names)
        return out

    def names_summary(self, kernels: Counter[int]) -> dict[str, Any]:
        """Launched handles and their launches by where their names came from: ``live``
        (the driver's name probes), the routes for handles resolved before attach
        (``host_stub``, ``registered_stub``, ``stub_slot``, ``driver_object``,
        ``driver_string``), or
        ``unknown``."""
        out = {k: {"handles": 0, "launches": 0} for k in NAME_ROWS}
        for h, n in kernels.items():
            row = out[name_row(self.name_sources.get(h) if h in self.names else None)]
            row["handles"] += 1
            row["launches"] += n
        return {**out, "host_stubs_seen": self.host_stubs, "name_records": self.name_records}


class GpuLedger:
    """Per-process GPU totals from a stream of GPU events."""

    def __init__(self) -> None:
        self.processes: dict[int, ProcessGpu] = {}
        self.sampling: LaunchSampling | None = None
        # from the GPU attribution (the pipeline wires them): each thread's steps as
        # booked, and the threads that also had bursts taken whole by one request
        self.step_totals: Mapping[tuple[int, int], StepTotals] = {}
        self.same_thread: AbstractSet[tuple[int, int]] = set()
        self.sampling_reason = ""  # why --gpu-sample auto last switched, if it did
        self.sampling_problem = ""  # a replayed capture that switched other copies

    def proc(self, pid: int) -> ProcessGpu:
        p = self.processes.get(pid)
        if p is None:
            p = self.processes[pid] = ProcessGpu(pid)
        return p

    def paused(self, ts: int, paused: bool) -> None:
        """The agent took its probes out or put them back (``schema.TracingPaused``)."""
        if self.sampling is not None:
            self.sampling.pause(ts, paused)

    def handle(self, ev: Any) -> None:
        """Account one GPU event (KernelBurst, KernelName, KernelStub, MemEvent,
        NcclEvent or an ibverbs event)."""
        if isinstance(ev, KernelBurst):
            t = self.proc(ev.pid).thread(ev.tid)
            t.add_burst(ev)
            if self.sampling is not None:
                copies = sampled_copy_counts(ev.copy_calls, ev.copy_bytes, ev.memset_calls,
                                             ev.memset_bytes, ev.sync_calls, ev.sync_wait_ns)
                if t.sample is None:  # what came before sampling began was all counted
                    t.sample = StepSample(
                        exact_launches=t.kernel_launches - ev.launches,
                        exact_graph_launches=t.graph_launches - ev.graph_launches,
                        exact_copies=Counter(sampled_copy_counts(
                            t.memcpy_calls, t.memcpy_bytes, t.memset_calls, t.memset_bytes,
                            t.sync_calls, t.sync_wait_ns)))
                    t.sample.exact_copies.subtract(copies)
                t.sample.add(ev.reason, ev.first_ts, ev.last_ts, ev.launches,
                             ev.graph_launches, self.sampling, copies,
                             ev.copy_calls.get("d2h", 0))
        elif isinstance(ev, KernelName):
            p = self.proc(ev.pid)
            p.name_records += 1
            p.add_name(ev)
        elif isinstance(ev, KernelStub):
            self.proc(ev.pid).host_stubs += 1
        elif isinstance(ev, MemEvent):
            p = self.proc(ev.pid)
            if ev.op == "alloc":
                p.allocs += 1
            else:
                p.frees += 1
                p.frees_of_unknown += not ev.known
            p.live_bytes = ev.live
            p.peak_bytes = max(p.peak_bytes, ev.live)
        elif isinstance(ev, NcclEvent):
            p = self.proc(ev.pid)
            if ev.op == "comm_init":
                p.communicators.append({"comm": ev.comm, "rank": ev.peer,
                                        "nranks": ev.nranks, "comm_id": ev.comm_id,
                                        "ret": ev.ret})
            else:
                p.thread(ev.tid).add_nccl(ev)
        elif isinstance(ev, GpuSampling):
            if self.sampling is None:
                self.sampling = LaunchSampling(ev.fraction)
            elif ev.fraction < 1.0:  # --gpu-sample auto follows the steps' length
                self.sampling.fraction = ev.fraction
            self.sampling.switch(ev.ts, ev.enabled, ev.attach_s, ev.detach_s, ev.copies,
                                 ev.memsets)
            if ev.copies and ev.copy_kinds != SAMPLED_COPIES:
                self.sampling_problem = (
                    f"recorded with the {ev.copy_kinds} copies switched with the launch "
                    f"probes; this version estimates {SAMPLED_COPIES}: replay it with the "
                    "version that recorded it")
            if ev.reason:
                self.sampling_reason = ev.reason
        elif isinstance(ev, KernelCounts):
            kernels = self.proc(ev.pid).thread(ev.tid).kernels
            kernels[ev.handle] = kernels.get(ev.handle, 0) + ev.count
        elif isinstance(ev, VerbsCounts):
            self.proc(ev.pid).thread(ev.tid).verbs.add(ev)
        elif isinstance(ev, (VerbsContext, VerbsMr, VerbsQp)):
            self.proc(ev.pid).verbs_event(ev)

    def totals(self) -> Iterator[tuple[ProcessGpu, ThreadTotals]]:
        """Each process with its threads' totals summed (exact counts: the console's
        live view; sampled launch counts are as seen)."""
        for pid, p in sorted(self.processes.items()):
            total = ThreadTotals()
            for t in p.threads.values():
                _merge(total, t)
            yield p, total

    def summary(self, top: int = 20) -> dict[str, Any]:
        """A JSON-ready summary: per process, its threads, top kernels by launches."""
        out = []
        for pid, p in sorted(self.processes.items()):
            total = ThreadTotals()
            for t in p.threads.values():
                _merge(total, t)
            est: dict[int, ThreadTotals] = {}
            est_total = None
            methods: dict[int, dict[str, Any]] = {}
            if self.sampling is not None:
                for tid, t in p.threads.items():
                    est[tid], methods[tid] = self._estimated(pid, tid, t, self.sampling)
                est_total = ThreadTotals()
                for e in est.values():
                    _merge(est_total, e)
            out.append({
                "pid": pid,
                **_totals(total, p, top, est_total),
                "device_memory": {"live_bytes": p.live_bytes, "peak_bytes": p.peak_bytes,
                                  "allocs": p.allocs, "frees": p.frees,
                                  "frees_of_unknown_size": p.frees_of_unknown},
                "nccl_communicators": p.communicators,
                "kernel_names": p.names_summary(total.kernels),
                "ibverbs": p.verbs_summary(total.verbs),
                "threads": {str(tid): {**_totals(t, p, top, est.get(tid)),
                                       **({"launch_estimate": methods[tid]}
                                          if tid in methods else {}),
                                       "ibverbs": t.verbs.summary()}
                            for tid, t in sorted(p.threads.items())},
            })
        doc: dict[str, Any] = {"processes": out}
        if self.sampling is not None:
            doc["launch_sampling"] = {
                **self.sampling.summary(),
                "note": "kernel and graph launch counts are estimates: an engine "
                        "thread's steps as charged to requests, each step the launch "
                        "probes did not see whole counted as the step of its shape they "
                        "did (method 'step_shapes'); else launches in steps wholly "
                        "sampled x all steps / sampled steps ('steps'), or seen / the "
                        "share of the thread's active span the launch probes were on "
                        "('time_share'); *_seen are the counts the probes saw"}
            if self.sampling_reason:
                doc["launch_sampling"]["chosen_by"] = self.sampling_reason
            if self.sampling_problem:
                doc["launch_sampling"]["problem"] = self.sampling_problem
        return doc

    def _estimated(self, pid: int, tid: int, t: ThreadTotals, sampling: LaunchSampling
                   ) -> tuple[ThreadTotals, dict[str, Any]]:
        """A sampled thread's estimated launch counts, and how they were estimated:
        from its steps as booked when all its bursts were steps, else scaled."""
        steps = self.step_totals.get((pid, tid))
        # with the syncs off with the copies, only a result copy ends a step: a thread
        # with none has its off windows merged into a few steps, its launches scaled
        told = not sampling.copies_ever or (t.sample is not None and t.sample.results)
        if (steps is not None and steps.steps and (pid, tid) not in self.same_thread
                and told):
            memsets, copies = sampling.memsets_ever, sampling.copies_ever
            return (ThreadTotals(kernel_launches=steps.launches,
                                 graph_launches=steps.graph_launches,
                                 kernels=+steps.kernels,
                                 memcpy_calls=_sampled_kinds(t.memcpy_calls, steps.copy_calls,
                                                             sampling),
                                 memcpy_bytes=_sampled_kinds(t.memcpy_bytes, steps.copy_bytes,
                                                             sampling),
                                 memset_calls=steps.memset_calls if memsets else t.memset_calls,
                                 memset_bytes=steps.memset_bytes if memsets else t.memset_bytes,
                                 sync_calls=steps.sync_calls if copies else t.sync_calls,
                                 sync_wait_ns=(steps.sync_wait_ns if copies
                                               else t.sync_wait_ns)),
                    {"method": "step_shapes", "steps": steps.steps,
                     "estimated_steps": steps.estimated})
        est, method = _scaled(t, sampling)
        s = t.sample
        return est, {"method": method, "steps": s.steps if s else 0,
                     "sampled_steps": s.sampled_steps if s else 0}


def _merge(into: ThreadTotals, t: ThreadTotals) -> None:
    for name in ("kernel_launches", "graph_launches", "memset_bytes", "memset_calls",
                 "sync_calls", "sync_wait_ns", "query_polls", "bursts"):
        setattr(into, name, getattr(into, name) + getattr(t, name))
    for name in ("memcpy_bytes", "memcpy_calls", "nccl_ops", "nccl_bytes", "kernels"):
        getattr(into, name).update(getattr(t, name))
    into.verbs.merge(t.verbs)
    if t.bursts:
        into.first_ts = min(into.first_ts, t.first_ts) if into.first_ts else t.first_ts
        into.last_ts = max(into.last_ts, t.last_ts)


def _scaled(t: ThreadTotals, sampling: LaunchSampling) -> tuple[ThreadTotals, str]:
    """Estimated launch counts of ``t`` (floats, rounded on output) and the method."""
    s = t.sample
    launches, method = estimate(t.kernel_launches, s.sampled_launches if s else 0, s,
                                sampling, t.first_ts, t.last_ts,
                                s.exact_launches if s else 0)
    graphs, _ = estimate(t.graph_launches, s.sampled_graph_launches if s else 0, s,
                         sampling, t.first_ts, t.last_ts,
                         s.exact_graph_launches if s else 0)
    # per kernel: the thread's seen mix, scaled to the estimated total
    f = launches / t.kernel_launches if t.kernel_launches else 0.0
    copies: dict[str, Counter[str]] = {"calls": Counter(), "bytes": Counter()}
    for what, seen in (("calls", t.memcpy_calls), ("bytes", t.memcpy_bytes)):
        for k in SAMPLED_COPY_KINDS if sampling.copies_ever else ():
            key = f"{what}.{k}"
            copies[what][k], _ = estimate(seen.get(k, 0), s.sampled_copies[key] if s else 0,
                                          s, sampling, t.first_ts, t.last_ts,
                                          s.exact_copies[key] if s else 0)
    memsets = {"calls": float(t.memset_calls), "bytes": float(t.memset_bytes)}
    syncs = {"calls": float(t.sync_calls), "wait": float(t.sync_wait_ns)}
    for ever, kind, counts in ((sampling.memsets_ever, "memset", memsets),
                               (sampling.copies_ever, "sync", syncs)):
        for what in counts if ever else ():
            key = f"{what}.{kind}"
            counts[what], _ = estimate(counts[what], s.sampled_copies[key] if s else 0, s,
                                       sampling, t.first_ts, t.last_ts,
                                       s.exact_copies[key] if s else 0)
    return ThreadTotals(kernel_launches=launches,  # type: ignore[arg-type]
                        graph_launches=graphs,  # type: ignore[arg-type]
                        memset_calls=memsets["calls"],  # type: ignore[arg-type]
                        memset_bytes=memsets["bytes"],  # type: ignore[arg-type]
                        sync_calls=syncs["calls"],  # type: ignore[arg-type]
                        sync_wait_ns=syncs["wait"],  # type: ignore[arg-type]
                        kernels=Counter({h: n * f for h, n in t.kernels.items()}),
                        memcpy_calls=_sampled_kinds(t.memcpy_calls, copies["calls"], sampling),
                        memcpy_bytes=_sampled_kinds(t.memcpy_bytes, copies["bytes"], sampling)
                        ), method


def _sampled_kinds(seen: Counter[str], estimated: Counter[str],
                   sampling: LaunchSampling) -> Counter[str]:
    """Copies by kind: those of ``SAMPLED_COPY_KINDS`` as estimated where they were
    switched with the launches, the rest (and all, where none was) as seen."""
    if not sampling.copies_ever:
        return seen
    out = Counter({k: n for k, n in seen.items() if k not in SAMPLED_COPY_KINDS})
    out.update({k: estimated.get(k, 0) for k in SAMPLED_COPY_KINDS})
    return out


def _totals(t: ThreadTotals, p: ProcessGpu, top: int,
            est: ThreadTotals | None = None) -> dict[str, Any]:
    """Summary fields of ``t``; launch counts from ``est`` when launches were sampled."""
    src = est if est is not None else t
    named: Counter[str] = Counter()
    for h, n in src.kernels.items():
        named[p.name_of(h)] += n
    seen = ({"kernel_launches_seen": t.kernel_launches, "graph_launches_seen": t.graph_launches,
             "memcpy_bytes_seen": {k: t.memcpy_bytes.get(k, 0) for k in SAMPLED_COPY_KINDS},
             "memcpy_calls_seen": {k: t.memcpy_calls.get(k, 0) for k in SAMPLED_COPY_KINDS},
             "memset_bytes_seen": t.memset_bytes, "memset_calls_seen": t.memset_calls,
             "sync_calls_seen": t.sync_calls}
            if est is not None else {})
    return {
        "kernel_launches": round(src.kernel_launches),
        "graph_launches": round(src.graph_launches),
        **seen,
        "memcpy_bytes": {k: round(src.memcpy_bytes.get(k, 0)) for k in COPY_KINDS},
        "memcpy_calls": {k: round(src.memcpy_calls.get(k, 0)) for k in COPY_KINDS},
        "memset_bytes": round(src.memset_bytes),
        "memset_calls": round(src.memset_calls),
        "sync_calls": round(src.sync_calls),
        "sync_wait_ms": round(src.sync_wait_ns / 1e6, 3),
        "query_polls": t.query_polls,
        "bursts": t.bursts,
        "nccl_ops": dict(t.nccl_ops),
        "nccl_bytes": dict(t.nccl_bytes),
        "top_kernels": [{"name": n, "readable": readable(n), "launches": round(c)}
                        for n, c in named.most_common(top)],
    }

"""Launch-site stacks joined to the GPU work they launched, and to requests.

The kernel counts sampled stacks per thread and sends them (``StackCounts``) right
before the burst they were taken in. ``StackBook`` keeps each thread's counts until
that burst arrives, so the stacks ride with the burst: into its engine step (or, on a
synchronous server, straight to its request) and from there, split with exactly the
fractions the step's work is split with, into each request's ``Flame``. A request
gets its share of the stacks as it gets its share of the launches, and the service
view is the sum.

Widths. A step's calls are known exactly per *unit*: each kernel handle's launches
(the burst slots), graph launches, memcpy calls per direction, NCCL calls per op. The
samples say which stacks made them: a unit's exact calls are split among the stacks
its samples in that step were taken in, in proportion to their samples; a unit with
no sample in the step is split like that unit's samples in the process so far (in
stream order, so a replay gives the same split), launches past a burst's 16 kernel
slots (no handle) like the process's samples of the kernels not in its slots; a unit
never sampled stays one ``[no stack sampled]`` stack under its kernel. So a request's
launch width is exact, and so is its width per kernel for kernels in the burst slots;
launches past the slots are divided among kernels by samples, and every division
among call sites is estimated. The
GPU time of a step (its span, ``steps.py``) is shared by its calls equally: tokentrace
does not time kernels one by one. The raw sample counts are kept beside both.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable

from tracer.events import wire
from tracer.events.gpu import COPY_KINDS, KernelBurst
from tracer.events.stacks import COPY_NAMES, StackCounts, StackFrames, what_label

C = wire.CONSTANTS
KERNEL, GRAPH, COPY, NCCL = C["STK_KERNEL"], C["STK_GRAPH"], C["STK_COPY"], C["STK_NCCL"]
Unit = tuple[int, int]  # (what, handle); handle 0 for all but kernels
Key = tuple[int, int, int, int]  # (pid, stack id or 0, what, handle)
OVERFLOW: Unit = (KERNEL, -1)  # launches past a burst's 16 kernel slots
SEPARATOR = "--"


def unit_of(what: int, handle: int) -> Unit:
    return (what, handle) if what == KERNEL else (what, 0)


def nccl_what(op: str) -> int:
    return NCCL + C.get("NCCL_" + op.upper(), 0)


def burst_units(b: KernelBurst) -> Counter[Unit]:
    """A burst's GPU calls by unit (exact)."""
    out: Counter[Unit] = Counter({(KERNEL, h): n for h, n in b.handle_counts.items() if n})
    past = b.launches - sum(b.handle_counts.values())
    if past > 0:
        out[OVERFLOW] += past
    if b.graph_launches:
        out[(GRAPH, 0)] += b.graph_launches
    for i, k in enumerate(COPY_KINDS):
        n = b.copy_calls.get(k, 0)
        if n:
            out[(COPY + i, 0)] += n
    return out


class Flame(dict[Key, list[float]]):
    """Weights per stack: key -> [calls, GPU time ns, samples]."""

    def add(self, other: "Flame", calls: float = 1.0, time: float = 1.0,
            other_calls: float | None = None) -> None:
        """self += other, its kernel/graph calls times ``calls``, its other calls (copies,
        NCCL) times ``other_calls`` (default ``time``), its time times ``time``."""
        oc = time if other_calls is None else other_calls
        for k, (n, t, s) in other.items():
            f = calls if k[2] in (KERNEL, GRAPH) else oc
            cur = self.get(k)
            if cur is None:
                self[k] = [n * f, t * time, s * f]
            else:
                cur[0] += n * f
                cur[1] += t * time
                cur[2] += s * f

    def total_calls(self) -> float:
        return sum(v[0] for v in self.values())


@dataclass
class StackBook:
    """What the stream said about stacks, in stream order."""

    pending: dict[tuple[int, int], list[StackCounts]] = field(default_factory=dict)
    frames: dict[tuple[int, int], StackFrames] = field(default_factory=dict)
    by_unit: dict[tuple[int, Unit], Counter[int]] = field(default_factory=dict)
    kernel_handles: dict[int, set[int]] = field(default_factory=dict)  # pid -> sampled kernels
    unattributed: dict[int, Flame] = field(default_factory=lambda: defaultdict(Flame))
    stats: Counter[str] = field(default_factory=Counter)

    pids: set[int] = field(default_factory=set)  # processes stacks were sampled in
    enabled: bool = False  # the capture said stack sampling runs (StackSampling)
    exited: dict[int, int] = field(default_factory=dict)  # pid -> when its state goes

    def sampled(self, pid: int) -> bool:
        """Whether ``pid``'s GPU work gets flames: once stack sampling runs, all of it
        (a unit with no sample yet is ``[no stack sampled]``, later ones are split by
        the process's samples so far)."""
        return self.enabled or pid in self.pids

    def exit(self, pid: int, ts: int, after_ns: int) -> None:
        """Process ``pid`` exited at ``ts``: its state goes at ``ts + after_ns`` (once its
        last steps are settled and its records exported), unless it shows up again
        first (a new process with the same pid)."""
        if pid in self.pids or any(k[0] == pid for k in self.frames):
            self.exited[pid] = ts + after_ns

    def prune(self, now: int) -> None:
        """Forget the processes whose time came (``exit``)."""
        for pid in [p for p, at in self.exited.items() if at <= now]:
            del self.exited[pid]
            self.pids.discard(pid)
            self.kernel_handles.pop(pid, None)
            self.unattributed.pop(pid, None)
            for d in (self.pending, self.frames, self.by_unit):
                for k in [k for k in d if k[0] == pid]:
                    del d[k]
            self.stats["stack_processes_pruned"] += 1

    def counts(self, ev: StackCounts) -> None:
        """A thread's sampled stacks: held for its next burst."""
        self.stats["stack_count_records"] += 1
        if self.exited:
            self.exited.pop(ev.pid, None)
        self.pending.setdefault((ev.pid, ev.tid), []).append(ev)
        self.pids.add(ev.pid)
        for sid, what, handle, n in ev.entries:
            u = unit_of(what, handle)
            self.by_unit.setdefault((ev.pid, u), Counter())[sid] += n
            if u[0] == KERNEL:
                self.kernel_handles.setdefault(ev.pid, set()).add(u[1])

    def define(self, ev: StackFrames) -> None:
        if self.exited:
            self.exited.pop(ev.pid, None)
        self.frames.setdefault((ev.pid, ev.stack_id), ev)

    def take(self, b: KernelBurst) -> Counter[tuple[int, Unit]] | None:
        """The samples taken in burst ``b`` (by stack id and unit), or None. Counts sent
        for an earlier burst that never came (lost) are dropped and counted."""
        got = self.pending.pop((b.pid, b.tid), None)
        if not got:
            return None
        out: Counter[tuple[int, Unit]] = Counter()
        for ev in got:
            if ev.burst_ts and ev.burst_ts != b.first_ts:
                self.stats["stack_counts_without_burst"] += sum(e[3] for e in ev.entries)
                continue
            for sid, what, handle, n in ev.entries:
                out[(sid, unit_of(what, handle))] += n
        return out

    def _overflow_share(self, pid: int, units: Counter[Unit]) -> Counter[tuple[int, int]]:
        """(stack id, handle) -> samples of ``pid``'s kernels other than those in
        ``units``' slots: how launches past a burst's slots are split when the burst
        itself sampled none of them."""
        dist: Counter[tuple[int, int]] = Counter()
        for h in self.kernel_handles.get(pid, ()):
            if (KERNEL, h) not in units:
                for sid, c in self.by_unit[(pid, (KERNEL, h))].items():
                    dist[(sid, h)] += c
        return dist

    def weights(self, pid: int, units: Counter[Unit], samples: Counter[tuple[int, Unit]],
                time_ns: float) -> Flame:
        """One step's (or burst's) exact calls per unit, split among stacks."""
        out = Flame()
        total = sum(units.values())
        per_call = time_ns / total if total else 0.0
        # unit -> {(stack id, handle): samples}
        by_unit: dict[Unit, Counter[tuple[int, int]]] = defaultdict(Counter)
        for (sid, (what, handle)), n in samples.items():
            by_unit[(what, handle)][(sid, handle)] += n
        if OVERFLOW in units:  # launches past the slots: sampled kernels not in the slots
            for u in [u for u in by_unit if u[0] == KERNEL and u not in units]:
                by_unit[OVERFLOW].update(by_unit.pop(u))
        for u, n in units.items():
            what, handle = u
            seen = by_unit.pop(u, None)
            dist = seen
            if not dist and u != OVERFLOW:
                proc = self.by_unit.get((pid, u))
                dist = Counter({(sid, handle): c for sid, c in proc.items()}) if proc else None
                if dist:
                    self.stats["stack_calls_by_process_share"] += n
            elif not dist and any(w == KERNEL and h > 0 for w, h in units):
                # launches past full slots, none sampled in this step: split like the
                # process's samples of the kernels this burst's slots do not hold
                dist = self._overflow_share(pid, units)
                if dist:
                    self.stats["stack_calls_by_process_share"] += n
            if not dist:
                out[(pid, 0, what, max(handle, 0))] = [float(n), n * per_call, 0.0]
                self.stats["stack_calls_unsampled"] += n
                continue
            mass = sum(dist.values())
            for (sid, h), c in dist.items():
                share = n * c / mass
                cur = out.setdefault((pid, sid, what, h), [0.0, 0.0, 0.0])
                cur[0] += share
                cur[1] += share * per_call
                cur[2] += float(c) if seen else 0.0
        for u, left in by_unit.items():  # samples of calls this step did not count
            for (sid, h), c in left.items():
                cur = out.setdefault((pid, sid, u[0], h), [0.0, 0.0, 0.0])
                cur[2] += c
        return out


# ---- frames --------------------------------------------------------------------------

Frame = tuple[str, str, str, int]  # (kind "py"/"native"/"sep"/"gpu", name, file, line)


def _python_frame(text: str) -> Frame:
    name, _, rest = text.partition("\t")
    fname, _, line = rest.partition("\t")
    return ("py", name, fname, int(line) if line.isdigit() else 0)


def _native_frame(text: str) -> Frame:
    name, _, lib = text.partition("\t")
    if not name:
        return ("native", lib, lib.split("+", 1)[0], 0)
    return ("native", name, lib, 0)


def gpu_label(what: int, handle: int, kernel_name: Callable[[int], str]) -> str:
    if what == KERNEL:
        return kernel_name(handle) if handle > 0 else "[kernels past the burst's slots]"
    if what == GRAPH:
        return "[CUDA graph launch]"
    if COPY <= what < COPY + len(COPY_NAMES):
        return f"[memcpy {COPY_NAMES[what - COPY]}]"
    return f"[{what_label(what)}]"


def resolve(flame: Flame, book: StackBook, kernel_name: Callable[[int, int], str]
            ) -> list[tuple[tuple[Frame, ...], float, float, float]]:
    """The flame's stacks as frames (root first: Python, native, separator, kernel),
    with their [calls, GPU time ns, samples]; identical stacks merged."""
    merged: dict[tuple[Frame, ...], list[float]] = {}
    for (pid, sid, what, handle), (n, t, s) in flame.items():
        top: Frame = ("gpu", gpu_label(what, handle, lambda h: kernel_name(pid, h)), "", 0)
        if sid == 0:
            body: tuple[Frame, ...] = (("native", "[no stack sampled]", "", 0),)
        else:
            fr = book.frames.get((pid, sid))
            if fr is None:
                body = (("native", f"[stack {sid:#x} not resolved]", "", 0),)
            else:
                body = (tuple(_python_frame(p) for p in fr.python)
                        + tuple(_native_frame(x) for x in fr.native))
        frames = body + (("sep", SEPARATOR, "", 0), top)
        cur = merged.setdefault(frames, [0.0, 0.0, 0.0])
        cur[0] += n
        cur[1] += t
        cur[2] += s
    return [(k, v[0], v[1], v[2]) for k, v in merged.items()]


def to_json(stacks: Iterable[tuple[tuple[Frame, ...], float, float, float]]) -> dict:
    """A compact JSON form (frames interned): what span JSONL lines carry."""
    index: dict[Frame, int] = {}
    rows = []
    for frames, n, t, s in stacks:
        ids = [index.setdefault(f, len(index)) for f in frames]
        rows.append([ids, round(n, 4), round(t, 1), round(s, 4)])
    return {"frames": [list(f) for f in index], "stacks": rows}


def from_json(doc: dict) -> list[tuple[tuple[Frame, ...], float, float, float]]:
    """The inverse of ``to_json``; ValueError for a malformed document."""
    try:
        frames = [(str(f[0]), str(f[1]), str(f[2]), int(f[3])) for f in doc["frames"]]
        return [(tuple(frames[i] for i in ids), float(n), float(t), float(s))
                for ids, n, t, s in doc["stacks"]]
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"not a flame: {e}") from None


def step_units(step: "Step") -> Counter[Unit]:  # noqa: F821 (steps.Step)
    """A step's GPU calls by unit (exact): kernel launches by handle, launches past the
    bursts' slots, graph launches, memcpy calls by direction, NCCL calls by op."""
    out: Counter[Unit] = Counter({(KERNEL, h): n for h, n in step.kernels.items() if n})
    past = step.launches - sum(step.kernels.values())
    if past > 0:
        out[OVERFLOW] = past
    graphs = int(step.work.get("graph_launches", 0))
    if graphs:
        out[(GRAPH, 0)] = graphs
    for i, n in enumerate(step.copy_calls):
        if n:
            out[(COPY + i, 0)] = n
    for op, n in step.nccl_calls.items():
        out[(nccl_what(op), 0)] += n
    return out

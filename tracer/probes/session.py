"""A live capture: load the probes, choose processes, and stream capture items.

A capture item is either the raw bytes of one ring-buffer record (decoded later by
``tracer.events.schema.decode``, the same way live and on replay) or a user-space
event read from /proc (``ProcessInfo``, ``SocketInfo``) or from the loss counters
(``DropReport``). Items go to ``sink`` in the order they happened to the capture.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from tracer.events import schema, wire
from tracer.events.gpu import MEMSET_GATE, SAMPLED_COPY_MASK, SYNC_GATE, GpuSampling
from tracer.events.netwait import NetTimingMode
from tracer.events.runs import RunArmed
from tracer.probes import loader, procfs, ringbuf, sockdiag
from tracer.probes.bpfstats import (ProgramCost, ProgramStats, early_exit_ns, format_costs,
                                    missed_runs)
from tracer.probes.gpu import GpuProbes

C = wire.CONSTANTS
CaptureItem = bytes | schema.Event
POLL_MS = 20  # see poll()
# The longest a poll reads the ring before its periodic work (the --gpu-sample duty
# cycle, the control socket, counters). A read used to go on while records kept coming:
# an agent behind its ring (two loaded benches on the dev VM) read for minutes, left a
# sampling window open all along and answered no `ctl` (120-s timeouts). The next poll
# then reads again at once.
DRAIN_BUDGET_S = 0.01
STACK_SCAN_WAIT_S = 10.0  # at start: the traced interpreters found before polling begins
PARALLEL_DETACH = 32  # tracepoints detached at once by pause: all of them (see there)
Sink = Callable[[CaptureItem], None]


@dataclass
class CaptureConfig:
    """What to trace and how much of it to keep."""

    pids: list[int] = field(default_factory=list)
    comms: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    capture_limit: int = 256 * 1024  # payload bytes captured per syscall
    ringbuf_mb: int = 32
    rescan_interval_s: float = 2.0  # look for new --comm/--port processes this often
    counters_interval_s: float = 1.0
    # cuda must precede process: process.c flushes a thread's GPU burst at its exit;
    # tls follows sockets (and netwait), whose structures it uses
    concerns: tuple[str, ...] = ("cuda", "nccl", "ibverbs", "process", "sockets", "tls")
    burst_ns: int = 10_000_000  # a thread's GPU burst is flushed at least this often
    burst_min_ns: int = 0  # ...and at a sync only if it is at least this old
    gpu_rescan_interval_s: float = 1.0  # look for newly loaded GPU libraries
    gpu_sample: float = 1.0  # share of each period the launch probes are attached
    # None: 1 s through uprobe_multi links (a detach takes ~0.1 s), 5 s through perf
    # events (~1 s); shorter periods refresh --gpu-sample's step references more often
    gpu_sample_period_s: float | None = None
    counter_maps_interval_s: float = 1.0  # read the kernel's counter maps (kernels, ibverbs)
    # kernel names by host stub (tracer/probes/stubnames.py): libcudart's launch probes
    # stay attached until runtime launches went on this long with no new stub (0: never
    # attach them)...
    stub_names_quiet_s: float = 5.0
    stub_names_max_s: float = 60.0  # ...or went on this long in all
    # the probes on cuKernelGetFunction (tracer/probes/lookups.py) are detached once
    # look-ups went on this long with no new alias, attached again when a new process
    # or an unnamed handle turns up (0: attached all along)
    alias_lookups_quiet_s: float = 5.0
    # uprobes through uprobe_multi links where the kernel has them ("auto"), always
    # ("multi": an error where it has not) or as BCC's perf events ("perf"); see
    # tracer/probes/uprobes.py
    uprobe_links: str = "auto"
    exclude_pids: set[int] = field(default_factory=set)
    # time requests at the socket (bpf/netwait.c) where the kernel allows ("auto"), or
    # keep the server's syscall times ("syscall"); TOKENTRACE_NET_TIMING sets the default
    net_timing: str = field(default_factory=lambda: os.environ.get("TOKENTRACE_NET_TIMING",
                                                                   "auto"))
    listen_scan_interval_s: float = 1.0  # look for ports traced servers started listening on
    # launch-site stacks (bpf/stacks.c, docs/flame.md): a thread's GPU calls are sampled
    # every this many on average (0: no stack sampling); jitter off samples exactly
    # every N-th call (tests); stack_slice: bytes of user stack unwound per new stack
    stack_every: int = 0
    stack_jitter: bool = True
    stack_slice: int = 16384
    # stage streamed responses' token writes in the kernel (bpf/sockets.c, "runs"):
    # one record per RUN_MAX tokens instead of one each, once the agent arms a response;
    # TOKENTRACE_TOKEN_RUNS=0 sets the default off
    token_runs: bool = field(default_factory=lambda: os.environ.get("TOKENTRACE_TOKEN_RUNS",
                                                                    "1") != "0")
    # the socket probes keep each thread's call in flight in task-local storage where
    # the kernel has it (bpf/sockets.c); TOKENTRACE_TASK_STORAGE=0: in a hash map, as
    # kernels without it do (to compare the two)
    task_storage: bool = field(
        default_factory=lambda: os.environ.get("TOKENTRACE_TASK_STORAGE", "1") != "0")


def clock_sync(samples: int = 5) -> schema.ClockSync:
    """Pair CLOCK_MONOTONIC (what BPF stamps) with wall time; the tightest of a few reads."""
    best: tuple[int, int, int] | None = None
    for _ in range(samples):
        m0 = time.monotonic_ns()
        w = time.time_ns()
        m1 = time.monotonic_ns()
        if best is None or m1 - m0 < best[0]:
            best = (m1 - m0, (m0 + m1) // 2, w)
    assert best is not None
    return schema.ClockSync(mono_ns=best[1], wall_ns=best[2])


class CaptureSession:
    """Owns the BPF program for one `run` or `record`."""

    def __init__(self, config: CaptureConfig, sink: Sink) -> None:
        self.config = config
        self.sink = sink
        self.bpf: Any = None
        self.ring: Any = None  # the events ring buffer's reader (ringbuf.open_reader)
        self.pids: set[int] = set()
        self._listen_cache: dict[tuple[int, int], tuple[int, str, int]] = {}
        self._next_rescan = 0.0
        self._next_counters = 0.0
        self._drained_to = time.monotonic_ns()  # the last drain that read all (_drain)
        self._lost_seen = 0  # records lost to the ring, at the last report
        self._exclude = set(config.exclude_pids) | {os.getpid()}
        self.user_counters: Counter[str] = Counter({"undecodable_records": 0})
        self.gpu: GpuProbes | None = None
        self._next_gpu_scan = 0.0
        self._next_counter_maps = 0.0
        self._next_sample_toggle = 0.0
        self.detach_s = 0.0  # how long detaching the GPU uprobes took at stop
        self.concerns = tuple(config.concerns)
        self.net_timing = NetTimingMode(ts=0, mode="syscall", reason="not started")
        self._nw_ports: set[int] = set()
        self._next_listen_scan = 0.0
        self.tls: Any = None  # tracer.probes.tls.TlsProbes when the TLS probes load
        self._next_tls_scan = 0.0
        self.paused = False
        self.uprobes_off = False  # --control uprobes off: the socket probes alone
        self._parked_tps: list[bytes] = []  # tracepoints taken out by pause()
        self.program_stats = ProgramStats()  # --control probe-stats on|off
        self.switches = 0  # pauses, resumes and other switches of whole probe sets
        self.analysis = True  # control "analysis off": records read and dropped
        self._own_netns = procfs.netns(os.getpid())  # sock_diag answers for this one
        self.dropped_unanalysed = 0
        self.records_read = 0  # ring-buffer records, for `status`
        self.stacks: Any = None  # tracer.probes.stacks.StackSampler with --stacks
        self._arm_seq = 0  # token-run arms written (RunArmed.arm)
        self.token_runs = False  # the kernel stages token writes (set at start)
        self.task_storage = False  # the call in flight in task storage (set at start)
        self._io_epoch = 1  # CFG_IO_EPOCH: bumped at each resume

    # ---- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        """Compile, configure and attach; emit the clock sync and the first targets."""
        self.net_timing = self._choose_net_timing()
        cflags = []
        if self.config.stack_every and "cuda" in self.concerns:
            i = self.concerns.index("cuda")  # cuda.c and nccl.c call into stacks.c
            self.concerns = self.concerns[:i] + ("stacks",) + self.concerns[i:]
            cflags.append("-DTT_STACKS")
        # the socket probes' call in flight: in each thread's own storage where the
        # kernel has it (bpf/sockets.c), else a hash map
        if "sockets" in self.concerns and self.config.task_storage:
            self.task_storage = loader.task_storage_missing() is None
            if self.task_storage:
                cflags.append("-DTT_TASK_STORAGE")
            else:
                self.user_counters["task_storage_unavailable"] = 1
        self.bpf = loader.compile_program(self.concerns, self.config.ringbuf_mb, cflags)
        if "stacks" in self.concerns:
            from tracer.events.stacks import StackSampling
            from tracer.probes.stacks import StackSampler

            self.stacks = StackSampler(self.bpf, self.config.stack_every,
                                       self.config.stack_jitter, self.config.stack_slice)
            self.sink(StackSampling(ts=time.monotonic_ns(), every=self.config.stack_every))
        config = self.bpf[b"config"]
        config[ctypes.c_int(C["CFG_CAPTURE_LIMIT"])] = ctypes.c_uint64(self.config.capture_limit)
        config[ctypes.c_int(C["CFG_BURST_NS"])] = ctypes.c_uint64(self.config.burst_ns)
        config[ctypes.c_int(C["CFG_BURST_MIN_NS"])] = ctypes.c_uint64(self.config.burst_min_ns)
        if "cuda" in self.config.concerns:
            self.gpu = GpuProbes(self.bpf, self.config.stub_names_quiet_s,
                                 self.config.stub_names_max_s, self.config.uprobe_links,
                                 self.config.alias_lookups_quiet_s)
            if self.config.gpu_sample < 1.0:
                # the first period starts "on" (so libraries found now attach their
                # launch probes) and says so
                self._begin_sampled_period()
        if "tls" in self.concerns:
            self._start_tls()
        for name in self.config.comms:
            key = self.bpf[b"traced_comms"].Key()
            key.comm = name.encode()[:15]
            self.bpf[b"traced_comms"][key] = ctypes.c_uint32(1)
        self.token_runs = self.config.token_runs and "sockets" in self.concerns
        if self.token_runs:
            try:
                loader.load_run_exit(self.bpf)
            except loader.ProbeSetupError:  # a record per token, as without
                self.token_runs = False
                self.user_counters["token_runs_unavailable"] = 1
        self.ring = ringbuf.open_reader(self.bpf, b"events", self._on_record)
        self.sink(clock_sync())
        self.sink(NetTimingMode(ts=time.monotonic_ns(), mode=self.net_timing.mode,
                                reason=self.net_timing.reason))
        self.rescan()
        if self.stacks is not None:  # the first calls after attach get Python frames too
            self.stacks.settle(STACK_SCAN_WAIT_S)

    def poll(self, timeout_ms: int = POLL_MS) -> None:
        """Deliver what the ring buffer holds, and run the periodic work. Records do
        not wake the poller one by one (see submit() in bpf/common.h), so this sleeps
        up to ``timeout_ms`` and then takes everything that arrived."""
        self.ring.wait(0 if self.ring.behind else timeout_ms)
        # Records sent without a wake-up do not make epoll report the ring ready, so
        # waiting alone would leave them until a forced wake-up: take them now.
        drained_to = self._drain()
        now = time.monotonic()
        if now >= self._next_rescan and (self.config.comms or self.config.ports):
            self._next_rescan = now + self.config.rescan_interval_s
            self.rescan()
        if self.gpu is not None and now >= self._next_gpu_scan:
            # libraries loaded after attach (a lazily imported torch.cuda, NCCL at init)
            self._next_gpu_scan = now + self.config.gpu_rescan_interval_s
            for pid in sorted(self.pids):
                self.gpu.scan(pid)
                if self.stacks is not None:
                    self.stacks.scan(pid)
        if (self.gpu is not None and self.config.gpu_sample < 1.0 and not self.paused
                and now >= self._next_sample_toggle):
            self._toggle_launch_probes(now)
        if self.stacks is not None:
            for frames in self.stacks.take():  # stacks resolved since the last poll
                self.sink(frames)
        if self.gpu is not None:
            for name in self.gpu.stubs.resolve():  # host stubs sent during this poll
                self.sink(name)
            self.gpu.stubs.tick(now)
            self.gpu.lookups.tick(now)
            if "ibverbs" in self.config.concerns:
                self.gpu.verbs.attach_pending()  # contexts learned during this poll
            if now >= self._next_counter_maps:
                self._next_counter_maps = now + self.config.counter_maps_interval_s
                self._collect_counters()
        if self.tls is not None and now >= self._next_tls_scan:
            # TLS libraries loaded after attach (Python imports ssl lazily)
            self._next_tls_scan = now + self.config.gpu_rescan_interval_s
            for pid in sorted(self.pids):
                self._tls_scan(pid)
        if self.net_timing.mode == "socket" and now >= self._next_listen_scan:
            self._next_listen_scan = now + self.config.listen_scan_interval_s
            self._watch_all_listeners()
        if now >= self._next_counters:
            self._next_counters = now + self.config.counters_interval_s
            # every interval, changed or not: its time stamp is also the stream's clock
            # for an idle server (the correlator releases what is due; a replay sees the
            # same ticks)
            self.report_counters(drained_to)

    def _drain(self) -> int:
        """Read the records the ring holds, for ``DRAIN_BUDGET_S`` at most; returns a
        time no later than any record still unread: stamped before a drain that read
        all, every record stamped earlier was read (a drain cut short returns the last
        such time). The counters report carries it as the stream's clock for an idle server:
        a stamp taken after the drain could run ahead of records sent meanwhile (an
        agent held off the CPU after its drain), and a request would be timed before
        the hold of its bytes was read."""
        drained_to = time.monotonic_ns()
        self.ring.consume(DRAIN_BUDGET_S)
        if self.ring.behind:  # cut at its budget: records stamped before now still unread
            self.user_counters["drains_cut"] += 1
            return self._drained_to
        self._drained_to = drained_to
        return drained_to

    def _toggle_launch_probes(self, now: float) -> None:
        """--gpu-sample: launch probes on for ``gpu_sample`` of each period, off for the
        rest. What is counted is set by a gate in the kernel: closed before the detach
        (which runs on its own thread: ~80 ms through links, ~0.1 s per probe through
        perf events; tracer/probes/uprobes.py), opened after the attach, each
        switch an event stamped at that instant. An "on" switch waits for the previous
        detach to finish (the off span is then longer; the estimate does not mind)."""
        assert self.gpu is not None
        fraction = self.config.gpu_sample
        if self.gpu.launches_on:
            self._switch_off()
            self.gpu.detach_launch_probes()
            share = 1.0 - fraction
        else:
            if self.gpu.detaching:
                return  # polled again in POLL_MS
            attach_s = self.gpu.attach_launch_probes()
            self._gates(closed=False)
            self.sink(GpuSampling(ts=time.monotonic_ns(), enabled=True, fraction=fraction,
                                  attach_s=attach_s, detach_s=self.gpu.last_detach_s,
                                  **self._switched()))
            share = fraction
        self._next_sample_toggle = time.monotonic() + self.sample_period_s() * share

    def _switch_off(self) -> None:
        """Close the kernel's gates of what --gpu-sample switches, said by an "off"
        switch stamped before they close, as an "on" one is after they open: a span
        counted is never wider than the gates were open (the two map writes take ~10
        us)."""
        off = GpuSampling(ts=time.monotonic_ns(), enabled=False,
                          fraction=self.config.gpu_sample, **self._switched())
        self._gates(closed=True)
        self.sink(off)

    def _switched(self) -> dict[str, bool]:
        """What goes on and off with the launch probes, as a switch event says it."""
        assert self.gpu is not None
        return {"copies": self.gpu.copies_switched, "memsets": self.gpu.memsets_switched}

    def _gates(self, closed: bool) -> None:
        """The kernel's gates of what --gpu-sample switches: the launches', and the
        copies (SAMPLED_COPY_KINDS)' with the syncs', and the memsets', where they are
        switched with them (else open)."""
        assert self.gpu is not None
        gate = self.bpf[b"config"]
        gate[ctypes.c_int(C["CFG_LAUNCH_GATE_CLOSED"])] = ctypes.c_uint64(closed)
        mask = ((SAMPLED_COPY_MASK | SYNC_GATE if self.gpu.copies_switched else 0)
                | (MEMSET_GATE if self.gpu.memsets_switched else 0))
        gate[ctypes.c_int(C["CFG_COPY_GATE_CLOSED"])] = ctypes.c_uint64(mask if closed else 0)

    def _begin_sampled_period(self, reason: str = "") -> None:
        """--gpu-sample: a period starts with the launch probes on, said by a switch."""
        assert self.gpu is not None
        fraction = self.config.gpu_sample
        self.sink(GpuSampling(ts=time.monotonic_ns(), enabled=True, fraction=fraction,
                              reason=reason, **self._switched()))
        self._next_sample_toggle = (time.monotonic()
                                    + self.sample_period_s() * fraction)

    def sample_period_s(self) -> float:
        """--gpu-sample's period: as configured, else ``default_sample_period_s``."""
        if self.config.gpu_sample_period_s:
            return self.config.gpu_sample_period_s
        return self.default_sample_period_s()

    def default_sample_period_s(self) -> float:
        """--gpu-sample's period where none is set: by how the launch probes detach
        (1 s through uprobe_multi links, 5 s through perf events)."""
        return 1.0 if self.gpu is not None and self.gpu.uprobes.multi else 5.0

    def set_gpu_sample(self, fraction: float, reason: str = "", copies: bool = False,
                       memsets: bool = False) -> float:
        """Change ``--gpu-sample`` while running (``--control gpu-sample F``, or
        ``--gpu-sample auto`` with its ``reason``). From counting every launch,
        sampling starts with the probes on for ``F`` of a period; back at 1 they are
        attached (once a detach under way ends) and the gate opened. ``copies``: the
        sampled copies' probes (SAMPLED_COPY_KINDS) and the syncs' are switched with the
        launch probes (``memsets``: the memsets' probes; from sampling's start; a
        fraction already in force keeps its choice). Every change
        is a ``GpuSampling`` switch, so the estimate of launch counts
        (tracer/correlate/sampling.py) sees which spans were counted."""
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"gpu-sample must be in (0, 1], not {fraction:g}")
        if self.gpu is None:
            raise ValueError("no GPU probes")
        if self.paused:
            raise ValueError("paused: resume first")
        old, self.config.gpu_sample = self.config.gpu_sample, fraction
        if fraction == old:
            return fraction
        if fraction < 1.0:
            if self.gpu.launches_on:  # the first sampled period begins "on", as at start
                if old == 1.0:
                    self.gpu.switch_groups(copies, memsets)
                self._begin_sampled_period(reason)
            else:  # off: the next toggle turns them on at the new share; said now
                self.sink(GpuSampling(ts=time.monotonic_ns(), enabled=False,
                                      fraction=fraction, reason=reason, **self._switched()))
            return fraction
        self.gpu.join_detach()
        attach_s = self.gpu.attach_launch_probes()
        self.gpu.switch_groups(False)
        self._gates(closed=False)
        self.sink(GpuSampling(ts=time.monotonic_ns(), enabled=True, fraction=fraction,
                              attach_s=attach_s, detach_s=self.gpu.last_detach_s,
                              reason=reason))
        return fraction

    def _collect_counters(self) -> None:
        """Send what the kernel's cumulative counter maps gained since the last read."""
        assert self.gpu is not None
        for raw in self.gpu.collect():
            self.sink(raw)
        self.gpu.stubs.prune()
        if "ibverbs" in self.config.concerns:
            for raw in self.gpu.verbs.collect():
                self.sink(raw)

    def stop(self) -> None:
        """Drain what is left and report the final counters."""
        if self.bpf is None:
            return
        self.ring.consume()
        if self.gpu is not None:
            for name in self.gpu.stubs.resolve():
                self.sink(name)
        if self.gpu is not None and self.config.gpu_sample < 1.0:
            self._switch_off()  # the end of the sampled span: no launch after it counted
        if self.tls is not None:
            self.tls.close()
        if self.gpu is not None:
            self.detach_s = self.gpu.close()  # before the drain: no launch after it
            if self.stacks is not None:
                self.ring.consume()  # the last STACKDEFs
                for raw in self.stacks.drain():  # before the bursts they belong to
                    self.sink(raw)
                for frames in self.stacks.finish():
                    self.sink(frames)
            for raw in self.gpu.drain():  # bursts not yet flushed: counts stay exact
                self.sink(raw)
            self._collect_counters()  # the final per-kernel and ibverbs counts
        if "sockets" in self.concerns:
            self.bpf[b"run_arms"].clear()  # no write is staged after this...
            self.ring.consume()
            self._take_staged_runs()  # ...and what was, the probes did not send
        self.report_counters(self._drain())  # with what the socket probes sent meanwhile
        self.ring.close()
        self.program_stats.disable()
        # BCC's cleanup detaches one tracepoint after the other, each waiting out the
        # kernel's grace period: 2.1 s for the 29 of them on the dev VM; from threads
        # 1.05 s (the kernel serialises part of each detach)
        self._detach_tracepoints(list(self.bpf.tracepoint_fds))
        self.bpf.cleanup()
        self.bpf = None

    # ---- pause and resume (tokentrace run: SIGUSR1 / SIGUSR2, --control) ---------

    # Tracepoints that stay in place while paused: processes starting and ending (rare,
    # and what keeps the traced set right across the pause).
    KEEP_WHILE_PAUSED = (b"sched:",)
    # Kernel maps of calls in flight and of connections: stale after a pause (their
    # other half, or the close, was missed), emptied before the probes go back.
    STALE_AFTER_PAUSE = (b"io_inflight", b"accept_inflight", b"connect_inflight", b"conns",
                         b"nw_socks", b"sync_inflight", b"name_inflight",
                         b"alloc_inflight", b"stub_pending", b"nccl_inflight",
                         b"verbs_poll_inflight", b"verbs_mr_inflight", b"verbs_qp_inflight",
                         # TLS objects tied to sockets whose conn_ids the resume renews:
                         # met again as after an attach (bpf/tls.c)
                         b"tls_calls", b"tls_ssls", b"tls_socks", b"tls_rbios", b"tls_bios",
                         b"tls_last_in", b"tls_egress", b"run_arms", b"run_stages")

    def pause(self, duty: float = 0.0) -> float:
        """Take every probe out but the process-lifecycle tracepoints, so the traced
        processes run as if untraced; the agent keeps its state (names, models, counts)
        and goes on polling. Open requests end at the pause (``TracingPaused``;
        ``duty``: a ``--duty-cycle`` switch, its fraction). Returns the seconds the
        switch took."""
        if self.paused or self.bpf is None:
            return 0.0
        t0 = time.perf_counter()
        self.paused = True
        self.switches += 1
        parked = [tp for tp in self.bpf.tracepoint_fds
                  if not tp.startswith(self.KEEP_WHILE_PAUSED)]
        # Each detach waits out the kernel's tracepoint grace period (~70 ms on the dev
        # VM: 1.8 s for the 26 of them one after the other); from threads the waits
        # overlap (0.7-0.9 s for the whole pause). BCC's detach only closes the event's
        # fd and drops its own dict entry.
        self._detach_tracepoints(parked)
        self._parked_tps += parked
        self._suspend_uprobes()
        self.ring.consume()  # what was sent before the probes came out
        self._take_staged_runs()  # ...and what they staged
        self._drain_bursts()
        took = time.perf_counter() - t0
        self.sink(schema.TracingPaused(ts=time.monotonic_ns(), paused=True, switch_s=took,
                                       duty=duty))
        return took

    def _detach_tracepoints(self, tps: list[bytes]) -> None:
        """Detach ``tps`` from a thread each: each detach waits out the kernel's
        tracepoint grace period, and from threads the waits overlap."""
        with ThreadPoolExecutor(max_workers=min(PARALLEL_DETACH, max(1, len(tps)))) as pool:
            list(pool.map(self.bpf.detach_tracepoint, tps))

    def _attach_tracepoint(self, tp: bytes) -> None:
        """Attach ``tp`` (``category:name``) again to its TRACEPOINT_PROBE program."""
        self.bpf.attach_tracepoint(tp=tp, fn_name=b"tracepoint__" + tp.replace(b":", b"__"))

    def resume(self, duty: float = 0.0) -> float:
        """Put the probes back (after ``pause``); sockets are adopted afresh, as at
        attach. ``duty``: the ``--duty-cycle`` fraction in force from here (0: none).
        Returns the seconds the switch took."""
        if not self.paused or self.bpf is None:
            return 0.0
        t0 = time.perf_counter()
        self.switches += 1
        for name in self.STALE_AFTER_PAUSE:
            if name == b"io_inflight" and self.task_storage:
                continue  # per-thread slots, not a table: the epoch below retires them
            try:
                self.bpf[name].clear()
            except KeyError:
                pass  # that concern is not loaded
        self._io_epoch += 1  # calls entered before the pause are not taken at their exit
        self.bpf[b"config"][ctypes.c_int(C["CFG_IO_EPOCH"])] = ctypes.c_uint64(self._io_epoch)
        for tp in self._parked_tps:
            self._attach_tracepoint(tp)
        self._parked_tps = []
        if not self.uprobes_off:
            for attacher, errors in self._uprobe_attachers():
                attacher.resume(errors)
        self.paused = False
        took = time.perf_counter() - t0
        self.sink(schema.TracingPaused(ts=time.monotonic_ns(), paused=False, switch_s=took,
                                       duty=duty))
        for pid in sorted(self.pids):
            self._adopt_sockets(pid)
        return took

    def _uprobe_attachers(self) -> list[tuple[Any, dict[str, str]]]:
        """Each uprobe attacher in use, once (TLS shares the GPU probes' when both run),
        with the error dict its owner keeps."""
        got: list[tuple[Any, dict[str, str]]] = []
        if self.gpu is not None:
            got.append((self.gpu.uprobes, self.gpu.errors))
        if self.tls is not None and (self.gpu is None or self.tls.uprobes is not self.gpu.uprobes):
            got.append((self.tls.uprobes, self.tls.errors))
        return got

    def _suspend_uprobes(self) -> None:
        if self.gpu is not None:
            self.gpu.join_detach()  # a --gpu-sample detach under way finishes first
        for attacher, errors in self._uprobe_attachers():
            attacher.suspend(errors)

    def _drain_bursts(self) -> None:
        """Send the GPU bursts open now (their probes just came out): counts stay exact."""
        if self.gpu is not None:
            for raw in self.gpu.drain():
                self.sink(raw)

    def set_uprobes(self, on: bool) -> float:
        """Every uprobe (GPU, NCCL, ibverbs, TLS) out, or back, while the socket and TCP
        tracepoints stay (``--control uprobes off|on``): what the socket probes cost on
        their own, for bench/real_server.py. The analysis sees no GPU work meanwhile.
        ``--gpu-sample``'s switches go on and take effect at ``on``. Returns the seconds
        the switch took."""
        if self.paused:
            raise ValueError("paused: resume first")
        if on != self.uprobes_off:
            return 0.0
        t0 = time.perf_counter()
        self.uprobes_off = not on
        self.switches += 1
        if on:
            for attacher, errors in self._uprobe_attachers():
                attacher.resume(errors)
        else:
            self._suspend_uprobes()
            self.ring.consume()  # the bursts sent before, ahead of those still open
            self._drain_bursts()
        return time.perf_counter() - t0

    def control(self, command: str) -> str:
        """One ``--control`` command; the reply (``ok ...`` or ``error: ...``).

        ``pause`` / ``resume``: all probes out / back; ``status``; ``counters`` (the
        loss counters so far, as the report at exit names them, one JSON object); and, to measure
        what each part costs (bench/real_server.py): ``capture-limit BYTES`` (payload
        bytes copied per syscall), ``burst-min-us US``, ``gpu-launch off|on`` (the
        kernel-launch uprobes), ``uprobes off|on`` (every uprobe: the socket and TCP
        probes alone), ``net-timing syscall|socket`` (the socket-level timing,
        bpf/netwait.c), ``stub-naming off|on`` (libcudart's launch probes),
        ``alias-lookups off|on`` (the probes on cuKernelGetFunction), ``analysis
        off|on`` (records read from the ring buffer and dropped, counted),
        ``sample-period SECONDS|default`` (``--gpu-sample-period``, from the next
        switch)."""
        words = command.split()
        if not words:
            return "error: empty command"
        cmd, args = words[0], words[1:]
        cfg = self.bpf[b"config"] if self.bpf is not None else None
        try:
            if cmd == "pause" and not args:
                return f"ok paused {self.pause():.3f}s"
            if cmd == "resume" and not args:
                return f"ok resumed {self.resume():.3f}s"
            if cmd == "status" and not args:
                return (f"ok {'paused' if self.paused else 'tracing'} pids="
                        f"{','.join(map(str, sorted(self.pids)))} analysis="
                        f"{'on' if self.analysis else 'off'} dropped={self.dropped_unanalysed} "
                        f"records={self.records_read} "
                        f"gpu_libs={len(self.gpu.attached) if self.gpu is not None else 0}")
            if cmd == "counters" and not args and self.bpf is not None:
                return "ok " + json.dumps(self.counters(), sort_keys=True)
            if cmd == "capture-limit" and len(args) == 1 and cfg is not None:
                n = int(args[0])
                # 0 in the map means "default": one byte is the least that can be asked
                cfg[ctypes.c_int(C["CFG_CAPTURE_LIMIT"])] = ctypes.c_uint64(max(1, n))
                return f"ok capture-limit {max(1, n)}"
            if cmd == "burst-min-us" and len(args) == 1 and cfg is not None:
                cfg[ctypes.c_int(C["CFG_BURST_MIN_NS"])] = ctypes.c_uint64(int(args[0]) * 1000)
                return f"ok burst-min-us {int(args[0])}"
            if cmd == "probe-stats" and args in ([], ["on"], ["off"]) and self.bpf is not None:
                if args == ["on"]:
                    self.program_stats.enable()
                elif args == ["off"]:
                    self.program_stats.disable()
                elif not self.program_stats.enabled:
                    return "error: probe-stats is off (probe-stats on)"
                return ("ok probe-stats " + (args[0] if args else
                        format_costs(self.program_costs()))).rstrip()
            switched = set()
            while cmd == "gpu-sample" and args and args[-1] in ("copies", "memsets"):
                switched.add(args.pop())
            if cmd == "gpu-sample" and len(args) in (1, 2):
                if len(args) == 2:  # and the duty cycle's period, from the next switch
                    period = float(args[1])
                    if not period >= 0.01:
                        raise ValueError(f"gpu-sample period must be >= 0.01 s, not {args[1]}")
                    self.config.gpu_sample_period_s = period
                fraction = self.set_gpu_sample(float(args[0]), copies="copies" in switched,
                                               memsets="memsets" in switched)
                return (f"ok gpu-sample {fraction:g}"
                        + (f" {self.sample_period_s():g}" if len(args) == 2 else "")
                        + (" copies" if self.gpu is not None and self.gpu.copies_switched
                           else "")
                        + (" memsets" if self.gpu is not None and self.gpu.memsets_switched
                           else ""))
            if cmd == "sample-period" and len(args) == 1:
                # the next switch on uses it; --gpu-sample auto keeps its window's
                # length in seconds (tracer/runner.py sets the share)
                period = None if args[0] == "default" else float(args[0])
                if period is not None and not period >= 0.01:
                    raise ValueError(f"sample-period must be >= 0.01 s, not {args[0]}")
                self.config.gpu_sample_period_s = period
                return f"ok sample-period {self.sample_period_s():g}"
            if cmd == "net-timing" and args in (["socket"], ["syscall"]):
                took = self.set_net_timing(args[0] == "socket")
                return f"ok net-timing {args[0]} {took:.3f}s"
            if cmd == "uprobes" and args in (["on"], ["off"]):
                return f"ok uprobes {args[0]} {self.set_uprobes(args[0] == 'on'):.3f}s"
            if (cmd in ("gpu-launch", "stub-naming", "alias-lookups", "analysis")
                    and args in (["on"], ["off"])):
                on = args[0] == "on"
                if cmd == "analysis":
                    self.analysis = on
                elif self.gpu is None:
                    return "error: no GPU probes"
                elif cmd == "gpu-launch":
                    if on:
                        self.gpu.join_detach()
                        self.gpu.attach_launch_probes()
                    else:
                        self.gpu.detach_launch_probes()
                        self.gpu.join_detach()
                elif cmd == "alias-lookups":
                    if on:
                        self.gpu.lookups.open_window("asked (--control alias-lookups on)")
                    else:
                        self.gpu.lookups.close_window("asked (--control alias-lookups off)")
                        self.gpu.lookups.join_detach()
                elif on:
                    self.gpu.stubs.open_window()
                else:
                    self.gpu.stubs.close_window("asked (--control stub-naming off)")
                    self.gpu.stubs.join_detach()
                return f"ok {cmd} {args[0]}"
        except (ValueError, RuntimeError, OSError) as e:
            return f"error: {e}"
        return f"error: unknown command {command!r} (see tokentrace run --help)"

    # ---- targets ----------------------------------------------------------------

    def resolve_targets(self) -> set[int]:
        """The processes named by pid, comm or port, and their descendants (children
        started later are followed from fork; these were there before we attached)."""
        found = set(p for p in self.config.pids if os.path.isdir(f"/proc/{p}"))
        for name in self.config.comms:
            found.update(procfs.pids_by_comm(name))
        for port in self.config.ports:
            found.update(procfs.pids_listening_on(port))
        for pid in list(found):
            found.update(procfs.descendants(pid))
        return found - self._exclude

    def rescan(self) -> None:
        for pid in sorted(self.resolve_targets() - self.pids):
            self.attach_pid(pid)

    def attach_pid(self, pid: int, existing_sockets: bool = True) -> None:
        """Trace ``pid``: put it in the kernel filter, describe it, adopt its sockets."""
        if pid in self._exclude:
            return
        self.bpf[b"traced"][ctypes.c_uint32(pid)] = ctypes.c_uint32(1)
        self.pids.add(pid)
        self.sink(self._process_info(pid))
        if self.gpu is not None:
            self.gpu.scan(pid)
        self._tls_scan(pid)
        if self.stacks is not None:
            self.stacks.scan(pid)
        if existing_sockets:
            self._adopt_sockets(pid)
        self._watch_listeners(pid)

    # ---- TLS (bpf/tls.c) ----------------------------------------------------------

    def _start_tls(self) -> None:
        """The TLS probes share the GPU probes' uprobe attacher (one choice of links or
        perf events per BPF object, one lock for BCC's bookkeeping)."""
        import threading

        from tracer.probes.tls import TlsProbes
        from tracer.probes.uprobes import Uprobes
        uprobes = (self.gpu.uprobes if self.gpu is not None
                   else Uprobes(self.bpf, threading.Lock(), self.config.uprobe_links))
        self.tls = TlsProbes(self.bpf, uprobes)

    def _tls_scan(self, pid: int) -> None:
        """Probe the TLS libraries ``pid`` maps that are new; say what was found."""
        if self.tls is None:
            return
        for lib in self.tls.scan(pid):
            self.sink(lib)

    # ---- socket-level timing (bpf/netwait.c) -------------------------------------

    def _choose_net_timing(self) -> NetTimingMode:
        """Add the netwait concern after sockets where asked for and possible."""
        mode = self.config.net_timing
        if "sockets" not in self.concerns:
            return NetTimingMode(ts=0, mode="syscall", reason="socket probes not loaded")
        if mode == "syscall":
            return NetTimingMode(ts=0, mode="syscall", reason="asked for (--net-timing "
                                 "syscall or TOKENTRACE_NET_TIMING=syscall)")
        if mode != "auto":
            raise loader.ProbeSetupError(f"net timing must be auto or syscall, not {mode!r}")
        missing = loader.netwait_missing()
        if missing is not None:
            return NetTimingMode(ts=0, mode="syscall", reason=missing)
        i = self.concerns.index("sockets")
        self.concerns = self.concerns[: i + 1] + ("netwait",) + self.concerns[i + 1:]
        return NetTimingMode(ts=0, mode="socket")

    NETWAIT_TRACEPOINTS = (b"tcp:tcp_probe", b"sock:inet_sock_set_state")

    def set_net_timing(self, on: bool) -> float:
        """Switch the socket-level timing (bpf/netwait.c) off or back on while running
        (``--control net-timing syscall|socket``), for bench/real_server.py to pair its
        cost in one run. Off: its two softirq tracepoints come out and its maps (ports,
        sockets, readers) are emptied, so what stays is a missed hash lookup in each
        traced socket syscall and read; spans are timed by syscalls from then on. On:
        the tracepoints go back and every socket is met as at attach (timed at the
        socket once its next ACK anchors it). A ``NetTimingMode`` record marks each
        switch, so a replay times the same spans the same way. Returns the seconds the
        switch took."""
        if self.paused:
            raise ValueError("paused: resume first")
        self.switches += 1
        if "netwait" not in self.concerns:
            raise ValueError("socket-level timing is not loaded: "
                             + (self.net_timing.reason or "--net-timing syscall"))
        if on == (self.net_timing.mode == "socket"):
            return 0.0
        t0 = time.perf_counter()
        if on:
            # the record first: what the probes send after it belongs to the new logs
            self.net_timing = NetTimingMode(ts=time.monotonic_ns(), mode="socket")
            self.sink(self.net_timing)
            for tp in self.NETWAIT_TRACEPOINTS:
                self._attach_tracepoint(tp)
            self._watch_all_listeners()
        else:
            self.bpf[b"nw_ports"].clear()  # the hooks in the syscall probes stop here
            self._nw_ports = set()
            self._detach_tracepoints(list(self.NETWAIT_TRACEPOINTS))
            self.ring.consume()  # what the probes sent before, under the old mode
            self.bpf[b"nw_socks"].clear()  # the sockets' keys kept in conns find nothing
            self.net_timing = NetTimingMode(
                ts=time.monotonic_ns(), mode="syscall",
                reason="switched off while running (--control net-timing syscall)")
            self.sink(self.net_timing)
        return time.perf_counter() - t0

    def _watch_all_listeners(self) -> None:
        """``_watch_listeners`` for every traced process, each network namespace's
        listening sockets asked once."""
        listening: dict[str, dict[int, int]] = {}
        for pid in sorted(self.pids):
            self._watch_listeners(pid, listening)

    def _watch_listeners(self, pid: int, listening: dict[str, dict[int, int]] | None = None
                         ) -> None:
        """Put ``pid``'s listening TCP ports (and --port) in the kernel's port filter:
        the softirq tracepoints keep state only for sockets on those ports. Run every
        second for every traced process: ``listening`` keeps each network namespace's
        listening sockets (inode -> port) for the round (traced processes mostly share
        one), asked of sock_diag in the agent's own namespace (the kernel's listening
        table alone), else read from the process's /proc/net/tcp."""
        if self.net_timing.mode != "socket":  # not loaded, or switched off
            return
        ports = set(self.config.ports)
        fds = procfs.socket_fds(pid)
        if fds:
            ns = procfs.netns(pid)
            ports_of = None if listening is None or ns is None else listening.get(ns)
            if ports_of is None:
                ports_of = sockdiag.tcp_listening() if ns == self._own_netns else None
                if ports_of is None:
                    ports_of = {i: e.local_port for i, e
                                in procfs.inet_sockets(pid, listening=True).items()}
                if listening is not None and ns is not None:
                    listening[ns] = ports_of
            inodes = set(fds.values())
            ports.update(port for i, port in ports_of.items() if i in inodes)
        table = self.bpf[b"nw_ports"]
        for port in sorted(ports - self._nw_ports):
            try:
                table[ctypes.c_uint16(port)] = ctypes.c_uint32(1)
            except Exception:
                self.user_counters["netwait_ports_full"] += 1
                continue
            self._nw_ports.add(port)

    def _process_info(self, pid: int) -> schema.ProcessInfo:
        return schema.ProcessInfo(
            pid=pid, ts=time.monotonic_ns(), comm=procfs.comm(pid), exe=procfs.exe(pid),
            cmdline=procfs.cmdline(pid), ppid=procfs.ppid(pid),
            container_id=procfs.container_id(pid), maps=procfs.maps(pid),
        )

    def _adopt_sockets(self, pid: int) -> None:
        """Register sockets that were connected before we attached (or inherited)."""
        if "sockets" not in self.concerns:
            return
        fds = procfs.socket_fds(pid)
        if not fds:
            return
        inet = procfs.inet_sockets(pid)
        unix = procfs.unix_sockets(pid)
        peers = sockdiag.unix_peers() if any(i in unix for i in fds.values()) else {}
        own = set(fds.values())
        conns = self.bpf[b"conns"]
        for fd, inode in sorted(fds.items()):
            e = inet.get(inode) or unix.get(inode)
            if e is None:
                continue
            if e.family == socket.AF_UNIX:
                if e.state:  # listening
                    continue
                if peers.get(inode) in own:
                    # both ends in this process: an event loop's wake-up pipe
                    self.user_counters["self_pipes_skipped"] += 1
                    continue
            elif e.state != procfs.TCP_ESTABLISHED:
                continue
            key = ctypes.c_uint64((pid << 32) | fd)
            conn_id = time.monotonic_ns()
            leaf = conns.Leaf()
            leaf.conn_id = conn_id
            leaf.role = C["ROLE_UNKNOWN"]
            try:
                conns[key] = leaf
            except Exception:
                self.user_counters["conns_full"] += 1
                continue
            self.sink(schema.SocketInfo(
                pid=pid, fd=fd, conn_id=conn_id, ts=conn_id, family=int(e.family),
                local_addr=e.local_addr, local_port=e.local_port,
                peer_addr=e.peer_addr, peer_port=e.peer_port, existing=True,
                role=C["ROLE_UNKNOWN"],
            ))

    # ---- ring buffer ------------------------------------------------------------

    def _on_record(self, buf: bytes) -> None:
        kind = wire.kind_of(buf) if len(buf) >= 4 else 0
        self.records_read += 1
        if kind == C["KIND_STACKDEF"] and self.stacks is not None:
            self.stacks.on_def(buf)  # raw stack memory: resolved here, never captured
            return
        if kind == C["KIND_PROC"] and self.token_runs:
            self._before_exit(buf)
        if self.analysis:
            self.sink(buf)
        else:
            self.dropped_unanalysed += 1
        try:
            if kind == C["KIND_CONN"]:
                self._after_conn(schema.decode(buf))
            elif kind == C["KIND_PROC"]:
                self._after_proc(schema.decode(buf))
            elif kind == C["KIND_VERBS_CTX"] and self.gpu is not None:
                self.gpu.verbs.on_context(schema.decode(buf))
            elif kind == C["KIND_KSTUB"] and self.gpu is not None:
                self.gpu.stubs.on_stub(schema.decode(buf))
            elif kind == C["KIND_KNAME"] and self.gpu is not None:
                self.gpu.lookups.on_name()  # news: the look-up window stays open
                if self.gpu.prenames:
                    name = schema.decode(buf)  # a known handle to learn driver objects from
                    self.gpu.prenames.live(name.pid, name.handle, name.name)
        except schema.WireError:
            self.user_counters["undecodable_records"] += 1

    def _after_conn(self, ev: schema.ConnEvent) -> None:
        if ev.op != C["CONN_ACCEPT"]:
            return
        local = self._listener_address(ev.pid, ev.listen_fd)
        if local is None:
            return
        family, addr, port = local
        self.sink(schema.SocketInfo(
            pid=ev.pid, fd=ev.fd, conn_id=ev.conn_id, ts=ev.ts, family=int(family),
            local_addr=addr, local_port=port, peer_addr=ev.peer_addr,
            peer_port=ev.peer_port, role=C["ROLE_SERVER"],
        ))

    def _listener_address(self, pid: int, listen_fd: int) -> tuple[int, str, int] | None:
        key = (pid, listen_fd)
        if key not in self._listen_cache:
            inode = procfs.fd_inode(pid, listen_fd)
            e = procfs.inet_sockets(pid).get(inode) or procfs.unix_sockets(pid).get(inode)
            if e is None:
                return None
            self._listen_cache[key] = (e.family, e.local_addr, e.local_port)
        return self._listen_cache[key]

    def _after_proc(self, ev: schema.ProcEvent) -> None:
        if ev.op == C["PROC_FORK"]:
            if procfs.tgid_of(ev.pid) != ev.pid:
                return  # a new thread, not a process
            self.pids.add(ev.pid)
            self.sink(self._process_info(ev.pid))
            self._tls_scan(ev.pid)  # its probes are its parent's no more (per-pid links)
            if self.gpu is not None:  # the same for the GPU probes: its own, now
                self.gpu.scan(ev.pid)
            self._adopt_sockets(ev.pid)
        elif ev.op == C["PROC_EXEC"]:
            self.pids.add(ev.pid)
            self.sink(self._process_info(ev.pid))
            if self.tls is not None:
                self.tls.forget(ev.pid)  # a new program: new libraries
                self._tls_scan(ev.pid)
            if self.stacks is not None:
                self.stacks.forget(ev.pid)  # another program: its interpreter, if any
        elif ev.op == C["PROC_EXIT"]:
            self.pids.discard(ev.pid)
            self._forget_pid(ev.pid)
            if self.gpu is not None:
                self.gpu.forget(ev.pid)
            if self.tls is not None:
                self.tls.forget(ev.pid)
            if self.stacks is not None:
                self.stacks.forget(ev.pid)

    def _forget_pid(self, pid: int) -> None:
        """A dead process's sockets were closed by the kernel, not by close(2)."""
        if "sockets" not in self.concerns:
            return
        for name in (b"conns", b"run_arms", b"run_stages"):
            table = self.bpf[name]
            for k in [k for k in table.keys() if (k.value >> 32) == pid]:
                try:
                    del table[k]
                except KeyError:
                    pass
        for key in [k for k in self._listen_cache if k[0] == pid]:
            del self._listen_cache[key]

    # ---- token runs (bpf/sockets.c) ----------------------------------------------

    def arm_runs(self, requests: list[tuple[tuple[int, int, int], bytes, bytes]]) -> None:
        """Tell the kernel these connections' token chunks (``TokenRuns.requests``:
        key, the SSE bytes before and after each token's text); each arm written is
        sent on as a ``RunArmed`` event, which the connection's runs are read with."""
        if not requests or not self.token_runs or self.paused or self.bpf is None:
            return
        table = self.bpf[b"run_arms"]
        for (pid, fd, conn_id), head, tail in requests:
            self._arm_seq += 1
            leaf = table.Leaf()
            leaf.conn_id = conn_id
            leaf.seq = self._arm_seq
            leaf.head_len = len(head)
            leaf.tail_len = len(tail)
            leaf.head_hash = wire.run_hash(head)
            leaf.tail_hash = wire.run_hash(tail)
            try:
                table[table.Key(pid << 32 | (fd & 0xFFFFFFFF))] = leaf
            except Exception:  # the map is full: these tokens keep a record each
                self.user_counters["run_arms_full"] += 1
                continue
            self.sink(RunArmed(ts=time.monotonic_ns(), pid=pid, fd=fd, conn_id=conn_id,
                               arm=self._arm_seq, head=head.decode("utf-8", "replace"),
                               tail=tail.decode("utf-8", "replace")))

    def _take_staged_runs(self, pid: int | None = None) -> None:
        """Send the runs the kernel staged and has not sent (of ``pid``, else all):
        their process died, or the probes came out. The kernel no longer adds to them
        (dead, detached or disarmed), and one it sends meanwhile is taken once: its
        writes' offsets say so (``take_run``). They are then forgotten."""
        if "sockets" not in self.concerns:
            return
        table = self.bpf[b"run_stages"]
        for k, v in list(table.items()):
            if pid is None or (k.value >> 32) == pid:
                if v.r.n:
                    self.sink(bytes(v.r))  # the RUN record, as the kernel lays it out
                    self.user_counters["runs_read_from_the_map"] += 1
                try:
                    del table[k]
                except KeyError:  # closed meanwhile
                    pass

    def _before_exit(self, buf: bytes) -> None:
        """A process's exit record: what it had staged goes first (its sockets were
        closed by the kernel, not by close(2), so nothing sent it)."""
        try:
            ev = schema.decode(buf)
        except schema.WireError:
            return
        if ev.op == C["PROC_EXIT"] and ev.pid in self.pids:
            self._take_staged_runs(ev.pid)

    # ---- loss -------------------------------------------------------------------

    def program_costs(self) -> dict[str, ProgramCost]:
        """Each loaded program's runs and run time (counted only while the kernel's
        run-time statistics are on: ``ProgramStats``)."""
        return ProgramStats.read(self.bpf.funcs) if self.bpf is not None else {}

    def traced_tracepoint_runs(self) -> int:
        """The tracepoints' runs for traced processes so far (the kernel counter
        ``traced_tp_runs``): the overhead meter sets them apart from the rest."""
        if self.bpf is None:
            return 0
        return int(sum(self.bpf[b"counters"][ctypes.c_int(C["CNT_TRACED_TP_RUNS"])]))

    def early_exit_ns(self) -> int | None:
        """What a syscall probe's run costs a process not traced, on this host
        (``bpfstats.early_exit_ns``; the kernel's statistics must be on)."""
        return early_exit_ns(self.program_costs)

    def kernel_counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        table = self.bpf[b"counters"]
        for idx, name in wire.COUNTER_NAMES.items():
            vals = table[ctypes.c_int(idx)]
            out[name] = int(sum(vals))
        return out

    def report_counters(self, ts: int) -> None:
        """Send the loss counters, stamped ``ts``: the last drain's time (``_drain``)."""
        counters = self.counters()
        self._note_ring_at_loss(counters)
        self.sink(schema.DropReport(ts=ts, counters=counters))

    def _note_ring_at_loss(self, counters: dict[str, int]) -> None:
        """When records were lost to the ring since the last report, the most the ring
        held meanwhile; ``ring_fill_at_loss_bytes`` is the least such. Near
        ``ring_bytes``, every loss was the agent falling behind (``--ringbuf-mb``);
        far below it, the ring had room and refused a record for another reason."""
        if not isinstance(self.ring, ringbuf.RingReader):
            return
        fill = self.ring.take_peak()
        lost = sum(v for k, v in counters.items() if k in wire.RING_LOSS_COUNTERS)
        if lost > self._lost_seen:
            self._lost_seen = lost
            key = "ring_fill_at_loss_bytes"
            self.user_counters[key] = counters[key] = min(self.user_counters.get(key, fill), fill)

    def counters(self) -> dict[str, int]:
        """The loss counters (and the kernel's and agent's other counts) as they stand:
        cumulative, as ``report_counters`` sends them and ``control("counters")`` says."""
        counters = self.kernel_counters()
        counters.update(self.user_counters)
        if isinstance(self.ring, ringbuf.RingReader):
            counters["ring_bytes"] = self.ring.size
            counters["ring_fill_peak_bytes"] = self.ring.peak
        if self.dropped_unanalysed:
            counters["unanalysed_records"] = self.dropped_unanalysed
        if getattr(self.ring, "errors", 0):
            counters["record_handler_errors"] = self.ring.errors
        missed = missed_runs(self.bpf.funcs)
        if missed:  # runs the kernel skipped: records never made, counted
            counters["probe_runs_missed"] = sum(missed.values())
            counters.update({f"probe_runs_missed.{k}": v for k, v in missed.items()})
        if self.gpu is not None:
            counters["gpu_attach_errors"] = len(self.gpu.errors)
            counters.update(self.gpu.stubs.counters())
        if self.tls is not None:
            counters.update(self.tls.counters())
        if self.stacks is not None:
            counters.update(self.stacks.counters())
        return counters



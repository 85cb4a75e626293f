"""Attach the CUDA, NCCL and ibverbs uprobes (bpf/cuda.c, bpf/nccl.c, bpf/ibverbs.c) to
the libraries that the traced processes map.

Libraries are found per process in ``/proc/PID/maps`` and opened through
``/proc/PID/root`` so that a containerised process's own copy is probed. A uprobe
belongs to a file (inode), not a process, so each library file is attached once and the
kernel-side pid filter decides whose calls count. Symbols sharing one address (NCCL's
``pncclX`` aliases) are attached once, so no call is counted twice. Of a versioned
symbol (libibverbs exports ``ibv_reg_mr@IBVERBS_1.0`` and ``ibv_reg_mr@@IBVERBS_1.1``)
only the default version is probed: the old compat versions call the default one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from tracer.probes import procfs
from tracer.probes.counters import CounterDeltas
from tracer.probes.entry import entry_site
from tracer.probes.lookups import LOOKUP_HANDLERS, AliasLookups
from tracer.probes.uprobes import Attached, Site, Uprobes


@dataclass(frozen=True)
class Probe:
    symbol: str
    entry: str | None  # BPF function at entry
    ret: str | None = None  # BPF function at return
    unless: str | None = None  # skip it where the library exports this symbol
    # BPF function at entry and return in one uprobe session, used instead of the two
    # where the kernel has sessions (tracer/probes/uprobes.py)
    session: str | None = None


def _each(symbols: str, entry: str | None, ret: str | None = None,
          session: str | None = None) -> list[Probe]:
    return [Probe(s, entry, ret, session=session) for s in symbols.split()]


# libcuda.so.1: the driver API. Variants that do not exist in a given driver are skipped.
CUDA_PROBES: list[Probe] = [
    *_each("cuLaunchKernel cuLaunchKernel_ptsz cuLaunchCooperativeKernel "
           "cuLaunchCooperativeKernel_ptsz", "tt_launch_arg1"),
    *_each("cuLaunchKernelEx cuLaunchKernelEx_ptsz", "tt_launch_arg2"),
    *_each("cuGraphLaunch cuGraphLaunch_ptsz", "tt_graph_launch"),
    *_each("cuMemcpyHtoD_v2 cuMemcpyHtoD_v2_ptds cuMemcpyHtoDAsync_v2 "
           "cuMemcpyHtoDAsync_v2_ptsz", "tt_copy_h2d_arg3"),
    *_each("cuMemcpyDtoH_v2 cuMemcpyDtoH_v2_ptds cuMemcpyDtoHAsync_v2 "
           "cuMemcpyDtoHAsync_v2_ptsz", "tt_copy_d2h_arg3"),
    *_each("cuMemcpyDtoD_v2 cuMemcpyDtoD_v2_ptds cuMemcpyDtoDAsync_v2 "
           "cuMemcpyDtoDAsync_v2_ptsz", "tt_copy_d2d_arg3"),
    *_each("cuMemcpy cuMemcpy_ptds cuMemcpyAsync cuMemcpyAsync_ptsz", "tt_copy_other_arg3"),
    *_each("cuMemcpyPeer cuMemcpyPeer_ptds cuMemcpyPeerAsync cuMemcpyPeerAsync_ptsz",
           "tt_copy_d2d_arg5"),
    *_each("cuMemsetD8_v2 cuMemsetD8_v2_ptds cuMemsetD8Async cuMemsetD8Async_ptsz",
           "tt_memset8_arg3"),
    *_each("cuMemsetD16_v2 cuMemsetD16_v2_ptds cuMemsetD16Async cuMemsetD16Async_ptsz",
           "tt_memset16_arg3"),
    *_each("cuMemsetD32_v2 cuMemsetD32_v2_ptds cuMemsetD32Async cuMemsetD32Async_ptsz",
           "tt_memset32_arg3"),
    *_each("cuStreamSynchronize cuStreamSynchronize_ptsz", "tt_sync_stream", "tt_sync_return",
           "tt_sync_stream_session"),
    *_each("cuEventSynchronize", "tt_sync_event", "tt_sync_return", "tt_sync_event_session"),
    # cudaDeviceSynchronize goes through cuCtxSynchronize_v2 on CUDA 13 (seen on an H200,
    # driver 580): without it, a device-wide sync would not end the thread's burst
    *_each("cuCtxSynchronize cuCtxSynchronize_v2", "tt_sync_ctx", "tt_sync_return",
           "tt_sync_ctx_session"),
    *_each("cuStreamQuery cuStreamQuery_ptsz cuEventQuery", None, "tt_query_return"),
    *_each("cuModuleGetFunction", "tt_module_get_function", "tt_name_return"),
    *_each("cuLibraryGetKernel", "tt_library_get_kernel", "tt_name_return"),
    *_each("cuKernelGetFunction", "tt_kernel_get_function", "tt_name_return"),
    *_each("cuMemAlloc_v2 cuMemAllocAsync cuMemAllocAsync_ptsz cuMemAllocFromPoolAsync "
           "cuMemAllocFromPoolAsync_ptsz cuMemAllocManaged", "tt_alloc", "tt_alloc_return"),
    *_each("cuMemFree_v2 cuMemFreeAsync cuMemFreeAsync_ptsz", "tt_free"),
]

NCCL_PROBES: list[Probe] = [
    Probe("ncclAllReduce", "tt_nccl_allreduce", "tt_nccl_return"),
    Probe("ncclAllGather", "tt_nccl_allgather", "tt_nccl_return"),
    Probe("ncclReduceScatter", "tt_nccl_reducescatter", "tt_nccl_return"),
    Probe("ncclBroadcast", "tt_nccl_broadcast", "tt_nccl_return"),
    Probe("ncclReduce", "tt_nccl_reduce", "tt_nccl_return"),
    Probe("ncclSend", "tt_nccl_send", "tt_nccl_return"),
    Probe("ncclRecv", "tt_nccl_recv", "tt_nccl_return"),
    Probe("ncclGroupStart", "tt_nccl_group_start", "tt_nccl_return"),
    Probe("ncclGroupEnd", "tt_nccl_group_end", "tt_nccl_return"),
    Probe("ncclCommInitRank", "tt_nccl_comm_init", "tt_nccl_return"),
    Probe("ncclCommInitRankConfig", "tt_nccl_comm_init", "tt_nccl_return"),
]

# The launch handlers: the probes --gpu-sample switches on and off (their uprobe trap is
# what an eager launch-bound loop pays per launch).
LAUNCH_HANDLERS = frozenset({"tt_launch_arg1", "tt_launch_arg2", "tt_graph_launch"})
# The handlers of the copies SAMPLED_COPY_KINDS names (tracer/events/gpu.py) and of the
# syncs (entries, returns and sessions alike; SYNC_GATE): switched with the launch probes
# where their steps are told apart without them (``copies_switched``), else attached all
# the time. cuMemcpy[Async] (direction known only from the pointers) stays probed, as
# does the device-to-host copy, which ends a step while the syncs are off.
COPY_HANDLERS = frozenset({"tt_copy_h2d_arg3", "tt_copy_d2d_arg3", "tt_copy_d2d_arg5",
                           "tt_sync_stream", "tt_sync_event", "tt_sync_ctx"})
# The memsets' handlers: switched with the launch probes on their own (``memsets_switched``)
MEMSET_HANDLERS = frozenset({"tt_memset8_arg3", "tt_memset16_arg3", "tt_memset32_arg3"})
# the groups that can go on and off with the launch probes, by their handlers
SWITCHED_GROUPS = {"copies": COPY_HANDLERS, "memsets": MEMSET_HANDLERS}

# libcudart: only device-wide synchronisation, which does not pass through an exported
# libcuda function on CUDA 13 (seen on an H200, driver 580). Launches are never counted
# here: they all reach cuLaunchKernel*, and counting both would count them twice.
CUDART_PROBES: list[Probe] = [
    Probe("cudaDeviceSynchronize", "tt_sync_ctx", "tt_sync_return", session="tt_sync_ctx_session"),
]

# libcudart's launch calls, whose func argument is the kernel's host stub: probed only
# while kernel naming by host stub is open (tracer/probes/stubnames.py), to learn which
# stub each handle belongs to; they count nothing.
STUB_PROBES: list[Probe] = [
    *_each("cudaLaunchKernel cudaLaunchKernel_ptsz cudaLaunchCooperativeKernel "
           "cudaLaunchCooperativeKernel_ptsz", "tt_stub_arg1"),
    *_each("cudaLaunchKernelExC cudaLaunchKernelExC_ptsz", "tt_stub_arg2"),
]

# libibverbs.so.1: only what is exported. The data path (post_send, post_recv, poll_cq)
# is inline in verbs.h and runs in the provider library: these probes learn each device
# context and tracer/probes/ibverbs.py attaches to the provider functions it points to.
VERBS_PROBES: list[Probe] = [
    Probe("ibv_open_device", None, "tt_verbs_open_device_return"),
    Probe("ibv_import_device", None, "tt_verbs_import_device_return"),
    # ibv_reg_mr and ibv_reg_mr_iova call ibv_reg_mr_iova2 (libibverbs >= 1.8): probing
    # them as well would count each registration twice
    Probe("ibv_reg_mr_iova2", "tt_verbs_reg_mr_iova2", "tt_verbs_mr_return"),
    Probe("ibv_reg_mr", "tt_verbs_reg_mr", "tt_verbs_mr_return", unless="ibv_reg_mr_iova2"),
    Probe("ibv_reg_dmabuf_mr", "tt_verbs_reg_dmabuf_mr", "tt_verbs_mr_return"),
    Probe("ibv_dereg_mr", "tt_verbs_dereg_mr", "tt_verbs_mr_return"),
    Probe("ibv_modify_qp", "tt_verbs_modify_qp", "tt_verbs_modify_qp_return"),
    Probe("ibv_ack_cq_events", "tt_verbs_ack_cq_events"),
]

LIBRARIES: dict[str, tuple[re.Pattern[str], list[Probe]]] = {
    "ibverbs": (re.compile(r"/libibverbs\.so(\.\d+)*$"), VERBS_PROBES),
    "cuda": (re.compile(r"/libcuda\.so(\.\d+)*$"), CUDA_PROBES),
    "cudart": (re.compile(r"/libcudart\.so(\.\d+)*$"), CUDART_PROBES),
    "nccl": (re.compile(r"/libnccl\.so(\.\d+)*$"), NCCL_PROBES),
}


@dataclass
class AttachedLibrary:
    kind: str
    path: str  # as opened (through /proc/PID/root)
    probes: int  # uprobes + uretprobes attached
    symbols: list[str]
    missing: list[str]


class GpuProbes:
    """Finds CUDA/NCCL/ibverbs libraries in traced processes and attaches to each file
    once; ``verbs`` attaches to the ibverbs providers those libraries reveal."""

    def __init__(self, bpf: Any, stub_quiet_s: float = 5.0, stub_max_s: float = 60.0,
                 uprobe_mode: str = "auto", lookups_quiet_s: float = 5.0) -> None:
        self.bpf = bpf
        self.attached: dict[tuple[int, int], AttachedLibrary] = {}  # (dev, inode) -> lib
        self.errors: dict[str, str] = {}
        from tracer.probes.ibverbs import VerbsProbes
        from tracer.probes.prenames import BackgroundPreNames, PreNames, device_arch
        from tracer.probes.stubnames import StubNames

        # BCC's attach and detach bookkeeping is not meant for two threads at once;
        # each probe goes into the traced processes that map its file, not every one
        self.uprobes = Uprobes(bpf, threading.Lock(), uprobe_mode, scope=self._mapping)
        self.verbs = VerbsProbes(bpf, self.errors, self.uprobes)
        # kernels resolved before attach: named from the libraries' registration code,
        # cubins and the driver's objects (off with host-stub naming)
        self.prenames = (BackgroundPreNames(PreNames(device_arch())) if stub_quiet_s > 0
                         else None)
        self._prenames_maps: dict[int, tuple[str, ...]] = {}  # pid -> its last library list
        self.stubs = StubNames(bpf, self.errors, self.uprobes, stub_quiet_s, stub_max_s,
                               self.prenames)
        self._stub_seen: set[tuple[int, str]] = set()  # (pid, libcudart path) found
        # the probes on cuKernelGetFunction: attached while they may tell a new alias
        self.lookups = AliasLookups(bpf, self.errors, self.uprobes, lookups_quiet_s)
        self._cuda_seen: set[int] = set()  # pids found mapping libcuda
        # each attached file's paths through the processes mapping it: probes attached
        # later (windows, --gpu-sample) go through a live one
        self._mappers: dict[tuple[int, int], dict[int, str]] = {}  # (dev, ino) -> pid -> path
        self._files: dict[str, tuple[int, int]] = {}  # a path attached through -> (dev, ino)
        self._unscoped: set[tuple[int, int]] = set()  # files attached for no process
        self.launch_sites: list[Site] = []  # every library's launch probes
        self._launch_attached: list[Attached] = []  # those attached now
        # SWITCHED_GROUPS: each group's sites, those attached now, and whether they go
        # on and off with the launch probes (else attached all the time)
        self.group_sites: dict[str, list[Site]] = {g: [] for g in SWITCHED_GROUPS}
        self._group_attached: dict[str, list[Attached]] = {g: [] for g in SWITCHED_GROUPS}
        self.switched: dict[str, bool] = {g: False for g in SWITCHED_GROUPS}
        self.launches_on = True
        self.last_detach_s = 0.0  # how long the last detach of the launch probes took
        self._detacher: threading.Thread | None = None
        self._kcounts = CounterDeltas(bpf, b"kernel_counts", lambda v: (v.value,))

    def scan(self, pid: int) -> list[AttachedLibrary]:
        """Attach to the GPU libraries ``pid`` maps that are not attached yet; then (the
        name probes attached) name what its libraries resolved before."""
        new = []
        mapped = procfs.maps(pid)
        for path in mapped:
            for kind, (pattern, probes) in LIBRARIES.items():
                if pattern.search(path):
                    lib = self._attach_file(kind, f"/proc/{pid}/root{path}", probes, pid)
                    if lib is not None:
                        new.append(lib)
                    if kind == "cuda" and pid not in self._cuda_seen:
                        # a new process resolves its kernels: its look-ups tell new aliases
                        self._cuda_seen.add(pid)
                        self.lookups.open_window("a new process with libcuda")
                    if kind == "cudart" and (pid, path) not in self._stub_seen:
                        # its kernels may all have been resolved before we came: name
                        # them by their host stubs for a while
                        self._stub_seen.add((pid, path))
                        self.stubs.open_window()
        if (self.prenames is not None and self._prenames_maps.get(pid) != mapped
                and any(LIBRARIES["cuda"][0].search(path) for path in mapped)):
            self._prenames_maps[pid] = mapped
            self.prenames.scan(pid)
        return new

    def _mapping(self, path: str) -> dict[int, str] | None:
        """``Uprobes``' scope: the traced processes that map the file at ``path`` (a path
        it was attached through), each with its own path to it; None for a file not
        attached here."""
        key = self._files.get(path)
        if key is None or key in self._unscoped:
            return None
        return dict(self._mappers.get(key, {}))

    def forget(self, pid: int) -> None:
        """``pid`` exited: its probes come out, and probes attached from now on reach its
        libraries through another process that maps them."""
        self.stubs.forget(pid)
        if any(pid in paths for paths in self._mappers.values()):
            self.uprobes.drop_process(pid, self.errors)
        for key, paths in self._mappers.items():
            gone = paths.pop(pid, None)
            lib = self.attached.get(key)
            if gone is not None and lib is not None and lib.path == gone and paths:
                self._move_file(lib, next(iter(paths.values())))
        self._stub_seen = {k for k in self._stub_seen if k[0] != pid}
        self._cuda_seen.discard(pid)
        self._prenames_maps.pop(pid, None)

    def _move_file(self, lib: AttachedLibrary, path: str) -> None:
        """Attach ``lib``'s later probes through ``path`` (its process gone)."""
        old, lib.path = lib.path, path
        self.lookups.window.move_file(old, path)
        self.stubs.window.move_file(old, path)
        self.launch_sites = [dataclasses.replace(s, path=path) if s.path == old else s
                             for s in self.launch_sites]
        for g, sites in self.group_sites.items():
            self.group_sites[g] = [dataclasses.replace(s, path=path) if s.path == old else s
                                   for s in sites]

    def _attach_file(self, kind: str, path: str, probes: list[Probe],
                     pid: int = 0) -> AttachedLibrary | None:
        """Attach ``probes`` to the library at ``path`` (as ``pid`` maps it, 0: no
        process) unless its file is attached already."""
        try:
            st = os.stat(path)
        except OSError as e:
            self.errors[path] = str(e)
            return None
        key = (st.st_dev, st.st_ino)
        self._files[path] = key
        if not pid and key not in self.attached:
            self._unscoped.add(key)  # attached as asked: in every process that maps it
        joined = bool(pid) and pid not in self._mappers.get(key, {})
        if pid:
            self._mappers.setdefault(key, {})[pid] = path
        if key in self.attached:
            if joined:  # probes attached in the processes that mapped it before: in it too
                self.uprobes.add_process(pid, self.errors)
            lib = self.attached[key]
            if lib.path != path and not os.path.exists(lib.path):  # an exit not yet seen
                self._move_file(lib, path)
            return None
        try:
            addresses = exported_functions(path, probe_sites=True)
        except (OSError, ELFError) as e:
            self.errors[path] = f"cannot read its symbols: {e}"
            addresses = {}
        done: dict[int, str] = {}  # address -> first symbol attached there
        lib = AttachedLibrary(kind, path, 0, [], [])
        sites: list[Site] = []
        launch: list[Site] = []
        grouped: dict[str, list[Site]] = {g: [] for g in SWITCHED_GROUPS}
        lookups: list[Site] = []  # attached by their window (tracer/probes/lookups.py)
        for p in probes:
            addr = addresses.get(p.symbol)
            if addr is None:
                lib.missing.append(p.symbol)
                continue
            if p.unless and p.unless in addresses:
                continue
            if addr in done:  # an alias of a symbol already probed
                continue
            done[addr] = p.symbol
            # by address: BCC's lookup by name may pick a non-default version
            looked_up = p.entry in LOOKUP_HANDLERS  # entry and return go in the window
            # a switched group takes the probe whole: entry, return, or its session
            group = next((g for g, h in SWITCHED_GROUPS.items() if p.entry in h), None)
            if p.session and self.uprobes.sessions:
                (grouped[group] if group else sites).append(
                    Site(path, addr, p.session, name=p.symbol, session=True))
                continue
            if p.entry:
                (launch if p.entry in LAUNCH_HANDLERS else grouped[group] if group
                 else lookups if looked_up
                 else sites).append(Site(path, addr, p.entry, False, p.symbol))
            if p.ret:
                (lookups if looked_up else grouped[group] if group else sites).append(
                    Site(path, addr, p.ret, True, p.symbol))
        self.launch_sites.extend(launch)
        attached = list(self.uprobes.attach(sites, self.errors).sites)
        if self.launches_on:  # else attached when sampling turns them on
            on = self.uprobes.attach(launch, self.errors)
            self._launch_attached.append(on)
            attached += on.sites
        wanted_grouped: list[Site] = []
        for g, members in grouped.items():
            self.group_sites[g].extend(members)
            if members and (self.launches_on or not self.switched[g]):  # else with the
                on = self.uprobes.attach(members, self.errors)  # launches'
                self._group_attached[g].append(on)
                attached += on.sites
                wanted_grouped += members
        if lookups:
            self.lookups.add_sites(lookups)
            now = self.lookups.window.attached
            attached += [s for s in lookups if (s.path, s.vaddr, s.ret) in now]
        lib.probes = len(attached)
        wanted = sites + lookups + (launch if self.launches_on else []) + wanted_grouped
        failed = {s.name for s in set(wanted) - set(attached)}
        lib.symbols = [name for name in done.values() if name not in failed]
        if kind == "cudart":
            self._add_stub_sites(lib, addresses)
        self.attached[key] = lib
        return lib

    def _add_stub_sites(self, lib: AttachedLibrary, addresses: dict[str, int]) -> None:
        """Hand libcudart's launch calls to stub naming, which attaches them itself."""
        sites: dict[int, str] = {}
        for p in STUB_PROBES:
            addr = addresses.get(p.symbol)
            if addr is None:
                lib.missing.append(p.symbol)
            elif p.entry:
                sites.setdefault(addr, p.entry)  # an alias of a symbol already there
        self.stubs.add_sites(lib.path, sorted(sites.items()))

    @property
    def detaching(self) -> bool:
        """Whether a detach of the launch probes is still under way."""
        return self._detacher is not None and self._detacher.is_alive()

    def attach_launch_probes(self) -> float:
        """--gpu-sample: attach the launch probes (with the sampled copies' and the
        memsets' where ``switched``) of every library (a few ms); the seconds it took.
        Call only once a detach has finished (``detaching``)."""
        if self.launches_on:
            return 0.0
        if self.detaching:
            raise RuntimeError("the launch probes are still being detached")
        t0 = time.perf_counter()
        # The launch sites last: every site traps from the moment it is in, and the
        # gate opens only after the whole attach, so a trap before that counts nothing
        # (capture.gated_calls). Launches are the most frequent of these calls.
        for g, on in self.switched.items():
            if on:
                self._group_attached[g] = [self.uprobes.attach(self.group_sites[g],
                                                               self.errors)]
        self._launch_attached = [self.uprobes.attach(self.launch_sites, self.errors)]
        self.launches_on = True
        return time.perf_counter() - t0

    @property
    def copies_switched(self) -> bool:
        """Whether the sampled copies' probes go on and off with the launch probes."""
        return self.switched["copies"]

    @property
    def memsets_switched(self) -> bool:
        """Whether the memsets' probes go on and off with the launch probes."""
        return self.switched["memsets"]

    def switch_groups(self, copies: bool, memsets: bool = False) -> None:
        """Whether the sampled copies' and the memsets' probes go on and off with the
        launch probes from the next switch on, or stay attached (attached now if they
        were off with the launches; wait for a detach under way first)."""
        for g, on in (("copies", copies), ("memsets", memsets)):
            if not on and self.switched[g] and not self.launches_on:
                self.join_detach()  # never two links on one site: each would count
                self._group_attached[g] = [self.uprobes.attach(self.group_sites[g],
                                                               self.errors)]
            self.switched[g] = on

    def detach_launch_probes(self) -> None:
        """--gpu-sample: detach the launch probes (with the sampled copies' and the
        memsets' where ``switched``), so that a launch costs no uprobe trap at all. On a
        thread of its own: through perf events each probe's detach
        blocks ~0.1 s in the kernel (tracer/probes/uprobes.py), and the agent keeps
        draining the ring buffer meanwhile."""
        if not self.launches_on:
            return
        self.launches_on = False
        groups, self._launch_attached = self._launch_attached, []
        for g, on in self.switched.items():
            if on:
                groups, self._group_attached[g] = groups + self._group_attached[g], []
        self._detacher = self.uprobes.detach_in_background(
            groups, self.errors, "off", done=lambda s: setattr(self, "last_detach_s", s))

    def join_detach(self) -> None:
        """Wait for a detach under way (before the BPF program is torn down)."""
        if self._detacher is not None:
            self._detacher.join()
        self.stubs.join_detach()
        self.lookups.join_detach()

    def close(self) -> float:
        """Detach every uprobe (before the BPF program is torn down); the seconds it
        took."""
        self.join_detach()
        return self.uprobes.close(self.errors)

    def collect(self) -> list[bytes]:
        """KCOUNT records for the launches counted past full burst slots since the last
        call (see bpf/cuda.c); exited threads' entries are read a last time and removed."""
        from tracer.events import wire

        ts = time.monotonic_ns()
        return [wire.KCOUNT.pack(pid=k.pid, tid=k.tid, ts=ts, handle=k.handle, count=d[0])
                for k, d in self._kcounts.read()]

    def open_bursts(self) -> list[bytes]:
        """The bursts open in the kernel now, as KBURST records (reason DRAIN), left in
        place: each thread's calls since its last flush. A burst stays open past a sync
        that ends no step (bpf/cuda.c, sync_session) until the thread's next flush, so
        counts read from flushed records alone reach a moment that much late."""
        return self._bursts(remove=False)

    def drain(self) -> list[bytes]:
        """The bursts still open in the kernel (``open_bursts``), removed from the map
        with the threads' emptied entries: called once capture stops so that counts
        are exact."""
        return self._bursts(remove=True)

    def _bursts(self, remove: bool) -> list[bytes]:
        """One walk of ``bursts``: its open entries as DRAIN records, every entry
        deleted as it goes with ``remove``."""
        import ctypes

        from tracer.events import wire

        table = self.bpf[b"bursts"]
        reason_off = wire.KBURST.offsets["reason"]
        drain = wire.CONSTANTS["BURST_DRAIN"].to_bytes(2, "little")
        out = []
        for k, v in list(table.items()):
            if v.first_ts:  # 0: emptied by its last flush, none open (bpf/cuda.c flush)
                raw = bytearray(ctypes.string_at(ctypes.addressof(v), ctypes.sizeof(v)))
                raw[reason_off : reason_off + 2] = drain
                out.append(bytes(raw))
            if remove:
                try:
                    del table[k]
                except KeyError:
                    pass
        return out


_VERSYM_HIDDEN = 0x8000  # a non-default version of a versioned symbol (ELF gABI)


def exported_functions(path: str, probe_sites: bool = False) -> dict[str, int]:
    """Defined dynamic function symbols of an ELF file -> their address (ELF virtual
    address, as BCC's ``addr`` takes it); non-default symbol versions left out. With
    ``probe_sites``, where each one's entry uprobe goes (past an ENDBR64: entry.py)."""
    out: dict[str, int] = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        dynsym = elf.get_section_by_name(".dynsym")
        if dynsym is None:
            return out
        versym = elf.get_section_by_name(".gnu.version")
        for i, sym in enumerate(dynsym.iter_symbols()):
            if sym["st_info"]["type"] not in ("STT_FUNC", "STT_GNU_IFUNC"):
                continue
            if sym["st_shndx"] == "SHN_UNDEF" or not sym["st_value"] or not sym.name:
                continue
            if versym is not None:
                ndx = versym.get_symbol(i)["ndx"]
                if isinstance(ndx, int) and ndx & _VERSYM_HIDDEN:
                    continue
            out.setdefault(sym.name, sym["st_value"])
        if probe_sites:
            out = {name: entry_site(elf, f, a) for name, a in out.items()}
    return out

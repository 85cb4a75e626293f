"""Attaching and detaching uprobes in groups.

BCC attaches each uprobe as a perf event of its own, and closing one waits for a kernel
grace period while holding the tracing subsystem's one mutex: ~0.14 s per probe,
serialised even when closed from many threads (measured on the dev VM: 20 probes, 2.8 s
one by one, 2.1 s from 20 threads). With ~100 GPU probes that made stopping take ~12 s,
and it kept the --gpu-sample launch probes firing for 1-1.6 s after every "off" switch.

Linux 6.6 added uprobe_multi links (``BPF_LINK_CREATE`` with
``BPF_TRACE_UPROBE_MULTI``): one link holds many probe sites of one BPF program in one
file, and closing it unregisters them all behind a single grace period, with no global
mutex held (the same VM: one link of 20 sites closes in ~40 ms; 20 one-site links from
20 threads in ~70-100 ms). Where the kernel has them, every uprobe goes through them;
elsewhere BCC's perf events are used, one by one. A program loaded for uprobe_multi
cannot be attached as a perf event and the other way round, so the choice is made once
per BPF object, before any handler is loaded.

Linux 6.13 added uprobe sessions (``BPF_TRACE_UPROBE_SESSION``): one program runs at a
function's entry and, unless the entry returned 1, at its return. A return probe costs a
second trap even where its program has nothing to do (on the dev VM: an entry probe
1.16 us a call, entry and return probes 2.55 us, a session that skips the return 0.89 us,
one that keeps it 2.19 us), so the synchronisation probes use sessions where the kernel
has them and skip the returns they do not need (bpf/cuda.c).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import platform
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from tracer.probes.entry import file_offset
from tracer.probes.loader import ProbeSetupError

# include/uapi/linux/bpf.h (6.6+); checked against this kernel's BTF (enum
# bpf_attach_type and union bpf_attr's link_create.uprobe_multi)
BPF_PROG_LOAD = 5
BPF_LINK_CREATE = 28
BPF_PROG_TYPE_KPROBE = 2
BPF_TRACE_UPROBE_MULTI = 48
BPF_TRACE_UPROBE_SESSION = 57  # 6.13+
BPF_F_UPROBE_MULTI_RETURN = 1
SYS_BPF = {"x86_64": 321, "aarch64": 280}

MODES = ("auto", "sessions", "multi", "perf")


class _ProgLoadAttr(ctypes.Structure):
    _fields_ = [("prog_type", ctypes.c_uint32), ("insn_cnt", ctypes.c_uint32),
                ("insns", ctypes.c_uint64), ("license", ctypes.c_uint64),
                ("log_level", ctypes.c_uint32), ("log_size", ctypes.c_uint32),
                ("log_buf", ctypes.c_uint64), ("kern_version", ctypes.c_uint32),
                ("prog_flags", ctypes.c_uint32), ("prog_name", ctypes.c_char * 16),
                ("prog_ifindex", ctypes.c_uint32), ("expected_attach_type", ctypes.c_uint32)]


class _LinkCreateAttr(ctypes.Structure):
    _fields_ = [("prog_fd", ctypes.c_uint32), ("target_fd", ctypes.c_uint32),
                ("attach_type", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("path", ctypes.c_uint64), ("offsets", ctypes.c_uint64),
                ("ref_ctr_offsets", ctypes.c_uint64), ("cookies", ctypes.c_uint64),
                ("cnt", ctypes.c_uint32), ("multi_flags", ctypes.c_uint32),
                ("pid", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


_libc = ctypes.CDLL(None, use_errno=True)


def sys_bpf(cmd: int, attr: Any) -> int:
    """bpf(2) with ``attr`` (a ctypes structure or array); the new fd, or raises
    OSError."""
    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        raise OSError(errno.ENOSYS, f"bpf(2) number unknown on {platform.machine()}")
    fd = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(cmd), ctypes.byref(attr),
                       ctypes.c_uint(ctypes.sizeof(attr)))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(fd)


def _create_link(prog_fd: int, path: str, offsets: list[int], ret: bool, pid: int = 0,
                 session: bool = False) -> int:
    """A uprobe_multi link (a session link where ``session``); ``pid`` > 0 limits it to
    that process: the kernel then puts the breakpoint only into that process's copy of
    the file's pages, so no other process using the library pays a trap."""
    arr = (ctypes.c_uint64 * len(offsets))(*offsets)
    cpath = ctypes.create_string_buffer(path.encode())
    attach = BPF_TRACE_UPROBE_SESSION if session else BPF_TRACE_UPROBE_MULTI
    attr = _LinkCreateAttr(prog_fd=prog_fd, attach_type=attach,
                           path=ctypes.addressof(cpath), offsets=ctypes.addressof(arr),
                           cnt=len(offsets),
                           multi_flags=BPF_F_UPROBE_MULTI_RETURN if ret else 0, pid=pid)
    return sys_bpf(BPF_LINK_CREATE, attr)


def uprobe_multi_support(session: bool = False) -> tuple[bool, str]:
    """Whether this kernel has uprobe_multi links (uprobe session links where
    ``session``), and why not.

    The check libbpf makes: a two-instruction program loaded for them, linked to "/". A
    kernel that has them rejects the directory with EBADF; one that does not rejects
    the attach type itself. Nothing is attached either way."""
    what = "uprobe session" if session else "uprobe_multi"
    insns = (ctypes.c_uint64 * 2)(0x00000000000000B7, 0x0000000000000095)  # r0 = 0; exit
    lic = ctypes.create_string_buffer(b"GPL")
    load = _ProgLoadAttr(prog_type=BPF_PROG_TYPE_KPROBE, insn_cnt=2,
                         insns=ctypes.addressof(insns), license=ctypes.addressof(lic),
                         expected_attach_type=(BPF_TRACE_UPROBE_SESSION if session
                                               else BPF_TRACE_UPROBE_MULTI))
    try:
        prog = sys_bpf(BPF_PROG_LOAD, load)
    except OSError as e:
        return False, f"loading a {what} program: {e.strerror}"
    try:
        fd = _create_link(prog, "/", [0], ret=False, session=session)
        os.close(fd)
        return False, "the kernel linked a uprobe to a directory"
    except OSError as e:
        if e.errno == errno.EBADF:
            return True, ""
        return False, f"BPF_LINK_CREATE {what}: {e.strerror}"
    finally:
        os.close(prog)


@dataclass(frozen=True)
class Site:
    """One uprobe: ``handler`` runs at ELF address ``vaddr`` of the file at ``path``
    (at its return where ``ret``; at its entry and, unless that returned 1, its return
    where ``session``); ``name`` is what errors call it. ``pid`` > 0: in that process
    only (a uprobe otherwise fires in every process mapping the file)."""
    path: str
    vaddr: int
    handler: str
    ret: bool = False
    name: str = ""
    pid: int = 0
    session: bool = False

    def describe(self) -> str:
        what = self.name or f"{self.vaddr:#x}"
        return (f"{self.path}:{what}" + (" (return)" if self.ret else "")
                + (" (session)" if self.session else "")
                + (f" (pid {self.pid})" if self.pid else ""))


@dataclass
class Attached:
    """What one ``attach`` put in place: its sites (as asked: a site of pid 0 stands
    for each process of the scope that maps its file), and what holds them: the links
    with the process each is limited to (0: none), or the perf events' own sites."""
    sites: list[Site] = field(default_factory=list)
    links: list[int] = field(default_factory=list)  # uprobe_multi link fds
    link_pids: list[int] = field(default_factory=list)  # each link's process (0: any)
    events: list[Site] = field(default_factory=list)  # perf events: the sites attached
    # (process, path as asked) each site of that path was attached for in that process
    reached: set[tuple[int, str]] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.sites)


# a site's file -> the traced processes that map it, each with the file's path as seen
# through that process (/proc/PID/root/...); None: the file is not known (attached in
# every process that maps it, as a site of pid 0 is)
Scope = Callable[[str], "dict[int, str] | None"]


class Uprobes:
    """Attaches groups of sites through uprobe_multi links where the kernel has them,
    else through BCC's perf events; detaches them the same way. ``sessions``: session
    sites can be attached (uprobe session links); callers that have a session handler
    use it then, else an entry and a return probe.

    ``lock`` guards BCC's bookkeeping, which is not meant for two threads at once.

    ``scope``: where a site of pid 0 goes. A uprobe is written into every process that
    maps its file unless it is limited to one; a process the agent does not trace then
    takes the trap for nothing (the program returns at once: on the dev VM 1.3 us of
    system time a call of the stand-in's cuLaunchKernel, bench/untraced_neighbour.py
    --gpu). With a scope, such a site is attached once per traced process that maps
    its file, limited to it (``add_process`` and ``drop_process`` follow them)."""

    def __init__(self, bpf: Any, lock: threading.Lock, mode: str = "auto",
                 scope: Scope | None = None) -> None:
        self.scope = scope
        if mode not in MODES:
            raise ValueError(f"uprobe mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.bpf = bpf
        self.lock = lock
        if mode == "perf":
            self.multi, self.why_not = False, "--uprobe-links perf"
        else:
            self.multi, self.why_not = uprobe_multi_support()
            if mode in ("multi", "sessions") and not self.multi:
                raise ProbeSetupError(f"--uprobe-links {mode}: this kernel has no uprobe_multi "
                                      f"links ({self.why_not}); use auto or perf")
        self.sessions, self.sessions_why_not = False, f"--uprobe-links {mode}"
        if self.multi and mode in ("auto", "sessions"):
            self.sessions, self.sessions_why_not = uprobe_multi_support(session=True)
            if platform.machine() != "x86_64":
                # bpf/cuda.c tells a sync's return from its entry by the stack pointer,
                # which only x86-64's `ret` moves
                self.sessions, self.sessions_why_not = False, \
                    f"the sync probes' sessions need x86-64, not {platform.machine()}"
            if mode == "sessions" and not self.sessions:
                raise ProbeSetupError(f"--uprobe-links sessions: this kernel has no uprobe "
                                      f"sessions ({self.sessions_why_not}); use auto or multi")
        self._live: list[Attached] = []
        self._live_lock = threading.Lock()
        # suspend(): groups detached for a while, each with the sites to put back
        self._parked: list[tuple[Attached, list[Site]]] = []
        self.suspended = False

    def sites_attached(self) -> int:
        """How many uprobes are attached now."""
        with self._live_lock:
            return sum(len(a) for a in self._live)

    @property
    def kind(self) -> str:
        """"uprobe_multi links" (", with sessions") or "perf events", for the user."""
        if not self.multi:
            return "perf events"
        return "uprobe_multi links" + (", with sessions" if self.sessions else "")

    def attach(self, sites: Iterable[Site], errors: dict[str, str]) -> Attached:
        """Attach ``sites``; a site that cannot be attached is left out and its error
        put in ``errors`` (by ``Site.describe()``)."""
        got = Attached()
        sites = list(sites)
        if self.suspended:  # attached at resume()
            with self._live_lock:
                self._parked.append((got, sites))
            return got
        self._attach_into(got, sites, errors)
        with self._live_lock:
            self._live.append(got)
        return got

    def _in_scope(self, got: Attached, sites: list[Site],
                  only: int | None = None) -> list[tuple[Site, Site]]:
        """Each site as asked, with each site to attach for it: itself where it names a
        process or its file is out of the scope, else one per traced process mapping
        its file that ``got`` has not reached yet (``only``: that process's alone)."""
        out = []
        scopes: dict[str, dict[int, str] | None] = {}  # each file's, asked once
        for s in sites:
            if s.pid or self.scope is None:
                where = None
            else:
                if s.path not in scopes:
                    scopes[s.path] = self.scope(s.path)
                where = scopes[s.path]
            if where is None:
                if only is None:
                    out.append((s, s))
                continue
            out += [(s, dataclasses.replace(s, pid=pid, path=path))
                    for pid, path in sorted(where.items())
                    if only in (None, pid) and (pid, s.path) not in got.reached]
        return out

    def _attach_into(self, got: Attached, sites: list[Site], errors: dict[str, str],
                     only: int | None = None) -> None:
        pairs = self._in_scope(got, sites, only)
        got.reached |= {(s.pid, asked.path) for asked, s in pairs if s is not asked}
        done: set[int] = set()  # sites as asked (by id) with one attached at least
        if self.multi:
            done = self._attach_links(pairs, errors, got)
        else:
            for asked, s in pairs:
                if s.session:
                    errors[s.describe()] = "uprobe sessions need uprobe_multi links"
                    continue
                try:
                    with self.lock:
                        how = self.bpf.attach_uretprobe if s.ret else self.bpf.attach_uprobe
                        how(name=s.path.encode(), addr=s.vaddr, fn_name=s.handler.encode(),
                            pid=s.pid or -1)
                except Exception as e:  # BCC raises bare Exception on attach failure
                    errors[s.describe()] = str(e)
                    continue
                got.events.append(s)
                done.add(id(asked))
        if only is None:
            got.sites += [s for s in sites if id(s) in done]

    def add_process(self, pid: int, errors: dict[str, str]) -> None:
        """``pid`` joined the scope (a traced process maps a file attached before): every
        group attached now is attached in it too (groups parked by ``suspend`` are at
        ``resume``, from the scope as it is then)."""
        with self._live_lock:
            live = list(self._live)
        for g in live:
            self._attach_into(g, g.sites, errors, only=pid)

    def drop_process(self, pid: int, errors: dict[str, str]) -> None:
        """``pid`` left the scope (it exited): the links and events limited to it are
        taken out of every group attached now."""
        with self._live_lock:
            live = list(self._live)
        fds = []
        for g in live:
            keep = [(fd, p) for fd, p in zip(g.links, g.link_pids) if p != pid]
            fds += [fd for fd, p in zip(g.links, g.link_pids) if p == pid]
            g.links, g.link_pids = [fd for fd, _ in keep], [p for _, p in keep]
            gone = [s for s in g.events if s.pid == pid]
            g.events = [s for s in g.events if s.pid != pid]
            g.reached = {r for r in g.reached if r[0] != pid}
            self._detach_events(gone, errors)
        if fds:
            _close_all(fds)

    def _attach_links(self, pairs: list[tuple[Site, Site]], errors: dict[str, str],
                      got: Attached) -> set[int]:
        """Link each site to attach, grouped by file, program and process; the ids of
        the sites as asked with one linked at least."""
        asked = {id(s): a for a, s in pairs}
        sites = [s for _, s in pairs]
        done: set[int] = set()
        groups: dict[tuple[str, str, bool, int, bool], list[tuple[Site, int]]] = \
            defaultdict(list)
        for s, off in _file_offsets(sites, errors):
            groups[(s.path, s.handler, s.ret, s.pid, s.session)].append((s, off))
        for (path, handler, ret, pid, session), members in groups.items():
            try:
                if session and not self.sessions:
                    raise ValueError("this kernel has no uprobe sessions")
                with self.lock:
                    prog = self.bpf.load_func(handler.encode(), self.bpf.KPROBE,
                                              attach_type=BPF_TRACE_UPROBE_SESSION if session
                                              else BPF_TRACE_UPROBE_MULTI)
            except Exception as e:  # BCC raises bare Exception
                for s, _ in members:
                    errors[s.describe()] = str(e)
                continue
            try:
                got.links.append(_create_link(prog.fd, path, [o for _, o in members], ret,
                                              pid, session))
                got.link_pids.append(pid)
                done.update(id(asked[id(s)]) for s, _ in members)
                continue
            except OSError:
                pass  # one bad site fails the whole link: find which, one by one
            for s, off in members:
                try:
                    got.links.append(_create_link(prog.fd, path, [off], ret, pid, session))
                except OSError as e:
                    errors[s.describe()] = f"uprobe_multi link: {e.strerror}"
                    continue
                got.link_pids.append(pid)
                done.add(id(asked[id(s)]))
        return done

    def sites_of(self, group: Attached) -> list[Site]:
        """``group``'s sites: attached, or parked until ``resume`` puts them back."""
        with self._live_lock:
            for g, sites in self._parked:
                if g is group:
                    return sites
        return group.sites

    def detach(self, groups: Attached | list[Attached], errors: dict[str, str]) -> float:
        """Detach what ``attach`` put in place (blocking); the seconds it took."""
        t0 = time.perf_counter()
        groups = [groups] if isinstance(groups, Attached) else groups
        with self._live_lock:
            self._live = [a for a in self._live if all(a is not g for g in groups)]
            self._parked = [(a, s) for a, s in self._parked if all(a is not g for g in groups)]
        self._release(groups, errors)
        return time.perf_counter() - t0

    def detach_in_background(self, groups: Attached | list[Attached], errors: dict[str, str],
                             label: str, done: Callable[[float], None] | None = None
                             ) -> threading.Thread:
        """``detach`` on a thread of its own, so the agent keeps draining the ring
        buffer meanwhile; ``done`` gets the seconds it took."""

        def run() -> None:
            took = self.detach(groups, errors)
            if done is not None:
                done(took)

        t = threading.Thread(target=run, name=f"tt-detach-{label}", daemon=True)
        t.start()
        return t

    def suspend(self, errors: dict[str, str]) -> float:
        """Detach every group for a while (``tokentrace run`` paused): each keeps its
        sites to be put back by ``resume``, and groups attached meanwhile wait for it;
        the seconds it took."""
        with self._live_lock:
            if self.suspended:
                return 0.0
            self.suspended = True
            live, self._live = self._live, []
            self._parked += [(g, list(g.sites)) for g in live]
        t0 = time.perf_counter()
        self._release(live, errors)
        return time.perf_counter() - t0

    def resume(self, errors: dict[str, str]) -> float:
        """Attach again what ``suspend`` detached (each group in place, so its owner's
        handle stays good), and what was attached meanwhile; the seconds it took."""
        with self._live_lock:
            if not self.suspended:
                return 0.0
            self.suspended = False
            parked, self._parked = self._parked, []
        t0 = time.perf_counter()
        for g, sites in parked:
            self._attach_into(g, sites, errors)
        with self._live_lock:
            self._live += [g for g, _ in parked]
        return time.perf_counter() - t0

    def _release(self, groups: list[Attached], errors: dict[str, str]) -> None:
        """Take ``groups``' probes out of the kernel; they are empty afterwards."""
        if self.multi:
            _close_all([fd for g in groups for fd in g.links])
        else:
            self._detach_events([s for g in groups for s in g.events], errors)
        for g in groups:
            g.links, g.link_pids, g.events, g.sites = [], [], [], []
            g.reached = set()

    def _detach_events(self, sites: list[Site], errors: dict[str, str]) -> None:
        """Perf events: detach each site attached so."""
        for s in sites:
            try:
                with self.lock:
                    how = self.bpf.detach_uretprobe if s.ret else self.bpf.detach_uprobe
                    how(name=s.path.encode(), addr=s.vaddr, pid=s.pid or -1)
            except Exception as e:  # BCC raises bare Exception
                errors[f"{s.describe()} (detach)"] = str(e)

    def close(self, errors: dict[str, str]) -> float:
        """Detach everything still attached, all links at once (BCC's ``cleanup`` would
        see to perf events, but not to links); the seconds it took."""
        with self._live_lock:
            live = list(self._live)
        return self.detach(live, errors)


def _close_all(fds: list[int]) -> None:
    """Close link fds from one thread each: every close waits for a grace period of its
    own, and these overlap (no lock is held across them)."""
    if len(fds) == 1:
        os.close(fds[0])
        return
    threads = [threading.Thread(target=os.close, args=(fd,), daemon=True) for fd in fds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _file_offsets(sites: list[Site], errors: dict[str, str]) -> list[tuple[Site, int]]:
    """Each site with the file offset of its address (what a link takes; BCC converts
    the same way), each file read once; a site with none goes to ``errors``."""
    by_path: dict[str, list[Site]] = defaultdict(list)
    for s in sites:
        by_path[s.path].append(s)
    out = []
    for path, group in by_path.items():
        try:
            with open(path, "rb") as f:
                elf = ELFFile(f)
                offsets = [file_offset(elf, s.vaddr) for s in group]
        except (OSError, ELFError) as e:
            for s in group:
                errors[s.describe()] = str(e)
            continue
        for s, off in zip(group, offsets):
            if off is None:
                errors[s.describe()] = f"{s.vaddr:#x} is outside every PT_LOAD segment"
            else:
                out.append((s, off))
    return out

"""The ibverbs data path: attach to the provider functions a device context points to,
and turn the kernel's per-thread counters into VERBS records.

``ibv_post_send``, ``ibv_post_recv`` and ``ibv_poll_cq`` are inline in verbs.h and
call ``ctx->ops.post_send`` etc., functions of the provider library (libmlx5, librxe,
...) that are usually not exported. bpf/ibverbs.c sends those three pointers when it
first sees a context (a VERBS_CTX record); here each pointer is resolved through
``/proc/PID/maps`` to its file and offset and a uprobe is attached there, once per
file and function, whichever process revealed it. Posts made between a context's
creation and that attach (one poll interval) are not seen.

The kernel sums posts and completions in ``verbs_counts`` (cumulative, per process,
thread, QP, op and opcode); ``collect`` sends what changed since its last read as VERBS
records, so the counts are exact at any read and Python does no per-post work.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from tracer.events import wire
from tracer.events.gpu import VerbsContext
from tracer.probes import procfs
from tracer.probes.entry import entry_sites
from tracer.probes.counters import CounterDeltas
from tracer.probes.uprobes import Site, Uprobes


# ctx->ops member -> (BPF function at entry, at return)
PROVIDER_OPS: dict[str, tuple[str, str | None]] = {
    "post_send": ("tt_verbs_post_send", None),
    "post_recv": ("tt_verbs_post_recv", None),
    "poll_cq": ("tt_verbs_poll_cq", "tt_verbs_poll_cq_return"),
}


@dataclass
class ProviderFile:
    """A provider library with probes on some of its (unexported) functions."""

    path: str  # as opened (through /proc/PID/root)
    functions: dict[str, int] = field(default_factory=dict)  # ops member -> ELF address


def file_offset_to_vaddr(path: str, offset: int) -> int | None:
    """The ELF virtual address that file ``offset`` is loaded at (PT_LOAD), or None."""
    with open(path, "rb") as f:
        for seg in ELFFile(f).iter_segments():
            if seg["p_type"] != "PT_LOAD":
                continue
            if seg["p_offset"] <= offset < seg["p_offset"] + seg["p_filesz"]:
                return offset - seg["p_offset"] + seg["p_vaddr"]
    return None


class VerbsProbes:
    """Provider probes learned from VERBS_CTX records, and the counter map's reader."""

    def __init__(self, bpf: Any, errors: dict[str, str], uprobes: Uprobes) -> None:
        self.bpf = bpf
        self.errors = errors
        self.uprobes = uprobes
        self.providers: dict[tuple[int, int], ProviderFile] = {}  # (dev, inode) -> file
        self.contexts = 0
        self._pending: list[VerbsContext] = []
        self._done: set[tuple[int, int, int]] = set()  # (dev, inode, address)
        self._counts = CounterDeltas(bpf, b"verbs_counts",
                                     lambda v: (v.count, v.bytes, v.errors, v.extra))

    # ---- provider functions ---------------------------------------------------------

    def on_context(self, ev: VerbsContext) -> None:
        """A context first seen: attach to its functions at the next ``attach_pending``
        (not inside the ring-buffer callback)."""
        self._pending.append(ev)

    def attach_pending(self) -> int:
        """Attach to the provider functions of the contexts seen since the last call;
        the number of probes attached."""
        added = 0
        pending, self._pending = self._pending, []
        for rec in pending:
            self.contexts += 1
            for op in PROVIDER_OPS:
                added += self._attach_function(rec.pid, op, getattr(rec, op))
        return added

    def _attach_function(self, pid: int, op: str, addr: int) -> int:
        where = f"pid {pid} ibverbs ops.{op} at {addr:#x}"
        m = procfs.mapping_of(pid, addr)
        if m is None or "x" not in m.perms:
            self.errors[where] = "not in an executable file mapping"
            return 0
        path = f"/proc/{pid}/root{m.path}"
        try:
            st = os.stat(path)
            vaddr = file_offset_to_vaddr(path, addr - m.start + m.offset)
        except (OSError, ELFError) as e:
            self.errors[where] = str(e)
            return 0
        if vaddr is None:
            self.errors[where] = f"{m.path}: offset outside every PT_LOAD segment"
            return 0
        try:
            vaddr = entry_sites(path, {op: vaddr})[op]  # past an ENDBR64 (entry.py)
        except (OSError, ELFError) as e:
            self.errors[where] = str(e)
            return 0
        key = (st.st_dev, st.st_ino, vaddr)
        if key in self._done:
            return 0
        self._done.add(key)
        entry, ret = PROVIDER_OPS[op]
        name = f"{op}@{vaddr:#x}"
        sites = [Site(path, vaddr, entry, False, name)]
        if ret:
            sites.append(Site(path, vaddr, ret, True, name))
        n = len(self.uprobes.attach(sites, self.errors))
        if n < len(sites):
            return n
        prov = self.providers.setdefault((st.st_dev, st.st_ino), ProviderFile(path))
        prov.functions[op] = vaddr
        return n

    # ---- counters -------------------------------------------------------------------

    def collect(self) -> list[bytes]:
        """VERBS records for every counter that changed since the last call."""
        ts = time.monotonic_ns()
        return [wire.VERBS.pack(pid=k.pid, tid=k.tid, qp_num=k.qp_num, op=k.op,
                                opcode=k.opcode, ts=ts, count=d[0], bytes=d[1], errors=d[2],
                                extra=d[3])
                for k, d in self._counts.read()]

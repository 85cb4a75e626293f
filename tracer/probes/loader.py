"""Assemble the enabled BPF concerns into one program and compile it with BCC.

All concerns share one BPF object, so the pid filter, counters and ring buffer in
``bpf/common.h`` exist once. Failures that users can fix (no BCC, no kernel headers,
no privileges, no tracefs) raise ``ProbeSetupError`` with the fix in the message.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path
from typing import Any, Iterable

import bpf
from tracer.events import wire

TRACEFS_CANDIDATES = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


class ProbeSetupError(RuntimeError):
    """The machine is missing something the probes need; the message says the fix."""


def tracefs() -> Path | None:
    """The mounted tracefs root, or None."""
    for p in TRACEFS_CANDIDATES:
        if Path(p, "events").is_dir():
            return Path(p)
    return None


def tracepoint_has_field(category: str, event: str, field: str) -> bool:
    """Whether this kernel's tracepoint format carries ``field`` (kernels differ)."""
    root = tracefs()
    if root is None:
        return False
    try:
        text = Path(root, "events", category, event, "format").read_text()
    except OSError:
        return False
    return f" {field};" in text


# What bpf/netwait.c reads from each tracepoint: present from Linux 5.15 to 6.18.
NETWAIT_FIELDS = {
    ("sock", "inet_sock_set_state"): ("oldstate", "newstate", "sport", "dport", "protocol",
                                      "saddr_v6[16]", "daddr_v6[16]"),
    ("tcp", "tcp_probe"): ("saddr[28]", "daddr[28]", "sport", "dport", "data_len", "snd_nxt",
                           "snd_una", "snd_cwnd", "snd_wnd"),
    ("tcp", "tcp_rcv_space_adjust"): ("sport", "dport", "saddr_v6[16]", "daddr_v6[16]"),
}


def netwait_missing() -> str | None:
    """Why socket-level request timing (bpf/netwait.c) cannot run here, or None."""
    for (category, event), fields in NETWAIT_FIELDS.items():
        for f in fields:
            if not tracepoint_has_field(category, event, f):
                return f"tracepoint {category}:{event} has no field {f!r} on this kernel"
    return None


# A tracepoint program taking its thread's task-local storage slot: what bpf/sockets.c's
# call in flight needs (TT_TASK_STORAGE). Loaded, never attached.
_TASK_STORAGE_PROBE = r"""
struct tt_probe_slot { u64 v; };
BPF_TASK_STORAGE(tt_probe_slots, struct tt_probe_slot);
int tt_task_storage_probe(void *ctx)
{
    struct tt_probe_slot *s = tt_probe_slots.task_storage_get(bpf_get_current_task_btf(), 0,
                                                              BPF_LOCAL_STORAGE_GET_F_CREATE);
    if (s)
        s->v++;
    return 0;
}
"""


@functools.lru_cache(maxsize=1)
def task_storage_missing() -> str | None:
    """Why tracepoint programs cannot keep per-thread state in task-local storage here
    (Linux 5.12+ with BTF), or None. Without it the socket probes keep the call in
    flight in a hash map, which costs each socket syscall more. Compiles and loads a
    small program once per process."""
    if not Path("/sys/kernel/btf/vmlinux").exists():
        return "no kernel BTF (/sys/kernel/btf/vmlinux)"
    try:
        check_environment()
        bcc = import_bcc()
        b = bcc.BPF(text=_TASK_STORAGE_PROBE.encode(), cflags=["-Wno-visibility"])
    except Exception as e:  # BCC raises bare Exception for compile failures
        return f"task storage program does not compile: {str(e).splitlines()[0][:200]}"
    try:
        b.load_func(b"tt_task_storage_probe", bcc.BPF.TRACEPOINT)
    except Exception as e:
        return f"the kernel refuses task storage in tracepoint programs: {str(e)[:200]}"
    finally:
        b.cleanup()
    return None


def kernel_headers_dir() -> Path:
    return Path("/lib/modules", platform.release(), "build")


def import_bcc() -> Any:
    """Import Debian's BCC module or explain how to get it."""
    try:
        import bcc  # type: ignore[import-not-found]
    except ImportError as e:
        raise ProbeSetupError(
            "BCC's Python module is not importable ({}). Install Debian's python3-bpfcc "
            "and link /usr/lib/python3/dist-packages/bcc into this environment "
            "(`make setup` does both). Note: the PyPI package named 'bcc' is unrelated."
            .format(e)
        ) from e
    if not hasattr(bcc, "BPF"):
        raise ProbeSetupError(
            f"the 'bcc' module at {getattr(bcc, '__file__', '?')} is not BCC (it has no BPF "
            "class; the PyPI package 'bcc' is an unrelated library): uninstall it and use "
            "Debian's python3-bpfcc"
        )
    return bcc


def check_environment() -> None:
    """Raise ProbeSetupError for the first missing prerequisite, with its fix."""
    if os.geteuid() != 0:
        from tracer.probes.caps import has_bpf_caps

        if not has_bpf_caps():
            raise ProbeSetupError(
                "tracing needs root or CAP_BPF + CAP_PERFMON (+ CAP_SYS_RESOURCE): "
                "run with sudo, or see `tokentrace doctor`"
            )
    if tracefs() is None:
        raise ProbeSetupError(
            "tracefs is not mounted: mount -t tracefs nodev /sys/kernel/tracing"
        )
    hdr = kernel_headers_dir()
    if not Path(hdr, "include").is_dir():
        raise ProbeSetupError(
            f"kernel headers are missing at {hdr}: install linux-headers-$(uname -r), or "
            "Debian's linux-headers-amd64 linked as /lib/modules/$(uname -r)/{build,source} "
            "(`make setup` does it)"
        )


def program_text(concerns: Iterable[str]) -> str:
    """The full C text: generated wire definitions, common.h, then each concern."""
    parts = [wire.c_definitions(), bpf.source("common.h")]
    for name in concerns:
        parts.append(f"/* ---- bpf/{name}.c ---- */\n" + bpf.source(name))
    return "\n".join(parts)


def load_run_exit(bpf: Any) -> None:
    """Load bpf/sockets.c's ``run_exit`` (the program the socket exit probes tail-call
    for a write on a connection armed for token runs) into ``run_progs``. Until it is
    there, armed writes are sent one record each. Raises ProbeSetupError."""
    bcc = import_bcc()
    try:
        fn = bpf.load_func(b"run_exit", bcc.BPF.TRACEPOINT)
        bpf[b"run_progs"][ctypes.c_int(0)] = ctypes.c_int(fn.fd)
    except Exception as e:  # BCC raises bare Exception for load failures
        raise ProbeSetupError(f"loading the token-run program failed: {e}") from e


def compile_program(concerns: Iterable[str], ringbuf_mb: int = 32,
                    extra_cflags: Iterable[str] = ()) -> Any:
    """Compile and load (tracepoint programs attach themselves on load)."""
    concerns = list(concerns)
    check_environment()
    bcc = import_bcc()
    pages = max(1, (ringbuf_mb * 1024 * 1024) // os.sysconf("SC_PAGE_SIZE"))
    pages = 1 << (pages.bit_length() - 1)  # BPF ring buffers are a power of two pages
    cflags = [f"-DTT_RINGBUF_PAGES={pages}", "-Wno-visibility", "-Wno-macro-redefined"]
    if tracepoint_has_field("sched", "sched_process_exit", "group_dead"):
        cflags.append("-DTT_HAVE_GROUP_DEAD")
    if "netwait" in concerns:
        cflags.append("-DTT_NETWAIT")  # sockets.c calls into bpf/netwait.c
    if "tls" in concerns:
        cflags.append("-DTT_TLS")  # sockets.c calls into bpf/tls.c
    cflags += list(extra_cflags)
    text = program_text(concerns)
    try:
        return bcc.BPF(text=text.encode(), cflags=cflags)
    except Exception as e:  # BCC raises bare Exception for compile/load/attach failures
        raise ProbeSetupError(f"loading the BPF program failed: {e}") from e

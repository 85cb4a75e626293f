"""`tokentrace doctor`: check every prerequisite of tracing and say how to fix each.

Each check returns a ``Check``; ``required`` ones must pass for `run` to work.
Nothing here changes the machine.
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tracer.probes.caps import (CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, effective_caps,
                                has_bpf_caps)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def check_privileges() -> Check:
    if os.geteuid() == 0 and has_bpf_caps():
        return Check("privileges", True, "root with CAP_SYS_ADMIN/CAP_BPF")
    if has_bpf_caps():
        caps = effective_caps()
        missing = [n for n, b in (("CAP_SYS_PTRACE", CAP_SYS_PTRACE),
                                  ("CAP_DAC_READ_SEARCH", CAP_DAC_READ_SEARCH))
                   if not caps & (1 << b)]
        if missing:
            return Check("privileges", True,
                         f"CAP_BPF + CAP_PERFMON, but not {', '.join(missing)}: other users' "
                         "/proc/PID/fd and maps may be unreadable",
                         "add CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH", required=False)
        return Check("privileges", True, "CAP_BPF + CAP_PERFMON")
    return Check("privileges", False, f"euid {os.geteuid()} without CAP_BPF/CAP_PERFMON",
                 "run as root (sudo tokentrace ...), or grant CAP_BPF, CAP_PERFMON, "
                 "CAP_SYS_RESOURCE, CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH "
                 "(docs/deploy.md explains the least-privilege set)")


def check_bpf_syscall() -> Check:
    """Create and close a one-element array map with the bpf(2) syscall."""
    from tracer.probes.uprobes import SYS_BPF, sys_bpf

    if platform.machine() not in SYS_BPF:
        return Check("bpf syscall", False, f"unknown architecture {platform.machine()}",
                     "tokentrace supports x86_64 and aarch64")
    attr = (ctypes.c_uint32 * 32)()
    attr[0], attr[1], attr[2], attr[3] = 2, 4, 4, 1  # BPF_MAP_TYPE_ARRAY, key, value, entries
    try:
        os.close(sys_bpf(0, attr))  # BPF_MAP_CREATE
        return Check("bpf syscall", True, "BPF_MAP_CREATE works")
    except OSError as e:
        err = e.errno
    hint = "run as root or with CAP_BPF"
    unpriv = Path("/proc/sys/kernel/unprivileged_bpf_disabled")
    if err == 38:
        hint = "this kernel has no BPF (CONFIG_BPF_SYSCALL=n): use a kernel built with it"
    elif err == 1 and unpriv.exists() and unpriv.read_text().strip() != "0":
        hint = "unprivileged BPF is disabled: run as root or with CAP_BPF"
    return Check("bpf syscall", False, f"bpf(BPF_MAP_CREATE) failed: {os.strerror(err)}", hint)


def check_uprobe_multi() -> Check:
    """uprobe_multi links (Linux 6.6+): without them GPU probes still work, as one perf
    event each, but stopping takes ~0.1 s per probe (tracer/probes/uprobes.py); and
    their sessions (6.13+), which spare the syncs inside an engine's step a return probe
    (bpf/cuda.c)."""
    from tracer.probes.uprobes import uprobe_multi_support

    ok, why = uprobe_multi_support()
    if ok:
        sessions, why_not = uprobe_multi_support(session=True)
        if sessions:
            return Check("uprobe links", True, "uprobe_multi with sessions: GPU probes "
                         "attach as links, and syncs inside an engine's step cost no "
                         "return probe", required=False)
        return Check("uprobe links", True, f"uprobe_multi: GPU probes attach as links; no "
                     f"uprobe sessions ({why_not}): every sync's return is probed",
                     "Linux 6.13 or later has sessions", required=False)
    return Check("uprobe links", False, f"no uprobe_multi ({why}): GPU probes attach as "
                 "perf events; stopping and --gpu-sample switches take ~0.1 s per probe",
                 "Linux 6.6 or later has them", required=False)


def check_tracefs() -> Check:
    from tracer.probes.loader import tracefs

    root = tracefs()
    if root is None:
        return Check("tracefs", False, "no tracefs with events/ is mounted at "
                     "/sys/kernel/tracing or /sys/kernel/debug/tracing (syscall "
                     "tracepoints are found there)",
                     "mount -t tracefs nodev /sys/kernel/tracing (`make setup` does; add "
                     "`tracefs /sys/kernel/tracing tracefs defaults 0 0` to /etc/fstab to "
                     "keep it); in a container, mount the host's /sys/kernel/tracing "
                     "(deploy/k8s/tokentrace.yaml does)")
    if not Path(root, "events", "syscalls", "sys_enter_read").is_dir():
        return Check("tracefs", False, f"{root} has no syscall tracepoints",
                     "the kernel needs CONFIG_FTRACE_SYSCALLS=y")
    return Check("tracefs", True, f"{root} with syscall tracepoints")


def check_debugfs(mounts: str = "/proc/self/mounts") -> Check:
    """debugfs: where tracefs lives on kernels older than 4.1 (and where some tools
    look for it); optional when tracefs is mounted on its own."""
    try:
        types = {line.split()[2] for line in Path(mounts).read_text().splitlines()
                 if len(line.split()) > 2}
    except OSError:
        types = set()
    if "debugfs" in types:
        return Check("debugfs", True, "mounted", required=False)
    return Check("debugfs", False, "debugfs is not mounted (only needed where the kernel "
                 "has tracefs under /sys/kernel/debug/tracing)",
                 "mount -t debugfs nodev /sys/kernel/debug (`make setup` does); in a "
                 "container, mount the host's /sys/kernel/debug", required=False)


def check_lockdown(path: str = "/sys/kernel/security/lockdown") -> Check:
    """Kernel lockdown in confidentiality mode forbids BPF reading kernel memory."""
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return Check("lockdown", True, "no lockdown LSM", required=False)
    mode = text.split("[", 1)[-1].split("]", 1)[0] if "[" in text else text
    if mode == "confidentiality":
        return Check("lockdown", False, "kernel lockdown is 'confidentiality': BPF may not "
                     "read kernel or user memory",
                     "boot with lockdown=integrity (or none); with Secure Boot, lockdown "
                     "follows it: see mokutil --disable-validation")
    return Check("lockdown", True, f"lockdown mode '{mode}' allows tracing", required=False)


def check_memlock(release: str | None = None, limit: int | None = None,
                  caps: int | None = None) -> Check:
    """Kernels before 5.11 charge BPF maps to RLIMIT_MEMLOCK; BCC raises the limit only
    with CAP_SYS_RESOURCE."""
    import resource

    release = release or platform.release()
    nums = [int(x) for x in release.split("-")[0].split(".")[:2] if x.isdigit()]
    if nums >= [5, 11]:
        return Check("memlock", True, f"kernel {release} accounts BPF memory to cgroups, "
                     "RLIMIT_MEMLOCK does not apply", required=False)
    limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if limit is None else limit
    caps = effective_caps() if caps is None else caps
    CAP_SYS_RESOURCE = 24
    if limit == resource.RLIM_INFINITY or caps & (1 << CAP_SYS_RESOURCE):
        return Check("memlock", True, "RLIMIT_MEMLOCK is unlimited or can be raised",
                     required=False)
    return Check("memlock", False, f"kernel {release} charges BPF maps to RLIMIT_MEMLOCK "
                 f"({limit} bytes) and CAP_SYS_RESOURCE is missing to raise it",
                 "run as root, add CAP_SYS_RESOURCE, or raise the limit "
                 "(ulimit -l unlimited; LimitMEMLOCK=infinity in a systemd unit)")


def check_uprobes() -> Check:
    p = Path("/sys/bus/event_source/devices/uprobe/type")
    if p.exists():
        return Check("uprobes", True, "uprobe PMU present (GPU library probes can attach)",
                     required=False)
    return Check("uprobes", False, "no uprobe PMU: CUDA/NCCL/ibverbs probes cannot attach",
                 "use a kernel with CONFIG_UPROBE_EVENTS=y; socket tracing still works",
                 required=False)


def check_kernel_headers() -> Check:
    release = platform.release()
    build = Path("/lib/modules", release, "build")
    if Path(build, "include").is_dir():
        target = os.path.realpath(build)
        note = "" if release in target else f" (linked to {target})"
        return Check("kernel headers", True, f"{build}{note}")
    return Check("kernel headers", False, f"{build} is missing (BCC compiles against it)",
                 f"apt-get install linux-headers-{release}; if that package does not exist, "
                 "apt-get install linux-headers-amd64 and link its directories as "
                 f"/lib/modules/{release}/build and /source (`make setup` does this)")


def check_bcc() -> Check:
    try:
        from tracer.probes.loader import ProbeSetupError, import_bcc

        bcc = import_bcc()
    except ProbeSetupError as e:
        return Check("bcc", False, str(e).split(":")[0],
                     "apt-get install python3-bpfcc, then link "
                     "/usr/lib/python3/dist-packages/bcc into this Python's site-packages "
                     "(`make setup` does both); never `pip install bcc` (unrelated package)")
    return Check("bcc", True, f"BCC at {os.path.dirname(bcc.__file__)}")


def check_btf() -> Check:
    ok = Path("/sys/kernel/btf/vmlinux").exists()
    return Check("btf", ok, "kernel BTF present" if ok else "no /sys/kernel/btf/vmlinux",
                 "" if ok else "optional: a kernel with CONFIG_DEBUG_INFO_BTF=y", required=False)


def check_task_storage(previous: list[Check]) -> Check:
    if not all(c.ok for c in previous if c.required):
        return Check("task storage", False, "not checked: it needs a BPF program loaded",
                     "fix the failing checks above first", required=False)
    from tracer.probes.loader import task_storage_missing

    why = task_storage_missing()
    if why is None:
        return Check("task storage", True, "the socket probes keep each thread's call in "
                     "flight in task-local storage", required=False)
    return Check("task storage", False, f"{why}: the socket probes keep calls in flight "
                 "in a hash map instead (more kernel time a socket syscall)",
                 "optional: Linux 5.12+ with CONFIG_DEBUG_INFO_BTF=y", required=False)


def check_compile(previous: list[Check]) -> Check:
    if not all(c.ok for c in previous if c.required):
        return Check("bpf program", False, "skipped: fix the checks above first", "")
    try:
        from tracer.probes.loader import compile_program

        b = compile_program(["process", "sockets"], ringbuf_mb=1)
        b.cleanup()
    except Exception as e:  # report any failure of the real load
        return Check("bpf program", False, f"compiling/loading failed: {e}",
                     "run `tokentrace doctor` as root; see the error above")
    return Check("bpf program", True, "socket and process probes compile, load and attach")


CHECKS: list[Callable[[], Check]] = [
    check_privileges, check_bpf_syscall, check_tracefs, check_debugfs, check_lockdown,
    check_memlock, check_uprobes, check_uprobe_multi, check_kernel_headers, check_btf,
    check_bcc,
]


def run_checks(load: bool = True) -> list[Check]:
    results = [fn() for fn in CHECKS]
    if load:
        results.append(check_task_storage(results))
        results.append(check_compile(results))
    return results


def format_checks(results: list[Check]) -> str:
    lines = []
    for c in results:
        mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
        lines.append(f"{mark}  {c.name:<15} {c.detail}")
        if not c.ok and c.fix:
            lines.append(f"      {'':<15} fix: {c.fix}")
    return "\n".join(lines)

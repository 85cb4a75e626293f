"""The process's effective Linux capabilities, and whether they are enough for BPF.

Shared by the loader (which refuses to start without them) and ``tokentrace doctor``
(which says what is missing)."""

from __future__ import annotations

from pathlib import Path

CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39
CAP_SYS_PTRACE = 19
CAP_DAC_READ_SEARCH = 2


def effective_caps() -> int:
    """The CapEff bit mask of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def has_bpf_caps() -> bool:
    """CAP_SYS_ADMIN, or CAP_BPF with CAP_PERFMON: enough to load and attach BPF."""
    caps = effective_caps()
    if caps & (1 << CAP_SYS_ADMIN):
        return True
    return bool(caps & (1 << CAP_BPF)) and bool(caps & (1 << CAP_PERFMON))

"""`tokentrace doctor` on a machine missing its prerequisites: run in a private mount
namespace where tracefs and debugfs are unmounted and /lib/modules is empty (what a
fresh VM looks like before `make setup`), every failure must come with its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT
from tracer.doctor import check_debugfs, check_lockdown, check_memlock

FRESH = """
set -e
mount --make-rprivate /
for m in /sys/kernel/debug/tracing /sys/kernel/tracing /sys/kernel/debug; do
  while mountpoint -q "$m"; do umount -l "$m"; done
done
mount -t tmpfs none /lib/modules
exec "$@"
"""


def test_doctor_on_a_fresh_machine_names_every_fix() -> None:
    if os.geteuid() != 0:
        raise AssertionError("a private mount namespace needs root (`make test` is root)")
    r = subprocess.run(["unshare", "--mount", "sh", "-c", FRESH, "sh", sys.executable, "-m",
                        "tracer", "doctor", "--json"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1, r.stdout + r.stderr  # required checks failed
    checks = {c["name"]: c for c in json.loads(r.stdout)}
    assert not checks["tracefs"]["ok"] and "mount -t tracefs" in checks["tracefs"]["fix"]
    assert not checks["debugfs"]["ok"] and "mount -t debugfs" in checks["debugfs"]["fix"]
    assert not checks["kernel headers"]["ok"]
    assert "linux-headers" in checks["kernel headers"]["fix"]
    assert not checks["bpf program"]["ok"]  # not attempted with the above failing
    assert not checks["task storage"]["ok"] and "checks above" in checks["task storage"]["fix"]
    for c in checks.values():
        if not c["ok"] and c["name"] != "bpf program":
            assert c["fix"], f"{c['name']} fails without saying how to fix it"
    # the host itself is untouched
    assert os.path.ismount("/sys/kernel/tracing") or os.path.isdir("/sys/kernel/tracing/events")


def test_debugfs_check_reads_the_mount_table(tmp_path) -> None:
    with open("/proc/self/mounts") as f:
        here = f.read()
    assert check_debugfs().ok == (" debugfs " in here)
    table = tmp_path / "mounts"
    table.write_text("proc /proc proc rw 0 0\nnodev /sys/kernel/tracing tracefs rw 0 0\n")
    c = check_debugfs(str(table))
    assert not c.ok and not c.required and "mount -t debugfs" in c.fix


def test_lockdown_confidentiality_is_explained(tmp_path) -> None:
    f = tmp_path / "lockdown"
    f.write_text("none integrity [confidentiality]\n")
    c = check_lockdown(str(f))
    assert not c.ok and c.required and "lockdown=integrity" in c.fix
    f.write_text("none [integrity] confidentiality\n")
    assert check_lockdown(str(f)).ok
    assert check_lockdown(str(tmp_path / "absent")).ok


def test_memlock_matters_only_before_5_11() -> None:
    assert check_memlock("6.1.0-18-amd64", limit=65536, caps=0).ok
    c = check_memlock("5.10.0-28-amd64", limit=65536, caps=0)
    assert not c.ok and "CAP_SYS_RESOURCE" in c.fix
    assert check_memlock("5.10.0-28-amd64", limit=65536, caps=1 << 24).ok

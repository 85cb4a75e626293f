"""Uprobes attached in groups (tracer/probes/uprobes.py), both ways: uprobe_multi links
and BCC's perf events, on a real library that a real process calls. Each way must see
every call (entry and return, with the return value), and none once detached."""

from __future__ import annotations

import subprocess
import threading

import pytest

from tracer.probes import uprobes as up
from tracer.probes.gpu import exported_functions

pytestmark = pytest.mark.bpf

LIB = """
int tt_a(int x) { return x * 3 + 1; }
int tt_b(int x) { return x - 1; }
"""
# "a N" calls tt_a(2) N times, "b N" tt_b(1) N times; each answers "ok"
PROG = r"""
#include <stdio.h>
#include <stdlib.h>
int tt_a(int x); int tt_b(int x);
int main(void) {
    char line[64]; long sum = 0;
    while (fgets(line, sizeof line, stdin)) {
        int n = atoi(line + 2);
        for (int i = 0; i < n; i++) sum += line[0] == 'a' ? tt_a(2) : tt_b(1);
        printf("ok %ld\n", sum); fflush(stdout);
    }
    return 0;
}
"""
BPF_TEXT = """
#include <uapi/linux/ptrace.h>
BPF_ARRAY(hits, u64, 3);
static int bump(int i) {
    if (bpf_get_current_pid_tgid() >> 32 != TARGET) return 0;
    u64 *v = hits.lookup(&i);
    if (v) __sync_fetch_and_add(v, 1);
    return 0;
}
int on_a(struct pt_regs *ctx) { return bump(0); }
int on_a_ret(struct pt_regs *ctx) { return PT_REGS_RC(ctx) == 7 ? bump(1) : 0; }
int on_b(struct pt_regs *ctx) { return bump(2); }
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("uprobes")
    (d / "lib.c").write_text(LIB)
    (d / "main.c").write_text(PROG)
    # CET on, as Ubuntu's gcc builds by default: the entry sites go past ENDBR64
    subprocess.run(["gcc", "-O2", "-fcf-protection=full", "-shared", "-fPIC", "-o",
                    str(d / "libttup.so"), str(d / "lib.c")], check=True)
    subprocess.run(["gcc", "-O2", "-o", str(d / "main"), str(d / "main.c"), f"-L{d}",
                    "-lttup", f"-Wl,-rpath,{d}"], check=True)
    return d


class Caller:
    def __init__(self, d):
        self.p = subprocess.Popen([str(d / "main")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)

    def call(self, what: str, n: int) -> None:
        self.p.stdin.write(f"{what} {n}\n")
        self.p.stdin.flush()
        assert self.p.stdout.readline().startswith("ok")

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(10)


def _setup(built, mode):
    from bcc import BPF

    caller = Caller(built)
    bpf = BPF(text=BPF_TEXT.replace("TARGET", str(caller.p.pid)).encode())
    lib = str(built / "libttup.so")
    at = exported_functions(lib, probe_sites=True)
    sites = [up.Site(lib, at["tt_a"], "on_a", name="tt_a"),
             up.Site(lib, at["tt_a"], "on_a_ret", ret=True, name="tt_a"),
             up.Site(lib, at["tt_b"], "on_b", name="tt_b")]
    return caller, bpf, up.Uprobes(bpf, threading.Lock(), mode), sites


def hits(bpf) -> list[int]:
    return [v.value for v in bpf[b"hits"].values()]


def test_this_kernel_has_uprobe_multi_links():
    """The dev and CI VMs run Linux 6.18; links need 6.6, their sessions 6.13."""
    assert up.uprobe_multi_support() == (True, "")
    assert up.uprobe_multi_support(session=True) == (True, "")


SESSION_BPF = """
#include <uapi/linux/ptrace.h>
BPF_ARRAY(hits, u64, 2);     /* [0]: entries, [1]: returns */
BPF_HASH(pending, u32, u8);  /* threads inside a call whose return was asked for */
static void bump(int i) {
    u64 *v = hits.lookup(&i);
    if (v) __sync_fetch_and_add(v, 1);
}
int on_call(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    if (id >> 32 != TARGET) return 1;
    u32 tid = id;
    if (pending.lookup(&tid)) {  /* the return of a call whose entry returned 0 */
        pending.delete(&tid);
        bump(1);
        return 0;
    }
    bump(0);
    if (PT_REGS_PARM1(ctx) != 2) return 1;  /* tt_b(1): no return wanted */
    u8 one = 1;
    pending.update(&tid, &one);
    return 0;
}
"""


@pytest.mark.parametrize("mode", ["sessions", "auto"])
def test_a_session_runs_at_the_return_only_where_its_entry_asked(built, mode):
    """One program at entry and return (an uprobe session link): tt_a's entries ask
    for the return (return 0), tt_b's do not (return 1), and the kernel runs the
    program at exactly the returns asked for."""
    from bcc import BPF

    caller = Caller(built)
    bpf = BPF(text=SESSION_BPF.replace("TARGET", str(caller.p.pid)).encode())
    lib = str(built / "libttup.so")
    at = exported_functions(lib, probe_sites=True)
    probes = up.Uprobes(bpf, threading.Lock(), mode)
    try:
        assert probes.sessions and probes.kind == "uprobe_multi links, with sessions"
        errors: dict[str, str] = {}
        got = probes.attach([up.Site(lib, at[f], "on_call", name=f, session=True)
                             for f in ("tt_a", "tt_b")], errors)
        assert not errors and len(got) == 2 and len(got.links) == 1
        caller.call("a", 300)
        caller.call("b", 200)
        assert hits(bpf) == [500, 300]
        probes.close(errors)
        caller.call("a", 10)
        assert hits(bpf) == [500, 300] and not errors
    finally:
        caller.close()
        bpf.cleanup()


def test_without_sessions_a_session_site_is_refused_by_name(built):
    """Through plain links (or perf events) a session site is an error of its own,
    and the other sites still attach."""
    caller, bpf, probes, sites = _setup(built, "multi")
    try:
        assert not probes.sessions and probes.kind == "uprobe_multi links"
        errors: dict[str, str] = {}
        odd = up.Site(sites[2].path, sites[2].vaddr, "on_b", name="tt_b", session=True)
        got = probes.attach([sites[0], odd], errors)
        assert list(errors) == [odd.describe()] and "no uprobe sessions" in errors[odd.describe()]
        assert len(got) == 1
    finally:
        probes.close({})
        caller.close()
        bpf.cleanup()


@pytest.mark.parametrize("mode", ["multi", "perf"])
def test_every_call_is_seen_and_none_once_detached(built, mode):
    caller, bpf, probes, sites = _setup(built, mode)
    try:
        assert probes.multi == (mode == "multi")
        errors: dict[str, str] = {}
        got = probes.attach(sites, errors)
        assert not errors and len(got) == 3 and probes.sites_attached() == 3
        # one link per (file, handler, entry/return): three here
        assert len(got.links) == (3 if mode == "multi" else 0)
        caller.call("a", 1000)
        caller.call("b", 250)
        assert hits(bpf) == [1000, 1000, 250]
        took = probes.detach(got, errors)
        assert not errors and took > 0 and probes.sites_attached() == 0
        caller.call("a", 500)
        caller.call("b", 500)
        assert hits(bpf) == [1000, 1000, 250]
        # attached again (a --gpu-sample "on" switch), then taken off by close()
        again = probes.attach(sites, errors)
        caller.call("a", 10)
        assert hits(bpf) == [1010, 1010, 250] and len(again) == 3
        probes.close(errors)
        caller.call("a", 10)
        assert hits(bpf) == [1010, 1010, 250] and not errors
    finally:
        caller.close()
        bpf.cleanup()


def test_a_site_the_kernel_refuses_is_named_and_the_rest_still_attach(built, monkeypatch):
    """One bad offset fails a whole link; the group is then linked one site at a time,
    so only the refused site is lost (and named in the errors)."""
    caller, bpf, probes, sites = _setup(built, "multi")
    real = up._create_link
    refused = sites[0]

    def create(prog_fd, path, offsets, ret, pid=0, session=False):
        bad = up._file_offsets([refused], {})[0][1]
        if bad in offsets and not ret:
            raise OSError(22, "Invalid argument")
        return real(prog_fd, path, offsets, ret, pid, session)

    monkeypatch.setattr(up, "_create_link", create)
    # on_a and on_b share no link: put both entry sites under one handler
    same = [refused, up.Site(refused.path, sites[2].vaddr, "on_a", name="tt_b")]
    try:
        errors: dict[str, str] = {}
        got = probes.attach(same + [sites[1]], errors)
        assert list(errors) == [f"{refused.path}:tt_a"]
        assert "uprobe_multi link: Invalid argument" in errors[f"{refused.path}:tt_a"]
        assert len(got) == 2
        caller.call("a", 100)
        caller.call("b", 30)
        assert hits(bpf) == [30, 100, 0]  # tt_b counted by on_a; tt_a's return still seen
    finally:
        probes.close({})
        caller.close()
        bpf.cleanup()


def test_a_site_outside_the_file_is_an_error_not_a_crash(built):
    caller, bpf, probes, sites = _setup(built, "multi")
    try:
        errors: dict[str, str] = {}
        gone = up.Site("/nonexistent/libcuda.so.1", 0x1000, "on_a", name="cuLaunchKernel")
        far = up.Site(sites[0].path, 1 << 40, "on_a", name="nowhere")
        got = probes.attach([gone, far, sites[2]], errors)
        assert len(got) == 1
        assert "No such file" in errors["/nonexistent/libcuda.so.1:cuLaunchKernel"]
        assert "outside every PT_LOAD" in errors[f"{sites[0].path}:nowhere"]
        caller.call("b", 5)
        assert hits(bpf) == [0, 0, 5]
    finally:
        probes.close({})
        caller.close()
        bpf.cleanup()


@pytest.mark.parametrize("mode", ["multi", "perf"])
def test_suspended_groups_see_nothing_and_come_back_in_place(built, mode):
    """`tokentrace run` paused: every group out, each owner's handle still good after
    the resume; a group attached while suspended waits for it, one detached while
    suspended never comes back."""
    caller, bpf, probes, sites = _setup(built, mode)
    try:
        errors: dict[str, str] = {}
        a = probes.attach(sites[:2], errors)
        gone = probes.attach(sites[2:], errors)
        caller.call("a", 10)
        assert hits(bpf) == [10, 10, 0]
        probes.suspend(errors)
        assert probes.sites_attached() == 0 and probes.suspended
        late = probes.attach(sites[2:], errors)  # a library found while paused
        probes.detach(gone, errors)  # an owner lets go while paused
        caller.call("a", 10)
        caller.call("b", 10)
        assert hits(bpf) == [10, 10, 0]
        probes.resume(errors)
        assert not errors and probes.sites_attached() == 3
        assert len(a) == 2 and len(late) == 1 and len(gone) == 0
        caller.call("a", 5)
        caller.call("b", 7)
        assert hits(bpf) == [15, 15, 7]
        probes.detach(a, errors)  # the owner's handle detaches what resume put back
        caller.call("a", 5)
        assert hits(bpf) == [15, 15, 7] and not errors
    finally:
        probes.close({})
        caller.close()
        bpf.cleanup()

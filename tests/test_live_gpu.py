"""GPU probes on a real process: the sample workload calls the stand-in libcuda.so.1 and
libnccl.so.2 (real sonames, exported symbols and signatures), real uprobes attach to
them, and the tracer's totals must equal the stand-ins' own call counts exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from samples.gpu.build import build
from tests.live import traced_cli

STEPS, KERNELS = 200, 12


@pytest.fixture(scope="module")
def gpu_build(tmp_path_factory):
    return build(tmp_path_factory.mktemp("gpu"))


def run_workload(paths, tmp: Path, args: list[str], tracer_args: list[str] = (),
                 kernel_ns: int = 2000, during=None):
    env = dict(os.environ, TT_STANDIN_COUNTS=str(tmp / "cuda.json"),
               TT_STANDIN_NCCL_COUNTS=str(tmp / "nccl.json"), TT_STANDIN_KERNEL_NS=str(kernel_ns))
    w = subprocess.Popen([str(paths["workload"]), "--wait", *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    assert w.stdout.readline().strip() == "ready"
    summary = tmp / "summary.json"
    with traced_cli(["--pid", str(w.pid), "--summary", str(summary), "--record",
                     str(tmp / "gpu.ttcap"), *tracer_args], str(tmp / "spans.jsonl")) as run:
        w.stdin.write("go\n")
        w.stdin.flush()
        if during is not None:
            during()  # while the workload launches
        assert w.stdout.readline().strip() == "done"
        assert w.wait(30) == 0
    assert run.returncode == 0, run.stderr
    truth = json.loads((tmp / "cuda.json").read_text())
    nccl = json.loads((tmp / "nccl.json").read_text())
    doc = json.loads(summary.read_text())
    (proc,) = doc["gpu"]["processes"]
    assert proc["pid"] == w.pid
    return proc, truth, nccl, doc, run


@pytest.mark.parametrize("links", ["multi", "perf"])
def test_counts_bytes_names_and_waits_match_the_libraries_exactly(gpu_build, tmp_path, links):
    """Both ways of attaching (tracer/probes/uprobes.py) see every call."""
    proc, truth, nccl, doc, run = run_workload(
        gpu_build, tmp_path, ["--steps", str(STEPS), "--kernels", str(KERNELS),
                              "--threads", "3", "--graph-every", "5", "--nccl"],
        ["--uprobe-links", links])
    kind = {"multi": "uprobe_multi links", "perf": "perf events"}[links]
    assert f"GPU probes attached as {kind}" in run.stderr
    assert "GPU probes detached in" in run.stderr and f"({kind})" in run.stderr
    assert truth["launches"] == 3 * STEPS * KERNELS
    assert proc["kernel_launches"] == truth["launches"]
    assert proc["graph_launches"] == truth["graph_launches"] == 3 * STEPS // 5
    assert proc["memcpy_bytes"]["h2d"] == truth["h2d_bytes"]
    assert proc["memcpy_bytes"]["d2h"] == truth["d2h_bytes"]
    assert proc["memcpy_calls"]["h2d"] == truth["h2d_calls"]
    assert proc["memset_bytes"] == truth["memset_bytes"]
    assert proc["memset_calls"] == truth["memset_calls"]
    assert proc["sync_calls"] == truth["sync_calls"]
    assert proc["query_polls"] == truth["query_not_ready"]
    # every stream sync slept ~2 us per launch queued before it: the waits are visible
    assert proc["sync_wait_ms"] > truth["sync_calls"] * KERNELS * 0.002 * 0.9
    # names: every launch is named, the cuKernelGetFunction alias included
    top = {k["name"]: k["launches"] for k in proc["top_kernels"]}
    assert top == {f"_Z11tt_kernel_{k:02d}PfS_i": 3 * STEPS for k in range(KERNELS)}
    # one record per name and per alias, though kernel 1's alias is asked for before
    # each of its launches (3 x STEPS calls)
    assert proc["kernel_names"]["name_records"] == 3 * (KERNELS + 1)
    # per thread: three workers with the same work, the main thread with none
    workers = [t for t in proc["threads"].values() if t["kernel_launches"]]
    assert len(workers) == 3
    assert all(t["kernel_launches"] == STEPS * KERNELS for t in workers)
    # device memory: two buffers per thread, all freed
    mem = proc["device_memory"]
    assert mem["allocs"] == truth["alloc_calls"] == 6
    assert mem["frees"] == truth["free_calls"] and mem["frees_of_unknown_size"] == 0
    assert mem["peak_bytes"] <= truth["alloc_bytes"] and mem["peak_bytes"] >= (1 << 20)
    assert mem["live_bytes"] == 0
    # NCCL: op counts and bytes (count x dtype size), the communicator's rank and id
    assert proc["nccl_ops"]["allreduce"] == nccl["allreduce"][0] == 3 * STEPS
    assert proc["nccl_bytes"]["allreduce"] == nccl["allreduce"][1]
    assert proc["nccl_ops"]["group_start"] == nccl["group_start"][0]
    (comm,) = proc["nccl_communicators"]
    assert (comm["rank"], comm["nranks"], comm["ret"]) == (0, 1, 0)
    assert comm["comm_id"] == 0x8877665544332211
    # nothing lost, and the drop counters are in the summary
    assert doc["report"]["capture.lost_gpu"] == 0
    assert doc["report"]["capture.bursts_full"] == 0
    assert "no events lost" in run.stderr


@pytest.mark.parametrize("links", ["sessions", "multi"])
def test_syncs_inside_a_step_are_counted_and_only_results_syncs_timed(gpu_build, tmp_path,
                                                                      links):
    """Each step syncs after its input copy (as PyTorch does after a pageable copy) and
    again on its results. Through uprobe sessions (Linux 6.13+) the input sync's return
    is not probed once the thread has synced on a device-to-host copy: it is counted at
    its entry in the burst that goes on, so a step is one burst. Through plain links
    every sync ends a burst of its own. Either way every call is counted exactly, and
    the step rule finds the same steps. The wait times: each results sync waits for
    the kernels queued before it, the input sync (nothing queued) for none."""
    from tracer.probes.uprobes import uprobe_multi_support

    if links == "sessions" and not uprobe_multi_support(session=True)[0]:
        with pytest.raises(AssertionError, match="no uprobe sessions"):
            run_workload(gpu_build, tmp_path, ["--steps", "10"], ["--uprobe-links", links])
        return
    steps = 400
    proc, truth, _, doc, run = run_workload(
        gpu_build, tmp_path, ["--steps", str(steps), "--kernels", str(KERNELS),
                              "--input-sync"], ["--uprobe-links", links])
    kind = "uprobe_multi links" + (", with sessions" if links == "sessions" else "")
    assert f"GPU probes attached as {kind}" in run.stderr
    assert truth["sync_calls"] == steps + steps - steps // 4  # every 4th step polls
    assert proc["sync_calls"] == truth["sync_calls"]
    assert proc["kernel_launches"] == truth["launches"] == steps * KERNELS
    assert proc["memcpy_calls"]["h2d"] == truth["h2d_calls"]
    assert proc["memcpy_bytes"]["d2h"] == truth["d2h_bytes"]
    assert proc["query_polls"] == truth["query_not_ready"]
    # a step ends at a results sync (a polled step runs on into the next one), but for
    # the first input sync (no results synced before it) and the last, polled, step
    # (closed at the thread's exit)
    assert doc["report"]["gpu_steps"] == steps - steps // 4 + 2
    # the results syncs waited ~2 us per launch queued before them (the stand-in's
    # kernel time); in "multi" the input syncs are timed too, and waited ~0
    assert proc["sync_wait_ms"] > (steps - steps // 4) * KERNELS * 0.002 * 0.9
    if links == "sessions":
        assert proc["bursts"] <= steps + 2  # the first step's input sync ends one too
    else:
        assert proc["bursts"] >= 2 * steps


@pytest.mark.parametrize("links", ["sessions", "multi"])
def test_calls_after_the_last_results_sync_are_held_open_and_read_in_place(gpu_build,
                                                                           tmp_path, links):
    """A thread that syncs on its results, then launches and syncs with no copy back
    (a script's closing torch.cuda.synchronize()): through uprobe sessions that sync
    ends no step, so those launches stay in the thread's open burst, unsent, while it
    waits. ``GpuProbes.open_bursts`` reads them in place; the benches' windows count
    the ledger plus them (bench/gpu_validate.py ``totals``), exactly, and the thread's
    exit sends them. Through plain links every sync ends its burst: nothing open."""
    from bench.gpu_validate import Tracer, totals
    from tracer.correlate.gpu import GpuLedger
    from tracer.probes.loader import ProbeSetupError
    from tracer.probes.uprobes import uprobe_multi_support

    sessions = uprobe_multi_support(session=True)[0]
    steps = 40
    env = dict(os.environ, TT_STANDIN_COUNTS=str(tmp_path / "cuda.json"),
               TT_STANDIN_KERNEL_NS="2000")
    w = subprocess.Popen([str(gpu_build["workload"]), "--wait", "--hold", "--steps",
                          str(steps), "--kernels", str(KERNELS)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    tr = None
    try:
        assert w.stdout.readline().strip() == "ready"
        ledger = GpuLedger()
        if links == "sessions" and not sessions:  # a kernel before 6.13: said, not skipped
            with pytest.raises(ProbeSetupError, match="no uprobe sessions"):
                Tracer([w.pid], ledger, None, uprobe_links=links)
            return
        tr = Tracer([w.pid], ledger, None, uprobe_links=links)
        w.stdin.write("go\n")
        w.stdin.flush()
        assert w.stdout.readline().strip() == "held"
        tr.settle()
        opened = tr.open_bursts(w.pid)
        sent, seen = totals(ledger, w.pid), totals(ledger, w.pid, opened)
        assert seen["launches"] == (steps + 1) * KERNELS
        if links == "sessions":
            assert [b.launches for b in opened] == [KERNELS]
            assert [b.reason for b in opened] == ["drain"]
            assert sum(opened[0].handle_counts.values()) == KERNELS
            assert sent["launches"] == steps * KERNELS
        else:
            assert opened == []
            assert sent == seen
        w.stdin.write("go\n")
        w.stdin.flush()
        assert w.stdout.readline().strip() == "done"
        assert w.wait(30) == 0
        tr.settle()
        assert tr.open_bursts(w.pid) == []  # the thread's exit sent them
        drops, tr = tr.stop(), None
    finally:
        if tr is not None:
            tr.stop()
        if w.poll() is None:
            w.kill()
    truth = json.loads((tmp_path / "cuda.json").read_text())
    assert totals(ledger, w.pid)["launches"] == truth["launches"] == (steps + 1) * KERNELS
    assert totals(ledger, w.pid)["syncs"] == truth["sync_calls"]
    assert drops.get("lost_gpu") == 0


def test_replay_of_the_capture_gives_the_same_summary(gpu_build, tmp_path):
    proc, truth, _, doc, _ = run_workload(gpu_build, tmp_path,
                                          ["--steps", "50", "--kernels", "20"])
    again = tmp_path / "again.json"
    r = subprocess.run([sys.executable, "-m", "tracer", "replay", str(tmp_path / "gpu.ttcap"),
                        "--quiet", "--summary", str(again)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(again.read_text())["gpu"] == doc["gpu"]
    # 20 kernels per step > 16 slots: bursts were cut early and stayed exact
    assert proc["kernel_launches"] == truth["launches"] == 50 * 20
    assert {k["launches"] for k in proc["top_kernels"]} == {50}


def test_short_burst_interval_keeps_counts_exact(gpu_build, tmp_path):
    """Bursts flushed by time (1 us here) and at thread exit lose nothing."""
    proc, truth, _, _, _ = run_workload(gpu_build, tmp_path, ["--steps", "30", "--threads", "2"],
                                        ["--burst-interval-us", "1"])
    assert proc["kernel_launches"] == truth["launches"]
    assert proc["bursts"] > truth["sync_calls"]


def test_coalesced_syncs_and_slot_overflow_keep_counts_and_names_exact(gpu_build, tmp_path):
    """--burst-min-us: a sync flushes only bursts older than 5 ms, so a burst spans many
    steps of 20 distinct kernels; launches past its 16 slots are named through the
    kernel_counts map (KCOUNT records), and every count stays exact."""
    proc, truth, _, doc, _ = run_workload(gpu_build, tmp_path,
                                          ["--steps", "200", "--kernels", "20"],
                                          ["--burst-min-us", "5000"])
    assert proc["kernel_launches"] == truth["launches"] == 200 * 20
    assert proc["sync_calls"] == truth["sync_calls"]
    assert proc["query_polls"] == truth["query_not_ready"]
    assert proc["bursts"] < truth["sync_calls"] / 4
    top = {k["name"]: k["launches"] for k in proc["top_kernels"]}
    assert top == {f"_Z11tt_kernel_{k:02d}PfS_i": 200 for k in range(20)}
    assert doc["report"]["capture.kcounts_full"] == 0


@pytest.mark.parametrize("links", ["multi", "perf"])
def test_sampled_launch_probes_give_marked_estimates_close_to_the_truth(gpu_build, tmp_path,
                                                                      links):
    """--gpu-sample 0.5 over 1.5 s periods, ~5 s of steady launches: the launch probes
    really go off (the counts they saw are well under the truth), the estimate from
    the steps seen whole, of each step's shape, is within 1 % of the stand-in's count,
    and everything not sampled (copies, syncs) stays exact."""
    proc, truth, _, doc, _ = run_workload(
        gpu_build, tmp_path, ["--steps", "4000", "--kernels", "12"],
        ["--gpu-sample", "0.5", "--gpu-sample-period", "1.5", "--uprobe-links", links],
        kernel_ns=100_000)
    s = doc["gpu"]["launch_sampling"]
    assert s["estimated"] and s["fraction"] == 0.5 and s["switches"] >= 4
    # the share the gate was open, over a few switches: through perf events a detach
    # (~0.75 s here) fills the off span, and the share came out at 0.71-0.72 in 4 of 8
    # runs on the dev VM (before and after the ring reads got a time budget). That the
    # probes really go off is the launches seen, below
    assert s["detach_ms"]["max"] > 0 and 0.05 < s["measured_on_share"] < 0.85
    if links == "multi":
        # one grace period per link, closed together (perf events: ~0.1 s per probe,
        # one after the other, 0.9 s for these 8 on the dev VM; links: ~80 ms)
        assert s["detach_ms"]["mean"] < 400, s
    (thread,) = proc["threads"].values()
    # its engine steps as booked for the requests (a step ends at a synchronisation;
    # the last at the drain), each one not seen whole counted as the latest of its
    # shape that was: every step of this workload launches alike (measured: exact)
    est = thread["launch_estimate"]
    assert est["method"] == "step_shapes"
    assert truth["sync_calls"] <= est["steps"] <= truth["sync_calls"] + 1
    assert 0 < est["estimated_steps"] < est["steps"]
    assert 0.1 * truth["launches"] < proc["kernel_launches_seen"] < 0.8 * truth["launches"]
    assert abs(proc["kernel_launches"] - truth["launches"]) < 0.01 * truth["launches"]
    assert proc["memcpy_calls"]["h2d"] == truth["h2d_calls"]
    assert proc["sync_calls"] == truth["sync_calls"]
    # the switches' own tax: launches that trapped while the gate was closed. Through
    # links the launch sites are the attach's last and a detach takes them out at its
    # start: 69 against 21,084 counted on the dev VM. Through perf events they come
    # out one by one, ~0.1 s each (3,738 against 20,580): why the period is 5 s there
    gated = doc["report"]["capture.gated_calls"]
    print(f"{links}: {gated} gated calls, {proc['kernel_launches_seen']} launches seen")
    bound = 0.05 if links == "multi" else 0.5
    assert gated < bound * proc["kernel_launches_seen"], (gated, s)


STEPS_RUN = 5000


@pytest.mark.parametrize("copies,memsets", [(False, False), (True, False), (True, True)])
def test_sampling_switched_on_and_off_while_running(gpu_build, tmp_path, copies, memsets):
    """`--control gpu-sample F PERIOD [copies] [memsets]` while the workload launches: full
    counting, then half of each 0.6 s period (the agent started with 5 s periods), 0.3
    of it, then full again. The launch probes really went off (fewer seen than launched), the
    estimate from the steps counted whole stays within 5 %, what is not sampled stays
    exact, and a fraction out of (0, 1] or a period under 10 ms is refused. With
    ``copies`` the host-to-device and device-to-device copies' probes and the syncs' go
    off with the launch probes (fewer seen) and are estimated with them, each step then
    ending at its device-to-host copy; without, they are all counted; the same for the
    memsets (one a step) with ``memsets``."""
    from tracer.control import send

    sock = str(tmp_path / "ctl.sock")
    replies = []
    on = "gpu-sample 0.5 0.6" + (" copies" if copies else "") + (" memsets" if memsets else "")

    def switch() -> None:
        time.sleep(0.8)
        replies.extend(send(sock, w) for w in ("gpu-sample 0", "gpu-sample 1.5",
                                               "gpu-sample 0.5 0", on))
        time.sleep(1.5)
        replies.append(send(sock, "gpu-sample 0.3"))  # while sampling: the share alone
        time.sleep(1.5)
        replies.append(send(sock, "gpu-sample 1"))

    proc, truth, _, doc, _ = run_workload(
        gpu_build, tmp_path, ["--steps", str(STEPS_RUN), "--kernels", "12", "--d2d", "3"],
        ["--control", sock, "--gpu-sample-period", "5"], kernel_ns=100_000,
        during=switch)
    assert [r.split()[0] for r in replies] == ["error:", "error:", "error:", "ok", "ok",
                                               "ok"], replies
    assert replies[3] == "ok " + on and replies[5] == "ok gpu-sample 1", replies
    s = doc["gpu"]["launch_sampling"]
    assert s["fraction"] == 0.3, s  # the latest share sampled
    assert s["estimated"] and s["switches"] >= 8, s  # 0.6 s periods, not 5 s
    assert s["copies_sampled"] is copies and s["memsets_sampled"] is memsets
    assert proc["kernel_launches_seen"] < 0.95 * truth["launches"]
    assert abs(proc["kernel_launches"] - truth["launches"]) < 0.05 * truth["launches"]
    if copies:  # the syncs went off with them: each step ended at its result copy
        assert proc["sync_calls_seen"] < 0.95 * truth["sync_calls"]
        # a step not seen whole takes its reference's syncs: at most one, where the
        # fourth step polled instead, so at most a third too many in the off windows.
        # A step whose result copy came just before an off switch and its sync after
        # keeps the none it was seen with, and is no reference (Step.end_unseen): so at
        # most one too few a switch. Learnt, it gave a whole off window no syncs: 3,486
        # and 3,715-3,732 of 3,750 in earlier runs (a capture of one replayed: 3,729
        # before, 4,056 after)
        assert truth["sync_calls"] - s["switches"] <= proc["sync_calls"] \
            < 4 / 3 * truth["sync_calls"]
        (thread,) = proc["threads"].values()
        steps = thread["launch_estimate"]["steps"]
        # a step a sync ended (three in four: the fourth polls, and continues into the
        # next) or its result copy did, off: between the two counts, none lost
        assert 0.75 * STEPS_RUN <= steps <= STEPS_RUN + 1, steps
    else:
        assert proc["sync_calls"] == truth["sync_calls"]
    for kind in ("h2d", "d2d"):
        seen, calls = proc["memcpy_calls_seen"][kind], proc["memcpy_calls"][kind]
        want, nbytes = truth[f"{kind}_calls"], truth[f"{kind}_bytes"]
        if copies:
            assert seen < 0.95 * want, kind
            assert abs(calls - want) < 0.05 * want, kind
            assert abs(proc["memcpy_bytes"][kind] - nbytes) < 0.05 * nbytes, kind
        else:
            assert seen == calls == want, kind
            assert proc["memcpy_bytes"][kind] == nbytes, kind
    want, nbytes = truth["memset_calls"], truth["memset_bytes"]
    if memsets:
        assert proc["memset_calls_seen"] < 0.95 * want
        assert abs(proc["memset_calls"] - want) < 0.05 * want
        assert abs(proc["memset_bytes"] - nbytes) < 0.05 * nbytes
    else:
        assert proc["memset_calls_seen"] == proc["memset_calls"] == want
        assert proc["memset_bytes"] == nbytes


def test_uprobes_off_leaves_the_gpu_unseen_until_on(gpu_build, tmp_path):
    """`--control uprobes off|on` (bench/real_server.py's sockets-only): every uprobe
    out while the workload launches, and back; a pause and resume in between keep them
    out. The syncs and launches of the stretch off are not seen, those after `on` are
    (every launch counted, not estimated); `on` while paused is refused."""
    from tracer.control import send

    sock = str(tmp_path / "ctl.sock")
    replies = []

    def switch() -> None:
        time.sleep(0.8)
        replies.extend(send(sock, w) for w in ("uprobes off", "uprobes off", "pause",
                                               "uprobes on", "resume"))
        time.sleep(1.5)
        replies.append(send(sock, "uprobes on"))

    proc, truth, _, doc, run = run_workload(
        gpu_build, tmp_path, ["--steps", "4000", "--kernels", "12"],
        ["--control", sock], kernel_ns=100_000, during=switch)
    want = ["ok uprobes off ", "ok uprobes off ", "ok paused ", "error: paused: resume first",
            "ok resumed ", "ok uprobes on "]
    assert len(replies) == len(want), replies
    assert all(r.startswith(w) for r, w in zip(replies, want)), replies
    assert replies[1] == "ok uprobes off 0.000s"  # already off: nothing to do
    assert not doc["gpu"].get("launch_sampling", {}).get("estimated")
    # ~1.5-2 s of ~5 s unseen; the rest seen, before the switch and after it
    assert 0.2 * truth["sync_calls"] < proc["sync_calls"] < 0.8 * truth["sync_calls"], \
        (proc["sync_calls"], truth["sync_calls"], run.stderr)
    assert 0.2 * truth["launches"] < proc["kernel_launches"] < 0.8 * truth["launches"]


def libcuda_anon_kb(pid: int) -> int:
    """Anonymous kB in ``pid``'s mappings of the stand-in libcuda's code: a uprobe written
    into a process's copy of a library's text turns that page anonymous (copy on
    write)."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = line.rstrip().endswith("libcuda.so.1") and "x" in head[1]
        elif inside and line.startswith("Anonymous:"):
            total += int(line.split()[1])
    return total


@pytest.mark.parametrize("links", ["multi", "perf"])
def test_a_process_not_traced_gets_no_probe_of_a_library_it_shares(gpu_build, tmp_path,
                                                                   links):
    """Two processes map the same libcuda file; the agent traces one. Its probes are
    written into that one only: the other takes no trap (it did, returning at once in
    BPF, before probes were limited to the traced processes; bench/untraced_neighbour.py
    --gpu: 1.3 us of system time a launch on the dev VM), and the traced one's counts
    stay exact."""
    env = dict(os.environ, TT_STANDIN_KERNEL_NS="2000")
    procs = []
    for name in ("traced", "other"):
        p = subprocess.Popen([str(gpu_build["workload"]), "--wait", "--steps", "50",
                              "--kernels", "4"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=dict(env, TT_STANDIN_COUNTS=str(tmp_path / f"{name}.json")))
        assert p.stdout.readline().strip() == "ready"
        procs.append(p)
    traced, other = procs
    assert libcuda_anon_kb(traced.pid) == libcuda_anon_kb(other.pid) == 0
    summary = tmp_path / "summary.json"
    with traced_cli(["--pid", str(traced.pid), "--summary", str(summary),
                     "--uprobe-links", links, "--gpu-sample", "1"],
                    str(tmp_path / "spans.jsonl")) as run:
        assert libcuda_anon_kb(traced.pid) > 0  # its probes are in
        assert libcuda_anon_kb(other.pid) == 0  # none in the process not traced
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout.readline().strip() == "done"
            assert p.wait(30) == 0
    assert run.returncode == 0, run.stderr
    doc = json.loads(summary.read_text())
    (proc,) = doc["gpu"]["processes"]
    assert proc["pid"] == traced.pid
    truth = json.loads((tmp_path / "traced.json").read_text())
    assert proc["kernel_launches"] == truth["launches"] == 50 * 4


def test_a_child_of_a_traced_process_gets_the_probes_of_a_file_attached_before(gpu_build,
                                                                               tmp_path):
    """A traced process maps libcuda (its probes attached, limited to it) and then starts
    a child that maps the same file: the child is traced as its parent's child and the
    file's probes are attached in it too, so its launches are counted exactly."""
    code = ("import ctypes, os, subprocess, sys\n"
            "ctypes.CDLL(sys.argv[1])\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "env = dict(os.environ, TT_STANDIN_COUNTS=sys.argv[3])\n"
            "child = subprocess.Popen([sys.argv[2], '--wait', '--steps', '30', '--kernels', '3'],"
            " stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)\n"
            "assert child.stdout.readline().strip() == 'ready'\n"
            "print('child', child.pid, flush=True)\n"
            "sys.stdin.readline()\n"
            "child.stdin.write('go\\n'); child.stdin.flush()\n"
            "assert child.stdout.readline().strip() == 'done'\n"
            "sys.exit(child.wait())\n")
    env = dict(os.environ, TT_STANDIN_KERNEL_NS="2000",
               TT_STANDIN_COUNTS=str(tmp_path / "parent.json"))
    parent = subprocess.Popen([sys.executable, "-c", code, str(gpu_build["libcuda"]),
                               str(gpu_build["workload"]), str(tmp_path / "child.json")],
                              stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    assert parent.stdout.readline().strip() == "ready"
    summary = tmp_path / "summary.json"
    with traced_cli(["--pid", str(parent.pid), "--summary", str(summary), "--gpu-sample", "1"],
                    str(tmp_path / "spans.jsonl")) as run:
        time.sleep(1.5)  # the parent's libcuda found and attached (limited to it)
        parent.stdin.write("\n")
        parent.stdin.flush()
        child = int(parent.stdout.readline().split()[1])
        time.sleep(2.5)  # the agent's rescan (1 s) finds the child mapping it
        assert libcuda_anon_kb(child) > 0
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.wait(30) == 0
    assert run.returncode == 0, run.stderr
    doc = json.loads(summary.read_text())
    procs = {p["pid"]: p for p in doc["gpu"]["processes"]}
    truth = json.loads((tmp_path / "child.json").read_text())
    assert procs[child]["kernel_launches"] == truth["launches"] == 30 * 3

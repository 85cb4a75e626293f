"""Command-line surface that needs no BPF: help, replay errors, doctor."""

import gzip
import json
import subprocess
import sys

import pytest

from tracer.doctor import check_kernel_headers, format_checks, run_checks
from tracer.export.console import ring_at_loss_text


def cli(*args):
    return subprocess.run([sys.executable, "-m", "tracer", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("sub", ["run", "record", "replay", "doctor", "demo", "report"])
def test_every_subcommand_has_help_with_a_description(sub):
    r = cli(sub, "--help")
    assert r.returncode == 0
    assert r.stdout.startswith("usage: tokentrace " + sub)
    assert len(r.stdout.splitlines()) > 5


def test_top_level_help_lists_commands_and_examples():
    r = cli("--help")
    assert r.returncode == 0
    for word in ("run", "record", "replay", "doctor", "demo", "examples:"):
        assert word in r.stdout


def test_no_command_prints_help_and_fails():
    r = cli()
    assert r.returncode == 2 and "usage:" in r.stdout


def test_replay_of_a_non_capture_is_a_clear_error(tmp_path):
    f = tmp_path / "junk"
    f.write_text("hello")
    r = cli("replay", str(f))
    assert r.returncode == 1 and "not a tokentrace capture" in r.stderr
    r = cli("replay", str(tmp_path / "missing.ttcap"))
    assert r.returncode == 1 and "error" in r.stderr


def test_replay_of_the_committed_capture(openai_capture, tmp_path):
    out = tmp_path / "s.jsonl"
    r = cli("replay", str(openai_capture), "--jsonl", str(out))
    assert r.returncode == 0, r.stderr
    expected = json.loads(openai_capture.with_name("openai-http1.expected.json").read_text())
    spans = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(spans) == len(expected)
    spans.sort(key=lambda s: s["start_time_unix_nano"])
    for want, s in zip(expected, spans):
        a = s["attributes"]
        assert a["url.path"] == want["path"]
        assert a["http.response.status_code"] == want["status"]
        if want["output_tokens"] is not None:
            assert a["gen_ai.usage.output_tokens"] == want["output_tokens"]
        if want["input_tokens"] is not None:
            assert a["gen_ai.usage.input_tokens"] == want["input_tokens"]
    assert "tiny-gpt" in r.stdout  # the console table


def test_max_connections_bounds_what_is_followed_and_counts_the_evicted(openai_capture,
                                                                       tmp_path):
    """--max-connections 1: the capture's other connections push each other out; every
    eviction is counted and said on exit, and nothing crashes."""
    summaries, said = {}, {}
    for n in (1, 100_000):
        out = tmp_path / f"s{n}.json"
        r = cli("replay", str(openai_capture), "--quiet", "--max-connections", str(n),
                "--summary", str(out))
        assert r.returncode == 0, r.stderr
        summaries[n], said[n] = json.loads(out.read_text())["report"], r.stderr
    assert summaries[1]["connections_evicted"] > 0
    assert f"connections_evicted={summaries[1]['connections_evicted']}" in said[1]
    assert summaries[100_000].get("connections_evicted", 0) == 0
    assert summaries[1].get("requests", 0) <= summaries[100_000]["requests"]


def test_exit_report_says_how_many_launches_got_a_kernel_name():
    from tests.conftest import CAPTURES
    r = cli("replay", str(CAPTURES / "wire3" / "gpu-standin.ttcap"), "--quiet")
    assert r.returncode == 0, r.stderr
    assert "kernel names for 100.0% of 1,600 launches (live 100.0%)" in r.stderr


def test_exit_report_says_whether_the_ring_had_room_when_records_were_lost():
    """The full ring is checked live (test_live_openai's overflow); a loss with room,
    a reservation the kernel refused, cannot be made on demand: its words are
    checked here."""
    mib = 2**20
    full = ring_at_loss_text({"capture.ring_fill_at_loss_bytes": mib - 100,
                              "capture.ring_bytes": mib})
    room = ring_at_loss_text({"capture.ring_fill_at_loss_bytes": 4096,
                              "capture.ring_bytes": 32 * mib, "capture.ring_refused_slow": 1,
                              "capture.ring_refused_ns": 251_000_000})
    assert full.startswith("; records were lost with the ring full") and "--ringbuf-mb" in full
    assert room.startswith("; records were lost with room in the ring (the ring held 4KB of "
                           "32MB; 1 refused after spinning on the ring's lock, 251.0 ms")
    assert ring_at_loss_text({"capture.ring_bytes": mib, "capture.lost_data": 0}) == ""
    # records refused at once and taken at the second try (bpf/common.h submit())
    assert ring_at_loss_text({"capture.ring_bytes": mib, "capture.ring_retry_saved": 2}) == (
        "; 2 records the ring refused at once were taken at a second try")


def test_replay_of_a_cut_capture_warns_and_keeps_what_it_has(openai_capture, tmp_path):
    raw = gzip.decompress(openai_capture.read_bytes())
    f = tmp_path / "cut.ttcap"
    f.write_bytes(gzip.compress(raw[: int(len(raw) * 0.7)]))
    r = cli("replay", str(f))
    assert r.returncode == 0 and "ends mid-record" in r.stderr


def test_doctor_passes_here_and_loads_the_probes():
    r = cli("doctor")
    assert r.returncode == 0, r.stdout
    assert "tracing can work" in r.stdout and "bpf program" in r.stdout
    # Linux 6.18 here: the GPU probes go in as uprobe_multi links, and the socket probes
    # keep each thread's call in flight in task-local storage
    assert "GPU probes attach as links" in r.stdout
    assert "ok    task storage" in r.stdout, r.stdout


def test_doctor_explains_missing_headers(monkeypatch):
    monkeypatch.setattr("platform.release", lambda: "0.0.0-no-such-kernel")
    c = check_kernel_headers()
    assert not c.ok and "linux-headers-amd64" in c.fix and "0.0.0-no-such-kernel" in c.fix
    text = format_checks([c])
    assert "FAIL" in text and "fix:" in text


def test_doctor_explains_missing_privileges(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    monkeypatch.setattr("tracer.probes.caps.effective_caps", lambda: 0)
    monkeypatch.setattr("tracer.doctor.effective_caps", lambda: 0)
    results = {c.name: c for c in run_checks(load=False)}
    assert not results["privileges"].ok and "CAP_BPF" in results["privileges"].fix


def test_doctor_explains_missing_bcc(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_bcc(name, *a, **kw):
        if name == "bcc":
            raise ImportError("No module named 'bcc'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_bcc)
    results = {c.name: c for c in run_checks(load=False)}
    assert not results["bcc"].ok and "python3-bpfcc" in results["bcc"].fix


def test_doctor_says_when_the_socket_probes_fall_back_to_a_hash(monkeypatch):
    """Without task-local storage for tracepoint programs (before Linux 5.12, or no
    BTF) the agent still traces, with each thread's call in flight in a hash map: a
    warning that says the price, never a failure."""
    from tracer import doctor
    from tracer.probes import loader

    monkeypatch.setattr(loader, "task_storage_missing", lambda: "no kernel BTF (/sys/kernel/btf/vmlinux)")
    c = doctor.check_task_storage([])
    assert not c.ok and not c.required
    assert "hash map" in c.detail and "5.12" in c.fix
    assert format_checks([c]).startswith("warn")

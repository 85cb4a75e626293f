"""The `tokentrace` command line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any, Callable

import tracer
from tracer.autosample import FRACTION as AUTO_FRACTION
from tracer.autosample import MIN_RATE as AUTO_MIN_RATE
from tracer.autosample import MIN_WINDOW_STEPS as AUTO_MIN_WINDOW_STEPS
from tracer.autosample import SHORT_FRACTION as AUTO_SHORT_FRACTION
from tracer.autosample import AutoSample
from tracer.duty import DEFAULT_PERIOD_S as DUTY_PERIOD_S
from tracer.duty import DutyCycle
from tracer.duty import parse as parse_duty
from tracer.correlate.connections import TrackerOptions
from tracer.events import capture
from tracer.events.wire import CONSTANTS
from tracer.export.console import probe_cost_text, ring_at_loss_text, skipped_runs_text
from tracer.export.context import ExportContext
from tracer.pipeline import Pipeline

EPILOG_MAIN = """\
commands:
  run       trace processes live and export requests as spans
  record    write the raw events of processes to a capture file
  replay    analyse a capture file as `run` would, without BPF
  doctor    check privileges, kernel and BCC; say how to fix what is missing
  demo      trace a sample inference server end to end
  report    per-request cost report (CSV, JSON, HTML) from a span JSONL file
  flame     flame graphs of the code that launched a request's or a service's GPU work
  ctl       pause, resume or adjust a running `run --control PATH`

examples:
  sudo tokentrace run --port 8000
  sudo tokentrace run --comm python3 --jsonl spans.jsonl --duration 60
  sudo tokentrace run --pid 4242 --otlp http://localhost:4318
  sudo tokentrace record --port 8000 -o cap.ttcap --duration 30
  tokentrace replay cap.ttcap --jsonl spans.jsonl
  tokentrace report spans.jsonl -o report
  sudo tokentrace run --port 8000 --stacks --jsonl spans.jsonl
  tokentrace flame spans.jsonl --service myserver -o flame
"""


def _say(msg: str) -> None:
    print(f"tokentrace: {msg}", file=sys.stderr, flush=True)


def _positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text}")
    return v


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to trace (any mix; repeatable)")
    g.add_argument("-p", "--pid", type=int, action="append", default=[], metavar="PID",
                   help="a process id; its children are traced from their start")
    g.add_argument("-c", "--comm", action="append", default=[], metavar="NAME",
                   help="processes whose name (comm, 15 chars) is NAME, now and later")
    g.add_argument("-P", "--port", type=int, action="append", default=[], metavar="PORT",
                   help="processes listening on TCP PORT, now and later")
    p.add_argument("-d", "--duration", type=float, metavar="SECONDS",
                   help="stop SECONDS after the probes are attached (default: until "
                        "Ctrl-C or SIGTERM)")
    g2 = p.add_argument_group("capture")
    g2.add_argument("--capture-limit", type=_positive_int, default=256 * 1024, metavar="BYTES",
                    help="payload bytes captured per syscall; more is counted as truncated "
                         "(default: 262144)")
    g2.add_argument("--no-token-runs", dest="token_runs", action="store_false",
                    help="send every token write of a streamed response as its own "
                         "record; by default, once a response's chunks are known, the "
                         "kernel sends its token writes %d at a time, without their text"
                         % CONSTANTS["RUN_MAX"])
    g2.add_argument("--ringbuf-mb", type=_positive_int, default=32, metavar="MB",
                    help="ring buffer size, rounded down to a power of two pages "
                         "(default: 32)")
    g2.add_argument("--burst-interval-us", type=_positive_int, default=10_000, metavar="US",
                    help="flush a thread's summed GPU calls at least this often, even "
                         "without a sync (default: 10000)")
    g2.add_argument("--gpu-sample", default="auto", metavar="FRACTION|auto",
                    help="attach the kernel-launch probes for FRACTION of each "
                         "--gpu-sample-period and detach them for the rest, so a "
                         "launch-bound server pays the uprobe trap on that share of its "
                         "launches only; launch counts become estimates, marked so. 1 "
                         "counts every launch. auto (the default) counts every launch "
                         "until a process launches over %d a second, all of them on "
                         "engine threads that run steps, then samples %g of each default "
                         "period, or %g where that share of it spans %g of their steps "
                         "(the window keeps its length in seconds where "
                         "--gpu-sample-period is longer: fewer windows, fewer traps) "
                         "(the host-to-device and device-to-device copies and the syncs "
                         "too, where those threads' steps are told apart without them, "
                         "and the memsets where they are predicted to 1 percent of the bytes "
                         "moved); "
                         "a thread launching for the one request it serves turns it back "
                         "to counting every launch (docs/overhead.md); `record` has no "
                         "analysis to decide with, and counts every launch"
                         % (AUTO_MIN_RATE, AUTO_FRACTION, AUTO_SHORT_FRACTION,
                            AUTO_MIN_WINDOW_STEPS))
    g2.add_argument("--gpu-sample-period", type=float, metavar="SECONDS",
                    help="the --gpu-sample duty cycle's period (default: 1 through "
                         "uprobe_multi links, 5 without them: before Linux 6.6 detaching "
                         "takes ~0.1 s per launch probe, so keep the off share over a "
                         "second there)")
    g2.add_argument("--stub-names-quiet", type=float, default=5.0, metavar="SECONDS",
                    help="name kernels resolved before attach by their host stubs: "
                         "libcudart's launch calls stay probed (a uprobe trap per launch, "
                         "~1 us) until runtime launches went on this long with no new "
                         "stub, or for 60 s of launches in all; 0 turns it off (default: 5)")
    g2.add_argument("--alias-lookups-quiet", type=float, default=5.0, metavar="SECONDS",
                    help="detach the probes on cuKernelGetFunction (some libraries "
                         "look a kernel's launch handle up before every launch: two "
                         "uprobe traps each) once look-ups went on this long with no new "
                         "handle; a new process or a launched handle with no name "
                         "attaches them again; 0 keeps them attached (default: 5)")
    g2.add_argument("--burst-min-us", type=int, default=0, metavar="US",
                    help="let a sync flush a thread's GPU burst only once it is this old, "
                         "so a loop syncing thousands of times a second costs the agent "
                         "fewer records; totals stay exact, GPU time attribution gets "
                         "this coarse (default: 0, every sync)")
    g2.add_argument("--uprobe-links", choices=("auto", "sessions", "multi", "perf"),
                    default="auto",
                    help="attach the GPU uprobes through uprobe_multi links (Linux 6.6+: "
                         "detaching them all takes well under a second), those with "
                         "uprobe sessions (6.13+: the syncs inside an engine's step cost "
                         "no return probe), or as one perf event each (~0.1 s apiece to "
                         "detach); auto picks the first of sessions, multi, perf the "
                         "kernel has (default: auto)")
    g2.add_argument("--stacks", action="store_true",
                    help="sample the code paths that launch GPU work: at the kernel-launch, "
                         "graph-launch, memcpy and NCCL probes, a thread's Python frames "
                         "(CPython 3.10-3.13) and native frames, counted per stack in the "
                         "kernel and joined to requests like their launches; `tokentrace "
                         "flame` draws them (docs/flame.md)")
    g2.add_argument("--stack-every", type=_positive_int, default=None, metavar="N",
                    help="with --stacks: sample a thread's GPU calls every N on average "
                         "(randomised gaps), and always the first call of each kernel "
                         "(default: 64)")
    g2.add_argument("--capture-secrets", action="store_true",
                    help="write Authorization, Proxy-Authorization, api-key, x-api-key, "
                         "Cookie and Set-Cookie values and command-line keys into the "
                         "capture as they were (default: masked, same length, before "
                         "writing; HTTP/2 header blocks are never masked)")
    g2.add_argument("--tenant-salt", metavar="TEXT",
                    help="salt of the tenant hash (tokentrace.tenant, from the API key): "
                         "the same salt gives the same tenant ids across runs; keep it "
                         "secret (default: a random one per run, kept in the capture)")
    g2.add_argument("--net-timing", choices=("auto", "syscall"), default=None,
                    help="auto: time requests as clients see them, from their bytes' "
                         "arrival at the socket to the response's bytes leaving it, where "
                         "the kernel's tracepoints allow (docs/netwait.md); syscall: the "
                         "server's reads and writes only (default: $TOKENTRACE_NET_TIMING, "
                         "else auto)")
    g2.add_argument("--tls", choices=("auto", "off"), default="auto",
                    help="auto: read requests inside TLS through uprobes on the traced "
                         "processes' OpenSSL 1.1/3.x libssl (SSL_read/SSL_write), attached "
                         "to those processes only; TLS the probes cannot read (BoringSSL "
                         "inside grpcio, other libraries) is counted as "
                         "tls_connections_unseen; off: no TLS probes (default: auto; "
                         "docs/tls.md)")
    g2.add_argument("--control", metavar="PATH",
                    help="listen on unix socket PATH (0600) for commands, one per "
                         "connection: pause, resume, status, counters, and the toggles "
                         "bench/real_server.py measures each part's cost with "
                         "(capture-limit, burst-min-us, gpu-launch, uprobes, net-timing, "
                         "stub-naming, alias-lookups, analysis); "
                         "`tokentrace ctl PATH COMMAND` sends one. SIGUSR1 pauses and "
                         "SIGUSR2 resumes without it: paused, every probe is out but "
                         "process start/exit, the traced processes run as if untraced, and "
                         "requests open at the pause end there, incomplete")
    g2.add_argument("--sched-idle", action="store_true",
                    help="run the tracer under SCHED_IDLE once attached: it only takes CPU "
                         "the traced service leaves idle (events wait in the ring buffer; "
                         "an overflow is counted, never silent)")


def _add_export_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("export (console table unless --quiet)")
    g.add_argument("--gpu-every", type=float, default=5.0, metavar="SECONDS",
                   help="run: print a GPU row per process (launches, copies, syncs, NCCL, "
                        "ibverbs, device memory) this often when it changed; 0: never "
                        "(default: 5)")
    g.add_argument("--jsonl", metavar="FILE", help="write one JSON object per span to FILE")
    g.add_argument("--otlp", metavar="ENDPOINT",
                   help="send spans over OTLP: host:4317 or grpc://host:4317 for gRPC, "
                        "http://host:4318 for HTTP")
    g.add_argument("--otlp-protocol", choices=("grpc", "http"),
                   help="override the protocol guessed from --otlp")
    g.add_argument("--service-name", metavar="NAME",
                   help="service.name of the spans (default: the traced process's name)")
    g.add_argument("--capture-content", action="store_true",
                   help="include prompt and completion text, and the error text servers "
                        "return, in spans (off by default: prompts are private)")
    g.add_argument("--capture-cmdline", action="store_true",
                   help="export process.command_line, with anything that looks like a "
                        "key or token redacted (off by default)")
    g.add_argument("--max-connections", type=int, default=100_000, metavar="N",
                   help="connections followed at once; past N the least recently active "
                        "is dropped and counted (connections_evicted). The agent's memory "
                        "grows ~5 KB per open connection (bench/soak.py) (default: 100000)")
    g.add_argument("--max-buffered-mb", type=float, default=256, metavar="MB",
                   help="bytes all connections together may hold for parsing (request "
                        "and response bodies, unfinished frames and messages); past it "
                        "the connections holding the most are dropped and counted "
                        "(connections_over_buffer_budget) (default: 256)")
    g.add_argument("--summary", metavar="FILE",
                   help="on exit, write per-process and per-thread GPU totals (kernel "
                        "launches, graph launches, memcpy/memset bytes, device memory, "
                        "syncs and waits, NCCL ops and bytes, top kernels) and every "
                        "drop counter to FILE as JSON")
    g.add_argument("--gpu-price", type=float, metavar="USD",
                   help="price of one GPU-hour for per-request cost (default: by GPU "
                        "model, from NVML or --gpu-model; see docs/report.md)")
    g.add_argument("--gpu-model", metavar="NAME",
                   help="GPU model to price by (default: what NVML reports; in replay, "
                        "what the capture recorded)")
    g.add_argument("-q", "--quiet", action="store_true", help="no console table")
    from tracer.export.metrics import add_metric_args

    add_metric_args(g)


def _duty_arg(text: str) -> tuple[float, float]:
    try:
        return parse_duty(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _budget_arg(text: str) -> float:
    from tracer.overhead import parse_budget
    try:
        return parse_budget(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokentrace",
        description="Zero-code eBPF tracing of LLM inference services: one span per "
                    "request with time to first token, tokens and GPU work.",
        epilog=EPILOG_MAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"tokentrace {tracer.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run", help="trace processes live",
        description="Attach to running processes (no restart, no code change), follow "
                    "their HTTP requests, and export one span per request. Prints a line "
                    "containing 'attached' on stderr once tracing; on exit flushes every "
                    "finished span and reports lost events.",
        epilog="examples:\n  sudo tokentrace run --port 8000\n"
               "  sudo tokentrace run --pid 4242 --jsonl spans.jsonl --duration 60\n"
               "  sudo tokentrace run --comm vllm --otlp localhost:4317 --quiet\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_target_args(run)
    _add_export_args(run)
    run.add_argument("--record", metavar="FILE",
                     help="also write the raw events to FILE for `tokentrace replay`")
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--duty-cycle", metavar="F[/PERIOD]", type=_duty_arg,
                     help="trace for F of every PERIOD seconds (default period: %g) and "
                          "take every probe out for the rest, so the servers pay F of "
                          "tracing's cost; only requests wholly inside a window are traced "
                          "whole (their spans say tokentrace.duty_cycle=F), those a window's "
                          "end cuts are counted (requests_cut_by_duty_cycle). Default: "
                          "trace all the time (docs/overhead.md, \"the duty cycle\")"
                          % DUTY_PERIOD_S)
    budget.add_argument("--max-overhead", metavar="PCT", type=_budget_arg,
                        help="keep what the probes cost the traced processes under PCT "
                             "percent of their CPU time: where the measured estimate "
                             "(probe_cpu_ppm, below) is over it, trace the share of every "
                             "%g s that brings it under, as --duty-cycle does, and all the "
                             "time again once it fits. The estimate is the probes' kernel "
                             "time in the traced processes (their runs elsewhere left out) "
                             "against those processes' CPU time "
                             "(docs/overhead.md, \"the probes' cost, measured live\")"
                             % DUTY_PERIOD_S)
    run.add_argument("--no-overhead-meter", action="store_true",
                     help="do not measure what the probes cost (by default a 2-s window "
                          "every 20 s, with the kernel's BPF run-time statistics on for it, "
                          "gives probe_cpu_ppm in the counters and the exit report)")
    run.set_defaults(func=cmd_run)

    rec = sub.add_parser(
        "record", help="write raw events to a capture file",
        description="Capture the events of processes to FILE without analysing them. "
                    "`tokentrace replay FILE` later gives the spans `run` would have.",
        epilog="example:\n  sudo tokentrace record --port 8000 -o cap.ttcap --duration 30\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_target_args(rec)
    rec.add_argument("-o", "--output", required=True, metavar="FILE", help="capture file")
    rec.set_defaults(func=cmd_record)

    rep = sub.add_parser(
        "replay", help="analyse a capture file",
        description="Run the analysis of `tokentrace run` on a capture file: same spans, "
                    "no BPF, no privileges.",
        epilog="example:\n  tokentrace replay cap.ttcap --jsonl spans.jsonl\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    rep.add_argument("capture", metavar="FILE", help="a file from `record` or `run --record`")
    _add_export_args(rep)
    rep.set_defaults(func=cmd_replay)

    doc = sub.add_parser(
        "doctor", help="check that this machine can trace",
        description="Check privileges, the bpf syscall, tracefs, uprobes, kernel headers "
                    "and BCC, then compile and load the probes. Each failure says how to "
                    "fix it. Exit status 0 when tracing can work.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    doc.add_argument("--no-load", action="store_true",
                     help="skip compiling and loading the BPF program")
    doc.add_argument("--json", action="store_true", help="print the checks as JSON")
    doc.set_defaults(func=cmd_doctor)

    demo = sub.add_parser(
        "demo", help="trace a sample inference server end to end",
        description="Start the sample OpenAI-compatible server (a tiny PyTorch GPT), "
                    "attach, send real requests with the openai client, and print the "
                    "per-request table. Spans go to out/demo-spans.jsonl.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--requests", type=_positive_int, default=8, metavar="N",
                      help="requests of each kind, streamed and not (default: 8)")
    demo.add_argument("--out", default="out", metavar="DIR",
                      help="where spans and the capture go (default: out)")
    demo.add_argument("--port", type=int, default=8765, help="sample server port")
    demo.set_defaults(func=cmd_demo)

    ctl = sub.add_parser(
        "ctl", help="send a command to a running `tokentrace run --control PATH`",
        description="Send one command to the control socket of a running `tokentrace run` "
                    "or `record` and print its answer. Commands: pause, resume, status, "
                    "counters (the loss and event counters so far, as JSON: what the "
                    "report at exit says), capture-limit BYTES, burst-min-us US, gpu-launch on|off, "
                    "uprobes on|off (every uprobe out: the socket and TCP probes alone), "
                    "net-timing syscall|socket (the socket-level timing out or back: "
                    "spans keep syscall times while out), "
                    "stub-naming on|off, alias-lookups on|off, analysis on|off, "
                    "sample-period SECONDS|default (--gpu-sample-period changed "
                    "while running; auto keeps its window's length), "
                    "gpu-sample F [PERIOD] [copies] [memsets] (--gpu-sample and "
                    "--gpu-sample-period, changed while running; copies: the "
                    "host-to-device and device-to-device copies' and the syncs' probes "
                    "sampled with the launch probes, memsets: the memsets' probes, their "
                    "counts estimated "
                    "with the launches), probe-stats on|off (the "
                    "kernel's run counts and run time per BPF program while on; "
                    "probe-stats alone prints them as name=runs/ns), duty-cycle "
                    "F[/PERIOD]|off (run's --duty-cycle set, changed or ended; a pause "
                    "holds it, the resume hands the probes back to it, on its phase). "
                    "Exit status 1 if it "
                    "answered with an error.",
        epilog="examples:\n  sudo tokentrace ctl /run/tokentrace.sock pause\n"
               "  sudo tokentrace ctl /run/tokentrace.sock resume\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ctl.add_argument("socket", metavar="PATH", help="the --control socket of the run")
    ctl.add_argument("words", nargs="+", metavar="COMMAND", help="the command and its arguments")
    ctl.set_defaults(func=cmd_ctl)

    from tracer.report.cli import add_parser as add_report_parser

    add_report_parser(sub)
    from tracer.flame.cli import add_parser as add_flame_parser

    add_flame_parser(sub)
    return parser


# ---- shared plumbing ----------------------------------------------------------------


def build_sinks(args: argparse.Namespace, ctx: ExportContext) -> tuple[list[Any], Any]:
    """The record sinks the export flags ask for; returns (sinks, console or None)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from tracer.export.console import ConsoleTable
    from tracer.export.spans import SpanBuilder

    ctx.service_name = getattr(args, "service_name", None)
    ctx.capture_cmdline = bool(getattr(args, "capture_cmdline", False))
    sinks: list[Any] = []
    console = None
    if not args.quiet:
        console = ConsoleTable(ctx)
        sinks.append(console)
    processors = []
    if args.jsonl:
        from tracer.export.jsonl import JsonlSpanExporter

        ctx.flames = {}  # request spans carry their launch-site stacks into the file
        processors.append(SimpleSpanProcessor(JsonlSpanExporter(args.jsonl, ctx.flames)))
    # what a span's `tokentrace flame` command reads: the spans file, else the capture
    ctx.flame_source = (args.jsonl or getattr(args, "record", None)
                        or getattr(args, "capture", None))
    if args.otlp:
        from tracer.export.otlp import otlp_processor

        processors.append(otlp_processor(args.otlp, args.otlp_protocol))
    if processors:
        sinks.append(SpanBuilder(ctx, processors))
    from tracer.export.identity import IdentityResolver
    from tracer.export.metrics import metric_sinks

    ctx.identity = IdentityResolver.from_env(live=getattr(args, "command", "") == "run")
    sinks.extend(metric_sinks(args, ctx))
    return sinks, console


def _write_summary(path: str | None, pipeline: Pipeline) -> None:
    if not path:
        return
    from tracer.privacy import open_private

    import dataclasses
    doc = {"gpu": pipeline.gpu.summary(), "report": pipeline.report(),
           "reconciliation": pipeline.reconciliation(),
           "tls": {"libraries": [dataclasses.asdict(lib) for lib in pipeline.tls_libraries]}}
    with open_private(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _report(pipeline: Pipeline, console: Any) -> None:
    if console is not None:
        _say(console.summary())
    rep = pipeline.report()
    lost = {k: v for k, v in rep.items()
            if v and (k.startswith("capture.lost") or k in (
                "bytes_lost", "capture.truncated", "capture.iov_cut", "capture.inflight_full",
                "capture.conns_full", "capture.verbs_cut", "capture.verbs_full",
                "capture.kcounts_full", "capture.bursts_full", "capture.unanalysed_records",
                "requests_cut_by_pause", "requests_cut_by_duty_cycle", "capture.tls.lost",
                "capture.tls.inflight_full",
                "capture.tls.state_full", "capture.tls.stale",
                "http_protocol_errors", "undecodable_records",
                "in_flight_at_exit", "identity.k8s_errors")
                or k.startswith("parser_errors") or k.endswith("_evicted")
                or k.endswith("_budget"))}
    for line in (reconciliation_lines(pipeline.reconciliation()) + kernel_name_lines(pipeline.gpu)
                 + tls_lines(pipeline)):
        _say(line)
    _say(f"{pipeline.records} requests exported; "
         + ("loss and truncation: " + ", ".join(f"{k}={v}" for k, v in lost.items())
            if lost else "no events lost") + skipped_runs_text(rep)
         + ring_at_loss_text(rep))
    cost = probe_cost_text(rep)
    if cost:
        _say(cost)


def tls_lines(pipeline: Pipeline) -> list[str]:
    """The exit report's TLS lines: the TLS libraries found and not probed, and what
    became of the TLS connections (decrypted, seen only as ciphertext, failed)."""
    out = []
    for lib in pipeline.tls_libraries:
        if lib.status != "probed":
            out.append(f"TLS not seen in pid {lib.pid}: {lib.path} ({lib.name}, "
                       f"{lib.status}): {lib.reason}")
        elif lib.reason:
            out.append(f"TLS probes in pid {lib.pid}: {lib.path} ({lib.name}): {lib.reason}")
    rep = pipeline.report()
    counts = [(rep.get("tls_connections_decrypted", 0), "read through the TLS probes"),
              (rep.get("tls_connections_unseen", 0), "seen only as ciphertext (not decrypted)"),
              (rep.get("tls_handshakes_failed", 0), "failed their handshake")]
    unbound = rep.get("capture.tls.unbound", 0)
    if any(n for n, _ in counts) or unbound:
        line = "TLS connections: " + ", ".join(f"{n} {what}" for n, what in counts)
        if unbound:
            line += (f"; {unbound} TLS reads/writes on no known socket not exported "
                     "(connections opened before attach)")
        out.append(line)
    return out


def kernel_name_lines(gpu: Any) -> list[str]:
    """The exit report's kernel-name lines: per GPU process, the share of its launches
    whose kernel got a name, by where the names came from."""
    from tracer.correlate.gpu import NAME_ROWS
    out = []
    for p, t in gpu.totals():
        names = p.names_summary(t.kernels)
        total = sum(names[r]["launches"] for r in NAME_ROWS)
        if not total:
            continue
        named = total - names["unknown"]["launches"]
        parts = ", ".join(f"{r} {names[r]['launches'] / total:.1%}" for r in NAME_ROWS
                          if names[r]["launches"])
        out.append(f"GPU pid {p.pid}: kernel names for {named / total:.1%} of "
                   f"{total:,} launches ({parts})")
    return out


def reconciliation_lines(recon: dict[str, Any]) -> list[str]:
    """The exit report's GPU lines: per process, launches and GPU time observed =
    charged to requests + unattributed (and idle time, and money, over its window)."""
    out = []
    for row in recon.get("cost", {}).get("processes", []):
        line = (f"GPU pid {row['pid']}: launches {row['launches_observed']:.0f} observed = "
                f"{row['launches_charged']:.1f} charged + {row['launches_unattributed']:.1f} "
                f"unattributed; GPU time {row['busy_s']:.3f} s busy = {row['charged_s']:.3f} s "
                f"charged + {row['unattributed_s']:.3f} s unattributed, "
                f"{row['idle_s']:.3f} s idle of {row['window_s']:.3f} s")
        if row.get("streams", 1) > 1:
            line += f" ({row['streams']} launching threads over {row['wall_s']:.3f} s wall)"
        if "busy_usd" in row:
            line += (f"; ${row['window_usd']:.6f} = ${row['charged_usd']:.6f} requests + "
                     f"${row['unattributed_usd']:.6f} unattributed + ${row['idle_usd']:.6f} idle")
        out.append(line)
    if recon.get("processes") and not recon.get("balanced", True):
        out.append("GPU reconciliation does NOT balance (a tokentrace bug): see --summary")
    return out


class _Stopper:
    """Stops on SIGINT/SIGTERM, or once `duration` seconds have passed since `arm()`.

    The clock starts when the probes are attached, not when the command starts:
    compiling and attaching can take seconds on a small machine, and a duration that
    had mostly run out before the first event could be seen would trace nothing.
    """

    def __init__(self, duration: float | None) -> None:
        self.duration = duration
        self.deadline: float | None = None
        self.stopped = False
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGTERM, self._stop)

    def _stop(self, *_: Any) -> None:
        self.stopped = True

    def arm(self) -> None:
        """Start the duration's clock (a no-op without a duration)."""
        if self.duration:
            self.deadline = time.monotonic() + self.duration

    def __bool__(self) -> bool:
        return self.stopped or (self.deadline is not None and time.monotonic() >= self.deadline)


def _targets(args: argparse.Namespace) -> Any:
    from tracer.probes.session import CaptureConfig

    return CaptureConfig(pids=args.pid, comms=args.comm, ports=args.port,
                         capture_limit=args.capture_limit, ringbuf_mb=args.ringbuf_mb,
                         burst_ns=args.burst_interval_us * 1000,
                         burst_min_ns=max(0, args.burst_min_us) * 1000,
                         gpu_sample=(1.0 if args.gpu_sample == "auto"
                                     else _sample_fraction(args.gpu_sample)),
                         gpu_sample_period_s=(max(0.01, args.gpu_sample_period)
                                              if args.gpu_sample_period else None),
                         stub_names_quiet_s=max(0.0, args.stub_names_quiet),
                         alias_lookups_quiet_s=max(0.0, args.alias_lookups_quiet),
                         uprobe_links=args.uprobe_links,
                         stack_every=_stack_every(args),
                         **({} if getattr(args, "token_runs", True) else {"token_runs": False}),
                         **({"concerns": tuple(c for c in CaptureConfig.concerns if c != "tls")}
                            if args.tls == "off" else {}),
                         **({"net_timing": args.net_timing} if args.net_timing else {}))


def _stack_every(args: argparse.Namespace) -> int:
    """--stacks' mean sampling interval (0: no stack sampling)."""
    from tracer.probes.stacks import DEFAULT_EVERY

    if args.stack_every is not None and not args.stacks:
        raise SystemExit("error: --stack-every needs --stacks")
    return (args.stack_every or DEFAULT_EVERY) if args.stacks else 0


def _sample_fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        f = float("nan")
    if not 0.0 < f <= 1.0:
        raise SystemExit(f"error: --gpu-sample must be auto or in (0, 1], not {text}")
    return f


def _sched_idle() -> None:
    """Lower every thread of this process to SCHED_IDLE (threads started later inherit)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except OSError as e:
            _say(f"warning: SCHED_IDLE not applied to thread {tid}: {e}")


def _say_gpu(gpu: Any) -> None:
    """Which GPU libraries got probes, and what could not be attached."""
    if gpu is None:
        return
    if gpu.attached:
        _say(f"GPU probes attached as {gpu.uprobes.kind}"
             + (f" ({gpu.uprobes.why_not})" if not gpu.uprobes.multi else ""))
    for lib in gpu.attached.values():
        _say(f"GPU probes: {lib.path} ({lib.kind}, {len(lib.symbols)} functions, "
             f"{lib.probes} uprobes)")
    for where, why in sorted(gpu.errors.items()):
        _say(f"warning: GPU probe not attached: {where}: {why}")


def _say_tls(tls: Any, said: set[Any]) -> None:
    """Which TLS libraries got probes (and which cannot be read): at attach, and as a
    rescan finds more (a process that loads libssl later, a new child). ``said``: the
    libraries already said."""
    if tls is None or len(tls.libraries) == len(said):
        return
    for key, lib in list(tls.libraries.items()):
        if key in said:
            continue
        said.add(key)
        if lib.status == "probed":
            _say(f"TLS probes: pid {lib.pid} {lib.path} ({lib.name})"
                 + (f": {lib.reason}" if lib.reason else ""))
        else:
            _say(f"warning: TLS not seen in pid {lib.pid}: {lib.path} ({lib.name}): "
                 f"{lib.reason}")


def _say_detached(session: Any) -> None:
    """How long taking the GPU probes off took (perf events: ~0.1 s each)."""
    gpu = session.gpu
    if gpu is not None and gpu.attached:
        _say(f"GPU probes detached in {session.detach_s:.2f}s ({gpu.uprobes.kind})")


def _drive(args: argparse.Namespace, open_: Callable[[], Any], poll: Callable[[], None],
           pids: Callable[[], set[int]], gpu: Callable[[], Any] = lambda: None,
           net: Callable[[], Any] = lambda: None,
           control: Callable[[], Callable[[str], str]] | None = None,
           tls: Callable[[], Any] = lambda: None) -> int:
    """Attach, say so, poll until stopped (applying SIGUSR1/SIGUSR2 and --control
    commands through ``control()``'s function). The caller closes in all cases."""
    from tracer.probes.loader import ProbeSetupError

    if not (args.pid or args.comm or args.port):
        _say("nothing to trace: give --pid, --comm or --port (see --help)")
        return 2
    stop = _Stopper(args.duration)
    try:
        open_()
    except ProbeSetupError as e:
        _say(f"error: {e}")
        return 1
    if not pids() and not (args.comm or args.port):
        _say(f"error: no such process: {', '.join(map(str, args.pid))}")
        return 1
    if args.sched_idle:
        _sched_idle()
    from tracer.control import Controller, restore_signals

    # ready before "attached" is said: a script may send its first command right then
    apply = control() if control is not None else None
    ctl = Controller(apply, getattr(args, "control", None)) if apply is not None else None
    _say_gpu(gpu())
    mode = net()
    timing = ("" if mode is None else "requests timed at the socket; " if mode.mode == "socket"
              else f"requests timed by syscalls only ({mode.reason}); ")
    desc = ", ".join(str(p) for p in sorted(pids())) or "none yet"
    _say(f"attached to {len(pids())} process(es) (pids: {desc}); {timing}"
         + (f"tracing for {args.duration:g}s" if args.duration else "Ctrl-C to stop"))
    said_tls: set[Any] = set()
    _say_tls(tls(), said_tls)  # after the 'attached' line: scripts wait for that one first
    stop.arm()
    try:
        while not stop:
            poll()
            _say_tls(tls(), said_tls)
            if ctl is not None:
                ctl.poll()
    finally:
        _say_tls(tls(), said_tls)  # a library the last poll found, before the exit lines
        if ctl is not None:
            ctl.close()
            restore_signals()
    return 0


def _new_header(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The capture header of a run: the tenant salt is --tenant-salt, else random."""
    extra = {"tenant_salt": args.tenant_salt} if args.tenant_salt else {}
    return capture.new_header(command=command, **extra)


# ---- commands -----------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from tracer.correlate.cost import GpuPricing
    from tracer.runner import TraceRun

    pricing = GpuPricing.resolve(price=args.gpu_price, model=args.gpu_model)
    header = _new_header(args, command="run")
    header["gpu_model"] = pricing.model
    ctx = ExportContext(capture_id=header["capture_id"], host=header["host"])
    sinks, console = build_sinks(args, ctx)
    targets = _targets(args)
    options = TrackerOptions(keep_content=args.capture_content,
                             tenant_salt=capture.tenant_salt(header),
                             max_connections=max(1, args.max_connections),
                             max_buffered=max(1 << 20, int(args.max_buffered_mb * 2**20)))
    auto = AutoSample() if args.gpu_sample == "auto" and "cuda" in targets.concerns else None
    duty = DutyCycle(*args.duty_cycle) if args.duty_cycle else None
    run = TraceRun(targets, sinks, options, record=args.record, ctx=ctx, header=header,
                   pricing=pricing, keep_secrets=args.capture_secrets, auto_sample=auto,
                   duty=duty, measure_overhead=not args.no_overhead_meter,
                   max_overhead=args.max_overhead)
    if duty is not None:
        _say(f"duty cycle: {duty.describe()}")
    if run.budget is not None:
        _say(f"overhead budget: {run.budget.budget:.2%} of the traced processes' CPU")
    gpu_table = console is not None and getattr(args, "gpu_every", 0) > 0
    if gpu_table:
        console.gpu, console.gpu_every_s = run.pipeline.gpu, args.gpu_every
    said = [auto.state if auto is not None else "", ""]

    def poll() -> None:
        run.poll()
        if gpu_table:
            console.gpu_tick()
        if auto is not None and auto.state != said[0]:
            said[0] = auto.state
            _say(f"gpu-sample auto: {auto.reason}")
        if run.meter_error and said[1] != run.meter_error:
            said[1] = run.meter_error
            _say(f"overhead meter off: {run.meter_error}"
                 + ("; --max-overhead is not applied" if run.budget is not None else ""))
        elif run.budget is not None and run.meter is not None and run.budget.reason != said[1]:
            said[1] = run.budget.reason
            if run.budget.fraction < 1.0 or said[1] != "not measured yet":
                _say(f"max-overhead: {said[1]}")

    try:
        rc = _drive(args, run.open, poll, lambda: run.session.pids,
                    lambda: run.session.gpu, lambda: run.session.net_timing,
                    lambda: run.apply, lambda: run.session.tls)
    finally:
        run.close()
        _say_detached(run.session)
        if run.session.stacks is not None:  # --stacks: which processes had Python frames
            for line in run.session.stacks.describe():
                _say(f"stacks: {line}")
    if rc == 0:
        _write_summary(args.summary, run.pipeline)
        _report(run.pipeline, console)
        _say(f"GPU time priced at {pricing.describe()}")
    return rc


def cmd_record(args: argparse.Namespace) -> int:
    from tracer.probes.session import CaptureSession

    from tracer.correlate.cost import detect_gpu_model

    header = _new_header(args, command="record")
    header["gpu_model"] = detect_gpu_model().name
    writer = capture.CaptureWriter(args.output, header, keep_secrets=args.capture_secrets)
    session = CaptureSession(_targets(args), writer.write)
    try:
        rc = _drive(args, session.start, session.poll, lambda: session.pids,
                    lambda: session.gpu, lambda: session.net_timing,
                    lambda: session.control, lambda: session.tls)
    finally:
        session.stop()
        writer.close()
        _say_detached(session)
    if rc == 0:
        _say(f"wrote {writer.items} items to {args.output}")
    return rc


def cmd_replay(args: argparse.Namespace) -> int:
    try:
        reader = capture.CaptureReader(args.capture)
    except (capture.CaptureError, OSError) as e:
        _say(f"error: {e}")
        return 1
    from tracer.correlate.cost import GpuDetection, GpuPricing

    recorded = reader.header.get("gpu_model")
    pricing = GpuPricing.resolve(
        price=args.gpu_price, model=args.gpu_model or recorded,
        detect=lambda: GpuDetection(reason="replay: the capture names no GPU model"))
    _say(f"GPU price: {pricing.describe()}")
    ctx = ExportContext(capture_id=str(reader.header.get("capture_id", "")),
                        host=str(reader.header.get("host", "")))
    sinks, console = build_sinks(args, ctx)
    options = TrackerOptions(keep_content=args.capture_content,
                             tenant_salt=capture.tenant_salt(reader.header),
                             secrets_masked=reader.header.get("secrets_masked") is True,
                             max_connections=max(1, args.max_connections),
                             max_buffered=max(1 << 20, int(args.max_buffered_mb * 2**20)))
    pipeline = Pipeline(sinks, ctx, options, pricing)
    try:
        for item in reader:
            pipeline.feed(item)
    except capture.CaptureError as e:
        _say(f"error: {e}")
    finally:
        pipeline.close()
    if reader.truncated:
        _say("warning: the capture ends mid-record (cut off while writing); "
             "analysed what was there")
    if reader.corrupt:
        _say(f"warning: the capture is damaged ({reader.corrupt}); analysed what came "
             "before it")
    if reader.bad_items:
        _say(f"warning: skipped {reader.bad_items} damaged event(s) in the capture")
    _write_summary(args.summary, pipeline)
    _report(pipeline, console)
    return 0


def cmd_ctl(args: argparse.Namespace) -> int:
    from tracer.control import send

    try:
        reply = send(args.socket, " ".join(args.words))
    except OSError as e:
        _say(f"error: cannot reach {args.socket}: {e}")
        return 1
    print(reply)
    return 1 if not reply.startswith("ok") else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from tracer.doctor import format_checks, run_checks

    results = run_checks(load=not args.no_load)
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2))
    else:
        print(format_checks(results))
    failed = [r for r in results if r.required and not r.ok]
    if not args.json:
        print("\ntracing can work" if not failed else f"\n{len(failed)} required check(s) failed")
    return 1 if failed else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from tracer.demo import run_demo

    return run_demo(requests=args.requests, out_dir=args.out, port=args.port)


def main(argv: list[str] | None = None) -> int:
    # Captures, span files, summaries and reports hold what a service's clients sent:
    # every file this process creates is for its user alone.
    os.umask(0o077)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""One tracing run: a capture session feeding the analysis pipeline (and, if asked,
a capture file). `tokentrace run` drives it in the foreground; the demo, tests and
benchmarks run it in a background thread with ``start()``/``stop()``."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from tracer import duty as duty_cycle
from tracer import overhead
from tracer.autosample import AutoSample
from tracer.correlate.connections import TrackerOptions
from tracer.events import capture, schema
from tracer.export.context import ExportContext
from tracer.pipeline import Pipeline
from tracer.probes import bpfstats, procfs
from tracer.probes.bpfstats import ProgramStats
from tracer.probes.session import CaptureConfig, CaptureSession

UNNAMED_CHECK_S = 2.0  # how often launched handles with no name are looked for


class TraceRun:
    def __init__(self, config: CaptureConfig, sinks: list[Any],
                 options: TrackerOptions | None = None, record: str | None = None,
                 ctx: ExportContext | None = None, header: dict[str, Any] | None = None,
                 pricing: Any = None, keep_secrets: bool = False,
                 auto_sample: AutoSample | None = None,
                 duty: duty_cycle.DutyCycle | None = None,
                 measure_overhead: bool = True, max_overhead: float | None = None,
                 meter_every_s: float = overhead.EVERY_S,
                 meter_window_s: float = overhead.WINDOW_S) -> None:
        self.header = header or capture.new_header(command="run")
        options = options or TrackerOptions()
        if options.tenant_salt is None:  # tenants hashed as the capture's replay will
            options.tenant_salt = capture.tenant_salt(self.header)
        self.ctx = ctx or ExportContext()
        self.ctx.capture_id = self.ctx.capture_id or self.header["capture_id"]
        self.ctx.host = self.ctx.host or self.header["host"]
        self.pipeline = Pipeline(sinks, self.ctx, options, pricing)
        self.writer = (capture.CaptureWriter(record, self.header, keep_secrets=keep_secrets)
                       if record else None)
        self.session = CaptureSession(config, self._sink)
        # the agent arms the kernel's token runs from what the analysis reads
        self.pipeline.tracker.runs.arming = config.token_runs and not options.keep_content
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._unnamed_reported: dict[int, set[int]] = {}  # pid -> handles asked about
        self._next_unnamed = 0.0
        # --gpu-sample auto: counting every launch until sampling pays (tracer/autosample.py)
        self.auto_sample = auto_sample
        self._next_auto = time.monotonic() + (auto_sample.check_s if auto_sample else 0.0)
        # --duty-cycle: traced for a share of every period, paused the rest (tracer/duty.py);
        # its phase counts from the first cycle set; a pause by hand holds it
        self.duty: duty_cycle.DutyCycle | None = None
        self._pending_duty = duty
        self._duty_origin: float | None = None
        self._hand_paused = False
        # what the probes cost the traced processes, measured in windows
        # (tracer/overhead.py); with --max-overhead, the duty cycle that keeps it in budget
        self._meter_stats = ProgramStats()  # its own hold on the kernel's statistics
        self.meter = (overhead.Meter(self._meter_stats_on, self.session.program_costs, _cpu_ns,
                                     every_s=meter_every_s, window_s=meter_window_s,
                                     traced_runs=self.session.traced_tracepoint_runs,
                                     early_exit=self.session.early_exit_ns)
                      if measure_overhead or max_overhead else None)
        self.budget = overhead.Budget(max_overhead) if max_overhead else None
        self.meter_error = ""  # why the meter stopped, if it did
        # control commands from other threads, applied by the polling one
        self._commands: queue.Queue[tuple[str, threading.Event, list[str]]] = queue.Queue()

    def _sink(self, item: Any) -> None:
        if self.writer is not None:
            self.writer.write(item)
        self.pipeline.feed(item)

    def open(self) -> None:
        """Load probes and attach (raises ProbeSetupError with a fix on failure)."""
        self.session.start()
        if self._pending_duty is not None:
            self._set_duty(self._pending_duty)

    def control(self, command: str, timeout: float = 60.0) -> str:
        """A ``--control`` command (``CaptureSession.control``), applied by the thread
        that polls (BCC is not for two threads at once); its reply."""
        if self._thread is None or not self._thread.is_alive():
            return self.apply(command)
        done, reply = threading.Event(), [""]
        self._commands.put((command, done, reply))
        if not done.wait(timeout):
            return "error: not applied in time"
        return reply[0]

    def poll(self) -> None:
        while not self._commands.empty():
            command, done, reply = self._commands.get()
            reply[0] = self.apply(command)
            done.set()
        self.session.poll()
        self.session.arm_runs(self.pipeline.tracker.runs.take_requests())
        now = time.monotonic()
        if now >= self._next_unnamed:
            self._next_unnamed = now + UNNAMED_CHECK_S
            self.ask_unnamed()
        if self.meter is not None:
            self._measure(now)
        if self.duty is not None:
            self._follow_duty(now)
        if self.auto_sample is not None and now >= self._next_auto:
            self._next_auto = now + self.auto_sample.check_s
            self.check_sampling(now)

    def apply(self, command: str) -> str:
        """A control command applied now, on the calling thread (the one that polls):
        ``CaptureSession.control``'s reply. Setting ``gpu-sample`` by hand stands
        ``--gpu-sample auto`` down. ``duty-cycle F[/PERIOD]|off`` is the run's own
        (``--duty-cycle``); a ``pause`` holds the cycle until the ``resume``, which
        gives the probes back to it, in its phase."""
        words = command.split()
        if words[:1] == ["duty-cycle"]:
            if self.budget is not None:  # set by hand: the budget stands down
                self.budget = None
                self.session.user_counters["overhead_budget_stood_down"] = 1
            return self._duty_command(words[1:])
        if words in (["pause"], ["resume"]):
            self._hand_paused = words == ["pause"]
        if self.duty is not None and words == ["resume"]:
            now = time.monotonic()
            if not self.duty.in_window(now):
                return (f"ok resumed 0.000s (the duty cycle's next window opens in "
                        f"{self.duty.next_window(now) - now:.1f}s)")
            took = self.session.resume(duty=self.duty.fraction)
            self._after_resume()
            return f"ok resumed {took:.3f}s"
        reply = self.session.control(command)
        if self.auto_sample is not None and reply.startswith("ok"):
            verb = words[0] if words else ""
            if verb == "gpu-sample":
                self.auto_sample.hand_set()
            elif verb == "sample-period":
                self.auto_sample.set_period(self.session.sample_period_s())
                self._follow_auto()
            elif verb == "resume":
                self._after_resume()
        return reply

    def _after_resume(self) -> None:
        if self.auto_sample is not None:
            self.auto_sample.restart()
            self._follow_auto()

    def _duty_command(self, args: list[str]) -> str:
        """``duty-cycle F[/PERIOD]`` or ``duty-cycle off``: set, change or end it. The
        cycle's phase is the run's (counted from the first cycle it had), so a cycle
        set or changed goes on where that phase is."""
        if args == ["off"]:
            self.duty = None
            if self.session.paused and not self._hand_paused:
                self.session.resume()  # the cycle's pause ends with it
                self._after_resume()
            else:
                self._announce_duty(0.0)
            return "ok duty-cycle off"
        if len(args) != 1:
            return "error: duty-cycle F[/PERIOD] or duty-cycle off"
        try:
            fraction, period = duty_cycle.parse(args[0])
        except ValueError as e:
            return f"error: {e}"
        self._set_duty(duty_cycle.DutyCycle(fraction, period))
        return f"ok duty-cycle {self.duty.describe()}"  # type: ignore[union-attr]

    def _set_duty(self, duty: duty_cycle.DutyCycle) -> None:
        """Put ``duty`` in force, on the run's phase: the probes go out or back now
        where it says so (``_follow_duty``: not while paused by hand)."""
        now = time.monotonic()
        if self._duty_origin is None:
            self._duty_origin = now
        duty.start = self._duty_origin
        self.duty = duty
        self._announce_duty(duty.fraction)
        self._follow_duty(now)

    def _announce_duty(self, fraction: float) -> None:
        """The fraction in force changed with the probes where they are: a switch
        record that switches nothing, so a replay labels the spans alike."""
        if not self.session.paused:
            self.session.sink(schema.TracingPaused(ts=time.monotonic_ns(), paused=False,
                                                   duty=fraction))

    def _follow_duty(self, now: float) -> None:
        """Pause or resume where ``--duty-cycle``'s phase says so (counted); nothing
        while paused by hand."""
        duty = self.duty
        assert duty is not None
        if self._hand_paused:
            return
        action = duty.due(now, self.session.paused)
        if action == "pause":
            self.session.pause(duty=duty.fraction)
            self.pipeline.stats["duty_cycle_switches"] += 1
        elif action == "resume":
            self.session.resume(duty=duty.fraction)
            self.pipeline.stats["duty_cycle_switches"] += 1
            self._after_resume()

    def _meter_stats_on(self, on: bool) -> None:
        """The meter's hold on the kernel's run-time statistics. Where it cannot take
        one (``BPF_ENABLE_STATS`` takes CAP_SYS_ADMIN, which the DaemonSet does not
        grant) it reads them as the node keeps them (``kernel.bpf_stats_enabled=1``);
        else the meter stops, counted and said (``meter_error``)."""
        try:
            if on:
                self._meter_stats.enable()
            else:
                self._meter_stats.disable()
        except OSError as e:
            if bpfstats.stats_sysctl_on():
                return
            self.meter = None
            self.meter_error = (f"{e.strerror or e}: set the sysctl kernel.bpf_stats_enabled=1 "
                                "or grant CAP_SYS_ADMIN")
            self.session.user_counters["probe_cpu_unmeasured"] = 1

    def _measure(self, now: float) -> None:
        """A window of the probes' cost (``overhead.Meter``); a finished estimate goes
        to the counters and, with ``--max-overhead``, to the budget's duty cycle."""
        meter, session = self.meter, self.session
        assert meter is not None
        room = (self.duty.room(now) if self.duty is not None and not self._hand_paused
                else float("inf"))
        est = meter.tick(now, not session.paused and session.bpf is not None,
                         session.switches, session.pids, room)
        if est is None:
            return
        counters = session.user_counters
        counters["probe_cpu_ppm"] = est.ppm
        counters["probe_cpu_ppm_max"] = max(counters.get("probe_cpu_ppm_max", 0), est.ppm)
        counters["probe_cpu_estimates"] += 1
        # the sums over every window: their ratio is the run's estimate
        counters["probe_cpu_probe_ns"] += est.probe_ns
        counters["probe_cpu_traced_ns"] += est.traced_cpu_ns
        # ...and what it is made of: the programs' own time and the runs by how each
        # was entered (their entries are the rest), in every process; the tracepoints'
        # runs not for traced processes, each an entry and an early exit of
        # probe_cpu_early_exit_ns, are taken off; with them all, the host's sum
        counters["probe_cpu_program_ns"] += est.probes.program_ns
        for kind, n in est.probes.hits.items():
            counters[f"probe_cpu_{kind}_runs"] += n
        counters["probe_cpu_others_runs"] += est.probes.others_runs
        counters["probe_cpu_early_exit_ns"] = est.early_exit_ns
        counters["probe_cpu_host_probe_ns"] += est.probes.total_ns
        budget = self.budget
        if budget is None:
            return
        fraction = budget.add(est)
        if fraction is None:
            return
        counters["overhead_budget_changes"] += 1
        counters["overhead_budget_fraction_pct"] = round(fraction * 100)
        if fraction >= 1.0:
            self._duty_command(["off"])
        else:
            self._set_duty(duty_cycle.DutyCycle(fraction, duty_cycle.DEFAULT_PERIOD_S))

    def _follow_auto(self) -> None:
        """Put ``--gpu-sample auto``'s share in force where it changed without a check
        (a new period; one set while paused waits for the resume)."""
        auto, session = self.auto_sample, self.session
        if (auto is None or auto.state != "sampling" or session.gpu is None
                or session.paused or session.config.gpu_sample == auto.fraction):
            return
        self._switch_auto(auto.fraction)

    def _switch_auto(self, fraction: float) -> None:
        """Put ``fraction``, auto's choice, in force with its reason, counted."""
        auto = self.auto_sample
        assert auto is not None
        self.session.set_gpu_sample(fraction, auto.reason, copies=auto.copies,
                                    memsets=auto.memsets)
        self.pipeline.stats["gpu_sample_auto_switches"] += 1

    def check_sampling(self, now: float) -> None:
        """``--gpu-sample auto``: switch the launch probes to sampling once launches are
        frequent and every launching thread is an engine's step thread; back to
        counting every launch if a thread launches for the one request it serves."""
        auto, session = self.auto_sample, self.session
        if auto is None or session.gpu is None or session.paused:
            return
        threads = self.pipeline.gpu_threads()
        estimates = self.pipeline.attribution.estimates
        request_steps = self.pipeline.attribution.typical_request_steps()
        fraction = auto.check(now, threads, self.pipeline.attribution.same_thread,
                              {k: estimates.copies_tell_steps_apart(*k) for k in threads},
                              {k: estimates.memsets_tell_steps_apart(*k, request_steps)
                               for k in threads},
                              {k: estimates.blind_memset_shares(*k, request_steps)
                               for k in threads}, period_s=session.sample_period_s(),
                              step_ns=self.pipeline.step_intervals(),
                              base_period_s=session.default_sample_period_s())
        if fraction is not None:
            self._switch_auto(fraction)

    def ask_unnamed(self) -> None:
        """Kernel handles launched with no name (new since the last time): the probes
        on cuKernelGetFunction are attached again (an alias looked up while they were
        detached is told at its next look-up), and the pre-attach naming reads the
        process's handle variables again (a kernel first launched after attach, once
        the naming window had closed). Each handle is asked about once."""
        gpu = self.session.gpu
        if gpu is None:
            return
        for pid, proc in list(self.pipeline.gpu.processes.items()):
            asked = self._unnamed_reported.setdefault(pid, set())
            new = proc.unnamed_handles() - asked
            if new:
                asked |= new
                gpu.lookups.open_window("a handle launched with no name")
                if gpu.prenames is not None:
                    gpu.prenames.unnamed(pid, new)

    def close(self) -> dict[str, int]:
        """Drain, flush every finished span, close files; returns the loss report."""
        if self.meter is not None:
            self.meter.close()
        try:
            self.session.stop()
        finally:
            self.pipeline.close()
            if self.writer is not None:
                self.writer.close()
        return self.pipeline.report()

    # background use ------------------------------------------------------------------

    def start(self) -> "TraceRun":
        """Attach, then keep polling in a thread until ``stop()``."""
        self.open()

        def loop() -> None:
            try:
                while not self._stop.is_set():
                    self.poll()
            except BaseException as e:  # surfaced by stop()
                self.error = e

        self._thread = threading.Thread(target=loop, name="tokentrace-poll", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> dict[str, int]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        report = self.close()
        if self.error is not None:
            raise RuntimeError("the tracing thread failed") from self.error
        return report


def _cpu_ns(pids: set[int]) -> dict[int, int]:
    """The CPU time of each of ``pids`` still running."""
    out = {}
    for pid in pids:
        ns = procfs.cpu_ns(pid)
        if ns is not None:
            out[pid] = ns
    return out

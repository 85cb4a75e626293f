"""Request metrics: OpenTelemetry GenAI server histograms and a Prometheus endpoint.

Both sinks read what the span of a request says (``spans.span_attributes``), so a
metric never disagrees with the trace it summarises. Only LLM requests (an OpenAI
request was parsed) are counted; health checks and model listings are not.

OTLP (``OtlpMetricsSink``): the GenAI semantic conventions' server histograms, in
seconds, with ``gen_ai.operation.name``, ``gen_ai.request.model`` and (on failure)
``error.type``; one MeterProvider per traced process, with the span resource. The
agent's health goes with them under a resource of its own (``service.name``
``tokentrace``): ``tokentrace.records.lost`` and ``tokentrace.probe.cpu.*``, the same
figures as the Prometheus ones below.

Prometheus (``PrometheusSink``): the same histograms under vLLM's names with a
``tokentrace_`` prefix, and counters; label ``model_name`` as in vLLM. It listens on
127.0.0.1 unless told an address.

Label values come from what clients and servers sent (a model name is whatever a request
body says), so each label takes at most ``MAX_LABEL_VALUES`` distinct values, the first
seen; later ones become ``other`` and are counted in
``tokentrace_label_values_capped_total{label}``. OTLP metric attributes are capped alike.

========================================  ==========================================
tokentrace                                vLLM
========================================  ==========================================
tokentrace_time_to_first_token_seconds    vllm:time_to_first_token_seconds
tokentrace_time_per_output_token_seconds  vllm:time_per_output_token_seconds
tokentrace_e2e_request_latency_seconds    vllm:e2e_request_latency_seconds
tokentrace_socket_wait_seconds            (none: span tokentrace.network.socket_wait)
tokentrace_request_success_total          vllm:request_success_total
tokentrace_prompt_tokens_total            vllm:prompt_tokens_total
tokentrace_generation_tokens_total        vllm:generation_tokens_total
tokentrace_request_failure_total          (none: errors by error_type)
tokentrace_gpu_kernel_launches_total      (none: span tokentrace.gpu.kernel_launches)
tokentrace_gpu_time_seconds_total         (none: span tokentrace.gpu.time_ms / 1000)
tokentrace_cost_usd_total                 (none: span tokentrace.cost.usd)
========================================  ==========================================

The agent's own health, from the counters it reports every second (``AgentCollector``):
``tokentrace_records_lost_total{counter}`` (records the probes made and the ring
buffer refused, by counter), and once the overhead meter has measured
(tracer/overhead.py), ``tokentrace_probe_cpu_ratio`` (the probes' estimated kernel
time in the traced processes over their CPU time, the last window) with the sums over
every window, ``tokentrace_probe_cpu_seconds_total`` and
``tokentrace_probe_cpu_measured_seconds_total``: their rates' ratio is the estimate
over any range.
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

from tracer.correlate.records import RequestRecord
from tracer.events.wire import RING_LOSS_COUNTERS
from tracer.export.context import ExportContext

# The GenAI semantic conventions' advised bucket boundaries (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# socket wait: sub-millisecond when the server keeps up, seconds when it is saturated
SOCKET_WAIT_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                       0.5, 1.0, 2.5, 5.0, 10.0)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)
MAX_LABEL_VALUES = 32
OTHER = "other"
DEFAULT_ADDR = "127.0.0.1"


class LabelCap:
    """One label's values: the first ``limit`` distinct ones pass, the rest become
    ``other`` (and are counted in ``capped``), so no client can create series."""

    def __init__(self, limit: int = MAX_LABEL_VALUES) -> None:
        self.limit = limit
        self.seen: set[str] = set()
        self.capped = 0

    def __call__(self, value: str) -> str:
        if value in self.seen:
            return value
        if len(self.seen) < self.limit:
            self.seen.add(value)
            return value
        self.capped += 1
        return OTHER


class RequestFacts:
    """What the metrics take from one request, read from its span attributes."""

    __slots__ = ("model", "operation", "ttft", "tpot", "duration", "socket_wait", "input_tokens",
                 "output_tokens", "error_type", "finish_reason", "kernel_launches",
                 "gpu_seconds", "cost_usd")

    def __init__(self, rec: RequestRecord) -> None:
        from tracer.export.spans import span_attributes

        a = span_attributes(rec)
        self.model: str = a.get("gen_ai.request.model") or a.get("gen_ai.response.model") or ""
        self.operation: str = a.get("gen_ai.operation.name", "")
        self.ttft: float | None = a.get("tokentrace.time_to_first_token")
        self.tpot: float | None = a.get("tokentrace.time_per_output_token")
        # the span's own extent: arrival to departure where the socket was seen
        self.duration: float = max(rec.client_end_ns - rec.client_start_ns, 0) * 1e-9
        self.socket_wait: float | None = a.get("tokentrace.network.socket_wait")
        self.input_tokens: int | None = a.get("gen_ai.usage.input_tokens")
        self.output_tokens: int | None = a.get("gen_ai.usage.output_tokens")
        self.error_type: str | None = a.get("error.type") if rec.failed else None
        reasons = a.get("gen_ai.response.finish_reasons") or []
        self.finish_reason: str = reasons[0] if reasons else "unknown"
        self.kernel_launches: int | None = a.get("tokentrace.gpu.kernel_launches")
        ms = a.get("tokentrace.gpu.time_ms")
        self.gpu_seconds: float | None = None if ms is None else ms / 1000.0
        self.cost_usd: float | None = a.get("tokentrace.cost.usd")


class AgentHealth:
    """The agent's health in one counter report (``ExportContext.drops``, replaced whole
    each second, so one read sees one report): the records lost by ring-loss counter,
    and, once the overhead meter has measured, its estimate."""

    __slots__ = ("lost", "measured", "ratio", "probe_s", "traced_s")

    def __init__(self, counters: dict[str, int]) -> None:
        self.lost = {name: counters.get(name, 0) for name in sorted(RING_LOSS_COUNTERS)}
        # the overhead meter is off or has not measured yet: no figure, not a zero
        self.measured = bool(counters.get("probe_cpu_estimates"))
        self.ratio = counters.get("probe_cpu_ppm", 0) / 1e6  # its last window
        self.probe_s = counters.get("probe_cpu_probe_ns", 0) / 1e9  # over every window
        self.traced_s = counters.get("probe_cpu_traced_ns", 0) / 1e9


LOST_HELP = ("Records the probes made and the ring buffer had no place for, by counter "
             "(lost_data: socket data, lost_gpu: GPU bursts...).")
RATIO_HELP = ("The probes' estimated kernel time in the traced processes over those "
              "processes' CPU time, in the overhead meter's last window (a 2-s window "
              "every 20 s; --max-overhead keeps it under its budget).")
PROBE_HELP = ("The probes' estimated kernel time in the traced processes, summed over "
              "the overhead meter's windows.")
MEASURED_HELP = ("The traced processes' CPU time in the overhead meter's windows: the "
                 "rate of the probes' time over this one is the estimate over any range.")


class AgentCollector:
    """The agent's health at each Prometheus scrape (``AgentHealth``)."""

    def __init__(self, ctx: ExportContext) -> None:
        self.ctx = ctx

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        h = AgentHealth(self.ctx.drops)
        lost = CounterMetricFamily("tokentrace_records_lost", LOST_HELP, labels=["counter"])
        for name, v in h.lost.items():
            lost.add_metric([name], v)
        yield lost
        if not h.measured:
            return
        yield GaugeMetricFamily("tokentrace_probe_cpu_ratio", RATIO_HELP, value=h.ratio)
        yield CounterMetricFamily("tokentrace_probe_cpu_seconds", PROBE_HELP,
                                  value=h.probe_s)
        yield CounterMetricFamily("tokentrace_probe_cpu_measured_seconds", MEASURED_HELP,
                                  value=h.traced_s)


class PrometheusSink:
    """A record sink serving ``/metrics`` on ``port`` (0: any free port, see ``.port``);
    with ``ctx``, the agent's own health too (``AgentCollector``).

    Metrics live in their own registry, so several sinks (tests) do not collide."""

    def __init__(self, port: int, addr: str = DEFAULT_ADDR,
                 max_label_values: int = MAX_LABEL_VALUES,
                 ctx: ExportContext | None = None) -> None:
        from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                                       start_http_server)

        self.caps = {name: LabelCap(max_label_values)
                     for name in ("model_name", "error_type", "finished_reason")}

        self.registry = CollectorRegistry()
        r, lab = self.registry, ["model_name"]
        self.ttft = Histogram("tokentrace_time_to_first_token_seconds",
                              "Time to first generated token (first text-carrying chunk).",
                              lab, registry=r, buckets=TTFT_BUCKETS)
        self.tpot = Histogram("tokentrace_time_per_output_token_seconds",
                              "Mean time between generated chunks after the first.",
                              lab, registry=r, buckets=TPOT_BUCKETS)
        self.e2e = Histogram("tokentrace_e2e_request_latency_seconds",
                             "Request bytes' arrival at the socket to the response's last "
                             "bytes leaving it (syscall times where those were not seen).",
                             lab, registry=r, buckets=DURATION_BUCKETS)
        self.socket_wait = Histogram("tokentrace_socket_wait_seconds",
                                     "Time a request's bytes waited in the socket (listen "
                                     "backlog, receive queue) before the server read them.",
                                     lab, registry=r, buckets=SOCKET_WAIT_BUCKETS)
        self.success = Counter("tokentrace_request_success", "Requests answered successfully.",
                               ["model_name", "finished_reason"], registry=r)
        self.failure = Counter("tokentrace_request_failure", "Requests that failed.",
                               ["model_name", "error_type"], registry=r)
        self.prompt_tokens = Counter("tokentrace_prompt_tokens", "Prompt (input) tokens.",
                                     lab, registry=r)
        self.generation_tokens = Counter("tokentrace_generation_tokens",
                                         "Generated (output) tokens.", lab, registry=r)
        self.kernels = Counter("tokentrace_gpu_kernel_launches",
                               "GPU kernel launches attributed to requests.", lab, registry=r)
        self.gpu_time = Counter("tokentrace_gpu_time_seconds",
                                "GPU time attributed to requests.", lab, registry=r)
        self.cost = Counter("tokentrace_cost_usd", "Cost attributed to requests, in USD.",
                            lab, registry=r)
        self.capped = Counter("tokentrace_label_values_capped",
                              "Observations whose label value was replaced by 'other': the "
                              "label had its most distinct values already.", ["label"],
                              registry=r)
        self.traced_share = Gauge("tokentrace_traced_share",
                                  "Share of the time the probes are in (run --duty-cycle; 1: "
                                  "all the time): the counts above cover that share of the "
                                  "requests, so divide rates by it.", registry=r)
        self.traced_share.set(1.0)
        if ctx is not None:
            r.register(AgentCollector(ctx))
        self._server, self._thread = start_http_server(port, addr, registry=r)
        self.port: int = self._server.server_port

    def on_record(self, rec: RequestRecord) -> None:
        if not rec.is_llm or rec.cut_by_duty_cycle:
            return
        self.traced_share.set(rec.duty_cycle or 1.0)
        f = RequestFacts(rec)
        m = self._label("model_name", f.model)
        self.e2e.labels(m).observe(f.duration)
        if f.socket_wait is not None:
            self.socket_wait.labels(m).observe(f.socket_wait)
        if f.ttft is not None:
            self.ttft.labels(m).observe(f.ttft)
        if f.tpot is not None:
            self.tpot.labels(m).observe(f.tpot)
        if f.error_type is not None:
            self.failure.labels(m, self._label("error_type", f.error_type)).inc()
        else:
            self.success.labels(m, self._label("finished_reason", f.finish_reason)).inc()
        for counter, v in ((self.prompt_tokens, f.input_tokens),
                           (self.generation_tokens, f.output_tokens),
                           (self.kernels, f.kernel_launches), (self.gpu_time, f.gpu_seconds),
                           (self.cost, f.cost_usd)):
            if v is not None:
                counter.labels(m).inc(v)

    def _label(self, name: str, value: str) -> str:
        out = self.caps[name](value)
        if out is OTHER and value != OTHER:
            self.capped.labels(name).inc()
        return out

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class OtlpMetricsSink:
    """A record sink recording the GenAI server histograms with the OpenTelemetry SDK
    and exporting them over OTLP every ``interval_s`` (and at close), with the agent's
    health read from ``ctx`` at each export."""

    def __init__(self, ctx: ExportContext, endpoint: str, protocol: str | None = None,
                 interval_s: float = 10.0) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.protocol = protocol
        self.interval_ms = int(interval_s * 1000)
        self._meters: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self.caps = {"model": LabelCap(), "error": LabelCap()}
        self._agent = self._agent_provider()

    def _instruments(self, pid: int) -> dict[str, Any]:
        with self._lock:
            entry = self._meters.get(pid)
            if entry is None:
                entry = self._new_provider(pid)
                self._meters[pid] = entry
            return entry[1]

    def _new_provider(self, pid: int) -> tuple[Any, dict[str, Any]]:
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

        import tracer
        from tracer.export.spans import resource_for

        views = [View(instrument_name=name,
                      aggregation=ExplicitBucketHistogramAggregation(list(buckets)))
                 for name, buckets in (("gen_ai.server.time_to_first_token", TTFT_BUCKETS),
                                       ("gen_ai.server.time_per_output_token", TPOT_BUCKETS),
                                       ("gen_ai.server.request.duration", DURATION_BUCKETS))]
        provider = self._provider(resource_for(self.ctx, pid), views)
        meter = provider.get_meter("tokentrace", tracer.__version__)
        inst = {
            "ttft": meter.create_histogram(
                "gen_ai.server.time_to_first_token", unit="s",
                description="Time to generate the first token for successful responses"),
            "tpot": meter.create_histogram(
                "gen_ai.server.time_per_output_token", unit="s",
                description="Time per output token generated after the first token "
                            "for successful responses"),
            "duration": meter.create_histogram(
                "gen_ai.server.request.duration", unit="s",
                description="Generative AI server request duration such as time-to-last "
                            "byte or last output token"),
        }
        return provider, inst

    def _provider(self, resource: Any, views: list[Any] | None = None) -> Any:
        """A MeterProvider for ``resource`` exporting to the endpoint every interval."""
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        from tracer.export.otlp import otlp_metric_exporter

        reader = PeriodicExportingMetricReader(
            otlp_metric_exporter(self.endpoint, self.protocol),
            export_interval_millis=self.interval_ms)
        return MeterProvider(metric_readers=[reader], resource=resource, views=views or (),
                             shutdown_on_exit=False)

    def _agent_provider(self) -> Any:
        """The agent's health (``AgentHealth``) under its own resource, observed at each
        export: ``tokentrace.records.lost`` by ``counter``, and once the overhead meter
        has measured, ``tokentrace.probe.cpu.ratio``, ``tokentrace.probe.cpu.time`` and
        ``tokentrace.probe.cpu.measured_time``."""
        from opentelemetry.metrics import CallbackOptions, Observation

        import tracer
        from tracer.export.spans import agent_resource

        def lost(_: CallbackOptions) -> list[Observation]:
            return [Observation(v, {"counter": name})
                    for name, v in AgentHealth(self.ctx.drops).lost.items()]

        def measured(field: str) -> Any:
            def observe(_: CallbackOptions) -> list[Observation]:
                h = AgentHealth(self.ctx.drops)
                return [Observation(getattr(h, field))] if h.measured else []
            return observe

        provider = self._provider(agent_resource(self.ctx))
        meter = provider.get_meter("tokentrace.agent", tracer.__version__)
        meter.create_observable_counter("tokentrace.records.lost", [lost], unit="{record}",
                                        description=LOST_HELP)
        meter.create_observable_gauge("tokentrace.probe.cpu.ratio", [measured("ratio")],
                                      unit="1", description=RATIO_HELP)
        meter.create_observable_counter("tokentrace.probe.cpu.time", [measured("probe_s")],
                                        unit="s", description=PROBE_HELP)
        meter.create_observable_counter("tokentrace.probe.cpu.measured_time",
                                        [measured("traced_s")], unit="s",
                                        description=MEASURED_HELP)
        return provider

    def on_record(self, rec: RequestRecord) -> None:
        if not rec.is_llm or rec.cut_by_duty_cycle:
            return
        f = RequestFacts(rec)
        inst = self._instruments(rec.pid)
        attrs: dict[str, Any] = {"gen_ai.operation.name": f.operation}
        if f.model:
            attrs["gen_ai.request.model"] = self.caps["model"](f.model)
        if f.error_type is not None:
            attrs["error.type"] = self.caps["error"](f.error_type)
        inst["duration"].record(f.duration, attrs)
        if f.error_type is None:  # the conventions: TTFT and TPOT of successful responses
            if f.ttft is not None:
                inst["ttft"].record(f.ttft, attrs)
            if f.tpot is not None:
                inst["tpot"].record(f.tpot, attrs)

    def close(self) -> None:
        for provider, _ in self._meters.values():
            provider.shutdown()  # collects and exports once more
        self._agent.shutdown()


# ---- command line ----------------------------------------------------------------------


def _listen(text: str) -> tuple[str, int]:
    addr, _, port = text.rpartition(":")
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected PORT or ADDR:PORT, not {text!r}")
    return addr.strip("[]") or DEFAULT_ADDR, int(port)


def add_metric_args(g: argparse._ArgumentGroup) -> None:
    """The metrics flags, in the export group of `run` and `replay`."""
    g.add_argument("--prometheus", type=_listen, metavar="[ADDR:]PORT",
                   help="serve Prometheus metrics (TTFT, TPOT, latency, requests, tokens, "
                        "GPU work, cost by model; the agent's lost records and the "
                        "probes' measured cost) at http://ADDR:PORT/metrics; ADDR is "
                        f"{DEFAULT_ADDR} unless given (0.0.0.0: every interface)")
    g.add_argument("--otlp-metrics", action="store_true",
                   help="also send the GenAI server metrics (gen_ai.server.*) and the "
                        "agent's health (lost records, the probes' measured cost) to the "
                        "--otlp endpoint")


def metric_sinks(args: argparse.Namespace, ctx: ExportContext) -> list[Any]:
    """The metric sinks the flags ask for (after the span sinks)."""
    sinks: list[Any] = []
    if getattr(args, "prometheus", None):
        addr, port = args.prometheus
        try:
            sinks.append(PrometheusSink(port, addr, ctx=ctx))
        except OSError as e:
            raise SystemExit(f"tokentrace: error: cannot serve metrics on {addr}:{port}: "
                             f"{e.strerror or e}") from None
    if getattr(args, "otlp_metrics", False):
        if not args.otlp:
            raise SystemExit("tokentrace: error: --otlp-metrics needs --otlp ENDPOINT")
        sinks.append(OtlpMetricsSink(ctx, args.otlp, args.otlp_protocol))
    return sinks

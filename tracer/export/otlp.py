"""OTLP span export to any collector, Jaeger or Phoenix, over gRPC or HTTP."""

from __future__ import annotations

from urllib.parse import urlparse

from opentelemetry.sdk.metrics.export import MetricExporter
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter


def otlp_exporter(endpoint: str, protocol: str | None = None) -> SpanExporter:
    """An OTLP exporter for ``endpoint``.

    ``protocol`` is "grpc" or "http"; if omitted it is taken from the endpoint:
    ``http(s)://...`` with port 4318 or a path means OTLP/HTTP, anything else gRPC
    (``host:4317`` or ``grpc://host:4317``).
    """
    u = urlparse(endpoint if "://" in endpoint else f"grpc://{endpoint}")
    if protocol is None:
        protocol = "http" if u.scheme in ("http", "https") and (
            u.port == 4318 or (u.path not in ("", "/"))) else "grpc"
    if protocol == "http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPExporter,
        )
        url = endpoint if "://" in endpoint else f"http://{endpoint}"
        if urlparse(url).path in ("", "/"):
            url = url.rstrip("/") + "/v1/traces"
        return HTTPExporter(endpoint=url)
    if protocol != "grpc":
        raise ValueError(f"OTLP protocol must be grpc or http, not {protocol!r}")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GRPCExporter,
    )
    target = f"{u.hostname}:{u.port or 4317}"
    return GRPCExporter(endpoint=target, insecure=u.scheme != "https")


def otlp_processor(endpoint: str, protocol: str | None = None) -> BatchSpanProcessor:
    return BatchSpanProcessor(otlp_exporter(endpoint, protocol), schedule_delay_millis=1000)


def otlp_metric_exporter(endpoint: str, protocol: str | None = None) -> MetricExporter:
    """An OTLP metric exporter for the same ``endpoint`` and protocol rules as
    ``otlp_exporter`` (OTLP/HTTP posts to ``/v1/metrics``)."""
    u = urlparse(endpoint if "://" in endpoint else f"grpc://{endpoint}")
    if protocol is None:
        protocol = "http" if u.scheme in ("http", "https") and (
            u.port == 4318 or (u.path not in ("", "/"))) else "grpc"
    if protocol == "http":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
            OTLPMetricExporter as HTTPMetricExporter,
        )
        base = endpoint if "://" in endpoint else f"http://{endpoint}"
        p = urlparse(base)
        return HTTPMetricExporter(endpoint=f"{p.scheme}://{p.netloc}/v1/metrics")
    if protocol != "grpc":
        raise ValueError(f"OTLP protocol must be grpc or http, not {protocol!r}")
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
        OTLPMetricExporter as GRPCMetricExporter,
    )
    return GRPCMetricExporter(endpoint=f"{u.hostname}:{u.port or 4317}",
                              insecure=u.scheme != "https")

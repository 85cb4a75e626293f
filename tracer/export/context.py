"""What exporters need to know besides the records: clock, processes, identity."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracer.events.schema import ProcessInfo


@dataclass
class ExportContext:
    """Shared, updated by the pipeline as capture items arrive."""

    capture_id: str = ""
    host: str = ""
    clock_offset_ns: int = 0  # wall = monotonic + offset
    processes: dict[int, ProcessInfo] = field(default_factory=dict)
    service_name: str | None = None  # overrides the process name as service.name
    capture_cmdline: bool = False  # export process.command_line (secrets redacted)
    extra_resource: dict[int, dict[str, Any]] = field(default_factory=dict)
    drops: dict[str, int] = field(default_factory=dict)
    identity: Any = None  # an identity.IdentityResolver: container and pod of each pid
    # launch-site stacks (tracer/correlate/stacks.py): turns a record's ``flame`` weights
    # into frames; the file a span's ``tokentrace.gpu.flame`` command reads (spans or
    # capture); span id -> its flame (JSON form) for the JSONL exporter, when one runs
    flame_resolver: Any = None
    flame_source: str | None = None
    flames: dict[int, Any] | None = None

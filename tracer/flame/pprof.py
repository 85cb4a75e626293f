"""Flame stacks as a pprof profile (``profile.proto``, gzipped): what ``go tool pprof``,
Parca, Pyroscope and Grafana read.

The message types are declared here from the documented format
(github.com/google/pprof, ``proto/profile.proto``: Profile, ValueType, Sample, Label,
Mapping, Location, Line, Function) and encoded by the protobuf runtime; no generated
code. Three sample types: ``launches``/``count`` (GPU calls), ``gpu_time``/
``nanoseconds`` and ``samples``/``count``; launches is the default. pprof values are
integers, so a stack's fractional share of a shared step is rounded, by largest
remainder so that the total stays the whole's. Each frame is a Location with one Line;
Python frames carry their file and line, native ones their library as the file, the
kernel its name. A ``kernel`` label on each sample names what it launched.
"""

from __future__ import annotations

import gzip
import time
from functools import lru_cache
from typing import Any, Iterable

from tracer.flame.model import Frame, Stack, merge

_I64, _U64, _BOOL, _STR = 3, 4, 8, 9  # FieldDescriptorProto.Type
_OPT, _REP = 1, 3  # FieldDescriptorProto.Label
SAMPLE_TYPES = (("launches", "count"), ("gpu_time", "nanoseconds"), ("samples", "count"))

# (message, [(field, number, type or message, repeated)])
_SCHEMA: list[tuple[str, list[tuple[str, int, Any, bool]]]] = [
    ("Profile", [("sample_type", 1, "ValueType", True), ("sample", 2, "Sample", True),
                 ("mapping", 3, "Mapping", True), ("location", 4, "Location", True),
                 ("function", 5, "Function", True), ("string_table", 6, _STR, True),
                 ("drop_frames", 7, _I64, False), ("keep_frames", 8, _I64, False),
                 ("time_nanos", 9, _I64, False), ("duration_nanos", 10, _I64, False),
                 ("period_type", 11, "ValueType", False), ("period", 12, _I64, False),
                 ("comment", 13, _I64, True), ("default_sample_type", 14, _I64, False)]),
    ("ValueType", [("type", 1, _I64, False), ("unit", 2, _I64, False)]),
    ("Sample", [("location_id", 1, _U64, True), ("value", 2, _I64, True),
                ("label", 3, "Label", True)]),
    ("Label", [("key", 1, _I64, False), ("str", 2, _I64, False), ("num", 3, _I64, False),
               ("num_unit", 4, _I64, False)]),
    ("Mapping", [("id", 1, _U64, False), ("memory_start", 2, _U64, False),
                 ("memory_limit", 3, _U64, False), ("file_offset", 4, _U64, False),
                 ("filename", 5, _I64, False), ("build_id", 6, _I64, False),
                 ("has_functions", 7, _BOOL, False), ("has_filenames", 8, _BOOL, False),
                 ("has_line_numbers", 9, _BOOL, False),
                 ("has_inline_frames", 10, _BOOL, False)]),
    ("Location", [("id", 1, _U64, False), ("mapping_id", 2, _U64, False),
                  ("address", 3, _U64, False), ("line", 4, "Line", True),
                  ("is_folded", 5, _BOOL, False)]),
    ("Line", [("function_id", 1, _U64, False), ("line", 2, _I64, False),
              ("column", 3, _I64, False)]),
    ("Function", [("id", 1, _U64, False), ("name", 2, _I64, False),
                  ("system_name", 3, _I64, False), ("filename", 4, _I64, False),
                  ("start_line", 5, _I64, False)]),
]
PACKAGE = "perftools.profiles"


@lru_cache(maxsize=1)
def message_classes() -> dict[str, Any]:
    """The profile.proto message classes, built from ``_SCHEMA``."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(name="tokentrace/pprof_profile.proto",
                                             package=PACKAGE, syntax="proto3")
    for name, fields in _SCHEMA:
        msg = fdp.message_type.add(name=name)
        for fname, number, typ, repeated in fields:
            f = msg.field.add(name=fname, number=number, label=_REP if repeated else _OPT)
            if isinstance(typ, str):
                f.type = 11  # TYPE_MESSAGE
                f.type_name = f".{PACKAGE}.{typ}"
            else:
                f.type = typ
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(
        f"{PACKAGE}.{name}")) for name, _ in _SCHEMA}


def _rounded(values: list[float]) -> list[int]:
    """Integers that add up to round(sum), each within 1 of its value."""
    floors = [int(v // 1) for v in values]
    left = int(round(sum(values))) - sum(floors)
    order = sorted(range(len(values)), key=lambda i: -(values[i] - floors[i]))
    for i in order[:max(0, left)]:
        floors[i] += 1
    return floors


def encode(stacks: Iterable[Stack], comment: str = "") -> bytes:
    """The gzipped profile of ``stacks``."""
    cls = message_classes()
    prof = cls["Profile"]()
    strings: dict[str, int] = {}

    def s(text: str) -> int:
        i = strings.get(text)
        if i is None:
            i = strings[text] = len(strings)
            prof.string_table.append(text)
        return i

    s("")
    for typ, unit in SAMPLE_TYPES:
        prof.sample_type.add(type=s(typ), unit=s(unit))
    prof.period_type.type = s("launches")
    prof.period_type.unit = s("count")
    prof.period = 1
    prof.default_sample_type = s("launches")
    prof.time_nanos = time.time_ns()
    if comment:
        prof.comment.append(s(comment))
    functions: dict[tuple[str, str], int] = {}
    locations: dict[Frame, int] = {}

    def location(f: Frame) -> int:
        loc = locations.get(f)
        if loc is not None:
            return loc
        kind, name, file, line = f
        fkey = (name, file)
        fid = functions.get(fkey)
        if fid is None:
            fid = functions[fkey] = len(functions) + 1
            prof.function.add(id=fid, name=s(name), system_name=s(name), filename=s(file))
        loc = locations[f] = len(locations) + 1
        prof.location.add(id=loc, line=[cls["Line"](function_id=fid, line=line)])
        return loc

    rows = [st for st in merge(stacks) if st[1] > 0 or st[2] > 0 or st[3] > 0]
    cols = [_rounded([st[i] for st in rows]) for i in (1, 2, 3)]
    kernel_key = s("kernel")
    for j, st in enumerate(rows):
        ids = [location(f) for f in reversed(st[0])]  # leaf first
        values = [cols[0][j], cols[1][j], cols[2][j]]
        if not any(values):
            continue
        prof.sample.add(location_id=ids, value=values,
                        label=[cls["Label"](key=kernel_key, str=s(st[0][-1][1]))])
    return gzip.compress(prof.SerializeToString(), mtime=0)


def decode(data: bytes) -> Any:
    """A gzipped (or plain) profile read back (tests, and ``tokentrace flame`` checks)."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    prof = message_classes()["Profile"]()
    prof.ParseFromString(data)
    return prof

"""Ground-truth JSON lines, appended whole by any number of processes.

Each line is one ``os.write`` on a file opened with ``O_APPEND``, so lines written by
the API process and the engine processes never interleave.
"""

from __future__ import annotations

import json
import os
from typing import Any


class TruthFile:
    """An append-only JSON-lines file; ``None`` as the path writes nothing."""

    def __init__(self, path: str | None) -> None:
        self.fd = (os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                   if path else -1)

    def write(self, doc: dict[str, Any]) -> None:
        """One record, one line, one write."""
        if self.fd < 0:
            return
        line = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
        n = os.write(self.fd, line)
        if n != len(line):  # a regular file takes the whole line or fails
            raise OSError(f"short write to the truth file: {n} of {len(line)} bytes")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a truth file, in the order written."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]

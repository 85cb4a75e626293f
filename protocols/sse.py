"""Server-sent events (text/event-stream), sans-I/O.

Feed body bytes as they were written, with their timestamp; get back each complete
event with the timestamp of the write that completed it. Lines may end in CRLF, LF or
CR, and an event or even a line may be split across any number of writes.
"""

from __future__ import annotations

from typing import NamedTuple

# An event (its unfinished line plus the data lines held until the blank line that ends
# it) larger than this is dropped, not buffered; LLM stream events are a few hundred bytes.
MAX_PENDING = 1024 * 1024


class ServerSentEvent(NamedTuple):
    """One event: ``data`` is its data lines joined by newlines."""

    ts: int
    data: str
    event: str = ""
    id: str = ""


class SSEParser:
    """One event stream; ``oversized`` counts events dropped for ``MAX_PENDING``."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._data: list[str] = []
        self._held = 0  # bytes in _data
        self._event = ""
        self._id = ""
        self._pending_cr = False
        self._dropping = False  # inside an event dropped for its size
        self.oversized = 0

    @property
    def buffered(self) -> int:
        """Bytes held: an unfinished line and the data lines of an unfinished event."""
        return len(self._buf) + self._held

    def feed(self, chunk: bytes, ts: int) -> list[ServerSentEvent]:
        if not (self._buf or self._data or self._pending_cr or self._dropping):
            ev = self._one_data_event(chunk, ts)
            if ev is not None:
                return [ev]
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the LF of a CRLF split across writes
        self._pending_cr = False
        self._buf += chunk
        out: list[ServerSentEvent] = []
        start = 0
        buf = self._buf
        n = len(buf)
        while start < n:
            lf = buf.find(b"\n", start)
            cr = buf.find(b"\r", start)
            if lf < 0 and cr < 0:
                break
            if cr >= 0 and (lf < 0 or cr < lf):
                end, nxt = cr, cr + 1
                if nxt < n and buf[nxt] == 0x0A:
                    nxt += 1
                elif nxt == n:
                    self._pending_cr = True
            else:
                end, nxt = lf, lf + 1
            self._line(bytes(buf[start:end]), ts, out)
            start = nxt
        del buf[:start]
        if len(buf) + self._held > MAX_PENDING:
            # drop the event so far; its remaining lines are dropped up to its end
            buf.clear()
            self._drop()
        return out

    def _one_data_event(self, chunk: bytes, ts: int) -> ServerSentEvent | None:
        """The event of ``chunk`` when it is exactly one ``data:`` line and the blank
        line that ends it (how LLM servers write each token), taken without the line
        loop: the same event the loop would give (None: not that shape). Only called
        between events: nothing buffered, no data line held."""
        if chunk.endswith(b"\n\n"):
            line = chunk[:-2]
        elif chunk.endswith(b"\r\n\r\n"):
            line = chunk[:-4]
        else:
            return None
        if (not line.startswith(b"data:") or b"\n" in line or b"\r" in line
                or len(line) > MAX_PENDING):
            return None
        value = line[6:] if line[5:6] == b" " else line[5:]
        ev = ServerSentEvent(ts, value.decode("utf-8", "replace"), self._event, self._id)
        self._event = ""
        return ev

    def _drop(self) -> None:
        self._data.clear()
        self._held = 0
        self._dropping = True
        self.oversized += 1

    def _line(self, line: bytes, ts: int, out: list[ServerSentEvent]) -> None:
        if not line:
            if self._data and not self._dropping:
                out.append(ServerSentEvent(ts, "\n".join(self._data), self._event, self._id))
            self._data = []
            self._held = 0
            self._dropping = False
            self._event = ""
            return
        if self._dropping:
            return
        if line.startswith(b":"):
            return  # comment / keep-alive
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        text = value.decode("utf-8", "replace")
        if name == b"data":
            self._data.append(text)
            self._held += len(line)
            if self._held > MAX_PENDING:
                self._drop()
        elif name == b"event":
            self._event = text
        elif name == b"id":
            self._id = text

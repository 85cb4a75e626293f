"""Real HTTP/2 bytes for the observer tests: two hyper-h2 endpoints talking to each
other in memory, every byte each one sends recorded in order as (from_client, bytes)."""

from __future__ import annotations

import struct
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings


class Wire:
    """A client and a server connection; ``chunks`` is what went over the wire."""

    def __init__(self, client_settings: dict[int, int] | None = None,
                 server_settings: dict[int, int] | None = None) -> None:
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=True, header_encoding=None))
        self.server = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None))
        self.client.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1000,
                                         **(client_settings or {})})
        self.server.local_settings = h2.settings.Settings(
            client=False, initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1000,
                                          **(server_settings or {})})
        self.chunks: list[tuple[bool, bytes]] = []
        self.server_events: list[Any] = []
        self.client.initiate_connection()
        self.server.initiate_connection()
        self.pump()

    def pump(self) -> None:
        """Move bytes both ways until both sides are quiet."""
        while True:
            moved = False
            data = self.client.data_to_send()
            if data:
                self.chunks.append((True, data))
                events = self.server.receive_data(data)
                self.server_events += events
                self._ack(self.server, events)
                moved = True
            data = self.server.data_to_send()
            if data:
                self.chunks.append((False, data))
                self._ack(self.client, self.client.receive_data(data))
                moved = True
            if not moved:
                return

    @staticmethod
    def _ack(conn: h2.connection.H2Connection, events: list[Any]) -> None:
        """Give flow-control credit back, as a reading application does."""
        for e in events:
            if isinstance(e, h2.events.DataReceived) and e.flow_controlled_length:
                try:
                    conn.acknowledge_received_data(e.flow_controlled_length, e.stream_id)
                except h2.exceptions.StreamClosedError:
                    pass

    def request(self, path: str, extra: list[tuple[str, str]] = (), body: bytes = b"",
                grpc: bool = True, end: bool = True) -> int:
        sid = self.client.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
                   (":authority", "localhost")]
        if grpc:
            headers += [("content-type", "application/grpc"), ("te", "trailers")]
        headers += list(extra)
        self.client.send_headers(sid, [(k.encode(), v.encode()) for k, v in headers],
                                 end_stream=end and not body)
        if body:
            self.client.send_data(sid, body, end_stream=end)
        self.pump()
        return sid

    def respond(self, sid: int, messages: list[bytes] = (), status: int = 0,
                message: str | None = None, trailers_only: bool = False,
                extra: list[tuple[str, str]] = ()) -> None:
        if trailers_only:
            hdrs = [(":status", "200"), ("content-type", "application/grpc"),
                    ("grpc-status", str(status))] + ([("grpc-message", message)] if message else [])
            self.server.send_headers(sid, [(k.encode(), v.encode()) for k, v in hdrs],
                                     end_stream=True)
            self.pump()
            return
        self.server.send_headers(sid, [(b":status", b"200"),
                                       (b"content-type", b"application/grpc")]
                                 + [(k.encode(), v.encode()) for k, v in extra])
        for m in messages:
            self.server.send_data(sid, m)
            self.pump()
        tr = [(b"grpc-status", str(status).encode())]
        if message:
            tr.append((b"grpc-message", message.encode()))
        self.server.send_headers(sid, tr, end_stream=True)
        self.pump()

    def client_bytes(self) -> bytes:
        return b"".join(d for c, d in self.chunks if c)

    def server_bytes(self) -> bytes:
        return b"".join(d for c, d in self.chunks if not c)


def grpc_message(payload: bytes, compressed: bool = False) -> bytes:
    """A length-prefixed gRPC message."""
    return struct.pack(">BI", int(compressed), len(payload)) + payload


def frame(ftype: int, flags: int, sid: int, payload: bytes) -> bytes:
    """One raw HTTP/2 frame."""
    return struct.pack(">BHBBI", len(payload) >> 16, len(payload) & 0xFFFF, ftype, flags,
                       sid) + payload

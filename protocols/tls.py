"""TLS records on the wire: recognising them, and reading the cleartext handshake.

The ClientHello and ServerHello travel in the clear in every TLS version (TLS 1.3
encrypts what follows the ServerHello). From them come what a span says about the
session: the protocol version the server chose (the ``supported_versions`` extension
in TLS 1.3, the legacy field before), the cipher suite, the server name the client asked
for (SNI) and, up to TLS 1.2, the application protocol agreed (ALPN; TLS 1.3 sends it
encrypted). Nothing else of a TLS stream is readable without the library's help.

Sans-I/O: ``HandshakeReader.receive(data, from_client)`` takes a connection's bytes as
they come, in either direction, and fills ``session``; it stops looking once the
ServerHello is read or a direction passed ``MAX_BYTES`` without it. Malformed input
ends the reading (counted by the caller as it likes), never raises.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

HANDSHAKE = 22
APPLICATION_DATA = 23
RECORD_TYPES = range(20, 25)  # change_cipher_spec, alert, handshake, app data, heartbeat
MAX_RECORD = (1 << 14) + 2048  # the largest TLSCiphertext fragment
MAX_BYTES = 64 * 1024  # bytes of one direction looked at for its hello

VERSIONS = {0x0300: ("ssl", "3.0"), 0x0301: ("tls", "1.0"), 0x0302: ("tls", "1.1"),
            0x0303: ("tls", "1.2"), 0x0304: ("tls", "1.3")}
# IANA names (what OpenTelemetry's tls.cipher takes) of the suites servers pick today
CIPHERS = {
    0x1301: "TLS_AES_128_GCM_SHA256", 0x1302: "TLS_AES_256_GCM_SHA384",
    0x1303: "TLS_CHACHA20_POLY1305_SHA256", 0x1304: "TLS_AES_128_CCM_SHA256",
    0xC02B: "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
    0xC02C: "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
    0xC02F: "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
    0xC030: "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
    0xCCA8: "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
    0xCCA9: "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
    0x009C: "TLS_RSA_WITH_AES_128_GCM_SHA256", 0x009D: "TLS_RSA_WITH_AES_256_GCM_SHA384",
}
EXT_SERVER_NAME, EXT_ALPN, EXT_SUPPORTED_VERSIONS = 0, 16, 43


def looks_like_record(data: bytes) -> bool:
    """Whether ``data`` starts with a TLS record header: a known content type, protocol
    major version 3, a length a record can have."""
    if len(data) < 5 or data[0] not in RECORD_TYPES or data[1] != 3 or data[2] > 4:
        return False
    n = (data[3] << 8) | data[4]
    return 0 < n <= MAX_RECORD


@dataclass
class TlsSession:
    """What the cleartext handshake said (None: not seen)."""

    protocol: str = "tls"  # "tls", or "ssl" for SSL 3.0
    version: str | None = None  # "1.2", "1.3"
    cipher: str | None = None  # IANA name, when a known suite
    cipher_suite: int | None = None
    server_name: str | None = None  # SNI
    alpn: str | None = None  # negotiated (TLS 1.2 and older: in the ServerHello)


class _Direction:
    def __init__(self) -> None:
        self.buf = bytearray()  # bytes of the current record
        self.hs = bytearray()  # handshake message bytes, across records
        self.seen = 0
        self.done = False


class HandshakeReader:
    """One connection's hellos in, ``session`` out."""

    def __init__(self) -> None:
        self.session = TlsSession()
        self.client_hello = False
        self.server_hello = False
        self.malformed = False
        self._dirs = {True: _Direction(), False: _Direction()}

    @property
    def done(self) -> bool:
        return self.server_hello or self.malformed or all(d.done for d in self._dirs.values())

    def receive(self, data: bytes, from_client: bool) -> None:
        d = self._dirs[from_client]
        if d.done or self.done:
            return
        d.seen += len(data)
        if d.seen > MAX_BYTES:
            d.done = True
            return
        d.buf += data
        while len(d.buf) >= 5 and not d.done:
            if not looks_like_record(bytes(d.buf[:5])):
                self.malformed = True
                return
            n = (d.buf[3] << 8) | d.buf[4]
            if len(d.buf) < 5 + n:
                return
            ctype, body = d.buf[0], bytes(d.buf[5:5 + n])
            del d.buf[:5 + n]
            if ctype != HANDSHAKE:
                d.done = True  # the hello comes first, in handshake records
                return
            d.hs += body
            self._messages(d, from_client)

    def _messages(self, d: _Direction, from_client: bool) -> None:
        while len(d.hs) >= 4 and not d.done:
            mtype = d.hs[0]
            n = int.from_bytes(d.hs[1:4], "big")
            if n > MAX_BYTES:
                self.malformed = True
                return
            if len(d.hs) < 4 + n:
                return
            body = bytes(d.hs[4:4 + n])
            del d.hs[:4 + n]
            try:
                if mtype == 1 and from_client:
                    self._client_hello(body)
                elif mtype == 2 and not from_client:
                    self._server_hello(body)
            except (IndexError, struct.error, UnicodeDecodeError, ValueError):
                self.malformed = True
                return
            d.done = True  # only the first message of each side is wanted

    def _client_hello(self, b: bytes) -> None:
        p = 2 + 32  # legacy_version, random
        p += 1 + b[p]  # session id
        p += 2 + struct.unpack_from(">H", b, p)[0]  # cipher suites
        p += 1 + b[p]  # compression methods
        for ext, data in _extensions(b, p):
            if ext == EXT_SERVER_NAME and len(data) >= 5 and data[2] == 0:
                n = struct.unpack_from(">H", data, 3)[0]
                self.session.server_name = data[5:5 + n].decode("ascii")
        self.client_hello = True

    def _server_hello(self, b: bytes) -> None:
        version = struct.unpack_from(">H", b, 0)[0]
        p = 2 + 32
        p += 1 + b[p]  # session id
        suite = struct.unpack_from(">H", b, p)[0]
        p += 2 + 1  # cipher suite, compression method
        alpn = None
        for ext, data in _extensions(b, p):
            if ext == EXT_SUPPORTED_VERSIONS and len(data) == 2:
                version = struct.unpack_from(">H", data, 0)[0]
            elif ext == EXT_ALPN and len(data) >= 3:
                alpn = data[3:3 + data[2]].decode("ascii")
        name = VERSIONS.get(version)
        if name is not None:
            self.session.protocol, self.session.version = name
        self.session.cipher_suite = suite
        self.session.cipher = CIPHERS.get(suite)
        self.session.alpn = alpn
        self.server_hello = True


def _extensions(b: bytes, p: int) -> list[tuple[int, bytes]]:
    """(type, data) of each extension of a hello whose extensions start at ``p``."""
    if p + 2 > len(b):
        return []
    end = p + 2 + struct.unpack_from(">H", b, p)[0]
    if end > len(b):
        raise ValueError("extensions run past the message")
    p += 2
    out = []
    while p + 4 <= end:
        ext, n = struct.unpack_from(">HH", b, p)
        if p + 4 + n > end:
            raise ValueError("an extension runs past the extensions")
        out.append((ext, b[p + 4:p + 4 + n]))
        p += 4 + n
    return out

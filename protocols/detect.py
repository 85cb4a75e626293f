"""Guess a connection's protocol from the first bytes a peer sent."""

from __future__ import annotations

from protocols.http1 import REQUEST_LINE, looks_like_request, looks_like_response

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

HTTP1_REQUEST = "http1-request"
HTTP1_RESPONSE = "http1-response"
HTTP2_PREFACE = "http2-preface"
TLS = "tls"
UNKNOWN = "unknown"
NEED_MORE = "need-more"


def sniff(data: bytes) -> str:
    """What the first bytes of a stream look like (``NEED_MORE`` if too few to say)."""
    if not data:
        return NEED_MORE
    if data.startswith(H2_PREFACE[: len(data)]):
        return HTTP2_PREFACE if len(data) >= len(H2_PREFACE) else NEED_MORE
    if looks_like_request(data):
        return HTTP1_REQUEST
    if looks_like_response(data):
        return HTTP1_RESPONSE
    if len(data) >= 3 and data[0] == 0x16 and data[1] == 0x03:
        return TLS
    if len(data) < 8 and any(m.startswith(data) for m in (b"GET ", b"POST ", b"HTTP/1.")):
        return NEED_MORE
    return UNKNOWN


def find_request_line(data: bytes) -> int:
    """Offset of the first HTTP/1 request line in ``data``, or -1."""
    m = REQUEST_LINE.search(data)
    return m.start() if m else -1

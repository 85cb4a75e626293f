"""The OpenAI-compatible API on top of HTTP, sans-I/O.

``operation_for`` recognises the endpoints (``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``, and the same paths under a prefix such as
Azure's ``/openai/deployments/<name>``). ``parse_request`` reads the request JSON.
``ResponseFollower`` follows the response body, streamed (SSE) or not, and yields
token timing and counts:

- the first chunk: the first SSE event of a stream, or the first body bytes;
- the first token: the first chunk that carries generated text (a chunk with only
  the role, or an empty delta, is not a token);
- output tokens: ``usage`` when the server sends it (including the final usage chunk
  of ``stream_options.include_usage``), else one per choice per chunk with text.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from protocols import sse as sse_mod
from protocols.sse import SSEParser

MAX_BODY = 8 * 1024 * 1024  # request/response JSON kept for parsing, per message
MAX_INFLATED = 64 * 1024 * 1024  # bytes a compressed response may inflate to, in all
INFLATE_STEP = 256 * 1024  # inflated at a time, so a small bomb never lands at once
MAX_TOKEN_TS = 8192  # text-carrying chunk times kept per response (the rest: counted)
MAX_COUNT = (1 << 63) - 1  # counts beyond int64 are not counts (and OTLP cannot carry them)
MAX_ERROR_TEXT = 512
MAX_NAME = 256  # model names and ids longer than this are cut
MAX_FINISH_REASONS = 64

_ENDPOINTS = (
    ("/chat/completions", "chat"),
    ("/completions", "text_completion"),
    ("/embeddings", "embeddings"),
)


def operation_for(method: str, target: str) -> str | None:
    """The GenAI operation name for an OpenAI-style endpoint, else None."""
    if method != "POST":
        return None
    path = target.split("?", 1)[0].rstrip("/")
    for suffix, op in _ENDPOINTS:
        if path.endswith(suffix):
            return op
    return None


@dataclass
class LLMRequest:
    """What the request body says (fields absent from the body stay None)."""

    operation: str
    model: str | None = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    prompt: str | None = None  # kept only when the caller asks for content
    # the prompt's size, always (no text kept): characters of its text, or the number
    # of token ids when the prompt is given as ids
    prompt_chars: int | None = None
    prompt_token_ids: int | None = None
    parsed: bool = False  # the JSON body was complete and valid
    error: str | None = None


_MODEL_RE = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.){0,256})"')
_STREAM_RE = re.compile(rb'"stream"\s*:\s*(true|false)')


def loads(data: bytes | str) -> Any:
    """``json.loads`` that fails only with ``ValueError``: also for nesting deeper than
    the interpreter's recursion limit (``RecursionError`` otherwise)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def as_float(v: Any) -> float | None:
    """A finite JSON number as a float, else None (Infinity, NaN, 1e999, booleans,
    strings and ints too large for a float are not numbers here)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def as_count(v: Any) -> int | None:
    """A non-negative whole number (``12`` or ``12.0``) that fits in int64, else None."""
    f = as_float(v)
    if f is None or f < 0 or f != int(f):
        return None
    n = v if isinstance(v, int) else int(f)
    return n if n <= MAX_COUNT else None


def text_of(v: Any, limit: int | None = None) -> str | None:
    """``v`` if it is a string (cut to ``limit``), a number as text, else None: never
    ``str()`` of a container, which recurses into whatever a peer nested."""
    if isinstance(v, str):
        return v if limit is None else v[:limit]
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if isinstance(v, int) and v.bit_length() > 64:
            return None  # str() of a huge int is quadratic (and refused past 4300 digits)
        return str(v)
    return None


def _prompt_text(operation: str, body: dict[str, Any]) -> str | None:
    if operation == "chat":
        msgs = body.get("messages")
        if isinstance(msgs, list):
            parts = []
            for m in msgs:
                if isinstance(m, dict):
                    c = m.get("content")
                    if isinstance(c, list):  # content parts: only their text parts
                        c = " ".join(t for t in (text_of(p.get("text")) for p in c
                                                 if isinstance(p, dict)) if t)
                    parts.append(f"{text_of(m.get('role')) or ''}: {text_of(c) or ''}")
            return "\n".join(parts)
    p = body.get("prompt") if operation == "text_completion" else body.get("input")
    if isinstance(p, list):  # prompts, or token ids (a list of ints, or of lists of ints)
        return "\n".join(_items_text(x) for x in p)
    return p if isinstance(p, str) else None


def _token_ids(operation: str, body: dict[str, Any]) -> int | None:
    """How many token ids a prompt given as ids holds (a list of ints, or of lists of
    ints), else None."""
    p = body.get("prompt") if operation == "text_completion" else body.get("input")
    if not isinstance(p, list) or not p:
        return None
    if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return len(p)
    if all(isinstance(x, list) and all(isinstance(y, int) and not isinstance(y, bool)
                                       for y in x) for x in p):
        return sum(len(x) for x in p)
    return None


def _prompt_size(operation: str, body: dict[str, Any]) -> int | None:
    """Characters of the prompt's text (message contents, without roles)."""
    if operation == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return None
        n = 0
        for m in msgs:
            if isinstance(m, dict):
                c = m.get("content")
                if isinstance(c, list):
                    n += sum(len(t) for t in (text_of(p.get("text")) for p in c
                                              if isinstance(p, dict)) if t)
                else:
                    n += len(text_of(c) or "")
        return n
    text = _prompt_text(operation, body)
    return len(text) if text is not None else None


def _items_text(x: Any) -> str:
    if isinstance(x, list):
        return " ".join(t for t in (text_of(y) for y in x) if t is not None)
    return text_of(x) or ""


def parse_request(operation: str, body: bytes, complete: bool, keep_prompt: bool = False
                  ) -> LLMRequest:
    """Read an OpenAI request body. A truncated body still yields model and stream
    when they can be found in the bytes that were seen."""
    req = LLMRequest(operation=operation)
    try:
        doc = loads(body) if complete else None
    except ValueError as e:  # UnicodeDecodeError is one
        doc = None
        req.error = f"request body is not JSON: {e}"
    if isinstance(doc, dict):
        req.parsed = True
        model = doc.get("model")
        req.model = model[:MAX_NAME] if isinstance(model, str) else None
        req.stream = doc.get("stream") is True
        so = doc.get("stream_options")
        req.include_usage = isinstance(so, dict) and so.get("include_usage") is True
        req.max_tokens = as_count(doc.get("max_completion_tokens", doc.get("max_tokens")))
        req.temperature = as_float(doc.get("temperature"))
        req.top_p = as_float(doc.get("top_p"))
        req.n = as_count(doc.get("n"))
        req.prompt_token_ids = _token_ids(operation, doc)
        if req.prompt_token_ids is None:
            req.prompt_chars = _prompt_size(operation, doc)
        if keep_prompt:
            req.prompt = _prompt_text(operation, doc)
        return req
    # Salvage from a partial body: enough to name the span and the stream mode.
    m = _MODEL_RE.search(body)
    if m:
        try:
            req.model = json.loads(b'"' + m.group(1) + b'"')
        except ValueError:
            pass
    s = _STREAM_RE.search(body)
    req.stream = bool(s and s.group(1) == b"true")
    if req.error is None and not complete:
        req.error = "request body incomplete"
    return req


@dataclass
class LLMResponse:
    """What the response says, and when."""

    status: int = 0
    streamed: bool = False
    model: str | None = None
    response_id: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    input_tokens: int | None = None
    output_tokens: int | None = None
    usage_source: str | None = None  # "usage" or "stream_chunks"
    first_chunk_ts: int | None = None
    first_token_ts: int | None = None
    token_ts: list[int] = field(default_factory=list)  # chunks that carried text
    token_ts_dropped: int = 0  # text chunks past MAX_TOKEN_TS, not timed
    chunks: int = 0
    text_chunks: int = 0
    done_marker: bool = False  # a stream ended with data: [DONE]
    text: str | None = None  # kept only when the caller asks for content
    error_type: str | None = None
    error_message: str | None = None
    parse_errors: int = 0
    body_truncated: bool = False

    def tokens_at(self, times: list[int]) -> None:
        """``token_at`` each of ``times``, in order."""
        if not times:
            return
        if self.first_token_ts is None:
            self.first_token_ts = times[0]
        room = max(0, MAX_TOKEN_TS - len(self.token_ts))
        self.token_ts.extend(times[:room])
        self.token_ts_dropped += max(0, len(times) - room)

    def token_at(self, ts: int) -> None:
        """A chunk carrying generated text was seen at ``ts``."""
        if self.first_token_ts is None:
            self.first_token_ts = ts
        if len(self.token_ts) < MAX_TOKEN_TS:
            self.token_ts.append(ts)
        else:
            self.token_ts_dropped += 1


def _has_text_delta(delta: Any) -> bool:
    if not isinstance(delta, dict):
        return False
    for key in ("content", "reasoning_content", "reasoning", "refusal"):
        v = delta.get(key)
        if isinstance(v, str) and v:
            return True
    return bool(delta.get("tool_calls")) or bool(delta.get("function_call"))


def _choice_text(operation: str, choice: dict[str, Any], streamed: bool) -> str:
    if operation == "text_completion":
        t = choice.get("text")
        return t if isinstance(t, str) else ""
    msg = choice.get("delta" if streamed else "message")
    if not isinstance(msg, dict):
        return ""
    parts = [msg.get(k) for k in ("reasoning_content", "reasoning", "content", "refusal")]
    return "".join(p for p in parts if isinstance(p, str))


# A JSON string literal as Python's json module reads it (strict: no raw control
# characters; \\u escapes with any four hex digits, lone surrogates included).
_JSON_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"')
# The same on UTF-8 bytes: a byte string matches iff its decoding (invalid bytes
# replaced) matches the one above (every byte >= 0x80 is a character either way).
_JSON_STRING_BYTES = re.compile(rb'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"')
_TEXT_KEYS = {"chat": '"content"', "text_completion": '"text"'}
MAX_TEMPLATE_TRIES = 4  # chunks a response may spend on templates that did not fit


class ChunkTemplate:
    """A stream's token chunks, minus their text: ``prefix`` + a JSON string + ``suffix``.

    LLM servers write every token of a stream as the same JSON document with a
    different text (``choices[0].delta.content``, or ``choices[0].text`` for
    completions): same id, model, created time. Such a chunk is read here by comparing
    the text's surroundings with a chunk already parsed, and checking that what sits
    between them is one JSON string; json.loads of the whole chunk would give the same
    document with that string as its text, so the chunk counts exactly as a parsed one
    would (a token when the string is not empty). Built only from a chunk whose every
    other part is inert (one choice, no finish reason, no usage, no error, no other
    text-carrying field), and proven on it: the document with another string spliced in
    must parse to the same document with that text."""

    __slots__ = ("prefix", "suffix", "min_len", "event_head", "event_tail")

    def __init__(self, prefix: str, suffix: str) -> None:
        self.prefix = prefix
        self.suffix = suffix
        self.min_len = len(prefix) + len(suffix) + 2
        # the SSE event's bytes around the text (``ResponseFollower.sse_write``); None
        # where a line break in the template would make the event more than one line
        one_line = not any(ch in prefix + suffix for ch in "\r\n")
        self.event_head = b"data: " + prefix.encode() if one_line else None
        self.event_tail = suffix.encode() + b"\n\n" if one_line else None

    def text_of(self, data: str) -> str | None:
        """The JSON string literal that ``data`` carries as its text, or None if
        ``data`` is not this template's document."""
        if (len(data) < self.min_len or not data.startswith(self.prefix)
                or not data.endswith(self.suffix)):
            return None
        lit = data[len(self.prefix):len(data) - len(self.suffix)]
        return lit if _JSON_STRING.fullmatch(lit) else None

    @classmethod
    def build(cls, operation: str, data: str, doc: dict[str, Any]) -> "ChunkTemplate | None":
        """The template of chunk ``data`` (parsed: ``doc``), or None if it cannot be one."""
        key = _TEXT_KEYS.get(operation)
        if key is None or doc.get("usage") is not None or doc.get("error") is not None:
            return None
        choices = doc.get("choices")
        if not (isinstance(choices, list) and len(choices) == 1
                and isinstance(choices[0], dict) and choices[0].get("finish_reason") is None):
            return None
        holder = choices[0].get("delta") if operation == "chat" else choices[0]
        if not isinstance(holder, dict) or not isinstance(holder.get(key[1:-1]), str):
            return None
        if operation == "chat" and _has_text_delta({**holder, "content": ""}):
            return None  # text-carrying parts besides the content
        at = data.find(key)
        if at < 0 or data.find(key, at + 1) >= 0:
            return None  # not exactly one place the text can be
        colon = at + len(key)
        while colon < len(data) and data[colon] in " \t\r\n":
            colon += 1
        if colon >= len(data) or data[colon] != ":":
            return None
        start = colon + 1
        while start < len(data) and data[start] in " \t\r\n":
            start += 1
        m = _JSON_STRING.match(data, start)
        if m is None:
            return None
        tmpl = cls(data[:start], data[m.end():])
        probe = '"\\u0078y"'  # "xy": any other string would do
        try:
            spliced = loads(tmpl.prefix + probe + tmpl.suffix)
        except ValueError:
            return None
        expected = json.loads(json.dumps(doc))  # a copy to splice into
        target = expected["choices"][0]
        (target["delta"] if operation == "chat" else target)[key[1:-1]] = "xy"
        return tmpl if spliced == expected else None


class ResponseFollower:
    """Follows one response body of an OpenAI-style endpoint."""

    def __init__(self, operation: str, keep_text: bool = False) -> None:
        """``keep_text``: keep the completion and any error text the server wrote (it
        can echo the prompt); off, neither is kept."""
        self.operation = operation
        self.keep_text = keep_text
        self.r = LLMResponse()
        self._sse: SSEParser | None = None
        self._body = bytearray()
        self._first_body_ts: int | None = None
        self._texts: list[str] = []
        self._decomp: Any = None
        self._inflated = 0
        self._template: ChunkTemplate | None = None
        self._template_tries = 0

    @property
    def buffered(self) -> int:
        """Bytes held for parsing: the JSON body so far, or the SSE parser's."""
        return len(self._body) + (self._sse.buffered if self._sse is not None else 0)

    def head(self, ts: int, status: int, headers: dict[str, str]) -> None:
        self.r.status = status
        ctype = headers.get("content-type", "")
        if "text/event-stream" in ctype:
            self.r.streamed = True
            self._sse = SSEParser()
        enc = headers.get("content-encoding", "").strip().lower()
        if enc in ("gzip", "deflate"):
            self._decomp = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header

    def data(self, ts: int, chunk: bytes) -> None:
        """Body bytes as the server wrote them (still compressed, if it compressed)."""
        if self._decomp is None:
            self._plain(ts, chunk)
            return
        while chunk:
            # bounded steps: what a few KiB inflate to is never held at once
            try:
                out = self._decomp.decompress(chunk, INFLATE_STEP)
            except zlib.error:
                self.r.parse_errors += 1
                self._decomp = None
                return
            self._inflated += len(out)
            if self._inflated > MAX_INFLATED:
                self.r.body_truncated = True
                self._decomp = None
                return
            self._plain(ts, out)
            chunk = self._decomp.unconsumed_tail
            if self._decomp.eof:
                return

    def sse_write(self, ts: int, chunk: bytes) -> bool:
        """The common case of ``data``, in one step: a streamed response's write that is
        one whole SSE event (``SSEParser._one_data_event``) carrying a token chunk like
        the last one parsed (``ChunkTemplate``), between events. True: taken, with the
        same effects as ``data``; False: nothing done, call ``data``."""
        sse = self._sse
        t = self._template
        if (t is None or sse is None or self._decomp is not None or sse._buf or sse._data
                or sse._pending_cr or sse._dropping):
            return False
        head, tail = t.event_head, t.event_tail
        if head is not None and tail is not None:
            # the template's bytes around one JSON string, read in place (no copy, no
            # decoding): where they match, the decoded event matches the checks below
            lo, hi = len(head), len(chunk) - len(tail)
            if (hi - lo >= 2 and len(chunk) - 2 <= sse_mod.MAX_PENDING
                    and chunk.startswith(head) and chunk.endswith(tail)
                    and _JSON_STRING_BYTES.fullmatch(chunk, lo, hi) is not None):
                sse._event = ""  # what ending the event does
                r = self.r
                r.chunks += 1
                if hi - lo != 2:  # a two-byte JSON string is ""
                    r.text_chunks += 1
                    r.token_at(ts)
                return True
        if not chunk.endswith(b"\n\n") or not chunk.startswith(b"data: "):
            return False
        line = chunk[6:-2]
        if b"\n" in line or b"\r" in line or len(chunk) - 2 > sse_mod.MAX_PENDING:
            return False
        lit = t.text_of(line.decode("utf-8", "replace"))
        if lit is None:
            return False
        sse._event = ""  # what ending the event does
        r = self.r
        r.chunks += 1
        if lit != '""':
            r.text_chunks += 1
            r.token_at(ts)
        return True

    def template_events(self, head: bytes, tail: bytes, ts: list[int] | tuple[int, ...],
                        texts: list[bool]) -> bool:
        """Events known to be ``head`` + one JSON string + ``tail`` each, without their
        bytes (the kernel compared them: tracer/events/runs.py), ``texts[i]`` whether
        the i-th string was not empty: ``sse_write`` of each, when ``head`` and
        ``tail`` are this stream's template. True: taken; False: nothing done."""
        sse = self._sse
        t = self._template
        if (t is None or sse is None or self._decomp is not None or sse._buf or sse._data
                or sse._pending_cr or sse._dropping or t.event_head != head
                or t.event_tail != tail):
            return False
        sse._event = ""
        r = self.r
        r.chunks += len(texts)
        at = [t for t, text in zip(ts, texts) if text]
        r.text_chunks += len(at)
        r.tokens_at(at)
        return True

    @property
    def template_bytes(self) -> tuple[bytes, bytes] | None:
        """The SSE bytes around the text of this stream's token chunks, once known:
        what the kernel may be armed with (tracer/events/runs.py)."""
        t = self._template
        if t is None or t.event_head is None or t.event_tail is None or self.keep_text:
            return None
        return t.event_head, t.event_tail

    def _plain(self, ts: int, chunk: bytes) -> None:
        if not chunk:
            return
        if self._first_body_ts is None:
            self._first_body_ts = ts
        if self._sse is not None:
            for ev in self._sse.feed(chunk, ts):
                self._sse_event(ev.ts, ev.data)
        elif len(self._body) + len(chunk) <= MAX_BODY:
            self._body += chunk
        else:
            self.r.body_truncated = True

    def _sse_event(self, ts: int, data: str) -> None:
        t = self._template
        if t is not None:
            lit = t.text_of(data)
            if lit is not None:  # a token chunk like the last one parsed (ChunkTemplate)
                r = self.r
                r.chunks += 1
                if lit != '""':
                    r.text_chunks += 1
                    r.token_at(ts)
                return
        if data.strip() == "[DONE]":
            self.r.done_marker = True
            return
        self.r.chunks += 1
        if self.r.first_chunk_ts is None:
            self.r.first_chunk_ts = ts
        try:
            doc = loads(data)
        except ValueError:
            self.r.parse_errors += 1
            return
        if not isinstance(doc, dict):
            return
        if not self.keep_text and self._template_tries < MAX_TEMPLATE_TRIES:
            self._template_tries += 1
            t = ChunkTemplate.build(self.operation, data, doc)
            if t is not None:
                self._template = t
                self._template_tries = 0
        self._common(doc)
        carried = 0
        choices = doc.get("choices")
        if isinstance(choices, list):
            for ch in choices:
                if not isinstance(ch, dict):
                    continue
                has_text = (_has_text_delta(ch.get("delta")) if self.operation == "chat"
                            else bool(ch.get("text")))
                if has_text:
                    carried += 1
                    if self.keep_text:
                        self._texts.append(_choice_text(self.operation, ch, True))
                fr = ch.get("finish_reason")
                if isinstance(fr, str) and len(self.r.finish_reasons) < MAX_FINISH_REASONS:
                    self.r.finish_reasons.append(fr[:MAX_NAME])
        if carried:
            self.r.text_chunks += carried
            self.r.token_at(ts)

    def _common(self, doc: dict[str, Any]) -> None:
        if self.r.model is None and isinstance(doc.get("model"), str):
            self.r.model = doc["model"][:MAX_NAME]
        if self.r.response_id is None and isinstance(doc.get("id"), str):
            self.r.response_id = doc["id"][:MAX_NAME]
        usage = doc.get("usage")
        if isinstance(usage, dict):
            it = as_count(usage.get("prompt_tokens", usage.get("input_tokens")))
            ot = as_count(usage.get("completion_tokens", usage.get("output_tokens")))
            if it is not None:
                self.r.input_tokens = it
            if ot is not None:
                self.r.output_tokens = ot
                self.r.usage_source = "usage"
        err = doc.get("error")
        if isinstance(err, dict):
            self.r.error_type = (text_of(err.get("type"), 64) or text_of(err.get("code"), 64)
                                 or "error")
            if self.keep_text:
                self.r.error_message = text_of(err.get("message"), MAX_ERROR_TEXT) or ""
        elif isinstance(err, str):
            self.r.error_type = "error"
            if self.keep_text:
                self.r.error_message = err[:MAX_ERROR_TEXT]

    def end(self, ts: int) -> LLMResponse:
        """The response is complete: parse a JSON body and settle the counts."""
        r = self.r
        if self._sse is None and self._body:
            r.first_chunk_ts = self._first_body_ts
            try:
                doc = loads(self._body)
            except ValueError:
                doc = None
                r.parse_errors += 1
            if isinstance(doc, dict):
                self._common(doc)
                choices = doc.get("choices")
                if isinstance(choices, list):
                    texts = [_choice_text(self.operation, c, False)
                             for c in choices if isinstance(c, dict)]
                    for c in choices[:MAX_FINISH_REASONS]:
                        if isinstance(c, dict) and isinstance(c.get("finish_reason"), str):
                            r.finish_reasons.append(c["finish_reason"][:MAX_NAME])
                    if any(texts) or any(isinstance(c, dict) and _has_text_delta(c.get("message"))
                                         for c in choices):
                        r.first_token_ts = self._first_body_ts
                        r.token_ts = ([self._first_body_ts] if self._first_body_ts is not None
                                      else [])
                    if self.keep_text:
                        self._texts = texts
        if r.output_tokens is None and r.streamed and r.text_chunks:
            r.output_tokens = r.text_chunks
            r.usage_source = "stream_chunks"
        if self.keep_text:
            r.text = "".join(self._texts)
        return r

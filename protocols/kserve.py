"""The KServe v2 (Open Inference Protocol) gRPC API, the LLM layer on top of gRPC.

``inference.GRPCInferenceService/ModelInfer`` (unary) and ``/ModelStreamInfer``
(Triton's bidi stream; decoupled LLM backends answer one request with many
responses). ``KServeFollower`` reads one call's messages with the protos in
``protocols/proto`` and yields an ``LLMRequest``/``LLMResponse`` pair, the same
records the OpenAI path makes, so spans carry the same attribute names:

- request: model name and version, request id, input names/types/shapes, and the
  generation knobs when sent as inputs or parameters (``max_tokens``, ...);
- response: a message *carries output* when it has an output tensor with elements
  (for BYTES, a non-empty one). The first such message is the first token.
- output tokens: the ``num_output_tokens`` output where the server returns it (vLLM's
  Triton backend does, on request), summed over responses; else, for a stream, one
  per response that carries output (``stream_chunks``, as for OpenAI SSE); else
  unknown. Input tokens: ``num_input_tokens`` where returned.
- TTFT counts from the first byte of the first request message (``request_ts``):
  a client may open a ModelStreamInfer stream well before it sends a request on it.

A call whose ``:path`` could not be decoded (a late attach; ``protocols.grpc``'s
``framing_inferred``) is followed with ``method=None``: it is taken for a KServe call
only if its first request message is a ``ModelInferRequest`` naming a model, with
every input named and of a KServe datatype (``inference_request``), and its method
is told by the first response (``method_of_response``): a ``ModelStreamInferResponse``
whose ``infer_response`` names the same model, or a ``ModelInferResponse`` that does.
Anything else is not followed (``rejected``): no LLM fields rather than wrong ones.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError

from protocols.openai import (MAX_COUNT, MAX_ERROR_TEXT, MAX_NAME, LLMRequest, LLMResponse, as_count,
                              as_float)
from protocols.proto import messages

SERVICE = "inference.GRPCInferenceService"
METHODS = frozenset({"ModelInfer", "ModelStreamInfer"})
MAX_TOKEN_INPUTS = ("max_tokens", "max_new_tokens", "max_output_tokens",
                    "request_output_len")
PROMPT_INPUTS = ("text_input", "prompt", "text_inputs", "input_text", "text")
STRUCT_FORMATS = {"INT8": "b", "INT16": "h", "INT32": "i", "INT64": "q", "UINT8": "B",
                  "UINT16": "H", "UINT32": "I", "UINT64": "Q", "FP32": "f", "FP64": "d",
                  "BOOL": "?"}


# the tensor datatypes of the KServe v2 protocol
DATATYPES = frozenset({"BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16",
                       "INT32", "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES"})


def is_kserve(service: str | None, method: str | None) -> bool:
    return service == SERVICE and method in METHODS


def inference_request(data: bytes) -> Any | None:
    """``data`` as a ``ModelInferRequest`` that names a model (printable, at most
    ``MAX_NAME`` long) and has inputs, each named and of a KServe datatype; else None.
    Protobuf decodes many byte strings as some message: these fields are the proof."""
    try:
        m = messages().ModelInferRequest.FromString(data)
    except DecodeError:
        return None
    name = m.model_name
    if not name or len(name) > MAX_NAME or not name.isprintable():
        return None
    if not m.inputs or any(not t.name or t.datatype not in DATATYPES for t in m.inputs):
        return None
    return m


def method_of_response(data: bytes, model: str | None) -> str | None:
    """The method a call's first response message says it is, for a request that
    named ``model``: ``ModelStreamInfer`` for a ``ModelStreamInferResponse`` whose
    ``infer_response`` names it, ``ModelInfer`` for a ``ModelInferResponse`` that
    does; None when neither holds. A stream's error-only response reads as a bare
    ``ModelInferResponse`` whose model name is the error text: not told (unless that
    text is the model's name)."""
    if not model:
        return None
    try:
        sm = messages().ModelStreamInferResponse.FromString(data)
        if sm.HasField("infer_response") and sm.infer_response.model_name == model:
            return "ModelStreamInfer"
    except DecodeError:
        pass
    try:
        if messages().ModelInferResponse.FromString(data).model_name == model:
            return "ModelInfer"
    except DecodeError:
        pass
    return None


@dataclass
class KServeRequest(LLMRequest):
    """An ``LLMRequest`` with what KServe adds: model version, request id, inputs
    (``name:DATATYPE[shape]``), and how many inference requests the call carried."""

    model_version: str | None = None
    request_id: str | None = None
    inputs: list[str] = field(default_factory=list)
    requests: int = 0
    api: str = "kserve-v2"


def _element_count(shape: Any) -> int:
    """Elements of a tensor of ``shape`` (0 if any dimension is 0 or negative), capped
    at 2**62: a peer's shape of many huge dimensions must not make a huge product."""
    dims = list(shape)
    if any(d <= 0 for d in dims):
        return 0
    n = 1
    for d in dims:
        n = min(n * d, 1 << 62)
    return n


def _raw_values(datatype: str, raw: bytes, limit: int = 16) -> list[Any]:
    """The first values of a raw tensor (BYTES: 4-byte little-endian length prefixes)."""
    if datatype == "BYTES":
        out: list[Any] = []
        pos = 0
        while pos + 4 <= len(raw) and len(out) < limit:
            (n,) = struct.unpack_from("<I", raw, pos)
            out.append(raw[pos + 4: pos + 4 + n])
            pos += 4 + n
        return out
    fmt = STRUCT_FORMATS.get(datatype)
    if fmt is None:
        return []
    size = struct.calcsize(fmt)
    count = min(len(raw) // size, limit)
    return list(struct.unpack_from("<" + fmt * count, raw))


def _content_values(datatype: str, contents: Any) -> list[Any]:
    for name in ("bytes_contents", "int_contents", "int64_contents", "uint_contents",
                 "uint64_contents", "fp32_contents", "fp64_contents", "bool_contents"):
        vals = list(getattr(contents, name))
        if vals:
            return vals[:16]
    return []


def _tensors(tensors: Any, raw: Any) -> dict[str, tuple[str, list[int], list[Any]]]:
    """name -> (datatype, shape, first values), from typed contents or raw contents."""
    out = {}
    for i, t in enumerate(tensors):
        if i < len(raw):
            vals = _raw_values(t.datatype, raw[i])
        else:
            vals = _content_values(t.datatype, t.contents)
        out[t.name] = (t.datatype, list(t.shape), vals)
    return out


def _param(params: Any, name: str) -> Any:
    if name not in params:
        return None
    p = params[name]
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


class KServeFollower:
    """Follows one ModelInfer / ModelStreamInfer call, message by message."""

    def __init__(self, method: str | None, keep_content: bool = False) -> None:
        """``method``: the call's, from its ``:path``; None: unknown, to be told by
        its messages (see the module's docstring)."""
        self.method = method
        self.inferred = method is None
        self.rejected = False  # inferred, and its messages say it is not KServe
        self.keep = keep_content
        self.streamed = method == "ModelStreamInfer"
        self.req = KServeRequest(operation="inference", stream=self.streamed)
        self.r = LLMResponse(streamed=self.streamed)
        self._texts: list[str] = []
        self._counted = 0  # responses that carried num_output_tokens
        self._in_counted = False
        self.request_ts: int | None = None  # first byte of the first request message

    # ---- request --------------------------------------------------------------------

    def request_message(self, ts: int, data: bytes | None, unreadable: str | None = None,
                        first_ts: int | None = None) -> None:
        """One request message (``data`` inflated if it was compressed), or None with
        the reason in ``unreadable``."""
        self.req.requests += 1
        if self.request_ts is None:
            self.request_ts = first_ts if first_ts is not None else ts
        if self.req.requests > 1:
            return
        if data is None:
            if self.inferred:  # nothing to tell it by
                self.rejected = True
                return
            self.req.error = f"request {unreadable or 'message unreadable'}"
            return
        if self.inferred:
            m = inference_request(data)
            if m is None:
                self.rejected = True
                return
        else:
            try:
                m = messages().ModelInferRequest.FromString(data)
            except DecodeError as e:
                self.req.error = f"request is not a ModelInferRequest: {e}"
                return
        q = self.req
        q.parsed = True
        q.model = m.model_name[:MAX_NAME] or None
        q.model_version = m.model_version[:MAX_NAME] or None
        q.request_id = m.id[:MAX_NAME] or None
        tensors = _tensors(m.inputs, m.raw_input_contents)
        q.inputs = [f"{name}:{dt}{shape}" for name, (dt, shape, _) in tensors.items()]
        if any(dt == "BYTES" for dt, _, _ in tensors.values()):
            q.operation = "text_completion"
        for name in MAX_TOKEN_INPUTS:
            v = tensors[name][2][0] if name in tensors and tensors[name][2] else None
            v = v if v is not None else _param(m.parameters, name)
            if as_count(v) is not None:
                q.max_tokens = as_count(v)
                break
        for attr, name in (("temperature", "temperature"), ("top_p", "top_p")):
            v = tensors[name][2][0] if name in tensors and tensors[name][2] else None
            v = v if v is not None else _param(m.parameters, name)
            if as_float(v) is not None:
                setattr(q, attr, as_float(v))
        if "stream" in tensors and tensors["stream"][2]:
            q.stream = bool(tensors["stream"][2][0]) or self.streamed
        if self.keep:
            for name in PROMPT_INPUTS:
                if name in tensors and tensors[name][2]:
                    v = tensors[name][2][0]
                    q.prompt = v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                    break

    # ---- responses ------------------------------------------------------------------

    def response_message(self, ts: int, data: bytes | None) -> None:
        """One response message (inflated if it was compressed); None: unreadable."""
        if self.method is None and not self._tell_method(data):
            return
        r = self.r
        r.chunks += 1
        if r.first_chunk_ts is None:
            r.first_chunk_ts = ts
        if data is None:
            r.parse_errors += 1
            return
        try:
            if self.streamed:
                sm = messages().ModelStreamInferResponse.FromString(data)
                if sm.error_message:
                    r.error_type = "stream_error"
                    if self.keep:  # server error text can echo the prompt
                        r.error_message = sm.error_message[:MAX_ERROR_TEXT]
                if not sm.HasField("infer_response"):
                    return
                m = sm.infer_response
            else:
                m = messages().ModelInferResponse.FromString(data)
        except DecodeError:
            r.parse_errors += 1
            return
        if r.model is None and m.model_name:
            r.model = m.model_name[:MAX_NAME]
        if r.response_id is None and m.id:
            r.response_id = m.id[:MAX_NAME]
        tensors = _tensors(m.outputs, m.raw_output_contents)
        counted = None
        if "num_output_tokens" in tensors and tensors["num_output_tokens"][2]:
            counted = as_count(tensors["num_output_tokens"][2][0])
            if counted is not None:
                self._counted += 1
                r.output_tokens = min((r.output_tokens or 0) + counted, MAX_COUNT)
                r.usage_source = "num_output_tokens"
        if "num_input_tokens" in tensors and tensors["num_input_tokens"][2] \
                and not self._in_counted:
            n_in = as_count(tensors["num_input_tokens"][2][0])
            if n_in is not None:
                r.input_tokens = n_in
                self._in_counted = True
        carries = False
        for name, (dt, shape, vals) in tensors.items():
            if name in ("num_output_tokens", "num_input_tokens"):
                continue
            if _element_count(shape) == 0:
                continue
            if dt == "BYTES":
                if any(vals):
                    carries = True
                    if self.keep:
                        self._texts.extend(v.decode("utf-8", "replace") for v in vals
                                           if isinstance(v, bytes))
            else:
                carries = True
        if counted == 0:
            carries = False
        if carries:
            r.text_chunks += 1
            r.token_at(ts)
        if _param(m.parameters, "triton_final_response") is True:
            r.done_marker = True

    def _tell_method(self, data: bytes | None) -> bool:
        """An inferred call's method from its first response; False (and rejected)
        when that does not tell it."""
        method = method_of_response(data, self.req.model) if data is not None else None
        if method is None:
            self.rejected = True
            return False
        self.method = method
        self.streamed = method == "ModelStreamInfer"
        self.req.stream = self.req.stream or self.streamed
        self.r.streamed = self.streamed
        return True

    def end(self, ts: int) -> tuple[KServeRequest, LLMResponse]:
        r = self.r
        if r.output_tokens is None and self.streamed and r.text_chunks:
            r.output_tokens = r.text_chunks
            r.usage_source = "stream_chunks"
        if self.keep:
            r.text = "".join(self._texts)
        return self.req, r

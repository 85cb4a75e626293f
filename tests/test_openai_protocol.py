"""The OpenAI API layer: endpoints, request bodies, streamed and plain responses."""

import gzip
import json

import pytest

from protocols.openai import ResponseFollower, operation_for, parse_request


@pytest.mark.parametrize("method,target,op", [
    ("POST", "/v1/chat/completions", "chat"),
    ("POST", "/v1/completions?x=1", "text_completion"),
    ("POST", "/openai/deployments/gpt4/chat/completions?api-version=2024", "chat"),
    ("POST", "/v1/embeddings", "embeddings"),
    ("GET", "/v1/chat/completions", None),
    ("POST", "/v1/models", None),
])
def test_operation_for(method, target, op):
    assert operation_for(method, target) == op


def test_parse_request_fields():
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                       "stream": True, "stream_options": {"include_usage": True},
                       "max_tokens": 12, "temperature": 0.5, "n": 2}).encode()
    r = parse_request("chat", body, True)
    assert (r.model, r.stream, r.include_usage, r.max_tokens, r.temperature, r.n) == (
        "m", True, True, 12, 0.5, 2)
    assert r.prompt is None  # prompts only on request
    assert parse_request("chat", body, True, keep_prompt=True).prompt == "user: hi"


def test_truncated_request_still_names_model_and_stream():
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * 1000 + b'"}], "model": "big-m'
    r = parse_request("chat", body + b'odel", "stream": true', False)
    assert r.model == "big-model" and r.stream and not r.parsed
    assert "incomplete" in r.error


def test_invalid_json_is_reported():
    r = parse_request("chat", b"{not json", True)
    assert not r.parsed and "not JSON" in r.error


def sse(*docs):
    return b"".join(b"data: " + (d if isinstance(d, bytes) else json.dumps(d).encode()) + b"\n\n"
                    for d in docs)


def test_stream_role_chunk_is_not_a_token_and_usage_wins():
    f = ResponseFollower("chat")
    f.head(0, 200, {"content-type": "text/event-stream"})
    f.data(10, sse({"model": "m", "id": "c1",
                    "choices": [{"delta": {"role": "assistant", "content": ""}}]}))
    f.data(20, sse({"choices": [{"delta": {"content": "Hel"}}]}))
    f.data(30, sse({"choices": [{"delta": {"content": "lo"}}]}))
    f.data(40, sse({"choices": [{"delta": {}, "finish_reason": "stop"}]}))
    f.data(50, sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}},
                   b"[DONE]"))
    r = f.end(60)
    assert r.first_chunk_ts == 10 and r.first_token_ts == 20
    assert r.token_ts == [20, 30]
    assert (r.input_tokens, r.output_tokens, r.usage_source) == (3, 5, "usage")
    assert r.finish_reasons == ["stop"] and r.done_marker and r.model == "m"


def test_stream_without_usage_counts_text_chunks():
    f = ResponseFollower("text_completion")
    f.head(0, 200, {"content-type": "text/event-stream; charset=utf-8"})
    for i in range(4):
        f.data(i, sse({"choices": [{"text": f" w{i}"}]}))
    f.data(9, sse({"choices": [{"text": "", "finish_reason": "length"}]}, b"[DONE]"))
    r = f.end(10)
    assert (r.output_tokens, r.usage_source, r.first_token_ts) == (4, "stream_chunks", 0)


def test_stream_ended_by_its_first_token_has_no_text_and_no_invented_count():
    """HF ``transformers serve`` when the model's first token is end-of-text (seen in
    CI with a tiny random Llama): a role chunk, then ``finish_reason: stop``, no usage,
    no [DONE]. No token times, no TTFT, and the output count left unset."""
    f = ResponseFollower("chat")
    f.head(0, 200, {"content-type": "text/event-stream; charset=utf-8"})
    f.data(10, sse({"id": "8616708b", "choices": [{"delta": {"role": "assistant"}, "index": 0}],
                    "object": "chat.completion.chunk"}))
    f.data(20, sse({"id": "8616708b", "choices": [{"delta": {}, "index": 0,
                                                  "finish_reason": "stop"}]}))
    r = f.end(30)
    assert (r.text_chunks, r.token_ts, r.first_token_ts) == (0, [], None)
    assert r.output_tokens is None and r.usage_source is None
    assert r.finish_reasons == ["stop"] and not r.done_marker and not r.parse_errors


def test_reasoning_and_tool_call_deltas_are_tokens():
    f = ResponseFollower("chat")
    f.head(0, 200, {"content-type": "text/event-stream"})
    f.data(5, sse({"choices": [{"delta": {"reasoning_content": "think"}}]}))
    f.data(6, sse({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}))
    assert f.end(7).token_ts == [5, 6]


def test_plain_json_response():
    doc = {"id": "x", "model": "m", "choices": [{"message": {"role": "assistant", "content": "hey"},
                                                 "finish_reason": "length"}],
           "usage": {"prompt_tokens": 2, "completion_tokens": 7}}
    body = json.dumps(doc).encode()
    f = ResponseFollower("chat", keep_text=True)
    f.head(0, 200, {"content-type": "application/json"})
    f.data(100, body[:10])
    f.data(101, body[10:])
    r = f.end(102)
    assert r.first_chunk_ts == r.first_token_ts == 100
    assert (r.output_tokens, r.text) == (7, "hey")


def test_error_body_and_no_text_means_no_ttft():
    f = ResponseFollower("chat")
    f.head(0, 404, {"content-type": "application/json"})
    f.data(1, json.dumps({"error": {"message": "no model", "type": "invalid_request_error"}}).encode())
    r = f.end(2)
    assert r.error_type == "invalid_request_error" and r.first_token_ts is None


def test_gzip_body():
    body = gzip.compress(json.dumps({"choices": [{"text": "a"}], "usage": {
        "completion_tokens": 1}}).encode())
    f = ResponseFollower("text_completion")
    f.head(0, 200, {"content-type": "application/json", "content-encoding": "gzip"})
    f.data(3, body)
    assert f.end(4).output_tokens == 1


def test_garbage_stream_counts_parse_errors():
    f = ResponseFollower("chat")
    f.head(0, 200, {"content-type": "text/event-stream"})
    f.data(1, b"data: {oops\n\ndata: 3\n\n")
    r = f.end(2)
    assert r.parse_errors == 1 and r.output_tokens is None


def test_the_prompts_size_is_read_without_keeping_its_text():
    """Prefill work is weighed by prompt size: characters of the message contents (not
    roles, not JSON), or the count of token ids; the text itself is not kept."""
    chat = json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image_url"},
                                     {"type": "text", "text": 5}]}]}).encode()
    r = parse_request("chat", chat, complete=True)
    assert r.prompt_chars == len("be brief") + len("hello") + len("5") and r.prompt is None
    ids = parse_request("text_completion", b'{"prompt": [[1, 2, 3], [4, 5]]}', complete=True)
    assert ids.prompt_token_ids == 5 and ids.prompt_chars is None
    text = parse_request("text_completion", b'{"prompt": "abc def"}', complete=True)
    assert text.prompt_chars == 7 and text.prompt_token_ids is None
    odd = parse_request("chat", b'{"messages": {"not": "a list"}}', complete=True)
    assert odd.prompt_chars is None

"""Server-sent events: any split, any line ending, keep-alive comments, fuzz."""

from hypothesis import given, settings, strategies as st

from protocols.sse import SSEParser

STREAM = (b'data: {"a": 1}\r\n\r\n: keep-alive\n\nevent: x\ndata: line1\ndata: line2\n\n'
          b"data: [DONE]\r\r")


def parse(chunks):
    p = SSEParser()
    out = []
    for i, c in enumerate(chunks):
        out += [(e.data, e.event) for e in p.feed(c, i)]
    return out


def test_events_and_line_endings():
    assert parse([STREAM]) == [('{"a": 1}', ""), ("line1\nline2", "x"), ("[DONE]", "")]


@given(st.lists(st.integers(1, len(STREAM) - 1), max_size=10, unique=True))
def test_any_split_gives_the_same_events(cuts):
    cuts = sorted(cuts)
    pieces = [STREAM[a:b] for a, b in zip([0] + cuts, cuts + [len(STREAM)])]
    assert parse(pieces) == parse([STREAM])


def test_event_timestamp_is_the_write_that_completed_it():
    p = SSEParser()
    assert p.feed(b"data: he", 10) == []
    (ev,) = p.feed(b"llo\n\n", 20)
    assert ev.ts == 20 and ev.data == "hello"


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=64), max_size=20))
def test_fuzz_never_raises(chunks):
    parse(chunks)

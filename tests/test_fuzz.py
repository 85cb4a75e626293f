"""Short fuzzing of every layer a peer's bytes reach (a few seconds each): mutated real
traffic, cut at random, through HTTP/1, SSE, the OpenAI layer, HTTP/2 + HPACK, gRPC,
KServe, the capture reader, the wire decoder and the whole pipeline. The targets and
their invariants are in tests/fuzz_targets.py; bench/fuzz.py runs them for long."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz_targets import TARGETS, TOKENS

ops = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 1 << 16),
                         st.binary(max_size=8) | st.sampled_from(TOKENS)), max_size=6)
splits = st.lists(st.sampled_from((1, 2, 3, 7, 64, 500, 4096)) | st.integers(1, 9000),
                  max_size=12)
EXAMPLES = {"tracker": 200, "capture": 200, "http2": 400, "grpc": 400}


@pytest.mark.parametrize("layer", sorted(TARGETS))
def test_fuzz(layer):
    target, corpus = TARGETS[layer]
    corpus()  # built outside the examples' clock

    @settings(max_examples=EXAMPLES.get(layer, 600), deadline=None, derandomize=True,
              database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.integers(0, 1 << 16), ops, splits)
    def run(seed, o, s):
        target(seed, o, s)

    run()

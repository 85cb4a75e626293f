"""The allocation on hand-built steps: each member is charged what it made the step
cost (a fixed part shared equally, its per-sequence part, its prefill part), exactly,
with the step-cost model learned from the steps themselves."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocols.openai import LLMResponse
from tracer.correlate.attribution import GpuAttribution
from tracer.correlate.costmodel import (DECODING, MIN_STEPS, Member, StepModel, fit,
                                        fractions, member_costs, split_fractions)
from tracer.correlate.records import RequestRecord
from tracer.events.gpu import KernelBurst

FIXED, PER_SEQ, PER_PREFILL = 6, 4, 25


def rows_of(steps: list[list[Member]], cost) -> list[tuple[float, float, float, float]]:
    from tracer.correlate.costmodel import features
    return [(*features(m), cost(m)) for m in steps]


def stand_in_cost(members: list[Member]) -> float:
    return FIXED + PER_SEQ * len(members) + PER_PREFILL * sum(m.prefill for m in members)


def varied_steps(n: int, seed: int = 1) -> list[list[Member]]:
    rng = np.random.default_rng(seed)
    return [[Member(prefill=bool(rng.random() < 0.3), tokens=10.0)
             for _ in range(int(rng.integers(1, 9)))] for _ in range(n)]


def test_the_fit_recovers_the_engines_costs_and_shares_follow_them():
    model = fit(rows_of(varied_steps(64), stand_in_cost))
    assert model.usable and model.r2 == pytest.approx(1.0)
    # per_prefill and per_token are one column here (every prefill is 10 tokens)
    assert (model.fixed, model.per_seq) == (pytest.approx(FIXED), pytest.approx(PER_SEQ))
    assert model.per_prefill + 10 * model.per_token == pytest.approx(PER_PREFILL)
    step = [Member(), Member(), Member(), Member(prefill=True, tokens=10.0)]
    f = fractions(member_costs(model, step))
    total = stand_in_cost(step)  # 6 + 16 + 25 = 47
    assert [x * total for x in f] == pytest.approx([5.5, 5.5, 5.5, 30.5])


def test_prefill_tokens_are_charged_by_the_token():
    """Chunked prefill: a member prefilling 64 prompt tokens in a step costs more than
    one prefilling 16."""
    model = StepModel(fixed=10, per_seq=1, per_prefill=0, per_token=0.5, usable=True)
    step = [Member(True, 64.0), Member(True, 16.0), Member(), Member()]
    costs = member_costs(model, step)
    assert costs == [10 / 4 + 1 + 32, 10 / 4 + 1 + 8, 3.5, 3.5]
    assert sum(fractions(costs)) == 1.0


def test_equal_shares_when_the_model_cannot_be_trusted():
    few = fit(rows_of(varied_steps(MIN_STEPS - 1), stand_in_cost))
    assert not few.usable and "steps" in few.reason
    rng = np.random.default_rng(3)
    noisy = fit(rows_of(varied_steps(200), lambda m: 50.0 * len(m) + rng.normal(0, 600)))
    assert not noisy.usable and "poor fit" in noisy.reason
    assert member_costs(noisy, [Member(), Member(True, 10.0)]) == [1.0, 1.0]
    # costs that do not depend on the members: a fixed part only, shared equally
    flat = fit(rows_of(varied_steps(200), lambda m: float(rng.integers(0, 1000))))
    assert flat.per_seq == flat.per_prefill == flat.per_token == 0
    assert member_costs(flat, [Member(), Member(True, 10.0)]) == [flat.fixed / 2] * 2
    same = fit([(4.0, 0.0, 0.0, 22.0)] * 100)
    assert not same.usable and "variety" in same.reason


def test_outlying_steps_do_not_move_the_model():
    steps = varied_steps(300, seed=7)
    rng = np.random.default_rng(8)
    rows = [(a, b, c, y * (5 if rng.random() < 0.1 else 1))
            for a, b, c, y in rows_of(steps, stand_in_cost)]
    model = fit(rows)
    assert model.per_seq == pytest.approx(PER_SEQ, rel=0.05)
    assert model.per_prefill + 10 * model.per_token == pytest.approx(PER_PREFILL, rel=0.05)


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=40))
def test_fractions_add_up_to_exactly_one(costs):
    f = fractions(costs)
    assert len(f) == len(costs) and sum(f) == pytest.approx(1.0, abs=1e-12)
    assert abs(1.0 - sum(f)) <= 1e-12 and all(x >= -1e-12 for x in f)


@given(st.integers(0, 60), st.lists(st.floats(0, 5000, allow_nan=False), max_size=6),
       st.tuples(*[st.floats(0, 100, allow_nan=False)] * 4), st.booleans())
def test_counted_fractions_are_the_listed_ones(decoding, tokens, coef, usable):
    """split_fractions (what a step's split uses: decoding members counted) gives each
    member what fractions(member_costs(...)) gives it, to rounding."""
    model = StepModel(*coef, usable=usable)
    others = [Member(prefill=True, tokens=t) for t in tokens]
    listed = fractions(member_costs(model, [DECODING] * decoding + others))
    one, rest = split_fractions(decoding, others, model)
    assert len(rest) == len(others)
    for x in listed[:decoding]:
        assert one == pytest.approx(x, rel=1e-9, abs=1e-12)
    assert rest == pytest.approx(listed[decoding:], rel=1e-9, abs=1e-12)
    if listed:
        assert one * decoding + sum(rest) == pytest.approx(1.0, abs=1e-12)


# ---- end to end: an engine whose steps cost 6 + 4 per member + 25 per prefilling one --

def step_burst(k: int, launches: int) -> KernelBurst:
    return KernelBurst(pid=1, tid=99, reason="sync", sync_api=0, first_ts=100 * k + 10,
                       last_ts=100 * k + 90, launches=launches, graph_launches=0,
                       copy_bytes={"h2d": 0, "d2h": 4, "d2d": 0, "other": 0},
                       copy_calls={"d2h": 1}, memset_bytes=0, memset_calls=0, sync_calls=1,
                       sync_wait_ns=0, query_polls=0, handle_counts={})


class Engine:
    """``plan``: request -> (arrival ns, prefill chunks before its first token, token
    steps, token write lags); steps are 100 ns apart, each ends at 100k + 90."""

    def __init__(self, plan: dict[str, tuple[int, list[int], list[int], dict[int, int]]],
                 steps: int, prompt: dict[str, int]) -> None:
        self.plan = plan
        self.members: list[dict[str, bool]] = [dict() for _ in range(steps)]
        for name, (_, pre, toks, _) in plan.items():
            for k in pre:
                self.members[k][name] = True
            for k in toks:  # the step that makes the first token ends the prefill
                self.members[k].setdefault(name, k == toks[0])
        out: list[RequestRecord] = []
        self.recs: dict[str, RequestRecord] = {}
        for fd, (name, (arrival, _, toks, lags)) in enumerate(plan.items(), start=10):
            ts = sorted(100 * k + 90 + lags.get(k, 5) for k in toks)
            r = LLMResponse(status=200, streamed=True, output_tokens=len(toks),
                            input_tokens=prompt[name], first_token_ts=ts[0], token_ts=ts)
            self.recs[name] = RequestRecord(pid=1, fd=fd, conn_id=fd, exchange=0,
                                            role="server", tids=[1], start_ns=arrival,
                                            request_end_ns=arrival, end_ns=ts[-1] + 1,
                                            llm_response=r)
        self.stats: Counter[str] = Counter()
        a = GpuAttribution(out.append, lambda pid: [], self.stats, hold_ns=1000)
        for k, m in enumerate(self.members):
            a.burst(step_burst(k, FIXED + PER_SEQ * len(m) + PER_PREFILL * sum(m.values())
                               if m else 3))
        for rec in sorted(self.recs.values(), key=lambda r: r.end_ns):
            a.finished(rec)
        a.close()
        self.attribution = a

    def truth(self, name: str) -> float:
        return sum(FIXED / len(m) + PER_SEQ + PER_PREFILL * m[name]
                   for m in self.members if name in m)


def test_each_member_pays_its_own_prefill_and_its_share_of_the_fixed_part():
    """r1 runs throughout; r2 ends at step 20 (its last token written during step 21:
    it left mid-step and is not charged step 21); r3 takes its slot; r4's long prompt is
    prefilled in three chunks, steps 31-33 (the last makes its first token), while a
    slot was free; r5 is preempted for
    steps 10-14 and resumed."""
    r = range
    plan = {
        "r1": (0, [], list(r(0, 48)), {}),
        "r2": (0, [], list(r(0, 21)), {20: 60}),
        "r3": (2050, [], list(r(21, 48)), {}),
        "r4": (3050, [31, 32], list(r(33, 48)), {}),
        "r5": (450, [], [*r(5, 10), *r(15, 20)], {}),
    }
    e = Engine(plan, 48, prompt={"r1": 10, "r2": 10, "r3": 10, "r4": 30, "r5": 10})
    for name, rec in e.recs.items():
        assert rec.gpu["gpu.kernel_launches"] == pytest.approx(e.truth(name), abs=1e-3), name
        assert rec.gpu["gpu.attribution"] == "step_model"
    assert e.recs["r4"].gpu["gpu.steps"] == 17  # two prefill chunks + 15 token steps
    assert e.recs["r5"].gpu["gpu.steps"] == 10  # not the five steps it was out
    assert e.stats["gpu_step_ranges_tokens_preempted"] == 1
    assert e.attribution.ledger.balanced()
    # the steps nobody was in (none here) and everything else balance
    assert e.stats["gpu_step_launches_charged"] == e.stats["gpu_step_launches"]


def chunked_steps(n: int, seed: int = 5) -> list[list[Member]]:
    """Steps whose prefill chunks are mostly the engine's chunk (32 tokens): the last
    chunk of a prompt is shorter, so a few are 1-31."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        members = [Member() for _ in range(int(rng.integers(4, 16)))]
        for _ in range(int(rng.integers(0, 3))):
            members.append(Member(True, 32.0 if rng.random() < 0.8 else float(rng.integers(1, 32))))
        out.append(members)
    return out


def test_prefill_that_grows_with_tokens_is_read_per_token_even_when_chunks_are_alike():
    """When every prefill chunk so far was the engine's chunk (32 tokens), "per
    prefilling sequence" and "per prefill token" are one column: either reading fits.
    The per-sequence one would charge a 3-token prompt what a 32-token chunk costs;
    prefill time grows with the tokens, so the token reading is kept."""
    rng = np.random.default_rng(6)
    steps = [[Member() for _ in range(int(rng.integers(4, 16)))]
             + [Member(True, 32.0) for _ in range(int(rng.integers(0, 3)))]
             for _ in range(300)]
    model = fit(rows_of(steps, lambda m: 1000 + 200 * len(m) + 600 * sum(
        x.tokens for x in m if x.prefill)))
    assert model.usable and model.per_prefill == 0
    assert model.per_token == pytest.approx(600)
    three, chunk = member_costs(model, [Member(True, 3.0), Member(True, 32.0)])
    assert chunk - three == pytest.approx(29 * 600)
    # launches do not grow with tokens: a token reading fits them far worse, and their
    # per-sequence prefill term stays
    launches = fit(rows_of(chunked_steps(300), stand_in_cost))
    assert launches.per_prefill == pytest.approx(PER_PREFILL) and launches.per_token == 0


def test_a_host_that_stretches_steps_at_random_still_gets_shares_by_the_members():
    """A busy host adds time no member caused: r2 falls under MIN_R2, but over enough
    steps what each member adds is still measured (F test), and used."""
    rng = np.random.default_rng(9)
    steps = chunked_steps(400)
    model = fit(rows_of(steps, lambda m: 1000 + 200 * len(m) + 600 * sum(
        x.tokens for x in m if x.prefill) + rng.exponential(30000)))
    assert model.r2 < 0.5 and model.usable and model.reason == "fitted"
    assert model.per_token == pytest.approx(600, rel=0.25)


def test_prompt_tokens_from_usage_ids_or_characters_at_the_learned_rate():
    from protocols.openai import LLMRequest
    from tracer.correlate.membership import PromptTokens

    def rec(chars=None, ids=None, usage=None, body=400):
        r = RequestRecord(pid=1, fd=3, conn_id=1, exchange=0, role="server")
        r.request_bytes = body
        r.llm_request = LLMRequest(operation="chat", prompt_chars=chars, prompt_token_ids=ids)
        if usage is not None:
            r.llm_response = LLMResponse(input_tokens=usage)
        return r

    p = PromptTokens()
    assert p.of(rec(chars=100)) == 100 * PromptTokens.DEFAULT  # nothing learned yet
    assert p.of(rec(ids=17)) == 17 and p.of(rec(usage=9, chars=100)) == 9
    assert p.of(rec()) == 100  # no prompt seen: body bytes / 4
    for n in range(PromptTokens.MIN_SAMPLES):
        p.learn(rec(chars=600 + n, usage=100))  # a word-level tokenizer: ~6 chars a token
    assert p.of(rec(chars=60)) == pytest.approx(10, rel=0.02)


def test_steps_that_waited_take_a_provisional_model_but_not_for_ever():
    """``models_for``: usable models at once; else wait 10 s; then a learner short of
    its full fit offers a model from its steps so far (8 or more, same fit tests), or
    the steps wait up to 60 s; a learner whose full fit found no usable model is not
    waited for (equal shares)."""
    from tracer.correlate.attribution import MAX_PENDING_HARD_NS, MAX_PENDING_NS, models_for
    from tracer.correlate.costmodel import Learner

    def learner(steps: list[list[Member]], cost) -> Learner:
        lr = Learner()
        for m in steps:
            lr.learn(m, cost(m))
        return lr

    few = varied_steps(12)
    k, t = learner(few, stand_in_cost), learner(few, stand_in_cost)
    assert not k.model.usable and not k.fitted  # 12 steps < 32: no full fit yet
    assert models_for(k, t, MAX_PENDING_NS - 1, now=False) is None
    km, tm, provisional = models_for(k, t, MAX_PENDING_NS, now=False)
    assert provisional and km.usable and tm.usable and km.steps == 12
    assert km.fixed == pytest.approx(FIXED) and km.per_seq == pytest.approx(PER_SEQ)
    # too few steps for even a provisional model: wait, up to the hard limit
    k3, t3 = learner(few[:5], stand_in_cost), learner(few[:5], stand_in_cost)
    assert models_for(k3, t3, MAX_PENDING_HARD_NS - 1, now=False) is None
    km, tm, provisional = models_for(k3, t3, MAX_PENDING_HARD_NS, now=False)
    assert not provisional and not km.usable and not tm.usable
    # a full fit that found nothing usable (steps all alike): no waiting past 10 s
    alike = [[Member(), Member()] for _ in range(40)]
    rng = np.random.default_rng(3)
    noisy = learner(alike, lambda m: float(rng.normal(100, 20)))
    assert noisy.fitted and not noisy.model.usable
    km, tm, provisional = models_for(learner(varied_steps(40), stand_in_cost), noisy,
                                     MAX_PENDING_NS, now=False)
    assert km.usable and not tm.usable and not provisional
    # the stream's end: no waiting at all
    assert models_for(k3, t3, 0, now=True) is not None


def test_the_engines_prefill_chunk_is_learned_and_a_prompt_is_split_by_it():
    """Chunked prefill (32 tokens a step): a 49-token prompt is 32 then 17, not 24.5 and
    24.5; prompts that agree with no single chunk leave the even split in place."""
    from tracer.correlate.membership import PrefillChunk

    chunk = PrefillChunk()
    assert chunk.split(49.0, 2, 0) == 24.5  # nothing learned yet
    rng = np.random.default_rng(11)
    for _ in range(40):
        p = int(rng.integers(33, 200))
        chunk.learn(p, -(-p // 32))
    chunk.learn(500, 2)  # one misplaced prefill does not move it
    assert chunk.chunk == 32
    assert [chunk.split(49.0, 2, j) for j in range(2)] == [32.0, 17.0]
    assert [chunk.split(96.0, 3, j) for j in range(3)] == [32.0, 32.0, 32.0]
    assert chunk.split(49.0, 3, 0) == pytest.approx(49 / 3)  # 3 steps: not this chunk
    assert chunk.split(20.0, 1, 0) == 20.0
    # placements a lagged hand-off made longer than their chunks (a third of them, by
    # one to three steps) do not hide the chunk; placements shorter than a chunk
    # needs rule it out
    lagged = PrefillChunk()
    for i in range(60):
        p = int(rng.integers(33, 200))
        lagged.learn(p, -(-p // 32) + (1 + i % 9 // 3 if i % 3 == 0 else 0))
    assert lagged.chunk == 32
    assert lagged.steps(49) == 2 and lagged.steps(20) == 1 and PrefillChunk().steps(49) is None
    # no agreement: no chunk
    noisy = PrefillChunk()
    for _ in range(40):
        noisy.learn(int(rng.integers(40, 400)), int(rng.integers(2, 6)))
    assert noisy.chunk is None

"""What each member of a batched step made it cost: a step-cost model and the shares.

A continuous-batching step's work (kernel launches, GPU time) is modelled as

    cost = fixed + per_seq * sequences + per_prefill * prefilling sequences
                 + per_token * prefill tokens

learned from the engine's own steps (``fit``): non-negative least squares over the four
coefficients, made robust to outliers with Huber weights. Each member is then charged
its marginal part plus an equal share of the fixed part (``member_costs``), scaled so
the members' shares add up to what the step really cost (``fractions``): nothing is
charged twice and nothing is lost, whatever the model says.

Everything here is a pure function of plain numbers, so the allocation can be checked
by hand and by property tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations
from typing import Sequence

import numpy as np

MIN_STEPS = 32  # fewer steps than this: equal shares
# a model fitted on fewer steps, only for steps that waited too long for a full one
# (an engine whose first steps take seconds each): still held to the same fit tests
MIN_PROVISIONAL_STEPS = 8
# per_prefill alone is kept over per_token only if it fits this much better (see fit)
TOKEN_PREFERENCE = 0.05
MIN_R2 = 0.5  # a model explaining less of the variance than this is not trusted...
MIN_F = 10.0  # ...unless its per-member terms are this significant together (F statistic)
HUBER_K = 1.345  # Huber's constant, in robust standard deviations
IRLS_ROUNDS = 3
COEFFICIENTS = ("fixed", "per_seq", "per_prefill", "per_token")


@dataclass(frozen=True)
class Member:
    """One request in one step, as far as the cost model is concerned."""

    prefill: bool = False
    tokens: float = 0.0  # prompt tokens this step processed for it (0 when decoding)


DECODING = Member()  # a member decoding (most members of most steps: one object)


@dataclass(frozen=True)
class StepModel:
    """A fitted step-cost model, or the reason there is none (``usable`` False)."""

    fixed: float = 0.0
    per_seq: float = 0.0
    per_prefill: float = 0.0
    per_token: float = 0.0
    r2: float = 0.0
    steps: int = 0
    usable: bool = False
    reason: str = "no steps"

    def predict(self, members: Sequence[Member]) -> float:
        return self.fixed + sum(self.marginal(m) for m in members)

    def marginal(self, m: Member) -> float:
        """What one member adds to a step."""
        if m.prefill:
            return self.per_seq + self.per_prefill + self.per_token * m.tokens
        return self.per_seq

    def describe(self) -> str:
        if not self.usable:
            return f"equal ({self.reason})"
        return (f"{self.fixed:.4g} + {self.per_seq:.4g}/seq + {self.per_prefill:.4g}/prefill"
                f" + {self.per_token:.4g}/prefill token (r2 {self.r2:.2f}, {self.steps} steps)")


EQUAL = StepModel()


def features(members: Sequence[Member]) -> tuple[float, float, float]:
    """(sequences, prefilling sequences, prefill tokens) of one step."""
    pre = [m for m in members if m.prefill]
    return float(len(members)), float(len(pre)), float(sum(m.tokens for m in pre))


def _nnls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0, by trying each subset of
    columns (four columns: fifteen small solves) and keeping the best feasible one.

    The weighted rows are reduced once to their QR form: a subset's least squares on
    all the rows is the same problem as on ``R``'s columns of it (``Q`` keeps lengths,
    and what lies outside its span adds the same residual to every subset), so each
    solve is 4 x k. ``rcond`` is the one lstsq would use on the n rows: the same
    columns are found dependent."""
    sw = np.sqrt(w)
    q, r = np.linalg.qr(x * sw[:, None])
    z = q.T @ (y * sw)
    rcond = np.finfo(float).eps * max(x.shape)
    best, best_sse = np.zeros(x.shape[1]), float(np.sum(w * y * y))
    cols = range(x.shape[1])
    for k in range(1, x.shape[1] + 1):
        for subset in combinations(cols, k):
            idx = list(subset)
            c = np.linalg.lstsq(r[:, idx], z, rcond=rcond)[0]
            if np.any(c < 0):
                continue
            full = np.zeros(x.shape[1])
            full[idx] = c
            res = y - x @ full
            sse = float(np.sum(w * res * res))
            if sse < best_sse - 1e-12 * max(1.0, best_sse):
                best, best_sse = full, sse
    return best


def _sse(x: np.ndarray, y: np.ndarray, w: np.ndarray, coef: np.ndarray) -> float:
    r = y - x @ coef
    return float(np.sum(w * r * r))


def _prefer_per_token(x: np.ndarray, y: np.ndarray, w: np.ndarray, coef: np.ndarray
                      ) -> np.ndarray:
    """Prefill work grows with the prompt tokens a step processes. When most prefill
    chunks have one size (the engine's chunk), "a cost per prefilling sequence" and "a
    cost per prefill token" are nearly the same column and noise decides between them;
    the per-sequence reading then charges a 5-token prompt what a 32-token chunk costs.
    So a fit that uses per_prefill and not per_token is replaced by the best fit without
    per_prefill unless it is ``TOKEN_PREFERENCE`` better (launch counts, which do not
    grow with tokens, keep their per-sequence term: the token fit is far worse there)."""
    if coef[2] <= 0 or coef[3] > 0:
        return coef
    keep = [0, 1, 3]
    alt = np.zeros_like(coef)
    alt[keep] = _nnls(x[:, keep], y, w)
    tiny = 1e-12 * float(np.sum(w * y * y))  # exact fits differ by rounding only
    if alt[3] > 0 and _sse(x, y, w, alt) <= (1 + TOKEN_PREFERENCE) * _sse(x, y, w, coef) + tiny:
        return alt
    return coef


def _members_matter(x: np.ndarray, y: np.ndarray, w: np.ndarray, coef: np.ndarray) -> bool:
    """The per-member terms together explain the steps far beyond chance: the F
    statistic of the fit against a fixed cost alone is at least ``MIN_F``. Steps can
    vary for reasons no member caused (a host busy with other work stretches some of
    them): r2 is then low, yet with enough steps what the members add is measured, and
    shares by it beat equal shares."""
    active = [i for i in range(len(coef)) if coef[i] > 0]
    k = sum(1 for i in active if i > 0)
    df = len(y) - len(active)
    if k == 0 or df <= 0:
        return False
    sse = _sse(x, y, w, coef)
    mean = float(np.average(y, weights=w))
    sse_fixed = float(np.sum(w * (y - mean) ** 2))
    if sse <= 0:
        return True
    return ((sse_fixed - sse) / k) / (sse / df) >= MIN_F


def fit(rows: Sequence[tuple[float, float, float, float]], min_steps: int = MIN_STEPS
        ) -> StepModel:
    """Fit the step-cost model to ``rows`` of (sequences, prefilling, prefill tokens,
    cost); equal shares (``usable`` False) when there are too few steps (fewer than
    ``min_steps``), too little variety in them, or the model explains too little of
    the variation."""
    if len(rows) < min_steps:
        return StepModel(steps=len(rows), reason=f"{len(rows)} steps < {min_steps}")
    a = np.asarray(rows, dtype=float)
    x = np.column_stack([np.ones(len(a)), a[:, 0], a[:, 1], a[:, 2]])
    y = a[:, 3]
    if len({tuple(r) for r in a[:, :3].tolist()}) < 3:
        return StepModel(steps=len(rows), reason="too little variety in the steps")
    w = np.ones(len(a))
    coef = _nnls(x, y, w)
    for _ in range(IRLS_ROUNDS):  # Huber weights: outlying steps count less
        r = y - x @ coef
        scale = 1.4826 * float(np.median(np.abs(r - np.median(r))))
        if scale <= 0:
            break
        u = np.abs(r) / (HUBER_K * scale)
        w = np.where(u <= 1, 1.0, 1.0 / np.maximum(u, 1e-12))
        coef = _nnls(x, y, w)
    coef = _prefer_per_token(x, y, w, coef)
    r = y - x @ coef
    mean = float(np.average(y, weights=w))
    ss_tot = float(np.sum(w * (y - mean) ** 2))
    r2 = 1.0 - float(np.sum(w * r * r)) / ss_tot if ss_tot > 0 else 1.0
    model = StepModel(*(float(c) for c in coef), r2=r2, steps=len(rows), usable=True,
                      reason="fitted")
    if coef[1:].sum() > 0 and r2 < MIN_R2 and not _members_matter(x, y, w, coef):
        return StepModel(*(float(c) for c in coef), r2=r2, steps=len(rows), usable=False,
                         reason=f"poor fit (r2 {r2:.2f} < {MIN_R2})")
    return model


def member_costs(model: StepModel, members: Sequence[Member]) -> list[float]:
    """Each member's cost under ``model``: its marginal part plus an equal share of the
    fixed part. Equal costs if the model is unusable or predicts nothing."""
    n = len(members)
    if not n:
        return []
    if not model.usable:
        return [1.0] * n
    costs = [model.fixed / n + model.marginal(m) for m in members]
    return costs if sum(costs) > 0 else [1.0] * n


def fractions(costs: Sequence[float]) -> list[float]:
    """Costs scaled to fractions of the step that add up to exactly 1 (the last member
    takes the rounding), or nothing for a step without members."""
    total = float(sum(costs))
    if not costs:
        return []
    if total <= 0:
        costs, total = [1.0] * len(costs), float(len(costs))
    out = [c / total for c in costs[:-1]]
    out.append(1.0 - sum(out))
    return out


WINDOW = 1024  # recent steps a model is fitted to
REFIT_EVERY = 64  # steps between refits


class Learner:
    """A step-cost model kept fitted to a sliding window of an engine's recent steps."""

    def __init__(self) -> None:
        from collections import deque
        self.rows: deque[tuple[float, float, float, float]] = deque(maxlen=WINDOW)
        self.model = EQUAL
        self.fitted = False  # a fit has been tried on at least MIN_STEPS steps
        self._since = 0

    def learn(self, members: Sequence[Member], cost: float) -> None:
        if members:
            self.learn_row(features(members), cost)

    def learn_row(self, row: tuple[float, float, float], cost: float) -> None:
        """``learn`` from a step's ``features``, computed once for both models."""
        self.rows.append((*row, float(cost)))
        self._since += 1
        # fitted at MIN_STEPS, then each time the window grows by half (48, 72, ...)
        # until REFIT_EVERY new steps are the rarer event
        due = self._since >= min(REFIT_EVERY, max(1, len(self.rows) // 3))
        if len(self.rows) >= MIN_STEPS and (due or not self.fitted):
            self._since = 0
            self.fitted = True
            self.model = fit(list(self.rows))

    def provisional(self) -> StepModel:
        """The model, or while it is not usable one fitted on the steps so far (at
        least ``MIN_PROVISIONAL_STEPS``), for steps that cannot wait any longer."""
        if self.model.usable:
            return self.model
        return fit(list(self.rows), MIN_PROVISIONAL_STEPS)


def split_fractions(decoding: int, others: Sequence[Member], model: StepModel
                    ) -> tuple[float, list[float]]:
    """``fractions(member_costs(...))`` of a step with ``decoding`` members decoding
    (all alike: ``DECODING``) and ``others``: one decoding member's fraction, and each
    other member's. Counted, not listed: a step has dozens of decoding members."""
    n = decoding + len(others)
    if not n:
        return 0.0, []
    c_dec, c_others = 1.0, [1.0] * len(others)
    if model.usable:
        fixed = model.fixed / n
        c = fixed + model.marginal(DECODING)
        cs = [fixed + model.marginal(m) for m in others]
        if c * decoding + sum(cs) > 0:
            c_dec, c_others = c, cs
    total = c_dec * decoding + sum(c_others)
    return c_dec / total, [x / total for x in c_others]

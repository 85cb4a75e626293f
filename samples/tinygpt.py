"""A tiny GPT with random weights: real PyTorch inference, no download.

The model is a standard decoder-only transformer (token + position embeddings,
pre-norm attention and MLP blocks, tied output head). Weights come from a fixed seed,
so the text is nonsense but the compute is real: every token is a forward pass with
real kernel launches (on the GPU when there is one).

Tokens are words from a fixed 512-word vocabulary; prompts are split into words and
punctuation, so ``count_tokens`` is what a tokenizer would report as prompt tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
VOCAB: list[str] = []
for _c1 in _CONSONANTS:
    for _v1 in _VOWELS:
        for _c2 in ("", "n", "r", "l", "s", "t", "m"):
            if len(VOCAB) < 512:
                VOCAB.append(_c1 + _v1 + _c2)
_WORD = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    return len(_WORD.findall(text))


def encode(text: str) -> list[int]:
    """Words to ids (a stable hash into the vocabulary)."""
    ids = []
    for w in _WORD.findall(text):
        h = 2166136261
        for ch in w.encode():
            h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
        ids.append(h % len(VOCAB))
    return ids or [0]


def decode_token(token_id: int) -> str:
    return " " + VOCAB[token_id % len(VOCAB)]


@dataclass
class GPTConfig:
    vocab: int = 512
    block: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))
        self.n_head = cfg.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        torch.manual_seed(seed)  # same random weights every run
        self.tok = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.n_embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.T  # tied head

    @torch.no_grad()
    def step(self, batch: torch.Tensor, temperature: float = 1.0,
             generator: torch.Generator | None = None) -> torch.Tensor:
        """One decode step for a batch of equal-length contexts: next token ids (B,)."""
        logits = self(batch[:, -self.cfg.block:])[:, -1, :]
        if temperature <= 0:
            return logits.argmax(dim=-1)
        probs = F.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(device: str = "auto") -> tuple[TinyGPT, torch.device]:
    dev = pick_device(device)
    model = TinyGPT().to(dev).eval()
    return model, dev

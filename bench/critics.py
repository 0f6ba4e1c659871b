"""The three critics (`PPOConfig.critic`) side by side: what each costs and how each learns.

    python bench/critics.py                                   # all three parts, ~15 min on 2 CPU cores
    python bench/critics.py --parts arithmetic                # the 1.5B / 8B arithmetic alone (instant)
    python bench/critics.py --iterations 12 --seeds 0 1 2     # the learning part's size (the defaults)

1. sizes: one process per critic on the tiny models (`hf_ppo.cli.tiny`: hidden 64, 2 layers; QLoRA policy r=8, 4-bit
   reward model, a 4-bit 'separate' critic), one PPO iteration: trainable and total parameters (4-bit weights
   counted by their logical shape), the bytes the weights take, and the process's peak RSS (`ru_maxrss`) minus its
   RSS after the imports. At this size RSS is mostly torch itself: the weight bytes are the number to compare.
2. arithmetic: the same setup at Qwen2.5-1.5B's and Llama-3-8B's shapes, from the architecture alone (no model is
   built): NF4 with double quantization at 4.127 bits per quantized weight, embeddings / LM head / norms in bf16,
   LoRA (r=16, all linear layers) and the value head in fp32 with AdamW's two fp32 moments and an fp32 gradient.
   Activations are left out (a critic with its own body also runs its own forward and backward).
3. learning: the demo's SFT policy (recipes/demo.py's cached models, built if missing) with the demo's trained
   reward model, and with the rule reward (`common.rule_score`), each critic, `--seeds`, the same iterations; the
   final reward (mean `objective/scores` of the last quarter of the iterations) and the explained variance of the
   values (`val/explained_variance`, same window), as mean and spread (min..max) over the seeds. With the rule
   reward there is no reward model: 'reward_lora' cannot apply, and 'separate' starts from the SFT checkpoint
   (`critic_model`).

Results go to bench/out/critics.json and are printed as the README's tables. What it leaves out: GPU timings,
and activation memory at the large sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

from common import current_rss_mb, peak_rss_mb, rule_score  # noqa: E402

CRITICS = ["shared", "separate", "reward_lora"]
# The learning runs: (label, critic, critic_quantization). 'separate' 4-bit from the 4-bit reward checkpoint computes
# what 'reward_lora' computes (same base weights, same LoRA initialisation) from a second copy; the full-precision
# one differs.
VARIANTS = [("shared", "shared", "none"), ("separate", "separate", "4bit"),
            ("separate-fp32", "separate", "none"), ("reward_lora", "reward_lora", "none")]
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}


# ---- 1. sizes at the tiny shape (one process per critic) ---------------------------------------------------------
def logical_numel(p) -> int:
    """Parameters a tensor stands for: a bitsandbytes 4-bit tensor packs two weights per byte."""
    state = getattr(p, "quant_state", None)
    return int(state.shape.numel()) if state is not None else p.numel()


def size_worker(critic: str) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from hf_ppo import PPOConfig, PPOLMTrainer
    from hf_ppo.cli.tiny import save_tiny_models

    torch.set_num_threads(1)
    base_rss = current_rss_mb()
    folder = tempfile.mkdtemp()
    policy, reward = save_tiny_models(folder)
    args = PPOConfig(output_dir=os.path.join(folder, "out"), per_device_train_batch_size=4, num_mini_batches=2,
                     num_ppo_epochs=1, max_steps=2, response_length=8, report_to=[], save_strategy="no",
                     disable_tqdm=True, num_sample_generations=0, policy_quantization="4bit",
                     reward_quantization="4bit", critic=critic,
                     critic_quantization="4bit" if critic == "separate" else "none")
    dataset = Dataset.from_dict({"prompt": ["the movie was", "the food was"] * 4})
    trainer = PPOLMTrainer(model=policy, args=args, processing_class=AutoTokenizer.from_pretrained(policy),
                           reward_model=reward, train_dataset=dataset,
                           peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                  task_type="CAUSAL_LM"))
    trainer.train()
    model = trainer.model
    seen, total, weight_bytes = set(), 0, 0
    for module in (model, trainer.ref_model, trainer.reward_model):
        for p in (module.parameters() if module is not None else []):
            if id(p) not in seen:
                seen.add(id(p))
                total += logical_numel(p)
                weight_bytes += p.numel() * p.element_size()
    return {"critic": critic, "critic_trainable": sum(p.numel() for p in model.critic_parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad), "total": total,
            "weight_kib": round(weight_bytes / 1024, 1), "peak_rss_mb": round(peak_rss_mb(), 1),
            "peak_rss_over_imports_mb": round(peak_rss_mb() - base_rss, 1)}


def run_worker(flag: str, payload: str) -> dict:
    """Run this script as a worker in a fresh process (its own peak RSS); return its JSON line."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, __file__, flag, payload], capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("CRITIC_RESULT "):
            return json.loads(line[len("CRITIC_RESULT "):])
    raise RuntimeError(f"worker {flag} {payload} failed:\n{done.stderr[-3000:]}")


# ---- 2. arithmetic at 1.5B and 8B ----------------------------------------------------------------------------------
SHAPES = {  # hidden, layers, intermediate, vocab, heads, kv_heads, head_dim, tied embeddings, qkv bias
    "Qwen2.5-1.5B": dict(hidden=1536, layers=28, intermediate=8960, vocab=151936, heads=12, kv_heads=2, head_dim=128,
                         tied=True, qkv_bias=True),
    "Llama-3-8B": dict(hidden=4096, layers=32, intermediate=14336, vocab=128256, heads=32, kv_heads=8, head_dim=128,
                       tied=False, qkv_bias=False),
}
NF4_BYTES = 4.127 / 8  # NF4 + double quantization: 4 bits + 8-bit absmax per 64 weights + fp32 per 256 blocks
TRAINED_BYTES = 4 + 4 + 8  # fp32 weight + fp32 gradient + AdamW's two fp32 moments
FULL_BF16_BYTES = 2 + 2 + 8  # bf16 weight + bf16 gradient + two fp32 moments (full fine-tuning)


def architecture_counts(hidden, layers, intermediate, vocab, heads, kv_heads, head_dim, tied, qkv_bias, lora_r=16):
    """Parameter counts of a Llama/Qwen-shaped decoder from its shape: the linear layers (what 4-bit quantizes and
    LoRA adapts), the embeddings, the LM head, the small rest (norms, biases), and LoRA(r) on every linear layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden),  # q, k, v, o
              (hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]  # gate, up, down
    linear = layers * sum(i * o for i, o in shapes)
    lora = layers * sum(lora_r * (i + o) for i, o in shapes)
    small = (2 * layers + 1) * hidden + (layers * (q + 2 * kv) if qkv_bias else 0)
    embed = vocab * hidden
    return {"linear": linear, "embed": embed, "lm_head": 0 if tied else embed, "small": small, "lora": lora,
            "head": hidden + 1}


def critic_costs(shape: dict) -> dict:
    """Per critic: its own trainable parameters, and the GB its weights + training state add to a QLoRA run whose
    policy (4-bit + LoRA) and reward model (4-bit) are the same in every option."""
    c = architecture_counts(**shape)
    body_4bit = c["linear"] * NF4_BYTES + (c["embed"] + c["small"]) * 2  # a second base body, no LM head
    body_bf16 = c["linear"] + c["embed"] + c["small"]
    gb = 1e9
    return {
        "params_total_b": round((c["linear"] + c["embed"] + c["lm_head"] + c["small"]) / 1e9, 2),
        "lora_params_m": round(c["lora"] / 1e6, 1),
        "shared": {"trainable": c["head"], "extra_gb": c["head"] * TRAINED_BYTES / gb},
        "separate (4-bit + LoRA)": {"trainable": c["lora"] + c["head"],
                                    "extra_gb": (body_4bit + (c["lora"] + c["head"]) * TRAINED_BYTES) / gb},
        "separate (bf16, full)": {"trainable": body_bf16 + c["head"],
                                  "extra_gb": (body_bf16 * FULL_BF16_BYTES + c["head"] * TRAINED_BYTES) / gb},
        "reward_lora": {"trainable": c["lora"] + c["head"], "extra_gb": (c["lora"] + c["head"]) * TRAINED_BYTES / gb},
        "policy + reward (common)": {
            "trainable": c["lora"],
            "extra_gb": (2 * c["linear"] * NF4_BYTES + (2 * c["embed"] + c["lm_head"] + 2 * c["small"]) * 2
                         + c["lora"] * TRAINED_BYTES) / gb},
    }


# ---- 3. learning ---------------------------------------------------------------------------------------------------
def demo_models() -> tuple[str, str]:
    """The demo's SFT policy and reward model (recipes/demo.py's cache under outputs/demo; built if missing)."""
    import demo

    cache = ROOT / "outputs" / "demo" / "cache" / demo.CACHE_VERSION
    demo.cached(lambda d: demo.build_sft_policy(d), cache / "sft", False, "SFT policy")
    demo.cached(lambda d: demo.build_reward(d), cache / "reward", False, "reward model")
    return str(cache / "sft"), str(cache / "reward")


def rule_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [rule_score(c) for c in completions]


def learn_worker(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    import demo
    from hf_ppo import PPOConfig, PPOLMTrainer

    torch.set_num_threads(1)
    sft, reward_path = spec["sft"], spec["reward"]
    steps_per_iteration = 4  # 2 epochs x 2 minibatches
    args = PPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16, num_mini_batches=2, num_ppo_epochs=2,
        max_steps=spec["iterations"] * steps_per_iteration, logging_steps=steps_per_iteration, response_length=12,
        temperature=0.7, missing_eos_penalty=1.0, learning_rate=5e-4, lr_scheduler_type="constant", kl_coef=0.2,
        vf_coef=0.1, policy_quantization="4bit", reward_quantization="4bit", critic=spec["critic"],
        critic_quantization=spec.get("critic_quantization", "none"), report_to=[], save_strategy="no",
        disable_tqdm=True, num_sample_generations=0, seed=spec["seed"])
    prompts = [json.loads(line)["prompt"] for line in
               demo.write_prompts(Path(tempfile.mkdtemp()) / "p.jsonl", n=512, seed=1000).read_text().splitlines()]
    rule = spec["task"] == "rule"
    trainer = PPOLMTrainer(
        model=sft, args=args, processing_class=AutoTokenizer.from_pretrained(sft),
        reward_model=rule_reward if rule else reward_path, train_dataset=Dataset.from_dict({"prompt": prompts}),
        peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA),
        critic_model=sft if rule and spec["critic"] == "separate" else None)
    start = time.perf_counter()
    trainer.train()
    logs = [e for e in trainer.state.log_history if "objective/scores" in e]
    window = logs[-max(1, len(logs) // 4):]
    return {**spec, "final_reward": statistics.mean(e["objective/scores"] for e in window),
            "explained_variance": statistics.mean(e["val/explained_variance"] for e in window),
            "first_reward": logs[0]["objective/scores"], "seconds": round(time.perf_counter() - start, 1),
            "peak_rss_mb": round(peak_rss_mb(), 1)}


def spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:+.3f} ({min(values):+.2f}..{max(values):+.2f})"


# ---- driver --------------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["sizes", "arithmetic", "learning"],
                        choices=["sizes", "arithmetic", "learning"])
    parser.add_argument("--iterations", type=int, default=12, help="PPO iterations per learning run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="+", default=["demo", "rule"], choices=["demo", "rule"])
    parser.add_argument("--variants", nargs="+", default=[v[0] for v in VARIANTS], choices=[v[0] for v in VARIANTS],
                        help="the learning runs to (re)do; the others are kept from --out")
    parser.add_argument("--out", default=str(HERE / "out" / "critics.json"))
    args = parser.parse_args()
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}

    if "sizes" in args.parts:
        results["sizes"] = [run_worker("--size-worker", critic) for critic in CRITICS]
        print("\n| critic | critic's trainable params | trainable params | total params | weight KiB | "
              "peak RSS over imports (MB) |\n|---|---|---|---|---|---|")
        for r in results["sizes"]:
            print(f"| {r['critic']} | {r['critic_trainable']:,} | {r['trainable']:,} | {r['total']:,} | "
                  f"{r['weight_kib']} | {r['peak_rss_over_imports_mb']} |")
    if "arithmetic" in args.parts:
        results["arithmetic"] = {name: critic_costs(shape) for name, shape in SHAPES.items()}
        for name, costs in results["arithmetic"].items():
            print(f"\n{name}: {costs['params_total_b']}B parameters, LoRA r=16 all-linear {costs['lora_params_m']}M")
            print("| critic | critic's trainable params | memory the critic adds (GB) |\n|---|---|---|")
            for option, c in costs.items():
                if isinstance(c, dict):
                    count = f"{c['trainable'] / 1e6:,.1f}M" if c["trainable"] >= 1e5 else f"{c['trainable']:,}"
                    print(f"| {option} | {count} | {c['extra_gb']:.3g} |")
    if "learning" in args.parts:
        sft, reward = demo_models()
        runs = [r for r in results.get("learning", [])
                if r["task"] not in args.tasks or r.get("label", r["critic"]) not in args.variants]
        for task in args.tasks:
            for label, critic, quantization in VARIANTS:
                if label not in args.variants or (task == "rule" and critic == "reward_lora"):
                    continue  # a rule reward has no reward model to put the critic on
                for seed in args.seeds:
                    spec = {"task": task, "label": label, "critic": critic, "critic_quantization": quantization,
                            "seed": seed, "iterations": args.iterations, "sft": sft, "reward": reward}
                    runs.append(run_worker("--learn-worker", json.dumps(spec)))
                    print(f"[critics] {task} {label} seed {seed}: final reward {runs[-1]['final_reward']:+.3f}, "
                          f"explained variance {runs[-1]['explained_variance']:+.3f} ({runs[-1]['seconds']} s)",
                          flush=True)
        results["learning"] = runs
        print(f"\n{args.iterations} iterations x 32 prompts, seeds {args.seeds}: mean (min..max)")
        print("| task | critic | final reward | explained variance | s per run |\n|---|---|---|---|---|")
        for task in args.tasks:
            for label, _, _ in VARIANTS:
                rows = [r for r in runs if r["task"] == task and r.get("label", r["critic"]) == label]
                if rows:
                    print(f"| {task} | {label} | {spread([r['final_reward'] for r in rows])} | "
                          f"{spread([r['explained_variance'] for r in rows])} | "
                          f"{statistics.mean(r['seconds'] for r in rows):.0f} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--size-worker":
        print("CRITIC_RESULT " + json.dumps(size_worker(sys.argv[2])))
    elif len(sys.argv) == 3 and sys.argv[1] == "--learn-worker":
        print("CRITIC_RESULT " + json.dumps(learn_worker(json.loads(sys.argv[2]))))
    else:
        main()

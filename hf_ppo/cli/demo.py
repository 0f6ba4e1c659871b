"""RLHF in a box: the offline demo behind `make demo` and `hf-ppo demo`.

    hf-ppo demo --output_dir outputs/demo                       # installed with the package, from any directory
    python recipes/demo.py --output_dir outputs/demo            # what `make demo` runs (the same demo)
    python recipes/demo.py --output_dir outputs/demo --seed 1   # another PPO seed, same cached models
    python recipes/demo.py --output_dir outputs/demo --rebuild  # retrain the cached SFT policy and reward model
    python recipes/demo.py --output_dir outputs/demo --verbose  # also print every metric dict and sample tables
    python recipes/demo.py --output_dir /tmp/demo --quick       # a smoke run of every stage (what the tests run)

Everything is built locally on the CPU, in four steps:

1. a tiny Llama policy (hidden 64, 2 layers, `hf_ppo.cli.tiny`) learns to write short reviews with a supervised pass
   (trl's `SFTTrainer`) on `hf_ppo.cli.tiny.synthetic_reviews` ("the movie was great but the plot was dull .");
2. a tiny reward model learns, with trl's `RewardTrainer`, to prefer the more positive of two reviews;
   its accuracy on held-out pairs is printed;
3. `recipes/ppo.py` runs with `hf_ppo/cli/configs/demo.yaml`: QLoRA policy (4-bit base + LoRA), 4-bit reward model,
   the reference being the policy with its adapter disabled; prompts are the first three words of reviews;
4. a before/after table of sampled completions with their rewards is printed, the curves of reward, KL,
   response length and entropy per PPO iteration are written to `<output_dir>/ppo/training_curves.png`, the
   figures the docs quote (docs/getting-started/demo.md) to `<output_dir>/summary.json`, and a closing summary says where everything is and
   prints a command that loads the policy from any directory.

The console shows one progress bar per stage and no metric dicts (they are in `ppo/trainer_state.json`).

Steps 1-2 are cached under `<output_dir>/cache/<CACHE_VERSION>/`, so a second run goes straight to PPO.
What it leaves out on purpose: any download, a GPU, evaluation beyond the before/after sample.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from ..runtime.versions import CHECKPOINTING_ARG
from . import tiny

# Bump when the corpus, the models or their training change: old caches are then ignored, not reused.
CACHE_VERSION = "v1"


# The YAML recipes: package data of hf_ppo.cli, at this one path in a checkout and in an installed wheel alike.
CONFIGS = Path(__file__).resolve().parent / "configs"


def demo_config() -> Path:
    """hf_ppo/cli/configs/demo.yaml, the config the demo's PPO stage runs with."""
    return CONFIGS / "demo.yaml"


PROMPT_WORDS = 3  # "the movie was": the subject and the verb, the sentiment is left to the policy


def sentiment(text: str) -> int:
    """Positive minus negative words of `text`: the hidden preference the reward model has to discover."""
    words = text.split()
    return sum(w in tiny.POSITIVE_WORDS for w in words) - sum(w in tiny.NEGATIVE_WORDS for w in words)


def _quiet_args(output_dir: Path, seed: int) -> dict:
    """TrainingArguments shared by the two supervised passes: CPU, no checkpoints, no trackers, no pinned memory."""
    return dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=50,
        seed=seed,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        **{CHECKPOINTING_ARG: False},  # trl defaults it on; the tiny models do not need it
    )


def _with_stage_bar(trainer, description: str, verbose: bool):
    """Swap Trainer's progress bar for one named after the demo stage (metric dicts printed only when verbose)."""
    from transformers.trainer_callback import ProgressCallback

    from ..trainer.progress import StageProgressCallback

    trainer.pop_callback(ProgressCallback)
    trainer.add_callback(StageProgressCallback(description, print_metrics=verbose))
    return trainer


def build_sft_policy(out_dir: Path, seed: int = 0, verbose: bool = False, max_steps: int = 300) -> Path:
    """Step 1: train the tiny policy to write synthetic reviews; save model + tokenizer to `out_dir`.

    A causal-LM loss over whole reviews ending in EOS, so the policy also learns to stop: the PPO demo relies on
    responses that end (the EOS trick and `rollout/eos_rate` only mean something then).
    """
    return sft_tiny_policy(tiny.synthetic_reviews(3000, seed=seed + 100), out_dir, seed=seed, max_steps=max_steps,
                           stage="1/4 SFT policy", verbose=verbose, lr_scheduler_type="cosine", warmup_steps=20)


def sft_tiny_policy(texts: list[str], out_dir: Path, *, seed: int, max_steps: int, stage: str, verbose: bool,
                    **schedule) -> Path:
    """A fresh tiny policy (hidden 64, 2 layers) given a supervised pass on `texts` with trl's `SFTTrainer` (batch
    32, learning rate 3e-3, `schedule`: the scheduler settings); model + tokenizer saved to `out_dir`. The demo's
    reviews and the arithmetic task's worked questions both start here."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tokenizer = tiny.build_tokenizer(seed=seed)
    model = tiny.build_causal_lm(tokenizer, hidden_size=64, num_layers=2, seed=seed)
    args = SFTConfig(**_quiet_args(out_dir / "_run", seed), max_steps=max_steps, per_device_train_batch_size=32,
                     learning_rate=3e-3, max_length=32, **schedule)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer)
    _with_stage_bar(trainer, stage, verbose).train()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def preference_pairs(n: int, seed: int) -> list[dict]:
    """`n` (chosen, rejected) review pairs where the chosen one has strictly more positive sentiment."""
    rng = random.Random(seed)
    pool = tiny.synthetic_reviews(8 * n, seed=seed)
    pairs = []
    while len(pairs) < n:
        a, b = rng.sample(pool, 2)
        if sentiment(a) != sentiment(b):
            chosen, rejected = (a, b) if sentiment(a) > sentiment(b) else (b, a)
            pairs.append({"chosen": chosen, "rejected": rejected})
    return pairs


def build_reward(out_dir: Path, seed: int = 0, verbose: bool = False, max_steps: int = 250) -> tuple[Path, float]:
    """Step 2: train the tiny reward model with trl's `RewardTrainer`; return its path and held-out pair accuracy."""
    from datasets import Dataset
    from transformers.trainer_callback import ProgressCallback
    from trl import RewardConfig, RewardTrainer

    tokenizer = tiny.build_tokenizer(seed=seed)
    model = tiny.build_reward_model(tokenizer, hidden_size=64, num_layers=2, seed=seed + 1)
    train = Dataset.from_list(preference_pairs(3000, seed=seed + 200))
    held_out = Dataset.from_list(preference_pairs(300, seed=seed + 300))
    args = RewardConfig(
        **_quiet_args(out_dir / "_run", seed),
        max_steps=max_steps,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=64,
        learning_rate=2e-3,
        lr_scheduler_type="cosine",
        warmup_steps=20,
        max_length=32,
        # Keeps scores centred on 0, so the PPO demo's reward curve starts near 0 and reads as "better than average".
        center_rewards_coefficient=0.01,
    )
    trainer = RewardTrainer(
        model=model, args=args, train_dataset=train, eval_dataset=held_out, processing_class=tokenizer
    )
    _with_stage_bar(trainer, "2/4 reward model", verbose).train()
    trainer.pop_callback(ProgressCallback)  # no bar for the few evaluation batches
    accuracy = trainer.evaluate()["eval_accuracy"]
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "held_out_accuracy.json").write_text(json.dumps({"accuracy": accuracy}))
    return out_dir, accuracy


def cached(build, out_dir: Path, rebuild: bool, label: str, tag: str = "demo", version: str = CACHE_VERSION):
    """Run `build(out_dir)` unless a finished build (marked by `DONE`) is there already; `tag` names the program in
    the console, `version` is written into the mark."""
    done = out_dir / "DONE"
    if done.exists() and not rebuild:
        print(f"[{tag}] {label}: cached in {out_dir}")
        return
    start = time.perf_counter()
    build(out_dir)
    done.write_text(version)  # written last: an interrupted build is redone, never half-used
    print(f"[{tag}] {label}: built in {time.perf_counter() - start:.1f}s -> {out_dir}")


def write_prompts(path: Path, n: int, seed: int) -> Path:
    """A jsonl file of prompts: the first `PROMPT_WORDS` words of fresh synthetic reviews."""
    reviews = tiny.synthetic_reviews(n, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for review in reviews:
            f.write(json.dumps({"prompt": " ".join(review.split()[:PROMPT_WORDS])}) + "\n")
    return path


@torch.no_grad()
def demo_samples(policy, reward_model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float,
                     seed: int) -> list[tuple[str, str, float]]:
    """(prompt, completion, reward) for each prompt: one sample each, scored by the full-precision reward model.

    The reward model sees prompt + completion (+ EOS when the policy stopped), as in its training pairs.
    """
    torch.manual_seed(seed)
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = policy.generate(**enc, do_sample=True, temperature=temperature, top_k=0, max_new_tokens=max_new_tokens,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    rows = []
    for prompt, ids in zip(prompts, out[:, enc["input_ids"].shape[1]:]):
        ids = ids.tolist()
        stopped = tokenizer.eos_token_id in ids
        ids = ids[: ids.index(tokenizer.eos_token_id)] if stopped else ids
        completion = tokenizer.decode(ids, skip_special_tokens=True)
        text = prompt + completion + (tokenizer.eos_token if stopped else "")
        score = reward_model(**tokenizer(text, return_tensors="pt")).logits[0, 0].item()
        rows.append((prompt, completion, score))
    return rows


def print_table(before, after, n_rows: int) -> None:
    """The before/after table (rich): the same prompts, sampled from the SFT policy and from the PPO policy."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Sampled completions: SFT policy (before) vs PPO policy (after)")
    for name, style in (("prompt", "bold"), ("before", ""), ("reward", "red"), ("after", ""), ("reward", "green")):
        table.add_column(name, style=style, justify="right" if name == "reward" else "left")
    for (prompt, c0, r0), (_, c1, r1) in list(zip(before, after))[:n_rows]:
        table.add_row(prompt, c0, f"{r0:+.2f}", c1, f"{r1:+.2f}")
    mean = lambda rows: sum(r for *_, r in rows) / len(rows)  # noqa: E731
    table.add_section()
    table.add_row(f"mean of {len(before)}", "", f"{mean(before):+.2f}", "", f"{mean(after):+.2f}")
    Console().print(table)


def quiet_console() -> None:
    """No per-file progress bars (datasets maps, weight loading/saving): one bar per demo stage is enough."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def load_command(policy_dir: Path) -> str:
    """A shell command that loads the saved policy from any directory and completes one prompt."""
    code = (f"from peft import AutoPeftModelForCausalLM; from transformers import AutoTokenizer; p = '{policy_dir}'; "
            "m = AutoPeftModelForCausalLM.from_pretrained(p); t = AutoTokenizer.from_pretrained(p); "
            "print(t.decode(m.generate(**t('the movie was', return_tensors='pt'), max_new_tokens=12, do_sample=False)"
            "[0], skip_special_tokens=True))")
    return f'python -c "{code}"'


def main(argv: list[str] | None = None, prog: str = "python recipes/demo.py") -> dict:
    """Build (or reuse) the SFT policy and reward model, run PPO, print and plot; return a summary dict."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="outputs/demo")
    parser.add_argument("--seed", type=int, default=0, help="PPO seed (the cached models do not depend on it).")
    parser.add_argument("--rebuild", action="store_true", help="Retrain the cached SFT policy and reward model.")
    parser.add_argument("--num_samples", type=int, default=64, help="Prompts in the before/after comparison.")
    parser.add_argument("--verbose", action="store_true",
                        help="Also print every logged metric dict and PPO's sample tables during training.")
    parser.add_argument("--quick", action="store_true",
                        help="A smoke run of every stage (30 SFT and reward steps, 2 PPO iterations, 16 samples; "
                             "cached apart): it checks the pipeline, its numbers mean nothing.")
    args, ppo_overrides = parser.parse_known_args(argv)  # anything else goes to recipes/ppo.py, e.g. --max_steps 16

    quiet_console()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from ..hub.plots import plot_training_curves
    from ..trainer.progress import kl_figures
    from . import train as ppo

    start = time.perf_counter()
    out = Path(args.output_dir).resolve()
    cache = out / "cache" / (CACHE_VERSION + ("-quick" if args.quick else ""))
    steps = {"max_steps": 30} if args.quick else {}
    if args.quick:
        args.num_samples = 16
        ppo_overrides = ["--max_steps", "16", *ppo_overrides]
    cached(lambda d: build_sft_policy(d, verbose=args.verbose, **steps), cache / "sft", args.rebuild, "1/4 SFT policy")
    cached(lambda d: build_reward(d, verbose=args.verbose, **steps), cache / "reward", args.rebuild, "2/4 reward model")
    accuracy = json.loads((cache / "reward" / "held_out_accuracy.json").read_text())["accuracy"]
    print(f"[demo] reward model accuracy on 300 held-out preference pairs: {accuracy:.1%}")
    prompts_file = write_prompts(out / "prompts.jsonl", n=2000, seed=1000)
    eval_prompts = [json.loads(line)["prompt"] for line in
                    write_prompts(out / "eval_prompts.jsonl", n=args.num_samples, seed=2000).read_text().splitlines()]
    setup_s = time.perf_counter() - start

    tokenizer = AutoTokenizer.from_pretrained(cache / "sft")
    reward_model = AutoModelForSequenceClassification.from_pretrained(cache / "reward").eval()
    sft = AutoModelForCausalLM.from_pretrained(cache / "sft").eval()

    print("[demo] 3/4 PPO: recipes/ppo.py --config hf_ppo/cli/configs/demo.yaml")
    ppo_dir = out / "ppo"
    console = ["--print_metrics", "true"] if args.verbose else ["--num_sample_generations", "0"]
    trainer = ppo.main([
        "--config", str(demo_config()),
        "--model_name_or_path", str(cache / "sft"),
        "--reward_model_name_or_path", str(cache / "reward"),
        "--dataset_name", str(prompts_file),
        "--output_dir", str(ppo_dir),
        "--seed", str(args.seed),
        *console,
        *ppo_overrides,
    ])
    ppo_s = time.perf_counter() - start - setup_s
    config = trainer.args

    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(cache / "sft"), ppo_dir).eval()
    gen = dict(max_new_tokens=config.response_length, temperature=config.temperature, seed=args.seed + 12345)
    before = demo_samples(sft, reward_model, tokenizer, eval_prompts, **gen)
    after = demo_samples(tuned, reward_model, tokenizer, eval_prompts, **gen)
    print("[demo] 4/4 results")
    print_table(before, after, n_rows=10)

    history = trainer.state.log_history
    panels = {"objective/scores": "reward-model score", "objective/kl": "KL(policy || reference), nats/response",
              "rollout/response_length": "response length (tokens)",
              # objective/entropy sums -log p over a response (TRL's convention), so it is per response, not per token
              "objective/entropy": "entropy (nats/response)"}
    iterations = trainer.state.global_step // config.optimizer_steps_per_iteration
    plot = plot_training_curves(history, ppo_dir / "training_curves.png", panels, x_key="iteration",
                                title=f"hf_ppo demo: PPO on a tiny Llama (QLoRA policy, 4-bit reward model); "
                                      f"{iterations} iterations = {trainer.state.global_step} optimizer steps")
    series = {k: [round(e[k], 3) for e in history if k in e] for k in
              ("objective/scores", "objective/kl", "rollout/response_length", "objective/entropy")}
    if args.verbose:
        for key, values in series.items():
            print(f"[demo] {key:24s} per logged iteration: {values}")
    total_s = time.perf_counter() - start
    summary = {
        "seed": args.seed,
        "reward_model_accuracy": accuracy,
        "mean_reward_before": sum(r for *_, r in before) / len(before),
        "mean_reward_after": sum(r for *_, r in after) / len(after),
        "num_samples": len(before),
        "kl": kl_figures(history),
        "iterations": iterations,
        "optimizer_steps": trainer.state.global_step,
        "series": series,
        "seconds": {"setup": round(setup_s, 1), "ppo": round(ppo_s, 1), "total": round(total_s, 1)},
        "plot": str(plot),
        "policy": str(ppo_dir),
        "load_command": load_command(ppo_dir),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    kl = summary["kl"]
    print(f"[demo] done in {total_s:.0f}s (PPO {ppo_s:.0f}s, {iterations} iterations, seed {args.seed})")
    print(f"[demo] mean reward on {len(before)} held-out prompts: {summary['mean_reward_before']:+.2f} (SFT) -> "
          f"{summary['mean_reward_after']:+.2f} (PPO); KL to the reference {kl['last']:.2f} at the end, "
          f"peak {kl['peak']:.2f} (iteration {kl['iteration_of_peak']})")
    print(f"[demo] plot:    {plot}")
    print(f"[demo] policy:  {ppo_dir} (LoRA adapter + tokenizer + model card; figures in {out / 'summary.json'})")
    print(f"[demo] load it: {summary['load_command']}")
    return summary

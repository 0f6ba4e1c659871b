"""The offline twin of the GSM8K recipe: a verifiable-reward task that runs on a CPU in minutes.

    python -m hf_ppo.cli.arithmetic --output_dir outputs/arithmetic     # build (cached), train, print before -> after
    hf-ppo train --config hf_ppo/cli/configs/arithmetic.yaml           # the training alone, once the above has run

Questions are generated locally ("What is 7 + 15?", both numbers up to 19) with an `answer` column ("22"); the
reward is `hf_ppo.rewards.exact_answer`, which reads the completion's "#### <number>" and compares it with the row's
`answer`, exactly as on GSM8K. The policy is the demo's tiny Llama (`hf_ppo.cli.tiny`: random init, hidden 64, 2
layers) after a short supervised pass on worked questions ("What is 7 + 15? #### 22"), short on purpose: it has
learned the format and some of the sums, not all of them. PPO with `reward_funcs` then raises the share it gets
right; accuracy is measured greedily on held-out questions (never trained on) before and after.

The SFT policy is cached under `<output_dir>/cache/<CACHE_VERSION>/sft`, like the demo's. The question files and
`summary.json` in `<output_dir>` are rewritten only when this command wrote them (`check_output_files`): a file of
yours of one of those names stops it first, kept as it is.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch

from . import demo
from .demo import quiet_console, sft_tiny_policy

# Bump when the questions, the model or its training change: old caches are then ignored, not reused.
CACHE_VERSION = "v1"
MAX_OPERAND = 19  # a + b with 0 <= a, b <= 19: 400 questions, answers 0-38
HELD_OUT = 0.2  # share of the questions kept for evaluation only (80), never trained on
# Stops while the policy still gets most sums wrong (about 15-20% greedy): it has the format and some of the sums.
SFT_STEPS = 300


def cached(build, out_dir: Path, rebuild: bool, label: str) -> None:
    """Run `build(out_dir)` unless a finished build is there already (the demo's cache rule, `demo.cached`)."""
    demo.cached(build, out_dir, rebuild, label, tag="arithmetic", version=CACHE_VERSION)


def arithmetic_config() -> Path:
    """hf_ppo/cli/configs/arithmetic.yaml, the config of the task's PPO stage."""
    return demo.CONFIGS / "arithmetic.yaml"


def question(a: int, b: int) -> str:
    """The prompt of one question; the policy answers after it, with " #### <sum>"."""
    return f"What is {a} + {b}?"


def split_pairs(seed: int = 0, max_operand: int = MAX_OPERAND, held_out: float = HELD_OUT):
    """(train pairs, held-out pairs): every (a, b) with 0 <= a, b <= max_operand, shuffled and split."""
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    cut = round(len(pairs) * held_out)
    return pairs[cut:], pairs[:cut]


def rows(pairs, repeat: int = 1) -> list[dict]:
    """Dataset rows {"prompt", "answer"} for `pairs`, each repeated `repeat` times."""
    return [{"prompt": question(a, b), "answer": str(a + b)} for a, b in pairs] * repeat


QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")
QUESTION_FILES = ("train.jsonl", "test.jsonl")
SUMMARY_FILE = "summary.json"
SUMMARY_KEYS = {"seed", "accuracy_before", "accuracy_after", "held_out_questions", "optimizer_steps", "seconds",
                "policy"}


def _task_questions(path: Path) -> bool:
    """Whether `path` holds this task's question rows only ({"prompt": "What is a + b?", "answer": "<a + b>"}): a file
    `main` wrote, whatever version split the questions."""
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            match = QUESTION.fullmatch(row["prompt"]) if isinstance(row, dict) and set(row) == {"prompt", "answer"} \
                else None
            if match is None or row["answer"] != str(int(match.group(1)) + int(match.group(2))):
                return False
    except (OSError, UnicodeDecodeError, ValueError, TypeError):  # a folder, a binary file, a line that is no JSON
        return False
    return True


def _task_summary(path: Path) -> bool:
    """Whether `path` is a summary `main` wrote: a JSON object with its keys."""
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(summary, dict) and SUMMARY_KEYS <= set(summary)


def check_output_files(out: Path) -> None:
    """Before anything is built: `main` rewrites train.jsonl, test.jsonl and summary.json in `out` only when it wrote
    them. A file of one of those names that it did not write (your own data) stops the run, naming it; it is kept."""
    foreign = [out / name for name in QUESTION_FILES if (out / name).exists() and not _task_questions(out / name)]
    if (out / SUMMARY_FILE).exists() and not _task_summary(out / SUMMARY_FILE):
        foreign.append(out / SUMMARY_FILE)
    if foreign:
        raise SystemExit(f"{', '.join(map(str, foreign))}: not written by hf_ppo (not the arithmetic task's "
                         f"{'files' if len(foreign) > 1 else 'file'}), and this command would overwrite "
                         f"{'them' if len(foreign) > 1 else 'it'}. Nothing was changed. Run it with another "
                         "--output_dir (a new folder), or move those files away.")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    """`records` as a jsonl file (one JSON object per line); returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build_sft_policy(out_dir: Path, seed: int = 0, max_steps: int = SFT_STEPS, verbose: bool = False) -> Path:
    """The demo's tiny policy, given a short supervised pass on worked training questions; saved to `out_dir`."""
    train_pairs, _ = split_pairs(seed)
    texts = [f"{r['prompt']} #### {r['answer']}" for r in rows(train_pairs, repeat=8)]
    random.Random(seed).shuffle(texts)
    return sft_tiny_policy(texts, out_dir, seed=seed, max_steps=max_steps, stage="1/3 SFT policy", verbose=verbose,
                           lr_scheduler_type="constant")


@torch.no_grad()
def accuracy(model, tokenizer, records: list[dict], max_new_tokens: int = 8) -> float:
    """Share of `records` whose greedy completion `exact_answer` scores 1 (the policy's accuracy)."""
    from ..rewards import exact_answer

    model.eval()
    enc = tokenizer([r["prompt"] for r in records], return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    scores = exact_answer(completions, [r["answer"] for r in records])
    return sum(scores) / len(scores)


def load_policy(path: Path):
    """The policy saved at `path`: full weights, or a LoRA adapter over its base."""
    from transformers import AutoModelForCausalLM

    if (Path(path) / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path)


def main(argv: list[str] | None = None, prog: str = "python -m hf_ppo.cli.arithmetic") -> dict:
    """Build (or reuse) the SFT policy and the question files, run `hf-ppo train` on the arithmetic recipe, print
    held-out accuracy before -> after; return a summary dict."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="outputs/arithmetic")
    parser.add_argument("--seed", type=int, default=0, help="PPO seed (the cached SFT policy does not depend on it).")
    parser.add_argument("--rebuild", action="store_true", help="Retrain the cached SFT policy.")
    parser.add_argument("--verbose", action="store_true", help="Print every logged metric dict.")
    args, overrides = parser.parse_known_args(argv)  # anything else goes to the recipe, e.g. --max_steps 16

    quiet_console()
    from transformers import AutoTokenizer

    from . import train

    start = time.perf_counter()
    out = Path(args.output_dir).resolve()
    check_output_files(out)  # before anything is built or written: a user's file of these names is kept
    sft_dir = out / "cache" / CACHE_VERSION / "sft"
    cached(lambda d: build_sft_policy(d, verbose=args.verbose), sft_dir, args.rebuild, "1/3 SFT policy")
    train_pairs, held_out_pairs = split_pairs()
    train_file = write_jsonl(out / "train.jsonl", rows(train_pairs))
    test_records = rows(held_out_pairs)
    write_jsonl(out / "test.jsonl", test_records)
    tokenizer = AutoTokenizer.from_pretrained(sft_dir)
    before = accuracy(load_policy(sft_dir), tokenizer, test_records)
    print(f"[arithmetic] SFT policy: {before:.1%} of {len(test_records)} held-out questions right (greedy)")

    print("[arithmetic] 2/3 PPO: hf-ppo train --config hf_ppo/cli/configs/arithmetic.yaml")
    console = ["--print_metrics", "true"] if args.verbose else ["--num_sample_generations", "0"]
    trainer = train.main(["--config", str(arithmetic_config()), "--model_name_or_path", str(sft_dir),
                          "--dataset_name", str(train_file), "--output_dir", str(out / "ppo"),
                          "--seed", str(args.seed), *console, *overrides], command="hf-ppo train")
    after = accuracy(load_policy(out / "ppo"), tokenizer, test_records)
    total_s = time.perf_counter() - start
    print(f"[arithmetic] 3/3 held-out accuracy (greedy, {len(test_records)} questions): {before:.1%} (SFT) -> "
          f"{after:.1%} (PPO) in {total_s:.0f}s, {trainer.state.global_step} optimizer steps")
    summary = {"seed": args.seed, "accuracy_before": before, "accuracy_after": after,
               "held_out_questions": len(test_records), "optimizer_steps": trainer.state.global_step,
               "seconds": round(total_s, 1), "policy": str(out / "ppo")}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()

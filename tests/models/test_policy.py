"""models/policy.py's reference: a reference of the policy's own checkpoint at another precision is said at
construction, since the KL penalty then starts at the quantization gap instead of 0."""

from __future__ import annotations

import warnings

import torch

from hf_ppo import PPOConfig, PPOLMTrainer


def build(tmp_path, tiny_models, tokenizer, peft_config=None, **settings):
    """A trainer whose ref_model is the policy's own checkpoint, and the precision warnings its construction gave."""
    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", response_length=4,
                     reward_quantization="none", **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                               reward_model=lambda p, c: [0.0] * len(c), ref_model=tiny_models["policy"],
                               peft_config=peft_config)
    return trainer, [str(w.message) for w in caught if "is the checkpoint the policy starts from" in str(w.message)]


def token_logprobs(model, tokenizer):
    ids = torch.tensor([tokenizer("the movie was great and the plot").input_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]


def test_the_policys_own_checkpoint_as_a_4bit_reference_of_a_full_precision_policy_is_said(tmp_path, tiny_models,
                                                                                              tokenizer):
    trainer, said = build(tmp_path, tiny_models, tokenizer)  # ref_quantization's default: 4bit
    assert len(said) == 1, said
    assert "'4bit' (ref_quantization)" in said[0] and "ref_quantization='none'" in said[0]
    assert "ref_model=None" in said[0]
    # What it warns about is real: the 4-bit copy differs from the policy before any step.
    policy = trainer.accelerator.unwrap_model(trainer.model).policy_model
    assert (token_logprobs(policy, tokenizer) - token_logprobs(trainer.ref_model, tokenizer)).abs().max() > 1e-3


def test_a_reference_at_the_policys_precision_is_not_said(tmp_path, tiny_models, tokenizer):
    from peft import LoraConfig

    assert build(tmp_path / "full", tiny_models, tokenizer, ref_quantization="none")[1] == []
    # QLoRA: the policy's base in 4 bits, the reference loaded in 4 bits alike.
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    assert build(tmp_path / "qlora", tiny_models, tokenizer, peft_config=lora, policy_quantization="4bit")[1] == []
    # LoRA on a full-precision base with the default 4-bit reference of that base: said.
    assert len(build(tmp_path / "lora", tiny_models, tokenizer, peft_config=lora)[1]) == 1

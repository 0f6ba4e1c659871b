"""One whole PPO iteration against a plain reference written from the equations (tests/plain_ppo.py).

For the responses hf_ppo sampled in its second iteration (so the policy has moved from the reference and the value
head from zero), every field of the rollout batch, the loss of the first optimizer step and its gradients must match
the reference, which runs each sequence alone through the models (no padding, no KV cache). Three set-ups: a
full-precision GPT-2 policy (absolute positions: wrong position ids show), LoRA with the adapter-disabled policy as
reference, and a reward model with its own tokenizer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from tests import plain_ppo
from hf_ppo import PPOConfig
from tests.wiring_models import PROMPTS, RecordingTrainer, build_wiring_models

CASES = {
    "full_precision": dict(policy="gpt2", reward="reward", peft=False, kl_estimator="k1", entropy_coef=0.01),
    "lora_adapter_disabled_reference": dict(policy="llama", reward="reward", peft=True, kl_estimator="k3",
                                            entropy_coef=0.0),
    "reward_model_with_another_tokenizer": dict(policy="llama", reward="other_reward", peft=False, kl_estimator="k2",
                                                entropy_coef=0.0),
}
CAPTURED_CALL = 1  # the first micro-batch (= the whole rollout, one step) of the second iteration
TIGHT = dict(rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return build_wiring_models(tmp_path_factory.mktemp("reference_models"))


def _config(tmp_path, case) -> PPOConfig:
    return PPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(PROMPTS), gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=1, max_steps=2, response_length=8, learning_rate=1e-3,
        lr_scheduler_type="constant", max_grad_norm=0.0, temperature=0.7, kl_coef=0.2,
        kl_estimator=case["kl_estimator"], vf_coef=0.3, entropy_coef=case["entropy_coef"], cliprange=0.2,
        cliprange_value=0.25, gamma=0.99, lam=0.9, missing_eos_penalty=0.5, reward_quantization="none",
        report_to=[], save_strategy="no", num_sample_generations=0, disable_tqdm=True, logging_steps=1, seed=3,
        # fp32 where CUDA is visible too (bf16 is the GPU's default): the reference computes in fp32 and every field
        # must match it to fp32 rounding. On the CPU this is the default.
        bf16=False,
    )


@pytest.mark.parametrize("name", list(CASES))
def test_one_iteration_matches_the_plain_reference(name, paths, tmp_path):
    case = CASES[name]
    args = _config(tmp_path, case)
    peft_config = (LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM") if case["peft"]
                   else None)
    trainer = RecordingTrainer(model=paths[case["policy"]], args=args, reward_model=paths[case["reward"]],
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=peft_config,
                               snapshot_calls=[CAPTURED_CALL])
    trainer.train()
    tokenizer = trainer.processing_class
    batch = trainer.micro_batches[CAPTURED_CALL]
    model, _ = trainer.snapshots[CAPTURED_CALL]
    assert len(batch) == len(PROMPTS), "the first micro-batch of an iteration should hold the whole rollout"

    # The reference's own models: the starting policy from disk, the reward model (and its tokenizer) from disk.
    ref_lm = AutoModelForCausalLM.from_pretrained(paths[case["policy"]]).eval()
    reward_model = AutoModelForSequenceClassification.from_pretrained(paths[case["reward"]]).eval()
    own_tokenizer = case["reward"] == "other_reward"
    reward_tokenizer = AutoTokenizer.from_pretrained(paths[case["reward"]]) if own_tokenizer else None
    policy_lm = model.pretrained_model.eval()

    # Prompts: left-padded with the pad token, each one a tokenized dataset prompt.
    tokenized = {tuple(tokenizer(p)["input_ids"]) for p in PROMPTS}
    rows = []
    for i in range(len(batch)):
        mask = batch.query_mask[i]
        first = int(mask.float().argmax())
        assert mask[first:].all() and not mask[:first].any(), "prompts must be left-padded"
        assert (batch.queries[i][~mask] == tokenizer.pad_token_id).all()
        prompt = batch.queries[i][mask].tolist()
        assert tuple(prompt) in tokenized
        rows.append((prompt, batch.responses[i].tolist()))
    assert len({tuple(p) for p, _ in rows}) == len(PROMPTS), "every prompt once per rollout"

    kw = dict(temperature=args.temperature, kl_coef=args.kl_coef, kl_estimator=args.kl_estimator, gamma=args.gamma,
              lam=args.lam, missing_eos_penalty=args.missing_eos_penalty)
    seqs = plain_ppo.rollout(rows, policy_lm=policy_lm, v_head=model.v_head, ref_lm=ref_lm, reward_model=reward_model,
                             policy_tokenizer=tokenizer, reward_tokenizer=reward_tokenizer,
                             stop_token_id=tokenizer.eos_token_id, **kw)
    # The set-up must exercise what it checks: early stops and full-length responses, a moved policy.
    assert 0 < sum(s["stopped"] for s in seqs) < len(seqs), [s["n"] for s in seqs]
    assert max(abs(k) for s in seqs for k in s["kl"]) > 1e-4  # 5x TIGHT atol (a GPU samples other tokens: 4e-4 seen)
    assert max(abs(v) for s in seqs for v in s["values"]) > 1e-3

    B, R = batch.responses.shape
    expected = {"queries": batch.queries.cpu(), "query_mask": batch.query_mask.cpu()}  # checked above
    expected["response_mask"] = torch.tensor([[t < s["n"] for t in range(R)] for s in seqs])
    expected["responses"] = torch.tensor([s["response"][:s["n"]] + [tokenizer.pad_token_id] * (R - s["n"])
                                          for s in seqs])
    expected["policy_mask"] = expected["response_mask"]  # no environment: every response token is the policy's
    expected["contains_stop"] = torch.tensor([s["stopped"] for s in seqs])
    expected["scores"] = torch.tensor([s["score"] for s in seqs])
    for field in ("logprobs", "ref_logprobs", "values", "rewards", "non_score_rewards", "advantages", "returns"):
        expected[field] = torch.tensor([s[field] + [0.0] * (R - s["n"]) for s in seqs])
    expected["sampling_logprobs"] = expected["logprobs"]  # the engine sampled the policy itself
    names = {f.name for f in dataclasses.fields(batch)}
    assert names == set(expected), f"RolloutBatch fields not pinned by this test: {names ^ set(expected)}"

    mask = expected["response_mask"]
    for field, want in expected.items():
        got = getattr(batch, field).cpu()  # the run's tensors are on its device, `expected` was built on the CPU
        if want.dtype == torch.bool or want.dtype == torch.long:
            assert torch.equal(got, want), field
        elif field in ("logprobs", "ref_logprobs", "values", "sampling_logprobs"):  # undefined at padding
            torch.testing.assert_close(got[mask].float(), want[mask].float(), **TIGHT, msg=field)
        else:  # rewards, advantages, returns: documented as 0 at padding
            torch.testing.assert_close(got.float(), want.float(), **TIGHT, msg=field)

    # The first optimizer step: its loss and gradients.
    reference_loss = plain_ppo.loss(seqs, policy_lm=policy_lm, v_head=model.v_head, temperature=args.temperature,
                                    cliprange=args.cliprange, cliprange_value=args.cliprange_value,
                                    vf_coef=args.vf_coef, entropy_coef=args.entropy_coef)
    torch.testing.assert_close(trainer.losses[CAPTURED_CALL], reference_loss.detach(), rtol=1e-4, atol=1e-6)
    reference_loss.backward()
    expected_grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    grads = trainer.step_grads[CAPTURED_CALL]
    assert set(grads) == {n for n, g in expected_grads.items() if g is not None}
    for param, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[param], rtol=1e-3, atol=1e-6, msg=param)

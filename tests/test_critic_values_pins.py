"""Issue 41, critics of their own: the value of response token t is the critic's own, read where documented.

GAE's V(s_t) for response token t is the critic's output at the state before that token: the last token of
prompt + response[:t] (position Q - 1 + t of the unpadded sequence; `rollout.steps.policy_forward` and the trainer's
`compute_loss` both keep the last R + 1 positions and drop the final one). A critic that reads a consistent
off-by-one position, or lets the left padding in, still trains self-consistently (rollout and loss agree); only a
comparison with the critic run by hand over each sequence alone shows it. For every `PPOConfig.critic` (the shared
head; 'separate' from a `critic_model` with absolute positions, GPT-2; 'separate' with LoRA from the reward model;
'reward_lora'; 'separate' from a reward model with a tokenizer of its own) the values the rollout stored and the
values the loss was given (new and old) are checked against that hand computation, for left-padded prompts of
different lengths:

- at the first micro-batch (nothing trained yet), a critic started from a one-label reward model is that model's
  own score (its pooled output) of each prefix: V_t = reward(prompt + response[:t]) (the N+ initialisation);
- at the second iteration's first micro-batch (the critic has moved), the critic's own modules, copied as they were
  when that loss was computed, run on prompt + response with no padding and no position ids.

A critic with another vocabulary is refused at construction (tests/test_critics.py), so "a critic with its own
tokenizer" here is one whose tokenizer gives the policy's ids their meaning but pads on the right with another pad
token: it must still read the policy's left-padded ids as they are.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import hf_ppo.trainer.ppo_trainer as ppo_trainer_module
import plain_ppo
from hf_ppo import PPOConfig
from hf_ppo.models.actor_critic import PolicyAndCritic
from hf_ppo.models.critics import ValueModel
from hf_ppo.models.value_head import AutoModelForCausalLMWithValueHead
from wiring_models import PROMPTS, RecordingTrainer, build_wiring_models

CASES = {
    # The shared head on a GPT-2 policy (absolute positions: position ids that ignore the padding show).
    "shared": dict(policy="gpt2", reward="reward", critic="shared", peft=False),
    # A fully fine-tuned critic from critic_model, a GPT-2 sequence classifier (absolute positions again).
    "separate_gpt2_critic_model": dict(policy="llama", reward="reward", critic="separate", critic_model="gpt2_reward",
                                       peft=False),
    "separate_lora": dict(policy="llama", reward="reward", critic="separate", peft=True),
    "reward_lora": dict(policy="llama", reward="reward", critic="reward_lora", peft=True),
    # Started from a reward model whose own tokenizer has the policy's vocabulary but pads on the right with <unk>.
    "separate_own_tokenizer": dict(policy="llama", reward="reward_own_tokenizer", critic="separate", peft=False),
}
SNAPSHOT_CALL = 1  # the second iteration's first micro-batch: one optimizer step after the start
TIGHT = dict(rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic_value_models")
    paths = build_wiring_models(root)
    own = str(root / "reward_own_tokenizer")
    shutil.copytree(paths["reward"], own)
    tokenizer = AutoTokenizer.from_pretrained(own)
    tokenizer.padding_side, tokenizer.pad_token = "right", "<unk>"
    tokenizer.save_pretrained(own)
    reloaded = AutoTokenizer.from_pretrained(own)
    policy_pad = AutoTokenizer.from_pretrained(paths["llama"]).pad_token_id
    assert (reloaded.padding_side, reloaded.pad_token) == ("right", "<unk>") and reloaded.pad_token_id != policy_pad
    paths["reward_own_tokenizer"] = own
    return paths


def _args(tmp_path, case) -> PPOConfig:
    # One step per iteration, its one micro-batch the whole (shuffled) rollout; no clipping of the gradient.
    return PPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(PROMPTS), gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=1, max_steps=2, response_length=8, learning_rate=1e-2,
        lr_scheduler_type="constant", max_grad_norm=0.0, temperature=0.7, kl_coef=0.2, vf_coef=0.5,
        missing_eos_penalty=0.5, reward_quantization="none", critic=case["critic"], report_to=[], save_strategy="no",
        num_sample_generations=0, disable_tqdm=True, logging_steps=1, seed=3, apply_chat_template_to_text=False)


@pytest.fixture(scope="module")
def trained(request, paths, tmp_path_factory):
    """One 2-step run per critic: its micro-batches, a copy of the model at the second one, and the (new, old)
    values every `compute_loss` handed to `ppo_loss`."""
    case = CASES[request.param]
    given = []
    original = ppo_trainer_module.ppo_loss

    def recording_ppo_loss(logits, values, old, *args, **kwargs):
        given.append((values.detach().clone(), old.values.detach().clone()))
        return original(logits, values, old, *args, **kwargs)

    peft = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM") if case["peft"] else None
    critic_model = paths[case["critic_model"]] if "critic_model" in case else None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ppo_trainer_module, "ppo_loss", recording_ppo_loss)
        trainer = RecordingTrainer(
            model=paths[case["policy"]], args=_args(tmp_path_factory.mktemp(request.param), case),
            reward_model=paths[case["reward"]], train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            peft_config=peft, critic_model=critic_model, snapshot_calls=[SNAPSHOT_CALL])
        trainer.train()
    assert len(trainer.micro_batches) == len(given) == 2
    return request.param, case, trainer, given


def values_by_hand(model, query: list[int], response: list[int]) -> torch.Tensor:
    """The critic's value of each response token (n,), fp32, from one pass over prompt + response alone (no padding,
    no mask, no position ids): the shared head on the hidden state the LM head reads, or a critic's value head on
    its backbone's last hidden state, at position Q - 1 + t for token t."""
    ids, start = query + response, len(query) - 1
    with torch.no_grad():
        if isinstance(model, AutoModelForCausalLMWithValueHead):
            _, hidden = plain_ppo.run_alone(model.pretrained_model.eval(), ids)
            return torch.stack([plain_ppo.value_of(model.v_head, row) for row in hidden[start:start + len(response)]])
        critic = model.critic.eval()
        hidden = critic.backbone(input_ids=torch.tensor([ids])).last_hidden_state[0, start:start + len(response)]
        return hidden.float() @ critic.head.weight[0].float() + critic.head.bias[0].float()


def prefix_scores(reward_model, query: list[int], response: list[int]) -> torch.Tensor:
    """A one-label reward model's own score (its pooled output) of prompt + response[:t], for each t (n,)."""
    with torch.no_grad():
        return torch.stack([reward_model(input_ids=torch.tensor([query + response[:t]])).logits[0, 0].float()
                            for t in range(len(response))])


def check_values(batch, given, by_hand, label: str) -> None:
    """Row by row: the values of a row's response tokens are by_hand(prompt, response) in the rollout batch and in the
    new and old values the loss got, whatever the row's left padding."""
    new_values, old_values = given
    assert torch.equal(old_values, batch.values), f"{label}: the loss's old values are not the rollout's"
    lengths = batch.query_mask.sum(1)
    assert len(set(lengths.tolist())) > 2 and (~batch.query_mask).any(), "prompts of different lengths, left-padded"
    moving = 0.0
    for i in range(len(batch)):
        query = batch.queries[i][batch.query_mask[i]].tolist()
        n = int(batch.response_mask[i].sum())
        expected = by_hand(query, batch.responses[i][:n].tolist())
        torch.testing.assert_close(batch.values[i, :n], expected, **TIGHT, msg=f"{label}: rollout values, row {i}")
        torch.testing.assert_close(new_values[i, :n].detach().float(), expected, **TIGHT,
                                   msg=f"{label}: the loss's values, row {i}")
        if n > 1:
            moving = max(moving, (expected[1:] - expected[:-1]).abs().max().item())
    # A position read one off must show: the values change from one token to the next by far more than the tolerance.
    assert moving > 1e-3, f"{label}: values almost constant along the response ({moving}); a shift would not show"


@pytest.mark.parametrize("trained", list(CASES), indirect=True)
def test_values_are_the_critics_own_at_the_state_before_each_token(trained):
    """Pins the position the value of response token t is read at (the last token of prompt + response[:t]) and that
    left padding changes no value, for every critic kind, in the rollout and in the loss: after one step, against the
    critic's own modules run on each sequence alone. A consistent off-by-one in the critic (rollout and loss read the
    same wrong position), a critic that attends the padding or ignores the position ids fails here."""
    name, case, trainer, given = trained
    model, _ = trainer.snapshots[SNAPSHOT_CALL]
    if case["critic"] == "shared":
        assert isinstance(model, AutoModelForCausalLMWithValueHead)
    else:
        assert isinstance(model, PolicyAndCritic) and isinstance(model.critic, ValueModel)
        assert model.critic.kind == case["critic"]
    batch = trainer.micro_batches[SNAPSHOT_CALL]
    assert batch.response_mask.sum(1).min() < batch.response_mask.shape[1], "some response stopped early"
    check_values(batch, given[SNAPSHOT_CALL], lambda q, r: values_by_hand(model, q, r), f"{name}, moved critic")


@pytest.mark.parametrize("trained", [name for name, case in CASES.items() if case["critic"] != "shared"],
                         indirect=True)
def test_a_critic_from_a_reward_model_starts_as_its_score_of_each_prefix(trained, paths):
    """Pins what the N+ initialisation promises, through the whole rollout and loss: before any step, the value of
    response token t of a critic started from a one-label reward model ('separate' by default, from critic_model,
    'reward_lora') is that reward model's score of prompt + response[:t], computed here from the model on disk. A
    critic reading the score one position late (the reward of prompt + response[:t + 1]) or through the padding
    fails here."""
    name, case, trainer, given = trained
    source = paths[case.get("critic_model", case["reward"])]
    reward_model = AutoModelForSequenceClassification.from_pretrained(source).eval()
    check_values(trainer.micro_batches[0], given[0], lambda q, r: prefix_scores(reward_model, q, r),
                 f"{name}, at the start")

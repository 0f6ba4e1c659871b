"""The actor-critic interface the trainer uses, on `modeling.PolicyAndCritic`: a policy with no critic (the
critic-free estimators) or with a critic module of its own. `TinyCritic` below is the smallest module that meets
the critic contract: forward(input_ids, attention_mask, position_ids, logits_to_keep) -> values (batch, kept) fp32,
and trainable_state_dict() / load_trainable_state_dict(state)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hf_ppo.models.value_head import AutoModelForCausalLMWithValueHead
from hf_ppo.models.actor_critic import PolicyAndCritic
from hf_ppo.algorithms.estimators import EstimatorSettings
from hf_ppo.rollout.engines import SamplingSettings
from hf_ppo.rollout.steps import RolloutParts, RolloutSettings, rollout
from hf_ppo.cli.tiny import build_causal_lm
from tests.scripted_engine import ScriptedEngine

# What the trainer, trainer/checkpoint.py and rollout/steps.py use of an actor-critic (AutoModelForCausalLMWithValueHead has them
# all; a new actor-critic must too).
INTERFACE = ["policy_model", "has_critic", "critic_parameters", "critic_device", "critic_state_dict",
             "load_critic_state_dict", "is_peft_model", "quantization_method", "config", "forward",
             "gradient_checkpointing_enable", "gradient_checkpointing_disable"]


class TinyCritic(nn.Module):
    """Token embeddings + a position term -> a linear head; one frozen parameter (not trainable, not in its state)."""

    def __init__(self, vocab_size: int, width: int = 8, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, 1)
        self.scale = nn.Parameter(torch.full((width,), 2.0), requires_grad=False)
        with torch.no_grad():
            for p in (self.embed.weight, self.head.weight, self.head.bias):
                p.copy_(torch.randn(p.shape, generator=generator))

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep: int = 0) -> torch.Tensor:
        hidden = self.embed(input_ids) * self.scale
        if position_ids is not None:
            hidden = hidden + 0.1 * position_ids[..., None].float()
        values = self.head(hidden)[..., 0].float()
        return values[:, -logits_to_keep:] if logits_to_keep else values

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = self.trainable_state_dict()
        if set(state) != set(own):
            raise ValueError(f"critic state has keys {sorted(state)}, expected {sorted(own)}")
        with torch.no_grad():
            for name, value in state.items():
                own[name].copy_(value)


@pytest.fixture(scope="module")
def policy(tok):
    return build_causal_lm(tok, hidden_size=32, num_layers=2).eval()


def model_inputs(inputs) -> dict:
    mask = inputs["attention_mask"]
    return {"input_ids": inputs["input_ids"], "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}


def test_both_actor_critics_have_the_interface(policy):
    for model in (AutoModelForCausalLMWithValueHead(policy), PolicyAndCritic(policy),
                  PolicyAndCritic(policy, TinyCritic(policy.config.vocab_size))):
        missing = [name for name in INTERFACE if not hasattr(model, name)]
        assert not missing, (type(model).__name__, missing)


def test_without_a_critic_forward_is_the_policy_and_there_is_no_critic_state(policy, inputs):
    model = PolicyAndCritic(policy)
    assert model.policy_model is policy and not model.has_critic and not model.is_peft_model
    assert model.config is policy.config and model.critic_device == policy.device
    kwargs = model_inputs(inputs)
    with torch.no_grad():
        for keep in (0, 3):
            out = model(**kwargs, logits_to_keep=keep)
            assert out.value is None
            assert torch.equal(out.logits, policy(**kwargs, logits_to_keep=keep, use_cache=False).logits)
    assert model.critic_parameters() == []
    assert model.critic_state_dict() == {}
    model.load_critic_state_dict({})  # a checkpoint of a critic-free run loads
    with pytest.raises(ValueError, match="holds a critic"):
        model.load_critic_state_dict({"head.weight": torch.zeros(1, 8)})


def test_with_a_critic_its_values_come_through_with_the_kept_shape(policy, inputs):
    critic = TinyCritic(policy.config.vocab_size)
    model = PolicyAndCritic(policy, critic)
    assert model.has_critic and model.critic_device == critic.embed.weight.device
    kwargs = model_inputs(inputs)
    B, T = kwargs["input_ids"].shape
    with torch.no_grad():
        full = model(**kwargs)
        kept = model(**kwargs, logits_to_keep=3)
        assert torch.equal(full.logits, policy(**kwargs, use_cache=False).logits)
        assert torch.equal(full.value, critic(**kwargs))  # the critic sees the same ids, mask and positions
    assert full.value.shape == (B, T) and full.value.dtype == torch.float32
    assert kept.value.shape == (B, 3) and kept.logits.shape[:2] == (B, 3)
    assert torch.equal(kept.value, full.value[:, -3:])
    # Only the critic's trainable parameters are the critic's; the frozen one is not.
    assert {id(p) for p in model.critic_parameters()} == {id(p) for p in critic.trainable_state_dict().values()}
    assert all(p is not critic.scale for p in model.critic_parameters())


def test_the_value_loss_trains_the_critic_alone(policy, inputs):
    critic = TinyCritic(policy.config.vocab_size)
    model = PolicyAndCritic(policy, critic)
    model.zero_grad(set_to_none=True)
    model(**model_inputs(inputs)).value.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.critic_parameters())
    assert critic.scale.grad is None
    assert all(p.grad is None for p in policy.parameters())  # a critic of its own: no gradient into the policy
    model.zero_grad(set_to_none=True)


def test_critic_state_round_trips_through_a_checkpoint_file(policy, inputs, tmp_path):
    trained = PolicyAndCritic(policy, TinyCritic(policy.config.vocab_size, seed=0))
    state = trained.critic_state_dict()
    assert set(state) == {"embed.weight", "head.weight", "head.bias"}  # trainable only
    assert all(v.device.type == "cpu" and not v.requires_grad and v.is_contiguous() for v in state.values())
    save_file(state, str(tmp_path / "critic.safetensors"))  # checkpoint.py's format

    fresh = PolicyAndCritic(policy, TinyCritic(policy.config.vocab_size, seed=1))
    kwargs = model_inputs(inputs)
    with torch.no_grad():
        before = fresh(**kwargs).value
        fresh.load_critic_state_dict(load_file(str(tmp_path / "critic.safetensors")))
        assert not torch.equal(before, trained(**kwargs).value)
        assert torch.equal(fresh(**kwargs).value, trained(**kwargs).value)
    for name, value in fresh.critic_state_dict().items():
        assert torch.equal(value, state[name]), name
    with pytest.raises(ValueError):  # the critic's own check on what it is given
        fresh.load_critic_state_dict({"head.bias": state["head.bias"]})


def test_rollout_values_are_the_critics_at_each_response_token(policy, tok):
    """Through `rollout()`: the value of response token t is the critic's at the position before it, as the critic
    computes it for the sequence alone (no padding), so positions and slicing line up."""
    critic = TinyCritic(policy.config.vocab_size)
    model = PolicyAndCritic(policy, critic)
    prompts = ["the movie was great", "bad"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    eos = tok.eos_token_id
    great, good = tok.convert_tokens_to_ids("Ġgreat"), tok.convert_tokens_to_ids("Ġgood")
    engine = ScriptedEngine([[great, good, eos, good], [good, good, great, great]])
    parts = RolloutParts(engine, lambda p, c: [1.0] * len(c), tok, [eos])
    settings = RolloutSettings(SamplingSettings(response_length=4, temperature=1.0, forward_batch_size=2),
                               EstimatorSettings(kl_coef=0.05, gamma=1.0, lam=0.95, whiten_advantages=False))
    result = rollout(model, batch["input_ids"], batch["attention_mask"].bool(), prompts, parts, settings)
    rb = result.batch
    assert engine.events[0][1] is policy
    for row in range(len(prompts)):
        query = rb.queries[row][rb.query_mask[row]]
        response = rb.responses[row][rb.response_mask[row]]
        ids = torch.cat([query, response])[None]
        with torch.no_grad():
            alone = critic(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])[0]
        n = len(response)
        torch.testing.assert_close(rb.values[row, :n], alone[len(query) - 1:len(query) - 1 + n], rtol=0, atol=1e-6)
    assert result.stats["objective/kl"].item() == 0  # no adapter, no ref_model: the reference is the policy itself

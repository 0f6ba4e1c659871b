"""The actor-critic interface the trainer trains, and its general implementation.

`ActorCritic` is what every actor-critic shares: the policy is `pretrained_model` (a causal LM or its `PeftModel`),
the config is the policy's, and the critic is saved with `save_critic`. `PolicyAndCritic` pairs the policy with a
critic that has a body of its own (`models.critics.ValueModel`, or any module with the critic interface), or with no
critic at all (the critic-free estimators). `AutoModelForCausalLMWithValueHead` (`value_head.py`) is the other
implementation: the critic is a head on the policy's body. `CausalLMOutputWithValue` is what both return."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from ..runtime.versions import (
    CACHE,
    GradientCheckpointingNames,
    checkpointing_disable,
    checkpointing_enable,
    supports_checkpointing,
)
from .critics import save_critic


@dataclass
class CausalLMOutputWithValue(ModelOutput):
    """loss: the causal-LM loss when `labels` were given; logits: (batch, kept_len, vocab); value: (batch, kept_len),
    fp32; past_key_values: only when asked for (`use_cache=True` or `return_past_key_values=True`).

    Read it by name (`out.logits`, `out.loss`, `out.value`), or by position as TRL's tuple was read:
    `logits, loss, value = model(...)`, `out[2]` is the value. Positions are fixed (loss is None without labels), so
    unpacking never shifts; `past_key_values` is a fourth element only when present.

    The field is `value`, not `values`: a ModelOutput is a mapping, and a `values` field would hide `.values()`,
    which DDP and pytree flattening call on outputs.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    value: torch.Tensor | None = None
    # The KV cache, under the field name of the installed transformers (`cache` from 5.24, `past_key_values` before);
    # the other name is a property, so code written for either reads it without a deprecation warning.
    if CACHE == "cache":
        cache: object | None = None

        @property
        def past_key_values(self):
            return self.cache
    else:
        past_key_values: object | None = None

        @property
        def cache(self):
            return self.past_key_values

    def to_tuple(self) -> tuple:
        """(logits, loss, value[, cache]): TRL 0.x's tuple order, with None kept in place."""
        base = (self.logits, self.loss, self.value)
        return base if self.cache is None else (*base, self.cache)

    def __iter__(self):
        # Iterating gives the tuple, as unpacking TRL's output did (the keys stay available through `.keys()`).
        return iter(self.to_tuple())


class ActorCritic(GradientCheckpointingNames, nn.Module):
    """What every actor-critic the trainer trains shares: the policy is `pretrained_model` (a causal LM or its
    `PeftModel`), and the model's config is the policy's."""

    @property
    def config(self):
        return self.pretrained_model.config

    @property
    def is_peft_model(self) -> bool:
        return hasattr(self.pretrained_model, "peft_config")

    @property
    def policy_model(self) -> nn.Module:
        """The policy alone (the causal LM, or its `PeftModel`): what samples, is saved and is published."""
        return self.pretrained_model

    def save_critic(self, folder: str, tokenizer=None) -> str:
        """Write the critic to `folder` (`critics.save_critic`; a fully fine-tuned critic needs the policy's
        `tokenizer`): a later run starts from it with `PPOLMTrainer(critic_model=folder)`. Returns the folder."""
        return save_critic(self, folder, tokenizer)

    def push_critic_to_hub(self, *args, **kwargs):
        """Moved off the model class: a model never publishes itself. Raises an error naming the replacements."""
        raise AttributeError(
            "model.push_critic_to_hub moved: push the critic with trainer.push_critic_to_hub(repo_id) (the trainer "
            "knows the tokenizer), or hf_ppo.hub.push_critic(model, repo_id, tokenizer). Nothing was uploaded.")

    @property
    def _no_split_modules(self) -> list[str]:
        """The decoder-layer classes of the models inside (policy, critic), as transformers names them: accelerate's
        FSDP auto-wrap reads this to give each layer a shard group of its own (else the whole model is one)."""
        names = {name for module in self.modules() if module is not self and isinstance(module, PreTrainedModel)
                 for name in (module._no_split_modules or [])}
        return sorted(names)


class PolicyAndCritic(ActorCritic):
    """The actor-critic when the critic is not the shared value head: the policy (a causal LM or its `PeftModel`) and
    a critic with a body of its own, or no critic at all (the critic-free advantage estimators).

    It has the interface of `AutoModelForCausalLMWithValueHead`, which is what the trainer uses: `forward` gives the
    policy's logits and the critic's `value` (None without a critic), and `policy_model`, `critic_parameters()`,
    `critic_device`, `critic_state_dict()` / `load_critic_state_dict()`. A critic is any module with
    `forward(input_ids, attention_mask, position_ids, logits_to_keep) -> values (batch, kept) fp32` (one value per
    position, aligned with the logits; the last `logits_to_keep` positions, 0 = all) and `trainable_state_dict()` /
    `load_trainable_state_dict()` (what checkpoints store of it, restored exactly on resume); its parameters with
    `requires_grad` are `critic_parameters()`. Pinned by tests/models/test_actor_critic.py (its `TinyCritic` is a
    complete example); see docs/guides/extending.md.
    """

    def __init__(self, policy: nn.Module, critic: nn.Module | None = None):
        super().__init__()
        self.pretrained_model = policy
        self.critic = critic

    @property
    def quantization_method(self):
        """The policy's quantization method, else the critic's (Trainer never `.to()`-moves a bitsandbytes part)."""
        return (getattr(self.pretrained_model, "quantization_method", None)
                or getattr(self.critic, "quantization_method", None))

    @property
    def has_critic(self) -> bool:
        return self.critic is not None

    def critic_parameters(self) -> list[nn.Parameter]:
        """The critic's trainable parameters (none without a critic)."""
        if self.critic is None:
            return []
        return [p for p in self.critic.parameters() if p.requires_grad]

    @property
    def critic_device(self) -> torch.device:
        module = self.critic if self.critic is not None else self.pretrained_model
        return next(module.parameters()).device

    def critic_state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores of the critic (CPU tensors); empty without a critic."""
        if self.critic is None:
            return {}
        return {k: v.detach().cpu().contiguous() for k, v in self.critic.trainable_state_dict().items()}

    def load_critic_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.critic is None:
            if state:
                raise ValueError(f"The checkpoint holds a critic ({len(state)} tensors) but this run has none.")
            return
        self.critic.load_trainable_state_dict(state)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0, critic_only: bool = False,
                **kwargs) -> CausalLMOutputWithValue:
        """The policy's logits and the critic's values (None without a critic) for the last `logits_to_keep`
        positions (0 = all). input_ids, attention_mask, position_ids: (batch, seq). `critic_only` (the critic
        warm-up): the policy runs without gradients, so the loss can move only the critic."""
        kwargs.setdefault("use_cache", False)
        with torch.no_grad() if critic_only else contextlib.nullcontext():
            out = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                        logits_to_keep=logits_to_keep, **kwargs)
        values = None
        if self.critic is not None:
            values = self.critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 logits_to_keep=logits_to_keep)
        return CausalLMOutputWithValue(loss=getattr(out, "loss", None), logits=out.logits, value=values)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, **kwargs):
        for module in (self.pretrained_model, self.critic):
            if module is not None and supports_checkpointing(module):
                checkpointing_enable(module, activation_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_disable(self):
        for module in (self.pretrained_model, self.critic):
            if module is not None and supports_checkpointing(module):
                checkpointing_disable(module)

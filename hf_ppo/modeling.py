"""`AutoModelForCausalLMWithValueHead`: a causal LM with a scalar value head on the shared body.

One forward pass gives the logits and a value at every position. The wrapped model may be a full-precision or
quantized `PreTrainedModel`, or a `PeftModel`. The head is a `hidden -> 1` linear layer kept in fp32 and
zero-initialised by default (N blog 2023), so the value of every state starts at 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.utils import ModelOutput

VALUE_HEAD_FILE = "value_head.safetensors"
# Files in which a TRL-format head (`v_head.summary.weight` / `.bias`) may be stored.
_TRL_HEAD_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin")


@dataclass
class CausalLMOutputWithValue(ModelOutput):
    """logits: (batch, kept_len, vocab); value: (batch, kept_len), fp32.

    The field is `value`, not `values`: a ModelOutput is a mapping, and a `values` field would hide `.values()`,
    which DDP and pytree flattening call on outputs.
    """

    logits: torch.Tensor | None = None
    value: torch.Tensor | None = None


class AutoModelForCausalLMWithValueHead(nn.Module):
    """Wraps `pretrained_model` (a causal LM or a `PeftModel` around one) and adds `v_head: Linear(hidden, 1)`.

    `generate`, gradient checkpointing and `save_pretrained` pass through to the wrapped model; the head is saved and
    loaded on its own (`value_head.safetensors`), so the saved policy stays a plain model or adapter.
    """

    def __init__(self, pretrained_model: nn.Module, value_head_init_std: float = 0.0):
        super().__init__()
        self.pretrained_model = pretrained_model
        # The head reads what the LM head reads, so its width is the output embedding's input width: not always
        # hidden_size (OPT-350m projects 1024 -> word_embed_proj_dim 512 before its LM head).
        output_embeddings = pretrained_model.get_output_embeddings()
        width = getattr(output_embeddings, "in_features", None) or output_embeddings.weight.shape[1]
        self.v_head = nn.Linear(width, 1, dtype=torch.float32, device=output_embeddings.weight.device)
        if value_head_init_std > 0:
            nn.init.normal_(self.v_head.weight, std=value_head_init_std)
        else:
            nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs) -> "AutoModelForCausalLMWithValueHead":
        """Load the causal LM with `AutoModelForCausalLM.from_pretrained` and, when the folder or repo has one, the
        value head (`value_head.safetensors`, or a TRL-format `v_head.summary.*` in the weights file)."""
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        wrapper = cls(model)
        head = _find_value_head(str(pretrained_model_name_or_path), kwargs.get("revision"), kwargs.get("token"))
        if head is not None:
            wrapper.load_value_head_state_dict(head)
        return wrapper

    @property
    def config(self):
        return self.pretrained_model.config

    @property
    def quantization_method(self):
        """The wrapped model's quantization method (Trainer never `.to()`-moves a bitsandbytes model)."""
        return getattr(self.pretrained_model, "quantization_method", None)

    @property
    def is_peft_model(self) -> bool:
        return hasattr(self.pretrained_model, "peft_config")

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithValue:
        """One pass of the body: logits and values for the last `logits_to_keep` positions (0 = all).

        input_ids, attention_mask, position_ids: (batch, seq). Returns logits (batch, kept, vocab) and `value`
        (batch, kept) computed in fp32 from the hidden state the LM head reads.
        """
        kwargs.setdefault("use_cache", False)  # a scoring/training pass: no KV cache to build
        # The value is read from exactly the tensor the LM head reads (already cut to the kept positions): the final
        # normed, and where the model has one, projected hidden state. A pre-hook finds it for every architecture,
        # without asking the model for all its hidden states.
        head_input = []
        hook = self.pretrained_model.get_output_embeddings().register_forward_pre_hook(
            lambda module, args: head_input.append(args[0]))
        try:
            out = self.pretrained_model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        finally:
            hook.remove()
        values = self.v_head(head_input[-1].to(self.v_head.weight.dtype)).squeeze(-1)
        return CausalLMOutputWithValue(logits=out.logits, value=values)

    def generate(self, *args, **kwargs):
        return self.pretrained_model.generate(*args, **kwargs)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, **kwargs):
        """Checkpoint the body's activations (Trainer calls this when `gradient_checkpointing=True`)."""
        self.pretrained_model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=activation_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_disable(self):
        self.pretrained_model.activation_checkpointing_disable()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None):
        """The older name of `activation_checkpointing_enable`, kept for callers that use it."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self):
        self.activation_checkpointing_disable()

    # ---- saving -----------------------------------------------------------------------------------------------
    def value_head_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in self.v_head.state_dict().items()}

    def load_value_head_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load {'weight', 'bias'}; TRL's `v_head.summary.weight` style keys are accepted too."""
        state = {k.rsplit(".", 1)[-1]: v for k, v in state.items()}
        self.v_head.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})

    def save_value_head(self, save_directory: str) -> str:
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, VALUE_HEAD_FILE)
        save_file(self.value_head_state_dict(), path, metadata={"format": "pt"})
        return path

    def save_pretrained(self, save_directory: str, save_value_head: bool = True, **kwargs):
        """Save the wrapped model (an adapter for a `PeftModel`) and, unless told not to, the value head beside it."""
        self.pretrained_model.save_pretrained(save_directory, **kwargs)
        if save_value_head:
            self.save_value_head(save_directory)


def _find_value_head(name_or_path: str, revision: str | None, token: str | None) -> dict | None:
    """The value head stored with a model, locally or on the Hub; None when there is none."""
    candidates = []
    if os.path.isdir(name_or_path):
        candidates = [os.path.join(name_or_path, f) for f in (VALUE_HEAD_FILE, *_TRL_HEAD_FILES)]
        candidates = [c for c in candidates if os.path.isfile(c)]
    else:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        try:  # the head file is small: fetch it if the repo has one
            candidates.append(hf_hub_download(name_or_path, VALUE_HEAD_FILE, revision=revision, token=token))
        except Exception:  # absent, offline, or no access: the model simply has no separate head
            pass
        for filename in _TRL_HEAD_FILES:  # weights files are already cached by from_pretrained; never re-download
            cached = try_to_load_from_cache(name_or_path, filename, revision=revision)
            if isinstance(cached, str):
                candidates.append(cached)
    for path in candidates:
        if os.path.basename(path) == VALUE_HEAD_FILE:
            return load_file(path)
        if path.endswith(".safetensors"):  # read only the head's tensors, never the whole weights file
            with safe_open(path, framework="pt") as f:
                head = {k: f.get_tensor(k) for k in f.keys() if "v_head." in k}
        else:
            head = {k: v for k, v in torch.load(path, map_location="cpu", weights_only=True).items() if "v_head." in k}
        if head:
            return head
    return None


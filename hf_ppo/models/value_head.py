"""`AutoModelForCausalLMWithValueHead`: a causal LM with a scalar value head on the shared body.

One forward pass gives the logits and a value at every position. The wrapped model may be a full-precision or
quantized `PreTrainedModel`, or a `PeftModel`. The head is a `hidden -> 1` linear layer kept in fp32 and
zero-initialised by default (N blog 2023), so the value of every state starts at 0.

The other critics (`PPOConfig.critic`) implement the same interface (`actor_critic.py`): `PolicyAndCritic` pairs the
policy with a critic of its own (`critics.ValueModel`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from ..runtime.versions import CACHE, checkpointing_disable, checkpointing_enable
from ..runtime.warn import warn_user, without_checkpointing_deprecation
from .actor_critic import ActorCritic, CausalLMOutputWithValue
from .pretrained import reject_seq2seq, reject_seq2seq_checkpoint

VALUE_HEAD_FILE = "value_head.safetensors"
# Where TRL's class saved the head of a PEFT model, beside the adapter (the head's tensors alone).
TRL_ADAPTER_HEAD_FILE = "pytorch_model.bin"
# Files in which a TRL-format head (`v_head.summary.weight` / `.bias`) may be stored, and the shard indexes of the
# two weights formats (a head saved in a sharded checkpoint sits in whichever shard the index names).
_TRL_HEAD_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin")
_SHARD_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# TRL's value-head keyword arguments, accepted by the constructor and `from_pretrained`.
_HEAD_KWARGS = ("value_head_init_std", "v_head_init_strategy", "v_head_initializer_range", "summary_dropout_prob")
# `from_pretrained` keyword arguments that go to peft's `prepare_model_for_kbit_training` (as in TRL).
_KBIT_KWARGS = ("use_gradient_checkpointing", "gradient_checkpointing_kwargs")


class ValueHead(nn.Module):
    """The `hidden -> 1` value head: its linear layer is `.summary`, where TRL's value head kept it, so the model's
    state keys are TRL's (`v_head.summary.weight`, `v_head.summary.bias`) and code written for TRL works;
    `.weight`, `.bias`, `in_features` and `out_features` reach that layer's, as when the head was a Linear. Older
    full state dicts (`v_head.weight`) still load."""

    def __init__(self, width: int, dtype: torch.dtype, device):
        super().__init__()
        self.summary = nn.Linear(width, 1, dtype=dtype, device=device)
        self.register_load_state_dict_pre_hook(_accept_flat_head_keys)

    @property
    def weight(self) -> nn.Parameter:
        return self.summary.weight

    @property
    def bias(self) -> nn.Parameter:
        return self.summary.bias

    @property
    def in_features(self) -> int:
        return self.summary.in_features

    @property
    def out_features(self) -> int:
        return self.summary.out_features

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden)


def _accept_flat_head_keys(module, state_dict, prefix, *args) -> None:
    """`load_state_dict` pre-hook: hf_ppo's earlier keys `v_head.weight` / `v_head.bias` become `v_head.summary.*`."""
    for name in ("weight", "bias"):
        if prefix + name in state_dict and prefix + "summary." + name not in state_dict:
            state_dict[prefix + "summary." + name] = state_dict.pop(prefix + name)



class AutoModelForCausalLMWithValueHead(ActorCritic):
    """Wraps `pretrained_model` (a causal LM or a `PeftModel` around one) and adds `v_head: Linear(hidden, 1)`.

    `generate`, gradient checkpointing and `save_pretrained` pass through to the wrapped model; the head is saved and
    loaded on its own (`value_head.safetensors`, plus TRL's `pytorch_model.bin` beside an adapter), so the saved
    policy stays a plain model or adapter. State keys are TRL's: `pretrained_model.*` and `v_head.summary.*`.

    TRL's keyword arguments are accepted: `v_head_init_strategy` (None: hf_ppo's zero head, unlike TRL's random one;
    "normal": N(0, `v_head_initializer_range`), default 0.2, bias 0) and `summary_dropout_prob` (dropout on the
    hidden state before the head; 0 by default, where TRL used 0.1. `PPOConfig(disable_dropout=True)`, the default,
    sets it to 0 anyway, as RL needs).
    """

    def __init__(self, pretrained_model: nn.Module, value_head_init_std: float = 0.0, **trl_kwargs):
        if not isinstance(pretrained_model, nn.Module):
            raise TypeError(f"{type(self).__name__}(...) wraps a model object, got {type(pretrained_model).__name__}. "
                            f"To load by Hub id or path use {type(self).__name__}.from_pretrained({pretrained_model!r}).")
        reject_seq2seq(getattr(pretrained_model, "config", None), "model passed")
        super().__init__()
        self.pretrained_model = pretrained_model
        # The head reads what the LM head reads, so its width is the output embedding's input width: not always
        # hidden_size (OPT-350m projects 1024 -> word_embed_proj_dim 512 before its LM head).
        output_embeddings = pretrained_model.get_output_embeddings()
        width = getattr(output_embeddings, "in_features", None) or output_embeddings.weight.shape[1]
        self.v_head = ValueHead(width, dtype=torch.float32, device=output_embeddings.weight.device)
        if value_head_init_std > 0:
            nn.init.normal_(self.v_head.weight, std=value_head_init_std)
        else:
            nn.init.zeros_(self.v_head.weight)
        nn.init.zeros_(self.v_head.bias)
        self._apply_trl_head_kwargs(**trl_kwargs)
        _warn_if_frozen_adapter(pretrained_model)

    def _apply_trl_head_kwargs(self, v_head_init_strategy: str | None = None, v_head_initializer_range: float | None = None,
                               summary_dropout_prob: float | None = None, **unknown) -> None:
        """TRL's value-head options; anything else is an error naming the accepted ones."""
        if unknown:
            raise TypeError(f"Unknown argument(s) {sorted(unknown)} for {type(self).__name__}: the value head takes "
                            f"{list(_HEAD_KWARGS)}; loading options go to from_pretrained.")
        if v_head_init_strategy == "normal":
            nn.init.normal_(self.v_head.weight, std=0.2 if v_head_initializer_range is None else v_head_initializer_range)
            nn.init.zeros_(self.v_head.bias)
        elif v_head_init_strategy is not None:
            raise ValueError(f"v_head_init_strategy={v_head_init_strategy!r}: use None (a zero-initialised head, "
                             "hf_ppo's default) or 'normal' (with v_head_initializer_range as the std).")
        elif v_head_initializer_range is not None:
            warn_user("v_head_initializer_range is used only with v_head_init_strategy='normal' (as in TRL); the "
                      "head stays zero-initialised. Pass v_head_init_strategy='normal' to use it.")
        if summary_dropout_prob is not None and not 0 <= summary_dropout_prob < 1:
            raise ValueError(f"summary_dropout_prob={summary_dropout_prob}: must be in [0, 1).")
        # A module (not a functional call), so that disable_dropout() finds it and sets p=0 for PPO like any other.
        self.summary_dropout = nn.Dropout(summary_dropout_prob) if summary_dropout_prob else nn.Identity()

    # ---- construction -----------------------------------------------------------------------------------------
    @classmethod
    @without_checkpointing_deprecation
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, peft_config=None, is_trainable: bool = False,
                        **kwargs) -> "AutoModelForCausalLMWithValueHead":
        """Load a causal LM (or a PEFT adapter on its base) with its value head, as TRL's class did.

        `pretrained_model_name_or_path`: a Hub id or local folder of a model or of a PEFT adapter (its base is loaded
        from `adapter_config.json`; the adapter is trainable only with `is_trainable=True`), or a model object
        (`PreTrainedModel` or `PeftModel`). `peft_config`: a fresh adapter is added with `get_peft_model` (after
        `prepare_model_for_kbit_training` for a quantized base, with `use_gradient_checkpointing=False` unless you
        pass it: turn checkpointing on with `PPOConfig(gradient_checkpointing=True)`). The value head is read from
        `value_head.safetensors` or a TRL-format `v_head.summary.*` in the weights (single file or any shard); without
        one it starts at zero. Value-head options: see the class. Everything else goes to
        `AutoModelForCausalLM.from_pretrained`; TRL-style `load_in_4bit=True` / `load_in_8bit=True` (and
        `bnb_4bit_*` options) become a `BitsAndBytesConfig`, and a quantized model is placed on this process's device
        unless `device_map` is given.
        """
        head_kwargs = {k: kwargs.pop(k) for k in _HEAD_KWARGS if k in kwargs}
        kbit_kwargs = {k: kwargs.pop(k) for k in _KBIT_KWARGS if k in kwargs}
        if peft_config is not None:
            from peft import PeftConfig

            if not isinstance(peft_config, PeftConfig):
                raise TypeError(f"peft_config must be a peft PeftConfig (e.g. LoraConfig(...)), got "
                                f"{type(peft_config).__name__}.")
        source = pretrained_model_name_or_path
        if isinstance(source, AutoModelForCausalLMWithValueHead):
            raise TypeError("This is already a model with a value head: use it as it is.")
        if isinstance(source, nn.Module):
            if model_args or kwargs:
                raise TypeError(f"Loading options {sorted(kwargs)} apply only when loading by Hub id or path; this "
                                "model object is already loaded. Pass it alone (value-head options and peft_config "
                                "are accepted).")
            model = source
        elif isinstance(source, (str, os.PathLike)):
            source = str(source)
            kwargs = _quantization_kwargs(kwargs)
            if _is_adapter(source, kwargs):
                if peft_config is not None:
                    raise ValueError(f"{source!r} is a PEFT adapter, and peft_config asks for a new one. To go on "
                                     "training this adapter, pass is_trainable=True and no peft_config; to train a "
                                     "fresh adapter, load its base model with peft_config.")
                model = _load_adapter(source, model_args, kwargs, is_trainable, kbit_kwargs)
            else:
                reject_seq2seq_checkpoint(source, kwargs, f"model {source!r}")
                model = AutoModelForCausalLM.from_pretrained(source, *model_args, **kwargs)
        else:
            raise TypeError("from_pretrained takes a Hub id, a local path, or a PreTrainedModel / PeftModel; got "
                            f"{type(source).__name__}.")
        if peft_config is not None:
            from peft import get_peft_model, prepare_model_for_kbit_training

            if hasattr(model, "peft_config"):
                raise ValueError("The model is already a PeftModel: pass peft_config=None to use its adapter (loaded "
                                 "with is_trainable=True to train it), or pass the base model with peft_config.")
            if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
                model = prepare_model_for_kbit_training(model, **{"use_gradient_checkpointing": False, **kbit_kwargs})
            model = get_peft_model(model, peft_config)
        elif kbit_kwargs and not hasattr(model, "peft_config"):
            warn_user(f"{sorted(kbit_kwargs)} apply only with peft_config on a quantized model; ignored.")
        wrapper = cls(model, **head_kwargs)
        if isinstance(source, str):
            head = _find_value_head(source, **_hub_kwargs(kwargs))
            if head is not None:
                wrapper.load_value_head_state_dict(head)
        return wrapper

    @property
    def quantization_method(self):
        """The wrapped model's quantization method (Trainer never `.to()`-moves a bitsandbytes model)."""
        return getattr(self.pretrained_model, "quantization_method", None)

    # ---- the actor-critic interface (with `policy_model`): what the trainer uses instead of the attributes ---------
    def critic_parameters(self) -> list[nn.Parameter]:
        """The parameters that only the critic owns (the value head; the body is shared with the policy)."""
        return list(self.v_head.parameters())

    @property
    def critic_device(self) -> torch.device:
        """Where the critic's own parameters live (checkpoint state is loaded onto it)."""
        return self.v_head.weight.device

    has_critic = True  # the shared value head; `PolicyAndCritic` may have none (the critic-free estimators)

    def critic_state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint stores of the critic (CPU tensors): here the value head."""
        return self.value_head_state_dict()

    def load_critic_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.load_value_head_state_dict(state)

    # ---- forward ----------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        critic_only: bool = False,
        **kwargs,
    ) -> CausalLMOutputWithValue:
        """One pass of the body: logits and values for the last `logits_to_keep` positions (0 = all).

        input_ids, attention_mask, position_ids: (batch, seq). Returns logits (batch, kept, vocab) and `value`
        (batch, kept) computed in fp32 from the hidden state the LM head reads. `critic_only` (the critic warm-up):
        the body runs without gradients, so only the value head can learn from the loss.
        """
        if kwargs.pop("return_past_key_values", False):  # TRL's name for "give me the KV cache too"
            kwargs["use_cache"] = True
        kwargs.setdefault("use_cache", False)  # a scoring/training pass: no KV cache to build
        for name in ("past_key_values", "cache"):  # a cache passed in, under either transformers' name
            if name != CACHE and name in kwargs:
                kwargs[CACHE] = kwargs.pop(name)
        # The value is read from exactly the tensor the LM head reads (already cut to the kept positions): the final
        # normed, and where the model has one, projected hidden state. A pre-hook finds it for every architecture,
        # without asking the model for all its hidden states.
        head_input = []
        hook = self.pretrained_model.get_output_embeddings().register_forward_pre_hook(
            lambda module, args: head_input.append(args[0]))
        try:
            with torch.no_grad() if critic_only else contextlib.nullcontext():
                out = self.pretrained_model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    logits_to_keep=logits_to_keep,
                    **kwargs,
                )
        finally:
            hook.remove()
        values = self.v_head(self.summary_dropout(head_input[-1]).to(self.v_head.weight.dtype)).squeeze(-1)
        cache = getattr(out, CACHE) if kwargs["use_cache"] else None
        return CausalLMOutputWithValue(loss=getattr(out, "loss", None), logits=out.logits, value=values,
                                       **{CACHE: cache})

    def generate(self, *args, **kwargs):
        return self.pretrained_model.generate(*args, **kwargs)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None, **kwargs):
        """Checkpoint the body's activations (Trainer calls this when `gradient_checkpointing=True`)."""
        checkpointing_enable(self.pretrained_model, activation_checkpointing_kwargs, **kwargs)

    def activation_checkpointing_disable(self):
        checkpointing_disable(self.pretrained_model)

    # ---- saving -----------------------------------------------------------------------------------------------
    def value_head_state_dict(self) -> dict[str, torch.Tensor]:
        """{'weight', 'bias'} of the head's linear layer (CPU): what checkpoints and `value_head.safetensors` hold.
        named_parameters, not state_dict: under FSDP (gathered) state_dict would hand back the shards."""
        return {k: v.detach().cpu().contiguous() for k, v in self.v_head.summary.named_parameters()}

    def load_value_head_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load {'weight', 'bias'}; TRL's `v_head.summary.weight` style keys are accepted too."""
        state = {k.rsplit(".", 1)[-1]: v for k, v in state.items()}
        self.v_head.summary.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})

    def save_value_head(self, save_directory: str) -> str:
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, VALUE_HEAD_FILE)
        save_file(self.value_head_state_dict(), path, metadata={"format": "pt"})
        return path

    def save_pretrained(self, save_directory: str, save_value_head: bool = True, **kwargs):
        """Save the wrapped model (an adapter for a `PeftModel`) and, unless told not to, the value head beside it.

        The head goes to `value_head.safetensors`; with a `PeftModel` also, as TRL's class wrote it, to
        `pytorch_model.bin` holding only `v_head.summary.weight` / `.bias`, so TRL's `from_pretrained` reads it
        too. A full model's weights file stays a plain causal LM (TRL put the head inside it). `from_pretrained`
        restores the head from any of these layouts.
        """
        self.pretrained_model.save_pretrained(save_directory, **kwargs)
        if save_value_head:
            self.save_value_head(save_directory)
            if self.is_peft_model:
                head = {f"v_head.summary.{k}": v for k, v in self.value_head_state_dict().items()}
                torch.save(head, os.path.join(save_directory, TRL_ADAPTER_HEAD_FILE))

    def push_to_hub(self, repo_id: str, *, commit_message: str = "Upload model with value head",
                    private: bool | None = None, token: str | None = None, revision: str | None = None,
                    create_pr: bool = False, **save_kwargs):
        """Upload what `save_pretrained` writes (model or adapter + `value_head.safetensors`) in one commit."""
        from huggingface_hub import create_repo, upload_folder

        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, **save_kwargs)
            repo_id = create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
            return upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message, token=token,
                                 revision=revision, create_pr=create_pr)


# ---- loading helpers ---------------------------------------------------------------------------------------------
def _warn_if_frozen_adapter(model: nn.Module) -> None:
    """Warn when a PeftModel has no trainable parameter: PPO would then train the value head alone."""
    if hasattr(model, "peft_config") and not any(p.requires_grad for p in model.parameters()):
        warn_user(
        "The policy's PEFT adapter is frozen (loaded without is_trainable=True): PPO would train ONLY the value "
        "head. Load it with AutoModelForCausalLMWithValueHead.from_pretrained(path, is_trainable=True) (or "
        "PeftModel.from_pretrained(base, path, is_trainable=True)) to train the adapter.")


def _hub_kwargs(kwargs: dict) -> dict:
    """The `from_pretrained` options that say where files live (used again to find the head and the adapter)."""
    return {k: kwargs.get(k) for k in ("revision", "token", "cache_dir", "subfolder")}


def _quantization_kwargs(kwargs: dict) -> dict:
    """TRL-era `load_in_4bit` / `load_in_8bit` (removed from transformers 5) as a `BitsAndBytesConfig`; a quantized
    model goes to this process's device unless `device_map` is given (as TRL did)."""
    kwargs = dict(kwargs)
    load_4bit, load_8bit = kwargs.pop("load_in_4bit", False), kwargs.pop("load_in_8bit", False)
    bnb_options = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith(("bnb_4bit_", "llm_int8_"))}
    if load_4bit or load_8bit:
        if load_4bit and load_8bit:
            raise ValueError("Pass load_in_4bit=True or load_in_8bit=True, not both.")
        if kwargs.get("quantization_config") is not None:
            raise ValueError("Pass either quantization_config or load_in_4bit / load_in_8bit, not both: put the "
                             "options in the BitsAndBytesConfig.")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=load_4bit, load_in_8bit=load_8bit,
                                                           **bnb_options)
    elif bnb_options:
        raise ValueError(f"{sorted(bnb_options)} need load_in_4bit=True or load_in_8bit=True (or put them in a "
                         "BitsAndBytesConfig passed as quantization_config).")
    if kwargs.get("quantization_config") is not None and "device_map" not in kwargs:
        from accelerate import PartialState

        kwargs["device_map"] = {"": PartialState().device}
    return kwargs


def _file_locator(name_or_path: str, revision=None, token=None, cache_dir=None, subfolder=None):
    """`locate(filename, download=False) -> local path or None` for a folder or a Hub repo.

    On the Hub, `download=False` only looks in the cache: weights files were just cached by `from_pretrained`, and a
    file it did not fetch (another format) may be gigabytes, so it is never downloaded here.
    """
    if os.path.isdir(name_or_path):
        root = os.path.join(name_or_path, subfolder or "")

        def locate(filename: str, download: bool = False) -> str | None:
            path = os.path.join(root, filename)
            return path if os.path.isfile(path) else None

        return locate
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    def locate(filename: str, download: bool = False) -> str | None:
        if download:
            try:
                return hf_hub_download(name_or_path, filename, subfolder=subfolder or None, revision=revision,
                                       token=token, cache_dir=cache_dir)
            except Exception:  # absent, offline, or no access: the repo simply has no such file
                return None
        cached = try_to_load_from_cache(name_or_path, f"{subfolder}/{filename}" if subfolder else filename,
                                        cache_dir=cache_dir, revision=revision)
        return cached if isinstance(cached, str) else None

    return locate


def _is_adapter(name_or_path: str, kwargs: dict) -> bool:
    """True when the folder or Hub repo holds a PEFT adapter (an `adapter_config.json`)."""
    return _file_locator(name_or_path, **_hub_kwargs(kwargs))("adapter_config.json", download=True) is not None


def _load_adapter(name_or_path: str, model_args, kwargs: dict, is_trainable: bool, kbit_kwargs: dict):
    """The adapter's base model (named in adapter_config.json) with the adapter on it, as a `PeftModel`."""
    from peft import PeftConfig, PeftModel, prepare_model_for_kbit_training

    where = {k: v for k, v in _hub_kwargs(kwargs).items() if v is not None}
    config = PeftConfig.from_pretrained(name_or_path, **where)
    if not config.base_model_name_or_path:
        raise ValueError(f"The adapter {name_or_path!r} names no base model in adapter_config.json: load the base "
                         "yourself, then PeftModel.from_pretrained(base, path, is_trainable=True), and pass that model.")
    # revision / subfolder name the adapter's repo, not the base's.
    base_kwargs = {k: v for k, v in kwargs.items() if k not in ("revision", "subfolder")}
    base = AutoModelForCausalLM.from_pretrained(config.base_model_name_or_path, *model_args, **base_kwargs)
    if is_trainable and (getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False)):
        base = prepare_model_for_kbit_training(base, **{"use_gradient_checkpointing": False, **kbit_kwargs})
    return PeftModel.from_pretrained(base, name_or_path, is_trainable=is_trainable, **where)


def _read_head(path: str) -> dict[str, torch.Tensor]:
    """The `v_head.*` tensors of one file (all of `value_head.safetensors`), read without loading the rest."""
    if os.path.basename(path) == VALUE_HEAD_FILE:
        return load_file(path)
    if path.endswith(".safetensors"):
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if "v_head." in k}
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {k: v for k, v in state.items() if "v_head." in k}


def _find_value_head(name_or_path: str, revision=None, token=None, cache_dir=None, subfolder=None) -> dict | None:
    """The value head stored with a model, locally or on the Hub; None when there is none.

    Looked for, in order: `value_head.safetensors` (hf_ppo's), the shard a sharded checkpoint's index names for
    `v_head.*` (either format), then TRL's layouts: `v_head.summary.*` inside `model.safetensors`,
    `adapter_model.safetensors` or `pytorch_model.bin` (TRL's adapter checkpoints keep the head alone there).
    """
    locate = _file_locator(name_or_path, revision, token, cache_dir, subfolder)
    path = locate(VALUE_HEAD_FILE, download=True)  # small: fetch it if the repo has one
    if path is not None:
        return load_file(path)
    for index_name in _SHARD_INDEX_FILES:
        index = locate(index_name)
        if index is None:
            continue
        with open(index) as f:
            weight_map = json.load(f).get("weight_map", {})
        head = {}
        for shard in sorted({file for key, file in weight_map.items() if "v_head." in key}):
            shard_path = locate(shard)
            if shard_path is None:
                raise OSError(f"{index_name} of {name_or_path!r} puts the value head in {shard}, which is missing.")
            head.update(_read_head(shard_path))
        if head:
            return head
    adapter = locate("adapter_config.json") is not None
    for filename in _TRL_HEAD_FILES:
        # In an adapter repo, pytorch_model.bin is TRL's head-only file (small): fetch it.
        path = locate(filename, download=adapter and filename == "pytorch_model.bin")
        head = _read_head(path) if path is not None else {}
        if head:
            return head
    return None

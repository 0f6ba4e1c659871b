"""`from_pretrained` with one clear error naming the model's role, and what every loaded model goes through.

Everything goes through `from_pretrained`, so the HF cache, `revision`, `token` and offline mode work as usual.
This is the only module that touches bitsandbytes (lazily, through `BitsAndBytesConfig`). Frozen models are put in
`eval()` mode with `requires_grad=False`, are never handed to the optimizer, and are never `.to()`-moved once
quantized (they are loaded straight onto their device with `device_map`). Dropout is turned off by name and type,
for any architecture."""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from ..runtime.sharding import sharded_by_accelerate


def compute_dtype(bf16: bool, fp16: bool) -> torch.dtype:
    """The dtype matmuls run in under the run's mixed-precision setting."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32


def quantization_config(kind: str, dtype: torch.dtype):
    """A `BitsAndBytesConfig` for '4bit' (NF4, double quantization) or '8bit'; None for 'none'."""
    if kind == "none":
        return None
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ImportError(f"Loading a model in {kind} needs bitsandbytes: `pip install bitsandbytes`, or set the "
                          "quantization to 'none'.") from err
    from transformers import BitsAndBytesConfig

    if kind == "4bit":
        # Under FSDP the 4-bit weights are stored in the compute dtype, so `fully_shard` can shard them (it shards
        # floating-point tensors only); the packed 4-bit values are the same.
        storage = dtype if sharded_by_accelerate() else torch.uint8
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=storage)
    if kind == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    raise ValueError(f"Unknown quantization {kind!r}: choose '4bit', '8bit' or 'none'.")


def from_pretrained(auto_cls, name_or_path: str, role: str, *, missing_fix: str | None = None, **kwargs):
    """`auto_cls.from_pretrained` with one clear error naming the model's role, its id and the remedies.

    `missing_fix` (for a frozen model, which nothing will train): weights the checkpoint lacks, which transformers
    initialises at random and only logs, are an error instead, naming them and this fix.
    """
    if auto_cls is AutoModelForCausalLM:
        reject_seq2seq_checkpoint(name_or_path, kwargs, f"{role} {name_or_path!r}")
    try:
        loaded = auto_cls.from_pretrained(name_or_path, **kwargs, **({"output_loading_info": True} if missing_fix
                                                                     else {}))
    except OSError as err:
        raise OSError(
            f"Could not load the {role} {name_or_path!r}: {err}\n"
            f"Check the id or path (and `revision`), that you have access (log in with `hf auth login` or pass "
            f"`token`), and, offline (HF_HUB_OFFLINE=1), that the model is in the HF cache (download it once online)."
        ) from err
    if not missing_fix:
        return loaded
    model, info = loaded
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ValueError(f"The {role} {name_or_path!r} ({type(model).__name__}) lacks weights its class needs: "
                         f"{shown}. transformers initialised them at random, and a frozen model is never trained, "
                         f"so training would follow noise. {missing_fix}")
    return model


# Ordinary text (ASCII, accents, CJK, emoji): a pad candidate must never come out of encoding it.
_PROBE_TEXT = (" ".join(chr(c) for c in range(33, 127)) + " Hello world, the quick brown fox. Héllo wörld ça "
               "日本語 中文 한국어 🙂\n\tend")


def freeze(model: nn.Module) -> nn.Module:
    """eval() mode and no gradients: a frozen model is never trained and never reaches the optimizer."""
    model.eval()
    model.requires_grad_(False)
    return model


def keep_4bit_differentiable(model: nn.Module) -> None:
    """Keep every bitsandbytes 4-bit layer of `model` in its standard layout on the CPU.

    bitsandbytes (0.50) repacks a 4-bit weight for a faster CPU kernel the first time the layer runs in eval mode
    without gradients (a reward model scoring, an evaluation pass), and from then on computes the layer with that
    kernel in training too; the kernel has no backward, so torch drops the gradient flowing through the layer with
    only a warning. A QLoRA policy evaluated once, or a `reward_lora` critic on the scoring reward model's base,
    would then train only its last layers. No effect on a GPU, where the repacking never happens.
    """
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False


# Attribute and config-field names that hold a dropout probability (`dropout`, `attention_dropout`, GPT-2's
# `resid_pdrop`, `summary_first_dropout`, OPT's `layerdrop`...).
_DROPOUT_FIELD = re.compile(r"dropout|pdrop|layerdrop", re.IGNORECASE)


def disable_dropout(model: nn.Module) -> None:
    """Turn off every kind of dropout in `model`: RL needs deterministic forwards (N+ paper), so that step-0 KL is
    exactly 0 and the first PPO ratio exactly 1.

    Dropout comes in three forms, all handled by name and type rather than per architecture: `nn.Dropout` modules
    (LoRA dropout included) get p=0; float attributes that modules pass to `F.dropout` (OPT's `self.dropout`,
    attention modules' `attention_dropout`) are set to 0; and the same fields of every config the modules hold
    (text, vision and audio sub-configs included) are set to 0, for code that reads the config at forward time.
    """
    configs = {}
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        _zero_dropout_fields(module)
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            configs[id(config)] = config
    stack = list(configs.values())
    while stack:
        config = stack.pop()
        _zero_dropout_fields(config)
        stack.extend(v for v in vars(config).values() if isinstance(v, PretrainedConfig))


def _zero_dropout_fields(obj) -> None:
    for name, value in vars(obj).items():
        if (_DROPOUT_FIELD.search(name) and isinstance(value, (int, float)) and not isinstance(value, bool)
                and value != 0):
            setattr(obj, name, 0.0)


def _is_quantized(model: nn.Module) -> bool:
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def _quantization_of(model: nn.Module) -> str:
    """'4bit', '8bit' or 'none': how `model` (or the body of a value-head wrapper) was loaded."""
    model = getattr(model, "pretrained_model", model)
    return ("4bit" if getattr(model, "is_loaded_in_4bit", False) else "8bit" if getattr(model, "is_loaded_in_8bit", False)
            else "none")


def _init_kwargs(init_kwargs: dict | None, quantization: str, dtype: torch.dtype, device) -> dict:
    kwargs = dict(init_kwargs or {})
    kwargs.setdefault("trust_remote_code", False)
    qconfig = quantization_config(quantization, dtype)
    if qconfig is not None:
        kwargs["quantization_config"] = qconfig
        kwargs.setdefault("dtype", dtype)
        kwargs["device_map"] = {"": device}
    return kwargs


def _shares_parameters(model: nn.Module, other) -> bool:
    """True when `model` and the module `other` hold a parameter in common (one is, or contains, the other)."""
    if not isinstance(other, nn.Module):
        return False
    ids = {id(p) for p in other.parameters()}
    return any(id(p) in ids for p in model.parameters())


SEQ2SEQ_FIX = ("hf_ppo trains decoder-only causal LMs; a value head on an encoder-decoder (TRL's "
               "AutoModelForSeq2SeqLMWithValueHead) is out of scope. Use a decoder-only model, one that "
               "AutoModelForCausalLM loads (e.g. Qwen2.5, Llama, SmolLM2, GPT-2), with the seq2seq task as its prompt.")


def reject_seq2seq(config, what: str) -> None:
    """Raise, naming `what`, when `config` is an encoder-decoder (seq2seq) model's: not supported (docs/guides/models.md)."""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"The {what} is an encoder-decoder (seq2seq) model ({getattr(config, 'model_type', '?')}), "
                         f"which is not supported. {SEQ2SEQ_FIX}")


def reject_seq2seq_checkpoint(name_or_path: str, kwargs: dict, what: str) -> None:
    """`reject_seq2seq` on a checkpoint's config, read before its weights (transformers would load only the decoder
    of some encoder-decoders as a causal LM). A config that cannot be read is left to the model's own loading."""
    from transformers import AutoConfig

    where = {k: v for k, v in kwargs.items() if k in ("revision", "token", "cache_dir", "subfolder", "gguf_file",
                                                      "trust_remote_code", "local_files_only") and v is not None}
    try:
        config = AutoConfig.from_pretrained(name_or_path, **where)
    except Exception:  # noqa: BLE001 - missing, offline, custom code: loading the model reports it
        return
    reject_seq2seq(config, what)


def pools_itself(reward_model: nn.Module) -> bool:
    """True for a sequence classifier that pools on its own (no `score` head over its backbone).

    Decoder reward models in transformers (Llama, Qwen, Mistral, GPT-2, ...) put a `score` head on every position;
    encoders (BERT, RoBERTa, DeBERTa) pool the first ([CLS]) position through `pooler` / `classifier` instead.
    """
    backbone = getattr(reward_model, getattr(reward_model, "base_model_prefix", ""), None)
    return backbone is None or not isinstance(getattr(reward_model, "score", None), nn.Module)

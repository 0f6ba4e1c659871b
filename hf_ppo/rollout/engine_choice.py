"""Which engine samples step 1: `make_rollout_engine` builds the one `SamplingSettings.rollout_engine` names."""

from __future__ import annotations

from torch import nn

from .engines import KVCacheSampler, RolloutEngine, SamplingSettings, StaticCacheSampler
from .vllm_engine import VLLMEngine, VLLMSettings


def make_rollout_engine(s: SamplingSettings, pad_token_id: int, stop_token_ids, *, policy: nn.Module | None = None,
                        trained_adapter: str | None = None, vllm: VLLMSettings | None = None) -> RolloutEngine:
    """The engine `s.rollout_engine` names, sampling as `s` says: 'kv_cache' (`KVCacheSampler`), 'static'
    (`StaticCacheSampler`) or 'vllm' (`VLLMEngine`, which holds a copy of `policy`, the causal LM or its `PeftModel`,
    with `trained_adapter` the adapter it trains (None: full fine-tuning), set up as `vllm` says)."""
    if s.rollout_engine == "vllm":
        if policy is None:
            raise ValueError("rollout_engine='vllm' holds a copy of the policy: pass policy= (the causal LM or its "
                             "PeftModel).")
        return VLLMEngine(s, vllm if vllm is not None else VLLMSettings(), pad_token_id=pad_token_id,
                          stop_token_ids=stop_token_ids, policy=policy, trained_adapter=trained_adapter)
    engine = StaticCacheSampler if s.rollout_engine == "static" else KVCacheSampler
    return engine(s, pad_token_id=pad_token_id, stop_token_ids=stop_token_ids)

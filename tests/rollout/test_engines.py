"""The rollout-engine interface (`generation.RolloutEngine`) and its default, `KVCacheSampler`.

A custom engine assigned as `trainer.rollout_engine` is what training and evaluation sample from, and it is told
(`weights_changed`) after every optimizer step and after a checkpoint load. The default engine decodes as a plain
loop of full forwards would, whatever the left padding, and stops rows at their stop tokens.
"""

import warnings

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.rollout.engines import KVCacheSampler, RolloutEngine, SamplingSettings, StaticCacheSampler
from tests.scripted_engine import ScriptedEngine, fingerprint

PROMPTS = ["the movie was", "the food was great", "bad", "the show was"]


@pytest.fixture(scope="module")
def policy(tiny_models):
    return AutoModelForCausalLM.from_pretrained(tiny_models["policy"]).eval()


def script_for(tokenizer) -> list[list[int]]:
    """Four scripted responses of 4 tokens: stop at 1 then junk (not padding), never stop, stop at 0, stop at 3."""
    great, good, bad = (tokenizer.convert_tokens_to_ids(t) for t in ("Ġgreat", "Ġgood", "Ġbad"))
    eos = tokenizer.eos_token_id
    return [[great, eos, bad, bad], [good, good, good, good], [eos, great, great, great], [bad, good, great, eos]]


def truncated_script(tokenizer) -> torch.Tensor:
    """`script_for` as `rollout` must keep it: everything after the first stop token replaced by padding."""
    pad = tokenizer.pad_token_id
    great, good, bad = (tokenizer.convert_tokens_to_ids(t) for t in ("Ġgreat", "Ġgood", "Ġbad"))
    eos = tokenizer.eos_token_id
    return torch.tensor([[great, eos, pad, pad], [good, good, good, good], [eos, pad, pad, pad],
                         [bad, good, great, eos]])


class RecordingReward:
    """A reward callable on text that remembers what it was asked to score."""

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions):
        self.calls.append((list(prompts), list(completions)))
        return [float(c.count("e")) for c in completions]


def make_trainer(tiny_models, tokenizer, out, reward, **overrides):
    args = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=1,
                num_ppo_epochs=2, max_steps=4, response_length=4, learning_rate=1e-2, logging_steps=1, report_to=[],
                save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0, per_device_eval_batch_size=4)
    args.update(overrides)
    return PPOLMTrainer(model=tiny_models["policy"], args=PPOConfig(**args), processing_class=tokenizer,
                        reward_model=reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                        eval_dataset=Dataset.from_dict({"prompt": PROMPTS}))


@pytest.fixture(scope="module")
def scripted_run(tiny_models, tokenizer, tmp_path_factory):
    """4 optimizer steps (2 iterations of 2 PPO epochs, each step 2 accumulated micro-batches) sampling from a
    scripted engine, a checkpoint after step 2."""
    out = tmp_path_factory.mktemp("scripted")
    reward = RecordingReward()
    trainer = make_trainer(tiny_models, tokenizer, out, reward, save_strategy="steps", save_steps=2,
                           per_device_train_batch_size=2, gradient_accumulation_steps=2)
    engine = ScriptedEngine(script_for(tokenizer), watch=trainer.model.policy_model)
    trainer.rollout_engine = engine
    trainer.train()
    return trainer, engine, reward, out


def test_training_samples_from_the_assigned_engine_truncated_after_the_stop_token(scripted_run, tokenizer):
    trainer, engine, reward, _ = scripted_run
    assert engine.kinds().count("generate") == 2  # one rollout per iteration
    # The engine gets the policy model itself (not the value-head wrapper) and the left-padded prompts.
    assert all(model is trainer.model.policy_model for kind, model in engine.events if kind == "generate")
    queries, query_mask = engine.queries[-1]
    assert query_mask.dtype == torch.bool and not query_mask[:, -1].logical_not().any()  # left-padded
    assert sorted(tokenizer.batch_decode(queries.masked_fill(~query_mask, tokenizer.pad_token_id),
                                         skip_special_tokens=True)) == sorted(PROMPTS)
    # The last rollout trained on is the script, with the junk after each row's first stop token padded away.
    batch = trainer._schedule.batch  # on the policy's device: compared on the CPU
    expected = truncated_script(tokenizer)
    assert torch.equal(batch.responses.cpu(), expected)
    assert torch.equal(batch.response_mask.cpu(), expected != tokenizer.pad_token_id)
    assert batch.contains_stop.tolist() == [True, False, True, True]
    # The reward scored the truncated script's text (stop token and padding not included).
    completions = reward.calls[-1][1]
    assert completions == tokenizer.batch_decode(expected, skip_special_tokens=True)
    assert torch.equal(batch.scores.cpu(), torch.tensor([c.count("e") for c in completions], dtype=torch.float32))


def test_weights_changed_after_every_optimizer_step(scripted_run):
    trainer, engine, _, _ = scripted_run
    # Per optimizer step, not per micro-batch (2 of them per step here).
    assert engine.kinds() == ["generate", "weights_changed", "weights_changed"] * 2
    assert trainer.state.global_step == 4
    # Each call comes after the step moved the weights: every fingerprint is new, the last is the final weights.
    changed = [fp for kind, fp in engine.events if kind == "weights_changed"]
    assert len(set(changed)) == 4
    assert changed[-1] == fingerprint(trainer.model.policy_model)


def test_weights_changed_after_a_checkpoint_load(scripted_run, tiny_models, tokenizer):
    trainer, engine, _, out = scripted_run
    after_step_2 = [fp for kind, fp in engine.events if kind == "weights_changed"][1]
    resumed = make_trainer(tiny_models, tokenizer, out / "resumed", RecordingReward(), per_device_train_batch_size=2,
                           gradient_accumulation_steps=2)
    fresh = fingerprint(resumed.model.policy_model)
    engine2 = ScriptedEngine(script_for(tokenizer), watch=resumed.model.policy_model)
    resumed.rollout_engine = engine2
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    # Told once the checkpoint's weights are in (before sampling anything), then after each of steps 3 and 4.
    assert engine2.kinds() == ["weights_changed", "generate", "weights_changed", "weights_changed"]
    loaded = engine2.events[0][1]
    assert loaded == after_step_2 and loaded != fresh
    assert engine2.events[-1][1] == fingerprint(resumed.model.policy_model)


def test_evaluation_samples_from_the_assigned_engine(scripted_run, tokenizer):
    trainer, _, reward, _ = scripted_run
    engine = ScriptedEngine(script_for(tokenizer))
    trainer.rollout_engine = engine
    metrics = trainer.evaluate()
    assert engine.kinds() == ["generate", "generate"]  # the reference's responses (sampled once), then the policy's
    trainer.evaluate()
    assert engine.kinds() == ["generate", "generate", "generate"]  # the reference's are cached
    completions = reward.calls[-1][1]
    assert completions == tokenizer.batch_decode(truncated_script(tokenizer), skip_special_tokens=True)
    assert metrics["eval_loss"] == pytest.approx(-sum(c.count("e") for c in completions) / len(completions))


def test_the_interface_raises_until_implemented():
    with pytest.raises(NotImplementedError):
        RolloutEngine().generate(None, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool))
    RolloutEngine().weights_changed()  # optional: the default does nothing


# ---- KVCacheSampler, the default engine ----------------------------------------------------------------------------
def sampler(tokenizer, **overrides) -> KVCacheSampler:
    settings = dict(response_length=8, temperature=1.0, top_k=None, top_p=1.0, forward_batch_size=8)
    stop_token_ids = overrides.pop("stop_token_ids", None)
    settings.update(overrides)
    return KVCacheSampler(SamplingSettings(**settings), pad_token_id=tokenizer.pad_token_id,
                          stop_token_ids=stop_token_ids)


@torch.no_grad()
def plain_decode(model, ids: torch.Tensor, steps: int, pick) -> torch.Tensor:
    """The reference: `steps` full forwards over unpadded prompts (B, Q), no KV cache; `pick` maps the last
    position's logits (B, vocab) to the next tokens (B,)."""
    out = []
    for _ in range(steps):
        token = pick(model(input_ids=ids).logits[:, -1])
        out.append(token)
        ids = torch.cat([ids, token[:, None]], dim=1)
    return torch.stack(out, dim=1)


def encode(tokenizer, prompts):
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"].bool()


def test_top_k_1_is_argmax_decoding(policy, tokenizer):
    for prompt in PROMPTS[:3]:
        ids, mask = encode(tokenizer, [prompt])
        expected = plain_decode(policy, ids, 8, lambda logits: logits.argmax(-1))
        assert torch.equal(sampler(tokenizer, top_k=1, temperature=0.7).generate(policy, ids, mask), expected)


def test_near_zero_temperature_is_argmax_decoding(policy, tokenizer):
    ids, mask = encode(tokenizer, [PROMPTS[0]])
    expected = plain_decode(policy, ids, 8, lambda logits: logits.argmax(-1))
    torch.manual_seed(0)
    assert torch.equal(sampler(tokenizer, temperature=1e-4).generate(policy, ids, mask), expected)
    torch.manual_seed(0)  # the check has teeth: at temperature 1 the same seed samples something else
    assert not torch.equal(sampler(tokenizer, temperature=1.0).generate(policy, ids, mask), expected)


def test_seeded_sampling_equals_the_plain_loop(policy, tokenizer):
    """Same seed, same draws: softmax(logits / T) sampled row by row as the plain loop does."""
    ids, mask = encode(tokenizer, ["the movie was", "the show was", "the book was"])  # equal lengths: no padding
    assert mask.all()
    temperature = 0.7
    torch.manual_seed(3)
    expected = plain_decode(policy, ids, 8, lambda logits: torch.multinomial(
        torch.softmax(logits.float() / temperature, -1), 1)[:, 0])
    torch.manual_seed(3)
    assert torch.equal(sampler(tokenizer, temperature=temperature).generate(policy, ids, mask), expected)


@pytest.fixture(scope="module")
def gpt2(tokenizer):
    """A tiny GPT-2: absolute position embeddings, so position ids that count the padding change its tokens (under
    RoPE a constant offset would not show)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=2, n_head=2,
                        pad_token_id=tokenizer.pad_token_id)
    return GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_left_padding_does_not_change_the_sampled_tokens(name, policy, gpt2, tokenizer):
    model = {"llama": policy, "gpt2": gpt2}[name]
    ids, mask = encode(tokenizer, [PROMPTS[1]])
    alone = sampler(tokenizer, top_k=1).generate(model, ids, mask)
    assert torch.equal(alone, plain_decode(model, ids, 8, lambda logits: logits.argmax(-1)))
    pad = torch.full((1, 5), tokenizer.pad_token_id)
    padded_ids, padded_mask = torch.cat([pad, ids], 1), torch.cat([torch.zeros(1, 5, dtype=torch.bool), mask], 1)
    assert torch.equal(sampler(tokenizer, top_k=1).generate(model, padded_ids, padded_mask), alone)
    # In a batch, beside a longer prompt (which pads this one), and in micro-batches of one row.
    batch_ids, batch_mask = encode(tokenizer, ["the food was great and the plot was fun and the music", PROMPTS[1]])
    assert not batch_mask[1].all()
    for batch_size in (1, 8):
        out = sampler(tokenizer, top_k=1, forward_batch_size=batch_size).generate(model, batch_ids, batch_mask)
        assert torch.equal(out[1:], alone)


def test_rows_stop_at_any_stop_token_and_the_rest_is_padding(policy, tokenizer):
    ids, mask = encode(tokenizer, PROMPTS)
    free = sampler(tokenizer, top_k=1).generate(policy, ids, mask)
    # Stop ids taken from the free run: row 0's third token and row 1's second (rows may hit either).
    stops = [int(free[0, 2]), int(free[1, 1])]
    out = sampler(tokenizer, top_k=1, stop_token_ids=stops).generate(policy, ids, mask)
    stopped_rows = 0
    for row in range(len(PROMPTS)):
        hits = torch.isin(free[row], torch.tensor(stops)).nonzero()
        end = int(hits[0]) + 1 if len(hits) else free.shape[1]
        stopped_rows += bool(len(hits))
        assert torch.equal(out[row, :end], free[row, :end]), row  # up to and including the first stop token
        assert (out[row, end:] == tokenizer.pad_token_id).all(), row
    assert stopped_rows >= 2


# ---- StaticCacheSampler (rollout_engine="static") ------------------------------------------------------------------
def static(tokenizer, compile=False, **overrides) -> StaticCacheSampler:
    settings = dict(response_length=12, temperature=1.0, top_k=None, top_p=1.0, forward_batch_size=8)
    stop_token_ids = overrides.pop("stop_token_ids", None)
    extra = {k: overrides.pop(k) for k in ("check_every", "prompt_bucket") if k in overrides}
    settings.update(overrides)
    return StaticCacheSampler(SamplingSettings(**settings), pad_token_id=tokenizer.pad_token_id,
                              stop_token_ids=stop_token_ids, compile=compile, **extra)


def lora_model(name: str):
    """A tiny model of architecture `name` (tests/integration/test_architectures.py) with a LoRA adapter whose B is not
    zero (so the adapter changes the tokens), and its tokenizer."""
    from peft import LoraConfig, get_peft_model
    from tests.integration.test_architectures import BY_NAME, build_tokenizer
    from transformers import AutoModelForCausalLM

    arch = BY_NAME[name]
    tok = build_tokenizer(arch)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(arch.config(len(tok) + arch.extra_rows, tok))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.2)
    return model.eval(), tok


@pytest.mark.parametrize("name", ["llama3", "qwen2", "gpt2", "gemma2"])
def test_static_engine_samples_the_kv_engines_tokens(name):
    """Greedy: the same tokens; sampling with one seed: the same draws (the same distribution at every step). With
    a LoRA adapter, left padding, a stop token and prompts padded up to the bucket."""
    model, tok = lora_model(name)
    ids, mask = encode(tok, PROMPTS)
    assert not mask.all()
    free = sampler(tok, top_k=1, response_length=12).generate(model, ids, mask)
    stop = int(free[0, 3])
    for settings in (dict(top_k=1), dict(temperature=0.9), dict(temperature=0.9, top_p=0.8, stop_token_ids=[stop])):
        torch.manual_seed(5)
        expected = sampler(tok, response_length=12, **settings).generate(model, ids, mask)
        torch.manual_seed(5)
        out = static(tok, prompt_bucket=16, **settings).generate(model, ids, mask)
        assert torch.equal(out, expected), settings
    with model.disable_adapter():  # the reference's context: the base alone
        base = static(tok, top_k=1).generate(model, ids, mask)
        assert torch.equal(base, sampler(tok, top_k=1, response_length=12).generate(model, ids, mask))
    assert not torch.equal(base, free)  # the adapter matters, so the check above has teeth


@pytest.mark.slow
def test_compiled_static_engine_gives_the_same_tokens():
    model, tok = lora_model("llama3")
    ids, mask = encode(tok, PROMPTS)
    engine = static(tok, compile=True, top_k=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback: the step compiled
        out = engine.generate(model, ids, mask)
    assert engine.compile and engine._compiled is not None
    assert torch.equal(out, sampler(tok, top_k=1, response_length=12).generate(model, ids, mask))


def test_a_step_that_cannot_be_compiled_runs_eagerly_after_one_warning(policy, tokenizer, monkeypatch):
    from torch._dynamo.exc import Unsupported

    def cannot(*args, **kwargs):
        raise Unsupported("Params4bit cannot be traced")

    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: cannot)
    ids, mask = encode(tokenizer, PROMPTS)
    engine = static(tokenizer, compile=True, top_k=1, forward_batch_size=2)
    with pytest.warns(UserWarning, match="could not be compiled .*Params4bit") as caught:
        out = engine.generate(policy, ids, mask)
    assert len([w for w in caught if "compiled" in str(w.message)]) == 1  # once, not once per micro-batch
    assert torch.equal(out, sampler(tokenizer, top_k=1, response_length=12).generate(policy, ids, mask))
    # An error of the model's own computation is not a compile error: it is raised, not hidden.
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        static(tokenizer, compile=True).generate(policy, ids, mask)


def test_trainer_with_the_static_engine_starts_at_ratio_1_and_kl_0(tiny_models, tokenizer, prompts_dataset,
                                                                   lora_config, tmp_path):
    """A QLoRA policy (4-bit base) with the adapter-disabled reference, sampled by the compiled static engine."""
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_mini_batches=1, num_ppo_epochs=1,
                     max_steps=2, response_length=6, learning_rate=1e-3, report_to="none", save_strategy="no",
                     logging_steps=1, rollout_engine="static", policy_quantization="4bit", seed=0)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=lambda p, c: [float(len(x)) for x in c], train_dataset=prompts_dataset,
                           peft_config=lora_config)
    assert isinstance(trainer.rollout_engine, StaticCacheSampler)
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["objective/kl"] == 0.0 and first["val/ratio"] == 1.0


# ---- the engines report their progress per decoded token, to whoever listens --------------------------------------
@pytest.mark.parametrize("engine", ["kv_cache", "static"])
def test_sampling_reports_rows_and_tokens_per_decode_step(engine, policy, tokenizer):
    from hf_ppo.rollout.engines import sampling_progress

    cls = KVCacheSampler if engine == "kv_cache" else StaticCacheSampler
    extra = {} if engine == "kv_cache" else {"compile": False}
    sampler = cls(SamplingSettings(response_length=5, temperature=1.0, forward_batch_size=2),
                  pad_token_id=tokenizer.pad_token_id, stop_token_ids=None, **extra)
    queries = torch.tensor([[5, 6, 7]] * 3)
    mask = torch.ones_like(queries, dtype=torch.bool)
    seen = []
    with sampling_progress(lambda *args: seen.append(args)):
        sampler.generate(policy, queries, mask)
    # two passes (rows 0-1, then row 2), 5 tokens each, never a stop token
    assert seen == [(0, 2, 3, t, 5) for t in range(1, 6)] + [(2, 3, 3, t, 5) for t in range(1, 6)]
    seen.clear()
    sampler.generate(policy, queries, mask)  # nobody listens: nothing reported
    assert seen == []


# ---- issue 59: no host sync per decoded token ---------------------------------------------------------------------
class _Syncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the host syncs (`_local_scalar_dense`: `.item()`, `bool(tensor)`; `nonzero`: boolean indexing) the
    operations make, but `torch.multinomial`'s argument check (`_assert_async`: a device-side assert on a GPU, a
    scalar read only on the CPU)."""

    def __init__(self):
        super().__init__()
        self.count, self.asserting = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_assert_async":
            self.asserting += 1
        try:
            if name in ("_local_scalar_dense", "nonzero") and not self.asserting:
                self.count += 1
            return func(*args, **(kwargs or {}))
        finally:
            if name == "_assert_async":
                self.asserting -= 1


def _syncs(engine, model, ids, mask) -> int:
    with _Syncs() as spy:
        engine.generate(model, ids, mask)
    return spy.count


@pytest.mark.parametrize("engine", ["kv_cache", "static"])
def test_the_decode_loop_syncs_the_host_once_per_8_tokens_not_per_token(engine, policy, tokenizer):
    """Left-padded prompts, no stop token: 8 more decoded tokens cost at most one more host sync (the stop check
    every STOP_CHECK_EVERY tokens), whatever the model's mask code would read at each step. Before issue 59 the
    kv_cache loop synced twice per token (its `done.all()` and transformers' padding check of the 2-D mask)."""
    ids, mask = encode(tokenizer, PROMPTS)
    assert not mask.all()
    make = {"kv_cache": lambda n: sampler(tokenizer, response_length=n),
            "static": lambda n: static(tokenizer, response_length=n, prompt_bucket=16)}[engine]
    assert _syncs(make(24), policy, ids, mask) - _syncs(make(8), policy, ids, mask) <= 2


@pytest.mark.parametrize("name", ["llama3", "gemma2"])
def test_the_4d_decode_mask_samples_the_2d_masks_tokens(name, monkeypatch):
    """The 4-D mask the loops hand the attention (`decode_mask`) changes no token: the same seed samples the same
    responses as with transformers' own 2-D mask, left-padded, for both engines; a model with a sliding window
    (gemma2) keeps the 2-D mask."""
    from hf_ppo.rollout import engines

    model, tok = lora_model(name)
    ids, mask = encode(tok, PROMPTS)
    assert not mask.all()
    four_d = engines.decode_mask(model, mask[:, :3]).dim() == 4
    assert four_d == (name == "llama3")
    runs = {}
    for label in ("4d", "2d"):
        if label == "2d":
            monkeypatch.setattr(engines, "decode_mask", lambda model, allowed: allowed)
        for engine in (sampler(tok, response_length=12, temperature=0.9), static(tok, temperature=0.9)):
            torch.manual_seed(5)
            runs[label, type(engine).__name__] = engine.generate(model, ids, mask)
    for kind in ("KVCacheSampler", "StaticCacheSampler"):
        assert torch.equal(runs["4d", kind], runs["2d", kind]), kind


def test_the_static_engine_compiles_once_per_bucket_and_never_again_across_iterations(monkeypatch):
    """Dynamo's own counters: one graph for a (rows, prompt length) bucket, however many iterations sample with it
    and however the weights change between them (an optimizer step changes them in place); a new bucket compiles once
    more, and going back to the first compiles nothing. `time/compile` reports the seconds of each compilation once.
    (Compiled with dynamo's eager backend: the counting is dynamo's, whatever the backend.)"""
    import functools

    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    model, tok = lora_model("llama3")
    ids, mask = encode(tok, PROMPTS)
    engine = static(tok, compile=True, prompt_bucket=16)
    for _ in range(3):  # three iterations, the adapter's weights changed in place between them
        engine.generate(model, ids, mask)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.add_(0.01)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"]
    first = engine.metrics()["time/compile"]
    engine.generate(model, ids, mask)  # one more rollout in the compiled bucket: no compile time
    assert first > 0 and engine.metrics() == {"time/compile": 0.0}  # reported once, not at every rollout
    assert ids.shape[1] <= 16
    engine.generate(model, torch.cat([ids, ids, ids], 1), torch.cat([mask, mask, mask], 1))  # the next bucket: 32
    engine.generate(model, ids, mask)
    assert counters["stats"]["unique_graphs"] == 2
    assert engine.metrics()["time/compile"] > 0
    torch._dynamo.reset()

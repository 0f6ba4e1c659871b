"""Behaviour tests of the wiring around the PPO math: each fails for one kind of realistic refactoring bug.

Everything goes through `PPOLMTrainer` and its public seams (`compute_loss`, callbacks, the rollout batch it trains
on), so the tests hold while the code behind them moves. The models are tiny (tests/wiring_models.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from tests import plain_ppo
from tests.devices import on_device_of
from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.models.value_head import AutoModelForCausalLMWithValueHead
from tests.wiring_models import PROMPTS, RecordingTrainer, build_wiring_models, row_key


def count_e(prompts, completions):
    """Rule-based reward: +1 per letter 'e' in the completion."""
    return [float(c.count("e")) for c in completions]


def config(tmp_path, **overrides) -> PPOConfig:
    defaults = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=len(PROMPTS), gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=1, max_steps=1, response_length=8, learning_rate=1e-3,
        reward_quantization="none", report_to=[], save_strategy="no", num_sample_generations=0, disable_tqdm=True,
        logging_steps=1, seed=0,
        # fp32 where CUDA is visible too (bf16 is the GPU's default): these tests compare the run with fp32 passes
        # of the models by hand, at tolerances of fp32 rounding. On the CPU this is the default.
        bf16=False,
    )
    defaults.update(overrides)
    return PPOConfig(**defaults)


def lora() -> LoraConfig:
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def rows_of(batches) -> dict:
    """{row key: (batch, index)} over micro-batches: every distinct row of a rollout once."""
    return {row_key(b, i): (b, i) for b in batches for i in range(len(b))}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return build_wiring_models(tmp_path_factory.mktemp("wiring_models"))


class RecordingKLController:
    """Wraps the trainer's KL controller and records each update: (coefficient before, KL fed, episodes, after)."""

    def __init__(self, inner):
        self.inner, self.updates = inner, []

    @property
    def value(self):
        return self.inner.value

    def update(self, current_kl, n_steps):
        before = self.inner.value
        self.inner.update(current_kl, n_steps)
        self.updates.append((before, float(current_kl), n_steps, self.inner.value))

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


# Two iterations of LoRA PPO (adapter-disabled reference), 2 epochs x 2 minibatches x 2 micro-batches each, a large
# learning rate so the policy moves within an iteration, the adaptive KL controller and the missing-EOS penalty.
STEPS_PER_ITERATION, MICRO_PER_ITERATION = 4, 8


@pytest.fixture(scope="module")
def lora_run(paths, tmp_path_factory):
    args = config(tmp_path_factory.mktemp("lora_run"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  num_mini_batches=2, num_ppo_epochs=2, max_steps=2 * STEPS_PER_ITERATION, learning_rate=2e-2,
                  lr_scheduler_type="constant", temperature=1.0, adaptive_kl=True, kl_coef=0.1, kl_target=0.5,
                  kl_horizon=40, missing_eos_penalty=1.0)
    trainer = RecordingTrainer(model=paths["llama"], args=args, reward_model=count_e,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora(),
                               snapshot_calls=[0])
    trainer.kl_ctl = RecordingKLController(trainer.kl_ctl)
    trainer.train()
    assert len(trainer.micro_batches) == 2 * MICRO_PER_ITERATION
    return trainer


def iteration_rows(trainer, iteration: int) -> dict:
    return rows_of(trainer.micro_batches[iteration * MICRO_PER_ITERATION:(iteration + 1) * MICRO_PER_ITERATION])


def real_tokens(batch, i, field):
    """Row i's `field` at its real response tokens, on the CPU (where the models by hand run and tensors are built)."""
    return getattr(batch, field)[i][batch.response_mask[i]].cpu()


def test_minibatch_order_differs_between_epochs(lora_run):
    per_epoch = MICRO_PER_ITERATION // 2
    orders = []
    for epoch in range(2):
        batches = lora_run.micro_batches[epoch * per_epoch:(epoch + 1) * per_epoch]
        orders.append([row_key(b, i) for b in batches for i in range(len(b))])
    assert sorted(orders[0]) == sorted(orders[1]) and len(set(orders[0])) == len(PROMPTS), "each row once per epoch"
    assert orders[0] != orders[1], "the minibatch order must be reshuffled for every PPO epoch"


def test_old_logprobs_stay_fixed_and_the_ratio_moves_within_an_iteration(lora_run):
    for iteration in range(2):
        batches = lora_run.micro_batches[iteration * MICRO_PER_ITERATION:(iteration + 1) * MICRO_PER_ITERATION]
        first_seen = {}
        for b in batches:
            for i in range(len(b)):
                old = (real_tokens(b, i, "logprobs"), real_tokens(b, i, "values"))
                seen = first_seen.setdefault(row_key(b, i), old)
                assert torch.equal(seen[0], old[0]) and torch.equal(seen[1], old[1]), "old log-probs/values changed"
    steps = [e for e in lora_run.state.log_history if "policy/approxkl_avg" in e]
    assert len(steps) == 2 * STEPS_PER_ITERATION
    for iteration in range(2):
        logs = steps[iteration * STEPS_PER_ITERATION:(iteration + 1) * STEPS_PER_ITERATION]
        # The first step runs at the rollout's weights: the ratio is 1 (up to float noise of another batch shape).
        assert logs[0]["policy/approxkl_avg"] < 1e-10 and abs(logs[0]["val/ratio"] - 1) < 1e-5
        assert all(e["policy/approxkl_avg"] > 1e-6 for e in logs[1:]), [e["policy/approxkl_avg"] for e in logs]
        epoch1, epoch2 = logs[:2], logs[2:]
        assert sum(e["policy/approxkl_avg"] for e in epoch2) > sum(e["policy/approxkl_avg"] for e in epoch1)
        assert sum(e["policy/clipfrac_avg"] for e in epoch2) > sum(e["policy/clipfrac_avg"] for e in epoch1)
        # Value clipping is measured against the rollout's values, so it acts once the value head has moved.
        assert logs[0]["val/clipfrac_avg"] == 0 and any(e["val/clipfrac_avg"] > 0 for e in logs[1:])


def test_kl_controller_moves_toward_its_target_with_the_observed_kl(lora_run):
    updates = lora_run.kl_ctl.updates
    assert len(updates) == 2
    args = lora_run.args
    for iteration, (before, fed, episodes, after) in enumerate(updates):
        rows = iteration_rows(lora_run, iteration)
        kls = [real_tokens(b, i, "logprobs") - real_tokens(b, i, "ref_logprobs") for b, i in rows.values()]
        observed = sum(k.sum().item() for k in kls) / len(kls)  # mean over responses of the summed k1 KL
        assert fed == pytest.approx(observed, abs=1e-5), "the controller must be fed the rollout's KL"
        assert episodes == len(PROMPTS)
        assert math.copysign(1, after - before) == math.copysign(1, observed - args.kl_target)
        # The rewards of this iteration used the coefficient in force before the update.
        for (b, i), kl in zip(rows.values(), kls):
            torch.testing.assert_close(real_tokens(b, i, "non_score_rewards"), -before * kl, rtol=1e-5, atol=1e-7)
    assert updates[1][1] > 1e-3, "the second iteration's KL should be non-zero (the adapter has moved)"
    assert updates[1][0] == updates[0][3]


def test_adapter_disabled_reference_is_the_starting_policy(lora_run, paths):
    base = AutoModelForCausalLM.from_pretrained(paths["llama"]).eval()
    temperature = lora_run.args.temperature
    rows = iteration_rows(lora_run, 1)
    hand_kl = []
    with torch.no_grad():
        for b, i in rows.values():
            prompt = b.queries[i][b.query_mask[i]].tolist()
            response = real_tokens(b, i, "responses").tolist()
            logits, _ = plain_ppo.run_alone(base, prompt + response)
            base_logp = torch.stack([plain_ppo.token_logprob(logits[len(prompt) + t - 1], tok, temperature)
                                     for t, tok in enumerate(response)])
            torch.testing.assert_close(real_tokens(b, i, "ref_logprobs"), base_logp, rtol=1e-4, atol=2e-5)
            hand_kl.append((real_tokens(b, i, "logprobs") - base_logp).sum().item())
    logged = [e["objective/kl"] for e in lora_run.state.log_history if "objective/kl" in e]
    assert logged[0] == 0.0  # a fresh adapter is the identity
    assert logged[1] == pytest.approx(sum(hand_kl) / len(hand_kl), abs=1e-4) and logged[1] > 1e-3


def test_missing_eos_penalty_only_for_responses_that_did_not_stop(lora_run):
    tokenizer, penalty = lora_run.processing_class, lora_run.args.missing_eos_penalty
    rows = list(rows_of(lora_run.micro_batches).values())
    stopped = [bool((real_tokens(b, i, "responses") == tokenizer.eos_token_id).any()) for b, i in rows]
    assert any(stopped) and not all(stopped), "the run must have responses with and without a stop token"
    for (b, i), did_stop in zip(rows, stopped):
        completion = tokenizer.decode(real_tokens(b, i, "responses"), skip_special_tokens=True)
        assert bool(b.contains_stop[i]) == did_stop
        assert b.scores[i].item() == pytest.approx(count_e([""], [completion])[0] - (0 if did_stop else penalty))


def test_returns_use_raw_advantages_and_advantages_are_whitened(lora_run):
    args = lora_run.args
    for iteration in range(2):
        rows = list(iteration_rows(lora_run, iteration).values())
        raw = []
        for b, i in rows:
            rewards, values = real_tokens(b, i, "rewards").tolist(), real_tokens(b, i, "values").tolist()
            advantages, running = [0.0] * len(rewards), 0.0
            for t in reversed(range(len(rewards))):
                next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
                running = rewards[t] + args.gamma * next_value - values[t] + args.gamma * args.lam * running
                advantages[t] = running
            torch.testing.assert_close(real_tokens(b, i, "returns"), torch.tensor(advantages) + torch.tensor(values),
                                       rtol=1e-5, atol=1e-5)
            raw.append(torch.tensor(advantages))
        flat = torch.cat(raw)
        whitened = (flat - flat.mean()) / torch.sqrt(flat.var() + 1e-8)
        got = torch.cat([real_tokens(b, i, "advantages") for b, i in rows])
        torch.testing.assert_close(got, whitened, rtol=1e-4, atol=1e-5)


def test_vf_coef_and_entropy_coef_change_the_loss_as_documented(lora_run):
    """loss = policy loss + vf_coef * value loss - entropy_coef * entropy, sums over tokens / minibatch tokens."""
    model, inputs = lora_run.snapshots[0]
    batch = lora_run.micro_batches[0]
    minibatch_tokens = sum(b.response_mask.sum().item() for b in lora_run.micro_batches[:2])  # minibatch 0
    seqs = []
    for i in range(len(batch)):
        n = int(batch.response_mask[i].sum())
        seqs.append(dict(prompt=batch.queries[i][batch.query_mask[i]].tolist(), response=batch.responses[i].tolist(),
                         n=n, values=batch.values[i][:n].tolist(), returns=batch.returns[i][:n].tolist()))
    policy_lm = model.pretrained_model
    value_sum = plain_ppo.value_loss_sum(seqs, policy_lm=policy_lm, v_head=model.v_head,
                                         cliprange_value=lora_run.args.cliprange_value)
    entropy_sum = plain_ppo.entropy_sum(seqs, policy_lm=policy_lm, temperature=lora_run.args.temperature)
    assert value_sum > 0 and entropy_sum > 0

    args, saved = lora_run.args, (lora_run.args.vf_coef, lora_run.args.entropy_coef)
    losses = {}
    try:
        with torch.no_grad():
            for vf_coef, entropy_coef in [(0.0, 0.0), (0.7, 0.0), (0.0, 0.3)]:
                args.vf_coef, args.entropy_coef = vf_coef, entropy_coef
                losses[vf_coef, entropy_coef] = lora_run.compute_loss(model, inputs).item()
    finally:
        args.vf_coef, args.entropy_coef = saved
    assert losses[0.7, 0.0] - losses[0.0, 0.0] == pytest.approx(0.7 * value_sum / minibatch_tokens, rel=1e-3)
    assert losses[0.0, 0.3] - losses[0.0, 0.0] == pytest.approx(-0.3 * entropy_sum / minibatch_tokens, rel=1e-3)


# ---- padding, positions and the reward slot ------------------------------------------------------------------------
LONG_PROMPTS = ["the book was bad but the plot was fun and the music was great and the acting was",
                "the food was great and the service was dull but the price was good so the view",
                "the song was great because the ending was lovely and the cast was happy while the story"]


def _greedy_rollout(paths, tmp_path, prompts):
    """One greedy iteration of a GPT-2 policy (with a random value head) and GPT-2 reward model."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    policy = AutoModelForCausalLMWithValueHead(AutoModelForCausalLM.from_pretrained(paths["gpt2_plain"]),
                                               value_head_init_std=0.5)
    args = config(tmp_path, per_device_train_batch_size=len(prompts), top_k=1)
    tokenizer = AutoTokenizer.from_pretrained(paths["gpt2_plain"])
    trainer = RecordingTrainer(model=policy, args=args, processing_class=tokenizer,
                               reward_model=paths["gpt2_reward"], train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train()
    return trainer.micro_batches[0]


def test_left_padding_does_not_change_tokens_logprobs_values_or_score(paths, tmp_path):
    alone = _greedy_rollout(paths, tmp_path / "alone", [PROMPTS[0]])
    batched = _greedy_rollout(paths, tmp_path / "batched", [PROMPTS[0]] + LONG_PROMPTS)
    assert not alone.query_mask.logical_not().any() and batched.query_mask.logical_not().any()
    assert alone.response_mask.all(), "the check needs a full-length greedy response"
    (key,) = rows_of([alone])
    i = next(i for i in range(len(batched)) if row_key(batched, i)[0] == key[0])
    assert torch.equal(batched.responses[i], alone.responses[0]), "greedy tokens changed with left padding"
    mask = alone.response_mask[0]
    for field in ("logprobs", "ref_logprobs", "values"):
        torch.testing.assert_close(getattr(batched, field)[i][mask], getattr(alone, field)[0][mask], rtol=1e-4,
                                   atol=2e-5, msg=field)
    torch.testing.assert_close(batched.scores[i], alone.scores[0], rtol=1e-4, atol=2e-5)


def test_reward_is_read_at_the_last_real_token(paths, tmp_path):
    """Responses that stop early are padded on the right: the score is the reward model's on the real tokens alone."""
    args = config(tmp_path, per_device_train_batch_size=len(PROMPTS), seed=1)
    trainer = RecordingTrainer(model=paths["llama"], args=args, reward_model=paths["gpt2_reward"],
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    trainer.train()
    batch = trainer.micro_batches[0]
    stopped = batch.response_mask.sum(1) < batch.responses.shape[1]
    assert stopped.any(), "the check needs responses that stopped early"
    reward = AutoModelForSequenceClassification.from_pretrained(paths["gpt2_reward"]).eval()
    for i in range(len(batch)):
        ids = batch.queries[i][batch.query_mask[i]].tolist() + real_tokens(batch, i, "responses").tolist()
        assert batch.scores[i].item() == pytest.approx(plain_ppo.score_alone(reward, ids), abs=2e-5)


# ---- sampling temperature ------------------------------------------------------------------------------------------
def test_near_zero_temperature_gives_identical_samples(paths, tmp_path):
    prompts = Dataset.from_dict({"prompt": [PROMPTS[0]] * 8})
    distinct = {}
    for temperature in (1e-4, 1.0):
        args = config(tmp_path / str(temperature), temperature=temperature, stop_token=None)
        trainer = RecordingTrainer(model=paths["llama"], args=args, reward_model=count_e, train_dataset=prompts)
        trainer.train()
        distinct[temperature] = len({tuple(r) for r in trainer.micro_batches[0].responses.tolist()})
    assert distinct[1e-4] == 1, "near-zero temperature must sample the same response for the same prompt"
    assert distinct[1.0] > 1


def _tiny_vocab_policy():
    """A Llama over an 8-token vocabulary with peaked next-token logits, and its word-level tokenizer."""
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "a", "b", "c", "d"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>", padding_side="left")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    return model, tokenizer


def test_sampled_token_distribution_is_softmax_of_logits_over_temperature(tmp_path):
    model, tokenizer = _tiny_vocab_policy()
    prompt, n, temperature = "a b c", 2000, 0.5
    with torch.no_grad():
        logits = model(**tokenizer(prompt, return_tensors="pt")).logits[0, -1]
    expected = torch.softmax(logits / temperature, -1)
    untempered = torch.softmax(logits, -1)
    args = config(tmp_path, per_device_train_batch_size=n, response_length=1, temperature=temperature,
                  stop_token=None, local_rollout_forward_batch_size=n)
    trainer = RecordingTrainer(model=model, args=args, processing_class=tokenizer, reward_model=count_e,
                               train_dataset=Dataset.from_dict({"prompt": [prompt] * n}))
    trainer.train()
    first = trainer.micro_batches[0].responses[:, 0].cpu()  # `expected` was computed on the CPU, before training
    empirical = torch.bincount(first, minlength=8).double() / n
    tv = 0.5 * (empirical - expected.double()).abs().sum().item()
    assert 0.5 * (expected - untempered).abs().sum() > 0.1, "the test needs logits where temperature matters"
    assert tv < 0.04, f"total variation {tv:.3f} between sampled and softmax(logits / T) frequencies"


# ---- frozen models, aliasing, dropout -------------------------------------------------------------------------------
def _assert_frozen_and_separate(trainer):
    policy_params = {id(p) for p in trainer.model.parameters()}
    frozen = [m for m in (trainer.ref_model, trainer.reward_model) if isinstance(m, torch.nn.Module)]
    for m in frozen:
        assert m is not trainer.model and m is not trainer.model.pretrained_model
        assert not any(id(p) in policy_params for p in m.parameters()), "a frozen model shares the policy's weights"
        assert not any(p.requires_grad for p in m.parameters()), "a frozen model has trainable parameters"
        assert not m.training, "a frozen model is in training mode"
    optimized = {id(p) for g in trainer.create_optimizer().param_groups for p in g["params"]}
    assert optimized and optimized <= policy_params
    return frozen


@pytest.mark.parametrize("how", ["path", "model_object", "model_object_as_ref", "wrapper", "wrapper_as_ref"])
def test_frozen_models_are_separate_and_the_policy_still_trains(paths, tmp_path, how):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["llama"])
    model = AutoModelForCausalLM.from_pretrained(paths["llama"]) if how != "path" else paths["llama"]
    if how.startswith("wrapper"):
        model = AutoModelForCausalLMWithValueHead(model)
    if how != "path":
        model.train()  # as a user's model object may be: the frozen copies must still end up in eval mode
    ref = model if how.endswith("as_ref") else None
    reward = AutoModelForSequenceClassification.from_pretrained(paths["reward"]).train()
    trainer = PPOLMTrainer(model=model, ref_model=ref, args=config(tmp_path), processing_class=tokenizer,
                           reward_model=reward, train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    frozen = _assert_frozen_and_separate(trainer)
    assert len(frozen) == 2
    body = [p for n, p in trainer.model.named_parameters() if not n.startswith("v_head")]
    assert body and all(p.requires_grad for p in body), "full fine-tuning must train the policy's body"


def test_frozen_models_with_lora(paths, tmp_path):
    trainer = PPOLMTrainer(model=paths["llama"], args=config(tmp_path), reward_model=paths["reward"],
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=lora())
    assert trainer.ref_model is None  # the adapter-disabled policy
    _assert_frozen_and_separate(trainer)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("v_head") for n in trainable)


def test_dropout_is_off_in_every_model(paths, tmp_path):
    """Models configured with dropout give identical outputs twice even in training mode."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["llama"])
    policy = AutoModelForCausalLM.from_pretrained(paths["llama"], attention_dropout=0.5)
    reward = AutoModelForSequenceClassification.from_pretrained(paths["gpt2_reward"], resid_pdrop=0.5, attn_pdrop=0.5,
                                                                embd_pdrop=0.5)
    peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.5, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = PPOLMTrainer(model=policy, args=config(tmp_path), processing_class=tokenizer, reward_model=reward,
                           ref_model=AutoModelForCausalLM.from_pretrained(paths["llama"], attention_dropout=0.5),
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}), peft_config=peft_config)
    probe = tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    with torch.no_grad():
        for name, model in [("policy", trainer.model), ("reference", trainer.ref_model),
                            ("reward", trainer.reward_model)]:
            was_training = model.training
            model.train()
            inputs = {k: on_device_of(model, v) for k, v in probe.items()}
            first, second = model(**inputs).logits, model(**inputs).logits
            model.train(was_training)
            assert torch.equal(first, second), f"dropout is still active in the {name} model"

"""The rollout's own pieces: the KV-cached sampler (against HF generate), stop-token truncation, scoring; `rollout()`
(steps 1-9) on a tiny policy with a scripted engine; `sample_and_score`; the resumable `MinibatchSchedule`."""

import math
from dataclasses import fields

import pytest
import torch

from hf_ppo.rollout.engines import generate, sample_token, sampling_logits
from hf_ppo.algorithms.ppo_math import LOSS_AGGREGATIONS
from hf_ppo.algorithms.estimators import EstimatorSettings
from hf_ppo.rollout.engines import SamplingSettings
from hf_ppo.rollout.steps import (ROLLOUT_STATS, RolloutParts, RolloutSettings, Samples, rollout, sample_and_score,
                                  truncate_after_stop)
from hf_ppo.trainer.schedule import MinibatchSchedule
from hf_ppo.rollout.batch import RolloutBatch
from tests.scripted_engine import ScriptedEngine


@pytest.fixture(scope="module")
def policy(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["policy"]).eval()


def test_greedy_decoding_matches_hf_generate(policy, tokenizer):
    """top_k=1 makes sampling greedy: the lean decode loop must produce HF generate's tokens, left padding included."""
    batch = tokenizer(["the movie was", "a", "the food was very"], return_tensors="pt", padding=True)
    ours = generate(policy, batch["input_ids"], batch["attention_mask"].bool(),
                    SamplingSettings(response_length=10, temperature=0.7, top_k=1, forward_batch_size=2),
                    pad_token_id=tokenizer.pad_token_id, stop_token_ids=None)
    theirs = policy.generate(**batch, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=None)[:, batch["input_ids"].shape[1]:]
    assert torch.equal(ours, theirs)


def test_rows_stop_at_the_stop_token_and_pad_after(policy, tokenizer):
    batch = tokenizer(["the movie was", "the food was"], return_tensors="pt", padding=True)
    s = SamplingSettings(response_length=6, temperature=1.0, top_k=1, forward_batch_size=8)
    greedy = generate(policy, batch["input_ids"], batch["attention_mask"].bool(), s,
                      pad_token_id=tokenizer.pad_token_id, stop_token_ids=None)
    stop = int(greedy[0, 2])  # pretend the third greedy token of row 0 is the stop token
    out = generate(policy, batch["input_ids"], batch["attention_mask"].bool(), s,
                   pad_token_id=tokenizer.pad_token_id, stop_token_ids=stop)
    first = (greedy[0] == stop).nonzero()[0].item()
    assert torch.equal(out[0, :first + 1], greedy[0, :first + 1])
    assert (out[0, first + 1:] == tokenizer.pad_token_id).all()


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_min_p_keeps_the_tokens_transformers_min_p_warper_keeps(min_p, temperature):
    """min_p as transformers samples it: temperature first, then MinPLogitsWarper on the same logits; the kept logits
    (and so the distribution drawn from) are the same, and the off value 0.0 changes nothing."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    theirs = MinPLogitsWarper(min_p)(None, TemperatureLogitsWarper(temperature)(None, logits.clone()))
    ours = sampling_logits(logits, SamplingSettings(temperature=temperature, min_p=min_p))
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)) and (~torch.isinf(ours)).sum() < logits.numel()
    torch.testing.assert_close(ours[~torch.isinf(ours)], theirs[~torch.isinf(theirs)])
    off = sampling_logits(logits, SamplingSettings(temperature=temperature, min_p=0.0))
    torch.testing.assert_close(off, logits / temperature)
    draws = sample_token(logits.repeat(200, 1), SamplingSettings(temperature=temperature, min_p=min_p))
    assert not torch.isinf(ours.repeat(200, 1).gather(1, draws[:, None])).any()  # never a token min_p dropped


def test_sample_token_top_k_and_top_p():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    assert set(sample_token(logits, SamplingSettings(temperature=1.0, top_k=2)).tolist()) == {0, 1}
    # Nucleus 0.7: 0.5 alone is below it, 0.5 + 0.3 reaches it -> tokens {0, 1}.
    assert set(sample_token(logits, SamplingSettings(temperature=1.0, top_p=0.7)).tolist()) == {0, 1}
    assert set(sample_token(logits, SamplingSettings(temperature=1.0, top_p=0.4)).tolist()) == {0}
    counts = torch.bincount(sample_token(logits, SamplingSettings(temperature=1.0)), minlength=4).float() / 2000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.04, rtol=0)


def test_truncate_after_stop():
    responses = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9]])
    out, mask, stopped = truncate_after_stop(responses, stop_token_ids=2, pad_token_id=0)
    assert out.tolist() == [[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]]
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert stopped.tolist() == [True, False, True]


def test_truncate_after_any_of_several_stop_tokens():
    responses = torch.tensor([[5, 3, 7, 2], [5, 6, 7, 8], [2, 9, 3, 9]])
    out, mask, stopped = truncate_after_stop(responses, stop_token_ids=[2, 3], pad_token_id=0)
    assert out.tolist() == [[5, 3, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]]
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert stopped.tolist() == [True, False, True]
    _, mask, stopped = truncate_after_stop(responses, stop_token_ids=[], pad_token_id=0)
    assert mask.all() and not stopped.any()


# ---- rollout(): steps 1-9 ------------------------------------------------------------------------------------------
PROMPTS = ["the movie was", "the food was great", "bad", "the show was"]
R = 5


@pytest.fixture(scope="module")
def lora_policy(tiny_models):
    """The actor-critic on a fresh LoRA adapter (B = 0: the policy is its adapter-disabled reference) with a random
    value head (non-zero values, so GAE has something to do)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_ppo import AutoModelForCausalLMWithValueHead

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    return AutoModelForCausalLMWithValueHead(peft, value_head_init_std=0.5).eval()


def script(tokenizer) -> list[list[int]]:
    """Stop at 1 (then junk), never stop, stop at 0, stop at the last position."""
    great, good, bad = (tokenizer.convert_tokens_to_ids(t) for t in ("Ġgreat", "Ġgood", "Ġbad"))
    eos = tokenizer.eos_token_id
    return [[great, eos, bad, bad, bad], [good, bad, good, bad, good], [eos, great, great, great, great],
            [bad, good, great, good, eos]]


def length_and_e(prompts, completions):
    """A text reward that reads both: prompt length + 2 per 'e' in the completion."""
    return [len(p) + 2.0 * c.count("e") for p, c in zip(prompts, completions)]


def prompt_batch(tokenizer):
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"].bool()


def run_rollout(policy, tokenizer, engine, shape_scores=lambda s: s, whiten_advantages=True):
    queries, query_mask = prompt_batch(tokenizer)
    parts = RolloutParts(engine, length_and_e, tokenizer, [tokenizer.eos_token_id], shape_scores=shape_scores)
    settings = RolloutSettings(SamplingSettings(response_length=R, temperature=0.7, forward_batch_size=3),
                               EstimatorSettings(kl_coef=0.05, gamma=1.0, lam=0.95, whiten_rewards=False,
                                                 whiten_advantages=whiten_advantages), missing_eos_penalty=1.5)
    return rollout(policy, queries, query_mask, PROMPTS, parts, settings)


@pytest.fixture(scope="module")
def scripted_rollout(lora_policy, tokenizer):
    engine = ScriptedEngine(script(tokenizer))
    return run_rollout(lora_policy, tokenizer, engine), engine


def documented_fields() -> dict[str, tuple[tuple[str, ...], torch.dtype]]:
    """{field: (shape in letters, dtype)} as RolloutBatch's source declares them: one field a line, its shape and dtype
    in the comment beside it (`queries: torch.Tensor  # (B, Q) long: ...`)."""
    import ast
    import inspect
    import io
    import re
    import tokenize

    from hf_ppo.rollout import batch as module

    source = inspect.getsource(module)
    comments = {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    (cls,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "RolloutBatch"]
    dtypes = {"long": torch.long, "bool": torch.bool, "float32": torch.float32}
    found = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign):
            match = re.match(r"#\s*\((?P<shape>[BQR](?:,\s*[BQR])*),?\)\s*(?P<dtype>\w+)\b",
                             comments.get(node.lineno, ""))
            assert match and match["dtype"] in dtypes, f"RolloutBatch.{node.target.id}: no `# (shape) dtype` comment"
            found[node.target.id] = (tuple(re.findall(r"[BQR]", match["shape"])), dtypes[match["dtype"]])
    return found


def test_every_rollout_batch_field_is_declared_on_its_own_line_with_its_shape():
    assert list(documented_fields()) == [f.name for f in fields(RolloutBatch)]


def test_rollout_batch_fields_have_the_documented_shapes_and_dtypes(scripted_rollout, tokenizer):
    result, _ = scripted_rollout
    batch = result.batch
    queries, query_mask = prompt_batch(tokenizer)
    B, Q = queries.shape
    sizes = {"B": B, "Q": Q, "R": R}
    expected = {name: (tuple(sizes[letter] for letter in shape), dtype)
                for name, (shape, dtype) in documented_fields().items()}
    assert set(expected) == {f.name for f in fields(RolloutBatch)}, "a RolloutBatch field without its shape comment"
    for name, (shape, dtype) in expected.items():
        value = getattr(batch, name)
        assert tuple(value.shape) == shape and value.dtype == dtype, (name, tuple(value.shape), value.dtype)
        if value.is_floating_point():
            assert torch.isfinite(value).all(), name
    assert torch.equal(batch.queries, queries) and torch.equal(batch.query_mask, query_mask)
    assert len(batch) == B


def test_rollout_truncates_after_the_stop_token_and_zeroes_masked_positions(scripted_rollout, tokenizer):
    batch = scripted_rollout[0].batch
    pad = tokenizer.pad_token_id
    assert batch.response_mask.sum(1).tolist() == [2, R, 1, R]
    assert batch.contains_stop.tolist() == [True, False, True, True]
    assert (batch.responses[~batch.response_mask] == pad).all()
    assert torch.equal(batch.responses[batch.response_mask],
                       torch.tensor(script(tokenizer))[batch.response_mask])
    for name in ("rewards", "non_score_rewards", "advantages", "returns"):  # documented: 0 at masked positions
        assert (getattr(batch, name)[~batch.response_mask] == 0).all(), name
    assert batch.advantages[batch.response_mask].abs().sum() > 0  # not trivially zero


def test_rollout_scores_get_the_missing_eos_penalty_only_without_a_stop_token(scripted_rollout, tokenizer):
    batch = scripted_rollout[0].batch
    completions = tokenizer.batch_decode(batch.responses, skip_special_tokens=True)
    raw = torch.tensor(length_and_e(PROMPTS, completions))
    assert torch.equal(batch.scores, raw - 1.5 * torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_rollout_stats_are_exactly_rollout_stats_and_finite(scripted_rollout):
    result, _ = scripted_rollout
    assert ROLLOUT_STATS == [
        "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward", "objective/scores",
        "rollout/response_length", "rollout/eos_rate", "val/num_eos_tokens", "val/explained_variance",
        "policy/entropy_avg", "rollout/advantages_mean", "rollout/returns_mean"]
    # Then the combined reward under TRL's names, and each reward's own mean and std, for
    # a single reward too.
    assert list(result.stats)[:len(ROLLOUT_STATS) + 4] == ROLLOUT_STATS + [
        "reward", "reward_std", "rewards/length_and_e/mean", "rewards/length_and_e/std"]
    for name, value in result.stats.items():
        assert torch.is_tensor(value) and value.dim() == 0 and math.isfinite(value.item()), name
    assert result.stats["rollout/eos_rate"].item() == pytest.approx(0.75)
    assert result.stats["rollout/response_length"].item() == pytest.approx((2 + R + 1 + R) / 4)
    assert result.stats["val/num_eos_tokens"].item() == 3
    assert result.stats["objective/scores"].item() == pytest.approx(scripted_rollout[0].batch.scores.mean().item())
    assert result.generate_seconds >= 0 and result.score_seconds >= 0


def test_rollout_step_0_reference_is_the_policy_and_the_engine_samples_the_policy_model(scripted_rollout, lora_policy):
    result, engine = scripted_rollout
    batch = result.batch
    assert engine.events[0][1] is lora_policy.policy_model  # the PeftModel, not the value-head wrapper
    # A fresh adapter (lora_B = 0) is the identity: log-probs with it equal those with it disabled, bitwise.
    assert torch.equal(batch.ref_logprobs, batch.logprobs)
    assert result.stats["objective/kl"].item() == 0 and (batch.non_score_rewards == 0).all()
    assert (batch.logprobs[batch.response_mask] < 0).all()


def test_rollout_logprobs_and_values_are_the_policys_on_each_sequence_alone(scripted_rollout, lora_policy):
    """Step 5 against a plain computation: each row unpadded, log softmax(logits / temperature) at the response
    tokens, and the value head's output at the position before each response token."""
    batch = scripted_rollout[0].batch
    for row in range(len(batch)):
        query = batch.queries[row][batch.query_mask[row]]
        response = batch.responses[row][batch.response_mask[row]]
        ids = torch.cat([query, response])[None]
        with torch.no_grad():
            out = lora_policy(input_ids=ids)
        start, n = len(query) - 1, len(response)
        logprobs = torch.log_softmax(out.logits[0, start:start + n].float() / 0.7, -1)[torch.arange(n), response]
        torch.testing.assert_close(batch.logprobs[row, :n], logprobs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(batch.values[row, :n], out.value[0, start:start + n], rtol=1e-5, atol=1e-5)


def test_rollout_returns_use_the_raw_advantages(lora_policy, tokenizer, scripted_rollout):
    """Whitening changes the advantages only: returns = raw GAE advantages + values, with or without it."""
    whitened = scripted_rollout[0].batch
    raw = run_rollout(lora_policy, tokenizer, ScriptedEngine(script(tokenizer)), whiten_advantages=False).batch
    mask = raw.response_mask
    torch.testing.assert_close(whitened.returns, raw.returns, rtol=0, atol=1e-6)
    torch.testing.assert_close(raw.returns[mask], (raw.advantages + raw.values)[mask], rtol=0, atol=1e-6)
    assert not torch.allclose(whitened.advantages[mask], raw.advantages[mask])
    assert whitened.advantages[mask].mean().abs() < 1e-5  # whitened over the batch's real tokens


def test_rollout_reference_sees_the_adapter_disabled(lora_policy, tokenizer):
    """With a moved adapter, the reference log-probs are the base model's and differ from the policy's."""
    peft = lora_policy.policy_model
    lora_b = [p for n, p in peft.named_parameters() if "lora_B" in n]
    saved = [p.detach().clone() for p in lora_b]
    try:
        with torch.no_grad():
            for p in lora_b:
                p.normal_(std=0.5)
        moved = run_rollout(lora_policy, tokenizer, ScriptedEngine(script(tokenizer))).batch
    finally:
        with torch.no_grad():
            for p, s in zip(lora_b, saved):
                p.copy_(s)
    fresh = run_rollout(lora_policy, tokenizer, ScriptedEngine(script(tokenizer))).batch
    mask = moved.response_mask
    torch.testing.assert_close(moved.ref_logprobs[mask], fresh.logprobs[mask], rtol=0, atol=1e-5)
    assert (moved.logprobs[mask] - moved.ref_logprobs[mask]).abs().max() > 1e-3


def test_rollout_shapes_scores_before_the_rewards_and_keeps_the_raw_scores(lora_policy, tokenizer):
    result = run_rollout(lora_policy, tokenizer, ScriptedEngine(script(tokenizer)), shape_scores=lambda s: 2 * s + 1)
    batch = result.batch
    last = batch.response_mask.long().cumsum(1).argmax(1)  # the last real token of each row
    rows = torch.arange(len(batch))
    # KL is 0 at step 0, so the per-token reward is the shaped score at the last real token and 0 elsewhere.
    assert torch.equal(batch.rewards[rows, last], 2 * batch.scores + 1)
    assert batch.rewards.count_nonzero() == len(batch)


def test_unscored_rows_are_the_nonfinite_ones_and_for_group_estimators_their_groups():
    from hf_ppo.rollout.steps import unscored_rows

    scores = torch.tensor([1.0, float("inf"), 0.0, 2.0, float("nan"), 3.0])
    assert unscored_rows(scores, EstimatorSettings(kl_coef=0.0)).tolist() == [False, True, False, False, True, False]
    grpo = EstimatorSettings(kl_coef=0.0, num_generations=2, advantage_estimator="grpo")  # groups by index: the row
    assert unscored_rows(scores, grpo).tolist() == [False, True, False, False, True, False]
    reinforce_pp = EstimatorSettings(kl_coef=0.0, num_generations=2, advantage_estimator="reinforce_pp")
    assert unscored_rows(scores, reinforce_pp).tolist() == [True, True, False, False, True, True]
    gae_k2 = EstimatorSettings(kl_coef=0.0, num_generations=2)  # gae reads no group: the row alone
    assert unscored_rows(scores, gae_k2).tolist() == [False, True, False, False, True, False]


def one_inf(prompts, completions):
    """A reward that scores row 2 inf and the others as `length_and_e` does."""
    scores = length_and_e(prompts, completions)
    scores[2] = float("inf")
    return scores


def test_a_row_scored_inf_leaves_the_update_and_the_rest_stays_finite(lora_policy, tokenizer):
    queries, query_mask = prompt_batch(tokenizer)
    parts = RolloutParts(ScriptedEngine(script(tokenizer)), one_inf, tokenizer, [tokenizer.eos_token_id])
    settings = RolloutSettings(SamplingSettings(response_length=R, temperature=0.7, forward_batch_size=3),
                               EstimatorSettings(kl_coef=0.05))
    with pytest.warns(UserWarning, match=r"The reward 'one_inf' returned inf for row 2 of the batch"):
        result = rollout(lora_policy, queries, query_mask, PROMPTS, parts, settings)
    batch = result.batch
    assert result.unscored.tolist() == [False, False, True, False]
    assert not batch.response_mask[2].any() and not batch.policy_mask[2].any()  # no token of it trains
    assert batch.response_mask[[0, 1, 3]].any(1).all()
    for f in fields(RolloutBatch):
        value = getattr(batch, f.name)
        assert not value.is_floating_point() or torch.isfinite(value).all(), f.name
    assert batch.scores[2] == 0.0 and math.isfinite(result.stats["objective/scores"].item())
    assert result.stats["objective/scores"].item() == pytest.approx(batch.scores[[0, 1, 3]].mean().item())


def test_sample_and_score_scores_are_the_reward_on_the_decoded_text(lora_policy, tokenizer):
    queries, query_mask = prompt_batch(tokenizer)
    calls = []

    def reward(prompts, completions):
        calls.append((prompts, completions))
        return length_and_e(prompts, completions)

    parts = RolloutParts(ScriptedEngine(script(tokenizer)), reward, tokenizer, [tokenizer.eos_token_id])
    samples = sample_and_score(parts, lora_policy, queries, query_mask, PROMPTS, batch_size=2)
    assert isinstance(samples, Samples)
    ((prompts, completions),) = calls
    assert prompts == PROMPTS  # the prompts' text, without the left padding
    assert completions == tokenizer.batch_decode(samples.responses, skip_special_tokens=True)
    assert completions[1] == tokenizer.decode(script(tokenizer)[1])  # the one that never stopped, whole
    assert torch.equal(samples.scores, torch.tensor(length_and_e(PROMPTS, completions)))  # no penalty here
    assert samples.contains_stop.tolist() == [True, False, True, True]


# ---- MinibatchSchedule: the update order over one rollout ----------------------------------------------------------
def numbered_batch(B: int = 8, Rlen: int = 4) -> RolloutBatch:
    """A synthetic rollout whose row i has queries[i, 0] = i and i % 4 + 1 real response tokens."""
    torch.manual_seed(0)
    lengths = torch.arange(B) % Rlen + 1
    mask = torch.arange(Rlen)[None] < lengths[:, None]
    floats = {name: torch.randn(B, Rlen) for name in ("logprobs", "ref_logprobs", "values", "rewards",
                                                      "non_score_rewards", "advantages", "returns")}
    return RolloutBatch(queries=torch.arange(B)[:, None].repeat(1, 3), query_mask=torch.ones(B, 3, dtype=torch.bool),
                        responses=torch.randint(3, 50, (B, Rlen)), response_mask=mask, scores=torch.randn(B),
                        contains_stop=lengths < Rlen, **floats)


def rows(micro: dict) -> list[int]:
    return micro["batch"].queries[:, 0].tolist()


def drain(schedule: MinibatchSchedule) -> list[dict]:
    out = []
    while not schedule.done:
        out.append(schedule.next())
    return out


def test_schedule_hands_out_every_row_once_per_epoch_in_micro_batches():
    batch = numbered_batch()
    torch.manual_seed(1)
    schedule = MinibatchSchedule.shuffled(batch, num_ppo_epochs=3, num_mini_batches=2, gradient_accumulation_steps=2)
    assert len(schedule) == 3 * 2 * 2
    micro = drain(schedule)
    assert len(micro) == 12 and all(len(m["batch"]) == 2 for m in micro)
    epochs = [sum((rows(m) for m in micro[e * 4:(e + 1) * 4]), []) for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(8))  # every row exactly once per epoch
    assert len({tuple(order) for order in epochs}) == 3  # reshuffled each epoch
    assert [tuple(o) for o in epochs] == [tuple(o) for o in schedule.orders.tolist()]
    # A micro-batch carries every field of its rows.
    m = micro[5]
    index = torch.tensor(rows(m))
    for f in fields(RolloutBatch):
        assert torch.equal(getattr(m["batch"], f.name), getattr(batch, f.name)[index]), f.name


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_schedule_normalizer_is_the_whole_minibatch_count(aggregation):
    batch = numbered_batch()
    schedule = MinibatchSchedule(batch, torch.stack([torch.arange(8), torch.arange(8).flip(0)]), num_mini_batches=2,
                                 gradient_accumulation_steps=2, loss_aggregation=aggregation)
    micro = drain(schedule)
    for i, m in enumerate(micro):
        minibatch = sum((rows(x) for x in micro[i // 2 * 2:i // 2 * 2 + 2]), [])  # both micro-batches of its minibatch
        assert len(minibatch) == 4
        if aggregation == "token_mean":
            expected = int(batch.response_mask[minibatch].sum())  # real tokens of the whole minibatch
        else:
            expected = 4  # sequences of the whole minibatch
        assert int(m["normalizer"]) == expected, (aggregation, i)
    assert rows(micro[0]) + rows(micro[1]) == [0, 1, 2, 3] and rows(micro[4]) == [7, 6]


@pytest.mark.parametrize("stop_after", [0, 3, 6])
def test_schedule_state_dict_resumes_with_exactly_the_remaining_micro_batches(stop_after, tmp_path):
    from safetensors.torch import load_file, save_file

    kwargs = dict(num_mini_batches=2, gradient_accumulation_steps=2, loss_aggregation="token_mean")
    torch.manual_seed(2)
    straight = MinibatchSchedule.shuffled(numbered_batch(), num_ppo_epochs=2, **kwargs)
    expected = drain(straight)
    torch.manual_seed(2)
    interrupted = MinibatchSchedule.shuffled(numbered_batch(), num_ppo_epochs=2, **kwargs)
    for _ in range(stop_after):
        interrupted.next()
    # Through the checkpoint's file format, as a resume reads it.
    save_file(interrupted.state_dict(), str(tmp_path / "buffer.safetensors"))
    torch.manual_seed(99)  # the global RNG at resume time must not matter
    resumed = MinibatchSchedule.from_state_dict(load_file(str(tmp_path / "buffer.safetensors")), **kwargs)
    assert resumed.position == stop_after and len(resumed) == len(straight)
    rest = drain(resumed)
    assert len(rest) == len(expected) - stop_after
    for got, want in zip(rest, expected[stop_after:]):
        assert torch.equal(got["normalizer"], want["normalizer"])
        for f in fields(RolloutBatch):
            assert torch.equal(getattr(got["batch"], f.name), getattr(want["batch"], f.name)), f.name


# ---- TRL's frac_reward_zero_std, and the rewards that gave every sample one value -----------------
def test_frac_reward_zero_std_counts_the_groups_without_spread():
    from hf_ppo.rollout.steps import frac_reward_zero_std

    assert frac_reward_zero_std(torch.tensor([1.0, 1.0, 0.0, 2.0]), 2).item() == 0.5  # by hand: group 1 of 2
    assert frac_reward_zero_std(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0]), 3).item() == 0.5
    assert frac_reward_zero_std(torch.tensor([float("nan"), float("nan")]), 2).item() == 0.0
    # num_generations 1: the whole batch is the one group
    assert frac_reward_zero_std(torch.zeros(4), 1).item() == 1.0
    assert frac_reward_zero_std(torch.tensor([0.0, 0.0, 1.0, 0.0]), 1).item() == 0.0
    assert frac_reward_zero_std(torch.tensor([3.0]), 1).item() == 1.0  # a rollout of one sample (batch size 1)
    gathered = frac_reward_zero_std(torch.zeros(2), 1, gather=lambda t: torch.cat([t, torch.ones(2)]))
    assert gathered.item() == 0.0  # over all processes: another process's samples differ


def test_uniform_rewards_names_each_reward_and_the_score_that_gave_every_sample_one_value():
    from hf_ppo.rollout.steps import uniform_rewards

    applies = torch.tensor([True, True, False, True])
    each = {"exact": (torch.zeros(4), torch.ones(4, dtype=torch.bool)),
            "fmt": (torch.tensor([1.0, 1.0, 5.0, 1.0]), applies),  # the row it does not apply to does not count
            "length": (torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.ones(4, dtype=torch.bool))}
    assert uniform_rewards(torch.tensor([1.0, 2.0, 3.0, 5.0]), each) == {"exact": 0.0, "fmt": 1.0}
    assert uniform_rewards(torch.full((4,), 0.5), {}) == {None: 0.5}
    assert uniform_rewards(torch.tensor([0.5]), {}) == {}  # one sample proves nothing


# ---- issue 63 kind 3: rows without a score leave the advantage estimator (its output with and without them) -------
def test_the_estimators_output_is_the_same_with_an_unscored_row_as_without_it(lora_policy, tokenizer):
    """Whitened GAE advantages of the scored rows: a rollout where row 2 is scored inf gives them exactly what a
    rollout of the other three rows alone gives (the unscored row enters no mean, variance or return)."""
    queries, query_mask = prompt_batch(tokenizer)
    settings = RolloutSettings(SamplingSettings(response_length=R, temperature=0.7, forward_batch_size=3),
                               EstimatorSettings(kl_coef=0.05, gamma=1.0, lam=0.95, whiten_advantages=True,
                                                 whiten_rewards=True))
    rows = script(tokenizer)
    with pytest.warns(UserWarning, match="returned inf"):
        whole = rollout(lora_policy, queries, query_mask, PROMPTS, RolloutParts(
            ScriptedEngine(rows), one_inf, tokenizer, [tokenizer.eos_token_id]), settings).batch
    kept = [0, 1, 3]
    alone = rollout(lora_policy, queries[kept], query_mask[kept], [PROMPTS[i] for i in kept], RolloutParts(
        ScriptedEngine([rows[i] for i in kept]), length_and_e, tokenizer, [tokenizer.eos_token_id]), settings).batch
    mask = alone.policy_mask
    assert torch.equal(whole.policy_mask[kept], mask)
    for name in ("advantages", "returns", "rewards"):
        with_row, without = getattr(whole, name)[kept], getattr(alone, name)
        assert torch.allclose(with_row[mask], without[mask], atol=1e-5), name

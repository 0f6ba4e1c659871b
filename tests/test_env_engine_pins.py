"""Issue 41: pins of environments and the rollout engines that the first tests left loose.

- An environment's `sample()` left-pads the sequences it continues: with prompts and turns of different lengths,
  every continuation is exactly what the policy gives the sequence alone (one row, no padding, no KV cache).
- `missing_eos_penalty` follows the documented rule (docs/guides/environments.md): it applies when the *policy* never
  sampled a stop token; a stop token the environment writes itself does not count, and one the policy sampled in
  an earlier turn does.
- `rollout/tokens_per_second` counts the tokens the policy sampled: not the environment's, not the padding.
- Both engines: a row that samples its stop token early gets padding after it (it never starts again), the other
  rows keep sampling to the end, and step 2 masks everything after the stop token.
"""

import pytest
import torch
from datasets import Dataset
from torch import nn
from transformers import AutoModelForCausalLM
from test_reliability import make_args
from wiring_models import RecordingTrainer

from hf_ppo import EnvSample, Environment
from hf_ppo.rollout.engines import KVCacheSampler, RolloutEngine, StaticCacheSampler
from hf_ppo.rollout.steps import RolloutParts, environment_samples, sample_and_score

# Real prompt lengths 1, 2, 3 and 7 tokens with the tiny tokenizer.
PROMPTS = ["a", "the show", "the movie was", "the food was great and the service"]
STOP_AT = 4  # sequence position (counting real tokens from 0) where `StopsAt` writes EOS
R = 12


class StopsAt(nn.Module):
    """The tiny policy, except that the token at sequence position `STOP_AT` is its stop token (EOS) and EOS and
    padding are impossible anywhere else: a row stops exactly there or never, and no padding comes from the model.
    Positions are the position ids the engines pass (real tokens only), so a prompt of length L < `STOP_AT` stops
    at its new token `STOP_AT - L`, and a longer one never does."""

    def __init__(self, lm, eos: int, pad: int):
        super().__init__()
        self.lm, self.config, self.eos, self.pad = lm, lm.config, eos, pad

    def get_input_embeddings(self):
        return self.lm.get_input_embeddings()

    def forward(self, input_ids, position_ids=None, **kwargs):
        out = self.lm(input_ids=input_ids, position_ids=position_ids, **kwargs)
        if position_ids is None:  # an unpadded sequence: positions 0..L-1
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        logits = out.logits.clone()
        forced = position_ids[:, -logits.shape[1]:] + 1 == STOP_AT  # the next token sits at STOP_AT
        logits[..., [self.eos, self.pad]] = float("-inf")
        logits[forced] = float("-inf")
        logits[..., self.eos] = torch.where(forced, 0.0, float("-inf"))
        out.logits = logits
        return out


@pytest.fixture(scope="module")
def stops_at(tiny_models, tokenizer):
    lm = AutoModelForCausalLM.from_pretrained(tiny_models["policy"]).eval()
    return StopsAt(lm, tokenizer.eos_token_id, tokenizer.pad_token_id).eval()


class Holder(nn.Module):
    """What `sample_and_score` / `environment_samples` read of the actor-critic: its `policy_model`."""

    def __init__(self, policy_model):
        super().__init__()
        self.policy_model = policy_model


def engine(kind: str, tokenizer, **overrides):
    settings = dict(response_length=R, temperature=1.0, top_k=1, top_p=1.0, pad_token_id=tokenizer.pad_token_id,
                    stop_token_ids=[tokenizer.eos_token_id], batch_size=8)
    settings.update(overrides)
    if kind == "static":
        return StaticCacheSampler(compile=False, prompt_bucket=16, **settings)
    return KVCacheSampler(**settings)


@torch.no_grad()
def alone(model, sequence: torch.Tensor, eos: int, limit: int) -> list[int]:
    """Greedy continuation of one unpadded sequence by full forwards (no KV cache, no batch), up to and including
    its first stop token, at most `limit` tokens: what any batched, padded, cached sampler must give."""
    ids, out = sequence[None], []
    while len(out) < limit:
        token = int(model(input_ids=ids).logits[0, -1].argmax())
        out.append(token)
        if token == eos:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def encode(tokenizer, prompts):
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    return batch["input_ids"], batch["attention_mask"].bool()


# ---- the engines: early stops --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["kv_cache", "static"])
def test_a_row_that_stops_early_gets_padding_and_the_others_sample_to_the_end(kind, stops_at, tokenizer):
    """Pins: a row that stopped starts sampling again (its `done` flag lost or not applied), or the static engine's
    stop check ends every row once any row stopped; and step 2 keeps or masks the wrong tokens around the stop."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    queries, query_mask = encode(tokenizer, PROMPTS)
    lengths = query_mask.sum(1).tolist()
    assert lengths == [1, 2, 3, 7]
    # check_every=8 < R: a stop check that ends the batch when any row stopped would cut row 3 after 8 tokens.
    sampler = engine(kind, tokenizer, check_every=8) if kind == "static" else engine(kind, tokenizer)
    out = sampler.generate(stops_at, queries, query_mask)
    assert out.shape == (len(PROMPTS), R)
    for row, length in enumerate(lengths):
        expected = alone(stops_at, queries[row][query_mask[row]], eos, R)
        end = STOP_AT - length + 1 if length < STOP_AT else R  # tokens up to and including the stop
        assert len(expected) == end and (expected[-1] == eos) == (length < STOP_AT), row
        assert out[row, :end].tolist() == expected, row
        assert (out[row, end:] == pad).all(), row  # after the stop token: padding, never a new start
    # Step 2 on what the engine sampled: the stop token is real, everything after it is masked.
    parts = RolloutParts(sampler, lambda prompts, completions: [0.0] * len(completions), tokenizer, [eos])
    samples = sample_and_score(parts, Holder(stops_at), queries, query_mask, PROMPTS, batch_size=8)
    ends = torch.tensor([STOP_AT - n + 1 if n < STOP_AT else R for n in lengths])
    assert torch.equal(samples.response_mask, torch.arange(R)[None] < ends[:, None])
    assert samples.contains_stop.tolist() == [True, True, True, False]
    assert torch.equal(samples.responses, out)


# ---- environments: sample() continues unpadded sequences ----------------------------------------------------------
REPLY = [300, 301, 302]  # the environment's reply: 1 to 3 of these tokens, by row


class Replies(Environment):
    """Two policy turns around a reply of a different length per row; records every (sequence, continuation)."""

    def __init__(self):
        self.calls = []

    def rollout(self, prompts, sample):
        first = self.turn(sample, [p.ids for p in prompts], 5)
        replies = [torch.tensor(REPLY[:1 + row % 3]) for row in range(len(prompts))]
        contexts = [torch.cat([p.ids, f, r]) for p, f, r in zip(prompts, first, replies)]
        second = self.turn(sample, contexts, 4)
        return [EnvSample(torch.cat([f, r, s]), torch.cat([torch.ones(len(f)), torch.zeros(len(r)),
                                                           torch.ones(len(s))]).bool(), 0.0)
                for f, r, s in zip(first, replies, second)]

    def turn(self, sample, sequences, max_new_tokens):
        new = sample(sequences, max_new_tokens=max_new_tokens)
        self.calls.append((sequences, new, max_new_tokens))
        return new


@pytest.mark.parametrize("kind", ["kv_cache", "static"])
def test_sample_continues_each_sequence_as_the_policy_continues_it_alone(kind, stops_at, tokenizer):
    """Pins the padding side of the batch `sample()` builds (right padding, or padding the model attends to):
    prompts of 1-7 tokens, first turns of 2-5 tokens (three rows stop, one is cut at max_new_tokens) and replies of
    1-3 tokens, so every call continues sequences of different lengths."""
    eos = tokenizer.eos_token_id
    queries, query_mask = encode(tokenizer, PROMPTS)
    env = Replies()
    parts = RolloutParts(engine(kind, tokenizer), None, tokenizer, [eos], environment=env)
    out = environment_samples(parts, Holder(stops_at), queries, query_mask, PROMPTS, batch_size=8, response_length=R)
    assert len(env.calls) == 2
    for sequences, continuations, limit in env.calls:
        assert len({len(s) for s in sequences}) == len(sequences)  # every length differs: the padding matters
        for sequence, continuation in zip(sequences, continuations):
            assert continuation.tolist() == alone(stops_at, sequence, eos, limit), sequence.tolist()
    first = [len(c) for c in env.calls[0][1]]
    assert first == [4, 3, 2, 5]  # stopped at STOP_AT, or cut at max_new_tokens
    # The episode as training gets it: policy, reply, policy, then padding, masked.
    for row, sequence in enumerate(env.calls[1][0]):
        episode = torch.cat([sequence[int(query_mask[row].sum()):], env.calls[1][1][row]])
        T = len(episode)
        assert out.responses[row, :T].tolist() == episode.tolist()
        assert (out.responses[row, T:] == tokenizer.pad_token_id).all() and out.response_mask[row].sum() == T
    assert out.contains_stop.tolist() == [True, True, True, False]


# ---- environments: whose stop token counts, and what tokens/second counts -----------------------------------------
class TurnScript(RolloutEngine):
    """Scripted policy turns: call k of `generate` returns `turns[k % len(turns)]` (one row per prompt), whatever the
    model says."""

    def __init__(self, turns: list[list[list[int]]]):
        self.turns, self.calls = [torch.tensor(t) for t in turns], 0

    def generate(self, model, queries, query_mask):
        turn = self.turns[self.calls % len(self.turns)]
        self.calls += 1
        return turn[:queries.shape[0]].to(queries.device)


def scripted_episodes(eos: int):
    """Four episodes (turn 1 cut at 4 tokens, the reply, turn 2 cut at 3) and the penalty the documented rule gives
    each with missing_eos_penalty=1: 0. the policy never stops, the environment's reply holds EOS: penalised;
    1. the policy stops in turn 1, not in turn 2: not penalised; 2. nobody stops: penalised; 3. the policy stops in
    turn 2: not penalised."""
    a, b, c, d, e, f, x = 310, 311, 312, 313, 314, 315, 316
    turn1 = [[a, b, c, d, e, f], [a, eos, x, x, x, x], [b, c, d, e, f, a], [c, d, e, f, a, b]]
    turn2 = [[d, e, f, a, b, c], [e, f, a, b, c, d], [f, a, b, c, d, e], [a, eos, x, x, x, x]]
    replies = [[300, eos, 301], [300], [301, 302], [302]]
    return turn1, turn2, replies, [-1.0, 0.0, -1.0, 0.0]


class ScriptedReplies(Environment):
    def __init__(self, replies):
        self.replies = replies

    def rollout(self, prompts, sample):
        first = sample([p.ids for p in prompts], max_new_tokens=4)
        replies = [torch.tensor(r) for r in self.replies]
        second = sample([torch.cat([p.ids, f, r]) for p, f, r in zip(prompts, first, replies)], max_new_tokens=3)
        return [EnvSample(torch.cat([f, r, s]), torch.cat([torch.ones(len(f)), torch.zeros(len(r)),
                                                           torch.ones(len(s))]).bool(), 0.0)
                for f, r, s in zip(first, replies, second)]


def test_missing_eos_penalty_and_tokens_per_second_read_the_policys_tokens(tiny_models, tokenizer, tmp_path):
    """Pins the documented rule of `missing_eos_penalty` with an environment (the policy never sampled a stop token;
    the environment's own EOS does not count, an earlier turn's does), and that `rollout/tokens_per_second` counts
    the policy's tokens: not the environment's (response_mask), not the padding (B x response_length)."""
    eos = tokenizer.eos_token_id
    turn1, turn2, replies, penalties = scripted_episodes(eos)
    trainer = RecordingTrainer(
        model=tiny_models["policy"], processing_class=tokenizer, environment=ScriptedReplies(replies),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        args=make_args(tmp_path, per_device_train_batch_size=4, num_mini_batches=1, num_ppo_epochs=1, max_steps=1,
                       response_length=R, missing_eos_penalty=1.0))
    assert list(trainer.stop_token_ids) == [eos]
    trainer.rollout_engine = TurnScript([turn1, turn2])
    trainer.train()
    assert trainer.rollout_engine.calls == 2

    def stop_cut(row, limit):
        return row[:row.index(eos) + 1][:limit] if eos in row else row[:limit]

    expected, policy_tokens, env_tokens = {}, 0, 0
    for t1, reply, t2, penalty in zip(turn1, replies, turn2, penalties):
        first, second = stop_cut(t1, 4), stop_cut(t2, 3)
        expected[tuple(first + reply + second)] = penalty
        policy_tokens, env_tokens = policy_tokens + len(first) + len(second), env_tokens + len(reply)
    batch = trainer.micro_batches[0]
    assert len(batch) == 4
    got = {tuple(batch.responses[row][batch.response_mask[row]].tolist()): float(batch.scores[row])
           for row in range(4)}
    assert got == expected
    log = trainer.state.log_history[0]
    assert log["rollout/eos_rate"] == 0.5
    counted = log["rollout/tokens_per_second"] * log["time/generate"]
    assert policy_tokens == 25 and env_tokens == 7
    assert counted == pytest.approx(policy_tokens, rel=1e-4)

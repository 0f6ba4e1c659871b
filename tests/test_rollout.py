"""The rollout's own pieces: the KV-cached sampler (against HF generate), stop-token truncation, and scoring."""

import pytest
import torch

from hf_ppo.generation import generate, sample_token
from hf_ppo.rollout import truncate_after_stop


@pytest.fixture(scope="module")
def policy(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["policy"]).eval()


def test_greedy_decoding_matches_hf_generate(policy, tokenizer):
    """top_k=1 makes sampling greedy: the lean decode loop must produce HF generate's tokens, left padding included."""
    batch = tokenizer(["the movie was", "a", "the food was very"], return_tensors="pt", padding=True)
    ours = generate(policy, batch["input_ids"], batch["attention_mask"].bool(), response_length=10, temperature=0.7,
                    top_k=1, top_p=1.0, pad_token_id=tokenizer.pad_token_id, stop_token_ids=None, batch_size=2)
    theirs = policy.generate(**batch, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=None)[:, batch["input_ids"].shape[1]:]
    assert torch.equal(ours, theirs)


def test_rows_stop_at_the_stop_token_and_pad_after(policy, tokenizer):
    batch = tokenizer(["the movie was", "the food was"], return_tensors="pt", padding=True)
    greedy = generate(policy, batch["input_ids"], batch["attention_mask"].bool(), response_length=6, temperature=1.0,
                      top_k=1, top_p=1.0, pad_token_id=tokenizer.pad_token_id, stop_token_ids=None, batch_size=8)
    stop = int(greedy[0, 2])  # pretend the third greedy token of row 0 is the stop token
    out = generate(policy, batch["input_ids"], batch["attention_mask"].bool(), response_length=6, temperature=1.0,
                   top_k=1, top_p=1.0, pad_token_id=tokenizer.pad_token_id, stop_token_ids=stop, batch_size=8)
    first = (greedy[0] == stop).nonzero()[0].item()
    assert torch.equal(out[0, :first + 1], greedy[0, :first + 1])
    assert (out[0, first + 1:] == tokenizer.pad_token_id).all()


def test_sample_token_top_k_and_top_p():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    assert set(sample_token(logits, 1.0, top_k=2, top_p=1.0).tolist()) == {0, 1}
    # Nucleus 0.7: 0.5 alone is below it, 0.5 + 0.3 reaches it -> tokens {0, 1}.
    assert set(sample_token(logits, 1.0, top_k=None, top_p=0.7).tolist()) == {0, 1}
    assert set(sample_token(logits, 1.0, top_k=None, top_p=0.4).tolist()) == {0}
    counts = torch.bincount(sample_token(logits, 1.0, top_k=None, top_p=1.0), minlength=4).float() / 2000
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

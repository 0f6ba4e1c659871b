"""The tokenizer checks of `hf_ppo.models.tokenizers`: how many unused embedding rows a vocabulary's padding
explains, and the warning for a tokenizer that leaves more unused (another model's tokenizer)."""

from __future__ import annotations

import warnings

import pytest

from hf_ppo.cli.tiny import build_causal_lm, build_tokenizer
from hf_ppo.models.tokenizers import check_vocab, spare_rows_expected


@pytest.mark.parametrize("rows, needed", [
    (51200, 50295),    # Phi-2: its tokens padded to a multiple of 1024
    (102400, 100015),  # DeepSeek LLM: to a multiple of 4096
    (151936, 151665),  # Qwen2.5
    (152064, 151665),  # Qwen2.5-7B
    (50304, 50277),    # Pythia: a multiple of 128
    (50272, 50265),    # OPT: a multiple of 8
    (32128, 32100),    # T5
    (1024, 417),       # a tiny vocabulary padded to a multiple of 1024
])
def test_the_padding_of_real_vocabularies_is_expected(rows, needed):
    assert rows - needed <= spare_rows_expected(rows)


@pytest.mark.parametrize("rows, needed", [
    (417, 300),      # a 300-id tokenizer on the tiny policy's 417-row embedding
    (448, 300),      # a multiple of 64, yet no padding of 300 ids reaches it
    (32768, 300),    # a 32k vocabulary (Mistral's) with a tiny tokenizer
    (4417, 417),     # another model's vocabulary, 4000 rows larger
])
def test_far_more_rows_than_a_padding_explains_are_unexpected(rows, needed):
    assert rows - needed > spare_rows_expected(rows)


def test_a_300_id_tokenizer_on_the_417_row_policy_is_warned_about():
    """Issue 49 item 11: the floor of 1024 spare rows exceeded the whole embedding of a small vocabulary, so any
    smaller tokenizer passed; a 300-id tokenizer whose ids mean other tokens to the policy now warns."""
    own, other = build_tokenizer(), build_tokenizer(vocab_size=300)
    model = build_causal_lm(own)
    assert (model.get_input_embeddings().weight.shape[0], len(other)) == (417, 300)
    with pytest.warns(UserWarning, match="tokenizer has 300 token ids but the policy's embedding has 417 rows: 117 rows "
                                         "no id reaches.*another model's tokenizer"):
        assert check_vocab(model, other, "policy", "", warn_unused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not check_vocab(model, own, "policy", "", warn_unused=True)  # its own tokenizer: silent

"""The answer check of the math recipe (`hf_ppo.rewards.answers`, `hf_ppo.rewards.exact_answer`) on hand-written
completions and GSM8K answers, and its offline twin: `hf-ppo train` with `reward_funcs` in a YAML raises a tiny
policy's accuracy on held-out sums."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from hf_ppo.rewards import exact_answer, extract_answer, parse_number, reference_answer

REPO = Path(__file__).resolve().parents[2]

# GSM8K's first training row, as the dataset stores it: the worked solution, then "#### <answer>".
GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
                "in April and May.\n#### 72")


@pytest.mark.parametrize("text, expected", [
    ("#### 42", 42),
    ("She pays 3 * 4 = 12 dollars.\n#### 12", 12),
    ("####42", 42),
    ("#### 1,200.00", 1200),
    ("#### $1,200", 1200),
    ("#### 42.", 42),
    ("#### -3", -3),
    ("#### \u22123", -3),  # the typographic minus
    ("#### 50%", 50),
    ("#### 0.5", Fraction(1, 2)),
    ("#### 3/4", Fraction(3, 4)),
    ("#### 42 apples", 42),
    ("The answer is 42.", 42),
    ("So the final answer is: $42", 42),
    ("Answer: **7**", 7),
    ("\\boxed{42}", 42),
    ("\\boxed{\\frac{3}{4}}", Fraction(3, 4)),
    ("\\boxed{1{,}000\\text{ apples}}", 1000),
    ("The answer is \\boxed{12}.", 12),  # "answer is" reads no number, the box does
    ("#### 5\nWait, I made a mistake. #### 6", 6),  # the last marked answer wins
    ("The answer is 5. Checking: 2 + 3 = 5, and 5 * 2 = 10", 5),  # numbers after the marker do not count
    ("#### forty-two\n#### 42", 42),  # a marker without a number is skipped
])
def test_extract_answer_reads_the_last_marked_number(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text", [
    "",
    "I think it is 42",  # no marker: strict by default, no last-number fallback
    "48 / 2 = 24, 24 + 48 = 72",
    "#### forty-two",
    "\\boxed{x + 1}",
    "#### ",
    "The answer is unknown",
])
def test_no_marked_number_is_no_answer(text):
    assert extract_answer(text) is None


def test_the_last_number_fallback_is_opt_in():
    assert extract_answer("48 / 2 = 24, 24 + 48 = 72", strict=False) == 72
    assert extract_answer("#### 70\nthen 2 more: 72", strict=False) == 70  # a marked answer still wins
    assert extract_answer("no number here", strict=False) is None


@pytest.mark.parametrize("token, expected", [("1,234", 1234), ("$5", 5), ("\\$5", 5), ("-0.25", Fraction(-1, 4)),
                                             ("7/0", None), ("1.2.3", None), ("abc", None), ("", None), ("-", None)])
def test_parse_number(token, expected):
    assert parse_number(token) == expected


def test_reference_answer_reads_gsm8k_solutions_bare_numbers_and_numbers():
    assert reference_answer(GSM8K_ANSWER) == 72
    assert reference_answer("1,200") == 1200 and reference_answer(" 42 ") == 42
    assert reference_answer(42) == 42 and reference_answer(0.5) == Fraction(1, 2)


@pytest.mark.parametrize("bad, error", [("no number at all", ValueError), ("", ValueError), (None, TypeError),
                                        (True, TypeError), (["42"], TypeError)])
def test_an_unreadable_reference_is_an_error_naming_the_row(bad, error):
    with pytest.raises(error, match="row 1"):
        exact_answer(["#### 1", "#### 2"], ["1", bad])


def test_exact_answer_scores_text_and_trl_chat_completions():
    completions = [
        "48 / 2 = 24 and 48 + 24 = 72.\n#### 72",
        [{"role": "assistant", "content": "The answer is 72."}],  # TRL's conversational form
        "I think it is 72",  # right number, no marker: 0
        "#### 70",
        "#### 72.00",
        "#### 72\nNo wait, #### 73",
    ]
    scores = exact_answer(completions=completions, answer=[GSM8K_ANSWER] * 6, prompts=["q"] * 6,
                          completion_ids=[[1]] * 6, question=["q"] * 6)
    assert scores == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    assert all(isinstance(s, float) for s in scores)


def test_exact_answer_refuses_misaligned_columns_and_odd_completions():
    with pytest.raises(ValueError, match="2 completions and 1 answers"):
        exact_answer(["#### 1", "#### 2"], ["1"])
    with pytest.raises(TypeError, match="conversational form"):
        exact_answer([{"content": "#### 1"}], ["1"])


def test_the_yaml_name_is_the_function():
    import hf_ppo.rewards
    from hf_ppo.rewards import answers

    assert hf_ppo.rewards.exact_answer is answers.exact_answer


def test_the_gsm8k_recipe_parses_and_names_its_reward():
    """Its keys are options of `hf-ppo train` and its reward function imports (the Hub ids are not fetched; bf16 is
    switched off from the command line because TrainingArguments refuses it without a GPU)."""
    from hf_ppo.cli.train import parse_args

    script_args, model_args, config = parse_args(["--config", str(REPO / "hf_ppo/cli/configs/gsm8k_ppo.yaml"),
                                                  "--bf16", "false"], command="hf-ppo train")
    assert (script_args.dataset_name, script_args.dataset_config) == ("openai/gsm8k", "main")
    assert model_args.reward_funcs == ["hf_ppo.rewards.exact_answer"] and model_args.reward_model_name_or_path is None
    assert [f.func for f in model_args.loaded_reward_funcs] == [exact_answer]
    assert config.critic in ("shared", "separate") and config.advantage_estimator == "gae"
    assert "####" in config.system_prompt
    assert config.rollout_batch_size == 256 and config.optimizer_steps_per_iteration == 4
    assert config.max_steps % config.optimizer_steps_per_iteration == 0


@pytest.mark.slow
def test_hf_ppo_train_with_reward_funcs_raises_held_out_accuracy(tmp_path):
    """The offline twin end to end (about 30 s on one core): a tiny policy after a short SFT pass gets ~15% of 80
    held-out sums right; `hf-ppo train --config hf_ppo/cli/configs/arithmetic.yaml` (reward_funcs:
    [hf_ppo.rewards.exact_answer], reading the `answer` column) takes it well above that."""
    import torch
    from transformers import AutoTokenizer

    from hf_ppo.cli import arithmetic, main

    # One thread: the tiny model's ops are too small to split, and two threads on two busy cores spin (10x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train_and_compare(tmp_path, arithmetic, main, AutoTokenizer)
    finally:
        torch.set_num_threads(threads)


def _train_and_compare(tmp_path, arithmetic, main, AutoTokenizer):
    arithmetic.quiet_console()
    sft = arithmetic.build_sft_policy(tmp_path / "sft")
    train_pairs, held_out_pairs = arithmetic.split_pairs()
    assert not set(train_pairs) & set(held_out_pairs)
    train = arithmetic.write_jsonl(tmp_path / "train.jsonl", arithmetic.rows(train_pairs))
    held_out = arithmetic.rows(held_out_pairs)
    tokenizer = AutoTokenizer.from_pretrained(sft)
    before = arithmetic.accuracy(arithmetic.load_policy(sft), tokenizer, held_out)
    # The SFT policy has the format and some sums, not all. Its start depends on the CPU's float kernels (15% where
    # the bench ran, 41% on an AMD EPYC): the test asks for the rise, not for one machine's start.
    assert 0.05 <= before <= 0.5, before

    main(["train", "--config", str(REPO / "hf_ppo/cli/configs/arithmetic.yaml"), "--model_name_or_path", str(sft),
          "--dataset_name", str(train), "--output_dir", str(tmp_path / "ppo")])
    after = arithmetic.accuracy(arithmetic.load_policy(tmp_path / "ppo"), tokenizer, held_out)
    assert after >= before + 0.15, (before, after)


# ---- system_prompt (the recipe's key the GSM8K config uses) -----------------------------------------------------

SYSTEM = "Give the final answer as '#### <number>'."


def test_system_prompt_makes_text_prompts_chats_and_leads_chat_prompts(tok):
    from datasets import Dataset

    from hf_ppo.cli.train import with_system_prompt

    text = Dataset.from_dict({"prompt": ["What is 1 + 2?"], "answer": ["3"]})
    out = with_system_prompt(text, SYSTEM, tok, "q.jsonl")
    assert out[0]["prompt"] == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 1 + 2?"}]
    assert out[0]["answer"] == "3"
    chat = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]]})
    assert with_system_prompt(chat, SYSTEM, tok, "c.jsonl")[0]["prompt"][0] == {"role": "system", "content": SYSTEM}
    assert with_system_prompt(text, None, tok, "q.jsonl") is text


def test_system_prompt_refuses_what_it_cannot_do(tok):
    from datasets import Dataset

    from hf_ppo.cli.train import with_system_prompt
    from hf_ppo.cli.tiny import build_tokenizer

    has_system = Dataset.from_dict({"prompt": [[{"role": "user", "content": "a"}],
                                               [{"role": "system", "content": "b"}, {"role": "user", "content": "c"}]]})
    with pytest.raises(ValueError, match="Row 1 of 'c.jsonl' already opens with a system message"):
        with_system_prompt(has_system, SYSTEM, tok, "c.jsonl")
    with pytest.raises(ValueError, match="token ids"):
        with_system_prompt(Dataset.from_dict({"input_ids": [[1, 2]]}), SYSTEM, tok, "ids.jsonl")
    with pytest.raises(ValueError, match="no chat template"):
        with_system_prompt(Dataset.from_dict({"prompt": ["a"]}), SYSTEM, build_tokenizer(chat_template=None), "q")


def test_hf_ppo_train_gives_the_system_prompt_and_the_answer_column_to_reward_funcs(tiny_models, tmp_path):
    """`system_prompt` and `reward_funcs` in one YAML: every call sees chat prompts that open with the system message
    and the `answer` of each completion's own row."""
    import json

    from hf_ppo.cli import main

    rows = [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(8)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(
        "CALLS = []\n"
        "def check(prompts, completions, answer, **kwargs):\n"
        "    for p, c, a in zip(prompts, completions, answer):\n"
        f"        assert p[0] == {{'role': 'system', 'content': {SYSTEM!r}}}, p\n"
        "        assert isinstance(c, list) and c[0]['role'] == 'assistant', c\n"
        "        assert int(p[1]['content'].split()[2]) + 1 == int(a), (p, a)\n"
        "    CALLS.append(len(prompts))\n"
        "    return [0.0] * len(prompts)\n")
    (tmp_path / "run.yaml").write_text(
        f"dataset_name: q.jsonl\nsystem_prompt: \"{SYSTEM}\"\nmodel_name_or_path: {tiny_models['policy']}\n"
        "reward_funcs: [rewards.py:check]\nresponse_length: 4\nper_device_train_batch_size: 4\nnum_mini_batches: 1\n"
        "num_ppo_epochs: 1\nmax_steps: 1\nreport_to: none\nsave_strategy: 'no'\nnum_sample_generations: 0\n"
        f"output_dir: {tmp_path / 'out'}\n")
    main(["train", "--config", str(tmp_path / "run.yaml")])
    import sys

    calls = [m for name, m in sys.modules.items() if getattr(m, "__file__", None) == str(tmp_path / "rewards.py")]
    assert calls and sum(calls[0].CALLS) >= 4


def test_float_answers_compare_as_the_decimals_they_were_written_as():
    """Issue 49 item 2: a float in the `answer` column is the decimal it was written as (0.1, not its binary
    fraction 3602879701896397/36028797018963968), whatever float type holds it."""
    import numpy as np

    answers = [0.1, 0.3, np.float64(1.1), np.float32(2.5), np.float32(0.1), 12.0, 1e-07, -0.75]
    written = ["0.1", "0.3", "1.1", "2.5", "0.1", "12", "0.0000001", "-3/4"]
    assert exact_answer([f"#### {w}" for w in written], answers) == [1.0] * len(answers)
    assert reference_answer(0.1) == Fraction(1, 10) and reference_answer(np.float64(1.1)) == Fraction(11, 10)
    assert exact_answer(["#### 0.1000000000000000055511151231257827"], [0.1]) == [0.0]
    assert reference_answer(np.int64(7)) == 7 and reference_answer(Fraction(1, 3)) == Fraction(1, 3)


def test_a_float32_answer_column_scores_the_right_answers_right(tmp_path):
    """Issue 60 item 3: a float32 column (datasets' Value("float32"), parquet, pandas) hands its cells back as Python
    floats (0.1 as 0.10000000149011612): they are read at float32's precision, so the answer written is the one
    scored right; a float64 answer keeps its own precision."""
    import numpy as np
    import pandas as pd
    from datasets import Dataset, Features, Value

    written = ["0.1", "3.3", "2.5", "-0.7", "1234.56", "72"]
    values = [0.1, 3.3, 2.5, -0.7, 1234.56, 72.0]
    column = Dataset.from_dict({"answer": values}, features=Features({"answer": Value("float32")}))["answer"]
    assert column[0] == 0.10000000149011612  # what a float32 cell is, read back
    assert exact_answer([f"#### {w}" for w in written], column) == [1.0] * len(written)
    pd.DataFrame({"answer": np.array(values, dtype=np.float32)}).to_parquet(tmp_path / "answers.parquet")
    from_parquet = Dataset.from_parquet(str(tmp_path / "answers.parquet"))["answer"]
    assert exact_answer([f"#### {w}" for w in written], from_parquet) == [1.0] * len(written)
    assert exact_answer(["#### 0.10000000149011612", "#### 0.3"], [float(np.float32(0.1)), 0.3]) == [0.0, 1.0]
    assert reference_answer(float(np.float32(3.3))) == Fraction(33, 10)
    assert reference_answer(1 / 3) == Fraction("0.3333333333333333")  # float64: its own shortest text
    assert reference_answer(16777217.0) == 16777217  # no float32 holds it: read at float64's precision
    assert reference_answer(np.float16(0.1)) == Fraction(1, 10)  # numpy's own types: their own precision
    assert reference_answer(np.float64(np.float32(0.1))) == Fraction(1, 10)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_float_answer_is_an_error_naming_the_row(bad):
    with pytest.raises(ValueError, match="row 1.*not a finite number"):
        exact_answer(["#### 1", "#### 2"], [1, bad])


@pytest.mark.parametrize("token, expected", [("1,234", 1234), ("12,345,678", 12345678), ("-1,234.5", Fraction(2469, -2)),
                                             ("1,5", None), ("1,23", None), ("12,34,567", None), ("1234,567", None),
                                             ("1,2345", None), (",5", None), ("1,,000", None)])
def test_only_proper_thousands_separators_are_removed(token, expected):
    assert parse_number(token) == expected


def test_a_comma_that_is_no_thousands_separator_is_no_answer():
    assert extract_answer("#### 1,5") is None
    assert exact_answer(["#### 1,5", "#### 1,500", "#### 15"], ["15", "1500", "15"]) == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="row 0"):
        reference_answer("1,5", 0)


# ---- i53r: answers in the forms models write them, read as meant (each was silently 0, or another number) ----

@pytest.mark.parametrize("text", ["**Answer:** 42", "**Final Answer:** 42", "**Answer**: 42", "*The answer is* 42",
                                  "**The final answer is:** $42$."])
def test_markdown_emphasis_around_the_marker_is_part_of_it(text):
    """Chat models bold the marker: the "**" after it is no answer, and a right answer scored 0."""
    assert extract_answer(text) == 42
    assert exact_answer([text, text], ["42", "41"]) == [1.0, 0.0]


@pytest.mark.parametrize("text, expected", [("Answer: -$5", -5), ("#### -\\$5", -5), ("The answer is -$1,200.", -1200),
                                            ("\\boxed{-\\frac{3}{4}}", Fraction(-3, 4)),
                                            ("\\boxed{\u2212\\dfrac{3}{4}}", Fraction(-3, 4)),
                                            ("#### -(5)", -5), ("#### --5", None), ("#### -$", None)])
def test_a_sign_before_a_currency_sign_or_a_frac_negates_it(text, expected):
    assert extract_answer(text) == expected


def test_a_negative_frac_reference_and_completion_compare_as_numbers():
    assert reference_answer("-\\frac{3}{4}") == Fraction(-3, 4)
    assert exact_answer(["\\boxed{-\\frac{3}{4}}"] * 3, ["-3/4", "3/4", -0.75]) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("text, expected", [("\\boxed{\\text{42}}", 42), ("\\boxed{\\mathbf{42}}", 42),
                                            ("\\boxed{\\textbf{42}}", 42), ("\\boxed{{42}}", 42),
                                            ("\\boxed{\\text{ 1,200 }}", 1200), ("\\boxed{90^\\circ}", 90),
                                            ("\\boxed{90^{\\circ}}", 90), ("\\boxed{\\tfrac{1}{2}}", Fraction(1, 2)),
                                            ("\\boxed{{x}}", None), ("\\boxed{\\text{42}\\text{43}}", None)])
def test_what_wraps_a_boxed_number_is_read_through(text, expected):
    """`\\text{...}` is a unit beside a number ("42\\text{ apples}"), but the number itself when it wraps all of the
    box: dropping it left nothing, and a right answer scored 0."""
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("The answer is 48 - 12 = 36.", 36),  # not 48, the first token
    ("So the answer is 36 = 48 - 12", 36),
    ("The answer is $48 \\times 2 = 96$.", 96),
    ("The answer is 10 \u2212 4 = 6", 6),
    ("answer: 5 - 2 = 3 + 1 = 4 apples", 4),
    ("#### 3 / 4", Fraction(3, 4)),  # not 3
    ("#### 2 + 3", None),  # an expression with no result is no answer, never 2
    ("#### 7 / 0", None),
    ("The answer is 12.\n- 3 apples", 12),  # the sentence (and the line) ends the expression
    ("#### 42\n= 43", 42),
    ("The answer is 5 - that is all", 5),
    ("The answer is:\n42", 42),
])
def test_an_expression_after_the_marker_is_read_as_its_result(text, expected):
    assert extract_answer(text) == expected


def test_the_first_number_of_an_expression_is_never_paid_as_the_answer():
    """Read token by token, "The answer is 48 - 12 = 36" was 48: paid against a reference of 48, 0 against 36."""
    text = "She has 48 - 12 = 36 left, so the answer is 48 - 12 = 36."
    assert exact_answer([text, text], ["36", "48"]) == [1.0, 0.0]
    assert exact_answer(["#### 2 + 3"] * 2, ["2", "5"]) == [0.0, 0.0]


# ---- i53s: space-grouped thousands, spaced math delimiters, explicit signs (each was silently another number, or 0) --

@pytest.mark.parametrize("text, expected", [
    ("#### 1 000", 1000),  # not 1
    ("#### 12 345", 12345),  # not 12
    ("#### 12 345 678.5", Fraction(24691357, 2)),
    ("#### -1 000", -1000),
    ("#### 1\u202f000", 1000), ("#### 1\u2009000", 1000), ("#### 1\u00a0000", 1000),  # narrow no-break, thin, no-break
    ("The answer is $1\\,000$.", 1000), ("\\boxed{1 000}", 1000),
    ("The answer is 5 000 - 3 = 4 997", 4997),
])
def test_space_grouped_thousands_are_one_number(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("#### 12 apples 345", 12),  # a word between: the number is 12, as "#### 42 apples" is 42
    ("#### 3 5", None),  # a list (or 3.5, or 35): no number, as "#### 3,5" is none
    ("#### 12 3456", None), ("#### 1234 567", None), ("#### 1 000 5", None), ("#### 1,000 000", None),
    ("#### 1 000,5", None),
    ("#### 5 3/4", None),  # a mixed number (5.75), never 5
    ("The answer is 12. 5 apples", 12),  # the sentence ends the answer
])
def test_numbers_side_by_side_that_are_no_grouping_are_no_answer(text, expected):
    assert extract_answer(text) == expected


def test_space_grouping_pays_the_grouped_number_only():
    completions = ["#### 1 000", "#### 12 345", "#### 3 5", "#### 12 apples 345"]
    assert exact_answer(completions, ["1000", "12345", "3", "12"]) == [1.0, 1.0, 0.0, 1.0]
    assert exact_answer(["#### 1 000", "#### 12 345"], ["1", "12"]) == [0.0, 0.0]
    assert extract_answer("the total is 1 000", strict=False) == 1000  # the fallback's last number too, not 0
    assert reference_answer("12 345") == 12345 and parse_number("3 5") is None


@pytest.mark.parametrize("text", ["The answer is \\( 42 \\)", "The answer is \\(42\\)", "The answer is \\[ 42 \\]",
                                  "The answer is \\[42\\].", "The answer is:\n\\[\n42\n\\]", "The answer is $ 42 $",
                                  "The answer is $$42$$", "The answer is \\( 48 - 6 = 42 \\)."])
def test_math_delimiters_around_the_answer_are_read_through(text):
    """A space after "\\(" made "\\(" the answer (no number), and "\\)" was stripped as ")" leaving "42\\": a right
    answer scored 0."""
    assert extract_answer(text) == 42
    assert exact_answer([text, text], ["42", "41"]) == [1.0, 0.0]


@pytest.mark.parametrize("text, expected", [("#### +5", 5), ("#### +$5", 5), ("The answer is +3/4.", Fraction(3, 4)),
                                            ("\\boxed{+5}", 5), ("#### +-5", None), ("#### ++5", None),
                                            ("\\boxed{\\frac{7}{-2}}", Fraction(-7, 2)),
                                            ("\\boxed{\\dfrac{-7}{-2}}", Fraction(7, 2)),
                                            ("\\boxed{-\\frac{7}{-2}}", Fraction(7, 2))])
def test_an_explicit_plus_sign_and_a_negative_denominator_are_read(text, expected):
    assert extract_answer(text) == expected


def test_signed_answers_score_against_their_references():
    assert exact_answer(["#### +5", "\\boxed{\\frac{7}{-2}}", "\\boxed{\\frac{7}{-2}}"], ["5", "-3.5", "3.5"]) \
        == [1.0, 1.0, 0.0]


# ---- issue 63 kind 4: a second side, a second message ----------------------------------------------------------------
def test_of_an_equation_of_two_numbers_the_last_side_is_the_answer():
    assert extract_answer("the answer is 40 = 42") == 42  # not 40, the first side
    assert extract_answer("#### 7 = 6 + 1 = 5") == 5


def test_a_conversational_completion_with_several_messages_is_read_from_the_last():
    completion = [{"role": "assistant", "content": "#### 70"}, {"role": "tool", "content": "72"},
                  {"role": "assistant", "content": "So the answer is 72."}]
    assert exact_answer(completions=[completion], answer=[GSM8K_ANSWER]) == [1.0]
    assert exact_answer(completions=[completion[:1]], answer=[GSM8K_ANSWER]) == [0.0]

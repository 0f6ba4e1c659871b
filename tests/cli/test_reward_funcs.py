"""`reward_funcs` in the YAML recipe (`hf-ppo train`) and in `hf-ppo evaluate`: entries by dotted path, by file and
as factories; combined with a reward model and reward_weights; every bad entry refused before a model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trl.rewards
import yaml
from tests.cli.test_train import TINY_RUN

from hf_ppo.cli import command, train
from hf_ppo.cli.reward_funcs import RewardFuncsError, load_reward_funcs

# What `record_answer` saw during a run: (prompt's user text, answer, completion's role) per completion.
SEEN: list[tuple[str, str, str]] = []


def record_answer(prompts, completions, answer, **kwargs):
    """A TRL-style reward function this module exposes by dotted path (`tests.cli.test_reward_funcs.record_answer`)."""
    SEEN.extend((p[-1]["content"], a, c[0]["role"]) for p, c, a in zip(prompts, completions, answer))
    return [1.0 if a in c[0]["content"] else 0.0 for c, a in zip(completions, answer)]


def explode(completions, completion_ids, **kwargs):
    """Fails on real completions (the construction probe passes empty ones)."""
    if any(completion_ids):
        raise ZeroDivisionError("the checker divided by zero")
    return [0.0] * len(completions)


REWARDS_FILE = '''
SCALE = 2.0


def exact(completions, answer, **kwargs):
    return [SCALE if a in (c if isinstance(c, str) else c[0]["content"]) else 0.0 for c, a in zip(completions, answer)]


def needs_gold(completions, gold):
    return [0.0 for _ in completions]
'''


def _project(tmp_path: Path, tiny_models: dict, rows: list[dict] | None = None, **extra) -> Path:
    """configs/run.yaml with rewards.py beside it and data/prompts.jsonl (chat prompts with an answer column)."""
    root = tmp_path / "project"
    (root / "configs").mkdir(parents=True)
    (root / "data").mkdir()
    rows = rows or [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?"}], "answer": str(2 * i)}
                    for i in range(4)]
    (root / "data" / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "configs" / "rewards.py").write_text(REWARDS_FILE)
    config = {
        "dataset_name": str(root / "data" / "prompts.jsonl"), "prompt_column": "messages",
        "model_name_or_path": tiny_models["policy"],
        "output_dir": str(tmp_path / "out"),
        **TINY_RUN, "max_steps": 1, **extra,
    }
    (root / "configs" / "run.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return root


class Built(Exception):
    """Raised by the stand-in trainer: the run got as far as building the trainer (where the models load)."""


@pytest.fixture
def no_model_loads(monkeypatch):
    """PPOLMTrainer (where every model loads) replaced: a call records its arguments and stops the run."""
    calls = []

    def trainer(**kwargs):
        calls.append(kwargs)
        raise Built

    monkeypatch.setattr(train, "PPOLMTrainer", trainer)
    import hf_ppo.trainer

    monkeypatch.setattr(hf_ppo.trainer, "PPOLMTrainer", trainer)  # what `hf-ppo evaluate` imports
    return calls


FACTORY = "trl.rewards.get_soft_overlong_punishment"


@pytest.mark.parametrize("entry, expected", [
    ("no_such_pkg.rewards.exact", ["'no_such_pkg.rewards.exact'", "No module named 'no_such_pkg'",
                                   "install the package", "rewards.py:<function name>"]),
    ("trl.rewards.acuracy_reward", ["'trl.rewards' has no 'acuracy_reward'", "accuracy_reward,", "Fix the name"]),
    ("rewards.py:exact_match", ["'rewards.py:exact_match'", "has no 'exact_match'", "exact", "needs_gold"]),
    ("rewards.py:SCALE", ["'rewards.py:SCALE' is not callable (it is float 2.0)", "name a function"]),
    ("elsewhere/rewards.py:exact", ["the file 'elsewhere/rewards.py' was not found", "configs/elsewhere/rewards.py",
                                    "Fix the path"]),
    ({FACTORY: {"max_len": 10}}, [FACTORY, "unexpected keyword argument 'max_len'", "Fix the arguments",
                                  "max_completion_len: int, soft_punish_cache: int"]),
    ({FACTORY: {"max_completion_len": 10, "soft_punish_cache": 2}, "x.y": {}}, ["a mapping with one key"]),
    ("rewards.py:needs_gold", ["on the training prompts", "'rewards.py:needs_gold'", "'gold'", "['answer']",
                               "Rename the parameter"]),
])
def test_bad_entry_stops_before_any_model_loads(tmp_path, tiny_models, no_model_loads, entry, expected):
    root = _project(tmp_path, tiny_models, reward_funcs=["trl.rewards.think_format_reward", entry])
    with pytest.raises(train.ConfigError) as info:
        train.main(["--config", str(root / "configs" / "run.yaml")])
    message = str(info.value)
    for part in expected:
        assert part in message, (part, message)
    assert "'trl.rewards.think_format_reward'" not in message and len(message.splitlines()) == 1  # only the bad one
    assert no_model_loads == []


def test_bad_entry_of_the_command_line_is_named_with_the_good_ones_kept(tmp_path, tiny_models, no_model_loads):
    root = _project(tmp_path, tiny_models)
    with pytest.raises(train.ConfigError) as info:
        train.main(["--config", str(root / "configs" / "run.yaml"), "--reward_funcs", "trl.rewards.nope",
                    "{not json", "math.pi"])
    lines = str(info.value).splitlines()  # every bad entry at once, one line each
    assert len(lines) == 3 and "trl.rewards.nope" in lines[0] and "not valid JSON" in lines[1]
    assert "'math.pi' is not callable" in lines[2]
    assert no_model_loads == []


def test_a_column_missing_from_the_evaluation_split_stops_before_training(tmp_path, tiny_models, no_model_loads):
    root = _project(tmp_path, tiny_models, reward_funcs=["rewards.py:exact"])
    (root / "data" / "test.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(train.ConfigError, match=r"on the evaluation prompts.*'rewards.py:exact'.*'answer'"):
        train.main(["--config", str(root / "configs" / "run.yaml"), "--dataset_test_split",
                    str(root / "data" / "test.jsonl")])
    assert no_model_loads == []


def test_dotted_path_and_file_beside_the_yaml(tmp_path, tiny_models, monkeypatch):
    root = _project(tmp_path, tiny_models, reward_funcs=["trl.rewards.think_format_reward", "rewards.py:exact"])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # rewards.py is found beside the config, as the recipe's other relative paths
    _, model_args, _ = train.parse_args(["--config", str(root / "configs" / "run.yaml")])
    think, exact = (f.func for f in model_args.loaded_reward_funcs)
    assert think is trl.rewards.think_format_reward
    assert exact.__name__ == "exact" and Path(exact.__code__.co_filename) == root / "configs" / "rewards.py"
    assert exact(completions=["it is 4"], answer=["4"]) == [2.0]
    # As for the other paths, a file in the working directory wins over the one beside the config.
    (elsewhere / "rewards.py").write_text("def exact(completions, **kwargs):\n    return [7.0] * len(completions)\n")
    _, model_args, _ = train.parse_args(["--config", str(root / "configs" / "run.yaml"),
                                         "--reward_funcs", "rewards.py:exact"])
    (exact,) = (f.func for f in model_args.loaded_reward_funcs)
    assert exact(completions=["x"]) == [7.0]


@pytest.mark.parametrize("where", ["yaml", "cli"])
def test_factory_with_arguments(tmp_path, tiny_models, where):
    factory = {FACTORY: {"max_completion_len": 10, "soft_punish_cache": 2}}
    root = _project(tmp_path, tiny_models, **({"reward_funcs": [factory]} if where == "yaml" else {}))
    argv = ["--config", str(root / "configs" / "run.yaml")]
    argv += ["--reward_funcs", json.dumps(factory)] if where == "cli" else []
    _, model_args, _ = train.parse_args(argv)
    (func,) = (f.func for f in model_args.loaded_reward_funcs)
    assert func.__name__ == "soft_overlong_punishment_reward"
    # 9 tokens: 1 past max_completion_len - soft_punish_cache = 8, punished by 1/2; 8 tokens: not at all.
    assert func(completion_ids=[[0] * 9, [0] * 8]) == [-0.5, 0.0]


def test_reward_model_functions_and_weights_combine_in_order(tmp_path, tiny_models, no_model_loads):
    root = _project(tmp_path, tiny_models, reward_model_name_or_path=tiny_models["reward"],
                    reward_funcs=["trl.rewards.think_format_reward", "rewards.py:exact"], reward_weights=[1.0, 0.5, 2.0])
    with pytest.raises(Built):
        train.main(["--config", str(root / "configs" / "run.yaml")])
    (kwargs,) = no_model_loads
    reward_model, think, exact = kwargs["reward_model"]
    assert reward_model == tiny_models["reward"] and think is trl.rewards.think_format_reward
    assert exact.__name__ == "exact"
    assert kwargs["args"].reward_weights == [1.0, 0.5, 2.0]
    # The rows keep their answer column for the functions; the trainer reads the prompts from the recipe's column.
    assert kwargs["train_dataset"].column_names == ["messages", "answer"]
    assert kwargs["args"].prompt_column == "messages"
    # TRL's reward_model_path joins the list the same way (and is not given twice).
    no_model_loads.clear()
    with pytest.raises(Built):
        train.main(["--config", str(root / "configs" / "run.yaml"), "--reward_model_path", tiny_models["reward"],
                    "--reward_model_name_or_path", tiny_models["reward"]])
    (kwargs,) = no_model_loads
    assert kwargs["reward_model"][0] == tiny_models["reward"] and kwargs["args"].reward_model_path is None


def test_functions_alone_are_enough_and_no_reward_names_both_ways(tmp_path, tiny_models, no_model_loads):
    root = _project(tmp_path, tiny_models, reward_funcs=["trl.rewards.think_format_reward"])
    with pytest.raises(Built):
        train.main(["--config", str(root / "configs" / "run.yaml")])
    assert no_model_loads[0]["reward_model"] is trl.rewards.think_format_reward
    root = _project(tmp_path / "none", tiny_models)
    with pytest.raises(ValueError, match=r"No reward model and no reward function.*--reward_model_name_or_path.*"
                                         r"--reward_funcs"):
        train.main(["--config", str(root / "configs" / "run.yaml")])


def test_help_offers_reward_funcs():
    text = train.build_parser("hf-ppo train").format_help()
    assert "--reward_funcs" in text and "custom reward functions" not in text
    assert "get_soft_overlong_punishment: {max_completion_len: 64" in text  # the factory spelling, braces intact


def test_train_with_trl_reward_functions_on_chat_prompts(tmp_path, tiny_models):
    """`hf-ppo train` end to end: TRL's think_format_reward and accuracy_reward (reading the `solution` column)
    unchanged, and a function given each row's answer."""
    pytest.importorskip("math_verify", reason="trl.rewards.accuracy_reward needs math-verify (the test extra has it)")
    SEEN.clear()
    rows = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?"}], "answer": str(2 * i),
             "solution": f"${2 * i}$"} for i in range(4)]
    root = _project(tmp_path, tiny_models, rows=rows, max_steps=2,
                    reward_funcs=["trl.rewards.think_format_reward", "trl.rewards.accuracy_reward",
                                  "tests.cli.test_reward_funcs.record_answer"])
    trainer = train.main(["--config", str(root / "configs" / "run.yaml")])
    assert trainer.state.global_step == 2
    assert (tmp_path / "out" / "adapter_config.json").exists()
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"rewards/think_format_reward/mean", "rewards/accuracy_reward/mean"} <= logged
    trained = [s for s in SEEN if s[2] == "assistant"]
    assert len(trained) >= 4  # two iterations of two prompts (and the construction probe)
    for question, answer, _ in SEEN:  # every completion scored against its own row's answer
        i = int(question.split()[2])
        assert answer == str(2 * i), (question, answer)


def test_an_error_inside_a_reward_function_reaches_the_user_named(tmp_path, tiny_models):
    root = _project(tmp_path, tiny_models, reward_funcs=["tests.cli.test_reward_funcs.explode"])
    with pytest.raises(Exception) as info:  # any type, as long as it names the function
        train.run(["--config", str(root / "configs" / "run.yaml")], command="hf-ppo train")
    assert not isinstance(info.value, SystemExit)  # not turned into a one-line exit that hides the cause
    assert "explode" in str(info.value) and "what is" in str(info.value)  # the function and the row's prompt
    chain, cause = [], info.value
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__
    assert any(isinstance(c, ZeroDivisionError) for c in chain)


# ---- hf-ppo evaluate --------------------------------------------------------------------------------------------
def _eval_argv(tmp_path, tiny_models, *extra) -> list[str]:
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {i} plus {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(2)))
    return ["--policy", tiny_models["policy"], "--reference", tiny_models["policy"], "--dataset", str(data),
            "--output_dir", str(tmp_path / "eval"), "--response_length", "3", "--batch_size", "2", *extra]


@pytest.mark.parametrize("entries, expected", [
    (["trl.rewards.acuracy_reward"], "'trl.rewards' has no 'acuracy_reward'"),
    ([f"{Path(__file__).name}:nope"], "has no 'nope'"),
    (["tests.cli.test_reward_funcs.SEEN"], "is not callable"),
    ([json.dumps({FACTORY: {"max_len": 1}})], "unexpected keyword argument 'max_len'"),
    (["tests.cli.test_reward_funcs.needs_solution"], "'solution'"),
])
def test_evaluate_refuses_bad_entries_before_any_model_loads(tmp_path, tiny_models, no_model_loads, monkeypatch,
                                                             entries, expected):
    monkeypatch.chdir(Path(__file__).parent)
    with pytest.raises(SystemExit) as info:
        command.main(["evaluate", *_eval_argv(tmp_path, tiny_models, "--reward_funcs", *entries)])
    assert str(info.value).startswith("hf-ppo evaluate: ") and expected in str(info.value)
    assert no_model_loads == []


def needs_solution(completions, solution):
    """Needs a column the evaluation dataset does not have."""
    return [0.0] * len(completions)


def test_evaluate_needs_a_reward_of_some_kind(tmp_path, tiny_models):
    with pytest.raises(SystemExit, match="--reward_model .*and/or --reward_funcs"):
        command.main(["evaluate", *_eval_argv(tmp_path, tiny_models)])
    with pytest.raises(SystemExit, match="--num_samples 0: give an integer >= 1"):
        command.main(["evaluate", *_eval_argv(tmp_path, tiny_models, "--reward_funcs", "x.y", "--num_samples", "0")])


def test_evaluate_scores_reward_functions_with_k_samples(tmp_path, tiny_models, no_model_loads):
    argv = _eval_argv(tmp_path, tiny_models, "--reward_model", tiny_models["reward"], "--reward_funcs",
                      "tests.cli.test_reward_funcs.exact_text", "--num_samples", "3")
    with pytest.raises(Built):
        command.main(["evaluate", *argv])
    (kwargs,) = no_model_loads
    assert kwargs["reward_model"] == [tiny_models["reward"], exact_text]
    assert kwargs["args"].num_eval_samples == 3
    assert kwargs["eval_dataset"].column_names == ["prompt", "answer"]


def exact_text(completions, answer, **kwargs):
    """1.0 when the completion holds the row's answer."""
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]


def test_evaluate_end_to_end_reports_each_function(tmp_path, tiny_models, capsys):
    metrics = command.evaluate(_eval_argv(tmp_path, tiny_models, "--reward_funcs",
                                          "tests.cli.test_reward_funcs.exact_text", "--num_samples", "2"))
    assert 0.0 <= metrics["eval_reward/exact_text/policy"] <= 1.0  # the function's mean (an accuracy)
    assert any(k.startswith("eval_reward/exact_text/pass@2") for k in metrics), sorted(metrics)  # --num_samples 2
    assert "exact_text" in capsys.readouterr().out
    assert sys.modules["tests.cli.test_reward_funcs"].exact_text is exact_text  # scored through this module's function


# ---- imports of a reward file and of a package in the working directory -------------------------------------------
HELPER_FILE = '''
def count_words(text):
    return float(len(text.split()))
'''

WORDY_FILE = '''
from helpers import count_words  # a module beside this file, as `python rewards.py` would import it


def wordy(completions, **kwargs):
    return [count_words(c if isinstance(c, str) else c[0]["content"]) for c in completions]
'''


def test_the_console_script_imports_modules_beside_the_file_and_packages_in_the_working_directory(tmp_path,
                                                                                                  tiny_models):
    """The installed `hf-ppo` (its sys.path[0] is the scripts folder, not the working directory) trains with a reward
    file that imports a module beside it, and with a dotted path to a package in the working directory."""
    root = _project(tmp_path, tiny_models, reward_funcs=["rewards_dir/wordy.py:wordy", "mypkg.scoring.short"])
    (root / "configs" / "rewards_dir").mkdir()
    (root / "configs" / "rewards_dir" / "helpers.py").write_text(HELPER_FILE)
    (root / "configs" / "rewards_dir" / "wordy.py").write_text(WORDY_FILE)
    work = tmp_path / "work"
    (work / "mypkg").mkdir(parents=True)
    (work / "mypkg" / "__init__.py").write_text("")
    (work / "mypkg" / "scoring.py").write_text("def short(completions, **kwargs):\n"
                                               "    return [1.0] * len(completions)\n")
    script = Path(sys.executable).parent / "hf-ppo"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([str(script), "train", "--config", str(root / "configs" / "run.yaml"), "--max_steps", "1"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "No module named" not in run.stderr
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    logged = {k for entry in state["log_history"] for k in entry}
    assert {"rewards/wordy/mean", "rewards/short/mean"} <= logged


def test_sys_path_is_restored_after_loading(tmp_path, monkeypatch):
    (tmp_path / "helpers.py").write_text(HELPER_FILE)
    (tmp_path / "wordy.py").write_text(WORDY_FILE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delitem(sys.modules, "helpers", raising=False)
    before = list(sys.path)
    (loaded,) = load_reward_funcs([str(tmp_path / "wordy.py") + ":wordy"])
    assert loaded.func(completions=["one two three"]) == [3.0]
    assert sys.path == before  # the file's folder was importable while it loaded, and only then


# ---- reward-function edges ------------------------------------------------------------------------------------------
def test_a_file_that_exits_at_import_is_refused_naming_the_file(tmp_path, tiny_models, no_model_loads):
    root = _project(tmp_path, tiny_models, reward_funcs=["quits.py:score"])
    (root / "configs" / "quits.py").write_text("import sys\nsys.exit(0)\n\ndef score(completions, **kw):\n"
                                               "    return [0.0] * len(completions)\n")
    with pytest.raises(train.ConfigError, match=r"'quits.py:score'.*quits\.py called exit\(0\) \(SystemExit\)"):
        train.main(["--config", str(root / "configs" / "run.yaml")])
    assert no_model_loads == []


def test_a_module_as_an_entry_is_named_a_module_with_its_functions():
    with pytest.raises(RewardFuncsError) as info:
        load_reward_funcs(["hf_ppo.rewards"])
    message = str(info.value)
    assert "'hf_ppo.rewards' is a module, not a function" in message
    assert "hf_ppo.rewards.exact_answer" in message and "has no" not in message


def test_reward_weights_of_the_wrong_length_is_one_line_before_any_model_loads(tmp_path, tiny_models,
                                                                               no_model_loads):
    root = _project(tmp_path, tiny_models, reward_funcs=["trl.rewards.think_format_reward", "rewards.py:exact"],
                    reward_weights=[1.0, 0.5, 2.0])
    with pytest.raises(train.ConfigError) as info:
        train.main(["--config", str(root / "configs" / "run.yaml")])
    message = str(info.value)
    assert len(message.splitlines()) == 1 and "reward_weights has 3 weights" in message
    assert "2 rewards (think_format_reward, exact)" in message and "one weight per reward" in message
    assert no_model_loads == []


def test_a_resume_with_more_reward_functions_is_one_line(tmp_path, tiny_models, capsys):
    root = _project(tmp_path, tiny_models, reward_funcs=["rewards.py:exact"], save_strategy="steps", save_steps=1,
                    max_steps=1, normalize_each_reward=True)
    config = str(root / "configs" / "run.yaml")
    train.run(["--config", config], command="hf-ppo train")
    with pytest.raises(SystemExit) as info:
        train.run(["--config", config, "--reward_funcs", "rewards.py:exact", "trl.rewards.think_format_reward",
                   "--max_steps", "2", "--resume_from_checkpoint", str(tmp_path / "out" / "checkpoint-1")],
                  command="hf-ppo train")
    message = str(info.value.code)
    assert message.startswith("hf-ppo train: error: ") and "rewards: checkpoint [exact (function " in message
    assert "think_format_reward (function trl.rewards" in message and "allow_config_change_on_resume" in message


# ---- issue 51: a single entry without its list; a class named as an entry ------------------------------------------
def test_a_single_entry_written_without_its_list_is_a_one_element_list(tmp_path, tiny_models, no_model_loads):
    """`reward_funcs: tests.cli.test_reward_funcs.exact_text` (a string, not a list) in the YAML: the function,
    exactly as `reward_funcs: [tests.cli.test_reward_funcs.exact_text]` gives it."""
    given = {}
    for form, entry in (("string", "tests.cli.test_reward_funcs.exact_text"),
                        ("list", ["tests.cli.test_reward_funcs.exact_text"])):
        root = _project(tmp_path / form, tiny_models, reward_funcs=entry)
        no_model_loads.clear()
        with pytest.raises(Built):
            train.main(["--config", str(root / "configs" / "run.yaml")])
        given[form] = no_model_loads[0]["reward_model"]
    assert given["string"] is exact_text and given["list"] is exact_text


class ScaledReward:
    """A reward written as a class: its instance (made by a factory entry) is the reward function."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def __call__(self, completions, **kwargs):
        return [self.scale] * len(completions)


def test_a_class_named_in_reward_funcs_is_refused_and_its_factory_form_works(tmp_path, tiny_models, no_model_loads):
    path = "tests.cli.test_reward_funcs.ScaledReward"
    root = _project(tmp_path, tiny_models, reward_funcs=[path])
    with pytest.raises(train.ConfigError) as info:
        train.main(["--config", str(root / "configs" / "run.yaml")])
    message = str(info.value)
    assert f"reward_funcs entry '{path}' is a class, not a reward function: write it as a factory, " \
           f"{{'{path}': {{<its arguments>}}}} in YAML" in message, message
    assert len(message.splitlines()) == 1 and no_model_loads == []
    (loaded,) = load_reward_funcs([{path: {"scale": 2.0}}])  # the fix named: its instance is the reward
    assert isinstance(loaded.func, ScaledReward) and loaded.func(completions=["a", "b"]) == [2.0, 2.0]

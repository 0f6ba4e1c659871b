"""What a run saves: the card's plot (the four documented panels against PPO
iterations), the card's load example (the chat template for a run on chat prompts; it runs as printed) and its run
length (the one that took effect), the saved tokenizer (left-padded, a real `model_max_length` after a GGUF-style
tokenizer), one evaluation report per step that never replaces a file hf_ppo did not write, and the card of a base
converted from a GGUF file (named by the file, the Hub repo it came from, or `hub_base_model_id`)."""

import contextlib
import io
import json
import os
import re
import struct
import warnings
from pathlib import Path

import pytest
from datasets import Dataset
from huggingface_hub import ModelCard
from peft import LoraConfig
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.cli.tiny import CHAT_TEMPLATE, build_causal_lm, build_tokenizer
from hf_ppo.evaluation.report import REPORT_FILE, REPORT_MARK, write_report
from hf_ppo.hub import cards
from hf_ppo.hub.cards import gguf_origin, write_model_card, write_policy_card
from hf_ppo.hub.plots import DEFAULT_PANELS, x_axis
from hf_ppo.models.tokenizers import choose_pad_token

CHAT = Dataset.from_dict({"messages": [[{"role": "user", "content": f"the {w} was"}]
                                       for w in ("movie", "food", "book", "show")] * 2})


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def gguf_like_tokenizer() -> PreTrainedTokenizerFast:
    """The tiny tokenizer as a GGUF conversion leaves one: built without `padding_side` or `model_max_length`
    (so it pads on the right and its length is transformers' 1e30 "no limit"), with a chat template."""
    tiny = build_tokenizer()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tiny.backend_tokenizer, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def gguf_like_base(tmp_path_factory) -> Path:
    """A tiny Llama (max_position_embeddings 256) saved with a GGUF-style tokenizer."""
    folder = tmp_path_factory.mktemp("gguf_like")
    tokenizer = gguf_like_tokenizer()
    build_causal_lm(build_tokenizer(), hidden_size=32, num_layers=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config.get("padding_side") is None and config["model_max_length"] > 1e20  # as a GGUF conversion's
    return folder


@pytest.fixture(scope="module")
def chat_run(gguf_like_base, tmp_path_factory):
    """A LoRA run on chat prompts, ended by max_steps=1, saved with save_model()."""
    out = tmp_path_factory.mktemp("chat_run") / "tiny-chat-ppo"
    trainer = one_step_lora_run(gguf_like_base, out)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.save_model()
    return out


def one_step_lora_run(base, out) -> PPOLMTrainer:
    """A LoRA run of one step on chat prompts, trained, not saved yet."""
    args = PPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_mini_batches=1, num_ppo_epochs=1,
                     max_steps=1, response_length=4, logging_steps=1, report_to=[], save_strategy="no",
                     num_sample_generations=0, disable_tqdm=True, seed=0)
    trainer = PPOLMTrainer(model=str(base), args=args, reward_model=count_e, train_dataset=CHAT,
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  task_type="CAUSAL_LM"))
    trainer.train()
    return trainer


def card_code(text: str) -> str:
    """The Python block of the card's "How to load" section."""
    section = text.split("## How to load", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


# ---- The plot ------------------------------------------------------------------------------------------------------
HISTORY = [{"step": 4 * i, "iteration": i, "objective/scores": 0.1 * i, "objective/kl": 0.01 * i,
            "rollout/response_length": 10.0 - i, "objective/entropy": 5.0 - 0.1 * i} for i in range(1, 4)]


def test_the_card_plot_has_the_four_documented_panels_against_iterations(tmp_path, monkeypatch):
    """Pins the card's plot to what the docs show: reward, KL, response length and entropy, per PPO iteration (it
    had reward and KL only, against optimizer steps)."""
    drawn = []
    real = cards.plot_training_curves
    monkeypatch.setattr(cards, "plot_training_curves",
                        lambda *a, **kw: drawn.append(kw) or real(*a, **kw))
    write_model_card(tmp_path, repo_id="org/run", base_model="org/base", reward_model="org/rm", ref_model=None,
                     dataset_names=[], peft_config=None, hyperparameters={}, log_history=HISTORY)
    (call,) = drawn
    assert list(call["panels"]) == ["objective/scores", "objective/kl", "rollout/response_length",
                                    "objective/entropy"] == list(DEFAULT_PANELS)
    assert call["x_key"] == "iteration"
    assert png_size(tmp_path / "training_curves.png")[0] == 4 * 400  # four 4-inch panels at 100 dpi
    text = (tmp_path / "README.md").read_text()
    assert "![Reward, KL, response length and entropy per PPO iteration](training_curves.png)" in text


def test_a_run_whose_reward_never_moved_names_no_best_step(tmp_path):
    """Issue 61: a run whose every sample scored 0 had a card row "at best reward (step 2)": the first step logged."""
    flat = [{"step": s, "iteration": s, "objective/scores": 0.0, "objective/kl": 0.0, "rollout/response_length": 40.0}
            for s in (2, 4, 6)]
    write_model_card(tmp_path, **{**card_kwargs(), "log_history": flat})
    text = (tmp_path / "README.md").read_text()
    assert "at best reward" not in text and "| reward (score) | 0 | 0 | 0 |" in text
    assert "The reward had the same value at every logged step: it never moved" in text


def test_a_history_without_iterations_is_plotted_against_steps():
    """A log history written before iterations were logged still plots (against optimizer steps)."""
    assert x_axis(HISTORY) == "iteration"
    assert x_axis([{k: v for k, v in e.items() if k != "iteration"} for e in HISTORY]) == "step"


# ---- The card's example and run length -----------------------------------------------------------------------------
def test_the_card_of_a_chat_run_prompts_through_the_chat_template_and_runs(chat_run):
    """Pins the load example of a policy trained on chat prompts: it applies the chat template (plain text is a
    prompt the policy never saw), and the code runs as printed against the saved folder."""
    text = (chat_run / "README.md").read_text()
    code = card_code(text)
    assert "apply_chat_template(messages, add_generation_prompt=True" in code
    assert 'tokenizer("The movie was"' not in code
    assert "max_new_tokens=4" in code  # the run's response_length
    code = code.replace(f'"path/to/{chat_run.name}"', repr(str(chat_run)))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "card example", "exec"), {})
    assert printed.getvalue().endswith("\n")  # it printed the decoded response


def test_the_card_of_a_text_run_prompts_with_plain_text(tmp_path):
    """The plain-text example stays for runs on text prompts."""
    write_model_card(tmp_path, repo_id="org/run", base_model="org/base", reward_model="org/rm", ref_model=None,
                     dataset_names=[], peft_config={"r": 4}, hyperparameters={"response_length": 7},
                     log_history=[], chat_prompts=False)
    code = card_code((tmp_path / "README.md").read_text())
    assert 'tokenizer("The movie was", return_tensors="pt")' in code and "apply_chat_template" not in code
    assert "max_new_tokens=7" in code


def test_the_card_shows_the_run_length_that_took_effect(chat_run, tmp_path):
    """Pins the hyperparameter table to the settings used: a max_steps run shows max_steps, not the unused
    num_train_epochs (default 3); an epochs run shows num_train_epochs, not max_steps=-1."""
    text = (chat_run / "README.md").read_text()
    assert "| `max_steps` | `1` |" in text and "num_train_epochs" not in text
    by_epochs = PPOConfig(output_dir=str(tmp_path), num_train_epochs=2, report_to=[]).card_hyperparameters
    assert by_epochs["num_train_epochs"] == 2 and "max_steps" not in by_epochs


# ---- The saved tokenizer -------------------------------------------------------------------------------------------
def test_the_saved_tokenizer_is_left_padded_with_the_models_context(chat_run, gguf_like_base):
    """Pins the saved copy to what the docs say: left-padded (save_pretrained writes only the keys a tokenizer was
    built with, so a GGUF-style tokenizer was saved right-padded), and model_max_length the model's
    max_position_embeddings instead of the 1e30 sentinel."""
    saved = json.loads((chat_run / "tokenizer_config.json").read_text())
    assert saved["padding_side"] == "left" and saved["model_max_length"] == 256
    reloaded = AutoTokenizer.from_pretrained(chat_run)
    assert reloaded.padding_side == "left" and reloaded.model_max_length == 256
    # The user's tokenizer is untouched, and a real model_max_length is kept.
    original = AutoTokenizer.from_pretrained(gguf_like_base)
    assert original.padding_side == "right" and original.model_max_length > 1e20


def test_a_tokenizer_with_a_real_length_keeps_it(tmp_path):
    """Only the "no limit" sentinel is replaced: a tokenizer's own model_max_length (here 128 < the model's 256)
    is its own."""
    tokenizer = gguf_like_tokenizer()
    tokenizer.model_max_length = 128
    model = build_causal_lm(build_tokenizer(), hidden_size=32, num_layers=1)
    chosen = choose_pad_token(tokenizer, model, [tokenizer.eos_token_id], "object")
    chosen.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.model_max_length == 128 and reloaded.padding_side == "left"


# ---- Evaluation reports --------------------------------------------------------------------------------------------
METRICS = {"reward/r/policy": 1.0, "reward/r/reference": 0.5, "reward/r/win_rate": 0.75, "reward/r/win_rate_low": 0.5,
           "reward/r/win_rate_high": 1.0, "policy/response_length": 4.0, "reference/response_length": 4.0,
           "policy/stop_rate": 1.0, "reference/stop_rate": 1.0, "kl_to_reference": 0.1}


def report(out: Path, step: int) -> str | None:
    return write_report(str(out), METRICS, [("p", "ref", {"r": 0.5}, "pol", {"r": 1.0})], step=step, num_prompts=1)


def test_each_evaluation_keeps_its_report_and_eval_report_md_is_the_latest(tmp_path):
    """Pins one report per step: a second evaluation overwrote the first's eval_report.md."""
    assert report(tmp_path, 2) == str(tmp_path / "eval_report-step2.md")
    report(tmp_path, 4)
    first, second = (tmp_path / "eval_report-step2.md").read_text(), (tmp_path / "eval_report-step4.md").read_text()
    assert "(step 2)" in first and "(step 4)" in second
    assert (tmp_path / REPORT_FILE).read_text() == second and second.startswith(REPORT_MARK)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval_report-step2.md", "eval_report-step4.md",
                                                           "eval_report.md"]  # no temporary file left


def test_hf_ppo_never_overwrites_a_report_file_it_did_not_write(tmp_path):
    """A file of a report's name that hf_ppo did not write is left byte for byte (with a warning), the other report
    is still written; a file named like the old temporary file is never touched; a report written by an earlier
    hf_ppo (the old first line) is rewritten."""
    (tmp_path / REPORT_FILE).write_text("my notes\n")
    (tmp_path / "eval_report-step6.md").write_text("mine too\n")
    (tmp_path / "eval_report.md.tmp").write_text("a file of mine\n")
    (tmp_path / "eval_report-step2.md").write_text(
        "<!-- hf_ppo evaluation report: rewritten by hf_ppo at each evaluation -->\nold\n")
    with pytest.warns(UserWarning, match="eval_report.md exists and was not written by hf_ppo"):
        assert report(tmp_path, 2) == str(tmp_path / "eval_report-step2.md")
    assert "(step 2)" in (tmp_path / "eval_report-step2.md").read_text()
    with pytest.warns(UserWarning, match="exists and was not written by hf_ppo") as record:
        assert report(tmp_path, 6) is None
    assert sorted(Path(str(w.message).split(" exists")[0]).name for w in record) == ["eval_report-step6.md",
                                                                                     "eval_report.md"]
    assert (tmp_path / REPORT_FILE).read_text() == "my notes\n"
    assert (tmp_path / "eval_report-step6.md").read_text() == "mine too\n"
    assert (tmp_path / "eval_report.md.tmp").read_text() == "a file of mine\n"


# ---- The card of a base converted from a GGUF file -----------------------------------------------------------------
def test_gguf_origin_names_the_file_from_the_argument_the_path_or_the_conversion_folder(tmp_path, monkeypatch):
    """The GGUF file is found whichever way the run named it: `gguf_file`, the `.gguf` path as the model, or
    hf_ppo's conversion folder (the base an adapter trained on a GGUF file names)."""
    monkeypatch.setenv("HF_PPO_CACHE", str(tmp_path / "cache"))
    assert gguf_origin("org/Model-GGUF", {"gguf_file": "model.Q4_K_M.gguf"}) == "model.Q4_K_M.gguf"
    assert gguf_origin(str(tmp_path / "models" / "tiny.Q8_0.gguf"), None) == "tiny.Q8_0.gguf"
    converted = tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1-0123456789abcdef"
    converted.mkdir(parents=True)
    assert gguf_origin(str(converted), None) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    other = tmp_path / "elsewhere" / "mine-0123456789abcdef"  # the same naming outside the cache is no GGUF
    other.mkdir(parents=True)
    assert gguf_origin(str(other), None) is None and gguf_origin("org/model", None) is None


def gguf_card(tmp_path, monkeypatch, model: str, **config) -> tuple[str, ModelCard]:
    """The card write_policy_card renders for an adapter whose base was given as `model`."""
    monkeypatch.setenv("HF_PPO_CACHE", str(tmp_path / "cache"))
    args = PPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, report_to=[], **config)
    sources = {"model": model, "reward_model": "org/rm", "ref_model": None}
    write_policy_card(tmp_path / "card", None, sources, args.publish_settings, HISTORY, repo_id="org/tiny-ppo",
                      merged=False, dataset_names=[])
    path = tmp_path / "card" / "README.md"
    return path.read_text(), ModelCard.load(path)


def test_the_card_of_a_base_from_a_conversion_folder_names_the_gguf_file(tmp_path, monkeypatch):
    """Pins the card of an adapter trained on hf_ppo's GGUF conversion: it named the base "a local model"."""
    converted = tmp_path / "cache" / "SmolLM2-135M-Instruct.Q4_1-0123456789abcdef"
    converted.mkdir(parents=True)
    text, card = gguf_card(tmp_path, monkeypatch, str(converted))
    assert ("| base model (policy initialisation) | the GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf` (a local file), "
            "de-quantized by hf_ppo |") in text
    assert "a local model" not in text.split("| reward model |")[0] and str(tmp_path) not in text
    assert card.data.base_model is None


def test_the_card_of_a_gguf_repo_loads_the_base_with_its_file(tmp_path, monkeypatch):
    """A GGUF file of a Hub repo: the card names both, and its example loads the base with `gguf_file`."""
    text, card = gguf_card(tmp_path, monkeypatch, "org/Model-GGUF", model_init_kwargs={"gguf_file": "m.Q4_1.gguf"})
    assert ("| the GGUF file `m.Q4_1.gguf` of [org/Model-GGUF](https://huggingface.co/org/Model-GGUF), "
            "de-quantized by hf_ppo |") in text
    assert 'AutoModelForCausalLM.from_pretrained("org/Model-GGUF", gguf_file="m.Q4_1.gguf")' in text
    assert card.data.base_model == "org/Model-GGUF"


def test_the_card_names_hub_base_model_id_and_the_gguf_file_it_came_from(tmp_path, monkeypatch):
    """With hub_base_model_id set, the card's base is that Hub id (metadata, table, example), trained from the
    named GGUF file."""
    text, card = gguf_card(tmp_path, monkeypatch, str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"),
                           hub_base_model_id="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert ("| [HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct), "
            "trained from the GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf` (a local file), de-quantized by hf_ppo |"
            ) in text
    assert 'AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")' in text
    assert str(tmp_path) not in text


# ---- Files hf_ppo did not write: a user's README.md or plot in the output folder -----------------------------------
@pytest.fixture(scope="module")
def peft_blank_card(tmp_path_factory) -> str:
    """The README.md PEFT's own `save_pretrained` writes beside a tiny LoRA adapter (the installed peft and
    huggingface_hub), exactly as written."""
    from peft import get_peft_model

    folder = tmp_path_factory.mktemp("peft_blank")
    base = build_causal_lm(build_tokenizer(), hidden_size=32, num_layers=1)
    base.config._name_or_path = "org/tiny-base"
    get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")).save_pretrained(folder)
    text = (folder / "README.md").read_bytes().decode("utf-8")
    assert "# Model Card for Model ID" in text and "[More Information Needed]" in text and "- PEFT " in text
    return text


def card_kwargs() -> dict:
    return dict(repo_id="org/run", base_model="org/base", reward_model="org/rm", ref_model=None, dataset_names=[],
                peft_config=None, hyperparameters={}, log_history=HISTORY)


def test_a_users_readme_is_never_rewritten_but_hf_ppos_own_card_is(tmp_path, peft_blank_card):
    readme = tmp_path / "README.md"
    readme.write_text("# My experiment\n\nNotes I keep beside the run.\n")
    with pytest.warns(UserWarning, match="not a model card hf_ppo wrote"):
        write_model_card(tmp_path, **card_kwargs())
    assert readme.read_text() == "# My experiment\n\nNotes I keep beside the run.\n"
    assert not (tmp_path / cards.PLOT_FILE).exists()  # no plot beside a card that is not there
    # hf_ppo's own card (its `hf_ppo` tag) is rewritten by a later save, with its plot.
    mine = tmp_path / "mine"
    write_model_card(mine, **card_kwargs())
    assert cards.is_hf_ppo_card(mine / "README.md") and cards.is_hf_ppo_plot(mine / cards.PLOT_FILE)
    later = dict(card_kwargs(), log_history=HISTORY + [dict(HISTORY[-1], step=16, iteration=4,
                                                            **{"objective/scores": 7.5})])
    write_model_card(mine, **later)
    assert "7.5" in (mine / "README.md").read_text()
    # PEFT's blank placeholder card (what `save_pretrained` writes beside an adapter) is nobody's writing: replaced.
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "README.md").write_bytes(peft_blank_card.encode())
    write_model_card(peft, **card_kwargs())
    assert cards.is_hf_ppo_card(peft / "README.md") and (peft / cards.PLOT_FILE).is_file()


def test_a_users_plot_of_the_same_name_is_kept(tmp_path, peft_blank_card):
    plot = tmp_path / cards.PLOT_FILE
    plot.write_bytes(b"\x89PNG\r\n\x1a\n not hf_ppo's")
    with pytest.warns(UserWarning, match="not a plot hf_ppo drew"):
        write_model_card(tmp_path, **card_kwargs())
    assert plot.read_bytes() == b"\x89PNG\r\n\x1a\n not hf_ppo's"
    text = (tmp_path / "README.md").read_text()
    assert cards.is_hf_ppo_card(tmp_path / "README.md") and cards.PLOT_FILE not in text
    # Beside PEFT's placeholder card (replaced) the user's plot is still the user's.
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "README.md").write_bytes(peft_blank_card.encode())
    (peft / cards.PLOT_FILE).write_bytes(b"\x89PNG\r\n\x1a\n mine")
    with pytest.warns(UserWarning, match="not a plot hf_ppo drew"):
        write_model_card(peft, **card_kwargs())
    assert (peft / cards.PLOT_FILE).read_bytes() == b"\x89PNG\r\n\x1a\n mine"
    assert cards.is_hf_ppo_card(peft / "README.md")


def test_save_model_keeps_a_users_readme_byte_for_byte(gguf_like_base, tmp_path):
    """PEFT's `save_pretrained` updates an existing README.md's metadata in place; a user's README in output_dir comes
    out of `save_model()` exactly as it went in, with a warning, and the save message does not claim a card."""
    out = tmp_path / "run"
    out.mkdir()
    user = b"---\nlicense: mit\n---\n# Mine\n"
    (out / "README.md").write_bytes(user)
    trainer = one_step_lora_run(gguf_like_base, out)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.warns(UserWarning, match="not a model card hf_ppo wrote"):
        trainer.save_model()
    assert (out / "README.md").read_bytes() == user
    assert (out / "adapter_model.safetensors").is_file() and not (out / cards.PLOT_FILE).exists()
    assert "Saved the policy (LoRA adapter, tokenizer) to" in printed.getvalue()


# ---- the edges: a file of the user's that partly looks like hf_ppo's ------------------------------------------------
PEFT_MARKS = ["# Model Card for Model ID", "<!-- Provide a quick summary of what the model is/does. -->"]


@pytest.mark.parametrize("mark", PEFT_MARKS, ids=["heading", "summary-comment"])
def test_a_users_readme_holding_one_of_peft_placeholder_marks_is_kept(tmp_path, mark):
    """PEFT's blank placeholder card holds both marks; a README of the user's that holds one of them (a heading kept
    from the Hub's template, say) is the user's own writing: kept byte for byte, with the warning, and no plot."""
    text = f"{mark}\n\nMy notes on this run: reward model v3, two epochs.\n"
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert not cards.is_replaceable_card(readme)
    with pytest.warns(UserWarning, match="not a model card hf_ppo wrote"):
        write_model_card(tmp_path, **card_kwargs())
    assert readme.read_text() == text and not (tmp_path / cards.PLOT_FILE).exists()


@pytest.mark.parametrize("tags", [["ppo"], ["rlhf"], ["ppo", "rlhf", "trl"]], ids=["ppo", "rlhf", "both"])
def test_a_readme_tagged_ppo_or_rlhf_but_not_hf_ppo_is_the_users(tmp_path, tags):
    """hf_ppo's card carries the tags hf_ppo, ppo and rlhf, and only `hf_ppo` marks it as hf_ppo's: the card of
    another PPO trainer (tagged ppo / rlhf) in output_dir is the user's, kept, and the save message claims no card."""
    from hf_ppo.hub.publish import saved_policy_message

    text = "---\ntags:\n" + "".join(f"- {tag}\n" for tag in tags) + "---\n# My PPO model\n\nTrained in my own loop.\n"
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert not cards.is_hf_ppo_card(readme) and not cards.is_replaceable_card(readme)
    with pytest.warns(UserWarning, match="not a model card hf_ppo wrote"):
        write_model_card(tmp_path, **card_kwargs())
    assert readme.read_text() == text
    assert "Saved the policy (LoRA adapter, tokenizer) to" in saved_policy_message(tmp_path, is_adapter=True)


def test_hf_ppos_own_unstamped_plot_beside_its_own_card_is_redrawn(tmp_path):
    """A plot drawn before hf_ppo stamped its plots has no stamp, but beside hf_ppo's own card it is hf_ppo's: a
    later save redraws it (stamped now), silently, and the card shows it."""
    from PIL import Image

    write_model_card(tmp_path, **card_kwargs())
    plot = tmp_path / cards.PLOT_FILE
    Image.new("RGB", (8, 8), "white").save(plot)  # an earlier hf_ppo's plot: a PNG without the stamp
    assert not cards.is_hf_ppo_plot(plot) and cards.is_hf_ppo_card(tmp_path / "README.md")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        write_model_card(tmp_path, **card_kwargs())
    assert not [str(w.message) for w in record if "not a plot hf_ppo drew" in str(w.message)]
    assert cards.is_hf_ppo_plot(plot) and png_size(plot) != (8, 8)
    assert cards.PLOT_FILE in (tmp_path / "README.md").read_text()


# ---- a card that says what the run was ------------------------------------------------------------------------------
def test_the_card_of_a_reward_function_run_names_them_its_dataset_and_its_system_prompt(gguf_like_base, tmp_path):
    """It said "from human feedback" and "reward model" for a run with reward functions only, "datasets: not
    recorded" for a local file, and its example left out the system prompt the policy was trained under."""
    system = 'Answer "yes" or "no".\nNothing else.'
    out = tmp_path / "run"
    args = PPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_mini_batches=1, num_ppo_epochs=1,
                     max_steps=1, response_length=4, logging_steps=1, report_to=[], save_strategy="no",
                     num_sample_generations=0, disable_tqdm=True, seed=0, system_prompt=system)
    trainer = PPOLMTrainer(model=str(gguf_like_base), args=args, reward_model=count_e, train_dataset=CHAT,
                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  task_type="CAUSAL_LM"))
    trainer.train()
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.save_model()
    trainer.create_model_card(dataset_name=str(data))
    with pytest.raises(TypeError, match="license"):  # Trainer's argument, which the card has no place for
        trainer.create_model_card(license="mit")
    text = (out / "README.md").read_text()
    assert "human feedback" not in text and "| reward model |" not in text and "reward model" not in text
    assert "| reward function | a reward function (`count_e`) |" in text and "with reward functions" in text
    assert "| datasets | a local dataset |" in text and str(tmp_path) not in text
    code = card_code(text).replace('"path/to/run"', repr(str(out)))
    assert json.dumps(system) in code
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, "card example", "exec"), {})  # it runs, system prompt and all


def test_the_card_names_reward_models_and_functions_as_what_they_are(tmp_path):
    from hf_ppo.hub.cards import reward_texts

    assert reward_texts(["org/rm"])["reward_source_text"] == "from human feedback"
    assert reward_texts(["org/rm", "reward function f"])["reward_label"] == "rewards"
    assert reward_texts(["reward function f", "reward function g"])["reward_label"] == "reward functions"
    write_model_card(tmp_path, **card_kwargs())
    assert "from human feedback" in (tmp_path / "README.md").read_text()  # a reward model run: RLHF, as before


# ---- PEFT's blank card: replaced only untouched -------------------------------------------------------------------
def test_peft_blank_card_as_peft_writes_it_is_replaced(tmp_path, peft_blank_card):
    """The README.md PEFT's save_pretrained wrote (library_name, tags, base model filled in; every placeholder
    blank) is nobody's writing: the card replaces it, with its plot, and no warning."""
    readme = tmp_path / "README.md"
    readme.write_bytes(peft_blank_card.encode())
    assert cards.is_peft_blank_card(readme) and cards.is_replaceable_card(readme)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_model_card(tmp_path, **card_kwargs())
    assert cards.is_hf_ppo_card(readme) and cards.is_hf_ppo_plot(tmp_path / cards.PLOT_FILE)
    assert "[More Information Needed]" not in readme.read_text()


FILLED_IN = {  # a user's edit of PEFT's blank card, which keeps both of its placeholder marks
    "a placeholder filled in": lambda t: t.replace("- **Developed by:** [More Information Needed]",
                                                   "- **Developed by:** the reward-modelling group", 1),
    "a note appended": lambda t: t + "\n\nTrained for the v3 release; see our report.\n",
    "a line removed": lambda t: t.replace("**APA:**\n\n[More Information Needed]\n\n", "", 1),
    "a metadata field of the user's": lambda t: t.replace("library_name: peft\n", "library_name: peft\nlicense: mit\n"),
    "a metadata comment": lambda t: t.replace("library_name: peft\n", "library_name: peft  # ours\n"),
    "another pipeline": lambda t: t.replace("pipeline_tag: text-generation", "pipeline_tag: text-classification"),
    "windows line ends": lambda t: t.replace("\n", "\r\n"),
}


@pytest.mark.parametrize("edit", list(FILLED_IN), ids=list(FILLED_IN))
def test_an_edited_peft_template_holding_its_marks_is_the_users_and_kept(tmp_path, peft_blank_card, edit):
    """PEFT's template filled in (or added to) by the user still holds both placeholder marks, which alone made it
    "PEFT's blank card", replaced: now any edit makes it the user's, kept byte for byte with the warning, no plot."""
    text = FILLED_IN[edit](peft_blank_card)
    assert text != peft_blank_card and all(mark in text for mark in PEFT_MARKS)
    readme = tmp_path / "README.md"
    readme.write_bytes(text.encode())
    assert not cards.is_peft_blank_card(readme) and not cards.is_replaceable_card(readme)
    with pytest.warns(UserWarning, match="not a model card hf_ppo wrote, so it is kept as it is"):
        write_model_card(tmp_path, **card_kwargs())
    assert readme.read_bytes() == text.encode() and not (tmp_path / cards.PLOT_FILE).exists()


# ---- issue 63 kind 3: the card's rollout batch is a value, worked out by hand ---------------------------------------
def test_the_cards_rollout_batch_is_the_responses_one_device_samples_per_iteration(chat_run, tmp_path):
    # 2 sequences per micro-batch x 3 accumulated x 2 minibatches: 12 responses per iteration on one device
    values = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=3,
                       num_mini_batches=2, report_to=[]).card_hyperparameters
    assert values["rollout_batch_size (per device)"] == 12 and values["world_size"] == 1
    text = (chat_run / "README.md").read_text()  # 4 x 1 x 1
    assert "| `rollout_batch_size (per device)` | `4` |" in text and "| `world_size` | `1` |" in text

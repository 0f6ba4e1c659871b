"""The `hf-ppo` console command, installed with the package: `train`, `evaluate`, `demo`, thin over the modules.

    hf-ppo train --config run.yaml [--key value ...]       # PPO from a YAML config (hf_ppo.cli.train; recipes/ppo.py)
    hf-ppo evaluate --policy PATH_OR_ID --reward_model RM --dataset prompts.jsonl   # the policy against its reference
    hf-ppo demo --output_dir outputs/demo                  # the offline demo (hf_ppo.demo; recipes/demo.py)

`hf-ppo <command> --help` says how to run each one, then lists its options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

EVALUATE_HELP = """The policy against its reference on a prompt dataset (hf_ppo/evaluation/): one sampled response each,
scored by every reward model and judge; prints the win rates (ties half, 95% bootstrap interval), KL, lengths and stop
rates, and writes the side-by-side report to OUTPUT_DIR/eval_report.md.

    hf-ppo evaluate --policy outputs/demo/ppo --reward_model outputs/demo/cache/v1/reward \\
        --dataset outputs/demo/eval_prompts.jsonl --response_length 12 --temperature 0.7
    hf-ppo evaluate --policy my-user/my-ppo-model --reference my-user/my-sft-model --reward_model my-user/my-rm \\
        --judge my-user/another-rm --dataset my-user/prompts --dataset_split test --prompt_column prompt
    hf-ppo evaluate --policy runs/math --reward_funcs hf_ppo.rewards.exact_answer --dataset math_test.jsonl \\
        --num_samples 4                                  # accuracy of each reward function, and pass@4

Rewards: --reward_model and/or --reward_funcs (as `reward_funcs` of hf-ppo train: dotted paths, files relative to the
working directory, factories as JSON objects); each function gets the dataset's other columns as keyword arguments.

--reference defaults to the reference the run that trained the policy gave (ref_model, recorded in hf_ppo_run.json),
else to the base model of a LoRA adapter policy (adapter_config.json's base_model_name_or_path); a full-model
policy needs it. Each model loads as the run that trained the policy loaded it (hf_ppo_run.json, which
save_model() writes beside the policy: the reference of a LoRA run is its base in the policy's quantization), in
full precision when nothing is recorded; --policy_quantization, --ref_quantization and --reward_quantization
(4bit, 8bit or none, PPOConfig's names) choose. The compute dtype is the run's too (bf16, fp16 or fp32, recorded
in the same file; fp32 when nothing is recorded); --precision chooses. Everything runs where torch finds a device
(CPU or one GPU); fp16 needs a GPU, so on a CPU an fp16 run is evaluated in fp32, and the command says so.

Prompts, responses and scores follow the run too (the same file): the prompt column, system prompt, chat template and
max_prompt_length, the sampling settings and stop tokens, reward_input_format; an option that sets another value is
said. With --dataset the dataset hf-ppo train trained on, --dataset_split defaults to the split it held out; its
training split is evaluated if asked, with a warning that these are the training prompts.
"""


def evaluate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-ppo evaluate", description=EVALUATE_HELP,
                                     usage="hf-ppo evaluate --policy PATH_OR_ID [--reward_model RM] [--reward_funcs "
                                           "ENTRY ...] --dataset PROMPTS [--key value ...]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--policy", required=True, help="The trained policy: a Hub id or folder (full model or LoRA adapter).")
    add("--reference", default=None,
        help="The model it started from (default: the run's ref_model, as its hf_ppo_run.json records it, else a "
             "LoRA adapter's base model).")
    add("--reward_model", action="append", default=None,
        help="A training reward model (id or folder; num_labels=1). Repeat for several: each is reported.")
    add("--reward_funcs", nargs="+", action="extend", default=None, metavar="ENTRY",
        help="Reward functions, scored for the policy and the reference as in training (after the reward models): "
             "dotted paths (trl.rewards.accuracy_reward), files (rewards.py:exact, relative to the working "
             "directory), or factories as a JSON object ('{\"path\": {\"arg\": value}}').")
    add("--judge", action="append", default=None, help="A reward model training never saw (repeatable).")
    add("--dataset", required=True, help="Prompts: a local .json/.jsonl/.csv/.parquet file or a Hub dataset id.")
    add("--dataset_config", default=None,
        help="Hub dataset configuration (subset) name. Default: the run's, when --dataset is the dataset it trained on "
             "(its hf_ppo_run.json).")
    add("--dataset_split", default=None,
        help="Split of a Hub dataset. Default: the split the run held out (its dataset_test_split, in its "
             "hf_ppo_run.json) when --dataset is the dataset it trained on, else 'train'. Its training split is "
             "evaluated if asked, with a warning: those are the prompts it trained on.")
    add("--prompt_column", default=None,
        help="Column of the prompts (text, or chat messages). Default: the run's (its hf_ppo_run.json), else "
             "'prompt'.")
    add("--system_prompt", default=None,
        help="A system message put first in every prompt, as PPOConfig's system_prompt. Default: the run's system "
             "prompt (its hf_ppo_run.json), else none; --system_prompt '' evaluates without one.")
    add("--apply_chat_template_to_text", choices=("true", "false"), default=None, type=str.lower,
        help="Text prompts through the chat template as one user turn each (true) or as they are (false). Default: "
             "as the run's prompts went in (its hf_ppo_run.json), else as they are, with a warning when the tokenizer "
             "has a chat template.")
    add("--num_prompts", type=int, default=None, help="Evaluate on the first N prompts (default: all).")
    add("--output_dir", default="hf_ppo_eval", help="Where eval_report.md and metrics.json go.")
    _add_sampling_options(add)
    add("--stop_token", choices=("eos", "none"), default=None, type=str.lower,
        help="What ends a response, as PPOConfig's stop_token: 'eos' (the tokenizer's and the policy's end tokens) or "
             "'none' (never stop, unless --stop_token_ids). Default: the run's stop tokens, else 'eos'.")
    add("--stop_token_ids", type=int, nargs="+", default=None, metavar="ID",
        help="Token ids that end a response (any of them), replacing --stop_token. Default: the run's, else none. "
             "Either stop option replaces both of the run's stop settings.")
    add("--max_prompt_length", type=_int_or_none, default=None, metavar="N",
        help="Prompts longer than N tokens are cut from the left ('none': never). Default: the run's, else 512.")
    add("--reward_input_format", choices=("auto", "chat", "pair", "concat"), default=None,
        help="How the reward models read (prompt, response), as PPOConfig's reward_input_format. Default: the run's, "
             "else 'auto'.")
    add("--batch_size", type=int, default=16, help="Prompts per sampling batch.")
    add("--num_samples", type=int, default=1,
        help="Responses sampled per prompt (k): with k > 1, pass@k of each 0/1 reward function (PPOConfig's "
             "num_eval_samples).")
    add("--seed", type=int, default=0, help="Sampling and bootstrap seed.")
    add("--rollout_engine", choices=("kv_cache", "static", "vllm"), default="kv_cache",
        help="What samples the responses (PPOConfig's name): 'vllm' samples the policy on vLLM (pip install "
             "\"hf_ppo[vllm]\"; docs/guides/vllm.md).")
    for flag, what in (("policy", "the policy (a LoRA policy's base)"), ("ref", "the reference"),
                       ("reward", "the reward models and judges")):
        add(f"--{flag}_quantization", choices=QUANTIZATIONS, default=None,
            help=f"Load {what} in 4bit, 8bit or none (full precision). Default: as the run that trained the policy "
                 "loaded it (its hf_ppo_run.json), else none.")
    add("--precision", choices=PRECISIONS, default=None,
        help="Compute dtype of every model: bf16, fp16 or fp32. Default: the one the run that trained the policy used "
             "(its hf_ppo_run.json), else fp32.")
    add("--disable_tqdm", action="store_true", help="No progress bar and no sampling status line while it samples.")
    return parser


def _add_sampling_options(add) -> None:
    """One option per setting of `SAMPLING_FIELDS`, named and explained as PPOConfig's field of that name and typed
    as its default (None: an integer, top_k), so a sampling setting added there is an option here too."""
    from ..rollout.engines import SAMPLING_FIELDS
    from ..trainer.config import PPOConfig

    declared = {f.name: f for f in fields(PPOConfig)}
    for name in SAMPLING_FIELDS:
        field = declared[name]
        kind = float if isinstance(SAMPLING_DEFAULTS[name], float) else int  # (field.type may be a string or not)
        add(f"--{name}", type=kind, default=None,
            help=f"{field.metadata.get('help', '')} Default: the run's (its hf_ppo_run.json), else "
                 f"{SAMPLING_DEFAULTS[name]}.")


def _int_or_none(value: str) -> int | str:
    """An option's integer, or 'none' (kept as the word: None is "not given")."""
    if value.strip().lower() == "none":
        return "none"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give an integer, or 'none'") from None


QUANTIZATIONS = ("4bit", "8bit", "none")
PRECISIONS = ("bf16", "fp16", "fp32")
# What `hf-ppo evaluate` samples with when neither an option nor the run record says (PPOConfig's defaults): the
# `sampling` of the run record.
# Written out, not read from `rollout.SamplingSettings`, so that `hf-ppo --help` loads no torch: a sampling setting
# added there fails tests/cli/test_command.py until it is added here (its options are made from SAMPLING_FIELDS).
SAMPLING_DEFAULTS = {"response_length": 53, "temperature": 0.7, "top_k": None, "top_p": 1.0, "min_p": 0.0,
                     "stop_token": "eos", "stop_token_ids": None}
# Every setting `recorded_prompting` resolves (each has the option of its name), its default (PPOConfig's), and the
# section of the run record it is read from.
PROMPTING_DEFAULTS = {"prompt_column": None, "system_prompt": None, "apply_chat_template_to_text": None,
                      "max_prompt_length": 512, **SAMPLING_DEFAULTS, "reward_input_format": "auto"}
PROMPTING = tuple(PROMPTING_DEFAULTS)
RECORD_SECTIONS = {"max_prompt_length": "prompts", **{name: "sampling" for name in SAMPLING_DEFAULTS},
                   "reward_input_format": "scoring"}
STOP_SETTINGS = ("stop_token", "stop_token_ids")  # one setting: either option replaces both of the run's


def _run_record(policy: str) -> dict | None:
    """The run record beside a policy folder (`hub.publish.RUN_RECORD_FILE`); None for a Hub id or without one."""
    from ..hub.publish import read_run_record

    return read_run_record(policy) if os.path.isdir(policy) else None


def trained_prompting(record: dict) -> dict:
    """The settings of `PROMPTING` a run record holds (a key it lacks is left out: not recorded), keyed as
    PPOConfig's fields. The prompt format follows the run's: prompts that went through the chat template there
    (`format` 'chat') do here."""
    prompts = record.get("prompts") if isinstance(record.get("prompts"), dict) else {}
    trained = {"prompt_column": prompts["column"]} if "column" in prompts else {}
    if "system_prompt" in prompts:
        trained["system_prompt"] = prompts["system_prompt"]
    if "format" in prompts or "apply_chat_template_to_text" in prompts:
        trained["apply_chat_template_to_text"] = {"chat": True, "text": False}.get(
            prompts.get("format"), prompts.get("apply_chat_template_to_text"))
    for name, section in RECORD_SECTIONS.items():
        held = record.get(section)
        if isinstance(held, dict) and name in held:
            trained[name] = held[name]
    return trained


def given_prompting(args: argparse.Namespace) -> dict:
    """The settings of `PROMPTING` given on the command line, as PPOConfig takes them: `--system_prompt ''` and the
    word 'none' mean None; a stop option given sets both stop settings (the other at its default)."""
    given = {name: getattr(args, name) for name in PROMPTING if getattr(args, name) is not None}
    if "apply_chat_template_to_text" in given:
        given["apply_chat_template_to_text"] = given["apply_chat_template_to_text"] == "true"
    if given.get("system_prompt") == "":
        given["system_prompt"] = None
    for name in ("stop_token", "max_prompt_length"):
        if given.get(name) == "none":
            given[name] = None
    if any(name in given for name in STOP_SETTINGS):
        given = {**{name: PROMPTING_DEFAULTS[name] for name in STOP_SETTINGS}, **given}
    return given


def recorded_prompting(policy: str, args: argparse.Namespace) -> tuple[dict, list[str]]:
    """(settings, recorded): how this evaluation prompts, samples and scores, keyed as PPOConfig's fields
    (`PROMPTING`): each option when given, else what the run that trained `policy` recorded beside it (the `prompts`,
    `sampling` and `scoring` of its `hub.publish.RUN_RECORD_FILE`, `trained_prompting`), else `PROMPTING_DEFAULTS`;
    and the names of the settings taken from the record. A record written before a key existed lacks it: that
    setting is the default (`prompting_notes` says which)."""
    recorded, given = trained_prompting(_run_record(policy) or {}), given_prompting(args)
    settings = {**PROMPTING_DEFAULTS, **recorded, **given}
    return settings, [name for name in PROMPTING if name in recorded and name not in given]


def _stop(settings: dict) -> tuple[str, object]:
    """What ends a response, as one comparable value: the ids when given (they replace the token), else the token."""
    ids = settings.get("stop_token_ids")
    return ("stop_token_ids", list(ids)) if ids is not None else ("stop_token", settings.get("stop_token"))


def prompting_notes(policy: str, args: argparse.Namespace, settings: dict) -> tuple[dict, list[str], list[str]]:
    """(not_as_trained, not_recorded, lines): the settings of `PROMPTING` an option gave another value than the run
    recorded ({name: {"evaluated", "trained"}}: scores then measure other responses than training's), the ones the
    run's record lacks and no option gave (a record written before they were recorded: PPOConfig's defaults here),
    and the lines that say so. Nothing without a record (a Hub id, another tool's folder)."""
    record = _run_record(policy)
    if record is None:
        return {}, [], []
    trained, given = trained_prompting(record), given_prompting(args)
    differs = {name: {"evaluated": settings[name], "trained": trained[name]} for name in PROMPTING
               if name in given and name in trained and name not in STOP_SETTINGS and settings[name] != trained[name]}
    if any(name in given for name in STOP_SETTINGS) and all(name in trained for name in STOP_SETTINGS) \
            and _stop(settings) != _stop(trained):  # another stop than the run's (the same ids, given again, is not)
        differs.update({name: {"evaluated": settings[name], "trained": trained[name]} for name in STOP_SETTINGS
                        if settings[name] != trained[name]})
    missing = [name for name in PROMPTING if name not in trained and name not in given]
    lines = []
    if differs:
        shown = ", ".join(f"{name} {d['evaluated']!r} (trained: {d['trained']!r})" for name, d in differs.items())
        lines.append(f"not as the run trained (its hf_ppo_run.json): {shown}. The scores are of other responses than "
                     "training's; leave those options out to evaluate as it trained.")
    if missing:
        shown = ", ".join(f"{name} {settings[name]!r}" for name in missing)
        lines.append(f"the run's hf_ppo_run.json (an older hf_ppo's) does not record {', '.join(missing)}: "
                     f"evaluating with PPOConfig's defaults, {shown}; pass "
                     + ", ".join(f"--{name}" for name in missing) + " to set them as the run trained.")
    return differs, missing, lines


def evaluation_dataset(policy: str, args: argparse.Namespace) -> tuple[dict, list[str], str | None]:
    """(dataset, notes, warning): the prompts this evaluation reads, {"name", "config", "split", "training_prompts"},
    as the run that trained `policy` recorded its dataset (`hub.publish.record_dataset`). When --dataset is the
    dataset it trained on, --dataset_config defaults to the run's and --dataset_split to the split it held out (a
    note says so); else (another dataset, nothing recorded, or the run held out a file of its own or nothing) to
    'train'. The split it trained on (the whole file, for a local file) is evaluated if asked, with the warning that
    says these are the training prompts; `training_prompts` is None when the record does not say."""
    record = _run_record(policy) or {}
    trained = record.get("dataset") if isinstance(record.get("dataset"), dict) else None
    same = trained is not None and same_model(trained.get("name"), args.dataset)
    config = args.dataset_config if args.dataset_config is not None or not same else trained.get("config")
    test = trained.get("test_split") if same else None
    held_out_file = isinstance(test, str) and (os.path.isabs(test) or os.path.isfile(test))
    notes = []
    if args.dataset_config is None and config is not None:
        notes.append(f"--dataset_config {config!r}, the run's (its hf_ppo_run.json).")
    split = args.dataset_split
    if split is None and test is not None and not held_out_file:
        split = test
        notes.append(f"--dataset_split {test!r}: the split the run held out (dataset_test_split, in its "
                     "hf_ppo_run.json); pass --dataset_split to choose another.")
    split = split or "train"
    training = None if trained is None else same and (os.path.isfile(args.dataset)
                                                      or split == trained.get("train_split"))
    warning = None
    if training:
        fix = (f"its held-out split is {test!r}: pass --dataset_split {test} (or leave --dataset_split out)"
               if test is not None and not held_out_file else
               f"it held out {test!r}: pass --dataset {test}" if held_out_file else
               "it held none out: pass prompts it did not train on (another --dataset_split, or another --dataset)")
        what = "the file" if os.path.isfile(args.dataset) else f"split {split!r} of {args.dataset!r}"
        warning = (f"hf-ppo evaluate: these are the training prompts: {what} is what the run that trained "
                   f"{policy!r} trained on (its hf_ppo_run.json), so the scores say how the policy fits prompts it "
                   f"was optimised on, not how it does on new ones. To measure it on held-out prompts, {fix}.")
    return {"name": args.dataset, "config": config, "split": split, "training_prompts": training}, notes, warning


def recorded_step(policy: str) -> int:
    """The optimizer steps the saved `policy` was trained for: its run record's `global_step`, else the
    trainer_state.json `hf-ppo train` saves beside it, else `Evaluator.UNKNOWN_STEP` (a Hub id, another tool's
    folder)."""
    from ..evaluation.evaluator import Evaluator
    from ..hub.publish import read_run_record

    if os.path.isdir(policy):
        step = (read_run_record(policy) or {}).get("global_step")
        if isinstance(step, int):
            return step
        try:
            with open(os.path.join(policy, "trainer_state.json")) as f:
                step = json.load(f).get("global_step")
        except (OSError, ValueError, AttributeError):
            step = None
        if isinstance(step, int):
            return step
    return Evaluator.UNKNOWN_STEP


def recorded_note(settings: dict, recorded: list[str]) -> str | None:
    """The line that says which settings came from the run record (those that are not PPOConfig's defaults, which
    the others are too), and how to override them; None when none did."""
    recorded = [name for name in recorded if settings[name] != PROMPTING_DEFAULTS[name]]
    if not recorded:
        return None
    shown = ", ".join(f"{name} {settings[name]!r}" for name in recorded)
    return (f"prompting, sampling and scoring as the run trained (its hf_ppo_run.json): {shown}. Override with "
            + ", ".join(f"--{name}" for name in recorded) + ".")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def recorded_precision(policy: str, args: argparse.Namespace) -> tuple[str, str | None]:
    """(precision, note): --precision when given, else the one the run that trained `policy` recorded beside it,
    else 'fp32'. fp16 without a GPU (Trainer refuses it on a CPU) becomes fp32, with the note that says so."""
    record = _run_record(policy) or {}
    recorded = record.get("precision") if record.get("precision") in PRECISIONS else None
    chosen = args.precision or recorded or "fp32"
    if chosen == "fp16" and not _cuda_available():
        where = "--precision fp16" if args.precision else "the run trained in fp16"
        return "fp32", f"{where}, but fp16 needs a GPU and none is here: evaluating in fp32."
    return chosen, None


def recorded_reference(policy: str) -> str | None:
    """The reference model the run that trained `policy` gave (`ref_model`, recorded beside the policy as its
    `hub.publish.RUN_RECORD_FILE`'s `reference`), the default of --reference over a LoRA adapter's base: None when
    the run's reference lived inside the policy (its adapter disabled, a reference adapter) or nothing is recorded.
    A recorded local path that is gone is an error naming it: its base is another model."""
    reference = (_run_record(policy) or {}).get("reference")
    if not isinstance(reference, str) or reference.startswith("adapter "):
        return None
    if not os.path.exists(reference) and (os.path.isabs(reference) or reference.startswith(".")):
        raise SystemExit(f"hf-ppo evaluate: the run that trained {policy!r} was evaluated against the reference "
                         f"{reference!r} (its hf_ppo_run.json), which is not there any more: pass --reference, that "
                         "model's folder or Hub id.")
    return reference


def same_model(a: str | None, b: str | None) -> bool:
    """Whether two model ids/paths name one model (a relative and an absolute path to one folder do)."""
    if a is None or b is None:
        return a == b
    return a == b or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


def recorded_quantization(policy: str, args: argparse.Namespace) -> dict[str, str]:
    """{"policy", "ref", "reward"}: each model's quantization for this evaluation: the option when given, else what
    the run that trained `policy` recorded beside it (`hub.publish.RUN_RECORD_FILE`), else 'none'. A reference
    given by --reference that is not the run's own reference is loaded in full precision unless told."""
    record = _run_record(policy) or {}
    loaded = record.get("quantization") or {}
    rewards = {q for q in loaded.get("reward") or [] if q is not None}
    recorded = {"policy": loaded.get("policy"), "ref": loaded.get("reference"),
                "reward": rewards.pop() if len(rewards) == 1 else None}
    chosen = {name: getattr(args, f"{name}_quantization") or recorded[name] or "none" for name in recorded}
    if args.ref_quantization is None and args.reference is not None and record.get("reference") is not None \
            and not same_model(record["reference"], args.reference):
        chosen["ref"] = "none"  # another reference than the run's: nothing says how it was loaded
    return chosen


MODEL_FLAGS = {"policy": "the trained policy", "reference": "the reference model", "reward_model": "a reward model",
               "judge": "a judge"}
LOCAL_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")
MODEL_FILES = ("config.json", "adapter_config.json")


def check_arguments(args: argparse.Namespace) -> None:
    """Stop before anything loads on a count below 1, or when a path argument names a local path that does not exist
    (a file where a model folder belongs, an empty prompts file). Hub ids pass: the Hub answers for them when they
    load."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not args.reward_model and not args.reward_funcs:
        raise SystemExit("hf-ppo evaluate: no reward: pass --reward_model (a reward model's id or folder) and/or "
                         "--reward_funcs (reward functions, e.g. --reward_funcs trl.rewards.accuracy_reward).")
    for flag in ("num_prompts", "batch_size", "num_samples"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise SystemExit(f"hf-ppo evaluate: --{flag} {value}: give an integer >= 1"
                             + (" (leave it out to evaluate on all the prompts)." if flag == "num_prompts" else "."))
    given = [(flag, value) for flag in MODEL_FLAGS for value in _as_list(getattr(args, flag))]
    for flag, value in given + [("dataset", args.dataset)]:
        where = "" if os.path.isabs(os.path.expanduser(value)) else f" (relative to {os.getcwd()})"
        if os.path.exists(value):
            if flag in ("policy", "reference") and os.path.isfile(value) and value.lower().endswith(".gguf"):
                continue  # a GGUF checkpoint: converted once, then loaded as a folder (models/gguf.py)
            if flag != "dataset" and not os.path.isdir(value):
                raise SystemExit(f"hf-ppo evaluate: --{flag} {value!r} is a file; {MODEL_FLAGS[flag]} is a folder "
                                 "(what save_pretrained / trainer.save_model wrote) or a Hub id: pass the folder "
                                 "that holds it.")
            if flag != "dataset" and not any(os.path.isfile(os.path.join(value, f)) for f in MODEL_FILES):
                inside = sorted(d for d in os.listdir(value) if any(os.path.isfile(os.path.join(value, d, f))
                                                                   for f in MODEL_FILES))
                raise SystemExit(f"hf-ppo evaluate: --{flag} {value!r} holds no model: it has neither config.json "
                                 "(a full model) nor adapter_config.json (a LoRA adapter). "
                                 + (f"These folders in it do: {inside[:3]}; pass one of them." if inside else
                                    "Pass the folder that save_pretrained / trainer.save_model wrote."))
            if flag == "dataset" and os.path.isfile(value) and not os.path.getsize(value):
                raise SystemExit(f"hf-ppo evaluate: --dataset {value!r} is an empty file: it holds no prompts.")
            continue
        try:
            validate_repo_id(value)
            hub_like = flag != "dataset" or not value.lower().endswith(LOCAL_SUFFIXES)
        except HFValidationError:
            hub_like = False
        if not hub_like:
            what = "file" if flag == "dataset" else "folder"
            raise SystemExit(f"hf-ppo evaluate: --{flag} {value!r} does not exist: no such {what}{where}. Check the "
                             f"path (or pass a Hub id).")


def _as_list(value) -> list[str]:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def default_reference(policy: str) -> str:
    """The base model a LoRA adapter policy was trained on; an error naming the fix for a full model, or saying
    that a Hub id that is not a local folder was not found."""
    from transformers.utils import CONFIG_NAME, cached_file

    from ..models.adapters import adapter_config

    adapter = adapter_config(policy, None) if not os.path.isfile(policy) else None  # a .gguf file is a full model
    if adapter is None and not os.path.exists(policy):
        try:  # not an adapter: is it a model at all?
            cached_file(policy, CONFIG_NAME)
        except OSError as err:
            raise SystemExit(f"hf-ppo evaluate: --policy {policy!r} is not a local folder, and the Hub has no model "
                             f"of that id (or could not be reached): {err}") from err
    if adapter is None or not adapter.get("base_model_name_or_path"):
        raise SystemExit(f"hf-ppo evaluate: {policy!r} is a full model: pass --reference, the model it started from "
                         "(a LoRA adapter's base model is its default reference).")
    return adapter["base_model_name_or_path"]


def evaluate(argv: list[str]) -> dict[str, float]:
    """`hf-ppo evaluate`: build a trainer around the saved policy (no training data), run `evaluate()`, print the
    metrics tables and where the report is; return the metrics."""
    args = evaluate_parser().parse_args(argv)
    check_arguments(args)
    from .reward_funcs import RewardFuncsError, check_signatures, load_reward_funcs

    try:  # imported (and checked) before any model loads
        funcs = load_reward_funcs(args.reward_funcs)
    except RewardFuncsError as err:
        raise SystemExit(f"hf-ppo evaluate: {err}") from err
    # The run's own reference when it gave one (ref_model), else a LoRA adapter's base.
    reference = args.reference or recorded_reference(args.policy)
    if args.reference is None and reference is not None:
        print(f"hf-ppo evaluate: reference {reference!r}, the one the run trained against (its hf_ppo_run.json). "
              "Override with --reference.")
    reference = reference or default_reference(args.policy)
    from ..evaluation.report import metrics_markdown, write_metrics
    from ..models import gguf
    from ..models.tokenizers import load_policy_tokenizer
    from ..runtime.warn import warn_user
    from ..trainer import PPOConfig, PPOLMTrainer
    from .train import load_split, prompts_from_column, silence_known_warnings, with_system_prompt

    silence_known_warnings()
    quantization = recorded_quantization(args.policy, args)
    precision, note = recorded_precision(args.policy, args)
    if note:
        print(f"hf-ppo evaluate: {note}")
    prompting, recorded = recorded_prompting(args.policy, args)
    not_as_trained, not_recorded, lines = prompting_notes(args.policy, args, prompting)
    dataset, dataset_notes, training_prompts = evaluation_dataset(args.policy, args)
    if args.dataset_split is None and _run_record(args.policy) is not None and dataset["training_prompts"] is None:
        not_recorded.append("dataset")
        lines.append("the run's hf_ppo_run.json does not record the dataset it trained on (hf-ppo train records it "
                     "beside the final policy; a checkpoint, the Python API and older versions do not): evaluating "
                     f"split {dataset['split']!r}; make sure those are not the prompts it trained on (--dataset_split).")
    for note in [recorded_note(prompting, recorded), *dataset_notes, *lines]:
        if note:
            print(f"hf-ppo evaluate: {note}")
    if training_prompts:
        warn_user(training_prompts)
    try:
        config = PPOConfig(output_dir=args.output_dir, per_device_eval_batch_size=args.batch_size,
                           bf16=precision == "bf16", fp16=precision == "fp16",
                           # Trainer takes bf16 without a GPU only when told to run on the CPU
                           use_cpu=precision == "bf16" and not _cuda_available(),
                           **{k: v for k, v in prompting.items() if k != "prompt_column"},
                           seed=args.seed, report_to=[], disable_tqdm=args.disable_tqdm, save_strategy="no",
                           rollout_engine=args.rollout_engine,
                           num_eval_samples=args.num_samples, policy_quantization=quantization["policy"],
                           ref_quantization=quantization["ref"], reward_quantization=quantization["reward"])
    except ValueError as err:  # an option out of range (--temperature 0, --top_p 2): its line, without the traceback
        raise SystemExit(f"hf-ppo evaluate: {err}".replace("Invalid PPOConfig:\n- ", "").replace("\n- ", "; "))
    policy, policy_kwargs = gguf.split_gguf_path(args.policy, None)  # a .gguf file: its folder and name
    tokenizer = load_policy_tokenizer(*gguf.converted(policy, policy_kwargs, "policy"))
    try:  # the prompts checked as the trainer reads them, before any model loads
        loaded = load_split(args.dataset, dataset["config"], dataset["split"], "--dataset_split")
        prompts = prompts_from_column(loaded, prompting["prompt_column"], tokenizer, args.dataset)
        if args.num_prompts is not None:
            prompts = prompts.select(range(min(args.num_prompts, len(prompts))))
        checked = with_system_prompt(prompts, config.system_prompt, tokenizer, args.dataset)
    except ValueError as err:
        raise SystemExit(f"hf-ppo evaluate: {err}") from err
    try:
        check_signatures(funcs, {"the --dataset prompts": checked})
    except RewardFuncsError as err:
        raise SystemExit(f"hf-ppo evaluate: {err}") from err
    rewards = list(args.reward_model or []) + [f.func for f in funcs]
    rewards = rewards if len(rewards) > 1 else rewards[0]
    trainer = PPOLMTrainer(model=args.policy, args=config, processing_class=tokenizer, reward_model=rewards,
                           ref_model=reference, eval_reward_model=args.judge, eval_dataset=prompts)
    trainer.evaluator.policy_step = recorded_step(args.policy)  # the report's title: the policy's training step
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the tables below say it all, once
    metrics = trainer.evaluate()
    # A metrics.json (or eval_report.md) of the user's is kept, with a warning: the last line says what was written.
    metrics_path = write_metrics(args.output_dir, {"policy": args.policy, "reference": reference,
                                                   "quantization": quantization, "precision": precision,
                                                   "dataset": dataset, "not_as_trained": not_as_trained,
                                                   "not_recorded": not_recorded, **without_eval_loss(metrics)})
    loaded = "quantization: " + ", ".join(f"{name} {q}" for name, q in quantization.items()) + f"; {precision}"
    split = "" if os.path.isfile(args.dataset) else f" split {dataset['split']!r}"
    training = ", the training prompts" if dataset["training_prompts"] else ""
    print(f"{args.policy} against {reference} on {len(prompts)} prompts of {args.dataset}{split}{training} "
          f"({loaded}):\n")
    print(metrics_markdown(metrics, "eval_"))
    print("\n" + written_files_line(args.output_dir, metrics_path))
    return metrics


def without_eval_loss(metrics: dict) -> dict:
    """`metrics` without Trainer's `eval_loss`: here it is minus the mean training score of the policy's samples, a
    number that reads as a loss and means nothing for this job; the scores are in `eval_reward/<name>/policy`."""
    return {k: v for k, v in metrics.items() if k != "eval_loss"}


def written_files_line(output_dir: str, metrics_path: str | None) -> str:
    """The command's last lines: where the side-by-side report and metrics.json are, or that they were not written
    because a file of the user's of that name is there (kept as it is, `evaluation.report`): never a user's file
    pointed at as if it were the report."""
    from ..evaluation.report import METRICS_FILE, REPORT_FILE, written_by_hf_ppo

    report = os.path.join(output_dir, REPORT_FILE)
    lines, kept = [], []
    if os.path.isfile(report) and written_by_hf_ppo(report):
        lines.append(f"Side by side: {report}")
    else:
        kept.append(report)
    if metrics_path is not None:
        lines.append(f"Metrics: {metrics_path}")
    else:
        kept.append(os.path.join(output_dir, METRICS_FILE))
    if kept:
        lines.append(f"Not written: {' and '.join(kept)} (a file hf_ppo did not write is there, kept as it is); pass "
                     "another --output_dir to get " + ("them." if len(kept) > 1 else "it."))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else (None, [])
    if command == "train":
        from .train import run

        run(rest, command="hf-ppo train")
    elif command == "evaluate":
        evaluate(rest)
    elif command == "demo":
        from .demo import main as demo

        demo(rest, prog="hf-ppo demo")
    elif command in (None, "-h", "--help"):
        print(f"usage: hf-ppo {{train,evaluate,demo}} ...\n\n{__doc__}")
    else:
        sys.exit(f"hf-ppo: unknown command {command!r}: choose train, evaluate or demo (hf-ppo --help).")


if __name__ == "__main__":
    main()

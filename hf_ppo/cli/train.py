"""`hf-ppo train` / `recipes/ppo.py`: PPO (RLHF) from a YAML config and command-line overrides.

The options are three dataclasses (`ScriptArguments`: the prompts; `ModelArguments`: the models; `PPOConfig`), read
by trl's `TrlParser`; `parse_args` checks keys and resolves paths before anything loads, `main` trains and saves.
The help text (`help_text`) is written for the command that runs it: `hf-ppo train` or `python recipes/ppo.py`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import traceback
import warnings
from dataclasses import dataclass, field, fields

from datasets import Dataset, DatasetDict, load_dataset
from transformers import AutoTokenizer, TrainingArguments
from trl import TrlParser

from ..hub.publish import pushed_policy_message, record_dataset, saved_policy_message
from ..models import gguf
from ..models.reward_model import reward_name
from ..rollout.reward_calls import RewardFunctionError
from ..rollout.scoring import probe_reward_callable, probing_once, unique_names
from ..runtime.warn import warn_user
from ..trainer.checkpoint import CheckpointError, SaveWriteError
from ..trainer.config import PPOConfig
from ..trainer.data import prepare_prompts, select_prompt_column
from ..trainer.data import with_system_prompt as system_prompt_first
from ..trainer.ppo_trainer import PPOLMTrainer
from ..trainer.run_lock import in_use_message
from ..trainer.watch import CollapseWatch
from .grpo_names import grpo_hint
from .reward_funcs import RewardFunc, RewardFuncsError, check_signatures, load_reward_funcs

HELP = """PPO (RLHF) on a Hub or local policy with a Hub or local reward model.

Three ways to run it: a YAML config, the same with command-line overrides (the command line wins), and
`accelerate launch` for several GPUs (DDP, DeepSpeed ZeRO-2, or FSDP2 to shard the policy; the command is unchanged):

    {run} --config hf_ppo/cli/configs/demo.yaml       # offline, after one `make demo` (or `hf-ppo demo`)
    {run} --config hf_ppo/cli/configs/qlora_24gb.yaml --learning_rate 5e-6 --output_dir runs/my-ppo
    accelerate launch --config_file recipes/accelerate/ddp.yaml {launch} --config hf_ppo/cli/configs/qlora_24gb.yaml
    accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml {launch} --config ...
    accelerate launch --config_file recipes/accelerate/fsdp.yaml {launch} --config ...

Every YAML key is an option below (`--key value`); a key that is none of them is an error that suggests the
nearest one. Relative paths (models, datasets, checkpoints) are looked up in the working directory, then next to
the config file; a name found in neither is taken as a Hub id when it reads as one (`name` or `namespace/name`),
else it is an error before anything loads. `output_dir` is relative to the working directory.

When it ends, the policy (LoRA adapter or full weights, tokenizer, model card) is in `output_dir`, with
`trainer_state.json` (every logged metric); the last lines say how to load and push it. `push_to_hub: true`
uploads the policy alone (never the value head, reference or reward model). A run that `stop_on_collapse: true`
stopped saves and pushes no policy (the collapsed one): the last lines name the last complete checkpoint instead.

Quantization is per model and lives in PPOConfig: `policy_quantization` (4bit + use_peft = QLoRA),
`ref_quantization`, `reward_quantization`. Prompts come from `prompt_column`: plain text, or chat conversations
(`prompt_column: messages`, a list of {{"role", "content"}} dicts) rendered with the policy tokenizer's chat template.
Defaults follow the N+ implementation-details paper (Huang et al. 2024), e.g. `response_length` 53 is its
TL;DR summary budget, `learning_rate` 3e-6, `kl_coef` 0.05: set them for your task (the configs in
hf_ppo/cli/configs/ do). With `dataset_test_split` and `eval_strategy: steps`, training evaluates the policy against
its reference (win rates, KL; `eval_report.md` in `output_dir`).

Rewards: a reward model (`reward_model_name_or_path`), reward functions (`reward_funcs`), or both; the rewards are
[the reward model, *reward_funcs], combined with `reward_weights` (one weight each, in that order). A `reward_funcs`
entry is a dotted import path (`trl.rewards.think_format_reward`), a file and a function in it (`rewards.py:exact`,
looked up like the other relative paths), or a factory with its arguments, in YAML a one-key mapping
(`- trl.rewards.get_soft_overlong_punishment: {{max_completion_len: 64, soft_punish_cache: 16}}`) and on the command
line a JSON object: `--reward_funcs my_pkg.rewards.exact rewards.py:fmt '{{"my_pkg.make": {{"scale": 2}}}}'`. A
function is called as in TRL: `prompts`, `completions`, `completion_ids` and every other dataset column as keyword
arguments. Each entry is imported and checked against the dataset's columns before any model loads.

Deliberately left out: dataset mixtures, streaming datasets, and any device placement (Trainer and accelerate own it).
"""

# Local files are read with the `datasets` builder matching their suffix.
LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class ScriptArguments:
    """Where the prompts come from."""

    dataset_name: str = field(metadata={"help": "Hub dataset id, or a local .json/.jsonl/.csv/.parquet file."})
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration (subset) name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str | None = field(
        default=None, metadata={"help": "Split (or local file) to evaluate on; None: no eval dataset."}
    )
    # The prompt column and the system prompt are PPOConfig's (`prompt_column`, `system_prompt`): the trainer applies
    # them, and records them beside the saved policy for `hf-ppo evaluate`.


@dataclass
class ModelArguments:
    """Which models to load, and how (quantization of each model is set in PPOConfig)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Policy: Hub id or local path of a causal LM (with TRL's --sft_model_path, a "
                                "PPOConfig field, only the tokenizer is read from here, as in TRL's script)."})
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Reward model: a sequence classifier with 1 label."})
    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "Reward functions, after the reward model if any: dotted paths "
                                "(trl.rewards.think_format_reward), files (rewards.py:exact), or factories (YAML: "
                                "{path: {arg: value}}; command line: a JSON object)."})
    ref_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Reference model; None: the policy with its LoRA adapter disabled "
                                "(with use_peft) or a frozen copy of the starting policy."},
    )
    critic_model_name_or_path: str | None = field(
        default=None, metadata={"help": "With --critic separate: the model to start the critic from (None: the reward "
                                "model). See docs/concepts/critics.md."},
    )
    model_revision: str | None = field(default=None, metadata={"help": "Branch, tag or commit of the policy."})
    ref_model_revision: str | None = field(default=None, metadata={"help": "Revision of the reference model."})
    reward_model_revision: str | None = field(default=None, metadata={"help": "Revision of the reward model."})
    dtype: str | None = field(default=None, metadata={"help": "'auto', 'bfloat16', 'float16' or 'float32'."})
    attn_implementation: str | None = field(default=None, metadata={"help": "e.g. 'sdpa', 'flash_attention_2'."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Run model code from the Hub repository."})
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters (needed for a quantized policy)."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout; RL wants 0 (stable log-ratios)."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt, e.g. 'all-linear' or q_proj v_proj; None: peft's default."}
    )
    # `reward_funcs` imported by `parse_args` (not an option: the command line never sets it).
    loaded_reward_funcs: list[RewardFunc] = field(default_factory=list, init=False, repr=False)


def resolve_model_paths(model_args: ModelArguments, ppo_config: PPOConfig) -> tuple[str, str, str | None]:
    """(policy, tokenizer, reward model) paths from hf_ppo's names or TRL's (PPOConfig's `sft_model_path`,
    `reward_model_path`); the reward model is None when `reward_funcs` alone give the rewards."""
    policy = ppo_config.sft_model_path or model_args.model_name_or_path
    if policy is None:
        raise ValueError("No policy: pass --model_name_or_path (or TRL's --sft_model_path).")
    rewards = {p for p in (model_args.reward_model_name_or_path, ppo_config.reward_model_path) if p is not None}
    if not rewards and model_args.reward_funcs:
        return policy, model_args.model_name_or_path or policy, None
    if not rewards:
        # TRL's script defaulted to EleutherAI/pythia-160m, a base LM whose score head would be random: no default.
        raise ValueError("No reward model and no reward function: pass --reward_model_name_or_path (or TRL's "
                         "--reward_model_path), a sequence classifier trained with num_labels=1 (e.g. with trl's "
                         "RewardTrainer), or --reward_funcs, reward functions by import path or file (e.g. "
                         "--reward_funcs trl.rewards.think_format_reward rewards.py:exact_match), or both.")
    if len(rewards) > 1:
        raise ValueError(f"--reward_model_name_or_path and --reward_model_path name different models {sorted(rewards)}: "
                         "pass one.")
    return policy, model_args.model_name_or_path or policy, rewards.pop()


class ConfigError(ValueError):
    """A bad key or path in the YAML config or on the command line: reported as one line, before anything loads."""


# Options that name things to read; a relative one is looked up in the working directory, then beside the config.
INPUT_PATHS = {ModelArguments: ["model_name_or_path", "reward_model_name_or_path", "ref_model_name_or_path",
                               "critic_model_name_or_path"],
               PPOConfig: ["sft_model_path", "reward_model_path"],
               ScriptArguments: ["dataset_name"]}
# "name" or "namespace/name": what a Hub id looks like (a path with more parts, or ./ ../, cannot be one).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


# How PPOConfig's help marks a field that is derived, never set (TRL's batch sizes).
DERIVED = "Derived in hf_ppo: do not set."


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (it holds commands), each option with its default."""


def help_text(command: str = "python recipes/ppo.py") -> str:
    """The help's description for the command that runs it (`hf-ppo train` or `python recipes/ppo.py`)."""
    launch = "recipes/ppo.py" if command.endswith("ppo.py") else "$(which hf-ppo) train"
    return HELP.format(run=command, launch=launch)


def build_parser(command: str = "python recipes/ppo.py") -> TrlParser:
    """The parser of `command`; `--help` leads with how to run it, then lists the PPO fields first, then data and
    models, then TrainingArguments."""
    parser = TrlParser((ScriptArguments, ModelArguments, PPOConfig), description=help_text(command),
                       usage=f"{command} [--config CONFIG.yaml] [--key value ...]", formatter_class=_HelpFormatter)
    parser.command = command
    trainer_fields = {f.name for f in fields(TrainingArguments)}
    ppo_fields = {f.name for f in fields(PPOConfig)} - trainer_fields
    titles = [("PPO (hf_ppo.PPOConfig)", ppo_fields),
              ("prompts (ScriptArguments)", {f.name for f in fields(ScriptArguments)}),
              ("models (ModelArguments)", {f.name for f in fields(ModelArguments)}),
              ("training (transformers.TrainingArguments, as in any Trainer run)", trainer_fields)]
    # HfArgumentParser puts every option in one group; regroup them so that the PPO fields come first.
    groups = [(parser.add_argument_group(title), names) for title, names in titles]
    for action in list(parser._optionals._group_actions):
        group = next((g for g, names in groups if action.dest in names), None)
        if group is not None:
            parser._optionals._group_actions.remove(action)
            group._group_actions.append(action)
    # TRL's batch sizes that hf_ppo derives are still parsed, so that giving one ends in PPOConfig's message naming
    # the fields to set instead, but --help does not offer them.
    for action in parser._actions:
        if action.dest in derived_fields():
            action.help = argparse.SUPPRESS
    return parser


def derived_fields() -> set[str]:
    """The PPOConfig fields a user must not set (TRL's sizes, derived here): those whose help says so."""
    return {f.name for f in fields(PPOConfig) if f.metadata.get("help", "").startswith(DERIVED)}


def _unknown_keys(parser: TrlParser, remaining: list[str], source: str, prefix: str) -> list[str]:
    """One message per unknown `--key` in `remaining`, with the nearest valid key when one is close.

    `prefix` is how keys are written in `source`: "" for YAML keys, "--" for command-line options.
    """
    known = sorted({a.dest for a in parser._actions if a.dest != "help" and a.help != argparse.SUPPRESS} | {"config"})
    messages = []
    for item in remaining:
        if not item.startswith("--"):
            continue
        key = item[2:].split("=", 1)[0].replace("-", "_")
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f" Did you mean '{prefix}{close[0]}'?" if close else f" `{parser.command} --help` lists every key."
        if grpo_hint(key) is not None:  # TRL GRPO's name: hf_ppo's for it, or why there is none
            hint = f" It is TRL GRPOConfig's: {grpo_hint(key)}."
        messages.append(f"unknown key '{prefix}{item[2:].split('=', 1)[0]}' {source}.{hint}")
    return messages


def parse_args(argv: list[str] | None = None, command: str = "python recipes/ppo.py",
               ) -> tuple[ScriptArguments, ModelArguments, PPOConfig]:
    """Parse the YAML config (`--config`) and the command line on top of it; resolve and check the paths."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--config=run.yaml` as `--config run.yaml`: TrlParser reads only the second form (the first would leave the
    # YAML unread, ending in "unknown key '--config'" or a missing required option).
    argv = [part for arg in argv for part in (["--config", arg[len("--config="):]] if arg.startswith("--config=")
                                              else [arg])]
    given = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]
    if len(given) > 1:
        raise ConfigError(f"--config is given {len(given)} times ({', '.join(given)}): TrlParser reads one YAML. Put "
                          "the settings in one file, and give the others on the command line (--key value).")
    config_file = given[0] if given else None
    if config_file is not None and not os.path.isfile(config_file):
        raise ConfigError(f"--config {config_file}: no such file (relative to {os.getcwd()}).")
    parser = build_parser(command)
    try:
        script_args, model_args, ppo_config, from_yaml, from_cli = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True)
    except ConfigError:
        raise
    except ValueError as err:  # PPOConfig's own refusals (GRPO without num_generations, two length names): one line
        raise ConfigError(one_line_config_error(err)) from err
    errors = (_unknown_keys(parser, from_yaml, f"in {config_file}", "")
              + _unknown_keys(parser, from_cli, "on the command line", "--"))
    if from_cli and not from_cli[0].startswith("--"):
        errors.append(f"unexpected argument {from_cli[0]!r} on the command line (options are written --key value).")
    if errors:
        raise ConfigError("\n".join(errors))
    config_dir = os.path.dirname(os.path.abspath(config_file)) if config_file else None
    for args in (script_args, model_args, ppo_config):
        for name in INPUT_PATHS[type(args)]:
            try:
                setattr(args, name, resolve_input(getattr(args, name), name, config_dir))
            except ConfigError as err:  # report every missing input at once
                errors.append(str(err))
    if errors:
        hint = " (the demo's are built by `make demo`)" if any("demo" in e for e in errors) else ""
        raise ConfigError("\n".join(errors) + "\nRelative paths are read from the working directory, then from the "
                          f"config file's folder: fix the paths{hint}.")
    try:  # imported now, so that a bad entry stops the run before anything loads
        model_args.loaded_reward_funcs = load_reward_funcs(model_args.reward_funcs, config_dir)
    except RewardFuncsError as err:
        raise ConfigError(str(err)) from err
    test = script_args.dataset_test_split
    if isinstance(test, str) and test.strip().lower() in ("none", "null"):
        # The command line's way to drop a YAML's `dataset_test_split` (the YAML writes `null`).
        script_args.dataset_test_split = test = None
    held_out_file = test is not None and (os.sep in test or os.path.splitext(test)[1].lower() in LOCAL_BUILDERS)
    # A held-out file with no evaluation during training is what `hf-ppo evaluate --dataset <file>` reads after it
    # (the run records it, and evaluate's messages name it): no warning at every run. A split of the training
    # dataset with eval_strategy 'no' is most likely an evaluation the user meant to run during training.
    if test is not None and not held_out_file and ppo_config.eval_strategy == "no" \
            and not getattr(ppo_config, "eval_on_start", False):
        warn_user(f"dataset_test_split={test!r} is set but eval_strategy is 'no': the evaluation prompts are loaded "
                  "and checked, and never evaluated on. Set eval_strategy: steps and eval_steps: N (--eval_strategy "
                  "steps --eval_steps N) to evaluate during training, or leave dataset_test_split out "
                  "(--dataset_test_split none).")
    if held_out_file:
        script_args.dataset_test_split = resolve_input(test, "dataset_test_split", config_dir, hub=False)
    resume = ppo_config.resume_from_checkpoint
    if isinstance(resume, str) and resume.strip().lower() in ("true", "false"):
        # What the YAML key takes (`resume_from_checkpoint: true`, a bool): the command line gives text, which
        # Trainer would read as a folder named "true".
        ppo_config.resume_from_checkpoint = resume.strip().lower() == "true"
    elif isinstance(resume, str):
        ppo_config.resume_from_checkpoint = resolve_input(resume, "resume_from_checkpoint", config_dir, hub=False)
    ppo_config.output_dir = os.path.abspath(ppo_config.output_dir)
    if ppo_config.process_index == 0:  # another live run in output_dir: one line now, before any model loads
        in_use = in_use_message(ppo_config.output_dir)
        if in_use is not None:
            raise ConfigError(in_use)
    return script_args, model_args, ppo_config


def one_line_config_error(err: ValueError) -> str:
    """PPOConfig's refusal (`Invalid PPOConfig:` and one `- ` line per problem) as the command line's one line, the
    problems joined with "; "."""
    return str(err).replace("Invalid PPOConfig:\n- ", "").replace("\n- ", "; ")


def context_error(policy_path: str, ppo_config: PPOConfig, model_args: ModelArguments) -> str | None:
    """The trainer's refusal of a `response_length` that leaves no room for a prompt in the policy's context, found
    from the policy's config alone (before any model loads); None when it fits or the context is unknown (the
    trainer's own load then says what is wrong)."""
    from transformers import AutoConfig

    from ..models.tokenizers import max_positions

    folder, _ = gguf.converted(policy_path, ppo_config.model_init_kwargs, "policy")
    try:
        config = AutoConfig.from_pretrained(folder, revision=None if folder != policy_path else
                                            model_args.model_revision, trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError):
        return None
    context = max_positions(config)
    if context is None or context - ppo_config.response_length >= 1:
        return None
    return (f"response_length={ppo_config.response_length} leaves no room for a prompt in the policy's context of "
            f"{context} tokens: lower response_length (--response_length; TRL GRPO's --max_completion_length is the "
            "same setting).")


def resolve_input(value: str | None, name: str, config_dir: str | None, hub: bool = True) -> str | None:
    """`value` as an absolute path when it exists (working directory first, then `config_dir`); a Hub id as is.

    Raises `ConfigError` naming both places looked in when it is neither a local path nor (with `hub`) a Hub id.
    """
    if value is None:
        return None
    expanded = os.path.expanduser(value)
    candidates = [os.path.abspath(expanded)]
    if config_dir is not None and not os.path.isabs(expanded):
        candidates.append(os.path.normpath(os.path.join(config_dir, expanded)))
    for candidate in candidates:
        if os.path.exists(candidate):
            return candidate
    if hub and HUB_ID.match(value) and not value.startswith("."):
        return value  # a Hub id: the trainer (or `datasets`) loads it, with its own error when it cannot
    where = " nor ".join(dict.fromkeys(candidates))
    raise ConfigError(f"{name}={value!r} was not found: it is neither {where}"
                      + (", and it is not a Hub id ('name' or 'namespace/name')." if hub else "."))


def silence_known_warnings() -> None:
    """Hide the deprecation warnings of other packages' code that we cannot fix: peft 0.21 reads transformers'
    `is_gradient_checkpointing`; bitsandbytes before 0.50 calls torch's `_check_is_size` in its CPU kernels."""
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning,
                            module="transformers.modeling_utils")
    warnings.filterwarnings("ignore", message="_check_is_size will be removed", category=FutureWarning,
                            module="bitsandbytes")


def init_kwargs(model_args: ModelArguments, revision: str | None) -> dict:
    """`from_pretrained` keyword arguments shared by the three models; unset values are left to transformers."""
    kwargs = {"revision": revision, "dtype": model_args.dtype, "attn_implementation": model_args.attn_implementation,
              "trust_remote_code": model_args.trust_remote_code}
    return {k: v for k, v in kwargs.items() if v is not None}


def load_tokenizer(path: str, policy_init_kwargs: dict, model_args: ModelArguments):
    """The policy's tokenizer from `path`; for a GGUF policy (`gguf_file` in `model_init_kwargs`, or the `.gguf` file
    itself as the model) from the folder it is converted into (`models/gguf.py`), which the trainer loads next."""
    folder, _ = gguf.converted(path, policy_init_kwargs, "policy")
    if folder != path:  # a GGUF checkpoint: its tokenizer was saved beside the converted weights
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=model_args.trust_remote_code)
    return AutoTokenizer.from_pretrained(path, revision=model_args.model_revision,
                                         trust_remote_code=model_args.trust_remote_code)


def load_split(name: str, config: str | None, split: str, option: str = "--dataset_train_split") -> Dataset:
    """One split of a Hub dataset, or the whole of a local file (its only split, "train"). `option`: the flag that
    chose `split`, named when it is wrong. Another split of a local file is refused: the whole file would be read
    under that split's name (a "test" split that is the training prompts again); a `config` for one is said to be
    ignored (a warning)."""
    suffix = os.path.splitext(name)[1].lower()
    if os.path.isfile(name):
        if suffix not in LOCAL_BUILDERS:
            raise ValueError(f"Cannot read {name!r}: use a {'/'.join(LOCAL_BUILDERS)} file or a Hub dataset id.")
        if split != "train":
            fix = ("pass the file of the test prompts (--dataset_test_split test.jsonl, or `dataset_test_split: "
                   "test.jsonl` in the YAML), or --dataset_test_split none for no evaluation set"
                   if option == "--dataset_test_split" else
                   f"leave {option} out (or give it 'train'"
                   + ("; `dataset_train_split` in the YAML" if option == "--dataset_train_split" else "")
                   + "), or pass the file of the prompts you mean")
            raise ValueError(f"{option} {split!r}: {name!r} is a local file, which has one split (all of it), so "
                             f"split {split!r} would read the whole file: {fix}.")
        if config is not None:  # nothing to choose in a file: said, since the user meant something by it
            warn_user(f"dataset_config {config!r} is ignored: {name!r} is a local file, and only a Hub dataset has "
                      "configurations. Leave dataset_config out (of the YAML, or --dataset_config on the command "
                      "line) to drop this note, or name the Hub dataset whose configuration you meant.")
        return load_dataset(LOCAL_BUILDERS[suffix], data_files=name, split="train")
    dataset = load_dataset(name, config)
    if isinstance(dataset, DatasetDict) and split not in dataset:
        raise ValueError(f"Dataset {name!r} has no split {split!r}; it has {list(dataset)}. Choose one with "
                         f"{option}.")
    return dataset[split]


def prompt_column_of(dataset: Dataset, column: str | None) -> str:
    """The column the prompts are read from: `column`, or with none given (or "prompt", the default name, where the
    dataset has none) "prompt", else "messages", else "input_ids" (TRL 1.12's pre-tokenized prompts), as the trainer
    reads a dataset; "prompt" when it has none of them (`prompts_from_column` then names the columns it has)."""
    if column is not None and (column != "prompt" or column in dataset.column_names):
        return column
    return next((c for c in ("prompt", "messages", "input_ids") if c in dataset.column_names), "prompt")


def prompts_from_column(dataset: Dataset, column: str | None, tokenizer, source: str) -> Dataset:
    """The dataset as the trainer reads it with `prompt_column=column` (`trainer.data.select_prompt_column`): the
    prompt column (`prompt_column_of`) renamed "prompt" (text, or chat messages the trainer renders with the chat
    template), or "input_ids" when it holds token ids, and every other column but the prompt's own names (prompt,
    messages, input_ids, attention_mask), which would compete with it: reward functions receive those columns as
    keyword arguments. Checked before any model loads: a missing column names the columns there are, chat messages
    need a chat template."""
    column = prompt_column_of(dataset, column)
    if column not in dataset.column_names:
        raise ValueError(
            f"Dataset {source!r} has no column {column!r}; its columns are {dataset.column_names}. Choose the prompt "
            "column with --prompt_column NAME (or `prompt_column: NAME` in the YAML); for chat datasets name the "
            "column of message lists, e.g. --prompt_column messages."
        )
    first = dataset[0][column] if len(dataset) else ""
    token_ids = isinstance(first, list) and first and all(isinstance(t, int) for t in first)
    if not token_ids and isinstance(first, list) and tokenizer.chat_template is None:  # chat: {"role", "content"}s
        raise ValueError(
            f"Column {column!r} of {source!r} holds chat messages, but the policy's tokenizer has no chat template. "
            "Use a chat/instruct model, save the tokenizer with a template (`tokenizer.chat_template = ...`), or "
            "point --prompt_column at a plain-text column."
        )
    if not isinstance(first, (str, list)):
        raise ValueError(f"Column {column!r} of {source!r} holds {type(first).__name__}, not text or chat messages.")
    return select_prompt_column(dataset, column, repr(source), "--prompt_column NAME")


def with_system_prompt(dataset: Dataset, system_prompt: str | None, tokenizer, source: str) -> Dataset:
    """`dataset` (as `prompts_from_column` returns it) with `system_prompt` first in every prompt, as the trainer puts
    it there (`trainer.data.with_system_prompt`), refused as it refuses it, before any model loads."""
    return system_prompt_first(dataset, system_prompt, tokenizer, repr(source))


def load_prompts(source: str, config: str | None, split: str, ppo_config: PPOConfig, tokenizer,
                 option: str = "--dataset_train_split") -> tuple[Dataset, Dataset]:
    """(the split as loaded, the same as the trainer will read it): `ppo_config.prompt_column` resolved
    (`prompt_column_of`) and its prompts checked, the system prompt put first. The trainer gets the first and prepares
    it itself; the second is for the checks that must come before any model loads (reward functions). `option`: the
    flag that chose `split` (`load_split`)."""
    loaded = load_split(source, config, split, option)
    checked = prompts_from_column(loaded, ppo_config.prompt_column, tokenizer, source)
    return loaded, with_system_prompt(checked, ppo_config.system_prompt, tokenizer, source)


def reward_list(reward_model: str | None, funcs: list[RewardFunc], datasets: dict,
                weights: list[float] | None = None):
    """The trainer's `reward_model`: [the reward model if any, *the reward functions], a single reward as itself.

    Each function is first checked against the columns of each dataset it will score (`datasets`: {name: dataset or
    None}), so a signature that cannot take the call stops the run before any model loads (`ConfigError`); so is a
    `reward_weights` (`weights`) that does not hold one weight per reward."""
    try:
        check_signatures(funcs, datasets)
    except RewardFuncsError as err:
        raise ConfigError(str(err)) from err
    rewards = ([reward_model] if reward_model is not None else []) + [f.func for f in funcs]
    if weights is not None and len(weights) != len(rewards):
        names = ", ".join(unique_names([reward_name(r) for r in rewards]))
        raise ConfigError(f"reward_weights has {len(weights)} weights but there {'are' if len(rewards) > 1 else 'is'} "
                          f"{len(rewards)} reward{'s' if len(rewards) > 1 else ''} ({names}): give one weight per "
                          "reward, in the order [reward_model_name_or_path, *reward_funcs], or leave reward_weights "
                          "out for all 1.0.")
    return rewards[0] if len(rewards) == 1 else rewards


def probe_reward_funcs(funcs: list[RewardFunc], datasets: dict, tokenizer, ppo_config: PPOConfig) -> None:
    """Each reward function called once on the first two prompts of each prompt set (`datasets`: {"train_dataset" or
    "eval_dataset": the prompts as `load_prompts` checked them, or None}; prepared as the trainer prepares them) with
    empty completions, as the trainer probes it (`rollout.scoring.probe_reward_callable`), but before any model
    loads: a value it cannot use, or an exception inside it, stops the run in one line (`ConfigError`; for an
    exception, with the file and line it came from). Inside `probing_once()`, the trainer built next skips these
    same probes: each function is called once per prompt set at start-up."""
    try:
        for source, prompts in datasets.items():
            if not funcs or prompts is None or not len(prompts):
                continue
            sample = prepare_prompts(prompts.select(range(min(2, len(prompts)))), tokenizer, source,
                                     max_prompt_length=None, response_length=ppo_config.response_length, context=None,
                                     apply_chat_template_to_text=ppo_config.apply_chat_template_to_text)
            for func in funcs:
                probe_reward_callable(func.func, sample, tokenizer, reward_name(func.func), source)
    except RewardFunctionError as err:
        frames = traceback.extract_tb(err.__cause__.__traceback__) if err.__cause__ is not None else []
        where = f" (raised at {frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
        raise ConfigError(f"{err}{where}") from err
    except (TypeError, ValueError) as err:
        raise ConfigError(str(err)) from err


def main(argv: list[str] | None = None, command: str = "python recipes/ppo.py") -> PPOLMTrainer:
    """Parse `argv` (default: sys.argv), train, save (and push); return the trainer. `command`: what the help and
    the errors call the command."""
    script_args, model_args, ppo_config = parse_args(argv, command)
    silence_known_warnings()

    ppo_config.model_init_kwargs = {**init_kwargs(model_args, model_args.model_revision),
                                    **(ppo_config.model_init_kwargs or {})}
    ppo_config.ref_model_init_kwargs = {**init_kwargs(model_args, model_args.ref_model_revision),
                                        **(ppo_config.ref_model_init_kwargs or {})}
    ppo_config.reward_model_init_kwargs = {**init_kwargs(model_args, model_args.reward_model_revision),
                                           **(ppo_config.reward_model_init_kwargs or {})}

    policy_path, tokenizer_path, reward_path = resolve_model_paths(model_args, ppo_config)
    too_long = context_error(policy_path, ppo_config, model_args)
    if too_long is not None:
        raise ConfigError(too_long)
    try:  # the tokenizer (a GGUF file's name checked), the prompts read and checked as the trainer will read them,
        # before any model loads
        tokenizer = load_tokenizer(tokenizer_path, ppo_config.model_init_kwargs, model_args)
        train, checked = load_prompts(script_args.dataset_name, script_args.dataset_config,
                                      script_args.dataset_train_split, ppo_config, tokenizer)
        evaluation, checked_evaluation = None, None
        if script_args.dataset_test_split is not None:
            test = script_args.dataset_test_split
            source, split = (test, "train") if os.path.isfile(test) else (script_args.dataset_name, test)
            evaluation, checked_evaluation = load_prompts(source, script_args.dataset_config, split, ppo_config,
                                                          tokenizer, "--dataset_test_split")
    except ValueError as err:  # a wrong column, chat prompts without a template, a system prompt it cannot take
        raise ConfigError(str(err)) from err
    ppo_config.prompt_column = prompt_column_of(train, ppo_config.prompt_column)  # recorded beside the policy
    reward = reward_list(reward_path, model_args.loaded_reward_funcs,
                         {"the training prompts": checked, "the evaluation prompts": checked_evaluation},
                         ppo_config.reward_weights)
    # Each reward function is called once at start-up: probed here, before any model loads, and the trainer built
    # inside `probing_once()` skips its own identical probe.
    with probing_once():
        probe_reward_funcs(model_args.loaded_reward_funcs,
                           {"train_dataset": checked, "eval_dataset": checked_evaluation}, tokenizer, ppo_config)
        if reward_path is not None and ppo_config.reward_model_path is not None and isinstance(reward, list):
            ppo_config.reward_model_path = None  # now in the list (the trainer would take a list for a second model)

        peft_config = None
        if model_args.use_peft:
            from peft import LoraConfig

            targets = model_args.lora_target_modules
            if isinstance(targets, list) and targets == ["all-linear"]:  # peft wants this one as a bare string
                targets = "all-linear"
            peft_config = LoraConfig(r=model_args.lora_r, lora_alpha=model_args.lora_alpha, task_type="CAUSAL_LM",
                                     lora_dropout=model_args.lora_dropout, target_modules=targets)

        trainer = PPOLMTrainer(
            model=policy_path,
            args=ppo_config,
            reward_model=reward,
            ref_model=model_args.ref_model_name_or_path,
            critic_model=model_args.critic_model_name_or_path,
            train_dataset=train,
            eval_dataset=evaluation,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    # The run holds output_dir until its final save is complete: no other run starts between the two.
    with trainer._holding_output_dir():
        trainer.train(resume_from_checkpoint=ppo_config.resume_from_checkpoint)
        trainer.save_state()  # trainer_state.json: every logged metric, beside the policy
        stop = next((c for c in trainer.callback_handler.callbacks if isinstance(c, CollapseWatch) and c.stopped), None)
        if stop is not None:  # stop_on_collapse: the policy in memory is the collapsed one, never saved as the result
            if trainer.is_world_process_zero():
                print(collapse_stop_message(stop.last_checkpoint(), ppo_config.output_dir, ppo_config.push_to_hub))
            return trainer
        if ppo_config.push_to_hub:  # saves the policy to output_dir, then uploads it with its card
            commit = trainer.push_to_hub(dataset_name=script_args.dataset_name)
            if trainer.is_world_process_zero():  # an adapter unless merged; full weights load with AutoModelForCausalLM
                adapter = (trainer.accelerator.unwrap_model(trainer.model).is_peft_model
                           and not ppo_config.push_merged_model)
                print(pushed_policy_message(trainer.hub_model_id, commit, ppo_config.output_dir, adapter))
        else:
            # The policy, then its card, written once (naming the dataset too, which save_model() alone does not know),
            # then where the policy is, how to load and push it (what save_model() prints).
            trainer.save_model(ppo_config.output_dir, _internal_call=True)
            trainer.create_model_card(dataset_name=script_args.dataset_name)
            if trainer.is_world_process_zero():
                print(saved_policy_message(ppo_config.output_dir, trainer.trained_adapter is not None))
        if ppo_config.should_save:  # the dataset beside the run record (the trainer knows no names): evaluate's default
            record_dataset(ppo_config.output_dir, script_args.dataset_name, script_args.dataset_config,
                           script_args.dataset_train_split, script_args.dataset_test_split)
    return trainer


def collapse_stop_message(checkpoint: str | None, output_dir: str, push: bool) -> str:
    """What `hf-ppo train` prints instead of saving (and pushing) the policy after the collapse watch stopped the run."""
    kept = (f"The last complete checkpoint is {checkpoint}: load the policy from it (from_pretrained), or fix the "
            "settings and run again with --resume_from_checkpoint true to resume from it." if checkpoint else
            "No checkpoint was saved before the stop (save_strategy='steps' with save_steps keeps some): fix the "
            "settings and run again.")
    return (f"Training stopped on a collapse signature (stop_on_collapse=True; the CollapseWarning above names it): the "
            f"policy in memory is the collapsed one, so it is not saved to {output_dir}"
            f"{' or pushed to the Hub' if push else ''}. {kept}")


def run(argv: list[str] | None = None, command: str = "python recipes/ppo.py") -> None:
    """`main` as a command: a bad key or path exits with its message alone (the whole story, no traceback)."""
    try:
        trainer = main(argv, command)
    # A resume the checkpoint refuses is the user's to fix, too, and so is a final save on a full disk (its message
    # names the folder, the space, the last complete checkpoint and the command that finishes the run).
    except (ConfigError, CheckpointError, SaveWriteError) as err:
        name = os.path.basename(command.split()[-1]) if command.endswith(".py") else command
        sys.exit(f"{name}: error: {err}")
    # The script's end (accelerate's end_training: trackers closed, the process group destroyed). Under `accelerate
    # launch` a process that exits with its gloo/NCCL group alive can abort in teardown ("terminate called without an
    # active exception"), after everything was saved, and the launcher then reports the run as failed.
    trainer.rollout_engine.close()  # vLLM's engine first: its process groups go with it, before accelerate's
    trainer.accelerator.end_training()

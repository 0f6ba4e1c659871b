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

--reference defaults to the base model of a LoRA adapter policy (adapter_config.json's base_model_name_or_path);
a full-model policy needs it. Each model loads as the run that trained the policy loaded it (hf_ppo_run.json, which
save_model() writes beside the policy: the reference of a LoRA run is its base in the policy's quantization), in
full precision when nothing is recorded; --policy_quantization, --ref_quantization and --reward_quantization
(4bit, 8bit or none, PPOConfig's names) choose. The compute dtype is the run's too (bf16, fp16 or fp32, recorded
in the same file; fp32 when nothing is recorded); --precision chooses. Everything runs where torch finds a device
(CPU or one GPU); fp16 needs a GPU, so on a CPU an fp16 run is evaluated in fp32, and the command says so.
"""


def evaluate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-ppo evaluate", description=EVALUATE_HELP,
                                     usage="hf-ppo evaluate --policy PATH_OR_ID [--reward_model RM] [--reward_funcs "
                                           "ENTRY ...] --dataset PROMPTS [--key value ...]",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--policy", required=True, help="The trained policy: a Hub id or folder (full model or LoRA adapter).")
    add("--reference", default=None, help="The model it started from (default: a LoRA adapter's base model).")
    add("--reward_model", action="append", default=None,
        help="A training reward model (id or folder; num_labels=1). Repeat for several: each is reported.")
    add("--reward_funcs", nargs="+", action="extend", default=None, metavar="ENTRY",
        help="Reward functions, scored for the policy and the reference as in training (after the reward models): "
             "dotted paths (trl.rewards.accuracy_reward), files (rewards.py:exact, relative to the working "
             "directory), or factories as a JSON object ('{\"path\": {\"arg\": value}}').")
    add("--judge", action="append", default=None, help="A reward model training never saw (repeatable).")
    add("--dataset", required=True, help="Prompts: a local .json/.jsonl/.csv/.parquet file or a Hub dataset id.")
    add("--dataset_config", default=None, help="Hub dataset configuration (subset) name.")
    add("--dataset_split", default="train", help="Split of a Hub dataset.")
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
    add("--response_length", type=int, default=None,
        help=f"Tokens sampled per response. Default: the run's (its hf_ppo_run.json), else "
             f"{SAMPLING_DEFAULTS['response_length']}.")
    add("--temperature", type=float, default=None,
        help=f"Sampling temperature. Default: the run's, else {SAMPLING_DEFAULTS['temperature']}.")
    add("--top_k", type=int, default=None, help="Top-k sampling (0: off). Default: the run's, else off.")
    add("--top_p", type=float, default=None, help="Nucleus sampling. Default: the run's, else 1.0 (off).")
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


QUANTIZATIONS = ("4bit", "8bit", "none")
PRECISIONS = ("bf16", "fp16", "fp32")
# What `hf-ppo evaluate` samples with when neither an option nor the run record says (PPOConfig's defaults).
SAMPLING_DEFAULTS = {"response_length": 53, "temperature": 0.7, "top_k": None, "top_p": 1.0}
# The settings `recorded_prompting` resolves, and the option that overrides each.
PROMPTING = ("prompt_column", "system_prompt", "apply_chat_template_to_text", *SAMPLING_DEFAULTS)


def recorded_prompting(policy: str, args: argparse.Namespace) -> tuple[dict, list[str]]:
    """(settings, recorded): how this evaluation prompts and samples, keyed as PPOConfig's fields (`PROMPTING`):
    each option when given, else what the run that trained `policy` recorded beside it (the `prompts` and `sampling`
    of its `hub.publish.RUN_RECORD_FILE`), else the defaults ('prompt', no system prompt, the text as it is,
    `SAMPLING_DEFAULTS`); and the names of the settings taken from the record. A record written before these keys
    existed records none of them. `--system_prompt ''` means none; the prompt format follows the run's: prompts that
    went through the chat template there (`format` 'chat') do here."""
    from ..hub.publish import read_run_record

    record = (read_run_record(policy) if os.path.isdir(policy) else None) or {}
    prompts, sampling = record.get("prompts") or {}, record.get("sampling") or {}
    formats = {"chat": True, "text": False}
    recorded = {"prompt_column": prompts.get("column"), "system_prompt": prompts.get("system_prompt"),
                "apply_chat_template_to_text": formats.get(prompts.get("format"),
                                                           prompts.get("apply_chat_template_to_text")),
                **{name: sampling[name] for name in SAMPLING_DEFAULTS if name in sampling}}
    recorded = {name: value for name, value in recorded.items() if value is not None or name in sampling}
    given = {name: getattr(args, name) for name in PROMPTING if getattr(args, name) is not None}
    if "apply_chat_template_to_text" in given:
        given["apply_chat_template_to_text"] = given["apply_chat_template_to_text"] == "true"
    if given.get("system_prompt") == "":
        given["system_prompt"] = None
    settings = {"prompt_column": None, "system_prompt": None, "apply_chat_template_to_text": None,
                **SAMPLING_DEFAULTS, **recorded, **given}
    return settings, [name for name in PROMPTING if name in recorded and name not in given]


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
    """The line that says which settings came from the run record, and how to override them; None when none did."""
    if not recorded:
        return None
    shown = ", ".join(f"{name} {settings[name]!r}" for name in recorded)
    return (f"prompting and sampling as the run trained (its hf_ppo_run.json): {shown}. Override with "
            + ", ".join(f"--{name}" for name in recorded) + ".")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def recorded_precision(policy: str, args: argparse.Namespace) -> tuple[str, str | None]:
    """(precision, note): --precision when given, else the one the run that trained `policy` recorded beside it,
    else 'fp32'. fp16 without a GPU (Trainer refuses it on a CPU) becomes fp32, with the note that says so."""
    from ..hub.publish import read_run_record

    record = (read_run_record(policy) if os.path.isdir(policy) else None) or {}
    recorded = record.get("precision") if record.get("precision") in PRECISIONS else None
    chosen = args.precision or recorded or "fp32"
    if chosen == "fp16" and not _cuda_available():
        where = "--precision fp16" if args.precision else "the run trained in fp16"
        return "fp32", f"{where}, but fp16 needs a GPU and none is here: evaluating in fp32."
    return chosen, None


def recorded_quantization(policy: str, args: argparse.Namespace) -> dict[str, str]:
    """{"policy", "ref", "reward"}: each model's quantization for this evaluation: the option when given, else what
    the run that trained `policy` recorded beside it (`hub.publish.RUN_RECORD_FILE`), else 'none'. A reference
    given by --reference that is not the run's own reference is loaded in full precision unless told."""
    from ..hub.publish import read_run_record

    record = (read_run_record(policy) if os.path.isdir(policy) else None) or {}
    loaded = record.get("quantization") or {}
    rewards = {q for q in loaded.get("reward") or [] if q is not None}
    recorded = {"policy": loaded.get("policy"), "ref": loaded.get("reference"),
                "reward": rewards.pop() if len(rewards) == 1 else None}
    chosen = {name: getattr(args, f"{name}_quantization") or recorded[name] or "none" for name in recorded}
    if args.ref_quantization is None and args.reference is not None and record.get("reference") not in (
            None, args.reference):
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
    reference = args.reference or default_reference(args.policy)
    from ..evaluation.report import metrics_markdown, write_metrics
    from ..models import gguf
    from ..models.tokenizers import load_policy_tokenizer
    from ..trainer import PPOConfig, PPOLMTrainer
    from .train import load_split, prompts_from_column, silence_known_warnings, with_system_prompt

    silence_known_warnings()
    quantization = recorded_quantization(args.policy, args)
    precision, note = recorded_precision(args.policy, args)
    if note:
        print(f"hf-ppo evaluate: {note}")
    prompting, recorded = recorded_prompting(args.policy, args)
    note = recorded_note(prompting, recorded)
    if note:
        print(f"hf-ppo evaluate: {note}")
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
        prompts = prompts_from_column(load_split(args.dataset, args.dataset_config, args.dataset_split),
                                      prompting["prompt_column"], tokenizer, args.dataset)
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
                                                   "quantization": quantization, "precision": precision, **metrics})
    loaded = "quantization: " + ", ".join(f"{name} {q}" for name, q in quantization.items()) + f"; {precision}"
    print(f"{args.policy} against {reference} on {len(prompts)} prompts of {args.dataset} ({loaded}):\n")
    print(metrics_markdown(metrics, "eval_"))
    print("\n" + written_files_line(args.output_dir, metrics_path))
    return metrics


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

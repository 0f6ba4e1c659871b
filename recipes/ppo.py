"""PPO (RLHF) on a Hub or local policy with a Hub or local reward model: the one hf_ppo recipe.

    # the offline demo config (after `make demo` has built its tiny models)
    python recipes/ppo.py --config recipes/configs/demo.yaml
    # a real run on one 24GB GPU (needs the Hub), with command-line overrides on top of the YAML
    python recipes/ppo.py --config recipes/configs/qlora_24gb.yaml --learning_rate 5e-6 --output_dir runs/my-ppo
    # several GPUs (DDP), or DeepSpeed ZeRO-2; the script itself is unchanged
    accelerate launch --config_file recipes/accelerate/ddp.yaml recipes/ppo.py --config recipes/configs/qlora_24gb.yaml
    accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml recipes/ppo.py --config ...
    # every option, with its help
    python recipes/ppo.py --help

The YAML keys are the fields of `ScriptArguments`, `ModelArguments` and `hf_ppo.PPOConfig` (which includes all of
`transformers.TrainingArguments`); a key none of them has is an error naming it. Quantization is per model and
lives in PPOConfig: `policy_quantization` (4bit + use_peft = QLoRA), `ref_quantization`, `reward_quantization`.

Prompts come from `prompt_column`: plain text, or chat conversations (`prompt_column: messages`, a list of
{"role", "content"} dicts) rendered with the policy tokenizer's chat template and a generation prompt.

Deliberately left out: custom reward functions (pass a callable to `PPOLMTrainer` in your own script), dataset
mixtures, streaming datasets, and any device placement (Trainer and accelerate own it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from datasets import Dataset, DatasetDict, load_dataset
from transformers import AutoTokenizer
from trl import TrlParser

from hf_ppo import PPOConfig, PPOLMTrainer

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
    prompt_column: str = field(
        default="prompt",
        metadata={"help": "Column holding the prompts: text, or chat messages (e.g. 'messages') rendered with the "
                  "tokenizer's chat template."},
    )


@dataclass
class ModelArguments:
    """Which models to load, and how (quantization of each model is set in PPOConfig)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Policy: Hub id or local path of a causal LM (with --sft_model_path, as in "
                                "TRL's script, only the tokenizer is read from here)."})
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Reward model: a sequence classifier with 1 label."})
    # TRL 1.12's script names (they lived in its PPOConfig): the policy/reference and the reward model.
    sft_model_path: str | None = field(
        default=None, metadata={"help": "TRL's name for the policy (and reference) model; the tokenizer still comes "
                                "from --model_name_or_path when given, as in TRL's script."})
    reward_model_path: str | None = field(default=None, metadata={"help": "TRL's name for --reward_model_name_or_path."})
    ref_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Reference model; None: the policy with its LoRA adapter disabled "
                                "(with use_peft) or a frozen copy of the starting policy."},
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


def resolve_model_paths(model_args: ModelArguments) -> tuple[str, str, str]:
    """(policy, tokenizer, reward model) paths from hf_ppo's names or TRL's (`sft_model_path`, `reward_model_path`)."""
    policy = model_args.sft_model_path or model_args.model_name_or_path
    if policy is None:
        raise ValueError("No policy: pass --model_name_or_path (or TRL's --sft_model_path).")
    rewards = {p for p in (model_args.reward_model_name_or_path, model_args.reward_model_path) if p is not None}
    if not rewards:
        # TRL's script defaulted to EleutherAI/pythia-160m, a base LM whose score head would be random: no default.
        raise ValueError("No reward model: pass --reward_model_name_or_path (or TRL's --reward_model_path), a "
                         "sequence classifier trained with num_labels=1 (e.g. with trl's RewardTrainer).")
    if len(rewards) > 1:
        raise ValueError(f"--reward_model_name_or_path and --reward_model_path name different models {sorted(rewards)}: "
                         "pass one.")
    return policy, model_args.model_name_or_path or policy, rewards.pop()


def init_kwargs(model_args: ModelArguments, revision: str | None) -> dict:
    """`from_pretrained` keyword arguments shared by the three models; unset values are left to transformers."""
    kwargs = {"revision": revision, "dtype": model_args.dtype, "attn_implementation": model_args.attn_implementation,
              "trust_remote_code": model_args.trust_remote_code}
    return {k: v for k, v in kwargs.items() if v is not None}


def load_split(name: str, config: str | None, split: str) -> Dataset:
    """One split of a Hub dataset, or the whole of a local file (its only split)."""
    suffix = os.path.splitext(name)[1].lower()
    if os.path.isfile(name):
        if suffix not in LOCAL_BUILDERS:
            raise ValueError(f"Cannot read {name!r}: use a {'/'.join(LOCAL_BUILDERS)} file or a Hub dataset id.")
        return load_dataset(LOCAL_BUILDERS[suffix], data_files=name, split="train")
    dataset = load_dataset(name, config)
    if isinstance(dataset, DatasetDict) and split not in dataset:
        raise ValueError(f"Dataset {name!r} has no split {split!r}; it has {list(dataset)}. Choose one with "
                         "--dataset_train_split / --dataset_test_split.")
    return dataset[split]


def prepare_prompts(dataset: Dataset, column: str, tokenizer, source: str) -> Dataset:
    """Keep `column` alone, renamed "prompt": text, or chat messages the trainer renders with the chat template.

    Pre-tokenized prompts (TRL 1.12's format: token ids, used when `column` holds them or, by default, when the
    dataset has "input_ids" and no "prompt") are kept as "input_ids", with their "attention_mask" when present.
    """
    if column == "prompt" and column not in dataset.column_names and "input_ids" in dataset.column_names:
        column = "input_ids"
    if column not in dataset.column_names:
        raise ValueError(
            f"Dataset {source!r} has no column {column!r}; its columns are {dataset.column_names}. Choose the prompt "
            "column with --prompt_column NAME (or `prompt_column: NAME` in the YAML); for chat datasets name the "
            "column of message lists, e.g. --prompt_column messages."
        )
    first = dataset[0][column] if len(dataset) else ""
    if isinstance(first, list) and first and all(isinstance(t, int) for t in first):  # token ids
        keep = [column] + (["attention_mask"] if "attention_mask" in dataset.column_names else [])
        dataset = dataset.select_columns(keep)
        return dataset.rename_column(column, "input_ids") if column != "input_ids" else dataset
    if isinstance(first, list) and tokenizer.chat_template is None:  # chat: a list of {"role", "content"} dicts
        raise ValueError(
            f"Column {column!r} of {source!r} holds chat messages, but the policy's tokenizer has no chat template. "
            "Use a chat/instruct model, save the tokenizer with a template (`tokenizer.chat_template = ...`), or "
            "point --prompt_column at a plain-text column."
        )
    if not isinstance(first, (str, list)):
        raise ValueError(f"Column {column!r} of {source!r} holds {type(first).__name__}, not text or chat messages.")
    dataset = dataset.select_columns([column])
    return dataset.rename_column(column, "prompt") if column != "prompt" else dataset


def main(argv: list[str] | None = None) -> PPOLMTrainer:
    """Parse `argv` (default: sys.argv), train, save (and push); return the trainer."""
    parser = TrlParser((ScriptArguments, ModelArguments, PPOConfig))
    script_args, model_args, ppo_config = parser.parse_args_and_config(argv)

    ppo_config.model_init_kwargs = {**init_kwargs(model_args, model_args.model_revision),
                                    **(ppo_config.model_init_kwargs or {})}
    ppo_config.ref_model_init_kwargs = {**init_kwargs(model_args, model_args.ref_model_revision),
                                        **(ppo_config.ref_model_init_kwargs or {})}
    ppo_config.reward_model_init_kwargs = {**init_kwargs(model_args, model_args.reward_model_revision),
                                           **(ppo_config.reward_model_init_kwargs or {})}

    policy_path, tokenizer_path, reward_path = resolve_model_paths(model_args)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, revision=model_args.model_revision,
                                              trust_remote_code=model_args.trust_remote_code)
    train = load_split(script_args.dataset_name, script_args.dataset_config, script_args.dataset_train_split)
    train = prepare_prompts(train, script_args.prompt_column, tokenizer, script_args.dataset_name)
    evaluation = None
    if script_args.dataset_test_split is not None:
        test = script_args.dataset_test_split
        source = test if os.path.isfile(test) else script_args.dataset_name
        evaluation = load_split(source, script_args.dataset_config, test)
        evaluation = prepare_prompts(evaluation, script_args.prompt_column, tokenizer, source)

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
        reward_model=reward_path,
        ref_model=model_args.ref_model_name_or_path,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train(resume_from_checkpoint=ppo_config.resume_from_checkpoint)
    if ppo_config.push_to_hub:  # saves the policy to output_dir, then uploads it with its card
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    else:
        trainer.save_model(ppo_config.output_dir)
    return trainer


if __name__ == "__main__":
    main()

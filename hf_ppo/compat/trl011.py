"""TRL 0.11's `PPOConfig` / `PPOTrainer` construction over hf_ppo, so a TRL 0.11 loop moves over with the import.

    from hf_ppo.trl011 import PPOConfig, PPOTrainer, AutoModelForCausalLMWithValueHead

`PPOConfig(**trl_0_11_fields)` is a function that maps TRL 0.11's field names (defaults included) onto hf_ppo's
`PPOConfig` and returns one; `PPOTrainer(config, model, ref_model, tokenizer, dataset, ...)` is a `PPOLMTrainer`
with TRL 0.11's constructor, `.dataloader`, `.config` and `.tokenizer`; `step()` and `generate()` are
PPOLMTrainer's own (`trainer/step_api.py`). A TRL 0.11 name whose effect on training hf_ppo cannot reproduce is an error naming
it; names with no effect on training are accepted with one warning listing them.
"""

from __future__ import annotations

import warnings

import torch

from ..models.value_head import AutoModelForCausalLMWithValueHead
from ..trainer.config import PPOConfig as _PPOConfig
from ..trainer.ppo_trainer import PPOLMTrainer
from ..trainer.step_api import STEP_VLLM_ERROR

__all__ = ["AutoModelForCausalLMWithValueHead", "PPOConfig", "PPOTrainer"]

# TRL 0.11 field -> its default there, for the fields hf_ppo maps (trl 0.11.4 trl/trainer/ppo_config.py).
TRL_DEFAULTS = {
    "seed": 0, "log_with": None, "exp_name": None, "learning_rate": 1.41e-5, "adap_kl_ctrl": True,
    "init_kl_coef": 0.2, "kl_penalty": "kl", "target": 6.0, "horizon": 10000.0, "gamma": 1.0, "lam": 0.95,
    "cliprange": 0.2, "cliprange_value": 0.2, "vf_coef": 0.1, "batch_size": 128, "forward_batch_size": None,
    "mini_batch_size": 128, "gradient_accumulation_steps": 1, "ppo_epochs": 4, "max_grad_norm": None,
    "early_stopping": False, "ratio_threshold": 10.0, "use_score_scaling": False, "use_score_norm": False,
    "score_clip": None, "whiten_rewards": False, "gradient_checkpointing": False, "remove_unused_columns": True,
}
# Kept on the config for the caller's code to read back (TRL 0.11's trainer did not train with them either).
READ_BACK = {"model_name": "gpt2", "query_dataset": "stanfordnlp/imdb",
             "reward_model": "sentiment-analysis:lvwerra/distilbert-imdb", "task_name": None, "steps": 20000,
             "tracker_project_name": "trl"}
# No effect on the update: accepted with one warning.
COSMETIC = ("tracker_kwargs", "accelerator_kwargs", "project_kwargs", "push_to_hub_if_best_kwargs",
            "optimize_cuda_cache", "optimize_device_cache", "compare_steps", "dataset_num_proc", "target_kl",
            "tracker_project_name", "task_name", "query_dataset", "reward_model", "steps")
# hf_ppo's own fields a TRL 0.11 config may also set. TRL 0.11 had no response cap: step() takes longer responses too
# (padding the batch to its longest), response_length is the width step() pads shorter batches to.
HF_PPO_EXTRAS = {"response_length": 128, "output_dir": "ppo_output"}
# Columns TRL 0.11's dataloader kept from a `datasets.Dataset` with remove_unused_columns=True: its value-head
# model's `forward` arguments and "label", "query", "response".
KEPT_COLUMNS = ("input_ids", "attention_mask", "past_key_values", "label", "query", "response")


def PPOConfig(**kwargs) -> _PPOConfig:  # noqa: N802 - TRL 0.11's class name, so its code runs unchanged
    """hf_ppo's `PPOConfig` from TRL 0.11's `PPOConfig` fields and defaults (docs/guides/from-trl.md).

    Sizes: `batch_size` samples per `step()` = `per_device_train_batch_size` (`mini_batch_size`) x
    `gradient_accumulation_steps` x `num_mini_batches` (`batch_size / (mini_batch_size x gradient_accumulation_steps)`),
    as TRL 0.11 took one optimizer step per `mini_batch_size x gradient_accumulation_steps` samples. The learning rate
    is constant (TRL 0.11 had no schedule unless one was passed), `max_grad_norm=None` means no clipping, nothing is
    saved (`save_strategy="no"`), and log-probs are taken at `temperature=1.0` (TRL 0.11's `step()` read the raw
    logits whatever its `generate()` sampled with). The result also carries `model_name` and TRL's other
    informational fields as attributes for the caller's code to read back.
    """
    unknown = set(kwargs) - set(TRL_DEFAULTS) - set(READ_BACK) - set(COSMETIC) - set(HF_PPO_EXTRAS)
    if unknown:
        raise TypeError(f"PPOConfig() got {sorted(unknown)}: not a TRL 0.11 PPOConfig field (nor response_length / "
                        "output_dir). For hf_ppo's other settings use hf_ppo.PPOConfig and PPOLMTrainer.")
    trl = {**TRL_DEFAULTS, **{k: v for k, v in kwargs.items() if k in TRL_DEFAULTS}}
    errors = _unmappable(trl)
    if trl["forward_batch_size"] is not None:  # TRL 0.11: the deprecated name overwrote mini_batch_size
        trl["mini_batch_size"] = trl["forward_batch_size"]
    step_size = trl["mini_batch_size"] * trl["gradient_accumulation_steps"]
    if step_size <= 0 or trl["batch_size"] % step_size:
        errors.append(f"batch_size={trl['batch_size']} must be a multiple of mini_batch_size x "
                      f"gradient_accumulation_steps = {step_size}.")
    if errors:
        raise ValueError("TRL 0.11 PPOConfig settings hf_ppo cannot reproduce:\n- " + "\n- ".join(errors))
    # Precision: TRL 0.11 trained in fp32 unless its Accelerator was told otherwise (accelerator_kwargs'
    # mixed_precision), where hf_ppo's own default is bf16 on a GPU that supports it.
    accelerator_kwargs = dict(kwargs.get("accelerator_kwargs") or {})
    mixed = accelerator_kwargs.pop("mixed_precision", "no")
    if mixed not in ("no", "fp16", "bf16"):
        raise ValueError(f"accelerator_kwargs['mixed_precision']={mixed!r}: 'no', 'fp16' or 'bf16'.")
    ignored = sorted(k for k in kwargs if k in COSMETIC and (k != "accelerator_kwargs" or accelerator_kwargs))
    if ignored:
        warnings.warn(f"PPOConfig: {ignored} have no effect on training in hf_ppo and are ignored.", stacklevel=2)
    args = _PPOConfig(
        **{k: kwargs.get(k, v) for k, v in HF_PPO_EXTRAS.items()},
        per_device_train_batch_size=trl["mini_batch_size"],
        gradient_accumulation_steps=trl["gradient_accumulation_steps"],
        num_mini_batches=trl["batch_size"] // step_size, num_ppo_epochs=trl["ppo_epochs"],
        learning_rate=trl["learning_rate"], lr_scheduler_type="constant", seed=trl["seed"], temperature=1.0,
        kl_coef=trl["init_kl_coef"], adaptive_kl=trl["adap_kl_ctrl"], kl_target=trl["target"],
        kl_horizon=int(trl["horizon"]), kl_estimator={"kl": "k1", "mse": "k2"}[trl["kl_penalty"]],
        gamma=trl["gamma"], lam=trl["lam"], cliprange=trl["cliprange"], cliprange_value=trl["cliprange_value"],
        vf_coef=trl["vf_coef"], whiten_rewards=trl["whiten_rewards"],
        normalize_rewards=trl["use_score_scaling"], reward_clip=trl["score_clip"],
        max_grad_norm=0.0 if trl["max_grad_norm"] is None else trl["max_grad_norm"],
        gradient_checkpointing=trl["gradient_checkpointing"], exp_name=trl["exp_name"],
        report_to=[trl["log_with"]] if trl["log_with"] else [], save_strategy="no",
        bf16=mixed == "bf16", fp16=mixed == "fp16",
    )
    for name, default in READ_BACK.items():
        setattr(args, name, kwargs.get(name, default))
    args.trl_remove_unused_columns = trl["remove_unused_columns"]
    return args


def _unmappable(trl: dict) -> list[str]:
    """The TRL 0.11 settings (already merged with TRL's defaults) whose training effect hf_ppo does not offer."""
    errors = []
    if trl["kl_penalty"] not in ("kl", "mse"):
        errors.append(f"kl_penalty={trl['kl_penalty']!r}: only 'kl' (k1) and 'mse' (k2) are offered.")
    if trl["early_stopping"]:
        errors.append("early_stopping=True: stopping an iteration's epochs on KL is not offered.")
    if trl["ratio_threshold"] != TRL_DEFAULTS["ratio_threshold"]:
        errors.append(f"ratio_threshold={trl['ratio_threshold']}: skipping minibatches by their mean ratio is not "
                      "offered (drop the setting; hf_ppo never skips them).")
    if trl["use_score_scaling"] and not trl["use_score_norm"]:
        errors.append("use_score_scaling=True without use_score_norm: scaling by the running std alone is not "
                      "offered; add use_score_norm=True (running mean/std normalisation, hf_ppo's normalize_rewards).")
    return errors


class PPOTrainer(PPOLMTrainer):
    """A `PPOLMTrainer` built with TRL 0.11's constructor; `step()` / `generate()` are PPOLMTrainer's.

    config: from `PPOConfig` above (or hf_ppo's own); model: a value-head model or a Hub id / path; ref_model:
    None for a frozen copy of the starting policy; tokenizer: the processing class; dataset / data_collator: give
    `.dataloader` (`batch_size` prompts per batch, shuffled with `seed`, the last incomplete batch dropped, as
    TRL 0.11's); optimizer: optional, over the model's trainable parameters (default: Trainer's AdamW with weight
    decay 0, i.e. Adam). `num_shared_layers` and `lr_scheduler` are not offered (errors).
    """

    def __init__(self, config=None, model=None, ref_model=None, tokenizer=None, dataset=None, optimizer=None,
                 data_collator=None, num_shared_layers=None, lr_scheduler=None):
        if num_shared_layers is not None:
            raise ValueError("num_shared_layers is not offered: the reference is a full frozen copy (or, with LoRA, "
                             "the adapter disabled); drop the argument.")
        if lr_scheduler is not None:
            raise ValueError("lr_scheduler is not offered (TRL 0.11 stepped it once per step(), Trainer steps a "
                             "schedule once per optimizer step): build hf_ppo.PPOConfig with lr_scheduler_type and "
                             "max_steps instead.")
        if not isinstance(config, _PPOConfig):
            raise TypeError(f"config must come from hf_ppo.trl011.PPOConfig(...), got {type(config).__name__}.")
        if config.rollout_engine == "vllm":  # TRL 0.11's loop samples itself and hands step() its samples
            raise ValueError(STEP_VLLM_ERROR)
        super().__init__(model=model, args=config, processing_class=tokenizer, ref_model=ref_model,
                         optimizers=(optimizer, None))
        if optimizer is not None:
            trained = {id(p) for p in self.model.parameters() if p.requires_grad}
            given = {id(p) for group in optimizer.param_groups for p in group["params"]}
            if not given or not given <= trained:
                raise ValueError("optimizer= must hold the trainer's own trainable parameters (build it over "
                                 "ppo_trainer.model.parameters() after construction), else step() trains nothing.")
        self.config, self.tokenizer, self.dataset = config, self.processing_class, dataset
        self.dataloader = None if dataset is None else self._dataloader(dataset, data_collator)

    def _dataloader(self, dataset, data_collator) -> torch.utils.data.DataLoader:
        """TRL 0.11's `prepare_dataloader`: `rollout_batch_size` rows a batch, shuffled, incomplete batch dropped."""
        if getattr(self.config, "trl_remove_unused_columns", False) and hasattr(dataset, "remove_columns"):
            dataset = dataset.remove_columns([c for c in dataset.column_names if c not in KEPT_COLUMNS])
        generator = torch.Generator().manual_seed(self.args.seed)
        return torch.utils.data.DataLoader(dataset, batch_size=self.args.rollout_batch_size, collate_fn=data_collator,
                                           shuffle=True, drop_last=True, generator=generator)

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log=("query", "response")) -> None:
        """TRL 0.11's `log_stats`: nothing left to do, since `step()` already logged its statistics to `report_to`
        (TRL's table of query/response texts is not logged)."""

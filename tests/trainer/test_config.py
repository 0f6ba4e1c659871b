"""The settings records `PPOConfig` builds for the floors below the trainer: every field of every record comes from
`PPOConfig`, so a setting is named where it is declared (a PPOConfig field) and where it is used (a record field), and
a setting dropped on the way fails here rather than in a run.

Two configurations set every source field away from its default (a GAE one and a GRPO one, since some settings
exclude each other). A record field that equals its default under both follows no PPOConfig field (a constant, or a
setting dropped on its way); a record field named like a PPOConfig field must hold that field's value."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import TrainingArguments

from hf_ppo import PPOConfig

# Every record property of PPOConfig. A new record is added here, or the check below fails.
RECORDS = ["sampling_settings", "vllm_settings", "estimator_settings", "rollout_settings", "loss_settings",
           "eval_settings", "publish_settings", "reward_settings", "reward_loading", "critic_loading"]
# Record fields no configuration on this machine can move, and why.
FIXED_HERE = {"device": "the run's device (TrainingArguments.device): the CPU on a machine without a GPU",
              "process_index": "this process's rank: 0 in a test's one process",
              "world_size": "the number of processes: 1 in a test",
              "enable_sleep_mode": "vllm_enable_sleep_mode needs a GPU (refused on a CPU)"}

GAE = dict(response_length=17, temperature=0.9, local_rollout_forward_batch_size=3, top_k=5, top_p=0.9, min_p=0.05,
           rollout_engine="vllm", vllm_gpu_memory_utilization=0.5, vllm_max_model_len=300, vllm_dtype="float32",
           vllm_importance_sampling_cap=2.0,
           kl_coef=0.3, num_generations=2, gamma=0.99, lam=0.9, lam_critic=0.5,
           whiten_rewards=True, whiten_advantages=False, kl_estimator="k3", use_kl_loss=True,
           use_bias_correction_kl=True, missing_eos_penalty=1.0, overlong_buffer_length=4,
           overlong_penalty_factor=2.0, drop_uniform_groups=True, max_refill_rounds=1, logits_memory_mb=64,
           cliprange=0.3, cliprange_value=0.4, vf_coef=0.5, entropy_coef=0.01, loss_aggregation="seq_mean_token_mean",
           cliprange_low=0.1, cliprange_high=0.28, dual_clip=3.0, importance_sampling_level="sequence",
           num_eval_samples=2, seed=7, hub_base_model_id="org/base", model_init_kwargs={"revision": "main"},
           bf16=True, use_cpu=True, max_steps=5, reward_model_init_kwargs={"num_labels": 1}, reward_quantization="8bit",
           critic="separate", critic_model_init_kwargs={"revision": "main"}, critic_quantization="4bit",
           gradient_checkpointing=True, reward_input_format="pair", reward_weights=[0.5, 2.0],
           normalize_each_reward=True, system_prompt="Answer as #### <number>.", prompt_column="question",
           apply_chat_template_to_text=True, max_prompt_length=64, stop_token=None, stop_token_ids=[2, 3])
GRPO = dict(advantage_estimator="grpo", num_generations=4, scale_rewards=False, lam_critic=None, whiten_rewards=False,
            gamma=1.0,
            critic="shared", critic_model_init_kwargs=None, critic_quantization="none",
            # no KL and one optimizer step per rollout: the reference and old-log-prob passes are skipped
            kl_coef=0.0, use_kl_loss=False, use_bias_correction_kl=False, num_ppo_epochs=1)
# bf16's default follows the machine (None: on where a CUDA GPU supports it), so GAE sets it on and this one sets it
# off: the precision and the models' dtype move away from the default on a machine with a GPU as on one without.
VAPO = dict(lam_length_alpha=0.5, bf16=False)
# The policy losses' own parameters (issue 62), each under its loss; the rollout correction's mode and floor.
CISPO = dict(policy_loss="cispo", cispo_clip_max=4.0, kl_loss_estimator="k3+", rollout_engine="vllm",
             vllm_importance_sampling_cap=3.0, vllm_importance_sampling_mode="sequence_mask",
             vllm_importance_sampling_min=0.5)
SAPO = dict(policy_loss="sapo", sapo_temperature_pos=0.9, sapo_temperature_neg=1.2)
GMPO = dict(policy_loss="gmpo", gmpo_cliprange=0.3)
CLIP_COV = dict(policy_loss="clip_cov", clip_cov_ratio=1e-3, clip_cov_lb=0.5, clip_cov_ub=4.0)
KL_COV = dict(policy_loss="kl_cov", kl_cov_ratio=1e-3, kl_cov_coef=0.5)
MULTI = dict(advantage_estimator="grpo", num_generations=2, scale_rewards="batch",
             multi_objective_aggregation="normalize_then_sum")
AUTO = dict(advantage_estimator="auto", num_generations=2, auto_ev_threshold=0.2)  # EVPO's gate (issue 61)


def config(tmp_path, **fields) -> PPOConfig:
    return PPOConfig(output_dir=str(tmp_path / f"run{len(fields)}"), report_to=[], **fields)


def leaves(record, prefix: str = "") -> dict:
    """A record's fields by name, a nested record's as `outer.inner`."""
    values = record._asdict() if hasattr(record, "_asdict") else {
        f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    out = {}
    for name, value in values.items():
        if dataclasses.is_dataclass(value) or hasattr(value, "_asdict"):
            out.update(leaves(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def is_record(value) -> bool:
    return (dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen) or (
        isinstance(value, tuple) and hasattr(value, "_asdict"))


def test_every_record_property_is_listed(tmp_path):
    args = config(tmp_path)
    own = [klass for klass in PPOConfig.__mro__ if klass not in TrainingArguments.__mro__]  # SettingsRecords too
    found = sorted({name for klass in own for name, value in vars(klass).items()
                    if isinstance(value, property) and is_record(getattr(args, name))})
    assert found == sorted(RECORDS)


@pytest.mark.parametrize("record", RECORDS)
def test_every_record_field_comes_from_ppoconfig(record, tmp_path):
    default = config(tmp_path)
    custom = [config(tmp_path, **GAE), config(tmp_path, **{**GAE, **GRPO}),
              config(tmp_path, **VAPO),
              *(config(tmp_path, **losses) for losses in (CISPO, SAPO, GMPO, CLIP_COV, KL_COV, MULTI, AUTO))]
    base = leaves(getattr(default, record))
    changed = [leaves(getattr(c, record)) for c in custom]
    frozen = [name for name in base if all(c[name] == base[name] for c in changed) and name not in FIXED_HERE]
    assert not frozen, f"{record}: these fields never follow PPOConfig: {frozen}"
    for args, values in zip([default, *custom], [base, *changed]):
        for name, value in values.items():
            source = name.rsplit(".", 1)[-1]
            if source in {f.name for f in dataclasses.fields(PPOConfig)}:
                given = getattr(args, source)
                assert value == (tuple(given) if isinstance(value, tuple) else given), f"{record}.{name}"


def test_a_record_cannot_be_changed_on_its_way_down(tmp_path):
    settings = config(tmp_path).rollout_settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.memory_bytes = 1
    assert settings.with_kl_coef(0.5).estimator.kl_coef == 0.5 and settings.estimator.kl_coef == 0.05


def test_a_config_converted_from_training_arguments_has_no_placeholder_token(tmp_path):
    """Issue 60 item 10: TrainingArguments.to_dict() writes hub_token as '<HUB_TOKEN>' (set or not), and
    PPOConfig(**args.to_dict()), the conversion hf_ppo's own error advised, pushed with that as the token. It reads
    as None (the saved login); the conversion the error now gives keeps a real token."""
    from transformers import TrainingArguments

    from hf_ppo import PPOConfig

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], hub_token="hf_real")
    assert args.to_dict()["hub_token"] == "<HUB_TOKEN>"
    assert PPOConfig(**args.to_dict()).hub_token is None
    assert PPOConfig(**{**args.to_dict(), "hub_token": args.hub_token}).hub_token == "hf_real"


# ---- a setting changed on a built trainer's args: read live by every step, or refused (issue 60 item 1) -------------
# A valid new value for each live field (`LIVE` in its metadata): the step after the change must use it.
LIVE_VALUES = {"cliprange": 0.3, "cliprange_value": 0.35, "vf_coef": 0.4, "entropy_coef": 0.02,
               "use_bias_correction_kl": True}


def _other_value(value):
    """A value of another type than `value` (so never equal to it): a refused assignment fails before any check."""
    return ("changed",) if not isinstance(value, tuple) else "changed"


def test_every_setting_changed_after_construction_is_used_by_the_next_step_or_refused(tiny_models, tokenizer,
                                                                                         tmp_path, monkeypatch):
    """Every PPOConfig field (a field added later included: the loop reads the dataclass) is either live, and the
    next step's loss reads the new value, or refused on assignment and on `trainer.args = replace(...)`, naming a fix,
    with the trainer's value unchanged."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from hf_ppo import PPOLMTrainer
    from hf_ppo.trainer import ppo_trainer as ppo_trainer_module
    from hf_ppo.trainer.after_build import live_fields, settled_fields

    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_mini_batches=1, num_ppo_epochs=1,
                     max_steps=1, response_length=3, report_to=[], save_strategy="no", num_sample_generations=0,
                     disable_tqdm=True, use_kl_loss=True, use_cpu=True)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=lambda prompts, completions, **kw: [float(len(c)) for c in completions],
                           train_dataset=Dataset.from_dict({"prompt": ["the movie was", "the food was"]}))
    own = {f.name for f in dataclasses.fields(PPOConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(LIVE_VALUES) == live_fields(PPOConfig), "each live field needs a new value here"
    assert own <= live_fields(PPOConfig) | settled_fields(PPOConfig)
    for name in sorted(settled_fields(PPOConfig)):
        before = getattr(trainer.args, name)
        with pytest.raises(AttributeError, match=rf"trainer\.args\.{name} = .* is refused: .*To change it, "):
            setattr(trainer.args, name, _other_value(before))
        assert getattr(trainer.args, name) == before
        setattr(trainer.args, name, before)  # the same value again changes nothing: allowed
    for name, value in {"temperature": 0.3, "response_length": 5, "top_k": 2, "kl_coef": 0.5}.items():
        with pytest.raises(AttributeError, match=rf"trainer\.args\.{name} = {value!r} is refused"):
            trainer.args = dataclasses.replace(trainer.args, **{name: value})
    with pytest.raises(AttributeError, match=r"trainer\.kl_ctl\.value = 0\.5"):
        trainer.args.kl_coef = 0.5
    assert trainer.args is args and trainer.args.temperature == 0.7
    with pytest.raises(ValueError, match=r"trainer\.args\.vf_coef: vf_coef=-1\.0: must be >= 0"):
        trainer.args.vf_coef = -1.0
    assert trainer.args.vf_coef == 0.1

    for name, value in LIVE_VALUES.items():
        setattr(trainer.args, name, value)
    used = []
    real_loss = ppo_trainer_module.ppo_loss

    def spy(*call_args, **kwargs):
        used.extend(a for a in call_args if type(a).__name__ == "LossSettings")
        return real_loss(*call_args, **kwargs)

    monkeypatch.setattr(ppo_trainer_module, "ppo_loss", spy)
    trainer.train()
    assert used and all(getattr(settings, name) == value for settings in used for name, value in LIVE_VALUES.items())
    trainer.args = dataclasses.replace(trainer.args)  # a copy that changes nothing settled is taken, and held too
    with pytest.raises(AttributeError, match="is refused"):
        trainer.args.temperature = 0.3

"""`SettingsRecords`, the half of `PPOConfig` that reads its fields: the derived sizes and the frozen records that
lower floors take (sampling, estimator, loss, rewards, loading, publishing), each built from the fields of its name.
A mixin with no fields of its own: `PPOConfig` declares every field (`trainer/config.py`), so `dataclasses.fields`,
HfArgumentParser and the resume comparison see exactly those."""

from __future__ import annotations

from ..algorithms.estimators import ESTIMATORS, EstimatorSettings
from ..algorithms.ppo_math import LossSettings
from ..evaluation.evaluator import EvalSettings
from ..hub.cards import CARD_HYPERPARAMETERS, PublishSettings
from ..models.critics import CriticLoading
from ..models.pretrained import compute_dtype
from ..models.reward_model import RewardLoading
from ..rollout.engines import SAMPLING_FIELDS, SamplingSettings
from ..rollout.scoring import RewardSettings
from ..rollout.steps import RolloutSettings
from ..rollout.vllm_engine import VLLMSettings
from ..runtime.sharding import fsdp_version


class SettingsRecords:
    """The properties `PPOConfig` inherits: derived sizes and the settings records, read from its fields."""

    @property
    def minibatch_size(self) -> int:
        """Sequences per optimizer step on one device: per_device_train_batch_size * gradient_accumulation_steps."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def rollout_batch_size(self) -> int:
        """Responses sampled per PPO iteration on one device: minibatch_size * num_mini_batches (prompts when
        num_generations is 1; else rollout_batch_size / num_generations prompts, each sampled num_generations times)."""
        return self.minibatch_size * self.num_mini_batches

    # The records lower floors read: each setting named where it is declared and where it is used.
    @property
    def sampling_settings(self) -> SamplingSettings:
        """Step 1's settings (`rollout.SamplingSettings`), each from the field of its name (and the rows per pass)."""
        return SamplingSettings(**{name: getattr(self, name) for name in SAMPLING_FIELDS},
                                forward_batch_size=self.local_rollout_forward_batch_size,
                                rollout_engine=self.rollout_engine)

    @property
    def vllm_settings(self) -> VLLMSettings:
        """The vLLM engine's settings (`rollout.VLLMSettings`), its seed this process's."""
        length = self.vllm_max_model_len or (self.max_prompt_length and self.max_prompt_length + self.response_length)
        return VLLMSettings(gpu_memory_utilization=self.vllm_gpu_memory_utilization, max_model_len=length or None,
                            dtype=self.vllm_dtype, enable_sleep_mode=self.vllm_enable_sleep_mode, seed=self.seed,
                            process_index=self.process_index, world_size=self.world_size)

    @property
    def estimator_settings(self) -> EstimatorSettings:
        """Step 8's settings (`algorithms.EstimatorSettings`), with `kl_coef` the starting coefficient."""
        return EstimatorSettings(kl_coef=self.kl_coef, num_generations=self.num_generations, gamma=self.gamma,
                                 lam=self.lam, whiten_rewards=self.whiten_rewards,
                                 whiten_advantages=self.whiten_advantages, scale_rewards=self.scale_rewards,
                                 lam_critic=self.lam_critic, lam_length_alpha=self.lam_length_alpha,
                                 advantage_estimator=self.advantage_estimator, kl_estimator=self.kl_estimator,
                                 use_kl_loss=self.use_kl_loss, auto_ev_threshold=self.auto_ev_threshold)

    @property
    def rollout_settings(self) -> RolloutSettings:
        """Steps 1-9's settings (`rollout.RolloutSettings`)."""
        return RolloutSettings(sampling=self.sampling_settings, estimator=self.estimator_settings,
                               missing_eos_penalty=self.missing_eos_penalty,
                               overlong_buffer_length=self.overlong_buffer_length,
                               overlong_penalty_factor=self.overlong_penalty_factor,
                               drop_uniform_groups=self.drop_uniform_groups, max_refill_rounds=self.max_refill_rounds,
                               memory_bytes=self.logits_memory_bytes, skip_reference=self.skips_reference,
                               skip_old_logprobs=self.old_logprobs_from_update,
                               importance_sampling=self.vllm_importance_sampling_cap is not None)

    @property
    def loss_settings(self) -> LossSettings:
        """Step 11's settings (`algorithms.LossSettings`)."""
        return LossSettings(temperature=self.temperature, cliprange=self.cliprange,
                            cliprange_value=self.cliprange_value, vf_coef=self.vf_coef, entropy_coef=self.entropy_coef,
                            loss_aggregation=self.loss_aggregation, response_length=self.response_length,
                            cliprange_low=self.cliprange_low, cliprange_high=self.cliprange_high,
                            dual_clip=self.dual_clip, importance_sampling_level=self.importance_sampling_level,
                            use_bias_correction_kl=self.use_bias_correction_kl, memory_bytes=self.logits_memory_bytes,
                            importance_sampling_cap=self.vllm_importance_sampling_cap,
                            importance_sampling_mode=self.vllm_importance_sampling_mode,
                            importance_sampling_min=self.vllm_importance_sampling_min,
                            kl_loss_estimator=self.kl_loss_estimator, policy_loss=self.policy_loss,
                            cispo_clip_max=self.cispo_clip_max, sapo_temperature_pos=self.sapo_temperature_pos,
                            sapo_temperature_neg=self.sapo_temperature_neg, gmpo_cliprange=self.gmpo_cliprange,
                            clip_cov_ratio=self.clip_cov_ratio, clip_cov_lb=self.clip_cov_lb,
                            clip_cov_ub=self.clip_cov_ub, kl_cov_ratio=self.kl_cov_ratio, kl_cov_coef=self.kl_cov_coef,
                            old_logprobs_from_forward=self.old_logprobs_from_update)

    @property
    def skips_reference(self) -> bool:
        """No reference pass at a rollout (but every `stats_pass_every`-th): `kl_coef=0` with a fixed controller
        puts the KL in no reward and no loss term, so the reference's log-probs would be read by no update."""
        return self.kl_coef == 0 and not self.adaptive_kl

    @property
    def old_logprobs_from_update(self) -> bool:
        """No old-log-prob pass at a rollout (but every `stats_pass_every`-th): a critic-free estimator whose
        rollout feeds exactly one optimizer step, with no KL in the reward. The update's own forward is then at the
        rollout's weights, so its detached log-probs are the old ones (the first ratio exactly 1, as TRL's GRPO)."""
        estimator = ESTIMATORS.get(self.advantage_estimator)
        return (estimator is not None and not estimator.needs_critic and self.optimizer_steps_per_iteration == 1
                and self.skips_reference)

    @property
    def eval_settings(self) -> EvalSettings:
        """What evaluation reads (`evaluation.EvalSettings`)."""
        return EvalSettings(temperature=self.temperature, forward_batch_size=self.local_rollout_forward_batch_size,
                            output_dir=self.output_dir, num_eval_samples=self.num_eval_samples, seed=self.seed,
                            kl_estimator=self.kl_estimator, memory_bytes=self.logits_memory_bytes)

    @property
    def publish_settings(self) -> PublishSettings:
        """What the card and the run record say of the run (`hub.PublishSettings`): `stop_token_id` as the one id of
        `stop_token_ids` (the two are never both set), so the record names the ids that ended responses."""
        stop_ids = self.stop_token_ids if self.stop_token_id is None else [self.stop_token_id]
        return PublishSettings(hyperparameters=self.card_hyperparameters,
                               model_init_kwargs=self.model_init_kwargs if isinstance(self.model_init_kwargs, dict)
                               else None, hub_base_model_id=self.hub_base_model_id, precision=self.precision,
                               system_prompt=self.system_prompt, prompt_column=self.prompt_column,
                               apply_chat_template_to_text=self.apply_chat_template_to_text, stop_token=self.stop_token,
                               sampling=self.sampling_settings, max_prompt_length=self.max_prompt_length,
                               stop_token_ids=stop_ids if stop_ids is None else tuple(stop_ids),
                               reward_input_format=self.reward_input_format)

    @property
    def precision(self) -> str:
        """The compute dtype the run loads its models in: 'bf16', 'fp16' or 'fp32' (`bf16` / `fp16`)."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def card_hyperparameters(self) -> dict:
        """The values the model card lists (`hub.cards.CARD_HYPERPARAMETERS`), plus the per-device rollout batch and
        the world size. Only the run length that took effect: `max_steps` when set (Trainer then ignores
        `num_train_epochs`), else `num_train_epochs` (`max_steps` is then -1, unused)."""
        unused = "num_train_epochs" if self.max_steps > 0 else "max_steps"
        values = {name: getattr(self, name) for name in CARD_HYPERPARAMETERS if name != unused}
        values["rollout_batch_size (per device)"] = self.rollout_batch_size
        values["world_size"] = self.world_size
        return values

    @property
    def fsdp_version(self) -> int | None:
        """The FSDP version this run asks for (`runtime.sharding.fsdp_version`); None without FSDP."""
        return fsdp_version(self.fsdp, self.fsdp_config)

    @property
    def logits_memory_bytes(self) -> int:
        return int(self.logits_memory_mb * 2**20)

    @property
    def optimizer_steps_per_iteration(self) -> int:
        """Optimizer steps per PPO iteration: num_ppo_epochs * critic_updates_per_step * num_mini_batches."""
        return self.num_ppo_epochs * self.critic_updates_per_step * self.num_mini_batches

    @property
    def schedule_settings(self) -> dict:
        """The fields `rollout.MinibatchSchedule.shuffled` reads (the update order of one rollout)."""
        return dict(num_ppo_epochs=self.num_ppo_epochs, num_mini_batches=self.num_mini_batches,
                    gradient_accumulation_steps=self.gradient_accumulation_steps,
                    loss_aggregation=self.loss_aggregation, critic_passes=self.critic_updates_per_step)

    @property
    def reward_loading(self) -> RewardLoading:
        """How the reward model(s) and the judges load (`models.RewardLoading`): their init kwargs and quantization,
        in the run's compute dtype, on its device."""
        return RewardLoading(reward_model_init_kwargs=self.reward_model_init_kwargs,
                             reward_quantization=self.reward_quantization,
                             dtype=compute_dtype(self.bf16, self.fp16), device=self.device)

    @property
    def critic_loading(self) -> CriticLoading:
        """How the critic loads (`models.CriticLoading`): which critic, its init kwargs and quantization (the reward
        model's init kwargs when it starts from the reward model), in the run's compute dtype, on its device."""
        return CriticLoading(critic=self.critic, critic_model_init_kwargs=self.critic_model_init_kwargs,
                             critic_quantization=self.critic_quantization,
                             reward_model_init_kwargs=self.reward_model_init_kwargs,
                             gradient_checkpointing=self.gradient_checkpointing,
                             dtype=compute_dtype(self.bf16, self.fp16), device=self.device)

    @property
    def reward_settings(self) -> RewardSettings:
        """How the rewards are read and combined (`rollout.RewardSettings`)."""
        weights = None if self.reward_weights is None else tuple(self.reward_weights)
        return RewardSettings(reward_input_format=self.reward_input_format, reward_weights=weights,
                              normalize_each_reward=self.normalize_each_reward,
                              multi_objective_aggregation=self.multi_objective_aggregation,
                              num_generations=self.num_generations)

"""`PPOLMTrainer`: clipped-PPO RLHF as a thin `transformers.Trainer` subclass.

Trainer keeps its loop, optimizer, LR schedule, accumulation, clipping, mixed precision, callbacks, logging,
checkpoint rotation and hub plumbing. PPO plugs into its seams (steps numbered as in `rollout/steps.py` and the docs):
the sampler repeats each rollout batch once per micro-batch of the iteration, so Trainer's step counting is right;
`_prepare_inputs` runs steps 1-9 (`rollout.steps.rollout`) and 10 (the KL controller) on an iteration's first micro-batch,
then hands out shuffled micro-batches for `num_ppo_epochs` epochs; `compute_loss` is step 11 (`algorithms.ppo_math.ppo_loss`,
normalised by the whole minibatch so accumulation is exact); `log` adds the PPO metrics; saving and publishing write
the policy alone (`hub/`), checkpoints add the critic and the PPO state (`trainer/checkpoint.py`); `train()` is
Trainer's, wrapped only to hold `output_dir` while it runs (`trainer/run_lock.py`: one run per output folder).
"""

from __future__ import annotations

import functools
import os
import time
from collections import defaultdict

import torch
from accelerate.utils import broadcast_object_list
from transformers import Trainer, set_seed
from transformers.trainer_callback import ProgressCallback

from ..algorithms.estimators import kl_loss_coef
from ..algorithms.ppo_math import AdaptiveKLController, FixedKLController, RunningMoments, ppo_loss
from ..evaluation.evaluator import Evaluator
from ..hub import cards, publish
from ..rollout import scoring
from ..rollout.batch import RolloutBatch
from ..rollout.engine_choice import make_rollout_engine
from ..rollout.engines import WeightsChangedCallback, sequence_inputs
from ..rollout.environments import check_environment
from ..rollout.refill import rollout_with_refill
from ..rollout.reward_calls import RewardLogs
from ..rollout.steps import RolloutParts
from ..runtime import sharding
from . import assembly, checkpoint, run_lock, watch
from .config import PPOConfig
from .data import (PromptCollator, RefillPrompts, RolloutPrompts, RolloutRepeatSampler, check_prompt_columns,
                   prepare_datasets)
from .guard import NonFiniteGuard, check_finite_weights, nonfinite_problem, score_hint
from .progress import PPOProgressCallback, maybe_log_samples, showing_sampling
from .schedule import MinibatchSchedule
from .step_api import StepAPI


class PPOLMTrainer(StepAPI, Trainer):
    """PPO for causal LMs with a value head, on `transformers.Trainer`.

    Args:
        model: id/path, `PreTrainedModel`, `PeftModel`, `AutoModelForCausalLMWithValueHead` (None: args.sft_model_path).
        args: a `PPOConfig`.
        processing_class: the policy's tokenizer (loaded with the model when `model` is an id/path and this is None).
        reward_model: Hub id / path / `AutoModelForSequenceClassification` with num_labels=1 / callable
            `(prompts: list[str], completions: list[str]) -> list[float]`, or a list of them (mixed rewards,
            weighted by `reward_weights`).
        ref_model: None (the policy with its LoRA adapter disabled; without LoRA, a frozen copy of the starting
            policy), or an id / path / model.
        train_dataset / eval_dataset: `datasets.Dataset` with a "prompt" (text) or "messages" (chat) column, or
            pre-tokenized "input_ids" (and optionally "attention_mask"), TRL 1.12's format.
        peft_config: a peft `LoraConfig` (None: full fine-tuning).
        reward_processing_class: the reward model's tokenizer when the reward model is passed as an object and its
            tokenizer differs from the policy's (loaded automatically when `reward_model` is an id/path).
        critic_model: with `critic='separate'`, an id / path / model to start the critic from instead of the reward
            model (needed with a reward callable); with any critic, a `save_critic` folder / `push_critic_to_hub` repo.
        environment: an `environment.Environment`: multi-turn / tool-use episodes replace steps 1-3 of training.
        eval_reward_model: judges that only evaluation reads (`evaluation/`), in the forms of `reward_model`.
    """

    # compute_loss already divides by the minibatch's token (or sequence) count, so Trainer must not divide again.
    loss_is_scaled_for_ga = True

    # Accelerator sets ACCELERATE_USE_FSDP before Trainer refuses FSDP on one process: a refused trainer leaves none.
    @sharding.environment_restored_on_error
    def __init__(
        self,
        model=None,
        args: PPOConfig | None = None,
        processing_class=None,
        reward_model=None, ref_model=None,
        train_dataset=None, eval_dataset=None,
        peft_config=None, reward_processing_class=None,
        critic_model=None, environment=None, eval_reward_model=None,
        value_model=None,  # TRL 1.12's name for a critic model of its own: critic="separate" from it
        callbacks=None, optimizers=(None, None),
    ):
        args = args if args is not None else PPOConfig(output_dir="ppo_output")
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a PPOConfig, got {type(args).__name__}: PPOConfig(**args.to_dict()) converts it.")
        if args.process_index == 0:  # a live run holds output_dir: refused now, before any model loads
            problem = run_lock.in_use_message(args.output_dir)
            if problem is not None:
                raise run_lock.OutputDirInUseError(problem)
        # Seed before any model is built: LoRA and value-head initialisation must follow `seed` too.
        set_seed(args.seed)
        model, reward_model, critic_model = assembly.trl_inputs(model, reward_model, value_model, critic_model, args)
        self.environment, reward_model = check_environment(environment, reward_model, train_dataset)
        check_prompt_columns(args, train_dataset=train_dataset, eval_dataset=eval_dataset)  # before any model loads
        loaded = assembly.load_models(model, processing_class, reward_model, ref_model, reward_processing_class,
                                     peft_config, args, args.device, critic_model)
        policy, tokenizer, self.ref_model, self.reward_model = (loaded.policy, loaded.tokenizer, loaded.ref_model,
                                                                loaded.reward_model)
        self.stop_token_ids, self.trained_adapter, self.ref_adapter = (loaded.stop_token_ids, loaded.trained_adapter,
                                                                       loaded.ref_adapter)
        self._model_sources = cards.model_sources(model, reward_model, ref_model, policy.policy_model,
                                                self.trained_adapter, self.ref_adapter, peft_config is not None)

        # Data: validated and tokenized here, so bad prompts fail before training starts.
        train_dataset, eval_dataset, chat = prepare_datasets(train_dataset, eval_dataset, tokenizer, args,
                                                             assembly.max_positions(policy.config))
        evaluated = {"eval_dataset": eval_dataset} if eval_dataset is not None else None  # probed too, now
        self.rewards = scoring.reward_set(loaded, reward_model, tokenizer, args.reward_settings, chat,  # step 3
                                          train_dataset, evaluated)
        self.reward_tokenizer = self.rewards.tokenizer
        self._chat_prompts = True in chat  # the model card's example prompts as training did
        self.evaluator = Evaluator(scoring.judge_set(eval_reward_model, tokenizer, args.reward_settings,
                                                     args.reward_loading, chat, train_dataset,
                                                     loaded.reward_scoring_context, evaluated))

        super().__init__(
            model=policy, args=args, data_collator=PromptCollator(tokenizer.pad_token_id),
            train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer,
            callbacks=watch.add_watch(callbacks, args, self._last_complete_checkpoint), optimizers=optimizers,
        )
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(PPOProgressCallback(self.args))

        # The engine `rollout_engine` names (vLLM's holds a copy of the policy); another one is a `RolloutEngine`
        # assigned here.
        self.rollout_engine = make_rollout_engine(args.sampling_settings, tokenizer.pad_token_id, self.stop_token_ids,
                                                  policy=policy.policy_model, trained_adapter=self.trained_adapter,
                                                  vllm=args.vllm_settings)
        self.add_callback(WeightsChangedCallback(self))
        self.kl_ctl = (AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon) if args.adaptive_kl
                       else FixedKLController(args.kl_coef))
        self.reward_moments = RunningMoments() if args.normalize_rewards else None
        self.iteration = 0  # rollouts done so far (restored on resume)
        self._micro_step = None  # position in the current iteration; derived from global_step on first use
        self._schedule: MinibatchSchedule | None = None  # the current iteration's rollout and update order
        self._guard = NonFiniteGuard(args.max_consecutive_nonfinite, score_hint(args))
        self._no_signal = watch.NoSignal(args)  # warns once when every sample got the same reward
        self._step_loss_finite: torch.Tensor | None = None  # all micro-batch losses of this optimizer step finite
        self._metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._reward_logs = RewardLogs()  # what reward functions log (TRL's log_metric / log_extra)
        self._train_phase_start = None

    # ---- data: one rollout batch per iteration, repeated for every micro-batch ---------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        repeat = self.args.optimizer_steps_per_iteration * self.args.gradient_accumulation_steps
        return RolloutRepeatSampler(len(dataset), self.args.rollout_batch_size * self.args.world_size, repeat,
                                    self.args.seed, self.args.num_generations)

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("PPOLMTrainer: training requires a train_dataset of prompts.")
        # Read once per iteration, not once per micro-batch (`RolloutPrompts`).
        return self._get_dataloader(dataset=RolloutPrompts(self.train_dataset), description="Training",
                                    batch_size=self.args.rollout_batch_size, sampler_fn=self._get_train_sampler,
                                    is_training=True)

    def _prepare_inputs(self, inputs: dict) -> dict:
        if not self.model.training or "batch" in inputs:  # evaluation, or a micro-batch of `step` (trainer/step_api.py)
            return super()._prepare_inputs(inputs)
        steps_per_iteration = self.args.optimizer_steps_per_iteration * self.args.gradient_accumulation_steps
        if self._micro_step is None:
            self._micro_step = self.state.global_step * self.args.gradient_accumulation_steps
            if self.state.global_step == 0 and self.args.world_size > 1:
                # Every rank was seeded with `seed`: sampling noise must differ per rank. (A resume restores each
                # rank's own RNG state from the checkpoint instead.)
                set_seed(self.args.seed + self.args.process_index)
        position = self._micro_step % steps_per_iteration
        if position == 0 or self._schedule is None or self._schedule.done:
            prompts = super()._prepare_inputs(inputs)
            batch = self._rollout(prompts)
            while batch is None:  # a non-finite rollout was dropped: sample again (the guard stops after too many)
                batch = self._rollout(prompts)
            self._schedule = MinibatchSchedule.shuffled(batch, **self.args.schedule_settings)
            # Resumed part-way through an iteration without its rollout (settings changed on resume): a fresh
            # rollout serves only the micro-batches still to do.
            self._schedule.position = position
        self._micro_step += 1
        return self._schedule.next()

    def create_optimizer(self, model=None):
        """Trainer's optimizer, with the critic (if any) in a group of its own when `critic_learning_rate` is set."""
        optimizer = super().create_optimizer(model)
        head = self.accelerator.unwrap_model(self.model).critic_parameters()
        if self.args.critic_learning_rate is None or not head:
            return optimizer
        ids = {id(p) for p in head}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        optimizer.add_param_group({"params": head, "lr": self.args.critic_learning_rate, "weight_decay": 0.0})
        return optimizer

    # ---- rollout: steps 1-10 --------------------------------------------------------------------------------------
    @torch.no_grad()
    def _rollout(self, inputs: dict) -> RolloutBatch | None:
        """Steps 1-9 (`rollout.rollout_with_refill`), then the NaN guard, metrics, step 10; None if it was dropped."""
        args, tokenizer = self.args, self.processing_class
        model = self.accelerator.unwrap_model(self.model)
        if self._train_phase_start is not None:
            self._record({"time/train": time.perf_counter() - self._train_phase_start})
        # eval() for sampling only where it changes something: active dropout, or checkpointing (which turns the
        # KV cache off in training mode); each toggle walks every module.
        toggle = model.training and (args.gradient_checkpointing or not args.disable_dropout)
        if toggle:
            model.eval()
        moments = self.reward_moments.state_dict() if self.reward_moments is not None else None
        each_moments = self.rewards.state_dict()
        self._reward_logs.take_extra()  # a dropped rollout's or an evaluation's log_extra columns are not this one's
        settings = args.rollout_settings.with_kl_coef(self.kl_ctl.value)
        if "response_length" in inputs:  # step(): its longest response
            settings = settings.with_response_length(inputs["response_length"])
        parts = self.rollout_parts(inputs.get("environment", self.environment))
        # Under the run's mixed precision (accelerate's autocast, as the prepared policy's own forward): the reference,
        # the reward model and the sampling then compute as the policy does, so that at step 0 the policy is its
        # reference bit for bit (KL 0) on a GPU's bf16 too, not only the policy's pass.
        with showing_sampling(self.callback_handler.callbacks, self.state, "rollout"), self.accelerator.autocast():
            result = rollout_with_refill(
                model, inputs["queries"], inputs["query_mask"], inputs["prompts"], parts, settings,
                columns=inputs.get("columns"),  # the dataset's other columns, for the reward functions
                extra_prompts=RefillPrompts(self.train_dataset, self.data_collator, args, self.state.global_step))
        if toggle:
            model.train()
        batch = result.batch
        self._guard.check_scale(batch.scores, result.reward_scores)
        # NaN/inf anywhere: drop the rollout before it moves the reward statistics, the KL controller or a weight
        # (decided over all processes, so they all sample again together).
        problem = nonfinite_problem(batch, self.accelerator, args.world_size, result.reward_scores)
        if problem:
            self.rewards.load_state_dict(each_moments)
            if moments is not None:
                self.reward_moments.load_state_dict(moments)
            self._train_phase_start = None
            self._guard.dropped_rollout(problem, self._last_complete_checkpoint)
            return None

        # Metrics, averaged over processes (so every rank's KL controller sees the same KL).
        stats = self.accelerator.reduce(torch.stack(list(result.stats.values())), reduction="mean")
        self._record(dict(zip(result.stats, stats)))
        # The collapse watch reads every rollout, however rarely the run logs (trainer/watch.py).
        watch.observe_rollout(self.callback_handler.callbacks,
                              {**dict(zip(result.stats, stats.tolist())), "iteration": self.iteration + 1})
        self._record(self._reward_logs.take_metrics())  # the reward functions' own (log_metric), as TRL names them
        self._guard.unscored_rows(result.unscored, self.accelerator, args.world_size)
        generated_tokens = result.generated_tokens * args.world_size
        self._record({"objective/kl_coef": self.kl_ctl.value, "time/generate": result.generate_seconds,
                      "time/score": result.score_seconds, "time/policy_forward": result.policy_forward_seconds,
                      "time/reference": result.reference_seconds,
                      "rollout/tokens_per_second": generated_tokens / max(result.generate_seconds, 1e-9)})
        # 10. The KL controller moves after each rollout, by the number of episodes it saw.
        self.kl_ctl.update(stats[0].item(), len(batch) * args.world_size)
        self.iteration += 1
        if self.is_world_process_zero():
            self._no_signal.check(result.uniform, self.iteration, len(batch) * args.world_size)
            maybe_log_samples(tokenizer, batch, self.iteration, self.state.global_step, self.state.max_steps, args,
                              inputs["prompts"], self._reward_logs.take_extra())
        self._reward_logs.take_extra()  # the columns reward functions logged (log_extra): this rollout's alone
        self._train_phase_start = time.perf_counter()
        return batch

    # ---- loss: step 11 --------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, batch = self.args, inputs["batch"]
        # The critic warm-up: the policy runs without gradients, so its weights stay exactly as they are.
        out = model(**sequence_inputs(batch.queries, batch.query_mask, batch.responses, batch.response_mask),
                    logits_to_keep=batch.responses.shape[1] + 1,
                    critic_only=inputs.get("critic_only") or self.state.global_step < args.critic_warmup_steps)
        loss, stats = ppo_loss(out.logits[:, :-1], out.value if out.value is None else out.value[:, :-1], batch,
                               inputs["normalizer"], args.loss_settings,
                               kl_loss_coef(args.estimator_settings._replace(kl_coef=self.kl_ctl.value)))
        finite = torch.isfinite(loss.detach())
        self._step_loss_finite = finite if self._step_loss_finite is None else self._step_loss_finite & finite
        self._record(stats)
        return (loss, out) if return_outputs else loss

    def rollout_parts(self, environment=None) -> RolloutParts:
        """What steps 1-7 sample, score and compare with (`rollout.RolloutParts`), read from the trainer at each
        rollout: an engine assigned after construction is the one used."""
        return RolloutParts(self.rollout_engine, self.rewards, self.processing_class, self.stop_token_ids,
                            ref_model=self.ref_model, ref_adapter=self.ref_adapter, environment=environment,
                            gather=self.accelerator.gather, shape_scores=functools.partial(
                                scoring.shape_scores, reward_moments=self.reward_moments,
                                reward_clip=self.args.reward_clip, gather=self.accelerator.gather),
                            hooks=self._reward_logs.hooks(self.state))

    def _get_grad_norm(self, model, grad_norm=None):
        """Trainer's gradient norm, right before `optimizer.step()`: a non-finite loss or norm skips the step (its
        gradients dropped, so the optimizer leaves every parameter, moment and decay untouched; `guard.check_step`)."""
        grad_norm = super()._get_grad_norm(model, grad_norm)
        loss_finite, self._step_loss_finite = self._step_loss_finite, None
        if loss_finite is not None and self.args.world_size > 1:
            loss_finite = self.accelerator.reduce(loss_finite.float(), reduction="sum") == self.args.world_size
        scaler = self.accelerator.scaler is not None
        if not self._guard.check_step(loss_finite, grad_norm, scaler, self.state.global_step + 1,
                                      self._last_complete_checkpoint) and not scaler:
            model.zero_grad(set_to_none=True)
        return grad_norm

    def _last_complete_checkpoint(self) -> str | None:
        return checkpoint.last_complete(self.args.output_dir)

    # ---- logging --------------------------------------------------------------------------------------------------
    def _record(self, metrics: dict) -> None:
        for key, value in metrics.items():
            self._metrics[key].append(value.detach().float() if torch.is_tensor(value) else torch.tensor(float(value)))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model is not None and self.model.training and self._metrics:
            for key, values in self._metrics.items():
                logs[key] = torch.stack([v.cpu() for v in values]).mean().item()
            logs["episode"] = self.iteration * self.args.rollout_batch_size * self.args.world_size
            logs["iteration"] = self.iteration
            logs.update(self._guard.log_values())
            if "learning_rate" in logs:
                logs["lr"] = logs["learning_rate"]
            self._metrics.clear()
        super().log(logs, start_time)

    # ---- evaluation: the policy against its reference (evaluation/; eval_loss = -mean training score) -------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        with showing_sampling(self.callback_handler.callbacks, self.state, "evaluation"), self.accelerator.autocast():
            loss = self.evaluator.step(self, super()._prepare_inputs(inputs), self.args.eval_settings)
        return loss.detach(), None, None

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self._record(self._reward_logs.take_metrics())  # training's, logged with training's metrics
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        output.metrics.update(self.evaluator.finish(self, self.args.eval_settings, metric_key_prefix))
        output.metrics.update({f"{metric_key_prefix}_{k}": v for k, v in self._reward_logs.take_metrics().items()})
        return output

    # ---- saving: the policy alone; checkpoints add the value head and PPO state ------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        wrapper = self.accelerator.unwrap_model(self.model)  # under FSDP, `state_dict` holds the gathered policy
        check_finite_weights(wrapper, output_dir, self._last_complete_checkpoint())
        # How the run loaded each model, beside the policy: hf-ppo evaluate reads it.
        record = publish.run_record(self.args.publish_settings, self._model_sources, wrapper.policy_model, self.ref_model,
                                    self.ref_adapter, self.reward_model, chat_prompts=self._chat_prompts,
                                    global_step=self.state.global_step)
        publish.save_policy_folder(wrapper.policy_model, output_dir, self.trained_adapter, self.processing_class,
                                   state_dict, record)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy (see `_save`); called by the user, also write its model card (the Hub card's template) and
        print once, on the main process, the folder, how to load the policy (adapter or merged) and how to push it."""
        if self.is_fsdp_enabled:  # Trainer saves no policy from a sharded model: rank 0 writes the gathered weights
            with sharding.gathered_policy(self.model) as state_dict:
                self._save(output_dir, state_dict)
        else:
            super().save_model(output_dir, _internal_call)
        if _internal_call or not self.args.should_save:
            return
        folder = output_dir if output_dir is not None else self.args.output_dir
        is_adapter = self._write_card(folder, os.path.basename(os.path.abspath(folder)), merged=False, dataset_names=[],
                                      saved_locally=True)
        if self.is_world_process_zero():
            print(publish.saved_policy_message(folder, is_adapter))

    def _save_checkpoint(self, model, trial) -> None:
        """The PPO state first, then Trainer's files: Trainer writes trainer_state.json last and rotates only after
        it, so a folder with a readable trainer_state.json is complete (see trainer/checkpoint.py)."""
        if watch.stopped_by_collapse(self.callback_handler.callbacks):  # save_strategy='best' decides after on_log
            return
        run_dir = self._get_output_dir(trial=trial)
        folder = checkpoint.checkpoint_folder(run_dir, self.state.global_step)
        # A write that fails (a full disk) is one error naming the folder, its disk and the last complete checkpoint.
        written = functools.partial(checkpoint.write_failures_named, folder, run_dir)
        with written(), sharding.gathered(self.model):  # On every process, so all of them stop together.
            check_finite_weights(self.accelerator.unwrap_model(self.model), folder, self._last_complete_checkpoint())
            if self.args.should_save:
                wrapper = self.accelerator.unwrap_model(self.model)
                schedule = self._schedule if self._schedule is not None and not self._schedule.done else None
                checkpoint.save_trainer_state(
                    folder, args=self.args, iteration=self.iteration, kl_controller=self.kl_ctl,
                    reward_moments=self.reward_moments, guard=self._guard, peft=wrapper.is_peft_model,
                    metrics=self._metrics, critic_state=wrapper.critic_state_dict(), rewards=self.rewards,
                    rollout_buffer=schedule.state_dict() if schedule is not None else None)
        with written():
            super()._save_checkpoint(model, trial)

    # ---- one run per output_dir: train() holds the folder (trainer/run_lock.py) ----------------------------------------
    def train(self, *args, **kwargs):
        """Trainer's `train()`, holding `output_dir` for its whole length (`run_lock.holding`): a second run into the
        same folder is refused, naming the process that holds it; a lock left by a dead process is taken over with a
        note; the lock goes at the end, also on error. The main process takes it, the others learn its outcome."""
        with run_lock.holding(self.args.output_dir, self.is_world_process_zero(), self._as_on_main_process):
            return super().train(*args, **kwargs)

    def _as_on_main_process(self, value):
        """`value` as the main process holds it, on every process (accelerate's `broadcast_object_list`)."""
        return value if self.args.world_size == 1 else broadcast_object_list([value], from_process=0)[0]

    def _hp_search_setup(self, trial) -> None:
        """The first call in `train()`, before it resolves `resume_from_checkpoint=True`: a rotation that would delete
        others' checkpoints is refused; incomplete ones above the last complete one are moved aside (`prepare_run_dir`)."""
        super()._hp_search_setup(trial)
        if self.args.should_save:
            checkpoint.prepare_run_dir(self.args.output_dir, self.args.save_total_limit)
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        wrapper = self.accelerator.unwrap_model(model if model is not None else self.model)
        saved = checkpoint.load_ppo_state(resume_from_checkpoint, self.args, wrapper.critic_device, self.rewards)
        self._critic_changed = False  # a critic changed on resume: the saved optimizer state fits no longer
        if self.is_fsdp_enabled:  # its sharded checkpoint holds the whole actor-critic, one shard per rank
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        else:
            self._critic_changed = checkpoint.load_actor_critic(wrapper, resume_from_checkpoint, saved,
                                                                wrapper.critic_device, self.trained_adapter)
        self.rollout_engine.weights_changed()
        self.iteration = checkpoint.restore_trainer_state(saved, kl_controller=self.kl_ctl,
                                                          reward_moments=self.reward_moments, guard=self._guard,
                                                          metrics=self._metrics, rewards=self.rewards)
        self._micro_step = None
        self._schedule = checkpoint.resumed_schedule(saved, resume_from_checkpoint, self.args)

    def _load_optimizer_and_scheduler(self, *args, **kwargs) -> None:
        """Trainer's, unless the critic changed on resume (`checkpoint.critic_changed_on_resume` warned): the
        optimizer's parameters changed with it, so both start afresh."""
        if not getattr(self, "_critic_changed", False):
            super()._load_optimizer_and_scheduler(*args, **kwargs)

    # ---- publishing: the policy alone, with its model card ----------------------------------------------------------
    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Resolve the repo id at construction (a clear error now, not after training); the push creates it."""
        token = token if token is not None else self.args.hub_token
        self.hub_model_id = publish.resolve_repo_id(self.args.hub_model_id, self.args.output_dir, token)
        self.push_in_progress = None

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Checkpoints hold optimizer and value-head state, which never go to the Hub: only `push_to_hub` pushes."""

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    create_pr: bool = False, dataset_name: str | list[str] | None = None, **kwargs):
        """Save the policy to `output_dir`, render its model card and upload only the policy files.

        The LoRA adapter (or full weights) + tokenizer + card + training-curve plot; with `push_merged_model`, the
        adapter merged into a full-precision base instead (in `output_dir/merged`). Never the critic (it goes to
        `critic_hub_model_id`, its own repo, when set), reference, reward model, optimizer state or training_args.bin.
        A failed push raises `HubPushError`, leaves the local output intact, and is retried by `push_to_hub()`.
        """
        args = self.args
        token = token if token is not None else args.hub_token
        repo_id = self.hub_model_id or publish.resolve_repo_id(args.hub_model_id, args.output_dir, token)
        self.save_model(args.output_dir, _internal_call=True)
        folder = os.path.join(args.output_dir, "merged") if args.push_merged_model else args.output_dir
        if args.push_merged_model and not self.accelerator.unwrap_model(self.model).is_peft_model:
            self.save_model(folder, _internal_call=True)
        elif args.push_merged_model and args.should_save:  # the adapter merged into a full-precision base
            publish.save_merged_policy(args.output_dir, self._model_sources["model"], folder, self.processing_class,
                                   args.model_init_kwargs)
        if not self.is_world_process_zero():
            return None
        names = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or [])
        self._write_card(folder, repo_id, merged=args.push_merged_model, dataset_names=names)
        publish.push_run_critic(self.accelerator.unwrap_model(self.model), self.processing_class,
                                args.critic_hub_model_id, repo_id, private=args.hub_private_repo, token=token)
        return publish.push_policy_folder(folder, repo_id, token=token,
                                      private=private if private is not None else args.hub_private_repo,
                                      revision=revision if revision is not None else args.hub_revision,
                                      create_pr=create_pr, commit_message=commit_message or "Upload PPO policy")

    def push_critic_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | None = None,
                           commit_message: str = "Upload hf_ppo critic"):
        """Push the critic, as `model.save_critic` writes it, with a card, to the Hub repo `repo_id` (a repo of its
        own, never the policy's): a later run starts from it with `PPOLMTrainer(critic_model=repo_id)`
        (`hf_ppo.hub.push_critic`). `private` None: the run's `hub_private_repo`, as for the policy. Returns the
        commit info (None on processes other than the main one)."""
        if not self.is_world_process_zero():
            return None
        private = private if private is not None else self.args.hub_private_repo
        return publish.push_critic(self.accelerator.unwrap_model(self.model), repo_id, self.processing_class,
                                   private=private, token=token if token is not None else self.args.hub_token,
                                   commit_message=commit_message)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | list[str] | None = None,
                          **unsupported) -> None:
        """TRL's call: write the model card of the policy `save_model()` saved in `output_dir` again, naming the
        datasets it was trained on (`dataset_name`: Hub ids are linked, a local file is named 'a local dataset';
        `save_model()` alone knows none). `model_name`: the card's title (default: the folder's name). Trainer's
        other card arguments (`license`, `tags`, ...) are refused, not dropped: the card has no place for them."""
        if unsupported:
            raise TypeError(f"create_model_card({', '.join(sorted(unsupported))}=...): hf_ppo's policy card takes "
                            "model_name and dataset_name only (TRL's call); edit README.md after it is written for more.")
        folder = self.args.output_dir
        names = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or [])
        if self.args.should_save:
            self._write_card(folder, model_name or os.path.basename(os.path.abspath(folder)), merged=False,
                             dataset_names=names, saved_locally=True)

    def _write_card(self, folder: str, repo_id: str, merged: bool, dataset_names: list[str],
                    saved_locally: bool = False) -> bool:
        """Render the policy's model card (and its plot) into `folder`; return whether the policy is an adapter."""
        policy = self.accelerator.unwrap_model(self.model).policy_model
        peft_config = policy.peft_config[self.trained_adapter].to_dict() if self.trained_adapter else None
        return cards.write_policy_card(folder, peft_config, self._model_sources, self.args.publish_settings,
                                     self.state.log_history,
                                     repo_id=repo_id, merged=merged, dataset_names=dataset_names,
                                     saved_locally=saved_locally, chat_prompts=self._chat_prompts)

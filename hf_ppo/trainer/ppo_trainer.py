"""`PPOLMTrainer`: clipped-PPO RLHF as a thin `transformers.Trainer` subclass.

Trainer keeps its loop, optimizer, LR schedule, accumulation, clipping, mixed precision, callbacks, logging,
checkpoint rotation and hub plumbing. PPO plugs into its seams (steps numbered as in `rollout/steps.py` and the docs):
the sampler repeats each rollout batch once per micro-batch of the iteration, so Trainer's step counting is right;
`_prepare_inputs` runs steps 1-9 (`rollout.steps.rollout`) and 10 (the KL controller) on an iteration's first micro-batch,
then hands out shuffled micro-batches for `num_ppo_epochs` epochs; `compute_loss` is step 11 (`algorithms.ppo_math.ppo_loss`,
normalised by the whole minibatch so accumulation is exact); `log` adds the PPO metrics; saving and publishing write
the policy alone (`SavingSeams`, `trainer/saving.py`), checkpoints add the critic and the PPO state
(`trainer/checkpoint.py`); `step()` is TRL 0.11's (`StepAPI`, `trainer/step_api.py`); `train()` is
Trainer's, wrapped only to hold `output_dir` while it runs (`trainer/run_lock.py`: one run per output folder).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

import torch
from accelerate.utils import broadcast_object_list
from transformers import Trainer, set_seed
from transformers.trainer_callback import ProgressCallback

from ..algorithms.estimators import kl_loss_coef
from ..algorithms.ppo_math import AdaptiveKLController, FixedKLController, RunningMoments, ppo_loss
from ..evaluation.evaluator import Evaluator
from ..hub import cards
from ..rollout import scoring
from ..rollout.batch import RolloutBatch
from ..rollout.engine_choice import make_rollout_engine
from ..rollout.engines import WeightsChangedCallback, predicting_inputs
from ..rollout.environments import check_environment
from ..rollout.refill import rollout_with_refill
from ..rollout.reward_calls import RewardLogs
from ..rollout.steps import RolloutParts
from ..runtime import sharding
from . import after_build, assembly, checkpoint, run_lock, watch
from .after_build import HeldArgs
from .config import PPOConfig
from .data import (PromptCollator, RefillPrompts, RolloutPrompts, RolloutRepeatSampler, check_prompt_columns,
                   prepare_datasets)
from .guard import NonFiniteGuard, nonfinite_problem, score_hint
from .progress import PPOProgressCallback, maybe_log_samples, showing_sampling
from .schedule import MinibatchSchedule
from .saving import SavingSeams
from .step_api import StepAPI


class PPOLMTrainer(StepAPI, SavingSeams, Trainer):
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
    args = HeldArgs()  # once built, a setting it took cannot change under it (trainer/config.py)

    # A refused trainer leaves os.environ and accelerate's state as it found them: an Accelerator sets
    # ACCELERATE_USE_FSDP and fills accelerate's process-wide state before later checks may refuse the run.
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
            raise TypeError(f"args must be a PPOConfig, got {type(args).__name__}: "
                            "PPOConfig(**{**args.to_dict(), 'hub_token': args.hub_token}) converts it.")
        if args.process_index == 0:  # a live run holds output_dir: refused now, before any model loads
            problem = run_lock.in_use_message(args.output_dir)
            if problem is not None:
                raise run_lock.OutputDirInUseError(problem)
        single = sharding.one_process_problem(args.fsdp, args.fsdp_config, args.parallel_mode)  # Trainer's, before any
        if single is not None:  # model loads and before its Accelerator replaces accelerate's state
            raise ValueError(single)
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
        # accelerate keeps one state per process, which later constructions replace: train() and evaluate() put
        # this trainer's own back first (`sharding.reinstate_accelerate_state`).
        self._accelerate_state = sharding.accelerate_state()
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
        self._step_lock, self._steps_hold_output_dir = None, False  # output_dir, once step() is called (run_lock)
        self._micro_step = None  # position in the current iteration; derived from global_step on first use
        self._schedule: MinibatchSchedule | None = None  # the current iteration's rollout and update order
        self._guard = NonFiniteGuard(args.max_consecutive_nonfinite, score_hint(args))
        self._no_signal = watch.NoSignal(args, self.rewards.names, watch.parameter_count(policy.policy_model),
                                         bool(self.stop_token_ids))  # warns when every sample got the same reward
        self._step_loss_finite: torch.Tensor | None = None  # all micro-batch losses of this optimizer step finite
        self._metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._reward_logs = RewardLogs()  # what reward functions log (TRL's log_metric / log_extra)
        self._train_phase_start = None
        after_build.hold(args)  # built: a setting taken above is refused on assignment from here on

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
        if args.stats_pass_every and self.iteration % args.stats_pass_every == 0:  # the skipped passes, for the metrics
            settings = settings.with_all_passes()
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
        reduced = {**dict(zip(result.stats, stats.tolist())), "iteration": self.iteration + 1}
        watch.observe_rollout(self.callback_handler.callbacks, reduced)
        self._record(self._reward_logs.take_metrics())  # the reward functions' own (log_metric), as TRL names them
        self._guard.unscored_rows(result.unscored, self.accelerator, args.world_size)
        generated_tokens = result.generated_tokens * args.world_size
        self._record({"objective/kl_coef": self.kl_ctl.value, "time/generate": result.generate_seconds,
                      "time/score": result.score_seconds, "time/policy_forward": result.policy_forward_seconds,
                      "time/reference": result.reference_seconds,
                      "rollout/tokens_per_second": generated_tokens / max(result.generate_seconds, 1e-9)})
        # 10. The KL controller moves after each rollout, by the number of episodes it saw (an adaptive one always
        # has the KL: the reference pass is skipped only with a fixed controller).
        if "objective/kl" in result.stats:
            kl = list(result.stats).index("objective/kl")
            self.kl_ctl.update(stats[kl].item(), len(batch) * args.world_size)
        self.iteration += 1
        if self.is_world_process_zero():
            self._no_signal.check(result.uniform, self.iteration, len(batch) * args.world_size, reduced)
            maybe_log_samples(tokenizer, batch, self.iteration, self.state.global_step, self.state.max_steps, args,
                              inputs["prompts"], self._reward_logs.take_extra())
        self._reward_logs.take_extra()  # the columns reward functions logged (log_extra): this rollout's alone
        self._train_phase_start = time.perf_counter()
        return batch

    # ---- loss: step 11 --------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, batch = self.args, inputs["batch"]
        # The critic warm-up: the policy runs without gradients, so its weights stay exactly as they are.
        out = model(**predicting_inputs(batch.queries, batch.query_mask, batch.responses, batch.response_mask),
                    logits_to_keep=batch.responses.shape[1],
                    critic_only=inputs.get("critic_only") or self.state.global_step < args.critic_warmup_steps)
        loss, stats = ppo_loss(out.logits, out.value, batch,
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

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Trainer's, under this trainer's own accelerate state (`sharding.reinstate_accelerate_state`)."""
        sharding.reinstate_accelerate_state(self._accelerate_state)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        self._record(self._reward_logs.take_metrics())  # training's, logged with training's metrics
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        output.metrics.update(self.evaluator.finish(self, self.args.eval_settings, metric_key_prefix))
        output.metrics.update({f"{metric_key_prefix}_{k}": v for k, v in self._reward_logs.take_metrics().items()})
        return output

    # ---- one run per output_dir: train() holds the folder (trainer/run_lock.py) ----------------------------------------
    def train(self, *args, **kwargs):
        """Trainer's `train()`, holding `output_dir` for its whole length (`run_lock.holding`): a second run into the
        same folder is refused, naming the process that holds it; a lock left by a dead process is taken over with a
        note; the lock goes at the end, also on error. The main process takes it, the others learn its outcome. After
        this trainer's own step() calls, the folder is already its own (`_step_lock`, held until the trainer goes).
        A resume from a checkpoint that reached max_steps trains nothing (`_finished_run`)."""
        with self._holding_output_dir():
            finished = self._finished_run(kwargs.get("resume_from_checkpoint", args[0] if args else None))
            return finished if finished is not None else super().train(*args, **kwargs)

    def _as_on_main_process(self, value):
        """`value` as the main process holds it, on every process (accelerate's `broadcast_object_list`)."""
        return value if self.args.world_size == 1 else broadcast_object_list([value], from_process=0)[0]

    def _hp_search_setup(self, trial) -> None:
        """The first call in `train()`, before it resolves `resume_from_checkpoint=True`: this trainer's accelerate
        state goes back (a PPOConfig or trainer built since replaced it); a rotation that would delete others'
        checkpoints is refused; incomplete ones above the last complete one are moved aside (`prepare_run_dir`)."""
        sharding.reinstate_accelerate_state(self._accelerate_state)
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

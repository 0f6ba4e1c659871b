"""`PPOLMTrainer`: clipped-PPO RLHF as a thin `transformers.Trainer` subclass.

Trainer keeps its loop, optimizer, LR schedule, gradient accumulation, `max_grad_norm` clipping, mixed precision,
callbacks, logging, checkpoint rotation and hub plumbing. PPO plugs into its seams (steps numbered as in the README's
"What one iteration does" and `rollout.py`):

- the sampler (`data.RolloutRepeatSampler`) repeats each rollout batch of prompts once per micro-batch of the
  iteration, so Trainer's step counting (`max_steps`, epochs, `save_steps`) is right;
- `_prepare_inputs`, on the first micro-batch of an iteration: steps 1-9 (`rollout.rollout`: generate, truncate,
  score, EOS penalty, policy forward, reference, shaping, rewards/GAE/whitening, statistics), then 10. the KL
  controller update; then it hands out shuffled micro-batches of that rollout for `num_ppo_epochs` epochs;
- `compute_loss`: 11. clipped policy loss + vf_coef * clipped value loss (- entropy bonus), normalised by the
  minibatch's token (or, for the seq-mean loss aggregations, sequence) count so accumulation gives the minibatch
  gradient exactly;
- `log`: the averaged PPO metrics; `_save` / `_save_checkpoint` / `_load_from_checkpoint` / `push_to_hub`: only the
  policy is saved and published (`hub.py`), checkpoints also hold the critic and the PPO state (`checkpoint.py`).
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from collections import defaultdict

import torch
from transformers import Trainer, set_seed
from transformers.trainer_callback import ProgressCallback, TrainerCallback

from . import adapters, checkpoint, hub, loading
from .config import PPOConfig
from .data import PromptCollator, RolloutRepeatSampler, check_rollout_batch, prepare_prompts
from .generation import KVCacheSampler
from .guard import NonFiniteGuard, describe_counts, score_hint, is_finite_number, nonfinite_counts, nonfinite_parameters
from .ppo_math import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    aggregate_loss,
    entropy_from_logits,
    logprobs_from_logits,
    loss_normalizer,
    masked_mean,
    masked_var,
    policy_loss,
    value_loss,
)
from .reporting import PPOProgressCallback, maybe_log_samples
from .rollout import (MinibatchSchedule, RolloutBatch, probe_reward_callable, rollout, sample_and_score,
                      sequence_inputs)

class _WeightsChanged(TrainerCallback):
    """Tells the trainer's rollout engine after every optimizer step that the policy's weights changed."""

    def __init__(self, trainer: "PPOLMTrainer"):
        self.trainer = weakref.ref(trainer)  # no reference cycle through Trainer's callback handler

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer().rollout_engine.weights_changed()


class PPOLMTrainer(Trainer):
    """PPO for causal LMs with a value head, on `transformers.Trainer`.

    Args:
        model: Hub id, local path, `PreTrainedModel`, `PeftModel` or `AutoModelForCausalLMWithValueHead`.
        args: a `PPOConfig`.
        processing_class: the policy's tokenizer (loaded with the model when `model` is an id/path and this is None).
        reward_model: Hub id / path / `AutoModelForSequenceClassification` with num_labels=1 / callable
            `(prompts: list[str], completions: list[str]) -> list[float]`.
        ref_model: None (the policy with its LoRA adapter disabled; without LoRA, a frozen copy of the starting
            policy), or an id / path / model.
        train_dataset / eval_dataset: `datasets.Dataset` with a "prompt" (text) or "messages" (chat) column, or
            pre-tokenized "input_ids" (and optionally "attention_mask"), TRL 1.12's format.
        peft_config: a peft `LoraConfig` (None: full fine-tuning).
        reward_processing_class: the reward model's tokenizer when the reward model is passed as an object and its
            tokenizer differs from the policy's (loaded automatically when `reward_model` is an id/path).
    """

    _tag_names = ["hf_ppo", "ppo", "rlhf"]
    # compute_loss already divides by the minibatch's token (or sequence) count, so Trainer must not divide again.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model,
        args: PPOConfig | None = None,
        processing_class=None,
        reward_model=None,
        ref_model=None,
        train_dataset=None,
        eval_dataset=None,
        peft_config=None,
        reward_processing_class=None,
        callbacks=None,
        optimizers=(None, None),
    ):
        args = args if args is not None else PPOConfig(output_dir="ppo_output")
        if not isinstance(args, PPOConfig):
            raise TypeError(f"args must be a PPOConfig, got {type(args).__name__}: PPOConfig(**args.to_dict()) converts it.")
        if reward_model is None:
            raise ValueError("PPOLMTrainer needs a reward_model: a Hub id or path, an "
                             "AutoModelForSequenceClassification (num_labels=1), or a callable (prompts, completions) -> list[float].")
        # Seed before any model is built: LoRA and value-head initialisation must follow `seed` too.
        set_seed(args.seed)
        device, dtype = args.device, loading.compute_dtype(args.bf16, args.fp16)
        self._model_sources = {"model": model if isinstance(model, str) else hub.source_name(model),
                               "reward_model": reward_model if isinstance(reward_model, str) else hub.source_name(reward_model),
                               "ref_model": ref_model if isinstance(ref_model, str) else hub.source_name(ref_model)}

        if processing_class is None:
            if not isinstance(model, str):
                raise ValueError("Pass processing_class=tokenizer when model is not a Hub id or path.")
            processing_class = loading.load_policy_tokenizer(model, args.model_init_kwargs)

        # Models: the policy + value head (trainable), the reference and the reward model (frozen). Each model that
        # reads the policy's token ids is checked against the tokenizer here, not by an IndexError mid-rollout.
        policy = loading.load_policy(model, args.model_init_kwargs, args.policy_quantization, peft_config, dtype,
                                     device, args.gradient_checkpointing)
        body = policy.policy_model
        loading.check_vocab(body, processing_class, "policy", loading.POLICY_VOCAB_FIX)
        # Stop tokens (the tokenizer's EOS and the model's generation_config ones), then a pad token that is none of
        # them: an existing unused special token when the tokenizer has no pad or pads with a stop token.
        self.stop_token_ids = loading.resolve_stop_token_ids(args.stop_token_ids, args.stop_token_id, args.stop_token,
                                                             processing_class, body)
        loading.check_stop_token_ids(self.stop_token_ids, body, needs_stop=args.missing_eos_penalty is not None)
        tokenizer = loading.choose_pad_token(processing_class, body, self.stop_token_ids,
                                             "id" if isinstance(model, str) else "object")
        # The trained adapter and, with ref_model=None, the reference adapter beside it (continuing from an adapter).
        self.trained_adapter, self.ref_adapter = adapters.prepare_adapters(
            body, fresh=peft_config is not None, ref_model_given=ref_model is not None,
            model_adapter_name=args.model_adapter_name, ref_adapter_name=args.ref_adapter_name)
        if isinstance(model, str) and self.trained_adapter and peft_config is None:  # an adapter given by id/path:
            # the card and the merged export name its base; the card names the adapter as the reference.
            self._model_sources["model"] = body.peft_config[self.trained_adapter].base_model_name_or_path
            self._model_sources["ref_model"] = self._model_sources["ref_model"] or model
        elif self.ref_adapter is not None:  # a reference adapter of a PeftModel object: never "the adapter disabled"
            self._model_sources["ref_model"] = f"adapter {self.ref_adapter!r} of the policy"
        self.ref_model = loading.load_reference(ref_model, model, args.ref_model_init_kwargs, args.ref_quantization,
                                                dtype, device, uses_peft=policy.is_peft_model)
        if self.ref_model is not None:
            loading.check_vocab(self.ref_model, tokenizer, "reference model", loading.REFERENCE_VOCAB_FIX)
        self.reward_model = loading.load_reward_model(reward_model, args.reward_model_init_kwargs,
                                                      args.reward_quantization, dtype, device)
        if isinstance(reward_model, str) and reward_processing_class is None:
            reward_processing_class = loading.load_tokenizer(reward_model, "reward model", args.reward_model_init_kwargs)
        if args.disable_dropout:
            for m in (policy, self.ref_model, self.reward_model):
                if isinstance(m, torch.nn.Module):
                    loading.disable_dropout(m)

        # Data: validated and tokenized here, so bad prompts fail before training starts.
        context = loading.max_positions(policy.config)
        train_dataset = prepare_prompts(train_dataset, tokenizer, "train_dataset", context=context,
                                        max_prompt_length=args.max_prompt_length, response_length=args.response_length,
                                        num_proc=args.dataset_num_proc)
        eval_dataset = prepare_prompts(eval_dataset, tokenizer, "eval_dataset", context=context,
                                       max_prompt_length=args.max_prompt_length, response_length=args.response_length,
                                       num_proc=args.dataset_num_proc)
        check_rollout_batch(args, train_dataset)
        chat = {isinstance(d[0]["prompt"], list) for d in (train_dataset, eval_dataset) if d is not None}
        self.reward_tokenizer = loading.reward_tokenizer(self.reward_model, tokenizer, reward_processing_class,
                                                         args.reward_input_format, chat or {False})
        probe_reward_callable(self.reward_model, train_dataset, tokenizer)

        super().__init__(
            model=policy, args=args, data_collator=PromptCollator(tokenizer.pad_token_id),
            train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer,
            callbacks=callbacks, optimizers=optimizers,
        )
        if self.pop_callback(ProgressCallback) is not None:
            self.add_callback(PPOProgressCallback(self.args.optimizer_steps_per_iteration, self.args.print_metrics))

        # The default rollout engine; another one is a `generation.RolloutEngine` assigned here.
        self.rollout_engine = KVCacheSampler(
            response_length=args.response_length,
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            pad_token_id=tokenizer.pad_token_id, stop_token_ids=self.stop_token_ids,
            batch_size=args.local_rollout_forward_batch_size)
        self.add_callback(_WeightsChanged(self))
        self.kl_ctl = (AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon) if args.adaptive_kl
                       else FixedKLController(args.kl_coef))
        self.reward_moments = RunningMoments() if args.normalize_rewards else None
        self.iteration = 0  # rollouts done so far (restored on resume)
        self._micro_step = None  # position in the current iteration; derived from global_step on first use
        self._schedule: MinibatchSchedule | None = None  # the current iteration's rollout and update order
        self._guard = NonFiniteGuard(args.max_consecutive_nonfinite, score_hint(args))
        self._step_loss_finite: torch.Tensor | None = None  # all micro-batch losses of this optimizer step finite
        self._metrics: dict[str, list[torch.Tensor]] = defaultdict(list)
        self._train_phase_start = None

    # ---- data: one rollout batch per iteration, repeated for every micro-batch ---------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        repeat = self.args.optimizer_steps_per_iteration * self.args.gradient_accumulation_steps
        return RolloutRepeatSampler(len(dataset), self.args.rollout_batch_size * self.args.world_size, repeat,
                                    self.args.seed)

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("PPOLMTrainer: training requires a train_dataset of prompts.")
        return self._get_dataloader(dataset=self.train_dataset, description="Training",
                                    batch_size=self.args.rollout_batch_size, sampler_fn=self._get_train_sampler,
                                    is_training=True)

    def _prepare_inputs(self, inputs: dict) -> dict:
        if not self.model.training:
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
            self._schedule = MinibatchSchedule.shuffled(
                batch, num_ppo_epochs=self.args.num_ppo_epochs, num_mini_batches=self.args.num_mini_batches,
                gradient_accumulation_steps=self.args.gradient_accumulation_steps,
                loss_aggregation=self.args.loss_aggregation)
            # Resumed part-way through an iteration without its rollout (settings changed on resume): a fresh
            # rollout serves only the micro-batches still to do.
            self._schedule.position = position
        self._micro_step += 1
        return self._schedule.next()

    def create_optimizer(self, model=None):
        """Trainer's optimizer, with the value head in a group of its own when `value_head_learning_rate` is set."""
        optimizer = super().create_optimizer(model)
        if self.args.value_head_learning_rate is None:
            return optimizer
        head = self.accelerator.unwrap_model(self.model).critic_parameters()
        ids = {id(p) for p in head}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        optimizer.add_param_group({"params": head, "lr": self.args.value_head_learning_rate, "weight_decay": 0.0})
        return optimizer

    # ---- rollout: steps 1-10 --------------------------------------------------------------------------------------
    @torch.no_grad()
    def _rollout(self, inputs: dict) -> RolloutBatch | None:
        """Steps 1-9 (`rollout.rollout`), then the trainer's part: the non-finite guard, metrics, step 10 (the KL
        controller); None when the rollout held NaN/inf and was dropped."""
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
        result = rollout(model, inputs["queries"], inputs["query_mask"], inputs["prompts"],
                         engine=self.rollout_engine, ref_model=self.ref_model, ref_adapter=self.ref_adapter,
                         reward=self.reward_model, tokenizer=tokenizer, reward_tokenizer=self.reward_tokenizer,
                         input_format=args.reward_input_format, stop_token_ids=self.stop_token_ids,
                         temperature=args.temperature, batch_size=args.local_rollout_forward_batch_size,
                         missing_eos_penalty=args.missing_eos_penalty, shape_scores=self._shape_scores,
                         kl_coef=self.kl_ctl.value, kl_estimator=args.kl_estimator,
                         gamma=args.gamma, lam=args.lam, whiten_rewards=args.whiten_rewards,
                         whiten_advantages=args.whiten_advantages)
        if toggle:
            model.train()
        batch = result.batch
        self._guard.check_scale(batch.scores)
        # NaN/inf anywhere: drop the rollout before it moves the reward statistics, the KL controller or a weight
        # (decided over all processes, so they all sample again together).
        counts = nonfinite_counts(batch)
        if args.world_size > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        problem = describe_counts(counts.tolist(), len(batch) * args.world_size)
        if problem:
            if moments is not None:
                self.reward_moments.load_state_dict(moments)
            self._train_phase_start = None
            self._guard.dropped_rollout(problem, self._last_complete_checkpoint)
            return None

        # Metrics, averaged over processes (so every rank's KL controller sees the same KL).
        stats = self.accelerator.reduce(torch.stack(list(result.stats.values())), reduction="mean")
        self._record(dict(zip(result.stats, stats)))
        generated_tokens = batch.response_mask.sum().item() * args.world_size
        self._record({"objective/kl_coef": self.kl_ctl.value, "time/generate": result.generate_seconds,
                      "time/score": result.score_seconds,
                      "rollout/tokens_per_second": generated_tokens / max(result.generate_seconds, 1e-9)})
        # 10. The KL controller moves after each rollout, by the number of episodes it saw.
        self.kl_ctl.update(stats[0].item(), len(batch) * args.world_size)
        self.iteration += 1
        if self.is_world_process_zero():
            maybe_log_samples(tokenizer, batch, self.iteration, self.state.global_step, self.state.max_steps, args)
        self._train_phase_start = time.perf_counter()
        return batch

    def _shape_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Running normalisation (statistics over all processes) and clipping of the scores, when configured."""
        if self.reward_moments is not None:
            self.reward_moments.update(self.accelerator.gather(scores))
            return self.reward_moments.normalize(scores, self.args.reward_clip)
        if self.args.reward_clip is not None:
            return scores.clamp(-self.args.reward_clip, self.args.reward_clip)
        return scores

    # ---- loss: step 11 --------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, batch, normalizer = self.args, inputs["batch"], inputs["normalizer"]
        mask = batch.response_mask
        out = model(**sequence_inputs(batch.queries, batch.query_mask, batch.responses, mask),
                    logits_to_keep=batch.responses.shape[1] + 1)
        logits, values = out.logits[:, :-1], out.value[:, :-1]
        logprobs = logprobs_from_logits(logits, batch.responses, args.temperature)
        aggregation = {"loss_aggregation": args.loss_aggregation, "max_length": args.response_length}
        pg_loss, pg_clipfrac, approxkl = policy_loss(logprobs, batch.logprobs, batch.advantages, mask, args.cliprange,
                                                     normalizer, cliprange_low=args.cliprange_low,
                                                     cliprange_high=args.cliprange_high, dual_clip=args.dual_clip,
                                                     **aggregation)
        vf_loss, vf_clipfrac = value_loss(values, batch.values, batch.returns, mask, args.cliprange_value, normalizer,
                                          **aggregation)
        loss = pg_loss + args.vf_coef * vf_loss
        if args.entropy_coef:  # a vocabulary-wide softmax: only paid when the bonus is on
            entropy = entropy_from_logits(logits, args.temperature)
            loss = loss - args.entropy_coef * aggregate_loss(entropy, mask, normalizer=normalizer, **aggregation)
        with torch.no_grad():
            finite = torch.isfinite(loss)
            self._step_loss_finite = finite if self._step_loss_finite is None else self._step_loss_finite & finite
            # Losses are reported as this micro-batch's own aggregate (the returned loss is scaled for accumulation).
            scale = normalizer / loss_normalizer(mask, args.loss_aggregation)
            ratio = torch.exp(logprobs - batch.logprobs)
            self._record({
                "loss/policy_avg": pg_loss * scale, "loss/value_avg": vf_loss * scale,
                "policy/approxkl_avg": approxkl, "policy/clipfrac_avg": pg_clipfrac, "val/clipfrac_avg": vf_clipfrac,
                "val/ratio": masked_mean(ratio, mask), "val/ratio_var": masked_var(ratio, mask),
            })
        return (loss, out) if return_outputs else loss

    def _get_grad_norm(self, model, grad_norm=None):
        """Trainer's gradient norm, taken right before `optimizer.step()`: a non-finite loss or norm skips the step.

        Skipping drops the gradients, and the optimizer leaves a parameter without one untouched (no update, no
        moment or weight-decay change). Under fp16's GradScaler, which already skips overflowed steps itself, only a
        non-finite loss counts.
        """
        grad_norm = super()._get_grad_norm(model, grad_norm)
        loss_finite, self._step_loss_finite = self._step_loss_finite, None
        if loss_finite is not None and self.args.world_size > 1:
            loss_finite = self.accelerator.reduce(loss_finite.float(), reduction="sum") == self.args.world_size
        scaler = self.accelerator.scaler is not None
        cause = ("the loss is NaN/inf" if loss_finite is not None and not loss_finite.item()
                 else None if scaler or is_finite_number(grad_norm) else f"the gradient norm is {float(grad_norm)}")
        if cause is None:
            self._guard.good_step()
            return grad_norm
        if not scaler:
            model.zero_grad(set_to_none=True)
        self._guard.skipped_step(f"{cause} at step {self.state.global_step + 1}", self._last_complete_checkpoint)
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

    # ---- evaluation: sample and score the eval prompts -----------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        scores = self._eval_scores(super()._prepare_inputs(inputs))
        return -scores.mean().detach(), None, None

    @torch.no_grad()
    def _eval_scores(self, inputs) -> torch.Tensor:
        """Scores of freshly sampled responses to eval prompts (steps 1-3; eval_loss = -mean score)."""
        return sample_and_score(self.rollout_engine, self.accelerator.unwrap_model(self.model), self.reward_model,
                                inputs["queries"], inputs["query_mask"], inputs["prompts"],
                                tokenizer=self.processing_class, reward_tokenizer=self.reward_tokenizer,
                                input_format=self.args.reward_input_format, stop_token_ids=self.stop_token_ids,
                                batch_size=self.args.local_rollout_forward_batch_size).scores

    # ---- saving: the policy alone; checkpoints add the value head and PPO state ------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        self._check_finite_weights(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        card = os.path.join(output_dir, "README.md")
        had_card = os.path.isfile(card)
        policy = self.accelerator.unwrap_model(self.model).policy_model
        adapters.save_policy(policy, output_dir, self.trained_adapter)
        self.processing_class.save_pretrained(output_dir)
        hub.make_base_path_absolute(output_dir)  # the adapter loads from any directory, not only where training ran
        if not had_card and os.path.isfile(card):
            os.remove(card)  # PEFT's placeholder card: save_model() and push_to_hub() write the real one

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy (see `_save`); called by the user, also write its model card and say how to use it.

        The card is the Hub card's template, rendered for the folder; the message (printed once, on the main
        process) names the folder, how to load the policy (adapter or merged) and how to push it.
        """
        super().save_model(output_dir, _internal_call)
        if _internal_call or not self.args.should_save:
            return
        folder = output_dir if output_dir is not None else self.args.output_dir
        is_adapter = self._write_card(folder, os.path.basename(os.path.abspath(folder)), merged=False, dataset_names=[],
                                      saved_locally=True)
        if self.is_world_process_zero():
            print(hub.saved_policy_message(folder, is_adapter))

    def _check_finite_weights(self, output_dir: str) -> None:
        bad = nonfinite_parameters(self.accelerator.unwrap_model(self.model))
        if bad:
            raise RuntimeError(f"Not saving to {output_dir}: parameters {bad[:5]} hold NaN/inf. The last complete "
                               f"checkpoint is {self._last_complete_checkpoint() or 'none'}.")

    def _save_checkpoint(self, model, trial) -> None:
        """The PPO state first, then Trainer's files: Trainer writes trainer_state.json last and rotates only after
        it, so a folder with a readable trainer_state.json is complete (see checkpoint.py)."""
        folder = checkpoint.checkpoint_folder(self._get_output_dir(trial=trial), self.state.global_step)
        self._check_finite_weights(folder)  # on every process, so all of them stop together
        if self.args.should_save:
            wrapper = self.accelerator.unwrap_model(self.model)
            schedule = self._schedule if self._schedule is not None and not self._schedule.done else None
            checkpoint.save_trainer_state(
                folder, args=self.args, iteration=self.iteration, kl_controller=self.kl_ctl,
                reward_moments=self.reward_moments, guard=self._guard, peft=wrapper.is_peft_model, metrics=self._metrics,
                critic_state=wrapper.value_head_state_dict(),
                rollout_buffer=schedule.state_dict() if schedule is not None else None)
        super()._save_checkpoint(model, trial)

    def _hp_search_setup(self, trial) -> None:
        """The first call in `train()`, before it resolves `resume_from_checkpoint=True` to the highest checkpoint:
        incomplete checkpoints above the last complete one are moved aside (with a warning), so it resolves to that."""
        super()._hp_search_setup(trial)
        if self.args.should_save:
            for folder, moved_to, issues in checkpoint.hide_incomplete(self.args.output_dir):
                warnings.warn(f"Skipping incomplete checkpoint {folder} ({'; '.join(issues)}): the run stopped while "
                              f"writing it. Moved to {moved_to}.")
        self.accelerator.wait_for_everyone()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        wrapper = self.accelerator.unwrap_model(model if model is not None else self.model)
        device = wrapper.critic_device
        saved = checkpoint.load_ppo_state(resume_from_checkpoint, self.args, device)
        checkpoint.load_policy_weights(wrapper.policy_model, resume_from_checkpoint, wrapper.is_peft_model, device,
                                      adapter_name=self.trained_adapter)
        wrapper.load_value_head_state_dict(saved.value_head)
        self.rollout_engine.weights_changed()
        self.iteration = checkpoint.restore_trainer_state(saved, kl_controller=self.kl_ctl,
                                                          reward_moments=self.reward_moments, guard=self._guard,
                                                          metrics=self._metrics)
        self._micro_step, self._schedule = None, None
        if saved.changed:
            warnings.warn(f"Resuming from {resume_from_checkpoint} with changed settings (allow_config_change_on_resume"
                          "): " + checkpoint.describe_changes(saved.changed, "; ") + ". The new values apply from now on"
                          + ("; the interrupted iteration's rollout is discarded (a fresh one serves its remaining "
                             "steps)." if saved.rollout_buffer is not None else "."))
        elif saved.rollout_buffer is not None:
            self._schedule = MinibatchSchedule.from_state_dict(
                saved.rollout_buffer, num_mini_batches=self.args.num_mini_batches,
                gradient_accumulation_steps=self.args.gradient_accumulation_steps,
                loss_aggregation=self.args.loss_aggregation)

    # ---- publishing: the policy alone, with its model card ----------------------------------------------------------
    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Resolve the repo id at construction (a clear error now, not after training); the push creates it."""
        self.hub_model_id = hub.resolve_repo_id(self.args.hub_model_id, self.args.output_dir,
                                            token if token is not None else self.args.hub_token)
        self.push_in_progress = None

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Checkpoints hold optimizer and value-head state, which never go to the Hub: only `push_to_hub` pushes."""

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    create_pr: bool = False, dataset_name: str | list[str] | None = None, **kwargs):
        """Save the policy to `output_dir`, render its model card and upload only the policy files.

        The LoRA adapter (or full weights) + tokenizer + card + training-curve plot; with `push_merged_model`, the
        adapter merged into a full-precision base instead (in `output_dir/merged`). Never the value head, the
        reference, the reward model, optimizer state or training_args.bin. A failed push raises `HubPushError`,
        leaves the local output intact, and can be retried by calling `push_to_hub()` again.
        """
        args = self.args
        token = token if token is not None else args.hub_token
        repo_id = self.hub_model_id or hub.resolve_repo_id(args.hub_model_id, args.output_dir, token)
        self.save_model(args.output_dir, _internal_call=True)
        folder = self._save_merged_policy() if args.push_merged_model else args.output_dir
        if not self.is_world_process_zero():
            return None
        names = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or [])
        self._write_card(folder, repo_id, merged=args.push_merged_model, dataset_names=names)
        return hub.push_policy_folder(folder, repo_id, token=token,
                                  private=private if private is not None else args.hub_private_repo,
                                  revision=revision if revision is not None else args.hub_revision,
                                  create_pr=create_pr, commit_message=commit_message or "Upload PPO policy")

    def _write_card(self, folder: str, repo_id: str, merged: bool, dataset_names: list[str],
                    saved_locally: bool = False) -> bool:
        """Render the policy's model card (and its plot) into `folder`; return whether the policy is an adapter."""
        return hub.write_policy_card(folder, self.accelerator.unwrap_model(self.model).policy_model,
                                     self.trained_adapter, self._model_sources, self.args, self.state.log_history,
                                     repo_id=repo_id, merged=merged, dataset_names=dataset_names,
                                     saved_locally=saved_locally)

    def _save_merged_policy(self) -> str:
        """Save the adapter merged into a full-precision base to `output_dir/merged`; return that folder."""
        folder = os.path.join(self.args.output_dir, "merged")
        if not self.accelerator.unwrap_model(self.model).is_peft_model:
            self.save_model(folder, _internal_call=True)
        elif self.args.should_save:
            hub.save_merged_policy(self.args.output_dir, self._model_sources["model"], folder, self.processing_class,
                               self.args.model_init_kwargs)
        return folder


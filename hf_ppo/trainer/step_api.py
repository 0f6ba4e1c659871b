"""The step API: TRL 0.11's `PPOTrainer.step(queries, responses, scores)` for users who sample in a loop of their own.

`trainer.step(...)` runs one PPO iteration on the given samples through the ordinary path: the samples stand in for
steps 1-3 (`environment.GivenSamples`), `PPOLMTrainer._rollout` does steps 4-10 (penalties, old log-probs and values,
the reference, shaping, advantages, the non-finite guard, the KL controller), and the update is Trainer's own seams:
`training_step` per micro-batch (`compute_loss`, step 11), then `_clip_grad_norm`, `_get_grad_norm` (the guard),
`optimizer.step()`, `lr_scheduler.step()` and the optimizer-step callbacks, once per minibatch. It returns the
iteration's statistics under TRL 0.11's keys where hf_ppo has the quantity (`TRL_KEYS`), and under hf_ppo's own.
The samples are checked where they enter (`given_samples`: every error names the argument and index); responses may
be longer than `response_length` (the batch is padded to the longest), as TRL 0.11's step() took any length. Like
`train()`, it saves checkpoints at `save_steps` (`_save_if_asked`) and refuses steps past the schedule's end. With
save_strategy="steps" its first call takes `output_dir` for the trainer's life, as `train()` holds it for its length
(`run_lock.hold_for_steps`): two step() loops into one folder would overwrite each other's checkpoints.
"""

from __future__ import annotations

import time

import torch

from ..algorithms.ppo_math import masked_mean
from ..rollout.environments import EnvSample, GivenSamples, embedding_rows, token_ids
from ..runtime import sharding
from . import run_lock
from .assembly import max_positions
from .data import PromptCollator
from .schedule import MinibatchSchedule
from .watch import stopped_by_collapse

# TRL 0.11 stats key -> the hf_ppo metric with that meaning. TRL's "ppo/policy/ratio" was an array; here its mean.
# (TRL's "ppo/mean_non_score_reward" is a per-token mean, hf_ppo's objective/non_score_reward a per-response sum:
# step() computes it apart.)
TRL_KEYS = {
    "objective/kl": "objective/kl", "objective/kl_coef": "objective/kl_coef", "objective/entropy": "objective/entropy",
    "ppo/mean_scores": "objective/scores",
    "ppo/loss/policy": "loss/policy_avg", "ppo/loss/value": "loss/value_avg", "ppo/policy/entropy": "policy/entropy_avg",
    "ppo/policy/approxkl": "policy/approxkl_avg", "ppo/policy/clipfrac": "policy/clipfrac_avg",
    "ppo/policy/advantages_mean": "rollout/advantages_mean", "ppo/policy/ratio": "val/ratio",
    "ppo/returns/mean": "rollout/returns_mean", "ppo/val/clipfrac": "val/clipfrac_avg",
    "ppo/val/var_explained": "val/explained_variance",
}
_CONSTANT_SCHEDULES = ("constant", "constant_with_warmup")
STEP_VLLM_ERROR = ("step() trains on samples your own loop generated, so rollout_engine='vllm' would hold a second copy "
                   "of the policy that nothing samples from: leave rollout_engine at 'kv_cache' (the default), or "
                   "let the trainer sample (train(), with rollout_engine='vllm').")


def _name(setting) -> str:
    """A TrainingArguments choice as its string (`save_strategy`, `lr_scheduler_type`: an enum after __post_init__)."""
    return getattr(setting, "value", setting)


_IDS_FIX = "step() takes, per sample, the prompt's and the response's token ids as 1-D LongTensors, as TRL 0.11's did."


def given_samples(queries, responses, scores, response_masks, *, args, tokenizer, rows: int | None,
                  context: int | None, device) -> dict:
    """The rollout inputs of `step`, checked where they enter (each error names the argument and index): the
    prompts left-padded as the data collator pads them, and the samples as an environment's (`GivenSamples`),
    padded to the longest response or `response_length`, whichever is longer ("response_length").

    queries / responses: lists of 1-D integer token tensors, ids below `rows` (the policy's embedding rows); scores:
    numbers; response_masks: None (every response token is the policy's) or 1-D 0/1 per response token, 0 = an
    environment's token. Each prompt + response must fit `context` (the policy's positions); with
    `num_generations` k > 1, queries[0:k] must be one prompt's k copies, queries[k:2k] the next's, and so on."""
    expected = args.rollout_batch_size
    lists = {"queries": queries, "responses": responses, "scores": scores}
    if response_masks is not None:
        lists["response_masks"] = response_masks
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)) or len(value) != expected:
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"step(): {name} must be a list of {expected} entries (rollout_batch_size = "
                             f"per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches), got {got}.")
    queries = [token_ids(q, f"step(): queries[{i}]", rows, _IDS_FIX) for i, q in enumerate(queries)]
    responses = [token_ids(r, f"step(): responses[{i}]", rows, _IDS_FIX) for i, r in enumerate(responses)]
    samples = []
    for i, (query, response, score) in enumerate(zip(queries, responses, scores)):
        mask = (torch.ones(len(response), dtype=torch.bool) if response_masks is None
                else _mask(response_masks[i], i, len(response)))
        if context is not None and len(query) + len(response) > context:
            raise ValueError(f"step(): queries[{i}] ({len(query)} tokens) + responses[{i}] ({len(response)} tokens) "
                             f"exceed the policy's context of {context} positions: shorten the prompt, or generate "
                             f"at most {max(context - len(query), 0)} new tokens for it.")
        if args.overlong_buffer_length is not None and len(response) > args.response_length:
            raise ValueError(f"step(): responses[{i}] has {len(response)} tokens, more than response_length="
                             f"{args.response_length}, against which overlong_buffer_length="
                             f"{args.overlong_buffer_length} penalises lengths: raise response_length to your "
                             "generation's max_new_tokens, or unset overlong_buffer_length.")
        samples.append(EnvSample(response, mask, _given_score(score, i)))
    _check_groups(queries, args.num_generations)
    known = len(tokenizer)  # ids past the tokenizer's vocabulary (padded embedding rows) have no text to decode
    text_rows = [{"input_ids": q.tolist(), "prompt": tokenizer.decode([t for t in q.tolist() if t < known],
                                                                     skip_special_tokens=True)} for q in queries]
    inputs = PromptCollator(tokenizer.pad_token_id)(text_rows)
    return {"queries": inputs["queries"].to(device), "query_mask": inputs["query_mask"].to(device),
            "prompts": inputs["prompts"], "environment": GivenSamples(samples),
            "response_length": max([args.response_length] + [len(r) for r in responses])}


def _mask(value, i: int, length: int) -> torch.Tensor:
    """response_masks[i] as a bool tensor of `length` flags with at least one policy token, or an error naming it."""
    try:
        mask = torch.as_tensor(value).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        mask = None
    if mask is None or mask.dim() != 1 or len(mask) != length or not ((mask == 0) | (mask == 1)).all():
        shown = f"shape {tuple(mask.shape)}" if mask is not None else type(value).__name__
        raise ValueError(f"step(): response_masks[{i}] ({shown}) must be {length} flags 0/1, one per token of "
                         f"responses[{i}] (1 = the policy sampled it, 0 = an environment's or a tool's token).")
    if not mask.any():
        raise ValueError(f"step(): response_masks[{i}] is all 0: responses[{i}] holds no token the policy sampled, so "
                         "there is nothing to train on. Mark the policy's tokens 1, or leave the sample out.")
    return mask.bool()


def _given_score(value, i: int) -> float:
    """scores[i] (a number, or a one-element tensor / array) as a float, or an error naming it."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"step(): scores[{i}] is {type(value).__name__} {value!r}: give one number per sample "
                        "(a float, or a one-element tensor such as torch.tensor(1.0)).")
    try:
        score = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"step(): scores[{i}] is a {type(value).__name__}: give one number per sample (a float, or "
                        "a one-element tensor such as torch.tensor(1.0)).") from None
    if score.numel() != 1:
        raise ValueError(f"step(): scores[{i}] has shape {tuple(score.shape)}: give one scalar score per sample.")
    return float(score)


def _check_groups(queries: list[torch.Tensor], k: int) -> None:
    """With num_generations k > 1 the estimators compare each group of k consecutive samples: they must share one
    prompt, token for token."""
    for first in range(0, len(queries) if k > 1 else 0, k):
        for j in range(first + 1, first + k):
            if not torch.equal(queries[j], queries[first]):
                raise ValueError(
                    f"step(): num_generations={k}, and queries[{first}:{first + k}] are not one prompt's {k} samples "
                    f"(queries[{j}] differs from queries[{first}]). The {k} samples of a prompt must be consecutive: "
                    f"queries[0:{k}] the first prompt's, queries[{k}:{2 * k}] the next prompt's, and so on (the "
                    "group estimators baseline each response against the others of its group). Order them so, or "
                    "set num_generations=1.")


class StepAPI:
    """`PPOLMTrainer.step`: one PPO iteration on samples made by the caller (see the module docstring)."""

    def step(self, queries: list[torch.Tensor], responses: list[torch.Tensor], scores: list, response_masks=None) -> dict:
        """One PPO iteration (`optimizer_steps_per_iteration` optimizer steps) on `rollout_batch_size` samples.

        queries: prompt token ids (1-D each, no padding; with `num_generations` k > 1, each prompt's k samples
        consecutive); responses: the tokens after each prompt (1-D, any length that fits the policy's context with
        its prompt: the batch is padded to the longest, at least `response_length`); scores: one number each;
        response_masks: optional, 1-D 0/1 per response token, 0 marking tokens the policy did not sample (an
        environment's or a tool's output: context, never trained on). The learning-rate schedule spans `max_steps`
        (set it, or use a constant `lr_scheduler_type`); a call past its end is refused. With save_strategy="steps" a
        call that reaches a multiple of `save_steps` (or `max_steps`) ends with a checkpoint, as `train()` saves.
        Returns the statistics: TRL 0.11's keys (`TRL_KEYS`, plus ppo/loss/total, ppo/std_scores,
        ppo/mean_non_score_reward (per token, as TRL's), ppo/learning_rate, tokens/*_len_mean, time/ppo/total) and
        hf_ppo's metric names; they are logged too (`log`).
        """
        start, args = time.perf_counter(), self.args
        sharding.reinstate_accelerate_state(self._accelerate_state)  # a PPOConfig or trainer built since replaced it
        self._check_step_settings()
        self._hold_output_dir()
        policy = self.accelerator.unwrap_model(self.model).policy_model
        inputs = given_samples(queries, responses, scores, response_masks, args=args, tokenizer=self.processing_class,
                               rows=embedding_rows(policy), context=max_positions(policy.config), device=args.device)
        first_step = self.state.global_step
        model = self._step_model()
        batch = self._rollout(inputs)
        if batch is None:  # NaN/inf in the rollout: dropped by the guard (which stops after too many in a row)
            return self._guard.log_values()
        schedule = MinibatchSchedule.shuffled(batch, **args.schedule_settings)
        self.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        losses = []
        while not schedule.done:
            for _ in range(args.gradient_accumulation_steps):
                losses.append(self.training_step(model, schedule.next()))
            self._step_optimizer(model)
        stats = {key: torch.stack([v.cpu() for v in values]).mean().item() for key, values in self._metrics.items()}
        stats.update({trl: stats[ours] for trl, ours in TRL_KEYS.items() if ours in stats})
        stats.update({"ppo/loss/total": torch.stack(losses).sum().item() / (len(losses) // args.gradient_accumulation_steps),
                      "ppo/std_scores": batch.scores.std().item() if len(batch) > 1 else 0.0,
                      "ppo/mean_non_score_reward": masked_mean(batch.non_score_rewards, batch.policy_mask).item(),
                      "ppo/learning_rate": self._get_learning_rate(),
                      "tokens/queries_len_mean": batch.query_mask.sum(1).float().mean().item(),
                      "tokens/responses_len_mean": batch.response_mask.sum(1).float().mean().item(),
                      "time/ppo/total": time.perf_counter() - start})
        self.log({})  # the metrics of this iteration, to the loggers and `state.log_history`
        self._save_if_asked(first_step)
        return stats

    @torch.no_grad()
    def generate(self, query_tensor, batch_size: int = 4, return_prompt: bool = True, **generation_kwargs):
        """TRL 0.11's `PPOTrainer.generate`: sample from the current policy with `model.generate(**generation_kwargs)`.

        A list of 1-D prompts -> a list of 1-D sequences without padding (up to and including the first EOS), in
        batches of `batch_size`, left-padded; one 1-D prompt -> `generate`'s (1, length) output. `return_prompt=False`
        drops the prompt. (TRL's `length_sampler` and `generate_ref_response` are not offered.)
        """
        for name in ("length_sampler", "generate_ref_response"):
            if generation_kwargs.pop(name, None):
                raise ValueError(f"generate(): {name} is not offered; sample lengths with max_new_tokens instead.")
        policy, tokenizer = self.accelerator.unwrap_model(self.model).policy_model, self.processing_class
        if torch.is_tensor(query_tensor) and query_tensor.dim() == 1:
            out = policy.generate(input_ids=query_tensor.unsqueeze(0).to(policy.device), **generation_kwargs)
            return out if return_prompt else out[:, len(query_tensor):]
        results = []
        for start in range(0, len(query_tensor), batch_size):
            rows = [{"input_ids": torch.as_tensor(q).tolist(), "prompt": ""} for q in query_tensor[start:start + batch_size]]
            inputs = PromptCollator(tokenizer.pad_token_id)(rows)
            ids, mask = inputs["queries"].to(policy.device), inputs["query_mask"].to(policy.device)
            out = policy.generate(input_ids=ids, attention_mask=mask.long(), **generation_kwargs)
            for row in range(len(rows)):
                new = out[row, ids.shape[1]:]
                stops = (new == tokenizer.eos_token_id).nonzero()
                new = new[:int(stops[0]) + 1] if len(stops) else new[new != tokenizer.pad_token_id]
                results.append(torch.cat([ids[row][mask[row]], new]) if return_prompt else new)
        return results

    def _check_step_settings(self) -> None:
        """Before anything of a `step()` call runs: the settings it cannot honour, and a call past the end of the
        learning-rate schedule (where it would train nothing)."""
        args, done = self.args, self.state.global_step
        if args.rollout_engine == "vllm":
            raise ValueError(STEP_VLLM_ERROR)
        if stopped_by_collapse(self.callback_handler.callbacks):
            raise ValueError(f"step(): stop_on_collapse=True and the collapse watch stopped training at step {done} "
                             "(its CollapseWarning names the signature and the last complete checkpoint), so this "
                             "call trains nothing. End your loop there, or set stop_on_collapse=False to be warned "
                             "and go on.")
        if args.max_refill_rounds:
            raise ValueError(f"step(): max_refill_rounds={args.max_refill_rounds} refills with prompts sampled from "
                             "train_dataset, and step() trains on the caller's samples: set max_refill_rounds=0 "
                             "(drop_uniform_groups still drops the uniform groups), or sample more in your loop.")
        strategy = _name(args.save_strategy)
        if strategy in ("epoch", "best"):
            raise ValueError(f"step(): save_strategy={strategy!r} saves at the end of an epoch or at a new best "
                             "evaluation, and step() has neither: set save_strategy='steps' and save_steps (optimizer "
                             "steps; the call that reaches a multiple ends with a checkpoint), or save_strategy='no' "
                             "and call trainer.save_model(folder) in your loop.")
        schedule = _name(args.lr_scheduler_type)
        steps = args.optimizer_steps_per_iteration
        if schedule not in _CONSTANT_SCHEDULES and 0 < args.max_steps < done + steps:
            raise ValueError(
                f"step(): this call's optimizer steps {done + 1}-{done + steps} go past max_steps={args.max_steps}, "
                f"where the lr_scheduler_type={schedule!r} schedule ends (its learning rate reaches 0), so they would "
                "train nothing. Nothing of this call ran; the policy trained so far is intact (trainer.save_model("
                "folder) saves it). Set max_steps to the number of step() calls x optimizer_steps_per_iteration "
                f"({steps} = num_ppo_epochs x critic_updates_per_step x num_mini_batches), or "
                "lr_scheduler_type='constant'.")

    def _hold_output_dir(self) -> None:
        """With save_strategy="steps" (step() writes checkpoints there), the first call takes `output_dir` for this
        trainer's step() loop, until the trainer is deleted or the process ends (`run_lock.hold_for_steps`; refused
        while another run holds it); a later call is refused once a later trainer of this process took the folder
        over (`run_lock.still_held`). With save_strategy="no" step() writes nothing there (TRL 0.11's loop wrote no
        folder either) and holds nothing."""
        if _name(self.args.save_strategy) != "steps":
            return
        if not self._steps_hold_output_dir:
            self._step_lock = run_lock.hold_for_steps(self.args.output_dir, self.is_world_process_zero(), self,
                                                      self._as_on_main_process)
            self._steps_hold_output_dir = True
            return
        refusal = self._step_lock_refusal()
        if refusal is not None:
            raise run_lock.OutputDirInUseError(refusal)

    def _step_lock_refusal(self) -> str | None:
        """`run_lock.still_held` asked on the main process, its answer on every process."""
        return self._as_on_main_process(run_lock.still_held(self._step_lock, self.args.output_dir))

    def _save_if_asked(self, first_step: int) -> None:
        """save_strategy="steps": a checkpoint (Trainer's `_save_checkpoint`, then the `on_save` callbacks) after a
        call whose optimizer steps reached a multiple of `save_steps`, or `max_steps`, where `train()` would save.
        At the end of the call, as a checkpoint-<global_step> folder: one taken part-way through it would hold
        half an update."""
        args, state = self.args, self.state
        if _name(args.save_strategy) != "steps":
            return
        every, last = state.save_steps, state.global_step
        if (every > 0 and last // every > first_step // every) or first_step < args.max_steps <= last:
            self._save_checkpoint(self.model_wrapped, trial=None)
            self.control = self.callback_handler.on_save(args, state, self.control)

    def _step_model(self):
        """The model `training_step` trains, with the optimizer and scheduler Trainer would make (once)."""
        if self.optimizer is not None and self.lr_scheduler is not None:
            return self.model_wrapped
        args = self.args
        schedule = _name(args.lr_scheduler_type)
        if args.max_steps <= 0 and schedule not in _CONSTANT_SCHEDULES:
            raise ValueError(f"step(): lr_scheduler_type={schedule!r} needs the run's length: set max_steps (optimizer "
                             "steps: iterations x num_ppo_epochs x num_mini_batches), or lr_scheduler_type='constant'.")
        self.state.max_steps = max(args.max_steps, 0)
        self.state.compute_steps(args, self.state.max_steps)  # save_steps as a fraction of max_steps, as train()'s
        if _name(args.save_strategy) == "steps":
            self._hp_search_setup(None)  # as train() does first: a rotation that would delete others' checkpoints is refused
        model, _ = self._prepare_for_training(max(args.max_steps, 1), None, None)
        return model

    def _step_optimizer(self, model) -> None:
        """Trainer's optimizer step, as its loop takes one after a minibatch's micro-batches."""
        args, state = self.args, self.state
        grad_norm = self._clip_grad_norm(model) if args.max_grad_norm > 0 else None
        grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)
        self.control = self.callback_handler.on_pre_optimizer_step(args, state, self.control)
        self.optimizer.step()
        self.control = self.callback_handler.on_optimizer_step(args, state, self.control)
        if not self.accelerator.optimizer_step_was_skipped:
            self.lr_scheduler.step()
        model.zero_grad()
        state.global_step += 1
        self._record({"grad_norm": grad_norm} if grad_norm is not None else {})

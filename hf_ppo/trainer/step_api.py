"""The step API: TRL 0.11's `PPOTrainer.step(queries, responses, scores)` for users who sample in a loop of their own.

`trainer.step(...)` runs one PPO iteration on the given samples through the ordinary path: the samples stand in for
steps 1-3 (`environment.GivenSamples`), `PPOLMTrainer._rollout` does steps 4-10 (penalties, old log-probs and values,
the reference, shaping, advantages, the non-finite guard, the KL controller), and the update is Trainer's own seams:
`training_step` per micro-batch (`compute_loss`, step 11), then `_clip_grad_norm`, `_get_grad_norm` (the guard),
`optimizer.step()`, `lr_scheduler.step()` and the optimizer-step callbacks, once per minibatch. It returns the
iteration's statistics under TRL 0.11's keys where hf_ppo has the quantity (`TRL_KEYS`), and under hf_ppo's own.
"""

from __future__ import annotations

import time

import torch

from ..rollout.environments import EnvSample, GivenSamples
from .data import PromptCollator
from .schedule import MinibatchSchedule

# TRL 0.11 stats key -> the hf_ppo metric with that meaning. TRL's "ppo/policy/ratio" was an array; here its mean.
TRL_KEYS = {
    "objective/kl": "objective/kl", "objective/kl_coef": "objective/kl_coef", "objective/entropy": "objective/entropy",
    "ppo/mean_non_score_reward": "objective/non_score_reward", "ppo/mean_scores": "objective/scores",
    "ppo/loss/policy": "loss/policy_avg", "ppo/loss/value": "loss/value_avg", "ppo/policy/entropy": "policy/entropy_avg",
    "ppo/policy/approxkl": "policy/approxkl_avg", "ppo/policy/clipfrac": "policy/clipfrac_avg",
    "ppo/policy/advantages_mean": "rollout/advantages_mean", "ppo/policy/ratio": "val/ratio",
    "ppo/returns/mean": "rollout/returns_mean", "ppo/val/clipfrac": "val/clipfrac_avg",
    "ppo/val/var_explained": "val/explained_variance",
}
_CONSTANT_SCHEDULES = ("constant", "constant_with_warmup")


def given_samples(queries, responses, scores, response_masks, *, expected: int, tokenizer, device) -> dict:
    """The rollout inputs of `step`: the prompts left-padded as the data collator pads them, and the samples as an
    environment's (`GivenSamples`). queries / responses: lists of 1-D token tensors; scores: scalars; response_masks:
    None (every response token is the policy's) or 1-D 0/1 per response token, 0 = an environment's token."""
    lists = {"queries": queries, "responses": responses, "scores": scores}
    if response_masks is not None:
        lists["response_masks"] = response_masks
    for name, value in lists.items():
        if not isinstance(value, (list, tuple)) or len(value) != expected:
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"step(): {name} must be a list of {expected} entries (rollout_batch_size = "
                             f"per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches), got {got}.")
    masks = response_masks if response_masks is not None else [torch.ones(len(r), dtype=torch.bool) for r in responses]
    samples = []
    for i, (response, mask, score) in enumerate(zip(responses, masks, scores)):
        score = torch.as_tensor(score, dtype=torch.float32)
        if score.numel() != 1:
            raise ValueError(f"step(): scores[{i}] has shape {tuple(score.shape)}: give one scalar score per sample.")
        samples.append(EnvSample(torch.as_tensor(response).long(), torch.as_tensor(mask).bool(), float(score)))
    rows = [{"input_ids": torch.as_tensor(q).long().tolist(), "prompt": tokenizer.decode(q, skip_special_tokens=True)}
            for q in queries]
    inputs = PromptCollator(tokenizer.pad_token_id)(rows)
    return {"queries": inputs["queries"].to(device), "query_mask": inputs["query_mask"].to(device),
            "prompts": inputs["prompts"], "environment": GivenSamples(samples)}


class StepAPI:
    """`PPOLMTrainer.step`: one PPO iteration on samples made by the caller (see the module docstring)."""

    def step(self, queries: list[torch.Tensor], responses: list[torch.Tensor], scores: list, response_masks=None) -> dict:
        """One PPO iteration (`optimizer_steps_per_iteration` optimizer steps) on `rollout_batch_size` samples.

        queries: prompt token ids (1-D each, no padding); responses: the tokens after each prompt (1-D, at most
        `response_length`); scores: one scalar each; response_masks: optional, 1-D 0/1 per response token, 0 marking
        tokens the policy did not sample (an environment's or a tool's output: context, never trained on). The
        learning-rate schedule spans `max_steps` (set it, or use a constant `lr_scheduler_type`). Returns the
        statistics: TRL 0.11's keys (`TRL_KEYS`, plus ppo/loss/total, ppo/std_scores, ppo/learning_rate,
        tokens/*_len_mean, time/ppo/total) and hf_ppo's metric names; they are logged too (`log`).
        """
        start, args = time.perf_counter(), self.args
        if args.max_refill_rounds:
            raise ValueError(f"step(): max_refill_rounds={args.max_refill_rounds} refills with prompts sampled from "
                             "train_dataset, and step() trains on the caller's samples: set max_refill_rounds=0 "
                             "(drop_uniform_groups still drops the uniform groups), or sample more in your loop.")
        inputs = given_samples(queries, responses, scores, response_masks, expected=args.rollout_batch_size,
                               tokenizer=self.processing_class, device=args.device)
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
                      "ppo/learning_rate": self._get_learning_rate(),
                      "tokens/queries_len_mean": batch.query_mask.sum(1).float().mean().item(),
                      "tokens/responses_len_mean": batch.response_mask.sum(1).float().mean().item(),
                      "time/ppo/total": time.perf_counter() - start})
        self.log({})  # the metrics of this iteration, to the loggers and `state.log_history`
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

    def _step_model(self):
        """The model `training_step` trains, with the optimizer and scheduler Trainer would make (once)."""
        if self.optimizer is not None and self.lr_scheduler is not None:
            return self.model_wrapped
        args = self.args
        schedule = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
        if args.max_steps <= 0 and schedule not in _CONSTANT_SCHEDULES:
            raise ValueError(f"step(): lr_scheduler_type={schedule!r} needs the run's length: set max_steps (optimizer "
                             "steps: iterations x num_ppo_epochs x num_mini_batches), or lr_scheduler_type='constant'.")
        self.state.max_steps = max(args.max_steps, 0)
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

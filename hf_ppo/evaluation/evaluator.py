"""Did it work? The policy against its reference on the eval prompts.

`trainer.evaluate()` (so `eval_strategy` / `eval_steps` during training, and `hf-ppo evaluate` on a saved policy)
samples a response from the policy and one from the reference for every eval prompt, with the training sampling
settings (steps 1-3, `rollout.sample_and_score`), and scores both with every training reward and every judge
(`eval_reward_model`: rewards that evaluation reads and training never sees). The reference's responses and scores
are sampled once per eval set and cached: the reference does not change, and every evaluation compares against the
same responses. Metrics, each under Trainer's prefix (`eval_`):

- `eval_reward/<name>/policy`, `.../reference`: the mean raw score of each side for each training reward
  (`eval_judge/<name>/...` for a judge);
- `.../win_rate`: the fraction of prompts where the policy's response scores above the reference's, ties counted
  half; `.../win_rate_low`, `.../win_rate_high`: its 95% percentile-bootstrap interval (`win_rate`);
- `eval_kl_to_reference`: KL(policy || reference) per response on the policy's samples (`kl_estimator`, summed over
  tokens, as `objective/kl`);
- `eval_policy/response_length`, `eval_reference/response_length` (tokens), `eval_policy/stop_rate`,
  `eval_reference/stop_rate` (the fraction of responses that ended with a stop token);
- `.../nonfinite`: the number of prompts where either side's score was NaN/inf. As training drops such rollouts,
  evaluation leaves those prompts out of that score's means and win rate, with a warning naming the reward or judge
  and a prompt; when no finite pair remains, the means, the win rate and its interval are NaN (never a loss, 0.0).
  `eval_loss` leaves NaN/inf training scores out of each batch's mean (a batch with none finite makes it NaN).

A side-by-side Markdown report (the metrics, then prompt / reference response and score / policy response and score)
goes to `output_dir/eval_report.md`, rewritten at each evaluation; a file of that name that hf_ppo did not write is
never touched (a warning says so).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..algorithms.ppo_math import kl_estimate, masked_sum
from ..rollout.rewards import RewardSet, decode_masked
from ..rollout.steps import policy_forward, reference_context, reference_logprobs, sample_and_score
from ..runtime.warn import warn_user
from .report import CONFIDENCE, NUM_BOOTSTRAP, REPORT_ROWS, write_report


def win_rate(policy_scores: torch.Tensor, reference_scores: torch.Tensor, *, num_bootstrap: int = NUM_BOOTSTRAP,
             seed: int = 0, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """The policy's win rate over the reference and its bootstrap interval: (rate, low, high).

    policy_scores, reference_scores (N,): the two responses' scores for each of N prompts. Each prompt's outcome is
    1 when the policy scores higher, 0.5 on a tie (equal scores), 0 otherwise; the rate is their mean. The interval is
    the percentile bootstrap: the (1 - confidence)/2 and (1 + confidence)/2 quantiles of the mean outcome over
    `num_bootstrap` resamples of the N prompts with replacement, drawn from a generator seeded with `seed` (the same
    scores always give the same interval), widened if needed to contain the rate itself. NaN/inf scores are refused:
    compared, a NaN would count as a loss (`evaluation_metrics` leaves such prompts out first).
    """
    if policy_scores.shape != reference_scores.shape or policy_scores.dim() != 1 or not policy_scores.numel():
        raise ValueError(f"win_rate needs two (N,) score tensors of one shape with N > 0, got "
                         f"{tuple(policy_scores.shape)} and {tuple(reference_scores.shape)}.")
    p, r = policy_scores.double().cpu(), reference_scores.double().cpu()
    bad = (~torch.isfinite(p) | ~torch.isfinite(r)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"win_rate got NaN/inf scores at {len(bad)} of {len(p)} positions (first: {bad[:5]}): a "
                         "non-finite score is no win and no loss. Leave those pairs out (torch.isfinite on both "
                         "sides) before calling win_rate.")
    outcome = (p > r).double() + 0.5 * (p == r).double()
    rate = outcome.mean().item()
    generator = torch.Generator().manual_seed(seed)
    resampled = outcome[torch.randint(len(outcome), (num_bootstrap, len(outcome)), generator=generator)].mean(1)
    tails = torch.tensor([(1 - confidence) / 2, (1 + confidence) / 2], dtype=torch.double)
    low, high = torch.quantile(resampled, tails).tolist()
    return rate, min(low, rate), max(high, rate)


@dataclass
class Side:
    """One side's (policy or reference) responses to a batch of eval prompts: decoded text, each reward's raw score
    {name: (B,)}, lengths (B,) in tokens and whether each stopped (B,) bool."""

    responses: list[str]
    scores: dict[str, torch.Tensor]
    lengths: torch.Tensor
    stopped: torch.Tensor


class _Generator(nn.Module):
    """A frozen reference model seen as `sample_and_score` expects a policy (a module that samples from
    `.policy_model`)."""

    def __init__(self, model):
        super().__init__()
        self.policy_model = model


class Evaluator:
    """Policy-vs-reference evaluation over an eval set, one batch at a time (`step`), then `finish`: the metrics and
    the report. `judges`: a `RewardSet` of the evaluation-only rewards, or None."""

    def __init__(self, judges: RewardSet | None = None):
        self.judges = judges
        self._reference: dict[tuple, Side] = {}  # per eval batch: sampled once, reused
        self._batches: list[tuple[list[str], Side, Side, dict]] = []

    def clear_reference_cache(self) -> None:
        """Forget the reference's cached responses (another reference, or other sampling settings)."""
        self._reference.clear()

    @torch.no_grad()
    def step(self, trainer, inputs: dict) -> torch.Tensor:
        """Sample and score both sides for one batch of eval prompts; return the eval loss (-mean training score of
        the policy's responses, as before this evaluation existed)."""
        policy = trainer.accelerator.unwrap_model(trainer.model)
        if getattr(trainer, "environment", None) is not None and not self._batches:
            warn_user("evaluate() samples one response per eval prompt from the policy and the reference and scores "
                      "them with the training rewards: the environment's episodes (turns, tools, its scores) are not "
                      "part of this evaluation. Evaluate multi-turn behaviour with your environment itself.")
        # The eval loader is sequential: a batch's position and prompts name it (a repeated prompt gets a sample of
        # its own from the reference, as from the policy).
        key = (len(self._batches), inputs["queries"].cpu().numpy().tobytes(),
               inputs["query_mask"].cpu().numpy().tobytes())
        if key not in self._reference:
            self._reference[key] = self._side(trainer, policy, inputs, reference=True)[0]
        side, combined, samples = self._side(trainer, policy, inputs, reference=False)
        args = trainer.args
        logprobs = policy_forward(policy, inputs["queries"], inputs["query_mask"], samples.responses,
                                  samples.response_mask, temperature=args.temperature,
                                  batch_size=args.local_rollout_forward_batch_size, with_values=False,
                                  memory_bytes=args.logits_memory_bytes)[0]
        ref_logprobs = reference_logprobs(policy, trainer.ref_model, inputs["queries"], inputs["query_mask"],
                                          samples.responses, samples.response_mask, temperature=args.temperature,
                                          batch_size=args.local_rollout_forward_batch_size,
                                          ref_adapter=trainer.ref_adapter, memory_bytes=args.logits_memory_bytes)
        kl = masked_sum(kl_estimate(logprobs, ref_logprobs, args.kl_estimator), samples.response_mask, dim=1)
        prompts = decode_masked(trainer.processing_class, inputs["queries"], inputs["query_mask"])
        # Gathered here, inside Trainer's loop, as it gathers its losses: the padding of a last uneven batch drops out.
        gathered = trainer.gather_function(_tensors(self._reference[key], side, kl))
        self._batches.append((prompts, self._reference[key], side, gathered))
        # NaN/inf scores are left out (as from the win rates); none finite: NaN, never a number that reads as real.
        return -combined[torch.isfinite(combined)].mean()

    def _side(self, trainer, policy, inputs: dict, reference: bool):
        """(Side, the combined training score (B,), the `Samples`) of the policy's or the reference's responses."""
        args, tokenizer = trainer.args, trainer.processing_class
        model, context = policy, contextlib.nullcontext()
        if reference and trainer.ref_model is not None:
            model = _Generator(trainer.ref_model)
        elif reference:
            context = reference_context(policy, trainer.ref_adapter)
        batch_size = args.local_rollout_forward_batch_size
        who = "reference" if reference else "policy"
        with context, _naming(f"while sampling the {who}'s responses and scoring them with the training reward(s) "
                              f"{trainer.rewards.names}", tokenizer, inputs):
            samples = sample_and_score(trainer.rollout_engine, model, trainer.rewards, inputs["queries"],
                                       inputs["query_mask"], inputs["prompts"], tokenizer=tokenizer,
                                       stop_token_ids=trainer.stop_token_ids, batch_size=batch_size)
        each = samples.reward_scores or {trainer.rewards.names[0]: samples.scores}  # one reward: its raw score
        scores = {f"reward/{k}": v for k, v in each.items()}
        if self.judges is not None:
            with _naming(f"while the judge(s) {self.judges.names} (eval_reward_model) scored the {who}'s responses",
                         tokenizer, inputs):
                judged = self.judges.score(queries=inputs["queries"], query_mask=inputs["query_mask"],
                                           responses=samples.responses, response_mask=samples.response_mask,
                                           tokenizer=tokenizer, prompts=inputs["prompts"], batch_size=batch_size)[1]
            scores.update({f"judge/{k}": v for k, v in judged.items()})
        side = Side(decode_masked(tokenizer, samples.responses, samples.response_mask), scores,
                    samples.response_mask.sum(1).float(), samples.contains_stop)
        return side, samples.scores, samples

    def finish(self, trainer, prefix: str = "eval") -> dict[str, float]:
        """The metrics of the batches seen since the last `finish` (gathered over processes), each named
        `{prefix}_...`; the report written to `output_dir` on the main process. {} when no batch was seen."""
        batches, self._batches = self._batches, []
        if not batches:
            return {}
        merged = {k: torch.cat([b[3][k].float().cpu() for b in batches]) for k in batches[0][3]}
        metrics = evaluation_metrics(merged, seed=trainer.args.seed)
        if trainer.is_world_process_zero():
            _warn_nonfinite(metrics, merged, [(prompts, ref, pol) for prompts, ref, pol, _ in batches], prefix)
        if trainer.is_world_process_zero() and trainer.args.should_save:
            rows = [row for prompts, ref, pol, _ in batches for row in _rows(prompts, ref, pol)][:REPORT_ROWS]
            write_report(trainer.args.output_dir, metrics, rows, step=trainer.state.global_step,
                         num_prompts=len(merged["kl"]))
        return {f"{prefix}_{k}": v for k, v in metrics.items()}


@contextlib.contextmanager
def _naming(doing: str, tokenizer, inputs: dict):
    """An error raised inside (a reward's own KeyError, say) keeps its type and traceback and gains a note: what
    evaluation was doing, and the batch's first prompt. (Python 3.10 has no notes: the error passes as it is.)"""
    try:
        yield
    except Exception as err:
        if hasattr(err, "add_note"):
            first = decode_masked(tokenizer, inputs["queries"][:1], inputs["query_mask"][:1])[0]
            err.add_note(f"hf_ppo: raised in evaluate() {doing}, on a batch of {len(inputs['queries'])} eval prompts "
                         f"starting with {first[:200]!r}.")
        raise


def _tensors(reference: Side, policy: Side, kl: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {"kl": kl.float()}
    for name, side in (("reference", reference), ("policy", policy)):
        out.update({f"{name}|{k}": v.float() for k, v in side.scores.items()})
        out[f"{name}|length"], out[f"{name}|stopped"] = side.lengths.float(), side.stopped.float()
    return out


def evaluation_metrics(tensors: dict[str, torch.Tensor], seed: int = 0) -> dict[str, float]:
    """The metrics (named as in the module docstring, without the prefix) from per-prompt tensors (N,):
    "kl", and "policy|<score name>", "reference|<score name>", "policy|length", "policy|stopped" (and the
    reference's)."""
    metrics = {}
    for key in [k for k in tensors if k.startswith("policy|") and k not in ("policy|length", "policy|stopped")]:
        name = key.split("|", 1)[1]
        policy, reference = tensors[key], tensors[f"reference|{name}"]
        finite = torch.isfinite(policy) & torch.isfinite(reference)  # a pair with a NaN/inf side is left out
        policy, reference = policy[finite], reference[finite]
        if finite.any():
            rate, low, high = win_rate(policy, reference, seed=seed)
            means = policy.mean().item(), reference.mean().item()
        else:
            rate = low = high = math.nan
            means = math.nan, math.nan
        metrics.update({f"{name}/policy": means[0], f"{name}/reference": means[1], f"{name}/win_rate": rate,
                        f"{name}/win_rate_low": low, f"{name}/win_rate_high": high,
                        f"{name}/nonfinite": float((~finite).sum())})
    metrics["kl_to_reference"] = tensors["kl"].mean().item()
    for side in ("policy", "reference"):
        metrics[f"{side}/response_length"] = tensors[f"{side}|length"].mean().item()
        metrics[f"{side}/stop_rate"] = tensors[f"{side}|stopped"].mean().item()
    return metrics


def _warn_nonfinite(metrics: dict[str, float], merged: dict[str, torch.Tensor],
                    batches: list[tuple[list[str], Side, Side]], prefix: str) -> None:
    """One warning per reward or judge that gave NaN/inf in this evaluation: the counts (`merged`: over all
    processes), which side, a prompt (of this process's `batches`, when it has one) and what became of the metrics."""
    for key in [k for k in metrics if k.endswith("/nonfinite") and metrics[k]]:
        name = key[:-len("/nonfinite")]
        kind, short = name.split("/", 1)
        sides = {side: int((~torch.isfinite(merged[f"{side}|{name}"])).sum()) for side in ("policy", "reference")}
        example = None
        for prompts, reference, policy in batches:
            bad = ~torch.isfinite(policy.scores[name]) | ~torch.isfinite(reference.scores[name])
            if example is None and bad.any():
                example = prompts[int(bad.nonzero()[0])]
        which = " and ".join(f"{n} on the {side}'s responses" for side, n in sides.items() if n)
        nothing_left = math.isnan(metrics[f"{name}/win_rate"])
        warn_user(
            f"Evaluation: the {'judge' if kind == 'judge' else 'reward'} {short!r} returned NaN/inf for "
            f"{int(metrics[key])} eval prompts ({which})"
            + (f", e.g. the prompt {example[:200]!r}" if example is not None else "") + ". "
            + ("No prompt has finite scores on both sides: its means, win rate and interval are NaN (no finite "
               "scores), not a loss. " if nothing_left else
               "Those prompts are left out of its means and win rate. ")
            + f"The count is logged as `{prefix}_{name}/nonfinite`. Make the {kind} return finite floats for every "
              "(prompt, completion).")


def _rows(prompts: list[str], reference: Side, policy: Side) -> list[tuple[str, str, dict, str, dict]]:
    def scores(side: Side, i: int) -> dict:
        return {k: v[i].item() for k, v in side.scores.items()}

    return [(p, reference.responses[i], scores(reference, i), policy.responses[i], scores(policy, i))
            for i, p in enumerate(prompts)]

"""Did it work? The policy against its reference on the eval prompts.

`trainer.evaluate()` (so `eval_strategy` / `eval_steps` during training, and `hf-ppo evaluate` on a saved policy)
samples `num_eval_samples` (k, default 1) responses from the policy and k from the reference for every eval prompt,
with the training sampling settings (steps 1-3, `rollout.sample_and_score`), and scores them with every training
reward and every judge (`eval_reward_model`: rewards that evaluation reads and training never sees); reward functions
get the prompt's dataset columns, as in training. The reference's responses and scores are sampled once per eval set
and cached: the reference does not change, and every evaluation compares against the same responses. Its sampling
is seeded on its own (the run's `seed`, the batch's position), so two evaluations of different policies on the same
prompts with the same seed show the same reference rows. Sample j of
the policy is paired with sample j of the reference for the same prompt; a pair is *scored* when both sides' scores
are finite and neither reward function returned None (does not apply). Metrics, each under Trainer's prefix
(`eval_`):

- `eval_reward/<name>/policy`, `.../reference`: the mean raw score of each side over the scored pairs, for each
  training reward (`eval_judge/<name>/...` for a judge): for a 0/1 reward, the accuracy;
- `.../win_rate`: the fraction of scored pairs where the policy's response scores above the reference's, ties
  counted half; `.../win_rate_low`, `.../win_rate_high`: its 95% percentile-bootstrap interval over prompts
  (`win_rate`);
- with k > 1, for a score whose every scored value is 0 or 1: `.../pass@j/policy`, `.../pass@j/reference` for j in
  1, the powers of 2 below k, and k (`pass_ks`): the unbiased pass@j of Chen et al. 2021 (`pass_at_k`), averaged
  over the prompts with at least j scored pairs; `.../pass@<k>/prompts`: how many prompts entered pass@k; and
  `eval_num_samples`, `eval_num_prompts`;
- `eval_kl_to_reference`: KL(policy || reference) per response on the policy's samples (`kl_estimator`, summed over
  tokens, as `objective/kl`), averaged over all k samples of every prompt;
- `eval_policy/response_length`, `eval_reference/response_length` (tokens), `eval_policy/stop_rate`,
  `eval_reference/stop_rate` (the fraction of responses that ended with a stop token);
- `eval_<name>/policy`, `eval_<name>/reference`: what a reward function logged with TRL's `log_metric(name, value)`
  while scoring that side's responses (the mean of its values), the two sides apart (`logged_metrics`);
- `.../nonfinite`: the number of pairs where either side's score was NaN/inf; `.../not_applicable`: the number of
  pairs where either side's reward function returned None. As training drops NaN rollouts, evaluation leaves those
  pairs out of that score's means, win rate and pass@k (NaN/inf with a warning naming the reward or judge and a
  prompt); when no scored pair remains, the means, the win rate and its interval are NaN (never a loss, 0.0).
  `eval_loss` leaves NaN/inf training scores out of each batch's mean (a batch with none finite makes it NaN).

A side-by-side Markdown report (the metrics, pass@k, then prompt / reference response and score / policy response and
score, one row per pair) goes to `output_dir/eval_report-step<N>.md`, one per evaluation, and to
`output_dir/eval_report.md`, the latest; a file of either name that hf_ppo did not write is never touched (a warning
says so).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..algorithms.ppo_math import LOGITS_MEMORY_BYTES, kl_estimate, masked_sum
from ..models.adapters import adapter_parameters
from ..rollout.engines import sampling_weights
from ..rollout.reward_calls import RewardLogs
from ..rollout.scoring import RewardSet, decode_masked
from ..rollout.steps import policy_forward, reference_context, reference_logprobs, sample_and_score
from ..runtime.warn import warn_user
from .report import CONFIDENCE, NUM_BOOTSTRAP, REPORT_ROWS, prompt_cell, system_prompt_of, write_report


def win_rate(policy_scores: torch.Tensor, reference_scores: torch.Tensor, *, num_bootstrap: int = NUM_BOOTSTRAP,
             seed: int = 0, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """The policy's win rate over the reference and its bootstrap interval: (rate, low, high).

    policy_scores, reference_scores (N,) or (N, k): the two sides' scores for each of N prompts, k samples each
    (sample j of the policy is paired with sample j of the reference). Each pair's outcome is 1 when the policy scores
    higher, 0.5 on a tie (equal scores), 0 otherwise; the rate is their mean. The interval is the percentile
    bootstrap over prompts (a prompt's k pairs are resampled together: they share the prompt): the
    (1 - confidence)/2 and (1 + confidence)/2 quantiles of the rate over `num_bootstrap` resamples of the N prompts
    with replacement, drawn from a generator seeded with `seed` (the same scores always give the same interval),
    widened if needed to contain the rate itself. NaN/inf scores are refused: compared, a NaN would count as a loss
    (`evaluation_metrics` leaves such pairs out first).
    """
    if (policy_scores.shape != reference_scores.shape or policy_scores.dim() not in (1, 2)
            or not policy_scores.numel()):
        raise ValueError(f"win_rate needs two (N,) or (N, k) score tensors of one shape with N > 0, got "
                         f"{tuple(policy_scores.shape)} and {tuple(reference_scores.shape)}.")
    p, r = policy_scores.double().cpu(), reference_scores.double().cpu()
    bad = (~torch.isfinite(p) | ~torch.isfinite(r)).flatten().nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"win_rate got NaN/inf scores at {len(bad)} of {p.numel()} positions (first: {bad[:5]}): a "
                         "non-finite score is no win and no loss. Leave those pairs out (torch.isfinite on both "
                         "sides) before calling win_rate.")
    p, r = p.reshape(len(p), -1), r.reshape(len(r), -1)
    return _paired_rate(_outcomes(p, r), torch.ones_like(p, dtype=torch.bool), num_bootstrap, seed, confidence)


def _outcomes(policy: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    return (policy > reference).double() + 0.5 * (policy == reference).double()


def _paired_rate(outcome: torch.Tensor, scored: torch.Tensor, num_bootstrap: int, seed: int,
                 confidence: float) -> tuple[float, float, float]:
    """(rate, low, high) of the outcomes (N, k) where `scored` (N, k) holds (at least one), bootstrapped over the
    prompts that have a scored pair."""
    keep = scored.any(1)
    wins, counts = (outcome * scored).sum(1)[keep], scored.sum(1)[keep].double()
    rate = (wins.sum() / counts.sum()).item()
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(wins), (num_bootstrap, len(wins)), generator=generator)
    resampled = wins[draws].sum(1) / counts[draws].sum(1)
    tails = torch.tensor([(1 - confidence) / 2, (1 + confidence) / 2], dtype=torch.double)
    low, high = torch.quantile(resampled, tails).tolist()
    return rate, min(low, rate), max(high, rate)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):
    the probability that at least one of k samples drawn without replacement from n samples, c of them correct, is
    correct: 1 - C(n - c, k) / C(n, k), computed as the product 1 - prod_{i = n-c+1}^{n} (1 - k / i), which never
    forms the (huge) binomials. Needs 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}.")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def pass_at_k_mean(correct: torch.Tensor, scored: torch.Tensor, k: int) -> tuple[float, int]:
    """(pass@k averaged over prompts, the number of prompts averaged): `correct` (N, m) 0/1 scores of m samples per
    prompt, `scored` (N, m) the samples that count (a NaN/inf or None score does not); a prompt with fewer than k
    scored samples has no pass@k and is left out. NaN when no prompt has k."""
    values = []
    for row_correct, row_scored in zip(correct.tolist(), scored.tolist()):
        n = sum(row_scored)
        if n >= k:
            values.append(pass_at_k(n, int(sum(c for c, s in zip(row_correct, row_scored) if s)), k))
    return (sum(values) / len(values) if values else math.nan), len(values)


def pass_ks(num_samples: int) -> list[int]:
    """The k of the pass@k metrics for `num_samples` samples per prompt: 1, the powers of 2 below it, and itself."""
    return sorted({1, num_samples, *(2 ** i for i in range(1, num_samples.bit_length()) if 2 ** i < num_samples)})


@dataclass
class Side:
    """One side's (policy or reference) responses to a batch of eval prompts, k samples per prompt, prompt-major (the
    k samples of prompt i are rows i*k .. i*k + k-1): decoded text, each reward's raw score {name: (B*k,)}, where each
    reward applied {name: (B*k,) bool} (False: the function returned None for that row), lengths (B*k,) in tokens
    and whether each stopped (B*k,) bool."""

    responses: list[str]
    scores: dict[str, torch.Tensor]
    lengths: torch.Tensor
    stopped: torch.Tensor
    applies: dict[str, torch.Tensor] = field(default_factory=dict)
    logged: dict[str, list[float]] = field(default_factory=dict)  # the reward functions' log_metric, this side's


class _Generator(nn.Module):
    """A frozen reference model seen as `sample_and_score` expects a policy (a module that samples from
    `.policy_model`)."""

    def __init__(self, model):
        super().__init__()
        self.policy_model = model


def repeated(inputs: dict, k: int) -> dict:
    """The eval batch with every prompt (its tokens, its prompt, its columns) repeated k times in a row, as
    `RolloutRepeatSampler` repeats prompts for `num_generations`: sample j of prompt i is row i*k + j."""
    if k == 1:
        return inputs
    out = dict(inputs, samples_per_prompt=k)
    out["queries"] = inputs["queries"].repeat_interleave(k, dim=0)
    out["query_mask"] = inputs["query_mask"].repeat_interleave(k, dim=0)
    out["prompts"] = [p for p in inputs["prompts"] for _ in range(k)]
    if inputs.get("columns"):
        out["columns"] = {name: [v for v in values for _ in range(k)] for name, values in inputs["columns"].items()}
    return out


@dataclass(frozen=True)
class EvalSettings:
    """What evaluation reads of the run's settings (`PPOConfig.eval_settings` builds it): `num_eval_samples`
    responses per prompt and side, the run's `seed` (the reference's sampling and the bootstrap are seeded from
    it), the sampling `temperature` of the log-probs, the rows per no-grad pass (`forward_batch_size`), the fp32 budget of
    the work on the logits (`memory_bytes`), the KL estimator, and the folder the reports go to (`output_dir`)."""

    temperature: float
    forward_batch_size: int
    output_dir: str
    num_eval_samples: int = 1
    seed: int = 42
    kl_estimator: str = "k1"
    memory_bytes: int = LOGITS_MEMORY_BYTES


class Evaluator:
    """Policy-vs-reference evaluation over an eval set, one batch at a time (`step`), then `finish`: the metrics and
    the report. `judges`: a `RewardSet` of the evaluation-only rewards, or None. Each call takes the run's
    `EvalSettings` as they are then (a setting changed between evaluations is read at the next)."""

    # `policy_step` when the evaluated policy's training step is not known (a folder saved without a record of it).
    UNKNOWN_STEP = -1

    def __init__(self, judges: RewardSet | None = None):
        self.judges = judges
        self._reference: dict[tuple, Side] = {}  # per eval batch: sampled once, reused
        self._batches: list[tuple[list[str], Side, Side, dict]] = []
        self._system_prompts: set[str | None] = set()  # the system message of each prompt seen (None: none)
        # The training step the report's title names: None, the trainer's own global_step (an evaluation during
        # training); `hf-ppo evaluate` sets the saved policy's, or UNKNOWN_STEP.
        self.policy_step: int | None = None

    def clear_reference_cache(self) -> None:
        """Forget the reference's cached responses (another reference, or other sampling settings)."""
        self._reference.clear()

    @torch.no_grad()
    def step(self, trainer, inputs: dict, settings: EvalSettings) -> torch.Tensor:
        """Sample `num_eval_samples` responses per prompt from each side and score them, for one batch of eval
        prompts; return the eval loss (-mean training score of the policy's responses, as before this evaluation
        existed)."""
        policy = trainer.accelerator.unwrap_model(trainer.model)
        if getattr(trainer, "environment", None) is not None and not self._batches:
            warn_user("evaluate() samples responses to each eval prompt from the policy and the reference and scores "
                      "them with the training rewards: the environment's episodes (turns, tools, its scores) are not "
                      "part of this evaluation. Evaluate multi-turn behaviour with your environment itself.")
        k = settings.num_eval_samples
        # The eval loader is sequential: a batch's position and prompts name it (a repeated prompt gets a sample of
        # its own from the reference, as from the policy).
        key = (len(self._batches), k, inputs["queries"].cpu().numpy().tobytes(),
               inputs["query_mask"].cpu().numpy().tobytes())
        inputs = repeated(inputs, k)
        if not self._batches:
            _warn_if_reference_is_policy(trainer, policy)
        if key not in self._reference:
            # Seeded on its own (the run's seed, the batch, the process), so the reference's responses are the same
            # whichever policy is evaluated and whatever it sampled before: a report's reference rows reproduce.
            seed = settings.seed + 1_000_003 * len(self._batches) + 7_919 * trainer.accelerator.process_index
            with _seeded(seed):
                self._reference[key] = self._side(trainer, policy, inputs, settings.forward_batch_size, reference=True)[0]
        side, combined, samples = self._side(trainer, policy, inputs, settings.forward_batch_size, reference=False)
        logprobs = policy_forward(policy, inputs["queries"], inputs["query_mask"], samples.responses,
                                  samples.response_mask, temperature=settings.temperature,
                                  batch_size=settings.forward_batch_size, with_values=False,
                                  memory_bytes=settings.memory_bytes)[0]
        ref_logprobs = reference_logprobs(policy, trainer.ref_model, inputs["queries"], inputs["query_mask"],
                                          samples.responses, samples.response_mask, temperature=settings.temperature,
                                          batch_size=settings.forward_batch_size, ref_adapter=trainer.ref_adapter,
                                          memory_bytes=settings.memory_bytes)
        kl = masked_sum(kl_estimate(logprobs, ref_logprobs, settings.kl_estimator), samples.response_mask, dim=1)
        # The report's prompt cells: the last user turn of a chat (its system prompt is shown once), else the text.
        decoded = decode_masked(trainer.processing_class, inputs["queries"], inputs["query_mask"])
        prompts = [prompt_cell(raw, text) for raw, text in zip(inputs["prompts"], decoded)]
        self._system_prompts.update(system_prompt_of(raw) for raw in inputs["prompts"])
        # Gathered here, inside Trainer's loop, as it gathers its losses: the padding of a last uneven batch drops out
        # (its rows are prompts: each tensor is (prompts, k)).
        gathered = trainer.gather_function(_tensors(self._reference[key], side, kl, k))
        self._batches.append((prompts, self._reference[key], side, gathered))
        # NaN/inf scores are left out (as from the win rates); none finite: NaN, never a number that reads as real.
        return -combined[torch.isfinite(combined)].mean()

    def _side(self, trainer, policy, inputs: dict, batch_size: int, reference: bool):
        """(Side, the combined training score (B,), the `Samples`) of the policy's or the reference's responses."""
        tokenizer = trainer.processing_class
        model, context, weights = policy, contextlib.nullcontext(), "policy"
        if reference and trainer.ref_model is not None:
            model, weights = _Generator(trainer.ref_model), "reference"
        elif reference:
            context = reference_context(policy, trainer.ref_adapter)
            weights = "base" if trainer.ref_adapter is None else "reference"  # the engine is told, never guesses
        who = "reference" if reference else "policy"
        columns = inputs.get("columns")
        with context, sampling_weights(weights), _naming(f"while sampling the {who}'s responses and scoring them with the training reward(s) "
                              f"{trainer.rewards.names}", tokenizer, inputs):
            # No gather: evaluation never moves the rewards' running statistics. The reward functions' log_metric
            # goes to this side's own log, so the policy's values and the reference's are reported apart.
            logs = RewardLogs()
            parts = replace(trainer.rollout_parts(), gather=None, hooks=logs.hooks(trainer.state))
            samples = sample_and_score(parts, model, inputs["queries"], inputs["query_mask"], inputs["prompts"],
                                       batch_size, columns)
        # Every reward's raw score and the rows it applies to (a function's None: applies False, score 0.0).
        each = samples.each_reward or {trainer.rewards.names[0]: (samples.scores, None)}
        scores = {f"reward/{k}": v for k, (v, _) in each.items()}
        applies = {f"reward/{k}": a for k, (_, a) in each.items() if a is not None}
        if self.judges is not None:
            with _naming(f"while the judge(s) {self.judges.names} (eval_reward_model) scored the {who}'s responses",
                         tokenizer, inputs):
                # Each judge on its own (never combined): a row only some judges skip (None) is no error.
                judged = self.judges.score_each(queries=inputs["queries"], query_mask=inputs["query_mask"],
                                                responses=samples.responses, response_mask=samples.response_mask,
                                                tokenizer=tokenizer, prompts=inputs["prompts"], batch_size=batch_size,
                                                columns=columns)
            scores.update({f"judge/{k}": v for k, (v, _) in judged.items()})
            applies.update({f"judge/{k}": a for k, (_, a) in judged.items()})
        side = Side(decode_masked(tokenizer, samples.responses, samples.response_mask), scores,
                    samples.response_mask.sum(1).float(), samples.contains_stop, applies, logs.metrics)
        return side, samples.scores, samples

    def finish(self, trainer, settings: EvalSettings, prefix: str = "eval") -> dict[str, float]:
        """The metrics of the batches seen since the last `finish` (gathered over processes), each named
        `{prefix}_...`; the report written to `output_dir` on the main process. {} when no batch was seen."""
        batches, self._batches = self._batches, []
        systems, self._system_prompts = self._system_prompts, set()
        if not batches:
            return {}
        merged = {k: torch.cat([b[3][k].float().cpu() for b in batches]) for k in batches[0][3]}
        metrics = evaluation_metrics(merged, seed=settings.seed)
        if trainer.is_world_process_zero():
            _warn_nonfinite(metrics, merged, [(prompts, ref, pol) for prompts, ref, pol, _ in batches], prefix)
        if trainer.is_world_process_zero():
            num_samples = merged["kl"].shape[1]
            rows = [row for prompts, ref, pol, _ in batches
                    for row in _rows(prompts, ref, pol, num_samples)][:REPORT_ROWS]
            step = trainer.state.global_step if self.policy_step is None else self.policy_step
            write_report(settings.output_dir, metrics, rows, step=None if step == self.UNKNOWN_STEP else step,
                         num_prompts=len(merged["kl"]), num_samples=num_samples,
                         system_prompt=next(iter(systems)) if len(systems) == 1 else None)
        metrics.update(logged_metrics([(ref, pol) for _, ref, pol, _ in batches]))
        return {f"{prefix}_{k}": v for k, v in metrics.items()}


def logged_metrics(sides: list[tuple[Side, Side]]) -> dict[str, float]:
    """What the reward functions logged with TRL's `log_metric` while scoring each side, `<name>/policy` and
    `<name>/reference` apart (the mean of the values logged over the (reference, policy) batches `sides`; this
    process's). The reference's come from the responses sampled once and cached, as its scores do."""
    values: dict[str, list[float]] = {}
    for reference, policy in sides:
        for who, side in (("reference", reference), ("policy", policy)):
            for name, logged in side.logged.items():
                values.setdefault(f"{name}/{who}", []).extend(logged)
    return {name: sum(v) / len(v) for name, v in sorted(values.items()) if v}


@contextlib.contextmanager
def _seeded(seed: int):
    """Run with torch's generators (CPU and CUDA) seeded with `seed`; on exit they are as they were, so the policy's
    sampling and training draw from the run's own stream, untouched."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _warn_if_reference_is_policy(trainer, policy) -> None:
    """Say so when the reference is the policy itself: an evaluation-only trainer (no train_dataset) whose policy is
    an adapter (a saved one given as `model`) and whose reference, with ref_model=None, is the frozen copy of that
    adapter made to continue training from it. It scores against itself (KL 0, win rates near 0.5) while it looks
    like a result. (Before training continues from an adapter, that is the start, and no warning is due.)"""
    name, body = trainer.ref_adapter, getattr(policy, "policy_model", policy)
    if (trainer.ref_model is not None or name is None or trainer.trained_adapter is None
            or getattr(trainer, "train_dataset", None) is not None or trainer.state.global_step):
        return
    trained = adapter_parameters(body, trainer.trained_adapter)
    reference = adapter_parameters(body, name)
    if len(trained) != len(reference) or not all(torch.equal(a, b) for a, b in zip(trained, reference)):
        return
    base = body.peft_config[trainer.trained_adapter].base_model_name_or_path
    warn_user(f"evaluate(): the reference is the policy itself. The policy is the adapter {trainer.trained_adapter!r} "
              f"(on {base!r}) and, with ref_model=None, its reference is a frozen copy of that adapter (the starting "
              "point when training continues from it), so KL is 0 and win rates are near 0.5: nothing is measured. "
              f"To evaluate a saved adapter against the model it was trained from, pass ref_model={base!r} (its "
              "base; with ref_quantization as in training), as `hf-ppo evaluate` does.")


@contextlib.contextmanager
def _naming(doing: str, tokenizer, inputs: dict):
    """An error raised inside (a reward's own KeyError, say) keeps its type and traceback and gains a note: what
    evaluation was doing, and the batch's first prompt. (Python 3.10 has no notes: the error passes as it is.)"""
    try:
        yield
    except Exception as err:
        if hasattr(err, "add_note"):
            first = decode_masked(tokenizer, inputs["queries"][:1], inputs["query_mask"][:1])[0]
            k = inputs.get("samples_per_prompt", 1)
            batch = f"{len(inputs['queries']) // k} eval prompts" + (f" x {k} samples" if k > 1 else "")
            err.add_note(f"hf_ppo: raised in evaluate() {doing}, on a batch of {batch} starting with "
                         f"{first[:200]!r}.")
        raise


def _tensors(reference: Side, policy: Side, kl: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Per-prompt tensors (B, k) to gather: "kl", "<side>|<score name>", "<side>|length", "<side>|stopped", and
    "applies:<side>|<score name>" (1.0 where the reward applied) for every score."""
    out = {"kl": kl.float().reshape(-1, k)}
    for name, side in (("reference", reference), ("policy", policy)):
        for score, values in side.scores.items():
            out[f"{name}|{score}"] = values.float().reshape(-1, k)
            applies = side.applies.get(score)
            out[f"applies:{name}|{score}"] = (torch.ones_like(values, dtype=torch.float) if applies is None else
                                              applies.to(values.device).float()).reshape(-1, k)
        out[f"{name}|length"] = side.lengths.float().reshape(-1, k)
        out[f"{name}|stopped"] = side.stopped.float().reshape(-1, k)
    return out


def evaluation_metrics(tensors: dict[str, torch.Tensor], seed: int = 0) -> dict[str, float]:
    """The metrics (named as in the module docstring, without the prefix) from per-prompt tensors, (N,) for one
    sample per prompt or (N, k) for k: "kl", and "policy|<score name>", "reference|<score name>", "policy|length",
    "policy|stopped" (and the reference's); optionally "applies:policy|<score name>" (and the reference's): 1.0 where
    the reward applied, 0.0 where its function returned None (absent: it applied everywhere).

    A (prompt, sample) pair is scored when both sides applied and both scores are finite; means, the win rate and
    pass@k read the scored pairs only, `nonfinite` and `not_applicable` count the others. pass@j (j in `pass_ks(k)`)
    is reported for k > 1 when every scored value of that score is 0 or 1.
    """
    tensors = {name: t.reshape(len(t), -1) for name, t in tensors.items()}
    k = tensors["kl"].shape[1]
    metrics = {}
    for key in [k_ for k_ in tensors if k_.startswith("policy|") and k_ not in ("policy|length", "policy|stopped")]:
        name = key.split("|", 1)[1]
        policy, reference = tensors[key], tensors[f"reference|{name}"]
        applies = torch.ones_like(policy, dtype=torch.bool)
        for side in ("policy", "reference"):
            if f"applies:{side}|{name}" in tensors:
                applies &= tensors[f"applies:{side}|{name}"].bool()
        finite = torch.isfinite(policy) & torch.isfinite(reference)  # a pair with a NaN/inf side is left out
        scored = finite & applies
        if scored.any():
            rate, low, high = _paired_rate(_outcomes(policy.double(), reference.double()), scored, NUM_BOOTSTRAP, seed,
                                           CONFIDENCE)
            means = policy[scored].mean().item(), reference[scored].mean().item()
        else:
            rate = low = high = math.nan
            means = math.nan, math.nan
        metrics.update({f"{name}/policy": means[0], f"{name}/reference": means[1], f"{name}/win_rate": rate,
                        f"{name}/win_rate_low": low, f"{name}/win_rate_high": high,
                        f"{name}/nonfinite": float((~finite).sum()), f"{name}/not_applicable": float((~applies).sum())})
        values = torch.cat([policy[scored], reference[scored]])
        if k > 1 and values.numel() and bool(((values == 0) | (values == 1)).all()):
            for j in pass_ks(k):
                for side, scores in (("policy", policy), ("reference", reference)):
                    metrics[f"{name}/pass@{j}/{side}"], used = pass_at_k_mean(scores.nan_to_num(0.0), scored, j)
            metrics[f"{name}/pass@{k}/prompts"] = float(used)
    metrics["kl_to_reference"] = tensors["kl"].mean().item()
    for side in ("policy", "reference"):
        metrics[f"{side}/response_length"] = tensors[f"{side}|length"].mean().item()
        metrics[f"{side}/stop_rate"] = tensors[f"{side}|stopped"].mean().item()
    if k > 1:
        metrics["num_samples"], metrics["num_prompts"] = float(k), float(len(tensors["kl"]))
    return metrics


def _warn_nonfinite(metrics: dict[str, float], merged: dict[str, torch.Tensor],
                    batches: list[tuple[list[str], Side, Side]], prefix: str) -> None:
    """One warning per reward or judge that gave NaN/inf in this evaluation: the counts (`merged`: over all
    processes), which side, a prompt (of this process's `batches`, when it has one) and what became of the metrics."""
    what = "eval prompts" if "num_samples" not in metrics else "sampled (prompt, response) pairs"
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
            f"{int(metrics[key])} {what} ({which})"
            + (f", e.g. the prompt {example[:200]!r}" if example is not None else "") + ". "
            + (f"No {'prompt' if 'num_samples' not in metrics else 'pair'} has finite scores on both sides: its "
               "means, win rate and interval are NaN (no finite scores), not a loss. " if nothing_left else
               "Those are left out of its means, win rate and pass@k. ")
            + f"The count is logged as `{prefix}_{name}/nonfinite`. Make the {kind} return finite floats for every "
              "(prompt, completion).")


def _rows(prompts: list[str], reference: Side, policy: Side, k: int = 1) -> list[tuple[str, str, dict, str, dict]]:
    """The report's rows: one per (prompt, sample) pair, the prompt marked with the sample's number when k > 1; a
    score of a reward that did not apply (None) is None."""
    def scores(side: Side, i: int) -> dict:
        return {name: (v[i].item() if name not in side.applies or bool(side.applies[name][i]) else None)
                for name, v in side.scores.items()}

    def label(i: int, prompt: str) -> str:
        return prompt if k == 1 else f"{prompt} (sample {i % k + 1}/{k})"

    return [(label(i, p), reference.responses[i], scores(reference, i), policy.responses[i], scores(policy, i))
            for i, p in enumerate(prompts)]

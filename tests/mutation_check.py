"""Mutation check: plant realistic wiring bugs one at a time and report which the test suite catches.

    python tests/mutation_check.py              # every mutation, 2 workers
    python tests/mutation_check.py -k shuffle   # only mutations whose name contains "shuffle"
    python tests/mutation_check.py --list       # the mutations, without running anything

Each mutation replaces an exact snippet of today's code (a file under hf_ppo/: rollout/, models/, algorithms/, trainer/)
with a bug of a kind a refactor introduces. It is applied to a temporary COPY of the repository (the working tree is never
touched), and a fast subset of the suite (`SUBSET`) runs against the copy with `-x`. The score is caught / total;
it must stay at 100%. A snippet that no longer appears exactly once in the code is reported STALE: when code moves,
move the mutation with it (same bug, new snippet). The script exits non-zero if a mutation is MISSED or STALE, or if
the unmutated subset does not pass. Not collected by pytest (the name does not start with `test_`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Fast tests that pin the wiring; the files that catch the most mutations run first (-x stops at the first failure).
SUBSET = [
    "tests/test_reference_iteration.py",
    "tests/test_wiring.py",
    "tests/test_trainer.py::test_gradient_accumulation_gives_the_whole_minibatch_gradient",
    "tests/test_estimators.py",
    "tests/test_critics.py",
    "tests/test_mixed_rewards.py",
    "tests/test_resume_settings.py",
    "tests/test_objective_wiring.py",
    "tests/test_guard_wiring.py",
    "tests/test_data.py",
]
COPIED = ["hf_ppo", "tests", "pyproject.toml"]


@dataclass
class Mutation:
    name: str
    bug: str  # the kind of bug, in the words
    edits: list[tuple[str, str, str]]  # (file under hf_ppo/, exact original snippet, replacement)


R = "rollout/steps.py"
RF = "rollout/refill.py"
SC = "trainer/schedule.py"
W = "rollout/rewards.py"
G = "rollout/engines.py"
LP = "models/policy.py"
PT = "models/pretrained.py"
AS = "trainer/assembly.py"
T = "trainer/ppo_trainer.py"
CR = "models/critics.py"
M = "models/value_head.py"
P = "algorithms/ppo_math.py"
E = "algorithms/estimators.py"
C = "trainer/config.py"
D = "trainer/data.py"
GU = "trainer/guard.py"
CK = "trainer/checkpoint.py"
ARANGE = "torch.arange({0}.shape[1], device={0}.device).expand_as({0})"
MUTATIONS = [
    # -- the reference ------------------------------------------------------------------------------------------------
    Mutation("ref_adapter_enabled", "reference log-probs computed with the LoRA adapter enabled",
             [(R, "    with reference_context(policy, ref_adapter):\n", "    with contextlib.nullcontext():\n")]),
    Mutation("adapter_disabled_noop", "reference log-probs computed with the LoRA adapter enabled",
             [(R, 'return peft_model.disable_adapter() if hasattr(peft_model, "disable_adapter") else contextlib.nullcontext()',
               "return contextlib.nullcontext()")]),
    Mutation("ref_is_policy", "frozen reference ignored: the policy scores itself (KL always 0)",
             [(R, "reference_logprobs(policy, ref_model,", "reference_logprobs(policy, None,")]),
    Mutation("ref_untempered", "reference log-probs without the sampling temperature",
             [(R, "policy_forward(ref_model, queries, query_mask, responses, response_mask, temperature=temperature,",
               "policy_forward(ref_model, queries, query_mask, responses, response_mask, temperature=1.0,")]),
    Mutation("ref_untempered_lora", "reference log-probs without the sampling temperature (adapter-disabled)",
             [(R, "response_mask, temperature=temperature, batch_size=batch_size, with_values=False,\n",
               "response_mask, temperature=1.0, batch_size=batch_size, with_values=False,\n")]),
    # -- the score ----------------------------------------------------------------------------------------------------
    Mutation("score_at_pad_slot", "reward model's score read at a pad slot instead of the last real token",
             [(W, "last = last_token_index(mask)",
               "last = torch.full_like(last_token_index(mask), mask.shape[1] - 1)")]),
    Mutation("score_attends_padding", "reward model attends the padding after the stop token",
             [(G, "attention_mask = torch.cat([query_mask, response_mask], dim=1).long()",
               "attention_mask = torch.cat([query_mask, torch.ones_like(response_mask)], dim=1).long()")]),
    Mutation("reward_tokenizer_ignored", "reward model with another tokenizer fed the policy's token ids",
             [(W, 'if formats == {"concat"} and same_tokenizer(tokenizer, chosen):', "if True:")]),
    Mutation("reward_text_without_prompt", "reward model with another tokenizer scores the completion alone",
             [(W, "encoded = reward_tokenizer([p + c for p, c in zip(prompt_texts, completions)], padding=True,",
               "encoded = reward_tokenizer(list(completions), padding=True,")]),
    Mutation("eos_penalty_to_stopped", "missing-EOS penalty given to responses that did stop",
             [(W, "missing_eos_penalty * (~contains_stop).float()", "missing_eos_penalty * contains_stop.float()")]),
    Mutation("eos_penalty_to_all", "missing-EOS penalty given to responses that did stop",
             [(W, "scores = scores - missing_eos_penalty * (~contains_stop).float()",
               "scores = scores - missing_eos_penalty")]),
    Mutation("stop_token_not_real", "the stop token left out of the response mask",
             [(R, "stops_before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()",
               "stops_before = torch.cumsum(is_stop.long(), dim=1)")]),
    Mutation("tokens_after_stop_kept", "tokens after the stop token not replaced by padding (sampler and truncation)",
             [(G, "token = sample_token(out.logits[:, -1], temperature, top_k, top_p).masked_fill(done, pad_token_id)",
               "token = sample_token(out.logits[:, -1], temperature, top_k, top_p)"),
              (R, "return responses.masked_fill(~mask, pad_token_id), mask, is_stop.any(dim=1)",
               "return responses, mask, is_stop.any(dim=1)")]),
    # -- positions and shifts -----------------------------------------------------------------------------------------
    Mutation("logprobs_shifted", "log-probs shifted by one position, consistently in rollout and loss",
             [(R, "logits = out.logits[:, :-1]\n", "logits = out.logits[:, 1:]\n"),
              (T, "out.logits[:, :-1], out.value if out.value is None else out.value[:, :-1], batch.responses,",
               "out.logits[:, 1:], out.value if out.value is None else out.value[:, :-1], batch.responses,")]),
    Mutation("values_shifted", "values shifted by one position, consistently in rollout and loss",
             [(R, "values.append(out.value[:, :-1].float())", "values.append(out.value[:, 1:].float())"),
              (T, "out.logits[:, :-1], out.value if out.value is None else out.value[:, :-1], batch.responses,",
               "out.logits[:, :-1], out.value if out.value is None else out.value[:, 1:], batch.responses,")]),
    Mutation("value_from_wrong_layer", "value head reads a hidden state other than the LM head's",
             [(M, "lambda module, args: head_input.append(args[0]))",
               "lambda module, args: head_input.append(torch.nn.functional.layer_norm(args[0], args[0].shape[-1:])))")]),
    Mutation("value_positions_misaligned", "value head reads the first positions instead of the kept ones",
             [(M, "lambda module, args: head_input.append(args[0]))",
               "lambda module, args: head_input.append(args[0].roll(1, dims=1)))")]),
    Mutation("positions_scoring", "position ids not derived from the attention mask (policy/reference passes)",
             [(G, "position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)",
               "position_ids = " + ARANGE.format("attention_mask"))]),
    Mutation("positions_generation", "position ids not derived from the attention mask (sampling)",
             [(G, "positions = (attention.cumsum(1) - 1).clamp(min=0)", "positions = " + ARANGE.format("attention"))]),
    Mutation("positions_reward", "position ids not derived from the attention mask (reward model)",
             [(W, "position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)", "position_ids = " + ARANGE.format("mask"))]),
    # -- temperature --------------------------------------------------------------------------------------------------
    Mutation("sampler_ignores_temperature", "the sampler ignoring temperature",
             [(G, "logits = logits.float() / temperature\n    if top_k:", "logits = logits.float()\n    if top_k:")]),
    Mutation("rollout_samples_at_t1", "the sampler ignoring temperature (not passed by the trainer)",
             [(T, "            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,",
               "            temperature=1.0, top_k=args.top_k, top_p=args.top_p,")]),
    Mutation("old_logprobs_untempered", "rollout log-probs without the sampling temperature",
             [(R, "logprobs.append(logprobs_from_logits(logits, responses[rows], temperature, memory_bytes))",
               "logprobs.append(logprobs_from_logits(logits, responses[rows], 1.0, memory_bytes))")]),
    Mutation("loss_logprobs_untempered", "loss log-probs without the sampling temperature",
             [(P, "logprobs = logprobs_from_logits(logits, responses, temperature, memory_bytes)",
               "logprobs = logprobs_from_logits(logits, responses, 1.0, memory_bytes)")]),
    # -- rewards, advantages, returns ---------------------------------------------------------------------------------
    Mutation("kl_estimator_ignored", "the configured KL estimator ignored",
             [(R, "kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)",
               'kl = kl_estimate(logprobs, ref_logprobs, "k1")')]),
    Mutation("advantages_not_whitened", "advantages never whitened although whiten_advantages=True",
             [(E, "whitened = masked_whiten(advantages, mask) if s.whiten_advantages else advantages",
               "whitened = advantages")]),
    Mutation("returns_from_whitened", "returns built from whitened advantages",
             [(E, '"advantages": whitened, "returns": returns}',
               '"advantages": whitened, "returns": torch.where(mask, masked_whiten(advantages, mask) + values, '
               'torch.zeros_like(advantages))}')]),
    Mutation("gamma_lam_swapped", "GAE hyperparameters swapped",
             [(C, "gamma=self.gamma, lam=self.lam", "gamma=self.lam, lam=self.gamma")]),
    # -- KL controller ------------------------------------------------------------------------------------------------
    Mutation("kl_ctl_fed_entropy", "the KL controller fed the wrong KL (the entropy)",
             [(T, "self.kl_ctl.update(stats[0].item(),", "self.kl_ctl.update(stats[1].item(),")]),
    Mutation("kl_ctl_fed_per_token_kl", "the KL controller fed the wrong KL (per token, not per response)",
             [(T, "self.kl_ctl.update(stats[0].item(),", "self.kl_ctl.update((stats[0] / stats[5]).item(),")]),
    Mutation("kl_coef_not_adapted", "rewards use the initial kl_coef, not the controller's",
             [(T, "kl_coef=self.kl_ctl.value,", "kl_coef=args.kl_coef,")]),
    # -- minibatches and the loss -------------------------------------------------------------------------------------
    Mutation("never_shuffled", "the minibatch order never shuffled",
             [(SC, "torch.stack([torch.randperm(len(batch), device=batch.queries.device)\n",
               "torch.stack([torch.arange(len(batch), device=batch.queries.device)\n")]),
    Mutation("same_order_every_epoch", "the minibatch order the same in every PPO epoch",
             [(SC, "torch.stack([torch.randperm(len(batch), device=batch.queries.device)\n"
                  "                              for _ in range(num_ppo_epochs * critic_passes)])",
               "torch.randperm(len(batch), device=batch.queries.device).expand(num_ppo_epochs * critic_passes, "
               "-1).clone()")]),
    Mutation("vf_coef_ignored", "vf_coef ignored",
             [(P, "loss = loss + vf_coef * vf_loss", "loss = loss + vf_loss")]),
    Mutation("entropy_sign", "the entropy bonus sign flipped",
             [(P, "loss = loss - entropy_coef *", "loss = loss + entropy_coef *")]),
    Mutation("old_logprobs_recomputed", "old log-probs recomputed every step (the ratio is always 1)",
             [(P, "policy_loss(logprobs, old_logprobs, advantages,", "policy_loss(logprobs, logprobs.detach(), advantages,")]),
    Mutation("old_values_recomputed", "old values recomputed every step (value clipping never acts)",
             [(P, "value_loss(values, old_values, returns,", "value_loss(values, values.detach(), returns,")]),
    Mutation("rollout_every_step", "old log-probs recomputed every step (a fresh rollout per micro-batch)",
             [(T, "if position == 0 or self._schedule is None or self._schedule.done:", "if True:")]),
    Mutation("micro_batch_normalizer", "loss normalised by the micro-batch's tokens, not the minibatch's",
             [(SC, '"normalizer": loss_normalizer(self.batch.policy_mask[minibatch], self.loss_aggregation),',
               '"normalizer": loss_normalizer(self.batch.policy_mask[minibatch[k * self.micro_batch_size:'
               '(k + 1) * self.micro_batch_size]], self.loss_aggregation),')]),
    # -- frozen models, aliasing, dropout -----------------------------------------------------------------------------
    Mutation("dropout_kept", "dropout left on",
             [(PT, "            module.p = 0.0\n", "            pass\n")]),
    Mutation("attention_dropout_kept", "dropout left on (Llama-family float attention dropout)",
             [(PT, "            setattr(obj, name, 0.0)\n", "            pass\n")]),
    Mutation("disable_dropout_skipped", "dropout left on (never called)",
             [(AS, "    if args.disable_dropout:\n", "    if False:\n")]),
    Mutation("frozen_trainable", "the reference (and reward) model left trainable",
             [(PT, "    model.requires_grad_(False)\n", "")]),
    Mutation("frozen_train_mode", "a frozen model left in training mode",
             [(PT, "    model.eval()\n    model.requires_grad_(False)\n", "    model.requires_grad_(False)\n")]),
    Mutation("ref_alias_not_copied", "a reference passed as an object aliasing the policy",
             [(LP, "        ref_model = copy.deepcopy(ref_model)\n", "        pass\n")]),
    Mutation("ref_alias_identity_only", "a reference aliasing the policy (a wrapper's body) not detected",
             [(LP, "elif _shares_parameters(ref_model, policy_source):", "elif ref_model is policy_source:")]),
    # -- advantage estimators, num_generations ---------------------------------------------------------------------------
    Mutation("groups_interleaved", "a prompt's k responses spread over the batch (and across devices)",
             [(D, "chunk = [i for i in order[start:start + self.prompts_per_batch] for _ in range(self.num_generations)]",
               "chunk = [i for _ in range(self.num_generations) for i in order[start:start + self.prompts_per_batch]]")]),
    Mutation("grpo_kl_loss_dropped", "grpo's KL loss term never applied",
             [(T, "kl_loss_coef=kl_loss_coef(args.advantage_estimator, self.kl_ctl.value, args.use_kl_loss))",
               "kl_loss_coef=0.0)")]),
    Mutation("critic_kept", "a critic-free estimator keeps the value head (memory, optimizer, checkpoint)",
             [(AS, "    if not ESTIMATORS[args.advantage_estimator].needs_critic:\n        policy = without_critic(",
               "    if False:\n        policy = without_critic(")]),
    Mutation("groups_ignored", "the group estimators see k=1 (each response its own group)",
             [(C, "num_generations=self.num_generations, scale_rewards", "num_generations=1, scale_rewards")]),
    # -- critics, mixed rewards ---------------------------------------------------------------------------------------
    Mutation("critic_adapter_scores", "the reward scored with the reward_lora critic's adapter enabled",
             [(CR, "with context() if context is not None else contextlib.nullcontext():",
               "with contextlib.nullcontext():")]),
    Mutation("warmup_moves_policy", "the critic warm-up lets the policy move",
             [(T, 'critic_only=inputs.get("critic_only") or self.state.global_step < args.critic_warmup_steps)',
               'critic_only=inputs.get("critic_only"))')]),
    Mutation("critic_passes_move_policy", "the critic-only passes (critic_updates_per_step) let the policy move",
             [(T, 'critic_only=inputs.get("critic_only") or self.state.global_step < args.critic_warmup_steps)',
               "critic_only=self.state.global_step < args.critic_warmup_steps)")]),
    Mutation("saved_critic_state_not_loaded", "critic_model=<a saved critic> rebuilds the critic but drops its state",
             [(AS, "        policy.load_critic_state_dict(saved.state)\n", "        pass\n")]),
    Mutation("uniform_groups_kept", "drop_uniform_groups never drops",
             [(R, "policy_mask=batch.policy_mask & kept)", "policy_mask=batch.policy_mask)")]),
    Mutation("refill_takes_uniform_groups", "the refill puts groups without signal in the dropped places",
             [(RF, "donors = (~extra_dropped.reshape(-1, k)[:, 0]).nonzero()",
               "donors = (extra_dropped.reshape(-1, k)[:, 0]).nonzero()")]),
    Mutation("refill_prompts_repeat_each_round", "every refill round samples the same extra prompts",
             [(D, "key = [self.seed, self.step, round_, self.process]", "key = [self.seed, self.step, 0, self.process]")]),
    Mutation("lam_critic_ignored", "the critic's returns use lam, not lam_critic",
             [(E, "returns = compute_gae(rewards, values, mask, s.gamma, s.lam_critic)[1]",
               "returns = compute_gae(rewards, values, mask, s.gamma, s.lam)[1]")]),
    Mutation("reward_weights_ignored", "mixed rewards summed without their weights",
             [(W, "term = self.weights[i] * scores", "term = scores")]),
    Mutation("reward_stats_not_restored", "a dropped NaN rollout moves the per-reward statistics",
             [(T, "            self.rewards.load_state_dict(each_moments)\n", "")]),
    # -- the objective's options on their way from PPOConfig to the loss -------------------------------------------------
    Mutation("clip_higher_swapped", "clip-higher wired backwards (low and high bounds swapped on the way to the loss)",
             [(T, "cliprange_low=args.cliprange_low, cliprange_high=args.cliprange_high,",
               "cliprange_low=args.cliprange_high, cliprange_high=args.cliprange_low,")]),
    Mutation("dual_clip_dropped", "the dual-clip setting never reaches the loss",
             [(T, "dual_clip=args.dual_clip,", "dual_clip=None,")]),
    Mutation("loss_aggregation_ignored", "loss_aggregation not passed to the loss (token_mean always)",
             [(T, "loss_aggregation=args.loss_aggregation, max_length", 'loss_aggregation="token_mean", max_length')]),
    Mutation("normalizer_token_count", "the minibatch normalizer always counts tokens, whatever the aggregation",
             [(C, "loss_aggregation=self.loss_aggregation, critic_passes",
               'loss_aggregation="token_mean", critic_passes')]),
    Mutation("cliprange_value_is_cliprange", "the value loss clipped with the policy's clip range",
             [(T, "cliprange_value=args.cliprange_value,", "cliprange_value=args.cliprange,")]),
    Mutation("entropy_coef_dropped", "entropy_coef never reaches the loss",
             [(T, "entropy_coef=args.entropy_coef,", "entropy_coef=0.0,")]),
    Mutation("kl_loss_initial_coef", "grpo's KL loss term at the initial kl_coef, not the controller's",
             [(T, "kl_loss_coef(args.advantage_estimator, self.kl_ctl.value, args.use_kl_loss)",
               "kl_loss_coef(args.advantage_estimator, args.kl_coef, args.use_kl_loss)")]),
    Mutation("use_kl_loss_ignored", "use_kl_loss never reaches the update (the KL leaves the reward for nothing)",
             [(T, "kl_loss_coef(args.advantage_estimator, self.kl_ctl.value, args.use_kl_loss)",
               "kl_loss_coef(args.advantage_estimator, self.kl_ctl.value)")]),
    Mutation("bias_correction_kl_ignored", "use_bias_correction_kl never reaches the loss",
             [(T, "use_bias_correction_kl=args.use_bias_correction_kl,", "use_bias_correction_kl=False,")]),
    Mutation("sequence_ratio_ignored", "importance_sampling_level never reaches the loss",
             [(T, "importance_sampling_level=args.importance_sampling_level,", 'importance_sampling_level="token",')]),
    Mutation("whiten_rewards_ignored", "whiten_rewards never reaches the estimator",
             [(C, "whiten_rewards=self.whiten_rewards", "whiten_rewards=False")]),
    Mutation("reward_clip_ignored", "reward_clip not applied to normalised scores",
             [(T, "reward_clip=args.reward_clip,", "reward_clip=None,")]),
    Mutation("normalize_rewards_ignored", "normalize_rewards builds no running moments",
             [(T, "RunningMoments() if args.normalize_rewards else None", "None")]),
    # -- the non-finite guard -------------------------------------------------------------------------------------------
    Mutation("guard_grad_norm_nan_only", "the guard checks the gradient norm for NaN but not for infinities",
             [(GU, "return value is None or math.isfinite(float(value))",
               "return value is None or not math.isnan(float(value))")]),
    Mutation("guard_rollout_nan_only", "the guard checks the rollout for NaN but not for infinities",
             [(GU, "counts = [(~torch.isfinite(batch.scores)).sum()]", "counts = [torch.isnan(batch.scores).sum()]"),
              (GU, "(~torch.isfinite(getattr(batch, name)) & mask)", "(torch.isnan(getattr(batch, name)) & mask)")]),
    Mutation("skipped_step_zero_grads", "a skipped step zeroes the gradients: Adam's moments, step and weight decay "
             "still move the weights", [(T, "model.zero_grad(set_to_none=True)", "model.zero_grad(set_to_none=False)")]),
    Mutation("skipped_step_steps", "a non-finite step is counted but the optimizer still steps",
             [(T, "            model.zero_grad(set_to_none=True)\n", "            pass\n")]),
    Mutation("reward_moments_not_restored", "a dropped rollout's scores stay in the reward normalisation's moments",
             [(T, "                self.reward_moments.load_state_dict(moments)\n", "                pass\n")]),
    # -- the resume comparison ------------------------------------------------------------------------------------------
    Mutation("resume_skips_a_field", "the resume comparison skips a field that changes the run",
             [(CK, '_NOT_COMPARED = {"model_init_kwargs",', '_NOT_COMPARED = {"cliprange_high", "model_init_kwargs",')]),
    Mutation("resume_skips_seed", "the resume comparison skips the seed (the prompt order)",
             [(CK, '_GEOMETRY = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed")',
               '_GEOMETRY = ("per_device_train_batch_size", "gradient_accumulation_steps")')]),
    # -- environments: their tokens are context (tests/test_environment.py, tests/test_ppo_math.py) --------------------
    Mutation("env_tokens_in_loss", "an environment's tokens trained on as actions (the loss reads the response mask)",
             [(T, 'batch.returns, batch.policy_mask, inputs["normalizer"],',
               'batch.returns, batch.response_mask, inputs["normalizer"],')]),
    Mutation("env_tokens_in_advantages", "KL penalty, rewards and advantages on an environment's tokens",
             [(R, "compute_advantages(logprobs, ref_logprobs, values, policy_mask,",
               "compute_advantages(logprobs, ref_logprobs, values, response_mask,")]),
    Mutation("gae_no_bootstrap_across_env", "GAE ends the episode at an environment segment (no bootstrap across it)",
             [(P, "next_value = torch.where(real, values[:, t], next_value)",
               "next_value = torch.where(real, values[:, t], torch.zeros_like(next_value))")]),
    Mutation("step_rewards_dropped", "an environment's per-position rewards never reach GAE",
             [(E, "rewards = rewards + torch.where(mask, step_rewards, torch.zeros_like(step_rewards))",
               "rewards = rewards")]),
]

THREADS_PLUGIN = '''"""Loaded by tests/mutation_check.py with -p: one torch thread per run (two runs share the cores)."""
import torch


def pytest_sessionstart(session):
    torch.set_num_threads(1)
'''


def make_copy(dest: Path) -> None:
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif source.exists():
            shutil.copy2(source, dest / name)
    (dest / "_mutation_threads.py").write_text(THREADS_PLUGIN)


def check_snippets(mutation: Mutation) -> str | None:
    """None when every edit's snippet occurs exactly once in today's code, else why it is stale."""
    for file, old, _ in mutation.edits:
        count = (ROOT / "hf_ppo" / file).read_text().count(old)
        if count != 1:
            return f"snippet found {count} times in hf_ppo/{file}: {old.strip()[:60]!r}"
    return None


def run_subset(copy: Path, timeout: int, tests: list[str] = SUBSET) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "_mutation_threads",
               "-W", "ignore", *tests]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        code, output = -1, "TIMEOUT"
    return code, output, time.perf_counter() - start


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ")[0].replace("tests/", "")
    return "TIMEOUT" if output == "TIMEOUT" else "(no test named: see the run's output)"


def run_mutation(mutation: Mutation, copy: Path, timeout: int, tests: list[str] = SUBSET) -> tuple[str, str, float]:
    originals = {}
    try:
        for file, old, new in mutation.edits:
            path = copy / "hf_ppo" / file
            text = originals.setdefault(path, path.read_text())
            current = path.read_text()
            path.write_text(current.replace(old, new, 1))
        code, output, seconds = run_subset(copy, timeout, tests)
    finally:
        for path, text in originals.items():
            path.write_text(text)
    return ("caught" if code != 0 else "MISSED"), (first_failure(output) if code != 0 else ""), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this (comma-separated: any)")
    parser.add_argument("--jobs", type=int, default=2, help="mutations run in parallel (each in its own copy)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run of the subset")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--tests", nargs="+", default=SUBSET,
                        help="run these tests instead of SUBSET (quicker; caught by them is caught by SUBSET)")
    args = parser.parse_args()
    mutations = [m for m in MUTATIONS if any(k in m.name for k in args.k.split(","))]
    if args.list:
        for m in mutations:
            print(f"{m.name:28s} {', '.join(sorted({f for f, _, _ in m.edits})):24s} {m.bug}")
        return 0

    stale = {m.name: why for m in mutations if (why := check_snippets(m))}
    runnable = [m for m in mutations if m.name not in stale]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_ppo_mutants_") as tmp:
        copies = [Path(tmp) / f"copy{i}" for i in range(max(1, args.jobs))]
        for copy in copies:
            copy.mkdir()
            make_copy(copy)
        code, output, seconds = run_subset(copies[0], args.timeout, args.tests)
        if code != 0:
            print(output[-4000:])
            print(f"The unmutated subset fails ({seconds:.0f} s): fix the suite before checking mutations.")
            return 2
        print(f"baseline: the unmutated subset passes in {seconds:.0f} s; running {len(runnable)} mutations "
              f"with {len(copies)} worker(s)", flush=True)
        free = list(copies)

        def work(mutation):
            copy = free.pop()
            try:
                result = run_mutation(mutation, copy, args.timeout, args.tests)
            finally:
                free.append(copy)
            print(f"  {mutation.name}: {result[0]} ({result[2]:.0f} s)", flush=True)
            return result

        with ThreadPoolExecutor(max_workers=len(copies)) as pool:
            results = dict(zip([m.name for m in runnable], pool.map(work, runnable)))

    print(f"\n{'mutation':28s} {'file(s)':24s} {'result':7s} {'secs':>5s}  caught by / bug")
    for m in mutations:
        files = ", ".join(sorted({f for f, _, _ in m.edits}))
        if m.name in stale:
            print(f"{m.name:28s} {files:24s} {'STALE':7s} {'':>5s}  {stale[m.name]}")
            continue
        result, test, seconds = results[m.name]
        print(f"{m.name:28s} {files:24s} {result:7s} {seconds:5.0f}  {test or m.bug}")
    caught = sum(r[0] == "caught" for r in results.values())
    print(f"\nscore: {caught}/{len(mutations)} caught ({100 * caught / max(1, len(mutations)):.0f}%), "
          f"{len(mutations) - len(runnable)} stale, {time.perf_counter() - start:.0f} s")
    return 0 if caught == len(mutations) else 1


if __name__ == "__main__":
    sys.exit(main())

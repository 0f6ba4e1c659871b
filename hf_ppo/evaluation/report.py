"""The evaluation report apart from the sampling: `eval_report.md` (metrics, then prompt / reference / policy side
by side), the metrics as Markdown tables (`metrics_markdown`, also what `hf-ppo evaluate` prints), and
`final_evaluation`, which publishing reads from the log history. Nothing here samples, so the Hub code can use it."""

from __future__ import annotations

import math
import os

from ..runtime.warn import warn_user

NUM_BOOTSTRAP = 1000
CONFIDENCE = 0.95
REPORT_FILE = "eval_report.md"
REPORT_MARK = "<!-- hf_ppo evaluation report: rewritten by hf_ppo at each evaluation -->"
REPORT_ROWS = 16  # samples shown side by side in the report


def score_names(metrics: dict[str, float], prefix: str = "") -> list[str]:
    """The scores ('reward/<name>' and 'judge/<name>') that `metrics` (named `{prefix}...`) hold a win rate for."""
    return [k[len(prefix):-len("/win_rate")] for k in metrics if k.startswith(prefix) and k.endswith("/win_rate")]


def metrics_markdown(metrics: dict[str, float], prefix: str = "") -> str:
    """The metrics as two Markdown tables (per score; per side), readable as plain text too."""
    lines = ["| score | policy | reference | policy win rate (95% CI) |", "|---|---|---|---|"]
    for name in score_names(metrics, prefix):
        m = {k: metrics[f"{prefix}{name}/{k}"] for k in ("policy", "reference", "win_rate", "win_rate_low",
                                                            "win_rate_high")}
        # Prompts with a NaN/inf score were left out (evaluation/evaluator.py); none left: no number to show.
        left_out = int(metrics.get(f"{prefix}{name}/nonfinite", 0) or 0)
        if math.isnan(m["win_rate"]):
            lines.append(f"| {name} | no finite scores | no finite scores | no finite scores ({left_out or 'all'} "
                         "prompts NaN/inf) |")
            continue
        note = f" ({left_out} prompts left out: NaN/inf)" if left_out else ""
        lines.append(f"| {name} | {m['policy']:.4g} | {m['reference']:.4g} | {m['win_rate']:.3f} "
                     f"[{m['win_rate_low']:.3f}, {m['win_rate_high']:.3f}]{note} |")
    lines += ["", "| | policy | reference |", "|---|---|---|"]
    for label, key in (("mean response length (tokens)", "response_length"), ("stop rate", "stop_rate")):
        policy, reference = metrics[f"{prefix}policy/{key}"], metrics[f"{prefix}reference/{key}"]
        lines.append(f"| {label} | {policy:.3f} | {reference:.3f} |")
    lines += ["", f"KL(policy || reference) per response, on the policy's samples: "
                  f"{metrics[f'{prefix}kl_to_reference']:.4f}"]
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Text made safe for one Markdown table cell."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return text.replace("\r", "").replace("\n", "<br>") or " "


def _score_cell(scores: dict) -> str:
    return "<br>".join(f"{name}: {value:.4g}" for name, value in scores.items())


def write_report(output_dir: str, metrics: dict[str, float], rows: list, *, step: int, num_prompts: int) -> str | None:
    """Write `output_dir/eval_report.md` (the metrics, then `rows` side by side); return its path, or None (with a
    warning) when a file of that name exists that hf_ppo did not write."""
    path = os.path.join(output_dir, REPORT_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.readline().rstrip("\n") != REPORT_MARK:
                warn_user(f"{path} exists and was not written by hf_ppo: the evaluation report was not written. "
                          f"Move that file, or use another output_dir.")
                return None
    lines = [REPORT_MARK, f"# The policy against its reference (step {step})", "",
             f"{num_prompts} eval prompts, one response each from the policy and from the reference, sampled with "
             "the training sampling settings and scored by every training reward (`reward/...`) and judge "
             "(`judge/...`). Win rate: the fraction of prompts where the policy's response scores higher, ties "
             f"counted half; the interval is a {CONFIDENCE:.0%} bootstrap interval ({NUM_BOOTSTRAP} resamples).", "",
             metrics_markdown(metrics), "", f"## Samples (the first {len(rows)})", "",
             "| prompt | reference response | reference score | policy response | policy score |",
             "|---|---|---|---|---|"]
    for prompt, ref_text, ref_scores, pol_text, pol_scores in rows:
        lines.append(f"| {_cell(prompt)} | {_cell(ref_text)} | {_score_cell(ref_scores)} | {_cell(pol_text)} | "
                     f"{_score_cell(pol_scores)} |")
    os.makedirs(output_dir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def final_evaluation(log_history: list[dict], prefix: str = "eval_") -> tuple[int | None, str | None]:
    """(step, Markdown tables) of the last evaluation in a Trainer `log_history`, or (None, None) when none ran."""
    for entry in reversed(log_history):
        if score_names(entry, prefix):
            return entry.get("step"), metrics_markdown(entry, prefix)
    return None, None

"""The evaluation report apart from the sampling: `eval_report-step<N>.md` per evaluation and `eval_report.md`, the
latest (metrics, then prompt / reference / policy side by side), the metrics as Markdown tables (`metrics_markdown`, also what `hf-ppo evaluate` prints), and
`final_evaluation`, which publishing reads from the log history; and `hf-ppo evaluate`'s `metrics.json`
(`write_metrics`). A report or metrics.json hf_ppo did not write is never replaced. Nothing here samples, so the Hub
code can use it."""

from __future__ import annotations

import itertools
import json
import math
import os

from ..runtime.warn import warn_user

NUM_BOOTSTRAP = 1000
CONFIDENCE = 0.95
REPORT_FILE = "eval_report.md"  # the latest evaluation's report
STEP_REPORT_FILE = "eval_report-step{step}.md"  # each evaluation's, kept
# The first line of every report: hf_ppo rewrites only files that start with it (earlier versions wrote the same
# opening with other words after it).
REPORT_MARK = "<!-- hf_ppo evaluation report: written by hf_ppo, which rewrites it -->"
_MARK_START = "<!-- hf_ppo evaluation report"
REPORT_ROWS = 16  # samples shown side by side in the report
METRICS_FILE = "metrics.json"  # what `hf-ppo evaluate` writes beside the report
# The stamp of a metrics.json hf_ppo wrote (an earlier version's is recognised by its keys: `_our_metrics`).
METRICS_STAMP = {"written_by": "hf-ppo evaluate"}


def score_names(metrics: dict[str, float], prefix: str = "") -> list[str]:
    """The scores ('reward/<name>' and 'judge/<name>') that `metrics` (named `{prefix}...`) hold a win rate for."""
    return [k[len(prefix):-len("/win_rate")] for k in metrics if k.startswith(prefix) and k.endswith("/win_rate")]


def metrics_markdown(metrics: dict[str, float], prefix: str = "") -> str:
    """The metrics as Markdown tables (per score; with several samples per prompt, pass@k per score; per side),
    readable as plain text too."""
    k = int(metrics.get(f"{prefix}num_samples", 1) or 1)
    unit = "prompts" if k == 1 else "samples"
    lines = ["| score | policy | reference | policy win rate (95% CI) |", "|---|---|---|---|"]
    for name in score_names(metrics, prefix):
        m = {k_: metrics[f"{prefix}{name}/{k_}"] for k_ in ("policy", "reference", "win_rate", "win_rate_low",
                                                             "win_rate_high")}
        # Pairs with a NaN/inf score or a None (does not apply) were left out (evaluation/evaluator.py).
        left_out = int(metrics.get(f"{prefix}{name}/nonfinite", 0) or 0)
        not_applicable = int(metrics.get(f"{prefix}{name}/not_applicable", 0) or 0)
        if math.isnan(m["win_rate"]):
            why = " and ".join([f"{left_out} {unit} NaN/inf"] * bool(left_out)
                               + [f"{not_applicable} {unit} None"] * bool(not_applicable)) or f"all {unit} NaN/inf"
            lines.append(f"| {name} | no finite scores | no finite scores | no finite scores ({why}) |")
            continue
        notes = ([f"{left_out} {unit} left out: NaN/inf"] * bool(left_out)
                 + [f"{not_applicable} {unit} left out: None, does not apply"] * bool(not_applicable))
        note = f" ({'; '.join(notes)})" if notes else ""
        lines.append(f"| {name} | {m['policy']:.4g} | {m['reference']:.4g} | {m['win_rate']:.3f} "
                     f"[{m['win_rate_low']:.3f}, {m['win_rate_high']:.3f}]{note} |")
    if k > 1:
        lines += ["", *pass_at_k_lines(metrics, prefix, k)]
    lines += ["", "| | policy | reference |", "|---|---|---|"]
    for label, key in (("mean response length (tokens)", "response_length"), ("stop rate", "stop_rate")):
        policy, reference = metrics[f"{prefix}policy/{key}"], metrics[f"{prefix}reference/{key}"]
        lines.append(f"| {label} | {policy:.3f} | {reference:.3f} |")
    lines += ["", f"KL(policy || reference) per response, on the policy's samples: "
                  f"{metrics[f'{prefix}kl_to_reference']:.4f}"]
    return "\n".join(lines)


def pass_at_k_lines(metrics: dict[str, float], prefix: str, k: int) -> list[str]:
    """The pass@k table (one row per score and side) and a line for each score without pass@k, saying why."""
    names = score_names(metrics, prefix)
    ks = sorted({int(key[len(prefix) + len(n) + 6:].split("/")[0]) for n in names for key in metrics
                 if key.startswith(f"{prefix}{n}/pass@") and not key.endswith("/prompts")})
    lines = [f"pass@j: the chance that at least one of j of the {k} responses sampled per prompt scores 1 (the "
             "unbiased estimator of Chen et al. 2021), averaged over the prompts with at least j scored samples; only "
             "for rewards whose every score is 0 or 1."]
    if ks:
        lines += ["", "| score | side | " + " | ".join(f"pass@{j}" for j in ks) + " |",
                  "|---|---|" + "---|" * len(ks)]
        for name in names:
            if f"{prefix}{name}/pass@1/policy" not in metrics:
                continue
            for side in ("policy", "reference"):
                cells = [metrics.get(f"{prefix}{name}/pass@{j}/{side}", math.nan) for j in ks]
                lines.append(f"| {name} | {side} | " + " | ".join("n/a" if math.isnan(v) else f"{v:.3f}"
                                                                 for v in cells) + " |")
        lines.append("")
    for name in names:
        prompts = metrics.get(f"{prefix}{name}/pass@{k}/prompts")
        num_prompts = metrics.get(f"{prefix}num_prompts")
        if f"{prefix}{name}/pass@1/policy" not in metrics:
            why = ("it has no scored samples" if math.isnan(metrics[f"{prefix}{name}/policy"]) else
                   "its scores are not all 0 or 1")
            lines.append(f"- {name}: no pass@k: {why}.")
        elif num_prompts is not None and prompts is not None and prompts < num_prompts:
            lines.append(f"- {name}: pass@{k} over {int(prompts)} of {int(num_prompts)} prompts (the others have "
                         f"fewer than {k} scored samples: NaN/inf or None).")
    return lines[:-1] if lines[-1] == "" else lines


def prompt_cell(raw, decoded: str) -> str:
    """What a table shows of a prompt: of a chat prompt its last user turn (the template's markup and system prompt
    are the same on every row), of a text prompt the text. `raw` is the dataset's prompt (text or messages) and
    `decoded` the prompt's tokens as text; `raw` is shown only when that text holds it (so a row the refill replaced,
    or a prompt truncated through its last turn, shows its tokens instead)."""
    if isinstance(raw, list):
        turns = [t for t in raw if isinstance(t, dict) and t.get("role") == "user"]
        content = turns[-1].get("content") if turns else None
        if isinstance(content, list):  # content parts: their text
            content = " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        raw = content
    return raw if isinstance(raw, str) and raw.strip() and raw.strip() in decoded else decoded


def system_prompt_of(raw) -> str | None:
    """The system message a chat prompt (`raw`: the dataset's prompt, text or messages) opens with; None for a text
    prompt or a chat without one."""
    if isinstance(raw, list) and raw and isinstance(raw[0], dict) and raw[0].get("role") == "system":
        content = raw[0].get("content")
        return content if isinstance(content, str) else None
    return None


def _cell(text: str) -> str:
    """Text made safe for one Markdown table cell."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return text.replace("\r", "").replace("\n", "<br>") or " "


def _score_cell(scores: dict) -> str:
    return "<br>".join(f"{name}: {'None (does not apply)' if value is None else format(value, '.4g')}"
                       for name, value in scores.items())


def written_by_hf_ppo(path: str) -> bool:
    """True when `path` does not exist or is a report hf_ppo wrote (it opens with the report mark)."""
    if not os.path.lexists(path):
        return True
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith(_MARK_START)
    except (OSError, UnicodeDecodeError):  # a folder, a binary file: not a report
        return False


def _our_metrics(path: str) -> bool:
    """True when `path` does not exist or is a metrics.json hf_ppo wrote: stamped (`METRICS_STAMP`), or, from before
    the stamp, holding what `hf-ppo evaluate` always wrote (the policy, the reference and eval_ metrics)."""
    if not os.path.lexists(path):
        return True
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):  # a folder, a binary file, not JSON: not ours
        return False
    if not isinstance(saved, dict):
        return False
    return all(saved.get(k) == v for k, v in METRICS_STAMP.items()) or (
        {"policy", "reference", "precision"} <= set(saved) and any(k.startswith("eval_") for k in saved))


def write_metrics(output_dir: str, record: dict) -> str | None:
    """Write `record` (stamped `METRICS_STAMP`) to `output_dir/metrics.json`; return its path, or None when a file of
    that name that hf_ppo did not write is there: it is kept as it is, and a warning names it."""
    path = os.path.join(output_dir, METRICS_FILE)
    if not _our_metrics(path):
        warn_user(f"{path} exists and was not written by hf_ppo: it was left as it is, and the metrics were not "
                  "written there (they are printed below). Move that file, or pass another --output_dir.")
        return None
    os.makedirs(output_dir, exist_ok=True)
    _write_atomically(path, json.dumps({**METRICS_STAMP, **record}, indent=2) + "\n")
    return path


def write_report(output_dir: str, metrics: dict[str, float], rows: list, *, step: int | None, num_prompts: int,
                 num_samples: int = 1, system_prompt: str | None = None) -> str | None:
    """Write the report (the metrics, then `rows` side by side) to `output_dir/eval_report-step<step>.md`, kept, and
    to `output_dir/eval_report.md`, the latest; return the path of the step's report, or None when it was not
    written. A file of either name that hf_ppo did not write is never replaced (a warning names it). `step`: the
    training step of the evaluated policy (None: not known, as for a policy saved without a record of it: the title
    says so, and only eval_report.md is written). `num_samples`: responses per prompt and side. `system_prompt`: the
    system message every prompt opens with, shown once above the rows (whose prompt cells show the last user turn,
    `prompt_cell`)."""
    paths = [os.path.join(output_dir, STEP_REPORT_FILE.format(step=step)), os.path.join(output_dir, REPORT_FILE)]
    if step is None:
        paths = paths[1:]
    foreign = [p for p in paths if not written_by_hf_ppo(p)]
    for path in foreign:
        warn_user(f"{path} exists and was not written by hf_ppo: it was left as it is, and the evaluation report was "
                  "not written there. Move that file, or use another output_dir.")
    each = "one response each" if num_samples == 1 else f"{num_samples} responses each"
    paired = "" if num_samples == 1 else " (sample j of the policy paired with sample j of the reference)"
    pairs = "prompts" if num_samples == 1 else "(prompt, sample) pairs"
    title = f"step {step}" if step is not None else "training step not recorded"
    lines = [REPORT_MARK, f"# The policy against its reference ({title})", "",
             f"{num_prompts} eval prompts, {each} from the policy and from the reference{paired}, sampled with "
             "the training sampling settings and scored by every training reward (`reward/...`) and judge "
             f"(`judge/...`). Win rate: the fraction of {pairs} where the policy's response scores higher, ties "
             f"counted half; the interval is a {CONFIDENCE:.0%} bootstrap interval ({NUM_BOOTSTRAP} resamples of "
             "the prompts).", "",
             metrics_markdown(metrics), "",
             f"## Samples (the first {len(rows)})", "",
             *([f"Every prompt opens with the system prompt: {_cell(system_prompt)}", ""] if system_prompt else []),
             "| prompt | reference response | reference score | policy response | policy score |",
             "|---|---|---|---|---|"]
    for prompt, ref_text, ref_scores, pol_text, pol_scores in rows:
        lines.append(f"| {_cell(prompt)} | {_cell(ref_text)} | {_score_cell(ref_scores)} | {_cell(pol_text)} | "
                     f"{_score_cell(pol_scores)} |")
    os.makedirs(output_dir, exist_ok=True)
    for path in paths:
        if path not in foreign:
            _write_atomically(path, "\n".join(lines) + "\n")
    return None if paths[0] in foreign else paths[0]


def _write_atomically(path: str, text: str) -> None:
    """Write `text` beside `path` under a fresh temporary name (never a name someone else's file has), then rename it
    over `path`: a reader sees the old report or the new one, never half of one."""
    folder, name = os.path.split(path)
    for attempt in itertools.count():
        tmp = os.path.join(folder, f".{name}.{os.getpid()}-{attempt}.tmp")
        try:
            f = open(tmp, "x", encoding="utf-8")  # "x": fails rather than open an existing file
        except FileExistsError:
            continue
        break
    try:
        with f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def final_evaluation(log_history: list[dict], prefix: str = "eval_") -> tuple[int | None, str | None]:
    """(step, Markdown tables) of the last evaluation in a Trainer `log_history`, or (None, None) when none ran."""
    for entry in reversed(log_history):
        if score_names(entry, prefix):
            return entry.get("step"), metrics_markdown(entry, prefix)
    return None, None

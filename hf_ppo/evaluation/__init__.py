"""Floor 4, evaluation: the policy against its reference (`Evaluator`, `win_rate`), and the report apart
(`report`: eval_report.md and the metrics tables), so that publishing reads reports without sampling anything."""

from .evaluator import EvalSettings, Evaluator, evaluation_metrics, pass_at_k, pass_at_k_mean, win_rate
from .report import REPORT_FILE, final_evaluation, metrics_markdown, write_report

__all__ = ["REPORT_FILE", "EvalSettings", "Evaluator", "evaluation_metrics", "final_evaluation", "metrics_markdown", "pass_at_k",
           "pass_at_k_mean", "win_rate", "write_report"]

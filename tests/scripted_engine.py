"""A rollout engine that returns scripted token ids: what a new engine looks like, and a probe of what the trainer
and `rollout()` do with an engine's output (tests/rollout/test_engines.py, tests/rollout/test_steps.py)."""

from __future__ import annotations

import hashlib

import torch

from hf_ppo.rollout.engines import RolloutEngine


class ScriptedEngine(RolloutEngine):
    """Row i of every batch gets `script[i % len(script)]` (a list of `response_length` token ids), whatever the
    model says. Records each call: `events` is a list of ("generate", model) and ("weights_changed", fingerprint)
    in call order, the fingerprint being the `watch` module's weights at that moment (`fingerprint`)."""

    def __init__(self, script: list[list[int]], watch: torch.nn.Module | None = None):
        self.script = torch.tensor(script, dtype=torch.long)
        self.watch = watch
        self.events: list[tuple[str, object]] = []
        self.queries: list[tuple[torch.Tensor, torch.Tensor]] = []

    def generate(self, model, queries, query_mask):
        self.events.append(("generate", model))
        self.queries.append((queries.clone(), query_mask.clone()))
        rows = torch.arange(queries.shape[0]) % len(self.script)
        return self.script[rows].to(queries.device)

    def weights_changed(self):
        self.events.append(("weights_changed", fingerprint(self.watch) if self.watch is not None else None))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.events]


@torch.no_grad()
def fingerprint(module: torch.nn.Module) -> str:
    """A digest of every parameter's bytes: equal exactly when no weight of `module` changed."""
    digest = hashlib.sha1()
    for p in module.parameters():
        digest.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()

"""Helpers of the wiring tests: tiny models that make wiring bugs visible, and a trainer that records its work.

- The policies are "EOS-prone": the EOS row of the LM head points along the mean final hidden state, so a fair share
  of sampled responses stop early and masks, the score slot and the missing-EOS penalty all matter.
- A GPT-2 policy and reward model next to the Llama ones: GPT-2 has learned absolute positions, so position ids
  that do not come from the attention mask change its outputs (Llama's rotary positions are relative, and hide it).
- A reward model with another tokenizer (a different vocabulary, padding on the right).
- `RecordingTrainer` records, through public seams only (`compute_loss`, a `TrainerCallback`), every micro-batch
  of rollout experience it trains on, the loss it returns, the gradients of every optimizer step and, on request,
  a copy of the model as it was when a micro-batch's loss was computed.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, TrainerCallback

from hf_ppo import PPOLMTrainer
from hf_ppo.cli.tiny import build_causal_lm, build_reward_model, build_tokenizer

# Distinct prompts of very different lengths (left padding matters; a row is identified by its prompt).
PROMPTS = ["the movie was", "the food was great and the service", "a", "the book was bad but the plot was fun and",
           "the show", "the game was dull", "the song was great because the", "the hotel was"]


def eos_prone(model, tokenizer, strength: float = 2.5):
    """Point the LM head's EOS row along the mean final hidden state: EOS gets a logit of about `strength`."""
    probe = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = model(**probe, output_hidden_states=True).hidden_states[-1][probe["attention_mask"].bool()]
        mean = hidden.mean(0)
        model.get_output_embeddings().weight[tokenizer.eos_token_id] = strength * mean / mean.norm() ** 2
    return model


def _gpt2_config(tokenizer, **extra) -> GPT2Config:
    return GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4, n_positions=256,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, **extra)


def build_wiring_models(root) -> dict[str, str]:
    """Save the tiny models under `root`; return their paths by name."""
    tok = build_tokenizer()
    other_tok = build_tokenizer(vocab_size=300)
    other_tok.padding_side = "right"  # the score must still be read at the last real token
    torch.manual_seed(0)
    models = {
        "llama": eos_prone(build_causal_lm(tok, seed=0), tok),
        # Strength 2: the second rollout of the 8 PROMPTS, which tests/integration/test_reference_iteration.py and
        # tests/models/test_critics.py check, holds responses that stop early for 18 of 20 seeds on the CPU (1.5: 16
        # and 14 of 20, and a GPU's random stream drew no early stop), so another device's stream rarely misses one.
        "gpt2": eos_prone(GPT2LMHeadModel(_gpt2_config(tok)), tok, strength=2.0),
        "reward": build_reward_model(tok, seed=1),
        "gpt2_reward": GPT2ForSequenceClassification(_gpt2_config(tok, num_labels=1)),
        "other_reward": build_reward_model(other_tok, seed=2),
        "gpt2_plain": GPT2LMHeadModel(_gpt2_config(tok)),  # no EOS bias: greedy responses run their full length
    }
    paths = {}
    for name, model in models.items():
        path = str(root / name)
        model.save_pretrained(path)
        (other_tok if name == "other_reward" else tok).save_pretrained(path)
        paths[name] = path
    return paths


def rollout_batch_in(inputs: dict):
    """The rollout experience in a micro-batch handed to `compute_loss` (the dataclass with a `response_mask`)."""
    return next(v for v in inputs.values() if dataclasses.is_dataclass(v) and hasattr(v, "response_mask"))


def clone_batch(batch):
    return type(batch)(**{f.name: _clone(getattr(batch, f.name)) for f in dataclasses.fields(batch)})


def _clone(value):
    return value.detach().clone() if torch.is_tensor(value) else copy.deepcopy(value)


def row_key(batch, i: int) -> tuple:
    """Identity of row i: its real prompt tokens and its response."""
    return tuple(batch.queries[i][batch.query_mask[i]].tolist()), tuple(batch.responses[i].tolist())


class _GradientRecorder(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.trainer.step_grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                        if p.grad is not None})


class RecordingTrainer(PPOLMTrainer):
    """PPOLMTrainer that records micro-batches, losses, step gradients and model copies (see the module docstring).

    `snapshot_calls`: indices of `compute_loss` calls before which the (unwrapped) model is deep-copied; with one
    micro-batch per step and no gradient clipping, snapshot k, micro_batches[k] and step_grads[k] belong together.
    """

    def __init__(self, *args, snapshot_calls=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_batches, self.losses, self.step_grads, self.snapshots = [], [], [], {}
        self._snapshot_calls = set(snapshot_calls)
        self.add_callback(_GradientRecorder(self))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Only what training computed is recorded: a test that calls compute_loss on a finished run (the loss tests of
        # tests/integration/test_objective_wiring.py) must not add its own batches to the record that a later test
        # reads.
        recording = self.is_in_train
        call = len(self.micro_batches)
        if recording:
            self.micro_batches.append(clone_batch(rollout_batch_in(inputs)))
            if call in self._snapshot_calls:
                self.snapshots[call] = (copy.deepcopy(self.accelerator.unwrap_model(model)), dict(inputs))
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if recording:
            self.losses.append((out[0] if return_outputs else out).detach().clone())
        return out

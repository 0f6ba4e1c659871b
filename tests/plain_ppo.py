"""A deliberately plain, slow reference of one PPO iteration, written from the equations.

It shares no code with hf_ppo: every sequence is run through the models alone (no padding, no KV cache, eval mode),
and the per-token quantities are computed with Python loops over tokens and floats. It takes the responses hf_ppo
sampled and recomputes everything that follows from them:

    logp_t      = log softmax(logits_{t-1} / T)[y_t]               (policy and reference, T = sampling temperature)
    V_t         = w . h_{t-1} + b                                  (h: the final hidden state the LM head reads)
    score       = r(prompt + response), read at the last real token; minus the penalty if no stop token
    KL_t        = k1: logp - logp_ref | k2: (logp - logp_ref)^2 / 2 | k3: (e^(logp_ref - logp) - 1) - (logp_ref - logp)
    r_t         = -beta * KL_t  (+ score at the last real token)
    delta_t     = r_t + gamma * V_{t+1} - V_t  (V after the last real token = 0);  A_t = delta_t + gamma lam A_{t+1}
    R_t         = A_t + V_t  (raw advantages);  A_t <- (A_t - mean) / sqrt(var_unbiased + 1e-8) over the batch
    loss        = [sum_t max(-A ratio, -A clip(ratio, 1 +- eps)) + vf_coef * sum_t 1/2 max((V - R)^2,
                  (V_old + clip(V - V_old, +- eps_v) - R)^2) - entropy_coef * sum_t H_t] / (real tokens of the minibatch)
"""

from __future__ import annotations

import math

import torch

from tests.devices import device_of


def real_length(response: list[int], stop_token_id: int | None) -> int:
    """Tokens up to and including the first stop token (all of them when there is none)."""
    for t, token in enumerate(response):
        if token == stop_token_id:
            return t + 1
    return len(response)


def run_alone(lm, ids: list[int]):
    """Logits (T, vocab) and the final hidden states (T, hidden) of one unpadded sequence, with no KV cache."""
    out = lm(input_ids=torch.tensor([ids], device=device_of(lm)), use_cache=False, output_hidden_states=True)
    logits, hidden = out.logits[0].float(), out.hidden_states[-1][0]
    # The value head must read the state the LM head reads: check that this is it.
    torch.testing.assert_close(lm.get_output_embeddings()(hidden).float(), logits, rtol=1e-4, atol=1e-5)
    return logits, hidden


def token_logprob(logits_row: torch.Tensor, token: int, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits_row / temperature, dim=-1)[token]


def token_entropy(logits_row: torch.Tensor, temperature: float) -> torch.Tensor:
    p = torch.softmax(logits_row / temperature, dim=-1)
    return -(p * torch.log(p)).sum()


def value_of(v_head, hidden_row: torch.Tensor) -> torch.Tensor:
    return (hidden_row.float() * v_head.weight[0].float()).sum() + v_head.bias[0].float()


def kl_token(logp: float, ref_logp: float, estimator: str) -> float:
    d = logp - ref_logp
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return math.expm1(-d) + d  # k3


@torch.no_grad()
def score_alone(reward_model, ids: list[int]) -> float:
    """The reward model on one unpadded sequence: its own pooling reads the last (= last real) token."""
    return reward_model(input_ids=torch.tensor([ids], device=device_of(reward_model))).logits[0, 0].item()


@torch.no_grad()
def rollout(rows, *, policy_lm, v_head, ref_lm, reward_model, policy_tokenizer, reward_tokenizer, stop_token_id,
            temperature, kl_coef, kl_estimator, gamma, lam, missing_eos_penalty, whiten_advantages=True):
    """Per-sequence experience for `rows` = [(prompt_ids, response_ids incl. padding), ...]: a list of dicts."""
    seqs = []
    for prompt, response in rows:
        n = real_length(response, stop_token_id)
        ids = prompt + response[:n]
        q = len(prompt)
        logits, hidden = run_alone(policy_lm, ids)
        ref_logits, _ = run_alone(ref_lm, ids)
        logp = [token_logprob(logits[q + t - 1], response[t], temperature).item() for t in range(n)]
        ref_logp = [token_logprob(ref_logits[q + t - 1], response[t], temperature).item() for t in range(n)]
        values = [value_of(v_head, hidden[q + t - 1]).item() for t in range(n)]
        if reward_tokenizer is None:
            score = score_alone(reward_model, ids)
        else:
            text = (policy_tokenizer.decode(prompt, skip_special_tokens=True)
                    + policy_tokenizer.decode(response[:n], skip_special_tokens=True))
            score = score_alone(reward_model, reward_tokenizer(text)["input_ids"])
        stopped = stop_token_id in response[:n]
        if missing_eos_penalty is not None and not stopped:
            score -= missing_eos_penalty
        kl = [kl_token(a, b, kl_estimator) for a, b in zip(logp, ref_logp)]
        non_score = [-kl_coef * k for k in kl]
        rewards = list(non_score)
        rewards[n - 1] += score
        advantages, next_advantage = [0.0] * n, 0.0
        for t in reversed(range(n)):
            next_value = values[t + 1] if t + 1 < n else 0.0
            delta = rewards[t] + gamma * next_value - values[t]
            next_advantage = delta + gamma * lam * next_advantage
            advantages[t] = next_advantage
        returns = [a + v for a, v in zip(advantages, values)]
        seqs.append(dict(prompt=prompt, response=response, n=n, stopped=stopped, logprobs=logp, ref_logprobs=ref_logp,
                         values=values, score=score, kl=kl, non_score_rewards=non_score, rewards=rewards,
                         raw_advantages=advantages, returns=returns))
    flat = [a for s in seqs for a in s["raw_advantages"]]
    mean = sum(flat) / len(flat)
    var = sum((a - mean) ** 2 for a in flat) / (len(flat) - 1)
    for s in seqs:
        s["advantages"] = ([(a - mean) / math.sqrt(var + 1e-8) for a in s["raw_advantages"]] if whiten_advantages
                           else list(s["raw_advantages"]))
    return seqs


def loss(seqs, *, policy_lm, v_head, temperature, cliprange, cliprange_value, vf_coef, entropy_coef):
    """The minibatch loss over `seqs` (from `rollout`) at the current weights, differentiable."""
    total = sum(s["n"] for s in seqs)
    policy_terms, value_terms, entropy_terms = [], [], []
    for s in seqs:
        q, n, response = len(s["prompt"]), s["n"], s["response"]
        logits, hidden = run_alone(policy_lm, s["prompt"] + response[:n])
        for t in range(n):
            row = logits[q + t - 1]
            ratio = torch.exp(token_logprob(row, response[t], temperature) - s["logprobs"][t])
            advantage = s["advantages"][t]
            policy_terms.append(torch.maximum(-advantage * ratio,
                                              -advantage * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)))
            value, old, ret = value_of(v_head, hidden[q + t - 1]), s["values"][t], s["returns"][t]
            clipped = old + torch.clamp(value - old, -cliprange_value, cliprange_value)
            value_terms.append(0.5 * torch.maximum((value - ret) ** 2, (clipped - ret) ** 2))
            entropy_terms.append(token_entropy(row, temperature))
    return (sum(policy_terms) + vf_coef * sum(value_terms) - entropy_coef * sum(entropy_terms)) / total


def value_loss_sum(seqs, *, policy_lm, v_head, cliprange_value) -> float:
    """sum over real tokens of 1/2 max((V - R)^2, (clipped V - R)^2) at the current weights (no gradient)."""
    total = 0.0
    with torch.no_grad():
        for s in seqs:
            q, n = len(s["prompt"]), s["n"]
            _, hidden = run_alone(policy_lm, s["prompt"] + s["response"][:n])
            for t in range(n):
                value, old, ret = value_of(v_head, hidden[q + t - 1]).item(), s["values"][t], s["returns"][t]
                clipped = old + min(max(value - old, -cliprange_value), cliprange_value)
                total += 0.5 * max((value - ret) ** 2, (clipped - ret) ** 2)
    return total


def entropy_sum(seqs, *, policy_lm, temperature) -> float:
    """sum over real tokens of the entropy of softmax(logits / T) at the current weights."""
    total = 0.0
    with torch.no_grad():
        for s in seqs:
            q, n = len(s["prompt"]), s["n"]
            logits, _ = run_alone(policy_lm, s["prompt"] + s["response"][:n])
            total += sum(token_entropy(logits[q + t - 1], temperature).item() for t in range(n))
    return total

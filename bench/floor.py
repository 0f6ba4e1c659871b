"""hf_ppo's compute floor: the unavoidable work of one PPO iteration, each piece timed alone in the same process.

floor = generate (the rollout batch, `response_length` new tokens, KV cache)
      + one no-grad policy+value forward over prompt+response
      + one no-grad reference forward (the frozen reference, or the policy with its adapter disabled)
      + one no-grad reward forward (or the reward callable on the decoded completions)
      + num_ppo_epochs x num_mini_batches x (forward + backward + optimizer step) on a minibatch

Each piece runs once to warm up, then `repeats` times; its median wall time counts (`floor_s`); the sums of the
fastest calls (`floor_min_s`) and of the median CPU seconds of the process (`floor_cpu_s`, robust to other load
when torch runs one thread) are kept too. The pieces call the models directly, generation timed both with Hugging Face `generate` and hf_ppo's lean sampling loop (the faster counts; no trainer code), with the trainer's own model objects and optimizer, so the ratio
`trainer s/iter / floor` is the trainer's overhead on top of the arithmetic it cannot avoid. Run it after
training: the optimizer steps it takes change the weights.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch


_MINS: dict[str, float] = {}
_CPU: dict[str, float] = {}


def _timed(fn, repeats: int, sync, name: str = "") -> float:
    """Median wall seconds of `repeats` calls after one warm-up call; the fastest call is kept in `_MINS[name]`
    and the median CPU seconds of the process in `_CPU[name]`."""
    fn()
    sync()
    times, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        sync()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    _MINS[name] = min(times)
    _CPU[name] = statistics.median(cpu)
    return statistics.median(times)


def measure_floor(*, policy, ref_model, reward, tokenizer, optimizer, prompts: list[str], batch: int,
                  response_length: int, num_ppo_epochs: int, num_mini_batches: int, temperature: float,
                  stop_token_id: int | None, repeats: int = 3) -> dict:
    """Seconds of each unavoidable piece and their sum (`floor_s`).

    policy: an `AutoModelForCausalLMWithValueHead` (its `pretrained_model` may be a PeftModel); ref_model: a causal
    LM, or None for "policy with the adapter disabled"; reward: a sequence classifier or a callable
    (prompts, completions) -> list[float]; optimizer: the trainer's, over the policy's trainable parameters.
    """
    device = next(policy.parameters()).device
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    enc = tokenizer(prompts[:batch], return_tensors="pt", padding=True)
    queries, query_mask = enc.input_ids.to(device), enc.attention_mask.to(device)
    base = policy.pretrained_model
    R = response_length

    from transformers import GenerationConfig

    gen_config = GenerationConfig(max_new_tokens=R, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_token_id, use_cache=True)
    was_training = policy.training
    policy.eval()
    out = {}

    def gen():
        with torch.no_grad():
            return base.generate(input_ids=queries, attention_mask=query_mask, generation_config=gen_config)

    def lean_gen():  # hf_ppo's own KV-cached sampling loop: the floor takes the faster of the two generators
        from hf_ppo.rollout.engines import SamplingSettings, generate

        s = SamplingSettings(response_length=R, temperature=temperature, forward_batch_size=queries.shape[0])
        return generate(base, queries, query_mask.bool(), s, pad_token_id=tokenizer.pad_token_id,
                        stop_token_ids=stop_token_id)

    out["hf_generate_s"] = _timed(gen, repeats, sync, "hf_generate_s")
    out["lean_generate_s"] = _timed(lean_gen, repeats, sync, "lean_generate_s")
    out["generate_s"] = min(out["hf_generate_s"], out["lean_generate_s"])
    _MINS["generate_s"] = min(_MINS["hf_generate_s"], _MINS["lean_generate_s"])
    _CPU["generate_s"] = min(_CPU["hf_generate_s"], _CPU["lean_generate_s"])
    seq = gen()
    if seq.shape[1] < queries.shape[1] + R:  # every row stopped early: pad to the full length
        pad = seq.new_full((seq.shape[0], queries.shape[1] + R - seq.shape[1]), tokenizer.pad_token_id)
        seq = torch.cat([seq, pad], 1)
    attention = torch.cat([query_mask, torch.ones_like(seq[:, queries.shape[1]:])], 1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    inputs = {"input_ids": seq, "attention_mask": attention, "position_ids": positions}

    def policy_value():
        with torch.no_grad():
            return policy(**inputs, logits_to_keep=R + 1)

    out["policy_value_forward_s"] = _timed(policy_value, repeats, sync, "policy_value_forward_s")

    def reference():
        ctx = contextlib.nullcontext()
        model = ref_model
        if model is None:
            model = base
            ctx = base.disable_adapter() if hasattr(base, "disable_adapter") else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            return model(**inputs, logits_to_keep=R + 1, use_cache=False)

    out["reference_forward_s"] = _timed(reference, repeats, sync, "reference_forward_s")

    if isinstance(reward, torch.nn.Module):
        def score():
            with torch.no_grad():
                return reward(input_ids=seq, attention_mask=attention, position_ids=positions, use_cache=False)
    else:
        def score():
            texts = tokenizer.batch_decode(seq[:, queries.shape[1]:], skip_special_tokens=True)
            return reward(prompts[:batch], texts)

    out["reward_forward_s"] = _timed(score, repeats, sync, "reward_forward_s")

    policy.train(was_training)
    mb = batch // num_mini_batches
    mb_inputs = {k: v[:mb] for k, v in inputs.items()}
    targets = seq[:mb, queries.shape[1]:]

    def train_step():
        o = policy(**mb_inputs, logits_to_keep=R + 1)
        logp = torch.log_softmax(o.logits[:, :-1].float() / temperature, -1).gather(-1, targets[..., None])
        value = o["value"] if "value" in o else o["values"]  # the field was renamed during development
        loss = -logp.mean() + value[:, :-1].float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step = _timed(train_step, repeats, sync, "train_step_s")
    out["train_step_s"] = step
    out["train_steps"] = num_ppo_epochs * num_mini_batches
    out["floor_s"] = (out["generate_s"] + out["policy_value_forward_s"] + out["reference_forward_s"]
                      + out["reward_forward_s"] + out["train_steps"] * step)
    # The same sum from each piece's fastest call: on a shared machine, compare it with the fastest iteration.
    out["floor_min_s"] = (sum(_MINS[k] for k in ("generate_s", "policy_value_forward_s", "reference_forward_s",
                                                 "reward_forward_s")) + out["train_steps"] * _MINS["train_step_s"])
    pieces = ("generate_s", "policy_value_forward_s", "reference_forward_s", "reward_forward_s")
    out["cpu"] = {k: round(_CPU[k], 5) for k in (*pieces, "train_step_s")}
    out["floor_cpu_s"] = sum(_CPU[k] for k in pieces) + out["train_steps"] * _CPU["train_step_s"]
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in out.items()}

"""PPOLMTrainer end to end on tiny models loaded with from_pretrained (CPU, offline)."""

import inspect
import math
import os
import warnings

import pytest
import torch
import transformers
import transformers.trainer
from datasets import Dataset
from safetensors import safe_open
from transformers import Trainer, TrainerState

from hf_ppo import PPOConfig, PPOLMTrainer
from tests.devices import device_of
from tests.guards import needs_fsdp2

METRICS = [
    "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward", "objective/scores",
    "objective/kl_coef", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg", "loss/policy_avg",
    "loss/value_avg", "val/clipfrac_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens",
    "val/explained_variance", "rollout/response_length", "rollout/eos_rate", "time/generate", "time/score", "lr",
    "episode",
]


def make_args(tmp_path, **overrides) -> PPOConfig:
    defaults = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_mini_batches=1, num_ppo_epochs=2, max_steps=4, response_length=8, logging_steps=1, learning_rate=1e-2,
        report_to=[], save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0,
    )
    defaults.update(overrides)
    return PPOConfig(**defaults)


def count_e(prompts, completions):
    """Rule-based reward: +1 per letter 'e' in the completion."""
    return [float(c.count("e")) for c in completions]


def test_qlora_policy_4bit_reward_adapter_disabled_reference(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path):
    args = make_args(tmp_path, policy_quantization="4bit", reward_quantization="4bit")
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=tiny_models["reward"], train_dataset=prompts_dataset, peft_config=lora_config)
    policy = trainer.model.pretrained_model
    assert trainer.ref_model is None  # the reference is the policy with its adapter disabled
    assert trainer.reward_model.is_loaded_in_4bit and policy.get_base_model().is_loaded_in_4bit
    assert not any(p.requires_grad for p in trainer.reward_model.parameters())

    lora = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" in n}
    # 4-bit weights may be repacked in place by bitsandbytes' CPU backend, so the base is checked by what it computes
    # (adapter disabled) and, for its unquantized tensors (norms, embeddings), by value.
    plain = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_" not in n and p.dtype != torch.uint8}
    probe = tokenizer(["the movie was great", "the food"], return_tensors="pt", padding=True).to(device_of(policy))
    with torch.no_grad(), policy.disable_adapter():
        base_logits = policy(**probe).logits
    head = trainer.model.v_head.weight.detach().clone()
    assert torch.count_nonzero(head) == 0  # zero-initialised

    trainer.train()

    history = trainer.state.log_history
    # Step 0: a fresh adapter is the identity, so policy and reference agree exactly.
    assert abs(history[0]["objective/kl"]) < 1e-6
    now = dict(policy.named_parameters())
    assert any(not torch.equal(lora[n], now[n]) for n in lora), "LoRA weights did not change"
    changed = [n for n in plain if not torch.equal(plain[n], now[n])]
    assert not changed, f"unquantized base weights changed: {changed}"
    with torch.no_grad(), policy.disable_adapter():
        torch.testing.assert_close(policy(**probe).logits, base_logits, rtol=0, atol=1e-6)
    assert not any(p.requires_grad for n, p in policy.named_parameters() if "lora_" not in n)
    assert not torch.equal(head, trainer.model.v_head.weight), "value head did not change"
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for n, p in trainer.model.named_parameters() if "lora_" in n or n.startswith("v_head")}
    logged = set().union(*history)
    assert set(METRICS) <= logged, f"missing metrics: {set(METRICS) - logged}"
    assert all(math.isfinite(e["objective/kl"]) for e in history if "objective/kl" in e)

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    files = set(os.listdir(out))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert not files & {"value_head.safetensors", "training_args.bin", "model.safetensors", "optimizer.pt"}
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        assert all("lora_" in k for k in f.keys())


def test_qlora_gradients_still_flow_through_4bit_layers_after_an_eval_pass(tiny_models, tokenizer, prompts_dataset,
                                                                           lora_config, tmp_path):
    """bitsandbytes 0.50 repacks a 4-bit weight for a faster CPU kernel on its first eval-mode forward without
    gradients, and that kernel has no backward: the gradient through the layer would be dropped with a warning.
    hf_ppo keeps the standard layout, so an evaluation (or the reward model scoring on the reward_lora critic's
    base) never changes what training computes."""
    args = make_args(tmp_path, policy_quantization="4bit", reward_quantization="4bit")
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=tiny_models["reward"], train_dataset=prompts_dataset, peft_config=lora_config)
    policy = trainer.model.pretrained_model
    probe = tokenizer(["the movie was great", "the food"], return_tensors="pt", padding=True).to(device_of(policy))

    def lora_grads():
        policy.train()
        policy.zero_grad()
        policy(**probe).logits.float().pow(2).mean().backward()
        return {n: p.grad.clone() for n, p in policy.named_parameters() if "lora_B" in n}  # A: zero grad at init

    before = lora_grads()
    policy.eval()
    with torch.no_grad():
        policy(**probe)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*autograd kernel was not registered")  # "... silently incorrect"
        after = lora_grads()
    first = [n for n in before if ".layers.0." in n]
    assert first and all(torch.count_nonzero(before[n]) for n in first)
    for n in before:
        torch.testing.assert_close(after[n], before[n], rtol=1e-5, atol=1e-7, msg=n)


def test_rule_based_reward_rises_full_finetune(tiny_models, tokenizer, tmp_path):
    prompts = Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"] * 8})
    args = make_args(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=1, num_mini_batches=2,
                     num_ppo_epochs=4, max_steps=160, learning_rate=1e-3, temperature=1.0, kl_coef=0.01,
                     logging_steps=8)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=prompts)
    ref_before = [p.detach().clone() for p in trainer.ref_model.parameters()]
    trainer.train()
    rollouts = [e for e in trainer.state.log_history if "objective/scores" in e]
    assert len(rollouts) == 20
    assert abs(rollouts[0]["objective/kl"]) < 1e-6  # without LoRA the reference is an exact copy of the start
    first = sum(e["objective/scores"] for e in rollouts[:5]) / 5
    last = sum(e["objective/scores"] for e in rollouts[-5:]) / 5
    assert last > first + 0.5, f"reward did not rise: first {first:.2f}, last {last:.2f}"
    assert all(math.isfinite(e["objective/kl"]) for e in rollouts)
    assert all(torch.equal(a, b) for a, b in zip(ref_before, trainer.ref_model.parameters()))


def test_gradient_accumulation_gives_the_whole_minibatch_gradient(tiny_models, tokenizer, prompts_dataset, tmp_path):
    """One optimizer step on a minibatch of 8: 1 x 8 and 2 x 4 (accumulated) must move the weights identically.
    fp32 on any machine (bf16=False): this checks how the accumulation normalises, not a precision; under a GPU's
    default bf16 autocast the two batch shapes round differently (q_proj off by more than 1e-4 on an H200)."""
    weights = []
    for micro, accumulation in [(8, 1), (4, 2)]:
        args = make_args(tmp_path, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                         num_ppo_epochs=1, max_steps=1, optim="sgd", learning_rate=1.0, max_grad_norm=0.0, bf16=False)
        trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                               reward_model=count_e, train_dataset=prompts_dataset)
        trainer.train()
        weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_checkpoint_holds_value_head_and_ppo_state(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path):
    args = make_args(tmp_path, save_strategy="steps", save_steps=4, adaptive_kl=True, kl_coef=0.2)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=prompts_dataset, peft_config=lora_config)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-4"
    files = set(os.listdir(checkpoint))
    assert {"adapter_model.safetensors", "value_head.safetensors", "ppo_state.json", "optimizer.pt",
            "scheduler.pt", "trainer_state.json", "rng_state.pth"} <= files
    assert trainer.kl_ctl.value != 0.2  # the adaptive controller moved, and its state is in the checkpoint


# ---- bad input: a clear error at construction ---------------------------------------------------------------------
def build(tiny_models, tokenizer, tmp_path, dataset=None, reward=count_e, **overrides):
    dataset = dataset if dataset is not None else Dataset.from_dict({"prompt": ["the movie was"] * 8})
    return PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path, **overrides), processing_class=tokenizer,
                        reward_model=reward, train_dataset=dataset)


def test_missing_prompt_column(tiny_models, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"'prompt' column.*it has \['text'\]"):
        build(tiny_models, tokenizer, tmp_path, Dataset.from_dict({"text": ["a"] * 8}))


def test_empty_prompts(tiny_models, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"2 empty prompt\(s\)"):
        build(tiny_models, tokenizer, tmp_path, Dataset.from_dict({"prompt": ["the movie", "  ", ""] + ["a"] * 5}))


def test_long_prompts_are_truncated_from_the_left_with_one_warning(tiny_models, tokenizer, tmp_path):
    long = "the movie was great and the acting was wonderful and the music was lovely"
    with pytest.warns(UserWarning, match="truncated from the left") as record:
        trainer = build(tiny_models, tokenizer, tmp_path, Dataset.from_dict({"prompt": [long] * 8}),
                        max_prompt_length=4)
    assert len([w for w in record if "truncated" in str(w.message)]) == 1
    ids = trainer.train_dataset[0]["input_ids"]
    assert ids == tokenizer(long)["input_ids"][-4:]


def test_response_longer_than_context(tiny_models, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="lower response_length"):
        build(tiny_models, tokenizer, tmp_path, response_length=256)


@pytest.mark.parametrize("pad", [None, "eos"])
def test_missing_or_eos_pad_is_replaced_by_an_unused_special_token(tiny_models, tokenizer, tmp_path, pad):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["policy"])
    tok.pad_token = tok.eos_token if pad == "eos" else None
    with pytest.warns(UserWarning, match="padding with '<pad>'") as record:
        trainer = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tok,
                               reward_model=count_e, train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}))
    assert len([w for w in record if "padding with" in str(w.message)]) == 1  # said once
    assert trainer.processing_class.pad_token == "<pad>" and trainer.processing_class.padding_side == "left"
    assert tok.pad_token == (tok.eos_token if pad == "eos" else None)  # the user's tokenizer is not modified
    assert trainer.stop_token_ids == [tok.eos_token_id]


def test_reward_model_with_two_labels(tiny_models, tokenizer, tmp_path):
    from hf_ppo.cli.tiny import build_reward_model

    model = build_reward_model(tokenizer)
    model.config.num_labels = 2
    with pytest.raises(ValueError, match="num_labels=2"):
        build(tiny_models, tokenizer, tmp_path, reward=model)


@pytest.mark.parametrize("reward, message", [
    (lambda p, c: [1.0], "returned 1 scores for 2 completions"),
    (lambda p, c: [float("nan")] * len(c), "NaN/inf"),
    (lambda p, c: ["good"] * len(c), "list of 2 floats"),
])
def test_bad_reward_callable(tiny_models, tokenizer, tmp_path, reward, message):
    with pytest.raises((ValueError, TypeError), match=message):
        build(tiny_models, tokenizer, tmp_path, reward=reward)


def test_dataset_smaller_than_one_rollout(tiny_models, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="samples 8 prompts.*has 3"):
        build(tiny_models, tokenizer, tmp_path, Dataset.from_dict({"prompt": ["a", "b", "c"]}))


def test_quantized_policy_needs_lora(tiny_models, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="needs `peft_config`"):
        build(tiny_models, tokenizer, tmp_path, policy_quantization="4bit")


def test_chat_prompts_need_a_chat_template(tiny_models, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["policy"])
    tok.chat_template = None
    chats = Dataset.from_dict({"messages": [[{"role": "user", "content": "hi"}]] * 8})
    with pytest.raises(ValueError, match="no chat template"):
        PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tok, reward_model=count_e,
                     train_dataset=chats)


def test_chat_prompts_are_rendered_with_the_template(tiny_models, tokenizer, tmp_path):
    chats = Dataset.from_dict({"messages": [[{"role": "user", "content": "the movie was"}]] * 8})
    trainer = build(tiny_models, tokenizer, tmp_path, chats, max_steps=2, num_ppo_epochs=1)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "the movie was"}], add_generation_prompt=True)
    assert trainer.train_dataset[0]["input_ids"] == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    trainer.train()


def test_reward_model_with_another_vocabulary_needs_its_tokenizer(tiny_models, tokenizer, tmp_path):
    from hf_ppo.cli.tiny import build_reward_model, build_tokenizer

    small = build_tokenizer(vocab_size=300)
    with pytest.raises(ValueError, match="reward_processing_class"):
        build(tiny_models, tokenizer, tmp_path, reward=build_reward_model(small))


@pytest.mark.parametrize("peft", [False, True], ids=["separate_reference", "adapter_disabled_reference"])
def test_under_bf16_mixed_precision_the_reference_computes_as_the_policy(tiny_models, tokenizer, prompts_dataset,
                                                                        lora_config, tmp_path, peft):
    """bf16 is on by default on a GPU: accelerate runs the prepared policy's forward under autocast, so every other
    pass of the rollout (the reference, a frozen model or the adapter-disabled policy) must run under it too, or the
    step-0 KL is the precision gap (0.00067 nats here before, 0.0015 on an H200) instead of 0. The CPU's autocast
    shows the same gap."""
    args = make_args(tmp_path, bf16=True, use_cpu=True, max_steps=2, gradient_accumulation_steps=1)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=tiny_models["reward"], train_dataset=prompts_dataset,
                           peft_config=lora_config if peft else None)
    assert (trainer.ref_model is None) == peft
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["objective/kl"] == 0.0 and first["val/ratio"] == 1.0, first


def test_evaluate_samples_and_scores_eval_prompts(tiny_models, tokenizer, prompts_dataset, tmp_path):
    trainer = build(tiny_models, tokenizer, tmp_path, prompts_dataset, reward=count_e)
    trainer.eval_dataset = trainer.train_dataset
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] <= 0  # -mean(count of 'e') <= 0


# ---- accelerate keeps one state per process: refused (and other) constructions leave a built trainer working --------
def one_step_args(tmp_path, name, **overrides) -> PPOConfig:
    return make_args(tmp_path, output_dir=str(tmp_path / name), max_steps=1, gradient_accumulation_steps=1,
                     num_ppo_epochs=1, response_length=4, apply_chat_template_to_text=False, **overrides)


def test_a_trainer_trains_and_evaluates_after_refused_constructions_in_its_process(
        tiny_models, tokenizer, prompts_dataset, tmp_path, monkeypatch):
    """Every TrainingArguments empties accelerate's process-wide AcceleratorState and every Accelerator fills it with
    its own settings: a PPOConfig refused after that, a trainer refused before its Accelerator exists (its PPOConfig
    already emptied the state) or after (the state is the refused one's: bf16 on the CPU here) left a trainer built
    before unable to train ("`AcceleratorState` object has no attribute `distributed_type`") or training under
    another run's mixed precision. It trains and evaluates as built; the corrected construction succeeds too."""
    from accelerate.state import AcceleratorState

    import hf_ppo.trainer.ppo_trainer as ppo_trainer

    def build_a(args, dataset=prompts_dataset):
        return PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                            train_dataset=dataset, eval_dataset=dataset)

    trainer = build_a(one_step_args(tmp_path, "a"))
    stepper = PPOLMTrainer(model=tiny_models["policy"], processing_class=tokenizer,  # a TRL 0.11 step() loop's
                           args=one_step_args(tmp_path, "c", lr_scheduler_type="constant"))

    def refusals():
        with pytest.raises(ValueError, match="kl_coef"):  # after TrainingArguments emptied the state
            one_step_args(tmp_path, "b", kl_coef=-1.0)
        with pytest.raises(ValueError, match="prompt"):  # before Trainer.__init__, after its PPOConfig
            build_a(one_step_args(tmp_path, "b"), Dataset.from_dict({"text": ["the movie was"] * 4}))
        with monkeypatch.context() as patch:  # after Trainer.__init__ made a bf16 Accelerator (vLLM missing, say)
            patch.setattr(ppo_trainer, "make_rollout_engine", lambda *a, **k: (_ for _ in ()).throw(
                ImportError("rollout_engine='vllm' needs vLLM")))
            with pytest.raises(ImportError, match="vLLM"):
                build_a(one_step_args(tmp_path, "b", bf16=True, use_cpu=True))

    refusals()
    precision = []
    trainer.add_callback(type("Precision", (transformers.TrainerCallback,), {
        "on_step_end": lambda self, *a, **k: precision.append(AcceleratorState().mixed_precision)})())
    trainer.train()
    assert trainer.state.global_step == 1 and precision == ["no"]
    refusals()
    assert math.isfinite(trainer.evaluate()["eval_loss"])

    corrected = build_a(one_step_args(tmp_path, "b", bf16=True, use_cpu=True))
    corrected.train()
    assert corrected.state.global_step == 1 and AcceleratorState().mixed_precision == "bf16"
    query = torch.tensor(tokenizer.encode("the movie was"))
    stepper.step([query] * 4, [torch.tensor([10, 11])] * 4, [1.0, 0.0, 1.0, 0.0])  # built before `corrected`, fp32
    assert stepper.state.global_step == 1 and AcceleratorState().mixed_precision == "no"
    trainer.args.max_steps = 2
    trainer.train(resume_from_checkpoint=False)  # the first trainer again, under its own fp32 state
    assert precision[-1] == "no"


@needs_fsdp2
def test_fsdp_in_a_single_process_is_refused_before_any_model_loads(tokenizer, prompts_dataset, tmp_path):
    """Trainer refuses FSDP in one process only after the models loaded and its Accelerator replaced accelerate's
    state: hf_ppo refuses it first, naming how to launch several processes (the model path here does not exist)."""
    args = one_step_args(tmp_path, "fsdp", fsdp="full_shard", fsdp_config={"version": 2})
    with pytest.raises(ValueError, match=r"single process.*distributed training.*accelerate launch --num_processes"):
        PPOLMTrainer(model=str(tmp_path / "no-such-model"), args=args, processing_class=tokenizer,
                     reward_model=count_e, train_dataset=prompts_dataset)


def test_gradient_checkpointing_with_lora(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path):
    args = make_args(tmp_path, gradient_checkpointing=True, max_steps=2, num_ppo_epochs=1)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=prompts_dataset, peft_config=lora_config)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)


def test_critic_learning_rate_gives_the_value_head_its_own_param_group(tiny_models, tokenizer, prompts_dataset,
                                                                       tmp_path):
    trainer = build(tiny_models, tokenizer, tmp_path, prompts_dataset, critic_learning_rate=0.5)
    optimizer = trainer.create_optimizer()
    head = {id(p) for p in trainer.model.v_head.parameters()}
    groups = [g for g in optimizer.param_groups if {id(p) for p in g["params"]} & head]
    assert len(groups) == 1 and groups[0]["lr"] == 0.5 and {id(p) for p in groups[0]["params"]} == head
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(trainer.model.parameters()))


def test_config_constructs_without_flags_on_cpu(tmp_path, monkeypatch):
    """PPOConfig() with no flags constructs on any machine: without a GPU mixed precision stays off instead of
    failing; where CUDA is visible bf16 is on exactly when the GPU supports it (fp16 is never turned on by itself).
    use_cpu=True runs on the CPU on either machine, so it keeps the CPU's default (off)."""
    monkeypatch.chdir(tmp_path)
    args = PPOConfig()
    bf16_supported = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    assert args.bf16 is bf16_supported and args.fp16 is False
    assert PPOConfig(use_cpu=True).bf16 is False


def test_use_cpu_keeps_the_cpus_precision_where_a_bf16_gpu_is_visible(tmp_path, monkeypatch):
    """bf16=None turns bf16 on for a run on a GPU that supports it; use_cpu=True runs on the CPU, so its default stays
    the CPU's fp32 (a test or a run pinned to the CPU on a GPU machine computes as on a machine without one)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    args = PPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    assert args.bf16 is False and args.device.type == "cpu"
    assert PPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=True).bf16 is True  # asked: on
    assert (args.rollout_batch_size, args.optimizer_steps_per_iteration) == (8, 4)
    assert (args.gamma, args.lam, args.cliprange, args.vf_coef, args.kl_coef, args.temperature) == (
        1.0, 0.95, 0.2, 0.1, 0.05, 0.7)


def test_trackers_and_sample_tables(tiny_models, tokenizer, prompts_dataset, tmp_path, capsys):
    """report_to works as in any Trainer (tensorboard event files), and with no tracker the sample table is printed."""
    args = make_args(tmp_path, report_to=["tensorboard"], num_sample_generations=2)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=prompts_dataset)
    trainer.train()
    assert list(tmp_path.rglob("events.out.tfevents.*"))
    assert "Samples at PPO iteration" not in capsys.readouterr().out  # a tracker is set: no console table

    args = make_args(tmp_path, num_sample_generations=2)  # report_to=[]: print with rich
    PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                 train_dataset=prompts_dataset).train()
    printed = capsys.readouterr().out
    assert printed.count("Samples at PPO iteration") == 2 and "the movie was" in printed


# ---- loss variants ---------------------------------------------------------------------------------------------------
def test_loss_variants_train_with_finite_metrics_and_a_sequence_normalizer(tiny_models, tokenizer, prompts_dataset,
                                                                           tmp_path):
    """Dr. GRPO's length-unbiased aggregation + clip-higher + dual clip + entropy bonus: two optimizer steps."""
    trainer = build(tiny_models, tokenizer, tmp_path, prompts_dataset, loss_aggregation="dr_grpo",
                    cliprange_low=0.2, cliprange_high=0.28, dual_clip=3.0, entropy_coef=0.01, max_steps=2)
    normalizers = []
    compute_loss = trainer.compute_loss

    def spy(model, inputs, *args, **kwargs):
        normalizers.append(float(inputs["normalizer"]))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = spy
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    # minibatch = 4 x 2 = 8 responses, each with at least one real token: the normalizer counts sequences, not tokens
    assert normalizers == [8.0] * 4
    logged = [e for e in trainer.state.log_history if "loss/policy_avg" in e]
    assert len(logged) == 2
    assert all(math.isfinite(v) for e in logged for k, v in e.items() if isinstance(v, float))
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("policy_loss", ["cispo", "sapo", "gmpo", "gpg", "clip_cov", "kl_cov"])
def test_each_policy_loss_trains_a_real_run_with_a_k3_plus_kl_loss(policy_loss, tiny_models, tokenizer,
                                                                    prompts_dataset, tmp_path):
    """Issue 62: every policy_loss (and the k3+ KL loss term) through PPOLMTrainer: two finite optimizer steps that
    move the policy, and a loss other than PPO's on the same first micro-batch."""
    trainer = build(tiny_models, tokenizer, tmp_path, prompts_dataset, policy_loss=policy_loss, use_kl_loss=True,
                    kl_loss_estimator="k3+", max_steps=2)
    assert (trainer.args.loss_settings.policy_loss, trainer.args.loss_settings.kl_loss_estimator) == (
        policy_loss, "k3+")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss/policy_avg" in e]
    assert len(logged) == 2 and all(math.isfinite(e["loss/kl_avg"]) for e in logged)
    assert all(math.isfinite(v) for e in logged for k, v in e.items() if isinstance(v, float))
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_normalize_then_sum_trains_on_each_reward_normalised_in_its_group(tiny_models, tokenizer, tmp_path):
    """Issue 62 (TRL's multi_objective_aggregation): the rollout's combined score is the weighted sum of each reward
    normalised within its prompt's group, so each group's score sums to 0, and objective/scores logs its mean (TRL's
    `reward`); the per-reward logs stay raw."""
    def length(prompts, completions):
        return [float(len(c)) for c in completions]

    trainer = build(tiny_models, tokenizer, tmp_path, reward=[count_e, length], reward_weights=[1.0, 0.5],
                    advantage_estimator="grpo", num_generations=4, scale_rewards="batch",
                    multi_objective_aggregation="normalize_then_sum", max_steps=1)
    rollouts = []
    rollout = trainer._rollout

    def spy(inputs):
        batch = rollout(inputs)
        rollouts.append(batch)
        return batch

    trainer._rollout = spy
    trainer.train()
    scores = rollouts[0].scores.reshape(-1, 4)
    assert torch.allclose(scores.sum(dim=1), torch.zeros(scores.shape[0]), atol=1e-4)
    assert scores.abs().sum() > 0
    logged = next(e for e in trainer.state.log_history if "objective/scores" in e)
    assert abs(logged["objective/scores"]) < 1e-4 and logged["rewards/length/mean"] > 1


def test_seq_mean_aggregation_accumulates_exactly(tiny_models, tokenizer, prompts_dataset, tmp_path):
    """1 x 8 and 2 x 4 (accumulated) move the weights identically under a sequence-level aggregation too (the
    normalizer is the minibatch's 8 sequences; each micro-batch's own 4 would double the 2 x 4 gradient). fp32 on any
    machine (bf16=False), as in the test above."""
    weights = []
    for micro, accumulation in [(8, 1), (4, 2)]:
        trainer = build(tiny_models, tokenizer, tmp_path, prompts_dataset, per_device_train_batch_size=micro,
                        gradient_accumulation_steps=accumulation, num_ppo_epochs=1, max_steps=1, optim="sgd",
                        learning_rate=1.0, max_grad_norm=0.0, loss_aggregation="seq_mean_token_mean", bf16=False)
        trainer.train()
        weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("field, value, message", [
    ("loss_aggregation", "seq_mean", "loss_aggregation='seq_mean': choose"),
    ("cliprange_low", 0.0, "cliprange_low=0.0: must be > 0"),
    ("cliprange_high", -0.1, "cliprange_high=-0.1: must be > 0"),
    ("dual_clip", 1.0, "dual_clip=1.0: must be > 1"),
])
def test_loss_variant_fields_are_range_checked(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **{field: value})


def test_warnings_name_the_line_of_the_users_code(tiny_models, tokenizer, prompts_dataset, tmp_path):
    """hf_ppo's warnings point at the line that constructed the trainer or called train(), not at hf_ppo's own
    code (nor Trainer's loop in between)."""
    import copy
    import inspect

    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None  # hf_ppo picks a pad token, and says so
    calls = {"n": 0}

    def nan_once(prompts, completions):
        calls["n"] += 1
        return [math.nan if calls["n"] == 2 else 1.0] * len(completions)  # call 1: the construction probe

    with pytest.warns(UserWarning) as built:
        line = inspect.currentframe().f_lineno + 1
        trainer = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path, max_steps=1), processing_class=no_pad,
                               reward_model=nan_once, train_dataset=prompts_dataset)
    pad = [w for w in built if "pad" in str(w.message)]
    assert pad and all((w.filename, w.lineno) == (__file__, line) for w in pad)
    with pytest.warns(UserWarning, match="Non-finite") as trained:
        line = inspect.currentframe().f_lineno + 1
        trainer.train()
    guard = [w for w in trained if "Non-finite" in str(w.message)]
    assert guard and all((w.filename, w.lineno) == (__file__, line) for w in guard)


def test_a_chosen_pad_token_is_announced_once(tiny_models, tokenizer, prompts_dataset, tmp_path):
    """hf_ppo's warning says which pad it chose; transformers then finds the model's configs already aligned and
    does not announce the pad again (its message may still list other tokens it aligns)."""
    import copy
    import logging

    logging.Logger.warning_once.cache_clear()
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    model.config.pad_token_id = model.generation_config.pad_token_id = None  # a checkpoint that names no pad
    model.save_pretrained(tmp_path / "no_pad")
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    try:
        with pytest.warns(UserWarning, match="has no pad token: padding with"):
            trainer = PPOLMTrainer(model=str(tmp_path / "no_pad"), args=make_args(tmp_path), processing_class=no_pad,
                                   reward_model=count_e, train_dataset=prompts_dataset)
        trainer.train()  # where Trainer aligns the model's special tokens with the tokenizer's, and says so
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [line for line in lines if "pad_token_id" in line], lines
    policy = trainer.model.pretrained_model
    assert policy.config.pad_token_id == policy.generation_config.pad_token_id == trainer.processing_class.pad_token_id


# ---- transformers.Trainer's seams ------------------------------------------------------------------------------------
# The transformers.Trainer seams hf_ppo relies on: each test names the method or attribute that disappeared or
# changed.
#
# pyproject.toml pins `transformers>=5.19`, the first release with `Trainer.loss_is_scaled_for_ga` (without it the
# token-normalised PPO loss is divided by gradient_accumulation_steps a second time). When one of these tests fails
# after a transformers upgrade, fix the override named in the message before raising the pin.

# Trainer method -> the leading parameters PPOLMTrainer's override (or call) passes, in order.
SEAMS = {
    "_prepare_inputs": ["inputs"],
    "compute_loss": ["model", "inputs", "return_outputs", "num_items_in_batch"],
    "training_step": ["model", "inputs", "num_items_in_batch"],
    "_get_train_sampler": ["train_dataset"],
    "_get_dataloader": ["dataset", "description", "batch_size", "sampler_fn", "is_training"],
    "create_optimizer": ["model"],
    "_get_grad_norm": ["model", "grad_norm"],
    "log": ["logs", "start_time"],
    "prediction_step": ["model", "inputs", "prediction_loss_only", "ignore_keys"],
    "evaluate": ["eval_dataset", "ignore_keys", "metric_key_prefix"],
    "save_model": ["output_dir", "_internal_call"],
    "save_state": [],
    "_save": ["output_dir", "state_dict"],
    "_save_checkpoint": ["model", "trial"],
    "_get_output_dir": ["trial"],
    "_hp_search_setup": ["trial"],
    "_load_from_checkpoint": ["resume_from_checkpoint", "model"],
    "init_hf_repo": ["token"],
    "_push_from_checkpoint": ["checkpoint_folder"],
    "push_to_hub": ["commit_message", "blocking", "token", "revision"],
    "pop_callback": ["callback"],
    "add_callback": ["callback"],
    "is_world_process_zero": [],
}


def _params(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


@pytest.mark.parametrize("name", sorted(SEAMS))
def test_trainer_has_the_method_with_its_parameters(name):
    assert hasattr(Trainer, name), f"transformers {transformers.__version__}: Trainer.{name} is gone; hf_ppo " \
                                   f"overrides or calls it (see hf_ppo/trainer/ppo_trainer.py)."
    params = _params(getattr(Trainer, name))
    expected = SEAMS[name]
    assert params[:len(expected)] == expected, (
        f"transformers {transformers.__version__}: Trainer.{name}{tuple(params)} no longer starts with "
        f"{tuple(expected)}; update PPOLMTrainer.{name}.")


def test_every_override_accepts_what_trainer_passes():
    for name, member in vars(PPOLMTrainer).items():
        if not inspect.isfunction(member) or not inspect.isfunction(getattr(Trainer, name, None)) or name == "__init__":
            continue
        ours, theirs = _params(member), _params(getattr(Trainer, name))
        accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(member).parameters.values())
        missing = [p for p in theirs if p not in ours and not p.startswith("*")]
        assert not missing or accepts_kwargs, (
            f"transformers {transformers.__version__}: Trainer.{name} takes {missing} that PPOLMTrainer.{name} "
            "does not accept.")


def test_loss_is_scaled_for_ga_is_read_by_training_step():
    assert "loss_is_scaled_for_ga" in vars(Trainer), (
        f"transformers {transformers.__version__}: Trainer.loss_is_scaled_for_ga is gone; PPOLMTrainer's loss is "
        "already normalised over the minibatch and would be divided by gradient_accumulation_steps again.")
    assert "self.loss_is_scaled_for_ga" in inspect.getsource(Trainer.training_step), "Trainer.training_step no " \
        "longer reads loss_is_scaled_for_ga."


def _order(source: str, *needles: str) -> list[int]:
    return [source.find(n) for n in needles]


def test_save_checkpoint_writes_trainer_state_last_then_rotates():
    """checkpoint.py's completeness rule: trainer_state.json is Trainer's last file, and rotation comes after it."""
    source = inspect.getsource(Trainer._save_checkpoint)
    positions = _order(source, "self.save_model(", "_save_rng_state(", "save_to_json(", "rotate_checkpoints(")
    assert -1 not in positions and positions == sorted(positions), (
        f"transformers {transformers.__version__}: Trainer._save_checkpoint no longer writes the model, RNG state, "
        f"trainer_state.json, then rotates (positions {positions}); hf_ppo's checkpoint completeness rule relies on it.")
    assert hasattr(transformers.trainer, "rotate_checkpoints") and hasattr(TrainerState, "save_to_json")


def test_train_calls_hp_search_setup_before_resolving_the_last_checkpoint():
    source = inspect.getsource(Trainer.train)
    positions = _order(source, "self._hp_search_setup(", "get_last_checkpoint(", "self._load_from_checkpoint(")
    assert -1 not in positions and positions == sorted(positions), (
        f"transformers {transformers.__version__}: Trainer.train no longer calls _hp_search_setup before resolving "
        "resume_from_checkpoint=True; PPOLMTrainer._hp_search_setup moves incomplete checkpoints aside there.")


def test_grad_norm_is_taken_right_before_the_optimizer_step():
    source = inspect.getsource(transformers.trainer)
    norm, step = source.find("self._get_grad_norm(model"), source.find("self.optimizer.step()")
    assert 0 <= norm < step, (
        f"transformers {transformers.__version__}: Trainer no longer calls _get_grad_norm right before "
        "optimizer.step(); PPOLMTrainer._get_grad_norm skips non-finite steps there.")


class _LogitsSizedTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """The distinct storages of (batch, positions, vocab) tensors of at least `numel` elements that operations make
    (each storage kept alive, so that an address handed out again is not counted twice)."""

    def __init__(self, numel: int, vocab: int):
        super().__init__()
        self.numel, self.vocab, self.storages = numel, vocab, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == self.vocab and t.numel() >= self.numel:
                self.storages.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage(), tuple(t.shape)))
        return out


def test_the_loss_keeps_only_the_positions_that_predict_the_response(tiny_models, tokenizer, tmp_path):
    """The loss's forward keeps exactly the R positions that predict the response (the sequence without its last
    token, `logits_to_keep=R`): no tensor of R + 1 positions is made, forward or backward. Keeping R + 1 and cutting
    the last one off gave the backward one more zero-filled tensor the size of all the logits (194 MB per micro-batch
    of SmolLM2 at 128 tokens), on top of the gradient itself."""
    trainer = build(tiny_models, tokenizer, tmp_path, max_steps=1, num_ppo_epochs=1, gradient_accumulation_steps=1,
                    bf16=False)
    vocab = trainer.model.policy_model.config.vocab_size
    compute_loss, made = trainer.compute_loss, []

    def measured(model, inputs, *args, **kwargs):
        batch = inputs["batch"]
        with _LogitsSizedTensors(len(batch) * batch.responses.shape[1] * vocab, vocab) as mode:
            loss = compute_loss(model, inputs, *args, **kwargs)
            loss.backward()
        made.append({shape for _, shape in mode.storages.values()})
        return loss.detach().requires_grad_()  # (its gradient is taken: Trainer's backward of it does nothing more)

    trainer.compute_loss = measured
    trainer.train()
    R = trainer.args.response_length
    assert made and all(shapes == {(4, R, vocab)} for shapes in made), f"logits-sized tensors: {made}"


# ---- issue 63 kind 5: truncated importance sampling sees the engine's own log-probs, end to end ----------------------
def test_truncated_importance_sampling_changes_the_loss_when_the_engines_log_probs_differ(
        tiny_models, tokenizer, prompts_dataset, tmp_path, monkeypatch):
    """A sampler whose log-probs are planted far below the policy's (a known gap, as a vLLM holding other weights
    would give): every token's weight is min(pi_old / pi_sampler, cap) = the cap, 2, not 1. With the weights
    computed against the policy's own log-probs on both sides, the weights would be 1 and a unit test of the weight
    formula alone would still pass."""
    from tests.scripted_engine import ScriptedEngine

    class Gapped(ScriptedEngine):
        def generate(self, model, queries, query_mask):
            responses = super().generate(model, queries, query_mask)
            self.sampled = torch.full(responses.shape, -30.0)  # exp(old - (-30)) is far above any cap
            return responses

        def last_logprobs(self):
            return self.sampled

    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize(" the movie was great and the end")][:8]
    monkeypatch.setattr("hf_ppo.trainer.ppo_trainer.make_rollout_engine", lambda *a, **k: Gapped([ids]))
    for cap, weight in ((2.0, 2.0), (None, None)):
        trainer = PPOLMTrainer(model=tiny_models["policy"], processing_class=tokenizer, reward_model=count_e,
                               train_dataset=prompts_dataset,
                               args=make_args(tmp_path, max_steps=1, num_ppo_epochs=1, gradient_accumulation_steps=1,
                                              rollout_engine="vllm", use_cpu=True, stop_token=None,
                                              vllm_importance_sampling_cap=cap))
        trainer.train()
        logged = [e["policy/importance_weight_avg"] for e in trainer.state.log_history
                  if "policy/importance_weight_avg" in e]
        gaps = [e["rollout/vllm_logprob_diff_mean"] for e in trainer.state.log_history
                if "rollout/vllm_logprob_diff_mean" in e]
        assert gaps and gaps[0] > 20  # the planted gap is seen
        if weight is None:
            assert logged == [] or logged == [pytest.approx(1.0)]  # off: no correction
        else:
            assert logged == [pytest.approx(weight)]  # every weight the cap, not 1


# ---- issue 59: the passes no update reads are skipped ---------------------------------------------------------------
def _counting_passes(monkeypatch) -> list[bool]:
    """Each no-grad forward pass of a rollout (steps 5 and 6: `policy_forward`), as whether it asked for values."""
    from hf_ppo.rollout import steps

    passes, forward = [], steps.policy_forward

    def counted(*args, **kwargs):
        passes.append(kwargs.get("with_values", True))
        return forward(*args, **kwargs)

    monkeypatch.setattr(steps, "policy_forward", counted)
    return passes


def test_grpo_with_one_step_per_rollout_and_no_kl_runs_no_old_logprob_or_reference_pass(
        tiny_models, tokenizer, tmp_path, monkeypatch):
    """kl_coef=0, one optimizer step per rollout (gradient accumulation is still one step), critic-free: neither pass
    runs but on every `stats_pass_every`-th rollout; the loss's ratio is exactly 1 (its own forward's log-probs are the
    old ones); the metrics those passes measure are absent from the other rollouts' logs, never a placeholder's 0."""
    passes = _counting_passes(monkeypatch)
    trainer = build(tiny_models, tokenizer, tmp_path, max_steps=4, num_ppo_epochs=1, gradient_accumulation_steps=2,
                    advantage_estimator="grpo", num_generations=2, kl_coef=0.0, stats_pass_every=2, bf16=False)
    trainer.train()
    assert len(passes) == 4, passes  # rollouts 1 and 3: the policy's pass and the reference's; 2 and 4: none
    history = [e for e in trainer.state.log_history if "val/ratio" in e]
    assert len(history) == 4
    assert all(e["val/ratio"] == 1.0 and e["val/ratio_var"] == 0.0 for e in history), history
    measured = ["objective/kl", "objective/entropy", "policy/entropy_avg"]
    assert [all(k in e for k in measured) for e in history] == [True, False, True, False]
    assert all("objective/scores" in e and "time/reference" in e for e in history)


def test_the_skipped_passes_run_where_an_update_reads_them(tiny_models, tokenizer, tmp_path, monkeypatch):
    """Two PPO epochs (the second update's ratio reads the rollout's log-probs), and kl_coef > 0 (the reward reads the
    KL): every rollout runs both passes, and logs every metric."""
    passes = _counting_passes(monkeypatch)
    build(tiny_models, tokenizer, tmp_path, max_steps=4, num_ppo_epochs=2, gradient_accumulation_steps=1,
          advantage_estimator="grpo", num_generations=2, kl_coef=0.0, stats_pass_every=0, bf16=False).train()
    assert len(passes) == 2  # two rollouts of two optimizer steps each: the old log-probs, no reference (kl_coef=0)
    passes.clear()
    trainer = build(tiny_models, tokenizer, tmp_path / "kl", max_steps=2, num_ppo_epochs=1,
                    gradient_accumulation_steps=1, advantage_estimator="rloo", num_generations=2, kl_coef=0.1,
                    stats_pass_every=0, bf16=False)
    trainer.train()
    assert len(passes) == 4  # both passes at each of the two rollouts
    assert all("objective/kl" in e for e in trainer.state.log_history if "val/ratio" in e)


def test_with_the_value_head_a_rollout_takes_log_probs_and_values_from_one_pass_of_the_body(
        tiny_models, tokenizer, tmp_path):
    """gae with the shared value head at kl_coef=0: one no-cache forward of the policy's body per rollout (the old
    log-probs and the values together; no reference pass), beside the sampling's cached ones."""
    trainer = build(tiny_models, tokenizer, tmp_path, max_steps=2, num_ppo_epochs=1, gradient_accumulation_steps=1,
                    kl_coef=0.0, stats_pass_every=0, bf16=False)
    body, rollout, calls = trainer.model.pretrained_model, trainer._rollout, []
    in_rollout = [False]

    def count(module, args, kwargs, output):
        if in_rollout[0] and not kwargs.get("use_cache", True):
            calls[-1] += 1

    def counted(inputs):
        calls.append(0)
        in_rollout[0] = True
        try:
            return rollout(inputs)
        finally:
            in_rollout[0] = False

    handle = body.register_forward_hook(count, with_kwargs=True)
    trainer._rollout = counted
    try:
        trainer.train()
    finally:
        handle.remove()
    assert calls == [1, 1], calls

"""hf_ppo.trl011: a TRL 0.11 PPO loop (its PPOConfig, PPOTrainer, dataloader, generate, step) with the import changed.

The loop below is written as TRL 0.11's documentation wrote it (field names, constructor, collator, loop body); only
the import line names hf_ppo.trl011. Tiny offline models from conftest.py.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from tests.scripted_engine import fingerprint

from hf_ppo import PPOConfig as HfPPOConfig
from hf_ppo.trl011 import PPOConfig, PPOTrainer


def test_a_trl_0_11_loop_runs_with_only_the_import_changed(tiny_models, tokenizer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default output_dir ("ppo_output") stays in the temp dir
    from hf_ppo.trl011 import AutoModelForCausalLMWithValueHead  # TRL 0.11: from trl import ...

    # ---- TRL 0.11's code from here on ----
    config = PPOConfig(model_name=tiny_models["policy"], learning_rate=1e-2, batch_size=4, mini_batch_size=2,
                       ppo_epochs=1, init_kl_coef=0.2, adap_kl_ctrl=True, seed=0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(config.model_name)
    reviews = ["the movie was", "the food was", "the book was", "the show was", "the game was", "the song was",
               "the hotel was", "the film was", "a"]  # 9 rows: batches of 4, the incomplete last one dropped
    ds = Dataset.from_dict({"review": reviews})

    def tokenize(sample):
        sample["input_ids"] = tokenizer.encode(sample["review"])
        sample["query"] = tokenizer.decode(sample["input_ids"])
        return sample

    ds = ds.map(tokenize)
    ds.set_format(type="torch")

    def collator(data):
        return dict((key, [d[key] for d in data]) for key in data[0])

    ppo_trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer, dataset=ds, data_collator=collator)
    generation_kwargs = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True,
                         "pad_token_id": tokenizer.pad_token_id, "max_new_tokens": 4}
    before = fingerprint(model)
    batches = 0
    for batch in ppo_trainer.dataloader:
        query_tensors = batch["input_ids"]
        response_tensors = ppo_trainer.generate(query_tensors, return_prompt=False, **generation_kwargs)
        batch["response"] = tokenizer.batch_decode(response_tensors)
        rewards = [torch.tensor(float(r.count("e"))) for r in batch["response"]]
        stats = ppo_trainer.step(query_tensors, response_tensors, rewards)
        ppo_trainer.log_stats(stats, batch, rewards)
        batches += 1
    # ---- end of TRL 0.11's code ----

    assert batches == 2 and set(batch) == {"input_ids", "query", "response"}  # "review" removed, as TRL did
    assert fingerprint(model) != before, "the user's model object must be the one trained"
    assert ppo_trainer.state.global_step == 4  # 2 step() calls x 2 minibatches x 1 epoch
    assert {"objective/kl", "objective/kl_coef", "objective/entropy", "ppo/mean_scores", "ppo/loss/policy",
            "ppo/loss/value", "ppo/loss/total", "ppo/policy/clipfrac", "ppo/policy/approxkl", "ppo/learning_rate",
            "ppo/val/var_explained"} <= set(stats)
    assert stats["ppo/learning_rate"] == pytest.approx(1e-2)  # constant, as TRL 0.11 without a scheduler
    assert not (tmp_path / "ppo_output").exists() or not any((tmp_path / "ppo_output").iterdir())


def test_config_maps_trl_0_11_fields_by_hand():
    args = PPOConfig(batch_size=64, mini_batch_size=16, ppo_epochs=3, init_kl_coef=0.3, adap_kl_ctrl=False,
                     target=5.0, horizon=2000.0, gamma=0.99, lam=0.9, cliprange=0.1, cliprange_value=0.3, vf_coef=0.5,
                     whiten_rewards=True, use_score_scaling=True, use_score_norm=True, score_clip=3.0,
                     kl_penalty="mse", seed=7, model_name="gpt2")
    assert isinstance(args, HfPPOConfig)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_mini_batches) == (16, 1, 4)
    assert args.rollout_batch_size == 64 and args.num_ppo_epochs == 3
    assert (args.kl_coef, args.adaptive_kl, args.kl_target, args.kl_horizon, args.kl_estimator) == (
        0.3, False, 5.0, 2000, "k2")
    assert (args.gamma, args.lam, args.cliprange, args.cliprange_value, args.vf_coef) == (0.99, 0.9, 0.1, 0.3, 0.5)
    assert args.whiten_rewards and args.normalize_rewards and args.reward_clip == 3.0 and args.seed == 7
    assert args.max_grad_norm == 0.0 and args.report_to == [] and args.model_name == "gpt2"
    # gradient accumulation: one optimizer step per mini_batch_size x gradient_accumulation_steps = 32 samples
    acc = PPOConfig(batch_size=64, mini_batch_size=16, gradient_accumulation_steps=2)
    assert (acc.per_device_train_batch_size, acc.gradient_accumulation_steps, acc.num_mini_batches) == (16, 2, 2)
    fwd = PPOConfig(batch_size=64, mini_batch_size=16, forward_batch_size=8)  # TRL 0.11: overwrites mini_batch_size
    assert (fwd.per_device_train_batch_size, fwd.num_mini_batches) == (8, 8)
    # TRL 0.11's defaults, not hf_ppo's
    trl = PPOConfig()
    assert (trl.learning_rate, trl.kl_coef, trl.adaptive_kl, trl.rollout_batch_size, trl.num_mini_batches) == (
        1.41e-5, 0.2, True, 128, 1)
    assert trl.lr_scheduler_type == "constant" and trl.seed == 0 and trl.save_strategy == "no"


def test_unmappable_and_unknown_names_error_and_cosmetic_ones_warn():
    with pytest.raises(ValueError, match="early_stopping=True"):
        PPOConfig(early_stopping=True)
    with pytest.raises(ValueError, match="ratio_threshold=5.0"):
        PPOConfig(ratio_threshold=5.0)
    with pytest.raises(ValueError, match="kl_penalty='abs'"):
        PPOConfig(kl_penalty="abs")
    with pytest.raises(ValueError, match="use_score_scaling=True without use_score_norm"):
        PPOConfig(use_score_scaling=True)
    with pytest.raises(ValueError, match="multiple of mini_batch_size"):
        PPOConfig(batch_size=10, mini_batch_size=4)
    with pytest.raises(TypeError, match="num_mini_batches"):
        PPOConfig(num_mini_batches=2)
    with pytest.warns(UserWarning, match=r"\['optimize_device_cache', 'tracker_project_name'\]"):
        PPOConfig(tracker_project_name="x", optimize_device_cache=True)


def test_precision_is_trl_0_11s_fp32_unless_its_accelerator_kwargs_ask(recwarn):
    """TRL 0.11 trained in fp32 unless `accelerator_kwargs` set `mixed_precision`: the shim does too, where
    hf_ppo's own default turns bf16 on with a GPU that supports it (on a GPU machine this test pins that)."""
    trl = PPOConfig()
    assert (trl.bf16, trl.fp16, trl.precision) == (False, False, "fp32")
    assert PPOConfig(accelerator_kwargs={"mixed_precision": "no"}).precision == "fp32"
    assert not [w for w in recwarn if "accelerator_kwargs" in str(w.message)]  # mixed_precision alone is not ignored
    with pytest.warns(UserWarning, match=r"\['accelerator_kwargs'\]"):  # its other keys are
        PPOConfig(accelerator_kwargs={"mixed_precision": "no", "log_with": "wandb"})
    with pytest.raises(ValueError, match="mixed_precision.*'no', 'fp16' or 'bf16'"):
        PPOConfig(accelerator_kwargs={"mixed_precision": "fp8"})


def test_accelerator_kwargs_mixed_precision_reaches_the_run(monkeypatch):
    """accelerator_kwargs={'mixed_precision': 'bf16'} trains in bf16, and the default is asked for as fp32 in so many
    words (not left to hf_ppo's bf16=None, which a GPU turns on). On the CPU, TrainingArguments takes bf16 only with
    use_cpu=True: the shim's config is built with it here, which leaves its own bf16=None at fp32 too."""
    from hf_ppo.compat import trl011

    built = []

    def on_the_cpu(**kwargs):
        built.append(kwargs)
        return HfPPOConfig(**kwargs, use_cpu=True)

    monkeypatch.setattr(trl011, "_PPOConfig", on_the_cpu)
    assert PPOConfig(accelerator_kwargs={"mixed_precision": "bf16"}).precision == "bf16"
    assert PPOConfig().precision == "fp32"
    assert (built[-1].get("bf16"), built[-1].get("fp16")) == (False, False)  # fp32 asked for, not left to a default


def test_trainer_arguments_it_does_not_offer_error_before_loading(tmp_path):
    config = PPOConfig(output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="num_shared_layers is not offered"):
        PPOTrainer(config, "no/such-model", num_shared_layers=2)
    with pytest.raises(ValueError, match="lr_scheduler is not offered"):
        PPOTrainer(config, "no/such-model", lr_scheduler=object())


def test_a_foreign_optimizer_errors_and_a_response_longer_than_response_length_trains(tiny_models, tokenizer,
                                                                                      tmp_path):
    config = PPOConfig(output_dir=str(tmp_path), batch_size=2, mini_batch_size=2, response_length=4)
    stray = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="optimizer= must hold the trainer's own trainable parameters"):
        PPOTrainer(config, tiny_models["policy"], tokenizer=tokenizer, optimizer=stray)
    trainer = PPOTrainer(config, tiny_models["policy"], tokenizer=tokenizer)
    assert trainer.dataloader is None
    queries = [torch.tensor(tokenizer.encode("the movie was"))] * 2
    # TRL 0.11's step() took responses of any length (its loop generates with its own max_new_tokens).
    stats = trainer.step(queries, [torch.tensor([10, 11, 12, 13, 14])] * 2, [1.0, 0.0])
    assert stats["tokens/responses_len_mean"] == 5 and trainer.state.global_step == 4  # ppo_epochs=4

"""Issue 3 through the trainer: push only the policy (round trip via a local Hub), failed pushes, resume, and a reward
model with a different tokenizer."""

import hashlib
import os

import pytest
import torch
from datasets import Dataset

from hf_ppo import PPOConfig, PPOLMTrainer
from hub_fixtures import TEST_USER


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


def make_args(tmp_path, **overrides) -> PPOConfig:
    defaults = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=1,
        num_mini_batches=2, num_ppo_epochs=2, max_steps=8, response_length=8, logging_steps=4, learning_rate=1e-2,
        report_to=[], save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0,
    )
    defaults.update(overrides)
    return PPOConfig(**defaults)


def folder_digest(folder) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(folder, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(folder)) if os.path.isfile(os.path.join(folder, f))}


def test_train_push_load_generate(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path, local_hub, hub_token):
    repo_id = f"{TEST_USER}/tiny-ppo"
    args = make_args(tmp_path, push_to_hub=True, hub_model_id=repo_id, hub_token=hub_token)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=tiny_models["reward"], train_dataset=prompts_dataset, peft_config=lora_config,
                           )
    trainer.train()
    trainer.push_to_hub(dataset_name="hf-ppo-test/prompts")

    pushed = local_hub.files(repo_id)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md",
            "training_curves.png"} <= set(pushed)
    assert not [f for f in pushed if f.startswith("checkpoint") or f in (
        "value_head.safetensors", "training_args.bin", "optimizer.pt", "scheduler.pt", "ppo_state.json")]
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json"):
        assert pushed[name] == open(os.path.join(args.output_dir, name), "rb").read()
    card = pushed["README.md"].decode()
    assert "hf_ppo" in card and "rlhf" in card and "hf-ppo-test/prompts" in card
    assert str(tmp_path) not in card and hub_token not in card

    # The pushed adapter loads by repo id from the (local) Hub and generates.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    policy = PeftModel.from_pretrained(base, repo_id, token=hub_token)
    tok = AutoTokenizer.from_pretrained(repo_id, token=hub_token)
    inputs = tok(["the movie was"], return_tensors="pt")
    out = policy.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > inputs["input_ids"].shape[1]
    trained = trainer.model.pretrained_model
    for name, value in policy.named_parameters():
        if "lora_" in name:
            torch.testing.assert_close(value, dict(trained.named_parameters())[name])


def test_push_to_hub_pushes_the_critic_to_its_own_repo(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path,
                                                        local_hub, hub_token):
    from hf_ppo.models.critics import CRITIC_INFO_FILE, CRITIC_STATE_FILE
    from hf_ppo.hub.publish import push_run_critic

    repo_id, critic_repo = f"{TEST_USER}/tiny-ppo", f"{TEST_USER}/tiny-ppo-critic"
    args = make_args(tmp_path, max_steps=4, hub_model_id=repo_id, hub_token=hub_token, critic="separate",
                     critic_hub_model_id=critic_repo)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=tiny_models["reward"], train_dataset=prompts_dataset, peft_config=lora_config)
    trainer.train()
    trainer.push_to_hub()
    policy_files, critic_files = set(local_hub.files(repo_id)), set(local_hub.files(critic_repo))
    assert "adapter_model.safetensors" in policy_files and not {CRITIC_STATE_FILE, CRITIC_INFO_FILE} & policy_files
    assert {CRITIC_STATE_FILE, CRITIC_INFO_FILE, "README.md"} <= critic_files
    assert "adapter_model.safetensors" not in critic_files
    assert critic_repo in local_hub.files(repo_id)["README.md"].decode()  # the policy's card names the critic's repo

    again = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path, critic="separate"),
                         processing_class=tokenizer, reward_model=tiny_models["reward"],
                         train_dataset=prompts_dataset, peft_config=lora_config, critic_model=critic_repo)
    saved, loaded = trainer.model.critic_state_dict(), again.model.critic_state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    # A hub_model_id without a namespace resolves to the critic's repo: refused before anything is pushed.
    with pytest.raises(ValueError, match="is the policy's repo: the critic goes to a repo of its own"):
        push_run_critic(trainer.model, tokenizer, args.critic_hub_model_id, critic_repo, private=None, token=hub_token)


def test_push_merged_model(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path, local_hub, hub_token):
    repo_id = f"{TEST_USER}/tiny-ppo-merged"
    args = make_args(tmp_path, max_steps=4, push_to_hub=True, hub_model_id=repo_id, hub_token=hub_token,
                     push_merged_model=True)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=prompts_dataset, peft_config=lora_config)
    trainer.train()
    trainer.push_to_hub()
    pushed = set(local_hub.files(repo_id))
    assert "model.safetensors" in pushed and "adapter_config.json" not in pushed

    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(repo_id, token=hub_token)
    probe = tokenizer(["the movie was great"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(merged(**probe).logits, trainer.model.pretrained_model(**probe).logits,
                                   atol=1e-4, rtol=1e-4)


def test_failed_push_keeps_output_and_can_be_retried(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path,
                                                     local_hub, hub_token):
    from hf_ppo.hub.publish import HubPushError

    repo_id = f"{TEST_USER}/tiny-ppo-retry"
    args = make_args(tmp_path, max_steps=4, push_to_hub=True, hub_model_id=repo_id, hub_token=hub_token)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=prompts_dataset, peft_config=lora_config)
    trainer.train()
    local_hub.fail_with(500)
    with pytest.raises(HubPushError, match="retry with trainer.push_to_hub"):
        trainer.push_to_hub()
    saved = folder_digest(args.output_dir)
    assert "adapter_model.safetensors" in saved
    local_hub.fail_with(None)
    trainer.push_to_hub()  # no retraining
    assert folder_digest(args.output_dir) == saved
    assert "adapter_model.safetensors" in local_hub.files(repo_id)


def test_push_without_repo_id_or_user_fails_at_construction(tiny_models, tokenizer, prompts_dataset, tmp_path):
    args = make_args(tmp_path, push_to_hub=True)  # no hub_model_id, no token: no user to push under
    with pytest.raises(ValueError, match="hub_model_id"):
        PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=count_e,
                     train_dataset=prompts_dataset)


@pytest.mark.parametrize("hub_up", [True, False], ids=["hub-404", "hub-down"])
def test_missing_model_id_names_it(tmp_path, prompts_dataset, request, monkeypatch, hub_up):
    if hub_up:
        request.getfixturevalue("local_hub")  # answers 404 at once
    else:
        # The port refuses connections and the client retries with back-off (~45 s of sleeping): skip the sleeps.
        import huggingface_hub

        monkeypatch.setattr(huggingface_hub.utils._http.time, "sleep", lambda seconds: None)
    with pytest.raises(OSError, match="hf-ppo-test/does-not-exist"):
        PPOLMTrainer(model="hf-ppo-test/does-not-exist", args=make_args(tmp_path), reward_model=count_e,
                     train_dataset=prompts_dataset)


def test_reward_model_with_a_different_tokenizer(tiny_models, tokenizer, tmp_path):
    """The reward model reads text in its own vocabulary and chat template: decode, re-template, re-tokenize."""
    from hf_ppo.rollout.scoring import score_responses
    from hf_ppo.cli.tiny import CHAT_TEMPLATE, build_reward_model, build_tokenizer

    reward_tok = build_tokenizer(vocab_size=300)
    reward_tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert reward_tok.get_vocab() != tokenizer.get_vocab() and reward_tok.chat_template != CHAT_TEMPLATE
    reward_dir = tmp_path / "reward300"
    build_reward_model(reward_tok).save_pretrained(reward_dir)
    reward_tok.save_pretrained(reward_dir)
    chats = Dataset.from_dict({"messages": [[{"role": "user", "content": "the movie was"}]] * 8})
    args = make_args(tmp_path, per_device_train_batch_size=4, num_mini_batches=1, max_steps=2, num_ppo_epochs=2,
                     reward_quantization="none")
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                           reward_model=str(reward_dir), train_dataset=chats)
    assert trainer.reward_tokenizer is not None
    trainer.train()
    assert all(torch.isfinite(torch.tensor(e["objective/scores"])) for e in trainer.state.log_history
               if "objective/scores" in e)

    # The score equals the reward model run by hand on the reward tokenizer's rendering of the conversation.
    batch = trainer.data_collator([trainer.train_dataset[0]])
    response = torch.tensor([tokenizer(" great fun", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]])
    score = score_responses(trainer.reward_model, queries=batch["queries"], query_mask=batch["query_mask"],
                            responses=response, response_mask=torch.ones_like(response, dtype=torch.bool),
                            tokenizer=tokenizer, prompts=batch["prompts"], batch_size=4,
                            reward_tokenizer=trainer.reward_tokenizer)
    text = reward_tok.apply_chat_template([{"role": "user", "content": "the movie was"},
                                           {"role": "assistant", "content": " great fun"}], tokenize=False)
    encoded = reward_tok([text], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        expected = trainer.reward_model(**encoded).logits[0, 0]
    torch.testing.assert_close(score[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_lora", [True, False])
def test_resume_matches_an_uninterrupted_run(tiny_models, tokenizer, prompts_dataset, lora_config, tmp_path, use_lora):
    """4 iterations straight == resume from the checkpoint after iteration 2, then 2 more: the same weights and logged
    metrics, bitwise on CPU (RNG states, sampler position, optimizer, scheduler, KL controller and value head are all
    restored, and the same ops run in the same order on the same data)."""
    common = dict(max_steps=16, save_strategy="steps", save_steps=8, adaptive_kl=True, kl_coef=0.1, logging_steps=4)

    def run(out, resume=None, **extra):
        args = make_args(tmp_path, output_dir=str(tmp_path / out), **{**common, **extra})
        trainer = PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer,
                               reward_model=count_e, train_dataset=prompts_dataset,
                               peft_config=lora_config if use_lora else None)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run("straight")
    # "Stop" after iteration 2: a fresh trainer (a new process would do the same) resumes from the checkpoint.
    resumed = run("resumed", resume=str(tmp_path / "straight" / "checkpoint-8"))

    def metrics(trainer):
        return [{k: v for k, v in e.items() if not k.startswith("time/") and "per_second" not in k and "runtime" not in k}
                for e in trainer.state.log_history if "objective/scores" in e]

    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert len(metrics(straight)) == 4 and metrics(straight) == metrics(resumed)
    assert straight.kl_ctl.value == resumed.kl_ctl.value

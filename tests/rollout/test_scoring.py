"""Reward-model inputs (chat / pair / concat), reward tokenizers, and continuing from an SFT adapter (CPU, offline)."""

import json
import os
import warnings

import pytest
import torch
from datasets import Dataset
from safetensors import safe_open

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.algorithms.ppo_math import overlong_penalty
from hf_ppo.hub.cards import model_sources, write_model_card
from hf_ppo.rollout.scoring import RewardSet, penalize, reward_input_format, score_responses
from tests.devices import CUDA, device_of
from tests.hub_fixtures import TEST_USER

QUESTION, ANSWER = "the movie was", " great fun"
CHAT = [{"role": "user", "content": QUESTION}]


def make_args(tmp_path, **overrides) -> PPOConfig:
    defaults = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_mini_batches=1, num_ppo_epochs=2, max_steps=2, response_length=6, logging_steps=1, learning_rate=1e-2,
        report_to=[], save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0,
        reward_quantization="none", ref_quantization="none",
    )
    defaults.update(overrides)
    return PPOConfig(**defaults)


def count_e(prompts, completions):
    return [float(c.count("e")) for c in completions]


# ---- tiny encoder reward model: DeBERTa-v2 with a WordPiece tokenizer that encodes pairs ---------------------------
def build_pair_tokenizer():
    """[CLS] q [SEP] a [SEP] with token_type_ids, no chat template, trained locally (BERT / DeBERTa-v3 shaped)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from hf_ppo.cli.tiny import synthetic_reviews

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(synthetic_reviews(500, seed=3), trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=specials, show_progress=False))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", padding_side="right", model_max_length=128)


@pytest.fixture(scope="module")
def deberta(tmp_path_factory):
    """Path of a tiny DebertaV2ForSequenceClassification (num_labels=1) saved with its own pair tokenizer."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    tok = build_pair_tokenizer()
    torch.manual_seed(5)
    config = DebertaV2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=128, type_vocab_size=2, num_labels=1,
                             relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"],
                             pad_token_id=tok.pad_token_id, initializer_range=0.5)  # scores well apart from 0
    model = DebertaV2ForSequenceClassification(config)
    folder = tmp_path_factory.mktemp("deberta")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def by_hand(model, tokenizer, *texts):
    """The reward model run alone on one unpadded input, on its device (a trainer's reward model may be on a GPU);
    the score on the CPU."""
    with torch.no_grad():
        return model(**tokenizer(*texts, return_tensors="pt").to(device_of(model))).logits[0, 0].cpu()


def rollout_of(tokenizer, prompts, answers):
    """Left-padded queries and right-padded responses (answer + EOS) as the rollout makes them."""
    queries = tokenizer(prompts, return_tensors="pt", padding=True)
    ids = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in answers]
    width = max(map(len, ids))
    responses = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(ids), width), dtype=torch.bool)
    for row, seq in enumerate(ids):
        responses[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), True
    return dict(queries=queries["input_ids"], query_mask=queries["attention_mask"].bool(), responses=responses,
                response_mask=mask)


def test_pair_format_scores_a_deberta_reward_model_like_by_hand(deberta, tiny_models, tokenizer, tmp_path):
    """auto picks 'pair' for the encoder; padded batched scores equal the model run alone on tokenizer(q, a)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompts, answers = [QUESTION, "the food was very"], [ANSWER, " awful and the plot was dull"]
    data = Dataset.from_dict({"prompt": prompts * 4})
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tokenizer,
                           reward_model=deberta, train_dataset=data)
    reward_tok = trainer.reward_tokenizer
    assert reward_tok is not None and reward_input_format("auto", trainer.reward_model, reward_tok, False) == "pair"
    scores = score_responses(trainer.reward_model, **rollout_of(tokenizer, prompts, answers), tokenizer=tokenizer,
                             prompts=prompts, batch_size=2, reward_tokenizer=reward_tok)
    # The rollout's tensors are on the CPU, the trainer's reward model on the run's device: the scores come back on
    # the CPU, and by hand the same weights run on the reward model's device.
    assert scores.device.type == "cpu"
    model = AutoModelForSequenceClassification.from_pretrained(deberta).to(device_of(trainer.reward_model)).eval()
    pair_tok = AutoTokenizer.from_pretrained(deberta)
    expected = torch.stack([by_hand(model, pair_tok, q, a) for q, a in zip(prompts, answers)])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    # The segments matter: the same text as one sequence scores differently, so 'pair' is not 'concat' in disguise.
    assert abs(expected[0] - by_hand(model, pair_tok, QUESTION + ANSWER)) > 1e-3
    concat = score_responses(trainer.reward_model, **rollout_of(tokenizer, prompts, answers), tokenizer=tokenizer,
                             prompts=prompts, batch_size=2, reward_tokenizer=reward_tok, input_format="concat")
    torch.testing.assert_close(concat[1], by_hand(model, pair_tok, prompts[1] + answers[1]), rtol=1e-5, atol=1e-5)
    trainer.train()  # end to end with the encoder
    assert all(torch.isfinite(torch.tensor(e["objective/scores"])) for e in trainer.state.log_history
               if "objective/scores" in e)


def test_chat_and_concat_formats_with_a_decoder_reward_model(tiny_models, tokenizer, tmp_path):
    """A decoder reward model with its own tokenizer: chat prompts -> its template; text prompts -> prompt + answer."""
    from hf_ppo.cli.tiny import build_reward_model, build_tokenizer

    reward_tok = build_tokenizer(vocab_size=300, chat_template="{% for m in messages %}[{{ m['role'] }}] "
                                 "{{ m['content'] }}\n{% endfor %}")
    model = build_reward_model(reward_tok).eval()
    batch = rollout_of(tokenizer, [tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)],
                       [ANSWER])
    batch["queries"], batch["query_mask"] = batch["queries"][:, 1:], batch["query_mask"][:, 1:]  # no second BOS

    chat = score_responses(model, **batch, tokenizer=tokenizer, prompts=[CHAT], batch_size=4, reward_tokenizer=reward_tok)
    text = "[user] the movie was\n[assistant]  great fun\n"
    assert reward_tok.apply_chat_template(CHAT + [{"role": "assistant", "content": ANSWER}], tokenize=False) == text
    with torch.no_grad():
        expected = model(**reward_tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
    torch.testing.assert_close(chat[0], expected, rtol=1e-5, atol=1e-5)

    # Text prompts: 'concat' is the decoded prompt + response as one sequence, in the reward tokenizer's ids.
    concat = score_responses(model, **rollout_of(tokenizer, [QUESTION], [ANSWER]), tokenizer=tokenizer,
                             prompts=[QUESTION], batch_size=4, reward_tokenizer=reward_tok)
    with torch.no_grad():
        expected = model(**reward_tok("the movie was great fun", return_tensors="pt")).logits[0, 0]
    torch.testing.assert_close(concat[0], expected, rtol=1e-5, atol=1e-5)

    # auto: chat for chat prompts with a template, concat for text prompts and for a tokenizer without pairs.
    assert reward_input_format("auto", model, reward_tok, True) == "chat"
    assert reward_input_format("auto", model, reward_tok, False) == "concat"


def test_forced_formats_that_cannot_apply_fail_at_construction(deberta, tiny_models, tokenizer, tmp_path):
    text = Dataset.from_dict({"prompt": [QUESTION] * 8})
    chats = Dataset.from_dict({"messages": [CHAT] * 8})
    with pytest.raises(ValueError, match="'chat' needs chat prompts"):
        PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path, reward_input_format="chat"),
                     processing_class=tokenizer, reward_model=tiny_models["reward"], train_dataset=text)
    with pytest.raises(ValueError, match="'chat' needs a reward tokenizer with a chat template"):
        PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path, reward_input_format="chat"),
                     processing_class=tokenizer, reward_model=deberta, train_dataset=chats)
    with pytest.raises(ValueError, match="reward callable"):
        PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path, reward_input_format="pair"),
                     processing_class=tokenizer, reward_model=count_e, train_dataset=text)
    with pytest.raises(ValueError, match="reward_input_format='tuple'"):
        make_args(tmp_path, reward_input_format="tuple")
    # Same tokenizer: concat keeps the fast path (ids, no decode); chat prompts re-render with the template.
    fast = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tokenizer,
                        reward_model=tiny_models["reward"], train_dataset=text)
    assert fast.reward_tokenizer is None
    chat = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tokenizer,
                        reward_model=tiny_models["reward"], train_dataset=chats)
    assert chat.reward_tokenizer is not None


# ---- reward tokenizers of reward models passed as objects --------------------------------------------------------------
def test_reward_object_loads_its_tokenizer_from_its_path(tiny_models, tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from hf_ppo.cli.tiny import build_reward_model, build_tokenizer

    other = build_tokenizer(vocab_size=600, seed=1)  # a larger, different vocabulary: ids must not be shared
    folder = tmp_path / "reward600"
    build_reward_model(other).save_pretrained(folder)
    other.save_pretrained(folder)
    data = Dataset.from_dict({"prompt": [QUESTION] * 8})
    reward = AutoModelForSequenceClassification.from_pretrained(folder)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tokenizer,
                           reward_model=reward, train_dataset=data)
    assert trainer.reward_tokenizer is not None and trainer.reward_tokenizer.get_vocab() == other.get_vocab()

    # The same model without a findable tokenizer (built in memory): an error asking for reward_processing_class.
    with pytest.raises(ValueError, match="reward_processing_class=<the reward model's tokenizer>.*"):
        PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tokenizer,
                     reward_model=build_reward_model(other), train_dataset=data)
    # A reward tokenizer larger than the reward model's embedding: refused before any rollout.
    with pytest.raises(ValueError, match=r"\d+ tokens but the reward model.s embedding has 300"):
        PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tokenizer,
                     reward_model=build_reward_model(build_tokenizer(vocab_size=300)), reward_processing_class=other,
                     train_dataset=data)
    # A folder without tokenizer files: the error names it.
    bare = tmp_path / "bare"
    build_reward_model(other).save_pretrained(bare)
    with pytest.raises(ValueError, match="bare"):
        PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tokenizer,
                     reward_model=AutoModelForSequenceClassification.from_pretrained(bare), train_dataset=data)


def test_reward_tokenizer_without_pad_gets_one_for_scoring(tiny_models, tokenizer, tmp_path):
    from hf_ppo.cli.tiny import build_reward_model, build_tokenizer

    # A reward model with a vocabulary of its own (the same vocabulary would take the token-id fast path, where the
    # reward tokenizer's pad never matters).
    reward_tok = build_tokenizer(vocab_size=300, seed=2)
    reward_tok.pad_token = None
    reward = build_reward_model(reward_tok)
    trainer = PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tokenizer,
                           reward_model=reward, reward_processing_class=reward_tok,
                           train_dataset=Dataset.from_dict({"prompt": [QUESTION, "the food was"] * 4}))
    assert reward_tok.pad_token is None  # the user's tokenizer is left as it was
    assert trainer.reward_tokenizer.pad_token == reward_tok.eos_token
    prompts, answers = [QUESTION, "the food was very"], [ANSWER, " awful"]
    scores = score_responses(trainer.reward_model, **rollout_of(tokenizer, prompts, answers), tokenizer=tokenizer,
                             prompts=prompts, batch_size=4, reward_tokenizer=trainer.reward_tokenizer)
    expected = torch.stack([by_hand(reward.eval(), reward_tok, p + a) for p, a in zip(prompts, answers)])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


# ---- continuing from an SFT adapter ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sft_adapter(tiny_models, tmp_path_factory):
    """An 'SFT' LoRA adapter on the tiny policy (non-zero B, so it changes the model), saved without a tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_models["policy"]),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    folder = tmp_path_factory.mktemp("sft_adapter")
    model.save_pretrained(folder)
    return str(folder)


def adapter_weights(peft_model, name):
    return {n: p.detach().clone() for n, p in peft_model.named_parameters() if f".{name}." in n}


def first_rollout(trainer):
    return next(e for e in trainer.state.log_history if "objective/kl" in e)


@pytest.mark.parametrize("quantization", ["none", "4bit"])
def test_continue_from_an_sft_adapter(sft_adapter, tiny_models, tokenizer, prompts_dataset, tmp_path, quantization):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    full = quantization == "none"  # QLoRA: one iteration; the reload and resume checks run once, on LoRA
    args = make_args(tmp_path, policy_quantization=quantization, max_steps=4 if full else 2,
                     save_strategy="steps" if full else "no", save_steps=2)
    trainer = PPOLMTrainer(model=sft_adapter, args=args, reward_model=count_e, train_dataset=prompts_dataset)
    policy = trainer.model.pretrained_model
    assert trainer.ref_model is None and set(policy.peft_config) == {"default", "reference"}
    assert (trainer.trained_adapter, trainer.ref_adapter) == ("default", "reference")
    assert getattr(policy.get_base_model(), "is_loaded_in_4bit", False) == (quantization == "4bit")
    sft = adapter_weights(policy, "default")
    reference = adapter_weights(policy, "reference")
    assert {n.replace(".default.", ".reference."): v for n, v in sft.items()}.keys() == reference.keys()
    assert all(torch.equal(v, reference[n.replace(".default.", ".reference.")]) for n, v in sft.items())
    trained = {id(p) for g in trainer.create_optimizer().param_groups for p in g["params"]}
    assert trained == {id(p) for n, p in trainer.model.named_parameters() if ".default." in n or "v_head" in n}

    trainer.train()
    first = first_rollout(trainer)
    assert first["objective/kl"] == 0.0  # the trained adapter starts as an exact copy of the reference adapter
    assert abs(trainer.state.log_history[0]["val/ratio"] - 1.0) < 1e-6
    if full:  # the second rollout comes from the trained adapter: the KL moved off 0
        assert [e["objective/kl"] != 0.0 for e in trainer.state.log_history if "objective/kl" in e] == [False, True]
    after = adapter_weights(policy, "reference")
    assert all(torch.equal(after[n], v) for n, v in reference.items()), "the reference adapter changed"
    assert any(not torch.equal(p, sft[n]) for n, p in adapter_weights(policy, "default").items())

    out = tmp_path / "saved"
    trainer.save_model(str(out))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    assert not (out / "reference").exists()
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        assert f.keys() and not any("reference" in k for k in f.keys())
    if full:
        device = device_of(policy)  # both on the trained policy's device, the probe too
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models["policy"]),
                                             out).to(device).eval()
        probe = tokenizer(["the movie was great", "the food"], return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(**probe).logits, policy(**probe).logits, rtol=0, atol=1e-5)

        # Resume from the mid-run checkpoint (a whole iteration) and end where the uninterrupted run ended.
        resumed = PPOLMTrainer(model=sft_adapter, args=make_args(tmp_path, max_steps=4, output_dir=str(tmp_path / "r")),
                               reward_model=count_e, train_dataset=prompts_dataset)
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
        final = adapter_weights(policy, "default")
        again = adapter_weights(resumed.model.pretrained_model, "default")
        assert all(torch.equal(again[n], v) for n, v in final.items())
        assert all(torch.equal(adapter_weights(resumed.model.pretrained_model, "reference")[n], v)
                   for n, v in reference.items())


def test_adapter_policy_with_peft_config_is_an_error(sft_adapter, tokenizer, prompts_dataset, lora_config, tmp_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="merge_and_unload"):
        PPOLMTrainer(model=sft_adapter, args=make_args(tmp_path), processing_class=tokenizer, reward_model=count_e,
                     train_dataset=prompts_dataset, peft_config=lora_config)
    # transformers' own adapter loading gives a plain model with adapters: refused, never trained as if adapter-free.
    integrated = AutoModelForCausalLM.from_pretrained(sft_adapter)
    assert getattr(integrated, "peft_config", None)
    with pytest.raises(ValueError, match="PeftModel.from_pretrained"):
        PPOLMTrainer(model=integrated, args=make_args(tmp_path), processing_class=tokenizer, reward_model=count_e,
                     train_dataset=prompts_dataset)


def test_frozen_adapter_with_an_explicit_reference_is_made_trainable(sft_adapter, tiny_models, tokenizer,
                                                                     prompts_dataset, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    frozen = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models["policy"]), sft_adapter)
    assert not any(p.requires_grad for p in frozen.parameters())
    with pytest.warns(UserWarning, match="made trainable"):
        trainer = PPOLMTrainer(model=frozen, args=make_args(tmp_path), processing_class=tokenizer, reward_model=count_e,
                               ref_model=sft_adapter, train_dataset=prompts_dataset)
    assert trainer.ref_adapter is None and set(frozen.peft_config) == {"default"}
    lora = [p for n, p in frozen.named_parameters() if "lora_" in n]
    assert lora and all(p.requires_grad for p in lora)


def test_named_adapters_train_one_and_use_the_other_as_reference(sft_adapter, tiny_models, tokenizer,
                                                                 prompts_dataset, tmp_path, local_hub, hub_token):
    """TRL's model_adapter_name / ref_adapter_name: reference log-probs come from the named frozen adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_ppo.rollout.steps import policy_forward, reference_logprobs

    base = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    model = PeftModel.from_pretrained(base, sft_adapter, adapter_name="sft")
    model.load_adapter(sft_adapter, adapter_name="ppo", is_trainable=True)
    for name, param in model.named_parameters():
        if ".ppo." in name and "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)  # the two adapters differ
    for bad, message in [(dict(ref_adapter_name="nope"), r"not an adapter of the policy; it has \['sft', 'ppo'\]"),
                         (dict(model_adapter_name="ppo", ref_adapter_name="sft", ref_model=tiny_models["policy"]),
                          "pass one of them")]:
        ref = bad.pop("ref_model", None)
        with pytest.raises(ValueError, match=message):
            PPOLMTrainer(model=model, args=make_args(tmp_path, **bad), processing_class=tokenizer,
                         reward_model=count_e, ref_model=ref, train_dataset=prompts_dataset)
    repo_id = f"{TEST_USER}/tiny-ppo-named"
    args = make_args(tmp_path, model_adapter_name="ppo", ref_adapter_name="sft", push_to_hub=True,
                     hub_model_id=repo_id, hub_token=hub_token)
    trainer = PPOLMTrainer(model=model, args=args, processing_class=tokenizer, reward_model=count_e,
                           train_dataset=prompts_dataset)
    sft = adapter_weights(model, "sft")
    assert set(model.peft_config) == {"sft", "ppo"} and model.active_adapter == "ppo"

    device = device_of(trainer.model)  # the trainer moved the policy to the run's device
    batch = {k: v.to(device) if torch.is_tensor(v) else v
             for k, v in trainer.data_collator([trainer.train_dataset[i] for i in range(4)]).items()}
    responses = torch.randint(7, len(tokenizer), (4, 5), device=device)
    mask = torch.ones_like(responses, dtype=torch.bool)
    ref = reference_logprobs(trainer.model, None, batch["queries"], batch["query_mask"], responses, mask,
                             temperature=0.7, batch_size=4, ref_adapter=trainer.ref_adapter)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    model.set_adapter("sft")
    by_hand_ref = policy_forward(model, batch["queries"], batch["query_mask"], responses, mask, temperature=0.7,
                                 batch_size=4, with_values=False)[0]
    model.set_adapter("ppo")
    for n, p in model.named_parameters():
        p.requires_grad_(flags[n])
    torch.testing.assert_close(ref, by_hand_ref, rtol=0, atol=0)
    policy_lp = policy_forward(model, batch["queries"], batch["query_mask"], responses, mask, temperature=0.7,
                               batch_size=4, with_values=False)[0]
    assert not torch.allclose(ref, policy_lp)  # the reference really is the other adapter

    trainer.train()
    assert model.active_adapter == "ppo"
    assert all(torch.equal(adapter_weights(model, "sft")[n], v) for n, v in sft.items())
    trainer.push_to_hub()  # saves to output_dir, then uploads: the trained adapter alone, as a plain adapter folder
    out = tmp_path / "out"
    assert not (out / "ppo").exists() and not (out / "sft").exists()
    pushed = local_hub.files(repo_id)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(pushed)
    assert not [f for f in pushed if "/" in f or f.startswith(("ppo", "sft", "reference"))]
    assert pushed["adapter_model.safetensors"] == (out / "adapter_model.safetensors").read_bytes()
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models["policy"]),
                                         out).to(device).eval()
    probe = tokenizer(["the movie was great"], return_tensors="pt").to(device)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**probe).logits, model(**probe).logits, rtol=0, atol=1e-5)


# ---- reward inputs longer than the reward model's context ----------------------------------------------------------
def test_a_decoder_reward_scores_a_too_long_input_on_its_last_tokens(tiny_models, tokenizer):
    from transformers import AutoModelForSequenceClassification

    from hf_ppo.rollout.scoring import reward_model_scores

    model = AutoModelForSequenceClassification.from_pretrained(tiny_models["reward"]).eval()
    long = tokenizer("the movie was great fun and the plot was dull", return_tensors="pt")["input_ids"][0]
    short = long[-3:]
    # Left-padded batch: a row longer than the context and one that fits.
    ids = torch.full((2, len(long)), tokenizer.pad_token_id)
    ids[0], ids[1, -3:] = long, short
    mask = ids != tokenizer.pad_token_id
    context = 6
    assert len(long) > context
    full_scores = reward_model_scores(model, ids, mask.long(), batch_size=2)
    model.config.max_position_embeddings = context
    with pytest.warns(UserWarning, match=r"1 reward input\(s\) .* scored on its last 6 tokens .* max_prompt_length"):
        scores = reward_model_scores(model, ids, mask.long(), batch_size=2)
    alone = reward_model_scores(model, long[-context:].unsqueeze(0), torch.ones(1, context, dtype=torch.long), 1)
    torch.testing.assert_close(scores[0], alone[0], rtol=1e-5, atol=1e-5)  # the last 6 tokens, positions from 0
    assert not torch.allclose(scores[0], full_scores[0])
    assert torch.equal(scores[1], full_scores[1])  # a row that fits is scored as before


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no GPU"))])
@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_a_reward_model_scores_inputs_from_another_device(kind, where, deberta, tiny_models, tokenizer):
    """A reward model may sit elsewhere than the rollout's tensors (on the GPU while they are on the CPU, or spread
    by a device_map): `reward_model_scores` moves the inputs to its input embedding's device and returns the scores
    on the inputs' device. The embedding records the device its ids arrive on. On a CPU-only machine both are the
    CPU (the contract, and the scores by hand); with CUDA visible the model also sits on the GPU with the inputs on
    the CPU, the case that broke. Both paths: a decoder's score head, an encoder's own pooling (token types too)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hf_ppo.rollout.scoring import reward_model_scores

    path = tiny_models["reward"] if kind == "decoder" else deberta
    tok = tokenizer if kind == "decoder" else AutoTokenizer.from_pretrained(deberta)
    model = AutoModelForSequenceClassification.from_pretrained(path).to(where).eval()
    arrived = []
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: arrived.append(args[0].device))
    texts = ["the movie was great fun", "bad"]
    encoded = tok(texts, return_tensors="pt", padding=True, return_token_type_ids=kind == "encoder")  # on the CPU
    assert not encoded["attention_mask"].bool().all()  # padding, so the last real token / pooling position matters
    token_types = encoded["token_type_ids"] if kind == "encoder" else None  # all 0 (one segment), as by hand
    scores = reward_model_scores(model, encoded["input_ids"], encoded["attention_mask"], 2, token_types)
    assert scores.device.type == "cpu" and set(arrived) == {device_of(model)}
    expected = torch.stack([by_hand(model, tok, text) for text in texts])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def test_an_encoder_reward_cuts_the_question_or_names_the_fix(deberta, tiny_models, tokenizer):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(deberta).eval()
    model.config.max_position_embeddings = 12
    pair_tok = AutoTokenizer.from_pretrained(deberta)
    prompts, answers = ["the movie was great fun and the plot was dull and the music was sad"], [" good"]
    batch = rollout_of(tokenizer, prompts, answers)
    # 'pair': the question is truncated, the answer kept: the score is the model's on the cut pair.
    scores = score_responses(model, **batch, tokenizer=tokenizer, prompts=prompts, batch_size=1,
                             reward_tokenizer=pair_tok, input_format="pair")
    encoded = pair_tok(prompts[0], answers[0].strip(), truncation="only_first", max_length=12, return_tensors="pt")
    with torch.no_grad():
        expected = model(**encoded).logits[0, 0]
    torch.testing.assert_close(scores[0], expected, rtol=1e-5, atol=1e-5)
    # 'concat' cannot be cut without losing [CLS] or the answer: an error that names the fix.
    with pytest.raises(ValueError, match="more than the reward model's context of 12.*max_prompt_length"):
        score_responses(model, **batch, tokenizer=tokenizer, prompts=prompts, batch_size=1, reward_tokenizer=pair_tok,
                        input_format="concat")


# ---- checkpoints that are not what their role needs ---------------------------------------------------------------------
def test_a_checkpoint_without_a_trained_score_head_is_refused_as_the_reward_model(deberta, tiny_models, tokenizer,
                                                                                  prompts_dataset, tmp_path):
    """A causal LM (with or without num_labels=1, as the old message suggested) and a base encoder saved without
    its classification head: transformers would initialise the head at random and only log it; hf_ppo stops before
    training with the real cause and the fix."""
    from transformers import AutoModel

    encoder = tmp_path / "base_encoder"
    AutoModel.from_pretrained(deberta).save_pretrained(encoder)  # the body alone: no `classifier`, no `pooler`
    cases = [(tiny_models["policy"], None, "score.weight"), (tiny_models["policy"], {"num_labels": 1}, "score.weight"),
             (str(encoder), {"num_labels": 1}, "classifier.weight")]
    for reward, init, head in cases:
        args = make_args(tmp_path, reward_model_init_kwargs=init)
        with pytest.raises(ValueError, match="lacks weights") as caught:
            PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=reward,
                         train_dataset=prompts_dataset)
        message = str(caught.value)
        assert head in message and "no reward model" in message and "RewardTrainer" in message
        assert "reward function" in message and "num_labels=2" not in message
    # A trained reward model (every weight in its checkpoint) still loads.
    PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tokenizer,
                 reward_model=tiny_models["reward"], train_dataset=prompts_dataset)


def test_a_reference_checkpoint_without_an_lm_head_is_refused(tiny_models, tokenizer, prompts_dataset, tmp_path):
    with pytest.raises(ValueError, match=r"reference model .* lacks weights .*lm_head"):
        PPOLMTrainer(model=tiny_models["policy"], args=make_args(tmp_path), processing_class=tokenizer,
                     reward_model=count_e, ref_model=tiny_models["reward"], train_dataset=prompts_dataset)


# ---- reward lists ----------------------------------------------------------------------------------------------------
# Reward lists: a list of reward models / callables combined by `reward_weights`, each logged on its own, optionally
# normalised on its own, an overlong penalty, the same bad-output checks for every reward, exact resume.

PROMPTS = ["the movie was", "the food was", "the book was", "the show was"]


def length_reward(prompts, completions):
    return [float(len(c)) for c in completions]


def reward_list_args(out, **overrides) -> PPOConfig:
    # 4 optimizer steps per iteration (2 epochs x 2 minibatches), 8 prompts per rollout.
    defaults = dict(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1, num_mini_batches=2,
        num_ppo_epochs=2, max_steps=8, response_length=6, logging_steps=1, learning_rate=1e-2, report_to=[],
        save_strategy="no", num_sample_generations=0, disable_tqdm=True, seed=0, reward_quantization="none",
    )
    defaults.update(overrides)
    return PPOConfig(**defaults)


def lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def make_trainer(models, tokenizer, out, rewards, peft=True, **overrides):
    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    return PPOLMTrainer(model=models["policy"], args=reward_list_args(out, **overrides), processing_class=tokenizer,
                        reward_model=rewards, train_dataset=dataset, peft_config=lora() if peft else None)


def batch_of(tokenizer, prompts, completions):
    """Left-padded prompts and right-padded responses as the rollout holds them."""
    queries = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    responses = tokenizer(completions, return_tensors="pt", padding=True, padding_side="right",
                          add_special_tokens=False)
    return dict(queries=queries["input_ids"], query_mask=queries["attention_mask"].bool(),
                responses=responses["input_ids"], response_mask=responses["attention_mask"].bool())


# ---- math: the overlong penalty and step 4 ---------------------------------------------------------------------------
def test_overlong_penalty_hand_computed():
    # L_max 8, buffer 4: no penalty up to 4 tokens, then -(|y| - 4) / 4 * factor, reaching -factor at 8 tokens.
    lengths = torch.tensor([3, 4, 5, 6, 8])
    assert torch.allclose(overlong_penalty(lengths, 8, 4, 0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    assert torch.equal(overlong_penalty(torch.tensor([9]), 8, 4, 1.0), torch.tensor([-1.0]))  # beyond L_max: -1


def test_penalize_adds_both_penalties_to_the_combined_score():
    scores = torch.tensor([1.0, 1.0, 1.0])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]).bool()  # lengths 2, 3, 4 of response_length 4
    stopped = torch.tensor([True, True, False])
    out = penalize(scores, stopped, mask, missing_eos_penalty=0.5, overlong_buffer_length=2, overlong_penalty_factor=1.0)
    # lengths 2, 3, 4 with buffer 2 of 4: penalties 0, -0.5, -1; the last never stopped: -0.5 more.
    assert torch.allclose(out, torch.tensor([1.0, 0.5, -0.5]))
    assert torch.equal(penalize(scores, stopped, mask, missing_eos_penalty=None), scores)  # off: untouched


# ---- scoring: the weighted sum, per-reward values, normalisation -----------------------------------------------------
@pytest.fixture(scope="module")
def mixed_run(tiny_models, tokenizer, tmp_path_factory):
    """A LoRA run of 2 iterations with a tiny reward model and a callable, weights 0.5 and 2.0."""
    trainer = make_trainer(tiny_models, tokenizer, tmp_path_factory.mktemp("mixed"), [tiny_models["reward"], count_e],
                           reward_weights=[0.5, 2.0])
    trainer.train()
    return trainer


def test_weighted_sum_of_a_reward_model_and_a_callable(mixed_run, tiny_models, tokenizer):
    from transformers import AutoModelForSequenceClassification

    rewards = mixed_run.rewards
    assert rewards.names == ["reward", "count_e"] and rewards.weights == [0.5, 2.0]
    completions = [" great fun", " the best ever seen"]
    combined, each = rewards.score(**batch_of(tokenizer, PROMPTS[:2], completions), tokenizer=tokenizer,
                                   prompts=PROMPTS[:2], batch_size=2)
    # By hand: the reward model's logit on each prompt + completion alone (no padding), and the e's counted.
    model = AutoModelForSequenceClassification.from_pretrained(tiny_models["reward"]).eval()
    logits = [model(**tokenizer(p + c, return_tensors="pt")).logits[0, 0].item() for p, c in zip(PROMPTS, completions)]
    assert torch.allclose(each["reward"], torch.tensor(logits), atol=1e-5)
    assert each["count_e"].tolist() == [1.0, 6.0]
    assert torch.allclose(combined, torch.tensor([0.5 * logits[0] + 2.0 * 1.0, 0.5 * logits[1] + 2.0 * 6.0]),
                          atol=1e-5)


def test_each_reward_is_logged_and_the_combined_score_is_their_weighted_sum(mixed_run):
    logs = [e for e in mixed_run.state.log_history if "objective/scores" in e]
    assert len(logs) == 2  # one rollout per iteration
    for entry in logs:
        # Means are linear: with no normalisation or penalty, mean(combined) = sum_i w_i * mean(r_i).
        expected = 0.5 * entry["objective/scores/reward"] + 2.0 * entry["objective/scores/count_e"]
        assert entry["objective/scores"] == pytest.approx(expected, abs=1e-4)
        assert all(v == v and abs(v) != float("inf") for v in entry.values() if isinstance(v, float))
    assert mixed_run.state.global_step == 8 and mixed_run.iteration == 2


def test_each_reward_normalised_by_its_own_running_statistics(tokenizer):
    rewards = RewardSet([count_e, length_reward], [None, None], ["count_e", "length_reward"], [1.0, 0.5],
                        normalize_each=True)
    batches = [[" eee", " e", " ", " ee e"], [" the end", " hello", " see", " x"]]
    seen = {"count_e": [], "length_reward": []}
    for completions in batches:
        batch = batch_of(tokenizer, PROMPTS, completions)
        combined, each = rewards.score(**batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4,
                                       gather=lambda t: t)
        for name in seen:
            seen[name] += each[name].tolist()
    # Each reward's statistics are those of all its raw scores so far, its own only.
    normalised = {}
    for (name, values), moments in zip(seen.items(), rewards.moments):
        values = torch.tensor(values, dtype=torch.float64)
        assert moments.count == 8 and moments.mean == pytest.approx(values.mean().item())
        assert moments.var == pytest.approx(values.var(unbiased=False).item())
        normalised[name] = (each[name] - moments.mean) / moments.std
    assert torch.allclose(combined, normalised["count_e"] + 0.5 * normalised["length_reward"], atol=1e-5)
    # Evaluation (no gather) normalises with the statistics it holds and leaves them as they are.
    state = json.dumps(rewards.state_dict())
    again, _ = rewards.score(**batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4)
    assert torch.allclose(again, combined) and json.dumps(rewards.state_dict()) == state


def test_a_single_reward_scores_as_before_and_logs_nothing_of_its_own(tokenizer):
    batch = batch_of(tokenizer, PROMPTS, [" eee", " e", " ", " ee e"])
    alone = score_responses(count_e, **batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4)
    scores, each = RewardSet.single(count_e).score(**batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4,
                                                   gather=lambda t: t)
    assert torch.equal(scores, alone) and each == {}
    assert RewardSet.single(count_e).tokenizer is None  # `trainer.reward_tokenizer` of a single reward, as before


# ---- errors ------------------------------------------------------------------------------------------------------
def bad_reward(prompts, completions):
    return {"score": 1.0}


def test_weights_of_another_length_are_refused(tiny_models, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"reward_weights has 3 weights but there are 2 rewards \(count_e, "
                                         r"length_reward\)"):
        make_trainer(tiny_models, tokenizer, tmp_path, [count_e, length_reward], reward_weights=[1.0, 1.0, 2.0])
    with pytest.raises(ValueError, match=r"reward_weights=\[1.0, nan\]: must be None or a non-empty list of finite"):
        reward_list_args(tmp_path, reward_weights=[1.0, float("nan")])
    with pytest.raises(ValueError, match=r"overlong_buffer_length=7: must be None \(off\) or an integer in \[1, "
                                         r"response_length=6\]"):
        reward_list_args(tmp_path, overlong_buffer_length=7)


def test_a_bad_callable_in_the_list_is_named(tiny_models, tokenizer, tmp_path):
    with pytest.raises(TypeError, match=r"Reward 'bad_reward' \(reward_model\[1\]\): The reward function "
                                        r"'bad_reward' returned dict"):
        make_trainer(tiny_models, tokenizer, tmp_path, [count_e, bad_reward])
    with pytest.raises(TypeError, match=r"Reward 'list' \(reward_model\[0\]\).*one flat list"):
        make_trainer(tiny_models, tokenizer, tmp_path, [[count_e], count_e])
    with pytest.raises(ValueError, match=r"reward_processing_class must be None or a list with one entry per reward"):
        PPOLMTrainer(model=tiny_models["policy"], args=reward_list_args(tmp_path), processing_class=tokenizer,
                     reward_model=[count_e, length_reward], reward_processing_class=tokenizer,
                     train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), peft_config=lora())


class NaNOnCalls:
    """A reward function returning NaN on the given calls (1-based; call 1 is the construction-time probe)."""

    def __init__(self, calls):
        self.calls, self.n = set(calls), 0

    def __call__(self, prompts, completions):
        self.n += 1
        return [float("nan") if self.n in self.calls else 1.0 for _ in completions]


def test_nan_from_one_reward_drops_the_rollout_naming_it(tiny_models, tokenizer, tmp_path):
    trainer = make_trainer(tiny_models, tokenizer, tmp_path, [count_e, NaNOnCalls({3})], normalize_each_reward=True)
    with pytest.warns(UserWarning, match=r"rollout dropped and sampled again \(scores: 8 NaN/inf of 8 responses;.* "
                                         r"from reward 'NaNOnCalls': 8 NaN/inf\)"):
        trainer.train()
    assert trainer.state.global_step == 8 and trainer.iteration == 2
    assert trainer.state.log_history[-2]["nonfinite/dropped_rollouts"] == 1
    # The dropped rollout moved neither reward's statistics: 2 kept rollouts of 8 responses each.
    assert [m.count for m in trainer.rewards.moments] == [16, 16]
    assert all(m.mean == m.mean for m in trainer.rewards.moments)


def test_huge_scores_of_one_reward_warn_naming_it(tiny_models, tokenizer, tmp_path):
    def huge(prompts, completions):
        return [1e6] * len(completions)

    trainer = make_trainer(tiny_models, tokenizer, tmp_path, [count_e, huge], reward_weights=[1.0, 1e-6], max_steps=4)
    with pytest.warns(UserWarning, match=r"Reward 'huge' scores reach 1e\+06.*normalize_each_reward=True"):
        trainer.train()


# ---- exact resume with per-reward statistics ---------------------------------------------------------------------
def logged(trainer):
    return [{k: v for k, v in e.items() if not k.startswith("time/") and "per_second" not in k and "runtime" not in k
             and k not in ("train_loss", "total_flos")} for e in trainer.state.log_history]


def test_resume_mid_iteration_with_normalize_each_reward_is_exact(tiny_models, tokenizer, tmp_path):
    rewards = [tiny_models["reward"], count_e]
    options = dict(reward_weights=[1.0, 0.25], normalize_each_reward=True, overlong_buffer_length=2)
    straight = make_trainer(tiny_models, tokenizer, tmp_path / "straight", rewards, save_strategy="steps",
                            save_steps=3, **options)
    straight.train()
    with open(tmp_path / "straight" / "checkpoint-3" / "ppo_state.json") as f:
        assert list(json.load(f)["each_reward_moments"]) == ["reward", "count_e"]
    resumed = make_trainer(tiny_models, tokenizer, tmp_path / "resumed", rewards, **options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))
    for (name, x), y in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(x, y), name
    assert resumed.rewards.state_dict() == straight.rewards.state_dict()
    assert [m.count for m in resumed.rewards.moments] == [16, 16]
    assert len(logged(straight)) == 9 and logged(straight) == logged(resumed)


# ---- the model card names every reward ---------------------------------------------------------------------------
def test_card_lists_every_reward(tmp_path):
    sources = model_sources("org/policy", ["org/reward-a", count_e], None, None, None, None, True)
    assert sources["reward_model"] == ["org/reward-a", "reward function count_e"]
    write_model_card(tmp_path, repo_id="me/tuned", base_model="org/policy", reward_model=sources["reward_model"],
                     ref_model=None, dataset_names=[], peft_config=None, hyperparameters={}, log_history=[])
    card = (tmp_path / "README.md").read_text()
    # A reward model and a function: the row says "rewards", and names each as what it is.
    assert "| rewards | [org/reward-a](https://huggingface.co/org/reward-a), a reward function (`count_e`) |" in card
    assert os.path.isfile(tmp_path / "README.md")


# ---- documented values, worked out by hand -------------------------------------------------------------------------
def test_reward_names_and_their_repeats_are_the_documented_values():
    """`reward_name` and `unique_names` give the names docs/concepts/rewards.md promises: an id or path's last part, a
    function's `__name__` (a lambda's without its brackets), a model's `name_or_path` last part, else the class
    name; a repeat gets `_2`, `_3`, skipping a number another reward already goes by."""
    from types import SimpleNamespace

    from hf_ppo.rollout.scoring import reward_name, unique_names

    class Judge:
        def __call__(self, prompts, completions):
            return [0.0] * len(completions)

    given = ["org/rm", "./local/rm/", "C:\\models\\rm", SimpleNamespace(name_or_path="other/rm"), count_e,
             lambda p, c: [0.0] * len(c), lambda p, c: [1.0] * len(c), Judge()]
    names = [reward_name(r) for r in given]
    assert names == ["rm", "rm", "rm", "rm", "count_e", "lambda", "lambda", "Judge"]
    assert unique_names(names) == ["rm", "rm_2", "rm_3", "rm_4", "count_e", "lambda", "lambda_2", "Judge"]
    assert unique_names(["acc", "acc", "acc_2"]) == ["acc", "acc_3", "acc_2"]  # the docs' own example
    assert unique_names(["a", "a", "a", "a_2", "a_3"]) == ["a", "a_4", "a_5", "a_2", "a_3"]
    assert unique_names(["b", "b_2", "b", "b_2"]) == ["b", "b_2", "b_3", "b_2_2"]


def test_normalize_each_reward_with_a_none_row_by_hand(tokenizer):
    """The combined score with `normalize_each_reward` when one reward returns None for some rows: each reward is
    normalised by the statistics of the rows it applies to, and a None row's term is left out (not its normalised
    0.0, which is -mean/std). By hand: `half` applies to rows 0-1 (1, 3: mean 2, std 1 -> -1, 1); `bonus` to all four
    (4, 4, 2, 6: mean 4, std sqrt(2) -> 0, 0, -sqrt(2), sqrt(2)); weights 2 and 0.5."""
    def half(prompts, completions, kind, **kwargs):
        return [None if k is None else float(k) for k in kind]

    def bonus(prompts, completions, extra, **kwargs):
        return [float(e) for e in extra]

    rewards = RewardSet([half, bonus], [None, None], ["half", "bonus"], [2.0, 0.5], normalize_each=True)
    batch = batch_of(tokenizer, PROMPTS, [" a", " b", " c", " d"])
    combined, raw = rewards.score(**batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4, gather=lambda t: t,
                                  columns={"kind": [1, 3, None, None], "extra": [4, 4, 2, 6]})
    root2 = 2 ** 0.5
    assert raw["half"].tolist() == [1.0, 3.0, 0.0, 0.0] and raw["bonus"].tolist() == [4.0, 4.0, 2.0, 6.0]
    assert (rewards.moments[0].mean, rewards.moments[0].var, rewards.moments[0].count) == (2.0, 1.0, 2)
    assert (rewards.moments[1].mean, rewards.moments[1].var, rewards.moments[1].count) == (4.0, 2.0, 4)
    assert combined.tolist() == pytest.approx([2 * -1.0, 2 * 1.0, 0.5 * -root2, 0.5 * root2], abs=1e-6)
    # Evaluation (no gather): the statistics as they are, a None row's term left out all the same.
    combined, _ = rewards.score(**batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4,
                                columns={"kind": [None, 5, 1, None], "extra": [4, 4, 4, 4]})
    assert combined.tolist() == pytest.approx([0.0, 2 * 3.0, 2 * -1.0, 0.0], abs=1e-6)
    assert rewards.moments[0].count == 2 and rewards.moments[1].count == 4


def test_a_chat_reward_model_reads_a_prefill_and_its_continuation_as_one_answer(tiny_models, tokenizer):
    """Issue 49 item 3: a prompt ending with an assistant turn ("The answer is") is continued by the policy; the reward
    model's chat input is that one assistant turn, prefill + continuation, not the prefill closed and the completion
    in a second assistant turn."""
    from hf_ppo.cli.tiny import build_reward_model, build_tokenizer

    reward_tok = build_tokenizer(vocab_size=300, chat_template="{% for m in messages %}[{{ m['role'] }}] "
                                 "{{ m['content'] }}\n{% endfor %}")
    model = build_reward_model(reward_tok).eval()
    prefilled = CHAT + [{"role": "assistant", "content": "The answer is"}]
    query = tokenizer.apply_chat_template(prefilled, tokenize=False, continue_final_message=True)
    batch = rollout_of(tokenizer, [query], [ANSWER])
    batch["queries"], batch["query_mask"] = batch["queries"][:, 1:], batch["query_mask"][:, 1:]  # no second BOS
    score = score_responses(model, **batch, tokenizer=tokenizer, prompts=[prefilled], batch_size=4,
                            reward_tokenizer=reward_tok)
    text = "[user] the movie was\n[assistant] The answer is great fun\n"
    with torch.no_grad():
        expected = model(**reward_tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]
    torch.testing.assert_close(score[0], expected, rtol=1e-5, atol=1e-5)


# ---- a NaN/inf score of one row --------------------------------------------------------------------------------------
def test_a_nonfinite_score_warns_once_per_reward_and_never_moves_the_statistics():
    from hf_ppo.algorithms.ppo_math import RunningMoments
    from hf_ppo.rollout.scoring import shape_scores

    rewards = RewardSet([None, None], [None, None], ["exact", "fmt"], [1.0, 1.0], normalize_each=True)
    each = {"exact": (torch.tensor([1.0, float("inf"), 3.0]), torch.tensor([True, True, True])),
            "fmt": (torch.tensor([0.0, 0.0, float("nan")]), torch.tensor([True, True, False]))}  # NaN where None
    with pytest.warns(UserWarning, match=r"The reward 'exact' returned inf for row 1 of the batch \(prompt 'b'\)"):
        combined = rewards.combine(each, ["a", "b", "c"], gather=lambda t: t)
    assert torch.isfinite(combined).tolist() == [True, False, True]  # the row leaves the update (steps.py)
    assert rewards.moments[0].count == 2 and rewards.moments[1].count == 2  # only finite scores of rows that apply
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reward: no second warning
        rewards.combine(each, ["a", "b", "c"], gather=lambda t: t)
    moments = RunningMoments()
    shaped = shape_scores(torch.tensor([1.0, float("inf"), 3.0]), reward_moments=moments, reward_clip=None,
                          gather=lambda t: t)
    assert moments.count == 2 and moments.mean == 2.0 and not torch.isfinite(shaped[1])


# ---- issue 51: what reward functions are given, and score_responses' refusal of None --------------------------------
def test_completion_ids_are_each_responses_tokens_cut_after_the_stop_token_without_padding(tiny_models, tokenizer,
                                                                                           tmp_path):
    """A reward's `completion_ids` in a training rollout: exactly the response's tokens, up to and including its first
    stop token, no padding (the stop token cut mid-response and first, two stop tokens, and none), each row with its
    own completion. The responses are scripted, so the expected ids are known here."""
    from tests.scripted_engine import ScriptedEngine

    seen = []

    def records(completions, completion_ids, **kwargs):
        seen.append((completions, completion_ids))
        return [float(len(ids)) for ids in completion_ids]

    trainer = PPOLMTrainer(model=tiny_models["policy"], processing_class=tokenizer, reward_model=records,
                           args=make_args(tmp_path, max_steps=1, gradient_accumulation_steps=1, num_ppo_epochs=1),
                           train_dataset=Dataset.from_dict({"prompt": PROMPTS}))
    eos, stops = tokenizer.eos_token_id, set(trainer.stop_token_ids)
    words = tokenizer(" great fun but the plot was bad and dull", add_special_tokens=False)["input_ids"]
    assert eos in stops and not stops & set(words) and tokenizer.pad_token_id not in words
    script = [words[:2] + [eos] + words[2:5], words[:6], [eos] + words[1:6], words[3:5] + [eos, eos] + words[5:7]]
    cut = [row[:next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in script]
    assert [len(c) for c in cut] == [3, 6, 1, 3]
    expected = {tokenizer.decode(ids, skip_special_tokens=True): ids for ids in cut}  # by the completion's text
    assert len(expected) == 4
    trainer.rollout_engine = ScriptedEngine(script)
    seen.clear()  # the construction probe's call
    trainer.train()
    rows = [(c if isinstance(c, str) else c[0]["content"], ids) for completions, completion_ids in seen
            for c, ids in zip(completions, completion_ids)]
    assert len(rows) == 4 and sorted(map(tuple, (ids for _, ids in rows))) == sorted(map(tuple, cut))
    for text, ids in rows:
        assert ids == expected[text], (text, ids)


def test_score_responses_refuses_a_none_naming_the_function_and_the_fix(tokenizer):
    def sometimes(prompts, completions):
        return [1.0, None, 2.0, None]

    batch = batch_of(tokenizer, PROMPTS, [" eee", " e", " ", " ee e"])
    with pytest.raises(ValueError, match=r"The reward function 'sometimes' returned None \(does not apply\) for 2 "
                                         r"row\(s\): score through a RewardSet, which leaves them out of the weighted "
                                         r"sum, or return a number for every row\."):
        score_responses(sometimes, **batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4)
    # The fix named: a RewardSet leaves the None rows out of the weighted sum (count_e applies to every row).
    scores, _ = RewardSet([sometimes, count_e], [None, None], ["sometimes", "count_e"], [1.0, 1.0]).score(
        **batch, tokenizer=tokenizer, prompts=PROMPTS, batch_size=4)
    assert scores.tolist() == [1.0 + 3, 0.0 + 1, 2.0 + 0, 0.0 + 3]


# ---- one probe per reward and inputs inside probing_once() (issue 53: hf-ppo train probed each function twice) -----
def test_probing_once_calls_a_reward_once_per_inputs_and_forgets_at_the_end():
    """Inside `probing_once()`, the same callable on the same prompts and columns is called once; other prompts, a
    probe that failed, another callable and any probe outside the block are called as before."""
    from hf_ppo.rollout.scoring import probe_reward_callable, probing_once

    calls = []

    def counted(prompts, completions, **kwargs):
        calls.append(list(prompts))
        return [0.0] * len(prompts)

    def other(prompts, completions, **kwargs):
        calls.append(["other"])
        return [0.0] * len(prompts)

    train = Dataset.from_dict({"prompt": ["a", "b", "c"], "id": [1, 2, 3]})
    same = Dataset.from_dict({"prompt": ["a", "b"], "id": [1, 2]})  # another dataset object, the same first rows
    other_ids = Dataset.from_dict({"prompt": ["a", "b"], "id": [7, 8]})  # the same prompts, other columns
    with probing_once():
        probe_reward_callable(counted, train, None)
        probe_reward_callable(counted, same, None, "counted_again", "eval_dataset")
        assert calls == [["a", "b"]]
        probe_reward_callable(counted, other_ids, None)
        probe_reward_callable(other, train, None)
        assert calls == [["a", "b"], ["a", "b"], ["other"]]
    probe_reward_callable(counted, train, None)  # outside: a probe of its own
    assert len(calls) == 4

    failures = []

    def flaky(prompts, completions, **kwargs):
        failures.append(1)
        return [float("nan")] * len(prompts)

    with probing_once():
        for _ in range(2):  # a failed probe is not remembered: it fails again
            with pytest.raises(ValueError, match="returned NaN/inf for the probe"):
                probe_reward_callable(flaky, train, None)
    assert len(failures) == 2

"""Reward-model inputs (chat / pair / concat), reward tokenizers, and continuing from an SFT adapter (CPU, offline)."""

import os

import pytest
import torch
from datasets import Dataset
from safetensors import safe_open

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.rollout.rewards import reward_input_format, score_responses
from hub_fixtures import TEST_USER

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
    """The reward model run alone on one unpadded input."""
    with torch.no_grad():
        return model(**tokenizer(*texts, return_tensors="pt")).logits[0, 0]


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
    model = AutoModelForSequenceClassification.from_pretrained(deberta).eval()
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
        reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models["policy"]), out).eval()
        probe = tokenizer(["the movie was great", "the food"], return_tensors="pt", padding=True)
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

    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    responses = torch.randint(7, len(tokenizer), (4, 5))
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
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models["policy"]), out).eval()
    probe = tokenizer(["the movie was great"], return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**probe).logits, model(**probe).logits, rtol=0, atol=1e-5)


# ---- reward inputs longer than the reward model's context ----------------------------------------------------------
def test_a_decoder_reward_scores_a_too_long_input_on_its_last_tokens(tiny_models, tokenizer):
    from transformers import AutoModelForSequenceClassification

    from hf_ppo.rollout.rewards import reward_model_scores

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

"""Coming from TRL, the last mile: TRL 1.12's `sft_model_path` / `reward_model_path` as PPOConfig fields, the value
head's state keys and files as TRL's class wrote and read them, the added-`[PAD]` error, a TRL name whose meaning
differs, and the seq2seq error. Tiny models built locally; checkpoints in TRL's layout are written by hand (file names
and keys as TRL 0.11 wrote them)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BartConfig, BartForConditionalGeneration, HfArgumentParser, T5Config
from transformers import T5ForConditionalGeneration

from hf_ppo import AutoModelForCausalLMWithValueHead, PPOConfig, PPOLMTrainer
from hf_ppo.trainer.assembly import trl_inputs
from hf_ppo.cli.tiny import build_causal_lm, build_tokenizer

Wrapper = AutoModelForCausalLMWithValueHead
TRL_HEAD_KEYS = {"v_head.summary.weight", "v_head.summary.bias"}


def _config(tmp_path, **kwargs) -> PPOConfig:
    return PPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def _random_head(wrapper, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        wrapper.v_head.weight.copy_(torch.randn(wrapper.v_head.weight.shape, generator=gen))
        wrapper.v_head.bias.fill_(0.75)
    return wrapper


def _lora(model):
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))


# ---- 1. sft_model_path / reward_model_path are PPOConfig fields ---------------------------------------------------
def test_model_path_fields_parse_from_the_command_line_and_yaml(tmp_path):
    parser = HfArgumentParser(PPOConfig)
    (args,) = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", "true",
                                                  "--sft_model_path", "org/sft", "--reward_model_path", "org/rm"])
    assert (args.sft_model_path, args.reward_model_path) == ("org/sft", "org/rm")
    config = tmp_path / "ppo.yaml"
    config.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nsft_model_path: org/sft\nreward_model_path: org/rm\n")
    (args,) = parser.parse_yaml_file(str(config))
    assert (args.sft_model_path, args.reward_model_path) == ("org/sft", "org/rm")
    assert _config(tmp_path).sft_model_path is None  # no default: TRL's was a base LM with a random score head
    with pytest.raises(ValueError, match="sft_model_path='  '"):
        _config(tmp_path, sft_model_path="  ")


def test_the_trainer_loads_the_models_the_fields_name(tiny_models, tmp_path):
    args = _config(tmp_path, sft_model_path=tiny_models["policy"], reward_model_path=tiny_models["reward"],
                   per_device_train_batch_size=2, max_steps=1, num_ppo_epochs=1, reward_quantization="none")
    trainer = PPOLMTrainer(args=args, train_dataset=Dataset.from_dict({"prompt": ["the movie was"] * 2}))
    assert trainer.model.policy_model.config.name_or_path == tiny_models["policy"]
    assert trainer.reward_model.config.name_or_path == tiny_models["reward"]


def test_a_field_and_an_argument_must_name_the_same_checkpoint(tiny_models, tmp_path):
    args = _config(tmp_path, sft_model_path=tiny_models["policy"], reward_model_path=tiny_models["reward"])
    policy = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])  # TRL's script: loaded from the same path

    def reward(prompts, completions):
        return [0.0] * len(prompts)

    assert trl_inputs(policy, tiny_models["reward"], None, None, args)[:2] == (policy, tiny_models["reward"])
    assert trl_inputs(None, None, None, None, args)[:2] == (tiny_models["policy"], tiny_models["reward"])
    with pytest.raises(ValueError, match=r"model= is 'org/other', but PPOConfig.sft_model_path="):
        trl_inputs("org/other", None, None, None, args)
    with pytest.raises(ValueError, match=r"reward_model= is a function, but PPOConfig.reward_model_path="):
        trl_inputs(None, reward, None, None, args)
    policy.config._name_or_path = "org/x"  # an object loaded from another checkpoint
    with pytest.raises(ValueError, match="LlamaForCausalLM loaded from 'org/x'"):
        trl_inputs(policy, None, None, None, args)
    with pytest.raises(ValueError, match=r"needs a policy.*sft_model_path"):
        trl_inputs(None, reward, None, None, _config(tmp_path))


def test_a_trl_name_whose_meaning_differs_warns(tmp_path):
    with pytest.warns(UserWarning, match="num_mini_batches=2 means something else than in TRL.*sft_model_path"):
        _config(tmp_path, sft_model_path="org/sft", num_mini_batches=2)
    with pytest.warns(UserWarning, match="ds3_gather_for_generation is ignored"):
        _config(tmp_path, ds3_gather_for_generation=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _config(tmp_path, num_mini_batches=2)  # an hf_ppo config: its own meaning, no warning


# ---- 2. the value head's keys and files, as TRL's class wrote and read them ----------------------------------------
def test_state_dict_has_trls_keys_and_loads_both_layouts():
    tok = build_tokenizer()
    wrapper = _random_head(Wrapper(build_causal_lm(tok)), seed=1)
    keys = set(wrapper.state_dict())
    assert TRL_HEAD_KEYS <= keys and all(k.startswith("pretrained_model.") for k in keys - TRL_HEAD_KEYS)
    assert {n for n, _ in wrapper.named_parameters()} >= TRL_HEAD_KEYS
    fresh = Wrapper(build_causal_lm(tok, seed=5))
    fresh.load_state_dict(wrapper.state_dict())
    torch.testing.assert_close(fresh.v_head.weight, wrapper.v_head.weight, rtol=0, atol=0)
    # hf_ppo's earlier keys (`v_head.weight`, `v_head.bias`) still load.
    old = {k.replace("v_head.summary.", "v_head."): v for k, v in wrapper.state_dict().items()}
    older = Wrapper(build_causal_lm(tok, seed=5))
    older.load_state_dict(old)
    torch.testing.assert_close(older.v_head.bias, torch.tensor([0.75]), rtol=0, atol=0)


def test_peft_save_writes_trls_head_file_beside_the_adapter(tmp_path):
    wrapper = _random_head(Wrapper(_lora(build_causal_lm(build_tokenizer()))), seed=2)
    wrapper.save_pretrained(str(tmp_path))
    files = set(os.listdir(tmp_path))
    assert {"adapter_config.json", "adapter_model.safetensors", "pytorch_model.bin", "value_head.safetensors"} <= files
    trl_file = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert set(trl_file) == TRL_HEAD_KEYS  # the head alone, under TRL's names
    torch.testing.assert_close(trl_file["v_head.summary.weight"], wrapper.v_head.weight.detach(), rtol=0, atol=0)
    # What TRL's loader did with that file: strip "v_head." and load the rest into a head whose layer is `summary`.
    trl_head = torch.nn.Module()
    trl_head.summary = torch.nn.Linear(wrapper.v_head.weight.shape[1], 1)
    trl_head.load_state_dict({k.replace("v_head.", ""): v for k, v in trl_file.items()}, strict=True)
    assert set(load_file(tmp_path / "value_head.safetensors")) == {"weight", "bias"}  # hf_ppo's file, unchanged


def test_a_trl_adapter_checkpoint_written_by_hand_loads(tmp_path):
    """TRL 0.11 saved a PEFT policy as the adapter files plus `pytorch_model.bin` holding only `v_head.summary.*`."""
    tok = build_tokenizer()
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    build_causal_lm(tok).save_pretrained(base_dir)
    peft_model = _lora(AutoModelForCausalLM.from_pretrained(base_dir))
    peft_model.save_pretrained(adapter_dir)
    gen = torch.Generator().manual_seed(3)
    head = {"v_head.summary.weight": torch.randn(1, 64, generator=gen), "v_head.summary.bias": torch.tensor([0.5])}
    torch.save(head, adapter_dir / "pytorch_model.bin")
    assert not (adapter_dir / "value_head.safetensors").exists()

    loaded = Wrapper.from_pretrained(str(adapter_dir), is_trainable=True)
    assert loaded.is_peft_model
    torch.testing.assert_close(loaded.v_head.summary.weight, head["v_head.summary.weight"], rtol=0, atol=0)
    torch.testing.assert_close(loaded.v_head.summary.bias, head["v_head.summary.bias"], rtol=0, atol=0)


def test_a_trl_full_checkpoint_written_by_hand_loads(tmp_path):
    """TRL 0.11 saved a full model as one `model.safetensors`: the body's own keys and `v_head.summary.*`."""
    tok = build_tokenizer()
    model = build_causal_lm(tok)
    model.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(4)
    head = {"v_head.summary.weight": torch.randn(1, 64, generator=gen), "v_head.summary.bias": torch.tensor([-1.0])}
    save_file({**load_file(tmp_path / "model.safetensors"), **head}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = Wrapper.from_pretrained(str(tmp_path))
    torch.testing.assert_close(loaded.v_head.weight, head["v_head.summary.weight"], rtol=0, atol=0)
    torch.testing.assert_close(loaded.v_head.bias, head["v_head.summary.bias"], rtol=0, atol=0)


# ---- 3. an added [PAD] without resizing: both fixes, for the reference too ------------------------------------------
def test_added_pad_without_resize_names_both_fixes_for_the_reference(tiny_models, tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    policy = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    policy.resize_token_embeddings(len(tokenizer))  # the policy follows TRL's habit; the reference, by path, does not
    args = _config(tmp_path, per_device_train_batch_size=2, max_steps=1, reward_quantization="none",
                   ref_quantization="none")
    with pytest.raises(ValueError, match=r"(?s)reference model's embedding.*add no pad token.*"
                                         r"model\.resize_token_embeddings\(len\(tokenizer\)\)"):
        PPOLMTrainer(model=policy, args=args, processing_class=tokenizer, reward_model=tiny_models["reward"],
                     ref_model=tiny_models["policy"], train_dataset=Dataset.from_dict({"prompt": ["a b"] * 2}))


# ---- 5. seq2seq is out of scope, said at construction -------------------------------------------------------------
def _tiny_t5():
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2))


def test_an_encoder_decoder_is_refused_with_what_to_use(tmp_path):
    with pytest.raises(ValueError, match=r"encoder-decoder \(seq2seq\) model \(t5\).*not supported.*decoder-only"):
        Wrapper(_tiny_t5())
    # BART by path: transformers would load its decoder alone as a causal LM; the checkpoint's config says seq2seq.
    bart = BartForConditionalGeneration(BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                                   encoder_ffn_dim=32, decoder_ffn_dim=32))
    bart.save_pretrained(tmp_path / "bart")
    with pytest.raises(ValueError, match=r"seq2seq\) model \(bart\)"):
        Wrapper.from_pretrained(str(tmp_path / "bart"))
    with pytest.raises(ValueError, match=r"policy .*seq2seq\) model \(bart\).*AutoModelForCausalLM"):
        PPOLMTrainer(model=str(tmp_path / "bart"), args=_config(tmp_path), processing_class=build_tokenizer(),
                     reward_model=lambda prompts, completions: [0.0] * len(prompts),
                     train_dataset=Dataset.from_dict({"prompt": ["a b"]}))

"""AutoModelForCausalLMWithValueHead on tiny Llama models: forward, PEFT, 4-bit, pass-throughs, save/load, TRL heads."""

from __future__ import annotations

import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from hf_ppo.models.value_head import VALUE_HEAD_FILE, AutoModelForCausalLMWithValueHead
from hf_ppo.cli.tiny import build_causal_lm

Wrapper = AutoModelForCausalLMWithValueHead


@pytest.fixture(scope="module")
def policy_dir(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    build_causal_lm(tok, hidden_size=64, num_layers=2).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_4bit(policy_dir):
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    return AutoModelForCausalLM.from_pretrained(policy_dir, quantization_config=config, device_map={"": "cpu"})


def _random_head(wrapper, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        wrapper.v_head.weight.copy_(torch.randn(wrapper.v_head.weight.shape, generator=gen))
        wrapper.v_head.bias.fill_(0.3)
    return wrapper


def _lora(model):
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))


def _assert_only_lora_and_head_get_grads(wrapper):
    trainable, got_grad = set(), set()
    for name, param in wrapper.named_parameters():
        if param.requires_grad:
            trainable.add(name)
        if param.grad is not None:
            got_grad.add(name)
    assert trainable == got_grad
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= got_grad
    lora = {n for n in got_grad if "lora_" in n}
    assert lora, "no LoRA parameter got a gradient"
    assert got_grad == lora | {"v_head.summary.weight", "v_head.summary.bias"}, sorted(got_grad - lora)
    # LoRA B starts at 0, so it is B that gets a non-zero gradient from the first backward
    assert any(wrapper.get_parameter(n).grad.abs().sum() > 0 for n in lora if "lora_B" in n)


# ---- the head and forward ----------------------------------------------------------------------------------------
def test_value_head_is_fp32_and_zero_initialised(tok, inputs):
    model = build_causal_lm(tok)
    wrapper = Wrapper(model)
    assert wrapper.v_head.weight.dtype == torch.float32 and wrapper.v_head.bias.dtype == torch.float32
    assert wrapper.v_head.weight.shape == (1, 64)
    assert torch.all(wrapper.v_head.weight == 0) and torch.all(wrapper.v_head.bias == 0)
    with torch.no_grad():
        out = wrapper(**inputs)
        plain = model(**inputs).logits
    batch, seq = inputs["input_ids"].shape
    assert out.value.shape == (batch, seq) and out.value.dtype == torch.float32
    assert torch.all(out.value == 0)
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=0)
    assert wrapper.config is model.config and not wrapper.is_peft_model
    assert wrapper.quantization_method is None


def test_value_head_init_std_gives_random_head(tok):
    wrapper = Wrapper(build_causal_lm(tok), value_head_init_std=0.5)
    assert wrapper.v_head.weight.abs().sum() > 0
    assert torch.all(wrapper.v_head.bias == 0)
    assert 0.2 < wrapper.v_head.weight.std().item() < 1.0


def test_values_come_from_final_normed_hidden_state(tok, inputs):
    model = build_causal_lm(tok)
    wrapper = _random_head(Wrapper(model))
    with torch.no_grad():
        out = wrapper(**inputs)
        last_hidden = model.model(**inputs).last_hidden_state  # after the final RMSNorm
    expected = last_hidden @ wrapper.v_head.weight[0] + 0.3
    torch.testing.assert_close(out.value, expected, atol=1e-5, rtol=1e-5)


def test_logits_to_keep_returns_last_positions(tok, inputs):
    wrapper = _random_head(Wrapper(build_causal_lm(tok)))
    with torch.no_grad():
        full = wrapper(**inputs)
        for k in (1, 3):
            part = wrapper(**inputs, logits_to_keep=k)
            assert part.logits.shape == (2, k, len(tok)) and part.value.shape == (2, k)
            torch.testing.assert_close(part.logits, full.logits[:, -k:], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(part.value, full.value[:, -k:], atol=1e-5, rtol=1e-5)


def test_position_ids_are_passed_through(tok, inputs):
    model = build_causal_lm(tok)
    wrapper = Wrapper(model)
    # RoPE is shift-invariant, so stretch the positions (x2) to get logits that really differ from the default
    position_ids = 2 * torch.arange(inputs["input_ids"].shape[1]).expand_as(inputs["input_ids"])
    with torch.no_grad():
        out = wrapper(**inputs, position_ids=position_ids)
        plain = model(**inputs, position_ids=position_ids).logits
        default = model(**inputs).logits
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=0)
    assert not torch.allclose(out.logits[0], default[0])  # the positions really were used


# ---- PEFT and 4-bit ----------------------------------------------------------------------------------------------
def test_wraps_peft_model_and_backward_reaches_lora_and_head_only(tok, inputs):
    peft_model = _lora(build_causal_lm(tok))
    wrapper = Wrapper(peft_model)
    assert wrapper.is_peft_model
    assert wrapper.config.hidden_size == 64
    out = wrapper(**inputs)
    with torch.no_grad():
        plain = peft_model(**inputs).logits
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=0)
    assert torch.all(out.value == 0)
    (out.logits.float().logsumexp(-1).mean() + out.value.pow(2).mean() + out.value.mean()).backward()
    _assert_only_lora_and_head_get_grads(wrapper)
    assert wrapper.v_head.weight.grad.abs().sum() > 0


def test_wraps_4bit_model(tok, inputs, model_4bit):
    import bitsandbytes as bnb

    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model_4bit.modules())  # really quantized
    wrapper = Wrapper(model_4bit)
    assert wrapper.v_head.weight.dtype == torch.float32
    with torch.no_grad():
        out = wrapper(**inputs)
        plain = model_4bit(**inputs).logits
    assert out.value.shape == inputs["input_ids"].shape and out.value.dtype == torch.float32
    assert torch.all(out.value == 0)
    torch.testing.assert_close(out.logits, plain, rtol=0, atol=0)


def test_bf16_body_still_gives_fp32_head_and_values(tok, inputs):
    wrapper = _random_head(Wrapper(build_causal_lm(tok).to(torch.bfloat16)))
    assert wrapper.v_head.weight.dtype == torch.float32
    with torch.no_grad():
        out = wrapper(**inputs)
    assert out.logits.dtype == torch.bfloat16 and out.value.dtype == torch.float32


def test_quantization_method_passes_through(tok, model_4bit):
    from transformers.utils.quantization_config import QuantizationMethod

    assert model_4bit.quantization_method == QuantizationMethod.BITS_AND_BYTES
    assert Wrapper(model_4bit).quantization_method == model_4bit.quantization_method
    assert Wrapper(build_causal_lm(tok)).quantization_method is None


def test_qlora_backward_reaches_lora_and_head_only(policy_dir, inputs):
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    base = AutoModelForCausalLM.from_pretrained(policy_dir, quantization_config=config, device_map={"": "cpu"})
    wrapper = Wrapper(_lora(base))
    assert wrapper.is_peft_model
    assert wrapper.quantization_method == base.quantization_method  # through the PeftModel too
    out = wrapper(**inputs)
    (out.logits.float().logsumexp(-1).mean() + out.value.mean()).backward()
    _assert_only_lora_and_head_get_grads(wrapper)


# ---- pass-throughs -----------------------------------------------------------------------------------------------
def test_generate_passes_through(tok, inputs):
    model = build_causal_lm(tok)
    wrapper = Wrapper(model)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        ours = wrapper.generate(**inputs, **kwargs)
        theirs = model.generate(**inputs, **kwargs)
    assert ours.shape == (2, inputs["input_ids"].shape[1] + 4)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_gradient_checkpointing_passes_through_and_gives_same_grads(tok, inputs):
    def grads(wrapper):
        wrapper.zero_grad()
        out = wrapper(**inputs)
        (out.logits.float().logsumexp(-1).mean() + out.value.pow(2).mean()).backward()
        return {n: p.grad.clone() for n, p in wrapper.named_parameters() if p.grad is not None}

    wrapper = _random_head(Wrapper(build_causal_lm(tok)))
    wrapper.train()
    reference = grads(wrapper)
    wrapper.gradient_checkpointing_enable()
    assert wrapper.pretrained_model.is_gradient_checkpointing
    checkpointed = grads(wrapper)
    assert checkpointed.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(checkpointed[name], reference[name], atol=1e-5, rtol=1e-4)
    wrapper.gradient_checkpointing_disable()
    assert not wrapper.pretrained_model.is_gradient_checkpointing


def test_gradient_checkpointing_with_peft_still_trains_lora(tok, inputs):
    wrapper = Wrapper(_lora(build_causal_lm(tok)))
    wrapper.train()
    wrapper.gradient_checkpointing_enable()  # transformers' default kwargs (non-reentrant)
    assert wrapper.pretrained_model.base_model.model.is_gradient_checkpointing
    out = wrapper(**inputs)
    (out.logits.float().logsumexp(-1).mean() + out.value.mean()).backward()
    _assert_only_lora_and_head_get_grads(wrapper)


# ---- save / load -------------------------------------------------------------------------------------------------
def test_save_and_from_pretrained_round_trip(tok, inputs, tmp_path):
    wrapper = _random_head(Wrapper(build_causal_lm(tok)), seed=3)
    wrapper.save_pretrained(str(tmp_path))
    files = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", VALUE_HEAD_FILE} <= files
    assert set(load_file(tmp_path / VALUE_HEAD_FILE)) == {"weight", "bias"}
    # the saved weights file stays a plain causal LM: no head keys inside it
    assert not any("v_head" in k for k in load_file(tmp_path / "model.safetensors"))

    loaded = Wrapper.from_pretrained(str(tmp_path))
    torch.testing.assert_close(loaded.v_head.weight, wrapper.v_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(loaded.v_head.bias, wrapper.v_head.bias, rtol=0, atol=0)
    with torch.no_grad():
        a, b = wrapper(**inputs), loaded(**inputs)
    torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=0)
    torch.testing.assert_close(b.value, a.value, rtol=0, atol=0)


def test_from_pretrained_4bit_restores_head(tok, inputs, tmp_path):
    wrapper = _random_head(Wrapper(build_causal_lm(tok)), seed=4)
    wrapper.save_pretrained(str(tmp_path))
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    loaded = Wrapper.from_pretrained(str(tmp_path), quantization_config=config, device_map={"": "cpu"})
    assert loaded.quantization_method == loaded.pretrained_model.quantization_method is not None
    torch.testing.assert_close(loaded.v_head.weight, wrapper.v_head.weight, rtol=0, atol=0)
    assert loaded.v_head.weight.dtype == torch.float32
    with torch.no_grad():
        assert loaded(**inputs).value.shape == inputs["input_ids"].shape


def test_save_without_value_head_loads_a_zero_head(tok, tmp_path):
    wrapper = _random_head(Wrapper(build_causal_lm(tok)))
    wrapper.save_pretrained(str(tmp_path), save_value_head=False)
    assert VALUE_HEAD_FILE not in os.listdir(tmp_path)
    loaded = Wrapper.from_pretrained(str(tmp_path))
    assert torch.all(loaded.v_head.weight == 0) and torch.all(loaded.v_head.bias == 0)


def test_peft_save_writes_adapter_and_head(tok, tmp_path):
    wrapper = _random_head(Wrapper(_lora(build_causal_lm(tok))), seed=5)
    wrapper.save_pretrained(str(tmp_path))
    files = set(os.listdir(tmp_path))
    assert {"adapter_config.json", "adapter_model.safetensors", VALUE_HEAD_FILE} <= files
    assert "model.safetensors" not in files
    head = load_file(tmp_path / VALUE_HEAD_FILE)
    torch.testing.assert_close(head["weight"], wrapper.v_head.weight.detach(), rtol=0, atol=0)
    fresh = Wrapper(_lora(build_causal_lm(tok)))
    fresh.load_value_head_state_dict(head)
    torch.testing.assert_close(fresh.v_head.bias, wrapper.v_head.bias, rtol=0, atol=0)


def _trl_head(seed=7):
    gen = torch.Generator().manual_seed(seed)
    return {"v_head.summary.weight": torch.randn(1, 64, generator=gen), "v_head.summary.bias": torch.tensor([0.25])}


def test_trl_format_head_in_model_safetensors(tok, inputs, tmp_path):
    model = build_causal_lm(tok)
    model.save_pretrained(tmp_path)
    weights_file = tmp_path / "model.safetensors"
    state = load_file(weights_file)
    head = _trl_head()
    save_file({**state, **head}, weights_file, metadata={"format": "pt"})  # as TRL's old wrapper saved it

    loaded = Wrapper.from_pretrained(str(tmp_path))
    torch.testing.assert_close(loaded.v_head.weight, head["v_head.summary.weight"], rtol=0, atol=0)
    torch.testing.assert_close(loaded.v_head.bias, head["v_head.summary.bias"], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)


def test_trl_format_head_in_pytorch_model_bin(tok, tmp_path):
    build_causal_lm(tok).save_pretrained(tmp_path)
    head = _trl_head(seed=8)
    torch.save(head, tmp_path / "pytorch_model.bin")  # the head's tensors in the legacy weights file
    loaded = Wrapper.from_pretrained(str(tmp_path))
    torch.testing.assert_close(loaded.v_head.weight, head["v_head.summary.weight"], rtol=0, atol=0)
    torch.testing.assert_close(loaded.v_head.bias, head["v_head.summary.bias"], rtol=0, atol=0)


def test_separate_value_head_file_wins_over_trl_keys(tok, tmp_path):
    wrapper = _random_head(Wrapper(build_causal_lm(tok)), seed=9)
    wrapper.save_pretrained(str(tmp_path))
    weights_file = tmp_path / "model.safetensors"
    save_file({**load_file(weights_file), **_trl_head()}, weights_file, metadata={"format": "pt"})
    loaded = Wrapper.from_pretrained(str(tmp_path))
    torch.testing.assert_close(loaded.v_head.weight, wrapper.v_head.weight, rtol=0, atol=0)


def test_load_value_head_state_dict_accepts_both_key_styles_and_casts_to_fp32(tok):
    wrapper = Wrapper(build_causal_lm(tok))
    wrapper.load_value_head_state_dict({"weight": torch.ones(1, 64, dtype=torch.bfloat16), "bias": torch.tensor([2.0])})
    assert wrapper.v_head.weight.dtype == torch.float32 and torch.all(wrapper.v_head.weight == 1)
    wrapper.load_value_head_state_dict(_trl_head())
    torch.testing.assert_close(wrapper.v_head.bias, torch.tensor([0.25]), rtol=0, atol=0)
    sd = wrapper.value_head_state_dict()
    assert set(sd) == {"weight", "bias"} and not sd["weight"].requires_grad

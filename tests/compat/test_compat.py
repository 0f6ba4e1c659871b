"""Coming from TRL: code and checkpoints written for TRL's value-head class and PPO scripts, with the import changed.

Written from TRL's documented API (trl 0.11 `AutoModelForCausalLMWithValueHead`, trl 1.12 `PPOConfig` and
`examples/scripts/ppo/ppo.py`'s command line), on tiny models saved to temp dirs and loaded with the real
`from_pretrained`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    BartConfig,
    BartForConditionalGeneration,
    BitsAndBytesConfig,
    HfArgumentParser,
    T5Config,
    T5ForConditionalGeneration,
)

from hf_ppo import AutoModelForCausalLMWithValueHead, PPOConfig, PPOLMTrainer
from hf_ppo.algorithms.ppo_math import masked_mean, masked_sum, masked_var, masked_whiten
from hf_ppo.cli.tiny import build_causal_lm, build_tokenizer
from hf_ppo.models.pretrained import disable_dropout
from hf_ppo.trainer.assembly import trl_inputs
from hf_ppo.trainer.data import prepare_prompts
from tests.hub_fixtures import TEST_USER

Wrapper = AutoModelForCausalLMWithValueHead
HIDDEN = 64  # bitsandbytes' CPU 4-bit kernels need in_features >= 64


@pytest.fixture(scope="module")
def base_dir(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    build_causal_lm(tok, hidden_size=HIDDEN).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _trl_head(seed: int) -> dict[str, torch.Tensor]:
    """A head as TRL stored it: `v_head.summary.weight` (1, hidden) and `v_head.summary.bias` (1,)."""
    gen = torch.Generator().manual_seed(seed)
    return {"v_head.summary.weight": torch.randn(1, HIDDEN, generator=gen), "v_head.summary.bias": torch.tensor([0.5])}


def _assert_head(wrapper, head):
    torch.testing.assert_close(wrapper.v_head.weight, head["v_head.summary.weight"], rtol=0, atol=0)
    torch.testing.assert_close(wrapper.v_head.bias, head["v_head.summary.bias"], rtol=0, atol=0)


@pytest.fixture(scope="module")
def adapter_dir(base_dir, tmp_path_factory):
    """A trained-looking LoRA adapter on `base_dir` (non-zero B), saved with hf_ppo's value head beside it."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(1))
    wrapper = Wrapper(model, v_head_init_strategy="normal")
    path = tmp_path_factory.mktemp("adapter")
    wrapper.save_pretrained(str(path))
    return str(path), wrapper


# ---- loading paths -----------------------------------------------------------------------------------------------
def test_from_pretrained_with_a_model_object(tok, base_dir, inputs):
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    wrapper = Wrapper.from_pretrained(model)
    assert wrapper.pretrained_model is model and torch.all(wrapper.v_head.weight == 0)
    with pytest.raises(TypeError, match="apply only when loading by Hub id or path"):
        Wrapper.from_pretrained(model, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"from_pretrained\('gpt2'\)"):
        Wrapper("gpt2")
    lora = Wrapper.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir),
                                   peft_config=LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert isinstance(lora.pretrained_model, PeftModel)
    assert any(p.requires_grad for n, p in lora.named_parameters() if "lora_" in n)


def test_hub_id_round_trip_through_push_to_hub(local_hub, hub_token, base_dir, inputs):
    wrapper = Wrapper.from_pretrained(base_dir, v_head_init_strategy="normal")
    repo_id = f"{TEST_USER}/value-head-model"
    wrapper.push_to_hub(repo_id, token=hub_token)
    assert {"config.json", "model.safetensors", "value_head.safetensors"} <= set(local_hub.files(repo_id))
    loaded = Wrapper.from_pretrained(repo_id, token=hub_token)
    torch.testing.assert_close(loaded.v_head.weight, wrapper.v_head.weight, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).value, wrapper(**inputs).value, rtol=0, atol=0)


def test_hub_ids_of_trl_checkpoints_adapter_and_sharded(local_hub, hub_token, adapter_dir, tok, tmp_path):
    """By Hub id: a TRL adapter repo (head alone in pytorch_model.bin) and a sharded repo (head in shard 2)."""
    from huggingface_hub import create_repo, upload_folder

    path, _ = adapter_dir
    trl_adapter, sharded = tmp_path / "trl_adapter", tmp_path / "sharded"
    trl_adapter.mkdir(), sharded.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (trl_adapter / name).write_bytes((Path(path) / name).read_bytes())
    adapter_head, sharded_head = _trl_head(seed=5), _trl_head(seed=6)
    torch.save(adapter_head, trl_adapter / "pytorch_model.bin")
    model = build_causal_lm(tok, hidden_size=HIDDEN, seed=7)
    model.config.save_pretrained(sharded)
    _write_sharded(sharded, model.state_dict(), sharded_head, "safetensors")
    for folder, head in ((trl_adapter, adapter_head), (sharded, sharded_head)):
        repo_id = f"{TEST_USER}/{folder.name}"
        create_repo(repo_id, token=hub_token)
        upload_folder(repo_id=repo_id, folder_path=str(folder), token=hub_token)
        loaded = Wrapper.from_pretrained(repo_id, token=hub_token, is_trainable=True)
        _assert_head(loaded, head)
        assert isinstance(loaded.pretrained_model, PeftModel) == (folder is trl_adapter)


def test_adapter_folder_trainable_with_is_trainable(adapter_dir, inputs):
    path, saved = adapter_dir
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = Wrapper.from_pretrained(path, is_trainable=True)
    assert not [w for w in caught if "ONLY the value head" in str(w.message)]
    assert isinstance(loaded.pretrained_model, PeftModel)
    lora = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad for p in lora.values())
    assert not any(p.requires_grad for n, p in loaded.named_parameters() if "lora_" not in n and "v_head" not in n)
    torch.testing.assert_close(loaded.v_head.weight, saved.v_head.weight, rtol=0, atol=0)
    with torch.no_grad():  # the trained adapter really is on: same outputs as the model that was saved
        torch.testing.assert_close(loaded(**inputs).logits, saved(**inputs).logits, rtol=1e-5, atol=1e-5)


def test_adapter_folder_loads_frozen_with_a_loud_warning(adapter_dir):
    path, _ = adapter_dir
    with pytest.warns(UserWarning, match="ONLY the value head.*is_trainable=True"):
        loaded = Wrapper.from_pretrained(path)
    assert not any(p.requires_grad for n, p in loaded.named_parameters() if "lora_" in n)
    with pytest.raises(ValueError, match="is_trainable=True and no peft_config"):
        Wrapper.from_pretrained(path, peft_config=LoraConfig(r=4, task_type="CAUSAL_LM"))


def test_trl_adapter_checkpoint_with_head_in_pytorch_model_bin(adapter_dir, tmp_path):
    """TRL saved a PEFT policy as the adapter plus `pytorch_model.bin` holding only `v_head.summary.*`."""
    path, _ = adapter_dir
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes((Path(path) / name).read_bytes())
    head = _trl_head(seed=2)
    torch.save(head, tmp_path / "pytorch_model.bin")
    _assert_head(Wrapper.from_pretrained(str(tmp_path), is_trainable=True), head)


def _write_sharded(folder: Path, state: dict, head: dict, fmt: str) -> None:
    """A two-shard checkpoint in `fmt` ('safetensors' or 'bin') with the TRL head in the second shard only."""
    keys = sorted(state)
    half = len(keys) // 2
    ext, index_name = ("safetensors", "model.safetensors.index.json") if fmt == "safetensors" else \
        ("bin", "pytorch_model.bin.index.json")
    prefix = "model" if fmt == "safetensors" else "pytorch_model"
    shards = {f"{prefix}-00001-of-00002.{ext}": {k: state[k] for k in keys[:half]},
              f"{prefix}-00002-of-00002.{ext}": {**{k: state[k] for k in keys[half:]}, **head}}
    weight_map = {}
    for name, tensors in shards.items():
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        if fmt == "safetensors":
            save_file(tensors, folder / name, metadata={"format": "pt"})
        else:
            torch.save(tensors, folder / name)
        weight_map.update(dict.fromkeys(tensors, name))
    (folder / index_name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_sharded_trl_checkpoint_head_in_a_later_shard(tok, inputs, tmp_path, fmt):
    model = build_causal_lm(tok, hidden_size=HIDDEN, seed=3)
    model.config.save_pretrained(tmp_path)
    head = _trl_head(seed=4)
    _write_sharded(tmp_path, model.state_dict(), head, fmt)
    loaded = Wrapper.from_pretrained(str(tmp_path))
    _assert_head(loaded, head)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)


# ---- TRL's keyword arguments -------------------------------------------------------------------------------------
def test_value_head_kwargs(tok, inputs):
    assert torch.all(Wrapper(build_causal_lm(tok)).v_head.weight == 0)  # hf_ppo's default: a zero head
    normal = Wrapper(build_causal_lm(tok), v_head_init_strategy="normal", v_head_initializer_range=0.05)
    assert 0.02 < normal.v_head.weight.std().item() < 0.1 and torch.all(normal.v_head.bias == 0)
    with pytest.raises(ValueError, match="'normal'"):
        Wrapper(build_causal_lm(tok), v_head_init_strategy="xavier")
    with pytest.warns(UserWarning, match="only with v_head_init_strategy='normal'"):
        assert torch.all(Wrapper(build_causal_lm(tok), v_head_initializer_range=0.1).v_head.weight == 0)
    with pytest.raises(TypeError, match="summary_dropout_prob"):
        Wrapper(build_causal_lm(tok), summary_dropot_prob=0.1)

    dropout = Wrapper(build_causal_lm(tok), summary_dropout_prob=0.5, v_head_init_strategy="normal").train()
    with torch.no_grad():
        assert not torch.equal(dropout(**inputs).value, dropout(**inputs).value)  # TRL's dropout before the head
        disable_dropout(dropout)  # what PPOLMTrainer does with disable_dropout=True
        torch.testing.assert_close(dropout(**inputs).value, dropout(**inputs).value, rtol=0, atol=0)


def test_trl_quantization_kwargs_become_a_bitsandbytes_config(base_dir):
    model = Wrapper.from_pretrained(base_dir, load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                    peft_config=LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    base = model.pretrained_model.get_base_model()
    assert base.is_loaded_in_4bit and base.config.quantization_config.bnb_4bit_quant_type == "nf4"
    assert any(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    with pytest.raises(ValueError, match="not both"):
        Wrapper.from_pretrained(base_dir, load_in_4bit=True, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    with pytest.raises(ValueError, match="need load_in_4bit"):
        Wrapper.from_pretrained(base_dir, bnb_4bit_quant_type="nf4")


# ---- forward -----------------------------------------------------------------------------------------------------
def test_forward_reads_like_trls_tuple_and_gives_the_lm_loss(tok, inputs):
    model = build_causal_lm(tok)
    wrapper = Wrapper(model, v_head_init_strategy="normal")
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    with torch.no_grad():
        logits, loss, value = wrapper(**inputs, labels=labels)  # TRL 0.x: (lm_logits, loss, value)
        expected = model(**inputs, labels=labels)
        torch.testing.assert_close(loss, expected.loss, rtol=0, atol=0)
        torch.testing.assert_close(logits, expected.logits, rtol=0, atol=0)
        assert value.shape == inputs["input_ids"].shape

        out = wrapper(**inputs)
        logits2, no_loss, value2 = out  # no labels: loss stays in its place as None, nothing shifts
        assert no_loss is None and out.loss is None and out[2] is out.value is value2
        torch.testing.assert_close(value2, value, rtol=0, atol=0)
        assert set(out.keys()) == {"logits", "value"}

        *_, past = wrapper(**inputs, return_past_key_values=True)
        assert past is not None


# ---- training after loading an adapter -----------------------------------------------------------------------------
def test_ppo_trains_an_adapter_loaded_with_is_trainable_on_pretokenized_prompts(adapter_dir, base_dir, tok, tmp_path):
    path, _ = adapter_dir
    policy = Wrapper.from_pretrained(path, is_trainable=True)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    ids = tok(["the movie was", "the food was", "the book was", "the show was"])["input_ids"]
    seen = []

    def reward(prompts, completions):
        seen.extend(prompts)
        return [float(c.count("e")) for c in completions]

    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_ppo_epochs=1, total_episodes=4,
                     response_length=4, learning_rate=1e-2, report_to=[], save_strategy="no",
                     num_sample_generations=0, disable_tqdm=True, ref_quantization="none", use_cpu=True,
                     stop_token_id=tok.convert_tokens_to_ids("<|user|>"))
    assert args.max_steps == 2  # ceil(4 / 2) iterations x 1 optimizer step each
    trainer = PPOLMTrainer(model=policy, args=args, processing_class=tok, reward_model=reward, ref_model=base_dir,
                           train_dataset=Dataset.from_dict({"input_ids": ids}))
    assert trainer.stop_token_ids == [tok.convert_tokens_to_ids("<|user|>")]  # TRL's stop_token_id is honoured
    trainer.train()
    assert trainer.state.global_step == 2
    changed = {n for n, p in policy.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert any("lora_" in n for n in changed) and "v_head.summary.weight" in changed
    assert all("lora_" in n or "v_head" in n for n in changed), sorted(changed)
    texts = {tok.decode(i, skip_special_tokens=True) for i in ids}
    assert seen and set(seen) <= texts  # the reward callable got the prompts as text


# ---- pre-tokenized prompts (TRL 1.12's dataset format) -------------------------------------------------------------
def _prepare(dataset, tok):
    return prepare_prompts(dataset, tok, "train_dataset", max_prompt_length=None, response_length=4, context=None)


def test_pretokenized_prompts_with_and_without_attention_mask(tok):
    ids = tok(["the movie was", "bad"])["input_ids"]
    plain = _prepare(Dataset.from_dict({"input_ids": ids}), tok)
    assert plain["input_ids"] == ids
    assert plain["prompt"] == [tok.decode(i, skip_special_tokens=True) for i in ids]
    padded = tok(["the movie was", "bad"], padding=True)  # left padding, as a TRL collator would have made
    masked = _prepare(Dataset.from_dict(dict(padded)), tok)
    assert masked["input_ids"] == ids and masked["prompt"] == plain["prompt"]


def test_pretokenized_prompts_errors_name_the_fix(tok):
    with pytest.raises(ValueError, match="outside the policy tokenizer.*another tokenizer"):
        _prepare(Dataset.from_dict({"input_ids": [[1, 2], [5, len(tok) + 7]]}), tok)
    with pytest.raises(ValueError, match="one list of token ids per row"):
        _prepare(Dataset.from_dict({"input_ids": [[[1, 2]], [[3]]]}), tok)
    with pytest.raises(ValueError, match=r"any\(x\['attention_mask'\]\)"):
        _prepare(Dataset.from_dict({"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [0]]}), tok)
    with pytest.raises(ValueError, match="'input_ids' column"):
        _prepare(Dataset.from_dict({"text": ["the movie was"]}), tok)
    # The advice TRL users once got (rename input_ids to prompt) now gets the right fix instead of a crash.
    with pytest.raises(ValueError, match=r"holds token ids, not text.*rename_column\('prompt', 'input_ids'\)"):
        _prepare(Dataset.from_dict({"prompt": [[1, 2], [3]]}), tok)


def test_recipe_keeps_pretokenized_prompts(tok):
    recipe = _load_recipe()
    data = Dataset.from_dict({"input_ids": [[5, 6], [7]], "attention_mask": [[1, 1], [1]], "label": [0, 1]})
    kept = recipe.prompts_from_column(data, "prompt", tok, "ds")  # the default --prompt_column finds input_ids
    assert kept.column_names == ["input_ids", "attention_mask", "label"]  # other columns reach reward functions
    renamed = recipe.prompts_from_column(data.rename_column("input_ids", "ids"), "ids", tok, "ds")
    assert renamed["input_ids"] == [[5, 6], [7]]


# ---- TRL 1.12 PPOConfig names ------------------------------------------------------------------------------------
def _config(tmp_path, **kwargs) -> PPOConfig:
    return PPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def test_total_episodes_and_num_total_batches_set_max_steps(tmp_path):
    # 2 prompts x 2 accumulation = 4 per iteration; ceil(10 / 4) = 3 iterations x (2 epochs x 1 minibatch) steps.
    args = _config(tmp_path, total_episodes=10, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                   num_ppo_epochs=2)
    assert args.max_steps == 3 * 2 and args.rollout_batch_size == 4
    assert _config(tmp_path, num_total_batches=5, num_ppo_epochs=3).max_steps == 15
    # A config rebuilt from its own dict (max_steps already derived) is consistent, not a conflict.
    assert PPOConfig(**{**args.to_dict(), "use_cpu": True}).max_steps == 6
    with pytest.raises(ValueError, match="both set the run length"):
        _config(tmp_path, total_episodes=10, max_steps=7)
    with pytest.raises(ValueError, match="not both"):
        _config(tmp_path, total_episodes=10, num_total_batches=2)
    with pytest.warns(UserWarning, match="divide gradient_accumulation_steps by num_mini_batches"):
        _config(tmp_path, total_episodes=16, per_device_train_batch_size=2, num_mini_batches=2)


def test_trl_names_that_cannot_apply_say_what_to_use(tmp_path):
    for name in ("batch_size", "local_batch_size", "mini_batch_size", "local_mini_batch_size", "micro_batch_size"):
        with pytest.raises(ValueError, match=f"{name}=8 cannot be set.*per_device_train_batch_size"):
            _config(tmp_path, **{name: 8})
    with pytest.warns(UserWarning, match="ds3_gather_for_generation is ignored.*ZeRO-2"):
        _config(tmp_path, ds3_gather_for_generation=False)
    assert _config(tmp_path, exp_name="my-ppo").run_name == "my-ppo"
    assert _config(tmp_path, dataset_num_proc=2).dataset_num_proc == 2


# ---- TRL 1.12's example command line through recipes/ppo.py ----------------------------------------------------------
def _load_recipe():
    spec = importlib.util.spec_from_file_location("ppo_recipe_trl", Path(__file__).resolve().parents[2] / "recipes" /
                                                  "ppo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trl_style_dataset(tmp_path_factory):
    """A local folder laid out like the Hub dataset TRL's example uses (split 'descriptiveness', column 'prompt')."""
    root = tmp_path_factory.mktemp("descriptiveness-sentiment-trl-style")
    (root / "data").mkdir()
    prompts = ["the movie was", "the food was", "the book was", "the show was"] * 2
    Dataset.from_dict({"prompt": prompts, "chosen": ["x"] * 8}).to_parquet(
        root / "data" / "descriptiveness-00000-of-00001.parquet")
    return str(root)


def test_trl_example_command_line_runs(base_dir, tiny_models, trl_style_dataset, tmp_path):
    """TRL 1.12's documented `examples/scripts/ppo/ppo.py` command (its second, with model paths), flag for flag;
    only the Hub ids became local paths and the sizes became tiny."""
    recipe = _load_recipe()
    argv = [
        "--dataset_name", trl_style_dataset,
        "--dataset_train_split", "descriptiveness",
        "--output_dir", str(tmp_path / "pythia-1b-deduped-descriptiveness-sentiment-trl-style-ppo"),
        "--num_ppo_epochs", "1",
        "--num_mini_batches", "1",
        "--learning_rate", "3e-6",
        "--per_device_train_batch_size", "1",
        "--gradient_accumulation_steps", "2",
        "--total_episodes", "4",
        "--model_name_or_path", tiny_models["policy"],
        "--sft_model_path", tiny_models["policy"],
        "--reward_model_path", tiny_models["reward"],
        "--local_rollout_forward_batch_size", "1",
        "--missing_eos_penalty", "1.0",
    ]
    trainer = recipe.main(argv)
    assert trainer.args.max_steps == math.ceil(4 / 2) * 1 == trainer.state.global_step
    assert trainer.args.total_episodes == 4 and trainer.args.missing_eos_penalty == 1.0
    assert (Path(trainer.args.output_dir) / "model.safetensors").is_file()
    assert len(trainer.train_dataset) == 8

    # TRL's first example command has no model paths: TRL then trained against a base LM's random score head.
    no_reward = [a for a in argv if a not in ("--reward_model_path", tiny_models["reward"])]
    with pytest.raises(ValueError, match="--reward_model_path"):
        recipe.main(no_reward)


# ---- math helpers take TRL's float masks ----------------------------------------------------------------------------
def test_masked_stats_float_int_and_bool_masks_agree_with_hand_values():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    bool_mask = torch.tensor([True, True, False, True])
    # Selected: 1, 2, 4. sum 7; mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9;
    # biased var 14/9, unbiased 42/9 / 2 = 7/3.
    for mask in (bool_mask, bool_mask.float(), bool_mask.long(), bool_mask.to(torch.bfloat16)):
        assert masked_sum(values, mask).item() == pytest.approx(7.0)
        assert masked_mean(values, mask).item() == pytest.approx(7 / 3)
        assert masked_var(values, mask, unbiased=False).item() == pytest.approx(14 / 9)
        assert masked_var(values, mask).item() == pytest.approx(7 / 3)
        expected = torch.tensor([(1 - 7 / 3), (2 - 7 / 3), 0.0, (4 - 7 / 3)]) / math.sqrt(7 / 3)
        torch.testing.assert_close(masked_whiten(values, mask), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(masked_whiten(values, mask), masked_whiten(values, bool_mask), rtol=0, atol=0)
    rows = torch.tensor([[1.0, 3.0], [5.0, 9.0]])
    torch.testing.assert_close(masked_mean(rows, torch.tensor([[1.0, 1.0], [0.0, 1.0]]), dim=1), torch.tensor([2.0, 9.0]))
    with pytest.raises(ValueError, match="only 0 and 1"):
        masked_mean(values, torch.tensor([1.0, 0.5, 0.0, 1.0]))


def test_added_pad_token_without_resize_is_blamed_on_the_policy(base_dir, tiny_models, tmp_path):
    """TRL's script adds "[PAD]" to the tokenizer; without resizing, the fix is on the policy, not the reward model."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    args = _config(tmp_path, per_device_train_batch_size=2, max_steps=1, reward_quantization="none")
    with pytest.raises(ValueError, match=r"policy's embedding.*resize_token_embeddings\(len\(tokenizer\)\)"):
        PPOLMTrainer(model=base_dir, args=args, processing_class=tokenizer, reward_model=tiny_models["reward"],
                     train_dataset=Dataset.from_dict({"prompt": ["the movie was"] * 2}))


def test_value_head_is_reachable_as_trls_summary_layer(tok):
    # Code written for TRL's value head reads and initialises `v_head.summary`: the same parameters here.
    wrapper = AutoModelForCausalLMWithValueHead(build_causal_lm(tok))
    assert wrapper.v_head.summary.weight is wrapper.v_head.weight and wrapper.v_head.summary.bias is wrapper.v_head.bias
    torch.nn.init.normal_(wrapper.v_head.summary.weight, std=0.5)
    assert wrapper.v_head.weight.abs().sum() > 0
    assert set(wrapper.value_head_state_dict()) == {"weight", "bias"}  # the saved keys are unchanged


# ---- the last mile ---------------------------------------------------------------------------------------------------
# Coming from TRL, the last mile: TRL 1.12's `sft_model_path` / `reward_model_path` as PPOConfig fields, the value
# head's state keys and files as TRL's class wrote and read them, the added-`[PAD]` error, a TRL name whose meaning
# differs, and the seq2seq error. Tiny models built locally; checkpoints in TRL's layout are written by hand (file
# names and keys as TRL 0.11 wrote them).

TRL_HEAD_KEYS = {"v_head.summary.weight", "v_head.summary.bias"}


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

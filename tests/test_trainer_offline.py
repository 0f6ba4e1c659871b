"""PPOLMTrainer loading policy, reward model and tokenizers by Hub id from an offline HF cache (no HTTP request)."""

import json
import os
import subprocess
import sys
import textwrap

from hub_fixtures import seed_offline_cache

# A fresh interpreter: HF_HUB_OFFLINE and HF_HUB_CACHE are read once, when huggingface_hub is imported.
SCRIPT = textwrap.dedent("""
    import json
    from datasets import Dataset
    from peft import LoraConfig
    from hf_ppo import PPOConfig, PPOLMTrainer

    prompts = Dataset.from_dict({"prompt": ["the movie was", "the food was"] * 4})
    args = PPOConfig(output_dir=OUT, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_ppo_epochs=1,
                     max_steps=1, response_length=6, report_to=[], save_strategy="no", disable_tqdm=True,
                     num_sample_generations=0, policy_quantization="4bit", reward_quantization="4bit",
                     model_init_kwargs={"revision": "v1"}, reward_model_init_kwargs={"revision": "v1"})
    trainer = PPOLMTrainer(model="hf-ppo-test/tiny-policy", args=args, reward_model="hf-ppo-test/tiny-reward",
                           train_dataset=prompts, peft_config=LoraConfig(r=4, target_modules="all-linear"))
    trainer.train()
    result = {"kl0": trainer.state.log_history[0]["objective/kl"],
              "hidden": trainer.model.config.hidden_size,
              "reward_tokenizer_fast_path": trainer.reward_tokenizer is None}
    try:
        PPOLMTrainer(model="hf-ppo-test/not-cached", args=args, reward_model="hf-ppo-test/tiny-reward",
                     train_dataset=prompts)
    except OSError as err:
        result["missing"] = str(err)
    print("RESULT=" + json.dumps(result))
""")


def test_load_by_hub_id_offline(tiny_models, tmp_path):
    cache = tmp_path / "hub"
    seed_offline_cache(cache, "hf-ppo-test/tiny-policy", tiny_models["policy"], revision="v1")
    seed_offline_cache(cache, "hf-ppo-test/tiny-reward", tiny_models["reward"], revision="v1")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "OMP_NUM_THREADS": "2",
           "HF_ENDPOINT": "http://127.0.0.1:9"}  # a closed port: any request would fail the run
    code = f"OUT = {str(tmp_path / 'out')!r}\n" + SCRIPT
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT=")[-1])
    assert result["kl0"] == 0.0 and result["hidden"] == 64 and result["reward_tokenizer_fast_path"]
    assert "hf-ppo-test/not-cached" in result["missing"] and "HF_HUB_OFFLINE" in result["missing"]

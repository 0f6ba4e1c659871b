"""Loading tiny models by Hub id from a seeded offline cache, through the real client, with no HTTP request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import load_file

from hf_ppo.cli.tiny import build_causal_lm, build_tokenizer
from tests.hub_fixtures import seed_offline_cache

REPO_ID = "hf-ppo-test/tiny-policy"

# Run in a fresh interpreter: HF_HUB_OFFLINE and HF_HUB_CACHE are read once, when huggingface_hub is imported.
LOADER = textwrap.dedent(
    """
    import json, sys
    from transformers import AutoModelForCausalLM, AutoTokenizer

    results = {}
    for revision in sys.argv[1:]:
        tokenizer = AutoTokenizer.from_pretrained("hf-ppo-test/tiny-policy", revision=revision)
        model = AutoModelForCausalLM.from_pretrained("hf-ppo-test/tiny-policy", revision=revision)
        inputs = tokenizer(["the movie was"], return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        results[revision] = {
            "vocab": len(tokenizer),
            "hidden_size": model.config.hidden_size,
            "embed_sum": float(model.get_input_embeddings().weight.sum()),
            "generated": out.shape[1] - inputs["input_ids"].shape[1],
        }
    for name, load in [("missing_model", lambda: AutoModelForCausalLM.from_pretrained("hf-ppo-test/not-cached")),
                       ("missing_tokenizer", lambda: AutoTokenizer.from_pretrained("hf-ppo-test/not-cached")),
                       ("missing_revision", lambda: AutoModelForCausalLM.from_pretrained(
                           "hf-ppo-test/tiny-policy", revision="never-seeded"))]:
        try:
            load()
            results[name] = None
        except Exception as err:
            cause = err.__cause__ or err.__context__
            results[name] = {"type": f"{type(err).__module__}.{type(err).__qualname__}", "message": str(err),
                             "cause": None if cause is None else f"{type(cause).__module__}.{type(cause).__qualname__}"}
    print("RESULTS=" + json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def seeded_cache(tmp_path_factory):
    """A Hub cache holding REPO_ID at "main" (hidden 32) and "v2" (hidden 64, another tokenizer)."""
    root = tmp_path_factory.mktemp("offline")
    cache = root / "hub"
    snapshots = {}
    for revision, hidden, vocab in [("main", 32, 512), ("v2", 64, 384)]:
        src = root / revision
        tokenizer = build_tokenizer(vocab_size=vocab)
        build_causal_lm(tokenizer, hidden_size=hidden, num_layers=1).save_pretrained(src)
        tokenizer.save_pretrained(src)
        snapshots[revision] = seed_offline_cache(cache, REPO_ID, src, revision=revision)
    return cache, snapshots


def test_seeded_cache_layout(seeded_cache):
    cache, snapshots = seeded_cache
    repo_dir = cache / "models--hf-ppo-test--tiny-policy"
    assert (repo_dir / "refs" / "main").read_text() == snapshots["main"].name
    assert (repo_dir / "refs" / "v2").read_text() == snapshots["v2"].name
    assert snapshots["main"].name != snapshots["v2"].name
    weights = snapshots["main"] / "model.safetensors"
    assert weights.is_symlink() and weights.resolve().parent == repo_dir / "blobs"


def test_offline_load_by_id_makes_no_request(local_hub, seeded_cache, tmp_path):
    cache, snapshots = seeded_cache
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(cache),
        "HF_HOME": str(tmp_path / "hf_home"),
        # Online by mistake, the subprocess would ask the local Hub, whose request log must stay empty.
        "HF_ENDPOINT": local_hub.url,
        "OMP_NUM_THREADS": "1",
    }
    sha_v2 = snapshots["v2"].name
    proc = subprocess.run([sys.executable, "-c", LOADER, "main", "v2", sha_v2], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS=")[-1])

    assert local_hub.requests == []
    for revision, hidden in [("main", 32), ("v2", 64), (sha_v2, 64)]:
        snapshot = snapshots["v2" if revision == sha_v2 else revision]
        embed = load_file(snapshot / "model.safetensors")["model.embed_tokens.weight"]
        assert results[revision]["hidden_size"] == hidden
        assert results[revision]["embed_sum"] == pytest.approx(float(embed.sum()), rel=1e-6)
        assert results[revision]["generated"] == 3
    assert results["main"]["vocab"] != results["v2"]["vocab"]
    # What offline mode raises for an id or a revision that is not cached: a bare OSError that names neither the
    # id nor offline mode, hence the trainer's own message around it.
    for case in ("missing_model", "missing_tokenizer", "missing_revision"):
        assert results[case]["type"] == "builtins.OSError", results[case]
        assert "couldn't find them in the cached files" in results[case]["message"], results[case]
        assert results[case]["cause"] == "huggingface_hub.errors.LocalEntryNotFoundError", results[case]


# ---- the trainer loads by Hub id from an offline cache ---------------------------------------------------------------
# PPOLMTrainer loading policy, reward model and tokenizers by Hub id from an offline HF cache (no HTTP request).

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

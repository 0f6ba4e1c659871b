#!/usr/bin/env bash
# Everything a lent GPU machine is for, in one command that fits its lease (issue 52's order): the GPU tests and the
# CPU suite's fast tests with CUDA visible, the single-GPU memory table (bench/gpu.py), the engines' tokens/s against
# transformers' `generate`, seconds per iteration against trl 1.12 (bench/bench.py --gpu), a torch.profiler summary.
#
#   bash ../shared/gpu/prepare_wheels.sh && TRL_PEER=1 bash ../shared/gpu/prepare_wheels.sh   # here: .whl, .whl-trl112
#   # the device command (carry .whl and .whl-trl112):  bash bench/gpu_session.sh
#   bash bench/gpu_session.sh --dry-run        # here, on the CPU, with .venv: every step runs on tiny shapes
#   STEPS="test_gpu suite tokens" SUITE="tests/trainer tests/rollout" bash bench/gpu_session.sh   # some steps only
#
# Each step has its own time limit and the whole run a deadline (BUDGET seconds, default 420), so a slow step leaves
# the others their turn; what a step measured is kept when a later one fails. Logs, JSON and the profiles go into
# $OUT/gpu-session.tar.gz (the device tool brings back $OUT), and the last lines printed are the tables.
set -u
cd "$(dirname "$0")/.."
DRY=0; [ "${1:-}" = --dry-run ] && DRY=1
OUT=${OUT:-bench/out/gpu-session}
BUDGET=${BUDGET:-420}
work=$(mktemp -d); logs=$work/logs; mkdir -p "$logs" "$OUT"
t0=$(date +%s)
STEPS=${STEPS:-"test_gpu suite memory tokens peer memory_8b_off"}
want() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
# step NAME LIMIT CMD...: runs CMD under min(LIMIT, time left), its output in logs/NAME.log; prints its last lines.
step() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -lt 15 ]; then echo "== $name: skipped, $(left) s left of the budget" | tee -a "$logs/summary.txt"; return; fi
  local start=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$logs/summary.txt"
  tail -n "${TAIL:-4}" "$logs/$name.log"
}

if [ "$DRY" = 1 ]; then
  PY=${PY:-.venv/bin/python}; GPU_ARGS=(--dry-run); SIZES_SMALL=(qwen2.5-0.5b); SIZES=(qwen2.5-0.5b llama-3.1-8b)
  SUITE=(${SUITE:-tests/hub}); WORKERS=1
else
  PY=python3; GPU_ARGS=(); SIZES_SMALL=(qwen2.5-0.5b); SIZES=(llama-3.1-8b qwen2.5-0.5b qwen2.5-1.5b llama-3.2-3b)
  SUITE=(${SUITE:-tests}); WORKERS=${WORKERS:-6}
  # The machine's python has torch, peft and accelerate; the rest of our range comes as wheels (prepare_wheels.sh).
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site-trl112 .whl-trl112/*.whl \
    || echo "trl 1.12 wheel missing: the peer comparison will say so"
  export PYTHONPATH=$PWD:/tmp/site HF_PPO_PEER_SITE=/tmp/site-trl112
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi 2>/dev/null | head -15
  "$PY" -c "import importlib.metadata as m, torch, sys; print(sys.version.split()[0], 'cuda', torch.version.cuda, torch.cuda.is_available()); [print(n, m.version(n)) for n in ('torch','transformers','peft','trl','accelerate','bitsandbytes','datasets','pyarrow','tokenizers','huggingface_hub','safetensors')]"
} >"$logs/versions.txt" 2>&1
cat "$logs/versions.txt"

# 1. What only a GPU can break, while the CPU suite's fast tests run beside it with CUDA visible (the suite is CPU
#    work; its own timings are not measurements).
want suite && ( TAIL=12 step suite "${SUITE_LIMIT:-240}" "$PY" -m pytest -q -rfE -p no:cacheprovider -m "not slow" --continue-on-collection-errors \
    $( [ "$WORKERS" -gt 1 ] && echo "-n $WORKERS" ) "${SUITE[@]}" ) > "$logs/suite.step" 2>&1 &
suite=$!
want test_gpu && TAIL=12 step test_gpu 180 "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/integration/test_gpu.py

# 2. Peak memory of one PPO iteration per size, gradient checkpointing on (the suite may still run: memory only).
want memory && step memory 200 "$PY" bench/gpu.py "${GPU_ARGS[@]}" --sizes "${SIZES[@]}" --checkpointing on --tokens-sizes \
  --skip-peer --json "$logs/gpu-memory.json"
# OVERLAP=1 (a short lease): the timings below run while the suite still runs (their numbers then carry its load).
want suite && [ -z "${OVERLAP:-}" ] && { wait $suite; cat "$logs/suite.step"; }

# 3. Alone on the machine, the timings: tokens/s of each engine and of `generate` at 0.5B (with the iteration without
#    checkpointing and its profile), then seconds per iteration against trl 1.12 at 0.5B.
want tokens && step tokens "${TOKENS_LIMIT:-150}" "$PY" bench/gpu.py "${GPU_ARGS[@]}" --sizes "${SIZES_SMALL[@]}" --checkpointing "${TOKENS_MEMORY:-both}" \
  --skip-peer --json "$logs/gpu-tokens.json" ${TOKENS_ARGS:---profile}
if ! want peer; then :
elif [ "$DRY" = 1 ]; then
  step peer 60 "$PY" bench/bench.py --gpu
else
  step peer 150 "$PY" bench/bench.py --gpu --rows gpu-0.5b-qlora --iters 3 --warmup 1 --reps 1 --learn-iters 0 \
    --skip-8b --results "$logs/RESULTS-gpu.md"
fi
# 4. With what is left: the 8B shape without checkpointing (does it fit 24 GB?).
want memory_8b_off && step memory_8b_off 120 "$PY" bench/gpu.py "${GPU_ARGS[@]}" --sizes llama-3.1-8b --checkpointing off --tokens-sizes \
  --skip-peer --json "$logs/gpu-8b-off.json"

want suite && [ -n "${OVERLAP:-}" ] && { wait $suite; cat "$logs/suite.step"; }
cp bench/out/logs/*.log "$logs/" 2>/dev/null
tar -czf "$OUT/gpu-session.tar.gz" -C "$work" logs
echo; echo "#### summary ($(( $(date +%s) - t0 )) s)"; cat "$logs/summary.txt"
for f in "$logs"/gpu-*.json; do
  [ -f "$f" ] && "$PY" -c "import json,sys; sys.path.insert(0,'bench'); from gpu import table; print(table(json.load(open('$f'))['results']))"
done
grep -h "| gpu-0.5b" "$logs/peer.log" 2>/dev/null | head -3
for f in suite test_gpu; do echo "$f: $(grep -E '(passed|failed|error)' "$logs/$f.log" 2>/dev/null | tail -n 1)"; done

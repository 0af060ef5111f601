#!/usr/bin/env bash
# gpu_issue30.sh - issue 30's checks on one GPU, in one device call of < 9 minutes.
#
# Runs on the GPU machine after the kit of benchmarks/gpu_issue30_carry.sh is installed into
# /tmp/site (the calls in .vllm-carry/calls_all.txt), from the repository root:
#   bash benchmarks/gpu_issue30.sh
# Steps, in order; each is time-boxed (`timeout`, and never past the script's deadline), each
# runs whatever the previous one did, and the GPU processes a step leaves are killed after it:
#   warm  (in the background from the start, with step b only) DeepSpeed's FusedAdam, which
#         builds just in time (nvcc, ~1 min) the first time a learner takes it: only ZeRO-3
#         learners do (rl_learner.build_optimizer), so d runs as on a fresh machine without it
#   a     nvidia-smi, `import vllm, ray, deepspeed, trl, datasets, msgspec` with their versions
#   b     pytest -m gpu: the gpu-marked tests
#   c     pytest tests/rollout/test_vllm_engine.py: VLLMEngine on the official vLLM, on the GPU
#   d     benchmarks/grpo_vs_trl.py --workload long --device cuda --model-size 0.5b: ours
#         (rl-launch ppo, vLLM and the DeepSpeed learner colocated on the GPU) against TRL's
#         GRPOTrainer (HF generate on the GPU), the same model, prompts and reward; ours as
#         D_VARIANT (resident: ray.colocate all with nothing slept or offloaded; sleep: the
#         default hybrid engine; async: resident + rollout.async_train; none: no run against
#         TRL, for a second call on the same warm machine), then each variant of D_MORE
#         ("async sleep") on our side alone while time is left
#   e     (only when named in STEPS) benchmarks/checkpoint_seal.py at the 0.5B checkpoint's size
# Everything is logged into $OUT (8 files, the most that come back): summary.txt, warm.log,
# a_env.log, b_gpu_tests.log, c_vllm_engine.log, d_long.log, d_ours.log, d_trl.log; the summary
# is printed at the end.
#
# Knobs (environment): BUDGET_S (530: seconds from the start to the deadline), VLLM_MODE (how
# our vLLM engine runs: decode-graphs, the default: no torch.compile, full CUDA graphs for decode
# batches only, captured in seconds; eager: rollout.enforce_eager; compiled: vLLM's default,
# torch.compile + piecewise graphs, ~1 min more at start-up), D_TOKENS (512 new tokens per
# answer, all of them: min_new_tokens), D_PROMPTS (8), D_N (8 samples per prompt), D_STEPS (5),
# D_TRL_GENERATION (hf: TRL with HF generate; vllm: TRL's vLLM colocate mode), D_CAP (330: the
# seconds the main d run may take), D_SIDE (each side's --timeout in it; default 55 % of D_CAP
# less 30 s: give TRL, whose 512-token steps take ~13.5 s on an H100, enough for D_STEPS), GPU_TESTS_STOP (--maxfail=3), GPU_TESTS_WORKERS (4 pytest-xdist workers for b), STEPS (abcd: the
# steps to run, e.g. STEPS=ad); for a dry run
# of this script on a CPU machine: PY (python3), SITE (/tmp/site), D_DEVICE (cuda), D_SIZE (0.5b).
set -u

START=$(date +%s)
DEADLINE=$((START + ${BUDGET_S:-530}))
OUT=${OUT:-/tmp/gpu_issue30_out}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BENCH=$HERE/grpo_vs_trl.py
[ -d packages/rl-launch/src ] || { echo "run me from the repository root" >&2; exit 2; }
ROOT=$(pwd)
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"

SITE=${SITE:-/tmp/site}
export PYTHONPATH="$SITE:$ROOT:$ROOT/packages/rl-algos/src:$ROOT/packages/rl-data/src:$ROOT/packages/rl-rollout/src:$ROOT/packages/rl-learner/src:$ROOT/packages/rl-launch/src"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DS_ACCELERATOR=cuda VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions # DeepSpeed's JIT ops: one build for every step
# H100 / H200, and the install call's prebuild flags (so one build, reused): not a value already
# in the environment, where an arch like '9.0a' fails DeepSpeed 0.19.8's parsing (2026-11-27)
export TORCH_CUDA_ARCH_LIST=9.0
export VLLM_USE_FLASHINFER_SAMPLER=0                     # FlashInfer's sampling kernels would JIT-compile (minutes)
PY=${PY:-python3}

say() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((DEADLINE - $(date +%s))); }

cleanup() { # the GPU processes, Ray daemons and vLLM engine cores a step left (a timed-out pytest
  # leaves vLLM's engine core running: it is not in timeout's process group); nothing else runs here
  local pid cmd
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    cmd=$({ tr '\0' ' ' < "/proc/$pid/cmdline"; } 2>/dev/null) || continue
    case "$cmd" in *FusedAdamBuilder*) ;; *) kill -9 "$pid" 2>/dev/null ;; esac
  done
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    cmd=$({ tr '\0' ' ' < "/proc/$pid/cmdline"; } 2>/dev/null) || continue
    case "$cmd" in
      *"$SITE/ray/core/src/ray/"* | *"$SITE/ray/_private/"* | *"$SITE/ray/dashboard/"* | "VLLM::"*) kill -9 "$pid" 2>/dev/null ;;
    esac
  done
  sleep 1
}

# step NAME MAX_SECONDS LOG COMMAND...: run with min(MAX, time left - 15 s); record rc and seconds
step() {
  local name=$1 max=$2 log=$3 t s rc
  shift 3
  case "${STEPS:-abcd}" in *"$name"*) ;; *) say "[$name] not run (STEPS=${STEPS})"; return ;; esac
  t=$(($(left) - 15))
  [ "$t" -lt "$max" ] || t=$max
  if [ "$t" -lt 20 ]; then
    say "[$name] SKIPPED: $(left) s left before the deadline"
    return
  fi
  s=$(date +%s)
  echo "== [$name] $* (timeout $t s)" >> "$log"
  timeout -k 10 "$t" "$@" >> "$log" 2>&1
  rc=$?
  local took=$(($(date +%s) - s))
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    say "[$name] TIMED OUT after $took s (limit $t s)"
  else
    say "[$name] rc=$rc in $took s"
  fi
  cleanup
}

say "gpu_issue30.sh at $(date -u +%FT%TZ); budget ${BUDGET_S:-530} s; VLLM_MODE=${VLLM_MODE:-decode-graphs}"

# warm: DeepSpeed's FusedAdam, built once in the background while a and b start (b's ZeRO-3 tests)
WARM_PID=
case "${STEPS:-abcd}" in *b*)
(
  t=$(date +%s)
  timeout 240 $PY -c "
import time; t = time.time()
from deepspeed.ops.op_builder import FusedAdamBuilder
FusedAdamBuilder().load()
print('FusedAdam built and loaded in %.1f s' % (time.time() - t))
"
  echo "rc=$? after $(($(date +%s) - t)) s"
) > "$OUT/warm.log" 2>&1 &
WARM_PID=$! ;;
esac

# a. the environment
A=$OUT/a_env.log
{
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  nproc
  free -g | head -2
  df -h /tmp | tail -1
  command -v nvcc && nvcc --version | tail -2
} >> "$A" 2>&1
say "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
step a 60 "$A" $PY -c "
import time; t = time.time()
import torch, vllm, ray, deepspeed, trl, datasets, msgspec, transformers
print('imports %.1f s' % (time.time() - t))
print('VERSIONS torch', torch.__version__, 'cuda', torch.version.cuda, '| vllm', vllm.__version__, '| ray', ray.__version__,
      '| deepspeed', deepspeed.__version__, '| trl', trl.__version__, '| datasets', datasets.__version__,
      '| msgspec', msgspec.__version__, '| transformers', transformers.__version__)
print('GPU', torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0), torch.cuda.mem_get_info())
"
grep -h '^VERSIONS\|^imports' "$A" | tee -a "$SUMMARY"
# what the launcher's driver imports before its first line (19 s here on an H100, 2.5 s on a
# 2-core CPU machine): the slowest modules by cumulative import time
case "${STEPS:-abcd}" in *a*)
  { echo "-- python -X importtime -c 'import rl_launch.cli, ray' (top 15 by cumulative us):"
    $PY -X importtime -c "import rl_launch.cli, ray" 2>&1 | grep '^import time:' | sort -t'|' -k2 -n -r | head -n 15
  } >> "$A" 2>&1
  grep -A3 '^-- python -X importtime' "$A" | tail -n 3 | sed 's/^/  a: /' | tee -a "$SUMMARY" ;;
esac

# b. the gpu-marked tests, collected from the files that have any (addopts replaced: the
# repository's need pytest-xdist >= 3.6)
PYTEST=($PY -m pytest -o "addopts=" --import-mode=importlib --strict-markers -p no:cacheprovider -q -rfEs)
B=$OUT/b_gpu_tests.log
mapfile -t GPU_FILES < <(grep -rl --include='test_*.py' 'mark\.gpu' tests | sort)
echo "gpu-marked files: ${GPU_FILES[*]}" >> "$B"
step b 150 "$B" "${PYTEST[@]}" -m gpu ${GPU_TESTS_STOP:---maxfail=3} -n "${GPU_TESTS_WORKERS:-4}" --dist loadfile "${GPU_FILES[@]}"
tail -n 25 "$B" | grep -E 'passed|failed|skipped|error|FAILED|ERROR' | tail -n 12 | sed 's/^/  b: /' | tee -a "$SUMMARY"

# c. the vLLM engine's tests on the official vLLM
C=$OUT/c_vllm_engine.log
# -v: each test's name and outcome as it ends (a step killed at its limit prints no summary);
# pytest-timeout (on the image) fails a test that hangs instead of the whole step
step c 200 "$C" "${PYTEST[@]}" -v --timeout 90 tests/rollout/test_vllm_engine.py
grep -sE '(FAILED|ERROR)( |$)|^=+ .*(passed|failed)' "$C" | head -n 20 | sed 's/^/  c: /' | tee -a "$SUMMARY"

# the warm-up should be long done; wait for it (bounded) so that it does not run beside d
if [ -n "$WARM_PID" ]; then
  wait "$WARM_PID" 2>/dev/null
  say "warm: $(tail -n 2 "$OUT/warm.log" | tr '\n' ' ')"
fi

# d. the long workload on the GPU: ours against TRL
D=$OUT/d_long.log
PRESETS=()
[ -d /tmp/gpukit/presets ] && PRESETS=(--preset-root /tmp/gpukit/presets) # the carried build: no SFT here

run_d() { # $1 = VLLM_MODE, $2 = our hybrid engine's variant, $3 = "ours" for our side alone
  local engine=() variant=() only=() t side cap=${D_CAP:-330}
  case "$1" in
    decode-graphs) engine=(--ours-option 'rollout.engine_options.compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}') ;;
    eager) engine=(--ours-option rollout.enforce_eager=true) ;;
    compiled) ;;
    *) say "VLLM_MODE=$1: not one of decode-graphs, eager, compiled; vLLM's default (compiled) runs" ;;
  esac
  case "$2" in
    sleep) ;; # rl-launch's default hybrid engine: engines sleep, learners offload, every step
    resident) variant=(--ours-option ray.engine_sleep=false --ours-option ray.learner_offload=false) ;;
    async) variant=(--ours-option ray.engine_sleep=false --ours-option ray.learner_offload=false
      --ours-option rollout.async_train=true) ;;
    *) say "D_VARIANT=$2: not one of sleep, resident, async; sleep runs" ;;
  esac
  if [ "${3:-}" = ours ]; then only=(--only ours); cap=200; fi
  t=$(($(left) - 15))
  [ "$t" -gt "$cap" ] && t=$cap
  side=$(((t - 30) * 11 / 20)) # each side's limit inside the benchmark (ours starts Ray and vLLM: 55 %)
  [ -n "${D_SIDE:-}" ] && side=$D_SIDE
  [ "${3:-}" = ours ] && side=$((t - 30))
  echo "=== [d] VLLM_MODE=$1, ours $2${3:+ (ours alone)}" >> "$D"
  say "[d] VLLM_MODE=$1, ours $2${3:+ (ours alone)}"
  step d "$cap" "$D" $PY "$BENCH" --workload long --device "${D_DEVICE:-cuda}" --model-size "${D_SIZE:-0.5b}" --seed 0 \
    --max-new-tokens "${D_TOKENS:-512}" --prompts "${D_PROMPTS:-8}" --n "${D_N:-8}" --steps "${D_STEPS:-5}" \
    --timeout "$side" --trl-generation "${D_TRL_GENERATION:-hf}" --keep "${PRESETS[@]}" "${engine[@]}" \
    "${variant[@]}" "${only[@]}"
}

collect_d() { # our side's console, metrics and actor logs (tails) into one file; TRL's console
  local scratch f
  scratch=$(sed -n 's/^scratch folder: //p' "$D" | tail -1)
  [ -n "$scratch" ] && [ -d "$scratch" ] || return
  {
    for f in $(find "$scratch" -name ours.log -o -name metrics.jsonl -o -path '*/ours/logs/*.log' | sort); do
      echo "===== $f (last 400 lines)"
      tail -n 400 "$f"
    done
  } >> "$OUT/d_ours.log" 2>&1
  [ -f "$scratch/trl.log" ] && { echo "===== $scratch/trl.log"; cat "$scratch/trl.log"; } >> "$OUT/d_trl.log"
}

MODE=${VLLM_MODE:-decode-graphs}
VARIANT=${D_VARIANT:-resident}
[ "$VARIANT" = none ] || { run_d "$MODE" "$VARIANT"; collect_d; }
if [[ "${STEPS:-abcd}" == *d* ]] && [ "$VARIANT" != none ] && ! grep -qE '^ours (done|killed)' "$D" && [ "$MODE" != eager ] && ! grep -q 'actors ready' "$OUT/d_ours.log" 2>/dev/null \
  && [ "$(left)" -gt 240 ]; then
  say "[d] ours failed before its actors were ready with VLLM_MODE=$MODE: once more with eager"
  MODE=eager
  run_d "$MODE" "$VARIANT"
  collect_d
fi
# our other variants, our side alone (TRL's numbers above are the baseline), while time is left
if [[ "${STEPS:-abcd}" == *d* ]]; then
  for more in ${D_MORE-async sleep}; do
    if [ "$(left)" -lt 150 ]; then say "[d] ours $more: not run, $(left) s left"; continue; fi
    run_d "$MODE" "$more" ours
    collect_d
  done
fi
grep -E '^(=== \[d\]|model |workload |samples/s|mean step|wall seconds|start-up|mean response|ours, share|  ours |  TRL |  TRL/ours|step seconds|ours (done|killed)|TRL (done|killed)|ours: samples|note: )' "$D" \
  | sed 's/^/  d: /' | tee -a "$SUMMARY"
grep -E 'Error|error:|Traceback' "$D" | tail -n 5 | sed 's/^/  d: /' | tee -a "$SUMMARY"

# e. sealing a checkpoint of the 0.5B model's ZeRO-2 size (1 GB of model states, 5.9 GB of
# optimizer states): sequential fsync + SHA-256 against rl_learner's thread pool (logged into
# a_env.log: 8 files come back)
step e 150 "$A" $PY "$HERE/checkpoint_seal.py" --sizes-mib 1024 5900 --repeats 1 --dir /tmp
grep -E '^(files |seal|verify)' "$A" | sed 's/^/  e: /' | tee -a "$SUMMARY"

say "total $(($(date +%s) - START)) s"
echo "=== SUMMARY"
cat "$SUMMARY"

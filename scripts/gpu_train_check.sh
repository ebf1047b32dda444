#!/usr/bin/env bash
# paravt's prepared device calls (issues 36, 49 and 65) as ONE script. A lent session has 15
# device-minutes in all, start-up included; docs/gpu/README.md, "Prepared calls", says which
# calls to make in which order on an H100 and on an H200, with their timeouts. In short:
#
#   here:   make gpu-wheels gpu-snapshot     # .gpu_wheels/ (pinned: scripts/gpu_wheels.txt,
#                                            # ~48.1 MiB) + .gpu_snap/ (code tar.gz, launch.sh)
#           python scripts/gpu_carry.py      # what each call carries, against 64 MiB
#   device: run(command="PARAVT_GPU_CALL=main bash .gpu_snap/launch.sh",
#               carry=[".gpu_snap", ".gpu_wheels"], timeout_s=480)      # no kind: H200 fallback
#
# .gpu_snap/launch.sh (scripts/gpu_launch.sh) unpacks the snapshot into an empty folder and runs
# this script there, so every call is self-sufficient on a fresh machine; on a warm one the setup
# reuses what an earlier call did (the same wheels installed, the same paravt._C built).
#
# PARAVT_GPU_CALL picks the steps, in order of value; PARAVT_GPU_STEPS overrides them (a rerun):
#   main   (timeout_s 480)
#     probe           scripts/gpu_probe.py: torch / Triton / numpy / Python versions, the card's
#                     free memory, libnvcuvid, paravt._C's CUDA ops, a one-layer Qwen3-VL-2B
#                     forward + backward through paravt's log-prob path on CUDA vs fp32 on CPU
#     real_size_2b    scripts/gpu_real_size.py on a random-initialised Qwen3-VL-2B (bf16,
#                     fp32 masters, checkpointing, packed vision, HF engine, 600 s videos, K in
#                     {32, 64}, 5 crops, G = 8, oracle main turns forcing crops and sub-agents)
#     kernel_targets  bench/gpu_kernels.py --targets: policy_loss >= 70% of HBM bandwidth in
#                     <= 2 kernels, linear_logprob <= 3x Liger FLCE's peak memory,
#                     linear_policy_loss >= 680 TFLOP/s; every baseline in the same run
#     gpu_tests       the tests that use the GPU (pytest -k cuda over GPU_TESTS: 14 tests; the
#                     rest of those files runs in CI)
#     varlen          scripts/varlen_attn_check.py (varlen_attn vs the per-sequence SDPA paths)
#   extra  (timeout_s 240; right after main, on the warm machine)
#     probe
#     copy_stream, hsdp, vllm_graphs   scripts/gpu_realscale.py: issue 61's GPU-only halves, each
#                     skipped "not implemented yet" (named) until the code has it
#     nvdec           scripts/nvdec_check.py: NVDEC through PyAV (FFmpeg's nvdec hwaccel on the
#                     native h264/hevc decoders) vs its CPU decode, 720p and 1080p H.264/HEVC
#   video  (timeout_s 600; name kind nvidia-h200: 4B needs 108 GiB)
#     probe
#     real_size_big   gpu_real_size.py on Qwen3-VL-8B if `python -m paravt.plan` says it fits
#                     the card this call got, else 4B if that fits, else skipped (the plan's
#                     numbers in steps.log); a plan that fails to run fails the step
#     default_train   `python -m paravt.train` (the embedded default) on CUDA
#   Also: dali (scripts/dali_check.py, needs DALI's wheel in parts: --split-dali below).
#
# Time plan: BUDGET below, seconds, setup included; a call's budgets add up to its deadline
# (PARAVT_GPU_DEADLINE_S, default their sum), 30 s under the timeout_s the docs give it
# (`bash scripts/gpu_train_check.sh --plan` prints every call's; tests/test_gpu_scripts.py checks
# the docs' tables against it). A step runs under max(its budget, what is left minus the budgets
# of the steps after it), at most what is left: time an earlier step did not use goes to the next,
# an overrun is taken from the last steps. A step left less than half its budget is skipped and
# named. Each step is independent: a failed one is recorded and the next one runs.
#
# The card: nvidia-smi's name picks the plan's --gpu (h100-80gb | h200-141gb; torch's device
# memory for another card); every plan of the run is for that card.
#
# Output: $OUT (the device tool brings back 8 files) or ./gpu_out:
#   steps.log     the setup, then every step's output, STREAMED as it runs (a step cut by the
#                 call's own limit still brings back what it printed)
#   summary.json  setup + per step {status, rc, seconds, limit_s, budget_s, reason, figures};
#   summary.txt   REWRITTEN after the setup, when each step starts and when it ends
#   NAME.json     the step's own JSON, written by the step while it runs: the first 5 steps that
#                 write one (the others' stay in $PARAVT_GPU_WORK/steps; summary.json has them)
# Work files (data, random checkpoints, runs) go to $PARAVT_GPU_WORK (./gpu_out_work, ignored).
#
# Without CUDA every step is reported `skipped: no CUDA` and the script exits 0.
# PARAVT_GPU_DRY=1 runs every step on the CPU at a tiny size through the same command lines
# (tests/test_gpu_scripts.py does, through the documented calls, in CI); it exits 1 if a step
# failed, as with CUDA. PARAVT_GPU_SETUP=0 skips the wheels and the build altogether.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
WORK=${PARAVT_GPU_WORK:-gpu_out_work}
PY=${PY:-python3}
DRY=${PARAVT_GPU_DRY:-0}
CALL=${PARAVT_GPU_CALL:-main}
DALI_STAGE=${PARAVT_DALI_STAGE:-/tmp/paravt_dali}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false

# ---- the calls and their time plans ------------------------------------------------------
declare -A BUDGET=([setup]=100 [probe]=30
  [real_size_2b]=180 [kernel_targets]=85 [gpu_tests]=35 [varlen]=20
  [copy_stream]=15 [hsdp]=15 [vllm_graphs]=10 [nvdec]=40
  [real_size_big]=260 [default_train]=180 [dali]=120)
declare -A CALL_STEPS=([main]="probe real_size_2b kernel_targets gpu_tests varlen"
  [extra]="probe copy_stream hsdp vllm_graphs nvdec"
  [video]="probe real_size_big default_train")
declare -A CALL_TIMEOUT=([main]=480 [extra]=240 [video]=600)  # the docs' timeout_s
CALL_MARGIN=30  # timeout_s - deadline: the unpack, the summary, the transfer of $OUT
plan_of() {  # STEPS -> "setup:100 probe:30 ..."
  local p="setup:${BUDGET[setup]}" s
  for s in $1; do p+=" $s:${BUDGET[$s]:-0}"; done
  echo "$p"
}
sum_of() {  # "a:1 b:2" -> 3
  local t=0 x
  for x in $1; do t=$((t + ${x##*:})); done
  echo "$t"
}
if [ "${1:-}" = "--plan" ]; then  # every call's plan as JSON (docs and tests read it)
  first=1
  echo "{"
  for c in main extra video; do
    p=$(plan_of "${CALL_STEPS[$c]}")
    [ $first = 1 ] || echo ","
    first=0
    printf ' "%s": {"steps": {%s}, "deadline_s": %s, "timeout_s": %s}' "$c" \
      "$(for x in $p; do printf '"%s": %s, ' "${x%%:*}" "${x##*:}"; done | sed 's/, $//')" \
      "$(sum_of "$p")" "${CALL_TIMEOUT[$c]}"
  done
  printf '\n}\n'
  exit 0
fi
if [ -z "${CALL_STEPS[$CALL]:-}" ]; then
  echo "PARAVT_GPU_CALL=$CALL is not one of main, extra, video" >&2
  exit 2
fi
STEPS=${PARAVT_GPU_STEPS:-${CALL_STEPS[$CALL]}}
STEPS=${STEPS//,/ }  # a rerun may name several: PARAVT_GPU_STEPS=real_size_2b,varlen
PLAN=$(plan_of "$STEPS")
DEADLINE=${PARAVT_GPU_DEADLINE_S:-$(sum_of "$PLAN")}
TIMEOUT=$((DEADLINE + CALL_MARGIN))

# ---- DALI's wheel travels in 55 MiB parts: the device tool carries 64 MiB per call, the tree ~4.5
# MB of it (the issue's 60 MiB parts would not fit beside the tree) --------------------------------
PARTS=${PARAVT_DALI_PARTS:-.gpu_dali}
if [ "${1:-}" = "--split-dali" ]; then  # here: --split-dali WHEEL [DIR]
  whl=$2 dir=${3:-$PARTS} name=$(basename "$2")
  mkdir -p "$dir" && rm -f "$dir/$name".part* "$dir/$name.sha256"
  split -b "${PARAVT_DALI_PART_SIZE:-55M}" -d -a 2 "$whl" "$dir/$name.part"
  (cd "$(dirname "$whl")" && sha256sum "$name") >"$dir/$name.sha256"
  ls -la "$dir"
  exit 0
fi
if [ "${1:-}" = "--stage-dali" ]; then  # device: move this call's carried part(s) out of the tree
  mkdir -p "$DALI_STAGE"
  compgen -G "$PARTS/*" >/dev/null && mv -f "$PARTS"/* "$DALI_STAGE"/
  ls -la "$DALI_STAGE"
  exit 0
fi
join_dali() {  # staged parts (and any still in $PARTS) -> $WORK/dali_wheel/NAME, sha256 checked
  local d=$WORK/dali_wheel sum name
  mkdir -p "$d" "$DALI_STAGE"
  compgen -G "$PARTS/*" >/dev/null && cp -f "$PARTS"/* "$DALI_STAGE"/
  sum=$(ls "$DALI_STAGE"/*.sha256 2>/dev/null | head -1)
  if [ -z "$sum" ]; then
    echo "no DALI wheel parts in $DALI_STAGE or $PARTS: run make gpu-dali-parts here, then one" \
      "--stage-dali call per part on the device" >&2
    return 1
  fi
  name=$(awk '{print $2}' "$sum")
  cat "$DALI_STAGE/$name".part* >"$d/$name"
  if ! (cd "$d" && sha256sum --quiet -c "$(realpath "$sum")") >&2; then
    echo "DALI wheel $name: the joined parts ($(ls "$DALI_STAGE/$name".part* | wc -l)) do not" \
      "match its sha256: a part is missing or damaged; carry the missing ones again" >&2
    return 1
  fi
  echo "$d/$name"
}
if [ "${1:-}" = "--join-dali" ]; then  # the joined wheel's path (exit 1: parts missing/damaged)
  join_dali
  exit
fi

mkdir -p "$OUT" "$WORK/steps" "$WORK/logs"
rm -f "$WORK"/steps/* "$WORK"/logs/* "$WORK/setup_problems.txt" "$OUT/steps.log"
LOG=$OUT/steps.log
T0=$SECONDS
# Step JSONs straight into $OUT while the step runs: 8 files come back, 3 are the log and the
# summaries, so the first 5 steps that write a JSON write it there.
JSON_STEPS=" probe real_size_2b kernel_targets varlen copy_stream hsdp vllm_graphs nvdec real_size_big dali "
declare -A SJ=()
n_json=0
for s in $STEPS; do
  SJ[$s]=$WORK/steps
  if [[ "$JSON_STEPS" == *" $s "* ]] && [ $n_json -lt 5 ]; then
    SJ[$s]=$OUT
    n_json=$((n_json + 1))
  fi
done

GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$GPU_NAME" in
  *H200*) CARD=h200-141gb ;;
  *H100*) CARD=h100-80gb ;;
  *) CARD="" ;;  # another card: the plans read torch's device memory
esac
[ "$DRY" = 1 ] && CARD=${PARAVT_GPU_CARD:-h100-80gb}
COMMIT=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
note() { echo "[setup] $*" | tee -a "$LOG"; }
SETUP_OK=1
problem() {
  SETUP_OK=0
  echo "$*" >>"$WORK/setup_problems.txt"
  note "FAILED: $*"
}
write_summary() {  # [--exit-status]
  local a=(--out "$OUT" --work "$WORK" --call "$CALL" --steps "$STEPS" --plan "$PLAN"
    --deadline "$DEADLINE" --timeout "$TIMEOUT" --elapsed "$((SECONDS - T0))" --commit "$COMMIT"
    --gpu "${GPU_NAME:-}" --card "${CARD:-}")
  [ "$CUDA" = 1 ] && a+=(--cuda)
  [ "$DRY" = 1 ] && a+=(--dry)
  [ "$SETUP_OK" = 1 ] || a+=(--setup-failed)
  "$PY" scripts/gpu_summary.py "${a[@]}" "$@"
}
after_budgets() {  # NAME: the budgets of the steps after NAME (setup: of every step)
  local sum=0 seen=0 s
  [ "$1" = setup ] && seen=1
  for s in $STEPS; do
    [ $seen = 1 ] && sum=$((sum + ${BUDGET[$s]:-0}))
    [ "$s" = "$1" ] && seen=1
  done
  echo $sum
}
limit_for() {  # NAME: max(its budget, what is left - the later steps' budgets), <= what is left
  local b=${BUDGET[$1]:-0} left=$((DEADLINE - (SECONDS - T0))) lim
  lim=$((left - $(after_budgets "$1")))
  [ "$lim" -lt "$b" ] && lim=$b
  [ "$lim" -gt "$left" ] && lim=$left
  echo "$lim"
}

{
  echo "==== [setup] call=$CALL commit=$COMMIT date=$(date -u +%FT%TZ) dry=$DRY"
  echo "steps: $STEPS"
  echo "plan (s): $PLAN; deadline ${DEADLINE} s (timeout_s $TIMEOUT)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version \
    --format=csv 2>&1
  "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda',
    torch.version.cuda, 'gpu', torch.cuda.is_available())" 2>&1
  echo "card=${GPU_NAME:-none} plan_gpu=${CARD:-torch}"
  echo "NVIDIA_DRIVER_CAPABILITIES=${NVIDIA_DRIVER_CAPABILITIES:-unset}"
  echo "CXX in the image: ${CXX:-unset}, CC: ${CC:-unset}"
} >>"$LOG" 2>&1
cat "$LOG"
CUDA=0
grep -q "gpu True$" "$LOG" && CUDA=1
RUN=0  # steps actually run: on CUDA, or the CPU dry run
{ [ "$CUDA" = 1 ] || [ "$DRY" = 1 ]; } && RUN=1

# ---- setup: the carried wheels, paravt's metadata (paravt_kernels), its CUDA extension -----
# Kept between calls on a warm machine (PARAVT_GPU_STATE): the key of the wheels installed, of
# the editable install, and each paravt._C built, by the hash of csrc/, setup.py and torch.
SETUP_LIMIT=$(limit_for setup)
setup_left() { echo $((SETUP_LIMIT - (SECONDS - T0))); }
STATE=${PARAVT_GPU_STATE:-/tmp/paravt_gpu_state}
WH=${PARAVT_GPU_WHEELS:-.gpu_wheels}
if [ "$RUN" = 1 ] && [ "${PARAVT_GPU_SETUP:-1}" != 0 ]; then
  mkdir -p "$STATE/ext"
  if ! compgen -G "$WH/*.whl" >/dev/null; then
    if [ "$DRY" = 1 ]; then
      note "wheels: none in $WH (a dry run installs none)"
    else
      problem "no wheels in $WH: run 'make gpu-wheels' in the session's checkout and carry .gpu_wheels"
    fi
  elif ! "$PY" scripts/gpu_carry.py --check-wheels "$WH" >>"$LOG" 2>&1; then
    problem "the wheels in $WH are not exactly scripts/gpu_wheels.txt's pins (steps.log names" \
      "each): run 'make gpu-wheels' in the session's checkout (it empties the folder first)"
  elif [ "$DRY" = 1 ]; then
    note "wheels: $WH holds exactly the pins (a dry run installs none)"
  else
    key=$(cd "$WH" && ls -l -- *.whl | awk '{print $5, $NF}' | md5sum | cut -c1-16)
    if [ "$(cat "$STATE/wheels" 2>/dev/null)" = "$key" ]; then
      note "wheels: the same set was installed by an earlier call on this machine"
    elif timeout "$(setup_left)" "$PY" -m pip install -q --no-deps --no-index "$WH"/*.whl \
      >>"$LOG" 2>&1; then
      echo "$key" >"$STATE/wheels"
      note "wheels: installed $(cd "$WH" && echo *.whl)"
    else
      problem "pip install of the carried wheels failed or ran out of the setup's time (steps.log)"
    fi
  fi
  if [ "$DRY" != 1 ] && [[ " $STEPS " == *" dali "* ]] && ! "$PY" -c "import nvidia.dali" >/dev/null 2>&1; then
    if whl=$(join_dali 2>>"$LOG") &&
      "$PY" -m pip install -q --no-deps --no-index "$whl" >>"$LOG" 2>&1; then
      note "dali: installed $(basename "$whl") from the staged parts"
    else
      note "dali: not installed (see above; the dali step reports it)"
    fi
  fi
  if [ "$DRY" = 1 ]; then
    # paravt_kernels from this tree's kernels/ (not the venv's editable install of another
    # checkout); paravt comes from this folder (PYTHONPATH), without paravt._C.
    mkdir -p "$WORK/shim"
    ln -sfn "$PWD/kernels" "$WORK/shim/paravt_kernels"
    export PYTHONPATH="$WORK/shim:$PYTHONPATH"
    note "dry: paravt and paravt_kernels from $PWD, no install, no paravt._C"
  else
    # The image exports CXX=/opt/gcc/bin/g++, whose builds of paravt._C segfault in
    # TORCH_CHECK (docs/gpu/README.md, runs 4-7): the system compiler, as gpu_check.sh does.
    [ -x /usr/bin/g++ ] && export CXX=${PARAVT_GPU_CXX:-/usr/bin/g++} CC=/usr/bin/gcc
    key=$( { echo "$PWD"; cat pyproject.toml kernels/pyproject.toml setup.py; } | md5sum | cut -c1-16)
    if [ "$(cat "$STATE/editable" 2>/dev/null)" = "$key" ]; then
      note "paravt, paravt_kernels: installed editable from $PWD by an earlier call"
    elif timeout "$(setup_left)" env PARAVT_SKIP_EXT=1 "$PY" -m pip install -q --no-deps \
      --no-build-isolation -e ./kernels -e . >>"$LOG" 2>&1; then
      echo "$key" >"$STATE/editable"
      note "paravt, paravt_kernels: installed editable from $PWD (metadata only)"
    else
      problem "pip install -e ./kernels -e . failed or ran out of the setup's time (steps.log)"
    fi
    # setup.py build_ext --inplace, not pip: a pip build segfaulted in TORCH_CHECK (run 4).
    key=$( { find csrc -type f | sort | xargs cat; cat setup.py
      "$PY" -c "import torch; print(torch.__version__)"; } 2>&1 | md5sum | cut -c1-16)
    t=$SECONDS
    if compgen -G "$STATE/ext/$key/_C*.so" >/dev/null; then
      cp "$STATE/ext/$key"/_C*.so paravt/
      note "paravt._C: the build of an earlier call on this machine (same csrc/, setup.py, torch)"
    elif [ "${PARAVT_GPU_BUILD:-1}" = 0 ]; then
      note "paravt._C: not built (PARAVT_GPU_BUILD=0): the steps run the pure-torch fallbacks"
    elif timeout "$(setup_left)" env PARAVT_FORCE_EXT=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 \
      "$PY" setup.py -q build_ext --inplace >>"$LOG" 2>&1; then
      mkdir -p "$STATE/ext/$key" && cp paravt/_C*.so "$STATE/ext/$key/"
      note "paravt._C: built in $((SECONDS - t)) s with CXX=${CXX:-unset} CC=${CC:-unset}"
    else
      problem "paravt._C did not build in $((SECONDS - t)) s (steps.log): CUDA pack and the" \
        "native ops fall back to torch"
    fi
  fi
fi
# Every module the steps import at their top, so that a package the image lacks (omegaconf,
# once) fails here, by name, not as each step's import error.
if [ "$RUN" = 1 ] && ! "$PY" -c "import paravt, paravt_kernels, paravt.train, paravt.plan, paravt.video, av" \
  >>"$LOG" 2>&1; then
  problem "paravt.train / paravt.plan / paravt_kernels / av do not import (steps.log):" \
    "carry the missing package's wheel (scripts/gpu_wheels.txt, make gpu-wheels)"
fi
note "done in $((SECONDS - T0)) s of its ${SETUP_LIMIT} s; cuda=$CUDA setup_ok=$SETUP_OK"
write_summary

# ---- steps -------------------------------------------------------------------------------
skip_json() {  # NAME STATUS REASON: the step's record when it does not run
  printf '{"status": "%s", "reason": "%s"}\n' "$2" "$3" >"$WORK/steps/$1.json"
}
step() {  # NAME CMD...: under limit_for NAME; its output streamed into $OUT/steps.log
  local name=$1 t0=$SECONDS rc lim log=$WORK/logs/$1.log
  shift
  lim=$(limit_for "$name")
  if [ "$lim" -lt 5 ] || [ $((2 * lim)) -lt "${BUDGET[$name]}" ]; then
    [ "$lim" -lt 0 ] && lim=0
    skip_json "$name" skipped "not run: $lim s left for it, under half its budget of ${BUDGET[$name]} s (deadline $DEADLINE s)"
    echo "==== [$name] skipped: $lim s left for it, budget ${BUDGET[$name]} s" | tee -a "$LOG"
    write_summary
    return 0
  fi
  touch "$WORK/steps/$name.started"
  echo "==== [$name] limit $lim s (budget ${BUDGET[$name]} s), at $((SECONDS - T0)) s of $DEADLINE: $*" |
    tee "$log" >>"$LOG"
  write_summary
  timeout -k 10 "$lim" "$@" 2>&1 | tee -a "$log" >>"$LOG"
  rc=${PIPESTATUS[0]}
  echo "$rc $((SECONDS - t0)) $lim" >"$WORK/steps/$name.rc"
  echo "==== [$name] rc=$rc in $((SECONDS - t0)) s" | tee -a "$log" >>"$LOG"
  echo "[$name] rc=$rc in $((SECONDS - t0)) s (limit $lim s)"
  tail -n 8 "$log"
  write_summary
  return 0
}

# Step 2's command line: the same keys for the real run and the dry run, only sizes differ.
REAL_COMMON=(--preset tiny_cpu model.init=random model.dtype=bfloat16 train.master_dtype=float32
  model.gradient_checkpointing=true model.packed_vision=true rollout.engine=hf
  data.synth_task=spot agent.max_parallel=5 video.crop_max_frames=16 train.prompts_per_step=1
  train.eval_prompts=0 train.save_every=0 algo.freeze_vision_tower=false algo.kl_coef=0.01
  algo.kl_mode=reward algo.kl_type=k1 sft.freeze_vision_tower=false train.progress=false)
PLAN_GPU=()
[ -n "$CARD" ] && PLAN_GPU=(--gpu "$CARD")
if [ "$DRY" = 1 ]; then
  # PARAVT_GPU_DRY_VOCAB (CI: 4096) cuts the narrowed arch's 151,936-row vocabulary
  "$PY" scripts/gpu_real_size.py --small-arch "$WORK/small_arch.json" \
    --small-arch-vocab "${PARAVT_GPU_DRY_VOCAB:-0}" >/dev/null
  DEV=cpu
  REAL_SIZE=(model.device=cpu data.synth_min_duration=60 data.synth_max_duration=60
    data.synth_num_videos=4 video.frame_budgets=[4] video.overview_min_pixels=1024
    video.overview_max_pixels=1024 video.crop_min_pixels=1024 video.crop_max_pixels=1024
    rollout.group_size=2 rollout.max_new_tokens=64 rollout.sub_max_new_tokens=8 train.steps=1)
  REAL_TOOL=(--gen-batch 2 --gen-prompt 32 --gen-tokens 4 --profile-step 1 "${PLAN_GPU[@]}")
  ARCH_2B=$WORK/small_arch.json
  SFT_2B=1 SFT_BIG=1
else
  DEV=cuda
  # 448 x 448 frames: 196 visual tokens per temporal patch; a K=64 overview is ~6.3k tokens.
  PIX=${PARAVT_GPU_PIXELS:-200704}
  REAL_SIZE=(model.device=cuda data.synth_min_duration=600 data.synth_max_duration=660
    data.synth_num_videos=8 video.frame_budgets=[32,64] video.overview_min_pixels=$PIX
    video.overview_max_pixels=$PIX video.crop_min_pixels=$PIX video.crop_max_pixels=$PIX
    rollout.group_size=8 rollout.max_new_tokens=256 rollout.sub_max_new_tokens=128 train.steps=3)
  REAL_TOOL=(--gen-batch 40 --gen-prompt 1024 --gen-tokens 128
    --profile-step "${PARAVT_GPU_PROFILE_STEP:-3}" "${PLAN_GPU[@]}")
  ARCH_2B=qwen3vl_2b
  SFT_2B=${PARAVT_GPU_SFT_STEPS:-2} SFT_BIG=0
fi
real_size() {  # NAME ARCH SFT_STEPS
  rm -rf "$WORK/$1"
  step "$1" "$PY" scripts/gpu_real_size.py --json "${SJ[$1]}/$1.json" "${REAL_TOOL[@]}" \
    -- "${REAL_COMMON[@]}" "${REAL_SIZE[@]}" "model.config=$2" "sft.steps=$3" \
    "train.out_dir=$WORK/$1" "data.synth_dir=$WORK/data_long" "model.tiny_dir=$WORK/models/tiny"
}
plan_fits() {  # ARCH: 0 fits the card, 1 does not fit, 2 the plan itself failed (its output:
  # $WORK/plan_ARCH.txt). An import error also exits 1: the plan's own "does not fit:" line
  # tells the two apart (a missing package once read as "8B does not fit").
  "$PY" -m paravt.plan "${PLAN_GPU[@]}" "${REAL_COMMON[@]}" "${REAL_SIZE[@]}" "model.config=$1" \
    >"$WORK/plan_$1.txt" 2>&1 && return 0
  grep -q "^does not fit:" "$WORK/plan_$1.txt" && return 1
  return 2
}
# The tests that use the GPU, and only those (-k cuda: a cuda mark, "cuda" in the test's or its
# file's name); the rest of these files runs in CI. tests/test_gpu_scripts.py fails when a test
# file that skips without CUDA is missing here.
GPU_TESTS=(tests/test_kernels_reference_parity.py tests/test_pack_vision.py tests/test_algo_advantages.py
  tests/test_vision_encoder.py tests/test_weight_sync.py tests/test_reference_placement.py
  tests/test_shared_prefix_cuda.py tests/test_vllm_graphs.py tests/test_distributed.py)
XDIST=()
"$PY" -c "import xdist" >/dev/null 2>&1 && [ "$CUDA" = 1 ] && XDIST=(-n 4)
D=()
[ "$DRY" = 1 ] && D=(--dry)

for s in $STEPS; do
  if [ "$RUN" != 1 ]; then
    skip_json "$s" skipped "no CUDA"
    echo "==== [$s] skipped: no CUDA" | tee -a "$LOG"
    write_summary
    continue
  fi
  case $s in
    probe) step probe "$PY" scripts/gpu_probe.py --json "${SJ[$s]}/probe.json" \
      --dir "$WORK/probe" "${D[@]}" ;;
    gpu_tests) step gpu_tests "$PY" -m pytest -q -p no:cacheprovider -rs "${XDIST[@]}" -k cuda \
      "${GPU_TESTS[@]}" ;;
    kernel_targets) step kernel_targets "$PY" bench/gpu_kernels.py --targets "${D[@]}" \
      --out "${SJ[$s]}/kernel_targets.json" ;;
    real_size_2b) real_size real_size_2b "$ARCH_2B" "$SFT_2B" ;;
    real_size_big)
      # 8B if the memory plan says this run fits the card this call got, else 4B, else none.
      big=""
      for arch in qwen3vl_8b qwen3vl_4b; do
        plan_fits "$arch"
        case $? in
          0) big=$arch; break ;;
          2) big=ERROR; break ;;
        esac
      done
      echo "==== [real_size_big] plan for ${CARD:-this device}: ${big:-neither 8B nor 4B fits}" |
        tee -a "$LOG"
      cat "$WORK"/plan_qwen3vl_*.txt >>"$LOG"
      if [ "$big" = ERROR ]; then
        skip_json real_size_big failed "python -m paravt.plan failed: $(tail -n 1 "$WORK/plan_$arch.txt" | tr '"' "'")"
        echo "1 0 0" >"$WORK/steps/real_size_big.rc"
        write_summary
      elif [ -z "$big" ]; then
        skip_json real_size_big skipped "neither Qwen3-VL-8B nor 4B fits ${CARD:-this device} (plan in steps.log)"
        write_summary
      elif [ "$DRY" = 1 ]; then  # the plan's choice is what the dry run checks; the run
        # itself is real_size_2b's code at another size
        skip_json real_size_big ok "dry: the plan for $CARD chose $big"
        echo "0 0 0" >"$WORK/steps/real_size_big.rc"
        write_summary
      else
        real_size real_size_big "$big" "$SFT_BIG"
      fi
      ;;
    varlen)
      if [ "$DRY" = 1 ]; then
        step varlen "$PY" scripts/varlen_attn_check.py --json "${SJ[$s]}/varlen.json" \
          --size tiny --device cpu --reps 3
      else
        step varlen "$PY" scripts/varlen_attn_check.py --json "${SJ[$s]}/varlen.json"
      fi
      ;;
    copy_stream | hsdp | vllm_graphs) step "$s" "$PY" scripts/gpu_realscale.py "$s" \
      --json "${SJ[$s]}/$s.json" "${D[@]}" ;;
    nvdec)
      # 5 s clips (150 frames at 30 fps): the four clips written and decoded twice in ~40 s
      N=(--seconds 5)
      [ "$DRY" = 1 ] && N=(--dry)
      step nvdec "$PY" scripts/nvdec_check.py --json "${SJ[$s]}/nvdec.json" \
        --dir "$WORK/nvdec_videos" "${N[@]}"
      ;;
    dali)
      if [ "$DRY" = 1 ]; then
        step dali "$PY" scripts/dali_check.py --json "${SJ[$s]}/dali.json" \
          --dir "$WORK/dali_videos" --videos 1 --duration 20 --codec vp9 --reps 1 --pixels 4096
      else
        step dali "$PY" scripts/dali_check.py --json "${SJ[$s]}/dali.json" \
          --dir "$WORK/dali_videos" --videos 2 --duration 600
      fi
      ;;
    default_train)
      rm -rf "$WORK/default_train"
      if [ "$DRY" = 1 ]; then
        TINY=(data.synth_num_videos=6 sft.steps=2 train.steps=1 train.eval_prompts=2
          train.eval_samples=1 data.synth_dir="$WORK/data_default_dry")
      else
        TINY=()
      fi
      step default_train "$PY" -m paravt.train "model.device=$DEV" train.progress=false \
        "train.out_dir=$WORK/default_train" "data.synth_dir=$WORK/data_default" \
        "model.tiny_dir=$WORK/models/tiny_default" "${TINY[@]}"
      ;;
    *) skip_json "$s" failed "unknown step $s (one of ${!BUDGET[*]})"
       echo "1 0 0" >"$WORK/steps/$s.rc"
       echo "==== [$s] unknown step" | tee -a "$LOG"
       write_summary ;;
  esac
done

write_summary --exit-status
rc=$?
cat "$OUT/summary.txt"
echo "total $((SECONDS - T0)) s of the ${DEADLINE} s deadline; files in $OUT: $(ls "$OUT" | wc -l) (the device tool returns 8)"
[ "$RUN" = 1 ] && exit $rc
exit 0

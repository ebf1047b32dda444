#!/usr/bin/env bash
# Issue 36 as ONE prepared command for a lent device session (15 device-minutes in all, start-up
# included): the first `python -m paravt.train` on a GPU, a real-size model measured phase by
# phase, torch's varlen attention, DALI/NVDEC. Launch (docs/gpu/README.md, "The training check"),
# in the checkout the device tool sends (the session's own):
#
#   here:   make gpu-train-wheels   # .gpu_wheels/ (transformers, liger, setuptools, PyAV, DALI's
#                                   # small needs, ~56 MB) and .gpu_dali/ (DALI's 199 MB wheel in
#                                   # 4 parts of <= 55 MiB: a part + the ~4.5 MB tree < 64 MiB)
#           make gpu-snapshot REV=<commit>   # .gpu_snap/: git archive + COMMIT (the device
#                                   # copy's .git is stale: the command runs from the snapshot)
#   device: per DALI part, back to back (a machine stays warm 30 s after a call):
#             run("mkdir -p /tmp/paravt_dali && mv .gpu_dali/* /tmp/paravt_dali/",
#                 carry=[".gpu_dali/<part>"])        (the .sha256 rides with the first part)
#           then run(<unpack .gpu_snap, cd there, bash scripts/gpu_train_check.sh>,
#                    carry=[".gpu_snap", ".gpu_wheels"], timeout_s=590)
#
# Steps (PARAVT_GPU_STEPS picks and orders them; default below: the issue's 2 first, its 1
# last, since 1 is the longest and the issue ranks 2 before 1, 3 and 4 when time runs short):
#   real_size_2b   issue step 2: scripts/gpu_real_size.py on a random-initialised Qwen3-VL-2B
#                  (bf16 compute, fp32 masters, checkpointing, packed vision, HF engine, 600 s
#                  videos, K in {32, 64}, 5 crops, G = 8, oracle main turns, 2 SFT + 3 RL steps)
#   varlen         issue step 3: scripts/varlen_attn_check.py (varlen_attn vs per-sequence SDPA)
#   dali           issue step 4: scripts/dali_check.py (NVDEC probe, DALI vs PyAV, speed ratio)
#   real_size_big  issue step 2 again on Qwen3-VL-8B if `python -m paravt.plan --gpu h200-141gb`
#                  says it fits one H200, else 4B (no SFT)
#   default_train  issue step 1: `python -m paravt.train` (the embedded default, seed 0 as the
#                  README's CPU run) on CUDA: wall time, evaluation table beside the CPU one
# Each step runs under `timeout` (its own limit, cut to what PARAVT_GPU_DEADLINE_S leaves of the
# whole run) and is independent: a failed step is recorded and the next one runs.
#
# Output: $OUT (the device tool returns at most 8 files) or ./gpu_out holds exactly
#   summary.json  env, setup, and per step {status, rc, seconds, reason, figures: the step's own
#                 JSON (written by the step into $WORK/steps/NAME.json)}
#   summary.txt   the same, as text; setup.log; NAME.log for each step (5)
# Work files (data, random checkpoints, runs) go to $PARAVT_GPU_WORK (./gpu_out_work, ignored).
#
# Without CUDA every step is reported `skipped: no CUDA` and the script exits 0.
# PARAVT_GPU_DRY=1 runs every step on the CPU at a tiny size through the same command lines
# (the small 2B-shaped architecture, 1 SFT step, 1 RL step, 60 s videos, VP9 for DALI's CPU
# decoder), so argument errors surface before device time is spent; it exits 1 if a step failed.
# With CUDA the script exits 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
WORK=${PARAVT_GPU_WORK:-gpu_out_work}
PY=${PY:-python3}
DRY=${PARAVT_GPU_DRY:-0}
DEADLINE=${PARAVT_GPU_DEADLINE_S:-560}
STEPS=${PARAVT_GPU_STEPS:-real_size_2b varlen dali real_size_big default_train}
DALI_STAGE=${PARAVT_DALI_STAGE:-/tmp/paravt_dali}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false

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

mkdir -p "$OUT" "$WORK/steps"
rm -f "$WORK"/steps/*
T0=$SECONDS
summary_txt() { echo "$*" | tee -a "$OUT/setup.log"; }

{
  echo "date: $(date -u +%FT%TZ)  commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv 2>&1
  "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda',
    torch.version.cuda, 'gpu', torch.cuda.is_available())" 2>&1
  echo "NVIDIA_DRIVER_CAPABILITIES=${NVIDIA_DRIVER_CAPABILITIES:-unset} dry=$DRY steps: $STEPS"
} >"$OUT/setup.log" 2>&1
cat "$OUT/setup.log"
CUDA=0
grep -q "gpu True$" "$OUT/setup.log" && CUDA=1
RUN=0  # steps actually run: on CUDA, or the CPU dry run
{ [ "$CUDA" = 1 ] || [ "$DRY" = 1 ]; } && RUN=1

# ---- setup: carried wheels, DALI, paravt's metadata (paravt_kernels) and its CUDA extension --
if [ "$RUN" = 1 ] && [ "$DRY" != 1 ]; then
  if compgen -G ".gpu_wheels/*.whl" >/dev/null; then
    summary_txt "wheels: $(ls .gpu_wheels | tr '\n' ' ')"
    "$PY" -m pip install -q --no-deps --no-index .gpu_wheels/*.whl >>"$OUT/setup.log" 2>&1 ||
      summary_txt "wheels: install FAILED (see above)"
  fi
  if ! "$PY" -c "import nvidia.dali" >/dev/null 2>&1; then
    if whl=$(join_dali 2>>"$OUT/setup.log") &&
      "$PY" -m pip install -q --no-deps --no-index "$whl" >>"$OUT/setup.log" 2>&1; then
      summary_txt "dali: installed $(basename "$whl") from the staged parts"
    else
      summary_txt "dali: not installed (see setup.log; the dali step reports it)"
    fi
  fi
  # The image exports CXX=/opt/gcc/bin/g++, whose builds of paravt._C segfault in TORCH_CHECK
  # (docs/gpu/README.md): the system compiler, as scripts/gpu_check.sh does.
  [ -x /usr/bin/g++ ] && export CXX=${PARAVT_GPU_CXX:-/usr/bin/g++} CC=/usr/bin/gcc
  timeout 200 bash -c "PARAVT_SKIP_EXT=1 $PY -m pip install -q --no-deps --no-build-isolation -e . \
    && { [ '${PARAVT_GPU_BUILD:-1}' = 0 ] || PARAVT_FORCE_EXT=1 TORCH_CUDA_ARCH_LIST=9.0 \
    MAX_JOBS=16 $PY setup.py -q build_ext --inplace; }" >>"$OUT/setup.log" 2>&1 ||
    summary_txt "paravt install/extension build FAILED (pure-torch fallbacks; see setup.log)"
fi
if [ "$RUN" = 1 ]; then
  "$PY" -c "import paravt, paravt_kernels" >>"$OUT/setup.log" 2>&1 ||
    summary_txt "paravt or paravt_kernels does not import: the steps will fail"
fi
summary_txt "setup done in $((SECONDS - T0)) s; cuda=$CUDA"

# ---- steps -------------------------------------------------------------------------------
skip_json() {  # NAME REASON: the step's JSON when it does not run
  printf '{"status": "skipped", "reason": "%s"}\n' "$2" >"$WORK/steps/$1.json"
}
step() {  # NAME LIMIT_S CMD...: run under the smaller of LIMIT_S and the time left
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  local left=$((DEADLINE - (SECONDS - T0)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    skip_json "$name" "not run: ${left} s left of PARAVT_GPU_DEADLINE_S=$DEADLINE"
    echo "[$name] skipped: no time left" | tee "$OUT/$name.log"
    return 0
  fi
  echo "[$name] limit ${limit} s: $*" >"$OUT/$name.log"
  timeout "$limit" "$@" >>"$OUT/$name.log" 2>&1
  rc=$?
  echo "$rc $((SECONDS - t0))" >"$WORK/steps/$name.rc"
  echo "[$name] rc=$rc in $((SECONDS - t0)) s"
  tail -n 12 "$OUT/$name.log"
  return 0
}

# Step 2's command line: the same keys for the real run and the dry run, only sizes differ.
REAL_COMMON=(--preset tiny_cpu model.init=random model.dtype=bfloat16 train.master_dtype=float32
  model.gradient_checkpointing=true model.packed_vision=true rollout.engine=hf
  data.synth_task=spot agent.max_parallel=5 video.crop_max_frames=16 train.prompts_per_step=1
  train.eval_prompts=0 train.save_every=0 algo.freeze_vision_tower=false algo.kl_coef=0.01
  algo.kl_mode=reward algo.kl_type=k1 sft.freeze_vision_tower=false train.progress=false)
if [ "$DRY" = 1 ]; then
  "$PY" scripts/gpu_real_size.py --small-arch "$WORK/small_arch.json" >/dev/null
  DEV=cpu
  REAL_SIZE=(model.device=cpu data.synth_min_duration=60 data.synth_max_duration=60
    data.synth_num_videos=4 video.frame_budgets=[4] video.overview_min_pixels=1024
    video.overview_max_pixels=1024 video.crop_min_pixels=1024 video.crop_max_pixels=1024
    rollout.group_size=2 rollout.max_new_tokens=64 rollout.sub_max_new_tokens=8 train.steps=1)
  REAL_TOOL=(--gen-batch 2 --gen-prompt 32 --gen-tokens 4 --profile-step 1 --gpu h200-141gb)
  ARCH_2B=$WORK/small_arch.json ARCH_8B=$WORK/small_arch.json ARCH_4B=$WORK/small_arch.json
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
    --profile-step "${PARAVT_GPU_PROFILE_STEP:-3}")
  ARCH_2B=qwen3vl_2b ARCH_8B=qwen3vl_8b ARCH_4B=qwen3vl_4b
  SFT_2B=${PARAVT_GPU_SFT_STEPS:-2} SFT_BIG=0
fi
real_size() {  # NAME ARCH SFT_STEPS LIMIT
  rm -rf "$WORK/$1"
  step "$1" "$4" "$PY" scripts/gpu_real_size.py --json "$WORK/steps/$1.json" "${REAL_TOOL[@]}" \
    -- "${REAL_COMMON[@]}" "${REAL_SIZE[@]}" "model.config=$2" "sft.steps=$3" \
    "train.out_dir=$WORK/$1" "data.synth_dir=$WORK/data_long" "model.tiny_dir=$WORK/models/tiny"
}

for s in $STEPS; do
  if [ "$RUN" != 1 ]; then
    skip_json "$s" "no CUDA"
    echo "skipped: no CUDA" >"$OUT/$s.log"
    echo "[$s] skipped: no CUDA"
    continue
  fi
  case $s in
    real_size_2b) real_size real_size_2b "$ARCH_2B" "$SFT_2B" 240 ;;
    real_size_big)
      # 8B if the memory plan says this run fits one H200 (141 GB class), else 4B.
      big=$ARCH_8B
      if [ "$DRY" != 1 ] && ! "$PY" -m paravt.plan --gpu h200-141gb "${REAL_COMMON[@]}" \
        "${REAL_SIZE[@]}" model.config=qwen3vl_8b >"$WORK/plan_8b.txt" 2>&1; then
        big=$ARCH_4B
      fi
      echo "[real_size_big] model.config=$big (plan: $WORK/plan_8b.txt)"
      real_size real_size_big "$big" "$SFT_BIG" 330
      ;;
    varlen)
      if [ "$DRY" = 1 ]; then
        step varlen 60 "$PY" scripts/varlen_attn_check.py --json "$WORK/steps/varlen.json" \
          --size tiny --device cpu --reps 3
      else
        step varlen 90 "$PY" scripts/varlen_attn_check.py --json "$WORK/steps/varlen.json"
      fi
      ;;
    dali)
      if [ "$DRY" = 1 ]; then
        step dali 60 "$PY" scripts/dali_check.py --json "$WORK/steps/dali.json" \
          --dir "$WORK/dali_videos" --videos 1 --duration 20 --codec vp9 --reps 1 --pixels 4096
      else
        step dali 120 "$PY" scripts/dali_check.py --json "$WORK/steps/dali.json" \
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
      step default_train 400 "$PY" -m paravt.train "model.device=$DEV" train.progress=false \
        "train.out_dir=$WORK/default_train" "data.synth_dir=$WORK/data_default" \
        "model.tiny_dir=$WORK/models/tiny_default" "${TINY[@]}"
      ;;
    *) printf '{"status": "failed", "reason": "unknown step %s (one of real_size_2b varlen dali real_size_big default_train)"}\n' \
         "$s" >"$WORK/steps/$s.json"
       echo "[$s] unknown step" | tee "$OUT/$s.log" ;;
  esac
done

# ---- summary.json / summary.txt ------------------------------------------------------------
"$PY" - "$OUT" "$WORK" "$STEPS" "$CUDA" "$DRY" <<'PYEOF'
import json, sys
from pathlib import Path

out, work, steps, cuda, dry = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(), sys.argv[4] == "1", sys.argv[5] == "1"
# The README's CPU run of the embedded default (make train, seed 0): accuracy and 95% half-width.
CPU_README = {
    "eval_before": {"K4_tools": (0.781, 0.109), "K4_notools": (0.500, 0.176), "K32_notools": (1.0, 0.0)},
    "eval_after": {"K4_tools": (0.828, 0.107), "K4_notools": (0.500, 0.176), "K32_notools": (1.0, 0.0)},
}


def default_train_figures(d: Path) -> dict:
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    r: dict = {"train_steps": sum(x["kind"] == "train" for x in rows)}
    for kind in ("eval_before", "eval_after"):
        ev = next((x for x in rows if x["kind"] == kind), None)
        if ev is None:
            continue
        r[kind] = {k: v for k, v in ev.items() if k not in ("step", "kind")}
        cmp = {}
        for name, (c, c_ci) in CPU_README[kind].items():
            g, g_ci = ev.get(f"{name}/accuracy"), ev.get(f"{name}/accuracy_ci95")
            if g is not None:
                cmp[name] = {"run": g, "run_ci95": g_ci, "cpu_readme": c, "cpu_ci95": c_ci,
                             "intervals_overlap": abs(g - c) <= (g_ci or 0) + c_ci}
        r[f"{kind}_vs_cpu"] = cmp
    return r


summary = {"cuda": cuda, "dry": dry, "setup_log": "setup.log", "steps": {}}
lines = []
failed = []
for s in steps:
    js, rcf = work / "steps" / f"{s}.json", work / "steps" / f"{s}.rc"
    rc, secs = (int(x) for x in rcf.read_text().split()) if rcf.is_file() else (None, None)
    try:
        fig = json.loads(js.read_text()) if js.is_file() else {}
    except ValueError as e:
        fig = {"status": "failed", "error": f"unreadable step JSON: {e}"}
    if s == "default_train" and rc == 0:
        try:
            fig = {"status": "ok", **default_train_figures(work / "default_train")}
        except (OSError, ValueError, KeyError) as e:
            fig = {"status": "failed", "error": f"metrics.jsonl: {type(e).__name__}: {e}"}
    status = fig.get("status") or ("ok" if rc == 0 else "failed")
    if rc == 124:
        status = "timeout"
    elif rc not in (0, None) and status == "ok":
        status = "failed"
    elif rc not in (0, None) and status == "running":
        status = "failed"
    summary["steps"][s] = {"status": status, "rc": rc, "seconds": secs, "log": f"{s}.log",
                           "reason": fig.get("reason") or fig.get("error"), "figures": fig}
    if status in ("failed", "timeout"):
        failed.append(s)
    why = summary["steps"][s]["reason"]
    lines.append(f"{s}: {status}" + (f" (rc {rc}, {secs} s)" if rc is not None else "") + (f": {why}" if why else ""))
    f = fig.get("figures")
    if isinstance(f, dict):
        lines += [f"    {k}: {v:.4g}" for k, v in sorted(f.items()) if isinstance(v, (int, float))]
summary["failed"] = failed
(out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
echo "total $((SECONDS - T0)) s"
if [ "$RUN" = 1 ] && "$PY" -c "import json,sys; sys.exit(1 if json.load(open('$OUT/summary.json'))['failed'] else 0)"; then
  exit 0
fi
[ "$RUN" = 1 ] && exit 1
exit 0

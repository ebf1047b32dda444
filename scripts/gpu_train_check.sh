#!/usr/bin/env bash
# paravt's prepared device calls (issues 36 and 49) as ONE script: a lent session has 15
# device-minutes in all, start-up included. The exact `run` commands, carries, timeouts and what
# comes back: docs/gpu/README.md, "Prepared calls". In short, here first:
#
#   make gpu-wheels gpu-snapshot     # .gpu_wheels/ (transformers, liger, setuptools, cce,
#                                    # omegaconf, PyAV; ~48 MiB) + .gpu_snap/ (code-only tar.gz)
#   python scripts/gpu_carry.py      # what each call carries, against the 64 MiB limit
#
# PARAVT_GPU_CALL picks the steps (PARAVT_GPU_STEPS overrides, e.g. to rerun one):
#   main   (~7 min of command, timeout_s 480): in order of value
#     kernel_tests    the fused kernels' tests, compiled Triton on the GPU (tests/test_kernels_*)
#     kernel_targets  bench/gpu_kernels.py --targets: policy_loss >= 70% of HBM bandwidth in
#                     <= 2 kernels, linear_logprob <= 3x Liger FLCE's peak memory,
#                     linear_policy_loss >= 680 TFLOP/s; every baseline in the same run
#     real_size_2b    scripts/gpu_real_size.py on a random-initialised Qwen3-VL-2B (bf16,
#                     fp32 masters, checkpointing, packed vision, HF engine, 600 s videos, K in
#                     {32, 64}, 5 crops, G = 8, oracle main turns forcing crops and sub-agents)
#     varlen          scripts/varlen_attn_check.py (varlen_attn vs the per-sequence SDPA paths)
#   video  (~7 min of command, timeout_s 480; name kind nvidia-h200 for 4B/8B):
#     nvdec           scripts/nvdec_check.py: NVDEC through PyAV vs its CPU decode, 720p and
#                     1080p H.264/HEVC (PyAV's wheel has the cuvid decoders: no DALI wheel)
#     real_size_big   gpu_real_size.py on Qwen3-VL-8B if `python -m paravt.plan` says it fits
#                     the card this call got, else 4B if that fits, else skipped (the plan's
#                     numbers in the step's JSON); a plan that fails to run fails the step
#     default_train   `python -m paravt.train` (the embedded default) on CUDA, if time is left
#   Also: dali (scripts/dali_check.py, needs DALI's wheel in parts: --split-dali below).
# Each step runs under `timeout` (its own limit, cut to what PARAVT_GPU_DEADLINE_S leaves of
# the whole run) and is independent: a failed step is recorded and the next one runs.
#
# The card: nvidia-smi's name picks the plan's --gpu (h100-80gb | h200-141gb; torch's device
# memory for another card), written to setup.log and summary.json; every plan of the run
# (gpu_real_size's, real_size_big's choice) is for that card.
#
# Output: $OUT (the device tool returns at most 8 files) or ./gpu_out:
#   setup.log     the image, the card, wheels, build, the import check of paravt.train/.plan
#   steps.log     every step's log, appended as each step ends
#   summary.json  setup + per step {status, rc, seconds, reason, figures}, REWRITTEN after
#   summary.txt   every step (a command cut at its limit still brings back what ended)
#   NAME.json     each step's own JSON, written by the step while it runs (<= 4 steps; with
#                 more they stay in $PARAVT_GPU_WORK and only summary.json carries them)
# Work files (data, random checkpoints, runs) go to $PARAVT_GPU_WORK (./gpu_out_work, ignored).
#
# Without CUDA every step is reported `skipped: no CUDA` and the script exits 0.
# PARAVT_GPU_DRY=1 runs every step on the CPU at a tiny size through the same command lines
# (tests/test_gpu_scripts.py does, in CI); it exits 1 if a step failed, as with CUDA.
# PARAVT_GPU_SETUP=0 skips the wheel install and the build (a rerun on the warm machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
WORK=${PARAVT_GPU_WORK:-gpu_out_work}
PY=${PY:-python3}
DRY=${PARAVT_GPU_DRY:-0}
DEADLINE=${PARAVT_GPU_DEADLINE_S:-450}
CALL=${PARAVT_GPU_CALL:-main}
case $CALL in
  main) DEFAULT_STEPS="kernel_tests kernel_targets real_size_2b varlen" ;;
  video) DEFAULT_STEPS="nvdec real_size_big default_train" ;;
  *) echo "PARAVT_GPU_CALL=$CALL is not one of main, video" >&2; exit 2 ;;
esac
STEPS=${PARAVT_GPU_STEPS:-$DEFAULT_STEPS}
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

mkdir -p "$OUT" "$WORK/steps" "$WORK/logs"
rm -f "$WORK"/steps/* "$WORK"/logs/*
# Step JSONs straight into $OUT while the step runs (at most 8 files come back: 4 + 4 steps).
SJ=$OUT
[ "$(wc -w <<<"$STEPS")" -gt 4 ] && SJ=$WORK/steps
T0=$SECONDS
summary_txt() { echo "$*" | tee -a "$OUT/setup.log"; }

GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$GPU_NAME" in
  *H200*) CARD=h200-141gb ;;
  *H100*) CARD=h100-80gb ;;
  *) CARD="" ;;  # another card: the plans read torch's device memory
esac
[ "$DRY" = 1 ] && CARD=${PARAVT_GPU_CARD:-h100-80gb}
{
  echo "date: $(date -u +%FT%TZ)  commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv 2>&1
  "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda',
    torch.version.cuda, 'gpu', torch.cuda.is_available())" 2>&1
  echo "call=$CALL card=${GPU_NAME:-none} plan_gpu=${CARD:-torch} dry=$DRY steps: $STEPS"
  echo "NVIDIA_DRIVER_CAPABILITIES=${NVIDIA_DRIVER_CAPABILITIES:-unset}"
} >"$OUT/setup.log" 2>&1
cat "$OUT/setup.log"
CUDA=0
grep -q "gpu True$" "$OUT/setup.log" && CUDA=1
RUN=0  # steps actually run: on CUDA, or the CPU dry run
{ [ "$CUDA" = 1 ] || [ "$DRY" = 1 ]; } && RUN=1
SETUP_OK=1

# ---- setup: carried wheels, DALI, paravt's metadata (paravt_kernels) and its CUDA extension --
if [ "$RUN" = 1 ] && [ "$DRY" != 1 ] && [ "${PARAVT_GPU_SETUP:-1}" != 0 ]; then
  if compgen -G ".gpu_wheels/*.whl" >/dev/null; then
    WHL=(.gpu_wheels/*.whl)
    compgen -G ".gpu_dali_deps/*.whl" >/dev/null && WHL+=(.gpu_dali_deps/*.whl)
    summary_txt "wheels: $(printf '%s ' "${WHL[@]##*/}")"
    "$PY" -m pip install -q --no-deps --no-index "${WHL[@]}" >>"$OUT/setup.log" 2>&1 ||
      summary_txt "wheels: install FAILED (see above)"
  else
    summary_txt "wheels: none carried (.gpu_wheels/ is empty: make gpu-wheels here first)"
  fi
  if [[ " $STEPS " == *" dali "* ]] && ! "$PY" -c "import nvidia.dali" >/dev/null 2>&1; then
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
  timeout 200 bash -c "PARAVT_SKIP_EXT=1 $PY -m pip install -q --no-deps --no-build-isolation -e ./kernels -e . \
    && { [ '${PARAVT_GPU_BUILD:-1}' = 0 ] || PARAVT_FORCE_EXT=1 TORCH_CUDA_ARCH_LIST=9.0 \
    MAX_JOBS=16 $PY setup.py -q build_ext --inplace; }" >>"$OUT/setup.log" 2>&1 ||
    summary_txt "paravt install/extension build FAILED (pure-torch fallbacks; see setup.log)"
fi
# Every module the steps import at their top, so that a package the image lacks (omegaconf,
# once) fails here, by name, not as each step's import error.
if [ "$RUN" = 1 ]; then
  if ! "$PY" -c "import paravt, paravt_kernels, paravt.train, paravt.plan, paravt.video, av" \
    >>"$OUT/setup.log" 2>&1; then
    SETUP_OK=0
    summary_txt "setup: FAILED: paravt.train / paravt.plan / paravt_kernels / av do not import" \
      "(see above): carry the missing package's wheel (make gpu-wheels)"
  fi
fi
summary_txt "setup done in $((SECONDS - T0)) s; cuda=$CUDA setup_ok=$SETUP_OK"

# ---- summary.json / summary.txt, rewritten after every step --------------------------------
write_summary() {
  "$PY" - "$OUT" "$WORK" "$SJ" "$STEPS" "$CUDA" "$DRY" "$SETUP_OK" "$CALL" "${GPU_NAME:-}" \
    "${CARD:-}" <<'PYEOF'
import json, re, sys
from pathlib import Path

out, work, sj = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
steps, cuda, dry = sys.argv[4].split(), sys.argv[5] == "1", sys.argv[6] == "1"
setup_ok, call, gpu, card = sys.argv[7] == "1", sys.argv[8], sys.argv[9], sys.argv[10]
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


def pytest_figures(log: Path) -> dict:
    """The counts of pytest's closing line (or of --collect-only's)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    tail = text.strip().splitlines()[-1:] or [""]
    r = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tail[0])}
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", text)
    if m:
        r["collected"] = int(m.group(1))
    return {"status": "ok" if r and not r.get("failed") and not r.get("error") else "failed",
            "figures": r}


summary = {"call": call, "gpu": gpu or None, "plan_gpu": card or "torch device memory",
           "cuda": cuda, "dry": dry, "setup_ok": setup_ok, "setup_log": "setup.log", "steps": {}}
lines = [f"call {call} on {gpu or 'no GPU'} (plan for {card or 'torch device memory'}); setup "
         + ("ok" if setup_ok else "FAILED (setup.log)")]
failed = [] if setup_ok else ["setup"]
for s in steps:
    js, rcf, log = sj / f"{s}.json", work / "steps" / f"{s}.rc", work / "logs" / f"{s}.log"
    rc, secs = (int(x) for x in rcf.read_text().split()) if rcf.is_file() else (None, None)
    if rc is None and not js.is_file() and not (work / "steps" / f"{s}.json").is_file():
        continue  # not reached yet
    if not js.is_file():
        js = work / "steps" / f"{s}.json"
    try:
        fig = json.loads(js.read_text()) if js.is_file() else {}
    except ValueError as e:
        fig = {"status": "failed", "error": f"unreadable step JSON: {e}"}
    if s == "kernel_tests" and rc is not None:
        fig = pytest_figures(log)
    if s == "default_train" and rc == 0:
        try:
            fig = {"status": "ok", **default_train_figures(work / "default_train")}
        except (OSError, ValueError, KeyError) as e:
            fig = {"status": "failed", "error": f"metrics.jsonl: {type(e).__name__}: {e}"}
    status = fig.get("status") or ("ok" if rc == 0 else "failed")
    if rc == 124:
        status = "timeout"
    elif rc not in (0, None) and status in ("ok", "running"):
        status = "failed"
    reason = fig.get("reason") or fig.get("error")
    if not reason and fig.get("errors"):
        reason = "; ".join(fig["errors"])
    summary["steps"][s] = {"status": status, "rc": rc, "seconds": secs, "log": "steps.log",
                           "reason": reason, "figures": fig}
    if status in ("failed", "timeout"):
        failed.append(s)
    lines.append(f"{s}: {status}" + (f" (rc {rc}, {secs} s)" if rc is not None else "")
                 + (f": {reason}" if reason else ""))
    f = fig.get("figures")
    if isinstance(f, dict):
        lines += [f"    {k}: {v:.4g}" for k, v in sorted(f.items()) if isinstance(v, (int, float))]
    for k, t in (fig.get("targets") or {}).items():
        lines.append(f"    target {k}: met={t.get('met')} " + ", ".join(
            f"{n}={v:.4g}" for n, v in t.items() if isinstance(v, (int, float))
            and not isinstance(v, bool)))
    if isinstance(fig.get("tool_work"), dict):
        lines.append(f"    tool work: {fig['tool_work']}")
summary["failed"] = failed
(out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
(out / "summary.txt").write_text("\n".join(lines) + "\n")
PYEOF
}

# ---- steps -------------------------------------------------------------------------------
skip_json() {  # NAME STATUS REASON: the step's JSON when it does not run
  printf '{"status": "%s", "reason": "%s"}\n' "$2" "$3" >"$SJ/$1.json"
}
step() {  # NAME LIMIT_S CMD...: run under the smaller of LIMIT_S and the time left
  local name=$1 limit=$2 t0=$SECONDS rc log=$WORK/logs/$1.log
  shift 2
  local left=$((DEADLINE - (SECONDS - T0)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    skip_json "$name" skipped "not run: ${left} s left of PARAVT_GPU_DEADLINE_S=$DEADLINE"
    echo "[$name] skipped: no time left" | tee -a "$OUT/steps.log"
    return 0
  fi
  echo "[$name] limit ${limit} s: $*" >"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "$rc $((SECONDS - t0))" >"$WORK/steps/$name.rc"
  echo "[$name] rc=$rc in $((SECONDS - t0)) s" >>"$log"
  cat "$log" >>"$OUT/steps.log"
  echo "[$name] rc=$rc in $((SECONDS - t0)) s"
  tail -n 12 "$log"
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
real_size() {  # NAME ARCH SFT_STEPS LIMIT
  rm -rf "$WORK/$1"
  step "$1" "$4" "$PY" scripts/gpu_real_size.py --json "$SJ/$1.json" "${REAL_TOOL[@]}" \
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
# The fused kernels' tests: compiled Triton on the GPU. Their CPU-tensor cases run Triton's
# interpreter, which under Triton < 3.7 with numpy >= 2.5 (the image seen so far) fails on
# int() of a 1-element array: there they are deselected (CI runs them), the GPU cases run.
KTESTS=(tests/test_kernels_reference_parity.py tests/test_kernels_linear_policy_loss.py
  tests/test_kernels_linear_logprob.py tests/test_kernels_policy_loss.py
  tests/test_kernels_group_advantage.py)
KSEL=()
if [ "$CUDA" = 1 ] && "$PY" -c 'import sys, numpy, triton
v = lambda s: tuple(int(x) for x in s.split(".")[:2])
sys.exit(0 if v(triton.__version__) < (3, 7) and v(numpy.__version__) >= (2, 5) else 1)' 2>/dev/null; then
  KSEL=(-k "cuda or not triton")
fi
XDIST=()
"$PY" -c "import xdist" >/dev/null 2>&1 && [ "$CUDA" = 1 ] && XDIST=(-n 8)

for s in $STEPS; do
  if [ "$RUN" != 1 ]; then
    skip_json "$s" skipped "no CUDA"
    echo "[$s] skipped: no CUDA" | tee -a "$OUT/steps.log"
    write_summary
    continue
  fi
  case $s in
    kernel_tests)
      if [ "$DRY" = 1 ]; then  # the same files and selection, collected only
        step kernel_tests 60 "$PY" -m pytest -q -p no:cacheprovider --co "${KTESTS[@]}"
      else
        step kernel_tests 120 "$PY" -m pytest -q -p no:cacheprovider -rs "${XDIST[@]}" \
          "${KSEL[@]}" "${KTESTS[@]}"
      fi
      ;;
    kernel_targets)
      D=(--targets)
      [ "$DRY" = 1 ] && D=(--all --dry)  # the dry run: every section of the script, once
      step kernel_targets 150 "$PY" bench/gpu_kernels.py "${D[@]}" --out "$SJ/kernel_targets.json"
      ;;
    real_size_2b) real_size real_size_2b "$ARCH_2B" "$SFT_2B" 240 ;;
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
      echo "[real_size_big] plan for ${CARD:-this device}: ${big:-neither 8B nor 4B fits}" |
        tee -a "$OUT/steps.log"
      cat "$WORK"/plan_qwen3vl_*.txt >>"$OUT/steps.log"
      if [ "$big" = ERROR ]; then
        skip_json real_size_big failed "python -m paravt.plan failed: $(tail -n 1 "$WORK/plan_$arch.txt" | tr '"' "'")"
        echo "1 0" >"$WORK/steps/real_size_big.rc"
        write_summary
      elif [ -z "$big" ]; then
        skip_json real_size_big skipped "neither Qwen3-VL-8B nor 4B fits ${CARD:-this device} (plan in steps.log)"
        write_summary
      elif [ "$DRY" = 1 ]; then  # the plan's choice is what the dry run checks; the run
        # itself is real_size_2b's code at another size
        skip_json real_size_big ok "dry: the plan for $CARD chose $big"
        echo "0 0" >"$WORK/steps/real_size_big.rc"
        write_summary
      else
        real_size real_size_big "$big" "$SFT_BIG" 330
      fi
      ;;
    varlen)
      if [ "$DRY" = 1 ]; then
        step varlen 60 "$PY" scripts/varlen_attn_check.py --json "$SJ/varlen.json" \
          --size tiny --device cpu --reps 3
      else
        step varlen 90 "$PY" scripts/varlen_attn_check.py --json "$SJ/varlen.json"
      fi
      ;;
    nvdec)
      D=()
      [ "$DRY" = 1 ] && D=(--dry)
      step nvdec 150 "$PY" scripts/nvdec_check.py --json "$SJ/nvdec.json" \
        --dir "$WORK/nvdec_videos" "${D[@]}"
      ;;
    dali)
      if [ "$DRY" = 1 ]; then
        step dali 60 "$PY" scripts/dali_check.py --json "$SJ/dali.json" \
          --dir "$WORK/dali_videos" --videos 1 --duration 20 --codec vp9 --reps 1 --pixels 4096
      else
        step dali 120 "$PY" scripts/dali_check.py --json "$SJ/dali.json" \
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
    *) skip_json "$s" failed "unknown step $s (one of kernel_tests kernel_targets real_size_2b varlen nvdec dali real_size_big default_train)"
       echo "1 0" >"$WORK/steps/$s.rc"
       echo "[$s] unknown step" | tee -a "$OUT/steps.log"
       write_summary ;;
  esac
done

write_summary
cat "$OUT/summary.txt"
echo "total $((SECONDS - T0)) s; files in $OUT: $(ls "$OUT" | wc -l) (the device tool returns 8)"
if [ "$RUN" = 1 ] && "$PY" -c "import json,sys; sys.exit(1 if json.load(open('$OUT/summary.json'))['failed'] else 0)"; then
  exit 0
fi
[ "$RUN" = 1 ] && exit 1
exit 0

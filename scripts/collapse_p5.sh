#!/usr/bin/env bash
# Collapse protocol 5 (docs/collapse/protocol5/PREREGISTRATION.md): the two cold-start regimes
# (L and M) x the arms vanilla, gating and PARA-GRPO on each seed, then the paired reading.
#
#   scripts/collapse_p5.sh                      # the fresh seeds 800 801 802, as pre-registered
#   SEEDS="0 1 2" OUT=runs/p5tune scripts/collapse_p5.sh --cold-only   # the tuning check
#
# Each seed is its own pair of collapse folders, OUT/L_sN and OUT/M_sN; M's task instance and
# stage 1 are L's, copied (their stamps, settings and code, are checked on reuse). JOBS seeds
# (default 3) run side by side, every job single-threaded (OMP_NUM_THREADS=1: no thread pool
# spins on a core another job holds; the numbers do not depend on it). A rerun keeps what
# finished (the collapse driver's stamps).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/collapse_p5}
SEEDS=${SEEDS:-"800 801 802"}
U_L=${U_L:-0.75}
U_M=${U_M:-0.62}
PY=${PYTHON:-python}
export OUT U_L U_M PY
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
export P5_ARGS="--arms vanilla,gating,paragrpo --eval-k 32 --eval-every 0 sft.steps=2000 train.eval_prompts=96 $*"

one_seed() {
    local s=$1 L=$OUT/L_s$1 M=$OUT/M_s$1
    # shellcheck disable=SC2086
    $PY -m paravt.experiments collapse --seeds 1 --first-seed "$s" --out "$L" \
        --unclosed-think "$U_L" $P5_ARGS > "$L.log" 2>&1
    mkdir -p "$M/cold/seed$s" "$M/data"
    [ -e "$M/data/seed$s" ] || cp -a "$L/data/seed$s" "$M/data/"
    [ -e "$M/cold/seed$s/base_sft" ] || cp -a "$L/cold/seed$s/base_sft" \
        "$L/cold/seed$s/base_sft_params.json" "$M/cold/seed$s/"
    # shellcheck disable=SC2086
    $PY -m paravt.experiments collapse --seeds 1 --first-seed "$s" --out "$M" \
        --unclosed-think "$U_M" $P5_ARGS > "$M.log" 2>&1
    echo "seed $s done $(date -u +%H:%M:%S)"
}
export -f one_seed
mkdir -p "$OUT"
printf '%s\n' $SEEDS | xargs -P "${JOBS:-3}" -I{} bash -c 'one_seed {}'
dirs() { local r=$1; printf '%s' "$r="; for s in $SEEDS; do printf '%s,' "$OUT/${r}_s$s"; done; }
cold=""
case " $* " in *" --cold-only "*) cold="--cold-only" ;; esac
# shellcheck disable=SC2046
$PY -m paravt.experiments paired "$(dirs L)" "$(dirs M)" $cold \
    --json "$OUT/paired.json" --md "$OUT/paired.md"

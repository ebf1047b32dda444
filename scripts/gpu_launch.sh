#!/usr/bin/env bash
# The one command of every prepared device call (docs/gpu/README.md, "Prepared calls"), e.g.
#
#   run(command="PARAVT_GPU_CALL=main bash .gpu_snap/launch.sh",
#       carry=[".gpu_snap", ".gpu_wheels"], timeout_s=480)
#
# `make gpu-snapshot` writes this file as .gpu_snap/launch.sh beside the code it belongs to
# (.gpu_snap/tree.tar.gz, .gpu_snap/COMMIT). On the device, from the root of the tree the call
# sent (whose .git is stale: the tree may hold others' uncommitted edits), it
#  1. checks that the snapshot was carried;
#  2. unpacks it into an EMPTY folder, $PARAVT_GPU_DIR (default /tmp/pv), on a fresh machine and
#     a warm one alike (nothing of an earlier call's code is left there);
#  3. runs scripts/gpu_train_check.sh from that folder, with $OUT made absolute, the carried
#     wheels named (PARAVT_GPU_WHEELS) and the work files in $PARAVT_GPU_WORK (default
#     /tmp/pv_work: outside the code folder, so a warm machine's synthetic videos and random
#     checkpoints serve the next call).
# The setup (wheels, paravt's editable install, paravt._C) is gpu_train_check.sh's: in full on a
# fresh machine, skipped where an earlier call on the same machine did the same.
set -uo pipefail
ROOT=$PWD
S=${PARAVT_GPU_DIR:-/tmp/pv}
OUT=$(realpath -m "${OUT:-gpu_out}")
mkdir -p "$OUT"
fail() {
  echo "launch: $*" | tee -a "$OUT/steps.log" >&2
  exit 2
}
[ -f .gpu_snap/tree.tar.gz ] ||
  fail "no .gpu_snap/tree.tar.gz under $ROOT: run 'make gpu-snapshot' in the session's checkout and carry .gpu_snap"
case $(realpath -m "$S") in
  / | "$ROOT" | "$HOME") fail "PARAVT_GPU_DIR=$S: not a folder to empty" ;;
esac
rm -rf "$S" && mkdir -p "$S" || fail "cannot empty $S"
tar -xzf .gpu_snap/tree.tar.gz -C "$S" || fail "cannot unpack .gpu_snap/tree.tar.gz into $S"
cp .gpu_snap/COMMIT "$S/COMMIT" 2>/dev/null
cd "$S" || fail "cannot enter $S"
export OUT PARAVT_GPU_WHEELS=${PARAVT_GPU_WHEELS:-$ROOT/.gpu_wheels}
export PARAVT_GPU_WORK=${PARAVT_GPU_WORK:-/tmp/pv_work}
exec bash scripts/gpu_train_check.sh

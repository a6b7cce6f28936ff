#!/usr/bin/env bash
# The job scripts of scripts/slurm/ (docs/cluster.md) run as a batch script
# runs them, with tests/fake_srun as srun (one machine; not SLURM itself):
# zero2 over 4 tasks has the threads backend's bits and, submitted again,
# goes on from its checkpoint with the bits of one longer run; sgp over 8
# and diloco over 4 tasks finish and write their metrics.
set -u
bin=$1
root=$2
source "$(dirname "$0")/check_lib.sh"

mkdir -p "$tmp/bin"
ln -s "$root/tests/fake_srun" "$tmp/bin/srun"
hash_of() { grep '^{' "$1" | tail -n 1 | python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])'; }
# job SCRIPT NTASKS JOB_ID [VAR=VALUE ...]: the script as sbatch would run it.
job() {
  local script=$1 n=$2 id=$3
  shift 3
  env PATH="$tmp/bin:$PATH" TMPDIR="$tmp" SLURM_JOB_ID="$id" SLURM_NTASKS="$n" SLURM_JOB_NUM_NODES=1 \
    SLURM_SUBMIT_DIR="$tmp" DISTOPT="$bin" "$@" bash "$root/scripts/slurm/$script" >"$tmp/$id.out" 2>"$tmp/$id.err"
}
same=(--data fashion-mnist --epochs 3 --optimizer adamw --lr 1e-3 --json)

job train_zero.sbatch 4 101 EXTRA="--max-steps 8 --json" || fail "zero2: exit $?: $(tail -3 "$tmp/101.err")"
want=$("$bin" train "${same[@]}" --strategy zero2 --world 4 --max-steps 8 2>/dev/null | tail -n 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
[ "$(hash_of "$tmp/101.out")" = "$want" ] || fail "zero2: not the threads backend's bits"
grep -q '"kind": "step"' "$tmp/runs/zero2-101/metrics.jsonl" || fail "zero2: no metrics"
ls "$tmp/runs/zero2-101/checkpoints" | grep -q '^step-0*8$' || fail "zero2: no checkpoint at step 8"
# Submitted again with the same OUT: --resume, on to step 16.
job train_zero.sbatch 4 102 OUT="$tmp/runs/zero2-101" EXTRA="--max-steps 16 --json" ||
  fail "zero2 again: exit $?: $(tail -3 "$tmp/102.err")"
want=$("$bin" train "${same[@]}" --strategy zero2 --world 4 --max-steps 16 2>/dev/null | tail -n 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
[ "$(hash_of "$tmp/102.out")" = "$want" ] || fail "zero2 resumed: not the bits of one 16-step run"
grep -q "resuming with --max-steps 16 (the checkpoint's run had 8)" "$tmp/102.err" || fail "zero2: not resumed"

job train_sgp.sbatch 8 103 EXTRA="--max-steps 6" || fail "sgp: exit $?: $(tail -3 "$tmp/103.err")"
grep -q '"consensus_distance"' "$tmp/runs/sgp-103/metrics.jsonl" || fail "sgp: no consensus distance in its metrics"
job train_diloco.sbatch 4 104 SYNC_EVERY=3 EXTRA="--max-steps 6" || fail "diloco: exit $?: $(tail -3 "$tmp/104.err")"
grep -q '"kind": "step"' "$tmp/runs/diloco-104/metrics.jsonl" || fail "diloco: no metrics"
finish cli.slurm_scripts

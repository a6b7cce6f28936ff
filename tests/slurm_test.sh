#!/usr/bin/env bash
# distopt under a real SLURM (docs/cluster.md, "A real SLURM"): Debian's
# slurmctld and slurmd for this one machine (scripts/slurm_local), jobs
# submitted with sbatch and waited for. A 4-task gloo ddp job (the job
# script scripts/slurm/train_zero.sbatch) and a 4-task MPI zero2 job
# (mpirun inside the allocation) have the threads backend's bits; a job
# with one task killed and --on-rank-failure continue finishes on the
# survivors; scancel stops every task at a step boundary with its metrics
# and checkpoint written; with the Python front end built (PYTHONDIR, its
# package's folder), the Python gossip job script trains SGP on 4 tasks
# and, submitted again, resumes every rank. Exits 77 (skipped) with the
# reason where the daemons are not installed or will not start.
set -u
bin=$1
root=$2
pythondir=${3:-}
source "$(dirname "$0")/check_lib.sh"

cluster="$tmp/cluster"
line=$("$root/scripts/slurm_local" start "$cluster")
case $? in
  0) ;;
  77) echo "skipped: $line"; exit 77 ;;
  *) echo "FAIL: scripts/slurm_local start: $line"; exit 1 ;;
esac
eval "$line"  # export SLURM_CONF=...
trap '"$root/scripts/slurm_local" stop "$cluster"; rm -rf "$tmp"' EXIT
# The jobs run in this environment (sbatch exports it), not a launcher's.
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT OMPI_COMM_WORLD_SIZE
export TMPDIR="$tmp"

hash_of() { grep '^{' "$1" | tail -n 1 | python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])'; }
threads_hash() { "$bin" train "$@" 2>/dev/null | tail -n 1 | python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])'; }
# wait_job ID: until the job has ended (squeue polled every 0.1 s:
# sbatch --wait looks only every 10 s); its exit status.
wait_job() {
  local i
  for i in $(seq 3000); do
    case "$(squeue -h -j "$1" -o %T 2>/dev/null)" in
      PENDING | CONFIGURING | RUNNING | COMPLETING | SUSPENDED) sleep 0.1 ;;
      *) break ;;
    esac
  done
  local code
  code=$(scontrol show job "$1" 2>/dev/null | sed -n 's/.* ExitCode=\([0-9]*\):.*/\1/p')
  return "${code:-1}"
}
# submit NAME SBATCH-ARGS...: submits and waits for the job's end (its
# exit status), output in $tmp/NAME.out and .err.
submit() {
  local name=$1 id
  shift
  id=$(sbatch --parsable --job-name "$name" --output "$tmp/$name.out" --error "$tmp/$name.err" "$@") || return 1
  wait_job "$id"
}
# The job script trains on Fashion-MNIST; the other jobs on synthetic data (quicker to load).
fmnist=(--data fashion-mnist --epochs 3 --optimizer adamw --lr 1e-3 --json)
common=(--data synthetic --train-size 4096 --test-size 128 --batch-size 48 --optimizer adamw --lr 1e-3 --json)
same=("${common[@]}" --epochs 3)

echo "cli.slurm: $SECONDS s: the cluster is up"
# 1. The job script, ddp over 4 tasks of the gloo backend.
submit ddp --ntasks 4 --export "ALL,DISTOPT=$bin,STRATEGY=ddp,OUT=$tmp/ddp,EXTRA=--max-steps 8 --json" \
  "$root/scripts/slurm/train_zero.sbatch" || fail "ddp: job exit $?: $(tail -n 3 "$tmp/ddp.err")"
[ "$(hash_of "$tmp/ddp.out")" = "$(threads_hash "${fmnist[@]}" --strategy ddp --world 4 --max-steps 8)" ] ||
  fail "ddp: not the threads backend's bits: $(tail -n 3 "$tmp/ddp.err")"
grep -q "started by srun as 4 processes: using --backend gloo" "$tmp/ddp.err" || fail "ddp: $(cat "$tmp/ddp.err")"

echo "cli.slurm: $SECONDS s: the gloo ddp job done"
# 2. MPI: zero2 over 4 ranks, mpirun inside the allocation (Open MPI's
# SLURM launcher), and srun --mpi=pmix where SLURM has PMIx.
mpi=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none)
want=$(threads_hash "${same[@]}" --strategy zero2 --world 4 --max-steps 8)
submit mpirun --ntasks 4 --wrap "${mpi[*]} mpirun -np 4 $bin train ${same[*]} --strategy zero2 --max-steps 8" ||
  fail "mpirun: job exit $?: $(tail -n 3 "$tmp/mpirun.err")"
[ "$(hash_of "$tmp/mpirun.out")" = "$want" ] || fail "mpirun: not the threads backend's bits: $(tail -n 3 "$tmp/mpirun.err")"
grep -q "started by mpirun with 4 processes: using --backend mpi" "$tmp/mpirun.err" || fail "mpirun: $(cat "$tmp/mpirun.err")"
if srun --mpi=list 2>&1 | grep -q pmix; then
  submit pmix --ntasks 4 --wrap "${mpi[*]} srun --mpi=pmix $bin train ${same[*]} --strategy zero2 --max-steps 8 --backend mpi" ||
    fail "srun --mpi=pmix: job exit $?: $(tail -n 3 "$tmp/pmix.err")"
  [ "$(hash_of "$tmp/pmix.out")" = "$want" ] || fail "srun --mpi=pmix: not the threads backend's bits: $(tail -n 3 "$tmp/pmix.err")"
fi

echo "cli.slurm: $SECONDS s: the MPI jobs done"
# 3. One task killed (kill -9 of itself after step 5), --on-rank-failure
# continue: the three others finish; srun reports the lost task.
submit lost --ntasks 4 --export "ALL,DISTOPT_FAULT=kill:2:5" --wrap \
  "srun $bin train ${same[*]} --max-steps 30 --on-rank-failure continue --comm-timeout 10 --metrics $tmp/lost.jsonl"
grep '^{' "$tmp/lost.out" | tail -n 1 | python3 -c '
import json, sys
s = json.load(sys.stdin)
assert s["world_at_end"] == 3 and s["membership_changes"] == 1 and s["steps"] == 30, s' ||
  fail "lost task: no survivors' summary: $(tail -n 5 "$tmp/lost.err")"
grep -q "rank(s) 2 lost after step 5; 3 ranks go on" "$tmp/lost.err" || fail "lost task: $(cat "$tmp/lost.err")"

echo "cli.slurm: $SECONDS s: the job with a lost task done"
# 4. scancel while a zero2 job trains: every task stops after a step
# (SIGTERM), rank 0 writes the metrics and every rank its part of a
# checkpoint at that step; the job ends before SLURM's KillWait (10 s).
ck="$tmp/cancel/ck"
mkdir -p "$tmp/cancel"
id=$(sbatch --parsable --ntasks 4 --job-name cancel --output "$tmp/cancel.out" --error "$tmp/cancel.err" --wrap \
  "srun --output $tmp/cancel/out.%t --error $tmp/cancel/err.%t $bin train ${common[*]} --strategy zero2 --epochs 400 \
   --checkpoint-dir $ck --checkpoint-every 100000 --metrics $tmp/cancel/m.jsonl")
# (The metrics go to m.jsonl.tmp.* until the run ends.)
for i in $(seq 600); do cat "$tmp/cancel/m.jsonl".tmp.* 2>/dev/null | grep -q '"kind": "step"' && break; sleep 0.1; done
cat "$tmp/cancel/m.jsonl".tmp.* 2>/dev/null | grep -q '"kind": "step"' ||
  fail "scancel: the job did not start: $(tail -n 3 "$tmp/cancel.err")"
t0=$(date +%s.%N)
scancel "$id"
wait_job "$id"
took=$(echo "$(date +%s.%N) - $t0" | bc)
[ "$(echo "$took < 10" | bc)" = 1 ] || fail "scancel: the job took $took s to end (KillWait is 10 s: killed, not stopped?)"
# (Each task's output goes to files of its own, written by slurmstepd: srun
# stops forwarding output when the step is cancelled.)
step=$(python3 - "$tmp/cancel/m.jsonl" <<'PY'
import json, sys
steps = [r["step"] for r in map(json.loads, open(sys.argv[1])) if r["kind"] == "step"]
print(steps[-1])
PY
) || fail "scancel: no metrics: $(ls "$tmp/cancel") $(tail -n 5 "$tmp/cancel.err")"
if [ -n "$step" ]; then
  last=$(ls "$ck" | tail -n 1)
  [ "$last" = "$(printf 'step-%012d' "$step")" ] || fail "scancel: the newest checkpoint is $last, the metrics end at step $step"
  for f in manifest.json rank0.safetensors rank1.safetensors rank2.safetensors rank3.safetensors; do
    [ -s "$ck/$last/$f" ] || fail "scancel: $last has no $f"
  done
fi
grep -q "terminated (SIGTERM): stopping after this step" "$tmp/cancel/err.0" ||
  fail "scancel: rank 0 announced no stop: $(tail -n 3 "$tmp/cancel/err.0")"
for r in 1 2 3; do  # (the others stop quietly)
  [ ! -s "$tmp/cancel/err.$r" ] || fail "scancel: task $r: $(tail -n 3 "$tmp/cancel/err.$r")"
done
grep '^{' "$tmp/cancel/out.0" | tail -n 1 | python3 -c "
import json, sys
s = json.load(sys.stdin)
assert s['interrupted'] and s['steps'] == ${step:-0}, s" || fail "scancel: rank 0's summary: $(tail -n 2 "$tmp/cancel/out.0")"
echo "cli.slurm: $SECONDS s: the cancelled job done (stopped $took s after scancel)"
# The checkpoint is whole: a run resumed from it at world 4 goes on.
"$bin" train "${common[@]}" --strategy zero2 --epochs 400 --world 4 --checkpoint-dir "$ck" --resume \
  --max-steps $((${step:-0} + 2)) >"$tmp/resumed.out" 2>"$tmp/resumed.err" || fail "scancel: resuming: $(tail -n 3 "$tmp/resumed.err")"
# 5. Python: the gossip job script (GossipDataParallel, sgp) over 4 tasks,
# comm.world() forming a gloo group from srun's variables; submitted again
# with the same OUT, every rank resumes from its own saved state.
if [ -n "$pythondir" ]; then
  py_env="ALL,DISTOPT_ROOT=$root,PYTHONPATH=$pythondir,OMP_NUM_THREADS=1,OUT=$tmp/py,EPOCHS=1,EXTRA=--max-steps 40"
  submit gossip --export "$py_env" "$root/scripts/slurm/python_gossip.sbatch" ||
    fail "python gossip: job exit $?: $(tail -n 5 "$tmp/gossip.err")"
  grep -q "epoch 1: test accuracy .* 4 ranks over torch, sgp with sgd" "$tmp/gossip.out" ||
    fail "python gossip: $(tail -n 3 "$tmp/gossip.out") $(tail -n 5 "$tmp/gossip.err")"
  [ -s "$tmp/py/gossip/$(printf 'step-%012d' 40)/manifest.json" ] ||
    fail "python gossip: no checkpoint of step 40: $(ls "$tmp/py/gossip")"
  submit gossip2 --export "$py_env" "$root/scripts/slurm/python_gossip.sbatch" ||
    fail "python gossip, resubmitted: job exit $?: $(tail -n 5 "$tmp/gossip2.err")"
  grep -q "resumed from $tmp/py/gossip after epoch 1" "$tmp/gossip2.out" ||
    fail "python gossip, resubmitted: $(tail -n 3 "$tmp/gossip2.out") $(tail -n 5 "$tmp/gossip2.err")"
  echo "cli.slurm: $SECONDS s: the Python gossip jobs done"
fi
finish cli.slurm

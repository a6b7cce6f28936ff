#!/usr/bin/env bash
# docs/reliability.md under mpirun: a SIGSTOPped rank ends the job within
# --comm-timeout naming it; SIGTERM to one process and SIGINT to mpirun stop
# every rank after the same step with the outputs written; divergence is
# status 4 with one line. Usage: mpi_reliability_test.sh MPIEXEC DISTOPT
set -u
mpiexec=$1
bin=$2
source "$(dirname "$0")/check_lib.sh"

long=(train --data synthetic --train-size 65536 --test-size 256 --epochs 100 --progress lines)

# rank_pid MPIRUN-PID RANK: the process of that rank (a child of mpirun).
rank_pid() {
  local p
  for p in $(pgrep -P "$1"); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" && { echo "$p"; return 0; }
  done
  return 1
}

# A stopped rank (kill -STOP): the others time out after 5 s naming it and
# the job ends well within 10 s of the stop, without temporary files; with
# ddp's collectives, sgp's point-to-point gossip and adpsgd's gossip thread.
for strategy in ddp sgp adpsgd; do
d="$tmp/stop-$strategy"; mkdir -p "$d"
"$mpiexec" -n 2 "$bin" "${long[@]}" --strategy $strategy --comm-timeout 5 --metrics "$d/m.jsonl" >/dev/null 2>"$d/err" &
job=$!
started "$job" "$d/m.jsonl" || fail "stop: the job did not start: $(cat "$d/err")"
victim=$(rank_pid "$job" 1) || fail "stop: no rank 1 under mpirun $job"
kill -STOP "$victim"
start=$(date +%s.%N)
wait "$job"
status=$?
elapsed=$(echo "$(date +%s.%N) - $start" | bc)
[ "$status" != 0 ] || fail "stop: exit 0"
grep -qE "distopt: error \(rank 0\): ([a-z_]+ on rank 0: timed out after 5 s waiting for rank(\(s\))? 1 \((tag [0-9]+, )?|adpsgd on rank 0: timed out after 5 s (receiving from|sending to) rank 1 in pairwise round [0-9]+ \()mpi backend\)" "$d/err" \
  || fail "stop ($strategy): message: $(grep distopt "$d/err")"
[ "$(echo "$elapsed < 10" | bc)" = 1 ] || fail "stop: the job took $elapsed s after the stop"
[ "$(ls "$d" | grep -c '\.tmp\.')" = 0 ] || fail "stop: temporary files left: $(ls "$d")"
echo "stopped rank ($strategy): job ended ${elapsed} s after SIGSTOP"
done

# A rank that stops (SIGSTOP, DISTOPT_FAULT=stall:1:init|end|finalize)
# before MPI_Init (which waits for every process: rank 0 gives up after the
# time-out), or at the run's end: before the ranks finish together (rank 0
# times out in that barrier) or after it, in MPI_Finalize (which waits like
# MPI_Init). Each time the job ends within the time-out plus a few seconds,
# naming the wait, and leaves no process.
for point in init end finalize; do
  d="$tmp/end-$point"; mkdir -p "$d"
  start=$(date +%s.%N)
  DISTOPT_FAULT=stall:1:$point timeout -s KILL 60 "$mpiexec" -n 2 "$bin" train --data synthetic --max-steps 5 \
    --progress none --comm-timeout 3 --metrics "$d/m.jsonl" >/dev/null 2>"$d/err"
  status=$?
  elapsed=$(echo "$(date +%s.%N) - $start" | bc)
  left=$(pgrep -f "$bin train --data synthetic --max-steps 5" || true)
  [ -z "$left" ] || { kill -KILL $left; fail "stop at the $point: processes left behind: $left"; }
  [ "$status" = 2 ] || fail "stop at the $point: exit $status, want 2: $(grep distopt "$d/err")"
  if [ $point = init ]; then
    want="distopt: error (rank 0): MPI_Init did not end within 3 s: another process of the job did not start (stopped or hung before MPI_Init)"
  elif [ $point = end ]; then
    want="distopt: error (rank 0): barrier on rank 0: timed out after 3 s waiting for the other ranks (mpi backend)"
  else
    want="distopt: error (rank 0): MPI_Finalize did not end within 3 s: another process of the job stopped answering after the run's end"
  fi
  grep -qxF "$want" "$d/err" || fail "stop at the $point: message: $(grep distopt "$d/err")"
  [ "$(echo "$elapsed < 15" | bc)" = 1 ] || fail "stop at the $point: the job took $elapsed s"
  echo "rank stopped at $point: job ended in ${elapsed} s"
done

# SIGTERM to rank 1 only, and SIGINT to mpirun (which passes SIGTERM on):
# every rank stops after the same step; rank 0 writes the metrics and the
# summary, marked interrupted.
for target in rank1 mpirun; do
  d="$tmp/$target"; mkdir -p "$d"
  "$mpiexec" -n 2 "$bin" "${long[@]}" --metrics "$d/m.jsonl" --json >"$d/out" 2>"$d/err" &
  job=$!
  started "$job" "$d/m.jsonl" || fail "$target: the job did not start: $(cat "$d/err")"
  if [ "$target" = rank1 ]; then kill -TERM "$(rank_pid "$job" 1)"; else kill -INT "$job"; fi
  wait "$job"
  status=$?
  [ "$status" != 0 ] || fail "$target: exit 0"
  [ "$target" = rank1 ] && [ "$status" != 143 ] && fail "$target: exit $status, want 143 (rank 0's status)"
  grep -q "distopt: stopped by SIGTERM after step" "$d/err" || fail "$target: no stop line: $(grep distopt "$d/err")"
  [ "$(ls "$d" | grep -c '\.tmp\.')" = 0 ] || fail "$target: temporary files left: $(ls "$d")"
  /usr/bin/env python3 - "$d" <<'PY' || fail "$target: outputs incomplete"
import json, sys
d = sys.argv[1]
s = json.loads(open(d + "/out").read().strip().splitlines()[-1])
assert s["interrupted"] is True and s["backend"] == "mpi" and 0 < s["steps"] < 51200, s
steps = [l for l in map(json.loads, open(d + "/m.jsonl")) if l["kind"] == "step"]
assert steps[-1]["step"] == s["steps"], (steps[-1], s["steps"])
PY
done

# Divergence under MPI: every rank stops at the same step; one line, status 4.
"$mpiexec" -n 2 "$bin" train --data synthetic --train-size 512 --test-size 64 --batch-size 64 --optimizer sgd \
  --lr 1e10 --progress none >"$tmp/out" 2>"$tmp/err"
status=$?
[ "$status" = 4 ] || fail "divergence: exit $status, want 4: $(cat "$tmp/err")"
[ "$(grep -c '^distopt: error: step 3: the loss is nan on rank 0' "$tmp/err")" = 1 ] \
  || fail "divergence: want one error line: $(cat "$tmp/err")"

finish "mpi reliability"

#!/usr/bin/env bash
# docs/reliability.md from outside, on the threads backend: Ctrl-C and
# SIGTERM, a second Ctrl-C, what a killed run leaves and the next run
# cleans, divergence (--on-nonfinite), missing values, stalls
# (--comm-timeout, DISTOPT_COMM_TIMEOUT).
set -u
bin=$1
source "$(dirname "$0")/check_lib.sh"

# A run long enough to be interrupted (100 epochs of 512 steps).
long=(train --data synthetic --train-size 65536 --test-size 256 --epochs 100 --world 2 --progress lines)

# Sanitizer builds run several times slower: wider time limits.
limit=10
sanitized && limit=30

# SIGINT and SIGTERM: stop after the current step on every rank, write the
# metrics, the parameters and the summary (marked interrupted), leave no
# temporary file, exit 128 + the signal's number.
for sig in INT TERM; do
  d="$tmp/$sig"; mkdir -p "$d"
  "$bin" "${long[@]}" --metrics "$d/m.jsonl" --export-params "$d/p.safetensors" --json >"$d/out" 2>"$d/err" &
  pid=$!
  started "$pid" "$d/m.jsonl" || fail "SIG$sig: the run did not start: $(cat "$d/err")"
  kill -"$sig" "$pid"
  wait "$pid"
  status=$?
  want=$([ "$sig" = INT ] && echo 130 || echo 143)
  [ "$status" = "$want" ] || fail "SIG$sig: exit $status, want $want: $(tail -3 "$d/err")"
  grep -q "distopt: stopped by SIG$sig after step [0-9]*; metrics and outputs hold that step" "$d/err" \
    || fail "SIG$sig: no stop line: $(cat "$d/err")"
  [ "$(ls "$d" | grep -c '\.tmp\.')" = 0 ] || fail "SIG$sig: temporary files left: $(ls "$d")"
  /usr/bin/env python3 - "$d" <<'PY' || fail "SIG$sig: outputs incomplete"
import json, struct, sys
d = sys.argv[1]
s = json.loads(open(d + "/out").read().strip().splitlines()[-1])
assert s["interrupted"] is True and 0 < s["steps"] < 51200, s
lines = [json.loads(l) for l in open(d + "/m.jsonl")]
steps = [l for l in lines if l["kind"] == "step"]
assert steps[-1]["step"] == s["steps"] and len(steps) == s["steps"], (steps[-1], s["steps"])
assert lines[-1]["kind"] == "epoch" and lines[-1]["test_accuracy"] == s["test_accuracy"], lines[-1]
raw = open(d + "/p.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
assert json.loads(raw[8:8 + n])["__metadata__"]["param_hash"] == s["param_hash"]
PY
done
grep -q "interrupted (SIGINT): stopping after this step; press Ctrl-C again to quit at once" "$tmp/INT/err" \
  || fail "SIGINT: no announcement: $(cat "$tmp/INT/err")"

# The same SIGTERM twice at once is one request (GNU timeout signals the
# command, then its process group): the second, sent as soon as the first
# was announced, well inside half a second, changes nothing. A gpt run with
# a large test set: the evaluation after the stop outlasts the repeat.
d="$tmp/dup"; mkdir -p "$d"
"$bin" train --model gpt --data fortunes --layers 1 --dim 32 --heads 2 --context 32 --test-size 8192 --epochs 100 \
  --world 2 --progress lines --metrics "$d/m.jsonl" --json >"$d/out" 2>"$d/err" &
pid=$!
started "$pid" "$d/m.jsonl" || fail "SIGTERM twice: the run did not start: $(cat "$d/err")"
kill -TERM "$pid"
for i in $(seq 400); do grep -q "terminated (SIGTERM)" "$d/err" && break; sleep 0.005; done
kill -TERM "$pid" 2>/dev/null
wait "$pid"
status=$?
[ "$status" = 143 ] || fail "SIGTERM twice: exit $status, want 143: $(tail -3 "$d/err")"
grep -q "distopt: stopped by SIGTERM after step [0-9]*; metrics and outputs hold that step" "$d/err" \
  || fail "SIGTERM twice: quit without its outputs: $(cat "$d/err")"
[ "$(ls "$d" | grep -c '\.tmp\.')" = 0 ] || fail "SIGTERM twice: temporary files left: $(ls "$d")"

# A second SIGINT (half a second or more after the first) quits at once,
# even when no step boundary comes (rank 1
# hangs after step 1, before it could see the first signal, so every rank
# waits for it whenever that signal came); its temporary file stays
# behind, recognisable by its name, and the next run writing that output
# removes it.
d="$tmp/twice"; mkdir -p "$d"
DISTOPT_FAULT=stall:1:1 "$bin" "${long[@]}" --metrics "$d/m.jsonl" >/dev/null 2>"$d/err" &
pid=$!
for i in $(seq 1200); do [ -e "$d/m.jsonl.tmp.$pid" ] && break; sleep 0.05; done
sleep 0.5
kill -INT "$pid"; sleep 1; kill -INT "$pid"
start=$(date +%s)
wait "$pid"
status=$?
[ "$status" = 130 ] || fail "second SIGINT: exit $status, want 130"
[ $(( $(date +%s) - start )) -le $(( limit / 5 )) ] || fail "second SIGINT: did not quit at once"
[ -e "$d/m.jsonl.tmp.$pid" ] || fail "second SIGINT: expected the temporary file to stay: $(ls "$d")"
"$bin" train --data synthetic --train-size 512 --test-size 64 --batch-size 64 --progress none --metrics "$d/m.jsonl" \
  >/dev/null 2>"$d/err2" || fail "the run after a killed one exited $?: $(cat "$d/err2")"
grep -q "distopt: removed .*m.jsonl.tmp.$pid, left by an earlier run (process $pid) that was killed" "$d/err2" \
  || fail "stale temporary file not reported: $(cat "$d/err2")"
[ "$(ls "$d" | grep -c "\.tmp\.")" = 0 ] || fail "after the next run: $(ls "$d")"
# A temporary file of a live process is not touched.
sleep 60 & live=$!
touch "$d/m.jsonl.tmp.$live"
"$bin" train --data synthetic --train-size 512 --test-size 64 --batch-size 64 --progress none --metrics "$d/m.jsonl" \
  >/dev/null 2>&1 || fail "run beside a live temporary file exited $?"
[ -e "$d/m.jsonl.tmp.$live" ] || fail "a live process's temporary file was removed"
kill "$live"; wait "$live" 2>/dev/null

# Divergence: --lr 1e10 gives a NaN loss at step 3. Default: stop there,
# one line naming the step, the rank and the last finite loss, status 4,
# the metrics up to that step kept.
diverge=(train --data synthetic --train-size 512 --test-size 64 --batch-size 64 --world 2 --optimizer sgd --lr 1e10
         --progress none)
expect_error 4 "^distopt: error: step 3: the loss is nan on rank 0 (the last finite loss was .*, at step 2); lower --lr" \
  -- "${diverge[@]}" --metrics "$tmp/div.jsonl"
[ "$(grep -c '"kind": "step"' "$tmp/div.jsonl" 2>/dev/null)" = 3 ] || fail "divergence: metrics not kept: $(cat "$tmp/div.jsonl")"
"$bin" "${diverge[@]}" --on-nonfinite warn --json >"$tmp/out" 2>"$tmp/err" || fail "--on-nonfinite warn exited $?"
[ "$(grep -c "warning" "$tmp/err")" = 1 ] || fail "--on-nonfinite warn: want one warning: $(cat "$tmp/err")"
grep -q "^distopt: warning: step 3: the loss is nan on rank 0" "$tmp/err" || fail "warning text: $(cat "$tmp/err")"
grep -q '"nonfinite_steps": 6' "$tmp/out" || fail "--on-nonfinite warn: nonfinite_steps: $(tail -1 "$tmp/out")"
"$bin" "${diverge[@]}" --on-nonfinite ignore >"$tmp/out" 2>"$tmp/err" || fail "--on-nonfinite ignore exited $?"
[ -s "$tmp/err" ] && fail "--on-nonfinite ignore printed: $(cat "$tmp/err")"
grep -q "6 of 8 steps had a non-finite loss or gradient norm" "$tmp/out" || fail "ignore summary: $(cat "$tmp/out")"
expect_error 2 "--on-nonfinite: stop not in {error,warn,ignore}" -- train --data synthetic --on-nonfinite stop

# Missing values are null, never invented: no test set, no test accuracy.
"$bin" train --data synthetic --train-size 512 --test-size 0 --batch-size 64 --progress lines --json \
  --metrics "$tmp/nt.jsonl" >"$tmp/out" 2>"$tmp/err" || fail "--test-size 0 exited $?: $(cat "$tmp/err")"
grep -q '"test_accuracy": null, "test_loss": null, "train_loss": [0-9]' "$tmp/out" || fail "--test-size 0: $(tail -1 "$tmp/out")"
grep -q '"test_loss": null, "test_accuracy": null' "$tmp/nt.jsonl" || fail "--test-size 0 metrics: $(tail -1 "$tmp/nt.jsonl")"
grep -q "test_loss n/a  test_accuracy n/a" "$tmp/err" || fail "--test-size 0 progress: $(cat "$tmp/err")"
"$bin" train --data synthetic --train-size 512 --test-size 0 --batch-size 64 --progress none \
  --metrics "$tmp/nt.csv" >/dev/null 2>&1 || fail "--test-size 0 with CSV metrics exited $?"
grep -q '^epoch,1,8,[0-9.]*,,,[0-9.e+]*,[0-9.]*,,,,,,,,,$' "$tmp/nt.csv" || fail "--test-size 0 CSV: $(tail -1 "$tmp/nt.csv")"
expect_error 2 "reducelronplateau steps on the test loss: it needs a test set" -- train --data synthetic \
  --test-size 0 --scheduler reducelronplateau

# Stalls: rank 1 stops answering after step 3 (DISTOPT_FAULT stands in for
# a hung rank); with --comm-timeout 5 the job ends in under 10 s naming the
# silent rank and the collective. The stuck thread is left behind.
start=$(date +%s.%N)
DISTOPT_FAULT=stall:1:3 "$bin" train --data synthetic --world 3 --progress none --comm-timeout 5 >/dev/null 2>"$tmp/err"
status=$?
elapsed=$(echo "$(date +%s.%N) - $start" | bc)
[ "$status" = 2 ] || fail "stall: exit $status, want 2: $(cat "$tmp/err")"
grep -q "^distopt: error: rank [02] failed: [a-z_]* on rank [02]: timed out after 5 s waiting for rank(s) 1 (threads backend); rank(s) 1 did not stop within 2 s and were abandoned$" "$tmp/err" \
  || fail "stall message: $(cat "$tmp/err")"
[ "$(echo "$elapsed < $limit" | bc)" = 1 ] || fail "stall: took $elapsed s"
# The same from the environment.
DISTOPT_FAULT=stall:1:3 DISTOPT_COMM_TIMEOUT=1.5 "$bin" train --data synthetic --world 2 --progress none \
  >/dev/null 2>"$tmp/err"
grep -q "timed out after 1.5 s waiting for rank(s) 1" "$tmp/err" || fail "DISTOPT_COMM_TIMEOUT: $(cat "$tmp/err")"
expect_error 2 "--comm-timeout: '0' is not a number of seconds in (0, one year\]" -- train --data synthetic --comm-timeout 0
expect_error 2 "--comm-timeout: 'soon' is not a number of seconds" -- train --data synthetic --comm-timeout soon
DISTOPT_COMM_TIMEOUT=-3 expect_error 2 "DISTOPT_COMM_TIMEOUT: '-3' is not a number of seconds" -- train --data synthetic
DISTOPT_FAULT=crash expect_error 2 "DISTOPT_FAULT: 'crash' is not stall:RANK:STEP, stall:RANK:init|end|finalize, fail:RANK:STEP, kill:RANK:STEP, term:RANK:STEP or exit:RANK:STEP:file|manifest" \
  -- train --data synthetic
# A rank that stalls at the run's end, after its last collective: the
# others have the time-out plus 2 s to end too, then the job ends naming it.
start=$(date +%s.%N)
DISTOPT_FAULT=stall:1:end "$bin" train --data synthetic --world 3 --max-steps 5 --progress none --comm-timeout 3 \
  >/dev/null 2>"$tmp/err"
status=$?
elapsed=$(echo "$(date +%s.%N) - $start" | bc)
[ "$status" = 2 ] || fail "stall at the end: exit $status, want 2: $(cat "$tmp/err")"
grep -qx "distopt: error: rank(s) 1 did not end within 5 s of rank(s) 0, 2 (threads backend); rank(s) 1 did not stop within 2 s and were abandoned" "$tmp/err" \
  || fail "stall at the end: $(cat "$tmp/err")"
[ "$(echo "$elapsed < 14" | bc)" = 1 ] || fail "stall at the end: took $elapsed s"

# Survivors (--on-rank-failure continue, ddp, threads): rank 2 of 4 fails
# (DISTOPT_FAULT=fail) or falls silent (stall) after step 5; the other three
# re-form the world and finish the run at world 3, with the bits of a run
# resumed at world 3 from the checkpoint of step 5. The metrics and the
# summary record the change; a silent rank costs about the time-out.
sv=(train --data synthetic --train-size 512 --test-size 128 --batch-size 48 --epochs 2 --progress none)
"$bin" "${sv[@]}" --world 4 --max-steps 5 --checkpoint-dir "$tmp/sv-ck" >/dev/null 2>"$tmp/err" || fail "survivors: checkpoint run: $(cat "$tmp/err")"
want=$("$bin" "${sv[@]}" --max-steps 12 --world 3 --checkpoint-dir "$tmp/sv-ck" --resume --json 2>"$tmp/err" | tail -n 1 | python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])') \
  || fail "survivors: resumed run: $(cat "$tmp/err")"
for fault in fail:2:5 stall:2:5 fail:0:5; do
  DISTOPT_FAULT=$fault "$bin" "${sv[@]}" --max-steps 12 --world 4 --on-rank-failure continue --comm-timeout 2 --json \
    --metrics "$tmp/sv.jsonl" >"$tmp/sv.out" 2>"$tmp/err" || fail "survivors ($fault): exit $?: $(cat "$tmp/err")"
  lost=${fault#*:}; lost=${lost%%:*}  # rank 0 lost too: the new rank 0 reports
  grep -q "^distopt: rank(s) $lost lost after step 5; 3 ranks go on from step 5 (" "$tmp/err" || fail "survivors ($fault): $(cat "$tmp/err")"
  /usr/bin/env python3 - "$tmp/sv.out" "$tmp/sv.jsonl" "$want" "$fault" "$lost" <<'PY' || fail "survivors ($fault): summary or metrics"
import json, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert s["param_hash"] == sys.argv[3], (s["param_hash"], sys.argv[3])
assert s["steps"] == 12 and s["membership_changes"] == 1 and s["world_at_end"] == 3, s
m = [r for r in map(json.loads, open(sys.argv[2])) if r["kind"] == "membership"]
assert len(m) == 1 and m[0]["step"] == 5 and m[0]["lost"] == [int(sys.argv[5])] and m[0]["world"] == 3, m
# a failed rank is noticed at once; a silent one after the 2 s time-out
assert m[0]["seconds"] < (1 if sys.argv[4].startswith("fail") else 4), m
PY
done
# zero2: the lost rank held the only copy of its shard; the survivors go
# back to the checkpoint of step 4 and on at world 3, with the bits of a
# run resumed there at world 3.
"$bin" "${sv[@]}" --strategy zero2 --world 4 --max-steps 4 --checkpoint-dir "$tmp/z-ck" >/dev/null 2>"$tmp/err" \
  || fail "zero2 survivors: checkpoint run: $(cat "$tmp/err")"
want=$("$bin" "${sv[@]}" --strategy zero2 --max-steps 12 --world 3 --checkpoint-dir "$tmp/z-ck" --resume --json 2>"$tmp/err" \
  | tail -n 1 | python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])') || fail "zero2 survivors: resumed run: $(cat "$tmp/err")"
DISTOPT_FAULT=fail:2:6 "$bin" "${sv[@]}" --strategy zero2 --max-steps 12 --world 4 --on-rank-failure continue \
  --checkpoint-dir "$tmp/z-run" --checkpoint-every 4 --json >"$tmp/sv.out" 2>"$tmp/err" || fail "zero2 survivors: exit $?: $(cat "$tmp/err")"
grep -q "^distopt: rank(s) 2 lost after step 6; 3 ranks go on from step 4 (back to the checkpoint of step 4: 2 steps again) (" "$tmp/err" \
  || fail "zero2 survivors: $(cat "$tmp/err")"
[ "$(tail -n 1 "$tmp/sv.out" | python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')" = "$want" ] \
  || fail "zero2 survivors: param_hash is not the resumed run's $want"
# The same with the checkpoint kept in memory (--memory-checkpoint, no
# --checkpoint-dir): each rank's file and its neighbour's; zero1-3 all end
# with the bits of the run resumed from step 4 at world 3.
for strategy in zero1 zero2 zero3; do
  DISTOPT_FAULT=fail:2:6 "$bin" "${sv[@]}" --strategy $strategy --max-steps 12 --world 4 --on-rank-failure continue \
    --memory-checkpoint --checkpoint-every 4 --json >"$tmp/sv.out" 2>"$tmp/err" || fail "$strategy in memory: exit $?: $(cat "$tmp/err")"
  grep -q "^distopt: rank(s) 2 lost after step 6; 3 ranks go on from step 4 (back to the checkpoint of step 4: 2 steps again) (" "$tmp/err" \
    || fail "$strategy in memory: $(cat "$tmp/err")"
  [ "$(tail -n 1 "$tmp/sv.out" | python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')" = "$want" ] \
    || fail "$strategy in memory: param_hash is not the resumed run's $want"
done
expect_error 2 "--memory-checkpoint is for --on-rank-failure continue" -- train --data synthetic --strategy zero2 --memory-checkpoint --checkpoint-every 4
expect_error 2 "--memory-checkpoint applies to zero1-3: under --strategy ddp every survivor goes on from its own state" \
  -- train --data synthetic --memory-checkpoint --checkpoint-every 4 --on-rank-failure continue
expect_error 2 "--memory-checkpoint needs --checkpoint-every N" -- train --data synthetic --strategy zero3 --memory-checkpoint --on-rank-failure continue
# Gossip and diloco survivors go on in memory, each from its own model, at
# the step they reached (rank 2 fails at the start of step 7: the others
# apply that step's update, and its mixing or loss fails): nothing is done
# again, no checkpoint is needed. The model (--hidden 1024) is padded
# differently at 4 and 3 ranks. slowmo and diloco end on an outer step:
# every survivor then holds the same synced model (their shared state was
# agreed). diloco fails mid-cycle, where only the step's loss is gathered:
# the same run again gives the same bits.
for strategy in sgp osgp dpsgd slowmo diloco; do
  g=(train --data synthetic --train-size 512 --test-size 128 --batch-size 48 --epochs 2 --progress none --json
     --hidden 1024 --strategy $strategy --world 4 --max-steps 12 --on-rank-failure continue --comm-timeout 2)
  case $strategy in
    diloco) g+=(--sync-every 3) ;;
    slowmo) g+=(--slowmo-frequency 3) ;;
    dpsgd) g+=(--topology ring) ;;  # (its bipartite default needs an even world)
  esac
  DISTOPT_FAULT=fail:2:6 "$bin" "${g[@]}" --metrics "$tmp/$strategy.jsonl" >"$tmp/out" 2>"$tmp/err" \
    || fail "$strategy survivors: $(cat "$tmp/err")"
  grep -q "^distopt: rank(s) 2 lost after step 7; 3 ranks go on from step 7 ([0-9.]* s lost)" "$tmp/err" \
    || fail "$strategy survivors: $(cat "$tmp/err")"
  python3 - "$tmp/out" "$tmp/$strategy.jsonl" $strategy <<'PY' || fail "$strategy survivors: summary or metrics"
import json, math, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert s["steps"] == 12 and s["membership_changes"] == 1 and s["world_at_end"] == 3, s
assert math.isfinite(s["test_loss"]), s
m = [r for r in map(json.loads, open(sys.argv[2])) if r["kind"] == "membership"]
assert len(m) == 1 and m[0]["step"] == 7 and m[0]["steps_redone"] == 0 and m[0]["lost"] == [2], m
if sys.argv[3] in ("slowmo", "diloco"):
    assert s["consensus_distance"] < 1e-9, s["consensus_distance"]
PY
  if [ $strategy = diloco ]; then
    want=$(tail -n 1 "$tmp/out" | python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
    got=$(DISTOPT_FAULT=fail:2:6 "$bin" "${g[@]}" 2>/dev/null | tail -n 1 |
      python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
    [ "$got" = "$want" ] || fail "diloco survivors: $got the second time, $want the first"
  fi
done
expect_error 2 "--on-rank-failure continue with --strategy dpsgd: the 3 survivors of lost ranks could not gossip (topology bipartite-exponential needs an even world size (got 3)" \
  -- train --data synthetic --strategy dpsgd --world 4 --on-rank-failure continue
expect_error 2 "--on-rank-failure continue with --strategy zero2 needs --checkpoint-dir or --memory-checkpoint: a lost rank holds the only copy of its shard" \
  -- train --data synthetic --strategy zero2 --on-rank-failure continue
expect_error 2 "--on-rank-failure continue: --strategy adpsgd (asynchronous pairs) cannot go on without a lost rank" \
  -- train --data synthetic --strategy adpsgd --on-rank-failure continue --checkpoint-dir "$tmp/adck"
expect_error 2 "--on-rank-failure: maybe not in" -- train --data synthetic --on-rank-failure maybe

# A run killed while it writes a checkpoint (DISTOPT_FAULT=exit:RANK:STEP:POINT
# ends the process at once, as a kill would: with half of that rank's file
# written, or with its file complete and no manifest): the previous
# checkpoint stays the latest, --resume goes on from it, and the result is
# the uninterrupted run's.
ck=(train --data synthetic --train-size 512 --test-size 128 --epochs 2 --batch-size 64 --world 3 --strategy zero1
    --progress none --json)
hash_of() { tail -n 1 "$1" | grep -o '"param_hash": "[0-9a-f]*"'; }
"$bin" "${ck[@]}" >"$tmp/straight" 2>/dev/null || fail "uninterrupted run exited $?"
for point in "0:6:file" "2:6:file" "1:9:manifest" "0:9:manifest"; do
  rm -rf "$tmp/ck"
  DISTOPT_FAULT=exit:$point "$bin" "${ck[@]}" --checkpoint-dir "$tmp/ck" --checkpoint-every 3 >/dev/null 2>&1
  status=$?
  [ "$status" = 137 ] || fail "exit:$point: status $status, want 137"
  step=$(echo "$point" | cut -d: -f2)
  [ -d "$tmp/ck/step-00000000000$step" ] && [ ! -f "$tmp/ck/step-00000000000$step/manifest.json" ] \
    || fail "exit:$point: $(ls -R "$tmp/ck")"
  "$bin" train --resume --checkpoint-dir "$tmp/ck" >"$tmp/resumed" 2>"$tmp/err" || fail "exit:$point: --resume exited $?: $(cat "$tmp/err")"
  [ -n "$(hash_of "$tmp/straight")" ] && [ "$(hash_of "$tmp/resumed")" = "$(hash_of "$tmp/straight")" ] \
    || fail "exit:$point: resumed $(hash_of "$tmp/resumed") vs uninterrupted $(hash_of "$tmp/straight")"
  [ ! -d "$tmp/ck/step-00000000000$step" ] || [ -f "$tmp/ck/step-00000000000$step/manifest.json" ] \
    || fail "exit:$point: the interrupted write is still there after a later checkpoint"
done

finish "cli reliability"

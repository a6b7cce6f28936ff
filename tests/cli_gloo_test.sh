#!/usr/bin/env bash
# docs/reliability.md ("Processes") from outside: `distopt train --backend
# gloo` with one process per rank. The threads backend's bits; survivors of
# a killed (SIGKILL) or stopped (SIGSTOP) process, of two losses in a row
# and of the loss of rank 0; zero2 going back to its checkpoint; diloco
# survivors going on in memory with the threads backend's bits; joins
# (diloco at an outer cycle's end); a minority
# stops; without --on-rank-failure continue every process ends named; bad
# input.
set -u
bin=$1
source "$(dirname "$0")/check_lib.sh"

timeout=3
base=(train --data synthetic --test-size 128 --batch-size 48 --progress none --json)
sv=("${base[@]}" --train-size 512 --epochs 2)

# gloo_run NAME N [VAR=VALUE ...] -- ARGS...: N processes of one run, rank r
# writing $tmp/NAME/out.r and err.r, pids in pid.r; waits for all; their
# exit statuses in $tmp/NAME/status (one line per rank) and the seconds the
# run took in $tmp/NAME/seconds. @R@ in a VALUE is the rank. With
# launched=1, without --backend/--world/--rank/--rendezvous (the
# launcher's variables give them); with rv=RENDEZVOUS, that rendezvous
# (tcp://HOST:PORT) instead of the directory $tmp/NAME/rv.
gloo_run() {
  local name=$1 n=$2 d="$tmp/$1" r
  shift 2
  local env=()
  while [ "$1" != "--" ]; do env+=("$1"); shift; done
  shift
  mkdir -p "$d"
  local t0 pids=()
  t0=$(date +%s.%N)
  for ((r = 0; r < n; r++)); do
    local flags=(--backend gloo --world "$n" --rank "$r" --rendezvous "${rv:-$d/rv}")
    [ -z "${launched:-}" ] || flags=()
    env "${env[@]//@R@/$r}" "$bin" "$@" "${flags[@]}" >"$d/out.$r" 2>"$d/err.$r" &
    pids[r]=$!
    echo "${pids[r]}" >"$d/pid.$r"
  done
  : >"$d/status"
  for ((r = 0; r < n; r++)); do
    wait "${pids[r]}"
    echo $? >>"$d/status"
  done
  echo "$(date +%s.%N) - $t0" | bc >"$d/seconds"
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# store_has tcp://HOST:PORT KEY: the TCP store there holds KEY (its wire
# format, include/distopt/comm/tcp_store.hpp, spoken by Python).
store_has() {
  python3 - "$1" "$2" <<'PY' 2>/dev/null
import socket, struct, sys
host, port = sys.argv[1][len("tcp://"):].rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=2)
s.sendall(b"dstore1\n")
assert s.recv(8) == b"dstore1\n"
key = sys.argv[2].encode()
s.sendall(bytes([3]) + struct.pack("<I", len(key)) + key)
sys.exit(0 if s.recv(1) == b"\x01" else 1)
PY
}
statuses() { tr '\n' ' ' <"$tmp/$1/status" | sed 's/ $//'; }
hash_of() { tail -n 1 "$1" | python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])'; }

# 1. Four processes have the threads backend's bits (ddp and zero2).
for strategy in ddp zero2; do
  want=$("$bin" "${sv[@]}" --world 4 --max-steps 12 --strategy $strategy 2>"$tmp/err" | tail -n 1 |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
  gloo_run plain-$strategy 4 -- "${sv[@]}" --max-steps 12 --strategy $strategy
  [ "$(statuses plain-$strategy)" = "0 0 0 0" ] || fail "plain $strategy: exits $(statuses plain-$strategy): $(cat "$tmp/plain-$strategy"/err.*)"
  [ "$(hash_of "$tmp/plain-$strategy/out.0")" = "$want" ] || fail "plain $strategy: not the threads backend's bits"
  [ ! -s "$tmp/plain-$strategy/out.1" ] || fail "plain $strategy: rank 1 printed a summary"
  [ -e "$tmp/plain-$strategy/rv/closed" ] || fail "plain $strategy: the rendezvous is not marked closed"
done

# 1b. Compressed gradients over gloo: zero1 at 3 processes, the threads
# backend's compressed ddp bits.
want=$("$bin" "${sv[@]}" --world 3 --max-steps 12 --strategy ddp --grad-compression bf16 2>"$tmp/err" | tail -n 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
gloo_run compressed 3 -- "${sv[@]}" --max-steps 12 --strategy zero1 --grad-compression bf16
[ "$(statuses compressed)" = "0 0 0" ] || fail "compressed: exits $(statuses compressed): $(cat "$tmp/compressed"/err.*)"
[ "$(hash_of "$tmp/compressed/out.0")" = "$want" ] || fail "compressed zero1: not the threads backend's compressed ddp bits"
# int8 (packets sent to their owners, ddp's sums packed and gathered back):
# ddp at 3 processes, the threads backend's bits.
want=$("$bin" "${sv[@]}" --world 3 --max-steps 12 --strategy ddp --grad-compression int8 2>"$tmp/err" | tail -n 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
gloo_run int8 3 -- "${sv[@]}" --max-steps 12 --strategy ddp --grad-compression int8
[ "$(statuses int8)" = "0 0 0" ] || fail "int8: exits $(statuses int8): $(cat "$tmp/int8"/err.*)"
[ "$(hash_of "$tmp/int8/out.0")" = "$want" ] || fail "int8 ddp: not the threads backend's int8 ddp bits"
# PowerSGD (compressed after 2 steps): zero2 at 3 processes, the threads
# backend's ddp bits.
pargs=(--max-steps 12 --grad-compression powersgd --powersgd-rank 2 --powersgd-warmup 2)
want=$("$bin" "${sv[@]}" --world 3 "${pargs[@]}" --strategy ddp 2>"$tmp/err" | tail -n 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
gloo_run powersgd 3 -- "${sv[@]}" "${pargs[@]}" --strategy zero2
[ "$(statuses powersgd)" = "0 0 0" ] || fail "powersgd: exits $(statuses powersgd): $(cat "$tmp/powersgd"/err.*)"
[ "$(hash_of "$tmp/powersgd/out.0")" = "$want" ] || fail "powersgd zero2: not the threads backend's powersgd ddp bits"
# 1-bit Adam (signs to the owners, their sums' signs gathered back; Adam
# for 2 steps first): zero1 at 3 processes, the threads backend's ddp bits.
oargs=(--max-steps 12 --optimizer adam --grad-compression onebit --onebit-warmup 2)
want=$("$bin" "${sv[@]}" --world 3 "${oargs[@]}" --strategy ddp 2>"$tmp/err" | tail -n 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
gloo_run onebit 3 -- "${sv[@]}" "${oargs[@]}" --strategy zero1
[ "$(statuses onebit)" = "0 0 0" ] || fail "onebit: exits $(statuses onebit): $(cat "$tmp/onebit"/err.*)"
[ "$(hash_of "$tmp/onebit/out.0")" = "$want" ] || fail "onebit zero1: not the threads backend's onebit ddp bits"

# 2. Survivors, ddp: rank 2 of 4 killed (SIGKILL, DISTOPT_FAULT=kill) or
# stopped (SIGSTOP, stall) after step 5. The three others finish at world 3
# with the bits of a run checkpointed at step 5 and resumed at world 3; the
# metrics and the summary record the change; seconds lost: a killed rank
# about 1 s (its heartbeat falls silent), a stopped one the time-out + 1 s.
"$bin" "${sv[@]}" --world 4 --max-steps 5 --checkpoint-dir "$tmp/ck5" >/dev/null 2>"$tmp/err" || fail "checkpoint run: $(cat "$tmp/err")"
want=$("$bin" "${sv[@]}" --max-steps 12 --world 3 --checkpoint-dir "$tmp/ck5" --resume 2>"$tmp/err" | tail -n 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])') || fail "resumed run: $(cat "$tmp/err")"
for fault in kill:2:5 stall:2:5 kill:0:5; do
  name=sv-${fault//:/-}
  lost=${fault#*:}; lost=${lost%%:*}
  reporter=$([ "$lost" = 0 ] && echo 1 || echo 0)
  if [ "${fault%%:*}" = stall ]; then  # the stopped process is killed once the others are done
    ( for i in $(seq 600); do [ -s "$tmp/$name/out.$reporter" ] && break; sleep 0.05; done
      kill -9 "$(cat "$tmp/$name/pid.2")" 2>/dev/null ) &
  fi
  gloo_run "$name" 4 DISTOPT_FAULT=$fault -- "${sv[@]}" --max-steps 12 --on-rank-failure continue \
    --comm-timeout $timeout --metrics "$tmp/$name/m.jsonl"
  wait
  want_status=$([ "$lost" = 0 ] && echo "137 0 0 0" || echo "0 0 137 0")
  [ "$(statuses "$name")" = "$want_status" ] || fail "$fault: exits $(statuses "$name"), want $want_status: $(cat "$tmp/$name"/err.*)"
  grep -q "^distopt: rank(s) $lost lost after step 5; 3 ranks go on from step 5 (" "$tmp/$name/err.$reporter" \
    || fail "$fault: no membership line: $(cat "$tmp/$name/err.$reporter")"
  # A killed rank's temporary metrics are removed by the reporter; a
  # stopped one's (its process still exists then) by the next run.
  left=$(ls "$tmp/$name" | grep '\.tmp\.')
  [ "${fault%%:*}" = stall ] && left=$(echo "$left" | grep -v "^m.jsonl.tmp.$(cat "$tmp/$name/pid.2")\$")
  [ -z "$left" ] || fail "$fault: temporary files left: $left"
  python3 - "$tmp/$name/out.$reporter" "$tmp/$name/m.jsonl" "$want" "$fault" "$lost" "$timeout" <<'PY' || fail "$fault: summary or metrics"
import json, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert s["param_hash"] == sys.argv[3], (s["param_hash"], sys.argv[3])
assert s["steps"] == 12 and s["membership_changes"] == 1 and s["world_at_end"] == 3, s
assert s["backend"] == "gloo", s
m = [r for r in map(json.loads, open(sys.argv[2])) if r["kind"] == "membership"]
assert len(m) == 1 and m[0]["step"] == 5 and m[0]["lost"] == [int(sys.argv[5])] and m[0]["world"] == 3, m
# Every step once, also where rank 0 was lost: the promoted one's record
# holds the steps before its promotion.
steps = [r["step"] for r in map(json.loads, open(sys.argv[2])) if r["kind"] == "step"]
assert steps == list(range(1, 13)), steps
t = float(sys.argv[6])
if sys.argv[4].startswith("stall"):
    assert t <= s["seconds_lost"] <= t + 2, s["seconds_lost"]
else:
    assert s["seconds_lost"] <= 2, s["seconds_lost"]
PY
done

# 3. zero2: rank 2 killed after step 6, checkpoints every 4 steps (on
# disk, or kept in memory: --memory-checkpoint): the survivors go back to
# step 4 and end with the bits of a run resumed from that checkpoint at
# world 3.
z=("${sv[@]}" --strategy zero2)
"$bin" "${z[@]}" --world 4 --max-steps 4 --checkpoint-dir "$tmp/zero2-ck" >/dev/null 2>"$tmp/err" || fail "zero2 checkpoint run: $(cat "$tmp/err")"
want=$("$bin" "${z[@]}" --world 3 --max-steps 12 --checkpoint-dir "$tmp/zero2-ck" --resume 2>"$tmp/err" | tail -n 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])') || fail "zero2 resumed run: $(cat "$tmp/err")"
for strategy in zero2 zero2-memory; do
  where=(--checkpoint-dir "$tmp/$strategy/ck")
  [ $strategy = zero2-memory ] && where=(--memory-checkpoint)
  gloo_run $strategy 4 DISTOPT_FAULT=kill:2:6 -- "${z[@]}" --max-steps 12 --on-rank-failure continue --comm-timeout $timeout \
    "${where[@]}" --checkpoint-every 4
  [ "$(statuses $strategy)" = "0 0 137 0" ] || fail "$strategy: exits $(statuses $strategy): $(cat "$tmp/$strategy"/err.*)"
  grep -q "^distopt: rank(s) 2 lost after step [67]; 3 ranks go on from step 4 (back to the checkpoint of step 4: [23] steps again)" \
    "$tmp/$strategy/err.0" || fail "$strategy: $(cat "$tmp/$strategy/err.0")"
  [ "$(hash_of "$tmp/$strategy/out.0")" = "$want" ] || fail "$strategy: not the bits of the run resumed at world 3"
done
# diloco: rank 2 killed at the start of step 5, in the middle of an outer
# cycle (H = 3); the survivors go on from step 5, each from its own replica,
# with the bits of the same failure on the threads backend.
d=("${sv[@]}" --strategy diloco --sync-every 3 --max-steps 12 --on-rank-failure continue --comm-timeout $timeout)
want=$(DISTOPT_FAULT=fail:2:4 "$bin" "${d[@]}" --world 4 2>"$tmp/err" | tail -n 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])') || fail "diloco on threads: $(cat "$tmp/err")"
gloo_run diloco 4 DISTOPT_FAULT=kill:2:4 -- "${d[@]}"
[ "$(statuses diloco)" = "0 0 137 0" ] || fail "diloco: exits $(statuses diloco): $(cat "$tmp/diloco"/err.*)"
grep -q "^distopt: rank(s) 2 lost after step 5; 3 ranks go on from step 5 ([0-9.]* s lost)" "$tmp/diloco/err.0" \
  || fail "diloco: $(cat "$tmp/diloco/err.0")"
[ "$(hash_of "$tmp/diloco/out.0")" = "$want" ] || fail "diloco: not the threads backend's bits"

long=("${base[@]}" --train-size 4096 --epochs 3)  # 258 steps (sections 7 and 10)
# 4. Two losses in a row: rank 2 killed after step 5, then rank 1 killed
# from outside (kill -9) once the first change is reported; the last two
# finish at world 2, both changes recorded. (12 epochs, 1032 steps: the
# kill must land while they train, which 258 steps did not always outlast
# once messages went through shared memory.)
( for i in $(seq 600); do grep -q "lost after" "$tmp/two/err.0" 2>/dev/null && break; sleep 0.05; done
  sleep 0.3; kill -9 "$(cat "$tmp/two/pid.1")" ) &
gloo_run two 4 DISTOPT_FAULT=kill:2:5 -- "${base[@]}" --train-size 4096 --epochs 12 --on-rank-failure continue --comm-timeout $timeout \
  --metrics "$tmp/two/m.jsonl"
wait
[ "$(statuses two)" = "0 137 137 0" ] || fail "two losses: exits $(statuses two): $(cat "$tmp/two"/err.*)"
python3 - "$tmp/two/out.0" "$tmp/two/m.jsonl" <<'PY' || fail "two losses: summary or metrics: $(cat "$tmp/two/err.0")"
import json, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert s["membership_changes"] == 2 and s["world_at_end"] == 2 and s["steps"] == 1032, s
m = [r for r in map(json.loads, open(sys.argv[2])) if r["kind"] == "membership"]
assert [(r["world_before"], r["world"], r["lost"]) for r in m] == [(4, 3, [2]), (3, 2, [1])], m
PY

# 5. A minority stops: one survivor of two.
gloo_run minority 2 DISTOPT_FAULT=kill:1:5 -- "${sv[@]}" --max-steps 12 --on-rank-failure continue --comm-timeout $timeout
[ "$(statuses minority)" = "2 137" ] || fail "minority: exits $(statuses minority)"
grep -q "only 1 of the 2 ranks .* more than half of its ranks (no split brain)" "$tmp/minority/err.0" \
  || fail "minority: $(cat "$tmp/minority/err.0")"

# 6. Without --on-rank-failure continue: every other process ends at once,
# naming the lost rank.
gloo_run stop 4 DISTOPT_FAULT=kill:2:5 -- "${sv[@]}" --max-steps 12 --comm-timeout $timeout
[ "$(statuses stop)" = "2 2 137 2" ] || fail "stop: exits $(statuses stop)"
# (Each names the first peer it found gone: rank 2, or one that ended for it.)
for r in 0 1 3; do
  grep -q "^distopt: error (rank $r): .* on rank $r: lost rank [0-9] (gloo: " "$tmp/stop/err.$r" || fail "stop: rank $r: $(cat "$tmp/stop/err.$r")"
done
cat "$tmp/stop/err.0" "$tmp/stop/err.1" "$tmp/stop/err.3" | grep -q "lost rank 2" || fail "stop: nobody names rank 2"
[ "$(echo "$(cat "$tmp/stop/seconds") < $timeout" | bc)" = 1 ] || fail "stop: took $(cat "$tmp/stop/seconds") s"

# 7. Joins (--join DIR): a process started with the run's flags is admitted
# between two steps and the run goes on at world 4 with the bits of a run
# checkpointed at that step and resumed at world 4 -- into a world of 3,
# and into one that lost rank 2 of 4 (ddp; zero2 there: back to the start,
# no checkpoint yet, then admitted after the step its checkpoint records,
# on disk or kept in memory: zero2mem, the joiner taking its part of the
# survivors' checkpoint in memory). diloco admits a new rank only at the
# end of an outer cycle.
j=("${long[@]}" --on-rank-failure continue --comm-timeout 10)
# ddp-tcp: ddp-3 through rank 0's TCP store (--rendezvous tcp://...).
for case in ddp-3 ddp-tcp ddp-lost zero2-lost zero2mem-lost diloco-3; do
  extra=(); n=3; fault=; at="$tmp/$case/rv"; rv=
  [ $case = ddp-tcp ] && { rv="tcp://127.0.0.1:$(free_port)"; at=$rv; }
  case $case in
    *-lost) n=4; fault=DISTOPT_FAULT=kill:2:5 ;;
  esac
  [ "${case%%-*}" = zero2 ] && extra=(--strategy zero2 --checkpoint-dir "$tmp/$case/ck" --checkpoint-every 100)
  [ "${case%%-*}" = zero2mem ] && extra=(--strategy zero2 --memory-checkpoint --checkpoint-every 100)
  [ "${case%%-*}" = diloco ] && extra=(--strategy diloco --sync-every 40)
  mkdir -p "$tmp/$case"
  ( if [ -n "$fault" ]; then
      for i in $(seq 600); do grep -q "lost after" "$tmp/$case/err.0" 2>/dev/null && break; sleep 0.05; done
    elif [ -n "$rv" ]; then
      for i in $(seq 600); do store_has "$rv" published/config && break; sleep 0.05; done
    else
      for i in $(seq 600); do [ -s "$tmp/$case/rv/published.config" ] && break; sleep 0.05; done
    fi
    "$bin" "${j[@]}" "${extra[@]}" --join "$at" >"$tmp/$case/out.join" 2>"$tmp/$case/err.join"
    echo $? >"$tmp/$case/status.join" ) &
  rv=$rv gloo_run "$case" $n ${fault:+"$fault"} -- "${j[@]}" "${extra[@]}" --metrics "$tmp/$case/m.jsonl"
  wait
  [ "$(cat "$tmp/$case/status.join")" = 0 ] || fail "join $case: the joiner: $(cat "$tmp/$case/err.join")"
  step=$(python3 - "$tmp/$case/out.0" "$tmp/$case/m.jsonl" <<'PY'
import json, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert s["world_at_end"] == 4 and s["steps"] == 258, s
m = [r for r in map(json.loads, open(sys.argv[2])) if r["kind"] == "membership"]
assert m[-1]["joined"] == [3] and m[-1]["lost"] == [] and m[-1]["world"] == 4 and m[-1]["world_before"] == 3, m
print(m[-1]["step"])
PY
) || { fail "join $case: summary or metrics: $(cat "$tmp/$case/err.0")"; continue; }
  grep -q "^distopt: rank(s) 3 joined after step $step; 4 ranks go on from step $step (" "$tmp/$case/err.0" \
    || fail "join $case: no line: $(cat "$tmp/$case/err.0")"
  if [ "${case%%-*}" = diloco ]; then  # admitted only where an outer cycle ends, taking rank 0's state
    [ $((step % 40)) = 0 ] || fail "join $case: admitted after step $step, inside an outer cycle of 40"
    continue
  fi
  # The same run on the threads backend: world 3 to that step, resumed at 4.
  ref=("${base[@]}" --train-size 4096 --epochs 3)
  [ "${case%%-*}" = zero2 ] || [ "${case%%-*}" = zero2mem ] && ref+=(--strategy zero2)
  # (ddp-lost: world 4 to step 5, where rank 2 was lost, then world 3.)
  if [ "$case" = ddp-lost ]; then
    "$bin" "${ref[@]}" --world 4 --max-steps 5 --checkpoint-dir "$tmp/$case/ref" >/dev/null 2>&1
    "$bin" "${ref[@]}" --world 3 --max-steps "$step" --checkpoint-dir "$tmp/$case/ref" --resume >/dev/null 2>&1
  else
    "$bin" "${ref[@]}" --world 3 --max-steps "$step" --checkpoint-dir "$tmp/$case/ref" --checkpoint-every 100 >/dev/null 2>&1
  fi
  want=$("$bin" "${ref[@]}" --world 4 --max-steps 258 --checkpoint-dir "$tmp/$case/ref" --resume 2>/dev/null | tail -n 1 |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
  [ "$(hash_of "$tmp/$case/out.0")" = "$want" ] || fail "join $case: not the bits of the run resumed at world 4 from step $step"
done

# 7b. A rank lost in the step where a process waits to join (diloco, at an
# outer cycle's end, H = 80: rank 2 killed after step 80 with the joiner's
# request pending, the run held until it is): the others form the group of
# the survivors and admit no one (some may have been admitting it, others
# shrinking); the joiner waits on and is admitted at the next cycle's end.
case=lost-while-joining
mkdir -p "$tmp/$case"
jd=("${j[@]}" --strategy diloco --sync-every 80)
( for i in $(seq 600); do [ -s "$tmp/$case/rv/published.config" ] && [ -s "$tmp/$case/pid.3" ] && break; sleep 0.01; done
  for r in 0 1 2 3; do kill -STOP "$(cat "$tmp/$case/pid.$r")"; done
  "$bin" "${jd[@]}" --join "$tmp/$case/rv" >"$tmp/$case/out.join" 2>"$tmp/$case/err.join" &
  joiner=$!
  for i in $(seq 600); do [ -e "$tmp/$case/rv/join.0" ] && break; sleep 0.01; done
  for r in 0 1 2 3; do kill -CONT "$(cat "$tmp/$case/pid.$r")"; done
  wait $joiner
  echo $? >"$tmp/$case/status.join" ) &
gloo_run $case 4 DISTOPT_FAULT=kill:2:80 -- "${jd[@]}" --metrics "$tmp/$case/m.jsonl"
wait
[ "$(statuses $case)" = "0 0 137 0" ] || fail "$case: exits $(statuses $case): $(cat "$tmp/$case"/err.*)"
[ "$(cat "$tmp/$case/status.join")" = 0 ] || fail "$case: the joiner: $(cat "$tmp/$case/err.join")"
python3 - "$tmp/$case/out.0" "$tmp/$case/m.jsonl" <<'PY' || fail "$case: summary or metrics: $(cat "$tmp/$case/err.0")"
import json, sys
s = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
assert s["world_at_end"] == 4 and s["steps"] == 258 and s["membership_changes"] == 2, s
m = [(r["step"], r["world_before"], r["world"], r["lost"], r["joined"])
     for r in map(json.loads, open(sys.argv[2])) if r["kind"] == "membership"]
assert m == [(80, 4, 3, [2], []), (160, 3, 4, [], [3])], m
PY

# 7c. A run that goes on after losses and then diverges: the process that
# holds rank 0 then (rank 1 here, rank 0 was killed after step 3) names the
# step, keeps the metrics of every step and removes the lost one's
# temporary file; every survivor ends with status 4.
gloo_run diverges 4 DISTOPT_FAULT=kill:0:3 -- "${sv[@]}" --max-steps 12 --on-rank-failure continue --comm-timeout $timeout \
  --optimizer sgd --lr 1000 --warmup-steps 10 --metrics "$tmp/diverges/m.jsonl"
[ "$(statuses diverges)" = "137 4 4 4" ] || fail "diverges: exits $(statuses diverges): $(cat "$tmp/diverges"/err.*)"
grep -q "^distopt: error: step [0-9]*: the loss is nan" "$tmp/diverges/err.1" || fail "diverges: $(cat "$tmp/diverges/err.1")"
! grep -q "error" "$tmp/diverges/err.2" "$tmp/diverges/err.3" || fail "diverges: another rank printed the error"
python3 - "$tmp/diverges/m.jsonl" <<'PY' || fail "diverges: metrics"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r["step"] for r in rows if r["kind"] == "step"]
assert steps == list(range(1, len(steps) + 1)) and len(steps) > 3 and rows[-1]["loss"] is None, steps
PY
[ -z "$(ls "$tmp/diverges" | grep '\.tmp\.')" ] || fail "diverges: temporary files left: $(ls "$tmp/diverges")"

# 8. Bad input: one line each.
b=("${sv[@]}" --max-steps 3 --backend gloo --world 2)
expect_error 2 "--backend gloo needs --world N, --rank R (0 .. N-1) and --rendezvous DIR" -- "${b[@]}" --rendezvous "$tmp/b1"
expect_error 2 "--rank 2 is not a rank of --world 2 (0 .. 1)" -- "${b[@]}" --rank 2 --rendezvous "$tmp/b1"
expect_error 2 "--rank, --rendezvous and --gloo-host are for --backend gloo" -- "${sv[@]}" --rank 1
expect_error 2 "--rendezvous $tmp/plain-ddp/rv: an earlier run ended in this directory" -- "${b[@]}" --rank 0 --rendezvous "$tmp/plain-ddp/rv"
expect_error 2 "rendezvous: timed out after 1 s waiting for rank(s) 1 to start in $tmp/b2" -- "${b[@]}" --rank 0 --rendezvous "$tmp/b2" --comm-timeout 1
expect_error 2 "the host no.such.host.invalid has no address here" -- "${b[@]}" --rank 0 --rendezvous "$tmp/b3" --gloo-host no.such.host.invalid
expect_error 2 "--on-rank-failure continue: --strategy adpsgd (asynchronous pairs) cannot go on" -- "${b[@]}" --rank 0 --rendezvous "$tmp/b4" --strategy adpsgd --on-rank-failure continue --checkpoint-dir "$tmp/b4ck"
DISTOPT_FAULT=kill:1:1 expect_error 2 "DISTOPT_FAULT kill:RANK:STEP needs a process per rank" -- "${sv[@]}" --world 2 --max-steps 3
expect_error 2 "--join $tmp/ddp-3/rv: this process has --lr 0.01, the run the default" -- "${j[@]}" --lr 0.01 --join "$tmp/ddp-3/rv"
expect_error 2 "--join $tmp/nothing: no run has published its configuration there" -- "${j[@]}" --join "$tmp/nothing"
expect_error 2 "--join: pass --on-rank-failure continue" -- "${long[@]}" --join "$tmp/ddp-3/rv"
expect_error 2 "--join RENDEZVOUS takes no --rank, --rendezvous or --world" -- "${j[@]}" --world 2 --join "$tmp/ddp-3/rv"

# 9. Started by srun or torchrun (their variables set as they set them): no
# --backend, --world, --rank or --rendezvous; the threads backend's bits;
# the rendezvous a directory of the run's own under $TMPDIR.
want=$("$bin" "${sv[@]}" --world 3 --max-steps 12 2>/dev/null | tail -n 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
launched=1 gloo_run srun 3 TMPDIR="$tmp/srun" SLURM_PROCID=@R@ SLURM_LOCALID=@R@ SLURM_STEP_NUM_TASKS=3 \
  SLURM_STEP_NUM_NODES=1 SLURM_STEP_NODELIST="node[07-09]" SLURM_JOB_ID=4242 SLURM_STEP_ID=0 -- "${sv[@]}" --max-steps 12
[ "$(statuses srun)" = "0 0 0" ] || fail "srun: exits $(statuses srun): $(cat "$tmp/srun"/err.*)"
[ "$(hash_of "$tmp/srun/out.0")" = "$want" ] || fail "srun: not the threads backend's bits"
grep -q "started by srun as 3 processes: using --backend gloo" "$tmp/srun/err.0" || fail "srun: $(cat "$tmp/srun/err.0")"
ls -d "$tmp/srun"/distopt-srun-4242.0-* >/dev/null 2>&1 || fail "srun: no rendezvous under TMPDIR: $(ls "$tmp/srun")"
launched=1 gloo_run torchrun 3 TMPDIR="$tmp/torchrun" RANK=@R@ LOCAL_RANK=@R@ WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 \
  MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 TORCHELASTIC_RUN_ID=t1 -- "${sv[@]}" --max-steps 12
[ "$(statuses torchrun)" = "0 0 0" ] || fail "torchrun: exits $(statuses torchrun): $(cat "$tmp/torchrun"/err.*)"
[ "$(hash_of "$tmp/torchrun/out.0")" = "$want" ] || fail "torchrun: not the threads backend's bits"
# Bad input, one line each.
SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=2 SLURM_STEP_NUM_NODES=1 expect_error 2 \
  "--world 4 disagrees with SLURM_STEP_NUM_TASKS=2 (the processes srun started)" -- "${sv[@]}" --max-steps 3 --world 4
SLURM_PROCID=1 SLURM_STEP_NUM_TASKS=2 SLURM_STEP_NUM_NODES=2 expect_error 2 \
  "--backend gloo under srun across 2 machines serves its rendezvous at MASTER_ADDR:MASTER_PORT, and SLURM_STEP_NODELIST (or MASTER_ADDR) is not set" \
  -- "${sv[@]}" --max-steps 3
SLURM_PROCID=2 SLURM_STEP_NUM_TASKS=2 expect_error 2 \
  "SLURM_PROCID=2 is not a rank of SLURM_STEP_NUM_TASKS=2 (0 .. 1)" -- "${sv[@]}" --max-steps 3
SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=2 SLURM_STEP_NODELIST="node[" expect_error 2 \
  "the SLURM node list 'node\[' has a '\[' not followed by a number" -- "${sv[@]}" --max-steps 3
RANK=x WORLD_SIZE=2 expect_error 2 "RANK=x is not a whole number" -- "${sv[@]}" --max-steps 3
SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=2 expect_error 2 "--backend threads under srun (SLURM_STEP_NUM_TASKS=2)" -- \
  "${sv[@]}" --max-steps 3 --backend threads

# 10. Across machines without a shared directory: rank 0's TCP store
# (docs/cluster.md, "Rendezvous"). Given by hand, and chosen under srun
# across machines (MASTER_ADDR and MASTER_PORT; here every "machine" is
# this one) and under torchrun whose agent holds MASTER_PORT (the port
# after it): the threads backend's bits.
# Every message on TCP, as between machines (DISTOPT_GLOO_SHM=0: no
# shared-memory rings).
export DISTOPT_GLOO_SHM=0
rv="tcp://127.0.0.1:$(free_port)" gloo_run tcp 3 -- "${sv[@]}" --max-steps 12
[ "$(statuses tcp)" = "0 0 0" ] || fail "tcp: exits $(statuses tcp): $(cat "$tmp/tcp"/err.*)"
[ "$(hash_of "$tmp/tcp/out.0")" = "$want" ] || fail "tcp: not the threads backend's bits"
port=$(free_port)
launched=1 gloo_run srun-nodes 3 SLURM_PROCID=@R@ SLURM_LOCALID=0 SLURM_STEP_NUM_TASKS=3 SLURM_STEP_NUM_NODES=3 \
  SLURM_STEP_NODELIST="node[07-09]" SLURM_JOB_ID=4243 SLURM_STEP_ID=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
  -- "${sv[@]}" --max-steps 12
[ "$(statuses srun-nodes)" = "0 0 0" ] || fail "srun, 3 nodes: exits $(statuses srun-nodes): $(cat "$tmp/srun-nodes"/err.*)"
[ "$(hash_of "$tmp/srun-nodes/out.0")" = "$want" ] || fail "srun, 3 nodes: not the threads backend's bits"
grep -q "the rendezvous is rank 0's store at tcp://127.0.0.1:$port" "$tmp/srun-nodes/err.0" \
  || fail "srun, 3 nodes: $(cat "$tmp/srun-nodes/err.0")"
port=$(free_port)
python3 -c 'import socket, sys, time; s = socket.socket(); s.bind(("", int(sys.argv[1]))); s.listen(); time.sleep(3600)' \
  "$port" & agent=$!
launched=1 gloo_run torchrun-nodes 2 RANK=@R@ LOCAL_RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
  TORCHELASTIC_USE_AGENT_STORE=True -- "${sv[@]}" --max-steps 12 --strategy zero2
want2=$("$bin" "${sv[@]}" --world 2 --max-steps 12 --strategy zero2 2>/dev/null | tail -n 1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["param_hash"])')
[ "$(statuses torchrun-nodes)" = "0 0" ] || fail "torchrun, agent store: exits $(statuses torchrun-nodes): $(cat "$tmp/torchrun-nodes"/err.*)"
[ "$(hash_of "$tmp/torchrun-nodes/out.0")" = "$want2" ] || fail "torchrun, agent store: not the threads backend's bits"
grep -q "the rendezvous is rank 0's store at tcp://127.0.0.1:$((port + 1))" "$tmp/torchrun-nodes/err.0" \
  || fail "torchrun, agent store: $(cat "$tmp/torchrun-nodes/err.0")"
# A lost rank: the survivors go on; the store's own process (rank 0)
# lost: each of the others ends in one line naming the store, at once.
rv="tcp://127.0.0.1:$(free_port)" gloo_run tcp-lost 3 DISTOPT_FAULT=kill:1:20 -- "${long[@]}" --on-rank-failure continue \
  --comm-timeout $timeout
[ "$(statuses tcp-lost)" = "0 137 0" ] || fail "tcp, rank 1 lost: exits $(statuses tcp-lost): $(cat "$tmp/tcp-lost"/err.*)"
tail -n 1 "$tmp/tcp-lost/out.0" | python3 -c 'import json, sys; s = json.load(sys.stdin); assert s["world_at_end"] == 2, s' \
  || fail "tcp, rank 1 lost: $(cat "$tmp/tcp-lost/err.0")"
# (When rank 0's process ended, seen from outside, to the others' end.)
mkdir -p "$tmp/tcp-lost0"
( for i in $(seq 2000); do [ -s "$tmp/tcp-lost0/pid.0" ] && break; sleep 0.01; done
  while kill -0 "$(cat "$tmp/tcp-lost0/pid.0")" 2>/dev/null; do sleep 0.01; done
  date +%s.%N >"$tmp/tcp-lost0/died" ) &
watcher=$!
rv="tcp://127.0.0.1:$(free_port)" gloo_run tcp-lost0 3 DISTOPT_FAULT=kill:0:20 -- "${long[@]}" --on-rank-failure continue \
  --comm-timeout $timeout
ended=$(date +%s.%N)
wait $watcher
[ "$(statuses tcp-lost0)" = "137 2 2" ] || fail "tcp, rank 0 lost: exits $(statuses tcp-lost0): $(cat "$tmp/tcp-lost0"/err.*)"
for r in 1 2; do
  [ "$(wc -l <"$tmp/tcp-lost0/err.$r")" = 1 ] && grep -q "^distopt: error (rank $r): rendezvous tcp://127.0.0.1:[0-9]*: the store hung up (the store's process, rank 0's, is gone?)$" "$tmp/tcp-lost0/err.$r" \
    || fail "tcp, rank 0 lost: rank $r: $(cat "$tmp/tcp-lost0/err.$r")"
done
[ "$(echo "$ended - $(cat "$tmp/tcp-lost0/died") < $timeout" | bc)" = 1 ] ||
  fail "tcp, rank 0 lost: the others ended $(echo "$ended - $(cat "$tmp/tcp-lost0/died")" | bc) s after it"
# Bad input, one line each, within --comm-timeout: the store's port taken
# (by the "agent" above), no store answering.
expect_error 2 "rendezvous: cannot serve the store on port $port: Address already in use (another run's store" -- \
  "${b[@]}" --rank 0 --rendezvous "tcp://127.0.0.1:$port"
kill $agent
nobody=$(free_port)
t0=$(date +%s.%N)
expect_error 2 "rendezvous tcp://127.0.0.1:$nobody: no store answered within 2 s" -- "${b[@]}" --rank 1 \
  --rendezvous "tcp://127.0.0.1:$nobody" --comm-timeout 2
[ "$(echo "$(date +%s.%N) - $t0 < 4" | bc)" = 1 ] || fail "no store: not within --comm-timeout 2"
expect_error 2 "--rendezvous tcp://127.0.0.1:0: the port is not a number from 1 to 65535" -- "${b[@]}" --rank 1 \
  --rendezvous tcp://127.0.0.1:0
finish cli.gloo

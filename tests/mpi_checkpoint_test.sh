#!/usr/bin/env bash
# Checkpoints under a real mpirun (docs/formats.md): resumed at the same
# world, at another world and strategy, and across backends.
set -u
mpiexec=$1
bin=$2
source "$(dirname "$0")/check_lib.sh"
hash_of() { tail -n 1 "$1" | grep -o '"param_hash": "[0-9a-f]*"'; }
# Checkpoints under mpirun: each process writes its rank's file, rank 0 the
# manifest. Saved at np 2 (zero2) after 7 steps; resumed at np 2 it gives
# the uninterrupted run's bits; resumed at np 3 (zero3) under mpirun and at
# 3 threads (ddp) from copies of the same checkpoint, the same bits as each
# other; saved at 4 threads and resumed under mpirun at np 4.
ck=(train --data synthetic --train-size 1024 --test-size 256 --epochs 2 --batch-size 96 --optimizer lamb --lr 0.003
    --seed 3 --progress none --json --strategy zero2)
"$bin" "${ck[@]}" --world 2 >"$tmp/straight" 2>"$tmp/err" || fail "threads straight: $(cat "$tmp/err")"
timeout "$(scaled 120)" "$mpiexec" -n 2 --oversubscribe "$bin" "${ck[@]}" --backend mpi --max-steps 7 --checkpoint-dir "$tmp/mck" \
  >/dev/null 2>"$tmp/err" || fail "mpi checkpointed run exited $?: $(tail -n 3 "$tmp/err")"
[ -f "$tmp/mck/step-000000000007/manifest.json" ] && [ -f "$tmp/mck/step-000000000007/rank1.safetensors" ] \
  || fail "mpi checkpoint: $(ls -R "$tmp/mck")"
cp -r "$tmp/mck" "$tmp/mck3"
cp -r "$tmp/mck" "$tmp/mckt"
timeout "$(scaled 120)" "$mpiexec" -n 2 --oversubscribe "$bin" train --resume --checkpoint-dir "$tmp/mck" --max-steps 0 --backend mpi \
  >"$tmp/mpi" 2>"$tmp/err" || fail "mpi --resume np 2 exited $?: $(tail -n 3 "$tmp/err")"
[ -n "$(hash_of "$tmp/mpi")" ] && [ "$(hash_of "$tmp/straight")" = "$(hash_of "$tmp/mpi")" ] ||
  fail "mpi resume np 2: $(hash_of "$tmp/mpi") vs uninterrupted $(hash_of "$tmp/straight")"
timeout "$(scaled 120)" "$mpiexec" -n 3 --oversubscribe "$bin" train --resume --checkpoint-dir "$tmp/mck3" --max-steps 0 --backend mpi \
  --world 3 --strategy zero3 >"$tmp/mpi3" 2>"$tmp/err" || fail "mpi --resume np 3 exited $?: $(tail -n 3 "$tmp/err")"
"$bin" train --resume --checkpoint-dir "$tmp/mckt" --max-steps 0 --world 3 --strategy ddp --backend threads \
  >"$tmp/t3" 2>"$tmp/err" || fail "threads --resume at 3 exited $?: $(cat "$tmp/err")"
[ -n "$(hash_of "$tmp/mpi3")" ] && [ "$(hash_of "$tmp/mpi3")" = "$(hash_of "$tmp/t3")" ] ||
  fail "one checkpoint: mpi zero3 np 3 $(hash_of "$tmp/mpi3") vs threads ddp 3 $(hash_of "$tmp/t3")"
"$bin" "${ck[@]}" --world 4 --max-steps 5 --checkpoint-dir "$tmp/tck" >/dev/null 2>&1 || fail "threads checkpoint at 4"
"$bin" "${ck[@]}" --world 4 >"$tmp/straight4" 2>/dev/null || fail "threads straight at 4"
timeout "$(scaled 120)" "$mpiexec" -n 4 --oversubscribe "$bin" train --resume --checkpoint-dir "$tmp/tck" --max-steps 0 --backend mpi \
  >"$tmp/mpi4" 2>"$tmp/err" || fail "mpi --resume np 4 exited $?: $(tail -n 3 "$tmp/err")"
[ "$(hash_of "$tmp/mpi4")" = "$(hash_of "$tmp/straight4")" ] ||
  fail "threads checkpoint resumed under mpirun np 4: $(hash_of "$tmp/mpi4") vs $(hash_of "$tmp/straight4")"
# A gossip run (osgp: rounds in flight at every checkpoint) saved under
# mpirun at np 4 and resumed at np 4 gives the uninterrupted threads run's
# bits; a threads checkpoint of dpsgd at 2 resumed under mpirun at np 2 too.
gk=(train --data synthetic --train-size 1024 --test-size 256 --epochs 2 --batch-size 96 --seed 3 --progress none --json)
"$bin" "${gk[@]}" --world 4 --strategy osgp --synch-freq 1 >"$tmp/g_straight" 2>"$tmp/err" || fail "osgp straight: $(cat "$tmp/err")"
timeout "$(scaled 120)" "$mpiexec" -n 4 --oversubscribe "$bin" "${gk[@]}" --strategy osgp --synch-freq 1 --backend mpi --max-steps 7 \
  --checkpoint-dir "$tmp/gck" >/dev/null 2>"$tmp/err" || fail "mpi osgp checkpointed run exited $?: $(tail -n 3 "$tmp/err")"
timeout "$(scaled 120)" "$mpiexec" -n 4 --oversubscribe "$bin" train --resume --checkpoint-dir "$tmp/gck" --max-steps 0 --backend mpi \
  >"$tmp/g_mpi" 2>"$tmp/err" || fail "mpi osgp --resume exited $?: $(tail -n 3 "$tmp/err")"
[ -n "$(hash_of "$tmp/g_mpi")" ] && [ "$(hash_of "$tmp/g_mpi")" = "$(hash_of "$tmp/g_straight")" ] ||
  fail "osgp saved and resumed under mpirun np 4: $(hash_of "$tmp/g_mpi") vs threads $(hash_of "$tmp/g_straight")"
"$bin" "${gk[@]}" --world 2 --strategy dpsgd >"$tmp/d_straight" 2>/dev/null || fail "dpsgd straight"
"$bin" "${gk[@]}" --world 2 --strategy dpsgd --max-steps 9 --checkpoint-dir "$tmp/dck" >/dev/null 2>&1 || fail "dpsgd checkpoint"
timeout "$(scaled 120)" "$mpiexec" -n 2 --oversubscribe "$bin" train --resume --checkpoint-dir "$tmp/dck" --max-steps 0 --backend mpi \
  >"$tmp/d_mpi" 2>"$tmp/err" || fail "mpi dpsgd --resume exited $?: $(tail -n 3 "$tmp/err")"
[ -n "$(hash_of "$tmp/d_mpi")" ] && [ "$(hash_of "$tmp/d_mpi")" = "$(hash_of "$tmp/d_straight")" ] ||
  fail "dpsgd threads checkpoint resumed under mpirun np 2: $(hash_of "$tmp/d_mpi") vs $(hash_of "$tmp/d_straight")"
# Quantized optimizer state (int8) under mpirun: zero3 at np 3 gives the
# threads ddp run's bits at 3; its checkpoint (codes as values and scales),
# saved at np 3 under zero3 and resumed at np 2 under zero1 and at 2 threads
# under ddp, gives the same bits both ways.
q=(train --data synthetic --train-size 1024 --test-size 256 --epochs 1 --batch-size 96 --optimizer adamw
   --state-dtype int8 --seed 3 --progress none --json)
"$bin" "${q[@]}" --world 3 --strategy ddp >"$tmp/q_t3" 2>"$tmp/err" || fail "int8 threads ddp: $(cat "$tmp/err")"
timeout "$(scaled 120)" "$mpiexec" -n 3 --oversubscribe "$bin" "${q[@]}" --backend mpi --strategy zero3 >"$tmp/q_m3" \
  2>"$tmp/err" || fail "mpi int8 zero3 exited $?: $(tail -n 3 "$tmp/err")"
[ -n "$(hash_of "$tmp/q_m3")" ] && [ "$(hash_of "$tmp/q_m3")" = "$(hash_of "$tmp/q_t3")" ] ||
  fail "int8: mpi zero3 np 3 $(hash_of "$tmp/q_m3") vs threads ddp 3 $(hash_of "$tmp/q_t3")"
timeout "$(scaled 120)" "$mpiexec" -n 3 --oversubscribe "$bin" "${q[@]}" --backend mpi --strategy zero3 --max-steps 5 \
  --checkpoint-dir "$tmp/qck" >/dev/null 2>"$tmp/err" || fail "mpi int8 checkpointed run exited $?: $(tail -n 3 "$tmp/err")"
cp -r "$tmp/qck" "$tmp/qckt"
timeout "$(scaled 120)" "$mpiexec" -n 2 --oversubscribe "$bin" train --resume --checkpoint-dir "$tmp/qck" --max-steps 0 \
  --backend mpi --world 2 --strategy zero1 >"$tmp/q_m2" 2>"$tmp/err" || fail "mpi int8 --resume np 2 exited $?: $(tail -n 3 "$tmp/err")"
"$bin" train --resume --checkpoint-dir "$tmp/qckt" --max-steps 0 --world 2 --strategy ddp --backend threads \
  >"$tmp/q_t2" 2>"$tmp/err" || fail "threads int8 --resume at 2 exited $?: $(cat "$tmp/err")"
[ -n "$(hash_of "$tmp/q_m2")" ] && [ "$(hash_of "$tmp/q_m2")" = "$(hash_of "$tmp/q_t2")" ] ||
  fail "int8 checkpoint: mpi zero1 np 2 $(hash_of "$tmp/q_m2") vs threads ddp 2 $(hash_of "$tmp/q_t2")"
finish "mpi checkpoint"

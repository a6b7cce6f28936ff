#!/usr/bin/env bash
# `distopt train` from outside (docs/formats.md): the --json summary,
# metrics and export files, and one-line errors for bad input.
set -u
bin=$1
source "$(dirname "$0")/check_lib.sh"

# A short run on synthetic data: the summary line, metrics and export.
"$bin" train --data synthetic --train-size 2048 --test-size 512 --world 2 --epochs 2 --batch-size 64 \
  --optimizer sgd --lr 0.05 --momentum 0.9 --metrics "$tmp/m.jsonl" --export-params "$tmp/p.safetensors" \
  --json >"$tmp/out" 2>"$tmp/err" || fail "train exited $?: $(cat "$tmp/err")"
/usr/bin/env python3 - "$tmp" <<'PY' || fail "train outputs do not follow the contract"
import json, struct, sys
tmp = sys.argv[1]
s = json.loads(open(tmp + "/out").read().strip().splitlines()[-1])
for k in ("test_accuracy", "test_loss", "train_loss", "steps", "param_hash", "samples_per_s", "memory_per_rank"):
    assert k in s, k
assert s["steps"] == 64, s["steps"]
assert len(s["param_hash"]) == 16
m = s["memory_per_rank"]
assert set(m) >= {"params", "grads", "master_params", "optimizer_state"}
# mlp 784-256-128-10 in 64-byte aligned slots, each layer padded to a multiple
# of world * 16 elements (fc3: 1296 -> 1312); sgd momentum: one buffer per parameter.
assert m["params"] == m["grads"] == 4 * 235168, m
assert m["optimizer_state"] >= 4 * 235146, m
lines = [json.loads(l) for l in open(tmp + "/m.jsonl")]
steps = [l for l in lines if l["kind"] == "step"]
epochs = [l for l in lines if l["kind"] == "epoch"]
assert len(steps) == 64 and len(epochs) == 2
assert epochs[-1]["test_accuracy"] == s["test_accuracy"]
raw = open(tmp + "/p.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
assert h["fc1.weight"]["shape"] == [256, 784] and h["fc3.bias"]["dtype"] == "F32"
assert h["__metadata__"]["param_hash"] == s["param_hash"]
assert len(raw) == 8 + n + 4 * 235146
PY
# No temporary files left behind.
[ "$(ls "$tmp" | grep -c tmp)" = 0 ] || fail "temporary files left: $(ls "$tmp")"

# The same run again gives the same parameters (the threads backend is deterministic).
"$bin" train --data synthetic --train-size 2048 --test-size 512 --world 2 --epochs 2 --batch-size 64 \
  --optimizer sgd --lr 0.05 --momentum 0.9 --json --progress none >"$tmp/out2" 2>/dev/null || fail "second run exited $?"
[ "$(tail -n 1 "$tmp/out" | grep -o '"param_hash": "[0-9a-f]*"')" = "$(tail -n 1 "$tmp/out2" | grep -o '"param_hash": "[0-9a-f]*"')" ] \
  || fail "two identical runs gave different parameters"

# CSV metrics.
"$bin" train --data synthetic --train-size 512 --test-size 64 --batch-size 64 --metrics "$tmp/m.csv" --progress none \
  >/dev/null 2>&1 || fail "train --metrics m.csv exited $?"
head -n 1 "$tmp/m.csv" | grep -q '^kind,epoch,step,wall_s,loss,lr' || fail "CSV header: $(head -n 1 "$tmp/m.csv")"
[ "$(grep -c '^step,' "$tmp/m.csv")" = 8 ] || fail "CSV has $(grep -c '^step,' "$tmp/m.csv") step rows, want 8"

# Bad input: one line on stderr, status 2.
expect_error 2 "unknown model 'resnet'" -- train --model resnet --data synthetic
expect_error 2 "unknown optimizer 'adamm'" -- train --optimizer adamm --data synthetic
expect_error 2 "unknown strategy 'zero9'" -- train --strategy zero9 --data synthetic
# Sizes: negative counts, and sizes beyond this machine's memory, are one
# line before anything is allocated (not a wrapped unsigned, not bad_alloc).
expect_error 2 "--batch-size: must be a non-negative integer (got -5)" -- train --batch-size -5 --data synthetic
expect_error 2 "--seed: must be a non-negative integer (got -1)" -- train --seed -1 --data synthetic
expect_error 2 "--max-steps: must be a non-negative integer (got -1)" -- train --max-steps -1 --data synthetic
expect_error 2 "--hidden: must be positive integers (got 0)" -- train --hidden 64,0 --data synthetic
expect_error 2 "--hidden needs .* GB for one layer" -- train --hidden 100000000 --data synthetic
expect_error 2 "--train-size 100000000 and --test-size 2048 need .* GB for the synthetic data" -- \
  train --train-size 100000000 --data synthetic
expect_error 2 "--scheduler: not valid JSON (.*number overflow parsing .1e999.)" -- train --data synthetic \
  --scheduler '{"name": "steplr", "options": {"step_size": 1e999}}'
# A global batch larger than the training set is the whole set (no huge buffer).
"$bin" train --data synthetic --train-size 256 --test-size 64 --batch-size 1000000000000 --progress none \
  >"$tmp/out" 2>"$tmp/err" || fail "train --batch-size 1e12: $(cat "$tmp/err")"
# An IDX file of 100 bytes whose header claims 21M images of 28x28: an error
# naming the truncation, without allocating the 16.5 GB the header promises.
mkdir -p "$tmp/badidx"
python3 - "$tmp/badidx" <<'PY'
import gzip, os, struct, sys
d = sys.argv[1]
head = struct.pack(">BBBBIII", 0, 0, 8, 3, 21000000, 28, 28)
for name in ("train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz"):
    open(os.path.join(d, name), "wb").write(gzip.compress(head + bytes(100 - len(head))))
for name in ("train-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
    open(os.path.join(d, name), "wb").write(gzip.compress(struct.pack(">BBBBI", 0, 0, 8, 1, 1) + b"\0"))
PY
if ! sanitized; then
  (ulimit -v 1500000; "$bin" train --data-dir "$tmp/badidx" --progress none) >"$tmp/out" 2>"$tmp/err"
  status=$?
  [ "$status" = 2 ] || fail "truncated IDX under ulimit -v: exit $status: $(head -c 300 "$tmp/err")"
  grep -q "truncated: header promises 16464000000 bytes of data, file has 84" "$tmp/err" || fail "truncated IDX: $(cat "$tmp/err")"
fi

# Outputs are checked before training and written where the user said.
expect_error 2 "--metrics needs a file name (got an empty one)" -- train --data synthetic --metrics ''
expect_error 2 "--metrics and --export-params both name $tmp/same: give each its own file" -- \
  train --data synthetic --metrics "$tmp/same" --export-params "$tmp/same"
mkdir -p "$tmp/adir"
expect_error 2 "--export-params $tmp/adir: is a folder, not a file" -- train --data synthetic --export-params "$tmp/adir"
expect_error 2 "--metrics $tmp/missing/m.jsonl: cannot create (folder .* is missing or not writable)" -- \
  train --data synthetic --metrics "$tmp/missing/m.jsonl"
mkdir -p "$tmp/real"
ln -sf "$tmp/real/m.jsonl" "$tmp/link.jsonl"
ln -sf "$tmp/real/p.safetensors" "$tmp/link.safetensors"
"$bin" train --data synthetic --train-size 256 --test-size 64 --metrics "$tmp/link.jsonl" \
  --export-params "$tmp/link.safetensors" --progress none >"$tmp/out" 2>"$tmp/err" || fail "train through links: $(cat "$tmp/err")"
[ -L "$tmp/link.jsonl" ] && [ -L "$tmp/link.safetensors" ] || fail "an output symlink was replaced by a regular file"
[ -s "$tmp/real/m.jsonl" ] && [ -s "$tmp/real/p.safetensors" ] || fail "outputs not written to the links' targets"
ls "$tmp/real" | grep -q tmp && fail "a temporary file was left beside the target: $(ls "$tmp/real")"
expect_error 2 "--swa-lr must be a non-negative number, like --lr (got -1)" -- \
  train --data synthetic --epochs 2 --swa-start 1 --swa-lr -1
# Control characters of the input come back escaped, on one line.
expect_error 2 'unknown model .a\\x0ab.' -- train --data synthetic --model "$(printf 'a\nb')"

# A world the system cannot start (thread stacks beyond a memory limit):
# one line, no abort (not in sanitizer builds: see check_lib.sh).
if ! sanitized; then
  (ulimit -v 700000; "$bin" train --world 400 --batch-size 512 --data synthetic --progress none) >"$tmp/out" 2>"$tmp/err"
  status=$?
  [ "$status" = 2 ] || fail "train --world 400 under ulimit -v: exit $status, want 2: $(head -c 300 "$tmp/err")"
  [ "$(wc -l <"$tmp/err")" = 1 ] || fail "train --world 400 under ulimit -v: not one line: $(head -c 300 "$tmp/err")"
  grep -q "cannot start 400 ranks as threads" "$tmp/err" || fail "train --world 400: $(cat "$tmp/err")"
fi
# Gossip options: with the strategies that use them only, and checked.
expect_error 2 "\-\-topology applies to the gossip strategies (sgp, osgp, dpsgd, adpsgd, slowmo, diloco), not \-\-strategy ddp" -- \
  train --data synthetic --topology ring
expect_error 2 "\-\-synch-freq applies to \-\-strategy osgp and adpsgd, not sgp" -- train --data synthetic --strategy sgp --synch-freq 1
expect_error 2 "\-\-slowmo-lr applies to \-\-strategy slowmo, not sgp" -- train --data synthetic --strategy sgp --slowmo-lr 2
expect_error 2 "\-\-sync-every applies to \-\-strategy diloco, not slowmo" -- train --data synthetic --strategy slowmo --sync-every 5
expect_error 2 "\-\-sync-every must be at least 1 (got 0)" -- train --data synthetic --strategy diloco --sync-every 0
expect_error 2 "\-\-outer-optimizer: 'foo' is not an optimizer of the library" -- train --data synthetic --strategy diloco \
  --outer-optimizer foo
expect_error 2 "\-\-outer-momentum must be in \[0, 1) (got 1)" -- train --data synthetic --strategy diloco --outer-momentum 1
expect_error 2 "\-\-outer-lr must be a positive number (got 0)" -- train --data synthetic --strategy diloco --outer-lr 0
expect_error 2 "\-\-topology applies to the strategies that gossip on a graph, not diloco" -- train --data synthetic \
  --strategy diloco --topology ring
expect_error 2 "\-\-outer-momentum applies to \-\-outer-optimizer sgd (adam keeps its own defaults)" -- train \
  --data synthetic --strategy diloco --outer-optimizer adam --outer-momentum 0.5
# Streaming DiLoCo and compressed pseudo-gradients.
expect_error 2 "\-\-fragments 4: the model has 3 units (a fragment is at least one; at most \-\-fragments 3)" -- train \
  --data synthetic --strategy diloco --fragments 4
expect_error 2 "\-\-fragments must be at least 1 (got 0)" -- train --data synthetic --strategy diloco --fragments 0
expect_error 2 "\-\-fragments 3 is more than \-\-sync-every 2: each fragment syncs at a step of its own in the cycle" -- \
  train --data synthetic --strategy diloco --fragments 3 --sync-every 2
expect_error 2 "\-\-sync-delay must be in \[0, \-\-sync-every) = \[0, 4) (got 4)" -- train --data synthetic \
  --strategy diloco --sync-every 4 --sync-delay 4
expect_error 2 "\-\-fragment-alpha must be in \[0, 1\] (got 1.5)" -- train --data synthetic --strategy diloco \
  --fragment-alpha 1.5
expect_error 2 "\-\-outer-dtype: 'int8' is not f32, bf16, fp8 or int4" -- train --data synthetic --strategy diloco \
  --outer-dtype int8
expect_error 2 "\-\-outer-error-feedback applies to a compressed \-\-outer-dtype (bf16, fp8, int4): f32 loses nothing" \
  -- train --data synthetic --strategy diloco --outer-error-feedback
expect_error 2 "\-\-fragment-carry applies to \-\-sync-delay 1 or more (with 0 no step runs while an average is in flight)" \
  -- train --data synthetic --strategy diloco --fragments 2 --fragment-carry
expect_error 2 "\-\-fragments applies to \-\-strategy diloco, not sgp" -- train --data synthetic --strategy sgp --fragments 2
expect_error 2 "\-\-sync-delay applies to \-\-strategy diloco, not slowmo" -- train --data synthetic --strategy slowmo \
  --sync-delay 1
expect_error 2 "\-\-outer-dtype applies to the gossip strategies (sgp, osgp, dpsgd, adpsgd, slowmo, diloco), not \-\-strategy zero2" \
  -- train --data synthetic --strategy zero2 --outer-dtype int4
expect_error 2 "unknown topology 'hypercube' (known: exponential," -- train --data synthetic --strategy sgp --topology hypercube
expect_error 2 "bipartite-exponential needs an even world size (got 3)" -- train --data synthetic --strategy dpsgd --world 3
expect_error 2 "\-\-peers-per-iteration 2 needs a world of more than 2 ranks (world 2)" -- train --data synthetic \
  --strategy sgp --world 2 --topology exponential-k --peers-per-iteration 2
expect_error 2 "\-\-param-dtype bf16: strategy sgp keeps fp32 parameters" -- train --data synthetic --strategy sgp \
  --param-dtype bf16
# A gossip run: the average model's figures, the consensus distance in the
# summary and in every epoch record.
"$bin" train --data synthetic --train-size 1024 --test-size 256 --world 4 --epochs 2 --strategy sgp --json \
  --metrics "$tmp/g.jsonl" --progress none >"$tmp/out" 2>"$tmp/err" || fail "sgp exited $?: $(cat "$tmp/err")"
/usr/bin/env python3 - "$tmp" <<'PY' || fail "sgp outputs"
import json, sys
tmp = sys.argv[1]
s = json.loads(open(tmp + "/out").read().strip().splitlines()[-1])
assert s["strategy"] == "sgp" and s["test_accuracy"] > 0.2 and s["consensus_distance"] >= 0, s
epochs = [l for l in map(json.loads, open(tmp + "/g.jsonl")) if l["kind"] == "epoch"]
assert len(epochs) == 2 and all(e["consensus_distance"] >= 0 for e in epochs), epochs
PY
# DiLoCo's bytes per sync in the step records: a sync every 4 steps, the
# steps between send only the loss (a few bytes); int4 pseudo-gradients
# send under a sixth of f32's.
for d in f32 int4; do
  "$bin" train --data synthetic --train-size 512 --test-size 64 --batch-size 64 --world 2 --strategy diloco \
    --sync-every 4 --outer-dtype $d --metrics "$tmp/d_$d.jsonl" --progress none >/dev/null 2>"$tmp/err" \
    || fail "diloco --outer-dtype $d exited $?: $(cat "$tmp/err")"
done
/usr/bin/env python3 - "$tmp" <<'PY' || fail "diloco bytes per sync"
import json, sys
tmp = sys.argv[1]
def per_step(d):
    steps = [l for l in map(json.loads, open(f"{tmp}/d_{d}.jsonl")) if l["kind"] == "step"]
    return {s["step"]: s["bytes_sent"] - p["bytes_sent"] for p, s in zip(steps, steps[1:])}
f32, int4 = per_step("f32"), per_step("int4")
assert max(b for k, b in f32.items() if k % 4) < 100, f32
assert min(f32[k] for k in (4, 8)) > 100000, f32
assert all(6 * int4[k] < f32[k] for k in (4, 8)), (int4, f32)
PY
expect_error 2 "--param-dtype: unknown dtype 'fp8' (known: f32, bf16, f16)" -- train --param-dtype fp8 --data synthetic
expect_error 2 "--grad-compression: unknown scheme 'int2' (known: none, bf16, fp16, int8, powersgd, onebit)" -- train --grad-compression int2 \
  --data synthetic
expect_error 2 "\-\-grad-compression bf16: strategy dpsgd sends no gradients (compression is for ddp and zero1-3" \
  -- train --data synthetic --strategy dpsgd --grad-compression bf16
expect_error 2 "\-\-grad-compression fp16 with \-\-param-dtype bf16: the gradients are bf16 on the wire already" \
  -- train --data synthetic --strategy zero1 --grad-compression fp16 --param-dtype bf16
# Compressed gradients: the summary names the scheme, and the bytes sent
# fall by what the reduction saves (ddp: about half of all it sends with
# bf16, about three quarters with int8).
for c in none bf16 int8; do
  "$bin" train --data synthetic --train-size 512 --test-size 64 --world 2 --grad-compression $c --json --progress none \
    >"$tmp/gc_$c" 2>"$tmp/err" || fail "--grad-compression $c exited $?: $(cat "$tmp/err")"
done
/usr/bin/env python3 - "$tmp" <<'PY' || fail "--grad-compression bytes"
import json, sys
tmp = sys.argv[1]
none, bf16, int8 = (json.loads(open(f"{tmp}/gc_{c}").read().strip().splitlines()[-1]) for c in ("none", "bf16", "int8"))
assert none["grad_compression"] == "none" and bf16["grad_compression"] == "bf16", (none, bf16)
assert int8["grad_compression"] == "int8", int8
assert 0.45 < bf16["bytes_sent_per_rank"] / none["bytes_sent_per_rank"] < 0.6, (none, bf16)
assert 0.2 < int8["bytes_sent_per_rank"] / none["bytes_sent_per_rank"] < 0.35, (none, int8)
assert bf16["param_hash"] != none["param_hash"] and int8["param_hash"] != none["param_hash"]
PY
# PowerSGD: rank 2 after 1 uncompressed step of the 4 sends about a quarter
# of none's bytes (the uncompressed step's; the default mlp's matrices at
# rank 2 and its biases whole send 1.5% of the gradient).
"$bin" train --data synthetic --train-size 512 --test-size 64 --world 2 --grad-compression powersgd --powersgd-rank 2 \
  --powersgd-warmup 1 --json --progress none >"$tmp/gc_powersgd" 2>"$tmp/err" || fail "--grad-compression powersgd exited $?: $(cat "$tmp/err")"
/usr/bin/env python3 - "$tmp" <<'PY' || fail "--grad-compression powersgd bytes"
import json, sys
tmp = sys.argv[1]
none, low = (json.loads(open(f"{tmp}/gc_{c}").read().strip().splitlines()[-1]) for c in ("none", "powersgd"))
assert low["grad_compression"] == "powersgd", low
assert 0.25 < low["bytes_sent_per_rank"] / none["bytes_sent_per_rank"] < 0.3, (none, low)
PY
expect_error 2 "--gather-compression: unknown scheme 'int4' (known: none, int8)" -- train --gather-compression int4 \
  --data synthetic
expect_error 2 "--gather-compression int8 applies to zero3, which gathers its parameters before use; strategy ddp holds" \
  -- train --gather-compression int8 --data synthetic
"$bin" train --data synthetic --train-size 512 --test-size 64 --world 2 --strategy zero3 --gather-compression int8 \
  --json --progress none >"$tmp/gather" 2>"$tmp/err" || fail "--gather-compression int8 exited $?: $(cat "$tmp/err")"
grep -q '"gather_compression": "int8"' "$tmp/gather" || fail "the summary lacks gather_compression: $(cat "$tmp/gather")"
expect_error 2 "--powersgd-rank and --powersgd-warmup apply to --grad-compression powersgd (this run has none)" \
  -- train --powersgd-rank 4 --data synthetic
expect_error 2 "--powersgd-rank must be in \[1, 65535\] (got 0)" -- train --grad-compression powersgd --powersgd-rank 0 \
  --data synthetic
expect_error 2 "--powersgd-warmup must be 0 or more steps (got -1)" -- train --grad-compression powersgd \
  --powersgd-warmup -1 --data synthetic
expect_error 2 "--bucket-cap-mb must be a positive number of MiB (got 0)" -- train --bucket-cap-mb 0 --data synthetic
expect_error 2 "--bucket-cap-mb must be a positive number of MiB (got -1)" -- train --bucket-cap-mb -1 --strategy zero2 --data synthetic
expect_error 2 "--prefetch-units applies to zero3, which gathers parameters; strategy ddp holds them whole" -- train --prefetch-units 0 --data synthetic
expect_error 2 "--max-buckets-in-flight applies to zero2 and zero3, which reduce-scatter gradient buckets; strategy zero1 keeps whole gradients" -- train --max-buckets-in-flight 1 --strategy zero1 --data synthetic
expect_error 2 "--prefetch-units: must be a non-negative integer (got -2)" -- train --prefetch-units -2 --strategy zero3 --data synthetic
expect_error 2 "--max-buckets-in-flight must be at least 1 (got 0)" -- train --max-buckets-in-flight 0 --strategy zero2 --data synthetic
expect_error 2 "max live parameters 1000 is below the largest unit, fc1 (" -- train --max-live-params 1000 --strategy zero3 --data synthetic --world 2
expect_error 2 "max live parameters 1000 is below one tile of fc1 (50176 elements gathered at once at world 2): at least 50176 would fit" -- train --max-live-params 1000 --tile-rows 64 --strategy zero3 --data synthetic --world 2
expect_error 2 "tiles (--tile-rows) apply to model mlp, not logreg" -- train --tile-rows 64 --model logreg --data synthetic
# The live limits keep ddp's bits.
"$bin" train --data synthetic --train-size 512 --test-size 64 --world 4 --batch-size 64 --progress none --json >"$tmp/live_ddp" \
  || fail "train ddp for the live limits exited $?"
"$bin" train --data synthetic --train-size 512 --test-size 64 --world 4 --batch-size 64 --progress none --json \
  --strategy zero3 --prefetch-units 0 --max-buckets-in-flight 1 >"$tmp/live_z3" || fail "zero3 --prefetch-units 0 exited $?"
live_hash=$(tail -n 1 "$tmp/live_ddp" | grep -o '"param_hash": "[0-9a-f]*"')
[ -n "$live_hash" ] && [ "$(tail -n 1 "$tmp/live_z3" | grep -o '"param_hash": "[0-9a-f]*"')" = "$live_hash" ] \
  || fail "zero3 --prefetch-units 0 --max-buckets-in-flight 1 changed the bits"
expect_error 2 "unknown data set 'cifar'" -- train --data cifar
expect_error 2 "batch size 2 is smaller than the world size 4" -- train --data synthetic --world 4 --batch-size 2
expect_error 2 "--lr: 'abc' is not a finite number" -- train --data synthetic --lr abc
expect_error 2 "--betas: '0.9' is not a pair" -- train --data synthetic --betas 0.9
expect_error 2 "--momentum is not an option of optimizer adamw" -- train --data synthetic --momentum 0.9
expect_error 2 "Invalid learning rate: -1" -- train --data synthetic --lr -1
expect_error 2 "--epochs must be at least 1" -- train --data synthetic --epochs 0
expect_error 2 "apt-get install dataset-fashion-mnist" -- train --data-dir "$tmp/nowhere"
expect_error 2 "Could not convert" -- train --data synthetic --batch-size many
# A corrupt dataset: wrong magic number, then a truncated file.
mkdir -p "$tmp/fm"
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
  printf '\x00\x00\x08\x01\x00\x00\x00\x02\x01\x02' | gzip >"$tmp/fm/$f.gz"
done
printf '\x01\x02\x08\x03' | gzip >"$tmp/fm/train-images-idx3-ubyte.gz"
expect_error 2 "wrong IDX magic number" -- train --data-dir "$tmp/fm"
printf '\x00\x00\x08\x03\x00\x00\x00\x02\x00\x00\x00\x1c\x00\x00\x00\x1c\x05' | gzip >"$tmp/fm/train-images-idx3-ubyte.gz"
expect_error 2 "truncated: header promises 1568 bytes of data, file has 1" -- train --data-dir "$tmp/fm"
# --keep-denormals is accepted (the default flushes them to zero).
"$bin" train --data synthetic --train-size 256 --test-size 64 --batch-size 64 --keep-denormals --progress none \
  >/dev/null 2>&1 || fail "train --keep-denormals exited $?"

# Schedulers: per step (OneCycleLR) and per epoch (StepLR); lrs in the metrics.
"$bin" train --data synthetic --train-size 512 --test-size 64 --batch-size 64 --epochs 2 --progress none \
  --scheduler onecyclelr --scheduler-option max_lr=0.01 --scheduler-option total_steps=16 --metrics "$tmp/oc.jsonl" \
  >/dev/null 2>&1 || fail "train --scheduler onecyclelr exited $?"
"$bin" train --data synthetic --train-size 512 --test-size 64 --batch-size 64 --epochs 3 --progress none --lr 0.01 \
  --scheduler steplr --scheduler-option step_size=1 --scheduler-option gamma=0.5 --scheduler-interval epoch \
  --metrics "$tmp/st.jsonl" >/dev/null 2>&1 || fail "train --scheduler steplr exited $?"
"$bin" train --data synthetic --train-size 512 --test-size 64 --batch-size 64 --epochs 2 --progress none \
  --scheduler '{"name": "sequentiallr", "options": {"milestones": [4]}, "schedulers": [{"name": "linearlr"}, {"name": "exponentiallr", "options": {"gamma": 0.9}}]}' \
  >/dev/null 2>&1 || fail "train --scheduler JSON exited $?"
/usr/bin/env python3 - "$tmp" <<'PY' || fail "scheduler lrs in the metrics are wrong"
import json, math, sys
tmp = sys.argv[1]
oc = [json.loads(l)["lr"] for l in open(tmp + "/oc.jsonl") if '"kind": "step"' in l]
assert len(oc) == 16 and abs(oc[0] - 0.01 / 25) < 1e-12, oc[:2]
assert abs(max(oc) - 0.01) < 2e-3 and oc[-1] < 1e-4, oc
st = [json.loads(l) for l in open(tmp + "/st.jsonl") if '"kind": "step"' in l]
for e, want in ((1, 0.01), (2, 0.005), (3, 0.0025)):
    assert all(abs(s["lr"] - want) < 1e-15 for s in st if s["epoch"] == e), (e, want)
PY
# muon: the matrices to muon, the biases to adamw, said once; zero2 gathers
# each matrix's update and gives ddp's bits.
"$bin" train --data synthetic --train-size 256 --test-size 64 --epochs 1 --optimizer muon --lr 0.02 --progress none \
  >"$tmp/out" 2>"$tmp/err" || fail "train --optimizer muon exited $?: $(cat "$tmp/err")"
grep -q "muon takes the weight matrices; the other parameters (biases) go to a second group with adamw" "$tmp/err" \
  || fail "muon notice: $(cat "$tmp/err")"
grep -q "^mlp on synthetic, muon, ddp" "$tmp/out" || fail "muon summary: $(cat "$tmp/out")"
for s in ddp zero2; do
  "$bin" train --data synthetic --train-size 256 --test-size 64 --epochs 1 --optimizer muon --lr 0.02 --world 2 \
    --strategy $s --progress none --json 2>/dev/null | tail -n 1 | grep -o '"param_hash": "[0-9a-f]*"' >"$tmp/muon_$s" \
    || fail "muon $s failed"
done
[ -s "$tmp/muon_ddp" ] && cmp -s "$tmp/muon_ddp" "$tmp/muon_zero2" \
  || fail "muon: ddp $(cat "$tmp/muon_ddp") vs zero2 $(cat "$tmp/muon_zero2")"
# Run configuration files: --config FILE (keys the long flag names, the
# command line overrides), --print-config (that format, read back as itself).
cat >"$tmp/run.json" <<'JSON'
{"data": "synthetic", "train-size": 512, "test_size": 128, "--lr": 0.02, "hidden": [24, 8], "optimizer": "muon",
 "ns_coefficients": [3.4445, -4.775, 2.0315], "scheduler": {"name": "steplr", "options": {"step_size": 2}},
 "keep-denormals": true, "progress": "none", "json": true, "world": 2, "strategy": "zero2"}
JSON
"$bin" train --config "$tmp/run.json" 2>/dev/null | tail -n 1 | grep -o '"param_hash": "[0-9a-f]*"' >"$tmp/h_config" \
  || fail "train --config exited $?"
"$bin" train --data synthetic --train-size 512 --test-size 128 --lr 0.02 --hidden 24,8 --optimizer muon \
  --ns-coefficients 3.4445,-4.775,2.0315 --scheduler '{"name": "steplr", "options": {"step_size": 2}}' \
  --keep-denormals --progress none --json --world 2 --strategy zero2 2>/dev/null | tail -n 1 \
  | grep -o '"param_hash": "[0-9a-f]*"' >"$tmp/h_flags" || fail "the same run by flags exited $?"
[ -s "$tmp/h_config" ] && cmp -s "$tmp/h_config" "$tmp/h_flags" \
  || fail "--config gave $(cat "$tmp/h_config"), the same flags $(cat "$tmp/h_flags")"
"$bin" train --config "$tmp/run.json" --print-config >"$tmp/p1.json" || fail "--print-config exited $?"
"$bin" train --config "$tmp/p1.json" --print-config >"$tmp/p2.json" || fail "--print-config of its own output exited $?"
cmp -s "$tmp/p1.json" "$tmp/p2.json" || fail "--print-config does not read back as itself: $(diff "$tmp/p1.json" "$tmp/p2.json")"
python3 - "$tmp/p1.json" <<'PY' || fail "--print-config: $(cat "$tmp/p1.json")"
import json, sys
c = json.load(open(sys.argv[1]))
assert c["lr"] == 0.02 and c["hidden"] == [24, 8] and c["optimizer"] == "muon" and c["world"] == 2, c
assert c["scheduler"] == {"name": "steplr", "options": {"step_size": 2}} and c["keep-denormals"] is True, c
assert c["ns-coefficients"] == "3.4445,-4.775,2.0315" and c["test-size"] == 128 and "config" not in c, c
PY
"$bin" train --config "$tmp/run.json" --lr 0.05 --world 3 --print-config | grep -q '"lr": 0.05' \
  || fail "the command line does not override --config"
# Bad files: CONTENT then the message expected.
bad_config() {
  printf '%s' "$1" >"$tmp/bad.json"
  expect_error 2 "$2" -- train --config "$tmp/bad.json"
}
bad_config '{"lr2": 1}' "--config: unknown key 'lr2' in $tmp/bad.json (keys are the long flag names"
bad_config '{"lr": 1' "--config: $tmp/bad.json is not valid JSON: parse error"
bad_config '[1]' "must hold one JSON object of flags"
bad_config '{"batch-size": -5}' "--batch-size: must be a non-negative integer (got -5) (from --config"
bad_config '{"json": 3}' "is a flag: its value is true or false"
bad_config '{"lr": null}' "key 'lr' is null"
expect_error 2 "--config: cannot read $tmp/missing.json" -- train --config "$tmp/missing.json"

# Checkpoints: --checkpoint-dir/--checkpoint-every/--keep-checkpoints and
# --resume (the run's flags from the manifest): the same world gives the
# uninterrupted run's bits; one checkpoint resumed at 3 ranks under zero3
# and ddp gives the same bits under each.
ck=(train --data synthetic --train-size 512 --test-size 128 --epochs 2 --batch-size 64 --strategy zero2 --world 2
    --progress none --json --optimizer adam --lr 0.003)
hash_of() { tail -n 1 "$1" | grep -o '"param_hash": "[0-9a-f]*"'; }
"$bin" "${ck[@]}" >"$tmp/straight" 2>/dev/null || fail "uninterrupted run exited $?"
"$bin" "${ck[@]}" --max-steps 10 --checkpoint-dir "$tmp/ck" --checkpoint-every 3 --keep-checkpoints 2 >/dev/null 2>&1 \
  || fail "checkpointed run exited $?"
[ "$(ls "$tmp/ck")" = "$(printf 'step-000000000009\nstep-000000000010')" ] || fail "kept checkpoints: $(ls "$tmp/ck")"
cp -r "$tmp/ck" "$tmp/ck3"
cp -r "$tmp/ck" "$tmp/ckd"
mkdir "$tmp/ck/step-000000000012"  # an interrupted write: ignored
"$bin" train --resume --checkpoint-dir "$tmp/ck" --max-steps 0 >"$tmp/resumed" 2>"$tmp/err" || fail "--resume exited $?: $(cat "$tmp/err")"
grep -q "resuming with --max-steps 0 (the checkpoint's run had 10)" "$tmp/err" || fail "override not reported: $(cat "$tmp/err")"
[ -n "$(hash_of "$tmp/straight")" ] && [ "$(hash_of "$tmp/straight")" = "$(hash_of "$tmp/resumed")" ] \
  || fail "resumed $(hash_of "$tmp/resumed") vs uninterrupted $(hash_of "$tmp/straight")"
"$bin" train --resume --checkpoint-dir "$tmp/ck3" --max-steps 0 --world 3 --strategy zero3 >"$tmp/r3" 2>/dev/null \
  || fail "--resume at zero3@3 exited $?"
"$bin" train --resume --checkpoint-dir "$tmp/ckd" --max-steps 0 --world 3 --strategy ddp >"$tmp/rd" 2>/dev/null \
  || fail "--resume at ddp@3 exited $?"
[ -n "$(hash_of "$tmp/r3")" ] && [ "$(hash_of "$tmp/r3")" = "$(hash_of "$tmp/rd")" ] \
  || fail "from one checkpoint: zero3@3 $(hash_of "$tmp/r3") vs ddp@3 $(hash_of "$tmp/rd")"
expect_error 2 "the checkpoint in .* is of --optimizer \"adam\"; --optimizer \"sgd\" would make it meaningless" \
  -- train --resume --checkpoint-dir "$tmp/ck" --optimizer sgd
# A checkpoint's error feedback belongs to its scheme, and 1-bit Adam's
# variance to its warm-up: another scheme with feedback, or another warm-up,
# is refused; --grad-compression none drops the feedback with a warning and
# leaves the saved scheme's options behind.
"$bin" train --data synthetic --train-size 256 --test-size 32 --world 2 --optimizer adam --grad-compression onebit \
  --onebit-warmup 2 --max-steps 4 --checkpoint-dir "$tmp/ck1" --checkpoint-every 4 --progress none >/dev/null 2>"$tmp/err" \
  || fail "checkpointed onebit run exited $?: $(cat "$tmp/err")"
expect_error 2 "holds --grad-compression onebit's error feedback; --grad-compression int8 would read it as its own" \
  -- train --resume --checkpoint-dir "$tmp/ck1" --grad-compression int8
expect_error 2 "is of --onebit-warmup 2, where 1-bit Adam freezes its variance; --onebit-warmup 3 would make it meaningless" \
  -- train --resume --checkpoint-dir "$tmp/ck1" --onebit-warmup 3
"$bin" train --resume --checkpoint-dir "$tmp/ck1" --grad-compression none --max-steps 6 --progress none >/dev/null \
  2>"$tmp/err" || fail "resuming onebit as none exited $?: $(cat "$tmp/err")"
grep -q "error feedback is dropped" "$tmp/err" || fail "dropped feedback not reported: $(cat "$tmp/err")"
mkdir -p "$tmp/empty_ck"
# checkpoint export and inspect: the whole parameters with the run's
# param_hash, the optimizer state in torch's layout, a verified listing.
"$bin" checkpoint export "$tmp/ck3" -o "$tmp/export.safetensors" --optimizer-state >/dev/null 2>"$tmp/err" \
  || fail "checkpoint export exited $?: $(cat "$tmp/err")"
"$bin" checkpoint inspect "$tmp/ck3" --json >"$tmp/inspect" 2>"$tmp/err" || fail "checkpoint inspect exited $?: $(cat "$tmp/err")"
python3 - "$tmp/export.safetensors" "$tmp/inspect" "$tmp/r3" <<'PY' || fail "checkpoint export/inspect"
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
i = json.loads(open(sys.argv[2]).read())
run = json.loads(open(sys.argv[3]).read().splitlines()[-1])
assert h["fc1.weight"]["shape"] == [256, 784] and h["state.0.exp_avg"]["shape"] == [256, 784], h.keys()
assert h["state.0.step"]["shape"] == [] and h["__metadata__"]["step"] == str(i["step"]), h["__metadata__"]
assert i["world"] == 3 and i["strategy"] == "zero3" and i["optimizer"] == "adam", i
assert i["tensors"]["param.fc3.bias"] == [10] and i["config"]["optimizer"] == "adam", i
# ck3's latest checkpoint is the end of the zero3@3 resumed run: its parameters are that run's.
assert h["__metadata__"]["param_hash"] == run["param_hash"], (h["__metadata__"], run["param_hash"])
PY
# Quantized optimizer state in checkpoints: saved under zero2@2 with int4
# state, resumed at zero3@3 and ddp@3 with the same bits; inspect names the
# block scales, export --dequantize leaves them out; gossip refuses.
qk=(train --data synthetic --train-size 512 --test-size 128 --epochs 1 --batch-size 64 --strategy zero2 --world 2
    --progress none --json --optimizer adamw --state-dtype int4)
"$bin" "${qk[@]}" --max-steps 5 --checkpoint-dir "$tmp/qk" >/dev/null 2>"$tmp/err" || fail "int4 checkpointed run: $(cat "$tmp/err")"
cp -r "$tmp/qk" "$tmp/qkd"
"$bin" train --resume --checkpoint-dir "$tmp/qk" --max-steps 0 --world 3 --strategy zero3 >"$tmp/q3" 2>"$tmp/err" \
  || fail "int4 --resume at zero3@3 exited $?: $(cat "$tmp/err")"
"$bin" train --resume --checkpoint-dir "$tmp/qkd" --max-steps 0 --world 3 --strategy ddp >"$tmp/qd" 2>"$tmp/err" \
  || fail "int4 --resume at ddp@3 exited $?: $(cat "$tmp/err")"
[ -n "$(hash_of "$tmp/q3")" ] && [ "$(hash_of "$tmp/q3")" = "$(hash_of "$tmp/qd")" ] \
  || fail "int4 from one checkpoint: zero3@3 $(hash_of "$tmp/q3") vs ddp@3 $(hash_of "$tmp/qd")"
"$bin" checkpoint inspect "$tmp/qk" >"$tmp/qinspect" 2>"$tmp/err" || fail "inspect int4: $(cat "$tmp/err")"
grep -q "state.0.exp_avg.absmax *\[1568\]  (block scales of quantized state)" "$tmp/qinspect" \
  || fail "inspect int4: $(cat "$tmp/qinspect")"
"$bin" checkpoint export "$tmp/qk" -o "$tmp/q.safetensors" --optimizer-state --dequantize >/dev/null 2>"$tmp/err" \
  || fail "export --dequantize exited $?: $(cat "$tmp/err")"
"$bin" checkpoint export "$tmp/qk" -o "$tmp/qs.safetensors" --optimizer-state >/dev/null 2>"$tmp/err" \
  || fail "export exited $?: $(cat "$tmp/err")"
python3 - "$tmp/q.safetensors" "$tmp/qs.safetensors" <<'PY' || fail "export of quantized state"
import json, struct, sys
def header(path):
    raw = open(path, "rb").read()
    return json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
d, s = header(sys.argv[1]), header(sys.argv[2])
assert d["state.0.exp_avg"]["shape"] == [256, 784] and d["state.0.exp_avg"]["dtype"] == "F32", d.keys()
assert not any(k.endswith(".absmax") for k in d), [k for k in d if k.endswith(".absmax")]
assert s["state.0.exp_avg_sq.absmax"]["shape"] == [1568], s.keys()
PY
expect_error 2 "--dequantize applies to --optimizer-state" -- checkpoint export "$tmp/qk" -o "$tmp/x.safetensors" --dequantize
expect_error 2 "checkpoints each rank's optimizer state in fp32" -- train --data synthetic --strategy sgp --world 2 \
  --state-dtype int8 --checkpoint-dir "$tmp/qg" --max-steps 1
expect_error 2 "$tmp/nothing: no such checkpoint directory" -- checkpoint inspect "$tmp/nothing"
expect_error 2 "no complete checkpoint in it" -- checkpoint export "$tmp/empty_ck" -o "$tmp/x.safetensors"
# Schedulers (per step with loss scaling, per epoch, on the test loss), the
# loss scaler, SWA with SWALR and EMA resume exactly (the parameters and the
# averaged model): from the end of an epoch (step 8, after the epoch's own
# scheduler step), from the middle of one (step 12), and after SWA started
# (step 28, in epoch 4).
sched=(train --data synthetic --train-size 512 --test-size 128 --epochs 5 --batch-size 64 --world 2 --strategy zero2
       --progress none --json)
for extra in "--scheduler onecyclelr --scheduler-option max_lr=0.01 --scheduler-option total_steps=40 --loss-scale dynamic --init-scale 1024 --growth-interval 3" \
             "--scheduler steplr --scheduler-option step_size=1 --scheduler-option gamma=0.5 --scheduler-interval epoch" \
             "--scheduler reducelronplateau --scheduler-option patience=0" \
             "--swa-start 2 --swa-lr 0.001" "--ema-decay 0.9"; do
  # shellcheck disable=SC2086
  "$bin" "${sched[@]}" $extra >"$tmp/s_straight" 2>/dev/null || fail "$extra: uninterrupted run exited $?"
  for cut in "8 5" "12 8" "28 24"; do
    set -- $cut
    rm -rf "$tmp/cks"
    # shellcheck disable=SC2086
    "$bin" "${sched[@]}" $extra --max-steps "$1" --checkpoint-dir "$tmp/cks" --checkpoint-every "$2" >/dev/null 2>&1 \
      || fail "$extra: checkpointed run to $1 exited $?"
    "$bin" train --resume --checkpoint-dir "$tmp/cks" --max-steps 0 >"$tmp/s_resumed" 2>/dev/null || fail "$extra: --resume exited $?"
    [ -n "$(hash_of "$tmp/s_straight")" ] && [ "$(hash_of "$tmp/s_resumed")" = "$(hash_of "$tmp/s_straight")" ] \
      || fail "$extra, resumed from step $1: $(hash_of "$tmp/s_resumed") vs $(hash_of "$tmp/s_straight")"
  done
done
expect_error 2 "--resume: the checkpoint's run had no scheduler; one cannot be added on resume" \
  -- train --resume --checkpoint-dir "$tmp/ck3" --scheduler steplr --scheduler-option step_size=2
expect_error 2 "is of the default --hidden; --hidden \[64\] would make it meaningless" \
  -- train --resume --checkpoint-dir "$tmp/ck3" --hidden 64
expect_error 2 "--resume needs --checkpoint-dir" -- train --data synthetic --resume
expect_error 2 "--resume: no complete checkpoint in $tmp/empty_ck" -- train --data synthetic --resume --checkpoint-dir "$tmp/empty_ck"
# Gossip runs keep every rank's own model, push-sum weight, optimizer state
# and rounds in flight: resumed at the same world and strategy, the
# uninterrupted run's bits (from inside an epoch and across its end); at
# another world or strategy, every rank starts from the ranks' mean, and
# the run says so.
gs=(train --data synthetic --train-size 512 --test-size 128 --epochs 2 --batch-size 64 --world 4 --progress none --json)
for g in "--strategy sgp" "--strategy osgp --synch-freq 1" "--strategy dpsgd" \
         "--strategy slowmo --slowmo-frequency 4 --localsgd-frequency 3" \
         "--strategy slowmo --slowmo-base sgp --slowmo-frequency 5 --topology ring" \
         "--strategy diloco --sync-every 4 --fragments 3 --sync-delay 2 --fragment-alpha 0.5 --outer-dtype int4 --outer-error-feedback" \
         "--strategy diloco --sync-every 3 --outer-optimizer sgd"; do
  rm -rf "$tmp/ckg"
  # shellcheck disable=SC2086
  "$bin" "${gs[@]}" $g >"$tmp/g_straight" 2>/dev/null || fail "$g: uninterrupted run exited $?"
  # shellcheck disable=SC2086
  "$bin" "${gs[@]}" $g --max-steps 11 --checkpoint-dir "$tmp/ckg" --checkpoint-every 5 >/dev/null 2>&1 \
    || fail "$g: checkpointed run exited $?"
  rm -rf "$tmp/ckg/step-000000000011"  # resume from step 10 (the epoch ended at 8)
  "$bin" train --resume --checkpoint-dir "$tmp/ckg" --max-steps 0 >"$tmp/g_resumed" 2>"$tmp/err" \
    || fail "$g: --resume exited $?: $(cat "$tmp/err")"
  [ -n "$(hash_of "$tmp/g_straight")" ] && [ "$(hash_of "$tmp/g_resumed")" = "$(hash_of "$tmp/g_straight")" ] \
    || fail "$g: resumed $(hash_of "$tmp/g_resumed") vs uninterrupted $(hash_of "$tmp/g_straight")"
  ! grep -q "mean model" "$tmp/err" || fail "$g: an exact resume reported a consensus start: $(cat "$tmp/err")"
done
"$bin" train --resume --checkpoint-dir "$tmp/ckg" --max-steps 0 --world 2 --strategy zero2 >/dev/null 2>"$tmp/err" \
  || fail "a gossip checkpoint resumed as zero2@2 exited $?: $(cat "$tmp/err")"
grep -q "resuming the diloco checkpoint of 4 ranks as zero2 at 2 .*every rank starts from the ranks' mean model and optimizer state" \
  "$tmp/err" || fail "consensus start not reported: $(cat "$tmp/err")"
"$bin" checkpoint inspect "$tmp/ckg" >"$tmp/inspect" 2>&1 || fail "inspect of a gossip checkpoint exited $?"
grep -q "gossip.3.x" "$tmp/inspect" || fail "inspect lists no rank's own state: $(cat "$tmp/inspect")"
[ ! -e "$tmp/ck/step-000000000012" ] || fail "the interrupted write was not pruned: $(ls "$tmp/ck")"
last=$(ls -d "$tmp/ck"/step-* | tail -n 1)  # the resumed run's final checkpoint
printf 'X' | dd of="$last/rank1.safetensors" bs=1 seek=40 conv=notrunc 2>/dev/null
expect_error 2 "rank1.safetensors is corrupted: its xxh64 is" -- train --resume --checkpoint-dir "$tmp/ck"

# Full-matrix Adagrad above its size limit: one line naming the remedy,
# before any data is read; shampoo likewise above max_precond_dim.
expect_error 2 "adagrad_full keeps two d x d matrices per block: a parameter of shape \[256, 784\] in one block of 200704 elements needs 300.125 GiB; the limit is max_size=4096 elements per block (set block_size" \
  -- train --data synthetic --optimizer adagrad_full
expect_error 2 "dimension 1 of a parameter of shape \[256, 784\] is 784, above max_precond_dim=512" \
  -- train --data synthetic --optimizer shampoo --max-precond-dim 512
expect_error 2 "unknown scheduler 'warmup'" -- train --data synthetic --scheduler warmup
expect_error 2 "steplr: option step_size is required" -- train --data synthetic --scheduler steplr
expect_error 2 "reducelronplateau: Factor should be < 1.0." -- train --data synthetic --scheduler reducelronplateau \
  --scheduler-option factor=1.5
expect_error 2 "Tried to step 6 times. The specified number of total steps is 4" -- train --data synthetic \
  --train-size 512 --test-size 64 --batch-size 64 --progress none --scheduler onecyclelr --scheduler-option max_lr=0.1 \
  --scheduler-option total_steps=4
expect_error 2 "needs --scheduler" -- train --data synthetic --scheduler-option step_size=3
expect_error 2 "'step_size' is not KEY=VALUE" -- train --data synthetic --scheduler steplr --scheduler-option step_size
expect_error 2 "optimizer must support momentum" -- train --data synthetic --optimizer adagrad --scheduler cycliclr \
  --scheduler-option base_lr=0.01 --scheduler-option max_lr=0.1

# Clipping, dynamic loss scaling and SWA together: the summary's members,
# per-step norms and scales, the averaged model's export.
"$bin" train --data synthetic --train-size 512 --test-size 64 --batch-size 64 --epochs 3 --progress none \
  --clip-grad-norm 0.5 --clip-norm-type inf --loss-scale dynamic --init-scale 256 --growth-interval 5 \
  --swa-start 2 --swa-lr 0.0005 --metrics "$tmp/swa.jsonl" --export-averaged "$tmp/avg.safetensors" --json \
  >"$tmp/out" 2>"$tmp/err" || fail "train with clipping, scaling and SWA exited $?: $(cat "$tmp/err")"
/usr/bin/env python3 - "$tmp" <<'PY' || fail "clipping/scaling/SWA outputs are wrong"
import json, struct, sys
tmp = sys.argv[1]
s = json.loads(open(tmp + "/out").read().strip().splitlines()[-1])
assert s["steps"] == 24 and s["skipped_steps"] == 0, s
assert s["loss_scale"] == 256 * 2 ** (24 // 5), s["loss_scale"]
a = s["averaged"]
assert a["kind"] == "swa" and a["n_averaged"] == 2 and 0 <= a["test_accuracy"] <= 1, a
assert a["param_hash"] != s["param_hash"]
lines = [json.loads(l) for l in open(tmp + "/swa.jsonl")]
steps = [l for l in lines if l["kind"] == "step"]
assert all(l["grad_norm"] > 0 and l["skipped"] is False for l in steps), steps[0]
assert steps[0]["loss_scale"] == 256 and steps[5]["loss_scale"] == 512, (steps[0], steps[5])
epochs = [l for l in lines if l["kind"] == "epoch"]
assert "avg_test_accuracy" not in epochs[0] and epochs[2]["avg_test_accuracy"] == a["test_accuracy"], epochs
raw = open(tmp + "/avg.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])["__metadata__"]
assert h["param_hash"] == a["param_hash"] and h["averaged"] == "swa" and h["n_averaged"] == "2", h
PY
# A diverged run (lr 1e30: NaN from step 2) trained on with --on-nonfinite
# ignore keeps its outputs readable: NaN losses and norms are null in the
# JSON summary and metrics; every step after the first is skipped by the
# loss scaler.
"$bin" train --data synthetic --train-size 512 --test-size 64 --batch-size 64 --max-steps 6 --progress none \
  --optimizer sgd --lr 1e30 --clip-grad-norm 1 --loss-scale dynamic --ema-decay 0.5 --metrics "$tmp/nan.jsonl" \
  --on-nonfinite ignore --json >"$tmp/out" 2>"$tmp/err" || fail "diverging train exited $?: $(cat "$tmp/err")"
/usr/bin/env python3 - "$tmp" <<'PY' || fail "a diverged run's outputs are not valid JSON with nulls"
import json, sys
tmp = sys.argv[1]
s = json.loads(open(tmp + "/out").read().strip().splitlines()[-1])
assert s["train_loss"] is None and s["test_loss"] is None and s["averaged"]["test_loss"] is None, s
assert s["skipped_steps"] == 5 and s["loss_scale"] == 65536 / 32 and s["nonfinite_steps"] == 5, s
lines = [json.loads(l) for l in open(tmp + "/nan.jsonl")]
steps = [l for l in lines if l["kind"] == "step"]
assert steps[0]["loss"] is not None and all(l["loss"] is None and l["grad_norm"] is None for l in steps[1:]), steps
assert [l["skipped"] for l in steps] == [False] + [True] * 5, steps
PY
expect_error 2 "\-\-swa-lr needs \-\-swa-start" -- train --data synthetic --swa-lr 0.1
expect_error 2 "\-\-swa-start 5 is after the last epoch" -- train --data synthetic --epochs 2 --swa-start 5
expect_error 2 "cannot be combined" -- train --data synthetic --epochs 2 --swa-start 1 --ema-decay 0.9
expect_error 2 "\-\-max-steps 3 ends training in epoch 1 (8 steps each), before \-\-swa-start 2" -- train \
  --data synthetic --train-size 512 --batch-size 64 --epochs 3 --max-steps 3 --swa-start 2
expect_error 2 "\-\-ema-decay must be in \[0, 1\]" -- train --data synthetic --ema-decay 2
expect_error 2 "\-\-export-averaged needs \-\-swa-start or \-\-ema-decay" -- train --data synthetic \
  --export-averaged "$tmp/a.safetensors"
expect_error 2 "need \-\-loss-scale dynamic" -- train --data synthetic --init-scale 1024
expect_error 2 "The backoff factor must be < 1.0" -- train --data synthetic --loss-scale dynamic --backoff-factor 2
expect_error 2 "\-\-init-scale must be a positive finite float32 number (got 1e+39)" -- train --data synthetic \
  --loss-scale dynamic --init-scale 1e39
expect_error 2 "\-\-clip-grad-norm must be a positive number" -- train --data synthetic --clip-grad-norm -1
expect_error 2 "\-\-clip-norm-type: 'two' is not a finite number" -- train --data synthetic --clip-grad-norm 1 \
  --clip-norm-type two

# An export that cannot be written fails clearly and leaves nothing half-written.
expect_error 2 "cannot create" -- train --data synthetic --train-size 256 --test-size 64 --progress none \
  --export-params "$tmp/missing-dir/p.safetensors"

finish "cli train"

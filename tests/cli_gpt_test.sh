#!/usr/bin/env bash
# distopt train --model gpt from outside: a tiny transformer on a text file
# and on the fortunes package, the same bits under ddp, zero1-3 and on
# threads, the language-model figures in the summary, and bad input.
# Usage: cli_gpt_test.sh DISTOPT
set -u
bin=$1
source "$(dirname "$0")/check_lib.sh"
hash_of() { tail -n 1 "$1" | grep -o '"param_hash": "[0-9a-f]*"'; }

# A text file of its own: 20 KB of English-like lines.
python3 -c '
import random
r = random.Random(3)
words = "the of and to a in is it you that he was for on are with as his they be at one have this from".split()
print("\n".join(" ".join(r.choice(words) for _ in range(r.randint(3, 12))) for _ in range(1000)))
' >"$tmp/corpus.txt"
tiny=(train --model gpt --data text --data-file "$tmp/corpus.txt" --layers 2 --heads 2 --dim 32 --context 16
      --batch-size 8 --test-size 32 --progress none --json)

# zero3 gathers block by block; every strategy gives ddp's bits.
"$bin" "${tiny[@]}" --max-steps 12 --world 4 --strategy ddp >"$tmp/ddp" 2>"$tmp/err" || fail "gpt ddp@4 exited $?: $(cat "$tmp/err")"
for s in zero1 zero2 zero3; do
  "$bin" "${tiny[@]}" --max-steps 12 --world 4 --strategy $s >"$tmp/$s" 2>"$tmp/err" || fail "gpt $s@4 exited $?: $(cat "$tmp/err")"
  [ -n "$(hash_of "$tmp/ddp")" ] && [ "$(hash_of "$tmp/$s")" = "$(hash_of "$tmp/ddp")" ] \
    || fail "gpt $s@4 $(hash_of "$tmp/$s") vs ddp@4 $(hash_of "$tmp/ddp")"
done
# Quantized optimizer state (int4: blocks of 128) under every strategy gives
# ddp's bits: gpt places its large tensors on the state's blocks.
"$bin" "${tiny[@]}" --max-steps 12 --world 4 --strategy ddp --state-dtype int4 >"$tmp/q_ddp" 2>"$tmp/err" \
  || fail "gpt int4 ddp@4 exited $?: $(cat "$tmp/err")"
[ "$(hash_of "$tmp/q_ddp")" != "$(hash_of "$tmp/ddp")" ] || fail "gpt --state-dtype int4 gave fp32 state's bits"
for s in zero1 zero2 zero3; do
  "$bin" "${tiny[@]}" --max-steps 12 --world 4 --strategy $s --state-dtype int4 >"$tmp/q_$s" 2>"$tmp/err" \
    || fail "gpt int4 $s@4 exited $?: $(cat "$tmp/err")"
  [ "$(hash_of "$tmp/q_$s")" = "$(hash_of "$tmp/q_ddp")" ] || fail "gpt int4 $s@4 $(hash_of "$tmp/q_$s") vs ddp@4"
done
# Threads within a rank give the same bits at any count. bfloat16 products
# give bits of their own, the same under ddp and zero3 and at any count.
"$bin" "${tiny[@]}" --max-steps 12 --world 4 --strategy zero3 --threads 3 >"$tmp/t3" 2>"$tmp/err" \
  || fail "gpt --threads 3 exited $?: $(cat "$tmp/err")"
[ "$(hash_of "$tmp/t3")" = "$(hash_of "$tmp/ddp")" ] || fail "gpt --threads 3 $(hash_of "$tmp/t3") vs $(hash_of "$tmp/ddp")"
# A CPU without AVX512 has no oneDNN bfloat16 product at all (not even an
# emulated one); distopt says so by name, and the bf16 checks are skipped.
if "$bin" "${tiny[@]}" --max-steps 12 --world 4 --matmul-precision bf16 >"$tmp/b_ddp" 2>"$tmp/err"; then
  "$bin" "${tiny[@]}" --max-steps 12 --world 4 --matmul-precision bf16 --strategy zero3 --threads 2 >"$tmp/b_z3" 2>/dev/null \
    || fail "gpt bf16 zero3 --threads 2 exited $?"
  [ "$(hash_of "$tmp/b_z3")" = "$(hash_of "$tmp/b_ddp")" ] || fail "gpt bf16: zero3 $(hash_of "$tmp/b_z3") vs ddp $(hash_of "$tmp/b_ddp")"
  [ "$(hash_of "$tmp/b_ddp")" != "$(hash_of "$tmp/ddp")" ] || fail "gpt bf16 gave float32's bits"
  grep -q '"threads": 2, "matmul_precision": "bf16"' "$tmp/b_z3" || fail "gpt summary: $(tail -n 1 "$tmp/b_z3")"
elif grep -q -e "oneDNN has no bfloat16 products on this CPU (it needs AVX512)" \
    -e "oneDNN has no bfloat16 product of this shape on this CPU" "$tmp/err"; then
  echo "cli gpt: skipping the bf16 checks: $(tail -n 1 "$tmp/err")"
else
  fail "gpt bf16 exited: $(cat "$tmp/err")"
fi
# Activation checkpointing: the same bits, under ddp and zero3, with a
# fraction of the activations in the summary.
"$bin" "${tiny[@]}" --max-steps 12 --world 4 --strategy zero3 --activation-checkpointing >"$tmp/ck" 2>"$tmp/err" \
  || fail "gpt --activation-checkpointing exited $?: $(cat "$tmp/err")"
[ "$(hash_of "$tmp/ck")" = "$(hash_of "$tmp/ddp")" ] || fail "gpt --activation-checkpointing $(hash_of "$tmp/ck") vs $(hash_of "$tmp/ddp")"
/usr/bin/env python3 - "$tmp/ck" "$tmp/ddp" <<'PY' || fail "gpt --activation-checkpointing: activations not reduced"
import json, sys
ck, plain = (json.loads(open(f).read().strip().splitlines()[-1])["memory_per_rank"] for f in sys.argv[1:])
assert 0 < ck["activations"] < plain["activations"] and ck["workspaces"] == plain["workspaces"] > 0, (ck, plain)
PY
expect_error 2 "\-\-activation-checkpointing applies to \-\-model gpt; model mlp" -- train --data synthetic --activation-checkpointing
expect_error 2 "\-\-threads must be at least 1 (got 0)" -- "${tiny[@]}" --threads 0
expect_error 2 "\-\-threads applies to \-\-model gpt; model mlp runs on one thread a rank (use \-\-world for more)" \
  -- train --data synthetic --threads 2
expect_error 2 "\-\-matmul-precision: unknown precision 'f16' (known: f32, bf16)" -- "${tiny[@]}" --matmul-precision f16
expect_error 2 "\-\-matmul-precision applies to \-\-model gpt; model mlp multiplies in float32" \
  -- train --data synthetic --matmul-precision bf16
# Every kind of rule on gpt's many matrices: tensor_stats (lamb, adafactor)
# and whole_tensor (muon with adamw for the 1-D parameters, shampoo) give
# ddp's bits under zero2 and zero3 too; and the gossip strategies run.
for o in sgd lamb adafactor muon shampoo; do
  "$bin" "${tiny[@]}" --max-steps 4 --world 2 --optimizer $o --strategy ddp >"$tmp/o_ddp" 2>"$tmp/err" \
    || fail "gpt $o ddp exited $?: $(cat "$tmp/err")"
  for s in zero2 zero3; do
    "$bin" "${tiny[@]}" --max-steps 4 --world 2 --optimizer $o --strategy $s >"$tmp/o_$s" 2>/dev/null || fail "gpt $o $s exited $?"
    [ -n "$(hash_of "$tmp/o_ddp")" ] && [ "$(hash_of "$tmp/o_$s")" = "$(hash_of "$tmp/o_ddp")" ] \
      || fail "gpt $o: $s $(hash_of "$tmp/o_$s") vs ddp $(hash_of "$tmp/o_ddp")"
  done
done
for s in sgp osgp dpsgd adpsgd slowmo diloco; do
  "$bin" "${tiny[@]}" --max-steps 4 --world 2 --strategy $s --clip-grad-norm 1 --ema-decay 0.9 >/dev/null 2>"$tmp/err" \
    || fail "gpt under $s exited $?: $(cat "$tmp/err")"
done
# Streaming DiLoCo over gpt's 4 units (one fragment holds only ln_f, whose
# 1-D parameters an outer muon gives to its adamw companion), fp8 on the
# wire, an overlapped sync.
"$bin" "${tiny[@]}" --max-steps 8 --world 2 --strategy diloco --sync-every 4 --fragments 4 --sync-delay 1 \
  --outer-optimizer muon --outer-lr 0.02 --outer-dtype fp8 >/dev/null 2>"$tmp/err" \
  || fail "gpt under streaming diloco exited $?: $(cat "$tmp/err")"
python3 - "$tmp/ddp" <<'PY' || fail "gpt summary: $(tail -n 1 "$tmp/ddp")"
import json, math, sys
d = json.loads(open(sys.argv[1]).read().splitlines()[-1])
assert d["model"] == "gpt" and d["steps"] == 12, d
assert abs(d["val_bits_per_byte"] - d["val_loss"] / math.log(2)) < 1e-6, d
assert 0 < d["val_loss"] < math.log(256) and 0 < d["train_loss"] < 6, d
assert d["tokens_per_s"] > 0 and d["gpt"] == {"layers": 2, "heads": 2, "dim": 32, "context": 16,
                                              "parameters": d["gpt"]["parameters"], "threads": 1,
                                              "matmul_precision": "f32"}, d
# wte 256x32, wpe 16x32, per block 12 d^2 + 13 d, ln_f 2d
assert d["gpt"]["parameters"] == 256 * 32 + 16 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32, d
PY
# Training lowers the validation loss.
"$bin" "${tiny[@]}" --max-steps 60 --lr 0.01 >"$tmp/longer" 2>/dev/null || fail "60 steps exited $?"
python3 - "$tmp/ddp" "$tmp/longer" <<'PY' || fail "60 steps did not lower val_loss below 12 steps'"
import json, sys
a, b = (json.loads(open(p).read().splitlines()[-1]) for p in sys.argv[1:])
assert b["val_loss"] < a["val_loss"] - 0.3, (a["val_loss"], b["val_loss"])
PY

# --warmup-steps: torch's SequentialLR of LinearLR(1/W over W - 1 steps) and
# CosineAnnealingLR over the rest (the values torch 1.13 gives for W 4 of 10).
"$bin" "${tiny[@]}" --max-steps 10 --warmup-steps 4 --lr 0.001 --metrics "$tmp/m.jsonl" >/dev/null 2>&1 \
  || fail "--warmup-steps exited $?"
python3 - "$tmp/m.jsonl" <<'PY' || fail "--warmup-steps schedule"
import json, sys
lrs = [json.loads(l)["lr"] for l in open(sys.argv[1]) if '"lr"' in l]
want = [0.00025, 0.0005, 0.00075, 0.001, 0.001, 0.000933013, 0.00075, 0.0005, 0.00025, 6.6987e-05]
assert len(lrs) == 10 and all(abs(a - b) < 1e-9 for a, b in zip(lrs, want)), lrs
PY
expect_error 2 "\-\-warmup-steps 10 leaves nothing of the run's 10 steps to decay over" -- "${tiny[@]}" --max-steps 10 --warmup-steps 10
expect_error 2 "\-\-warmup-steps is a schedule of its own" -- "${tiny[@]}" --warmup-steps 10 --scheduler steplr

# distopt sample: the prompt, then --tokens bytes, the same for a seed; from
# --export-params and from a checkpoint export alike (both record --heads).
"$bin" "${tiny[@]}" --max-steps 20 --export-params "$tmp/g.safetensors" --checkpoint-dir "$tmp/gck" >/dev/null 2>&1 \
  || fail "gpt export exited $?"
"$bin" checkpoint export "$tmp/gck" -o "$tmp/gc.safetensors" >/dev/null 2>&1 || fail "gpt checkpoint export exited $?"
"$bin" sample --params "$tmp/g.safetensors" --prompt "the " --tokens 50 --seed 4 >"$tmp/s1" 2>"$tmp/err" \
  || fail "sample exited $?: $(cat "$tmp/err")"
"$bin" sample --params "$tmp/gc.safetensors" --prompt "the " --tokens 50 --seed 4 >"$tmp/s2" 2>/dev/null || fail "sample of a checkpoint export"
cmp -s "$tmp/s1" "$tmp/s2" || fail "sample: --export-params and checkpoint export differ: $(cat "$tmp/s1") / $(cat "$tmp/s2")"
[ "$(head -c 4 "$tmp/s1")" = "the " ] && [ "$(wc -c <"$tmp/s1")" = 55 ] || fail "sample output: $(od -c "$tmp/s1" | head -3)"
"$bin" sample --params "$tmp/g.safetensors" --prompt "the " --tokens 50 --seed 5 >"$tmp/s3" 2>/dev/null
! cmp -s "$tmp/s1" "$tmp/s3" || fail "sample: seeds 4 and 5 gave the same text"
"$bin" sample --params "$tmp/g.safetensors" --prompt "the " --tokens 30 --temperature 0 --seed 1 >"$tmp/g1" 2>/dev/null
"$bin" sample --params "$tmp/g.safetensors" --prompt "the " --tokens 30 --temperature 0 --seed 2 >"$tmp/g2" 2>/dev/null
cmp -s "$tmp/g1" "$tmp/g2" || fail "sample --temperature 0 depends on the seed"
"$bin" train --data synthetic --max-steps 1 --progress none --export-params "$tmp/mlp.safetensors" >/dev/null 2>&1
expect_error 2 "$tmp/mlp.safetensors: not a gpt parameter file (no wte and wpe matrices)" \
  -- sample --params "$tmp/mlp.safetensors" --prompt x
expect_error 2 "\-\-heads 5 does not divide \-\-dim 32" -- sample --params "$tmp/g.safetensors" --prompt x --heads 5
# A file whose tensors disagree with each other: one of them from a wider model.
python3 - "$tmp/g.safetensors" "$tmp/bad.safetensors" <<'PY'
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
h = json.loads(raw[8:8 + n])
h["h.1.mlp.c_fc.bias"]["shape"] = [64, 2]  # same bytes, another shape
b = json.dumps(h).encode()
open(sys.argv[2], "wb").write(struct.pack("<Q", len(b)) + b + raw[8 + n:])
PY
expect_error 2 "bad.safetensors: h.1.mlp.c_fc.bias is \[64, 2\]; a gpt with \-\-dim 32 \-\-context 16 \-\-heads 2 needs \[128\]" \
  -- sample --params "$tmp/bad.safetensors" --prompt x
expect_error 2 "\-\-prompt needs at least one byte of text" -- sample --params "$tmp/g.safetensors" --prompt ""
expect_error 2 "\-\-temperature must be a non-negative number (got -1)" -- sample --params "$tmp/g.safetensors" --prompt x --temperature -1

# The fortunes package (Debian's), in sorted file order.
if [ -d /usr/share/games/fortunes ]; then
  "$bin" train --model gpt --data fortunes --layers 1 --heads 2 --dim 16 --context 32 --batch-size 4 --max-steps 3 \
    --test-size 8 --progress none >"$tmp/f" 2>"$tmp/err" || fail "--data fortunes exited $?: $(cat "$tmp/err")"
  grep -q "^gpt on fortunes, adamw, ddp, world 1: val_loss [0-9.]* ([0-9.]* bits/byte)" "$tmp/f" || fail "$(cat "$tmp/f")"
  # fortunes is gpt's default data set.
  "$bin" train --model gpt --layers 1 --heads 2 --dim 16 --context 32 --batch-size 4 --max-steps 2 --test-size 4 \
    --progress none >"$tmp/f2" 2>&1 || fail "--model gpt without --data exited $?: $(cat "$tmp/f2")"
  grep -q "^gpt on fortunes" "$tmp/f2" || fail "--model gpt without --data: $(cat "$tmp/f2")"
  # ... and so its checkpoint's: the command that started the run resumes
  # it with --resume added (and a later --max-steps).
  small=(train --model gpt --layers 1 --heads 2 --dim 16 --context 32 --batch-size 4 --test-size 4 --progress none
         --checkpoint-dir "$tmp/ckf" --checkpoint-every 2)
  "$bin" "${small[@]}" --max-steps 2 >"$tmp/f3" 2>&1 || fail "gpt checkpointed exited $?: $(cat "$tmp/f3")"
  "$bin" "${small[@]}" --max-steps 3 --resume >"$tmp/f4" 2>&1 || fail "gpt resumed exited $?: $(cat "$tmp/f4")"
  grep -q "^gpt on fortunes, .* steps 3 " "$tmp/f4" || fail "gpt resumed: $(cat "$tmp/f4")"
  "$bin" train --model gpt --print-config | grep -q '"data": "fortunes"' || fail "--print-config names no fortunes"
fi
DISTOPT_FORTUNES_DIR="$tmp/none" expect_error 2 "$tmp/none: no such folder; --data fortunes reads Debian's fortunes package (apt-get install fortunes)" \
  -- train --model gpt --data fortunes
mkdir "$tmp/nofortunes"
expect_error 2 "no fortune files in it" -- train --model gpt --data fortunes --data-dir "$tmp/nofortunes"

# Bad input: one line before any work.
expect_error 2 "\-\-heads 3 does not divide \-\-dim 32: every head needs dim / heads channels" \
  -- train --model gpt --data text --data-file "$tmp/corpus.txt" --heads 3 --dim 32
: >"$tmp/empty.txt"
expect_error 2 "\-\-data-file $tmp/empty.txt: the file is empty" -- train --model gpt --data text --data-file "$tmp/empty.txt"
expect_error 2 "\-\-data-file $tmp/missing.txt: no such file" -- train --model gpt --data text --data-file "$tmp/missing.txt"
expect_error 2 "\-\-data-file $tmp: is a folder, not a file" -- train --model gpt --data text --data-file "$tmp"
printf 'just a short line of text\n' >"$tmp/short.txt"
expect_error 2 "\-\-context 64 needs windows of 65 bytes; the training part of $tmp/short.txt has 24" \
  -- train --model gpt --data text --data-file "$tmp/short.txt"
expect_error 2 "\-\-model gpt reads text: use \-\-data fortunes or \-\-data text \-\-data-file PATH (not \-\-data fashion-mnist)" \
  -- train --model gpt --data fashion-mnist
expect_error 2 "\-\-model gpt reads text: use \-\-data fortunes or \-\-data text \-\-data-file PATH (not \-\-data synthetic)" \
  -- train --model gpt --data synthetic
expect_error 2 "\-\-data fortunes is text: it needs \-\-model gpt (not \-\-model mlp)" -- train --data fortunes
expect_error 2 "\-\-data text needs \-\-data-file PATH" -- train --model gpt --data text
expect_error 2 "\-\-data-file goes with \-\-data text" -- train --model gpt --data fortunes --data-file "$tmp/corpus.txt"
chmod 000 "$tmp/corpus.txt"
if ! cat "$tmp/corpus.txt" >/dev/null 2>&1; then  # not as root, who reads anything
  expect_error 2 "$tmp/corpus.txt: cannot read it" -- train --model gpt --data text --data-file "$tmp/corpus.txt"
fi
chmod 644 "$tmp/corpus.txt"
finish "cli gpt"

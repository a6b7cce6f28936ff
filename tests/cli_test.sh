#!/usr/bin/env bash
# The command-line contract (docs/formats.md), checked from outside:
# exit codes, one-line errors on stderr, --json as the last line of stdout.
set -u
bin=$1
src=$2
source "$(dirname "$0")/check_lib.sh"

golden=$src/tests/golden/optim/adam_004_ams_wd.json
# replay --json: exactly one JSON object as the last line, with params and lr.
"$bin" replay "$golden" --json >"$tmp/out" 2>"$tmp/err" || fail "replay --json exited $?"
tail -n 1 "$tmp/out" | grep -q '^{"params": \[\[.*\]\], "lr": \[\[.*\]\]}$' || fail "replay --json last line: $(tail -n 1 "$tmp/out")"
# ... and the printed floats reproduce the golden values (compared by --check through a rebuilt case).
/usr/bin/env python3 - "$golden" "$tmp/out" <<'PY' || fail "replay output does not match expected within tolerance"
import json, sys
case = json.load(open(sys.argv[1]))
out = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
for ours, want in zip(out["params"], case["expected"]["params"]):
    assert len(ours) == len(want)
    for a, b in zip(ours, want):
        assert abs(a - b) <= 1e-6 + 1e-5 * abs(b), (a, b)
PY

# --check on a tampered golden file fails with status 1 and names the value.
/usr/bin/env python3 - "$golden" "$tmp/bad.json" <<'PY'
import json, sys
case = json.load(open(sys.argv[1]))
case["expected"]["params"][0][0] += 1e-3
json.dump(case, open(sys.argv[2], "w"))
PY
"$bin" replay --check "$tmp/bad.json" --json >"$tmp/out" 2>"$tmp/err"
[ $? = 1 ] || fail "replay --check on a wrong expectation did not exit 1"
tail -n 1 "$tmp/out" | grep -q '"passed": 0, "failed": 1' || fail "replay --check --json summary: $(tail -n 1 "$tmp/out")"
grep -q 'params\[0\]\[0\]' "$tmp/err" || fail "replay --check does not name the mismatching value"

# Bad input: one line on stderr, status 2.
head -c 300 "$golden" >"$tmp/truncated.json"
# --check judges every case; an unreadable one makes the status 2, not 1.
"$bin" replay --check "$golden" "$tmp/truncated.json" >"$tmp/out" 2>"$tmp/err"
[ $? = 2 ] || fail "replay --check with an unreadable case did not exit 2"
grep -q "replay --check: 1 passed, 1 failed (1 of them unreadable)" "$tmp/out" || fail "unreadable summary: $(cat "$tmp/out")"
grep -q "^FAIL .*truncated.json: .*malformed JSON" "$tmp/err" || fail "unreadable case line: $(cat "$tmp/err")"
expect_error 2 "malformed JSON" -- replay "$tmp/truncated.json"
expect_error 2 "cannot open file" -- replay "$tmp/missing.json"
expect_error 2 "The following argument was not expected: --frobnicate" -- replay "$golden" --frobnicate
expect_error 2 "unknown benchmark rule 'adamm'" -- bench optim --rules adamm
expect_error 2 "unknown benchmark case '3M'" -- bench optim --cases 3M
# Numbers beyond double's range, shapes whose product overflows, endless
# input: one-line errors naming the file, never an internal error.
sed 's/"lr":[0-9.e-]*/"lr":1e999/' "$golden" >"$tmp/huge.json"
expect_error 2 "huge.json: malformed JSON: number overflow" -- replay "$tmp/huge.json"
cat >"$tmp/shape.json" <<'JSON'
{"format": "distopt-replay/1", "optimizer": {"name": "sgd", "options": {"lr": 0.1}},
 "params": [{"shape": [3, 6148914691236517206], "data": [1, 2]}], "steps": []}
JSON
expect_error 2 "shape.json: params\[0\].shape: has more elements than any tensor can" -- replay "$tmp/shape.json"
expect_error 2 "larger than 256 MiB, too large for a replay case" -- replay /dev/zero
expect_error 2 "--atol: must be a non-negative number (got -1)" -- replay --check "$golden" --atol -1
expect_error 2 "golden: is a folder: give one case file, or --check" -- replay "$src/tests/golden"
sed 's/"name":"adam"/"name":"adamm"/' "$golden" >"$tmp/unknown.json"
expect_error 2 "unknown optimizer 'adamm'" -- replay "$tmp/unknown.json"
sed 's/"options":{/"options":{"lrr":1,/' "$golden" >"$tmp/option.json"
expect_error 2 "unknown option 'lrr' for optimizer adam" -- replay "$tmp/option.json"

# bench optim --json: a small run prints the contract's fields.
"$bin" bench optim --rules adam --cases 1000x16K --threads 1 --repeats 1 --json >"$tmp/out" 2>/dev/null || fail "bench optim exited $?"
tail -n 1 "$tmp/out" | grep -q '^{"results": \[{"rule": "adam", "case": "1000x16K", "threads": 1, "gbps": [0-9.]*, "roofline_gbps": [0-9.]*, "fraction": [0-9.]*, "step_s": [0-9.e-]*}\]}$' \
  || fail "bench optim --json: $(tail -n 1 "$tmp/out")"
"$bin" bench optim --rules adamw,adamw-int8 --cases 1000x16K --threads 1 --repeats 1 --json >"$tmp/out" 2>/dev/null \
  || fail "bench optim adamw-int8 exited $?"
tail -n 1 "$tmp/out" | grep -q '"rule": "adamw-int8", "case": "1000x16K"' || fail "bench optim adamw-int8: $(tail -n 1 "$tmp/out")"

# bench comm --json (threads backend): the contract's fields, no wrong results.
"$bin" bench comm --world 3 --min-bytes 4096 --max-bytes 65536 --json >"$tmp/out" 2>/dev/null || fail "bench comm exited $?"
tail -n 1 "$tmp/out" | grep -q '^{"backend": "threads", "world": 3, "results": \[{"backend": "threads", "collective": "all_reduce", "bytes": [0-9]*, .*"busbw_gbps": [0-9.]*, .*"raw_busbw_gbps": null, .*"wrong": 0}' \
  || fail "bench comm --json: $(tail -n 1 "$tmp/out" | cut -c1-300)"
tail -n 1 "$tmp/out" | grep -q '"wrong": [1-9]' && fail "bench comm reported wrong results"
expect_error 2 "--world: Value 0 not in range" -- bench comm --world 0
expect_error 2 "unknown collective 'allreduce'" -- bench comm --collectives allreduce
if env | grep -q '^OMPI_COMM_WORLD_SIZE='; then :; else
  expect_error 2 "needs to be started by mpirun" -- bench comm --backend mpi
fi

# bench strategies --json: every strategy, and the bytes each rank sends within
# 5% of the ZeRO volumes (a property of the collectives issued, not a timing).
"$bin" bench strategies --models mlp --worlds 2,4 --rounds 1 --steps 2 --grad-compression none,bf16,int8 --json \
  >"$tmp/out" 2>/dev/null ||
  fail "bench strategies exited $?"
/usr/bin/env python3 "$src/tests/bench_strategies_check.py" "$tmp/out" threads 2,4 >/dev/null 2>"$tmp/err" ||
  fail "bench strategies: $(tail -n 1 "$tmp/err")"
expect_error 2 "unknown benchmark model 'resnet'" -- bench strategies --models resnet
expect_error 2 "unknown strategy 'zero4'" -- bench strategies --strategies zero4
expect_error 2 "--grad-compression: unknown scheme 'int2' (known: none, bf16, fp16, int8, powersgd, onebit)" -- bench strategies \
  --grad-compression int2

# bench memory: under one cap on the training process's resident memory,
# zero3 fits a larger gpt than ddp (the ZeRO headline, small: width 64);
# every largest model's peak within the cap, one more layer over it. Not
# under a sanitizer: its shadow memory counts in the resident size.
if sanitized; then
  echo "bench memory under a cap: skipped (a sanitizer's shadow memory is not the program's)"
else
"$bin" bench memory --cap 160M --dim 64 --strategies ddp,zero3 --steps 1 --json >"$tmp/out" 2>"$tmp/err" ||
  fail "bench memory exited $?: $(tail -n 1 "$tmp/err")"
/usr/bin/env python3 - "$tmp/out" <<'PY' || fail "bench memory --json: $(tail -n 1 "$tmp/out" | cut -c1-400)"
import json, sys
d = json.loads(open(sys.argv[1]).read().splitlines()[-1])
r = {x["strategy"]: x for x in d["results"]}
assert d["cap"] == 160 << 20, d["cap"]
for x in r.values():
    assert 0 < x["peak_rss"] <= d["cap"], x
    assert x["first_over"] == x["layers"] + 1, x
assert r["zero3"]["parameters"] > 2 * r["ddp"]["parameters"], r
PY
fi
expect_error 2 "not even a 1-layer gpt of width 64 fits under ddp at world 4" -- bench memory --cap 8M --dim 64 --strategies ddp
expect_error 2 "--cap must be a positive size in bytes" -- bench memory --cap 1X
expect_error 2 "unknown strategy 'zero4'" -- bench memory --cap 100M --strategies zero4

finish "cli contract"

#!/usr/bin/env bash
# The documented commands that no other test ran (docs/reliability.md,
# "Documented commands"): scripts/demo's training on the real Fashion-MNIST
# of Debian's dataset-fashion-mnist, the README's logreg and link-emulator
# lines, and distopt --help; each as documented, with only --max-steps or
# --epochs cut where the documented run is long.
set -u
bin=$1
source "$(dirname "$0")/check_lib.sh"

# scripts/demo's job, exactly: one epoch, 4 ranks, real data.
"$bin" train --model mlp --data fashion-mnist --optimizer adamw --lr 1e-3 --strategy ddp --world 4 --batch-size 128 \
  --epochs 1 --metrics "$tmp/demo.jsonl" --json --progress none >"$tmp/demo" 2>"$tmp/err" ||
  fail "the demo's train exited $?: $(cat "$tmp/err")"
/usr/bin/env python3 - "$tmp" <<'PY' || fail "the demo's run is not what the README says"
import json, sys
s = json.loads(open(sys.argv[1] + "/demo").read().strip().splitlines()[-1])
assert s["data"] == "fashion-mnist" and s["world"] == 4 and s["steps"] == 469, s
assert s["test_accuracy"] > 0.82, s["test_accuracy"]  # the README: 0.84 after one epoch
lines = [json.loads(l) for l in open(sys.argv[1] + "/demo.jsonl")]
assert sum(l["kind"] == "step" for l in lines) == 469
PY

# README: logistic regression with SGD and momentum, real data (one epoch).
"$bin" train --model logreg --optimizer sgd --lr 0.1 --momentum 0.9 --json --progress none >"$tmp/logreg" 2>"$tmp/err" ||
  fail "train --model logreg exited $?: $(cat "$tmp/err")"
/usr/bin/env python3 -c "
import json, sys
s = json.loads(open('$tmp/logreg').read().strip().splitlines()[-1])
assert s['model'] == 'logreg' and s['test_accuracy'] > 0.7, s
" || fail "train --model logreg: $(tail -n 1 "$tmp/logreg")"

# README and docs/gossip.md: sgp on an emulated 100 Mbit/s link with 1 ms latency.
"$bin" train --strategy sgp --world 8 --topology exponential --link-bandwidth 100M --link-latency 0.001 \
  --data synthetic --train-size 2048 --test-size 256 --max-steps 8 --json --progress none >"$tmp/link" 2>"$tmp/err" ||
  fail "train with the link emulator exited $?: $(cat "$tmp/err")"
grep -q '"strategy": "sgp"' "$tmp/link" || fail "train with the link emulator: $(cat "$tmp/link")"

# distopt --help lists every verb.
"$bin" --help >"$tmp/help" 2>&1 || fail "distopt --help exited $?"
for verb in train replay bench gossip-average checkpoint sample; do
  grep -q "$verb" "$tmp/help" || fail "distopt --help does not list $verb"
done

finish "documented commands"

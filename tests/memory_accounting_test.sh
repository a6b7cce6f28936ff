#!/usr/bin/env bash
# Every byte accounted for (docs/performance.md, "Memory"): the summary's
# memory_process explains the process's peak resident memory within 10%:
# the runtime before the data, the data set, and each rank's reported
# categories (parameters, gradients, optimizer state, activations,
# workspaces, each a peak) times the ranks in the process. ddp and zero3,
# gpt and the MLP on Fashion-MNIST, 4 ranks of the threads backend; and a
# run that writes checkpoints (streamed from the live state: no copy).
set -u
bin=$1
source "$(dirname "$0")/check_lib.sh"
if sanitized; then
  echo "memory accounting: skipped (a sanitizer's shadow memory is not the program's)"
  exit 77
fi

check() {  # NAME ARGS...: one run, its unexplained share under 10%
  local name=$1
  shift
  "$bin" train "$@" --world 4 --optimizer adam --max-steps 4 --progress none --json >"$tmp/out" 2>"$tmp/err" ||
    { fail "$name: train exited $?: $(tail -n 1 "$tmp/err")"; return; }
  /usr/bin/env python3 - "$tmp/out" "$name" <<'PY' || fail "$name: $(tail -n 1 "$tmp/out" | cut -c1-600)"
import json, sys
s = json.loads(open(sys.argv[1]).read().splitlines()[-1])
p, m = s["memory_process"], s["memory_per_rank"]
per_rank = sum(m[k] for k in ("params", "grads", "master_params", "optimizer_state", "activations", "workspaces"))
assert p["ranks"] == 4, p
assert p["runtime"] > 0 and p["data"] > 0, p
assert p["accounted"] == p["runtime"] + p["data"] + 4 * per_rank, (p, m)
share = (s["peak_rss"] - p["accounted"]) / s["peak_rss"]
assert abs(share - p["unexplained"]) < 1e-6, (share, p)
assert abs(share) < 0.10, f"unexplained {share:.1%} of a peak RSS of {s['peak_rss'] / 1e6:.0f} MB: {p}"
print(f"{sys.argv[2]}: peak {s['peak_rss'] / 1e6:.0f} MB, unexplained {share:.1%}")
PY
}

gpt=(--model gpt --data fortunes --layers 8 --dim 256 --heads 4 --context 64 --batch-size 4 --test-size 4
  --activation-checkpointing)
mlp=(--model mlp --data fashion-mnist --hidden 2048,2048,2048 --batch-size 128)
check "gpt ddp" "${gpt[@]}" --strategy ddp
check "gpt zero3" "${gpt[@]}" --strategy zero3
check "gpt ddp, checkpoints" "${gpt[@]}" --strategy ddp --checkpoint-every 2 --checkpoint-dir "$tmp/checkpoints"
check "mlp ddp" "${mlp[@]}" --strategy ddp
check "mlp zero3" "${mlp[@]}" --strategy zero3
check "mlp zero3, tiles" "${mlp[@]}" --strategy zero3 --tile-rows 256

finish "memory accounting"

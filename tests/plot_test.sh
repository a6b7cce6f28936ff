#!/usr/bin/env bash
# scripts/plot_metrics.py on real metrics files (docs/gossip.md, "Plots"):
# two gossip runs (JSON lines and CSV) and a ddp run; the figure is written,
# and the consensus distance it reports for each run is the last one its
# metrics file holds (ddp has none).
set -u
bin=$1
root=$2
source "$(dirname "$0")/check_lib.sh"

/usr/bin/python3 -c "import matplotlib" 2>/dev/null || { echo "skipped: no python3-matplotlib"; exit 77; }
run=(train --data synthetic --train-size 512 --test-size 128 --batch-size 64 --epochs 3 --world 4 --progress none)
"$bin" "${run[@]}" --strategy sgp --metrics "$tmp/sgp.jsonl" >/dev/null 2>"$tmp/err" || fail "sgp: $(cat "$tmp/err")"
"$bin" "${run[@]}" --strategy dpsgd --metrics "$tmp/dpsgd.csv" >/dev/null 2>"$tmp/err" || fail "dpsgd: $(cat "$tmp/err")"
"$bin" "${run[@]}" --strategy ddp --metrics "$tmp/ddp.jsonl" >/dev/null 2>"$tmp/err" || fail "ddp: $(cat "$tmp/err")"
/usr/bin/python3 "$root/scripts/plot_metrics.py" "$tmp/sgp.jsonl" "$tmp/dpsgd.csv" "$tmp/ddp.jsonl" \
  --label sgp --label dpsgd --label ddp --smooth 5 -o "$tmp/fig.png" >"$tmp/out" 2>"$tmp/err" ||
  fail "plot_metrics exited $?: $(cat "$tmp/err")"
[ "$(head -c 8 "$tmp/fig.png" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] || fail "no PNG written"
/usr/bin/python3 - "$tmp" <<'PY' || fail "the reported consensus distances: $(cat "$tmp/out")"
import csv, json, sys
d = sys.argv[1]
out = {l.split(":")[1].strip(): l for l in open(d + "/out") if l.startswith("plot_metrics: ") and "wrote" not in l}
last = {
    "sgp": [json.loads(l) for l in open(d + "/sgp.jsonl") if '"epoch"' in l and '"kind": "epoch"' in l][-1],
    "dpsgd": [r for r in csv.DictReader(open(d + "/dpsgd.csv")) if r["kind"] == "epoch"][-1],
}
for name, rec in last.items():
    want = float(rec["consensus_distance"])
    assert want > 0, (name, want)
    got = float(out[name].rsplit("consensus distance ", 1)[1])
    assert abs(got - want) <= 1e-5 * want, (name, got, want)
assert "consensus" not in out["ddp"], out["ddp"]
PY
expect_error_py() {
  /usr/bin/python3 "$root/scripts/plot_metrics.py" "$@" -o "$tmp/bad.png" >/dev/null 2>"$tmp/err" && fail "plot_metrics $*: exit 0"
  [ "$(wc -l <"$tmp/err")" = 1 ] || fail "plot_metrics $*: not one line: $(cat "$tmp/err")"
}
echo "not json" >"$tmp/bad.jsonl"
expect_error_py "$tmp/bad.jsonl"
finish cli.plot

#!/usr/bin/env bash
# distopt gossip-average from outside: exact consensus, odd worlds, one rank,
# bad input; with MPIEXEC given, the MPI backend gives the same numbers as
# the threads backend at 2, 3 and 4 ranks.
# Usage: gossip_cli_test.sh DISTOPT [MPIEXEC]
set -u
bin=$1
mpiexec=${2:-}
source "$(dirname "$0")/check_lib.sh"

json() { "$bin" gossip-average --json "$@" 2>"$tmp/err" | tail -n 1; }

if [ -z "$mpiexec" ]; then
  out=$(json --world 8 --rounds 3 --dim 1000)
  /usr/bin/env python3 -c '
import json, sys
d = json.loads(sys.argv[1])
assert d["max_abs_error"] < 1e-5 and d["weight_sum_error"] == 0 and d["rounds"] == 3, d
assert len(d["errors"]) == 4 and d["errors"][2] > 1e-2 and d["predicted_rate"] == 0, d
assert d["bytes_sent_per_rank"] == 3 * (8 + 4 * 1000), d
' "$out" || fail "world 8: $out"
  for args in "--world 1" "--world 5 --topology ring" "--world 7" "--world 6 --topology bipartite-exponential" \
              "--world 9 --topology exponential-k --peers-per-iteration 2" "--world 3 --topology complete"; do
    out=$(json $args --rounds 60 --dim 100) || fail "$args: exit $?: $(cat "$tmp/err")"
    /usr/bin/env python3 -c '
import json, sys
d = json.loads(sys.argv[1])
assert d["max_abs_error"] < 1e-4 * max(d["errors"][0], 1e-30) + 1e-6, d
assert abs(d["weight_sum_error"]) < 1e-12, d
' "$out" || fail "$args: did not converge: $out"
  done
  "$bin" gossip-average --world 4 --rounds 2 >"$tmp/out" 2>&1 || fail "human output: exit $?"
  grep -q "^gossip-average: exponential, world 4, 2 rounds, dim 65536: max_abs_error" "$tmp/out" || fail "$(cat "$tmp/out")"

  # A gossip peer that stops answering mid-training: a time-out naming it,
  # for every strategy, within the time-out plus the 2 s abandonment.
  for s in sgp osgp dpsgd adpsgd slowmo; do
    start=$(date +%s)
    DISTOPT_FAULT=stall:1:2 "$bin" train --data synthetic --world 4 --strategy $s --comm-timeout 2 --progress none \
      >/dev/null 2>"$tmp/err"
    status=$?
    [ "$status" = 2 ] || fail "$s stall: exit $status: $(cat "$tmp/err")"
    # A collective ("waiting for rank(s) 1") or a gossip receive ("waiting
    # for rank 1 (tag ...)") may time out first.
    grep -qE "timed out after 2 s waiting for rank(\(s\))? 1.*rank\(s\) 1 did not stop within 2 s and were abandoned" "$tmp/err" \
      || fail "$s stall: $(cat "$tmp/err")"
    limit=10
    sanitized && limit=30
    [ $(( $(date +%s) - start )) -lt $limit ] || fail "$s stall: took $(( $(date +%s) - start )) s"
  done
  # bench gossip, small: the byte counts of each strategy, sgp waiting for
  # its link after compute, osgp, dpsgd and adpsgd overlapping it.
  "$bin" bench gossip --worlds 4 --bandwidths 100M --params 200000 --compute-s 0.02 --steps 3 --json \
    >"$tmp/bench" 2>"$tmp/err" || fail "bench gossip exited $?: $(cat "$tmp/err")"
  timing=1
  sanitized && timing=0  # sanitizers make the copies, not the link, the bottleneck
  /usr/bin/env python3 - "$tmp/bench" "$timing" <<'PY' || fail "bench gossip: $(tail -n 1 "$tmp/bench")"
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
timing = sys.argv[2] == "1"
r = {x["strategy"]: x for x in d["results"]}
assert set(r) == {"ddp", "sgp", "osgp", "dpsgd", "adpsgd"}, r.keys()
for x in r.values():
    assert x["world"] == 4 and x["link_bandwidth_bps"] == 1e8 and x["iter_s_p90"] >= x["iter_s_median"] > 0, x
    for k in ("compute_s", "comm_s", "wait_s", "link_latency_s"):
        assert k in x, (k, x)
# ddp all-reduces 2 (n-1)/n of the model per step, sgp sends it once.
assert abs(r["ddp"]["bytes_per_rank_per_step"] / r["sgp"]["bytes_per_rank_per_step"] - 1.5) < 0.02, r
assert r["sgp"]["iter_s_median"] >= 0.95 * (r["sgp"]["compute_s"] + r["sgp"]["comm_s"]), r["sgp"]
for s in ("osgp", "dpsgd", "adpsgd"):
    assert not timing or r[s]["iter_s_median"] < 0.95 * r["sgp"]["iter_s_median"], (r[s], r["sgp"])
PY
  # diloco in the bench: one all-reduce of the model per --sync-every steps,
  # ddp's bytes over 5; on a 100 Mbit/s link its mean step is shorter.
  "$bin" bench gossip --worlds 4 --bandwidths 100M --params 200000 --compute-s 0.02 --steps 5 --sync-every 5 \
    --strategies ddp,diloco --json >"$tmp/bench" 2>"$tmp/err" || fail "bench gossip diloco exited $?: $(cat "$tmp/err")"
  /usr/bin/env python3 - "$tmp/bench" "$timing" <<'PY' || fail "bench gossip diloco: $(tail -n 1 "$tmp/bench")"
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
r = {x["strategy"]: x for x in d["results"]}
ratio = r["ddp"]["bytes_per_rank_per_step"] / r["diloco"]["bytes_per_rank_per_step"]
assert abs(ratio - 5) < 0.1, ratio
assert sys.argv[2] == "0" or r["diloco"]["iter_s_mean"] < r["ddp"]["iter_s_mean"], r
PY
  expect_error 2 "\-\-fragments must be in \[1, 4\] (the bench's model has 4 layers; got 5)" -- \
    bench gossip --strategies diloco --fragments 5
  expect_error 2 "\-\-bandwidths: '-5' is not a positive bandwidth" -- bench gossip --bandwidths -5
  expect_error 2 "\-\-topology ring: adpsgd averages in pairs on bipartite-exponential (its only topology)" -- \
    train --data synthetic --strategy adpsgd --topology ring
  expect_error 2 "\-\-peers-per-iteration: adpsgd averages with one partner at a time" -- \
    train --data synthetic --strategy adpsgd --peers-per-iteration 2
  expect_error 2 "\-\-link-bandwidth: 'fast' is not a positive bandwidth" -- train --data synthetic --link-bandwidth fast
  expect_error 2 "\-\-link-latency must be a non-negative number of seconds (got -1)" -- train --data synthetic \
    --link-latency -1
  expect_error 2 "unknown topology 'hypercube' (known: exponential, exponential-pm, exponential-k" -- \
    gossip-average --topology hypercube
  expect_error 2 "\-\-peers-per-iteration 4 needs a world of more than 4 ranks (world 4)" -- \
    gossip-average --world 4 --topology exponential-k --peers-per-iteration 4
  expect_error 2 "\-\-peers-per-iteration applies to topology exponential-k only" -- \
    gossip-average --topology ring --peers-per-iteration 2
  expect_error 2 "bipartite-exponential needs an even world size (got 5)" -- \
    gossip-average --world 5 --topology bipartite-exponential
  expect_error 2 "\-\-dim must be at least 1" -- gossip-average --dim 0
  expect_error 2 "\-\-rounds: must be a non-negative integer (got -1)" -- gossip-average --rounds -1
  expect_error 2 "\-\-world must be at least 1 (got 0)" -- gossip-average --world 0
  expect_error 2 "\-\-topology: needs a value" -- gossip-average --topology ''
  finish "gossip cli"
fi

# MPI: the same bits as threads.
for np in 2 3 4; do
  want=$(json --world "$np" --rounds 5 --dim 999 --topology ring | sed 's/"backend": "threads", //')
  got=$("$mpiexec" -n "$np" "$bin" gossip-average --backend mpi --json --rounds 5 --dim 999 --topology ring 2>"$tmp/err" \
        | tail -n 1 | sed 's/"backend": "mpi", //')
  [ -n "$got" ] && [ "$got" = "$want" ] || fail "np $np: mpi $got, threads $want; $(cat "$tmp/err")"
done
finish "gossip mpi"

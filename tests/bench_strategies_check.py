#!/usr/bin/env python3
"""Checks `distopt bench strategies --json` output (last line of a file):
every strategy at every world, the contract's fields, and bytes sent per
rank within 5% of the ZeRO volumes (2Ψ ddp/zero1/zero2, 3Ψ zero3, x (n-1)/n;
with compressed gradients their share -- ddp's all-reduce, zero1-3's
reduce-scatter -- at 2 bytes an element, int8's at 1 + 4/256)."""
import json
import sys

path, backend, worlds = sys.argv[1], sys.argv[2], [int(w) for w in sys.argv[3].split(",")]
rows = json.loads(open(path).read().strip().splitlines()[-1])["results"]
fields = {"strategy", "grad_compression", "backend", "world", "model", "params", "step_s", "bytes_per_rank",
          "theory_bytes", "hidden_fraction", "peak_bytes", "param_hash"}
seen = set()
for r in rows:
    assert set(r) == fields, r
    assert r["backend"] == backend, r
    n, wire = r["world"], {"none": 4, "bf16": 2, "fp16": 2, "int8": 1 + 4 / 256}[r["grad_compression"]]
    grads, gathers = {"ddp": (2, 0), "zero1": (1, 1), "zero2": (1, 1), "zero3": (1, 2)}[r["strategy"]]
    want = (grads * wire + gathers * 4) * r["params"] * (n - 1) / n
    assert abs(r["theory_bytes"] - want) <= 1, (r, want)
    ratio = r["bytes_per_rank"] / r["theory_bytes"]
    assert 0.95 <= ratio <= 1.05, f"{r['strategy']} world {n}: {ratio:.4f} of the theoretical volume"
    assert r["step_s"] > 0 and 0 <= r["hidden_fraction"] <= 1 and r["peak_bytes"] > 0, r
    seen.add((r["strategy"], n, r["grad_compression"]))
compressions = {r["grad_compression"] for r in rows}
for w in worlds:
    for s in ("ddp", "zero1", "zero2", "zero3"):
        for c in compressions:
            assert (s, w, c) in seen, (s, w, c)
# The same parameters under every strategy (per compression; compressed
# gradients change them; int8's ddp packs its sums twice, so it has its own).
def family(r):
    return r["grad_compression"], r["grad_compression"] == "int8" and r["strategy"] == "ddp"
for w in worlds:
    families = {family(r) for r in rows}
    hashes = {f: {r["param_hash"] for r in rows if r["world"] == w and family(r) == f} for f in families}
    assert all(len(h) == 1 for h in hashes.values()), hashes
    assert len({h.pop() for h in hashes.values()}) == len(families), hashes
# Memory falls as the strategies shard more (ZeRO's stages).
for w in worlds:
    peak = {r["strategy"]: r["peak_bytes"] for r in rows if r["world"] == w and r["grad_compression"] == "none"}
    assert peak["zero1"] < peak["ddp"], peak
print("bench strategies: all checks passed")

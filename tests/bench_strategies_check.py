#!/usr/bin/env python3
"""Checks `distopt bench strategies --json` output (last line of a file):
every strategy at every world, the contract's fields, and bytes sent per
rank within 5% of the ZeRO volumes (2Ψ ddp/zero1/zero2, 3Ψ zero3, x (n-1)/n)."""
import json
import sys

path, backend, worlds = sys.argv[1], sys.argv[2], [int(w) for w in sys.argv[3].split(",")]
rows = json.loads(open(path).read().strip().splitlines()[-1])["results"]
fields = {"strategy", "backend", "world", "model", "params", "step_s", "bytes_per_rank", "theory_bytes",
          "hidden_fraction", "peak_bytes", "param_hash"}
seen = set()
for r in rows:
    assert set(r) == fields, r
    assert r["backend"] == backend, r
    psi = 4 * r["params"]
    n = r["world"]
    want = (3 if r["strategy"] == "zero3" else 2) * psi * (n - 1) / n
    assert abs(r["theory_bytes"] - want) <= 1, (r, want)
    ratio = r["bytes_per_rank"] / r["theory_bytes"]
    assert 0.95 <= ratio <= 1.05, f"{r['strategy']} world {n}: {ratio:.4f} of the theoretical volume"
    assert r["step_s"] > 0 and 0 <= r["hidden_fraction"] <= 1 and r["peak_bytes"] > 0, r
    seen.add((r["strategy"], n))
for w in worlds:
    for s in ("ddp", "zero1", "zero2", "zero3"):
        assert (s, w) in seen, (s, w)
# The same parameters under every strategy.
for w in worlds:
    hashes = {r["param_hash"] for r in rows if r["world"] == w}
    assert len(hashes) == 1, hashes
# Memory falls as the strategies shard more (ZeRO's stages).
for w in worlds:
    peak = {r["strategy"]: r["peak_bytes"] for r in rows if r["world"] == w}
    assert peak["zero1"] < peak["ddp"], peak
print("bench strategies: all checks passed")

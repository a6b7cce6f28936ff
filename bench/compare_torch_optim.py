#!/usr/bin/python3
"""distopt's optimizer step against PyTorch's on the same cases, in one run.

Runs `build/bin/distopt bench optim --json` (which measures its own roofline
in the same process) and bench/torch_optim_bench.py (Debian's python3-torch,
install with `scripts/install-deps --golden`), then prints, per rule, case and
thread count: distopt GB/s, torch GB/s, the roofline, distopt/torch and each
one's fraction of the roofline. Both count the same minimum bytes per step.

Usage: /usr/bin/python3 bench/compare_torch_optim.py [--json] [--binary build/bin/distopt]
"""
import argparse
import json
import subprocess
import sys

RULES = {"adam": "adam", "adamw": "adamw", "sgd-momentum": "sgd"}  # distopt label -> torch script label


def last_json(cmd):
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default="build/bin/distopt")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ours = last_json([args.binary, "bench", "optim", "--json", "--rules", ",".join(RULES)])["results"]
    theirs = last_json([sys.executable, "bench/torch_optim_bench.py", "--json"])["results"]
    torch_by_key = {(r["rule"], r["case"], r["threads"]): r for r in theirs}
    rows = []
    for r in ours:
        t = torch_by_key[(RULES[r["rule"]], r["case"], r["threads"])]
        rows.append({"rule": r["rule"], "case": r["case"], "threads": r["threads"], "distopt_gbps": r["gbps"],
                     "torch_gbps": round(t["gbps"], 3), "roofline_gbps": r["roofline_gbps"],
                     "speedup_vs_torch": round(r["gbps"] / t["gbps"], 2),
                     "distopt_fraction": r["fraction"], "torch_fraction": round(t["gbps"] / r["roofline_gbps"], 3)})
    print(f"{'rule':14} {'case':9} {'thr':>3} {'distopt':>8} {'torch':>7} {'roofline':>8} {'x torch':>7} "
          f"{'ours/roof':>9} {'torch/roof':>10}", file=sys.stderr)
    for x in rows:
        print(f"{x['rule']:14} {x['case']:9} {x['threads']:3d} {x['distopt_gbps']:8.2f} {x['torch_gbps']:7.2f} "
              f"{x['roofline_gbps']:8.2f} {x['speedup_vs_torch']:7.2f} {x['distopt_fraction']:9.3f} "
              f"{x['torch_fraction']:10.3f}", file=sys.stderr)
    if args.json:
        print(json.dumps({"results": rows}))


if __name__ == "__main__":
    main()

"""Shared by the scripts/gen_golden_*.py generators that write one JSON
file of cases: number encoding and the file layout."""
import json
import math
import os


def enc(x):
    """A float as JSON: non-finite values as the strings NaN, Infinity, -Infinity."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def write_cases(path, generator, cases):
    """Writes {"generator": ..., "cases": [...]} with one case per line."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="ascii", newline="\n") as f:
        f.write("{\"generator\": \"%s\",\n\"cases\": [\n" % generator)
        f.write(",\n".join(json.dumps(c, separators=(",", ":")) for c in cases))
        f.write("\n]}\n")
    print("wrote %d cases to %s" % (len(cases), path))

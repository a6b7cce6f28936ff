#!/usr/bin/env python3
"""Public headers (include/distopt, installed) include only the standard
library, compiler intrinsics, and other installed distopt headers: no
private header (src/, tools/, tests/, the tool's bench headers) and no
third-party header the package does not declare."""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
include = root / "include"
allowed_system = {"pmmintrin.h", "immintrin.h"}  # compiler intrinsics, part of GCC
bad = []
headers = sorted(p for p in (include / "distopt").rglob("*.hpp") if "bench" not in p.relative_to(include).parts)
for h in headers:
    for n, line in enumerate(h.read_text().splitlines(), 1):
        m = re.match(r'\s*#\s*include\s*([<"])([^>"]+)[>"]', line)
        if not m:
            continue
        kind, name = m.groups()
        where = f"{h.relative_to(root)}:{n}: {line.strip()}"
        if kind == '"':
            if not name.startswith("distopt/") or name.startswith("distopt/bench/"):
                bad.append(where + " (not an installed distopt header)")
            elif name != "distopt/version.hpp" and not (include / name).exists():
                bad.append(where + " (no such header)")
        elif "/" in name or name.endswith(".h") and name not in allowed_system:
            bad.append(where + " (third-party or non-standard)")
if bad:
    print("\n".join(bad))
    sys.exit(1)
print(f"header policy: {len(headers)} public headers include only std, intrinsics and distopt/")

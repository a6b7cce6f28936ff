#!/usr/bin/env python3
"""The layers of docs/architecture.md, checked against the includes.

Reads two tables from docs/architecture.md ("Layers"): which layers each
layer may include, and the internal interfaces (private headers under src/
that rooms other than their own may include). Then every #include "..." of
src/ and include/distopt/ is resolved to the room it lands in; it fails
when a file includes a header of a layer its row does not name, or a
private header of another room that is not an internal interface for it.
  tests/layering.py ROOT
"""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1]).resolve()
doc = (root / "docs" / "architecture.md").read_text()


def table(header):
    """Rows of the markdown table whose header line is `header`."""
    lines = doc.splitlines()
    start = next(i for i, l in enumerate(lines) if l.strip() == header)
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


rooms = {}
for left, right in table("| layer | may include |"):
    if "/" in left:  # bench/, tools/, tests/ ...: outside the library
        continue
    names = [n.strip() for n in left.split(",")]
    allowed = set(re.findall(r"[a-z]+", right)) - {"the", "standard", "library"}
    for n in names:
        rooms[n] = allowed
for allowed in rooms.values():
    unknown = allowed - set(rooms)
    if unknown:
        sys.exit(f"layering: docs/architecture.md names unknown layers {sorted(unknown)}")

interfaces = {}
for header, users in table("| internal interface | may be included by |"):
    path = header.strip("`")
    if not (root / path).exists():
        sys.exit(f"layering: docs/architecture.md names {path}, which does not exist")
    interfaces[path] = {u.strip() for u in users.split(",")}

include_re = re.compile(r'\s*#\s*include\s*"([^"]+)"')
bad = []
checked = 0
sources = [p for base in ("src", "include/distopt") for p in (root / base).rglob("*")
           if p.suffix in {".hpp", ".cpp", ".cu", ".cuh", ".h"}]
for f in sorted(sources):
    rel = f.relative_to(root)
    parts = rel.parts
    room = parts[1] if parts[0] == "src" else parts[2]
    if f.parent == root / "src" or room not in rooms:
        if room not in rooms and f.parent != root / "src" and room != "bench":
            bad.append(f"{rel}: room '{room}' is not in docs/architecture.md's layer table")
        continue
    for n, line in enumerate(f.read_text().splitlines(), 1):
        m = include_re.match(line)
        if not m:
            continue
        name = m.group(1)
        where = f"{rel}:{n}: {line.strip()}"
        if name.startswith("distopt/"):
            target_room = "core" if name == "distopt/version.hpp" else name.split("/")[1]
            private = None
        else:
            target = (f.parent / name).resolve()
            try:
                trel = target.relative_to(root)
            except ValueError:
                bad.append(where + " (outside the repository)")
                continue
            if trel.parts[0] == "include":
                target_room, private = trel.parts[2], None
            elif trel.parts[0] == "src":
                target_room, private = trel.parts[1], trel.as_posix()
            else:
                bad.append(where + " (not a library header)")
                continue
        checked += 1
        if target_room == room:
            continue
        if target_room not in rooms[room]:
            bad.append(where + f" ({room} may not include {target_room}: docs/architecture.md, Layers)")
        elif private is not None and room not in interfaces.get(private, set()):
            bad.append(where + f" (a private header of {target_room}, not an internal interface for {room})")
if bad:
    print("\n".join(bad))
    sys.exit(1)
print(f"layering: {checked} includes of {len(sources)} files follow docs/architecture.md's layers")

"""safetensors files with numpy alone (8-byte little-endian header length,
JSON header, raw little-endian data): what distopt's --export-params,
`distopt checkpoint export` and the golden files use. Shared by the
scripts; no safetensors package needed."""
import json
import struct

import numpy as np


def read_safetensors(path):
    """-> ({name: float32 array}, metadata dict)"""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] != "F32":
            raise SystemExit(f"{path}: tensor {name} is {entry['dtype']}, not F32")
        begin, end = entry["data_offsets"]
        tensors[name] = np.frombuffer(data[begin:end], dtype="<f4").reshape(entry["shape"])
    return tensors, header.get("__metadata__", {})


def write_safetensors(path, tensors, metadata=None):
    """tensors: name -> float32 array, written in the given order."""
    header, chunks, at = {}, [], 0
    for name, value in tensors.items():
        b = np.ascontiguousarray(value, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(np.shape(value)), "data_offsets": [at, at + len(b)]}
        chunks.append(b)
        at += len(b)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(chunks))

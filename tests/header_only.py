"""An HF directory whose model.safetensors is only its header: what a large model's sizes say,
on any disk (tests/cli/test_size_refusals.py, bench/size_refusals.py)."""
from __future__ import annotations

import json
import struct
from pathlib import Path


def header_only_dir(path: Path, cfg: dict) -> Path:
    """config.json of ``cfg`` (a dense family's) and a model.safetensors that is its header and a
    hole of the weights' bytes (a sparse file: nothing written, nothing loadable worth reading)."""
    from circleops.sources.sizes import dense_shapes

    header, offset = {}, 0
    for name, shape in dense_shapes(cfg).items():
        n = 4
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return path

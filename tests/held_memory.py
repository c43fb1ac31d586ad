"""The bytes an object graph holds in tensors, each storage once (tests/generate/
test_integer_graphs.py, bench/integer_calibration.py --held: what the integer calibration keeps
per window)."""
from __future__ import annotations

import gc
from typing import Any

import torch


def held_bytes(root: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` through lists, tuples,
    dicts and circleops objects' attributes, found without making any (a lazily built sample
    is not materialized)."""
    seen, storages, stack = set(), {}, [root]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        elif isinstance(o, (list, tuple, dict)):
            stack.extend(gc.get_referents(o))
        elif type(o).__module__.startswith("circleops"):
            stack.extend(vars(o).values())
    return sum(storages.values())

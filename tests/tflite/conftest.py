"""Session-wide conversions shared by the tflite tests: each (model, dtype) converts once."""
from __future__ import annotations

import os
import sys
from typing import Callable

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import convnet  # noqa: E402
from families import BY_NAME, example_ids  # noqa: E402
from tflite_util import Converted, convert  # noqa: E402

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Callable[[str, str], Converted]:
    """converted(name, dtype): a family of tests/families.py, or "convnet", as .tflite."""
    cache: dict[tuple[str, str], Converted] = {}
    root = tmp_path_factory.mktemp("tflite")

    def get(name: str, dtype: str = "fp32") -> Converted:
        key = (name, dtype)
        if key not in cache:
            if name == "convnet":
                build, example = convnet.build, convnet.example_image
            else:
                build, example = BY_NAME[name].build, lambda: example_ids(seq_len=8)
            cache[key] = convert(build, example, root / f"{name}_{dtype}.tflite", DTYPES[dtype])
        return cache[key]

    return get

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny_vlms import BUILDERS, save_tiny  # noqa: E402

from circleops.adapters.vlm import BY_MODEL_TYPE  # noqa: E402

_SAVED: dict[str, object] = {}  # one tiny model per family and worker, whichever fixture asks first


def _tiny(family, tmp_path_factory):
    if family not in _SAVED:
        _SAVED[family] = save_tiny(family, tmp_path_factory.mktemp(family))
    return _SAVED[family]


def _rows(keep):
    """The tiny families whose VLMFamily row has the capability ``keep`` asks for."""
    return sorted(t for t in BUILDERS if keep(BY_MODEL_TYPE[t]))


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny_vlm(request, tmp_path_factory):
    """A tiny random model of each newer VLM family, saved with its processor."""
    return _tiny(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=_rows(lambda row: row.mrope))
def mrope_vlm(request, tmp_path_factory):
    """The families with 3-D (M-RoPE) positions."""
    return _tiny(request.param, tmp_path_factory)

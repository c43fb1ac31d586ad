import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny_vlms import BUILDERS, save_tiny  # noqa: E402


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny_vlm(request, tmp_path_factory):
    """A tiny random model of each newer VLM family, saved with its processor."""
    return save_tiny(request.param, tmp_path_factory.mktemp(request.param))

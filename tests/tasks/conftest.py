import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny_models import ZOO  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """tiny_dir(name) -> the saved directory of tiny_models.ZOO's row ``name``, built once per session."""
    made: dict[str, Path] = {}
    rows = {t.name: t for t in ZOO}

    def get(name: str) -> Path:
        if name not in made:
            path = tmp_path_factory.mktemp(name) / name
            rows[name].build(path)
            made[name] = path
        return made[name]

    return get

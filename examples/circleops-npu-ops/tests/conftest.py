import importlib.metadata
import sys
from pathlib import Path

import pytest

# The package's tests run from a source checkout too; what needs the *installed* package
# (its entry point) asks for it with the `installed` fixture.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture()
def installed():
    """The entry point of the installed plugin (pip install -e examples/circleops-npu-ops)."""
    points = [ep for ep in importlib.metadata.entry_points(group="circleops.ops") if ep.value == "circleops_npu_ops"]
    assert points, ("circleops-npu-ops is not installed, so circleops cannot find its entry point: "
                    "pip install -e examples/circleops-npu-ops (.ci/run does)")
    return points[0]

"""Every runtime's Session checks its inputs against the file before running.

Before this check LiteRT resized a mis-shaped input and failed deep in XNNPACK (or returned
outputs of another shape), and onert's message named neither the input nor what to do.
"""
import numpy as np
import pytest
import torch

import circleops
from circleops.errors import CircleOpsError
from circleops.runtime import RUNTIMES, open_session
from circleops.targets import PROFILES


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x, ids):
        return self.linear(x).relu() + ids.float().sum()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """runtime -> a file of the target that runtime verifies (or a Circle one for the interpreter)."""
    torch.manual_seed(0)
    model, args = TwoInputs(), (torch.randn(2, 8), torch.tensor([1, 2, 3]))
    out = {}
    for runtime, formats in RUNTIMES.items():
        profile = next(p for p in PROFILES.values() if p.format == formats[0] and p.runtime in (runtime, "reference"))
        path = tmp_path_factory.mktemp(runtime) / f"two.{profile.format}"
        circleops.convert(model, args, path, target=profile.name, verify=False)
        out[runtime] = path
    return out


GOOD = (np.ones((2, 8), np.float32), np.array([1, 2, 3], np.int64))


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_matching_inputs_run(files, runtime):
    out, = open_session(runtime, files[runtime]).run(list(GOOD))
    assert out.shape == (2, 4) and out.dtype == np.float32


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("case, inputs, words", [
    ("shape", (np.ones((3, 8), np.float32), GOOD[1]), ["'x'", "[3, 8]", "expects [2, 8]", "convert again"]),
    ("rank", (np.ones((16,), np.float32), GOOD[1]), ["'x'", "[16]", "expects [2, 8]"]),
    ("dtype", (GOOD[0], GOOD[1].astype(np.int32)), ["'ids'", "int32", "expects int64", "astype(np.int64)"]),
    ("count", (GOOD[0],), ["takes 2 input", "1 given", "x float32[2, 8]", "ids int64[3]"]),
])
def test_mismatched_inputs_are_refused_by_name(files, runtime, case, inputs, words):
    session = open_session(runtime, files[runtime])
    with pytest.raises(CircleOpsError) as err:
        session.run(list(inputs))
    message = str(err.value)
    assert str(files[runtime]) in message
    for word in words:
        assert word in message, f"{runtime}/{case}: {word!r} not in {message!r}"
    # the session stays usable after a refused run
    out, = session.run(list(GOOD))
    assert out.shape == (2, 4)


@pytest.mark.parametrize("runtime", [r for r in RUNTIMES if r != "onert"])  # onert takes no dict
def test_inputs_by_name_need_every_name(files, runtime):
    session = open_session(runtime, files[runtime])
    with pytest.raises(CircleOpsError, match=r"lack \['ids'\]"):
        session.run({"x": GOOD[0]})
    out, = session.run({"x": GOOD[0], "ids": GOOD[1]})
    assert out.shape == (2, 4)

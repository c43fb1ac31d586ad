"""Every op of OPS (torch's OpInfo samples of the Core ATen ops inference uses) converted to
circle, onert and tflite, run (reference interpreter, onert, LiteRT) and compared with torch.

Each op x target must end as recorded in expected.json (tools/coverage.py writes it with
docs/coverage.md): an op that passes keeps passing, an op that is refused is refused with a
CircleOpsError (never a crash), and a change in either direction updates the record and
the published table together.
"""
from __future__ import annotations

import pytest

import opinfo_harness as h

EXPECTED = h.load_expected()
BUGS = ("wrong", "runtime", "crash", "export")


def test_every_op_has_a_recorded_outcome():
    assert set(EXPECTED) == set(h.OPS), (
        f"run tools/coverage.py: no record for {sorted(set(h.OPS) - set(EXPECTED))}, "
        f"stale records {sorted(set(EXPECTED) - set(h.OPS))}")


# No fixtures are shared: the ops spread over four xdist groups, so both workers take them
# (one group per module would put the suite's largest module on one worker).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(f"opinfo-{i % 4}"))
                                  for i, n in enumerate(h.OPS)])
def test_opinfo_op(name):
    got = h.run_op(name, h.SAMPLES)
    want = EXPECTED.get(name, {})
    changed = {t: (want.get(t), o.status, o.detail) for t, o in got.items() if o.status != want.get(t)}
    assert not changed, f"{name}: outcome (recorded, now, why) changed: {changed}; rerun tools/coverage.py if intended"

"""A session asked for isolated after the runtime already ran in this process (issue 24's
containment beside generate's in-process sessions): a child forked from such a process waited
forever inside onert's run (the suite hung); it now runs in-process, as generate's do, and a
fresh process (a one-shot command) still forks its child."""
from __future__ import annotations

import numpy as np

import circleops
from circleops.runtime import isolated, open_session
from families import BY_NAME, example_ids


def test_isolated_onert_after_an_in_process_onert_session(tmp_path, monkeypatch):
    from circleops.runtime import onert

    path = tmp_path / "m.circle"
    circleops.convert(BY_NAME["llama"].build(), (example_ids(8),), path, target="onert")
    ids = example_ids(8).numpy()
    monkeypatch.setattr(isolated, "_NATIVE_USED", set())  # as in a fresh process
    assert isolated.can_isolate()
    want = onert.Session(path).run([ids])[0]  # onert's native code now runs in this process
    assert "onert" in isolated._NATIVE_USED and not isolated.can_isolate()
    session = open_session("onert", path, isolated=True)
    assert not isinstance(session, isolated.IsolatedSession)
    np.testing.assert_array_equal(session.run([ids])[0], want)

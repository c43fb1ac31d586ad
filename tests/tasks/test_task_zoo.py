"""The task zoo: one tiny random model per task (tests/tasks/tiny_models.py, saved with
save_pretrained as a user's directory is), converted by ``circleops convert DIR`` with the task
inferred from config.json, written for onert and circle and verified in onert / the reference
interpreter. docs/tasks.md's table is bench/task_zoo.py's run of the same rows."""
from __future__ import annotations

import json

import pytest

from circleops.cli import main
from circleops.recipes.tasks import read_task_record
from tiny_models import ZOO


@pytest.mark.parametrize("target", ["onert", "circle"])
@pytest.mark.parametrize("row", ZOO, ids=lambda t: t.name)
def test_task_model_converts_from_its_directory(row, target, tiny_dir, tmp_path, capsys):
    model_dir = tiny_dir(row.name)
    out, report = tmp_path / f"{row.name}.circle", tmp_path / "report.json"
    code = main(["convert", str(model_dir), "-o", str(out), "--target", target, "--verify",
                 "--report", str(report), *row.args])
    captured = capsys.readouterr()
    if row.expect != "pass":
        assert code == 2 and row.expect in captured.err, captured.err
        assert not out.exists()
        return
    assert code == 0, captured.err
    data = json.loads(report.read_text())
    assert [name for name, _, _ in data["outputs"]] == list(row.outputs)
    v = data["verify"]
    assert v["runtime"] == ("onert" if target == "onert" else "reference") and v["passed"]
    # tighter than verify's 1e-3 x max(1, max|out|): tiny random heads have tiny outputs
    assert v["max_abs_error"] <= 1e-5 * max(v["reference_max_abs"], 1e-3), v
    if row.task != "text-generation":
        assert f"({row.task}," in captured.out  # the summary says which task was inferred
        record = read_task_record(out)
        assert record["task"] == row.task and record["model_dir"] == str(model_dir.resolve())
        assert record["outputs"] == list(row.outputs)
        assert list(record["inputs"]) == [name for name, _, _ in data["inputs"]]


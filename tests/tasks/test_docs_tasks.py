"""docs/tasks.md runs: its Python blocks in order (one namespace), its shell commands through
the CLI in the same directory, its console transcripts (errors: exit code 2 and that message);
and its zoo table has a row for every model of tests/tasks/tiny_models.py, the CI rows passing."""
from __future__ import annotations

import re
from pathlib import Path

from doc_blocks import blocks, run_cli
from tiny_models import EXTRA, ZOO

DOC = Path(__file__).resolve().parents[2] / "docs" / "tasks.md"
# commands not run, with why
NOT_RUN = {
    "circleops convert google/vit-base-patch16-224 -o vit-base.circle --target onert --verify":
        "downloads from the Hub (no network in CI); hub ids are tested with a cache built in tmp in test_hub.py",
}


def _blocks() -> list[tuple[str, str]]:
    return blocks(DOC)


def _cli(command: str) -> tuple[int, str, str]:
    return run_cli(command)


def test_every_block_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    ran = 0
    for lang, code in _blocks():
        assert lang in ("python", "shell", "console", "text"), lang
        if lang == "python":
            exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - the doc's own example
        elif lang == "shell":
            for command in filter(None, (x.strip() for x in code.splitlines())):
                if command in NOT_RUN:
                    continue
                status, out, err = _cli(command)
                assert status == 0, (command, err)
        elif lang == "console":
            lines = code.strip().splitlines()
            command, transcript = lines[0].removeprefix("$ "), lines[1:]
            status, out, err = _cli(command)
            assert status == 2, (command, out, err)
            for line in transcript:
                assert line in err.splitlines(), (command, line, err)
        ran += 1
    assert ran >= 8
    # what the prose says the commands print
    assert Path("vit.circle").exists() and Path("ner.circle").exists() and Path("vit-features.circle").exists()


def test_the_run_examples_print_labels(tmp_path, monkeypatch):
    """The two `run` commands of the page print what the page says they print."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for lang, code in _blocks():
        if lang == "python" and "save_pretrained" in code:
            exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102
    assert _cli("circleops convert vit-tiny -o vit.circle --target onert --quiet")[0] == 0
    _, out, _ = _cli("circleops run vit.circle --image cat.png --top 3 --runtime onert")
    assert "top 3 (image-classification):" in out and len(re.findall(r"^  0\.\d{4}  ", out, re.M)) == 3
    assert _cli("circleops convert ner-tiny -o ner.circle --target onert --seq-len 16 --quiet")[0] == 0
    _, out, _ = _cli('circleops run ner.circle --text "the cat sat in paris" --runtime onert')
    tokens = re.findall(r"^  (\S+)\t(O|B-LOC|I-LOC)$", out, re.M)
    assert [t for t, _ in tokens] == ["[CLS]", "the", "cat", "sat", "in", "paris", "[SEP]"]


def test_zoo_table_lists_every_model_and_the_ci_rows_pass():
    """The table bench/task_zoo.py wrote: one row per tiny model; the rows CI converts
    (tests/tasks/test_task_zoo.py) pass on both targets there too."""
    text = DOC.read_text()
    table = text[text.index("<!-- task-zoo:start -->"):text.index("<!-- task-zoo:end -->")]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([\w.-]+)` \|.*$", table, re.M)}
    assert set(rows) == {t.name for t in ZOO + EXTRA}
    for t in ZOO + EXTRA:
        cells = [c.strip() for c in rows[t.name].strip("|").split("|")]
        assert cells[1] == t.task and cells[4] in (", ".join(t.outputs), "-"), cells
        if t in ZOO:
            assert cells[5].startswith("pass") and cells[6].startswith("pass") and cells[7] == "yes", cells

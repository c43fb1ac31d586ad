"""The task zoo: tiny random Hugging Face models of every task circleops.recipes.tasks knows, saved
as directories and converted with ``circleops convert DIR --target onert|circle --verify``;
the table goes into docs/tasks.md (between the ``task-zoo`` markers).

    python bench/task_zoo.py                 # every row -> docs/tasks.md
    python bench/task_zoo.py --only vit,hiera   # a few rows, table on stdout

Rows: tests/tasks/tiny_models.py — ZOO (one per task; CI runs them in
tests/tasks/test_task_zoo.py) and EXTRA (more architectures, bench only). Each row runs in
its own process (onert can crash one); the cell is "pass" with onert's / the reference
interpreter's max abs error, or the error the CLI printed.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "tasks"))
DOC = ROOT / "docs" / "tasks.md"
START, END = "<!-- task-zoo:start -->", "<!-- task-zoo:end -->"
TARGETS = ("onert", "circle")


def run_row(name: str) -> dict:
    """Build the row's directory and convert it for each target, in this process."""
    import contextlib
    import io

    import tiny_models
    from circleops.cli import main

    row = {t.name: t for t in tiny_models.ZOO + tiny_models.EXTRA}[name]
    result: dict = {"name": name, "task": row.task, "ci": row in tiny_models.ZOO}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / name
        row.build(model_dir)
        result["class"] = json.loads((model_dir / "config.json").read_text())["architectures"][0]
        for target in TARGETS:
            report = Path(tmp) / f"{target}.json"
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = main(["convert", str(model_dir), "-o", str(Path(tmp) / f"{target}.circle"), "--target",
                             target, "--verify", "--report", str(report), *row.args])
            if code == 0:
                data = json.loads(report.read_text())
                result["inputs"] = [f"{n} {'x'.join(map(str, s))}" for n, s, _ in data["inputs"]]
                result["outputs"] = [n for n, _, _ in data["outputs"]]
                v = data["verify"]
                result[target] = f"pass {v['max_abs_error']:.1e} (max abs {v['reference_max_abs']:.2g})"
            else:
                lines = [x for x in err.getvalue().splitlines() if x.startswith("circleops")]
                text = lines[-1].split("error: ", 1)[-1] if lines else f"exit code {code}"
                result[target] = "fails: " + re.sub(r"/tmp/\S+", "FILE", text)[:240]
    return result


def versions() -> str:
    import datetime
    from importlib.metadata import version

    return (f"Run on {datetime.date.today()}: transformers {version('transformers')}, torch {version('torch')}, "
            f"onert {version('onert')}.")


def table(results: list[dict]) -> str:
    lines = [versions(), "", "| model | task | class | inputs | outputs | onert | circle | CI |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| `{r['name']}` | {r['task']} | {r.get('class', '-')} | {', '.join(r.get('inputs', [])) or '-'} "
                     f"| {', '.join(r.get('outputs', [])) or '-'} | {r.get('onert', '-')} | {r.get('circle', '-')} "
                     f"| {'yes' if r['ci'] else 'no'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated row names; prints the table instead of writing the docs")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # worker: one row, JSON on stdout
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_row(args.one)), flush=True)
        return 0
    import tiny_models

    names = [t.name for t in tiny_models.ZOO + tiny_models.EXTRA]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    results = []
    for name in names:
        proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                              timeout=600)
        found = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        row = json.loads(found[0][7:]) if found else {"name": name, "task": "?", "ci": False,
                                                      "onert": f"fails: the process died ({proc.returncode})"}
        print(f"{name}: onert {row.get('onert')} | circle {row.get('circle')}", file=sys.stderr, flush=True)
        results.append(row)
    text = table(results)
    if args.only:
        print(text)
        return 0
    doc = DOC.read_text()
    start, end = doc.index(START) + len(START), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])
    print(f"wrote {len(results)} rows to {DOC}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

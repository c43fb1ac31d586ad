"""Every code block of README.md and of the guides in docs/ runs, so the docs cannot drift
from the code.

- Every fenced block is labelled: ``python``, ``shell`` (commands), ``console`` (``$ command``
  followed by what it prints) or ``text`` (synopses, tables, listings).
- Python blocks run in page order, section by section (a section = one page's heading), in a fresh namespace holding the
  placeholders of tests/docs/readme_fixture.py.
- Shell and console commands run in a prepared directory, with ``circleops`` being this
  tree, and print no line of a dependency on stderr. A console transcript that shows an
  error must fail with exit status 2 and that message; `circleops generate` must print
  exactly the transcript's text, `circleops inspect` exactly the transcript. Other
  transcripts (convert's, with timings and the real model's figures) are run, not compared;
  ``text`` blocks (synopses, tables, listings) are not run. Commands that are
  not run are listed, each with its reason, in readme_fixture.NOT_RUN (pip installs, the
  test suite itself, repeated conversions of the real model).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

import readme_fixture as fx
import readme_llm
from zygote import MODEL_WARM, WARM, ForkServer

LANGS = {"python", "shell", "console", "text"}


@dataclass(frozen=True)
class Block:
    section: str  # "page.md: ## parent / ### heading"
    lang: str
    code: str
    line: int


@dataclass(frozen=True)
class Command:
    section: str
    cmd: str
    line: int
    transcript: tuple[str, ...] = ()  # console: the lines it printed
    console: bool = False


def _page_blocks(page) -> list[Block]:
    out, parents, inside = [], {}, None
    name = page.relative_to(fx.ROOT).as_posix()
    lines = page.read_text().split("\n")
    for n, line in enumerate(lines, 1):
        if inside is None:
            m = re.match(r"(#{1,6}) ", line)
            if m:
                level = len(m.group(1))
                parents = {k: v for k, v in parents.items() if k < level}
                parents[level] = line.strip()
            elif line.startswith("```"):
                inside = (line[3:].strip(), n, [])
        elif line.startswith("```"):
            lang, start, body = inside
            # a page's sections are its ## headings (a block above the first: the page title)
            section = " / ".join(parents[k] for k in sorted(parents) if k >= 2) or parents.get(1, "")
            out.append(Block(f"{name}: {section}", lang, "\n".join(body), start))
            inside = None
        else:
            inside[2].append(line)
    return out


def _blocks() -> list[Block]:
    return [b for page in fx.PAGES for b in _page_blocks(page)]


BLOCKS = _blocks()


def _strip_comment(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line).strip()


def _commands() -> list[Command]:
    out = []
    for b in BLOCKS:
        if b.lang == "shell":
            out += [Command(b.section, _strip_comment(s), b.line) for s in b.code.split("\n")
                    if s.strip() and not s.lstrip().startswith("#")]
        elif b.lang == "console":
            current = None
            for s in b.code.split("\n"):
                if s.startswith("$ "):
                    if current:
                        out.append(current)
                    current = Command(b.section, _strip_comment(s[2:]), b.line, (), True)
                elif current is not None:
                    current = Command(current.section, current.cmd, current.line, current.transcript + (s,), True)
            if current:
                out.append(current)
    return out


COMMANDS = _commands()
SLOW = [c for c in COMMANDS if (c.cmd.startswith(fx.SLOW_PREFIX) or " out/" in c.cmd) and c.cmd not in fx.NOT_RUN]
FAST = [c for c in COMMANDS if c not in SLOW and c.cmd not in fx.NOT_RUN]


def test_every_block_is_labelled():
    bad = [f"{b.section.split(':')[0]}:{b.line}: ```{b.lang}" for b in BLOCKS if b.lang not in LANGS]
    assert not bad, f"code blocks need one of {sorted(LANGS)}: {bad}"


def test_guides_are_read():
    """The guides' blocks are collected too (the harness reads docs/*.md, not only the README)."""
    pages = {b.section.split(":")[0] for b in BLOCKS}
    assert "README.md" in pages and {"docs/converting.md", "docs/llm.md", "docs/quantization.md"} <= pages


def test_every_command_runs_or_says_why_not():
    """A new command in the docs either runs here or gets a reason in NOT_RUN; a NOT_RUN entry
    whose command left the docs is stale."""
    known = {c.cmd for c in COMMANDS}
    stale = [c for c in fx.NOT_RUN if c not in known]
    assert not stale, f"NOT_RUN names commands the docs no longer have: {stale}"
    assert FAST and SLOW


# ---------------------------------------------------------------- python blocks

def _python_sections() -> dict[str, list[Block]]:
    sections: dict[str, list[Block]] = {}
    for b in BLOCKS:
        if b.lang == "python":
            sections.setdefault(b.section, []).append(b)
    return sections


PY_SECTIONS = _python_sections()


def _is_slow(section: str, blocks: list[Block]) -> bool:
    return any("load_smollm2()" in b.code for b in blocks)


@pytest.fixture(scope="module")
def python_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("readme_py")
    fx.prepare_python_dir(d)
    return d


@pytest.fixture
def kernels_restored():
    """The README's kernel example registers a kernel under an existing opcode: take the
    real one out while it runs, put it back after."""
    from circleops.runtime.kernels import IN_PLACE, KERNELS

    saved, saved_in_place = dict(KERNELS), dict(IN_PLACE)
    KERNELS.pop("SQUARED_DIFFERENCE", None)
    yield KERNELS
    KERNELS.clear(), KERNELS.update(saved)
    IN_PLACE.clear(), IN_PLACE.update(saved_in_place)


@pytest.mark.parametrize("section", [
    pytest.param(s, marks=[pytest.mark.slow] if _is_slow(s, bs) else []) for s, bs in PY_SECTIONS.items()])
def test_python_blocks_run(section, python_dir, monkeypatch, kernels_restored, capsys, smollm2_fp16_check):
    import torch

    import circleops.tools.precision

    monkeypatch.chdir(python_dir)
    # docs/tools.md's check() of the real SmolLM2 in fp16 is tests/check/test_check_smollm2.py's
    # report: computed once per process (tests/smollm2_shared.py); any other call runs check()
    monkeypatch.setattr(circleops.tools.precision, "check", smollm2_fp16_check.check)
    namespace = fx.python_namespace(python_dir)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for b in PY_SECTIONS[section]:
            code = compile(b.code, f"{b.section.split(':')[0]}:{b.line}", "exec")
            exec(code, namespace)
    finally:
        torch.set_num_threads(saved_threads)
    if "@kernel(" in "".join(b.code for b in PY_SECTIONS[section]):
        assert kernels_restored["SQUARED_DIFFERENCE"] is namespace["_"]


# ---------------------------------------------------------------- commands

def _page(c: Command) -> str:
    return c.section.split(":")[0]


# each page's commands in page order: a command may read what an earlier one of its page wrote
PAGE_COMMANDS: dict[str, list[Command]] = {}
for _c in FAST:
    PAGE_COMMANDS.setdefault(_page(_c), []).append(_c)


@pytest.fixture(scope="module")
def shell_run(tmp_path_factory):
    """run(c): c's result, run in its page's directory after every earlier command of that page.

    The order does not come from the scheduler: under xdist (any --dist) a worker may be handed
    `inspect model-q4.circle` without the `convert ... -o model-q4.circle` before it. So each
    page gets its own copy of the prepared directory, and a command first runs the commands
    above it on its page that this process has not run yet (once each: their own tests then
    check the result recorded here). In page order nothing runs twice."""
    template = tmp_path_factory.mktemp("readme_sh")
    fx.prepare_shell_dir(template)
    env = fx.shell_env(tmp_path_factory.mktemp("bin"))
    server = ForkServer(env, tmp_path_factory.mktemp("fork_server"), warm=WARM + MODEL_WARM)  # convert/check MODEL
    env = server.client_env(tmp_path_factory.mktemp("bin_forked"), env)
    dirs: dict[str, Path] = {}
    done: dict[int, subprocess.CompletedProcess] = {}  # id() of a FAST command -> its result

    def run(c: Command) -> subprocess.CompletedProcess:
        page = _page(c)
        if page not in dirs:
            dirs[page] = tmp_path_factory.mktemp("readme_sh_" + re.sub(r"\W", "_", page))
            shutil.copytree(template, dirs[page], dirs_exist_ok=True)
        for earlier in PAGE_COMMANDS[page]:
            if id(earlier) not in done:
                done[id(earlier)] = _run(earlier, dirs[page], env)
            if earlier is c:
                return done[id(c)]
        raise AssertionError(f"{c.cmd} is not one of {page}'s commands")

    yield run
    server.close()


def _run(c: Command, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    cmd = c.cmd
    for word, value in fx.SHELL_PLACEHOLDERS.items():
        cmd = re.sub(rf"\b{word}\b", value, cmd)
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _check(c: Command, p: subprocess.CompletedProcess) -> None:
    where = f"{c.section.split(':')[0]}:{c.line}: {c.cmd}"
    errors = [t for t in c.transcript if ": error:" in t]
    if errors:
        assert p.returncode == 2, f"{where}: the README shows an error, exit status was {p.returncode}"
        assert errors[0].strip() in p.stderr.strip(), f"{where}: printed {p.stderr!r}, the README shows {errors[0]!r}"
        return
    assert p.returncode == 0, f"{where}: exit status {p.returncode}\n{p.stderr[-3000:]}"
    # what a dependency logs is hidden in a normal run (circleops/cli/quiet.py): every stderr
    # line is circleops' own ("circleops...", or the indented continuation of one)
    foreign = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith(("circleops", " "))]
    assert not foreign, f"{where}: lines from a dependency on stderr: {foreign[:5]}"
    if c.console and c.cmd.startswith("circleops generate") and c.transcript:
        assert p.stdout.split("\n")[0] == c.transcript[0], f"{where}: printed {p.stdout!r}"
    if c.console and c.cmd.startswith("circleops inspect") and c.transcript:
        # inspect is deterministic: the transcript is exactly what it prints
        shown = "\n".join(c.transcript).rstrip("\n")
        assert p.stdout.rstrip("\n") == shown, f"{where}: printed\n{p.stdout}"


# correct in any order (shell_run runs a page's earlier commands first); one worker
# (pyproject: --dist loadgroup) only saves running a page's prefix on both workers
@pytest.mark.xdist_group("readme_commands")
@pytest.mark.parametrize("c", FAST, ids=[f"{c.section.split(':')[0]}:L{c.line}:{c.cmd[:60]}" for c in FAST])
def test_command_runs(c, shell_run):
    _check(c, shell_run(c))


@pytest.mark.slow
@pytest.mark.xdist_group(readme_llm.GROUP)  # with tests/generate/test_smollm2.py: out/ is converted once
def test_real_smollm2_commands_run(tmp_path_factory, readme_llm_out):
    """The LLM guide's commands on the real SmolLM2 (docs/llm.md), in page order (a command
    shown twice runs once): convert (tests/readme_llm.py runs it, in a fresh process),
    generate the guide's text, the cache error."""
    assert readme_llm.CONVERT in [c.cmd for c in SLOW], "tests/readme_llm.py must run the guide's own convert"
    cwd = readme_llm_out.cwd
    env = fx.shell_env(tmp_path_factory.mktemp("bin_smollm2"))
    with ForkServer(env, tmp_path_factory.mktemp("fork_server_smollm2")) as server:
        env = server.client_env(tmp_path_factory.mktemp("bin_smollm2_forked"), env)
        done: dict[str, subprocess.CompletedProcess] = {readme_llm.CONVERT: readme_llm_out.proc}
        for c in SLOW:
            p = done.get(c.cmd) or _run(c, cwd, env)
            done[c.cmd] = p
            _check(c, p)

"""Hold-out fuzz of every reader through the ``circleops`` command line, run as a user runs it
(issue 31): each case is a new ``python -m circleops.cli ...`` process with a time limit and
an address-space limit, on an input that tests/fuzz/cli_kinds.py damaged (19 kinds: the
flags of convert / check / run / inspect / ops / generate / chat, hub ids, safetensors, HF
directories, calibration files, .pt2 archives, VLM and Whisper directories, graph files,
task processors, .npy headers, tokenizers, chat templates, manifests, generation configs).

    python tests/fuzz/fuzz_cli.py --cases 340 --seed 2026            # the hold-out run
    python tests/fuzz/fuzz_cli.py --kinds npy,pt2 --cases 20         # some kinds only
    python tests/fuzz/fuzz_cli.py --in-process --cases 40            # forked children (the CI slice's way)
    python tests/fuzz/fuzz_cli.py --replay /tmp/fz/failed            # the saved failing cases, run again

Each outcome is counted: ``ok`` (exit 0), ``refused`` (exit 2, one "circleops CMD: error:"
paragraph or argparse's usage), and the failures: ``code_ran`` (a payload's marker file
exists), ``signal``, ``internal_error`` (exit 1 "internal error ... please report"),
``traceback``, ``memory`` (MemoryError / bad_alloc under the limit), ``hang`` (over the time
limit; the process group is killed) and ``bad_exit`` (any other status). Failing cases are
copied to --save-dir with their log. ``--work DIR`` keeps the seeds between runs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from cli_kinds import KINDS, MARKER, NEEDS, CliCase  # noqa: E402
from cli_seeds import build_seeds  # noqa: E402

GOOD = ("ok", "refused")
BAD = ("code_ran", "signal", "internal_error", "traceback", "memory", "hang", "bad_exit")
MEMORY = 6 << 30  # address space of a case's process: a real run of every seed fits well inside


@dataclass
class CliStats:
    cases: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    per_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    processes: int = 0  # cases run as a new process
    slowest: tuple[float, str] = (0.0, "")

    @property
    def bad(self) -> int:
        return sum(self.outcomes.get(k, 0) for k in BAD)

    def add(self, kind: str, how: str, elapsed: float, what: str) -> None:
        self.cases[kind] = self.cases.get(kind, 0) + 1
        self.outcomes[how] = self.outcomes.get(how, 0) + 1
        row = self.per_kind.setdefault(kind, {})
        row[how] = row.get(how, 0) + 1
        if elapsed > self.slowest[0]:
            self.slowest = (elapsed, f"[{kind}] {what}"[:120])

    def summary(self) -> str:
        outcomes = ", ".join(f"{k} {self.outcomes.get(k, 0)}" for k in GOOD + BAD)
        if self.outcomes.get("not_run"):
            outcomes += f", not run (harness) {self.outcomes['not_run']}"
        return (f"{sum(self.cases.values())} cases over {len(self.cases)} kinds in {self.seconds:.0f} s "
                f"(children's CPU {self.cpu_seconds:.0f} s; slowest {self.slowest[0]:.1f} s {self.slowest[1]}): "
                f"{outcomes}")


def classify(returncode: int | None, text: str, case_dir: Path) -> str:
    """The outcome of one case from its exit status and output (None: it hung)."""
    if any(case_dir.rglob(MARKER)):
        return "code_ran"
    if returncode is None:
        return "hang"
    if returncode < 0:
        return "signal"
    if "MemoryError" in text or "bad_alloc" in text:
        return "memory"
    if "internal error" in text:
        return "internal_error"
    if "Traceback (most recent call last)" in text:
        return "traceback"
    return {0: "ok", 2: "refused"}.get(returncode, "bad_exit")


def _limits(memory: int):
    def apply() -> None:
        os.setsid()  # its own process group: a hang's children are killed with it
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_user_process(case: CliCase, case_dir: Path, timeout: float, memory: int) -> tuple[str, str]:
    """``python -m circleops.cli ARGV`` as a user runs it, in ``case_dir``: (outcome, output)."""
    # offline unless the case says otherwise (HF_HUB_OFFLINE="": huggingface_hub may try the network)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **case.env}
    try:
        proc = subprocess.Popen([sys.executable, "-m", "circleops.cli", *case.argv], cwd=case_dir, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=_limits(memory))
    except OSError as err:  # an argument no shell could pass either (E2BIG): a harness bug, counted apart
        return "not_run", f"cannot start: {err}"
    try:
        out, _ = proc.communicate(case.stdin or b"", timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        code = None
    except BrokenPipeError:  # it exited before reading its stdin
        out, _ = proc.communicate()
        code = proc.returncode
    text = out.decode(errors="replace")
    return classify(code, text, case_dir), text


def run_in_child(case: CliCase, case_dir: Path, timeout: float) -> tuple[str, str]:
    """The case through ``circleops.cli.main`` in a forked child (modules imported once; the CI
    slice's way): the same outcomes, from fuzz_inputs.run_child's exit codes and log."""
    import fuzz_inputs

    def run() -> int:
        os.environ.update({"HF_HUB_OFFLINE": "1", **case.env})
        os.chdir(case_dir)
        from circleops.cli import main

        return main(list(case.argv))

    log = case_dir / "log.txt"
    how, code = fuzz_inputs.run_child(fuzz_inputs.Case(case.kind, case.what, run, cli=True, stdin=case.stdin),
                                      timeout, log)
    text = log.read_text(errors="replace") if log.exists() else ""
    returncode = {"ok": 0, "refused": 2, "signal": -code, "hang": None}.get(how, 1)
    outcome = classify(returncode, text, case_dir)
    return ("bad_exit" if how in ("uncaught", "bad_exit") and outcome in GOOD else outcome), text


def fuzz_cli(cases: int, seed: int = 0, kinds: tuple[str, ...] = tuple(KINDS), timeout: float = 180,
             memory: int = MEMORY, work: Path | None = None, save_dir: Path | None = None,
             in_process: bool = False, log=None, process_every: int = 0) -> CliStats:
    """``cases`` cases spread over ``kinds`` in turn (case n is kind n mod len(kinds), drawn from
    random.Random(seed)), each as a new process, or with ``in_process`` a forked child (then
    every ``process_every``-th case still a new process)."""
    stats = CliStats()
    t0 = time.monotonic()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory(prefix="circleops-fuzz-cli-") as tmp:
        root = Path(work or tmp)
        seeds = build_seeds(root / "seeds", tuple(sorted({n for k in kinds for n in NEEDS[k]})))
        rng = random.Random(seed)
        for n in range(cases):
            kind = kinds[n % len(kinds)]
            case_dir = root / "cases" / f"{n:05d}"
            if case_dir.exists():
                shutil.rmtree(case_dir)
            case_dir.mkdir(parents=True)
            try:
                case = KINDS[kind](rng, seeds, case_dir)
            except Exception as err:  # noqa: BLE001 - a harness bug is counted apart, the run goes on
                stats.add(kind, "not_run", 0.0, f"cannot make the case: {type(err).__name__}: {err}")
                stats.failures.append(f"case {n} [{kind}] not run (harness): {type(err).__name__}: {err}")
                continue
            t = time.monotonic()
            child = in_process and not (process_every and n % process_every == 0)
            how, text = run_in_child(case, case_dir, timeout) if child else \
                run_user_process(case, case_dir, timeout, memory)
            stats.processes += not child
            elapsed = time.monotonic() - t
            stats.add(kind, how, elapsed, case.what)
            if log is not None:
                print(f"{n:4d} {kind:17s} {how:14s} {elapsed:6.1f}s {case.what[:90]!r}", file=log, flush=True)
            if how in BAD:
                tail = " | ".join(text.strip().splitlines()[-4:])[-700:]
                stats.failures.append(f"case {n} [{kind}] {case.what[:200]}: {how}: {tail}\n    argv: "
                                      f"{' '.join(case.argv)[:400]}")
                if save_dir is not None:  # replayable: python tests/fuzz/fuzz_cli.py --replay SAVE_DIR
                    (case_dir / "log.txt").write_text(text)
                    (case_dir / "case.json").write_text(json.dumps(
                        {"kind": kind, "what": case.what, "argv": case.argv, "env": case.env, "dir": str(case_dir),
                         "stdin": None if case.stdin is None else case.stdin.decode("latin-1")}))
                    shutil.copytree(case_dir, Path(save_dir) / f"{n:05d}-{kind}", symlinks=True, dirs_exist_ok=True)
            _remove(case_dir)
    stats.seconds = time.monotonic() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    stats.cpu_seconds = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    return stats


def replay(save_dir: Path, timeout: float = 180, memory: int = MEMORY) -> CliStats:
    """Run again every case a run saved in ``save_dir`` (its copy of the case's files in place
    of the original directory), as a new process: the outcomes with the code as it is now."""
    stats = CliStats()
    for saved in sorted(p for p in Path(save_dir).iterdir() if (p / "case.json").is_file()):
        spec = json.loads((saved / "case.json").read_text())
        argv = [a.replace(spec["dir"], str(saved)) for a in spec["argv"]]
        stdin = None if spec["stdin"] is None else spec["stdin"].encode("latin-1")
        case = CliCase(spec["kind"], spec["what"], argv, stdin, spec["env"])
        for marker in saved.rglob(MARKER):
            marker.unlink()
        t = time.monotonic()
        how, text = run_user_process(case, saved, timeout, memory)
        stats.add(spec["kind"], how, time.monotonic() - t, spec["what"])
        stats.failures += [] if how in GOOD else [f"{saved.name}: {how}: {text.strip().splitlines()[-1:]}"]
    return stats


def _remove(path: Path) -> None:
    for p in path.rglob("*"):  # a case may leave an unreadable file behind
        try:
            if not p.is_symlink():
                p.chmod(0o700)
        except OSError:
            pass
    shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=len(KINDS) * 18)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--timeout", type=float, default=180, help="seconds per case (default 180: a loaded machine)")
    p.add_argument("--memory-gib", type=float, default=MEMORY / 2 ** 30, help="address space per case")
    p.add_argument("--work", type=Path, default=None, help="keep the seeds (and cases) here")
    p.add_argument("--save-dir", type=Path, default=None)
    p.add_argument("--in-process", action="store_true", help="forked children instead of new processes")
    p.add_argument("--process-every", type=int, default=0, help="with --in-process: every N-th case a new process")
    p.add_argument("--replay", type=Path, default=None, help="run again the cases a run saved in this --save-dir")
    args = p.parse_args(argv)
    if args.replay is not None:
        stats = replay(args.replay, args.timeout, int(args.memory_gib * 2 ** 30))
        print(stats.summary())
        print("\n".join(stats.failures))
        return 1 if stats.bad else 0
    kinds = tuple(args.kinds.split(","))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        p.error(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    stats = fuzz_cli(args.cases, args.seed, kinds, args.timeout, int(args.memory_gib * 2 ** 30), args.work,
                     args.save_dir, args.in_process, log=sys.stdout, process_every=args.process_every)
    print(stats.summary())
    for kind, row in sorted(stats.per_kind.items()):
        print(f"  {kind:18s} " + ", ".join(f"{k} {v}" for k, v in sorted(row.items())))
    for line in stats.failures:
        print(line)
    return 1 if stats.bad else 0


if __name__ == "__main__":
    sys.exit(main())

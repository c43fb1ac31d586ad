"""Seeded fuzzing of the paths that hand a file to a native runtime (issue 24).

    python tests/fuzz/fuzz_native.py --cases 2000                     # every path, 2,000 cases each
    python tests/fuzz/fuzz_native.py --paths onert --cases 300 --seed 3

Paths:
* ``onert``: a mutated Circle file (a 1-layer Llama decode graph for target onert, and a small
  RMS-norm net) through ``circleops run FILE --runtime onert``;
* ``litert``: a mutated .tflite (the same nets for target tflite; the Llama through its
  ``decode`` signature) through ``circleops run FILE --runtime litert``;
* ``generate``: a converted directory (target onert, and one for tflite) whose manifest.json is
  mutated (file names made absolute, ``..``, symlinks leaving the directory, /etc/passwd, wrong
  types and values, truncated JSON) or whose graph file is a mutated Circle/TFLite file, through
  ``circleops generate DIR --token-ids ...``.

Each case runs the CLI in a forked child (the modules are loaded once, a case costs what
its command costs), with its output in a file. Counted as failures: a child killed by a
signal ("signal"), an exit status other than 0 / 2 or "Traceback" in its output ("traceback"),
a case over the time limit ("hang"), and a RuntimeCrashError ("contained": `circleops run`
runs the runtime in a child process, so a runtime crash on a file the verifier passed is
reported, not fatal; it still means the verifier let something through).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(HERE), str(REPO / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402

from fuzz import mutate  # noqa: E402

PATHS = ("onert", "litert", "generate")
CRASH_WORDS = "crashed while"  # RuntimeCrashError's message (circleops.runtime.isolated)


@dataclass
class Target:
    """One seed of a path: the argv to run (with {case} for the mutated file or directory)."""

    path: str
    name: str
    data: bytes | None  # the file to mutate (None for a directory seed)
    suffix: str
    argv: list[str]
    directory: Path | None = None  # generate: the converted directory


@dataclass
class NativeStats:
    cases: dict[str, int] = field(default_factory=dict)
    exit0: int = 0
    exit2: int = 0
    signal: int = 0
    traceback: int = 0
    hang: int = 0
    contained: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def bad(self) -> int:
        return self.signal + self.traceback + self.hang + self.contained

    def summary(self) -> str:
        per_path = ", ".join(f"{k} {v}" for k, v in self.cases.items())
        return (f"cases: {per_path}; exit 0: {self.exit0}, exit 2: {self.exit2}; signal deaths: {self.signal}, "
                f"tracebacks/bad exits: {self.traceback}, hangs: {self.hang}, contained runtime crashes: "
                f"{self.contained}")


# --------------------------------------------------------------------------- seeds

def _inputs(path: Path, signature: str | None, work: Path, name: str) -> list[str]:
    """Zero inputs of the file's (signature's) input specs, saved as .npy files."""
    from circleops.runtime import reference

    session = reference.Session(str(path), signature)
    out = []
    for i, spec in enumerate(session.inputs):
        p = work / f"{name}_in{i}.npy"
        np.save(p, np.zeros(spec.shape, spec.dtype))
        out.append(str(p))
    return out


def build_targets(work: Path, paths: tuple[str, ...] = PATHS) -> list[Target]:
    """Convert the seeds once (a 1-layer random Llama's graphs, a small RMS-norm net)."""
    import copy

    import torch

    import circleops
    from circleops.recipes.llm import convert_graphs
    from families import BY_NAME
    from fuzz import _Tiny

    torch.manual_seed(0)
    llama = BY_NAME["llama"].build(num_hidden_layers=1)
    dirs = {}
    for target in ("onert", "tflite"):
        if target == "onert" and not {"onert", "generate"} & set(paths):
            continue
        if target == "tflite" and not {"litert", "generate"} & set(paths):
            continue
        dirs[target] = work / f"llama_{target}"
        convert_graphs(copy.deepcopy(llama), dirs[target], target=target, prefill_len=4, max_cache_len=8,
                       source="fuzz llama")
    x = torch.randn(2, 4, 8)
    targets = []
    if "onert" in paths:
        tiny = work / "tiny_onert.circle"
        circleops.convert(_Tiny().eval(), (x,), tiny, target="onert", fuse="none")
        decode = dirs["onert"] / "decode.circle"
        for name, path in (("llama_decode", decode), ("tiny", tiny)):
            npys = _inputs(path, None, work, f"onert_{name}")
            targets.append(Target("onert", name, path.read_bytes(), ".circle",
                                  ["run", "{case}", "--runtime", "onert", "-i", *npys]))
    if "litert" in paths:
        tiny = work / "tiny.tflite"
        circleops.convert(_Tiny().eval(), (x,), tiny, target="tflite", fuse="none")
        model = dirs["tflite"] / "model.tflite"
        npys = _inputs(tiny, None, work, "litert_tiny")
        targets.append(Target("litert", "tiny", tiny.read_bytes(), ".tflite",
                              ["run", "{case}", "--runtime", "litert", "-i", *npys]))
        npys = _inputs(model, "decode", work, "litert_llama")
        targets.append(Target("litert", "llama_decode", model.read_bytes(), ".tflite",
                              ["run", "{case}", "--runtime", "litert", "--signature", "decode", "-i", *npys]))
    if "generate" in paths:
        for target, d in dirs.items():
            targets.append(Target("generate", f"llama_{target}", None, "", [
                "generate", "{case}", "--token-ids", "1,2,3,4,5", "--max-new-tokens", "2"], directory=d))
    return targets


# --------------------------------------------------------------------------- manifest mutations

_BAD_NAMES = ("/etc/passwd", "../decode.circle", "../../etc/passwd", "a/../../x", "/", ".", "", "manifest.json",
              "tokenizer", "escape", "escape_dir/decode.circle", "nonexistent.circle", 7, None, ["decode.circle"],
              "decode.circle\x00", "C:\\x.circle", "\\\\server\\x")
_BAD_VALUES = (0, -1, 1, 2, 3, 7, 2 ** 31, -(2 ** 31), 10 ** 12, 1.5, "x", None, [], {}, [1], [-1, 8, 2, 4],
               [1, 8, 2, 4, 5], True)


def mutate_manifest(rng: random.Random, manifest: dict, names: list[str]) -> tuple[dict, list[str]]:
    """1-3 changes to a manifest's fields (names: the graph files of the directory)."""
    m = json.loads(json.dumps(manifest))
    done = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        kind = rng.choice(("file", "file", "tokenizer", "value", "value", "drop", "swap"))
        if kind == "file" and isinstance(m.get("files"), dict) and m["files"]:
            graph = rng.choice(sorted(m["files"]))
            m["files"][graph] = rng.choice(_BAD_NAMES + tuple(names))
            done.append(f"files[{graph}]={m['files'][graph]!r}")
        elif kind == "tokenizer":
            part = m.get("text") if isinstance(m.get("text"), dict) else m  # version 4: the text section's
            part["tokenizer"] = rng.choice(_BAD_NAMES)
            done.append(f"tokenizer={part['tokenizer']!r}")
        elif kind in ("value", "drop"):
            # version 4: a common key or one of a section's (text, vision, speech), as often
            sections = [k for k in ("text", "vision", "speech") if isinstance(m.get(k), dict)]
            part = m[rng.choice(sections)] if sections and rng.random() < 0.5 else m
            if not part:
                continue
            key = rng.choice(sorted(part))
            if kind == "value":
                part[key] = rng.choice(_BAD_VALUES)
                done.append(f"{key}={part[key]!r}")
            else:
                del part[key]
                done.append(f"drop {key}")
        else:  # two graphs' files swapped (a prefill graph as the decode graph)
            if isinstance(m.get("files"), dict) and len(m["files"]) > 1:
                a, b = rng.sample(sorted(m["files"]), 2)
                m["files"][a], m["files"][b] = m["files"][b], m["files"][a]
                done.append(f"swap {a} {b}")
    return m, done


def make_case_dir(rng: random.Random, seed: Target, dest: Path) -> list[str]:
    """A copy of the seed directory with a mutated manifest and/or a mutated graph file, plus
    the traps the mutated names point at (a symlink out of the directory, /etc/passwd)."""
    src = seed.directory
    assert src is not None
    shutil.copytree(src, dest, symlinks=True)
    (dest / "escape").symlink_to("/etc/passwd")
    (dest / "escape_dir").symlink_to(src)  # a symlinked directory leaving dest
    manifest = json.loads((src / "manifest.json").read_text())
    names = sorted(set(manifest["files"].values()))
    done: list[str] = []
    choice = rng.random()
    if choice < 0.4:  # a damaged graph file inside the directory
        name = rng.choice(names)
        data, what = mutate(rng, (src / name).read_bytes())
        (dest / name).write_bytes(data)
        done.append(f"{name}: {what}")
    if choice >= 0.3:
        m, what = mutate_manifest(rng, manifest, names)
        text = json.dumps(m)
        if rng.random() < 0.1:
            text = text[: rng.randrange(len(text))]
            what.append("truncated json")
        (dest / "manifest.json").write_text(text)
        done += what
    return done


# --------------------------------------------------------------------------- running a case

def run_forked(argv: list[str], timeout: float, log: Path) -> tuple[str, int]:
    """``circleops argv`` in a forked child, its output in ``log``: ("exit", status) or
    ("signal", signum) or ("hang", 0)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            # new streams on the fds: under pytest sys.stdout/stderr are its capture objects
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            from circleops.cli import main

            code = main(argv)
        except SystemExit as err:  # argparse
            code = err.code if isinstance(err.code, int) else 2
        except BaseException:  # noqa: BLE001 - a traceback is what the harness counts
            import traceback

            traceback.print_exc()
            code = 71
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hang", 0
        time.sleep(0.005)
    if os.WIFSIGNALED(status):
        return "signal", os.WTERMSIG(status)
    return "exit", os.WEXITSTATUS(status)


def fuzz_native(cases: int, seed: int = 0, paths: tuple[str, ...] = PATHS, timeout: float = 60,
                save_dir: Path | None = None, verbose: bool = False, time_budget: float | None = None) -> NativeStats:
    """``cases`` mutated inputs per path (or until ``time_budget`` seconds); returns the counts."""
    rng = random.Random(seed)
    stats = NativeStats()
    with tempfile.TemporaryDirectory(prefix="circleops-fuzz-native-") as tmp:
        work = Path(tmp)
        targets = build_targets(work, paths)
        t0 = time.monotonic()
        by_path = {p: [t for t in targets if t.path == p] for p in paths}
        order = [p for _ in range(cases) for p in paths]
        for k, path in enumerate(order):
            if time_budget is not None and time.monotonic() - t0 > time_budget:
                break
            n = stats.cases.get(path, 0)
            seed_t = by_path[path][n % len(by_path[path])] if n < len(by_path[path]) else rng.choice(by_path[path])
            stats.cases[path] = n + 1
            case_root = work / f"case{k}"
            case_root.mkdir()
            if seed_t.directory is not None:
                case = case_root / "graphs"
                what = make_case_dir(rng, seed_t, case) if n >= len(by_path[path]) else ["none"]
                if what == ["none"]:
                    shutil.copytree(seed_t.directory, case, symlinks=True)
            else:
                assert seed_t.data is not None
                data, what = (seed_t.data, ["none"]) if n < len(by_path[path]) else mutate(rng, seed_t.data)
                case = case_root / f"case{seed_t.suffix}"
                case.write_bytes(data)
            argv = [a.replace("{case}", str(case)) for a in seed_t.argv]
            log = case_root / "log.txt"
            how, value = run_forked(argv, timeout, log)
            text = log.read_text(errors="replace") if log.exists() else ""
            failure = None
            if how == "signal":
                stats.signal += 1
                failure = f"killed by {signal.Signals(value).name}"
            elif how == "hang":
                stats.hang += 1
                failure = f"over {timeout} s"
            elif value not in (0, 2) or "Traceback" in text:
                stats.traceback += 1
                failure = f"exit {value}: {text.strip()[-400:]}"
            elif CRASH_WORDS in text:
                stats.contained += 1
                failure = f"contained runtime crash: {text.strip()[-300:]}"
            elif value == 0:
                stats.exit0 += 1
            else:
                stats.exit2 += 1
            if failure is not None:
                line = f"case {k} path={path} seed={seed_t.name} mutations={what}: {failure}"
                stats.failures.append(line)
                if verbose:
                    print(line, flush=True)
                if save_dir is not None:
                    save_dir.mkdir(parents=True, exist_ok=True)
                    dest = save_dir / f"case{k}_{path}_{seed_t.name}{seed_t.suffix}"
                    if case.is_dir():
                        shutil.copytree(case, dest, symlinks=True, dirs_exist_ok=True)
                    else:
                        shutil.copyfile(case, dest)
            shutil.rmtree(case_root, ignore_errors=True)
            if verbose and (k + 1) % 300 == 0:
                print(f"[{time.monotonic() - t0:.0f}s, load {os.getloadavg()[0]:.1f}] {stats.summary()}", flush=True)
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=2000, help="cases per path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--timeout", type=float, default=120, help="seconds per case before it counts as a hang")
    parser.add_argument("--save-dir", type=Path, default=Path("fuzz-native-failures"))
    parser.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds")
    args = parser.parse_args(argv)
    paths = tuple(p for p in args.paths.split(",") if p)
    unknown = set(paths) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}: choose from {', '.join(PATHS)}")
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("NUM_THREADS", "1")  # onert: one thread per case on a shared machine
    t0 = time.monotonic()
    stats = fuzz_native(args.cases, args.seed, paths, args.timeout, args.save_dir, verbose=True,
                        time_budget=args.time_budget)
    print(f"done in {time.monotonic() - t0:.0f} s (load average {os.getloadavg()[0]:.2f}): {stats.summary()}")
    for line in stats.failures[:50]:
        print(line)
    return 1 if stats.bad else 0


if __name__ == "__main__":
    sys.exit(main())

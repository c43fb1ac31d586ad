"""Seeded, bounded fuzzing of everything that reads a Circle/TFLite file from outside.

    python tests/fuzz/fuzz.py --cases 20000            # the long run (a few minutes)
    python tests/fuzz/fuzz.py --cases 300 --seed 7     # reproduce a CI run
    python tests/fuzz/fuzz.py --replay CASE_FILE       # one saved failing case
    python tests/fuzz/fuzz_native.py --cases 2000      # the files and directories onert / LiteRT get

Seed files are small real models written by circleops (Circle with fused RMS_NORM, TFLite
with a STABLEHLO_COMPOSITE and its decomposition, and a hand-built graph whose FILL / TILE /
BROADCAST_TO / PAD / RANGE shapes come from constants) plus amplification bombs. Each case
applies 1-3 mutations (truncation, byte flips, out-of-range offsets, huge vector lengths,
bad indices, null offsets, scalar field changes, splices) and then runs, under a per-case
alarm: ``read_model``, ``inspect.summarize`` + ``format_text``, the reference interpreter on
the seed's inputs, and, every few cases, ``circleops inspect`` / ``circleops run`` in-process.

Counted as a failure: any exception that is not a CircleOpsError ("uncaught"), a case over
the alarm ("hang"), a CLI exit status other than 0/2. Failing cases are saved to
``--save-dir`` for replay. Peak memory is reported (the interpreter runs with a 64 MB
per-tensor limit: a case must not allocate more than its file plus its declared tensors).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import resource
import signal
import struct
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# hostile sizes fail fast instead of allocating gigabytes: set for a fuzz run only (at
# import it leaked into every later test of the same pytest worker, whose real SmolLM2
# lm_head then failed the 64 MB cap)
MAX_TENSOR_BYTES = str(64 << 20)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from circleops import ir  # noqa: E402
from circleops.errors import CircleOpsError  # noqa: E402


class Hang(BaseException):
    """Raised by the alarm: a BaseException, so circleops' `except Exception` cannot hide it."""


def _alarm(signum, frame):
    raise Hang()


# --------------------------------------------------------------------------- seeds

@dataclass
class Seed:
    name: str
    data: bytes
    inputs: list[np.ndarray]
    suffix: str


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        import circleops.ops  # noqa: F401 - registers torch.ops.circle

        return torch.ops.circle.rms_norm(self.lin(x), self.w).softmax(-1) * 2.0


def _shape_ops_model() -> ir.Model:
    """A hand-built graph whose allocations come from constants (FILL dims, TILE multiples...)."""
    def const(name, arr, dtype):
        return ir.Tensor(name, tuple(arr.shape), dtype, arr)

    sg = ir.Subgraph("main")
    x = sg.add_tensor(ir.Tensor("x", (2, 3), "FLOAT32"))
    dims = sg.add_tensor(const("dims", np.array([2, 3], np.int32), "INT32"))
    val = sg.add_tensor(const("val", np.array(1.5, np.float32), "FLOAT32"))
    filled = sg.add_tensor(ir.Tensor("filled", (2, 3), "FLOAT32"))
    mult = sg.add_tensor(const("mult", np.array([2, 1], np.int32), "INT32"))
    tiled = sg.add_tensor(ir.Tensor("tiled", (4, 3), "FLOAT32"))
    pads = sg.add_tensor(const("pads", np.array([[0, 1], [1, 0]], np.int32), "INT32"))
    padded = sg.add_tensor(ir.Tensor("padded", (5, 4), "FLOAT32"))
    bshape = sg.add_tensor(const("bshape", np.array([3, 5, 4], np.int32), "INT32"))
    bcast = sg.add_tensor(ir.Tensor("bcast", (3, 5, 4), "FLOAT32"))
    start = sg.add_tensor(const("start", np.array(0, np.int32), "INT32"))
    limit = sg.add_tensor(const("limit", np.array(6, np.int32), "INT32"))
    delta = sg.add_tensor(const("delta", np.array(1, np.int32), "INT32"))
    rng = sg.add_tensor(ir.Tensor("rng", (6,), "INT32"))
    summed = sg.add_tensor(ir.Tensor("summed", (2, 3), "FLOAT32"))
    sg.operators += [
        ir.Operator("FILL", [dims, val], [filled]),
        ir.Operator("ADD", [x, filled], [summed], "AddOptions", {}),
        ir.Operator("TILE", [summed, mult], [tiled]),
        ir.Operator("PAD", [tiled, pads], [padded]),
        ir.Operator("BROADCAST_TO", [padded, bshape], [bcast]),
        ir.Operator("RANGE", [start, limit, delta], [rng]),
    ]
    sg.inputs, sg.outputs = [x], [bcast, rng]
    return ir.Model([sg], [ir.Signature("serving_default", 0, {"x": x}, {"bcast": bcast, "rng": rng})])


def _bomb(data: bytes, fmt: str, copies: int) -> bytes:
    """The seed with its subgraphs vector repeating one subgraph table ``copies`` times."""
    import flatbuffers

    from circleops.serialize.schema import get_schema

    schema = get_schema(fmt)
    m = schema.cls("Model").InitFromPackedBuf(bytearray(data), 0)
    b = flatbuffers.Builder(0)
    sg = m.subgraphs[0].Pack(b)
    ocs = [oc.Pack(b) for oc in m.operatorCodes]
    bufs = [x.Pack(b) for x in m.buffers]
    mod = schema.module_for("Model")

    def vec(start, offsets):
        start(b, len(offsets))
        for o in reversed(offsets):
            b.PrependUOffsetTRelative(o)
        return b.EndVector()

    subs = vec(mod.ModelStartSubgraphsVector, [sg] * copies)
    ocv = vec(mod.ModelStartOperatorCodesVector, ocs)
    bv = vec(mod.ModelStartBuffersVector, bufs)
    mod.ModelStart(b)
    mod.ModelAddVersion(b, m.version)
    mod.ModelAddOperatorCodes(b, ocv)
    mod.ModelAddSubgraphs(b, subs)
    mod.ModelAddBuffers(b, bv)
    b.Finish(mod.ModelEnd(b), file_identifier=schema.identifier)
    return bytes(b.Output())


def build_seeds(workdir: Path) -> list[Seed]:
    """The seed files (written once per run, in ``workdir``)."""
    import circleops
    from circleops.serialize import write_model

    torch.manual_seed(0)
    x = torch.randn(2, 8)
    seeds = []
    for target, suffix in (("circle", ".circle"), ("tflite", ".tflite")):
        path = workdir / f"tiny_{target}{suffix}"
        circleops.convert(_Tiny().eval(), (x,), path, target=target, fuse="none")
        seeds.append(Seed(f"tiny_{target}", path.read_bytes(), [x.numpy()], suffix))
    xs = np.arange(6, dtype=np.float32).reshape(2, 3)
    for fmt, suffix in (("circle", ".circle"), ("tflite", ".tflite")):
        path = workdir / f"shapes_{fmt}{suffix}"
        write_model(_shape_ops_model(), path, fmt)
        seeds.append(Seed(f"shapes_{fmt}", path.read_bytes(), [xs], suffix))
    seeds.append(Seed("bomb_circle", _bomb(seeds[0].data, "circle", 3000), [x.numpy()], ".circle"))
    seeds.append(Seed("bomb_tflite", _bomb(seeds[1].data, "tflite", 3000), [x.numpy()], ".tflite"))
    return seeds


# --------------------------------------------------------------------------- mutations

_BAD_U32 = (0, 1, 3, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFC, 0xFFFF, 0x10000)
_BAD_I32 = (-1, -2, -3, -(2 ** 31), 2 ** 31 - 1, 1, 2, 3, 7, 100, 1000, 65536)


def _aligned(rng: random.Random, data: bytearray) -> int:
    return rng.randrange(0, max(len(data) - 4, 1)) & ~3


def mutate(rng: random.Random, data: bytes) -> tuple[bytes, list[str]]:
    """1-3 random mutations of ``data``; returns the bytes and what was done."""
    out = bytearray(data)
    done = []
    for _ in range(rng.choice((1, 1, 2, 3))):
        if len(out) < 8:
            break
        kind = rng.choice(("truncate", "flip", "offset", "length", "index", "null", "scalar", "splice",
                           "flip", "index", "scalar", "offset"))
        pos = _aligned(rng, out)
        if kind == "truncate":
            cut = rng.randrange(0, len(out))
            del out[cut:]
            done.append(f"truncate@{cut}")
        elif kind == "flip":
            for _ in range(rng.randint(1, 8)):
                p = rng.randrange(len(out))
                out[p] ^= 1 << rng.randrange(8)
            done.append("flip")
        elif kind == "offset":  # an offset pointing past the end, or somewhere wrong
            value = rng.choice((len(out), len(out) + 4, len(out) * 2, rng.randrange(len(out)))
                               + _BAD_U32) & 0xFFFFFFFF
            struct.pack_into("<I", out, pos, value)
            done.append(f"offset@{pos}={value}")
        elif kind == "length":  # a huge vector length (or string length)
            value = rng.choice((0x7FFFFFFF, 0xFFFFFFFF, len(out), len(out) // 4 + 1, 1 << 20, 1 << 28))
            struct.pack_into("<I", out, pos, value)
            done.append(f"length@{pos}={value}")
        elif kind == "index":  # a tensor / opcode / buffer / subgraph index out of range
            value = rng.choice(_BAD_I32)
            struct.pack_into("<i", out, pos, value)
            done.append(f"index@{pos}={value}")
        elif kind == "null":
            struct.pack_into("<I", out, pos, 0)
            done.append(f"null@{pos}")
        elif kind == "scalar":  # enum / type / option fields: one byte or a small int
            p = rng.randrange(len(out))
            if rng.random() < 0.5:
                out[p] = rng.randrange(256)
            else:
                struct.pack_into("<i", out, pos, rng.randrange(-300, 300))
            done.append(f"scalar@{p}")
        else:  # splice: copy a chunk of the file over another place
            n = rng.randint(4, 64)
            src, dst = rng.randrange(len(out)), rng.randrange(len(out))
            chunk = out[src:src + n]
            out[dst:dst + len(chunk)] = chunk
            done.append(f"splice {src}->{dst}:{n}")
    return bytes(out), done


# --------------------------------------------------------------------------- one case

@dataclass
class Stats:
    cases: int = 0
    read_ok: int = 0
    ran_ok: int = 0
    refused: int = 0
    cli_runs: int = 0
    uncaught: int = 0
    hangs: int = 0
    bad_exit: int = 0
    slowest: float = 0.0
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        return (f"cases={self.cases} read_ok={self.read_ok} ran_ok={self.ran_ok} refused(CircleOpsError)={self.refused} "
                f"cli_runs={self.cli_runs} uncaught={self.uncaught} hangs={self.hangs} bad_exit={self.bad_exit} "
                f"slowest_case={self.slowest:.2f}s peak_rss={rss}MB")


def _cli(argv: list[str]) -> int:
    from circleops.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(argv)


def run_case(path: Path, seed: Seed, npys: list[str], with_cli: bool, stats: Stats) -> None:
    """Everything that reads the file; raises what escaped (the caller classifies it)."""
    from circleops.tools.inspect import format_text, summarize
    from circleops.runtime import reference
    from circleops.serialize import read_model

    try:
        model = read_model(path)
    except CircleOpsError:
        stats.refused += 1
        model = None
    if model is not None:
        stats.read_ok += 1
        try:
            format_text(summarize(path))
        except CircleOpsError:
            pass
        try:
            reference.run(model, seed.inputs)
            stats.ran_ok += 1
        except CircleOpsError:
            pass
    if with_cli:
        stats.cli_runs += 1
        for argv in (["inspect", str(path)], ["run", str(path), "-i", *npys]):
            code = _cli(argv)
            if code not in (0, 2):
                raise RuntimeError(f"`circleops {' '.join(argv[:1])}` exited {code}")


def fuzz(cases: int, seed: int = 0, timeout: int = 10, time_budget: float | None = None,
         save_dir: Path | None = None, cli_every: int = 10, verbose: bool = False) -> Stats:
    """Run ``cases`` mutated files (or stop at ``time_budget`` seconds); returns the counts."""
    saved = os.environ.get("CIRCLEOPS_MAX_TENSOR_BYTES")
    os.environ.setdefault("CIRCLEOPS_MAX_TENSOR_BYTES", MAX_TENSOR_BYTES)
    try:
        return _fuzz(cases, seed, timeout, time_budget, save_dir, cli_every, verbose)
    finally:
        if saved is None:
            os.environ.pop("CIRCLEOPS_MAX_TENSOR_BYTES", None)


def _fuzz(cases: int, seed: int, timeout: int, time_budget: float | None, save_dir: Path | None,
          cli_every: int, verbose: bool) -> Stats:
    rng = random.Random(seed)
    stats = Stats()
    old = signal.signal(signal.SIGALRM, _alarm)
    with tempfile.TemporaryDirectory(prefix="circleops-fuzz-") as tmp:
        work = Path(tmp)
        seeds = build_seeds(work)
        t_start = time.monotonic()  # the budget is for the cases, not the seeds' conversion
        npys = {}
        for s in seeds:
            npys[s.name] = []
            for i, a in enumerate(s.inputs):
                p = work / f"{s.name}_in{i}.npy"
                np.save(p, a)
                npys[s.name].append(str(p))
        # The unmutated seeds first: they must read and run.
        for k in range(cases):
            if time_budget is not None and time.monotonic() - t_start > time_budget:
                break
            s = seeds[k % len(seeds)] if k < len(seeds) else rng.choice(seeds)
            data, what = (s.data, ["none"]) if k < len(seeds) else mutate(rng, s.data)
            path = work / f"case{s.suffix}"
            path.write_bytes(data)
            stats.cases += 1
            t0 = time.monotonic()
            signal.alarm(timeout)
            failure = None
            try:
                run_case(path, s, npys[s.name], k % cli_every == 0, stats)
            except Hang:
                stats.hangs += 1
                failure = f"hang (> {timeout} s)"
            except Exception as err:  # noqa: BLE001 - exactly what the harness counts
                if isinstance(err, RuntimeError) and str(err).startswith("`circleops"):
                    stats.bad_exit += 1
                else:
                    stats.uncaught += 1
                tb = traceback.extract_tb(err.__traceback__)[-1]
                failure = f"{type(err).__name__}: {str(err)[:200]} at {Path(tb.filename).name}:{tb.lineno}"
            finally:
                signal.alarm(0)
            stats.slowest = max(stats.slowest, time.monotonic() - t0)
            if failure is not None:
                line = f"case {k} seed={s.name} mutations={what}: {failure}"
                stats.failures.append(line)
                if verbose:
                    print(line, flush=True)
                if save_dir is not None:
                    save_dir.mkdir(parents=True, exist_ok=True)
                    (save_dir / f"case{k}_{s.name}{s.suffix}").write_bytes(data)
            if verbose and stats.cases % 1000 == 0:
                print(f"[{time.monotonic() - t_start:.0f}s] {stats.summary()}", flush=True)
    signal.signal(signal.SIGALRM, old)
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=10, help="seconds per case before it counts as a hang")
    parser.add_argument("--save-dir", type=Path, default=Path("fuzz-failures"))
    parser.add_argument("--cli-every", type=int, default=10, help="run the CLI commands on every Nth case")
    parser.add_argument("--replay", type=Path, help="run one saved case file and print what escapes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.replay:
        from circleops.runtime import reference
        from circleops.serialize import read_model

        model = read_model(args.replay)
        print("read:", len(model.subgraphs), "subgraphs")
        print(reference.run(model, [np.zeros(t.shape, np.float32) for t in
                                    (model.subgraphs[0].tensors[j] for j in model.subgraphs[0].inputs)]))
        return 0
    t0 = time.monotonic()
    stats = fuzz(args.cases, args.seed, args.timeout, save_dir=args.save_dir, cli_every=args.cli_every, verbose=True)
    print(f"done in {time.monotonic() - t0:.0f}s (load average {os.getloadavg()[0]:.2f}): {stats.summary()}")
    for line in stats.failures[:50]:
        print(line)
    return 1 if stats.uncaught or stats.hangs or stats.bad_exit else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark (not a test): what one LiteRT decode step spends, and an A/B of two files' step (issue 34).

    python bench/decode_step.py ab A_DIR B_DIR --threads 1 2        # interleaved in one process: CPU, wall
    python bench/decode_step.py handoffs DIR --threads 2             # XNNPACK operators run and thread hand-offs
    python bench/decode_step.py profile DIR --threads 1              # perf: a Generator step's CPU by bucket

``ab``: each directory's decode signature (``--signature``, default decode_c32: the window a
step after a short prompt runs) in one process, its inputs in LiteRT's own memory (as the
Generator gives them: token 504 at position 20, caches N(0, 0.5)); blocks of ``--runs`` runs,
A and B alternating (ABBA), per-block CPU (time.process_time, every thread) and wall; the
median ratio of B to A over the blocks. The outputs of the first run are compared: ``max
|B - A|`` (0: the same bits).

``handoffs`` and ``profile`` need ``perf`` (and root, for uprobes). ``handoffs`` puts uprobes on
``xnn_run_operator_with_index`` (an XNNPACK operator run) and ``pthreadpool_parallelize`` (a
task handed to the thread pool: pthreadpool runs a range of one tile inline, on the calling
thread) in the wheel's libpywrap_litert_common.so, counts them over ``--runs`` runs and names
each handed-off task's compute function (the symbol at its address). ``profile`` samples
``--steps`` greedy Generator steps after a 5-token prompt (perf record -g, the loop alone:
perf's control fifo) and sums the samples by bucket (the int4 and int8 products, attention,
XNNPACK's dispatch, the thread pool, LiteRT's run, Python).
"""
from __future__ import annotations

import argparse
import bisect
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lib() -> Path:
    import ai_edge_litert

    return Path(ai_edge_litert.__file__).parent / "libpywrap_litert_common.so"


def _session(directory: str, signature: str, threads: int):
    """A LiteRT session of ``signature`` with its inputs set in its own memory."""
    import numpy as np

    os.environ["NUM_THREADS"] = str(threads)
    from circleops.runtime.litert import Session

    s = Session(Path(directory) / "model.tflite", signature=signature)
    views = s.input_views()
    rng = np.random.default_rng(0)
    for spec, v in zip(s.inputs, views):
        v[...] = 504 if spec.name == "input_ids" else 20 if spec.name == "pos" else \
            rng.standard_normal(v.shape).astype(v.dtype) * 0.5
    s.outputs_in_place()
    return s, views


def ab(args: argparse.Namespace) -> None:
    import numpy as np

    for threads in args.threads:
        sessions = [_session(d, args.signature, threads) for d in (args.a, args.b)]
        first = [[np.array(x) for x in s.run(v)] for s, v in sessions]
        diff = max(float(np.abs(x - y).max()) for x, y in zip(*first))
        times: list[list[tuple[float, float]]] = [[], []]
        for block in range(args.blocks):
            for i in ((0, 1) if block % 2 == 0 else (1, 0)):
                s, v = sessions[i]
                for _ in range(3):
                    s.run(v)
                w, c = time.perf_counter(), time.process_time()
                for _ in range(args.runs):
                    s.run(v)
                times[i].append((1000 * (time.perf_counter() - w) / args.runs, 1000 * (time.process_time() - c) / args.runs))
        med = [[statistics.median(t[k] for t in times[i]) for k in (0, 1)] for i in (0, 1)]
        ratio = [statistics.median(b[k] / a[k] for a, b in zip(*times)) for k in (0, 1)]
        print(f"{threads} thread(s), {args.signature}, {args.blocks} blocks of {args.runs} runs: "
              f"A wall {med[0][0]:.3f} CPU {med[0][1]:.3f} ms, B wall {med[1][0]:.3f} CPU {med[1][1]:.3f} ms; "
              f"B/A wall {ratio[0]:.3f} CPU {ratio[1]:.3f}; outputs max |B - A| {diff:.3g}; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        del sessions


def _controlled(perf_args: list[str], child: list[str]) -> str:
    """Run ``child`` under ``perf <perf_args>`` with events enabled only between the child's
    "enable" and "disable" (perf's control fifo); perf's stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        ctl, ack = Path(tmp) / "ctl", Path(tmp) / "ack"
        os.mkfifo(ctl)
        os.mkfifo(ack)
        env = dict(os.environ, DECODE_STEP_CTL=str(ctl),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(["perf", *perf_args, "-D", "-1", "--control", f"fifo:{ctl},{ack}", sys.executable,
                               __file__, *child], env=env, capture_output=True, text=True, check=True)
        return proc.stderr


def _perf(cmd: str) -> None:
    ctl = os.environ.get("DECODE_STEP_CTL")
    if ctl:
        with open(ctl, "w") as f:
            f.write(cmd + "\n")
        with open(str(Path(ctl).with_name("ack"))) as f:
            f.readline()


def child_runs(args: argparse.Namespace) -> None:
    s, views = _session(args.dir, args.signature, args.threads[0])
    for _ in range(5):
        s.run(views)
    _perf("enable")
    for _ in range(args.runs):
        s.run(views)
    _perf("disable")


def child_steps(args: argparse.Namespace) -> None:
    os.environ["NUM_THREADS"] = str(args.threads[0])
    from circleops.generation.generator import Generator

    gen = Generator(args.dir, runtime="litert", threads=args.threads[0])
    ids = [504, 33059, 40061, 17288, 260]
    for rnd in range(args.rounds + 1):
        token = int(gen.prefill(ids).argmax())
        if rnd:
            _perf("enable")
        for _ in range(args.steps):
            token = int(gen._step(token).argmax())
        if rnd:
            _perf("disable")
        gen.reset()


def handoffs(args: argparse.Namespace) -> None:
    lib = _lib()
    for probe in ("decode_step_runop=xnn_run_operator_with_index", "decode_step_handoff=pthreadpool_parallelize task=%r8:x64"):
        subprocess.run(["perf", "probe", "-q", "-x", str(lib), "-a", probe], capture_output=True)
    group = "probe_libpywrap_litert_common"
    syms: list[tuple[int, str]] = []
    for line in subprocess.run(["nm", str(lib)], capture_output=True, text=True).stdout.splitlines():
        p = line.split()
        if len(p) == 3:
            syms.append((int(p[0], 16), p[2]))
    syms.sort()
    addrs = [a for a, _ in syms]
    # the executable segment's file offset -> address in the ELF (nm's addresses)
    seg = re.search(r"LOAD\s+(0x[0-9a-f]+)\s+(0x[0-9a-f]+)\s+\S+\s+\S+\s+\S+\s+R E",
                    subprocess.run(["readelf", "-lW", str(lib)], capture_output=True, text=True).stdout)
    delta = int(seg.group(2), 16) - int(seg.group(1), 16)
    for threads in args.threads:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "perf.data"
            _controlled(["record", "-q", "-e", f"{group}:decode_step_runop", "-e", f"{group}:decode_step_handoff",
                         "-o", str(data)], ["--child-runs", "--dir", args.dir, "--signature", args.signature,
                                            "--threads", str(threads), "--runs", str(args.runs)])
            script = subprocess.run(["perf", "script", "-i", str(data), "--show-mmap-events"], capture_output=True,
                                    text=True).stdout
        m = re.search(r"\[(0x[0-9a-f]+)\((0x[0-9a-f]+)\) @ (0x[0-9a-f]+) [^]]*\]: r-xp \S*libpywrap_litert_common", script)
        base, offset = int(m.group(1), 16), int(m.group(3), 16)
        ops, tasks = 0, Counter()
        for line in script.splitlines():
            if "decode_step_runop" in line:
                ops += 1
            elif "decode_step_handoff" in line:
                addr = int(re.search(r"task=(0x[0-9a-f]+)", line).group(1), 16) - base + offset + delta
                tasks[syms[bisect.bisect_right(addrs, addr) - 1][1]] += 1
        print(f"{threads} thread(s), {args.signature}: {ops / args.runs:.0f} XNNPACK operators run, "
              f"{sum(tasks.values()) / args.runs:.0f} handed to the thread pool per run: "
              + ", ".join(f"{n / args.runs:.0f} {name}" for name, n in tasks.most_common()), flush=True)


# perf symbol -> bucket, first match wins
BUCKETS = [
    ("int4 products (qd8-f32-qb4w GEMM)", r"qb4w_gemm"),
    ("int8 products: the 30 MLP downs and the head (qd8-f32-qc8w GEMM)", r"qc8w_gemm"),
    ("the products' input quantization and packing", r"pack_lh|qp8gemm|f32_qd8|qd8_vcvt|rminmax"),
    ("attention: XNNPACK packing the cache operands", r"packw"),
    ("attention and the RoPE rotation: f32 BATCH_MATMUL", r"f32_gemm|grouped_gemm|igemm"),
    ("softmax", r"softmax|raddstoreexpminusmax|f32_rmax|vscale"),
    ("elementwise ops, reductions, slices (norms, RoPE, SiLU, residuals)",
     r"xnn_f32_v|elementwise|univector|reduce|slice|transpose|copy|rsum"),
    ("thread pool: spinning, hand-offs, the kernel", r"thread_main|thread_parallelize|pthreadpool|futex"),
    ("XNNPACK's dispatch (run_operator, invoke_runtime)", r"^xnn_"),
    ("LiteRT's run: buffers, invoke", r"tflite::|LiteRt|litert::|pybind11"),
    ("memcpy, memset", r"memmove|memset|memcpy"),
    ("Python and numpy: the generation loop, the cache rows", r"^_?Py|^PyArray|^_aligned|^npy|array_|^long_|^dict"),
]


def profile(args: argparse.Namespace) -> None:
    for threads in args.threads:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "perf.data"
            _controlled(["record", "-q", "-F", "4000", "-o", str(data)],
                        ["--child-steps", "--dir", args.dir, "--threads", str(threads), "--steps", str(args.steps),
                         "--rounds", str(args.rounds)])
            out = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,symbol"],
                                 capture_output=True, text=True).stdout
        sums: Counter = Counter()
        for line in out.splitlines():
            m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[.\]\s+(.*?)\s*$", line)
            if not m:
                continue
            pct, dso, sym = float(m.group(1)), m.group(2), m.group(3)
            name = next((b for b, rx in BUCKETS if re.search(rx, sym)), None)
            if name is None:
                name = "thread pool: spinning, hand-offs, the kernel" if dso.startswith("[kernel") else "other"
            sums[name] += pct
        print(f"{threads} thread(s), {args.rounds} x {args.steps} greedy steps: "
              + "; ".join(f"{name} {pct:.1f} %" for name, pct in sums.most_common()), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", choices=["ab", "handoffs", "profile"])
    ap.add_argument("dirs", nargs="*", help="converted directories (`convert --graphs prefill,decode --target tflite`)")
    ap.add_argument("--signature", default="decode_c32")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--child-runs", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-steps", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_runs:
        child_runs(args)
    elif args.child_steps:
        child_steps(args)
    elif args.what == "ab":
        if len(args.dirs) != 2:
            ap.error("ab takes two directories")
        args.a, args.b = args.dirs
        ab(args)
    else:
        if len(args.dirs) != 1:
            ap.error(f"{args.what} takes one directory")
        args.dir = args.dirs[0]
        (handoffs if args.what == "handoffs" else profile)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

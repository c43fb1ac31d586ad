"""Seeded, bounded fuzzing of the readers of a user's files and values (issue 31).

    python tests/fuzz/fuzz_inputs.py --cases 2000            # the long run
    python tests/fuzz/fuzz_inputs.py --cases 200 --seed 7    # reproduce a CI run
    python tests/fuzz/fuzz_inputs.py --kinds wav,template    # some kinds only

Seeds are small valid inputs of each kind: WAV files (16-bit mono, stereo, 8-bit, 24-bit,
float), PNG / JPEG / GIF images, a .npy input of a tiny Circle file, a converted chat
directory (its manifest.json, generation_config.json, tokenizer.json, tokenizer_config.json
and chat template), a Whisper speech manifest, a Hugging Face directory (config.json,
model.safetensors.index.json) and generate's command-line values. Each case applies 1-3
mutations of its kind (truncation, byte flips, inserted garbage, huge numbers, wrong types,
deleted keys, deep nesting; hostile templates; hostile flag values) and runs the documented
entry point on it (``speech.read_audio``, ``vlm.read_image``, ``models.load``,
``generate.generate``, ``load_tokenizer`` + ``encode_prompt``, ``read_speech_manifest``,
``SamplingConfig.from_generation_config`` + a draw, and ``circleops run`` / ``generate`` /
``chat`` through ``circleops.cli.main``) in a forked child: the modules are loaded once, a
case costs what its reader costs, and a signal or a hang cannot take the harness down. The
child's address space may grow by at most 3 GiB (a MemoryError is a failure, not a swap).

Counted as failures: an exception that is not a CircleOpsError (a traceback), a CLI exit
status other than 0 / 2 or "internal error" / "Traceback" in its output, a child killed by a
signal, a case over the time limit (a hang), and code run (a marker file a payload would
create). Failing cases are kept in ``--save-dir`` with their log.
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import random
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(HERE), str(REPO / "tests"), str(REPO / "tests" / "generate")):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402

KINDS = ("wav", "image", "npy", "manifest", "generation_config", "tokenizer", "template", "speech_manifest",
         "config", "index", "cli_values")
CHILD_MEMORY = 3 << 30
MARKER = "pwned"  # created by a payload that ran: never, whatever the mutation

HUGE = (0, -1, 1, 2, 3, 2 ** 31, 2 ** 31 - 1, 2 ** 32, 2 ** 40, 2 ** 63, 2 ** 64, 10 ** 12, -(2 ** 63), 10 ** 30,
        1e308, -1e308, 1e-45, 0.5, float("inf"), float("nan"))
WRONG = ("x", "", [], [1, "a"], {}, {"a": 1}, None, True, False, [[[[[]]]]], "../../../etc/passwd", "\u0000")
HOSTILE_TEMPLATES = (
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the sandbox's SecurityError
    "{% for %}", "{{ foo.bar.baz }}", "{{ raise_exception('refused by the template') }}", "{% if %}{% endif",
    "{{ 'x' * 10000000000 }}", "{{ [1] * 10000000000 }}", "{{ 9 ** 9999999999 }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "{{ 1 + 'a' }}", "{{ messages[99] }}",
    "{{ range(10000000000) }}", "{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "{{ (messages|first).nope() }}",
    "{{ '%2000000000s' % 'x' }}", "{{ 'x'|center(2000000000) }}", "{{ cycler }}{{ joiner()() }}",
)
FLAG_VALUES = {
    "--seed": ("-1", "0", "18446744073709551616", "1e3", "x", "9" * 5000),
    "--temperature": ("1e-45", "0", "-1", "nan", "inf", "1e308", "x"),
    "--top-k": ("-1", "0", "1", "99999999999", "1.5"),
    "--top-p": ("0", "1e-45", "1", "2", "nan", "-0.5"),
    "--repetition-penalty": ("0", "-1", "1e308", "nan", "1e-45"),
    "--max-new-tokens": ("0", "-1", "100000", "99999999999999999999"),
    # ids outside the vocabulary (-5, 2**63) are checked by the token-id guard (issue 31, "sec")
    "--token-ids": ("1,2", "", ",", "1,,2", "x", "1.5"),
    "--threads": ("0", "-1", "100000", "x"),
}


DEEP = "\u0000deep nesting\u0000"


# --------------------------------------------------------------------------- seeds

@dataclass
class Seeds:
    work: Path
    files: dict[str, tuple[bytes, str]] = field(default_factory=dict)  # name -> (data, suffix)
    chat_dir: Path | None = None
    hf_dir: Path | None = None
    speech_dir: Path | None = None
    circle: Path | None = None


def _wav(channels: int, width: int, fmt: int = 1, frames: int = 400, rate: int = 16000) -> bytes:
    t = np.arange(frames * channels) / rate
    x = 0.5 * np.sin(2 * np.pi * 440 * t)
    if fmt == 3:
        raw = x.astype("<f4").tobytes()
    elif width == 1:
        raw = (x * 127 + 128).astype(np.uint8).tobytes()
    elif width == 3:
        v = (x * 8388607).astype("<i4").tobytes()
        raw = b"".join(v[i:i + 3] for i in range(0, len(v), 4))
    else:
        raw = (x * (2 ** (8 * width - 1) - 1)).astype(f"<i{width}").tobytes()
    fmt_chunk = struct.pack("<HHIIHH", fmt, channels, rate, rate * channels * width, channels * width, 8 * width)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt_chunk + b"data" + struct.pack("<I", len(raw)) + raw
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _png(w: int, h: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = b"".join(b"\0" + bytes(range(3 * w)) for _ in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _image_bytes(fmt: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    im = Image.new("RGB", (8, 6), (200, 30, 90))
    if fmt == "GIF":
        im.save(out, fmt, save_all=True, append_images=[Image.new("RGB", (8, 6), (0, 0, 0))])
    else:
        im.save(out, fmt)
    return out.getvalue()


def speech_manifest_dict() -> dict[str, Any]:
    """A speech manifest as circleops.recipes.speech writes it for a 2-layer Whisper."""
    return {"format": "circleops-speech", "version": 1, "default_runtime": "onert", "cache_update": "rows",
            "target": "onert", "dtype": "fp32",
            "files": {"encoder": "encoder.circle", "prefill": "prefill.circle", "decode": "decode.circle"},
            "signatures": {"encoder": None, "prefill": None, "decode": None}, "num_layers": 2,
            "cache_shape": [1, 4, 64, 16], "cross_shape": [1, 4, 50, 16], "input_features": [1, 20, 100],
            "prefill_len": 4, "vocab_size": 268, "decoder_start_token_id": 257, "eos_token_ids": [256],
            "pad_token_id": 256, "max_target_positions": 64, "is_multilingual": True,
            "lang_to_id": {"<|en|>": 258, "<|fr|>": 259}, "task_to_id": {"transcribe": 263, "translate": 262},
            "no_timestamps_token_id": 267, "forced_decoder_ids": [], "suppress_tokens": [34, 35],
            "begin_suppress_tokens": [32, 256], "processor": "processor", "source": "whisper", "num_threads": None,
            "quantize": None}


def build_seeds(work: Path) -> Seeds:
    """Every seed, written once per run under ``work`` (a tiny chat model is converted for onert)."""
    import torch

    import circleops
    from chat_fixtures import tiny_chat_tokenizer
    from circleops.recipes.llm import convert_graphs
    from families import BY_NAME

    work.mkdir(parents=True, exist_ok=True)
    s = Seeds(work)
    for name, args in {"mono16": (1, 2), "stereo16": (2, 2), "u8": (1, 1), "s24": (1, 3), "f32": (1, 4, 3)}.items():
        s.files[f"wav_{name}"] = (_wav(*args), ".wav")
    s.files["image_png"] = (_png(8, 6), ".png")
    s.files["image_jpeg"] = (_image_bytes("JPEG"), ".jpg")
    s.files["image_gif"] = (_image_bytes("GIF"), ".gif")
    npy = io.BytesIO()
    np.save(npy, np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8))
    s.files["npy"] = (npy.getvalue(), ".npy")
    s.circle = work / "lin.circle"
    torch.manual_seed(0)
    circleops.convert(torch.nn.Linear(8, 8).eval(), (torch.randn(2, 8),), s.circle, target="circle", fuse="none")
    torch.manual_seed(0)
    model = BY_NAME["llama"].build(vocab_size=259, max_position_embeddings=128, num_hidden_layers=1)
    s.chat_dir = work / "chat"
    convert_graphs(copy.deepcopy(model), s.chat_dir, target="onert", prefill_len=8, max_cache_len=32,
                   tokenizer=tiny_chat_tokenizer())
    s.hf_dir = work / "hf"
    model.save_pretrained(s.hf_dir)
    from safetensors import safe_open

    with safe_open(str(s.hf_dir / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    (s.hf_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": {k: "model.safetensors" for k in keys}}))
    s.speech_dir = work / "speech"
    (s.speech_dir / "processor").mkdir(parents=True)
    for g in ("encoder", "prefill", "decode"):
        (s.speech_dir / f"{g}.circle").write_bytes(b"")
    (s.speech_dir / "manifest.json").write_text(json.dumps(speech_manifest_dict()))
    return s


# --------------------------------------------------------------------------- mutations

def mutate_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    out = bytearray(data)
    kind = rng.choice(("truncate", "truncate", "flip", "flip", "garbage", "zero", "duplicate", "empty"))
    if kind == "empty" or not out:
        return b"", "empty"
    if kind == "truncate":
        cut = rng.randrange(len(out))
        return bytes(out[:cut]), f"truncate@{cut}"
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            p = rng.randrange(len(out))
            out[p] ^= 1 << rng.randrange(8)
        return bytes(out), "flip"
    pos = rng.randrange(len(out))
    if kind == "garbage":
        out[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif kind == "zero":
        out[pos:pos + rng.randint(1, 64)] = b"\0" * 8
    else:
        out[pos:pos] = out[max(0, pos - 200):pos]
    return bytes(out), kind


def _hostile(rng: random.Random) -> Any:
    if rng.random() < 0.06:
        return DEEP  # written as 3000 nested lists by _json_text
    return rng.choice(HUGE + WRONG)


def mutate_json(rng: random.Random, value: Any) -> tuple[Any, str]:
    """Replace, delete or retype one value somewhere in the JSON ``value``."""
    value = copy.deepcopy(value)
    slots: list[tuple[Any, Any]] = []

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            for k in list(v):
                slots.append((v, k))
                walk(v[k])
        elif isinstance(v, list):
            for i in range(len(v)):
                slots.append((v, i))
                walk(v[i])

    walk(value)
    if not slots:
        return _hostile(rng), "replace root"
    parent, key = rng.choice(slots)
    if isinstance(parent, dict) and rng.random() < 0.25:
        del parent[key]
        return value, f"delete {key!r}"
    parent[key] = _hostile(rng)
    return value, f"set {key!r}"


def _json_text(value: Any) -> str:
    # a deep list does not serialize with json.dumps (its recursion): spliced in as text
    return json.dumps(value, allow_nan=True).replace(json.dumps(DEEP), "[" * 3000 + "]" * 3000)


def mutate_json_file(rng: random.Random, path: Path) -> str:
    """A mutation of the JSON file at ``path``: structured (a value) or raw (bytes)."""
    data = path.read_bytes()
    r = rng.random()
    if r < 0.55:
        value, what = mutate_json(rng, json.loads(data))
        if rng.random() < 0.3:
            value, more = mutate_json(rng, value)
            what += ", " + more
        path.write_text(_json_text(value))
        return what
    if r < 0.65:
        path.write_text("[" * 100000 + "]" * 100000)
        return "deep nesting"
    new, what = mutate_bytes(rng, data)
    path.write_bytes(new)
    return what


def mutate_wav(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """Header fields set to hostile numbers, or byte mutations."""
    out = bytearray(data)
    fields = {"riff_size": (4, "<I"), "fmt_len": (16, "<I"), "format": (20, "<H"), "channels": (22, "<H"),
              "rate": (24, "<I"), "block": (32, "<H"), "bits": (34, "<H"), "data_len": (40, "<I")}
    if rng.random() < 0.5 and len(out) >= 44:
        name = rng.choice(list(fields))
        offset, fmt = fields[name]
        big = (1 << (8 * struct.calcsize(fmt))) - 1
        value = rng.choice((0, 1, 2, 3, 7, 0xFFFF, 0xFFFE, big, big // 2, rng.randrange(big), 2 ** 31 // 2))
        struct.pack_into(fmt, out, offset, value & big)
        return bytes(out), f"{name}={value & big}"
    return mutate_bytes(rng, data)


def mutate_image(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    if data.startswith(b"\x89PNG") and rng.random() < 0.4:  # the IHDR's width/height
        w, h = rng.choice(((20000, 20000), (2 ** 31 - 1, 1), (0, 5), (1, 2 ** 31 - 1), (65535, 65535)))
        ihdr = data[16:29]
        new = struct.pack(">II", w, h) + ihdr[8:]
        crc = struct.pack(">I", zlib.crc32(b"IHDR" + new))
        return data[:16] + new + crc + data[33:], f"ihdr {w}x{h}"
    return mutate_bytes(rng, data)


# --------------------------------------------------------------------------- one case

@dataclass
class Case:
    kind: str
    what: str
    run: Callable[[], Any]  # in the child: raises or returns; a CLI case returns its exit status
    cli: bool = False
    stdin: bytes | None = None


def _copy_dir(src: Path, dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, symlinks=True)
    return dest


def _cli(argv: list[str]) -> Callable[[], int]:
    def run() -> int:
        from circleops.cli import main

        return main(argv)
    run.argv = argv  # type: ignore[attr-defined]
    return run


def run_process(case: Case, timeout: float, log: Path) -> tuple[str, int]:
    """A CLI case as a user runs it: ``python -m circleops.cli ...`` in a new process."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run([sys.executable, "-m", "circleops.cli", *case.run.argv], input=case.stdin,
                              capture_output=True, timeout=timeout, env=env, cwd=log.parent)
    except subprocess.TimeoutExpired:
        return "hang", 0
    text = (proc.stdout + proc.stderr).decode(errors="replace")
    log.write_text(text)
    if proc.returncode < 0:
        return "signal", -proc.returncode
    if proc.returncode not in (0, 2) or "Traceback" in text or "internal error" in text:
        return "bad_exit", proc.returncode
    return ("ok" if proc.returncode == 0 else "refused"), proc.returncode


def make_case(rng: random.Random, kind: str, seeds: Seeds, dest: Path) -> Case:
    """A mutated input of ``kind`` under ``dest`` and how to run it."""
    dest.mkdir(parents=True, exist_ok=True)
    marker = dest / MARKER
    if kind in ("wav", "image", "npy"):
        names = [n for n in seeds.files if n.startswith(kind)]
        name = rng.choice(names)
        data, suffix = seeds.files[name]
        what = []
        for _ in range(rng.choice((1, 1, 2))):
            data, w = {"wav": mutate_wav, "image": mutate_image, "npy": mutate_bytes}[kind](rng, data)
            what.append(w)
        path = dest / f"input{suffix}"
        path.write_bytes(data)
        desc = f"{name}: {', '.join(what)}"
        if kind == "wav":
            def run() -> Any:
                from circleops.generation.speech import read_audio

                return read_audio(path, 16000)
            return Case(kind, desc, run)
        if kind == "image":
            def run() -> Any:
                from circleops.generation.vision import read_image

                return read_image(path).size
            return Case(kind, desc, run)
        return Case(kind, desc, _cli(["run", str(seeds.circle), "-i", str(path), "--runtime", "reference"]), cli=True)
    if kind in ("manifest", "generation_config", "tokenizer", "template", "cli_values"):
        d = _copy_dir(seeds.chat_dir, dest / "chat")
        if kind == "manifest":
            what = mutate_json_file(rng, d / "manifest.json")

            def run() -> Any:
                from circleops.generation.generator import generate

                return generate(d, [5, 6, 7], 3).tokens
            return Case(kind, what, run)
        if kind == "generation_config":
            what = mutate_json_file(rng, d / "generation_config.json")

            def run() -> Any:
                from circleops.generation.sampling import Sampler, SamplingConfig

                config = SamplingConfig.from_generation_config(d, do_sample=True, seed=1)
                return Sampler(config)(np.linspace(-3, 3, 259, dtype=np.float32), [1, 2])
            return Case(kind, what, run)
        if kind == "tokenizer":
            name = rng.choice(("tokenizer.json", "tokenizer.json", "tokenizer_config.json"))
            what = f"{name}: " + mutate_json_file(rng, d / "tokenizer" / name)

            def run() -> Any:
                from circleops.generation.generator import encode_prompt, load_tokenizer
                from circleops.package.manifest import read_manifest

                tokenizer = load_tokenizer(read_manifest(d))
                ids = encode_prompt(tokenizer, "hi there", chat=rng_flag)
                return tokenizer.decode(ids)
            rng_flag = rng.random() < 0.5
            return Case(kind, what, run)
        if kind == "template":
            template = d / "tokenizer" / "chat_template.jinja"
            if rng.random() < 0.6:
                text, what = rng.choice(HOSTILE_TEMPLATES), "hostile"
            else:
                raw, what = mutate_bytes(rng, template.read_bytes())
                text = raw.decode("utf-8", "replace")
            template.write_text(text)
            what = f"{what}: {text[:60]!r}"
            if rng.random() < 0.25:  # through the CLI, as a user runs it
                return Case(kind, what, _cli(["generate", str(d), "--prompt", "hi", "--chat", "-q",
                                              "--max-new-tokens", "2"]), cli=True)

            def run() -> Any:
                from circleops.generation.generator import encode_prompt, hf_tokenizer

                return encode_prompt(hf_tokenizer(d / "tokenizer"), "hi", chat=True)
            return Case(kind, what, run)
        argv = ["generate", str(d), "--token-ids", "5,6,7", "-q", "--max-new-tokens", "2", "--sample"]
        flags = rng.sample(sorted(FLAG_VALUES), rng.choice((1, 1, 2)))
        for flag in flags:
            value = rng.choice(FLAG_VALUES[flag])
            if flag in argv:
                argv[argv.index(flag) + 1] = value
            else:
                argv += [flag, value]
        if rng.random() < 0.2:  # chat, with a line that is not UTF-8
            stdin = rng.choice((b"\xff\xfe hi\nhello\n", b"hi\n\xc3\n", "\u00e9\n".encode("latin-1")))
            return Case(kind, f"chat stdin {stdin!r}", _cli(["chat", str(d), "-q", "--max-new-tokens", "2"]),
                        cli=True, stdin=stdin)
        return Case(kind, " ".join(argv[3:]), _cli(argv), cli=True)
    if kind == "speech_manifest":
        d = _copy_dir(seeds.speech_dir, dest / "speech")
        what = mutate_json_file(rng, d / "manifest.json")

        def run() -> Any:
            from circleops.package.speech_manifest import read_speech_manifest

            return read_speech_manifest(d).num_layers
        return Case(kind, what, run)
    if kind == "config":
        path = dest / "config.json"
        shutil.copy(seeds.hf_dir / "config.json", path)
        what = mutate_json_file(rng, path)

        def run() -> Any:
            from circleops.sources import models

            return type(models.load(None, config=str(path)).module).__name__
        return Case(kind, what, run)
    if kind == "index":
        d = dest / "hf"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir()
        for f in seeds.hf_dir.iterdir():  # the weights linked, not copied
            (d / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, d / f.name)
        name = rng.choice(("model.safetensors.index.json", "model.safetensors.index.json", "config.json",
                           "generation_config.json"))
        if name == "model.safetensors.index.json" and rng.random() < 0.3:
            index = json.loads((d / name).read_text())
            target = rng.choice(("../../../etc/passwd", "/etc/passwd", "../hf/model.safetensors", "missing.safetensors",
                                 str(seeds.hf_dir / "model.safetensors")))
            key = rng.choice(sorted(index["weight_map"]))
            index["weight_map"][key] = target
            (d / name).write_text(json.dumps(index))
            what = f"{name}: {key} -> {target}"
        else:
            what = f"{name}: " + mutate_json_file(rng, d / name)

        def run() -> Any:
            from circleops.sources import models

            return type(models.load(str(d)).module).__name__
        return Case(kind, what, run)
    raise ValueError(kind)


def run_child(case: Case, timeout: float, log: Path) -> tuple[str, int]:
    """``case`` in a forked child, output in ``log``: ("ok"|"refused"|"uncaught"|"bad_exit", code),
    ("signal", signum) or ("hang", 0)."""
    sys.stdout.flush()
    sys.stderr.flush()
    stdin_path = None
    if case.stdin is not None:
        stdin_path = log.with_suffix(".stdin")
        stdin_path.write_bytes(case.stdin)
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 70
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            if stdin_path is not None:
                sfd = os.open(stdin_path, os.O_RDONLY)
                os.dup2(sfd, 0)
                sys.stdin = open(0, "r", closefd=False)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            _limit_memory()
            import torch

            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive fork
            from circleops.errors import CircleOpsError

            try:
                result = case.run()
                code = {0: 0, 2: 2}.get(result, 4) if case.cli else 0
            except CircleOpsError as err:
                print(f"refused: {type(err).__name__}: {err}")
                code = 4 if case.cli else 2  # the CLI must have caught it itself
            except SystemExit as err:  # argparse's usage error: status 2
                code = 2 if err.code == 2 else 4
        except BaseException:  # noqa: BLE001 - a traceback is what the harness counts
            import traceback

            traceback.print_exc()
            code = 3
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
        time.sleep(0.002)
    if os.WIFSIGNALED(status):
        return "signal", os.WTERMSIG(status)
    code = os.WEXITSTATUS(status)
    text = log.read_text(errors="replace")
    if code in (0, 2) and ("Traceback" in text or "internal error" in text):
        return "bad_exit", code
    return {0: "ok", 2: "refused", 3: "uncaught"}.get(code, "bad_exit"), code


def _limit_memory() -> None:
    with open("/proc/self/status") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = used + CHILD_MEMORY if hard == resource.RLIM_INFINITY else min(used + CHILD_MEMORY, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


# --------------------------------------------------------------------------- the run

@dataclass
class Stats:
    cases: dict[str, int] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    processes: int = 0  # CLI cases run as a new process

    @property
    def bad(self) -> int:
        return sum(self.outcomes.get(k, 0) for k in ("uncaught", "bad_exit", "signal", "hang", "code_ran"))

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.cases.items()))
        outcomes = ", ".join(f"{k} {n}" for k, n in sorted(self.outcomes.items()))
        return (f"{sum(self.cases.values())} cases in {self.seconds:.1f} s ({kinds}; {self.processes} as a new "
                f"process): {outcomes}")


def fuzz_inputs(cases: int, seed: int = 0, kinds: tuple[str, ...] = KINDS, timeout: float = 60,
                save_dir: Path | None = None, work: Path | None = None, process_every: int = 8) -> Stats:
    """``cases`` mutated inputs, spread over ``kinds`` in turn, each in a forked child; every
    ``process_every``-th CLI case runs as a new ``python -m circleops.cli`` process instead."""
    cli_cases = 0
    stats = Stats()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="circleops-fuzz-inputs-") as tmp:
        work = Path(work or tmp)
        seeds = build_seeds(work / "seeds")
        rng = random.Random(seed)
        for n in range(cases):
            kind = kinds[n % len(kinds)]
            case_dir = work / "cases" / f"{n:05d}"
            case = make_case(rng, kind, seeds, case_dir)
            log = case_dir / "log.txt"
            if case.cli:
                cli_cases += 1
            if case.cli and process_every and cli_cases % process_every == 1:
                how, code = run_process(case, timeout, log)
                stats.processes += 1
            else:
                how, code = run_child(case, timeout, log)
            if how in ("ok", "refused") and any(p.name == MARKER for p in case_dir.rglob(MARKER)):
                how = "code_ran"
            stats.cases[kind] = stats.cases.get(kind, 0) + 1
            stats.outcomes[how] = stats.outcomes.get(how, 0) + 1
            if how not in ("ok", "refused"):
                tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:]) if log.exists() else ""
                stats.failures.append(f"case {n} [{kind}] {case.what}: {how} {code}: {tail[:600]}")
                if save_dir is not None:
                    shutil.copytree(case_dir, Path(save_dir) / f"{n:05d}-{kind}", dirs_exist_ok=True)
            shutil.rmtree(case_dir, ignore_errors=True)
    stats.seconds = time.monotonic() - t0
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--save-dir", type=Path, default=None)
    p.add_argument("--process-every", type=int, default=8, help="every N-th CLI case as a new process (0: none)")
    args = p.parse_args(argv)
    stats = fuzz_inputs(args.cases, args.seed, tuple(args.kinds.split(",")), args.timeout, args.save_dir,
                        process_every=args.process_every)
    print(stats.summary())
    for line in stats.failures:
        print(line)
    return 1 if stats.bad else 0


if __name__ == "__main__":
    sys.exit(main())

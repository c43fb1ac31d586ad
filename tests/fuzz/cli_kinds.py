"""The kinds of tests/fuzz/fuzz_cli.py: each makes one damaged or hostile input from a seed
(tests/fuzz/cli_seeds.py) and the ``circleops`` command line that hands it to its reader.

Every kind covers a reader of issue 31's list through the documented command, with
mutations tests/fuzz/fuzz_inputs.py does not make (there: single readers called directly):
the flags of every command, hub ids over a damaged cache, safetensors headers, HF
directories, calibration files, .pt2 archives, VLM and Whisper directories (images, WAVs,
processors, manifests, graphs), task processors, .npy headers, tokenizer.json internals, chat
templates, text manifests and generation configs. Payloads that would run code (a
``__reduce__`` pickle, an ``auto_map`` module, a template reaching for Python) create the
file ``MARKER`` in the case's directory: the harness counts it as code run.
"""
from __future__ import annotations

import json
import pickle
import random
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cli_seeds import HUB_ID, CliSeeds, copy_tree, write_zip, zip_members
from fuzz_inputs import HUGE, WRONG, _json_text, mutate_bytes, mutate_image, mutate_json, mutate_json_file, mutate_wav

MARKER = "pwned"


@dataclass
class CliCase:
    kind: str
    what: str
    argv: list[str]  # after "circleops"
    stdin: bytes | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:  # an argument cannot hold NUL (execve): the nearest a user can type
        self.argv = [a.replace("\0", "\1") for a in self.argv]


class _Payload:
    """Unpickled, it creates ``path`` (what a hostile pickle's os.system would do, observably)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def payload_pickle(marker: Path) -> bytes:
    return pickle.dumps({"weights": _Payload(marker)})


def evil_module(directory: Path, marker: Path, name: str = "modeling_evil") -> str:
    """A module that creates ``marker`` when imported; returns its auto_map reference."""
    (directory / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Evil:\n    pass\n")
    return f"{name}.Evil"


def _pick(rng: random.Random, values: dict[str, tuple]) -> list[str]:
    out: list[str] = []
    for flag in rng.sample(sorted(values), rng.choice((1, 1, 2))):
        out += [flag, str(rng.choice(values[flag]))]
    return out


def _edit_json(path: Path, edit: Callable[[Any], Any]) -> None:
    value = json.loads(path.read_text())
    new = edit(value)
    path.write_text(_json_text(value if new is None else new))


def _mutate_json_or(rng: random.Random, path: Path, edits: list[tuple[str, Callable[[Any], Any]]]) -> str:
    """A targeted edit of the JSON at ``path`` (half the time), else a generic mutation."""
    if edits and rng.random() < 0.5:
        name, edit = rng.choice(edits)
        _edit_json(path, edit)
        return name
    return mutate_json_file(rng, path)


def _set(key: str, value: Any) -> Callable[[Any], Any]:
    def edit(d: Any) -> None:
        node = d
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {}) if isinstance(node, dict) else node
        if isinstance(node, dict):
            node[last] = value
    return edit


def _sets(rng: random.Random, keys: tuple[str, ...], extra: tuple = ()) -> list[tuple[str, Callable[[Any], Any]]]:
    values = HUGE + WRONG + extra
    return [(f"{k}={v!r}"[:80], _set(k, v)) for k in keys for v in rng.sample(values, 3)]


# --------------------------------------------------------------------------- flags

BIG = ("0", "-1", "1e18", "18446744073709551616", "99999999999", "nan", "x", "", " ", "1,2", "9" * 400)
CONVERT_FLAGS = {
    "--seq-len": BIG + ("8,8", "8,,4", "4,8", "100000", "2049"),
    "--input-shape": ("input_ids=1x8", "input_ids=0x8", "x=1x3", "input_ids=1x99999999999", "=1x2", "input_ids=",
                      "input_ids=1x-4", "input_ids=1e18", "input_ids=1x8x8x8x8x8x8x8x8", "input_ids"),
    "--max-cache-len": BIG + ("7", "16", "65536"),
    "--cache-windows": ("0", "-1", "8,x", "4,4,4", "99999999", ",", "16", "1e9"),
    "--graphs": ("prefill,,decode", "vision", "encoder,prefill,decode", "decode", "prefill", "x", "", ",",
                 "prefill,decode,prefill", "vision,prefill,decode"),
    "--tolerance": ("nan", "-1", "inf", "0", "1e-300", "x"),
    "--threads": BIG,
    "--max-file-bytes": BIG + ("1", "100"),
    "--calibrate": ("0", "-1", "1000000000", "x"),
    "--int16": ("foo", "*", "lm_head", "auto,auto", ",", "[", "norms,mlp_out,embedding", "model.layers.99.*"),
    "--weight-group-size": ("-1", "3", "0", "1000000000", "x", "33"),
    "--weight-bits": ("4", "2", "x"),
    "--seed": ("-1", "18446744073709551616", "x"),
    "--quantize": ("q4_0", "q8_0", "w8", "uint8", "int16", "int4", "int4-pc", "q4_k", "", "Q4_0", "fp16"),
    "--dtype": ("fp16", "bf16", "int8"),
    "--task": ("fill-mask", "image-classification", "automatic-speech-recognition", "speech-encoder", "x"),
    "--target": ("tflite", "onert", "circle", "tf"),
    "--fuse": ("none", "patterns", "adapters"),
    "--onert-signatures": ("on", "off", "x"),
    "--int8-weights": ("auto", "x"),
    "--rotate": ("on", "off", "x"),
    "--report": ("/", "/proc/self/nope/r.json", "{out}", "{dir}"),
}


def convert_flags(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """``convert`` with hostile flag values, on --config (random weights) or the HF directory."""
    source = ["--config", str(s["config"])] if rng.random() < 0.5 else [str(s["hf"])]
    graphs = rng.random() < 0.4
    out = dest / ("out" if graphs else "out.circle")
    argv = ["convert", *source, "-o", str(out), "--seq-len", "8"] + (["--graphs", "prefill,decode",
                                                                     "--max-cache-len", "32"] if graphs else [])
    if rng.random() < 0.15:  # -o itself
        argv[argv.index("-o") + 1] = rng.choice(("/", "/proc/self/x.circle", str(dest), str(s["config"]), "",
                                                 "/dev/null", str(dest / "missing" / "a.circle"), "x.tflite"))
    for flag, value in zip(*[iter(_pick(rng, CONVERT_FLAGS))] * 2):
        value = value.replace("{out}", str(out)).replace("{dir}", str(dest))
        argv = _set_flag(argv, flag, value)
    return CliCase("convert_flags", " ".join(argv[1:]), argv)


def _set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    if flag in argv:
        argv = list(argv)
        argv[argv.index(flag) + 1] = value
        return argv
    return argv + [flag, value]


CHECK_FLAGS = {
    "--dtype": ("bf16", "fp32", "x"), "--prompt": ("", "\u0000", "x" * 100000, "\ud800".encode("utf-8", "surrogatepass")
                                                  .decode("utf-8", "replace")),
    "--prompt-ids": ("", "1,2,99999", "-5", "1.5", "18446744073709551616", ",", "1," * 3000),
    "-n": ("0", "-1", "100000", "x"), "--policies": ("", "x", "fused,fused", ",", "native"),
    "--json": ("/", "/proc/x/y.json"), "--plot": ("/", "x.txt"), "--keep": ("/proc/x", "/dev/null"),
    "--seed": ("-1", "x"), "--threads": ("0", "-1", "100000"),
    "--quantize": ("q4_0", "w8", "uint8", "x"), "--runtime": ("litert", "onert"),
    "--window": ("0", "-1", "1", "99999999"), "--max-windows": ("0", "-1", "x"),
}


def check_flags(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    argv = ["check", "--config", str(s["config"]), "-q", "--prompt-ids", "5,6,7,8", "-n", "2", "--policies", "fused"]
    for flag, value in zip(*[iter(_pick(rng, CHECK_FLAGS))] * 2):
        argv = _set_flag(argv, flag, value)
    return CliCase("check_flags", " ".join(argv[1:])[:200], argv)


def run_flags(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """``run`` on the small Circle / TFLite files with hostile flags and input lists."""
    file = s[rng.choice(("lin.circle", "lin.tflite"))]
    npy = str(s["npy"])
    argv = ["run", str(file), "-i", npy]
    choice = rng.randrange(9)
    if choice == 0:
        argv = ["run", str(file), "-i", npy, npy]
    elif choice == 1:
        argv = ["run", str(file)]
    elif choice == 2:
        argv += ["--signature", rng.choice(("", "decode", "x" * 5000, "0", "serving_default"))]
    elif choice == 3:
        argv += ["--compare", rng.choice(("onert", "litert", "reference", "x"))]
    elif choice == 4:
        argv += ["--top", rng.choice(("0", "-1", "99999999999", "x"))]
    elif choice == 5:
        argv += ["-o", rng.choice(("/", str(s["npy"]), "/proc/self/out", str(dest / "o" / "p")))]
    elif choice == 6:
        argv = ["run", str(file), rng.choice(("--image", "--audio")), str(s[rng.choice(("photo.png", "clip.wav"))])]
    elif choice == 7:
        argv = ["run", str(file), "--text", "hi", "--model", rng.choice((str(s["hf"]), str(dest), "/", "x/y"))]
    else:
        argv += ["--runtime", rng.choice(("onert", "litert"))]
    return CliCase("run_flags", " ".join(argv[1:])[:200], argv)


def inspect_ops(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """``inspect`` of things that are not plain files, and ``ops`` with odd names."""
    r = rng.randrange(8)
    if r == 0:
        return CliCase("inspect_ops", "ops", ["ops", *rng.sample(("attention", "rms_norm", "x", "", "ATTENTION",
                                                                 "circle.rope", "\u0000"), 2),
                                             "--format", rng.choice(("json", "markdown", "table"))])
    if r == 1:  # a sparse file of 64 GiB: no byte is read past what a check needs
        path = dest / "sparse.circle"
        with open(path, "wb") as f:
            f.truncate(64 << 30)
        return CliCase("inspect_ops", "sparse 64 GiB", ["inspect", str(path), *rng.sample(("--json", "--tensors"), 1)])
    if r == 2:
        path = rng.choice(("/dev/zero", "/dev/null", "/proc/self/status", "/", str(dest), "/etc/passwd"))
        return CliCase("inspect_ops", f"inspect {path}", ["inspect", path])
    if r == 3:  # a file of the wrong kind with the right suffix
        src = s[rng.choice(("npy", "photo.png", "clip.wav", "pt2", "calibration"))]
        path = dest / ("x" + rng.choice((".circle", ".tflite")))
        shutil.copy(src, path)
        return CliCase("inspect_ops", f"{src.name} as {path.name}", ["inspect", str(path), "--tensors"])
    if r == 4:  # stdin as the file
        data = s["lin.circle"].read_bytes()
        return CliCase("inspect_ops", "/dev/stdin", ["inspect", "/dev/stdin"], stdin=data[:rng.randrange(len(data))])
    if r == 5:  # the other suffix
        path = dest / "swap.tflite"
        shutil.copy(s["lin.circle"], path)
        return CliCase("inspect_ops", "circle as .tflite", ["run", str(path), "-i", str(s["npy"])])
    if r == 6:
        path = dest / "link.circle"
        path.symlink_to(path)  # a loop
        return CliCase("inspect_ops", "symlink loop", ["inspect", str(path)])
    path = dest / "noread.circle"
    shutil.copy(s["lin.circle"], path)
    path.chmod(0)
    return CliCase("inspect_ops", "unreadable", ["inspect", str(path)])


GENERATE_FLAGS = {
    "--runtime": ("litert", "reference", "onert"), "--image": ("{photo}", "{wav}", "/", "/dev/zero"),
    "--audio": ("{wav}", "{photo}"), "--language": ("en", "xx", ""), "--task": ("translate",),
    "--max-new-tokens": ("31", "32", "33", "1"), "--prompt": ("x" * 100000, "", "\u202e\u0000", "<|im_end|>" * 50),
    "--threads": ("1", "64"),
}


def generate_flags(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """generate and chat on the text directories with flags for another kind of model, prompts
    that are empty, huge or made of special tokens, and chat input that is hostile."""
    d = s[rng.choice(("chat", "chat_tflite"))]
    if rng.random() < 0.35:
        stdin = rng.choice((b"", b"\n\n\n", b"/reset\n" * 50, b"x" * 3_000_000 + b"\n", b"\x00\x00\n",
                            "<|im_start|>system\n".encode() * 100 + b"\n", b"hi\r\nho\r\n", b"\x1b[2J\x07\n"))
        argv = ["chat", str(d), "-q", "--max-new-tokens", rng.choice(("2", "0", "-3", "40")),
                *rng.choice(([], ["--system", "x" * 50000], ["--system", ""], ["--image", str(s["photo.png"])]))]
        return CliCase("generate_flags", f"chat stdin {stdin[:40]!r}", argv, stdin=stdin)
    argv = ["generate", str(d), "--prompt", "hi", "-q", "--max-new-tokens", "2"]
    for flag, value in zip(*[iter(_pick(rng, GENERATE_FLAGS))] * 2):
        value = value.replace("{photo}", str(s["photo.png"])).replace("{wav}", str(s["clip.wav"]))
        if flag == "--audio" and "--prompt" in argv:  # one input: the audio replaces the prompt
            at = argv.index("--prompt")
            del argv[at:at + 2]
        argv = _set_flag(argv, flag, value)
    if rng.random() < 0.3:
        argv.append("--chat")
    return CliCase("generate_flags", " ".join(argv[2:])[:200], argv)


# --------------------------------------------------------------------------- sources

def hub(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """A hub id over a copy of a Hugging Face cache (HF_HOME) that is damaged or hostile."""
    home = copy_tree(s["hf_home"], dest / "hf_home")
    org, name = HUB_ID.split("/")
    repo = home / "hub" / f"models--{org}--{name}"
    snap = repo / "snapshots" / "0123456789abcdef"
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    model, what = HUB_ID, "intact"
    r = rng.randrange(10)
    if r == 0:
        (repo / "refs" / "main").write_text(rng.choice(("../../../../..", "", "x" * 5000, "/etc", "..", "\u0000")))
        what = "refs/main"
    elif r == 1:
        shutil.rmtree(snap)
        snap.symlink_to(rng.choice(("/", "/etc", str(s["hf"]), str(snap))))
        what = "snapshot symlink"
    elif r == 2:
        (snap / "config.json").unlink()
        (snap / "config.json").symlink_to(rng.choice(("/etc/passwd", "/dev/zero", "../../../../../../etc/hostname")))
        what = "config.json symlink"
    elif r == 3:
        model = rng.choice((f"{org}/../{name}", "../x", "a/b/c", f"{org}/{name}/", f"{org.upper()}/{name}", "org/",
                            "/tiny", f"{org}/{name}.gguf", "x" * 200 + "/y", "org/n\u00e9", "-org/name"))
        what = f"id {model!r}"
    elif r == 4:
        (snap / "model.safetensors").unlink()
        what = "weights missing (offline)"
    elif r == 5:
        env["HF_HUB_OFFLINE"] = ""
        model, what = "fuzz-org/not-cached", "not cached, online (no network)"
    elif r == 6:
        cfg = json.loads((snap / "config.json").read_text())
        cfg["auto_map"] = {"AutoModelForCausalLM": evil_module(snap, dest / MARKER)}
        (snap / "config.json").write_text(json.dumps(cfg))
        what = "auto_map"
    elif r == 7:
        shutil.rmtree(repo / "refs")
        what = "no refs"
    elif r == 8:
        env["HF_HOME"] = rng.choice(("/dev/null", "/proc/self", str(dest / "nope"), ""))
        what = f"HF_HOME={env['HF_HOME']}"
    else:
        what = mutate_json_file(rng, snap / "config.json")
    graphs = ["--graphs", "prefill,decode", "--max-cache-len", "32", "--seq-len", "8"] if rng.random() < 0.5 else []
    out = dest / ("out" if graphs else "out.circle")
    return CliCase("hub", what, ["convert", model, "-o", str(out), *graphs], env=env)


def _safetensors_parts(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _safetensors_bytes(header: Any, body: bytes, pad: bool = True) -> bytes:
    text = _json_text(header).encode() if not isinstance(header, bytes) else header
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def safetensors(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """The HF directory with its model.safetensors damaged: header length, header JSON (dtype,
    shape, offsets), the tensor bytes."""
    d = copy_tree(s["hf"], dest / "hf")
    path = d / "model.safetensors"
    data = path.read_bytes()
    header, body = _safetensors_parts(data)
    names = sorted(k for k in header if k != "__metadata__")
    name = rng.choice(names)
    r = rng.randrange(8)
    if r == 0:
        value = rng.choice((0, 1, 7, len(data), len(data) - 8, 2 ** 32, 2 ** 63, 2 ** 64 - 1, 100 << 20))
        new, what = struct.pack("<Q", value) + data[8:], f"header length {value}"
    elif r == 1:
        header[name]["dtype"] = rng.choice(("F64", "I8", "BOOL", "F8_E4M3", "C64", "x", "", 5, None))
        new, what = _safetensors_bytes(header, body), f"{name} dtype {header[name]['dtype']!r}"
    elif r == 2:
        header[name]["shape"] = rng.choice(([], [0], [-1, 4], [2 ** 40, 2 ** 40], [1] * 5000, ["a"], [3.5],
                                            [2 ** 63], list(reversed(header[name]["shape"]))))
        new, what = _safetensors_bytes(header, body), f"{name} shape {str(header[name]['shape'])[:40]}"
    elif r == 3:
        a, b = header[name]["data_offsets"]
        header[name]["data_offsets"] = rng.choice(([b, a], [0, 2 ** 62], [a, b + 4], [-8, b], [a, len(body) + 64],
                                                   [0, 0], [a], "x"))
        new, what = _safetensors_bytes(header, body), f"{name} offsets {header[name]['data_offsets']}"
    elif r == 4:
        new, what = _safetensors_bytes(header, body[:rng.randrange(len(body))]), "body cut"
    elif r == 5:
        value, what = mutate_json(rng, header)
        new = _safetensors_bytes(value, body)
    elif r == 6:
        header[name + ".copy"] = header[name]  # two names, one byte range (aliasing)
        header["__metadata__"] = rng.choice(({"format": "tf"}, {"format": 5}, [1], {"x": "y" * 1000}))
        new, what = _safetensors_bytes(header, body), "alias + metadata"
    else:
        new, what = mutate_bytes(rng, data)
    path.write_bytes(new)
    graphs = ["--graphs", "prefill,decode", "--max-cache-len", "32", "--seq-len", "8"] if rng.random() < 0.3 else []
    return CliCase("safetensors", what, ["convert", str(d), "-o", str(dest / ("out" if graphs else "o.circle")),
                                         "--seq-len", "8", *graphs])


def _config_edits(rng: random.Random, d: Path, marker: Path) -> list[tuple[str, Callable[[Any], Any]]]:
    edits = _sets(rng, ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "rope_theta",
                        "rope_scaling", "torch_dtype", "dtype", "tie_word_embeddings", "model_type", "architectures",
                        "rms_norm_eps", "head_dim", "max_position_embeddings", "hidden_act", "quantization_config",
                        "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id"),
                  ("bert", "whisper", "llama4", ["LlamaForCausalLM", "X"], {"rope_type": "yarn", "factor": -1},
                   {"quant_method": "bitsandbytes"}, {"quant_method": "gptq", "bits": 4}, "bfloat16", "gelu_new"))
    edits.append(("auto_map", _set("auto_map", {"AutoModelForCausalLM": evil_module(d, marker)})))
    edits.append(("hidden_size=48 (weights 32)", _set("hidden_size", 48)))
    edits.append(("num_hidden_layers=3 (weights 1)", _set("num_hidden_layers", 3)))
    return edits


def hf_dir(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """The HF directory damaged as a whole: config values that do not match the weights or
    name code, files missing, replaced by directories or symbolic links, tokenizer damage."""
    d = copy_tree(s["hf"], dest / "hf")
    marker = dest / MARKER
    r = rng.randrange(7)
    if r <= 2:
        what = "config: " + _mutate_json_or(rng, d / "config.json", _config_edits(rng, d, marker))
    elif r == 3:
        victim = rng.choice(("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"))
        (d / victim).unlink()
        how = rng.choice(("missing", "dir", "link /dev/zero", "link loop", "fifo-like /dev/null"))
        if how == "dir":
            (d / victim).mkdir()
        elif how.startswith("link /dev/zero"):
            (d / victim).symlink_to("/dev/zero")
        elif how == "link loop":
            (d / victim).symlink_to(d / victim)
        elif how.startswith("fifo"):
            (d / victim).symlink_to("/dev/null")
        what = f"{victim} {how}"
    elif r == 4:
        name = rng.choice(("tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                           "added_tokens.json", "chat_template.json"))
        if not (d / name).exists():
            (d / name).write_text(json.dumps({"x": 1}))
        edits = [("auto_map", _set("auto_map", {"AutoTokenizer": [evil_module(d, marker, "tok_evil"), None]}))]
        what = f"{name}: " + _mutate_json_or(rng, d / name, edits)
    elif r == 5:
        (d / "tokenizer.model").write_bytes(bytes(rng.randrange(256) for _ in range(rng.choice((0, 10, 4000)))))
        (d / "tokenizer.json").unlink()
        what = "tokenizer.model garbage, no tokenizer.json"
    else:
        new, what = mutate_bytes(rng, (d / "chat_template.jinja").read_bytes())
        (d / "chat_template.jinja").write_bytes(new)
        what = "chat_template.jinja " + what
    graphs = rng.random() < 0.6
    argv = ["convert", str(d), "-o", str(dest / ("out" if graphs else "o.circle")), "--seq-len", "8"]
    if graphs:
        argv += ["--graphs", "prefill,decode", "--max-cache-len", "32"]
    return CliCase("hf_dir", what, argv)


def _calibration_payloads(rng: random.Random, marker: Path) -> tuple[Any, str]:
    import torch

    choices = [
        (torch.randn(4, 8).double(), "float64"), (torch.randint(0, 5, (4, 8)), "int64"), (torch.randn(4, 9), "[4,9]"),
        (torch.randn(0, 8), "empty"), (torch.tensor(3.0), "0-d"), (torch.full((4, 8), float("nan")), "nan"),
        (torch.full((4, 8), float("inf")), "inf"), (torch.randn(4, 8) > 0, "bool"), (torch.randn(4, 8, dtype=torch.cfloat),
                                                                                     "complex"),
        ([torch.randn(2, 8), torch.randn(3, 8)], "list of shapes"), ([], "[]"), ({"x": torch.randn(4, 8)}, "dict"),
        ("text", "str"), ([[torch.randn(2, 8)]] * 3, "nested"), ([1, 2, 3], "ints"), (None, "None"),
        (torch.randn(2, 8).t(), "transposed view"), (torch.randn(10000, 8)[::1000], "strided"),
        ([torch.randn(2, 8)] * 100000, "100000 samples"), (torch.randn(4, 8).to(torch.float16), "fp16"),
        (_Payload(marker), "payload"),
    ]
    return rng.choice(choices)


def calibration(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """``convert mlp.pt2 --quantize uint8 --calibration-data FILE`` with a damaged or hostile
    calibration file: wrong types, shapes and values, pickles with payloads, a damaged zip."""
    import torch

    path = dest / "calib.pt"
    r = rng.random()
    if r < 0.55:
        obj, what = _calibration_payloads(rng, dest / MARKER)
        torch.save(obj, path)
    elif r < 0.7:  # a plain (non-zip) pickle with a payload
        path.write_bytes(payload_pickle(dest / MARKER))
        what = "raw pickle payload"
    elif r < 0.85:
        members = zip_members(s["calibration"])
        name = rng.choice(sorted(members))
        members[name], what = mutate_bytes(rng, members[name])
        write_zip(path, members)
        what = f"{name.split('/', 1)[-1]}: {what}"
    else:
        data, what = mutate_bytes(rng, s["calibration"].read_bytes())
        path.write_bytes(data)
    argv = ["convert", str(s["pt2"]), "-o", str(dest / "o.circle"), "--quantize", rng.choice(("uint8", "int16")),
            "--calibration-data", str(path), "--calibrate", rng.choice(("2", "4"))]
    return CliCase("calibration", what, argv)


def pt2(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """``convert FILE.pt2`` of a damaged ExportedProgram archive: JSON members mutated
    (graph, weights config: sizes, strides, offsets, dtypes), members dropped or replaced by
    pickles with payloads, bytes damaged."""
    members = zip_members(s["pt2"])
    path = dest / "m.pt2"
    r = rng.random()
    jsons = sorted(n for n in members if n.endswith(".json"))
    if r < 0.5:
        name = rng.choice(jsons)
        value, what = mutate_json(rng, json.loads(members[name]))
        members[name] = _json_text(value).encode()
        what = f"{name.split('/', 1)[-1]}: {what}"
    elif r < 0.6:
        name = rng.choice(sorted(members))
        del members[name]
        what = f"{name.split('/', 1)[-1]} removed"
    elif r < 0.75:
        name = rng.choice(sorted(n for n in members if "/data/" in n and not n.endswith(".json")))
        members[name] = rng.choice((payload_pickle(dest / MARKER), b"", members[name][:3], members[name] * 2))
        what = f"{name.split('/', 1)[-1]} replaced"
    elif r < 0.85:
        cfg = [n for n in jsons if "weights_config" in n][0]
        value = json.loads(members[cfg])
        entry = rng.choice(sorted(value["config"]))
        meta = value["config"][entry]["tensor_meta"]
        field_name = rng.choice(("sizes", "strides", "storage_offset", "dtype"))
        meta[field_name] = rng.choice(([{"as_int": 2 ** 40}], [{"as_int": -1}, {"as_int": 8}], {"as_int": 2 ** 40},
                                       {"as_int": -4}, 99, [{"as_sym": "s0"}]))
        members[cfg] = json.dumps(value).encode()
        what = f"{entry} {field_name}"
    else:
        data, what = mutate_bytes(rng, s["pt2"].read_bytes())
        path.write_bytes(data)
        return CliCase("pt2", what, ["convert", str(path), "-o", str(dest / "o.circle")])
    write_zip(path, members)
    return CliCase("pt2", what, ["convert", str(path), "-o", str(dest / "o.circle")])


# --------------------------------------------------------------------------- VLM and speech directories

def _image_file(rng: random.Random, s: CliSeeds, dest: Path) -> tuple[Path, str]:
    """An image of an odd kind (extreme aspect, modes, formats, EXIF values, frames) or a damaged one."""
    from PIL import Image

    path = dest / "img.png"
    r = rng.randrange(6)
    if r == 0:
        w, h = rng.choice(((1, 1), (1, 20000), (20000, 1), (3, 5000), (4000, 4000), (11000, 11000)))
        Image.new("RGB", (w, h), (10, 200, 30)).save(path, optimize=False, compress_level=1)
        return path, f"{w}x{h}"
    if r == 1:
        mode = rng.choice(("L", "LA", "RGBA", "P", "CMYK", "I", "F", "I;16", "1", "YCbCr", "HSV"))
        fmt = "TIFF" if mode in ("CMYK", "I", "F", "YCbCr", "HSV") else "PNG"
        path = dest / ("img.tif" if fmt == "TIFF" else "img.png")
        try:
            Image.new(mode, (20, 12)).save(path, fmt)
        except (OSError, ValueError, KeyError):
            Image.new(mode, (20, 12)).convert("RGB").save(path, fmt)
        return path, f"mode {mode}"
    if r == 2:
        fmt = rng.choice(("BMP", "WEBP", "ICO", "TIFF", "PPM", "TGA", "PCX", "SGI", "QOI"))
        path = dest / f"img.{fmt.lower()}"
        try:
            Image.new("RGB", (30, 20), (1, 2, 3)).save(path, fmt)
        except (OSError, KeyError, ValueError):
            return dest / "img.none", f"{fmt} unsupported by Pillow here"
        return path, fmt
    if r == 3:  # EXIF orientation outside 1..8, or an EXIF block that is damaged
        im = Image.new("RGB", (24, 16), (9, 9, 9))
        exif = Image.Exif()
        exif[0x0112] = rng.choice((0, 9, 255, 65535, -1 & 0xFFFF, 6))
        path = dest / "img.jpg"
        im.save(path, "JPEG", exif=exif.tobytes())
        if rng.random() < 0.5:
            data = bytearray(path.read_bytes())
            at = data.find(b"Exif")
            if at > 0:
                data[at + 6:at + 30] = bytes(rng.randrange(256) for _ in range(24))
            path.write_bytes(bytes(data))
        return path, f"exif orientation {exif[0x0112]}"
    if r == 4:  # an animated GIF of many frames
        path = dest / "img.gif"
        frames = [Image.new("P", (16, 16), i % 256) for i in range(rng.choice((2, 500)))]
        frames[0].save(path, save_all=True, append_images=frames[1:])
        return path, f"gif {len(frames)} frames"
    src = s[rng.choice(("photo.png", "photo.jpg"))]
    data, what = mutate_image(rng, src.read_bytes())
    path = dest / f"img{src.suffix}"
    path.write_bytes(data)
    return path, f"{src.name}: {what}"


def vlm(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """``generate VLM --image IMG`` with odd or damaged images, manifests and processor configs."""
    d = copy_tree(s["vlm"], dest / "vlm")
    image, what = s["photo.png"], "intact"
    r = rng.random()
    if r < 0.45:
        image, what = _image_file(rng, s, dest)
    elif r < 0.65:
        edits = _sets(rng, ("image_seq_len", "image_processor.size.longest_edge", "image_processor.max_image_size",
                            "image_processor.do_image_splitting", "image_processor.image_mean",
                            "image_processor.resample", "image_processor.rescale_factor"), ((0.5,) * 7, 10 ** 9))
        what = "processor: " + _mutate_json_or(rng, d / "tokenizer" / "processor_config.json", edits)
    elif r < 0.85:
        edits = _sets(rng, ("image_token_id", "image_tokens", "vision", "vision_inputs", "image_seq_len", "vlm",
                            "files.vision", "prefill_len", "vocab_size"))
        what = "manifest: " + _mutate_json_or(rng, d / "manifest.json", edits)
    else:
        what = "tokenizer: " + mutate_json_file(rng, d / "tokenizer" / "tokenizer.json")
    command = rng.choice(("generate", "generate", "chat"))
    if command == "chat":
        argv = ["chat", str(d), "--image", str(image), "-q", "--max-new-tokens", "2"]
        return CliCase("vlm", what, argv, stdin=b"what is it?\n")
    return CliCase("vlm", what, ["generate", str(d), "--image", str(image), "--prompt", "what is it?", "-q",
                                 "--max-new-tokens", "2", *rng.choice(([], ["--chat"]))])


def _wav_extra(rng: random.Random, s: CliSeeds, dest: Path) -> tuple[Path, str]:
    """A WAV of a kind the other fuzzers do not write: extra chunks of hostile sizes,
    WAVE_FORMAT_EXTENSIBLE, odd rates and widths, A-law, 65535 channels, an hour of audio."""
    from fuzz_inputs import _wav

    path = dest / "a.wav"
    data = s["speech.wav"].read_bytes()
    r = rng.randrange(7)
    if r == 0:  # a chunk before "data" whose size is hostile
        size = rng.choice((0, 1, 3, 2 ** 31, 2 ** 32 - 1, len(data)))
        chunk = rng.choice((b"LIST", b"fact", b"cue ", b"data", b"fmt ", b"\0\0\0\0")) + struct.pack("<I", size) + b"INFOx"
        new, what = data[:36] + chunk + data[36:], f"chunk {chunk[:4]!r} size {size}"
        new = new[:4] + struct.pack("<I", len(new) - 8) + new[8:]
    elif r == 1:
        rate = rng.choice((1, 8000, 44100, 48000, 2 ** 31, 4294967295))
        new = bytearray(_wav(1, 2, frames=8000))
        struct.pack_into("<II", new, 24, rate, (2 * rate) & 0xFFFFFFFF)  # the rate and the byte rate it implies
        new, what = bytes(new), f"rate {rate}"
    elif r == 2:
        fmt, width = rng.choice(((6, 1), (7, 1), (0xFFFE, 2), (3, 8), (2, 2), (1, 5), (1, 0)))
        new, what = _wav(1, width or 1, fmt=fmt, frames=4000), f"format {fmt} width {width}"
        if width == 0:
            new = new[:34] + struct.pack("<H", 0) + new[36:]
    elif r == 3:
        channels = rng.choice((0, 3, 255, 65535))
        new = bytearray(_wav(1, 2, frames=6000))
        struct.pack_into("<H", new, 22, channels)
        new, what = bytes(new), f"{channels} channels"
    elif r == 4:  # long: an hour at 16 kHz is 115 MB; the model's window is 1 s
        seconds = rng.choice((30, 600, 3600))
        new, what = _wav(1, 2, frames=16000 * seconds), f"{seconds} s"
    elif r == 5:
        new, what = _wav(1, 2, frames=rng.choice((0, 1, 2, 159))), "a few frames"
    else:
        new, what = mutate_wav(rng, data)
    path.write_bytes(new)
    return path, what


def asr(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """``generate ASR --audio WAV`` with odd or damaged WAVs, feature extractors, manifests and flags."""
    d = copy_tree(s["asr"], dest / "asr")
    wav, what = s["speech.wav"], "intact"
    r = rng.random()
    if r < 0.4:
        wav, what = _wav_extra(rng, s, dest)
    elif r < 0.6:
        keys = tuple(f"feature_extractor.{k}" for k in ("feature_size", "n_fft", "hop_length", "sampling_rate",
                                                         "chunk_length", "n_samples", "nb_max_frames", "padding_value",
                                                         "dither", "feature_extractor_type"))
        what = "extractor: " + _mutate_json_or(rng, d / "processor" / "processor_config.json",
                                               _sets(rng, keys, (0.5, 400, 1e-9)))
    elif r < 0.8:
        edits = _sets(rng, ("input_features", "cross_shape", "cache_shape", "max_target_positions", "prefill_len",
                            "lang_to_id", "task_to_id", "forced_decoder_ids", "suppress_tokens", "num_layers",
                            "graphs.decode.inputs", "files.encoder", "processor"), ([[1, 999999]], {"<|xx|>": -3}))
        what = "manifest: " + _mutate_json_or(rng, d / "manifest.json", edits)
    else:
        what = "tokenizer: " + mutate_json_file(rng, d / "processor" / rng.choice(("tokenizer.json",
                                                                                  "tokenizer_config.json")))
    argv = ["generate", str(d), "--audio", str(wav), "-q", "--max-new-tokens", rng.choice(("4", "4", "1000", "0"))]
    if rng.random() < 0.3:
        argv += rng.choice((["--language", rng.choice(("fr", "xx", "", "<|en|>", "english", "French"))],
                            ["--task", "translate"], ["--runtime", "reference"], ["--sample", "--seed", "3"],
                            ["--chat"], ["--image", str(s["photo.png"])]))
    return CliCase("asr", what, argv)


def graph(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """A graph file of a converted directory damaged (the TFLite chat model, the VLM's vision
    graph, the Whisper encoder and decoder): flatbuffer-aware mutations (tests/fuzz/fuzz.py)."""
    from fuzz import mutate

    seed = rng.choice(("chat_tflite", "vlm", "asr", "asr"))
    d = copy_tree(s[seed], dest / seed)
    name = {"chat_tflite": "model.tflite", "vlm": rng.choice(("vision.circle", "prefill.circle")),
            "asr": rng.choice(("encoder.circle", "decode.circle", "prefill.circle"))}[seed]
    data, done = mutate(rng, (d / name).read_bytes())
    (d / name).write_bytes(data)
    what = f"{seed}/{name}: {', '.join(done)}"
    if seed == "chat_tflite":
        argv = ["generate", str(d), "--prompt", "hi", "-q", "--max-new-tokens", "3"]
    elif seed == "vlm":
        argv = ["generate", str(d), "--image", str(s["photo.png"]), "--prompt", "hi", "-q", "--max-new-tokens", "2"]
    else:
        argv = ["generate", str(d), "--audio", str(s["speech.wav"]), "-q", "--max-new-tokens", "3"]
    return CliCase("graph", what, argv)


# --------------------------------------------------------------------------- task models, .npy

def task(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """``run TASK.circle --image/--text --model DIR`` with the model directory's processor,
    tokenizer or config damaged (or asking for code)."""
    marker = dest / MARKER
    if rng.random() < 0.5:
        d = copy_tree(s["task_image_hf"], dest / "vit")
        name = rng.choice(("preprocessor_config.json", "preprocessor_config.json", "config.json"))
        edits = _sets(rng, ("size", "size.height", "size.width", "image_mean", "image_std", "resample",
                            "rescale_factor", "do_resize", "image_processor_type", "crop_size", "id2label",
                            "num_labels"), ({"shortest_edge": 10 ** 6}, {"height": 0, "width": 0}, [1.0, 2.0],
                                            "ViTImageProcessorFast", {"0": "x"}))
        edits.append(("auto_map", _set("auto_map", {"AutoImageProcessor": evil_module(d, marker)})))
        what = f"vit {name}: " + _mutate_json_or(rng, d / name, edits)
        image = s["photo.png"] if rng.random() < 0.6 else _image_file(rng, s, dest)[0]
        argv = ["run", str(s["task_image"]), "--image", str(image), "--model", str(d)]
    else:
        d = copy_tree(s["task_text_hf"], dest / "sst")
        name = rng.choice(("tokenizer.json", "tokenizer_config.json", "config.json", "vocab.txt"))
        if name == "vocab.txt":
            data, what = mutate_bytes(rng, (d / name).read_bytes())
            (d / name).write_bytes(data)
            (d / "tokenizer.json").unlink()
        else:
            edits = _sets(rng, ("model_max_length", "id2label", "max_position_embeddings", "tokenizer_class",
                                "do_lower_case", "pad_token", "truncation", "model.vocab.cat"),
                          ("BertTokenizerFast", "GPT2Tokenizer", 2 ** 70))
            edits.append(("auto_map", _set("auto_map", {"AutoTokenizer": [evil_module(d, marker), None]})))
            what = _mutate_json_or(rng, d / name, edits)
        text = rng.choice(("the cat sat", "", "x" * 100000, "\u0000\ud7ff", "[CLS] [SEP] [MASK]" * 100))
        argv = ["run", str(s["task_text"]), "--text", text, "--model", str(d)]
        what = f"sst {name}: {what}"
    if rng.random() < 0.2:
        argv += ["--top", rng.choice(("0", "-1", "1000"))]
    return CliCase("task", what, argv)


def _npy_header(dtype: str, shape: tuple, fortran: bool = False, version: int = 1) -> bytes:
    text = f"{{'descr': {dtype!r}, 'fortran_order': {fortran}, 'shape': {shape!r}, }}"
    pad = 64 - (10 + len(text) + 1) % 64
    body = (text + " " * pad + "\n").encode("latin-1")
    if version == 1:
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body
    return b"\x93NUMPY" + bytes((version, 0)) + struct.pack("<I", len(body)) + body


def npy(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """``run lin.circle -i X.npy`` with .npy headers of other dtypes, shapes and versions, an
    object array holding a payload, and a .npz."""
    import numpy as np

    raw = np.load(s["npy"]).tobytes()
    cases = [
        ("<f8", (2, 8), raw * 2), (">f4", (2, 8), raw), ("<i8", (2, 8), raw * 2), ("|b1", (2, 8), raw[:16]),
        ("<f2", (2, 8), raw[:32]), ("<c8", (2, 8), raw * 2), ("<U5", (2, 8), raw * 5), ("|V8", (2, 8), raw),
        ("<f4", (16,), raw), ("<f4", (1, 2, 8), raw), ("<f4", (8, 2), raw), ("<f4", (), raw[:4]), ("<f4", (0, 8), b""),
        ("<f4", (2, 8), raw[:-4]), ("<f4", (2 ** 31, 2 ** 31), raw), ("<f4", (-2, 8), raw), ("x", (2, 8), raw),
        ("<f4", (2, 8.5), raw), ("<f4", "(2, 8)", raw), ("[('a', '<f4')]", (2, 8), raw),
    ]
    path = dest / "x.npy"
    r = rng.random()
    if r < 0.7:
        dtype, shape, body = rng.choice(cases)
        version = rng.choice((1, 1, 2, 3))
        path.write_bytes(_npy_header(dtype, shape, rng.random() < 0.15, version) + body)
        what = f"{dtype} {shape} v{version}"
    elif r < 0.8:
        arr = np.empty(2, dtype=object)
        arr[0] = _Payload(dest / MARKER)
        np.save(path, arr, allow_pickle=True)
        what = "object array payload"
    elif r < 0.9:
        np.savez(dest / "x.npz", a=np.load(s["npy"]))
        path = dest / "x.npz"
        what = ".npz"
    else:
        text = rng.choice(("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 8), 'x': __import__('os')}",
                           "{'descr': '<f4', 'fortran_order': False, 'shape': " + "(" * 500 + ")" * 500 + "}",
                           "{" * 10000))
        body = (text + "\n").encode()
        path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body + raw)
        what = f"header {text[:40]!r}"
    file = s[rng.choice(("lin.circle", "lin.tflite"))]
    argv = ["run", str(file), "-i", str(path), *rng.choice(([], ["--runtime", "onert" if file.suffix == ".circle"
                                                                  else "litert"]))]
    return CliCase("npy", what, argv)


# --------------------------------------------------------------------------- tokenizers, templates, manifests

def _tokenizer_edits(rng: random.Random) -> list[tuple[str, Callable[[Any], Any]]]:
    def added(token_id: Any) -> Callable[[Any], Any]:
        def edit(d: Any) -> None:
            d["added_tokens"].append({"id": token_id, "content": "<evil>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
        return edit

    def vocab(token_id: Any) -> Callable[[Any], Any]:
        def edit(d: Any) -> None:
            d["model"]["vocab"]["h"] = token_id
        return edit

    def set_part(part: str, value: Any) -> Callable[[Any], Any]:
        def edit(d: Any) -> None:
            d[part] = value
        return edit

    catastrophic = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
    blowup = {"type": "Replace", "pattern": {"String": "h"}, "content": "h" * 100000}
    post = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}], "pair": [],
            "special_tokens": {"<bos>": {"id": "<bos>", "ids": [rng.choice((10 ** 6, -1, 2 ** 40))],
                                         "tokens": ["<bos>"]}}}
    return [
        ("added token id 10**6", added(10 ** 6)), ("added token id -1", added(-1)), ("added token id 2**64", added(2 ** 64)),
        ("added token dup id", added(5)), ("vocab h -> 10**6", vocab(10 ** 6)), ("vocab h -> 2**40", vocab(2 ** 40)),
        ("vocab h -> -3", vocab(-3)), ("vocab h -> 'x'", vocab("x")), ("pre_tokenizer (a+)+$", set_part("pre_tokenizer",
                                                                                                     catastrophic)),
        ("normalizer x100000", set_part("normalizer", blowup)), ("post_processor ids", set_part("post_processor", post)),
        ("model type BPE", set_part("model", {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b", "x"]})),
        ("model type Unigram", set_part("model", {"type": "Unigram", "vocab": [["a", float("nan")]], "unk_id": 99})),
        ("truncation -1", set_part("truncation", {"max_length": -1, "stride": 0, "strategy": "LongestFirst",
                                                  "direction": "Right"})),
        ("padding huge", set_part("padding", {"strategy": {"Fixed": 10 ** 9}, "direction": "Right", "pad_id": 0,
                                              "pad_type_id": 0, "pad_token": "x", "pad_to_multiple_of": None})),
        ("decoder unknown", set_part("decoder", {"type": "Nope"})),
    ]


def tokenizer(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """generate / chat with a saved tokenizer.json whose internals are hostile: ids past the
    vocabulary in added tokens, the vocab or the post-processor, a catastrophic-backtracking
    pre-tokenizer regex, a normalizer that multiplies the text, unknown model types."""
    d = copy_tree(s["chat"], dest / "chat")
    path = d / "tokenizer" / "tokenizer.json"
    name, edit = rng.choice(_tokenizer_edits(rng))
    _edit_json(path, edit)
    prompt = "h" * rng.choice((1, 100, 5000)) if "Replace" in json.dumps(json.loads(path.read_text())
                                                                        .get("normalizer")) else \
        rng.choice(("hi", "a" * 30 + "!", "a" * 5000 + "!"))
    argv = ["generate", str(d), "--prompt", prompt, "-q", "--max-new-tokens", "2", *rng.choice(([], ["--chat"]))]
    if rng.random() < 0.25:
        return CliCase("tokenizer", name, ["chat", str(d), "-q", "--max-new-tokens", "2"], stdin=prompt.encode() + b"\n")
    return CliCase("tokenizer", name, argv)


TEMPLATES = (
    "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    "{{ lipsum(n=1000000) }}", "{{ lipsum(n=100, min=1000000, max=1000001) }}",
    "{% include 'other.jinja' %}", "{% import 'macros' as m %}{{ m.x() }}", "{% extends 'base' %}",
    "{{ messages|tojson(indent=1000000000) }}", "{{ 'x'|indent(width=1000000000, first=True) }}",
    "{{ 'x'.ljust(2000000000) }}", "{{ 'ab'.center(1500000000) }}", "{{ 'ab'.zfill(1500000000) }}",
    "{{ 'x'|wordwrap(0) }}", "{{ 'x'|truncate(-5) }}", "{{ range(10**9)|sum }}",
    "{{ (range(10**7)|list)|join(',') }}", "{{ range(10**8)|batch(10**7)|list|length }}",
    "{{ messages.__class__.__base__ }}", "{{ self._TemplateReference__context }}", "{{ cycler.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__['os'] }}", "{{ raise_exception(messages) }}", "{{ raise_exception() }}",
    "{% set d = dict() %}{% for i in range(10**6) %}{% set _ = d.update({i: i}) %}{% endfor %}{{ d|length }}",
    "{% for m in messages %}{{ m['content'] * 10**8 }}{% endfor %}", "{{ 'x' ~ 'y' * 10**8 ~ 'z' * 10**8 }}",
    "{{ ('%' ~ '0' * 3 ~ 's') % 'x' }}", "{{ messages[0]['content'].encode('utf-16') }}",
    "{{ '{0.__class__}'.format(messages) }}", "{{ ''.join(['x'] * 10**8) }}", "{{ [messages] * 10**8 }}",
    "{{ range(2**62)|list }}", "{% filter upper %}{{ 'x' * 16000000 }}{{ 'y' * 16000000 }}{% endfilter %}",
    "{{ 'a'|replace('', 'b' * 1000)|replace('b', 'c' * 1000) }}", "{{ 10**10**10 }}", "{{ 2.0**2000 }}",
    "\u0000{{ bos_token }}\ud7ff", "{% if true %}" * 5000, "{{ x|attr('__class__') }}",
    "{{ messages|map(attribute='role')|list * 10**8 }}", "{% macro f(n) %}{{ f(n) ~ f(n) }}{% endmacro %}{{ f(1) }}",
)


def template(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """generate --chat / chat with chat templates that the earlier fuzzers did not write: loop
    recursion, lipsum, include/import/extends without a loader, huge indents and paddings from
    string methods, sums over 10^9, reaching for globals, filters whose output multiplies."""
    d = copy_tree(s[rng.choice(("chat", "chat", "vlm"))], dest / "d")
    text = rng.choice(TEMPLATES)
    (d / "tokenizer" / "chat_template.jinja").write_text(text, errors="surrogatepass")
    what = repr(text[:70])
    if rng.random() < 0.3:
        return CliCase("template", what, ["chat", str(d), "-q", "--max-new-tokens", "2"], stdin=b"hi\nagain\n")
    return CliCase("template", what, ["generate", str(d), "--prompt", "hi", "--chat", "-q", "--max-new-tokens", "2"])


def manifest(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """generate on a text directory (onert or TFLite) whose manifest.json was edited into a
    consistent-looking lie: files swapped or borrowed, lengths, shapes and versions changed."""
    seed = rng.choice(("chat", "chat_tflite"))
    d = copy_tree(s[seed], dest / "chat")
    path = d / "manifest.json"
    value = json.loads(path.read_text())
    files = value.get("files", {})

    def swap(v: Any) -> None:
        if len(files) >= 2:
            a, b = list(files)[:2]
            v["files"][a], v["files"][b] = files[b], files[a]

    def borrow(v: Any) -> None:
        for k in v["files"]:
            v["files"][k] = str(s["vlm"] / "decode.circle")
            break

    edits = [("swap files", swap), ("borrow a graph", borrow)] + _sets(
        rng, ("prefill_lens", "prefill_len", "cache_shape", "num_layers", "vocab_size", "version", "cache_update",
              "signatures", "one_file_per_graph", "inputs", "outputs", "eos_token_ids", "tokenizer", "target",
              "default_runtime", "quantize", "num_threads", "format", "dtype", "cache_layout", "split", "chain"),
        ([8, 8, 8], [1, 2, 3, 4, 5], 10 ** 6, "onert", "litert", "x/../../..", [[0, 1]], {"prefill": 3}))
    what = _mutate_json_or(rng, path, edits)
    argv = ["generate", str(d), "--prompt", "hi", "-q", "--max-new-tokens", rng.choice(("2", "20"))]
    if rng.random() < 0.3:
        argv = ["generate", str(d), "--token-ids", "5,6,7", "-q", "--max-new-tokens", "3"]
    return CliCase("manifest", f"{seed}: {what}", argv)


def generation_config(rng: random.Random, s: CliSeeds, dest: Path) -> CliCase:
    """generate --sample / chat with generation_config.json values of other types and ranges,
    through the command line (the direct reader is fuzzed by fuzz_inputs)."""
    seed = rng.choice(("chat", "chat_tflite", "asr"))
    d = copy_tree(s[seed], dest / "d")
    path = d / "generation_config.json"
    edits = _sets(rng, ("temperature", "top_k", "top_p", "repetition_penalty", "do_sample", "eos_token_id",
                        "pad_token_id", "max_new_tokens", "max_length", "min_p", "typical_p", "no_repeat_ngram_size",
                        "suppress_tokens", "begin_suppress_tokens", "forced_decoder_ids", "bad_words_ids",
                        "decoder_start_token_id", "lang_to_id", "task_to_id"),
                  ([10 ** 6], [-1], [[1, 10 ** 9]], "0.5", [0.5], {"t": 1}))
    what = f"{seed}: " + _mutate_json_or(rng, path, edits)
    if seed == "asr":
        argv = ["generate", str(d), "--audio", str(s["speech.wav"]), "-q", "--max-new-tokens", "3"]
    else:
        argv = ["generate", str(d), "--prompt", "hi", "-q", "--max-new-tokens", "3"]
    if rng.random() < 0.7:
        argv += ["--sample", *rng.choice(([], ["--seed", "1"], ["--temperature", "0.5"], ["--top-k", "3"]))]
    return CliCase("generation_config", what, argv)


KINDS: dict[str, Callable[[random.Random, CliSeeds, Path], CliCase]] = {
    "convert_flags": convert_flags, "check_flags": check_flags, "run_flags": run_flags, "inspect_ops": inspect_ops,
    "generate_flags": generate_flags, "hub": hub, "safetensors": safetensors, "hf_dir": hf_dir,
    "calibration": calibration, "pt2": pt2, "vlm": vlm, "asr": asr, "graph": graph, "task": task, "npy": npy,
    "tokenizer": tokenizer, "template": template, "manifest": manifest, "generation_config": generation_config,
}
# the seeds each kind reads (cli_seeds.build_seeds builds only these)
NEEDS: dict[str, tuple[str, ...]] = {
    "convert_flags": ("config", "hf"), "check_flags": ("config",), "run_flags": ("files", "hf"),
    "inspect_ops": ("files", "pt2", "calibration"), "generate_flags": ("chat", "chat_tflite", "files"),
    "hub": ("hub",), "safetensors": ("hf",), "hf_dir": ("hf",), "calibration": ("pt2", "calibration"),
    "pt2": ("pt2",), "vlm": ("vlm", "files"), "asr": ("asr", "files"), "graph": ("chat_tflite", "vlm", "asr", "files"),
    "task": ("task_image", "task_text", "files"), "npy": ("files",), "tokenizer": ("chat",),
    "template": ("chat", "vlm"), "manifest": ("chat", "chat_tflite", "vlm"),
    "generation_config": ("chat", "chat_tflite", "asr", "files"),
}

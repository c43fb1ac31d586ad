"""The valid inputs tests/fuzz/fuzz_cli.py damages: one small real instance of every kind of
file or directory a user hands the ``circleops`` command line, written once per run.

Each seed is what circleops itself (or transformers' ``save_pretrained``) writes, so an
undamaged seed runs to exit 0; the harness checks that before it counts refusals.
Which seeds are built is chosen by the kinds run (``build_seeds(work, needs)``): the CI
slice builds only the cheap ones.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(HERE), str(REPO / "tests"), str(REPO / "tests" / "generate"), str(REPO / "tests" / "speech"),
          str(REPO / "tests" / "tasks")):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402

# what each seed name needs built (the cheap ones first)
SEED_NAMES = ("config", "hf", "files", "pt2", "calibration", "hub", "chat", "chat_tflite", "vlm", "asr", "task_image",
              "task_text")
HUB_ID = "fuzz-org/tiny-llama"


@dataclass
class CliSeeds:
    work: Path
    paths: dict[str, Path] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Path:
        return self.paths[name]


def _tiny_llama(vocab: int = 259):
    from families import BY_NAME
    import torch

    torch.manual_seed(0)
    return BY_NAME["llama"].build(vocab_size=vocab, max_position_embeddings=128, num_hidden_layers=1)


def _convert(argv: list[str]) -> None:
    from circleops.cli import main

    rc = main(argv + ["-q"])
    if rc != 0:
        raise RuntimeError(f"seed conversion failed ({rc}): circleops {' '.join(argv)}")


def _hf(s: CliSeeds) -> None:
    """A tiny Llama as save_pretrained writes it, with the byte-level chat tokenizer."""
    from chat_fixtures import tiny_chat_tokenizer

    d = s.work / "hf"
    model = _tiny_llama()
    model.save_pretrained(d)
    tiny_chat_tokenizer().save_pretrained(d)
    s.paths["hf"] = d
    s.paths["config"] = d / "config.json"


def _files(s: CliSeeds) -> None:
    """Small Circle and TFLite files of a linear layer, an input .npy and two WAVs and images."""
    import torch

    import circleops
    from fuzz_inputs import _image_bytes, _png, _wav

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    for target, suffix in (("circle", ".circle"), ("tflite", ".tflite")):
        s.paths[f"lin{suffix}"] = s.work / f"lin{suffix}"
        circleops.convert(net, (x,), s.paths[f"lin{suffix}"], target=target, fuse="none")
    s.paths["npy"] = s.work / "x.npy"
    np.save(s.paths["npy"], x.numpy())
    for name, data in (("clip.wav", _wav(1, 2, frames=16000)), ("stereo.wav", _wav(2, 2, frames=8000)),
                       ("photo.png", _png(56, 40)), ("photo.jpg", _image_bytes("JPEG"))):
        s.paths[name] = s.work / name
        s.paths[name].write_bytes(data)


def _pt2(s: CliSeeds) -> None:
    """A .pt2 ExportedProgram (torch.export.save) of a small MLP with its example input."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    ep = torch.export.export(net, (torch.randn(2, 8),))
    s.paths["pt2"] = s.work / "mlp.pt2"
    torch.export.save(ep, s.paths["pt2"])


def _calibration(s: CliSeeds) -> None:
    """A calibration file for the .pt2's input: 4 samples [4, 8]."""
    import torch

    torch.manual_seed(1)
    s.paths["calibration"] = s.work / "calib.pt"
    torch.save(torch.randn(4, 8), s.paths["calibration"])


def _hub(s: CliSeeds) -> None:
    """A Hugging Face cache (HF_HOME) holding HUB_ID as huggingface_hub lays it out."""
    org, name = HUB_ID.split("/")
    repo = s.work / "hf_home" / "hub" / f"models--{org}--{name}"
    snap = repo / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    for f in s["hf"].iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    s.paths["hf_home"] = s.work / "hf_home"


def _chat(s: CliSeeds, target: str) -> None:
    key = "chat" if target == "onert" else "chat_tflite"
    s.paths[key] = s.work / key
    _convert(["convert", str(s["hf"]), "--graphs", "prefill,decode", "--target", target, "--seq-len", "8",
              "--max-cache-len", "32", "-o", str(s.paths[key])])


def _vlm(s: CliSeeds) -> None:
    """A tiny SmolVLM (Idefics3) over the byte-level chat tokenizer, converted for onert."""
    from chat_fixtures import tiny_chat_tokenizer
    from vlm_fixtures import tiny_vlm

    from circleops.recipes import vlm

    tokenizer = tiny_chat_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(vlm.IMAGE_TOKENS)})
    model = tiny_vlm(len(tokenizer), tokenizer.convert_tokens_to_ids("<image>"))
    d = s.work / "vlm_hf"
    model.save_pretrained(str(d))
    vlm.build_processor(tokenizer, model).save_pretrained(str(d))
    s.paths["vlm_hf"] = d
    s.paths["vlm"] = s.work / "vlm"
    _convert(["convert", str(d), "--graphs", "vision,prefill,decode", "--target", "onert", "--seq-len", "16,8",
              "--max-cache-len", "128", "-o", str(s.paths["vlm"])])


def _asr(s: CliSeeds) -> None:
    from tiny_whisper import save_tiny_whisper, write_wav

    s.paths["whisper_hf"] = save_tiny_whisper(s.work / "whisper_hf")
    s.paths["asr"] = s.work / "asr"
    s.paths["speech.wav"] = write_wav(s.work / "speech.wav")
    _convert(["convert", str(s.paths["whisper_hf"]), "--graphs", "encoder,prefill,decode", "--target", "onert",
              "-o", str(s.paths["asr"])])


def _task(s: CliSeeds, name: str, key: str) -> None:
    from tiny_models import ZOO

    row = next(t for t in ZOO if t.name == name)
    d = s.work / f"{key}_hf"
    row.build(d)
    s.paths[f"{key}_hf"] = d
    s.paths[key] = s.work / f"{key}.circle"
    _convert(["convert", str(d), "-o", str(s.paths[key]), *row.args])


BUILDERS = {
    "hf": _hf, "config": _hf, "files": _files, "pt2": _pt2, "calibration": _calibration, "hub": _hub,
    "chat": lambda s: _chat(s, "onert"), "chat_tflite": lambda s: _chat(s, "tflite"), "vlm": _vlm, "asr": _asr,
    "task_image": lambda s: _task(s, "vit", "task_image"),
    "task_text": lambda s: _task(s, "distilbert-sst2", "task_text"),
}
DEPENDS = {"hub": ("hf",), "chat": ("hf",), "chat_tflite": ("hf",), "calibration": ("pt2",)}


def build_seeds(work: Path, needs: tuple[str, ...] = SEED_NAMES) -> CliSeeds:
    """The seeds ``needs`` names (and what they depend on), built under ``work``; a seed
    already there from an earlier run with the same ``work`` is reused (its ``.done`` file)."""
    from generate_fixtures import one_torch_thread

    work.mkdir(parents=True, exist_ok=True)
    s = CliSeeds(work)
    index = work / "seeds.json"
    done = json.loads(index.read_text()) if index.exists() else {}
    order = [n for n in SEED_NAMES if n in needs or any(n in DEPENDS.get(m, ()) for m in needs)]
    for name in order:
        if name not in done:
            before = dict(s.paths)
            s.paths.update({k: Path(v) for d in done.values() for k, v in d.items()})
            with one_torch_thread():
                BUILDERS[name](s)
            done[name] = {k: str(v) for k, v in s.paths.items() if before.get(k) != v}
            index.write_text(json.dumps(done))
        s.paths.update({k: Path(v) for k, v in done[name].items()})
    return s


def zip_members(path: Path) -> dict[str, bytes]:
    """The members of a .pt2 / .pt (a zip archive), by name."""
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def write_zip(path: Path, members: dict[str, bytes]) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    path.write_bytes(buf.getvalue())


def copy_tree(src: Path, dest: Path) -> Path:
    """A fresh copy of the directory ``src`` at ``dest`` (the seeds are small: copied, never linked,
    so that a mutation cannot reach the seed)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, symlinks=True)
    return dest

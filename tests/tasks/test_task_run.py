"""``circleops run FILE --image / --text / --audio``: inputs made by the model's saved processor
(found through the file's metadata), outputs printed as labels: the same numbers transformers
gives for the torch model on the same input."""
from __future__ import annotations

import re
import wave

import numpy as np
import pytest
import torch

from circleops.cli import main


@pytest.fixture(scope="module")
def converted(tiny_dir, tmp_path_factory):
    """name -> (model dir, the onert file converted from it by the CLI)."""
    made = {}

    def get(name: str):
        if name not in made:
            out = tmp_path_factory.mktemp("run") / f"{name}.circle"
            args = ["--seq-len", "16"] if name.startswith(("bert", "distilbert")) else []
            if name.startswith("wav2vec2"):
                args = ["--input-shape", "input_values=1x1600"]
            assert main(["convert", str(tiny_dir(name)), "-o", str(out), "--target", "onert", "--quiet", *args]) == 0
            made[name] = (tiny_dir(name), out)
        return made[name]

    return get


def _printed_probs(text: str) -> list[tuple[float, str]]:
    return [(float(p), label) for p, label in re.findall(r"^  (\d\.\d{4})  (.+)$", text, re.M)]


def _torch_model(model_dir, cls_name):
    import transformers

    return getattr(transformers, cls_name).from_pretrained(str(model_dir), attn_implementation="eager").eval()


def test_image_prints_the_labels_transformers_gives(converted, tmp_path, capsys):
    from PIL import Image
    from transformers import AutoImageProcessor

    model_dir, path = converted("vit")
    image = tmp_path / "photo.png"
    Image.fromarray((np.random.RandomState(1).rand(48, 64, 3) * 255).astype("uint8")).save(image)
    assert main(["run", str(path), "--image", str(image), "--top", "3", "--runtime", "onert"]) == 0
    printed = _printed_probs(capsys.readouterr().out)
    pixels = AutoImageProcessor.from_pretrained(str(model_dir))(images=Image.open(image), return_tensors="pt")
    with torch.no_grad():
        probs = _torch_model(model_dir, "ViTForImageClassification")(**pixels).logits.softmax(-1)[0]
    top = probs.argsort(descending=True)[:3]
    from tiny_models import LABELS

    assert [label for _, label in printed] == [LABELS[int(i)] for i in top]
    assert [p for p, _ in printed] == pytest.approx([float(probs[i]) for i in top], abs=1e-4)


def test_text_classification_and_tokens(converted, capsys):
    from transformers import AutoTokenizer

    model_dir, path = converted("distilbert-sst2")
    assert main(["run", str(path), "--text", "good movie", "--runtime", "onert"]) == 0
    printed = dict((label, p) for p, label in _printed_probs(capsys.readouterr().out))
    enc = AutoTokenizer.from_pretrained(str(model_dir))("good movie", return_tensors="pt")  # no padding
    with torch.no_grad():
        probs = _torch_model(model_dir, "DistilBertForSequenceClassification")(**enc).logits.softmax(-1)[0]
    assert printed == pytest.approx({"NEGATIVE": float(probs[0]), "POSITIVE": float(probs[1])}, abs=1e-4)

    model_dir, path = converted("bert-ner")
    assert main(["run", str(path), "--text", "the cat sat in paris", "--runtime", "onert"]) == 0
    rows = re.findall(r"^  (\S+)\t(\S+)$", capsys.readouterr().out, re.M)
    enc = AutoTokenizer.from_pretrained(str(model_dir))("the cat sat in paris", return_tensors="pt")
    with torch.no_grad():
        ids = _torch_model(model_dir, "BertForTokenClassification")(**enc).logits[0].argmax(-1)
    labels = {0: "O", 1: "B-LOC", 2: "I-LOC"}
    assert rows == list(zip(["[CLS]", "the", "cat", "sat", "in", "paris", "[SEP]"], [labels[int(i)] for i in ids]))


def test_fill_mask_names_the_tokens(converted, capsys):
    from transformers import AutoTokenizer

    model_dir, path = converted("bert-mlm")
    assert main(["run", str(path), "--text", "the cat [MASK] on the mat", "--top", "3", "--runtime", "onert"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[MASK] at 3:")][0]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    with torch.no_grad():
        logits = _torch_model(model_dir, "BertForMaskedLM")(**tok("the cat [MASK] on the mat", return_tensors="pt"))
    best = logits.logits[0, 3].softmax(-1).argsort(descending=True)[:3]
    assert re.findall(r"(\S+) \(", line.split(":", 1)[1]) == [tok.decode([int(i)]) for i in best]


def test_audio_from_a_wav_file(converted, tmp_path, capsys):
    from transformers import AutoFeatureExtractor

    model_dir, path = converted("wav2vec2-cls")
    wav = tmp_path / "clip.wav"
    samples = (np.sin(np.arange(1200) * 0.05) * 12000).astype(np.int16)  # shorter than the graph: zero padded
    with wave.open(str(wav), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000), f.writeframes(samples.tobytes())
    assert main(["run", str(path), "--audio", str(wav), "--runtime", "onert"]) == 0
    printed = dict((label, p) for p, label in _printed_probs(capsys.readouterr().out))
    values = AutoFeatureExtractor.from_pretrained(str(model_dir))(samples / 32768.0, sampling_rate=16000,
                                                                    return_tensors="pt")["input_values"]
    values = torch.nn.functional.pad(values.float(), (0, 1600 - values.shape[1]))
    with torch.no_grad():
        probs = _torch_model(model_dir, "Wav2Vec2ForSequenceClassification")(values).logits.softmax(-1)[0]
    assert printed == pytest.approx({"speech": float(probs[0]), "music": float(probs[1]),
                                     "noise": float(probs[2])}, abs=1e-4)


def _error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_run_input_errors(converted, tiny_dir, tmp_path, capsys):
    model_dir, path = converted("vit")
    assert "takes pixel_values: give --image, not --text" in _error(capsys, "run", str(path), "--text", "hello")
    assert "cannot read the image" in _error(capsys, "run", str(path), "--image", str(model_dir / "config.json"))
    # a file converted from --config: no processor recorded, --model DIR gives it
    from PIL import Image

    image = tmp_path / "p.png"
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(image)
    random = tmp_path / "random.circle"
    assert main(["convert", "--config", str(model_dir / "config.json"), "-o", str(random), "--quiet"]) == 0
    assert "--model DIR" in _error(capsys, "run", str(random), "--image", str(image))
    assert main(["run", str(random), "--image", str(image), "--model", str(model_dir)]) == 0
    assert "tabby cat" in capsys.readouterr().out
    # a file that records no task
    llama = tmp_path / "llama.circle"
    assert main(["convert", str(tiny_dir("llama")), "-o", str(llama), "--seq-len", "4", "--quiet"]) == 0
    assert "records no task" in _error(capsys, "run", str(llama), "--text", "hi")


@pytest.mark.parametrize("key,value", [("image_mean", ""), ("image_std", [0.5]), ("rescale_factor", "x"),
                                       ("resample", 99)])
def test_a_processor_config_it_cannot_use_is_named(converted, tmp_path, capsys, key, value):
    """A preprocessor_config.json value the image processor cannot use (found by the CLI
    hold-out fuzz: "image_mean": "" ended in an internal ValueError) is one paragraph naming
    the processor and its directory, exit 2."""
    import json
    import shutil

    from PIL import Image

    model_dir, path = converted("vit")
    bad = tmp_path / "vit"
    shutil.copytree(model_dir, bad)
    config = json.loads((bad / "preprocessor_config.json").read_text())
    config[key] = value
    (bad / "preprocessor_config.json").write_text(json.dumps(config))
    image = tmp_path / "p.png"
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(image)
    err = _error(capsys, "run", str(path), "--image", str(image), "--model", str(bad))
    assert f"the image processor saved in {bad} failed on this input" in err and "internal error" not in err


def test_inspect_shows_the_task(converted, capsys):
    model_dir, path = converted("vit")
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"task: image-classification (ViTForImageClassification, from {model_dir.resolve()}); 5 labels" in out


def test_speech_recognition_prints_the_greedy_ctc_transcript(converted, tmp_path, capsys):
    from transformers import AutoFeatureExtractor, AutoTokenizer

    model_dir, path = converted("wav2vec2-ctc")
    wav = tmp_path / "speech.wav"
    samples = (np.random.RandomState(3).randn(1600) * 3000).astype(np.int16)
    with wave.open(str(wav), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000), f.writeframes(samples.tobytes())
    assert main(["run", str(path), "--audio", str(wav), "--runtime", "onert"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("transcript")][0]
    values = AutoFeatureExtractor.from_pretrained(str(model_dir))(samples / 32768.0, sampling_rate=16000,
                                                                    return_tensors="pt")["input_values"]
    with torch.no_grad():
        ids = _torch_model(model_dir, "Wav2Vec2ForCTC")(values.float()).logits.argmax(-1)
    expected = AutoTokenizer.from_pretrained(str(model_dir)).batch_decode(ids)[0]  # HF's own CTC decoding
    assert expected and line == f"transcript (automatic-speech-recognition, greedy CTC): {expected!r}"


def test_segmentation_and_detection_are_read_from_their_outputs(converted, tmp_path, capsys):
    from PIL import Image
    from transformers import AutoImageProcessor

    image = tmp_path / "street.png"
    Image.fromarray((np.random.RandomState(2).rand(40, 40, 3) * 255).astype("uint8")).save(image)
    model_dir, path = converted("segformer")
    assert main(["run", str(path), "--image", str(image), "--runtime", "onert"]) == 0
    printed = {label: float(p) / 100 for p, label in re.findall(r"^ +(\d+\.\d\d)%  (\S+)$", capsys.readouterr().out,
                                                                 re.M)}
    pixels = AutoImageProcessor.from_pretrained(str(model_dir))(images=Image.open(image), return_tensors="pt")
    with torch.no_grad():
        winners = _torch_model(model_dir, "SegformerForSemanticSegmentation")(**pixels).logits[0].argmax(0)
    share = torch.bincount(winners.reshape(-1), minlength=3).double() / winners.numel()
    assert printed == pytest.approx({f"LABEL_{i}": float(s) for i, s in enumerate(share) if s > 0}, abs=1e-4)

    model_dir, path = converted("yolos")
    assert main(["run", str(path), "--image", str(image), "--top", "2", "--runtime", "onert"]) == 0
    rows = re.findall(r"^  (0\.\d{4})  LABEL_\d  \(([\d., ]+)\)$", capsys.readouterr().out, re.M)
    with torch.no_grad():
        out = _torch_model(model_dir, "YolosForObjectDetection")(**pixels)
    scores = out.logits[0].softmax(-1)[:, :-1].max(-1).values
    top = scores.argsort(descending=True)[:2]
    assert [float(s) for s, _ in rows] == pytest.approx([float(scores[q]) for q in top], abs=1e-4)
    assert len(rows) == 2 and all(len(box.split(", ")) == 4 for _, box in rows)


@pytest.mark.parametrize("name, flag, file", [("vit", "--image", "preprocessor_config.json"),
                                              ("distilbert-sst2", "--text", "tokenizer_config.json")])
def test_run_refuses_a_model_dir_naming_code(converted, tmp_path, name, flag, file):
    """``run FILE --image/--text --model DIR`` with an ``auto_map`` in DIR (issue 31): refused
    before transformers reads it, stdin answering "y", no code run (tests/security/evil_dirs)."""
    import shutil
    import sys
    from pathlib import Path

    from PIL import Image

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))
    from evil_dirs import cli_with_yes, make_evil, refused

    model_dir, path = converted(name)
    marker = tmp_path / "pwned"
    evil = make_evil(Path(shutil.copytree(model_dir, tmp_path / "evil")), file, marker)
    image = tmp_path / "p.png"
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(image)
    value = str(image) if flag == "--image" else "good movie"
    refused(cli_with_yes("run", str(path), flag, value, "--model", str(evil), cwd=tmp_path), evil / file, marker)


def test_image_is_read_upright_as_transformers_load_image(converted, tmp_path, capsys):
    """A phone photo (EXIF Orientation=6) through ``run --image``: the labels transformers gives
    on ``load_image`` of the same file (upright), not on the sideways pixels (issue 31)."""
    from PIL import Image
    from transformers import AutoImageProcessor
    from transformers.image_utils import load_image

    model_dir, path = converted("vit")
    image = tmp_path / "phone.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray((np.random.RandomState(2).rand(48, 64, 3) * 255).astype("uint8")).save(image, exif=exif.tobytes())
    assert main(["run", str(path), "--image", str(image), "--top", "3", "--runtime", "onert"]) == 0
    printed = _printed_probs(capsys.readouterr().out)
    processor, model = AutoImageProcessor.from_pretrained(str(model_dir)), _torch_model(model_dir, "ViTForImageClassification")

    def probs(picture):
        with torch.no_grad():
            return model(**processor(images=picture, return_tensors="pt")).logits.softmax(-1)[0]

    upright, sideways = probs(load_image(str(image))), probs(Image.open(image).convert("RGB"))
    assert (upright - sideways).abs().max() > 1e-3  # the orientation matters to this model
    top = upright.argsort(descending=True)[:3]
    assert [p for p, _ in printed] == pytest.approx([float(upright[i]) for i in top], abs=1e-4)

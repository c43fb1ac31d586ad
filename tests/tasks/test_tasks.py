"""circleops.recipes.tasks: which task a config.json means, the inputs made for it, and the errors a
user gets for a model or an option circleops cannot convert (one paragraph, exit code 2)."""
from __future__ import annotations

import json

import pytest

from circleops.recipes import tasks
from circleops.cli import main
from circleops.errors import TargetError


@pytest.mark.parametrize("cfg, task", [
    ({"model_type": "vit", "architectures": ["ViTForImageClassification"]}, "image-classification"),
    ({"model_type": "vit", "architectures": ["ViTModel"]}, "image-feature-extraction"),
    ({"model_type": "bert", "architectures": ["BertModel"]}, "feature-extraction"),
    ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "fill-mask"),
    ({"model_type": "bert", "architectures": ["BertForTokenClassification"]}, "token-classification"),
    ({"model_type": "distilbert", "architectures": ["DistilBertForSequenceClassification"]}, "text-classification"),
    ({"model_type": "wav2vec2", "architectures": ["Wav2Vec2ForSequenceClassification"]}, "audio-classification"),
    ({"model_type": "wav2vec2", "architectures": ["Wav2Vec2ForCTC"]}, "automatic-speech-recognition"),
    ({"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"]}, "speech-encoder"),
    ({"model_type": "segformer", "architectures": ["SegformerForSemanticSegmentation"]}, "semantic-segmentation"),
    ({"model_type": "yolos", "architectures": ["YolosForObjectDetection"]}, "object-detection"),
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "text-generation"),
    # no architectures: the causal LM as before, else the base model
    ({"model_type": "llama"}, "text-generation"),
    ({"model_type": "bert"}, "text-generation"),
    ({"model_type": "vit"}, "image-feature-extraction"),
    ({"model_type": "whisper"}, "speech-encoder"),
])
def test_task_is_inferred_from_config(cfg, task):
    assert tasks.infer_task(cfg) == task


def test_unknown_architecture_is_an_error_listing_the_tasks():
    with pytest.raises(TargetError) as err:
        tasks.infer_task({"model_type": "bert", "architectures": ["BertForSomethingNew"]}, "my-model")
    text = str(err.value)
    assert "BertForSomethingNew" in text and "--task" in text
    assert all(name in text for name in tasks.TASKS)
    assert "bert has: " in text and "fill-mask" in text.split("bert has: ")[1]


def test_task_the_model_type_lacks_names_the_ones_it_has():
    pick = tasks.model_class_for("fill-mask")
    with pytest.raises(TargetError, match=r"no fill-mask model for model_type 'vit'.*image-classification"):
        pick(None, {"model_type": "vit"}, "vit-dir")


@pytest.mark.parametrize("item", ["pixel_values", "pixel_values=", "pixel_values=1x3xfoo", "x=1x0x3", "=1x2"])
def test_bad_input_shape_is_an_error(item):
    with pytest.raises(TargetError, match="NAME=DxDx"):
        tasks.parse_input_shapes([item])


def test_input_shape_parses():
    assert tasks.parse_input_shapes(["pixel_values=1x3x64x48", "input_ids=1X9"]) == {
        "pixel_values": (1, 3, 64, 48), "input_ids": (1, 9)}


def test_input_shape_overrides_and_sizes_come_from_the_processor(tiny_dir, tmp_path, capsys):
    """--input-shape sets the graph's input; without it the image size is the processor's, and a
    name the model does not take is an error naming its inputs."""
    vit = tiny_dir("dinov2")  # Dinov2 interpolates its position embeddings: any size runs
    proc = json.loads((vit / "preprocessor_config.json").read_text())
    assert proc["size"] == {"height": 32, "width": 32}
    out = tmp_path / "d.circle"
    assert main(["convert", str(vit), "-o", str(out), "--input-shape", "pixel_values=1x3x48x40", "--quiet"]) == 0
    assert tasks.read_task_record(out)["inputs"] == {"pixel_values": [1, 3, 48, 40]}
    code = main(["convert", str(vit), "-o", str(tmp_path / "e.circle"), "--input-shape", "images=1x3x8x8"])
    err = capsys.readouterr().err
    assert code == 2 and "no input 'images'" in err and "pixel_values" in err
    assert not (tmp_path / "e.circle").exists()


def test_model_that_rejects_the_shape_is_a_clear_error(tiny_dir, tmp_path, capsys):
    code = main(["convert", str(tiny_dir("vit")), "-o", str(tmp_path / "v.circle"),
                 "--input-shape", "pixel_values=1x3x64x64"])
    err = capsys.readouterr().err
    assert code == 2 and "does not run on the inputs pixel_values=1x3x64x64" in err and "Traceback" not in err


def test_task_flag_converts_another_head_of_the_checkpoint(tiny_dir, tmp_path, capsys):
    """--task image-feature-extraction on a classifier's directory: its body, as saved (no
    randomly initialized pooler)."""
    out = tmp_path / "body.circle"
    assert main(["convert", str(tiny_dir("vit")), "-o", str(out), "--task", "image-feature-extraction",
                 "--verify"]) == 0
    text = capsys.readouterr().out
    assert "outputs: last_hidden_state [1, 17, 32]" in text and "ViTForImageClassification" in text


def test_unknown_task_flag_lists_the_tasks(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["convert", "x", "-o", str(tmp_path / "x.circle"), "--task", "image-to-poetry"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "image-to-poetry" in err and "image-classification" in err and "speech-encoder" in err


def test_config_with_random_weights(tiny_dir, tmp_path, capsys):
    """--config config.json of a non-LLM: built with random weights for its task."""
    out = tmp_path / "r.circle"
    assert main(["convert", "--config", str(tiny_dir("vit") / "config.json"), "-o", str(out), "--quiet"]) == 0
    record = tasks.read_task_record(out)
    assert record["task"] == "image-classification" and record["model_dir"] is None
    assert record["id2label"]["0"] == "tabby cat"


def test_integer_calibration_of_a_text_model_keeps_the_mask(tiny_dir, tmp_path):
    """uint8/int16 calibration samples for a text model: token windows through its tokenizer,
    and the attention mask all ones (the generic sampler would fill it with token ids)."""
    import torch
    from transformers import AutoTokenizer

    from circleops.options import ConvertOptions
    from circleops.sources.models import load

    model_dir = tiny_dir("bert-ner")
    config = load(str(model_dir), model_class=tasks.model_class_for("token-classification")).module.config
    inputs = tasks.example_inputs({"input_ids": ((1, 16), "int64"), "attention_mask": ((1, 16), "int64")},
                                  config.vocab_size)
    path = tasks._text_calibration(inputs, str(model_dir), config, ConvertOptions(quantize="uint8", calibrate=3),
                                   str(tmp_path))
    rows = torch.load(path, weights_only=True)
    assert len(rows) == 3 and all(len(r) == 2 for r in rows)
    assert all(torch.equal(mask, torch.ones(1, 16, dtype=torch.int64)) for _, mask in rows)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    from circleops.quantize.pt2e import CALIBRATION_TEXT

    text_ids = tok(CALIBRATION_TEXT.read_text())["input_ids"]
    assert rows[0][0][0].tolist() == text_ids[:16]  # the shipped text, tokenized by the model's tokenizer
    assert tasks._text_calibration(inputs, str(model_dir), config, ConvertOptions(quantize="w8"), str(tmp_path)) is None

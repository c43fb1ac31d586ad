"""Tiny random Hugging Face models, one or more per task of circleops.recipes.tasks.TASKS, saved with
save_pretrained (config.json, model.safetensors and the processor / tokenizer a user has).

The task zoo (tests/tasks/test_task_zoo.py, and bench/task_zoo.py that writes the table in
docs/tasks.md) converts each with the CLI for onert and circle with --verify. A row's
``expect`` is "pass", or the reason it fails (checked to still fail so: a row that starts to
pass must be moved to "pass" and the docs regenerated).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "cat", "dog", "sat", "on", "mat", "is",
         "good", "bad", "movie", "paris", "france", "in", "city", "capital", "of", "and", "was"]
SEQ = 16


@dataclass(frozen=True)
class Tiny:
    name: str
    task: str
    build: Callable[[Path], None]
    outputs: tuple[str, ...]  # the file's output names, in order
    args: tuple[str, ...] = ()  # extra CLI arguments (e.g. --seq-len)
    expect: str = "pass"


def _bert_tokenizer(path: Path) -> None:
    from transformers import BertTokenizer

    (path / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    BertTokenizer(str(path / "vocab.txt")).save_pretrained(str(path))


def _save(model: Any, path: Path) -> None:
    model.save_pretrained(str(path))


def _seeded(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    def build(path: Path) -> None:
        import torch

        torch.manual_seed(0)
        path.mkdir(parents=True, exist_ok=True)
        fn(path)

    return build


def _bert(cls_name: str, **extra: Any) -> Callable[[Path], None]:
    @_seeded
    def build(path: Path) -> None:
        import transformers

        cfg = transformers.BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=64, **extra)
        _save(getattr(transformers, cls_name)(cfg), path)
        _bert_tokenizer(path)

    return build


@_seeded
def _distilbert_sst(path: Path) -> None:
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    cfg = DistilBertConfig(vocab_size=len(WORDS), dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                           max_position_embeddings=64, id2label={0: "NEGATIVE", 1: "POSITIVE"},
                           label2id={"NEGATIVE": 0, "POSITIVE": 1})
    _save(DistilBertForSequenceClassification(cfg), path)
    _bert_tokenizer(path)


def _vit_processor(path: Path, size: int) -> None:
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    ViTImageProcessorPil(size={"height": size, "width": size}).save_pretrained(str(path))


LABELS = {i: name for i, name in enumerate(["tabby cat", "golden retriever", "red fox", "teapot", "sports car"])}


def _vision(cls_name: str, config_name: str, size: int = 32, **kwargs: Any) -> Callable[[Path], None]:
    @_seeded
    def build(path: Path) -> None:
        import transformers

        cfg = getattr(transformers, config_name)(**kwargs)
        _save(getattr(transformers, cls_name)(cfg), path)
        _vit_processor(path, size)

    return build


_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
            patch_size=8)


def _wav2vec2(cls_name: str, config_name: str = "Wav2Vec2Config", **extra: Any) -> Callable[[Path], None]:
    @_seeded
    def build(path: Path) -> None:
        import transformers

        cfg = getattr(transformers, config_name)(vocab_size=len(CTC_VOCAB), hidden_size=32, num_hidden_layers=2,
                                                 num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
                                                 conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                                 num_conv_pos_embedding_groups=4, pad_token_id=0, **extra)
        _save(getattr(transformers, cls_name)(cfg), path)
        transformers.Wav2Vec2FeatureExtractor(sampling_rate=16000).save_pretrained(str(path))
        (path / "vocab.json").write_text(json.dumps({c: i for i, c in enumerate(CTC_VOCAB)}))
        transformers.Wav2Vec2CTCTokenizer(str(path / "vocab.json")).save_pretrained(str(path))

    return build


CTC_VOCAB = ["<pad>", "<s>", "</s>", "<unk>", "|"] + list("abcdefghijklmnopqrstuvwxyz'")


@_seeded
def _whisper(path: Path) -> None:
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                        max_source_positions=32, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[])
    _save(WhisperForConditionalGeneration(cfg), path)
    WhisperFeatureExtractor(feature_size=16, chunk_length=1, n_samples=None).save_pretrained(str(path))


@_seeded
def _llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    _save(LlamaForCausalLM(cfg), path)


ZOO: list[Tiny] = [
    Tiny("llama", "text-generation", _llama, ("logits",), ("--seq-len", "8")),
    Tiny("bert", "feature-extraction", _bert("BertModel"), ("last_hidden_state", "pooler_output"), ("--seq-len", str(SEQ))),
    Tiny("bert-mlm", "fill-mask", _bert("BertForMaskedLM"), ("logits",), ("--seq-len", str(SEQ))),
    Tiny("distilbert-sst2", "text-classification", _distilbert_sst, ("logits",), ("--seq-len", str(SEQ))),
    Tiny("bert-ner", "token-classification",
         _bert("BertForTokenClassification", id2label={0: "O", 1: "B-LOC", 2: "I-LOC"},
               label2id={"O": 0, "B-LOC": 1, "I-LOC": 2}), ("logits",), ("--seq-len", str(SEQ))),
    Tiny("bert-qa", "question-answering", _bert("BertForQuestionAnswering"), ("start_logits", "end_logits"), ("--seq-len", str(SEQ))),
    Tiny("vit", "image-classification",
         _vision("ViTForImageClassification", "ViTConfig", **_VIT, id2label=LABELS,
                 label2id={v: k for k, v in LABELS.items()}), ("logits",)),
    Tiny("convnext", "image-classification",
         _vision("ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[16, 32], depths=[1, 1],
                 num_stages=2, image_size=32, id2label=LABELS, label2id={v: k for k, v in LABELS.items()}),
         ("logits",)),
    Tiny("dinov2", "image-feature-extraction",
         _vision("Dinov2Model", "Dinov2Config", **_VIT), ("last_hidden_state", "pooler_output")),
    Tiny("segformer", "semantic-segmentation",
         _vision("SegformerForSemanticSegmentation", "SegformerConfig", num_encoder_blocks=2, depths=[1, 1],
                 sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2], patch_sizes=[7, 3],
                 strides=[4, 2], mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=3), ("logits",)),
    Tiny("dpt", "depth-estimation",
         _vision("DPTForDepthEstimation", "DPTConfig", **{**_VIT, "num_hidden_layers": 4},
                 backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 32, 32], fusion_hidden_size=16),
         ("predicted_depth",)),
    Tiny("yolos", "object-detection",
         _vision("YolosForObjectDetection", "YolosConfig", **{**_VIT, "image_size": [32, 32]},
                 num_detection_tokens=5, num_labels=4), ("logits", "pred_boxes", "last_hidden_state")),
    Tiny("wav2vec2-ctc", "automatic-speech-recognition", _wav2vec2("Wav2Vec2ForCTC"), ("logits",),
         ("--input-shape", "input_values=1x1600")),
    Tiny("wav2vec2-cls", "audio-classification",
         _wav2vec2("Wav2Vec2ForSequenceClassification", id2label={0: "speech", 1: "music", 2: "noise"},
                   label2id={"speech": 0, "music": 1, "noise": 2}), ("logits",),
         ("--input-shape", "input_values=1x1600")),
    Tiny("whisper", "speech-encoder", _whisper, ("last_hidden_state",)),
]


def _text(cls_name: str, config_name: str, **kwargs: Any) -> Callable[[Path], None]:
    @_seeded
    def build(path: Path) -> None:
        import transformers

        cfg = getattr(transformers, config_name)(vocab_size=len(WORDS), max_position_embeddings=64, **kwargs)
        _save(getattr(transformers, cls_name)(cfg), path)
        _bert_tokenizer(path)

    return build


_ENC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
_SEQ_ARGS = ("--seq-len", str(SEQ))

# More architectures for bench/task_zoo.py's table in docs/tasks.md (not run in CI: the rows
# above cover each task once; these show how far the same path reaches, and what fails).
EXTRA: list[Tiny] = [
    Tiny("roberta", "text-classification", _text("RobertaForSequenceClassification", "RobertaConfig", **_ENC,
                                                 pad_token_id=0), ("logits",), _SEQ_ARGS),
    Tiny("albert", "fill-mask", _text("AlbertForMaskedLM", "AlbertConfig", embedding_size=16, **_ENC), ("logits",),
         _SEQ_ARGS),
    Tiny("electra", "token-classification", _text("ElectraForTokenClassification", "ElectraConfig", embedding_size=16,
                                                  **_ENC), ("logits",), _SEQ_ARGS),
    Tiny("deberta-v2", "fill-mask", _text("DebertaV2ForMaskedLM", "DebertaV2Config", **_ENC), ("logits",), _SEQ_ARGS),
    Tiny("deit", "image-classification", _vision("DeiTForImageClassificationWithTeacher", "DeiTConfig", **_VIT),
         ("logits", "cls_logits", "distillation_logits")),
    Tiny("beit", "image-classification", _vision("BeitForImageClassification", "BeitConfig", **_VIT), ("logits",)),
    Tiny("swin", "image-classification",
         _vision("SwinForImageClassification", "SwinConfig", image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                 num_heads=[1, 2], window_size=4), ("logits",)),
    Tiny("resnet", "image-classification",
         _vision("ResNetForImageClassification", "ResNetConfig", embedding_size=8, hidden_sizes=[8, 16],
                 depths=[1, 1]), ("logits",)),
    Tiny("mobilenet_v2", "image-classification",
         _vision("MobileNetV2ForImageClassification", "MobileNetV2Config", image_size=32, depth_multiplier=0.25),
         ("logits",)),
    Tiny("hiera", "image-classification",
         _vision("HieraForImageClassification", "HieraConfig", image_size=[64, 64], embed_dim=8, depths=[1, 1, 1, 1],
                 num_heads=[1, 1, 1, 1], size=64), ("logits",)),
    Tiny("clip-vision", "image-feature-extraction",
         _vision("CLIPVisionModel", "CLIPVisionConfig", **_VIT), ("last_hidden_state", "pooler_output")),
    Tiny("siglip-vision", "image-feature-extraction",
         _vision("SiglipVisionModel", "SiglipVisionConfig", **_VIT), ("last_hidden_state", "pooler_output")),
    Tiny("detr", "object-detection",
         _vision("DetrForObjectDetection", "DetrConfig", use_timm_backbone=False, use_pretrained_backbone=False,
                 backbone_config={"model_type": "resnet", "embedding_size": 8, "hidden_sizes": [8, 16, 16, 16],
                                  "depths": [1, 1, 1, 1], "out_features": ["stage4"]},
                 d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5, num_labels=4),
         ("logits", "pred_boxes", "last_hidden_state", "encoder_last_hidden_state")),
    Tiny("hubert-ctc", "automatic-speech-recognition", _wav2vec2("HubertForCTC", "HubertConfig"), ("logits",),
         ("--input-shape", "input_values=1x1600")),
]

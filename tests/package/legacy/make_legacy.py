"""Writes the directories of tests/package/legacy with the circleops of commit 3222152 (the
last to write format circleops-generate v2/v3 and circleops-speech v1), keeping only their
manifest.json: the graph files are written byte for byte alike by the current package step
(checked when these were made; but the VLM's 8-row prefill, now lowered for the one thread it
runs at), so tests/package/test_legacy_manifests.py converts the same
tiny models again and puts these manifests beside the files, as that version left them.

    git archive 3222152 | tar -x -C /tmp/oldcode
    PYTHONPATH=/tmp/oldcode:/tmp/oldcode/tests:/tmp/oldcode/tests/generate:/tmp/oldcode/tests/speech \\
        python tests/package/legacy/make_legacy.py OUT_DIR
"""
from __future__ import annotations

import copy
import shutil
import sys
from pathlib import Path

import torch

# the settings the test converts with again (tests/package/test_legacy_manifests.py)
TEXT = dict(prefill_len=8, max_cache_len=32, source="tiny llama")
SPLIT_BYTES = 300_000  # two layer-range files of the tiny llama
VISION = dict(prefill_len=(16, 8), max_cache_len=64, source="smolvlm-tiny")
SPEECH_CACHE = 32


def text_model():
    from families import BY_NAME

    torch.manual_seed(0)
    return BY_NAME["llama"].build().eval()


def vision_model():
    from transformers import AutoTokenizer

    from circleops.recipes import vlm
    from circleops.sources.models import smollm2_dir
    from vlm_fixtures import tiny_vlm

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    tokenizer.add_special_tokens({"additional_special_tokens": list(vlm.IMAGE_TOKENS)})
    model = tiny_vlm(len(tokenizer), tokenizer.convert_tokens_to_ids("<image>"))
    return model, vlm.build_processor(tokenizer, model)


def main(out: Path) -> None:
    from circleops.recipes import llm, speech, vlm
    from tiny_whisper import save_tiny_whisper

    out.mkdir(parents=True, exist_ok=True)
    llm.convert_graphs(text_model(), out / "text-onert", target="onert", **TEXT)
    llm.convert_graphs(text_model(), out / "text-circle", target="circle", **TEXT)
    llm.convert_graphs(text_model(), out / "text-split", target="onert", max_file_bytes=SPLIT_BYTES, **TEXT)
    model, processor = vision_model()
    vlm.convert_vlm_graphs(copy.deepcopy(model), out / "vision-onert", processor=processor, target="onert", **VISION)
    whisper = save_tiny_whisper(out / "whisper-tiny")
    speech.convert_speech(whisper, out / "speech-onert", target="onert", max_cache_len=SPEECH_CACHE,
                          source="whisper-tiny")
    shutil.rmtree(out / "whisper-tiny")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny_whisper import save_tiny_whisper, write_wav  # noqa: E402


@pytest.fixture(scope="session")
def whisper_dir(tmp_path_factory):
    """The tiny random Whisper (tests/speech/tiny_whisper.py), saved once per session."""
    return save_tiny_whisper(tmp_path_factory.mktemp("whisper") / "whisper-tiny")


@pytest.fixture(scope="session")
def clip(tmp_path_factory):
    return write_wav(tmp_path_factory.mktemp("audio") / "clip.wav")


@pytest.fixture(scope="session")
def speech_graphs(whisper_dir, tmp_path_factory):
    """speech_graphs(target) -> the directory `circleops convert --graphs encoder,prefill,decode`
    wrote for that target (verified), converted once per session."""
    from circleops.cli import main

    made = {}

    def get(target: str):
        if target not in made:
            out = tmp_path_factory.mktemp(f"asr-{target}") / "asr"
            assert main(["convert", str(whisper_dir), "--graphs", "encoder,prefill,decode", "--target", target,
                         "--verify", "--quiet", "-o", str(out)]) == 0
            made[target] = out
        return made[target]

    return get

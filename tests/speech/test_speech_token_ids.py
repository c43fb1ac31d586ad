"""A Whisper manifest's token ids (start, end, pad, forced, suppressed, language and task
tokens) are checked against the vocabulary when it is read (issue 31): an out-of-range
forced id reached onert's embedding GATHER (SIGSEGV) and a suppressed one indexed the logits."""
from __future__ import annotations

import json
import shutil

import pytest

import manifest_json
from circleops.cli import main
from circleops.errors import ModelLoadError
from circleops.package.speech_manifest import read_speech_manifest


@pytest.mark.parametrize("field, value", [
    ("forced_decoder_ids", [[1, 10 ** 6]]), ("forced_decoder_ids", [[1, -2]]), ("suppress_tokens", [1, 2 ** 40]),
    ("begin_suppress_tokens", [-1]), ("decoder_start_token_id", 10 ** 9), ("eos_token_ids", [-5]),
    ("pad_token_id", 1e9), ("no_timestamps_token_id", 99999999), ("lang_to_id", {"<|en|>": 10 ** 6}),
])
def test_whisper_manifest_ids_outside_the_vocabulary(speech_graphs, clip, tmp_path, capsys, field, value):
    out = shutil.copytree(speech_graphs("onert"), tmp_path / "asr")
    data = manifest_json.fields(out)
    manifest_json.edit(out, {field: value})
    with pytest.raises(ModelLoadError, match=f"manifest.json: {field}: token id .* outside the model's vocabulary "
                                             f"of {data['vocab_size']} tokens"):
        read_speech_manifest(out)
    assert main(["generate", str(out), "--audio", str(clip)]) == 2
    err = capsys.readouterr().err
    assert f"{field}: token id" in err and err.count("\n") == 1

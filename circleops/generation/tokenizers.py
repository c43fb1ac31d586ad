"""Text in and out of a generation: the tokenizer saved next to the graphs
(:func:`load_tokenizer`: tokenizer.json through the ``tokenizers`` library, else transformers),
the prompt's ids (:func:`encode_prompt`, with the chat template) and the text of the new tokens
as they arrive (:class:`TextStream`)."""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from circleops.errors import CircleOpsError, ModelLoadError
from circleops.inputs.chat_template import template_budget
from circleops.inputs.remote_code import refuse_remote_code
from circleops.inputs.tokenizer_json import MAX_NORMALIZER_GROWTH, normalizer_growth
from circleops.package.manifest import MANIFEST, confined_tokenizer


class TextStream:
    """Writes the decoded text of the new tokens as they arrive (whole characters only:
    a byte-level BPE token can end inside a UTF-8 sequence)."""

    def __init__(self, tokenizer: Any, out: Any = None):
        self.tokenizer = tokenizer
        self.out = out if out is not None else sys.stdout
        self.ids: list[int] = []
        self.printed = 0

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.text()
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def close(self) -> str:
        text = self.text()
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()
        return text


def check_tokenizer_dir(directory: Path) -> Any:
    """ModelLoadError naming the file unless every JSON file of the tokenizer directory reads
    (circleops.inputs.user_files.read_json: not empty, UTF-8, JSON, not nested past the limit) and
    tokenizer.json loads in the ``tokenizers`` library (which refuses e.g. a negative id);
    returns that ``tokenizers.Tokenizer`` (None without tokenizer.json or the library)."""
    from circleops.inputs.user_files import check_json_files

    fix = "The tokenizer is damaged: convert the model again."
    saved = check_json_files(directory, error=ModelLoadError, fix=fix)
    path = directory / "tokenizer.json"
    if isinstance(saved.get(path.name), dict):
        growth = normalizer_growth(saved[path.name].get("normalizer"))
        if growth > MAX_NORMALIZER_GROWTH:
            raise ModelLoadError(f"{path}: its normalizer can make each character of a prompt up to {growth:.0f} "
                                 f"characters (a Replace whose content is far longer than its pattern), so a short "
                                 f"prompt would exhaust the memory. {fix}")
    if path.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return None
        try:
            return Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the Rust library's one exception type for a bad file
            raise ModelLoadError(f"{path} is not a tokenizer the tokenizers library can load: "
                                 f"{' '.join(str(err).split())[:200]}. {fix}") from None
    return None


class FastTokenizer:
    """The saved tokenizer.json through the ``tokenizers`` library: what generation needs
    (encode, decode) without importing torch and transformers (seconds of start-up)."""

    def __init__(self, directory: Path):
        import tokenizers  # noqa: F401 - ImportError: the caller falls back to transformers

        self.directory = directory
        self.tokenizer = check_tokenizer_dir(directory)

    def encode(self, text: str) -> list[int]:
        with tokenizing(self.directory):
            return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


@contextlib.contextmanager
def tokenizing(directory: Any) -> Iterator[None]:
    """Around a saved tokenizer's run on a text: what the library raises on values of the
    files it cannot use (a catastrophic pre-tokenizer regex, an empty vocabulary) becomes a
    ModelLoadError naming the directory, and a Rust panic's own report (the panic hook writes
    it to fd 2, with a backtrace under RUST_BACKTRACE=1) is dropped: the error says it once."""
    from circleops.inputs.user_files import users_processor

    with users_processor("tokenizer", directory, error=ModelLoadError), _native_stderr_held():
        yield


@contextlib.contextmanager
def _native_stderr_held() -> Iterator[None]:
    """fd 2 into a temporary file while the block runs, written back unless a Rust panic ended
    it (what the library printed for a prompt it tokenized is kept)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no fd 2 (an embedding application): nothing to hold
        yield
        return
    panicked = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException as err:
            panicked = type(err).__name__ == "PanicException"
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if not panicked and held.tell():
                held.seek(0)
                os.write(2, held.read())


def load_tokenizer(manifest: Any) -> Any:
    """The tokenizer saved next to the graphs: a FastTokenizer over tokenizer.json when
    there is one, else transformers.AutoTokenizer."""
    if not manifest.tokenizer:
        raise ModelLoadError(f"{manifest.directory} has no tokenizer (the model was converted without one, e.g. "
                             f"from --config): pass the prompt as token ids with --token-ids 1,2,3.")
    # checked again here: a Manifest can be built by hand, not only read (read_manifest checks)
    path = confined_tokenizer(manifest.directory, manifest.tokenizer, manifest.directory / MANIFEST)
    if not path.is_dir():
        raise ModelLoadError(f"the tokenizer directory {path} listed in manifest.json is missing. Convert again.")
    refuse_remote_code(path)  # its tokenizer.json alone would tokenize differently from the custom class
    if (path / "tokenizer.json").is_file():
        try:
            return FastTokenizer(path)
        except ImportError:
            pass
    return hf_tokenizer(path)


def hf_tokenizer(path: Path) -> Any:
    """transformers' AutoTokenizer of a saved tokenizer directory (chat templates need it)."""
    check_tokenizer_dir(path)  # a damaged file is named here, not a traceback inside transformers
    try:
        return _auto_tokenizer(path)
    except CircleOpsError:
        raise
    except Exception as err:  # noqa: BLE001 - transformers on a value of the wrong type in a user's file
        raise ModelLoadError(f"transformers cannot load the tokenizer in {path}: {type(err).__name__}: "
                             f"{' '.join(str(err).split())[:200]}. The tokenizer files (tokenizer_config.json) are "
                             f"damaged: convert the model again.") from None


def _auto_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    from circleops.sources.models import quiet_transformers

    refuse_remote_code(path)
    with quiet_transformers():
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest vocabulary
    entry: a byte-level or SentencePiece piece is one character per byte or character)."""
    cached = getattr(tokenizer, "_circleops_longest_token", None)
    if cached is None:
        vocab = (tokenizer.tokenizer if isinstance(tokenizer, FastTokenizer) else tokenizer).get_vocab()
        cached = max((len(piece) for piece in vocab), default=1) or 1
        try:
            tokenizer._circleops_longest_token = cached
        except AttributeError:
            pass
    return int(cached)


def check_text_fits(tokenizer: Any, text: str, tokens: int, what: str = "the prompt", *,
                    error: type[CircleOpsError] | None = None) -> None:
    """An ``error`` (default: GenerationLimitError) when ``text`` is longer than ``tokens``
    tokens could be even at the tokenizer's longest token: checked before tokenizing, which
    costs hundreds of bytes per character (a pasted 30 MB text would take gigabytes to be
    refused afterwards)."""
    longest = longest_token_chars(tokenizer)
    if len(text) > tokens * longest:
        if error is None:
            from circleops.generation.core import GenerationLimitError as error
        raise error(
            f"{what} is {len(text)} characters: more than the model's {tokens} cache slots can hold even at its "
            f"longest token ({longest} characters). Shorten it, or convert again with a larger --max-cache-len.")


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = False, max_tokens: int | None = None) -> list[int]:
    """Token ids of ``prompt``, special tokens added as the tokenizer's post-processor says
    (as ``tokenizer(prompt)`` does); with ``chat`` the chat template around one user turn.
    ``max_tokens``: the cache's length, which a prompt longer than could ever fit is refused
    against before tokenizing (check_text_fits)."""
    if max_tokens is not None:
        check_text_fits(tokenizer, prompt, max_tokens)
    if chat:
        if isinstance(tokenizer, FastTokenizer):
            tokenizer = hf_tokenizer(tokenizer.directory)  # templates are rendered by transformers
        if not getattr(tokenizer, "chat_template", None):
            raise ModelLoadError("--chat: this tokenizer has no chat template; drop --chat.")
        with tokenizing(tokenizer.name_or_path), template_budget(tokenizer):  # the template: someone else's program
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.encode(prompt)
    with tokenizing(getattr(tokenizer, "name_or_path", "the model's directory")):
        return [int(i) for i in tokenizer(prompt)["input_ids"]]



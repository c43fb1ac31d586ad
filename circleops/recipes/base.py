"""A recipe: the set of graphs a model is written as, for ``circleops generate`` to run.

A recipe supplies what differs between models; the package step
(circleops.package.step.run) does the rest the same way for every recipe: the option checks,
the file plan per target (a file per graph, one file with signatures, onert's C-API
signatures, split parts), export, the pipeline (fuse, lower, quantize), the write, the
numeric comparison with torch (``--verify``), the manifest and the atomic publish.

    class MyRecipe(Recipe):
        kind = "text"                            # its manifest section
        graph_names = ("prefill", "decode")      # the graphs it accepts (--graphs)

        def graphs(self, opts, parts):           # what to export: Graph(name, module, args, io)
        def manifest(self, directory, opts, plan, infos):   # the Manifest, assets saved beside it
        def references(self):                    # torch's outputs the written graphs must match
        def compare(self, manifest, runtime, references):   # {graph: (max abs error, max |reference|)}

    report = package.step.run(MyRecipe(model, options), "out/")

The decoder LLM (circleops.recipes.llm.LLMRecipe) is one; circleops/recipes/vlm.py and
speech.py are others. Everything else has a default here: the model's dtype, the weights
the format applies to, no split, the EOS rule, the report's lines.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, ContextManager, Sequence

from circleops.errors import ModelLoadError, OutputError, TargetError
from circleops.options import ConvertOptions
from circleops.package.step import Graph
from circleops.quantize.quality import float_arrays

__all__ = ["Graph", "Recipe", "eos_token_ids", "pad_token_id", "refuse_float_dtype", "save_generation_config"]


def eos_token_ids(*configs: Any) -> list[int]:
    """The one EOS rule: every ``eos_token_id`` of ``configs`` (a model's generation_config and
    config; an int or a list each), sorted, once each. Generation stops at any of them."""
    ids: list[int] = []
    for cfg in configs:
        value = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if value is not None:
            ids += list(value) if isinstance(value, (list, tuple)) else [value]
    return sorted({int(i) for i in ids})


def pad_token_id(config: Any, eos: Sequence[int]) -> int:
    """The config's pad token, else the first EOS id, else 0 (what pads a short prefill chunk)."""
    pad = getattr(config, "pad_token_id", None)
    return int(pad) if pad is not None else (eos[0] if eos else 0)


def save_generation_config(model: Any, directory: Path) -> None:
    """The model's generation_config.json next to the graphs: `circleops generate --sample`
    takes its temperature / top-k / top-p / repetition penalty as defaults, Whisper its start,
    language and task tokens."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    try:
        config.to_json_file(str(directory / "generation_config.json"))
    except OSError as err:
        raise OutputError(f"cannot write {directory / 'generation_config.json'}: {err}.") from None


def refuse_float_dtype(options: ConvertOptions, what: str, hint: str) -> None:
    """Refuse ``--dtype`` other than fp32 for a recipe whose graphs compute in fp32 only
    (``what``: the model kind, ``hint``: what makes the file smaller instead)."""
    if options.dtype not in (None, "fp32") and str(options.dtype) != "torch.float32":
        raise TargetError(f"--dtype {options.dtype}: {what}'s graphs compute in fp32 so far ({hint}); drop --dtype.")


class Recipe:
    """A set of graphs over one model (see the module docstring). ``options`` is the
    conversion's circleops.options.ConvertOptions (target, quantize, verify, threads,
    seq_len, max_cache_len, ...); ``tokenizer`` (or a processor) is saved with the graphs
    and tokenizes calibration text; ``source`` names the model in reports and the manifest."""

    kind: str = "text"  # the manifest section it writes: text, vision, speech
    graph_names: tuple[str, ...] = ()  # the graphs it accepts (--graphs)
    compared: str = "logit"  # what its comparison measures, in the report ("" for any output)

    def __init__(self, model: Any, options: ConvertOptions | None = None, *, tokenizer: Any = None,
                 source: str = ""):
        self.model = model
        self.options = options if options is not None else ConvertOptions()
        self.tokenizer = tokenizer
        self.source = source

    # --------------------------------------------------------------- before any work

    @classmethod
    def check_options(cls, options: ConvertOptions, source: str | None = None) -> None:
        """Refuse what the options ask of this recipe that no model can give, before the
        model is loaded (``source``: where it will come from, to name it)."""

    @classmethod
    def from_source(cls, model: str | None, options: ConvertOptions) -> "Recipe":
        """The recipe of the model at ``model`` (an HF directory, or ``options.config``'s
        random weights), loaded with its assets (``circleops convert --graphs``)."""
        raise NotImplementedError

    def dtype(self) -> Any:
        """The torch dtype the graphs compute in: the model's (float32 if it has none)."""
        import torch

        from circleops.pipeline.validate import model_dtype

        return model_dtype(self.model) or torch.float32

    def check(self, opts: Any) -> None:
        """Refuse what this recipe cannot write, and settle its own settings (lengths, graph
        names), before any work. ``opts``: the resolved circleops.pipeline.stages.Options."""

    def layer_bytes(self, quantize: str | None) -> Any:
        """The weight bytes of its layer-range parts (circleops.package.split.PartBytes), or
        None: it is never split into several files."""
        return None

    # --------------------------------------------------------------- the graphs

    def weights_module(self) -> Any:
        """The torch module whose weights the weight format applies to (and whose forward
        runs on the dequantized weights for the comparison)."""
        return self.model.eval()

    def references(self) -> Any:
        """torch's outputs that the written graphs are compared with (the model's own
        forward, run before its modules are fused; again on the dequantized weights)."""
        raise NotImplementedError

    def graphs(self, opts: Any, parts: Sequence[tuple[int, int]]) -> list[Graph]:
        """The graphs to write (``parts``: a split model's layer ranges, or ())."""
        raise NotImplementedError

    def exporting(self) -> ContextManager[Any]:
        """A context the graphs are built and exported in (e.g. a VLM's explicit attention mask)."""
        return contextlib.nullcontext()

    def lowering_options(self, opts: Any, graph: Graph) -> Any:
        """The lowering options of ``graph``: lowered for the thread count it runs at. A graph
        that generate runs at one thread on the target's runtime (fewer rows than
        circleops.generation.generator.GRAPH_THREAD_CAPS says: onert's 8-row prefill and
        decode) is lowered for one thread, which writes its multi-row linears
        FULLY_CONNECTED (pipeline.target_profile): SmolLM2's 8-row prefill took 0.66-0.85x
        the CPU so (bench/results/09-llm-speed.yaml)."""
        from circleops.generation.generator import GRAPH_THREAD_CAPS
        from circleops.targets import PROFILES

        few_rows, cap = GRAPH_THREAD_CAPS.get(PROFILES[opts.target].runtime, (0, 0))
        if graph.rows is not None and graph.rows < few_rows and cap == 1 and opts.threads != 1:
            return dataclasses.replace(opts, threads=1)
        return opts

    # --------------------------------------------------------------- what is written beside them

    def manifest(self, directory: Path, opts: Any, plan: Any, infos: dict[str, Any]) -> Any:
        """The manifest of the written graphs (circleops.package.manifest), its assets (the
        tokenizer or processor, generation_config.json) saved into ``directory``."""
        raise NotImplementedError

    def eos_token_ids(self) -> list[int]:
        """The model's EOS ids by the one rule (:func:`eos_token_ids`)."""
        return eos_token_ids(getattr(self.model, "generation_config", None), getattr(self.model, "config", None))

    def check_token_ids(self) -> None:
        """The EOS and pad ids the manifest will record are ids of the model's vocabulary,
        checked before any work: ``circleops generate`` refuses a directory whose are not (an id
        the model can never produce would never stop a generation)."""
        config = getattr(self.model, "config", None)
        text = getattr(config, "text_config", None) or config
        vocab = getattr(text, "vocab_size", None)
        if not isinstance(vocab, int) or vocab <= 0:
            return
        ids = {"eos_token_id": self.eos_token_ids()}
        pad = getattr(text, "pad_token_id", None)
        if isinstance(pad, int):
            ids["pad_token_id"] = [pad]
        for name, values in ids.items():
            bad = [i for i in values if not 0 <= i < vocab]
            if bad:
                raise ModelLoadError(
                    f"{self.source or 'the model'}: its {name} {bad[0]} is outside its vocabulary of {vocab} tokens "
                    f"(ids 0 to {vocab - 1}): a generation could never produce or stop at it. Fix {name} in its "
                    f"config.json / generation_config.json (the tokenizer's id for that token).")

    # --------------------------------------------------------------- the comparison and the report

    def noise(self, references: Any, moved: Any) -> dict[str, float] | float:
        """How far the compared outputs move between two of this recipe's references, the
        second with every input the runtime rounds nudged (the model's own noise floor, which
        verify admits twice of: circleops.package.step): graph -> max abs difference at what
        that graph is compared with, or one figure for every graph. Default: the max abs
        difference over every float array of the two (a recipe comparing fewer rows may say
        per graph)."""
        return max((float(abs(b - a).max()) for a, b in zip(float_arrays(references), float_arrays(moved))
                    if a.size), default=0.0)

    def compare(self, manifest: Any, runtime: str, references: Any) -> dict[str, tuple[float, float]]:
        """Run the written graphs on ``runtime`` against ``references``: graph -> (max abs
        error, max |reference|). The package step applies the tolerance."""
        raise NotImplementedError

    # --------------------------------------------------------------- integer (PT2E) graphs

    integer_graphs = False  # it writes integer graphs (--quantize uint8 / int16): it has the hooks below

    def integer_calibration(self, count: int) -> Any:
        """After :meth:`graphs`: an object with ``samples`` (graph -> its calibration inputs,
        ``count`` windows) and ``ranges`` (graph input name -> (min, max): inputs quantized
        with fixed parameters, a KV cache shared by several graphs)."""
        raise NotImplementedError

    def integer_probe(self) -> Any:
        """Before the weights change: what :meth:`integer_quality` compares with (fp32), or None."""
        return None

    def integer_references(self, converted: dict[str, Any], references: Any) -> Any:
        """``references`` as the converted (fake-quantized) graphs compute them: what the written
        integer graphs are compared with."""
        raise NotImplementedError

    def integer_rounding(self, converted: dict[str, Any]) -> ContextManager[Any]:
        """A context in which the converted graphs round every activation stochastically
        (unbiased, at most one integer step off: their noise floor, :meth:`noise` of the two
        references); default: no floor."""
        return contextlib.nullcontext()

    def integer_quality(self, converted: dict[str, Any], probe: Any) -> Any:
        """The quantized graphs against fp32 (circleops.quantize.quality.Quality), or None."""
        return None

    def describe(self, manifest: Any) -> dict[str, Any]:
        """The report's recipe lines (circleops.package.report.GraphsReport fields):
        ``manifest_line``, ``next_args``, ``attention``."""
        return {}

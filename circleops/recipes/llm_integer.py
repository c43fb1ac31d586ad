"""Integer (PT2E) prefill and decode graphs of a causal LM: their calibration, the KV cache's
integer form, torch's quantized references and the quality against fp32.

    circleops convert DIR --graphs prefill,decode --target circle --quantize int16 --verify -o OUT

Each graph (every prefill length, and decode) is quantized on its own by PT2E
(circleops.pipeline.stages.quantize_program: CircleQuantizer, calibration, convert_pt2e), so each
has its own activation scales; what they pass to each other, the KV caches, has one integer form
shared by all of them.

The cache's integer form: **one fixed scale per layer's K cache and per layer's V cache** (and a
zero point for uint8), in the recipe's activation type (int16 symmetric for ``--quantize int16``,
uint8 asymmetric for ``--quantize uint8``), taken from calibration: the range of every key and
value the fp32 model writes into that cache over the calibration text (prefill chunks at pos 0
and after a first chunk, then decode steps), widened to hold 0 (an empty cache is exactly 0).
Why fixed and per layer:

* the prefill writes the caches and the decode reads and rewrites them: they must agree on the
  scale, or each step would requantize every cache (an error per step that grows with the
  generation's length, and a full pass over every cache per token on an NPU);
* a scale observed per graph would differ between the prefill and the decode graph (they see
  different inputs), and one scale for every layer would waste the range: SmolLM2's K caches span
  from a few units to tens of units between layers;
* per tensor, not per head or per channel: Circle's ATTENTION takes one scale per cache operand,
  what NPU compilers (and ONE's kernel) consume, and is what the usual NPU recipes fix at
  calibration (values beyond the calibrated range saturate, as every other activation does).

The caches stay fp32 at the graphs' inputs and outputs (a QUANTIZE after each cache input, a
DEQUANTIZE before each cache output): the values the generator stores are exactly the integers
times the scale, so the round trip between graphs is lossless, and the ATTENTION builtin reads and
writes integer cache tensors inside the graph.

Verify compares the written graphs with torch running the same quantized computation (the
converted, fake-quantized modules, in the order generation runs them: a prefill, then a decode
step on the caches that prefill produced), at the integer formats' tolerance; the quality against
fp32 (logits SQNR and greedy agreement, teacher-forced on a hold-out text through the quantized
prefill and decode) is reported beside it, never a bound.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Callable, Iterator, Mapping

# decode steps per calibration window: the decode graph's calibration inputs (after the
# prefill chunks of that window), each on the caches the steps before it wrote. 32, not 4:
# the decode graph's activation ranges come from these steps alone, and 8 windows x 4 steps
# were 32 tokens of text for every decode scale (and the positions only up to 2n + 4)
CALIBRATION_DECODE_STEPS = 32
# positions the quality is measured over after the longest prefill (teacher-forced decode steps)
QUALITY_DECODE_STEPS = 32


class CacheSamples(Sequence):
    """One graph's calibration inputs whose KV caches are made when a sample is read: each
    window's caches are kept once (the last state its fp32 steps wrote, shared by every graph's
    samples) and a sample taken at position p reads them with the slots from p on zeroed,
    what the caches held when it was taken (a window writes each slot once, in order, on
    caches that start empty). A clone per sample instead held (2 prefill chunks + 32 decode
    steps) x 8 windows of SmolLM2-135M's 512-slot caches (23.6 MB each): 6.8 GB of the full
    int16 convert's 11.0 GB peak RSS (bench/results/51)."""

    def __init__(self, finals: list[list[Any]], layout: str):
        self.finals, self.layout = finals, layout  # window -> its last caches (shared list)
        self.entries: list[tuple[tuple, int, int]] = []  # (the inputs before the caches, window, pos)

    def add(self, head: tuple, window: int, pos: int) -> None:
        """A sample of inputs ``head`` then the caches of ``window`` as they are at ``pos``."""
        self.entries.append((head, window, pos))

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[k] for k in range(*index.indices(len(self)))]
        from circleops.generation.caches import slot_axis

        head, window, pos = self.entries[index]
        caches = []
        for i, final in enumerate(self.finals[window]):
            c = final.clone()
            at = [slice(None)] * c.ndim
            at[slot_axis(self.layout, i, len(self.finals[window]) // 2)] = slice(pos, None)
            c[tuple(at)] = 0
            caches.append(c)
        return (*head, *caches)


@dataclass
class IntegerCalibration:
    """What each graph is calibrated on, and the caches' fixed ranges."""

    samples: dict[str, Sequence[tuple]] = field(default_factory=dict)  # graph -> its calibration inputs
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)  # cache input name -> (min, max)

    def note(self, names: Sequence[str], caches: Sequence[Any]) -> None:
        """Widen the ranges of the caches ``names`` to hold ``caches``' values."""
        for name, c in zip(names, caches):
            lo, hi = float(c.min()), float(c.max())
            old = self.ranges.get(name)
            self.ranges[name] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))


def calibration_windows(model: Any, tokenizer: Any, count: int, length: int) -> list[Any]:
    """``count`` windows of ``length`` tokens of the shipped calibration text (seeded ids
    below the vocabulary without a tokenizer): circleops.quantize.pt2e.calibration_samples."""
    import torch

    from circleops.quantize import pt2e

    samples = pt2e.calibration_samples((torch.zeros(1, length, dtype=torch.int64),), count, tokenizer=tokenizer,
                                       vocab_size=int(model.config.vocab_size))
    return [s[0] for s in samples]


def calibrate(step: Any, named: Mapping[str, tuple[str, int]], windows: Sequence[Any], cache_names: Sequence[str],
              max_cache_len: int) -> IntegerCalibration:
    """The calibration inputs of each graph (``named``: graph -> (kind, length)) and the caches'
    ranges, from the fp32 ``step`` (a DecoderWithCache, "full" caches) over ``windows``: the
    longest prefill at pos 0, again at pos n after it when the cache holds both and a slot
    more, each shorter prefill at pos 0 and after the first chunk, then up to
    CALIBRATION_DECODE_STEPS decode steps (as far as the window and the cache reach) on the
    caches those chunks wrote (each on the caches the steps before it wrote)."""
    import torch

    finals: list[list[Any]] = []  # window -> its last caches (CacheSamples)
    cal = IntegerCalibration({g: CacheSamples(finals, step.cache_layout) for g in named})
    n = max(length for kind, length in named.values() if kind == "prefill") if any(
        kind == "prefill" for kind, _ in named.values()) else 0
    with torch.no_grad():
        for w, ids in enumerate(windows):
            caches, pos = list(step.empty_caches()), 0
            # a second chunk (a prefill at pos n) whenever it leaves a slot for a decode step
            for chunk in range(2 if 2 * n < max_cache_len else 1 if n else 0):
                for g, (kind, m) in named.items():
                    if kind == "prefill" and pos + m <= max_cache_len:
                        cal.samples[g].add((ids[:, pos:pos + m], torch.tensor([pos]), torch.tensor([m - 1])), w, pos)
                caches = list(step(ids[:, pos:pos + n], torch.tensor([pos]), *caches)[1:])
                cal.note(cache_names, caches)
                pos += n
            for k in range(CALIBRATION_DECODE_STEPS if "decode" in named else 0):
                if pos >= min(max_cache_len, ids.shape[1]):
                    break
                token, at = ids[:, pos:pos + 1], torch.tensor([pos])
                cal.samples["decode"].add((token, at), w, pos)
                caches = list(step(token, at, *caches)[1:])
                cal.note(cache_names, caches)
                pos += 1
            finals.append(caches)
    return cal


# --------------------------------------------------------------------------- torch's quantized computation

class TorchSession:
    """A converted (fake-quantized) graph run by torch behind the runtime Session interface
    (``run(numpy inputs) -> numpy outputs``): the generation core runs it as it runs a file, so
    torch's quantized tokens come from the same loop (:func:`torch_generator`)."""

    def __init__(self, module: Any, inputs: Any = (), outputs: Any = ()):
        self.module, self.inputs, self.outputs = module, list(inputs), list(outputs)

    def run(self, inputs: Sequence[Any]) -> list[Any]:
        import numpy as np
        import torch

        args = [torch.from_numpy(np.array(a)) for a in inputs]
        with torch.no_grad():
            outs = self.module(*args)
        return [o.detach().numpy() for o in outs]


def torch_generator(directory: Any, converted: Mapping[str, Any]) -> Any:
    """A circleops.generation.generator.Generator over ``directory``'s manifest whose graphs are
    ``converted`` (graph -> the fake-quantized module the file was verified against) run by
    torch: what the written integer graphs must generate, token for token."""
    from circleops.generation.generator import Generator

    gen = Generator(directory, runtime="reference")
    for n, g in gen.prefill_graphs.items():
        gen.prefill_sessions[n] = TorchSession(converted[g], gen.sessions[g].inputs, gen.sessions[g].outputs)
    gen.decode_session = TorchSession(converted["decode"], gen.decode_session.inputs, gen.decode_session.outputs)
    return gen


def quantized_references(references: Any, converted: Mapping[str, Any], named: Mapping[str, tuple[str, int]],
                         step: Any, pad_id: int, checked_tokens: Callable[[int], int]) -> Any:
    """``references`` (circleops.recipes.llm.References: the model's fp32 logits of every prefix
    of its ids) with the rows the comparison reads replaced by the converted modules' logits,
    computed as the comparison runs the files: each prefill graph of length L on its first
    ``checked_tokens(L)`` tokens (right-padded with ``pad_id``) from pos 0 on empty caches, then
    one decode step on the caches the longest prefill wrote (or, without a prefill, the first token on empty caches)."""
    import numpy as np
    import torch

    ids, logits = references.ids, np.array(references.logits, copy=True)
    after, zeros = None, list(step.empty_caches())
    with torch.no_grad():
        for g, (kind, n) in sorted(named.items(), key=lambda item: -item[1][1]):
            if kind != "prefill":
                continue
            p = checked_tokens(n)
            buf = torch.full((1, n), int(pad_id), dtype=torch.int64)
            buf[0, :p] = ids[:p]
            outs = converted[g](buf, torch.tensor([0]), torch.tensor([p - 1]), *[z.clone() for z in zeros])
            logits[p - 1] = outs[0][0, 0].numpy()
            after = after or (list(outs[1:]), p)
        if "decode" in named:
            caches, p = after if after is not None else (zeros, 0)
            out = converted["decode"](ids[p].reshape(1, 1), torch.tensor([p]), *[c.clone() for c in caches])
            logits[p] = out[0][0, 0].numpy()
    return type(references)(ids, logits)


def hold_out_ids(model: Any, tokenizer: Any, length: int) -> Any:
    """The first ``length`` tokens of the hold-out text (circleops.quantize.llm.HOLDOUT_TEXT,
    never calibrated on), [1, length] int64 (its bytes modulo the vocabulary without a tokenizer)."""
    import torch

    from circleops.quantize.llm import HOLDOUT_TEXT

    vocab = int(model.config.vocab_size)
    text = HOLDOUT_TEXT.read_text()
    ids = list(tokenizer(text)["input_ids"]) if tokenizer is not None else [b % vocab for b in text.encode()]
    ids = (ids * (length // max(len(ids), 1) + 1))[:length]
    return torch.tensor([ids], dtype=torch.int64)


def fp32_logits(model: Any, ids: Any) -> Any:
    """The model's own (HF, no cache) fp32 logits of every prefix of ``ids`` [1, S]: [S, V]."""
    import torch

    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits[0].double()


def quality(fp32: Any, ids: Any, converted: Mapping[str, Any], longest: str, n: int, step: Any) -> Any:
    """circleops.quantize.quality.Quality of the quantized prefill and decode against ``fp32``
    (:func:`fp32_logits` of ``ids``): the ``longest`` prefill (length ``n``) on the first n
    tokens, then teacher-forced decode steps on the rest; compared at every position they predict."""
    import torch

    from circleops.quantize.quality import Quality

    got = []
    with torch.no_grad():
        outs = converted[longest](ids[:, :n], torch.tensor([0]), torch.tensor([n - 1]), *step.empty_caches())
        got.append(outs[0][0, 0].double())
        caches = list(outs[1:])
        for pos in range(n, ids.shape[1]):
            outs = converted["decode"](ids[:, pos:pos + 1], torch.tensor([pos]), *caches)
            got.append(outs[0][0, 0].double())
            caches = list(outs[1:])
    q, want = torch.stack(got), fp32[n - 1:n - 1 + len(got)]
    noise = float((q - want).pow(2).sum())
    db = math.inf if noise == 0 else 10 * math.log10(float(want.pow(2).sum()) / noise)
    return Quality(sqnr_db=db, agreement=int((q.argmax(-1) == want.argmax(-1)).sum()), positions=len(got),
                   max_abs=float((q - want).abs().max()))


@contextlib.contextmanager
def stochastic_rounding(converted: Mapping[str, Any], seed: int = 0) -> Iterator[None]:
    """Every activation quantize of the converted modules rounds stochastically instead of to
    nearest: x/scale goes to floor(x/scale + u), u uniform in [0, 1) (seeded), so each
    integer moves by at most one step, and by none on average. That is what integer kernels
    (TFLite's fixed-point requantization) and torch's float fake-quant differ by: a last-step
    rounding either way, unbiased. How far the logits move then is the model's own noise floor
    at its depth (the package step admits circleops.quantize.weights.NOISE_FLOORS of it).
    Rounding every op down instead (this floor's first form) moved each integer by half a step
    on average, always the same way: an offset that accumulates with the depth, so the floor
    measured a bias the kernels do not have, not their rounding."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def stochastic_quantize(x, scale, zero_point, quant_min, quant_max, dtype):
        u = torch.rand(x.shape, generator=gen, dtype=torch.float32).to(x.dtype)
        return torch.clamp(torch.floor(x / scale + u) + zero_point, quant_min, quant_max).to(dtype)

    changed = []
    for module in converted.values():
        for node in module.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("quantized_decomposed.quantize_per_tensor"):
                changed.append((node, node.target))
                node.target = stochastic_quantize
        module.recompile()
    try:
        yield
    finally:
        for node, target in changed:
            node.target = target
        for module in converted.values():
            module.recompile()

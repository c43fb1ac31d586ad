"""Choosing the next token from logits, with transformers' GenerationConfig semantics, in
numpy (generation imports neither torch nor transformers).

    from circleops.generation.sampling import SamplingConfig, Sampler
    sampler = Sampler(SamplingConfig(do_sample=True, temperature=0.7, top_p=0.9, seed=0))
    token = sampler(logits, context_ids)      # logits [V] of the last position

The processing order is transformers' (``GenerationMixin._get_logits_processor``):
repetition penalty on the raw logits, then — only when sampling — temperature, top-k,
top-p; then argmax (greedy) or a draw from the softmax. Greedy is the default: without
``do_sample`` temperature/top-k/top-p are ignored, as in transformers, and the repetition
penalty still applies. Draws come from ``numpy.random.default_rng(seed)``: a fixed seed
gives fixed tokens (the same distribution as transformers, not the same draws as torch's
generator).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from circleops.errors import CircleOpsError
from circleops.inputs.user_files import read_json

GENERATION_CONFIG = "generation_config.json"


class SamplingError(CircleOpsError):
    """A sampling parameter out of its range."""


@dataclass(frozen=True)
class SamplingConfig:
    """transformers' GenerationConfig fields that choose a token (same names, same defaults)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50  # None or 0: no top-k
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        def number(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        wrong = [f"{name}={value!r}" for name, value, ok in (
            ("temperature", self.temperature, number(self.temperature)), ("top_p", self.top_p, number(self.top_p)),
            ("repetition_penalty", self.repetition_penalty, number(self.repetition_penalty)),
            ("top_k", self.top_k, self.top_k is None or (isinstance(self.top_k, int) and not isinstance(self.top_k, bool))),
            ("seed", self.seed, self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool))),
        ) if not ok]
        if wrong:
            raise SamplingError(f"{', '.join(wrong)}: sampling parameters are numbers (top_k and seed integers).")
        if self.seed is not None and self.seed < 0:
            raise SamplingError(f"the seed must be 0 or more, got {self.seed}.")
        if not self.temperature > 0:
            raise SamplingError(f"temperature must be > 0 (got {self.temperature}); for greedy decoding leave "
                                "sampling off.")
        if self.top_k is not None and self.top_k < 0:
            raise SamplingError(f"top-k must be 0 (off) or more, got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top-p must be in (0, 1], got {self.top_p}.")
        if not self.repetition_penalty > 0:
            raise SamplingError(f"repetition penalty must be > 0 (1.0 is none), got {self.repetition_penalty}.")

    @classmethod
    def from_generation_config(cls, source: str | Path | dict | None, **overrides: Any) -> "SamplingConfig":
        """The model's defaults from ``generation_config.json`` (a path, a directory holding
        one, or its dict; missing = transformers' defaults), then ``overrides`` that are not
        None. ``do_sample`` is NOT taken from the file: greedy stays the default, so the
        same command gives the same text; pass ``do_sample=True`` to sample."""
        data: dict[str, Any] = {}
        where = "the generation config"
        if isinstance(source, dict):
            data = source
        elif source is not None:
            path = Path(source)
            path = path / GENERATION_CONFIG if path.is_dir() else path
            if path.is_file():
                where = str(path)
                data = read_json(path, error=SamplingError)
                if not isinstance(data, dict):
                    raise SamplingError(f"{path} holds a JSON {type(data).__name__}, not an object. Fix or remove it.")
        names = {f.name for f in fields(cls)} - {"do_sample", "seed"}
        try:
            base = cls(**{k: data[k] for k in names if data.get(k) is not None})
        except SamplingError as err:  # the model's file, not the user's flags: say which
            raise SamplingError(f"{where}: {err} "
                                f"Fix generation_config.json, or pass the values as flags.") from None
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})

    def describe(self) -> str:
        if not self.do_sample:
            return "greedy" + (f", repetition penalty {self.repetition_penalty:g}" if self.repetition_penalty != 1 else "")
        parts = [f"temperature {self.temperature:g}"]
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        if self.top_p < 1:
            parts.append(f"top-p {self.top_p:g}")
        if self.repetition_penalty != 1:
            parts.append(f"repetition penalty {self.repetition_penalty:g}")
        parts.append(f"seed {self.seed}" if self.seed is not None else "unseeded")
        return "sampling: " + ", ".join(parts)


def repetition_penalty(scores: np.ndarray, context: Sequence[int], penalty: float) -> np.ndarray:
    """transformers' RepetitionPenaltyLogitsProcessor: every token already in ``context``
    (prompt included) has its logit divided by ``penalty`` if positive, multiplied if negative."""
    if penalty == 1.0 or len(context) == 0:
        return scores
    ids = np.unique(np.asarray(context, dtype=np.int64))
    s = scores[ids]
    scores = scores.copy()
    scores[ids] = np.where(s < 0, s * penalty, s / penalty)
    return scores


def top_k(scores: np.ndarray, k: int | None) -> np.ndarray:
    """transformers' TopKLogitsWarper: logits below the k-th largest become -inf (ties kept)."""
    if not k or k >= scores.shape[-1]:
        return scores
    kth = np.partition(scores, -k)[-k]
    return np.where(scores < kth, -np.inf, scores).astype(scores.dtype)


def top_p(scores: np.ndarray, p: float) -> np.ndarray:
    """transformers' TopPLogitsWarper: keep the smallest set of most likely tokens whose
    probability reaches ``p`` (at least one)."""
    if p >= 1.0:
        return scores
    order = np.argsort(scores, kind="stable")  # ascending, as transformers sorts
    cumulative = np.cumsum(softmax(scores[order]))
    remove = cumulative <= (1 - p)
    remove[-1] = False
    out = scores.copy()
    out[order[remove]] = -np.inf
    return out


def softmax(scores: np.ndarray) -> np.ndarray:
    """Probabilities of ``scores``; a tiny temperature's +inf scores share the mass, NaN
    scores (a broken graph) get none."""
    s = np.where(np.isnan(scores), -np.inf, scores.astype(np.float64))
    top = np.max(s)
    if np.isposinf(top):
        e = np.isposinf(s).astype(np.float64)
    elif np.isneginf(top):
        raise SamplingError("every logit is NaN or -inf: the graph's output is broken; run `circleops check` or "
                            "convert again.")
    else:
        e = np.exp(s - top)
    return e / e.sum()


class Sampler:
    """Picks tokens under one SamplingConfig; holds the random generator, so one Sampler
    per generation gives reproducible draws for a seed."""

    def __init__(self, config: SamplingConfig | None = None):
        self.config = config or SamplingConfig()
        self.rng = np.random.default_rng(self.config.seed)

    def process(self, logits: np.ndarray, context: Sequence[int]) -> np.ndarray:
        """The scores a token is chosen from (-inf = excluded), in transformers' order."""
        c = self.config
        scores = np.asarray(logits, dtype=np.float32).reshape(-1)
        scores = repetition_penalty(scores, context, c.repetition_penalty)
        if not c.do_sample:
            return scores
        with np.errstate(over="ignore"):
            divided = scores / np.float32(c.temperature)
            if np.isinf(divided).any() and np.isfinite(scores).all():  # a tiny temperature overflows float32:
                divided = scores.astype(np.float64) / c.temperature  # float64 keeps the order (the top token wins)
        scores = divided
        scores = top_k(scores, c.top_k)
        return top_p(scores, c.top_p)

    def __call__(self, logits: np.ndarray, context: Sequence[int] = ()) -> int:
        scores = self.process(logits, context)
        if not self.config.do_sample:
            return int(np.argmax(scores))
        probs = softmax(scores)
        return int(self.rng.choice(probs.shape[0], p=probs))

"""The quality figure a quantized --graphs conversion reports beside verify
(circleops.quantize.quality), and the default noise floor of a recipe that says nothing per
graph (circleops.recipes.base.Recipe.noise). The end-to-end figure is checked against the
model in tests/quantize/test_quantize_convert.py::test_graphs_quantized_generate."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from circleops.quantize.quality import float_arrays, measure
from circleops.recipes.base import Recipe


@dataclass
class _Refs:
    ids: torch.Tensor
    logits: np.ndarray


def test_sqnr_and_agreement_over_every_position():
    """Logits moved by 0.1 where they are 1: SQNR 20 dB; a position whose argmax moved counts
    against the agreement; the integer ids are no output."""
    a = np.zeros((4, 8), np.float32)
    a[np.arange(4), [1, 2, 3, 4]] = 1.0
    b = a.copy()
    b[np.arange(4), [1, 2, 3, 4]] += 0.1
    b[3, 5] = 1.2  # position 3's greedy token is now 5, not 4
    ids = torch.arange(4)
    q = measure(_Refs(ids, a), _Refs(ids, b))
    signal, noise = 4.0, 4 * 0.01 + 1.2 ** 2
    assert q.positions == 4 and q.agreement == 3
    assert math.isclose(q.sqnr_db, 10 * math.log10(signal / noise), rel_tol=1e-6)
    assert math.isclose(q.max_abs, 1.2, rel_tol=1e-6)


def test_identical_outputs_are_infinite_sqnr_and_plain_json():
    a = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    q = measure({"logits": a}, {"logits": a.copy()})
    assert math.isinf(q.sqnr_db) and q.agreement == 3 and q.to_dict()["sqnr_db"] is None
    assert "identical" in q.line()


def test_float_arrays_takes_floats_in_a_fixed_order():
    refs = {"b": torch.ones(2), "a": (np.zeros(3, np.float32), np.arange(3))}
    got = float_arrays(refs)
    assert [x.shape for x in got] == [(3,), (2,)] and all(x.dtype.kind == "f" for x in got)


def test_default_noise_is_the_largest_move_of_any_float_output():
    """A recipe that does not say per graph: one figure, the max abs difference of its references."""
    a = np.zeros((2, 4), np.float32)
    b = a.copy()
    b[1, 2] = -0.25
    assert Recipe(None).noise(_Refs(torch.arange(2), a), _Refs(torch.arange(2), b)) == 0.25

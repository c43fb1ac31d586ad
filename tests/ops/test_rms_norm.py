"""circle::rms_norm: bit-equal to every Hugging Face RMSNorm class, and its fp16/bf16 numerics
against an fp64 oracle per compute policy."""
from __future__ import annotations

import importlib
import math

import pytest
import torch

from circleops.ops import REGISTRY
from circleops.ops._common import OpArgumentError

rms_norm = torch.ops.circle.rms_norm
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOW = (torch.float16, torch.bfloat16)

# family -> (HF RMSNorm class, the op attributes that reproduce it)
LLAMA_STYLE: dict = {}
GEMMA_STYLE = {"multiply": "fp32", "offset": 1.0}
HF_VARIANTS = {
    "llama": ("LlamaRMSNorm", LLAMA_STYLE),
    "mistral": ("MistralRMSNorm", LLAMA_STYLE),
    "qwen2": ("Qwen2RMSNorm", LLAMA_STYLE),
    "qwen3": ("Qwen3RMSNorm", LLAMA_STYLE),
    "phi3": ("Phi3RMSNorm", LLAMA_STYLE),
    "olmo2": ("Olmo2RMSNorm", {"multiply": "fp32"}),
    "gemma": ("GemmaRMSNorm", GEMMA_STYLE),
    "gemma2": ("Gemma2RMSNorm", GEMMA_STYLE),
    "gemma3": ("Gemma3RMSNorm", GEMMA_STYLE),
}


def _hf_norm(family: str, hidden: int, eps: float, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(module, HF_VARIANTS[family][0])(hidden, eps=eps)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # trained-looking weights: Llama-style around 1, Gemma-style offsets around 0
        norm.weight.add_(torch.randn(hidden, generator=g) * 0.3)
    return norm.to(dtype)


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3
    x[..., ::7] *= 40  # outlier channels, as real residual streams have (RMS in the hundreds)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("family", HF_VARIANTS)
def test_bit_equal_to_hf(family, dtype):
    attrs = HF_VARIANTS[family][1]
    for shape in ((2, 7, 96), (2, 3, 7, 32)):  # hidden states, and per-head q/k norms (Qwen3, Gemma3)
        norm = _hf_norm(family, shape[-1], 1e-5, dtype)
        x = _inputs(shape, dtype)
        with torch.no_grad():
            want = norm(x)
            got = rms_norm(x, norm.weight, 1e-5, **attrs)
        assert got.dtype == want.dtype and torch.equal(got, want), f"{family} {dtype} {shape}: max diff {(got.double() - want.double()).abs().max()}"


def test_defaults_are_llama():
    for dtype in DTYPES:
        norm = importlib.import_module("transformers.models.llama.modeling_llama").LlamaRMSNorm(64).to(dtype)
        x = _inputs((3, 5, 64), dtype)
        with torch.no_grad():
            assert torch.equal(rms_norm(x, norm.weight), norm(x))


@pytest.mark.parametrize("family", ("llama", "olmo2", "gemma3"))
@pytest.mark.parametrize("dtype", LOW, ids=lambda d: str(d)[6:])
def test_fp32_weight_with_low_precision_input(family, dtype):
    # autocast-style / mixed checkpoints: the module stays fp32, the activations are bf16/fp16
    norm = _hf_norm(family, 64, 1e-6, torch.float32)
    x = _inputs((4, 64), dtype)
    with torch.no_grad():
        want = norm(x)
        got = rms_norm(x, norm.weight, 1e-6, **HF_VARIANTS[family][1])
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_no_weight_is_weight_one():
    x = _inputs((3, 32), torch.bfloat16)
    assert torch.equal(rms_norm(x, None), rms_norm(x, torch.ones(32, dtype=torch.bfloat16)))


def test_bad_weight_shape_is_a_clear_error():
    with pytest.raises(OpArgumentError, match=r"weight must be \[16\].*got \[8\]"):
        rms_norm(torch.randn(2, 16), torch.ones(8))


# ---------------------------------------------------------------- numerics vs an fp64 oracle
HIDDEN = (64, 512, 4096, 8192)
RMS = (1e-3, 1e-2, 1.0, 16.0, 300.0, 5000.0, 1e4)
EPS = 1e-6
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def _ulps(y: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|y - exact| in ulps of y.dtype at the exact (fp64) value; subnormal spacing below the normal range."""
    finfo = torch.finfo(y.dtype)
    exponent = torch.floor(torch.log2(exact.abs().clamp_min(finfo.smallest_normal)))
    return (y.double() - exact).abs() / torch.exp2(exponent - MANTISSA_BITS[y.dtype])


def _oracle(x: torch.Tensor, w: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _rows(hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """8 rows per input RMS: Gaussian, and Gaussian with 30x spikes every 97 channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(RMS), 2, 4, hidden, generator=g, dtype=torch.float64)
    x[:, 1, :, ::97] *= 30
    x = x * torch.tensor(RMS, dtype=torch.float64)[:, None, None, None]
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
        x[-1, 1, 0, 0] = 60000.0
    return x.reshape(-1, hidden).to(dtype)


@pytest.mark.parametrize("policy", ("fp32", "scaled"))
@pytest.mark.parametrize("dtype", LOW, ids=lambda d: str(d)[6:])
def test_error_bound_against_fp64(dtype, policy):
    bound = REGISTRY["rms_norm"].contract["compute_policy"]["bounds_ulp"][policy]
    bound = bound[str(dtype).removeprefix("torch.")] if isinstance(bound, dict) else bound
    worst = 0.0
    for i, hidden in enumerate(HIDDEN):
        x = _rows(hidden, dtype, seed=i)
        w = (torch.rand(hidden, generator=torch.Generator().manual_seed(i), dtype=torch.float64) + 0.5).to(dtype)
        y = rms_norm(x, w, EPS, policy=policy)
        assert y.dtype == dtype and torch.isfinite(y).all(), f"{policy} {dtype} hidden {hidden}: inf/NaN"
        worst = max(worst, _ulps(y, _oracle(x, w)).max().item())
    assert worst <= bound, f"{policy} in {dtype}: worst error {worst:.2f} ulp > {bound}"


def test_scaled_rescales_eps():
    # At input RMS 1e-3 eps=1e-6 is as large as mean(x²): dropping the eps/m² rescale (or eps
    # itself, as some converters do) is off by far more than the bound.
    x = (torch.randn(4, 512, generator=torch.Generator().manual_seed(0)) * 1e-3).half()
    w = torch.ones(512, dtype=torch.float16)
    exact = _oracle(x, w)
    assert _ulps(rms_norm(x, w, EPS, policy="scaled"), exact).max() <= 3
    without_eps = _oracle(x, w, eps=0.0).half()
    assert _ulps(without_eps, exact).max() > 100


def test_native_fp16_overflow_starts_at_256():
    x = torch.ones(3, 64, dtype=torch.float16)
    x[0, 0] = 255.875  # the largest fp16 below 256: x² = 65472 is finite
    x[1, 0] = 256.0  # x² = 65536 rounds to inf
    x[2, 0] = 60000.0
    w = torch.ones(64, dtype=torch.float16)
    native = rms_norm(x, w, EPS, policy="native")
    assert torch.isinf(x[1:, 0].pow(2)).all() and torch.isfinite(x[0, 0].pow(2))
    assert _ulps(native[0], _oracle(x, w)[0]).max() <= 2, "below 256 native is still accurate"
    assert (native[1:] == 0).all(), "from 256 up, mean(x²) is inf and native returns zeros"
    for policy in ("fp32", "scaled"):
        y = rms_norm(x, w, EPS, policy=policy)
        assert torch.isfinite(y).all() and _ulps(y, _oracle(x, w)).max() <= 3


def test_scaled_is_safe_at_the_fp16_extremes():
    # all-max rows, all-zero rows, a lone subnormal, one huge spike among tiny values
    x = torch.zeros(5, 256, dtype=torch.float16)
    x[0] = 65504.0
    x[2, 3] = 2.0 ** -24
    x[3, 0], x[3, 1:] = 60000.0, 1e-3
    x[4] = -3e-5
    w = torch.ones(256, dtype=torch.float16)
    y = rms_norm(x, w, EPS, policy="scaled")
    assert torch.isfinite(y).all()
    assert _ulps(y, _oracle(x, w)).max() <= 3

"""The importance-weighted Q4_0 quantizer: the same format (gguf's own dequantize reads its
blocks), a lower weighted error than ggml's reference rounding, and the importances it is
given (mean square of each linear's inputs)."""
from __future__ import annotations

import gguf
import numpy as np
import torch

from circleops.quantize import ggml
from circleops.quantize.importance import calibration_ids, input_importance
from circleops.quantize.weights import source_key
from families import BY_NAME

Q4_0 = gguf.GGMLQuantizationType.Q4_0


def _weighted_error(w, deq, imp):
    return float((imp[None, :] * (w - deq) ** 2).sum())


def test_weighted_blocks_decode_with_gguf_and_beat_the_reference():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 256)) * rng.uniform(0.01, 1, (24, 1))).astype(np.float32)
    w[3, 64:96] = 0.0  # an all-zero block: d = 0, every value 0
    imp = (rng.random(256) ** 4).astype(np.float32)
    imp[128:160] = 0.0  # inputs that never fired: quantized by magnitude, not left at 0
    blocks = ggml.quantize(w, "GGML_Q4_0", importance=imp)
    assert blocks.dtype == np.uint8 and blocks.size == 24 * 256 // 32 * 18
    deq = gguf.quants.dequantize(blocks.reshape(24, -1), Q4_0)
    np.testing.assert_array_equal(deq, ggml.dequantize(blocks, "GGML_Q4_0", w.shape).numpy())
    assert not deq[3, 64:96].any()
    ref = gguf.quants.dequantize(gguf.quants.quantize(w, Q4_0), Q4_0)
    assert _weighted_error(w, deq, imp) < 0.8 * _weighted_error(w, ref, imp)
    # unweighted, the zero-importance block is still as close as 4 bits allow
    assert np.abs(deq[:, 128:160] - w[:, 128:160]).max() <= np.abs(w[:, 128:160]).max() / 7
    # a flat importance is a plain least-squares fit: never worse than the reference, block by block
    flat = ggml.quantize(w, "GGML_Q4_0", importance=np.ones(256, np.float32))
    err = ((gguf.quants.dequantize(flat.reshape(24, -1), Q4_0) - w) ** 2).reshape(-1, 32).sum(1)
    assert (err <= ((ref - w) ** 2).reshape(-1, 32).sum(1) * (1 + 1e-3) + 1e-9).all()


def test_without_importance_and_for_q8_0_it_is_ggml_reference():
    w = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_array_equal(ggml.quantize(w, "GGML_Q4_0"), gguf.quants.quantize(w, Q4_0).reshape(-1))
    q8 = gguf.GGMLQuantizationType.Q8_0
    np.testing.assert_array_equal(ggml.quantize(w, "GGML_Q8_0", importance=np.ones(64)),
                                  gguf.quants.quantize(w, q8).reshape(-1))


def test_importance_is_the_mean_square_input_of_each_linear():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(5, 3, 8)
    imp = input_importance(net, (x,))
    assert set(imp) == {source_key(net[0].weight.detach()), source_key(net[2].weight.detach())}
    torch.testing.assert_close(imp[source_key(net[0].weight.detach())], (x * x).reshape(-1, 8).mean(0))
    hidden = torch.relu(net[0](x)).detach()
    torch.testing.assert_close(imp[source_key(net[2].weight.detach())], (hidden * hidden).reshape(-1, 16).mean(0))


def test_llm_importance_runs_the_calibration_text():
    model = BY_NAME["llama"].build()
    ids = calibration_ids(model)
    assert ids.shape == (1, min(128, model.config.max_position_embeddings))
    imp = input_importance(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(imp) == len(linears) and all((v > 0).all() for v in imp.values())


def test_dequantize_into_equals_dequantize():
    w = np.random.default_rng(2).standard_normal((6, 64)).astype(np.float32)
    for dtype in ("GGML_Q4_0", "GGML_Q8_0"):
        blocks = ggml.quantize(w, dtype)
        out = torch.full((6, 64), float("nan"))
        ggml.dequantize_into(blocks, dtype, out)
        assert torch.equal(out, ggml.dequantize(blocks, dtype, (6, 64)))


def test_llm_importance_is_read_back_from_the_cache_until_a_weight_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("CIRCLEOPS_CACHE", str(tmp_path))
    model = BY_NAME["llama"].build().eval()
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    first = input_importance(model)
    assert len(forwards) == 1 and len(list((tmp_path / "importance").glob("*.pt"))) == 1
    again = input_importance(model)
    assert len(forwards) == 1  # no second forward
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    changed = input_importance(model)
    assert len(forwards) == 2
    down = source_key(model.model.layers[0].mlp.down_proj.weight.detach())
    assert not torch.equal(changed[down], first[down])  # the up projection feeds it
    # a damaged cache file is computed again, not trusted
    for f in (tmp_path / "importance").glob("*.pt"):
        f.write_bytes(b"not a torch file")
    assert input_importance(model).keys() == first.keys() and len(forwards) == 3

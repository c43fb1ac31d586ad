"""circleops.quantize.sensitivity.tensor_sqnr rounds an observed tensor by blocks of rows: an
observer the embedding's output shares with its table sees the whole table (128256 x 2048 at
the Llama-3.2-1B shape), whose float64 temporaries made uint8 --int16 auto's 1B peak
(bench/results/72). The scores are those of the whole tensor at once."""
from __future__ import annotations

import math

import torch

from circleops.quantize import sensitivity
from circleops.quantize.pt2e import make_quantizer

VOCAB, WIDTH = 3000, 64


class Embedded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, ids):
        return self.proj(self.embed(ids))


def _prepared():
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    ids = (torch.arange(8) * 37 % VOCAB).reshape(1, 8)
    prepared = prepare_pt2e(torch.export.export(Embedded(), (ids,), strict=False).module(), make_quantizer("uint8"))
    with torch.no_grad():
        prepared(ids)
    return prepared, [(ids,), (ids.flip(-1),)]


def _whole(prepared, samples) -> dict[str, float]:
    """The scores of each observed tensor rounded whole (what tensor_sqnr computed before blocks)."""
    sums = {}
    hooks = []
    for node, obs in sensitivity._observers(prepared):
        scale, zp = (float(t.reshape(-1)[0]) for t in obs.calculate_qparams())

        def hook(module, args, output, key=node.name, obs=obs, scale=scale, zp=int(zp)):
            x = args[0].detach().to(torch.float64)
            q = torch.clamp(torch.round(x / scale) + zp, obs.quant_min, obs.quant_max)
            rows = x.reshape(-1, x.shape[-1])
            errs = ((q - zp) * scale - x).reshape(rows.shape)
            signal = rows.pow(2).sum(-1)
            keep = signal > 0
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += float(keep.sum())
            acc[1] += float((errs.pow(2).sum(-1)[keep] / signal[keep]).sum())
        hooks.append(obs.register_forward_hook(hook))
    with torch.no_grad():
        for args in samples:
            prepared(*args)
    for h in hooks:
        h.remove()
    producers = {node.name: sensitivity._real_node(node).name for node, _ in sensitivity._observers(prepared)}
    whole = {}
    for key, (c, r) in sums.items():  # per producer, its worst observed tensor (as tensor_sqnr reports)
        if c:
            db = math.inf if r == 0 else -10 * math.log10(r / c)
            whole[producers[key]] = min(db, whole.get(producers[key], math.inf))
    return whole


def test_scores_by_blocks_are_the_whole_tensors(monkeypatch):
    """With blocks of 4 rows, every score equals the whole tensor's; no rounding sees more than
    a block (the table's 3000 rows go through in 750 blocks)."""
    prepared, samples = _prepared()
    monkeypatch.setattr(sensitivity, "SQNR_BLOCK", 4 * WIDTH)
    largest, rounding = [0], torch.round

    def spy(x, *a, **k):
        largest[0] = max(largest[0], x.numel())
        return rounding(x, *a, **k)

    monkeypatch.setattr(sensitivity.torch, "round", spy)
    scores = sensitivity.tensor_sqnr(prepared, samples)
    monkeypatch.setattr(sensitivity.torch, "round", rounding)
    assert 0 < largest[0] <= 4 * WIDTH
    whole = _whole(prepared, samples)
    seen_table = False
    for s in scores:
        assert s.sqnr_db == whole[s.producer], (s, whole[s.producer])  # the same float64 ratios, summed as one vector
    assert {s.producer for s in scores} == set(whole)
    # the shared observer does see the table: the case the blocks are for
    for node, obs in sensitivity._observers(prepared):
        sizes = []
        h = obs.register_forward_hook(lambda m, a, o: sizes.append(a[0].numel()))
        with torch.no_grad():
            prepared(*samples[0])
        h.remove()
        seen_table |= VOCAB * WIDTH in sizes
    assert seen_table

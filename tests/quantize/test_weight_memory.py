"""What a quantized conversion keeps resident of a model loaded from safetensors (issue 32:
the Llama-3.2-1B shape's convert peaked at 2-2.6x its fp32 weights).

The weights are a private (copy-on-write) mapping of the file. A pass that changes them in
place (SmoothQuant's fold) keeps no clone while the file holds their values
(circleops.system.snapshot), and a weight read for the last time leaves the resident set
(circleops.system.memory.Pager). Read page by page from /proc/self/pagemap (written or the
file's) and this process's RssFile, not from RssAnon, which the forwards' allocations blur."""
from __future__ import annotations

import copy
import mmap
from pathlib import Path

import pytest
import torch

from circleops.system.memory import Pager, unwritten_file_range
from circleops.system.snapshot import Snapshot

MB = 1 << 20


def _rss(kind: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(kind + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {kind} in /proc/self/status")


def _saved_llama(tmp_path_factory, name: str, **shape) -> Path:
    """A random tied Llama of ``shape`` saved as safetensors (what a mapped load reads)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(tie_word_embeddings=True, **shape)
    path = tmp_path_factory.mktemp("mapped") / name
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _saved_llama(tmp_path_factory, "llama", vocab_size=4096, hidden_size=512, intermediate_size=2048,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)


def _load(path):
    from circleops.sources import models

    return models.load(str(path)).module


def _file_holds(t) -> bool:
    """Whether every whole page inside ``t`` is its file's (none written: no anonymous copy
    resident; the two pages it shares with its neighbours are restored by copying)."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    a, b = start + (-start) % mmap.PAGESIZE, end - end % mmap.PAGESIZE
    return unwritten_file_range(a, b - a)


def test_snapshot_of_a_mapped_weight_is_the_file(model_dir):
    """A mapped weight's snapshot keeps only its edge elements; written and restored, it has
    its values back bit for bit, its neighbours untouched, and its written pages are freed."""
    model = _load(model_dir)
    w = model.model.layers[1].mlp.up_proj.weight
    before = w.detach().clone()
    neighbours = [p.detach().clone() for p in model.parameters()]
    snap = Snapshot(w)
    assert snap.from_file and snap.head.numel() + snap.tail.numel() < 4096
    with torch.no_grad():
        w.mul_(3.0)
    assert not _file_holds(w) and not Snapshot(w).from_file  # written: its file no longer holds its values
    snap.restore(w)
    assert torch.equal(w, before) and _file_holds(w)  # the written copy is gone
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), neighbours))


def test_snapshot_of_a_model_in_memory_is_a_clone():
    w = torch.randn(256, 256)
    snap = Snapshot(w)
    assert not snap.from_file
    w.mul_(2.0)
    snap.restore(w)
    assert torch.equal(w, snap.clone)


def test_pager_gives_back_a_weight_read_for_the_last_time(model_dir):
    model = _load(model_dir)
    params = [p for p in model.parameters() if p.numel() >= 2048 * 512]
    total = sum(p.numel() * 4 for p in params)
    for p in params:
        float(p.sum())  # read: resident
    resident = _rss("RssFile")
    pager = Pager(lambda path: path.endswith(".safetensors"))
    assert pager and sum(pager.release_tensor(p) for p in params) >= total
    assert resident - _rss("RssFile") >= total * 3 // 4


def test_smoothquant_keeps_no_clone_of_mapped_weights(model_dir, monkeypatch):
    """w8's SmoothQuant folds its scales into the mapped weights in place: it keeps no clone
    of them to restore (each snapshot is the file, a few edge elements aside), and on exit
    the weights are the file's again: their written copies are no longer resident."""
    import circleops.quantize.smooth as smooth

    snaps = []

    class Spy(Snapshot):
        def __init__(self, t):
            super().__init__(t)
            snaps.append(self)

    monkeypatch.setattr(smooth, "Snapshot", Spy)
    model = _load(model_dir).eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    linears = [m.weight for n, m in model.named_modules() if n.split(".")[-1] in
               ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")]
    with smooth.smoothed(model, (), None, alpha=0.5) as report:
        assert report.linears == len(linears) == 4 * 6
        assert not any(_file_holds(w) for w in linears)  # folded in place: written
    kept = sum(s.head.numel() + s.tail.numel() if s.from_file else s.clone.numel() for s in snaps)
    assert len(snaps) == len(linears) + 8  # and the 8 norms' gammas (under a page: cloned)
    assert kept * 4 < sum(w.numel() * 4 for w in linears) / 100
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(_file_holds(w) for w in linears)


def test_a_copy_of_the_model_is_restored_from_its_clones(model_dir):
    """A deep copy lives in memory, not in the file: its snapshots are clones, restored alike."""
    from circleops.quantize.smooth import smoothed

    model = copy.deepcopy(_load(model_dir)).eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with smoothed(model, (), None, alpha=0.5) as report:
        assert report.linears == 4 * 6
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return _saved_llama(tmp_path_factory, "small", vocab_size=1024, hidden_size=256, intermediate_size=1024,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_w8_graphs_never_hold_the_folded_weights_beside_the_references(small_dir, tmp_path, monkeypatch):
    """convert --graphs --quantize w8 --verify of a mapped model (issue 32: the 1B shape peaked
    at 1.39x its fp32 weights): the fp32 references run before SmoothQuant folds anything
    (on the file's pages alone), and each folded linear is the file's again once quantized,
    so by the write no folded copy is resident; the written files still pass verify."""
    from circleops.package import step
    from circleops.recipes.llm import LLMRecipe, convert_graphs

    model = _load(small_dir).eval()
    linears = [m.weight for n, m in model.named_modules() if n.split(".")[-1] in
               ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj")]
    seen: dict[str, list[bool]] = {"references": [], "write": []}
    references, write_files = LLMRecipe.references, step.write_files

    def spy_references(self):
        seen["references"].append(all(_file_holds(w) for w in linears))
        return references(self)

    def spy_write(*args, **kwargs):
        seen["write"].append(all(_file_holds(w) for w in linears))
        return write_files(*args, **kwargs)

    monkeypatch.setattr(LLMRecipe, "references", spy_references)
    monkeypatch.setattr(step, "write_files", spy_write)
    report = convert_graphs(model, tmp_path / "g", target="tflite", graphs="decode", prefill_len=8, max_cache_len=16, verify=True,
                            quantize="w8")
    assert report.quantization.smoothing.startswith("SmoothQuant")
    assert seen["references"][0]  # the fp32 references: before the fold
    assert seen["write"] == [True]  # every folded linear restored as it was quantized
    assert all(_file_holds(w) for w in linears)


def test_a_mapped_model_loaded_in_fp16_never_holds_its_fp32_file(model_dir):
    """--dtype fp16 from fp32 safetensors (issue 32: the 1B shape's load peaked at 1.56x its fp32
    weights): converted a module at a time, each mapped weight's pages given back once read,
    so the load's peak is the fp16 copy and one module's fp32 pages, not the whole file
    beside it (the peak resident set, reset before the load: /proc/self/clear_refs)."""
    from circleops.sources import models

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM = VmRSS now
    before = _rss("VmRSS")
    model = models.load(str(model_dir), dtype=torch.float16).module
    grew = _rss("VmHWM") - before
    half = sum(p.numel() * 2 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied: one copy
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert grew < half + half, (grew / MB, half / MB)  # the fp16 copy and under as much again; the file: 2x

"""Tied weights are stored once; writes are atomic; layouts switch at the 2 GiB limit."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from circleops import ir, targets
from circleops.errors import OutputError, TargetError
from circleops.serialize import read_model, write_model
from circleops.serialize import writer as writer_mod
from serialize import tiny_models


def _two_consts(a, b, dtype="FLOAT32") -> ir.Model:
    sg = ir.Subgraph("main")
    sg.add_tensor(ir.Tensor("a", tuple(a.shape), dtype, a))
    sg.add_tensor(ir.Tensor("b", tuple(b.shape), dtype, b))
    return ir.Model([sg])


EMB = torch.randn(64, 16)
SHARED = {
    "same object": (EMB, EMB),
    "same storage view": (EMB[4:8], EMB[4:8]),  # two view objects, same storage + offset
    "byte-identical copies": (EMB.clone(), EMB.clone().numpy()),
    "numpy same object": (np.ones((1000,), np.float32),) * 2,
}
DIFFERENT = {
    "different views of one storage": (EMB[0:4], EMB[4:8]),
    "same head and tail, middle differs": (torch.zeros(100000), torch.zeros(100000).index_fill_(0, torch.tensor([50001]), 1.0)),
    "same bytes, different shape": (EMB.reshape(-1)[:32].reshape(2, 16), EMB.reshape(-1)[:32].reshape(4, 8)),
}


@pytest.mark.parametrize("case", list(SHARED))
def test_shared_constants_stored_once(tmp_path, case):
    a, b = SHARED[case]
    info = write_model(_two_consts(a, b), tmp_path / "m.circle")
    assert (info.buffers, info.shared_buffers) == (2, 1)  # buffer 0 + one shared
    tensors = read_model(tmp_path / "m.circle").subgraphs[0].tensors
    assert tensors[0].data is tensors[1].data  # the reader keeps them shared too


@pytest.mark.parametrize("case", list(DIFFERENT))
def test_different_constants_kept_apart(tmp_path, case):
    a, b = DIFFERENT[case]
    info = write_model(_two_consts(a, b), tmp_path / "m.circle")
    back = read_model(tmp_path / "m.circle").subgraphs[0].tensors
    assert info.shared_buffers == (1 if case == "same bytes, different shape" else 0)
    for t, src in zip(back, (a, b)):
        assert t.data.tobytes() == np.ascontiguousarray(src).tobytes()


def test_tied_embedding_one_buffer_file_size(tmp_path):
    emb = torch.randn(1000, 64)  # 256 KB: the file must hold it once
    info = write_model(_two_consts(emb, emb), tmp_path / "m.circle")
    assert emb.numel() * 4 <= info.file_bytes < emb.numel() * 4 + 4096


def test_inconsistent_data_is_rejected(tmp_path):
    sg = ir.Subgraph("main")
    sg.add_tensor(ir.Tensor("w", (3, 3), "FLOAT32", np.zeros((2, 2), np.float32)))
    with pytest.raises(ValueError, match="'w'.*16 bytes.*needs 36"):
        write_model(ir.Model([sg]), tmp_path / "m.circle")
    assert not (tmp_path / "m.circle").exists()


def test_unwritable_path(tmp_path):
    model, _ = tiny_models.fc_add()
    with pytest.raises(OutputError, match="does not exist"):
        write_model(model, tmp_path / "missing" / "m.circle")
    with pytest.raises(OutputError, match="is a directory"):
        write_model(model, tmp_path)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(OutputError, match="writable"):
            write_model(model, ro / "m.circle")


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    model, _ = tiny_models.fc_add()
    path = tmp_path / "m.circle"
    path.write_bytes(b"old contents")

    def broken(f, plan, placed, table):
        f.write(plan.head)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_mod, "_stream", broken)
    with pytest.raises(OutputError, match="No space left"):
        write_model(model, path)
    assert path.read_bytes() == b"old contents"  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.circle"]  # no temp file left


def test_switches_to_offset_layout_past_the_limit(tmp_path, monkeypatch):
    model, reference = tiny_models.fc_add()
    inline = write_model(model, tmp_path / "m.tflite", "tflite")
    assert inline.layout == "inline"
    # a limit just below this file's size stands for 2 GiB
    monkeypatch.setattr(targets, "FLATBUFFER_LIMIT", inline.file_bytes - 1)
    info = write_model(model, tmp_path / "m.tflite", "tflite")
    assert info.layout == "offset" and info.flatbuffer_bytes < inline.file_bytes
    from circleops.runtime import litert

    x = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(litert.run(tmp_path / "m.tflite", [x])[0], reference(x)[0], rtol=1e-6)
    with pytest.raises(TargetError, match="2 GiB.*weights_after=False"):
        write_model(model, tmp_path / "n.tflite", "tflite", weights_after=False)
    assert not (tmp_path / "n.tflite").exists()


def test_enum_option_names_and_errors(tmp_path):
    from circleops.errors import UnsupportedOpError

    model, _ = tiny_models.fc_add()
    model.subgraphs[0].operators[1].options = {"fusedActivationFunction": "relu"}
    write_model(model, tmp_path / "m.circle")
    assert read_model(tmp_path / "m.circle").subgraphs[0].operators[1].options["fusedActivationFunction"] == 1
    model.subgraphs[0].operators[1].options = {"fusedActivationFunction": "SWISH"}
    with pytest.raises(ValueError, match="SWISH.*ActivationFunctionType"):
        write_model(model, tmp_path / "m.circle")
    model.subgraphs[0].operators[1].options = {"nope": 1}
    with pytest.raises(ValueError, match="AddOptions has no field 'nope'"):
        write_model(model, tmp_path / "m.circle")
    rms, _ = tiny_models.rms_norm_circle()
    with pytest.raises(UnsupportedOpError, match="RMS_NORM.*tflite"):
        write_model(rms, tmp_path / "m.tflite", "tflite")
    with pytest.raises(TargetError, match="unknown file format 'onnx'"):
        write_model(rms, tmp_path / "m.onnx", "onnx")


def test_weights_alone_past_the_limit(tmp_path, monkeypatch):
    """Weights past 4 GiB: inline offsets would overflow 32 bits, so they are never packed."""
    from circleops.runtime import litert

    model, reference = tiny_models.fc_add(torch.randn(3, 8192))
    real_layout = writer_mod._layout_inline

    def huge_tail(placed):  # pretend the tail is 5 GiB (its offsets overflow uint32)
        real_layout(placed)
        for p in placed:
            p.tail_pos += 5 * 2**30
        return 5 * 2**30

    monkeypatch.setattr(writer_mod, "_layout_inline", huge_tail)
    info = write_model(model, tmp_path / "m.tflite", "tflite")
    assert info.layout == "offset"
    x = np.random.default_rng(2).standard_normal((1, 8192)).astype(np.float32)
    np.testing.assert_allclose(litert.run(tmp_path / "m.tflite", [x])[0], reference(x)[0], rtol=1e-4, atol=1e-4)


def test_constant_bytes_bounds_the_weights_without_reading_them(tmp_path):
    """The IR-only size estimate a size rule uses before packing: tied weights once, each
    constant aligned; an upper bound of what the writer stores, short of the graph tables."""
    emb = torch.randn(1000, 64)
    model = _two_consts(emb, emb.clone())  # byte-identical copies in different memory
    info = write_model(model, tmp_path / "m.circle")
    estimate = writer_mod.constant_bytes(model)
    assert 2 * emb.numel() * 4 <= estimate < 2 * emb.numel() * 4 + 64  # the copy counts: an upper bound
    assert info.weight_bytes == emb.numel() * 4  # the writer stores it once
    tied = _two_consts(emb, emb)
    assert emb.numel() * 4 <= writer_mod.constant_bytes(tied) < emb.numel() * 4 + 32
    assert writer_mod.constant_bytes(tied) <= write_model(tied, tmp_path / "t.circle").file_bytes
    # a linear's weight and its 1x1 CONV_2D filter view [N, 1, 1, K] in the graphs of one
    # file (onert signatures): the same memory, counted once (the writer stores it once)
    conv = _two_consts(emb, emb.view(1000, 1, 1, 64))
    assert writer_mod.constant_bytes(conv) == writer_mod.constant_bytes(tied)
    assert write_model(conv, tmp_path / "c.circle").weight_bytes == emb.numel() * 4


def test_inline_only_past_the_limit_uses_the_callers_message(tmp_path, monkeypatch):
    """weights_after=False with a too_large message: a caller (target onert) says why the
    offset layout is not allowed; nothing is written."""
    model, _ = tiny_models.fc_add()
    fits = write_model(model, tmp_path / "m.circle", weights_after=False)
    assert fits.layout == "inline"
    monkeypatch.setattr(targets, "FLATBUFFER_LIMIT", fits.file_bytes - 1)
    with pytest.raises(TargetError, match=rf"^onert cannot: {fits.file_bytes}$"):
        write_model(model, tmp_path / "n.circle", weights_after=False, too_large=lambda n: f"onert cannot: {n}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.circle"]  # no file, no temp file


def _mappings(path) -> int:
    """How many regions of this process map ``path``."""
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip("\n").endswith(" " + target))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_a_file_read_twice_is_mapped_once(tmp_path):
    """The reference interpreter reads a signature file once per graph's Session (verify,
    generate): each read of a live file shares the first's mapping, so its weights are
    resident once in the process's RSS (the 1B shape's fp16 file: 7.02 GB of RSS for 5.43 GB
    of Pss when each Session mapped it, bench/results/37)."""
    from circleops.runtime import reference

    emb = torch.randn(1000, 64)
    path = tmp_path / "m.circle"
    write_model(_two_consts(emb, emb), path)
    first = reference.Session(path)
    second = reference.Session(path)
    one, two = (s.interpreter.model.subgraphs[0].tensors[0].data for s in (first, second))
    assert _mappings(path) == 1 and np.shares_memory(one, two)
    del first, second, one, two
    import gc

    gc.collect()
    assert _mappings(path) == 0  # the mapping goes with its last reader
    write_model(_two_consts(emb * 2, emb), path)  # a new file at the path: its own mapping
    assert np.array_equal(read_model(path).subgraphs[0].tensors[0].data, (emb * 2).numpy())

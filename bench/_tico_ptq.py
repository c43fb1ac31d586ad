"""tico 0.3.0's post-training quantization (``tico.quantization``, default ``PTQConfig()``)
of SmolLM2-135M, as its docs and examples do it; run by bench/pt2e.py with the tico venv's
python (circleops on PYTHONPATH only to load the same model and the same calibration
windows). Not importable from circleops.

    python bench/_tico_ptq.py SEQ.pt OUT.circle CALIBRATE RESULT.json

The flow (tico/quantization/wrapq/examples/quantize_full_qmodel_with_gptq.py, without GPTQ /
SpinQuant, with the default config): ``prepare(model, PTQConfig())`` wraps the HF modules,
the prepared model runs the calibration windows, ``convert(model)`` freezes the observers,
``tico.convert(q.as_export_module("prefill", return_kv=False), (ids,))`` writes Circle.
RESULT.json gets the stage timings, the fake-quantized torch logits' path, and, if a stage
fails, the stage, the exception type and message.
"""
import json
import sys
import time
import traceback

t0 = time.perf_counter()
import torch  # noqa: E402

seq_path, out, calibrate, result_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
result: dict = {"timings": {}}
stage = "import"


def mark(name: str, t: float) -> float:
    now = time.perf_counter()
    result["timings"][name] = now - t
    return now


try:
    import tico
    from tico.quantization import convert, prepare
    from tico.quantization.config.ptq import PTQConfig

    from circleops.sources.models import load_smollm2
    from circleops.quantize.pt2e import calibration_samples

    t = mark("import", t0)
    stage = "load"
    seq = torch.load(seq_path)
    model, tok = load_smollm2()
    model.eval()
    model.config.use_cache = False
    model.config._attn_implementation = "eager"
    # tico's Llama wrappers precompute the causal mask and RoPE tables for
    # max_position_embeddings (8192 here: a 256 MB mask); its examples set it to the
    # sequence length they export
    model.config.max_position_embeddings = seq.shape[1]
    samples = calibration_samples((seq,), calibrate, tokenizer=tok)
    t = mark("load", t)

    stage = "prepare"
    q = prepare(model, PTQConfig())
    t = mark("prepare", t)
    stage = "calibrate"
    with torch.no_grad():
        for (ids,) in samples:
            q(input_ids=ids, use_cache=False)
    t = mark("calibrate", t)
    stage = "convert"
    q = convert(q)
    t = mark("convert", t)
    stage = "fake-quantized logits"
    with torch.no_grad():
        logits = q(input_ids=seq, use_cache=False).logits
    torch.save(logits, out + ".torch_logits.pt")
    result["torch_logits"] = out + ".torch_logits.pt"
    t = mark("torch logits", t)
    stage = "tico.convert"
    module = q.wrapped.as_export_module("prefill", return_kv=False).eval() \
        if hasattr(q, "wrapped") and hasattr(q.wrapped, "as_export_module") else q.eval()
    with torch.no_grad():
        circle = tico.convert(module, (seq,), strict=False)
    t = mark("tico.convert", t)
    stage = "save"
    circle.save(out)
    mark("save", t)
    result["file"] = out
except BaseException as err:  # noqa: BLE001 - recorded: a failure is a measurement too
    tb = traceback.extract_tb(err.__traceback__)
    where = next((f for f in reversed(tb) if "/tico/" in f.filename), tb[-1] if tb else None)
    result["error"] = {"stage": stage, "type": type(err).__name__, "message": str(err).strip().splitlines()[0][:400]
                       if str(err).strip() else "", "where": f"{where.filename}:{where.lineno} ({where.name})"
                       if where else ""}
    traceback.print_exc()
result["total"] = time.perf_counter() - t0
with open(result_path, "w") as f:
    json.dump(result, f, indent=2)

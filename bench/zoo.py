"""The Hugging Face causal-LM zoo: every architecture of the installed transformers that
builds from a tiny config, converted for target onert and compared with torch.

    python bench/zoo.py                          # all architectures -> docs/zoo.md
    python bench/zoo.py --only llama,mixtral     # a few, table on stdout
    python bench/zoo.py --tree /path/to/old/checkout --out /tmp/zoo_before.md   # another circleops

Architectures come from transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES (no remote code).
Each config is shrunk (hidden 64, 2 layers, 4 heads, vocab 256, 4 experts, ...: every such
field the config has) and the model built with random weights; one that cannot be built
or run in torch at that size is listed as "no tiny build" and left out of the pass count.
Constant-initialized weights (zero-initialized routers, unit norm weights) get noise, so
router scores do not tie (torch.topk and TOPK_V2 may break a tie differently).
The rest go through ``circleops.convert(model, (ids,), target="onert", verify=True)``:
"pass" when onert's logits match torch within 1e-4 x max(1, max|logits|).

Workers run the architectures in subprocesses (onert can crash the process); one that
dies or exceeds --timeout is recorded as such and the next worker carries on.
Not a test: the whole zoo takes 10-30 minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4

# Every field a config may have, shrunk; only those the config defines are set.
SMALL = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, n_positions=128, n_ctx=128,
    n_embd=64, n_layer=2, n_head=4, n_inner=128, d_model=64, d_ff=128, ffn_dim=128, num_layers=2, n_layers=2,
    num_heads=4, d_kv=16, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128,
    num_local_experts=4, num_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=64, moe_topk=2, n_group=1, topk_group=1,
    kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    rotary_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, attention_window=8, sliding_window=4, local_window_size=4,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
SEQ = 8


# --------------------------------------------------------------------------- one architecture

def tiny_config(model_type: str, mha: bool = False):
    """The architecture's default config with every SMALL field it has shrunk (``mha``: as
    many key/value heads as heads, for architectures that require it, e.g. MLA)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    kwargs = _small_kwargs(cls())
    if mha and "num_key_value_heads" in kwargs:
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    cfg = cls(**kwargs)
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    return cfg


def _small_kwargs(default) -> dict:
    """Constructor arguments shrinking ``default`` (sub-configs of a composite model too)."""
    from transformers import PretrainedConfig

    keys = set(default.to_dict()) | set(vars(default))
    settable = {k for k in keys if not isinstance(getattr(type(default), k, None), property)}
    kwargs = {k: v for k, v in SMALL.items() if k in settable}
    if {"expand", "num_heads", "head_dim"} <= keys and "hidden_size" in kwargs:
        # SSM heads (Mamba2) tile the expanded inner width: num_heads * head_dim == hidden * expand
        kwargs["num_heads"] = kwargs["hidden_size"] * int(getattr(default, "expand")) // kwargs["head_dim"]
    layers = kwargs.get("num_hidden_layers", kwargs.get("n_layer", 2))
    for name in ("layer_types", "mlp_layer_types", "layers_block_type"):
        value = getattr(default, name, None)
        if name in settable and isinstance(value, (list, tuple)) and value:
            kwargs[name] = list(value)[:layers] if len(value) >= layers else None
    for name, value in vars(default).items():
        if isinstance(value, PretrainedConfig) and name in settable:
            kwargs[name] = {**value.to_dict(), **_small_kwargs(value)}
    return kwargs


def run_one(model_type: str, class_name: str) -> dict:
    """Build, run in torch, convert for onert with verify; a result row."""
    import torch
    import transformers

    import circleops
    from circleops.errors import CircleOpsError

    row = {"arch": model_type, "class": class_name, "status": "", "error": None, "fused": {}, "reason": ""}
    for mha in (False, True):
        try:
            cfg = tiny_config(model_type, mha)
            torch.manual_seed(0)
            model = getattr(transformers, class_name)(cfg).eval()
            with torch.no_grad():
                # constant-initialized weights (zero routers, unit norms) make every score tie:
                # which expert wins a tie is each topk's own choice, so break them
                for p in model.parameters():
                    if p.is_floating_point() and p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
            vocab = min(getattr(cfg, "vocab_size", None) or SMALL["vocab_size"], SMALL["vocab_size"])
            ids = torch.randint(3, vocab, (1, SEQ), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                out = model(input_ids=ids)
            if getattr(out, "logits", None) is None:
                raise RuntimeError("no logits")
            break
        except Exception as err:  # noqa: BLE001 - any failure to build is "no tiny build"
            row.update(status="no tiny build", reason=_first_line(err))
    else:
        return row
    row.update(status="", reason="")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            report = circleops.convert(model, (ids,), Path(tmp) / "m.circle", target="onert", verify=True,
                                       tolerance=TOLERANCE)
            row.update(status="pass", error=report.verify.max_abs_error, fused=report.fused)
        except CircleOpsError as err:
            verify = type(err).__name__ == "VerifyError"
            row.update(status="mismatch" if verify else "refused", reason=f"{type(err).__name__}: {_first_line(err)}")
        except Exception as err:  # noqa: BLE001 - what the zoo is for: crashes are findings
            row.update(status="crash", reason=f"{type(err).__name__}: {_first_line(err)}")
    return row


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return (text[:237] + "...") if len(text) > 240 else text


def worker(archs: list[tuple[str, str]]) -> None:
    """Run ``archs`` one by one, one JSON line per result on stdout."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter off the result channel
    for model_type, class_name in archs:
        out.write(json.dumps({"start": model_type}) + "\n")
        out.flush()
        row = run_one(model_type, class_name)
        out.write(json.dumps(row, default=str) + "\n")
        out.flush()


# --------------------------------------------------------------------------- the zoo

def architectures(only: list[str] | None) -> list[tuple[str, str]]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())
    return [a for a in archs if only is None or a[0] in only]


def run_zoo(archs: list[tuple[str, str]], tree: Path, timeout: float, log=print,
            progress: Path | None = None) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]), OMP_NUM_THREADS="1")
    rows: dict[str, dict] = {}
    pending = list(archs)
    while pending:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(pending)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0, env=env, cwd=str(tree))
        current, started = None, time.monotonic()
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 5.0)
            if current is not None and time.monotonic() - started > timeout:
                proc.kill()
                proc.wait()
                rows[current] = {"arch": current, "class": dict(archs)[current], "status": "timeout",
                                 "reason": f"over {timeout:.0f} s", "fused": {}}
                break
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            # unbuffered: a line left in a read buffer would hide the next "start" from select,
            # and a hung architecture (onert deadlocks) would never time out
            line = proc.stdout.readline().decode()
            if not line:
                proc.wait()
                if current is not None:
                    rows[current] = {"arch": current, "class": dict(archs)[current], "status": "crash",
                                     "reason": f"the process died (exit code {proc.returncode})", "fused": {}}
                break
            msg = json.loads(line)
            if "start" in msg:
                current, started = msg["start"], time.monotonic()
                continue
            rows[msg["arch"]] = msg
            current = None
            if progress is not None:  # rows so far: --from-json renders a partial run
                progress.write_text(json.dumps(list(rows.values()), indent=1, default=str))
            log(f"{msg['arch']:28s} {msg['status']:14s} {msg.get('reason', '')[:100]}")
        pending = [a for a in pending if a[0] not in rows]
        if proc.poll() is None:
            proc.kill()
    return [rows[a] for a, _ in archs]


def table(rows: list[dict], elapsed: float, tree: Path) -> str:
    measured = [r for r in rows if r["status"] != "not measured"]
    built = [r for r in measured if r["status"] != "no tiny build"]
    passed = [r for r in built if r["status"] == "pass"]
    lines = [
        "# The Hugging Face causal-LM zoo on target onert",
        "",
        "Generated by `python bench/zoo.py` (not a test; CI runs a representative dozen in "
        "tests/onert/test_onert_zoo.py). Every architecture in transformers' "
        "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built from its default config shrunk to hidden 64, "
        "2 layers, 4 heads, vocab 256 (4 experts for MoE), with random weights, and converted with "
        "`circleops.convert(model, (input_ids [1, 8],), target=\"onert\", verify=True)`; *pass* means "
        f"onert's logits match torch within {TOLERANCE:g} x max(1, max|logits|).",
        "",
        f"**{len(passed)} of {len(built)}** architectures that build tiny pass "
        f"({len(measured) - len(built)} more do not build or run in torch at that size"
        + (f"; {len(rows) - len(measured)} not measured: a partial run" if len(measured) < len(rows) else "")
        + "). "
        f"transformers {_version('transformers')}, torch {_version('torch')}, onert {_version('onert')}"
        + (f"; {elapsed / 60:.0f} min." if elapsed else "."),
        "",
        "| arch | class | converts | max abs error | fused ops | failure |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        fused = ", ".join(f"{k} {v}" for k, v in sorted((r.get("fused") or {}).items())) or "-"
        err = f"{r['error']:.1e}" if isinstance(r.get("error"), (int, float)) else "-"
        reason = (r.get("reason") or "").replace("|", "\\|")
        lines.append(f"| {r['arch']} | {r.get('class', '')} | {r['status']} | {err} | {fused} | {reason} |")
    return "\n".join(lines) + "\n"


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated model types (default: all)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "zoo.md"), help="markdown table to write ('-': stdout)")
    ap.add_argument("--json", help="also write the rows as JSON here")
    ap.add_argument("--tree", default=str(ROOT), help="the circleops checkout to measure (default: this one)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture")
    ap.add_argument("--shard", help="i/n: run every n-th architecture from the i-th (several processes, one table "
                                    "with --from-json a.json,b.json,...)")
    ap.add_argument("--from-json", help="render the table from --json files (comma-separated) of earlier or partial runs")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker([tuple(a) for a in json.loads(args.worker)])
        return 0
    only = args.only.split(",") if args.only else None
    t = time.perf_counter()
    if args.from_json:
        got = {r["arch"]: r for p in args.from_json.split(",") for r in json.loads(Path(p).read_text())}
        archs = architectures(only)
        rows = [got[a] for a, _ in archs if a in got]
        if len(rows) < len(archs):  # a partial run: say which were not measured
            rows += [{"arch": a, "class": c, "status": "not measured", "reason": "the run was stopped before it",
                      "fused": {}} for a, c in archs if a not in got]
    else:
        archs = architectures(only)
        if args.shard:
            i, n = (int(v) for v in args.shard.split("/"))
            archs = archs[i::n]
        rows = run_zoo(archs, Path(args.tree).resolve(), args.timeout,
                       progress=Path(args.json) if args.json else None)
    text = table(rows, None if args.from_json else time.perf_counter() - t, Path(args.tree))
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        print(text.splitlines()[6])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``circleops check MODEL --dtype fp16``: how an fp16/bf16 Circle file computes, per norm policy.

For each RMSNorm policy (fused RMS_NORM builtin, fp32 island, scaled, native; see
circleops.numerics.policy) the model is converted to an fp16 (or bf16) Circle file for
target circle and run by the reference interpreter; the report gives the max error of
every decoder layer's output against the fp32 model, and how many greedy tokens agree
with fp32's before the first divergence.

    from circleops.tools.precision import check
    report = check(model, tokenizer, dtype="fp16", new_tokens=32)
    print(report.table())

How agreement is measured: fp32 generates N tokens greedily (torch, end-of-text not
special). Each file takes the prompt plus fp32's first N-1 tokens in one run; its greedy
choice at position P+k-1 is the token it would generate at step k, because a causal
graph's output at a position depends only on the tokens up to it. So the leading
positions where its choice equals fp32's token are exactly the tokens free-running
greedy generation with the file shares with fp32, and the first choice that differs is
the token it generates there. One run per policy instead of N. (Exact as long as the
file computes no inf/NaN: such a value at a later position reaches earlier rows
through the additive attention mask; the report counts them.)
"""
from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from circleops.dtypes import float_dtype, short_name

DEFAULT_PROMPT = "Once upon a time,"
DEFAULT_NEW_TOKENS = 32
DTYPE_CHOICES = ("fp16", "bf16")
POLICY_NAMES = ("fused", "fp32-island", "scaled", "native")  # circleops.numerics.NORM_POLICIES
_DEFAULT_PROMPT_LEN = 5  # prompt ids made up for a model without a tokenizer

Progress = Callable[[str], None]


# --------------------------------------------------------------------------- API

@dataclass
class ReportOptions:
    """What the numerics report (``check``) and the quantization report
    (circleops.tools.quant_report) take besides the model: the prompt and how many greedy
    tokens fp32 generates over it, where the files go, the model's name in the report."""

    prompt: str | None = DEFAULT_PROMPT  # encoded by the tokenizer; None: made-up ids without prompt_ids
    prompt_ids: Sequence[int] | None = None  # the prompt as token ids (a model without a tokenizer)
    new_tokens: int = DEFAULT_NEW_TOKENS
    work_dir: str | os.PathLike | None = None  # where the files are written (kept); None: a removed temp dir
    source: str | None = None  # the model's name in the report (default: its class name)


@dataclass
class CheckOptions(ReportOptions):
    """``check``'s options: the low precision checked and the norm policies compared."""

    dtype: Any = "fp16"  # "fp16" or "bf16" (or the torch dtype)
    policies: Sequence[str] = POLICY_NAMES  # names from circleops.numerics.NORM_POLICIES


def options_with(options: Any, fields: dict[str, Any]) -> Any:
    """``options`` with ``fields`` (keyword shorthands for its fields) replaced; a keyword
    that is no field is a TypeError, as for any call."""
    return dataclasses.replace(options, **fields) if fields else options


def check(model: Any, tokenizer: Any = None, options: CheckOptions | None = None, *,
          progress: Progress | None = None, **fields: Any) -> Any:
    """The numerics report (a :class:`circleops.numerics.CheckReport`) of ``model``.

    model: a Hugging Face *ForCausalLM (left unchanged; copies are cast). tokenizer: encodes
        ``prompt`` and decodes the tokens; without one, pass ``prompt_ids`` (else a fixed
        made-up prompt of 5 ids is used). options: a :class:`CheckOptions` (dtype "fp16" or
        "bf16", policies from circleops.numerics.NORM_POLICIES, work_dir for the .circle files,
        kept; None writes them to a temporary directory removed afterwards); its fields may
        also be given as keywords (``check(model, tok, dtype="bf16", new_tokens=8)``).
    """
    import torch

    from circleops.numerics import CheckReport, norm_policy

    o = options_with(options or CheckOptions(), fields)
    torch_dtype = low_precision_dtype(o.dtype)
    chosen = [norm_policy(p) for p in o.policies]
    if not chosen:
        raise _error("no norm policy chosen: pass at least one of " + ", ".join(POLICY_NAMES) + ".")
    say = progress or (lambda _msg: None)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    ref = fp32_reference(model, tokenizer, o, say)
    ref.model = None  # the fp32 copy is not needed past here
    timings["reference"] = time.perf_counter() - t

    t = time.perf_counter()
    say(f"export ({short_name(torch_dtype)}, {ref.seq.shape[1]} positions)")
    ep = _exportlow_precision_dtype(model, ref.seq, torch_dtype)
    timings["export"] = time.perf_counter() - t

    eos = eos_ids(model, tokenizer)
    hidden_ref = ref.want[1:]
    report = CheckReport(
        source=o.source or type(model).__name__, dtype=short_name(torch_dtype), prompt=ref.prompt,
        prompt_ids=list(ref.ids), new_tokens=o.new_tokens, reference_tokens=ref.tokens,
        reference_text=decode_text(tokenizer, ref.tokens),
        layer_rms=[float(h.double().pow(2).mean(-1).sqrt().max()) for h in hidden_ref],
        layer_max=[float(h.abs().max()) for h in hidden_ref], eos_ids=eos, timings=timings)
    with WorkDirectory(o.work_dir) as directory:
        for policy in chosen:
            say(f"{policy.name}: convert, run")
            result = _run_policy(ep, policy, torch_dtype, Path(directory), ref, _Decoded(eos, tokenizer))
            report.policies.append(result)
            timings[policy.name] = sum(result.seconds.values())
    return report


@dataclass
class Reference:
    """fp32's side of a report: the prompt, fp32's greedy tokens over it, and its logits and
    decoder layer outputs on prompt + tokens[:-1] (one run of a file gives the same rows)."""

    ids: list[int]  # the prompt's token ids
    prompt: str | None
    model: Any  # the fp32 model (the model itself when it is fp32 already)
    tokens: list[int]  # fp32's greedy tokens
    seq: Any  # [1, len(ids) + len(tokens) - 1] int64: the prompt and every token but the last
    want: list[Any]  # [logits, each decoder layer's output] of the fp32 model on seq

    def agreement(self, logits: Any) -> tuple[list[int], int]:
        """(the file's greedy choices at the positions predicting fp32's tokens, how many
        leading ones equal fp32's) from its logits [positions, vocab]."""
        n, start = len(self.tokens), len(self.ids) - 1
        predicted = logits[start: start + n].argmax(-1).tolist()
        return predicted, next((k for k in range(n) if predicted[k] != self.tokens[k]), n)


def fp32_reference(model: Any, tokenizer: Any, options: ReportOptions, say: Progress) -> Reference:
    """The prompt's ids (checked against the vocabulary and the model's positions), fp32's
    ``options.new_tokens`` greedy tokens, and fp32's logits and layer outputs over them."""
    import torch

    if options.new_tokens < 1:
        raise _error(f"--new-tokens must be at least 1, got {options.new_tokens}.")
    ids, prompt = prompt_token_ids(model, tokenizer, options.prompt, options.prompt_ids)
    check_length(model, len(ids) + options.new_tokens - 1)
    say(f"fp32 reference: {options.new_tokens} greedy tokens")
    reference = fp32_model(model)
    tokens = greedy(reference, ids, options.new_tokens)
    seq = torch.tensor([ids + tokens[:-1]])
    return Reference(ids, prompt, reference, tokens, seq, layer_outputs(reference, seq))


def greedy(model: Any, prompt_ids: Sequence[int], new_tokens: int) -> list[int]:
    """``new_tokens`` greedy tokens of ``model`` in torch, with its KV cache when its
    forward takes one; end-of-text is not special, so every policy is compared over the
    same N positions."""
    import inspect

    import torch

    from circleops.pipeline.stages import hf_export_settings

    params = inspect.signature(model.forward).parameters
    cache_arg = next((name for name in ("cache", "past_key_values") if name in params), None)
    ids = list(prompt_ids)
    step, cache = ids, None
    with hf_export_settings(model), torch.no_grad():
        for _ in range(new_tokens):
            kwargs = {cache_arg: cache, "use_cache": True} if cache_arg else {"use_cache": False}
            out = model(input_ids=torch.tensor([step]), return_dict=True, **kwargs)
            ids.append(int(out.logits[0, -1].argmax()))
            cache = getattr(out, cache_arg, None) if cache_arg else None
            step = ids[-1:] if cache is not None else ids  # no cache: the whole sequence again
    return ids[len(prompt_ids):]


# Special tokens that end a text whatever the model's configured eos is (SmolLM2-Instruct's
# eos is <|im_end|>, but its <|endoftext|> is what it emits once its norms overflow).
END_OF_TEXT_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>")


def eos_ids(model: Any, tokenizer: Any = None) -> list[int]:
    """End-of-text token ids: the model's eos (config, generation config, tokenizer) and
    the tokenizer's special tokens in :data:`END_OF_TEXT_TOKENS`."""
    found: list[int] = []
    values: list[Any] = []
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(cfg, "eos_token_id", None)
        values += value if isinstance(value, (list, tuple)) else [value]
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_tokens", []) or [])
        values += [tokenizer.convert_tokens_to_ids(t) for t in END_OF_TEXT_TOKENS if t in special]
    for v in values:
        if isinstance(v, int) and v >= 0 and v not in found:
            found.append(v)
    return found


def directory_tokenizer(model: str | None) -> Any:
    """The tokenizer saved with an HF model directory, if there is one (else None):
    circleops.sources.models.directory_tokenizer."""
    from circleops.sources.models import directory_tokenizer as load

    return load(model)


# --------------------------------------------------------------------------- steps

def _error(msg: str) -> Exception:
    from circleops.errors import CircleOpsError

    return CircleOpsError(msg)


def low_precision_dtype(dtype: Any) -> Any:
    """torch.float16 or torch.bfloat16 for a name or dtype; CircleOpsError for anything else."""
    resolved = float_dtype(dtype)
    if resolved is not None and short_name(resolved) in DTYPE_CHOICES:
        return resolved
    raise _error(f"dtype {dtype!r} cannot be checked: the report compares an fp16 or bf16 file with fp32; "
                 "use --dtype fp16 or --dtype bf16.")


def prompt_token_ids(model: Any, tokenizer: Any, prompt: str | None, prompt_ids: Sequence[int] | None
                     ) -> tuple[list[int], str | None]:
    """(token ids, prompt text) of the prompt: ``prompt_ids`` as given, else ``prompt`` encoded, else
    made-up ids; CircleOpsError for an empty or out-of-vocabulary prompt."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if prompt_ids is not None:
        ids = [int(i) for i in prompt_ids]
        prompt = decode_text(tokenizer, ids)
    elif tokenizer is not None and prompt is not None:
        ids = list(tokenizer(prompt).input_ids)
    else:
        from circleops.sources.models import example_token_ids

        if vocab is None:
            raise _error("the model's config has no vocab_size: pass --prompt-ids.")
        ids, prompt = example_token_ids(_DEFAULT_PROMPT_LEN, vocab).tolist()[0], None
    if not ids:
        raise _error("the prompt is empty: give a --prompt with text or --prompt-ids.")
    if vocab is not None and any(not 0 <= i < vocab for i in ids):
        raise _error(f"prompt ids {ids} are out of range for the model's vocabulary of {vocab}.")
    return ids, prompt


def check_length(model: Any, positions: int) -> None:
    """CircleOpsError when ``positions`` exceed the model's max_position_embeddings."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit is not None and positions > limit:
        raise _error(f"prompt + --new-tokens - 1 = {positions} positions, but the model takes at most {limit}; "
                     "use a shorter prompt or fewer --new-tokens.")


def fp32_model(model: Any) -> Any:
    """The model in fp32 and eval mode (itself when it already is, else a copy)."""
    import torch

    from circleops.numerics import decoder_layers

    decoder_layers(model)  # the error names the model class before any work
    params = [p for p in model.parameters() if p.is_floating_point()]
    if params and all(p.dtype == torch.float32 for p in params):
        return model.eval()
    return copy.deepcopy(model).float().eval()


def layer_outputs(model: Any, seq: Any) -> list[Any]:
    """[logits, each decoder layer's output] of ``model`` on ``seq``, in fp32."""
    import torch

    from circleops.pipeline.stages import hf_export_settings
    from circleops.numerics import LayerOutputs

    with hf_export_settings(model), torch.no_grad():
        return [t.float() for t in LayerOutputs(model).eval()(seq)]


def _exportlow_precision_dtype(model: Any, seq: Any, dtype: Any) -> Any:
    """One export in ``dtype`` with the layers' outputs as extra outputs, adapters on."""
    import torch

    from circleops.pipeline.stages import hf_export_settings, export
    from circleops.numerics import LayerOutputs, rms_norm_nodes

    low = copy.deepcopy(model).to(dtype).eval()
    with hf_export_settings(low), torch.no_grad():
        ep = export(LayerOutputs(low).eval(), (seq,), adapters=True, warn_list=[])
    if not rms_norm_nodes(ep):
        raise _error(f"{type(model).__name__} exported without any circle.rms_norm: its RMSNorms are not "
                     "routed to the fused op (no adapter for this family?), so there is no norm policy to compare.")
    return ep


@dataclass
class _Decoded:
    """What a policy's greedy choices are read against: the end-of-text ids, the tokenizer."""

    eos: list[int]
    tokenizer: Any


def _run_policy(ep: Any, policy: Any, dtype: Any, directory: Path, ref: Reference, decoded: _Decoded) -> Any:
    import torch

    from circleops.pipeline.stages import op_histogram
    from circleops.lowering import lower_program
    from circleops.numerics import PolicyResult, set_norm_policy
    from circleops.runtime import reference
    from circleops.serialize import write_model

    seconds: dict[str, float] = {}
    t = time.perf_counter()
    set_norm_policy(ep, policy)
    model = lower_program(ep, "circle", dtype=dtype)
    ops = op_histogram(model)
    seconds["lower"] = time.perf_counter() - t
    t = time.perf_counter()
    path = directory / f"{policy.name}.circle"
    write_model(model, path, "circle")
    del model
    seconds["write"] = time.perf_counter() - t
    t = time.perf_counter()
    got = reference.Session(path).run_torch([ref.seq])
    seconds["run"] = time.perf_counter() - t

    errors, rel, bad = [], [], []
    for g, w in zip(got[1:], ref.want[1:]):
        e, n = _max_error(g, w)
        errors.append(e)
        bad.append(n)
        scale = float(w.abs().max())
        rel.append(e / scale if scale > 0 else e)
    logits_error, logits_bad = _max_error(got[0], ref.want[0])
    n = len(ref.tokens)
    predicted, agreement = ref.agreement(got[0][0].float())
    generated = predicted[:agreement + 1]
    tokenizer = decoded.tokenizer
    return PolicyResult(
        name=policy.name, description=policy.description, path=str(path), ops=ops, layer_max_abs=errors,
        layer_rel=rel, layer_nonfinite=bad, logits_max_abs=logits_error, logits_nonfinite=logits_bad,
        agreement=agreement, first_divergence=None if agreement == n else agreement, generated=generated,
        predicted=predicted, eos_predicted=sum(p in decoded.eos for p in predicted),
        generated_text=decode_text(tokenizer, generated), predicted_text=decode_text(tokenizer, predicted), seconds=seconds)


def _max_error(got: Any, want: Any) -> tuple[float, int]:
    """(max |got - want|, how many of got are inf/NaN); inf when any is."""
    import torch

    g = got.double()
    finite = torch.isfinite(g)
    nonfinite = int((~finite).sum())
    if nonfinite:
        return float("inf"), nonfinite
    return float((g - want.double()).abs().max()), 0


def decode_text(tokenizer: Any, ids: Sequence[int]) -> str | None:
    """The text of ``ids`` (None without a tokenizer)."""
    if tokenizer is None:
        return None
    return tokenizer.decode(list(ids), skip_special_tokens=False)


class WorkDirectory:
    """``work_dir`` as given (created, kept), or a temporary directory removed on exit."""

    def __init__(self, work_dir: str | os.PathLike | None):
        self.work_dir = work_dir
        self.tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> str:
        if self.work_dir is None:
            self.tmp = tempfile.TemporaryDirectory(prefix="circleops-check-")
            return self.tmp.name
        path = Path(self.work_dir)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            from circleops.errors import OutputError

            raise OutputError(f"cannot create --keep directory {path}: {err.strerror}.") from None
        return str(path)

    def __exit__(self, *exc: Any) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()

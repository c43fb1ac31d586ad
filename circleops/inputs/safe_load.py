"""Loading files from outside without running their code.

A .pt2 archive (``torch.export.save``) is a zip of JSON (the graph, the weight layout) and
raw tensor bytes, but torch.export.load also unpickles with ``weights_only=False`` whatever
the archive asks for: weights or constants marked ``use_pickle``, custom/opaque objects,
legacy ``.pt`` weight files, and example inputs that fail the safe unpickler (it falls
back to the unsafe one). A pickle runs arbitrary code, so converting a file someone sent
you would run their code. :func:`check_pt2_archive` reads the archive's table of contents
and configs first and refuses every such entry; :func:`load_pt2` then loads with every
``torch.load`` forced to ``weights_only=True`` (tensors and plain containers only) as a
second line of defence.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import zipfile
from pathlib import Path
from typing import Any, Iterator

import torch

from circleops.errors import ModelLoadError

_WHY = ("circleops never unpickles a .pt2's entries with weights_only=False, because a pickle can "
        "run arbitrary code")
_FIX = ("If you trust the file, load it yourself (torch.export.load) and pass the ExportedProgram to "
        "circleops.convert / circleops.save; otherwise re-export it with plain tensors "
        "(torch.export.save of a model without tensor subclasses or custom objects).")


def _refuse(path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: refusing to load: {what}; {_WHY}. {_FIX}")


def _strip_root(names: list[str]) -> dict[str, str]:
    """archive-relative name -> zip name (torch writes every entry under one root folder)."""
    roots = {n.split("/", 1)[0] for n in names if "/" in n}
    if len(roots) == 1 and all("/" in n for n in names):
        return {n.split("/", 1)[1]: n for n in names}
    return {n: n for n in names}


def check_pt2_archive(path: str | os.PathLike) -> None:
    """Raise ModelLoadError unless the .pt2 at ``path`` can be loaded without unpickling code.

    Refused: compiled code (AOTInductor/ExecuTorch/MTIA payloads), legacy pickled weight or
    constant files, config entries with ``use_pickle`` or custom/opaque objects, and example
    inputs that are not plain tensors (checked with ``torch.load(weights_only=True)``).
    """
    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        raise ModelLoadError(f"cannot load {path} as an ExportedProgram: it is not a .pt2 archive "
                             f"(torch.export.save writes a zip file): {err}") from None
    with zf:
        try:
            entries = _strip_root(zf.namelist())
        except Exception as err:  # noqa: BLE001 - a broken central directory
            raise ModelLoadError(f"{path}: the .pt2 zip archive is corrupt ({err})") from None

        def read(name: str) -> bytes:
            try:
                return zf.read(entries[name])
            except Exception as err:  # noqa: BLE001 - zlib/CRC/size errors of a damaged archive
                raise ModelLoadError(f"{path}: cannot read {name} from the .pt2 archive ({err}); the "
                                     "file is damaged") from None

        for name in entries:
            if name.startswith(("data/aotinductor/", "data/executorch/", "data/mtia")):
                raise _refuse(path, f"it holds compiled code ({name}), which loading would execute")
            if name.startswith("xl_model_weights/"):
                raise _refuse(path, f"it holds externally stored weights ({name})")
            if name.startswith(("data/weights/", "data/constants/")) and name.endswith(".pt"):
                raise _refuse(path, f"{name} is a legacy pickled weight file")
        configs = [n for n in entries if n.startswith(("data/weights/", "data/constants/")) and n.endswith(".json")]
        for name in configs:
            try:
                config = json.loads(read(name))
            except ValueError as err:
                raise ModelLoadError(f"{path}: {name} is not valid JSON ({err}); the file is damaged") from None
            items = config.get("config") if isinstance(config, dict) else None
            if not isinstance(items, dict):
                continue
            for fqn, meta in items.items():
                if not isinstance(meta, dict):
                    continue
                if meta.get("use_pickle"):
                    raise _refuse(path, f"{name} marks {fqn!r} as a pickled payload (use_pickle), which "
                                        "would be unpickled with weights_only=False")
                pname = str(meta.get("path_name", ""))
                if pname.startswith(("custom_obj_", "opaque_obj_")):
                    raise _refuse(path, f"{name} holds {fqn!r} as a pickled object ({pname})")
        for name in entries:
            if name.startswith(("data/sample_inputs/", "extra/")) and name.endswith(".pt"):
                try:
                    torch.load(io.BytesIO(read(name)), weights_only=True)
                except ModelLoadError:
                    raise
                except Exception as err:  # noqa: BLE001 - anything but plain tensors
                    raise _refuse(path, f"its example inputs ({name}) are not plain tensors "
                                        f"({str(err).splitlines()[0][:200] if str(err) else type(err).__name__})")


@contextlib.contextmanager
def weights_only_torch_load() -> Iterator[None]:
    """Every ``torch.load`` inside the block runs with ``weights_only=True``."""
    original = torch.load

    def safe_load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    torch.load = safe_load
    try:
        yield
    finally:
        torch.load = original


def _targets(node: Any) -> Iterator[str]:
    """Every node ``target`` string in a serialized graph (nested graphs of higher-order ops
    included), walked without recursion."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            target = item.get("target")
            if isinstance(target, str) and "inputs" in item:
                yield target
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def pt2_unknown_ops(path: str | os.PathLike) -> list[str]:
    """The ops (``ns::name``) a .pt2's graphs call that this process has not defined:
    torch.export.load would fail on them with "check the warnings above" (warnings it logs,
    not raises). Unreadable archives give []: :func:`check_pt2_archive` reports those."""
    unknown: set[str] = set()
    try:
        with zipfile.ZipFile(path) as zf:
            entries = _strip_root(zf.namelist())
            for name, member in entries.items():
                if not (name.startswith("models/") and name.endswith(".json")):
                    continue
                for target in _targets(json.loads(zf.read(member))):
                    parts = target.split(".")
                    if len(parts) < 4 or parts[:2] != ["torch", "ops"]:
                        continue  # python callables, higher-order ops: torch.export.load resolves those
                    namespace, op = parts[2], parts[3]
                    try:
                        getattr(getattr(torch.ops, namespace), op)
                    except (AttributeError, RuntimeError):
                        unknown.add(f"{namespace}::{op}")
    except (OSError, zipfile.BadZipFile, ValueError, RecursionError, KeyError):
        return []
    return sorted(unknown)


def load_pt2(path: str | os.PathLike) -> Any:
    """``torch.export.load`` of a checked archive with pickles restricted to tensors."""
    check_pt2_archive(path)
    with weights_only_torch_load():
        return torch.export.load(str(path))

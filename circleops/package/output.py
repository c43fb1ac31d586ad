"""The output directory's life cycle: a directory that exists or can be made, a staging
directory beside it where the whole output is written and compared, and the publish of a
complete output (the manifest last), so that a failed conversion leaves an earlier output
unchanged and a reader never sees a manifest describing files that are not all there.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from circleops.errors import OutputError
from circleops.package.manifest import MANIFEST


def check_dir(out_dir: Path) -> None:
    """Refuse an output directory that cannot be made or written, changing nothing: the CLI
    asks this before it loads a model (seconds of imports and reading for a request that
    must fail)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"-o {out_dir} is a file; with --graphs, -o names a directory (e.g. -o out/).")
    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    if not out_dir.exists():
        if not parent.is_dir():
            raise OutputError(f"cannot create {out_dir}: the directory {parent} does not exist. Create it first.")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OutputError(f"cannot create {out_dir}: permission denied. Choose a directory you can write.")
    elif not os.access(out_dir, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write into {out_dir}: permission denied. Choose a directory you can write.")


def prepare_dir(out_dir: Path) -> None:
    """``out_dir`` exists (made if its parent does) and is writable; OutputError otherwise."""
    check_dir(out_dir)
    if not out_dir.exists():
        try:
            out_dir.mkdir()
        except OSError as err:
            raise OutputError(f"cannot create {out_dir}: {err.strerror}. Choose a directory you can write.") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write into {out_dir}: permission denied. Choose a directory you can write.")


def staging_dir(out_dir: Path) -> Path:
    """A new directory beside ``out_dir`` where the whole output is built and compared
    before anything in ``out_dir`` changes (``.NAME.<pid>-<random>.tmp``: a later run removes
    those whose process died)."""
    from circleops.serialize.writer import default_dir_mode, remove_stale_temporaries, temp_prefix

    parent = out_dir.parent if str(out_dir.parent) else Path(".")
    remove_stale_temporaries(out_dir)
    try:
        staging = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir), suffix=".tmp", dir=parent))
        staging.chmod(default_dir_mode())  # mkdtemp's 0700 would survive the publish of new dirs
    except OSError as err:
        raise OutputError(f"cannot create a directory beside {out_dir}: {err.strerror or err}. "
                          "Choose an output directory whose parent you can write.") from None
    return staging


def publish(staging: Path, out_dir: Path) -> None:
    """Move the complete, compared output from ``staging`` into ``out_dir``. The old
    manifest goes only now, and the new one is moved last: a reader never sees a manifest
    describing files that are not all there. Files of the user's own in ``out_dir`` stay."""
    out_dir.mkdir(exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)
    for entry in sorted(staging.iterdir()):
        if entry.name == MANIFEST:
            continue
        dest = out_dir / entry.name
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        os.replace(entry, dest)
    os.replace(staging / MANIFEST, out_dir / MANIFEST)
    staging.rmdir()

"""Reading the files a user passes (JSON, WAV, images, .npy) and checking the sizes they ask for.

Every reader here turns a malformed, truncated, oversized or unsupported file into a
CircleOpsError (by default :class:`InputFileError`) that names the file, says what is wrong
and what to do; nothing is allocated from a size a file declares before that size was
checked against the file's own length (or the machine's memory). One reader per kind, used
everywhere circleops reads that kind from a user: a bug fixed here is fixed for every command.
"""
from __future__ import annotations

import contextlib
import os
import re
import struct
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from circleops.errors import CircleOpsError, ModelLoadError

if TYPE_CHECKING:
    import numpy as np

# JSON written by Hugging Face and circleops nests 5-6 levels (tokenizer.json: model > vocab >
# entry); 64 leaves room for any real file and stops a "[[[[..." bomb long before Python's
# recursion limit (the json decoder recurses once per level).
MAX_JSON_DEPTH = 64
# tokenizer.json of the largest vocabularies is ~35 MB; a 20 GB "config" is not read whole.
MAX_JSON_BYTES = 512 << 20
# Pillow's own default limit is 89.5 Mpx (it raises only above twice that); 2^27 px (a
# 16384 x 8192 panorama, any phone photo) decodes to 384 MB of RGB.
DEFAULT_MAX_IMAGE_PIXELS = 1 << 27
MAX_IMAGE_PIXELS_ENV = "CIRCLEOPS_MAX_IMAGE_PIXELS"


class InputFileError(ModelLoadError):
    """A file or value the user passed is malformed, truncated, oversized or unsupported."""


def _fail(error: type[CircleOpsError], message: str) -> CircleOpsError:
    return error(message)


# --------------------------------------------------------------------------- JSON

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


def json_depth(data: bytes) -> int:
    """The deepest nesting of ``[``/``{`` in the JSON text ``data`` (brackets inside strings
    not counted), without parsing it."""
    import numpy as np

    def deepest(raw: bytes) -> int:
        arr = np.frombuffer(raw, np.uint8)
        step = np.isin(arr, (ord("["), ord("{"))).astype(np.int32) - np.isin(arr, (ord("]"), ord("}")))
        return int(np.cumsum(step).max()) if step.size else 0

    bound = deepest(data)  # counting brackets in strings too: an upper bound, exact for most files
    return bound if bound <= MAX_JSON_DEPTH else deepest(_JSON_STRING.sub(b'""', data))


def parse_json(data: bytes | str, source: str, *, error: type[CircleOpsError] = InputFileError,
               fix: str = "") -> Any:
    """JSON text from ``source`` (named in the message) as Python values: not UTF-8, not
    JSON, nested deeper than MAX_JSON_DEPTH or with a number Python refuses are each an
    ``error`` saying so; ``fix`` is appended (what to do)."""
    fix = f" {fix}" if fix else ""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if not raw.strip():
        raise _fail(error, f"{source} is empty: it should hold JSON.{fix}")
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise _fail(error, f"{source} nests {depth} levels of JSON arrays/objects; circleops reads at most "
                           f"{MAX_JSON_DEPTH} (no real config comes close): the file is damaged or hostile.{fix}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _fail(error, f"{source} is not UTF-8 text (byte {err.start}): it is not a JSON file, or it is "
                           f"damaged.{fix}") from None
    import json

    try:
        return json.loads(text)
    except RecursionError:
        raise _fail(error, f"{source} nests JSON too deeply to read.{fix}") from None
    except ValueError as err:  # JSONDecodeError, and numbers of more than 4300 digits
        raise _fail(error, f"{source} is not valid JSON: {str(err)[:200]}.{fix}") from None


def read_json(path: str | os.PathLike, *, error: type[CircleOpsError] = InputFileError, fix: str = "",
              what: str | None = None) -> Any:
    """The JSON file at ``path`` (see :func:`parse_json`); a missing or unreadable file, or
    one over MAX_JSON_BYTES, is an ``error`` too. ``what`` names it in messages (default: the path)."""
    path = Path(path)
    source = what or str(path)
    fix_text = f" {fix}" if fix else ""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise _fail(error, f"{source} is {size / 2**20:.0f} MiB; a JSON file circleops reads is at most "
                               f"{MAX_JSON_BYTES >> 20} MiB.{fix_text}")
        data = path.read_bytes()
    except OSError as err:
        raise _fail(error, f"cannot read {source}: {err.strerror or err}.{fix_text}") from None
    return parse_json(data, source, error=error, fix=fix)


def check_json_files(directory: str | os.PathLike, *, error: type[CircleOpsError] = InputFileError,
                     fix: str = "") -> dict[str, Any]:
    """Read every ``*.json`` directly in ``directory`` with :func:`read_json`: run before a
    library (transformers, tokenizers) reads the directory, so that a damaged, binary or
    nested-bomb file is named here instead of failing inside it. Returns the values by file name."""
    d = Path(directory)
    if not d.is_dir():
        return {}
    return {path.name: read_json(path, error=error, fix=fix) for path in sorted(d.glob("*.json")) if path.is_file()}


def json_object(value: Any, source: str, *, error: type[CircleOpsError] = InputFileError, fix: str = "") -> dict:
    """``value`` if it is a JSON object, else an ``error`` saying what it is."""
    if not isinstance(value, dict):
        raise _fail(error, f"{source} holds a JSON {type(value).__name__}, not an object.{' ' + fix if fix else ''}")
    return value


def outside_reason(directory: Path, name: Any) -> str | None:
    """Why the file ``name`` a file in ``directory`` refers to is not inside ``directory`` (not a
    relative file name, ``..``, absolute, a symbolic link out, the directory itself), or None."""
    if not isinstance(name, str) or not name or "\0" in name or not Path(name).parts:
        return "is not a file name"
    if os.path.isabs(name) or Path(name).is_absolute() or name.startswith(("/", "\\")) or ":" in Path(name).parts[0]:
        return "is an absolute path"
    if ".." in Path(name.replace("\\", "/")).parts:
        return "leaves the directory with '..'"
    real, root = (Path(directory) / name).resolve(), Path(directory).resolve()
    if real != root and root not in real.parents:
        return f"is a symbolic link to {real}, outside the directory"
    if real == root:
        return "names the directory itself"
    return None


# --------------------------------------------------------------------------- sizes

def machine_memory() -> int:
    """The machine's physical memory in bytes (8 GiB when the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def check_count(value: Any, what: str, *, low: int = 1, high: int | None = None,
                error: type[CircleOpsError] = InputFileError, fix: str = "") -> int:
    """``value`` as an int if it is an integer (not a bool) in [low, high], else an ``error``
    naming ``what``: one check for every count, size and id a file or a flag gives."""
    import numpy as np  # only once a value is checked: `circleops --help` stays light

    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if ok and value >= low and (high is None or value <= high):
        return int(value)
    span = f"from {low} to {high}" if high is not None else f"at least {low}"
    raise _fail(error, f"{what} is {value!r}; it must be an integer {span}.{' ' + fix if fix else ''}")


def check_bytes(nbytes: int, what: str, *, limit: int | None = None, limit_name: str = "the limit",
                error: type[CircleOpsError] = InputFileError, fix: str = "") -> None:
    """Refuse ``what`` when it needs more than ``limit`` bytes (default: the machine's
    physical memory) before anything of that size is allocated."""
    if limit is None:
        limit, limit_name = machine_memory(), "this machine's memory"
    if nbytes > limit:
        raise _fail(error, f"{what} would need {_size(nbytes)}, more than {_size(limit)} ({limit_name})."
                           f"{' ' + fix if fix else ''}")


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"


# --------------------------------------------------------------------------- WAV

_WAV_FORMATS = {1: "PCM", 3: "IEEE float", 0xFFFE: "extensible"}
_PCM_KINDS = {1: ("u1", 128.0, 128.0), 2: ("<i2", 0.0, 32768.0), 4: ("<i4", 0.0, 2147483648.0)}  # dtype, zero, scale
# A data chunk size a writer that could not seek back (a pipe) leaves: "to the end of the file".
_STREAMED_SIZES = (0, 0xFFFFFFFF)


def read_wav(path: str | os.PathLike, *, error: type[CircleOpsError] = InputFileError) -> tuple[np.ndarray, int]:
    """A WAV file (8/16/24/32-bit PCM or 32-bit float, any number of channels, mixed down) as
    mono float32 in [-1, 1], and its sample rate.

    The RIFF chunks are walked with every size checked against the file's length; the samples
    are read from the bytes the file holds, never from a buffer sized by the header. A data
    chunk that declares more bytes than the file holds (a cut copy or download), or that
    stops inside a frame, is refused: transcribing part of a file without a word would look
    like a model error. A data size of 0 or 0xFFFFFFFF followed by samples (what a writer to
    a pipe leaves) reads to the end of the file.
    """
    path = Path(path)
    fix = "Export the audio again as a PCM WAV file (e.g. `ffmpeg -i IN -ar 16000 -ac 1 out.wav`)."

    def bad(why: str) -> CircleOpsError:
        return _fail(error, f"cannot read {path} as a WAV file: {why}. {fix}")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(12)
            if len(head) == 0:
                raise bad("the file is empty")
            if len(head) < 12 or head[:4] not in (b"RIFF", b"RF64") or head[8:12] != b"WAVE":
                raise bad(f"it does not start with a RIFF/WAVE header (it starts with {head[:12]!r})"
                          if len(head) == 12 else f"the file is {size} bytes long, shorter than a WAV header")
            if head[:4] == b"RF64":
                raise bad("it is an RF64 (over 4 GB) WAV, which circleops does not read")
            fmt: tuple[int, ...] | None = None
            while True:
                pos = f.tell()
                chunk = f.read(8)
                if len(chunk) < 8:
                    raise bad(f"the header ends at byte {size} without a 'data' chunk" if fmt else
                              f"the header ends at byte {size} before its 'fmt ' chunk (the file is cut inside "
                              f"its header)")
                cid, clen = chunk[:4], struct.unpack("<I", chunk[4:])[0]
                start = pos + 8
                if cid == b"fmt ":
                    if clen < 16 or start + clen > size:
                        raise bad(f"its 'fmt ' chunk is {clen} bytes and the file holds {max(0, size - start)} of "
                                  f"them (the header is damaged or cut)")
                    fmt = struct.unpack("<HHIIHH", f.read(16))
                    if fmt[0] == 0xFFFE and clen >= 40:  # WAVE_FORMAT_EXTENSIBLE: the real format is in the GUID
                        f.read(8)
                        fmt = (struct.unpack("<H", f.read(2))[0],) + fmt[1:]
                    f.seek(start + clen + (clen & 1))
                elif cid == b"data":
                    if fmt is None:
                        raise bad("its 'data' chunk comes before the 'fmt ' chunk that describes it")
                    held = size - start
                    streamed = clen in _STREAMED_SIZES and held > 0
                    return _wav_samples(f, fmt, held if streamed else clen, held, bad)
                else:
                    f.seek(start + clen + (clen & 1))
    except OSError as err:
        raise _fail(error, f"cannot read {path}: {err.strerror or err}.") from None


def _wav_samples(f: Any, fmt: tuple[int, ...], declared: int, held: int, bad: Any) -> tuple[np.ndarray, int]:
    import numpy as np

    tag, channels, rate, _, block, bits = fmt
    width = (bits + 7) // 8
    if tag not in (1, 3):
        raise bad(f"its samples are encoded as format {tag:#06x} ({_WAV_FORMATS.get(tag, 'compressed')}); circleops "
                  f"reads PCM (8, 16, 24, 32-bit) and 32-bit float WAV")
    if channels < 1 or rate < 1:
        raise bad(f"its header says {channels} channels at {rate} Hz")
    if (tag == 1 and width not in (1, 2, 3, 4)) or (tag == 3 and width != 4):
        raise bad(f"its samples are {bits}-bit {_WAV_FORMATS[tag]}; circleops reads 8, 16, 24 or 32-bit PCM and "
                  f"32-bit float")
    frame = channels * width
    if declared % frame:
        raise bad(f"its data chunk is {declared} bytes, not a whole number of {frame}-byte frames "
                  f"({channels} channel(s) x {width} bytes): the header is damaged")
    if declared > held:
        raise bad(f"its header declares {declared // frame} frames ({declared // frame / rate:.2f} s) and the file "
                  f"holds {held // frame} ({held // frame / rate:.2f} s): the file is cut (an interrupted copy or "
                  f"download?); circleops refuses it rather than hear part of the audio without a word")
    raw = f.read(declared)
    if len(raw) != declared:  # the file shrank while it was read
        raise bad("the file changed while it was read")
    if tag == 3:
        samples = np.frombuffer(raw, "<f4").astype(np.float32)
        if not np.isfinite(samples).all():
            raise bad("its float samples include NaN or infinity")
    elif width == 3:  # 24-bit: sign-extend three little-endian bytes into int32
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        samples = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 8388608.0
    else:
        dtype, zero, scale = _PCM_KINDS[width]
        samples = (np.frombuffer(raw, dtype).astype(np.float32) - zero) / scale
    return samples.reshape(-1, channels).mean(axis=1), rate


# --------------------------------------------------------------------------- images

def positive_whole_number(text: str | None, default: int) -> int | None:
    """The count a setting's text gives (an environment variable's): ``default`` for no text,
    the whole number it holds when that is 1 or more, else None (the caller names the setting)."""
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= 1 else None


def max_image_pixels() -> int:
    """The largest image (width x height) circleops decodes: CIRCLEOPS_MAX_IMAGE_PIXELS, or 2^27."""
    text = os.environ.get(MAX_IMAGE_PIXELS_ENV)
    value = positive_whole_number(text, DEFAULT_MAX_IMAGE_PIXELS)
    if value is None:
        raise InputFileError(f"{MAX_IMAGE_PIXELS_ENV}={text!r}: it must be a positive number of pixels "
                             f"(default {DEFAULT_MAX_IMAGE_PIXELS}).")
    return value


@contextlib.contextmanager
def opened_image(path: str | os.PathLike, *, error: type[CircleOpsError] = InputFileError) -> Iterator[Any]:
    """The image at ``path`` opened by Pillow (lazily: only its header read) after its size
    was checked against :func:`max_image_pixels`; anything Pillow raises while the block
    decodes it becomes an ``error`` naming the file."""
    try:
        from PIL import Image
    except ImportError:
        raise _fail(error, "reading an image needs Pillow: pip install pillow.") from None
    limit = max_image_pixels()
    if not Path(path).is_file():
        raise _fail(error, f"the image {path} does not exist: pass the path of a PNG or JPEG file.")
    # Pillow's own checks (at open, and when a frame is decoded) warn above MAX_IMAGE_PIXELS and
    # raise above twice it: circleops checks its limit exactly at open, and Pillow's later checks
    # (other frames) use that limit too.
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None  # opening reads only the header; its size is checked just after
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                picture = Image.open(path)
            except Exception as err:  # noqa: BLE001 - a decoder's error on a damaged file: OSError, SyntaxError...
                raise _fail(error, f"cannot read the image {path}: {_first_line(err)}. Pass a PNG or JPEG "
                                   f"file.") from None
            with picture:
                pixels = picture.width * picture.height
                if pixels > limit:
                    raise _fail(error, f"the image {path} declares {picture.width} x {picture.height} = {pixels} "
                                       f"pixels, over circleops' limit of {limit} (a decompression bomb, or a huge "
                                       f"image): shrink it, or raise the limit with {MAX_IMAGE_PIXELS_ENV}=N if you "
                                       f"trust it.")
                if pixels == 0:
                    raise _fail(error, f"the image {path} is {picture.width} x {picture.height} pixels: it is empty.")
                Image.MAX_IMAGE_PIXELS = limit
                try:
                    yield picture
                except CircleOpsError:
                    raise
                except Exception as err:  # noqa: BLE001 - decoding happens lazily, inside the block
                    raise _fail(error, f"cannot decode the image {path}: {_first_line(err)}. The file is damaged "
                                       f"or not a PNG/JPEG image.") from None
    finally:
        Image.MAX_IMAGE_PIXELS = saved


# what transformers' processors, tokenizers and feature extractors raise when their saved
# configuration holds a value they cannot use ("image_mean": "", "n_fft": 0, "size": [1, 2])
PROCESSOR_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError,
                    RuntimeError, AssertionError)


@contextlib.contextmanager
def users_processor(what: str, source: Any, *, error: type[CircleOpsError] = InputFileError) -> Iterator[None]:
    """Inside, a processor, tokenizer or feature extractor that a user's files configure runs on
    an input: what it raises on values of its configuration it cannot use becomes ``error``
    naming ``what`` and where it was saved (``source``). Keep the block to the call itself."""
    try:
        yield
    except CircleOpsError:
        raise
    except BaseException as err:
        # the Rust tokenizers library raises a bare Exception ("WordPiece error: Missing [UNK]
        # token from the vocabulary" for an empty vocab.txt) or, through pyo3, a PanicException
        # (a BaseException: "Onig: Regex search error: retry-limit-in-match over" for a
        # catastrophic pre-tokenizer regex): the files' fault too
        if not (isinstance(err, PROCESSOR_ERRORS) or type(err) is Exception or type(err).__name__ == "PanicException"):
            raise
        raise _fail(error, f"the {what} saved in {source} failed on this input: {type(err).__name__}: "
                           f"{_first_line(err)}. Its configuration holds values it cannot use: fix those files or "
                           f"save the {what} again (save_pretrained).") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0][:200] if text else type(err).__name__) or type(err).__name__


# --------------------------------------------------------------------------- safetensors

MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit (safetensors refuses larger headers)


def read_safetensors_header(path: str | os.PathLike, *, error: type[CircleOpsError] = InputFileError
                            ) -> dict[str, dict[str, Any]]:
    """The tensor entries of a .safetensors file's header (name -> {"dtype", "shape",
    "data_offsets"}), from its first bytes only (no weight is read), each checked: a dtype
    name, a shape of whole numbers >= 0, offsets [start, end] inside the data the file holds.
    Anything else (a cut or damaged header, other types) is ``error`` naming the file."""
    import json
    import struct

    path = Path(path)
    fix = "The file is damaged or incomplete: download or save it again."
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise _fail(error, f"{path} is {size} bytes: too short for a safetensors file. {fix}")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
                raise _fail(error, f"{path}: its header claims {n} bytes and the file holds {size}. {fix}")
            text = f.read(n)
    except OSError as err:
        raise _fail(error, f"cannot read {path}: {err.strerror or err}.") from None
    header = parse_json(text, f"the header of {path}", error=error, fix=fix)
    if not isinstance(header, dict):
        raise _fail(error, f"the header of {path} is not a JSON object. {fix}")
    body = size - 8 - n
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        whole = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)
        if not (isinstance(info.get("dtype") if isinstance(info, dict) else None, str) and isinstance(shape, list)
                and all(map(whole, shape)) and isinstance(offsets, list) and len(offsets) == 2
                and all(map(whole, offsets)) and offsets[0] <= offsets[1] <= body):
            raise _fail(error, f"{path}: the header's entry for {str(name)[:80]!r} is not a tensor (a dtype, a shape "
                               f"of whole numbers, data offsets inside the {body} bytes of data): "
                               f"{json.dumps(info)[:160]}. {fix}")
        entries[name] = info
    return entries


# --------------------------------------------------------------------------- .npy

def load_npy(path: str | os.PathLike, *, error: type[CircleOpsError] = InputFileError) -> np.ndarray:
    """A .npy file as an array: its header read and its size (shape x dtype) checked against
    the bytes the file holds before any allocation; object arrays (pickles) refused."""
    import numpy as np

    path = Path(path)
    fix = "Save it with numpy.save(path, array) of a numeric array."
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise _fail(error, f"{path} is empty, not a .npy file. {fix}")
            try:
                version = np.lib.format.read_magic(f)
                reader = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
                if version not in reader:
                    raise ValueError(f"unknown .npy format version {version}")
                shape, fortran, dtype = reader[version](f, max_header_size=1 << 16)
            except Exception as err:  # noqa: BLE001 - numpy's header parser: ValueError, SyntaxError, TokenError...
                raise _fail(error, f"{path} is not a readable .npy file: {_first_line(err)}. {fix}") from None
            if dtype.hasobject:
                raise _fail(error, f"{path} holds Python objects (dtype {dtype}), which load only by unpickling, and "
                                   f"a pickle can run code: circleops refuses it. {fix}")
            count = 1
            for n in shape:
                count *= int(n)
            need, held = count * dtype.itemsize, size - f.tell()
            if need != held:
                raise _fail(error, f"{path}: its header declares a {dtype} array of shape {list(shape)} ({need} bytes) "
                                   f"and the file holds {held} bytes of data: it is {'cut' if need > held else 'damaged'}. "
                                   f"{fix}")
            array = np.fromfile(f, dtype=dtype, count=count)
            return array.reshape(shape, order="F" if fortran else "C")
    except OSError as err:
        raise _fail(error, f"cannot read {path}: {err.strerror or err}.") from None

"""Streaming safetensors reader and writer for :mod:`nemo_fp8_plugin.rl.export`.

Why not ``safetensors``' own API: its memory. ``safe_open`` maps a whole shard and its pages
count as resident until the shard is closed, and ``save_file`` builds the whole output file
in memory before writing it; an export through them peaked at 593 MiB above baseline on the
419 MB checkpoint of ``tests/rl/test_export_memory.py`` (one mapped source shard plus the
quantized output shard), against 24 MiB for the streaming export when it was written, and a
5 GB shard would cost 5 GB or more. The bound the test holds (twice the largest tensor plus 300 MiB) cannot be met through
the library, so this module reads and writes the format itself (the format is a little-endian
u64 header length, a JSON header, then the tensors' bytes at the header's offsets):

- :func:`plan` reads every header of the checkpoint and checks it as the format requires
  (offsets inside the file, contiguous, sizes matching shapes) before any data is read;
- :func:`stream_entries` yields each tensor in file order, each through a memory map of its
  own bytes that is released with the tensor (about one tensor resident; the pages are the
  page cache's, so nothing is copied and no fresh memory faulted in);
- :class:`ShardWriter` appends each tensor to the current output shard as it arrives: a shard
  reserves room for its header (only known once the shard is complete), writes its data
  after that room, and fills the header in, padded with spaces (which the format allows),
  when it closes.

Dtypes outside :data:`ST_DTYPES` (a newer format addition) are read and spelt by the
library itself, one tensor at a time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import struct
import sys
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import FP8ConfigError, format_value

__all__ = [
    "ST_DTYPES",
    "Entry",
    "ShardWriter",
    "plan",
    "read_header",
    "stream_entries",
]

MAX_HEADER_BYTES = 100 * 2**20
"""Largest safetensors header read (the limit the safetensors library itself applies)."""

MAX_ELEMENTS = 2**48
"""Most elements a tensor header may describe, zero dimensions counted as one (a header of
shape ``[0, 2**62]`` holds no bytes, but every step after the read would size work by its
dimensions). 2**48 is 256 Ti elements, far above any real tensor."""

_CHUNK = 64 * 2**20
"""Bytes per read or write call: large enough for the disk's sequential speed, small enough
that an interrupted call loses little."""

# safetensors dtype names <-> torch dtypes (the format's own spelling).
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
for _name, _attr in (
    ("F8_E8M0", "float8_e8m0fnu"),
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
):
    if hasattr(torch, _attr):
        ST_DTYPES[_name] = getattr(torch, _attr)
_ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}

METADATA_KEY = "__metadata__"
"""The header entry the format reserves for string metadata (never a tensor name)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, from its header.

    Attributes:
        name: the tensor's name.
        file: the shard holding it.
        dtype: the safetensors spelling (``BF16``, ``F32``, ...).
        shape: its dimensions.
        begin, end: absolute byte offsets of its data in ``file``.
    """

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def bad_file(path: Path, why: str) -> FP8ConfigError:
    return FP8ConfigError(
        f"{path} is not a readable safetensors file ({why})", key="source", value=str(path)
    )


def _header_json(path: Path) -> tuple[dict, int, int]:
    """The header object, the offset its data starts at, and the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise bad_file(path, "shorter than a header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise bad_file(path, f"header length {n} does not fit the file")
            text = fh.read(n)
    except OSError as exc:
        raise FP8ConfigError(
            f"cannot read {path}: {exc.strerror or exc}", key="source", value=str(path)
        ) from None
    try:
        header = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." past the stack
        raise bad_file(path, f"header is not JSON: {format_value(str(exc))}") from None
    if not isinstance(header, dict):
        raise bad_file(path, "header is not a JSON object")
    return header, 8 + n, size


def _entry(path: Path, base: int, name: str, info: Any) -> Entry:
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        ok = (
            isinstance(dtype, str)
            and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and type(begin) is int
            and type(end) is int
            and 0 <= begin <= end
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise bad_file(path, f"bad header entry for {format_value(name)}")
    numel = bound = 1
    for d in shape:
        numel *= d
        bound *= max(d, 1)
        if bound > MAX_ELEMENTS:
            raise FP8ConfigError(
                f"{path}: tensor {format_value(name)} has shape {format_value(shape)}, more "
                f"than {MAX_ELEMENTS} elements (zero dimensions counted as one)",
                key=name,
                value=shape,
            )
    known = ST_DTYPES.get(dtype)
    if known is not None and (end - begin) != numel * known.itemsize:
        raise bad_file(path, f"{format_value(name)}: {end - begin} bytes for {shape} {dtype}")
    return Entry(name, path, dtype, tuple(shape), base + begin, base + end)


def read_header(path: Path) -> list[Entry]:
    """The tensors of one safetensors file, in file order, checked as the format requires
    (offsets inside the file, contiguous, sizes matching shapes) before any data is read."""
    header, base, size = _header_json(path)
    entries = [
        _entry(path, base, name, info) for name, info in header.items() if name != METADATA_KEY
    ]
    entries.sort(key=lambda e: (e.begin, e.end))
    at = base
    for e in entries:
        if e.begin != at:
            raise bad_file(path, f"{format_value(e.name)}: data offsets are not contiguous")
        at = e.end
    if at != size:
        raise bad_file(path, f"data ends at byte {at}, the file has {size}")
    return entries


def plan(files: list[Path], index: dict[str, str] | None = None) -> list[Entry]:
    """Every tensor of the checkpoint, from the headers alone. Refused here, before any
    work: a name in two shards (which copy would win is not ours to guess), and, given the
    index's ``weight_map``, a tensor it names that no shard holds."""
    entries: list[Entry] = []
    seen: dict[str, Path] = {}
    for path in files:
        for e in read_header(path):
            if e.name in seen:
                raise FP8ConfigError(
                    f"tensor {format_value(e.name)} appears in both {seen[e.name].name} and "
                    f"{path.name}",
                    key=e.name,
                )
            seen[e.name] = path
            entries.append(e)
    for name, file in (index or {}).items():
        if name not in seen:
            raise FP8ConfigError(
                f"model.safetensors.index.json names tensor {format_value(name)} in "
                f"{format_value(file)}, which does not hold it",
                key=name,
                hint="the index and the shards are from different checkpoints, or a shard "
                "is incomplete",
            )
    return entries


def _read_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done : done + _CHUNK]], offset + done)
        if not got:
            raise bad_file(path, "it ended early (truncated while being read?)")
        done += got


def _read_with_safetensors(entry: Entry) -> torch.Tensor:
    """A dtype this module does not spell (a newer format addition): read by the library."""
    from safetensors import safe_open

    try:
        with safe_open(str(entry.file), framework="pt") as fh:
            return fh.get_tensor(entry.name).clone()  # off the memory map before it closes
    except Exception as exc:  # the library's own error types; the file is the user's
        raise bad_file(entry.file, format_value(str(exc))) from None


def map_tensor(fd: int, entry: Entry, dtype: torch.dtype) -> torch.Tensor | None:
    """The tensor's bytes mapped from the file (a private mapping of just this tensor, so its
    pages count as resident only while the tensor lives, and are the page cache's own: no
    copy, no fresh pages to fault in), or None where a mapping does not fit (data not aligned
    to the element size)."""
    if entry.begin % dtype.itemsize:
        return None
    start = entry.begin - entry.begin % mmap.ALLOCATIONGRANULARITY
    try:
        mm = mmap.mmap(fd, entry.end - start, offset=start, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    if hasattr(mm, "madvise"):
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_SEQUENTIAL)
    raw = torch.frombuffer(
        mm, dtype=torch.uint8, count=entry.end - entry.begin, offset=entry.begin - start
    )
    return raw.view(dtype).reshape(entry.shape)  # holds the mapping until it is freed


def _open_source(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    if hasattr(os, "posix_fadvise"):  # a larger readahead window for the kernel
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd


def _read_entry(fd: int, e: Entry, dtype: torch.dtype) -> torch.Tensor:
    mapped = map_tensor(fd, e, dtype)
    if mapped is not None:
        return mapped
    raw = torch.empty(e.end - e.begin, dtype=torch.uint8)
    _read_into(fd, raw.numpy().data, e.begin, e.file)
    return raw.view(dtype).reshape(e.shape)


def stream_entries(
    entries: list[Entry], on_done: Callable[[int], None]
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Each tensor in file order: mapped from the file (one mapping per tensor, released
    with the tensor, so about one tensor's pages are resident, not the shard's), or where a
    mapping does not fit, read into a buffer of its own (not a reused one: the consumer's
    generator still holds the previous tensor when it asks for the next)."""
    fd: int | None = None
    open_path: Path | None = None
    try:
        for e in entries:
            dtype = ST_DTYPES.get(e.dtype)
            nbytes = e.end - e.begin
            if dtype is None or sys.byteorder != "little":
                tensor = _read_with_safetensors(e)
            elif nbytes == 0:
                tensor = torch.empty(e.shape, dtype=dtype)
            else:
                if e.file != open_path:
                    if fd is not None:
                        os.close(fd)
                        fd = None
                    fd, open_path = _open_source(e.file), e.file
                assert fd is not None  # opened for e.file, now or for an earlier entry
                tensor = _read_entry(fd, e, dtype)
            yield e.name, tensor
            del tensor
            on_done(nbytes)
    except OSError as exc:
        where = open_path if open_path is not None else (entries[0].file if entries else "")
        raise FP8ConfigError(
            f"cannot read {where}: {exc.strerror or exc}", key="source", value=str(where)
        ) from None
    finally:
        if fd is not None:
            os.close(fd)


# --------------------------------------------------------------------------- writing


@functools.cache
def st_dtype_name(dtype: torch.dtype) -> str | None:
    """The safetensors spelling of a dtype, as the library writes it for those outside the
    table; None for one it cannot store."""
    if dtype in _ST_NAMES:
        return _ST_NAMES[dtype]
    try:
        from safetensors.torch import save

        blob = save({"x": torch.empty(1, dtype=dtype)})
        (n,) = struct.unpack("<Q", blob[:8])
        return str(json.loads(blob[8 : 8 + n])["x"]["dtype"])
    except Exception:  # no safetensors, or a dtype it cannot store
        return None


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + _CHUNK], offset + done)


def checked_tensor(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The safetensors dtype name and a contiguous CPU copy (or the tensor itself) of what
    is about to be written; refuses what the format cannot hold, naming the tensor."""
    if name == METADATA_KEY:
        raise FP8ConfigError(
            f"a tensor is named {METADATA_KEY!r}, the safetensors header's metadata entry "
            f"(the checkpoint written could not be loaded)",
            key=name,
            hint="rename the tensor",
        )
    if tensor.is_meta:
        raise FP8ConfigError(
            f"tensor {format_value(name)} is on the meta device (a shape without data)",
            key=name,
            hint="load the weights (e.g. model.to_empty() and load_state_dict) first",
        )
    dtype = st_dtype_name(tensor.dtype)
    if dtype is None:
        raise FP8ConfigError(
            f"tensor {format_value(name)} has dtype {tensor.dtype}, which safetensors cannot store",
            key=name,
        )
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return dtype, t.resolve_conj().resolve_neg().contiguous()


class ShardWriter:
    """Writes safetensors shards of at most ``max_bytes`` (header included) into a directory,
    each tensor as it arrives, with positioned writes (``os.pwrite``) on a raw descriptor.

    A shard reserves header room when it opens (``_room``), writes tensor data after it, and
    closes when the next tensor would pass ``max_bytes`` or its header would outgrow the
    room; closing writes the header, padded with spaces to the reserved size, at offset 0.
    """

    _META = '"__metadata__":{"format":"pt"}'

    def __init__(self, directory: Path, max_bytes: int, shown: Path) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.shown = shown  # the path errors name (the temporary directory is ours)
        self.default_room = min(max(_round8(max_bytes // 64), 1024), 2**20)
        self.files: list[tuple[Path, list[str]]] = []
        """Closed shards (temporary path, tensor names), in order."""
        self.names: set[str] = set()
        """Every tensor name written so far."""
        self.total_bytes = 0
        """Bytes of tensor data written so far."""
        self._fd: int | None = None
        self._path: Path | None = None
        self._room = 0
        self._fragments: list[str] = []
        self._shard_names: list[str] = []
        self._header_len = 0
        self._data = 0

    def _fail(self, exc: OSError) -> OSError:
        return OSError(exc.errno, exc.strerror or str(exc), str(self.shown))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise FP8ConfigError(
                f"tensor {format_value(name)} appears twice in the output (the source has it "
                f"twice, or has a tensor by the name of a scale this export writes)",
                key=name,
            )
        dtype, t = checked_tensor(name, tensor)
        size = t.numel() * t.element_size()
        if self._fd is not None:
            fragment = self._fragment(name, dtype, t.shape, self._data, size)
            if (
                self._header_len + 1 + len(fragment) > self._room
                or 8 + self._room + self._data + size > self.max_bytes
            ):
                self.close_shard()
        if self._fd is None:
            fragment = self._fragment(name, dtype, t.shape, 0, size)
            # room for this entry and its scale's, whatever the name's length
            self._open(max(self.default_room, _round8(len(self._META) + 8 + 3 * len(fragment))))
        self._fragments.append(fragment)
        self._shard_names.append(name)
        self._header_len += 1 + len(fragment)
        self.names.add(name)
        if size:
            assert self._fd is not None  # opened above
            try:
                data = t.reshape(-1).view(torch.uint8).numpy().data
                _write_all(self._fd, data, 8 + self._room + self._data)
            except OSError as exc:
                raise self._fail(exc) from None
        self._data += size
        self.total_bytes += size

    @staticmethod
    def _fragment(name: str, dtype: str, shape: Iterable[int], begin: int, size: int) -> str:
        info = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, begin + size]}
        return json.dumps(name) + ":" + json.dumps(info, separators=(",", ":"))

    def _open(self, room: int) -> None:
        self._path = self.directory / f".shard-{len(self.files) + 1:05d}.safetensors"
        self._room = room
        self._fragments, self._shard_names, self._data = [], [], 0
        self._header_len = 2 + len(self._META)  # the braces and the metadata entry
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(self._path, flags, 0o666)
        except OSError as exc:
            raise self._fail(exc) from None

    def close_shard(self) -> None:
        if self._fd is None or self._path is None:
            return
        header = "{" + ",".join([self._META, *self._fragments]) + "}"
        data = header.encode("ascii")  # json.dumps escapes every non-ASCII character
        if len(data) != self._header_len or len(data) > self._room:  # pragma: no cover
            raise AssertionError(f"safetensors header size {len(data)} != {self._header_len}")
        fd, self._fd = self._fd, None
        try:
            _write_all(fd, memoryview(struct.pack("<Q", self._room) + data.ljust(self._room)), 0)
        except OSError as exc:
            raise self._fail(exc) from None
        finally:
            os.close(fd)
        self.files.append((self._path, self._shard_names))

    def abort(self) -> None:
        """Close what is open (after a failure; the caller removes the files)."""
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None

    def finish(self) -> dict[str, str]:
        """Close the last shard and rename the shards to Hugging Face names; returns the
        weight map."""
        self.close_shard()
        total = len(self.files)
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self.files, start=1):
            final = (
                "model.safetensors" if total == 1 else f"model-{i:05d}-of-{total:05d}.safetensors"
            )
            path.rename(self.directory / final)
            weight_map.update({n: final for n in names})
        return weight_map

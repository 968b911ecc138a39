"""Write a block-FP8 checkpoint that vLLM loads natively, from a state dict or a checkpoint dir.

The output is a Hugging Face checkpoint directory in the layout of vLLM's ``fp8`` method
(DeepSeek-V3 / NeMo RL style): every linear weight the recipe puts in FP8 stored as
``float8_e4m3fn`` ``[N, K]`` with ``<name>_scale_inv`` fp32 ``[ceil(N/128), ceil(K/128)]``,
every other tensor as it came, and ``config.json`` carrying

``quantization_config: {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [128, 128], ignored_layers: [...]}``

where ``ignored_layers`` names the modules left in high precision (vLLM would otherwise
create FP8 parameters for them). ``vllm.LLM(path)`` loads it with vLLM's own ``fp8`` method;
``vllm.LLM(path, quantization="nemo_fp8")`` loads it with the plugin's refit-stable method.
MXFP8 recipes write the plugin's ``nemo_fp8`` quantization config instead (vLLM's ``fp8``
checkpoint format is block FP8 only), so they load with ``quantization="nemo_fp8"``.

The quantization is :func:`nemo_fp8_plugin.rl.quantize_for_refit` (bit-identical to what a
refit sends). Everything streams, one tensor at a time:

- a safetensors source is read tensor by tensor, in file order, each tensor through a
  memory map of its own bytes that is released with the tensor (``safe_open`` maps the
  whole shard, and its pages count as resident until the shard is closed: a 5 GB shard
  would cost 5 GB of resident memory);
- each output tensor is written to the current output shard as soon as it exists. A
  safetensors file starts with its header, which is only known once the shard is complete,
  so each shard reserves room for the header, writes its tensors after that room, and fills
  the header in (padded with spaces, which the format allows) when it is closed.

Peak memory is about one source tensor and its quantized copy, whatever the checkpoint or
shard size (``tests/rl/test_export_memory.py`` checks it in a fresh process). The directory
is built under a temporary name beside ``out_dir`` and renamed into place at the end, so a
crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .._io import atomic_write_text, check_output_dir, same_file
from ..errors import FP8ConfigError, format_value

__all__ = ["export_fp8_checkpoint", "ExportResult", "WEIGHT_FILES"]

WEIGHT_FILES = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
"""Files of a source directory that are replaced, not copied (weights and their index)."""

_SCALE_SUFFIX = "_scale_inv"

_MAX_HEADER_BYTES = 100 * 2**20
"""Largest safetensors header read (the limit the safetensors library itself applies)."""

# safetensors dtype names <-> torch dtypes (the format's own spelling). Others are asked of
# the safetensors library (_st_dtype_name) or read through it (_read_with_safetensors).
_ST_DTYPES: dict[str, torch.dtype] = {
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
        _ST_DTYPES[_name] = getattr(torch, _attr)
_ST_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}


@dataclass
class ExportResult:
    """What :func:`export_fp8_checkpoint` wrote.

    Attributes:
        path: the checkpoint directory.
        quantized: number of weights stored in FP8 (each with a ``_scale_inv``).
        passed_through: number of tensors stored as they came.
        shards: number of safetensors files.
        bytes: total bytes of tensor data written.
        quantization_config: the mapping written into ``config.json``.
    """

    path: Path
    quantized: int = 0
    passed_through: int = 0
    shards: int = 0
    bytes: int = 0
    quantization_config: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- arguments


def _read_config(config: Any, source_dir: Path | None) -> dict[str, Any]:
    if config is None and source_dir is not None:
        config = source_dir / "config.json"
        if not config.exists():
            raise FP8ConfigError(
                f"{source_dir} has no config.json",
                key="config",
                hint="pass config= (the model's Hugging Face config)",
            )
    if config is None:
        raise FP8ConfigError(
            "a state dict needs the model's Hugging Face config",
            key="config",
            hint="pass config= (a mapping or a path to config.json)",
        )
    if isinstance(config, (str, os.PathLike)):
        from ..config import regular_file

        path = Path(config)
        if not str(config):
            raise FP8ConfigError("expected a config.json path, got ''", key="config", value="")
        if path.is_dir():
            path = path / "config.json"
        regular_file(path, key="config", what="config.json")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise FP8ConfigError(
                f"cannot read {path}: {format_value(str(exc))}", key="config", value=str(path)
            ) from None
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise FP8ConfigError(
            f"expected a mapping or a config.json path, got {format_value(config)}",
            key="config",
            value=config,
        )
    return dict(config)


def _num_layers(config: Mapping[str, Any]) -> int | None:
    for holder in (config, config.get("text_config") or {}):
        value = holder.get("num_hidden_layers") if isinstance(holder, Mapping) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _check_flag(key: str, value: Any, *, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if not isinstance(value, bool):  # "false" is a mistake, not True
        expected = "True, False or None" if none_ok else "True or False"
        raise FP8ConfigError(
            f"expected {expected}, got {format_value(value)}", key=key, value=value
        )


def _check_out_dir(out: Path, source_dir: Path | None, overwrite: bool) -> None:
    """Refuse, before any tensor is read, an output that cannot or must not be written."""
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise FP8ConfigError(
                f"{out} already exists",
                key="out_dir",
                value=str(out),
                hint="pick a new directory or pass overwrite=True",
            )
        if out.is_symlink() or not out.is_dir():
            # overwrite replaces a checkpoint directory, never a file, a device or a link
            what = "a symbolic link" if out.is_symlink() else "not a directory"
            raise FP8ConfigError(
                f"{out} is {what}; overwrite=True replaces only a checkpoint directory",
                key="out_dir",
                value=str(out),
            )
    if source_dir is not None:
        if same_file(out, source_dir):
            raise FP8ConfigError("out_dir is the source directory", key="out_dir", value=str(out))
        resolved_out, resolved_src = out.resolve(), source_dir.resolve()
        if overwrite and resolved_out in resolved_src.parents:
            raise FP8ConfigError(
                f"out_dir {out} contains the source directory {source_dir}; replacing it "
                f"would delete the source",
                key="out_dir",
                value=str(out),
            )
    check_output_dir(out, "out_dir")  # the parent exists or can be made, and is writable


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file, from its header."""

    name: str
    file: Path
    dtype: str  # the safetensors spelling (BF16, F32, ...)
    shape: tuple[int, ...]
    begin: int  # absolute offsets in the file
    end: int


def _safetensors_files(source: Path) -> list[Path]:
    from ..config import safetensors_files

    # Index entries stay inside the directory; only regular files are opened (a FIFO blocks).
    files = safetensors_files(source, key="source")
    if not files:
        other = [p.name for p in source.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        hint = (
            "convert it to safetensors first (transformers: save_pretrained(..., "
            "safe_serialization=True))"
            if other
            else None
        )
        raise FP8ConfigError(
            f"no *.safetensors files in {source}", key="source", value=str(source), hint=hint
        )
    return files


def _bad_file(path: Path, why: str) -> FP8ConfigError:
    return FP8ConfigError(
        f"{path} is not a readable safetensors file ({why})", key="source", value=str(path)
    )


def _read_header(path: Path) -> list[_Entry]:
    """The tensors of one safetensors file, in file order, checked as the format requires
    (offsets inside the file, contiguous, sizes matching shapes) before any data is read."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise _bad_file(path, "shorter than a header")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER_BYTES or 8 + n > size:
                raise _bad_file(path, f"header length {n} does not fit the file")
            text = fh.read(n)
    except OSError as exc:
        raise FP8ConfigError(
            f"cannot read {path}: {exc.strerror or exc}", key="source", value=str(path)
        ) from None
    try:
        header = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." past the stack
        raise _bad_file(path, f"header is not JSON: {format_value(str(exc))}") from None
    if not isinstance(header, dict):
        raise _bad_file(path, "header is not a JSON object")
    base = 8 + n
    entries: list[_Entry] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
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
            raise _bad_file(path, f"bad header entry for {format_value(name)}")
        numel = 1
        for d in shape:
            numel *= d
        known = _ST_DTYPES.get(dtype)
        if known is not None and (end - begin) != numel * known.itemsize:
            raise _bad_file(path, f"{format_value(name)}: {end - begin} bytes for {shape} {dtype}")
        entries.append(_Entry(name, path, dtype, tuple(shape), base + begin, base + end))
    entries.sort(key=lambda e: (e.begin, e.end))
    at = base
    for e in entries:
        if e.begin != at:
            raise _bad_file(path, f"{format_value(e.name)}: data offsets are not contiguous")
        at = e.end
    if at != size:
        raise _bad_file(path, f"data ends at byte {at}, the file has {size}")
    return entries


def _plan(files: list[Path]) -> list[_Entry]:
    """Every tensor of the checkpoint, from the headers alone; a name in two shards is
    refused here, before any work (which copy would win is not ours to guess)."""
    entries: list[_Entry] = []
    seen: dict[str, Path] = {}
    for path in files:
        for e in _read_header(path):
            if e.name in seen:
                raise FP8ConfigError(
                    f"tensor {format_value(e.name)} appears in both {seen[e.name].name} and "
                    f"{path.name}",
                    key=e.name,
                )
            seen[e.name] = path
            entries.append(e)
    return entries


def _read_into(fh: BinaryIO, view: memoryview, path: Path) -> None:
    done = 0
    while done < len(view):
        got = fh.readinto(view[done:])
        if not got:
            raise _bad_file(path, "it ended early (truncated while being read?)")
        done += got


def _read_with_safetensors(entry: _Entry) -> torch.Tensor:
    """A dtype this module does not spell (a newer format addition): read by the library."""
    from safetensors import safe_open

    try:
        with safe_open(str(entry.file), framework="pt") as fh:
            return fh.get_tensor(entry.name).clone()  # off the memory map before it closes
    except Exception as exc:  # the library's own error types; the file is the user's
        raise _bad_file(entry.file, format_value(str(exc))) from None


def _map(fh: BinaryIO, entry: _Entry, dtype: torch.dtype) -> torch.Tensor | None:
    """The tensor's bytes mapped from the file (a private mapping of just this tensor, so
    its pages count as resident only while the tensor lives), or None where a mapping does
    not fit (data not aligned to the element size)."""
    if entry.begin % dtype.itemsize:
        return None
    start = entry.begin - entry.begin % mmap.ALLOCATIONGRANULARITY
    try:
        mm = mmap.mmap(fh.fileno(), entry.end - start, offset=start, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None
    if hasattr(mm, "madvise"):
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_SEQUENTIAL)
    raw = torch.frombuffer(
        mm, dtype=torch.uint8, count=entry.end - entry.begin, offset=entry.begin - start
    )
    return raw.view(dtype).reshape(entry.shape)  # holds the mapping until it is freed


def _stream_entries(entries: list[_Entry], on_done) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor in file order: mapped from the file (one mapping per tensor, released
    with the tensor, so about one tensor's pages are resident, not the shard's), or where a
    mapping does not fit, read into a buffer of its own (not a reused one: the consumer's
    generator still holds the previous tensor when it asks for the next).
    """
    fh: BinaryIO | None = None
    open_path: Path | None = None
    try:
        for e in entries:
            dtype = _ST_DTYPES.get(e.dtype)
            nbytes = e.end - e.begin
            if dtype is None or sys.byteorder != "little":
                tensor = _read_with_safetensors(e)
            elif nbytes == 0:
                tensor = torch.empty(e.shape, dtype=dtype)
            else:
                if e.file != open_path:
                    if fh is not None:
                        fh.close()
                    fh, open_path = open(e.file, "rb", buffering=0), e.file
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                mapped = _map(fh, e, dtype)
                if mapped is not None:
                    tensor = mapped
                else:
                    raw = torch.empty(nbytes, dtype=torch.uint8)
                    fh.seek(e.begin)
                    _read_into(fh, memoryview(raw.numpy()), e.file)
                    tensor = raw.view(dtype).reshape(e.shape)
                del mapped
            yield e.name, tensor
            del tensor
            on_done(nbytes)
    except OSError as exc:
        where = open_path if open_path is not None else (entries[0].file if entries else "")
        raise FP8ConfigError(
            f"cannot read {where}: {exc.strerror or exc}", key="source", value=str(where)
        ) from None
    finally:
        if fh is not None:
            fh.close()


def _stream_mapping(source: Mapping, on_done) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in source.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise FP8ConfigError(
                f"expected tensor names mapped to torch.Tensor, got {format_value(name)}: "
                f"{type(tensor).__name__}",
                key="source",
            )
        yield name, tensor
        on_done(tensor.numel() * tensor.element_size())


def _progress_bar(total: int, enabled: bool | None):
    """A byte counter on stderr (tqdm's rule when ``enabled`` is None: only on a terminal)."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the analyze extra; without it, no bar
        return None
    return tqdm(
        total=total,
        desc="export",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=None if enabled is None else not enabled,
        leave=False,
    )


# --------------------------------------------------------------------------- writing


@functools.cache
def _st_dtype_name(dtype: torch.dtype) -> str | None:
    """The safetensors spelling of a dtype outside the table, as the library writes it."""
    try:
        from safetensors.torch import save

        blob = save({"x": torch.empty(1, dtype=dtype)})
        (n,) = struct.unpack("<Q", blob[:8])
        return str(json.loads(blob[8 : 8 + n])["x"]["dtype"])
    except Exception:  # no safetensors, or a dtype it cannot store
        return None


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


class _ShardWriter:
    """Writes safetensors shards of at most ``max_bytes`` (header included) into a directory,
    each tensor as it arrives.

    A shard reserves header room when it opens (``_room``), writes tensor data after it, and
    closes when the next tensor would pass ``max_bytes`` or its header would outgrow the
    room; closing writes the header, padded with spaces to the reserved size.

    Writes are synchronous. A writer thread overlapping the next tensor's quantization gave
    no clear gain on the 2-core machine (the quantizer's OpenMP threads then share a core
    with it), and it would break the memory bound: a passed-through tensor still being
    written, the next tensor and its FP8 copy reach 2.5x the largest tensor.
    """

    _META = '"__metadata__":{"format":"pt"}'

    def __init__(self, directory: Path, max_bytes: int, shown: Path) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.shown = shown  # the path errors name (the temporary directory is ours)
        self.default_room = min(max(_round8(max_bytes // 64), 1024), 2**20)
        self.files: list[tuple[Path, list[str]]] = []
        self.names: set[str] = set()
        self.total_bytes = 0
        self._fh: BinaryIO | None = None
        self._handles: list[BinaryIO] = []  # closed when their shard is, or by abort
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
        dtype = _ST_NAMES.get(tensor.dtype) or _st_dtype_name(tensor.dtype)
        if dtype is None:
            raise FP8ConfigError(
                f"tensor {format_value(name)} has dtype {tensor.dtype}, which safetensors "
                f"cannot store",
                key=name,
            )
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.resolve_conj().resolve_neg().contiguous()
        size = t.numel() * t.element_size()
        if self._fh is not None:
            fragment = self._fragment(name, dtype, t.shape, self._data, size)
            if (
                self._header_len + 1 + len(fragment) > self._room
                or 8 + self._room + self._data + size > self.max_bytes
            ):
                self.close_shard()
        if self._fh is None:
            fragment = self._fragment(name, dtype, t.shape, 0, size)
            # room for this entry and its scale's, whatever the name's length
            self._open(max(self.default_room, _round8(len(self._META) + 8 + 3 * len(fragment))))
        self._fragments.append(fragment)
        self._shard_names.append(name)
        self._header_len += 1 + len(fragment)
        self.names.add(name)
        if size:
            fh = self._fh
            assert fh is not None  # opened above
            try:
                fh.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            except OSError as exc:
                raise self._fail(exc) from None
        self._data += size
        self.total_bytes += size

    @staticmethod
    def _fragment(name: str, dtype: str, shape, begin: int, size: int) -> str:
        info = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, begin + size]}
        return json.dumps(name) + ":" + json.dumps(info, separators=(",", ":"))

    def _open(self, room: int) -> None:
        self._path = self.directory / f".shard-{len(self.files) + 1:05d}.safetensors"
        self._room = room
        self._fragments, self._shard_names, self._data = [], [], 0
        self._header_len = 2 + len(self._META)  # the braces and the metadata entry
        try:
            self._fh = open(self._path, "wb")
            self._handles.append(self._fh)
            self._fh.seek(8 + room)
        except OSError as exc:
            raise self._fail(exc) from None

    def close_shard(self) -> None:
        if self._fh is None or self._path is None:
            return
        header = "{" + ",".join([self._META, *self._fragments]) + "}"
        data = header.encode("ascii")  # json.dumps escapes every non-ASCII character
        if len(data) != self._header_len or len(data) > self._room:  # pragma: no cover
            raise AssertionError(f"safetensors header size {len(data)} != {self._header_len}")
        fh, self._fh = self._fh, None
        try:
            fh.seek(0)
            fh.write(struct.pack("<Q", self._room) + data.ljust(self._room))  # spaces
            fh.close()
        except OSError as exc:
            raise self._fail(exc) from None
        self.files.append((self._path, self._shard_names))

    def abort(self) -> None:
        """Close what is open (after a failure; the caller removes the files)."""
        for fh in self._handles:
            fh.close()  # a no-op for those already closed
        self._fh = None

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


# --------------------------------------------------------------------------- the export


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def _ignored_layers(
    high_precision_weights: Iterable[str], quantized_modules: set[str]
) -> list[str]:
    """Modules with a weight left in high precision; vLLM's fp8 method must skip them.

    Embeddings and the output head are left out (vLLM's fp8 method never quantizes them).
    """
    from ..rules import names

    out: list[str] = []
    for weight in high_precision_weights:
        module = _module_of(weight)
        leaf = module.rsplit(".", 1)[-1]
        if (
            module in quantized_modules
            or "embed" in leaf
            or names.builtin_high_precision(module) == "output_head"
        ):
            continue
        out.append(module)
        unit = names.generic_unit(module)
        if unit is not None and unit.endswith(".mlp.experts") and unit not in quantized_modules:
            out.append(unit)
    return list(dict.fromkeys(out))


def _quantization_config(spec, ignored: list[str]) -> dict[str, Any]:
    if spec.scaling == "block":
        cfg: dict[str, Any] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(spec.weight_block),
            "ignored_layers": ignored,
        }
        if spec.pow2_scales:
            cfg["pow2_scales"] = True  # read by nemo_fp8; vLLM's fp8 method ignores it
        return cfg
    from ..hosts.vllm import quantization_config

    cfg = quantization_config(spec)
    cfg.pop("_warnings", None)
    cfg["ignored_layers"] = ignored
    cfg["num_first_layers_in_bf16"] = cfg["num_last_layers_in_bf16"] = 0
    return cfg


def export_fp8_checkpoint(
    source: Mapping[str, torch.Tensor] | str | os.PathLike,
    out_dir: str | os.PathLike,
    spec: Any = "fp8_blockwise",
    *,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    copy_other_files: bool = True,
    progress: bool | None = None,
) -> ExportResult:
    """Quantize a model's weights and write a checkpoint vLLM loads natively.

    Tensors stream through one at a time (read, quantize, append to the current output
    shard), so memory stays at about one source tensor and its FP8 copy whatever the size
    of the checkpoint or its shards.

    Args:
        source: a state dict in Hugging Face naming (``{name: tensor}``, any device), or a
            Hugging Face checkpoint directory with safetensors weights and ``config.json``.
        out_dir: the directory to create. It must not exist unless ``overwrite``.
        spec: the recipe (name, ``fp8:``-style mapping or :class:`~nemo_fp8_plugin.spec.RecipeSpec`);
            its scaling, tiles, ``pow2_scales`` and generation-side BF16 rules decide what is
            quantized. Default ``"fp8_blockwise"``.
        config: the model's Hugging Face config (mapping, ``config.json`` path, or an object
            with ``to_dict``). Required for a state dict; defaults to ``source/config.json``.
        max_shard_bytes: largest safetensors file written (header included), unless one
            tensor alone is larger. Default 5 GiB.
        overwrite: replace an existing ``out_dir`` directory (atomically). Default False.
        copy_other_files: copy the source directory's other files (tokenizer, generation
            config, ...). Default True.
        progress: a progress bar on stderr (bytes of the source done): True, False, or None
            (default) for one only when stderr is a terminal.

    Returns:
        An :class:`ExportResult` (path, counts, the ``quantization_config`` written).

    Raises:
        FP8ConfigError: a bad argument (named by ``key``), a source that is not a readable
            safetensors checkpoint, an output that exists or cannot be written.
    """
    from ..registry import get_recipe

    if isinstance(out_dir, bool) or not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
        raise FP8ConfigError(
            f"expected a directory path, got {format_value(out_dir)}", key="out_dir", value=out_dir
        )
    _check_flag("overwrite", overwrite)
    _check_flag("copy_other_files", copy_other_files)
    _check_flag("progress", progress, none_ok=True)
    if not (
        config is None
        or isinstance(config, (Mapping, str, os.PathLike))
        or hasattr(config, "to_dict")
    ):
        raise FP8ConfigError(
            f"expected a mapping, a config.json path or None, got {format_value(config)}",
            key="config",
        )
    try:
        spec = get_recipe(spec)
    except FP8ConfigError as err:  # the argument is `spec`
        key = "spec" if err.key in (None, "recipe") else f"spec.{err.key}"
        raise FP8ConfigError(err.bare_message, key=key, value=err.value, hint=err.hint) from None
    if spec.generation != "fp8" or spec.scaling not in ("block", "mx"):
        raise FP8ConfigError(
            f"recipe {spec.name!r} has no FP8 generation checkpoint format "
            f"(scaling: {spec.scaling}, generation: {spec.generation})",
            key="spec",
            value=spec.name,
            hint="export block (fp8_blockwise, fp8_subchannel) or mxfp8 recipes",
        )
    if (
        isinstance(max_shard_bytes, bool)
        or not isinstance(max_shard_bytes, int)
        or max_shard_bytes <= 0
    ):
        raise FP8ConfigError(
            f"expected a positive number of bytes, got {format_value(max_shard_bytes)}",
            key="max_shard_bytes",
            value=max_shard_bytes,
        )
    source_dir: Path | None = None
    entries: list[_Entry] | None = None
    if isinstance(source, (str, os.PathLike)):
        if not str(source):
            raise FP8ConfigError("expected a checkpoint directory, got ''", key="source", value="")
        source_dir = Path(source)
        if not source_dir.is_dir():
            raise FP8ConfigError(
                f"checkpoint directory not found: {source_dir}", key="source", value=str(source_dir)
            )
        entries = _plan(_safetensors_files(source_dir))
        total = sum(e.end - e.begin for e in entries)
    elif isinstance(source, Mapping):
        total = sum(
            v.numel() * v.element_size() for v in source.values() if isinstance(v, torch.Tensor)
        )
    else:
        raise FP8ConfigError(
            f"expected a state dict or a checkpoint directory, got {format_value(source)}",
            key="source",
        )
    hf_config = _read_config(config, source_dir)

    out = Path(out_dir)
    _check_out_dir(out, source_dir, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name[:64]}.", suffix=".tmp", dir=out.parent))
    bar = None

    def done(nbytes: int) -> None:
        if bar is not None:
            bar.update(nbytes)

    named: Iterable[tuple[str, torch.Tensor]]
    if entries is not None:
        named = _stream_entries(entries, done)
    else:
        assert isinstance(source, Mapping)
        named = _stream_mapping(source, done)
    try:
        bar = _progress_bar(total, progress)
        result = _write(
            tmp, out, named, spec, hf_config, max_shard_bytes, source_dir, copy_other_files
        )
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    result.path = out
    return result


def _write(
    tmp: Path,
    out: Path,
    named: Iterable[tuple[str, torch.Tensor]],
    spec,
    hf_config: dict,
    max_shard_bytes: int,
    source_dir: Path | None,
    copy_other_files: bool,
) -> ExportResult:
    from .refit import quantize_for_refit

    writer = _ShardWriter(tmp, max_shard_bytes, shown=out)
    result = ExportResult(path=tmp)
    quantized_modules: set[str] = set()
    high_precision: list[str] = []
    try:
        for name, tensor in quantize_for_refit(named, spec, num_layers=_num_layers(hf_config)):
            writer.add(name, tensor)
            if name.endswith(_SCALE_SUFFIX):
                quantized_modules.add(_module_of(name[: -len(_SCALE_SUFFIX)]))
                result.quantized += 1
            elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                pass
            else:
                result.passed_through += 1
                if name.endswith(".weight") and tensor.dim() in (2, 3):
                    high_precision.append(name)
            del tensor
        weight_map = writer.finish()
    finally:
        writer.abort()
    result.shards = len(writer.files)
    result.bytes = writer.total_bytes
    if len(writer.files) > 1:
        index = {"metadata": {"total_size": writer.total_bytes}, "weight_map": weight_map}
        atomic_write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")

    qcfg = _quantization_config(spec, _ignored_layers(high_precision, quantized_modules))
    result.quantization_config = qcfg
    new_config = dict(hf_config)
    new_config["quantization_config"] = qcfg
    atomic_write_text(tmp / "config.json", json.dumps(new_config, indent=2, sort_keys=False) + "\n")

    if source_dir is not None and copy_other_files:
        for item in source_dir.iterdir():
            if item.name == "config.json" or any(item.match(p) for p in WEIGHT_FILES):
                continue
            if item.is_file():  # regular files (a link's target); no FIFO, no directory
                shutil.copy2(item, tmp / item.name)
    return result


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory to ``out``; an existing ``out`` is replaced only after
    the new one is complete."""
    if not out.exists():
        os.replace(tmp, out)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{out.name[:64]}.", suffix=".old", dir=out.parent))
    backup.rmdir()
    os.replace(out, backup)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(backup, out)
        raise
    shutil.rmtree(backup, ignore_errors=True)

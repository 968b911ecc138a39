"""Streaming a safetensors checkpoint: which tensors are linear weights, read one at a time.

A pass over the headers (:func:`scan_headers`) decides what to read and why the rest is
skipped; :func:`iter_tensors` then reads the chosen tensors one by one through
``safetensors.safe_open`` (memory-mapped), so at most one tensor and its quantized copies are
in memory, never the model.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Generator, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import FP8ConfigError
from ..rules.names import builtin_high_precision

if TYPE_CHECKING:
    from safetensors import safe_open

_T = TypeVar("_T")

__all__ = [
    "checkpoint_files",
    "open_checkpoint_file",
    "skip_reason",
    "scan_headers",
    "iter_tensors",
    "progress_bar",
    "natural_key",
]

_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_FP8_DTYPES = {"F8_E4M3", "F8_E5M2", "F8_E8M0"}
_EMBEDDING = re.compile(
    r"(?:^|\.)(?:embed_tokens|word_embeddings|position_embeddings|"
    r"token_type_embeddings|wte|wpe|embeddings?)(?:\.|$)"
)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The ``.safetensors`` files of a checkpoint (a file, or a directory with or without a
    ``model.safetensors.index.json``)."""
    from .._io import regular_file, safetensors_files

    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        return [regular_file(path, key="CHECKPOINT", what="checkpoint file")]  # no FIFO
    if not path.is_dir():
        raise FP8ConfigError(f"checkpoint not found: {path}", key="CHECKPOINT", value=str(path))
    # Index entries stay inside the directory; only regular files are opened.
    files = safetensors_files(path, key="CHECKPOINT")
    if not files:
        raise FP8ConfigError(
            f"no .safetensors files in {path}",
            key="CHECKPOINT",
            value=str(path),
            hint="analyze reads Hugging Face safetensors checkpoints",
        )
    return files


def open_checkpoint_file(file: Path) -> safe_open:
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error types; the file is the user's
        raise FP8ConfigError(
            f"{file} is not a readable safetensors file ({exc})", key="CHECKPOINT", value=str(file)
        ) from None


def skip_reason(name: str, shape: list[int], dtype: str) -> str | None:
    if not name.endswith(".weight"):
        return "not a weight"
    if dtype in _FP8_DTYPES:
        return "already FP8"
    if dtype not in _FLOAT_DTYPES:
        return f"not a float tensor ({dtype})"
    if len(shape) not in (2, 3):
        return f"{len(shape)}-D, not a linear weight"
    if any(d == 0 for d in shape):
        return "empty"
    module = name[: -len(".weight")]
    if _EMBEDDING.search(module):
        return "embedding (not an FP8 GEMM)"
    builtin = builtin_high_precision(module)
    if builtin == "output_head":
        return "output head (never FP8 on any host)"
    if builtin == "router":
        return "MoE router (kept in high precision)"
    return None


def scan_headers(files: list[Path]) -> tuple[list[tuple[Path, str, list[int], str]], list[dict]]:
    """(file, name, shape, dtype) of every candidate weight, and the tensors skipped, from the
    headers alone."""
    todo, skipped = [], []
    for file in files:
        with open_checkpoint_file(file) as f:
            try:
                keys = list(f.keys())
                for name in keys:
                    sl = f.get_slice(name)
                    shape, dtype = list(sl.get_shape()), str(sl.get_dtype())
                    reason = skip_reason(name, shape, dtype)
                    if reason is None:
                        todo.append((file, name, shape, dtype))
                    elif reason != "not a weight":
                        skipped.append(
                            {"name": name, "shape": shape, "dtype": dtype, "reason": reason}
                        )
            except FP8ConfigError:
                raise
            except Exception as exc:
                raise FP8ConfigError(
                    f"{file} is not a readable safetensors file ({exc})",
                    key="CHECKPOINT",
                    value=str(file),
                ) from None
    return todo, skipped


def iter_tensors(
    todo: Iterable[tuple[Path, str, list[int], str]],
) -> Generator[tuple[Path, str, list[int], str, Any], None, None]:
    """``(file, name, shape, dtype, tensor)`` for each ``(file, name, shape, dtype)`` of
    :func:`scan_headers`, reading one tensor at a time; a file stays open while its tensors
    are read. Close the generator (``contextlib.closing``) if the loop may stop early."""
    handles: dict[Path, Any] = {}
    try:
        for file, name, shape, dtype in todo:
            if file not in handles:
                for h in handles.values():
                    h.__exit__(None, None, None)
                handles = {file: open_checkpoint_file(file).__enter__()}
            try:
                tensor = handles[file].get_tensor(name)
            except Exception as exc:
                raise FP8ConfigError(
                    f"{file}: cannot read tensor {name} ({exc})", key="CHECKPOINT", value=str(file)
                ) from None
            yield file, name, shape, dtype, tensor
            del tensor  # the next tensor is read only once the caller has let this one go
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


def progress_bar(
    iterable: Iterable[_T], total: int, desc: str, enabled: bool | None
) -> Iterable[_T]:
    try:
        from tqdm import tqdm
    except ImportError:  # the analyze extra brings tqdm; without it, no bar
        return iterable
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit="tensor",
        file=sys.stderr,
        disable=None if enabled is None else not enabled,
        leave=False,
    )


def natural_key(name: str) -> list:
    """Sort key putting layer 2 before layer 10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]

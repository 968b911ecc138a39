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
refit sends). Everything streams, one tensor at a time, through
:mod:`nemo_fp8_plugin.rl.safetensors_io` (which says why it is not the safetensors library's
own API: memory): each source tensor is read, quantized, and appended to the current output
shard. Peak memory is about one source tensor and its quantized copy, whatever the checkpoint
or shard size (``tests/rl/test_export_memory.py`` checks it in a fresh process).

What a failure leaves: the directory is built under a temporary name beside ``out_dir``
(``.<name>.nemo-fp8-export-<random>.tmp``) and renamed into place at the end, so a crash
never leaves a half-written checkpoint. SIGTERM and SIGINT raise (:mod:`nemo_fp8_plugin._signals`),
so the temporary directory is removed; the swap of ``overwrite`` (old directory to
``.<name>.nemo-fp8-export-<random>.old``, new one into place) holds them until both renames
are done. What a SIGKILL leaves carries that prefix, and the next export to the same
``out_dir`` removes it (or, where ``out_dir`` itself is missing, puts the old directory back).
A lock file (``.<name>.nemo-fp8-export.lock``, ``flock``) keeps two exports from writing the
same ``out_dir`` at once: the second is refused.

Longer than the package's 600-line guide: the source checks, the streaming write and the
directory swap share the temporary-name, lock and signal protocol above.

Over 600 lines on purpose: one command's path from its arguments to the output directory
swapped into place; no section is used elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._io import check_output_dir, same_file
from .._signals import interruptible, signals_held
from ..capabilities import capability
from ..errors import FP8ConfigError, format_value
from . import safetensors_io as st

if TYPE_CHECKING:
    from ..spec import RecipeSpec

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

MAX_SHARD_BYTES = 2**63 - 1
"""Largest ``max_shard_bytes`` accepted (a file offset is a signed 64-bit number)."""

TEMP_MARK = ".nemo-fp8-export-"
"""What names this module's temporary entries beside ``out_dir``:
``.<name>`` + TEMP_MARK + ``<random>.tmp`` (the new directory) or ``.old`` (the one it
replaces), and ``.<name>.nemo-fp8-export.lock``."""

_SCALE_SUFFIX = "_scale_inv"


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
        skipped: entries of the source directory not copied (subdirectories such as
            ``original/``, FIFOs and other non-regular files), by name.
        outside: symbolic links of the source directory not copied because they point out
            of it (a Hugging Face cache snapshot's links into its ``blobs`` are followed),
            by name.
    """

    path: Path
    quantized: int = 0
    passed_through: int = 0
    shards: int = 0
    bytes: int = 0
    quantization_config: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- arguments


def _read_config(config: Any, source_dir: Path | None) -> dict[str, Any]:
    # The checkpoint's own config.json is blamed on the checkpoint the user named, not on a
    # config= (--model-config) they never passed.
    key = "source" if config is None and source_dir is not None else "config"
    if config is None and source_dir is not None:
        from .._io import inside_checkpoint

        config = source_dir / "config.json"
        if not config.exists():
            raise FP8ConfigError(
                f"{source_dir} has no config.json",
                key="config",
                hint="pass config= (the model's Hugging Face config)",
            )
        if not inside_checkpoint(config, source_dir):  # it is copied into the output
            raise FP8ConfigError(
                f"{config} is a symbolic link out of the checkpoint directory",
                key="config",
                value=str(config),
                hint="pass config= naming the model's config.json",
            )
    if config is None:
        raise FP8ConfigError(
            "a state dict needs the model's Hugging Face config",
            key="config",
            hint="pass config= (a mapping or a path to config.json)",
        )
    if isinstance(config, (str, os.PathLike)):
        from .._io import read_user_json

        path = Path(config)
        if not str(config):
            raise FP8ConfigError("expected a config.json path, got ''", key="config", value="")
        if path.is_dir() and key == "config":  # --model-config naming the model's folder
            path = path / "config.json"
        # a regular file within LIMITS.config_bytes, nesting and digits bounded
        config = read_user_json(path, key=key, what="config.json")
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise FP8ConfigError(
            f"expected a mapping or a config.json path, got {format_value(config)}",
            key=key,
            value=config,
        )
    return dict(config)


_QUANTIZED_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F8_E8M0"})
"""Safetensors dtypes of quantized weights and their scales (FP8, MX E8M0)."""

_INTEGER_DTYPES = frozenset({"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64"})
"""Safetensors integer dtypes: a ``.weight`` in one is a quantized weight (int8, bitsandbytes,
packed 4-bit), never one to convert; exported as it came it would sit under an FP8 config."""

_QUANTIZED_NAMES = (_SCALE_SUFFIX, ".weight_scale", ".input_scale", ".qweight", ".weight_packed")
"""Tensor name endings of a quantized checkpoint (FP8's, ModelOpt's, AWQ / GPTQ, compressed-tensors)."""


def _refuse_quantized(
    hf_config: Mapping[str, Any],
    entries: list[st.Entry] | None,
    source: Any,
    *,
    config_key: str,
) -> None:
    """A source that is already quantized is refused before any work: its FP8 weights would
    pass through as they are beside scales in another layout, and its ``quantization_config``
    would be replaced, so the output would claim a recipe its tensors do not follow."""
    for holder in ("quantization_config", "compression_config"):
        if hf_config.get(holder) is not None:
            qcfg = hf_config[holder]
            method = qcfg.get("quant_method") if isinstance(qcfg, Mapping) else None
            raise FP8ConfigError(
                f"the checkpoint is already quantized: its config.json has {holder}"
                + (f" (quant_method: {format_value(method)})" if method is not None else ""),
                key=config_key,
                value=format_value(qcfg),
                hint="export the unquantized (BF16, FP16 or FP32) checkpoint",
            )
    if entries is not None:
        named = ((e.name, e.dtype) for e in entries)
    else:
        named = ((n, st.st_dtype_name(t.dtype) or str(t.dtype)) for n, t in source.items())
    for name, dtype in named:
        if dtype in _INTEGER_DTYPES and name.endswith(".weight"):
            raise FP8ConfigError(
                f"the checkpoint is already quantized: tensor {format_value(name)} is {dtype}, "
                f"an integer weight",
                key="source",
                value=name,
                hint="export the unquantized (BF16, FP16 or FP32) checkpoint",
            )
        if dtype in _QUANTIZED_DTYPES or name.endswith(_QUANTIZED_NAMES):
            raise FP8ConfigError(
                f"the checkpoint is already quantized: tensor {format_value(name)} is "
                f"{'a quantized weight or scale' if dtype not in _QUANTIZED_DTYPES else dtype}",
                key="source",
                value=name,
                hint="export the unquantized (BF16, FP16 or FP32) checkpoint",
            )


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
    check_output_dir(out, "out_dir")  # the parent exists and is writable


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


def _quantization_config(spec: RecipeSpec, ignored: list[str]) -> dict[str, Any]:
    from ..numerics.reference import check_block

    if capability(spec.scaling).is_block:
        cfg: dict[str, Any] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(check_block(spec.weight_block, key="weight_block")),
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
        source: a state dict in Hugging Face naming (``{name: tensor}``, any device), a
            Hugging Face checkpoint directory with safetensors weights and ``config.json``,
            or the one ``*.safetensors`` file of such a directory (one without an index).
        out_dir: the directory to create. It must not exist unless ``overwrite``.
        spec: the recipe (name, ``fp8:``-style mapping or :class:`~nemo_fp8_plugin.spec.RecipeSpec`);
            its scaling, tiles, ``pow2_scales`` and generation-side BF16 rules decide what is
            quantized. Default ``"fp8_blockwise"``.
        config: the model's Hugging Face config (mapping, ``config.json`` path, or an object
            with ``to_dict``). Required for a state dict; defaults to the source directory's
            ``config.json``.
        max_shard_bytes: largest safetensors file written (header included), unless one
            tensor alone is larger. Default 5 GiB.
        overwrite: replace an existing ``out_dir`` directory (atomically). Default False.
        copy_other_files: copy the source directory's other regular files (tokenizer,
            generation config, ...); subdirectories are not copied and are listed in
            :attr:`ExportResult.skipped`. Default True.
        progress: a progress bar on stderr (bytes of the source done): True, False, or None
            (default) for one only when stderr is a terminal.

    Returns:
        An :class:`ExportResult` (path, counts, the ``quantization_config`` written).

    Raises:
        FP8ConfigError: a bad argument (named by ``key``), a source that is not a readable
            safetensors checkpoint, an output that exists, cannot be written, or is being
            written by another export (a lock).
    """
    spec = _check_args(out_dir, spec, config, max_shard_bytes, overwrite, copy_other_files)
    source_dir, entries, total = _source(source)
    hf_config = _read_config(config, source_dir)
    _refuse_quantized(
        hf_config, entries, source, config_key="source" if config is None else "config"
    )
    out = Path(out_dir)
    _check_out_dir(out, source_dir, overwrite)
    _check_flag("progress", progress, none_ok=True)
    with interruptible(), _locked(out):
        _check_out_dir(out, source_dir, overwrite)  # again: another export may have finished
        bar = _progress_bar(total, progress)
        named: Iterator[tuple[str, torch.Tensor]]
        if entries is not None:
            named = st.stream_entries(entries, bar.update if bar is not None else _ignore)
        else:
            assert isinstance(source, Mapping)
            named = _stream_mapping(source, bar.update if bar is not None else _ignore)
        tmp = _make_temp_dir(out)
        try:
            args = (spec, hf_config, max_shard_bytes, source_dir, copy_other_files)
            result = _write(tmp, out, named, *args)
            _swap_into_place(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if bar is not None:
                bar.close()
    result.path = out
    return result


def _ignore(nbytes: int) -> None:
    """No progress bar: the byte counts go nowhere."""


def _check_args(
    out_dir: object,
    spec: Any,
    config: object,
    max_shard_bytes: object,
    overwrite: object,
    copy_other_files: object,
) -> RecipeSpec:
    """Every argument but the source and ``progress`` checked; returns the recipe."""
    from ..registry import get_recipe

    if isinstance(out_dir, bool) or not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
        raise FP8ConfigError(
            f"expected a directory path, got {format_value(out_dir)}", key="out_dir", value=out_dir
        )
    _check_flag("overwrite", overwrite)
    _check_flag("copy_other_files", copy_other_files)
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
    if spec.generation != "fp8" or not capability(spec.scaling).vllm_generation:
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
        or not 0 < max_shard_bytes <= MAX_SHARD_BYTES
    ):
        raise FP8ConfigError(
            f"expected a positive number of bytes up to {MAX_SHARD_BYTES}, got "
            f"{format_value(max_shard_bytes)}",
            key="max_shard_bytes",
            value=max_shard_bytes,
        )
    return spec


# --------------------------------------------------------------------------- the source


def _source(source: Any) -> tuple[Path | None, list[st.Entry] | None, int]:
    """(source directory, its tensors from the headers, total bytes) for a directory or a
    file; (None, None, total bytes) for a state dict, checked before any work."""
    if isinstance(source, (str, os.PathLike)):
        if not str(source):
            raise FP8ConfigError("expected a checkpoint directory, got ''", key="source", value="")
        path = Path(source)
        if path.is_file() and path.suffix == ".safetensors":
            source_dir, files, index = _single_file(path)
        elif path.is_dir():
            source_dir = path
            files, index = _safetensors_files(path), _index_weight_map(path)
        else:
            raise FP8ConfigError(
                f"checkpoint directory or safetensors file not found: {path}",
                key="source",
                value=str(path),
            )
        entries = st.plan(files, index)
        return source_dir, entries, sum(e.end - e.begin for e in entries)
    if isinstance(source, Mapping):
        for name, tensor in source.items():
            _check_state_dict_item(name, tensor)
        return None, None, sum(v.numel() * v.element_size() for v in source.values())
    raise FP8ConfigError(
        f"expected a state dict or a checkpoint directory, got {format_value(source)}",
        key="source",
    )


def _single_file(path: Path) -> tuple[Path, list[Path], None]:
    """A checkpoint's one weights file (as ``analyze`` accepts it); its directory gives the
    config and the other files. One shard of an indexed checkpoint is refused: the export
    would be part of a model."""
    from .._io import regular_file

    directory = path.parent
    if (directory / "model.safetensors.index.json").exists():
        raise FP8ConfigError(
            f"{path} is one shard of the checkpoint in {directory} (it has "
            f"model.safetensors.index.json); exporting it alone would write part of a model",
            key="source",
            value=str(path),
            hint=f"export the directory {directory}",
        )
    return directory, [regular_file(path, key="source", what="safetensors file")], None


def _safetensors_files(source: Path) -> list[Path]:
    from .._io import safetensors_files

    # Index entries stay inside the directory; only regular files are opened (a FIFO blocks).
    try:
        files = safetensors_files(source, key="source")
    except RecursionError:  # an index nested past the interpreter's stack
        raise FP8ConfigError(
            f"{source / 'model.safetensors.index.json'} is nested too deeply to read",
            key="source",
            value=str(source),
        ) from None
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


def _index_weight_map(source: Path) -> dict[str, str] | None:
    """The index's ``weight_map`` (already checked by ``safetensors_files``), or None."""
    from .._io import _INDEX_BYTES, read_user_json

    index = source / "model.safetensors.index.json"
    if not index.exists():
        return None
    document = read_user_json(index, key="source", what="safetensors index", limit=_INDEX_BYTES)
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    return weight_map if isinstance(weight_map, dict) else None


def _check_state_dict_item(name: Any, tensor: Any) -> None:
    if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
        raise FP8ConfigError(
            f"expected tensor names mapped to torch.Tensor, got {format_value(name)}: "
            f"{type(tensor).__name__}",
            key="source",
        )
    if name == st.METADATA_KEY or tensor.is_meta:
        st.checked_tensor(name, tensor)  # raises, naming the tensor


def _stream_mapping(
    source: Mapping, on_done: Callable[[int], object]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in source.items():
        _check_state_dict_item(name, tensor)  # again: a mapping may change as it is read
        yield name, tensor
        on_done(tensor.numel() * tensor.element_size())


def _progress_bar(total: int, enabled: bool | None) -> Any:
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


def _write(
    tmp: Path,
    out: Path,
    named: Iterable[tuple[str, torch.Tensor]],
    spec: RecipeSpec,
    hf_config: dict,
    max_shard_bytes: int,
    source_dir: Path | None,
    copy_other_files: bool,
) -> ExportResult:
    writer = st.ShardWriter(tmp, max_shard_bytes, shown=out)
    result = ExportResult(path=tmp)
    quantized_modules: set[str] = set()
    high_precision: list[str] = []
    # Writes stay on this thread: a writer thread overlapping the next tensor's quantization
    # (tried, within the memory bound) took more CPU time (median 2.9 s against 2.3 s on the
    # 2.01 GB benchmark checkpoint, 2 shared cores) for no gain in wall time, and doubled
    # the peak memory (the largest tensor still queued while the next one is read).
    try:
        with quantizer_threads():
            for name, tensor in _quantized(named, spec, hf_config):
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
        _write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")

    qcfg = _quantization_config(spec, _ignored_layers(high_precision, quantized_modules))
    result.quantization_config = qcfg
    new_config = dict(hf_config)
    new_config["quantization_config"] = qcfg
    _write_text(tmp / "config.json", json.dumps(new_config, indent=2, sort_keys=False) + "\n")
    if source_dir is not None and copy_other_files:
        result.skipped, result.outside = _copy_other_files(source_dir, tmp)
    return result


def _quantized(
    named: Iterable[tuple[str, torch.Tensor]], spec: RecipeSpec, hf_config: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    from .refit import quantize_for_refit

    return quantize_for_refit(named, spec, num_layers=_num_layers(hf_config))


@contextlib.contextmanager
def quantizer_threads() -> Iterator[None]:
    """torch's (and so the C++ quantizer's) thread count for the export: the cores this
    process may run on that other work is not using now (the 1-minute load average, less
    this process's own share), at least one, at most torch's setting; restored after.
    OpenMP threads that outnumber the free cores wait on each other at every barrier: on a
    loaded 2-core machine two threads made the export 2-3x slower than one."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        others = max(0.0, os.getloadavg()[0] - 1.0)  # this process counts about 1 when busy
    except (AttributeError, OSError):
        others = 0.0
    torch.set_num_threads(max(1, min(before, round((cores or 1) - others))))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _write_text(path: Path, text: str) -> None:
    """A new file in the export's own temporary directory. No temp file and rename of its
    own (the directory is renamed into place whole) and no fsync: an fsync here can make the
    export wait for the disk to take every shard written before it (ext4 commits the
    journal with the data it orders), which a copy of the checkpoint never does. Like a
    copy, the export is durable once the system writes it back (``sync`` to force it)."""
    with open(path, "x", encoding="utf-8") as fh:
        fh.write(text)


def _copy_other_files(source_dir: Path, tmp: Path) -> tuple[list[str], list[str]]:
    """Copy the source's regular non-weight files; returns the names of what was not copied
    (subdirectories, FIFOs, sockets, devices) and of the symbolic links not followed because
    they point out of the checkpoint (``ln -s ~/.ssh/id_rsa ck/notes.txt`` must not end up in
    the output; a Hugging Face snapshot's links into its ``blobs`` are followed)."""
    from .._io import inside_checkpoint

    skipped: list[str] = []
    outside: list[str] = []
    for item in sorted(source_dir.iterdir()):
        if item.name == "config.json" or any(item.match(p) for p in WEIGHT_FILES):
            continue
        # this export's own temporary directory and lock, when OUT lies inside the source
        if item == tmp or TEMP_MARK.rstrip("-") in item.name:
            continue
        if item.is_symlink() and not inside_checkpoint(item, source_dir):
            outside.append(item.name)
        elif item.is_file():  # regular files (a link's target); no FIFO, no directory
            shutil.copy2(item, tmp / item.name)
        else:
            skipped.append(item.name + ("/" if item.is_dir() else ""))
    return skipped, outside


# --------------------------------------------------------------------------- the output


def _stem(out: Path) -> str:
    """``out``'s name as the prefix of its temporary entries: the characters safe in any
    file system and encoding (a name with a non-UTF-8 byte would break a prefix built from
    it), at most 64."""
    return "." + (re.sub(r"[^A-Za-z0-9_.-]", "_", out.name)[:64] or "_")


def _make_temp_dir(out: Path) -> Path:
    """A new directory beside ``out``, created with mode 0777 so the umask decides its
    mode, as for any directory the user makes (``tempfile.mkdtemp`` makes 0700)."""
    for _ in range(100):
        tmp = out.parent / f"{_stem(out)}{TEMP_MARK}{secrets.token_hex(4)}.tmp"
        try:
            os.mkdir(tmp, 0o777)
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name beside {out}")  # pragma: no cover


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Hold ``out``'s lock file for the export (refused if another export holds it), and
    clean what an export to ``out`` killed by SIGKILL left behind."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock, no cleanup
        yield
        return
    lock = out.parent / f"{_stem(out)}{TEMP_MARK[:-1]}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FP8ConfigError(
                f"another export is writing {out} (it holds {lock.name})",
                key="out_dir",
                value=str(out),
                hint="wait for it to finish, or pick another directory",
            ) from None
        # The file may have been removed by the export that held it before: then this lock
        # guards nothing, and the next open makes a new file.
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                break
        os.close(fd)
    try:
        _clean_leftovers(out)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
        os.close(fd)


def _clean_leftovers(out: Path) -> None:
    """Remove the temporary entries an export to ``out`` left when it was killed (called
    with the lock held, so none is in use). A ``.old`` directory with no ``out`` is the old
    output of a swap cut between its two renames: it is put back, not removed."""
    prefix = _stem(out) + TEMP_MARK
    for item in sorted(out.parent.iterdir()):
        if not item.name.startswith(prefix) or item.is_symlink() or not item.is_dir():
            continue
        if item.name.endswith(".old") and not out.exists() and not out.is_symlink():
            os.replace(item, out)
        elif item.name.endswith((".tmp", ".old")):
            shutil.rmtree(item, ignore_errors=True)


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory to ``out``; an existing ``out`` is replaced only after
    the new one is complete, and the swap (two renames and the old directory's removal) is
    not cut by SIGTERM or SIGINT."""
    if not out.exists():
        os.replace(tmp, out)
        return
    backup = out.parent / f"{_stem(out)}{TEMP_MARK}{secrets.token_hex(4)}.old"
    with signals_held() as pending:
        os.replace(out, backup)
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(backup, out)
            raise
        if pending:  # interrupted during the swap: undone, as if the signal came before it
            os.replace(out, tmp)
            os.replace(backup, out)
            return  # the signal is delivered as the block ends; the caller removes tmp
        shutil.rmtree(backup, ignore_errors=True)  # a few files: quick, and never left

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
refit sends). Tensors stream through: a safetensors source is read one tensor at a time and
the output is written in shards of at most ``max_shard_bytes``, so memory stays around one
shard. The directory is built under a temporary name beside ``out_dir`` and renamed into
place at the end, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._io import atomic_write_text
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
        value = holder.get("num_hidden_layers")
        if isinstance(value, int):
            return value
    return None


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


def _stream_dir(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


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


class _ShardWriter:
    """Accumulates tensors and writes safetensors shards of bounded size into a directory."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.pending or any(name in names for _, names in self.files):
            raise FP8ConfigError(
                f"tensor {format_value(name)} appears twice in the source", key=name
            )
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.directory / f".shard-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> dict[str, str]:
        """Rename the shards to Hugging Face names; returns the weight map."""
        self.flush()
        total = len(self.files)
        weight_map: dict[str, str] = {}
        for i, (path, names) in enumerate(self.files, start=1):
            final = (
                "model.safetensors" if total == 1 else f"model-{i:05d}-of-{total:05d}.safetensors"
            )
            path.rename(self.directory / final)
            weight_map.update({n: final for n in names})
        return weight_map


def export_fp8_checkpoint(
    source: Mapping[str, torch.Tensor] | str | os.PathLike,
    out_dir: str | os.PathLike,
    spec: Any = "fp8_blockwise",
    *,
    config: Mapping[str, Any] | str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    copy_other_files: bool = True,
) -> ExportResult:
    """Quantize a model's weights and write a checkpoint vLLM loads natively.

    Args:
        source: a state dict in Hugging Face naming (``{name: tensor}``, any device), or a
            Hugging Face checkpoint directory with safetensors weights and ``config.json``.
        out_dir: the directory to create. It must not exist unless ``overwrite``.
        spec: the recipe (name, ``fp8:``-style mapping or :class:`~nemo_fp8_plugin.spec.RecipeSpec`);
            its scaling, tiles, ``pow2_scales`` and generation-side BF16 rules decide what is
            quantized. Default ``"fp8_blockwise"``.
        config: the model's Hugging Face config (mapping, ``config.json`` path, or an object
            with ``to_dict``). Required for a state dict; defaults to ``source/config.json``.
        max_shard_bytes: largest safetensors file written. Default 5 GiB.
        overwrite: replace an existing ``out_dir`` (atomically). Default False.
        copy_other_files: copy the source directory's other files (tokenizer, generation
            config, ...). Default True.

    Returns:
        An :class:`ExportResult` (path, counts, the ``quantization_config`` written).
    """
    from ..registry import get_recipe

    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
        raise FP8ConfigError(
            f"expected a directory path, got {format_value(out_dir)}", key="out_dir", value=out_dir
        )
    for key, flag in (("overwrite", overwrite), ("copy_other_files", copy_other_files)):
        if not isinstance(flag, bool):  # "false" is a mistake, not True
            raise FP8ConfigError(
                f"expected True or False, got {format_value(flag)}", key=key, value=flag
            )
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
    if isinstance(source, (str, os.PathLike)):
        source_dir = Path(source)
        if not source_dir.is_dir():
            raise FP8ConfigError(
                f"checkpoint directory not found: {source_dir}", key="source", value=str(source_dir)
            )
        named: Iterable[tuple[str, torch.Tensor]] = _stream_dir(_safetensors_files(source_dir))
    elif isinstance(source, Mapping):
        named = source.items()
    else:
        raise FP8ConfigError(
            f"expected a state dict or a checkpoint directory, got {format_value(source)}",
            key="source",
        )
    hf_config = _read_config(config, source_dir)

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FP8ConfigError(
            f"{out} already exists",
            key="out_dir",
            value=str(out),
            hint="pick a new directory or pass overwrite=True",
        )
    if source_dir is not None and out.resolve() == source_dir.resolve():
        raise FP8ConfigError("out_dir is the source directory", key="out_dir", value=str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        result = _write(tmp, named, spec, hf_config, max_shard_bytes, source_dir, copy_other_files)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.path = out
    return result


def _write(
    tmp: Path,
    named,
    spec,
    hf_config: dict,
    max_shard_bytes: int,
    source_dir: Path | None,
    copy_other_files: bool,
) -> ExportResult:
    from .refit import quantize_for_refit

    writer = _ShardWriter(tmp, max_shard_bytes)
    result = ExportResult(path=tmp)
    quantized_modules: set[str] = set()
    high_precision: list[str] = []
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
    weight_map = writer.finish()
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
            if item.is_file():
                shutil.copy2(item, tmp / item.name)
    return result


def _swap_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory to ``out``; an existing ``out`` is replaced only after
    the new one is complete."""
    if not out.exists():
        os.replace(tmp, out)
        return
    backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
    backup.rmdir()
    os.replace(out, backup)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(backup, out)
        raise
    shutil.rmtree(backup, ignore_errors=True)

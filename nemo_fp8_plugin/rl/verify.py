"""Verify a refit: does the generation engine hold the FP8 grid the trainer's weights give?

After a refit the engine should hold, for every linear weight the recipe puts in FP8, exactly
the codes and scales that the trainer's weight quantizes to with the recipe's numerics, and
for every other weight the trainer's values. :func:`verify_refit` checks that, weight by
weight, and says per weight: bit-equal, equal within the scale difference two faithful
quantizers show (``within_ulp``: see :mod:`nemo_fp8_plugin.numerics.refit_diff`), different
(with the worst tile), or missing. ``nemo-fp8 verify-refit`` is its command line.

What the engine holds comes as one of:

* a checkpoint directory or ``*.safetensors`` file in the layout ``nemo-fp8 export`` writes
  (``<name>`` float8, ``<name>_scale_inv``): an exported checkpoint, or a dump of a running
  ``nemo_fp8`` engine (:func:`dump_engine_weights`);
* a mapping of such tensors;
* the vLLM model itself, in the engine's process (``worker.model_runner.get_model()``).

The trainer's weights: a Hugging Face checkpoint (directory or file) or a state dict in
Hugging Face naming, high precision. They are requantized with the numerics the recipe
claims: ``"te"`` (Transformer Engine's, :func:`nemo_fp8_plugin.rl.quantize_for_refit`: what
the trainer-side refit sends and what the ``nemo_fp8`` method quantizes on arrival with) or
``"nemo_rl"`` (NeMo RL's vLLM worker quantizer, ``cast_tensor_to_fp8_blockwise``,
:func:`nemo_fp8_plugin.numerics.nemo_rl_numerics.quantize_weight_nemo_rl`). Which weights are
FP8 is the recipe's generation-side BF16 rules, as the refit quantizer decides it.

Files stream: one trainer tensor, and the engine tensors of the same name, at a time.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import FP8ConfigError, format_value
from ..numerics.reference import check_block
from ..numerics.refit_diff import (
    STATUSES,
    WeightCheck,
    compare_high_precision,
    compare_quantized,
    missing_weight,
)
from . import safetensors_io as st

if TYPE_CHECKING:
    from ..spec import RecipeSpec

__all__ = ["NUMERICS", "RefitReport", "dump_engine_weights", "verify_refit"]

NUMERICS = ("te", "nemo_rl")
"""How the trainer's weights are requantized: Transformer Engine's numerics (the plugin's
refit quantizer and the ``nemo_fp8`` method), or NeMo RL's vLLM worker quantizer."""

_SCALE = "_scale_inv"
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class RefitReport:
    """What :func:`verify_refit` found.

    Attributes:
        checks: one :class:`~nemo_fp8_plugin.numerics.refit_diff.WeightCheck` per weight, in
            the trainer's order (engine weights the trainer lacks at the end).
        recipe: the recipe's name.
        numerics: ``"te"`` or ``"nemo_rl"``.
        exact: whether ``within_ulp`` counts as a difference.
        seconds: wall time of the verification.
    """

    checks: tuple[WeightCheck, ...]
    recipe: str
    numerics: str
    exact: bool = False
    seconds: float = 0.0

    @property
    def counts(self) -> dict[str, int]:
        """Number of weights per status (every status present, 0 included)."""
        out = dict.fromkeys(STATUSES, 0)
        for check in self.checks:
            out[check.status] += 1
        return out

    def failed(self) -> list[WeightCheck]:
        """The weights that fail: different or missing, and ``within_ulp`` when exact."""
        bad = {"different", "missing"} | ({"within_ulp"} if self.exact else set())
        return [c for c in self.checks if c.status in bad]

    @property
    def ok(self) -> bool:
        return not self.failed()

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "recipe": self.recipe,
            "numerics": self.numerics,
            "exact": self.exact,
            "counts": self.counts,
            "seconds": self.seconds,
            "weights": [c.to_dict() for c in self.checks],
        }


# --------------------------------------------------------------------------- sources


class _Engine:
    """The engine's tensors by name: from files (read on demand), a mapping, or a model."""

    def __init__(self, source: Any) -> None:
        self._entries: dict[str, st.Entry] = {}
        self._tensors: Mapping[str, torch.Tensor] = {}
        if isinstance(source, torch.nn.Module):
            from ..hosts.vllm.refit_check import engine_weights

            tensors: dict[str, torch.Tensor] = {}
            for name, data, scale in engine_weights(source):
                tensors[name] = data
                if scale is not None:
                    tensors[name + _SCALE] = scale
            self._tensors = tensors
        elif isinstance(source, Mapping):
            self._tensors = _checked_mapping(source, "engine")
        else:
            self._entries = {e.name: e for e in _plan(source, "engine")[1]}
        self.names = dict.fromkeys(self._tensors if self._tensors else self._entries)
        """Every tensor name the engine's record holds, in its order."""

    def get(self, name: str) -> torch.Tensor | None:
        if name in self._tensors:
            return self._tensors[name]
        entry = self._entries.get(name)
        if entry is None:
            return None
        stream = st.stream_entries([entry], _ignore)
        try:
            return next(stream)[1]
        finally:
            stream.close()


def _ignore(nbytes: int) -> None:
    """No progress to report."""


def _checked_mapping(source: Mapping, key: str) -> Mapping[str, torch.Tensor]:
    for name, tensor in source.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise FP8ConfigError(
                f"expected tensor names mapped to torch.Tensor, got {format_value(name)}: "
                f"{type(tensor).__name__}",
                key=key,
            )
    return source


def _plan(source: Any, key: str) -> tuple[Path | None, list[st.Entry]]:
    """(the checkpoint's directory, its tensors from the headers) for a directory or one
    ``*.safetensors`` file, checked before any data is read."""
    from .._io import regular_file, safetensors_files

    if not isinstance(source, (str, os.PathLike)) or not str(source):
        raise FP8ConfigError(
            f"expected a checkpoint directory, a .safetensors file or tensors, got "
            f"{format_value(source)}",
            key=key,
        )
    path = Path(source)
    if path.is_dir():
        files = safetensors_files(path, key=key)
        if not files:
            raise FP8ConfigError(f"no *.safetensors files in {path}", key=key, value=str(path))
        index = path / "model.safetensors.index.json"
        weight_map = (
            json.loads(index.read_text(encoding="utf-8"))["weight_map"] if index.exists() else None
        )
        return path, _entries(files, weight_map, key)
    if path.suffix == ".safetensors" or path.is_file():
        return path.parent, _entries(
            [regular_file(path, key=key, what="safetensors file")], None, key
        )
    raise FP8ConfigError(
        f"checkpoint directory or safetensors file not found: {path}", key=key, value=str(path)
    )


def _entries(files: list[Path], weight_map: dict[str, str] | None, key: str) -> list[st.Entry]:
    try:
        return st.plan(files, weight_map)
    except FP8ConfigError as err:  # the reader names its argument "source"
        raise FP8ConfigError(err.bare_message, key=key, value=err.value, hint=err.hint) from None


def _trainer(source: Any) -> tuple[Iterator[tuple[str, torch.Tensor]], Path | None]:
    if isinstance(source, Mapping):
        return iter(_checked_mapping(source, "trainer").items()), None
    directory, entries = _plan(source, "trainer")
    return st.stream_entries(entries, _ignore), directory


def _num_layers(directory: Path | None) -> int | None:
    if directory is None or not (directory / "config.json").is_file():
        return None
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for key in ("num_hidden_layers", "num_layers", "n_layer"):
        value = config.get(key) if isinstance(config, dict) else None
        if type(value) is int and value > 0:
            return value
    return None


# --------------------------------------------------------------------------- expectation


def _expected_fp8(
    name: str, weight: torch.Tensor, spec: RecipeSpec, numerics: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv) the trainer's weight quantizes to with the claimed numerics."""
    if numerics == "nemo_rl":
        from ..numerics.nemo_rl_numerics import quantize_weight_nemo_rl

        return quantize_weight_nemo_rl(
            weight, check_block(spec.weight_block, key="weight_block"), pow2_scales=spec.pow2_scales
        )
    from .refit import quantize_for_refit

    (_, data), (_, scale) = quantize_for_refit(
        [(name, weight)], spec, keep_bf16=_never, is_linear_weight=_always
    )
    return data, scale


def _never(name: str) -> bool:
    return False


def _always(name: str, tensor: torch.Tensor) -> bool:
    return True


def _check_numerics(numerics: Any, spec: RecipeSpec) -> str:
    from ..capabilities import capability

    if not isinstance(numerics, str) or numerics not in NUMERICS:
        raise FP8ConfigError(
            f"expected one of {', '.join(NUMERICS)}, got {format_value(numerics)}",
            key="numerics",
            value=numerics,
        )
    row = capability(spec.scaling)
    if not row.vllm_generation:
        raise FP8ConfigError(
            f"a refit serves block or mx scaling, not {spec.scaling!r} (recipe {spec.name})",
            key="spec",
            value=spec.name,
        )
    tile = check_block(spec.weight_block, key="weight_block")  # the tuple a tiled kind has
    if numerics == "nemo_rl" and (not row.is_block or tile[0] != tile[1]):
        raise FP8ConfigError(
            f"NeMo RL's worker quantizer is block FP8 with square tiles; recipe {spec.name} "
            f"has {spec.scaling} scaling with {list(tile)} tiles",
            key="numerics",
            value=numerics,
            hint="use numerics 'te' for this recipe",
        )
    return numerics


def _compare(
    name: str,
    trainer: torch.Tensor,
    engine: _Engine,
    spec: RecipeSpec,
    numerics: str,
    fp8_expected: bool,
) -> WeightCheck:
    from ..hosts.vllm.refit_check import canonical_name

    kind = "fp8" if fp8_expected else "high_precision"
    key = canonical_name(name)
    held = engine.get(key)
    if held is None:
        return missing_weight(name, kind, "the engine holds no weight of this name")
    scale = engine.get(key + _SCALE)
    if not fp8_expected:
        if held.dtype in _FP8:
            return WeightCheck(
                name=name,
                status="different",
                kind=kind,
                detail="the engine holds FP8 where the recipe keeps high precision",
            )
        return compare_high_precision(name, held, trainer)
    if held.dtype not in _FP8:
        return WeightCheck(
            name=name,
            status="different",
            kind=kind,
            detail=f"the engine holds {str(held.dtype).replace('torch.', '')} where the recipe "
            f"quantizes to FP8",
        )
    if scale is None:
        return missing_weight(name, kind, f"the engine holds FP8 codes but no {key}{_SCALE}")
    block = check_block(spec.weight_block, key="weight_block")  # the tuple a tiled kind has
    if trainer.dim() == 3 and held.dim() == 3:  # an expert stack, expert by expert
        checks = [
            compare_quantized(
                f"{name}[{e}]",
                held[e],
                scale[e],
                *_expected_fp8(name, trainer[e], spec, numerics),
                block,
            )
            for e in range(trainer.shape[0])
        ]
        return max(checks, key=lambda c: STATUSES.index(c.status))  # the worst expert
    want, want_scale = _expected_fp8(name, trainer, spec, numerics)
    return compare_quantized(name, held, scale, want, want_scale, block)


def _stack_parts(
    name: str, stack: torch.Tensor, engine: _Engine
) -> list[tuple[str, torch.Tensor]] | None:
    """A whole 3-D expert stack of the trainer's cut into each expert's weights as the
    engine holds them (``experts.<e>.w1`` / ``w3`` / ``w2``; vLLM's loader cuts it so), or
    None for any other tensor. The stack is taken transposed when only that layout gives the
    shape the engine holds."""
    from ..hosts.vllm.refit_check import expert_stack

    parts = expert_stack(name, stack)
    if parts is None:
        return None
    held = engine.get(parts[0][0])
    if held is not None and held.shape != parts[0][1].shape:
        flipped = expert_stack(name, stack, transposed=True)
        if flipped is not None and flipped[0][1].shape == held.shape:
            return flipped
    return parts


def verify_refit(
    engine: Any,
    trainer: Any,
    spec: Any = "fp8_blockwise",
    *,
    numerics: str = "te",
    num_layers: int | None = None,
    exact: bool = False,
) -> RefitReport:
    """Check that the engine holds what the trainer's weights give under the recipe.

    Args:
        engine: what the engine holds: a checkpoint directory or ``*.safetensors`` file in
            the export layout (an exported checkpoint, a :func:`dump_engine_weights` dump),
            a mapping of such tensors, or a ``nemo_fp8`` vLLM model in its own process.
        trainer: the trainer's weights: a Hugging Face checkpoint directory or file, or a
            state dict, in Hugging Face naming and high precision.
        spec: the recipe (name, ``fp8:`` mapping or spec): scaling, tiles, ``pow2_scales``,
            ``amax_epsilon`` and the generation-side BF16 rules. Default ``fp8_blockwise``.
        numerics: ``"te"`` (default) or ``"nemo_rl"`` (see :data:`NUMERICS`).
        num_layers: the model's layer count, for ``bf16_layers.last``; default: the
            trainer checkpoint's ``config.json``.
        exact: count ``within_ulp`` as a difference (the engine claims the same numerics
            bit for bit).

    Returns:
        A :class:`RefitReport`; ``report.ok`` is False when a weight is different or
        missing (or within the scale difference, with ``exact``).

    Raises:
        FP8ConfigError: an argument or file that cannot be read as described, a recipe a
            refit cannot serve, trainer weights that are already FP8.
    """
    from ..hosts.vllm.refit_check import canonical_name
    from ..registry import get_recipe
    from ..rules import keeps_bf16
    from .refit import default_is_linear_weight

    start = time.perf_counter()
    try:
        spec = get_recipe(spec)
    except FP8ConfigError as err:
        key = "spec" if err.key in (None, "recipe") else f"spec.{err.key}"
        raise FP8ConfigError(err.bare_message, key=key, value=err.value, hint=err.hint) from None
    numerics = _check_numerics(numerics, spec)
    if not isinstance(exact, bool):
        raise FP8ConfigError(f"expected True or False, got {format_value(exact)}", key="exact")
    if num_layers is not None and (type(num_layers) is not int or num_layers < 1):
        raise FP8ConfigError(
            f"expected a positive integer, got {format_value(num_layers)}", key="num_layers"
        )
    held = _Engine(engine)
    named, directory = _trainer(trainer)
    if num_layers is None:
        num_layers = _num_layers(directory)
    checks: list[WeightCheck] = []
    seen: set[str] = set()
    for name, tensor in named:
        if tensor.dtype in _FP8 or name.endswith(_SCALE):
            raise FP8ConfigError(
                f"{name} is already FP8; the trainer's weights are compared in high precision",
                key="trainer",
                value=name,
                hint="pass the trainer's BF16/FP32 weights (a Hugging Face checkpoint)",
            )
        key = canonical_name(name)
        parts = None if key in held.names else _stack_parts(name, tensor, held)
        linear = parts is not None or default_is_linear_weight(name, tensor)
        fp8 = (
            spec.generation == "fp8"
            and linear
            and keeps_bf16(spec, name, side="generation", num_layers=num_layers) is None
        )
        if not linear and key not in held.names:
            continue  # not a refit's weight, and the engine's record does not carry it
        for part_name, part in parts or [(name, tensor)]:
            part_key = canonical_name(part_name)
            seen.update((part_key, part_key + _SCALE))
            checks.append(_compare(part_name, part, held, spec, numerics, fp8))
        del tensor, parts
    for name in held.names:
        if name not in seen and not name.endswith(_SCALE) and held.get(name + _SCALE) is not None:
            checks.append(missing_weight(name, "fp8", "the trainer has no weight of this name"))
    return RefitReport(
        checks=tuple(checks),
        recipe=spec.name,
        numerics=numerics,
        exact=exact,
        seconds=time.perf_counter() - start,
    )


# --------------------------------------------------------------------------- dump


def dump_engine_weights(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    *,
    layers: Iterable[int] | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write what a ``nemo_fp8`` vLLM engine holds (its linear weights, FP8 codes with their
    ``_scale_inv``, by the checkpoint's names) as safetensors shards in ``out_dir``, for
    ``nemo-fp8 verify-refit``. Call it in the engine's process, e.g.
    ``llm.collective_rpc(lambda w: dump_engine_weights(w.model_runner.get_model(), path))``
    (one directory per rank). ``layers``: only these decoder layers. The directory is built
    under a temporary name beside ``out_dir`` and renamed into place; ``out_dir`` must not
    exist. Returns ``out_dir``."""
    from .._io import check_output_dir
    from .._signals import interruptible
    from ..hosts.vllm.refit_check import engine_weights

    out = Path(out_dir)
    if out.exists():
        raise FP8ConfigError(f"{out} exists", key="out_dir", value=str(out))
    check_output_dir(out, "out_dir")
    tmp = out.parent / f".{out.name}.nemo-fp8-dump-{secrets.token_hex(4)}.tmp"
    os.mkdir(tmp)
    try:
        with interruptible():
            writer = st.ShardWriter(tmp, max_shard_bytes, shown=out)
            try:
                for name, data, scale in engine_weights(model, layers=layers):
                    writer.add(name, data.detach().to("cpu"))
                    if scale is not None:
                        writer.add(name + _SCALE, scale.detach().to("cpu"))
                weight_map = writer.finish()
            finally:
                writer.abort()
            if len(writer.files) > 1:
                index = {"metadata": {"total_size": writer.total_bytes}, "weight_map": weight_map}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

"""What a command loads once: the config (and its ``defaults:`` chain), the request, the
model the rules resolve against, and the host the config's shape names."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import FP8ConfigError
from .contract import HostAdapter, HostContext
from .table import adapters

__all__ = [
    "load_context",
    "mapping_context",
    "model_sizes_section",
    "detect_host",
    "shape_mismatch",
    "refuse_other_host",
]


def load_context(
    path: str | Path,
    *,
    hardware: str | None = None,
    model: str | None = None,
    model_config: str | Path | None = None,
    output: str | Path | None = None,
    strict: bool = False,
    check_hardware: bool = True,
    stack: str | None = None,
    host_forced: bool = False,
    host: str | None = None,
) -> HostContext:
    """Read ``path`` once (its ``defaults:`` chain too), find the request and the model.

    ``model`` (a built-in model name) or ``model_config`` (a Hugging Face ``config.json`` or a
    checkpoint directory holding one) override the model the config names.
    ``check_hardware=False``: a target the recipe cannot run on is reported by the caller
    (``explain``, ``doctor``), not refused here. ``stack``: the ``--stack`` name (None: the
    installed versions). ``host_forced``: the host was chosen with ``--force`` against the
    config's shape. ``host``: whose sides the target GPU is judged for (None: the host the
    config's shape names).
    """
    from ..config import find_fp8_request, load_config_files
    from ..stacks import assumed_versions

    assumed = assumed_versions(stack)  # a bad --stack is refused before the file is read
    path = Path(path)
    raw, resolved, sources = load_config_files(path)
    request = find_fp8_request(resolved, hardware=hardware, check_hardware=False)
    if check_hardware:
        from .hardware import targeted

        request = targeted(request, host if host is not None else detect_host(resolved))
    ctx = HostContext(
        path=path,
        raw=raw,
        resolved=resolved,
        request=request,
        stated=_stated(resolved),
        hardware=hardware,
        output=Path(output) if output not in (None, "-") else None,
        strict=strict,
        fmt="json" if path.suffix.lower() == ".json" else "yaml",
        stack=assumed,
        host_forced=host_forced,
        sources=tuple(sources),
    )
    return _with_model(ctx, path, model, model_config)


def mapping_context(
    config: Mapping[str, Any],
    *,
    hardware: str | None = None,
    strict: bool = False,
    path: str | Path | None = None,
    model: str | None = None,
    stack: str | None = None,
) -> HostContext:
    """A :class:`HostContext` for a config mapping built in code (no file, no ``defaults:``
    chain); a model file the mapping names is read relative to ``path``'s directory (the
    working directory without one). ``stack``: a ``--stack`` name whose versions to assume;
    None: no stack."""
    from ..config import find_fp8_request
    from ..errors import check_depth, format_value
    from ..stacks import assumed_versions

    if not isinstance(config, Mapping):
        raise FP8ConfigError(f"a config must be a mapping, got {format_value(config)}")
    # A mapping built in code can contain itself (d["a"] = d): every walk over it below
    # would recurse without end. Refused by depth, walked without recursion.
    check_depth(dict(config), key="config", what="the config mapping (or it contains itself)")
    ctx = HostContext(
        path=Path(path) if path is not None else None,
        raw=config,
        resolved=config,
        request=find_fp8_request(config, hardware=hardware),
        stated=_stated(config),
        hardware=hardware,
        strict=strict,
        stack=assumed_versions(stack) if stack is not None else None,
    )
    return _with_model(ctx, Path(path) if path is not None else Path("config.yaml"), model, None)


def _stated(config: Mapping[str, Any]) -> frozenset[str]:
    block = config.get("fp8")
    if not isinstance(block, Mapping):
        return frozenset()
    return frozenset(k for k in block if isinstance(k, str))


def _with_model(
    ctx: HostContext, path: Path, model: str | None, model_config: str | Path | None
) -> HostContext:
    """``ctx`` with the model description the rules resolve against, where it came from, and
    why there is none.

    Precedence: ``--model-config``, ``--model``, ``fp8.model`` (its errors are the user's),
    the megatron-core sizes of the config's ``model:`` section, then a model name the host
    config carries (NeMo RL ``policy.model_name``, a vLLM ``model:``), which may be unknown
    to the built-in table without that being an error. Files are read relative to the
    config's directory, whatever the working directory.
    """
    request, config = ctx.request, ctx.resolved
    if request is None:
        return ctx

    def found(
        name: Any, key: str, base: Path | None = None, where: str | None = None
    ) -> HostContext:
        return dataclasses.replace(ctx, model=ctx.describe(name, key, base), model_key=where or key)

    if model_config is not None:
        return found(str(model_config), "--model-config")
    if model is not None:
        return found(model, "--model")
    block = config.get("fp8")
    if isinstance(block, Mapping) and block.get("model") is not None:
        return found(block["model"], "fp8.model", path.parent)
    sizes = model_sizes_section(config)
    named, key = request.model, "policy.model_name" if request.model else None
    if named is None and isinstance(config.get("model"), str):  # vLLM engine configs
        named, key = config["model"], "model"
    try:
        if sizes is not None:
            return found(sizes[1], sizes[0])
        if named is not None:
            return found(named, "model", path.parent, key)
    except FP8ConfigError as err:
        return dataclasses.replace(ctx, model_notes=(f"{err}; per-layer decisions are not shown",))
    if not request.spec.bf16_layers.empty:
        return dataclasses.replace(
            ctx,
            model_notes=(
                "the config names no model: pass --model NAME or --model-config PATH to "
                "see which layers the bf16_layers rules keep in BF16",
            ),
        )
    return ctx


def model_sizes_section(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
    """``(dotted key, section)`` of the ``language_model:`` / ``model:`` section (or its
    ``config`` / ``transformer`` mapping: NeMo 2, Bridge's GPTModelConfig) that holds
    megatron-core sizes, or None."""
    for name in ("language_model", "model"):
        node = config.get(name)
        if not isinstance(node, Mapping):
            continue
        for where, candidate in (
            (name, node),
            (f"{name}.config", node.get("config")),
            (f"{name}.transformer", node.get("transformer")),
        ):
            if (
                isinstance(candidate, Mapping)
                and isinstance(candidate.get("num_layers"), int)
                and isinstance(candidate.get("hidden_size"), int)
            ):
                return where, candidate
    return None


def detect_host(config: Mapping[str, Any]) -> str | None:
    """The host a config is written for, from its shape (each adapter's
    :meth:`~.contract.HostAdapter.detects`, in its :attr:`~.contract.HostAdapter.detect_order`);
    None for a config with none of them (``precision:`` alone)."""
    for adapter in sorted(adapters(), key=lambda a: a.detect_order):
        if adapter.detects(config):
            return adapter.name
    return None


def shape_mismatch(
    adapter: HostAdapter, ctx: HostContext, accepted: tuple[str, ...] | None = None
) -> str | None:
    """The host the config's shape names (:func:`detect_host`) when it is not ``accepted``
    (default: the adapter's own) and the adapter does not also serve that shape; None when
    they agree or the shape names none."""
    other = detect_host(ctx.raw) or detect_host(ctx.resolved)
    if other is None or other in (accepted or (adapter.name,)):
        return None
    return None if other in adapter.serves_shapes else other


def refuse_other_host(
    adapter: HostAdapter, ctx: HostContext, accepted: tuple[str, ...] | None = None
) -> None:
    """Refuse a config whose shape says it is for another host than ``accepted`` (default:
    the adapter's own): its keys would land where that host never reads them.
    ``ctx.host_forced`` (``--force``) lets it through: the command says so."""
    other = shape_mismatch(adapter, ctx, accepted)
    if other is None or ctx.host_forced:
        return
    raise FP8ConfigError(
        f"this is a {other} config (from its shape), not a {adapter.name} one: "
        f"{adapter.name}'s keys would be written where {other} never reads them",
        key="--host",
        value=adapter.name,
        hint=f"use --host {other} (or --force to write {adapter.name}'s keys anyway)",
    )

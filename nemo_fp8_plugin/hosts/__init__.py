"""Host adapters: one per host, one contract, one pipeline.

Every host (NeMo 2, Megatron-Bridge, megatron-core, NeMo RL, vLLM, Transformer Engine)
implements :class:`HostAdapter` once, in its own package under ``nemo_fp8_plugin.hosts``, and
is listed in :data:`ADAPTERS`. ``nemo-fp8 apply``, ``nemo-fp8 explain``, the NeMo-Run
factories, the Bridge registration and the vLLM plugin all go through :func:`run`:

    request -> refuse -> spell -> merge (conflicts refused) -> strict -> result

so ``explain`` shows exactly what ``apply`` writes and refuses exactly what ``apply``
refuses. A command loads and parses its config once (:func:`load_context`); adapters read
the :class:`HostContext` and never the file.

Nothing here imports a host: each adapter imports its host inside the functions that need it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import ConflictingKeyError, FP8ConfigError

if TYPE_CHECKING:
    from ..config import FP8Request
    from ..rules import ModelDescription
    from ..spec import RecipeSpec
    from ..stacks import Assumed

__all__ = [
    "ADAPTERS",
    "HOSTS",
    "HostKeys",
    "ApplyResult",
    "HostContext",
    "HostAdapter",
    "get_adapter",
    "load_context",
    "mapping_context",
    "run",
    "apply_path",
    "apply_mapping",
    "ConfigEditAdapter",
    "NO_REQUEST",
    "available_hosts",
    "diff_written",
]

ADAPTERS = {
    "nemo2": "nemo_fp8_plugin.hosts.nemo2:ADAPTER",
    "bridge": "nemo_fp8_plugin.hosts.bridge:ADAPTER",
    "megatron": "nemo_fp8_plugin.hosts.megatron:ADAPTER",
    "nemo-rl": "nemo_fp8_plugin.hosts.nemo_rl:ADAPTER",
    "vllm": "nemo_fp8_plugin.hosts.vllm.adapter:ADAPTER",
    "te": "nemo_fp8_plugin.hosts.te:ADAPTER",
}
"""CLI host name -> ``module:attribute`` of its adapter object. The order is the order
``explain`` shows hosts in."""

HOSTS = tuple(ADAPTERS)
"""Every host name ``--host`` accepts (``nemo_rl`` is accepted for ``nemo-rl``)."""

NO_REQUEST = (
    "no FP8 recipe requested (no `precision:`, `policy.precision:`, "
    "`mixed_precision:` or `fp8:` naming one); the config runs in its own precision"
)
"""The one message for a config that asks for no FP8 recipe."""


@dataclass
class HostKeys:
    """A host's native spelling of a recipe (plain data, no host import).

    Attributes:
        keys: native keys and values, nested as they appear in the host's config.
        warnings: what the host cannot express, each naming the rule and the host.
        env: environment variables the host's training process must have.
    """

    keys: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"keys": self.keys}
        if self.env:
            out["env"] = self.env
        if self.warnings:
            out["warnings"] = self.warnings
        return out


@dataclass
class ApplyResult:
    """What :func:`run` produces for one host.

    Attributes:
        data: the output mapping (what ``apply`` writes).
        warnings: what the host cannot express or drops; ``--strict`` makes the first an error.
        notes: advice that loses nothing (where to export an environment variable, ...).
        env: environment variables the host's process needs and its config cannot carry.
        fmt: ``"yaml"`` or ``"json"``.
        written: the keys ``data`` sets or changes relative to the input, nested (what
            ``explain`` shows for the host); filled by :func:`run` unless the adapter's output
            is a new document rather than an edit (Transformer Engine).
        removed: dotted keys of the input that ``data`` drops (the request keys it consumed).
        requested: whether the config asked for a recipe (False: ``data`` is the input).
        runtime: which code applies these keys when the job runs (the host's own FP8 path,
            or this package's), so nobody believes a path runs that does not.
    """

    data: Any
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    fmt: str = "yaml"
    written: dict[str, Any] | None = None
    removed: list[str] = field(default_factory=list)
    requested: bool = True
    runtime: str = ""

    def summary(self) -> dict[str, Any]:
        """The host section of ``explain --json``."""
        out: dict[str, Any] = {"keys": self.written or {}}
        for name in ("removed", "env", "warnings", "notes", "runtime"):
            value = getattr(self, name)
            if value:
                out[name] = value
        return out


@dataclass(frozen=True)
class HostContext:
    """Everything an adapter may read about the command it serves, loaded once.

    Attributes:
        path: the config file, or None for a mapping given in code.
        raw: the file as written (its ``defaults:`` chain not merged in).
        resolved: the file with its NeMo RL ``defaults:`` chain merged parent-first (``raw``
            itself when it has none).
        request: the FP8 request found in ``resolved`` (None: the config asks for none).
        model: the model description the per-layer rules resolve against, or None.
        model_notes: why there is no model description when one would matter.
        stated: the fields the user wrote in the ``fp8:`` block (``{"fp8_param", ...}``),
            so an adapter can tell a user's choice from a preset's default.
        hardware: the ``--hardware`` target, or None.
        output: where the result will be written (None: standard output); adapters that
            write relative references (NeMo RL's ``defaults:``) need it.
        strict: ``--strict``.
        fmt: the input's format, ``"yaml"`` or ``"json"``.
        stack: the host versions assumed (:func:`nemo_fp8_plugin.stacks.assumed_versions`:
            ``--stack NAME``, else the installed ones); None for a mapping given in code
            (adapters then read the installed versions).
    """

    path: Path | None
    raw: Mapping[str, Any]
    resolved: Mapping[str, Any]
    request: FP8Request | None
    model: ModelDescription | None = None
    model_notes: tuple[str, ...] = ()
    stated: frozenset[str] = frozenset()
    hardware: str | None = None
    output: Path | None = None
    strict: bool = False
    fmt: str = "yaml"
    stack: Assumed | None = None

    @property
    def spec(self) -> RecipeSpec:
        """The requested spec (only valid when :attr:`request` is not None)."""
        assert self.request is not None
        return self.request.spec

    @property
    def in_file(self) -> bool:
        """Whether every request key is in the file itself (not only in a parent)."""
        from ..config import get_path

        missing = object()
        return self.request is not None and all(
            get_path(self.raw, k, missing) is not missing for k in self.request.keys
        )


@runtime_checkable
class HostAdapter(Protocol):
    """The contract every host implements, once.

    ``spell`` is pure data from the spec (no host import, no file); ``merge`` refuses what
    the host cannot run or what the config contradicts (:class:`ConflictingKeyError` for a
    native key set otherwise) and returns the output; ``validate`` feeds a result to the
    host's own code where the host is installed and says what it checked.
    """

    name: str
    """The ``--host`` name."""

    def spell(self, spec: RecipeSpec, ctx: HostContext | None = None) -> HostKeys:
        """The host's native keys for ``spec`` (``ctx`` adds the model and the user's
        stated fields when there is a config)."""
        ...

    def merge(self, ctx: HostContext) -> ApplyResult:
        """The config rewritten into the host's keys (``ctx.request`` is not None)."""
        ...

    def passthrough(self, ctx: HostContext) -> Any:
        """The output for a config that asks for no recipe (normally the input as is)."""
        ...

    def validate(self, result: ApplyResult, ctx: HostContext) -> list[str]:
        """Check ``result`` with the host's own code; raise :class:`FP8ConfigError` when the
        host rejects it; return one line per check made or skipped (and why)."""
        ...


class ConfigEditAdapter:
    """Shared behaviour of the adapters whose output is the input config with the host's
    keys merged in (every host but Transformer Engine): a config that asks for no recipe is
    written back as it is, and the file is read as written (no ``defaults:`` chain)."""

    name: str = ""
    follows_defaults = False

    def passthrough(self, ctx: HostContext) -> Any:
        return copy.deepcopy(dict(ctx.raw))


def apply_path(adapter: HostAdapter, path: str | Path, **context: Any) -> ApplyResult:
    """:func:`run` on a config file: what each host module's ``apply_file`` is. ``context``:
    the keyword arguments of :func:`load_context` (``hardware``, ``strict``, ``output``...)."""
    return run(adapter, load_context(path, **context))


def apply_mapping(adapter: HostAdapter, config: Mapping[str, Any], **context: Any) -> ApplyResult:
    """:func:`run` on a config mapping built in code (see :func:`mapping_context`)."""
    return run(adapter, mapping_context(config, **context))


def get_adapter(name: str) -> HostAdapter:
    """The adapter of a host, by ``--host`` name (``nemo_rl`` accepted for ``nemo-rl``)."""
    name = name.replace("_", "-") if name.replace("_", "-") in ADAPTERS else name
    if name not in ADAPTERS:
        raise FP8ConfigError(
            f"unknown host {name!r}", key="--host", value=name, hint=f"one of {', '.join(ADAPTERS)}"
        )
    module, attr = ADAPTERS[name].split(":")
    adapter: HostAdapter = getattr(import_module(module), attr)
    return adapter


def available_hosts() -> list[str]:
    """Hosts whose adapter module exists in this installation."""
    from importlib.util import find_spec

    return [
        name for name, target in ADAPTERS.items() if find_spec(target.split(":")[0]) is not None
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
) -> HostContext:
    """Read ``path`` once (its ``defaults:`` chain too), find the request and the model.

    ``model`` (a built-in model name) or ``model_config`` (a Hugging Face ``config.json`` or a
    checkpoint directory holding one) override the model the config names.
    ``check_hardware=False``: a target the recipe cannot run on is reported by the caller
    (``explain``, ``doctor``), not refused here (:func:`~nemo_fp8_plugin.config.find_fp8_request`).
    ``stack``: the ``--stack`` name (None: the installed versions).
    """
    from ..config import find_fp8_request, load_config_chain
    from ..stacks import assumed_versions

    assumed = assumed_versions(stack)  # a bad --stack is refused before the file is read

    path = Path(path)
    raw, resolved = load_config_chain(path)
    request = find_fp8_request(resolved, hardware=hardware, check_hardware=check_hardware)
    found, notes = (
        (None, ()) if request is None else _model_of(request, resolved, path, model, model_config)
    )
    block = resolved.get("fp8")
    stated = (
        frozenset(k for k in block if isinstance(k, str))
        if isinstance(block, Mapping)
        else frozenset()
    )
    return HostContext(
        path=path,
        raw=raw,
        resolved=resolved,
        request=request,
        model=found,
        model_notes=tuple(notes),
        stated=stated,
        hardware=hardware,
        output=Path(output) if output not in (None, "-") else None,
        strict=strict,
        fmt="json" if path.suffix.lower() == ".json" else "yaml",
        stack=assumed,
    )


def mapping_context(
    config: Mapping[str, Any],
    *,
    hardware: str | None = None,
    strict: bool = False,
    path: str | Path | None = None,
    model: str | None = None,
) -> HostContext:
    """A :class:`HostContext` for a config mapping built in code (no file, no ``defaults:``
    chain): what the library functions ``apply_config(mapping)`` use."""
    from ..config import find_fp8_request
    from ..errors import format_value

    if not isinstance(config, Mapping):
        raise FP8ConfigError(f"a config must be a mapping, got {format_value(config)}")
    request = find_fp8_request(config, hardware=hardware)
    where = Path(path) if path is not None else Path("config.yaml")
    found, notes = (None, ()) if request is None else _model_of(request, config, where, model, None)
    block = config.get("fp8")
    stated = (
        frozenset(k for k in block if isinstance(k, str))
        if isinstance(block, Mapping)
        else frozenset()
    )
    return HostContext(
        path=Path(path) if path is not None else None,
        raw=config,
        resolved=config,
        request=request,
        model=found,
        model_notes=tuple(notes),
        stated=stated,
        hardware=hardware,
        strict=strict,
    )


def _model_of(
    request: FP8Request,
    config: Mapping[str, Any],
    path: Path,
    model: str | None,
    model_config: str | Path | None,
) -> tuple[ModelDescription | None, list[str]]:
    """The model description the rules resolve against, and why there is none.

    Precedence: ``--model-config``, ``--model``, ``fp8.model`` (its errors are the user's),
    the megatron-core sizes of the config's ``model:`` section, then a model name the host
    config carries (NeMo RL ``policy.model_name``, a vLLM ``model:``), which may be unknown
    to the built-in table without that being an error.
    """
    from ..rules import describe_model

    if model_config is not None:
        return describe_model(str(model_config), key="--model-config"), []
    if model is not None:
        return describe_model(model, key="--model"), []
    block = config.get("fp8")
    if isinstance(block, Mapping) and block.get("model") is not None:
        return describe_model(block["model"], key="fp8.model", base_dir=path.parent), []
    sizes = _megatron_model_fields(config)
    if sizes is not None:
        try:
            return describe_model(sizes, key="model"), []
        except FP8ConfigError as err:
            return None, [f"{err}; per-layer decisions are not shown"]
    named = request.model
    if named is None and isinstance(config.get("model"), str):  # vLLM engine configs
        named = config["model"]
    if named is not None:
        try:
            return describe_model(named, key="model", base_dir=path.parent), []
        except FP8ConfigError as err:
            return None, [f"{err}; per-layer decisions are not shown"]
    if not request.spec.bf16_layers.empty:
        return None, [
            "the config names no model: pass --model NAME or --model-config PATH to "
            "see which layers the bf16_layers rules keep in BF16"
        ]
    return None, []


def _megatron_model_fields(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A ``model:`` / ``language_model:`` section with megatron-core sizes."""
    for name in ("language_model", "model"):
        node = config.get(name)
        nested = (
            [node.get(k) for k in ("config", "transformer")] if isinstance(node, Mapping) else []
        )
        for candidate in (node, *nested):
            if (
                isinstance(candidate, Mapping)
                and isinstance(candidate.get("num_layers"), int)
                and isinstance(candidate.get("hidden_size"), int)
            ):
                return candidate
    return None


def run(adapter: HostAdapter, ctx: HostContext) -> ApplyResult:
    """The one pipeline: request -> refuse -> spell -> merge -> strict -> result."""
    if (
        ctx.request is not None
        and not getattr(adapter, "follows_defaults", False)
        and not ctx.in_file
    ):
        raise FP8ConfigError(
            f"the FP8 request is in a parent file named by defaults:, which "
            f"{adapter.name} configs do not have",
            key=ctx.request.keys[0],
            hint="put the request in this file (only NeMo RL configs chain "
            "parents), or use --host nemo-rl",
        )
    if ctx.request is None:
        data = adapter.passthrough(ctx)
        result = ApplyResult(data=data, warnings=[NO_REQUEST], requested=False, fmt=ctx.fmt)
        result.written, result.removed = diff_written(ctx.raw, data)
        return result
    from ..config import check_sections

    # Typed before merging: a list where the host reads a mapping names its key.
    check_sections(adapter.name, ctx.raw)
    if getattr(adapter, "follows_defaults", False):
        check_sections(adapter.name, ctx.resolved)
    try:
        result = adapter.merge(ctx)
    except ConflictingKeyError as err:
        raise ConflictingKeyError(
            f"{err.bare_message} (host {adapter.name})", key=err.key, value=err.value, hint=err.hint
        ) from None
    if result.written is None:
        result.written, result.removed = diff_written(ctx.raw, result.data)
    if not result.runtime:
        result.runtime = getattr(adapter, "runtime", "")
    if ctx.strict and result.warnings:
        more = f" (and {len(result.warnings) - 1} more)" if len(result.warnings) > 1 else ""
        raise FP8ConfigError(
            result.warnings[0] + more,
            key="--strict",
            hint="fix the rules, or drop --strict to see every warning",
        )
    return result


_ABSENT = object()


def diff_written(before: Any, after: Any) -> tuple[dict[str, Any], list[str]]:
    """``(written, removed)``: the nested keys ``after`` sets or changes relative to
    ``before``, and the dotted keys it drops. Lists and scalars compare as wholes."""
    written: dict[str, Any] = {}
    removed: list[str] = []

    def walk(b: Any, a: Any, into: dict[str, Any], prefix: str) -> None:
        for key, value in a.items():
            old = b.get(key, _ABSENT) if isinstance(b, Mapping) else _ABSENT
            if isinstance(value, Mapping) and isinstance(old, Mapping) and value:
                child: dict[str, Any] = {}
                walk(old, value, child, f"{prefix}{key}.")
                if child:
                    into[key] = child
            elif old is _ABSENT or old != value or type(old) is not type(value):
                into[key] = copy.deepcopy(value)
        if isinstance(b, Mapping):
            for key in b:
                if key not in a:
                    removed.append(f"{prefix}{key}")

    if isinstance(after, Mapping):
        walk(before if isinstance(before, Mapping) else {}, after, written, "")
    return written, removed

"""Host adapters: one per host, one contract, one pipeline.

Every host (NeMo 2, Megatron-Bridge, megatron-core, NeMo RL, vLLM, Transformer Engine)
subclasses :class:`HostAdapter` once, as ``ADAPTER`` in its own module
``nemo_fp8_plugin.hosts.<host>`` (:data:`ADAPTERS`). Two entry functions use it:

* :func:`run`, for a config: ``request -> refuse -> spell -> merge (conflicts refused) ->
  strict -> result``; ``nemo-fp8 apply`` and ``nemo-fp8 explain`` both run it, so explain
  shows exactly what apply writes and refuses exactly what apply refuses. A command loads
  and parses its config once (:func:`load_context`); adapters read the :class:`HostContext`
  and never the file.
* :func:`recipe_keys`, for code that starts from a recipe, not a file (the NeMo-Run
  factories, Bridge's ``register`` / ``mixed_precision_config``, vLLM's ``engine_kwargs``,
  the training callbacks): ``refuse -> spell``, the same refusals and the same keys.

Nothing here imports a host: each adapter imports its host inside the functions that need it.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConflictingKeyError, FP8ConfigError

if TYPE_CHECKING:
    from ..config import FP8Request
    from ..rules import ModelDescription
    from ..spec import RecipeSpec
    from ..stacks import Assumed, ReleaseChoice

__all__ = [
    "ADAPTERS",
    "HOSTS",
    "HostKeys",
    "RuleIssue",
    "RuleIssueKind",
    "ApplyResult",
    "HostContext",
    "HostAdapter",
    "get_adapter",
    "load_context",
    "mapping_context",
    "run",
    "apply_path",
    "apply_mapping",
    "recipe_keys",
    "refuse_recipe",
    "detect_host",
    "check_model_shape",
    "model_shape_findings",
    "megatron_model_section",
    "refuse_other_host",
    "shape_mismatch",
    "NO_REQUEST",
    "available_hosts",
    "diff_written",
    "NO_DEFAULT",
    "NativeRecipe",
    "read_native",
]

ADAPTERS = {
    "nemo2": "nemo_fp8_plugin.hosts.nemo2:ADAPTER",
    "bridge": "nemo_fp8_plugin.hosts.bridge:ADAPTER",
    "megatron": "nemo_fp8_plugin.hosts.megatron:ADAPTER",
    "nemo-rl": "nemo_fp8_plugin.hosts.nemo_rl:ADAPTER",
    "vllm": "nemo_fp8_plugin.hosts.vllm:ADAPTER",
    "te": "nemo_fp8_plugin.hosts.te:ADAPTER",
}
"""CLI host name -> ``module:attribute`` of its adapter object, by one rule: ``ADAPTER`` of
the host's own module ``nemo_fp8_plugin.hosts.<host>`` (a package may define the class in
``adapter.py``; its ``__init__`` exports it). The order is the order ``explain`` shows hosts
in."""

HOSTS = tuple(ADAPTERS)
"""Every host name ``--host`` accepts (``nemo_rl`` is accepted for ``nemo-rl``)."""

NO_REQUEST = (
    "no FP8 recipe requested (no `precision:`, `policy.precision:`, "
    "`mixed_precision:` or `fp8:` naming one); the config runs in its own precision"
)
"""The one message for a config that asks for no FP8 recipe."""


class RuleIssueKind(Enum):
    """Why a host's spelling of a ``bf16_layers.modules`` rule falls short (see
    :class:`RuleIssue`)."""

    UNTRANSLATABLE = "untranslatable"
    """It names particular layers in Hugging Face names and no model description is at hand
    to give their megatron-core names."""
    PASSED_AS_IS = "passed_as_is"
    """It matches no module name the plugin knows; the pattern is written unchanged."""
    STAGE_LOCAL = "stage_local"
    """Its megatron-core patterns name particular layers, right with pipeline size 1 only."""
    TRAINING_UNEXPRESSIBLE = "training_unexpressible"
    """The host's training keys cannot express it (NeMo RL: training runs its modules in
    FP8 unless the TE precision file carries it)."""


@dataclass(frozen=True)
class RuleIssue:
    """One rule's shortfall in a host's spelling, as data: code decides on these, never on
    the wording of :attr:`warning`.

    Attributes:
        kind: what falls short.
        index: the rule's position in ``bf16_layers.modules``.
        pattern: the rule's glob.
        warning: the user-facing warning that reports it (one of :attr:`HostKeys.warnings`;
            several rules may share one).
    """

    kind: RuleIssueKind
    index: int
    pattern: str
    warning: str

    @property
    def key(self) -> str:
        """The rule's key, ``bf16_layers.modules[<index>]``."""
        return f"bf16_layers.modules[{self.index}]"


@dataclass
class HostKeys:
    """A host's native spelling of a recipe (plain data, no host import).

    Attributes:
        keys: native keys and values, nested as they appear in the host's config.
        warnings: what the host cannot express, each naming the rule and the host.
        env: environment variables the host's training process must have.
        notes: advice that loses nothing (copied onto :attr:`ApplyResult.notes`).
        rule_issues: the BF16 rules' shortfalls behind some of :attr:`warnings`, as records
            (set by the rules spellings: ``to_megatron``, ``to_nemo_rl``).
    """

    keys: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    rule_issues: list[RuleIssue] = field(default_factory=list)

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
        files: companion files ``apply`` writes (atomically, before the output itself):
            path -> text. The NeMo RL adapter's TE precision file
            (:mod:`nemo_fp8_plugin.hosts.megatron.precision_file`) is one.
        checks: pre-flight records as plain data, by name, for ``explain --json`` and
            ``doctor`` (NeMo RL: ``rollout``, ``kv_cache``, ``ignore_list``); the lines that
            say them are among :attr:`notes` / :attr:`warnings`.
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
    files: dict[str, str] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The host section of ``explain --json``."""
        out: dict[str, Any] = {"keys": self.written or {}}
        for name in ("removed", "env", "warnings", "notes", "runtime", "checks"):
            value = getattr(self, name)
            if value:
                out[name] = value
        if self.files:
            out["files"] = sorted(self.files)
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
        model_key: where the model description came from, as the key a message names: a
            section holding megatron-core sizes (``language_model``, ``model.config``, ...;
            a dimension is named ``<section>.<field>``), or the key naming the model
            (``--model``, ``--model-config``, ``fp8.model``, ``policy.model_name``, ``model``).
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
        host_forced: ``--force`` with ``--host``: the host was chosen against the config's
            shape (:func:`refuse_other_host` lets it through, and the command says so).
    """

    path: Path | None
    raw: Mapping[str, Any]
    resolved: Mapping[str, Any]
    request: FP8Request | None
    model: ModelDescription | None = None
    model_notes: tuple[str, ...] = ()
    model_key: str | None = None
    stated: frozenset[str] = frozenset()
    hardware: str | None = None
    output: Path | None = None
    strict: bool = False
    fmt: str = "yaml"
    stack: Assumed | None = None
    host_forced: bool = False

    def assumed_version(self, host: str) -> str | None:
        """The version of ``host`` this command assumes: the ``--stack``'s pin, else the
        installed one (:func:`load_context` sets :attr:`stack` either way); None when the
        host is absent or the context was built in code without a stack. For ``nemo-rl``
        the release name (:attr:`nemo_rl`), never None. The one place adapters ask, so a
        version-table fact is decided the same way everywhere."""
        if host == "nemo-rl":
            return self.nemo_rl.release
        return self.stack.version(host) if self.stack is not None else None

    @property
    def nemo_rl(self) -> ReleaseChoice:
        """The NeMo RL release this command writes for and how it was decided: the stack's
        (``--stack``, or detected from the installed vLLM and Transformer Engine), else, for a
        context built in code, the newest release (:data:`nemo_fp8_plugin.stacks.NEMO_RL_NEWEST`)."""
        if self.stack is not None:
            return self.stack.release
        from ..stacks import NEMO_RL_NEWEST, ReleaseChoice

        return ReleaseChoice(NEMO_RL_NEWEST, "assumed, the newest release: no --stack given")

    @property
    def spec(self) -> RecipeSpec:
        """The requested spec (only valid when :attr:`request` is not None)."""
        assert self.request is not None
        return self.request.spec

    @property
    def in_file(self) -> bool:
        """Whether every request key is in the file itself (not only in a parent)."""
        from ..dotted import get_path

        missing = object()
        return self.request is not None and all(
            get_path(self.raw, k, missing) is not missing for k in self.request.keys
        )

    @property
    def prefix(self) -> str:
        """``"fp8"`` when the request is an ``fp8:`` block (spec keys are named under it)."""
        return "fp8" if self.request is not None and "fp8" in self.request.keys else ""


NO_DEFAULT: Any = type("NoDefault", (), {"__repr__": lambda self: "NO_DEFAULT"})()
""":meth:`HostAdapter.default`'s answer for a key whose absent meaning is not known (the key
is then written whatever its value)."""


@dataclass(frozen=True)
class NativeRecipe:
    """What a config that is already FP8 in a host's own keys means (:meth:`HostAdapter.read_native`).

    Attributes:
        host: the host whose keys were read.
        spec: the registered recipe those keys spell, with the fields they set differently
            (None: the keys turn FP8 on but map to no recipe of ours; :attr:`unmatched` says why).
        read: ``(dotted key, value)`` of each native key the reading rests on, as written.
        differs: the spec fields the keys set differently from the registered preset
            ``spec.name`` (``{"kv_cache": "fp8"}``), so the reading says what was changed.
        alike: other registered recipes whose keys here are the same (what tells them apart
            lives outside the config, e.g. an environment variable), with that reason.
        unmatched: ``key: what it means`` for each FP8 key no recipe of ours spells.
    """

    host: str
    spec: RecipeSpec | None
    read: tuple[tuple[str, Any], ...] = ()
    differs: tuple[tuple[str, Any], ...] = ()
    alike: tuple[str, ...] = ()
    unmatched: tuple[str, ...] = ()

    def summary(self) -> dict[str, Any]:
        """The ``native`` section of ``explain --json``."""
        return {
            "host": self.host,
            "recipe": self.spec.name if self.spec is not None else None,
            "read": {k: v for k, v in self.read},
            "differs": {k: v for k, v in self.differs},
            "alike": list(self.alike),
            "unmatched": list(self.unmatched),
        }


class HostAdapter(abc.ABC):
    """The contract every host implements, once (as vLLM's ``QuantizationConfig``: the
    abstract methods must be defined, or the subclass cannot be constructed; the hooks have
    default bodies).

    The pipeline (:func:`run`) calls, in order: :meth:`refuse` (every refusal of the host, in
    one place), :meth:`spell` (the host's keys, plain data), :meth:`merge` (writes exactly
    those keys into the config, refusing a native key that contradicts them). Entry points
    that start from a recipe (:func:`recipe_keys`) call :meth:`refuse` and :meth:`spell` with
    ``ctx=None``.
    """

    name: ClassVar[str]
    """The ``--host`` name."""

    runtime: ClassVar[str] = ""
    """Which code applies these keys when the job runs (the host's own FP8 path, or this
    package's), copied onto :attr:`ApplyResult.runtime`."""

    follows_defaults: ClassVar[bool] = False
    """Whether the host reads a NeMo RL ``defaults:`` chain (a request in a parent file is
    then the config's); False: the request must be in the file itself."""

    @abc.abstractmethod
    def refuse(self, spec: RecipeSpec, ctx: HostContext | None) -> None:
        """Raise :class:`FP8ConfigError`, naming the key, for what the host cannot run:
        ``spec`` alone when ``ctx`` is None (an entry point that starts from a recipe), and
        with ``ctx`` also what the config states (layer counts, sections, other keys)."""

    @abc.abstractmethod
    def spell(
        self, spec: RecipeSpec, ctx: HostContext | None = None, *, model: Any = None
    ) -> HostKeys:
        """The host's native keys for ``spec``, nested as the host's config holds them (plain
        data, no host import, no file). ``ctx`` adds the model, the user's stated fields and
        the layout of the config; without it ``model`` (a model description) may be given."""

    @abc.abstractmethod
    def merge(self, ctx: HostContext, keys: HostKeys) -> ApplyResult:
        """The config with ``keys`` (what :meth:`spell` gave for ``ctx``) written in; a
        native key already set to something else is refused with
        :class:`ConflictingKeyError`. ``ctx.request`` is not None."""

    def passthrough(self, ctx: HostContext) -> Any:
        """The output for a config that asks for no recipe: the file as written."""
        return copy.deepcopy(dict(ctx.raw))

    def validate(self, result: ApplyResult, ctx: HostContext) -> list[str]:
        """Check ``result`` with the host's own code; raise :class:`FP8ConfigError` when the
        host rejects it; return one line per check made or skipped (and why)."""
        return [f"{self.name}: not checked (no check of the host's own code here)"]

    def default(self, key: str, data: Mapping[str, Any]) -> Any:
        """What the host does with the dotted ``key`` when neither the config nor its
        ``defaults:`` parents set it: its own default value (read from the host's source or
        recorded from it and checked against it by a test), or, for a key that the output
        ``data`` makes inert, the value ``data`` holds (either way writing it changes
        nothing, so :func:`run` leaves it out); :data:`NO_DEFAULT` when not known."""
        return NO_DEFAULT

    def read_native(self, ctx: HostContext) -> NativeRecipe | None:
        """The recipe a config asking for none (``ctx.request`` None) already runs in the
        host's own FP8 keys, or None when those keys turn nothing to FP8 (or the host has no
        reader). Keys no recipe of ours spells are named in :attr:`NativeRecipe.unmatched`,
        never raised."""
        return None


def apply_path(adapter: HostAdapter, path: str | Path, **context: Any) -> ApplyResult:
    """:func:`run` on a config file. ``context``: the keyword arguments of
    :func:`load_context` (``hardware``, ``strict``, ``output``...)."""
    return run(adapter, load_context(path, **{"host": adapter.name, **context}))


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


def refuse_recipe(host: str | HostAdapter, spec: RecipeSpec) -> None:
    """Everything ``host`` refuses of ``spec`` alone (no config): what ``apply`` refuses of a
    config asking for the same recipe, minus what only the config can state."""
    adapter = get_adapter(host) if isinstance(host, str) else host
    refuse_qat_elsewhere(adapter, spec, None)
    adapter.refuse(spec, None)


def refuse_qat_elsewhere(adapter: HostAdapter, spec: RecipeSpec, ctx: HostContext | None) -> None:
    """ModelOpt quantization-aware RL (``qat``) is spelled for NeMo RL only; any other host
    would silently train Transformer Engine NVFP4 instead, so it is refused."""
    if spec.qat is None or adapter.name == "nemo-rl":
        return
    in_block = ctx is not None and isinstance(ctx.resolved.get("fp8"), Mapping)
    raise FP8ConfigError(
        f"ModelOpt quantization-aware RL is NeMo RL's path (policy.quant_cfg); the plugin "
        f"writes no ModelOpt keys for {adapter.name}",
        key="fp8.qat" if in_block else "qat",
        value=spec.qat.preset,
        hint="use --host nemo-rl, or remove qat (Transformer Engine NVFP4 training)",
    )


def recipe_keys(host: str | HostAdapter, spec: Any, *, model: Any = None) -> HostKeys:
    """The one function for code that starts from a recipe rather than a config (NeMo-Run
    factories, Bridge's registration, vLLM's ``engine_kwargs``, the training callbacks):
    ``spec`` (a :class:`RecipeSpec`, a name or a mapping) refused as ``apply`` refuses it,
    then spelt as ``apply`` spells it."""
    from ..registry import get_recipe

    adapter = get_adapter(host) if isinstance(host, str) else host
    spec = get_recipe(spec)
    refuse_qat_elsewhere(adapter, spec, None)
    adapter.refuse(spec, None)
    return adapter.spell(spec, None, model=model)


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
    (``explain``, ``doctor``), not refused here (:func:`~nemo_fp8_plugin.config.find_fp8_request`).
    ``stack``: the ``--stack`` name (None: the installed versions). ``host_forced``: the
    host was chosen with ``--force`` against the config's shape (:func:`refuse_other_host`).
    ``host``: whose sides the target GPU is judged for
    (:func:`~nemo_fp8_plugin.hosts.hardware.targeted`; None: the host the config's shape
    names).
    """
    from ..config import find_fp8_request, load_config_chain
    from ..stacks import assumed_versions

    assumed = assumed_versions(stack)  # a bad --stack is refused before the file is read

    path = Path(path)
    raw, resolved = load_config_chain(path)
    request = find_fp8_request(resolved, hardware=hardware, check_hardware=False)
    if check_hardware:
        from .hardware import targeted

        request = targeted(request, host if host is not None else detect_host(resolved))
    found = _model_of(request, resolved, path, model, model_config)
    return HostContext(
        path=path,
        raw=raw,
        resolved=resolved,
        request=request,
        model=found.model,
        model_notes=tuple(found.notes),
        model_key=found.key,
        stated=_stated(resolved),
        hardware=hardware,
        output=Path(output) if output not in (None, "-") else None,
        strict=strict,
        fmt="json" if path.suffix.lower() == ".json" else "yaml",
        stack=assumed,
        host_forced=host_forced,
    )


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
    working directory without one). ``stack``: a ``--stack`` name whose versions (and NeMo RL
    release) to assume; None: no stack (no host versions; NeMo RL's newest release)."""
    from ..config import find_fp8_request
    from ..errors import format_value
    from ..stacks import assumed_versions

    if not isinstance(config, Mapping):
        raise FP8ConfigError(f"a config must be a mapping, got {format_value(config)}")
    from ..errors import check_depth

    # A mapping built in code can contain itself (d["a"] = d): every walk over it below
    # would recurse without end. Refused by depth, walked without recursion.
    check_depth(dict(config), key="config", what="the config mapping (or it contains itself)")
    request = find_fp8_request(config, hardware=hardware)
    where = Path(path) if path is not None else Path("config.yaml")
    found = _model_of(request, config, where, model, None)
    return HostContext(
        path=Path(path) if path is not None else None,
        raw=config,
        resolved=config,
        request=request,
        model=found.model,
        model_notes=tuple(found.notes),
        model_key=found.key,
        stated=_stated(config),
        hardware=hardware,
        strict=strict,
        stack=assumed_versions(stack) if stack is not None else None,
    )


def _stated(config: Mapping[str, Any]) -> frozenset[str]:
    block = config.get("fp8")
    if not isinstance(block, Mapping):
        return frozenset()
    return frozenset(k for k in block if isinstance(k, str))


@dataclass(frozen=True)
class _FoundModel:
    model: ModelDescription | None = None
    notes: tuple[str, ...] = ()
    key: str | None = None


def _model_of(
    request: FP8Request | None,
    config: Mapping[str, Any],
    path: Path,
    model: str | None,
    model_config: str | Path | None,
) -> _FoundModel:
    """The model description the rules resolve against, where it came from, and why there
    is none.

    Precedence: ``--model-config``, ``--model``, ``fp8.model`` (its errors are the user's),
    the megatron-core sizes of the config's ``model:`` section, then a model name the host
    config carries (NeMo RL ``policy.model_name``, a vLLM ``model:``), which may be unknown
    to the built-in table without that being an error. Files are read relative to the
    config's directory, whatever the working directory.
    """
    from ..rules import describe_model

    if request is None:
        return _FoundModel()
    if model_config is not None:
        return _FoundModel(
            describe_model(str(model_config), key="--model-config"), (), "--model-config"
        )
    if model is not None:
        return _FoundModel(describe_model(model, key="--model"), (), "--model")
    block = config.get("fp8")
    if isinstance(block, Mapping) and block.get("model") is not None:
        found = describe_model(block["model"], key="fp8.model", base_dir=path.parent)
        return _FoundModel(found, (), "fp8.model")
    sizes = megatron_model_section(config)
    if sizes is not None:
        where, section = sizes
        try:
            return _FoundModel(describe_model(section, key=where), (), where)
        except FP8ConfigError as err:
            return _FoundModel(None, (f"{err}; per-layer decisions are not shown",))
    named, key = request.model, "policy.model_name" if request.model else None
    if named is None and isinstance(config.get("model"), str):  # vLLM engine configs
        named, key = config["model"], "model"
    if named is not None:
        try:
            return _FoundModel(describe_model(named, key="model", base_dir=path.parent), (), key)
        except FP8ConfigError as err:
            return _FoundModel(None, (f"{err}; per-layer decisions are not shown",))
    if not request.spec.bf16_layers.empty:
        return _FoundModel(
            None,
            (
                "the config names no model: pass --model NAME or --model-config PATH to "
                "see which layers the bf16_layers rules keep in BF16",
            ),
        )
    return _FoundModel()


def megatron_model_section(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]] | None:
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


def model_shape_findings(ctx: HostContext) -> list[Any]:
    """What the model's GEMM dimensions (split as the config splits them) mean for the
    recipe, each keyed by the config key to change: the TP key when the split is at fault,
    ``<section>.<field>`` for sizes the config states, else the key naming the model.
    ``explain`` and :func:`run` (so ``apply``) both read this one list."""
    if ctx.request is None or ctx.model is None:
        return []
    from .alignment import dimension_findings
    from .nemo_rl.values import resolved_value

    found = dimension_findings(ctx.spec, ctx.model, ctx.resolved, resolved_value)
    out = []
    for f in found:
        key = f.key
        if key.startswith("model.") and ctx.model_key is not None:
            field_name = key.split(".", 1)[1]
            named = megatron_model_section(ctx.resolved)
            key = (
                f"{ctx.model_key}.{field_name}"
                if named is not None and named[0] == ctx.model_key
                else ctx.model_key
            )
        out.append(type(f)(f.level, key, f.message))
    return out


def check_model_shape(ctx: HostContext) -> list[str]:
    """Refuse a model the recipe's GEMMs cannot run (:func:`model_shape_findings` at level
    error); return the warnings, one line each."""
    warnings = []
    for f in model_shape_findings(ctx):
        if f.level == "error":  # MXFP8 cannot run on a partial 32-element block
            assert ctx.model is not None
            raise FP8ConfigError(
                f"{f.message} (model {ctx.model.name})",
                key=f.key,
                hint=f"recipe {ctx.spec.name!r}: use a tensor parallel size that keeps "
                f"every per-rank size a multiple, or another recipe",
            )
        warnings.append(f"{f.key}: {f.message}")
    return warnings


_VLLM_ENGINE_KEYS = (
    "tensor_parallel_size",
    "max_model_len",
    "gpu_memory_utilization",
    "quantization",
    "kv_cache_dtype",
    "served_model_name",
    "enforce_eager",
    "dtype",
)


def detect_host(config: Mapping[str, Any]) -> str | None:
    """The host a config is written for, from its shape: ``policy:`` with ``megatron_cfg`` or
    ``generation`` is NeMo RL; ``trainer:`` NeMo 2; ``mixed_precision:`` Megatron-Bridge; a
    string ``model:`` with vLLM engine options (dashes or underscores) vLLM; a ``model:`` or
    ``language_model:`` mapping megatron-core; None for a config with none of these
    (``precision:`` alone)."""
    policy = config.get("policy")
    if isinstance(policy, Mapping) and ("megatron_cfg" in policy or "generation" in policy):
        return "nemo-rl"
    if isinstance(config.get("trainer"), Mapping):
        return "nemo2"
    if "mixed_precision" in config:
        return "bridge"
    options = {k.replace("-", "_") for k in config if isinstance(k, str)}
    if isinstance(config.get("model"), str) and options & set(_VLLM_ENGINE_KEYS):
        return "vllm"
    if isinstance(config.get("model"), Mapping) or isinstance(
        config.get("language_model"), Mapping
    ):
        return "megatron"
    return None


_SHAPE_SERVES = {"megatron": ("nemo2", "bridge")}
"""Hosts a config shaped for another one also serves: a megatron-core model config is also a
NeMo 2 / Megatron-Bridge overlay."""


def shape_mismatch(
    adapter: HostAdapter, ctx: HostContext, accepted: tuple[str, ...] | None = None
) -> str | None:
    """The host the config's shape names (:func:`detect_host`) when it is not ``accepted``
    (default: the adapter's own) and the shape does not serve the adapter too (a megatron-core
    model config serves NeMo 2 and Bridge); None when they agree or the shape names none."""
    other = detect_host(ctx.raw) or detect_host(ctx.resolved)
    if other is None or other in (accepted or (adapter.name,)):
        return None
    return None if adapter.name in _SHAPE_SERVES.get(other, ()) else other


def refuse_other_host(
    adapter: HostAdapter, ctx: HostContext, accepted: tuple[str, ...] | None = None
) -> None:
    """Refuse a config whose shape says it is for another host (:func:`detect_host`) than
    ``accepted`` (default: the adapter's own): its keys would land where that host never
    reads them (a NeMo RL config given ``--host megatron`` would get a root ``model: {fp8:
    ...}`` NeMo RL ignores, and train in BF16). ``ctx.host_forced`` (``--force``) lets it
    through: the command says so."""
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


def _refuse_parent_request(adapter: HostAdapter, ctx: HostContext) -> None:
    if ctx.request is not None and not adapter.follows_defaults and not ctx.in_file:
        raise FP8ConfigError(
            f"the FP8 request is in a parent file named by defaults:, which "
            f"{adapter.name} configs do not have",
            key=ctx.request.keys[0],
            hint="put the request in this file (only NeMo RL configs chain "
            "parents), or use --host nemo-rl",
        )


def run(adapter: HostAdapter, ctx: HostContext) -> ApplyResult:
    """The one pipeline: request -> refuse -> spell -> merge -> strict -> result."""
    _refuse_parent_request(adapter, ctx)
    if ctx.request is None:
        data = adapter.passthrough(ctx)
        result = ApplyResult(data=data, warnings=[NO_REQUEST], requested=False, fmt=ctx.fmt)
        result.written, result.removed = diff_written(ctx.raw, data)
        return result
    from ..config import check_sections

    # Typed before merging: a list where the host reads a mapping names its key.
    check_sections(adapter.name, ctx.raw)
    if adapter.follows_defaults:
        check_sections(adapter.name, ctx.resolved)
    # The model's shape first, as explain checks it before any host.
    shape = check_model_shape(ctx)
    refuse_qat_elsewhere(adapter, ctx.spec, ctx)
    adapter.refuse(ctx.spec, ctx)
    keys = adapter.spell(ctx.spec, ctx)
    try:
        result = adapter.merge(ctx, keys)
    except ConflictingKeyError as err:
        raise ConflictingKeyError(
            f"{err.bare_message} (host {adapter.name})", key=err.key, value=err.value, hint=err.hint
        ) from None
    result.warnings[:0] = [w for w in shape if w not in result.warnings]
    if result.written is None:
        _drop_no_ops(adapter, ctx, result.data)
        result.written, result.removed = diff_written(ctx.raw, result.data)
    if not result.runtime:
        result.runtime = adapter.runtime
    if ctx.strict and result.warnings:
        more = f" (and {len(result.warnings) - 1} more)" if len(result.warnings) > 1 else ""
        raise FP8ConfigError(
            result.warnings[0] + more,
            key="--strict",
            hint="fix the rules, or drop --strict to see every warning",
        )
    return result


_ABSENT = object()


def read_native(ctx: HostContext, host: str | None) -> NativeRecipe | None:
    """The one dispatch of :meth:`HostAdapter.read_native` (``explain``): ``host``'s reader,
    else the first host whose reader finds FP8 keys in the config (None: none does)."""
    names = [host] if host is not None else [n for n in ADAPTERS if n != "te"]
    for name in names:
        reading = get_adapter(name).read_native(ctx)
        if reading is not None:
            return reading
    return None


def _same_value(a: Any, b: Any) -> bool:
    """Equal as the host reads them: numbers by value (``0`` and ``0.0``), a bool only as a
    bool, everything else by equality and type."""
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, numbers) and isinstance(b, numbers):
        return float(a) == float(b)
    return type(a) is type(b) and a == b


def _drop_no_ops(adapter: HostAdapter, ctx: HostContext, data: Any) -> None:
    """Leave out of ``data`` each key the adapter wrote that changes nothing: the config's
    file does not set it, and what it already means (its ``defaults:`` parents' value, else
    :meth:`HostAdapter.default`) is the value written. A key the file sets (to be reset) and
    a key whose absent meaning is unknown are kept; sections left empty and new are dropped."""
    from ..dotted import delete_path, flatten, get_path

    if not isinstance(data, dict):
        return
    written, _ = diff_written(ctx.raw, data)
    # A fully resolved output (NeMo RL's resolve=True) carries its parents' keys itself.
    whole = "defaults" in ctx.raw and "defaults" not in data
    for key, value in list(flatten(written)):
        if get_path(ctx.raw, key, _ABSENT) is not _ABSENT:
            continue
        meant = get_path(ctx.resolved, key, _ABSENT)
        if meant is not _ABSENT and whole:
            continue
        if meant is _ABSENT:
            meant = adapter.default(key, data)
        if meant is NO_DEFAULT or not _same_value(meant, value):
            continue
        delete_path(data, key)
        parts = key.split(".")[:-1]
        while parts:
            here = ".".join(parts)
            node = get_path(data, here, _ABSENT)
            if node != {} or get_path(ctx.raw, here, _ABSENT) is not _ABSENT:
                break
            delete_path(data, here)
            parts.pop()


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

"""The adapter contract: what a host adapter is given, what it answers, and the records it
answers with (plain data, no host import).

A command loads its config once (:class:`HostContext`, :mod:`.context`); an adapter's
:meth:`HostAdapter.spell` turns a recipe into flat :class:`Write` s (:class:`Spelling`), and
one shared writer (:func:`nemo_fp8_plugin.hosts.pipeline.run`) merges them into the config.
Warnings and notes are :class:`Message` records: code decides on their fields, never on
their wording.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..dotted import get_path, set_path

if TYPE_CHECKING:
    from ..config import FP8Request
    from ..errors import FP8ConfigError
    from ..rules import ModelDescription
    from ..spec import RecipeSpec
    from ..stacks import Assumed

__all__ = [
    "RuleIssueKind",
    "Message",
    "Write",
    "DELETE",
    "Spelling",
    "ApplyResult",
    "HostContext",
    "NativeRecipe",
    "NO_DEFAULT",
    "NO_REQUEST",
    "HostAdapter",
    "same_value",
]

NO_REQUEST = (
    "no FP8 recipe requested (no `precision:`, `policy.precision:`, "
    "`mixed_precision:` or `fp8:` naming one); the config runs in its own precision"
)
"""The one message for a config that asks for no FP8 recipe."""


class RuleIssueKind(Enum):
    """Why a host's spelling of a ``bf16_layers.modules`` rule falls short."""

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
class Message:
    """A warning or a note, as data (``str()`` is the line a user reads).

    Attributes:
        text: what is said.
        host: the host it is about (``""``: none named): ``"<host>: <text>"``, or after the
            rules it concerns ``"<rules> (host <host>): <text>"``.
        rules: the rule labels it concerns (``bf16_layers.modules[0]='*gate*'``), or ``""``.
        kind: what falls short of those rules, or None.
        indices: the positions of those rules in ``bf16_layers.modules``.
        patterns: their globs, in the order of :attr:`indices`.
    """

    text: str
    host: str = ""
    rules: str = ""
    kind: RuleIssueKind | None = None
    indices: tuple[int, ...] = ()
    patterns: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.rules:
            return f"{self.rules} (host {self.host}): {self.text}"
        return f"{self.host}: {self.text}" if self.host else self.text

    def about(self, host: str) -> Message:
        """The same message said of ``host``."""
        return dataclasses.replace(self, host=host)

    @property
    def key(self) -> str:
        """The first rule's key, ``bf16_layers.modules[<index>]``."""
        return f"bf16_layers.modules[{self.indices[0]}]"


class _Delete:
    def __repr__(self) -> str:
        return "DELETE"


DELETE: Any = _Delete()
""":attr:`Write.value` that removes the key."""


@dataclass(frozen=True)
class Write:
    """One native key a recipe decides, flat.

    Attributes:
        key: the dotted key in the host's config (``model.fp8_recipe``).
        value: what it must hold (:data:`DELETE`: the key is removed).
        why: what the key carries, named by a conflict's hint (``""``: the recipe).
        guard: only a check: a value the config already has there must agree (or be one the
            host may overwrite); nothing is written.
        checked: False when the spelling already reconciled the key with the config (a
            sequence length raised to the alignment), so it is written whatever is there.
    """

    key: str
    value: Any
    why: str = ""
    guard: bool = False
    checked: bool = True


@dataclass
class Spelling:
    """A host's native spelling of a recipe: flat writes and what goes with them.

    Attributes:
        writes: the keys, in writing order.
        warnings: what the host cannot express, each naming the rule or the field.
        env: environment variables the host's process must have.
        notes: advice that loses nothing (copied onto :attr:`ApplyResult.notes`).
    """

    writes: list[Write] = field(default_factory=list)
    warnings: list[Message] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    notes: list[Message] = field(default_factory=list)

    def set(self, key: str, value: Any, why: str = "", **flags: bool) -> None:
        """Write ``key`` (a later write of a key replaces the earlier one, in its place)."""
        self._add(Write(key, value, why, **flags))

    def guard(self, key: str, value: Any) -> None:
        """Add a guard: an existing value at ``key`` must agree with ``value``."""
        self._add(Write(key, value, guard=True))

    def _add(self, write: Write) -> None:
        for i, w in enumerate(self.writes):
            if w.key == write.key and w.guard == write.guard:
                self.writes[i] = write
                return
        self.writes.append(write)

    def extend(self, other: Spelling, prefix: str = "") -> Spelling:
        """Take ``other``'s writes (under ``prefix``), warnings, env and notes."""
        for w in other.writes:
            self._add(dataclasses.replace(w, key=prefix + w.key))
        self.warnings += other.warnings
        self.env.update(other.env)
        self.notes += other.notes
        return self

    @property
    def keys(self) -> dict[str, Any]:
        """The written keys, nested as the host's config holds them."""
        out: dict[str, Any] = {}
        for w in self.writes:
            if not w.guard and w.value is not DELETE:
                set_path(out, w.key, w.value)
        return out

    def get(self, key: str, default: Any = None) -> Any:
        """The value written at ``key`` (the last write), or ``default``."""
        found = [w.value for w in self.writes if w.key == key and not w.guard]
        return found[-1] if found else default


@dataclass
class ApplyResult:
    """What the pipeline produces for one host.

    Attributes:
        data: the output mapping (what ``apply`` writes).
        warnings: what the host cannot express or drops; ``--strict`` makes the first an error.
        notes: advice that loses nothing (where to export an environment variable, ...).
        env: environment variables the host's process needs and its config cannot carry.
        fmt: ``"yaml"`` or ``"json"``.
        written: the keys ``data`` sets or changes relative to the input, nested (what
            ``explain`` shows for the host).
        removed: dotted keys of the input that ``data`` drops (the request keys it consumed).
        requested: whether the config asked for a recipe (False: ``data`` is the input).
        runtime: which code applies these keys when the job runs.
        files: companion files ``apply`` writes (atomically, before the output): path -> text.
        edit: whether ``data`` is the input edited (False: a new document).
        checks: pre-flight records as plain data, by name, for ``explain --json`` and
            ``doctor`` (NeMo RL: ``rollout``, ``kv_cache``, ``ignore_list``); the lines that
            say them are among :attr:`notes` / :attr:`warnings`.
    """

    data: Any
    warnings: list[Message] = field(default_factory=list)
    notes: list[Message] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    fmt: str = "yaml"
    written: dict[str, Any] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    requested: bool = True
    runtime: str = ""
    files: dict[str, str] = field(default_factory=dict)
    edit: bool = True
    checks: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The host section of ``explain --json``."""
        out: dict[str, Any] = {"keys": self.written}
        for name in ("removed", "env", "warnings", "notes", "runtime", "checks"):
            value = getattr(self, name)
            if value:
                out[name] = [str(m) for m in value] if name in ("warnings", "notes") else value
        if self.files:
            out["files"] = sorted(self.files)
        return out


@dataclass(frozen=True)
class HostContext:
    """Everything an adapter may read about the command it serves, loaded once.

    Attributes:
        path: the config file, or None for a mapping given in code.
        raw: the file as written (its ``defaults:`` chain not merged in).
        resolved: the file with its ``defaults:`` chain merged parent-first (``raw`` itself
            when it has none).
        request: the FP8 request found in ``resolved`` (None: the config asks for none).
        model: the model description the per-layer rules resolve against, or None.
        model_notes: why there is no model description when one would matter.
        model_key: where the model description came from, as the key a message names: a
            section holding megatron-core sizes (a dimension is named ``<section>.<field>``),
            or the key naming the model (``--model``, ``fp8.model``, ``policy.model_name``...).
        stated: the fields the user wrote in the ``fp8:`` block, so an adapter can tell a
            user's choice from a preset's default.
        hardware: the ``--hardware`` target, or None.
        output: where the result will be written (None: standard output).
        strict: ``--strict``.
        fmt: the input's format, ``"yaml"`` or ``"json"``.
        stack: the host versions assumed (``--stack NAME``, else the installed ones); None for
            a mapping given in code.
        host_forced: ``--force`` with ``--host``: the host was chosen against the config's shape.
        sources: every file of the ``defaults:`` chain, the config first (read once).
        described: every model this command described (or refused), by name: a model is
            described once per command.
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
    sources: tuple[Path, ...] = ()
    described: dict[tuple[str, str, Path | None], ModelDescription | FP8ConfigError] = field(
        default_factory=dict, compare=False, hash=False
    )

    def assumed_version(self, host: str) -> str | None:
        """The version of ``host`` this command assumes (``--stack``'s pin, else the installed
        one); None when absent or the context was built in code without a stack."""
        return self.stack.version(host) if self.stack is not None else None

    @property
    def spec(self) -> RecipeSpec:
        """The requested spec (only valid when :attr:`request` is not None)."""
        assert self.request is not None
        return self.request.spec

    @property
    def in_file(self) -> bool:
        """Whether every request key is in the file itself (not only in a parent)."""
        return self.request is not None and all(
            get_path(self.raw, k, _ABSENT) is not _ABSENT for k in self.request.keys
        )

    @property
    def prefix(self) -> str:
        """``"fp8"`` when the request is an ``fp8:`` block (spec keys are named under it)."""
        return "fp8" if self.request is not None and "fp8" in self.request.keys else ""

    def describe(self, name: Any, key: str, base_dir: Path | None = None) -> ModelDescription:
        """:func:`~nemo_fp8_plugin.rules.describe_model` of ``name`` (a file read relative to
        ``base_dir``), once per command: a refusal is raised again, not described again."""
        from ..errors import FP8ConfigError
        from ..rules import describe_model

        slot = (repr(name), key, base_dir)
        if slot not in self.described:
            try:
                self.described[slot] = describe_model(name, key=key, base_dir=base_dir)
            except FP8ConfigError as err:  # the same refusal, every time it is asked
                self.described[slot] = err
        found = self.described[slot]
        if isinstance(found, FP8ConfigError):
            raise found
        return found


_ABSENT = object()

NO_DEFAULT: Any = type("NoDefault", (), {"__repr__": lambda self: "NO_DEFAULT"})()
""":meth:`HostAdapter.default`'s answer for a key whose absent meaning is not known."""


def same_value(a: Any, b: Any) -> bool:
    """Equal as a host reads them: numbers by value (``0`` and ``0.0``), a bool only as a
    bool, everything else by equality and type."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return type(a) is type(b) and a == b


@dataclass(frozen=True)
class NativeRecipe:
    """What a config that is already FP8 in a host's own keys means.

    Attributes:
        host: the host whose keys were read.
        spec: the registered recipe those keys spell, with the fields they set differently
            (None: the keys turn FP8 on but map to no recipe of ours; :attr:`unmatched` says why).
        read: ``(dotted key, value)`` of each native key the reading rests on, as written.
        differs: the spec fields the keys set differently from the preset ``spec.name``.
        alike: other registered recipes whose keys here are the same, with that reason.
        unmatched: ``key: what it means`` for each FP8 key no recipe of ours spells.
        ignored: ``key: what runs instead`` for each FP8 key the config sets that the host
            release assumed does not read (it is left out of the reading: the run ignores it).
    """

    host: str
    spec: RecipeSpec | None
    read: tuple[tuple[str, Any], ...] = ()
    differs: tuple[tuple[str, Any], ...] = ()
    alike: tuple[str, ...] = ()
    unmatched: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()

    def summary(self) -> dict[str, Any]:
        """The ``native`` section of ``explain --json``."""
        return {
            "host": self.host,
            "recipe": self.spec.name if self.spec is not None else None,
            "read": {k: v for k, v in self.read},
            "differs": {k: v for k, v in self.differs},
            "alike": list(self.alike),
            "unmatched": list(self.unmatched),
            "ignored": list(self.ignored),
        }


class HostAdapter(abc.ABC):
    """The contract every host implements, once (as vLLM's ``QuantizationConfig``: the
    abstract methods must be defined; the hooks have default bodies).

    The pipeline calls :meth:`refuse` (every refusal, in one place), then :meth:`spell` (the
    host's keys as flat writes), merges them with the one shared writer (conflicts with the
    user's values refused through :meth:`same` / :meth:`overwrites`, no-ops left out through
    :meth:`default`), then :meth:`finish`. Code that starts from a recipe calls :meth:`refuse`
    and :meth:`spell` with ``ctx=None``.
    """

    name: ClassVar[str]
    """The ``--host`` name."""

    label: ClassVar[str] = ""
    """The host as messages name it (``"NeMo RL"``)."""

    runtime: ClassVar[str] = ""
    """Which code applies these keys when the job runs, copied onto :attr:`ApplyResult.runtime`."""

    follows_defaults: ClassVar[bool] = False
    """Whether the host reads a ``defaults:`` chain (a request in a parent file is then the
    config's, and values are compared with the merged chain); False: the file alone."""

    edits_config: ClassVar[bool] = True
    """Whether the output is the config edited (False: a new document, written whole)."""

    spells_qat: ClassVar[bool] = False
    """Whether the host has keys for ModelOpt quantization-aware RL (``qat``)."""

    serves_shapes: ClassVar[tuple[str, ...]] = ()
    """Other hosts whose config shape this host also reads (a megatron-core model config is
    also a NeMo 2 / Megatron-Bridge overlay)."""

    detect_order: ClassVar[int] = 100
    """Where :meth:`detects` is asked among the hosts (lower first); the first yes wins."""

    @abc.abstractmethod
    def refuse(self, spec: RecipeSpec, ctx: HostContext | None) -> None:
        """Raise :class:`FP8ConfigError`, naming the key, for what the host cannot run:
        ``spec`` alone when ``ctx`` is None, with ``ctx`` also what the config states."""

    @abc.abstractmethod
    def spell(
        self, spec: RecipeSpec, ctx: HostContext | None = None, *, model: Any = None
    ) -> Spelling:
        """The host's native keys for ``spec`` as flat writes, for ``ctx``'s config (its
        section layout, an existing block, the user's stated fields); without a context for
        a fresh config (``model``: a model description)."""

    def detects(self, config: Mapping[str, Any]) -> bool:
        """Whether ``config``'s shape is this host's."""
        return False

    def base(self, ctx: HostContext) -> dict[str, Any]:
        """The mapping the writes go into: the file as written (copied)."""
        return copy.deepcopy(dict(ctx.raw)) if self.edits_config else {}

    def passthrough(self, ctx: HostContext) -> Any:
        """The output for a config that asks for no recipe: the file as written."""
        return self.base(ctx)

    def value(self, config: Mapping[str, Any], key: str, default: Any = None) -> Any:
        """``key`` of ``config`` as the host reads it (interpolations resolved)."""
        return get_path(config, key, default)

    def same(self, key: str, have: Any, want: Any) -> bool:
        """Whether the value the config has at ``key`` already says ``want``."""
        return same_value(have, want)

    def overwrites(self, ctx: HostContext, key: str, have: Any, want: Any) -> bool:
        """Whether ``have`` (not None, not the same) is a value the recipe may overwrite with
        ``want`` (what a config without FP8 holds there); False: a conflict."""
        return False

    def conflict(self, ctx: HostContext, write: Write, have: Any) -> FP8ConfigError:
        """The refusal of ``write`` where the config holds ``have``."""
        from ..errors import ConflictingKeyError, format_value

        return ConflictingKeyError(
            f"already set to {format_value(have)}, but {ctx.spec.name} as requested needs "
            f"{format_value(write.value)}",
            key=write.key,
            value=have,
            hint=write.why
            or "state the recipe once: remove the native key or the plugin's precision/fp8 key",
        )

    def default(self, key: str, data: Mapping[str, Any]) -> Any:
        """What the host does with ``key`` when no file of the config sets it (its own
        default, or, for a key the output ``data`` makes inert, the value ``data`` holds): a
        write of that value changes nothing and is left out; :data:`NO_DEFAULT` when unknown."""
        return NO_DEFAULT

    def finish(self, ctx: HostContext, result: ApplyResult) -> ApplyResult:
        """The host's last step on the merged result (companion files, its own start-up
        checks on the config as written)."""
        return result

    def validate(self, result: ApplyResult, ctx: HostContext) -> list[str]:
        """Check ``result`` with the host's own code; one line per check made or skipped."""
        return [f"{self.name}: not checked (no check of the host's own code here)"]

    def read_native(self, ctx: HostContext) -> NativeRecipe | None:
        """The recipe a config asking for none already runs in the host's own FP8 keys, or
        None."""
        return None

    def check_native(self, ctx: HostContext, result: ApplyResult) -> None:
        """The host's own checks of a config already FP8 in its keys, as :meth:`finish` runs
        them on what it writes: ``ctx.spec`` is the recipe :meth:`read_native` read back (with
        the target GPU), ``result`` the config left as it is; refusals raise, what runs is
        added to ``result`` (notes, warnings, checks, env). The default: none (the read-back
        recipe's hardware target is the pipeline's)."""
        return None

    def preamble(self, ctx: HostContext) -> list[str]:
        """Lines ``apply`` prints first (which host release the keys are written for)."""
        return []

    def env_lines(self, result: ApplyResult) -> list[str]:
        """Lines ``apply`` prints for :attr:`ApplyResult.env` no config key carries."""
        return []

    def refusal(self, err: FP8ConfigError, ctx: HostContext) -> FP8ConfigError:
        """``err`` as the command reports it (a refusal naming an assumed release says how it
        was decided)."""
        return err

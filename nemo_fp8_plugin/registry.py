"""The recipe registry: built-in presets plus recipes other packages declare.

Built-ins are the YAML presets of ``conf/recipes/`` (shipped inside the wheel as
``nemo_fp8_plugin/_conf/recipes``). Third-party packages add recipes through the entry-point
group ``nemo_fp8_plugin.recipes``: the entry-point name is the recipe name and the object
is a :class:`~nemo_fp8_plugin.spec.RecipeSpec`, a mapping in the preset format, or a
zero-argument callable returning either. A name claimed twice is refused with an error
that names both sources, never silently shadowed.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import LIMITS, FP8ConfigError, RecipeRegistryError, check_limit, format_value, suggest
from .spec import RecipeSpec

__all__ = [
    "ENTRY_POINT_GROUP",
    "RecipeRegistry",
    "default_registry",
    "get_recipe",
    "list_recipes",
    "register_recipe",
    "preset_dir",
]

ENTRY_POINT_GROUP = "nemo_fp8_plugin.recipes"


def preset_dir() -> Path:
    """Directory of the built-in preset YAML files (``conf/recipes``)."""
    from ._resources import conf_dir

    return conf_dir("recipes")


_LOADER: type[Any] | None = None


def _safe_loader() -> type[Any]:
    """PyYAML's safe loader, reading floats as YAML 1.2 (and OmegaConf, NeMo RL) do.

    YAML 1.1 wants a dot in a float, so the safe loader alone reads ``1e-8`` (NeMo RL's
    ``adam_eps``) as a string; OmegaConf's loader, which the hosts use, reads a float.
    """
    global _LOADER
    if _LOADER is None:
        import re

        import yaml

        base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

        class Loader(base):  # type: ignore[misc, valid-type]
            def construct_document(self, node: Any) -> Any:
                # Checked on the composed node graph, before anything is built from it, so
                # that nothing later (merging, copying, error messages) walks an unchecked one.
                _check_document(self, node)
                return super().construct_document(node)

        Loader.yaml_implicit_resolvers = {
            k: list(v) for k, v in base.yaml_implicit_resolvers.items()
        }
        Loader.add_implicit_resolver(
            "tag:yaml.org,2002:float",
            re.compile(
                r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                       |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                       |\.[0-9_]+(?:[eE][-+][0-9]+)?
                       |[-+]?\.(?:inf|Inf|INF)
                       |\.(?:nan|NaN|NAN))$""",
                re.X,
            ),
            list("-+0123456789."),
        )
        _LOADER = Loader
    return _LOADER


def _short(path: str) -> str:
    """A dotted key path short enough for one line (deep paths keep both ends)."""
    return path if len(path) <= 120 else f"{path[:40]}...{path[-77:]}"


def _check_document(loader: Any, root: Any) -> None:
    """Refuse, naming the dotted key, what PyYAML would otherwise accept silently or expand
    without bound: a key given twice in one mapping, at any depth (both lines named; PyYAML
    keeps the last), nesting deeper than ``LIMITS.yaml_depth``, more than
    ``LIMITS.yaml_aliases`` alias references, or more than ``LIMITS.yaml_nodes`` values once
    aliases are expanded (a "billion laughs" document is a few lines long). Iterative, so a
    deep document cannot exhaust the Python stack here."""
    import yaml

    where = getattr(root.start_mark, "name", None) or "the document"
    nodes = aliases = 0
    seen: set[int] = set()
    stack: list[tuple[Any, int, str, bool]] = [(root, 0, "", False)]
    while stack:
        node, depth, path, inside = stack.pop()  # inside: below an alias already counted
        nodes += 1
        if nodes > LIMITS.yaml_nodes:
            check_limit(
                nodes,
                LIMITS.yaml_nodes,
                f"{where} holds too many values (aliases expanded); counted",
                key=None,
            )
        again = id(node) in seen
        if again and not inside:
            aliases += 1
            check_limit(
                aliases,
                LIMITS.yaml_aliases,
                f"{where} repeats anchors too often: alias references",
                key=_short(path) or None,
            )
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            continue
        if depth >= LIMITS.yaml_depth:
            raise FP8ConfigError(
                f"{where} nests mappings and lists more than "
                f"{LIMITS.yaml_depth} levels deep (line "
                f"{node.start_mark.line + 1})",
                key=_short(path) or None,
                hint="limits: docs/refusals.md",
            )
        inside = inside or again
        children: list[tuple[Any, int, str, bool]] = []
        if isinstance(node, yaml.SequenceNode):
            children = [
                (item, depth + 1, f"{path}[{i}]", inside) for i, item in enumerate(node.value)
            ]
        elif isinstance(node, yaml.MappingNode):
            first: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges, by design
                    children.append((value_node, depth + 1, path, inside))
                    continue
                label = path
                if isinstance(key_node, yaml.ScalarNode):
                    key = loader.construct_object(key_node)
                    text = str(key)
                    text = text if len(text) <= 80 else text[:77] + "..."
                    label = f"{path}.{text}" if path else text
                    try:
                        earlier = first.setdefault(key, key_node)
                    except TypeError:  # unhashable; the constructor reports it
                        earlier = key_node
                    if earlier is not key_node:
                        # PyYAML keeps the last of two equal keys; a config that says
                        # `precision:` twice is a mistake to report, not a choice to make.
                        raise FP8ConfigError(
                            f"duplicate key {format_value(key)} in {where}: line "
                            f"{key_node.start_mark.line + 1}, "
                            f"column {key_node.start_mark.column + 1}; first at line "
                            f"{earlier.start_mark.line + 1}, column "
                            f"{earlier.start_mark.column + 1}",
                            key=_short(label),
                            hint="keep one of them",
                        )
                else:
                    children.append((key_node, depth + 1, path, inside))
                children.append((value_node, depth + 1, label, inside))
        stack.extend(reversed(children))


def load_yaml_file(path: Path) -> Any:
    """Parse a YAML file safely (no Python object tags; YAML 1.2 floats), within
    :data:`~nemo_fp8_plugin.errors.LIMITS`.

    Only a regular file is read: it is opened without blocking and checked before a byte is
    read, so a FIFO or a device named as a config is refused instead of hanging the command
    (or reading ``/dev/zero`` forever). Raises :class:`FP8ConfigError` for those and for every
    limit; PyYAML's own errors and ``UnicodeDecodeError`` propagate for the caller to word.
    """
    import io
    import os
    import stat

    import yaml

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        if not stat.S_ISREG(mode):
            kind = (
                "a directory"
                if stat.S_ISDIR(mode)
                else "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a special file"
            )
            raise FP8ConfigError(
                f"{path} is {kind}, not a regular file; name a YAML config file", value=str(path)
            )
        data = fh.read(LIMITS.config_bytes + 1)
    check_limit(len(data), LIMITS.config_bytes, f"{path} is too large: bytes", key=None)
    text = _join_surrogate_escapes(data.decode("utf-8"))
    _check_event_count(text, str(path))
    stream = io.StringIO(text)
    stream.name = str(path)  # PyYAML's marks (line numbers) name the file
    try:
        return yaml.load(stream, Loader=_safe_loader())  # a SafeLoader subclass
    except RecursionError:  # the pure-Python composer recurses per level, below our check
        raise FP8ConfigError(
            f"{path} nests mappings and lists too deeply to read", hint="limits: docs/refusals.md"
        ) from None


def _check_event_count(text: str, where: str) -> None:
    """Refuse, from the parser's events and before anything is composed, a document with
    far more values than ``LIMITS.yaml_nodes`` (the composer builds a node for each first:
    150,000 keys took seconds before :func:`_check_document` could count them). Each entry is
    a key and a value, so more than twice the limit in events means more values than the
    limit; the exact count, aliases expanded, is :func:`_check_document`'s."""
    import io

    import yaml

    counted = (yaml.ScalarEvent, yaml.AliasEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)
    events = 0
    stream = io.StringIO(text)
    stream.name = where
    for event in yaml.parse(stream, Loader=_safe_loader()):
        if isinstance(event, counted):
            events += 1
            if events > 2 * LIMITS.yaml_nodes + 1:
                check_limit(
                    LIMITS.yaml_nodes + 1,
                    LIMITS.yaml_nodes,
                    f"{where} holds too many values (aliases expanded); counted",
                    key=None,
                )


_SURROGATE_PAIR = re.compile(
    r"(?<!\\)((?:\\\\)*)\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})"
)


def _join_surrogate_escapes(text: str) -> str:
    """JSON spells a character outside the BMP as two escapes, ``\\ud83d\\ude00``; YAML
    refuses each half ("invalid Unicode character escape"), so valid JSON read as YAML would
    be refused. Each such pair (not itself escaped) becomes YAML's ``\\U0001f600``."""
    if "\\u" not in text:
        return text

    def join(m: re.Match[str]) -> str:
        high, low = int(m.group(2), 16), int(m.group(3), 16)
        code = 0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00)
        return f"{m.group(1)}\\U{code:08x}"

    return _SURROGATE_PAIR.sub(join, text)


class RecipeRegistry:
    """Name -> spec, with the source of each name kept for duplicate reports."""

    def __init__(self) -> None:
        self._specs: dict[str, RecipeSpec] = {}
        self._sources: dict[str, str] = {}

    def register(self, spec: RecipeSpec, source: str) -> None:
        """Add ``spec`` under ``spec.name``; refuse a name that is already taken."""
        if not isinstance(spec, RecipeSpec):
            raise RecipeRegistryError(f"{source} provides {format_value(spec)}, not a RecipeSpec")
        if spec.name in self._specs:
            raise RecipeRegistryError(
                f"recipe {spec.name!r} is defined twice: by {self._sources[spec.name]} and by {source}",
                key=spec.name,
                hint="uninstall or rename one of them",
            )
        self._specs[spec.name] = spec
        self._sources[spec.name] = source

    def get(self, name: str, *, key: str = "recipe") -> RecipeSpec:
        """The spec registered as ``name``; an unknown name lists the valid ones."""
        if isinstance(name, str) and name in self._specs:
            return self._specs[name]
        raise self.unknown(name, key=key)

    def unknown(self, name: Any, *, key: str) -> FP8ConfigError:
        """The error for an unknown recipe name: valid names and the closest one."""
        names = list(self._specs)
        near = suggest(name, names)
        hint = (f"did you mean {near!r}? " if near else "") + f"valid recipes: {', '.join(names)}"
        return FP8ConfigError(
            f"unknown FP8 recipe {format_value(name)}", key=key, value=name, hint=hint
        )

    def source(self, name: str) -> str:
        return self._sources[name]

    def names(self) -> list[str]:
        return list(self._specs)

    def specs(self) -> list[RecipeSpec]:
        return list(self._specs.values())

    def __contains__(self, name: object) -> bool:
        return name in self._specs


def _spec_from_object(obj: Any, name: str, source: str) -> RecipeSpec:
    if callable(obj) and not isinstance(obj, (RecipeSpec, Mapping)):
        try:
            obj = obj()
        except FP8ConfigError as err:
            raise RecipeRegistryError(f"{source} failed to build its recipe: {err}") from None
        except Exception as exc:  # a broken plugin must say which plugin it is
            raise RecipeRegistryError(
                f"{source} failed to build its recipe: {type(exc).__name__}: {exc}"
            ) from exc
    if isinstance(obj, Mapping):
        try:
            obj = RecipeSpec.from_mapping({"name": name, **obj})
        except FP8ConfigError as err:
            raise RecipeRegistryError(f"{source} declares an invalid recipe: {err}") from None
    if not isinstance(obj, RecipeSpec):
        raise RecipeRegistryError(
            f"{source} provides {format_value(obj)}; expected a RecipeSpec, "
            "a mapping, or a zero-argument callable returning one"
        )
    if obj.name != name:
        # The entry-point name is the public name; a spec derived from a preset keeps the
        # preset's name unless renamed, so rename rather than refuse.
        return obj.replace(name=name)
    return obj


# Built-ins in the order users meet them: per-tensor first, then tiles, then MX, then FP4.
_BUILTIN_ORDER = ("fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8", "nvfp4")


def _load_builtins(registry: RecipeRegistry) -> None:
    rank = {n: i for i, n in enumerate(_BUILTIN_ORDER)}
    paths = sorted(preset_dir().glob("*.yaml"), key=lambda p: (rank.get(p.stem, len(rank)), p.stem))
    for path in paths:
        data = load_yaml_file(path)
        source = f"built-in preset {path.name}"
        try:
            spec = RecipeSpec.from_mapping(data)
        except FP8ConfigError as err:
            raise RecipeRegistryError(f"{source} is invalid: {err}") from None
        if spec.name != path.stem:
            raise RecipeRegistryError(
                f"{source} names itself {spec.name!r}; the file name must match"
            )
        registry.register(spec, source)


def _load_entry_points(registry: RecipeRegistry) -> None:
    from importlib.metadata import entry_points

    seen: set[tuple[str, str, str]] = set()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "unknown distribution"
        ident = (ep.name, ep.value, dist)
        if ident in seen:  # the same distribution found twice on sys.path is not a conflict
            continue
        seen.add(ident)
        source = f"entry point '{ep.name} = {ep.value}' of {dist}"
        try:
            obj = ep.load()
        except Exception as exc:
            raise RecipeRegistryError(f"cannot load {source}: {type(exc).__name__}: {exc}") from exc
        registry.register(_spec_from_object(obj, ep.name, source), source)


# Re-entrant: a plugin's factory typically derives its recipe from a built-in with
# get_recipe(), which calls back into default_registry() while it is being built.
_lock = threading.RLock()
_default: RecipeRegistry | None = None
_programmatic: list[tuple[RecipeSpec, str]] = []


def default_registry(*, reload: bool = False) -> RecipeRegistry:
    """The process-wide registry: built-ins, entry points, then programmatic registrations.

    While entry points load, the registry already holds the built-ins, so a plugin's
    factory may start from one (``get_recipe({"recipe": "fp8_blockwise", ...})``).
    """
    global _default
    with _lock:
        if _default is None or reload:
            reg = RecipeRegistry()
            _load_builtins(reg)
            _default = reg
            try:
                _load_entry_points(reg)
                for spec, source in _programmatic:
                    reg.register(spec, source)
            except BaseException:
                _default = None
                raise
        return _default


def register_recipe(
    spec: RecipeSpec | Mapping[str, Any] | Callable[[], Any], *, source: str | None = None
) -> RecipeSpec:
    """Register a recipe from Python (for code that cannot declare an entry point)."""
    if isinstance(spec, Mapping):
        name = spec.get("name")
    elif isinstance(spec, RecipeSpec):
        name = spec.name
    else:
        name = None
    if not isinstance(name, str):
        built = _spec_from_object(spec, "<unnamed>", source or "register_recipe()")
        raise RecipeRegistryError(f"register_recipe() needs a named recipe, got {built.name!r}")
    src = source or "register_recipe()"
    built = _spec_from_object(spec, name, src)
    reg = default_registry()
    with _lock:
        reg.register(built, src)
        _programmatic.append((built, src))
    return built


def get_recipe(recipe: str | Mapping[str, Any] | RecipeSpec) -> RecipeSpec:
    """The one way to turn what a user wrote into a frozen spec.

    Accepts a spec (returned as is); a registered name (``"fp8_blockwise"``, the preset); a
    mapping that starts from one (``{"recipe": "fp8_blockwise", "pow2_scales": True}``: the
    preset with those fields changed, nested ``bf16_layers`` / ``importance_sampling`` merged
    field by field); a full spec mapping (``spec.to_dict()``, no ``recipe`` key, every field
    given); or either mapping as a JSON string (the form NeMo-Run YAML can carry to a
    constructor). Every mistake is an :class:`FP8ConfigError` naming ``recipe``.
    """
    if isinstance(recipe, RecipeSpec):
        return recipe
    if isinstance(recipe, str) and recipe.lstrip().startswith("{"):
        import json  # only for the JSON form

        try:
            recipe = json.loads(recipe)
        except RecursionError:
            raise FP8ConfigError(
                "the JSON recipe mapping is nested too deeply", key="recipe"
            ) from None
        except ValueError as exc:
            raise FP8ConfigError(
                f"not a valid JSON recipe mapping: {format_value(str(exc), limit=200)}",
                key="recipe",
                value=recipe,
            ) from None
    if isinstance(recipe, (dict, list)):
        from .errors import check_depth

        check_depth(recipe, key="recipe", what="the recipe mapping")
    reg = default_registry()
    if isinstance(recipe, str):
        return reg.get(recipe)
    if isinstance(recipe, Mapping):
        overrides = dict(recipe)
        if "recipe" not in overrides:
            if "name" in overrides and "scaling" in overrides:  # a full spec.to_dict()
                return RecipeSpec.from_mapping(overrides)
            raise FP8ConfigError(
                "a recipe mapping must start from a registered name",
                key="recipe",
                hint=f"valid recipes: {', '.join(reg.names())}",
            )
        base = reg.get(overrides.pop("recipe"))
        return base.with_overrides(overrides)
    raise FP8ConfigError(
        f"expected a recipe name or mapping, got {format_value(recipe)}", key="recipe", value=recipe
    )


def list_recipes() -> list[RecipeSpec]:
    """Every registered recipe, built-ins first."""
    return default_registry().specs()

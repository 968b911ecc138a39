"""The recipes the GPU check covers, also where PyYAML is not installed.

The check must run on a GPU machine that has torch and Triton and nothing else, but the
registry reads the built-in presets (``conf/recipes/*.yaml``) with PyYAML. Without it, the
presets are read here by a reader for the one shape they have: one ``key: value`` per line,
values that are scalars or flow collections (``[1, 128]``, ``{first: 0, modules: []}``),
``#`` comments. Anything else is refused with the file and line, never guessed;
``tests/tools/test_gpu_check.py`` holds this reader to PyYAML's result on every preset, so a preset
that outgrows it fails there first. Entry-point recipes need their own packages (and PyYAML)
and are only covered where the registry loads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

__all__ = ["check_recipes", "check_recipe", "read_preset", "preset_paths"]

_INT = re.compile(r"[-+]?[0-9]+$")
# YAML 1.2 floats, as the registry's loader resolves them (exponent without a dot included)
_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][-+]?[0-9]+)?$")


def preset_paths() -> list[Path]:
    """The built-in preset files, by name."""
    from ..._resources import conf_dir

    return sorted(conf_dir("recipes").glob("*.yaml"))


def check_recipes() -> tuple[list[Any], str]:
    """The recipe specs to check and where they came from: the registry (built-ins and entry
    points) where PyYAML imports, else the built-in presets read by :func:`read_preset`."""
    try:
        import yaml  # noqa: F401 - only asks whether the registry can load
    except ImportError:
        from ...spec import RecipeSpec

        specs = [RecipeSpec.from_mapping(read_preset(path)) for path in preset_paths()]
        return specs, "built-in presets (PyYAML is not installed: read without it)"
    from ...registry import list_recipes

    return list_recipes(), "registry"


def check_recipe(name: str) -> Any:
    """One of :func:`check_recipes`' specs by name."""
    specs, _ = check_recipes()
    for spec in specs:
        if spec.name == name:
            return spec
    raise KeyError(name)


def read_preset(path: Path) -> dict[str, Any]:
    """The mapping a preset file holds (see the module docstring for the shape it accepts)."""
    out: dict[str, Any] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = _strip_comment(raw).rstrip()
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if line[0].isspace() or ":" not in line:
            raise ValueError(f"{where}: not a top-level `key: value` line; install PyYAML")
        key, _, text = line.partition(":")
        if not text.strip():
            raise ValueError(f"{where}: a block value; install PyYAML")
        parser = _Flow(text.strip(), where)
        out[key.strip()] = parser.value()
        parser.end()
    return out


def _strip_comment(line: str) -> str:
    """``line`` without a ``#`` comment (one at the start or after a space, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _scalar(text: str) -> Any:
    if text in ("null", "~", ""):
        return None
    if text in ("true", "false"):
        return text == "true"
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text):
        return float(text)
    return text


class _Flow:
    """A recursive-descent reader of one value: a plain scalar to the end of the line, or a
    flow list / mapping of scalars and nested flow collections."""

    def __init__(self, text: str, where: str):
        self.text, self.where, self.i = text, where, 0

    def _skip(self) -> None:
        while self.i < len(self.text) and self.text[self.i] == " ":
            self.i += 1

    def _peek(self) -> str:
        self._skip()
        return self.text[self.i] if self.i < len(self.text) else ""

    def _expect(self, ch: str) -> None:
        if self._peek() != ch:
            raise ValueError(
                f"{self.where}: expected {ch!r} at {self.text[self.i :]!r}; install PyYAML"
            )
        self.i += 1

    def end(self) -> None:
        if self._peek():
            raise ValueError(f"{self.where}: unexpected {self.text[self.i :]!r}; install PyYAML")

    def value(self, stops: str = "") -> Any:
        ch = self._peek()
        if ch == "[":
            return self._items("[", "]", lambda: self.value(",]"))
        if ch == "{":
            out: dict[str, Any] = {}

            def entry():
                key = self.value(":")
                self._expect(":")
                out[key] = self.value(",}")

            self._items("{", "}", entry)
            return out
        start = self.i
        while self.i < len(self.text) and self.text[self.i] not in stops:
            if not stops and self.text[self.i] in "[]{}":
                break
            self.i += 1
        return _scalar(self.text[start : self.i].strip())

    def _items(self, open_: str, close: str, item) -> list[Any]:
        self._expect(open_)
        items = []
        while self._peek() != close:
            items.append(item())
            if self._peek() == ",":
                self.i += 1
            elif self._peek() != close:
                self._expect(close)
        self._expect(close)
        return items

"""``stacks.FACTS`` for megatron-core checked against megatron-core's own source.

megatron-core 0.17 and later ship cp312 wheels only and cannot be installed in the test
environment (Python 3.11, megatron-core 0.16.1), so their facts are checked against excerpts of
the upstream files copied from the registry's wheels into ``tests/fixtures/megatron_core/``
(NOTICE.md and LICENSE there); the installed 0.16.1 is read in place (tests marked ``host``).
Nothing is imported: every file is parsed with :mod:`ast`, so a fact's range is compared with
what each release's code says, and the first release that has it must be the fact's minimum.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import pytest

from conftest import FIXTURES
from nemo_fp8_plugin import stacks

pytestmark = pytest.mark.torch_free

EXCERPTS = FIXTURES / "megatron_core"
DDP_FILE = "megatron/core/distributed/distributed_data_parallel_config.py"
FP4_FILE = "megatron/core/fp4_utils.py"
FP8_FILE = "megatron/core/fp8_utils.py"

INSTALLED = "0.16.1"
"""The megatron-core the test environment installs (read in place by the host tests)."""

SHIPPED = ("0.17.0", "0.18.0", "0.19.2")
"""The releases whose excerpts are shipped, oldest first."""


def ddp_fields(tree: ast.Module) -> set[str]:
    """The field names of ``DistributedDataParallelConfig`` (its annotated class statements)."""
    classes = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and n.name == "DistributedDataParallelConfig"
    ]
    assert len(classes) == 1, "the file no longer defines DistributedDataParallelConfig once"
    return {
        s.target.id
        for s in classes[0].body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
    }


def nvfp4_keywords(tree: ast.Module) -> set[str]:
    """The keyword arguments ``get_fp4_recipe`` passes to ``NVFP4BlockScaling(...)``.

    The module defines ``get_fp4_recipe`` twice (under ``if HAVE_TE:`` and a stub returning
    None without TE); exactly one ``NVFP4BlockScaling`` call must be found across them, so a
    reorganised function fails here instead of reading as "passes nothing"."""
    calls = [
        c
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and fn.name == "get_fp4_recipe"
        for c in ast.walk(fn)
        if isinstance(c, ast.Call) and ast.unparse(c.func).endswith("NVFP4BlockScaling")
    ]
    assert len(calls) == 1, f"expected one NVFP4BlockScaling call, found {len(calls)}"
    return {kw.arg for kw in calls[0].keywords if kw.arg is not None}


def mxfp8_keywords(tree: ast.Module) -> set[str]:
    """The keyword arguments ``get_fp8_recipe`` passes to ``MXFP8BlockScaling(...)`` (exactly
    one such call across the module's definitions, as for :func:`nvfp4_keywords`)."""
    calls = [
        c
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef) and fn.name == "get_fp8_recipe"
        for c in ast.walk(fn)
        if isinstance(c, ast.Call) and ast.unparse(c.func).endswith("MXFP8BlockScaling")
    ]
    assert len(calls) == 1, f"expected one MXFP8BlockScaling call, found {len(calls)}"
    return {kw.arg for kw in calls[0].keywords if kw.arg is not None}


Probe = Callable[[Callable[[str], ast.Module]], bool]

# fact name -> whether a release's source has it (given a reader: upstream path -> parsed file)
PROBES: dict[str, Probe] = {
    "ddp.fp4_param_gather": lambda read: "fp4_param_gather" in ddp_fields(read(DDP_FILE)),
    "get_fp4_recipe.fp8_dpa": lambda read: "fp8_dpa" in nvfp4_keywords(read(FP4_FILE)),
    "get_fp8_recipe.mxfp8.fp8_dpa": lambda read: "fp8_dpa" in mxfp8_keywords(read(FP8_FILE)),
}


def excerpt_reader(version: str) -> Callable[[str], ast.Module]:
    return lambda path: ast.parse((EXCERPTS / version / path).read_text(encoding="utf-8"))


def installed_reader() -> Callable[[str], ast.Module]:
    """Reads the installed megatron-core's files by path (``find_spec``: nothing imported)."""
    spec = importlib.util.find_spec("megatron.core")
    assert spec is not None and spec.submodule_search_locations, "megatron-core not installed"
    root = Path(next(iter(spec.submodule_search_locations))).parent.parent
    return lambda path: ast.parse((root / path).read_text(encoding="utf-8"))


def megatron_fact(name: str) -> stacks.HostFact:
    f = stacks.fact("megatron-core", name)
    assert f is not None, f"stacks.FACTS has no megatron-core fact {name!r}"
    return f


def test_the_excerpts_are_shipped_with_their_licence_and_notice():
    notice = (EXCERPTS / "NOTICE.md").read_text(encoding="utf-8")
    licence = (EXCERPTS / "LICENSE").read_text(encoding="utf-8")
    assert "NVIDIA CORPORATION" in licence and "Redistribution and use" in licence
    shipped = sorted(p.name for p in EXCERPTS.iterdir() if p.is_dir())
    assert shipped == sorted(SHIPPED)
    for version in SHIPPED:
        assert f"megatron_core-{version}-" in notice, version
        for path in (DDP_FILE, FP4_FILE, FP8_FILE):
            text = (EXCERPTS / version / path).read_text(encoding="utf-8")
            assert (
                text.startswith("# Copyright (c)") and "NVIDIA CORPORATION" in text.splitlines()[0]
            )


@pytest.mark.parametrize("version", SHIPPED)
def test_the_excerpts_cover_the_neighbouring_code(version):
    """An excerpt that lost the region a fact lives in would read as "absent": each one must
    still hold the neighbours (``fp8_param_gather``; the NVFP4 call itself)."""
    read = excerpt_reader(version)
    assert {"fp8_param_gather", "use_distributed_optimizer"} <= ddp_fields(read(DDP_FILE))
    nvfp4_keywords(read(FP4_FILE))  # exactly one NVFP4BlockScaling call
    assert "fp8_format" in mxfp8_keywords(read(FP8_FILE))  # the MXFP8 call, with its format


@pytest.mark.parametrize("name", sorted(PROBES))
@pytest.mark.parametrize("version", SHIPPED)
def test_the_fact_range_agrees_with_each_release_source(name, version):
    has = PROBES[name](excerpt_reader(version))
    f = megatron_fact(name)
    assert f.versions.contains(version) is has, (
        f"megatron-core {version}'s source {'has' if has else 'lacks'} {name}, "
        f"stacks.FACTS says {f.versions.label}"
    )
    assert stacks.lookup("megatron-core", name, version).present is has


@pytest.mark.parametrize("name", sorted(PROBES))
def test_the_minimum_is_the_first_shipped_release_that_has_it(name):
    """Once a release has the fact the newer ones keep it, and the fact's minimum is the first
    of them (whether the release before the oldest excerpt lacks it is the host test's)."""
    seen = [PROBES[name](excerpt_reader(v)) for v in SHIPPED]
    assert any(seen), f"no shipped release has {name}: the fact cannot be checked"
    first = seen.index(True)
    assert all(seen[first:]), f"{name} disappears again after {SHIPPED[first]}"
    low = megatron_fact(name).versions.low
    assert low is not None
    assert stacks.parse_version(SHIPPED[first])[: len(low)] == low, (
        f"{name} first appears in {SHIPPED[first]}; stacks.FACTS says from {_fmt(low)}"
    )


def _fmt(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@pytest.mark.host
def test_the_installed_megatron_core_is_the_release_before_the_excerpts():
    assert metadata.version("megatron-core") == INSTALLED
    assert stacks.parse_version(INSTALLED) < stacks.parse_version(SHIPPED[0])


@pytest.mark.host
@pytest.mark.parametrize("name", sorted(PROBES))
def test_the_installed_megatron_core_agrees_and_lacks_both(name):
    """0.16.1's own files: it has neither fact, and the table says so; with the excerpt test
    this pins each fact's minimum to the first release whose source has it."""
    read = installed_reader()
    has = PROBES[name](read)
    assert has is False, f"megatron-core {INSTALLED} already has {name}"
    assert megatron_fact(name).versions.contains(INSTALLED) is False
    assert stacks.lookup("megatron-core", name, INSTALLED).present is False
    # the probes see the installed file's neighbours, so "lacks" is not a misread file
    assert "fp8_param_gather" in ddp_fields(read(DDP_FILE))


# --------------------------------------------------------------------------- get_fp8_recipe's branches

_VIA_TE_DELAYED = frozenset(
    f.name.rsplit(".", 1)[1]
    for f in stacks.FACTS
    if f.name.startswith("get_fp8_recipe.delayed.") and "TEDelayedScaling" in f.source
)
"""The delayed branch's fields read inside ``TEDelayedScaling.__init__`` (its file is not in
the excerpts: the installed 0.16.1 is read through it)."""


def _rows(version: str) -> dict[str, frozenset[str]]:
    from nemo_fp8_plugin.hosts.megatron.honoured import honoured_fp8_fields

    return honoured_fp8_fields(version).fields


@pytest.mark.host
def test_the_branch_rows_are_the_installed_get_fp8_recipe_s():
    from megatron_source import read_honoured_fields

    root = Path(str(metadata.distribution("megatron-core").locate_file("megatron")))
    assert read_honoured_fields(root) == _rows(INSTALLED)


@pytest.mark.parametrize("version", SHIPPED)
def test_the_branch_rows_are_each_excerpt_s(version):
    """Each excerpt's branches read exactly the rows' fields, but those the delayed branch
    hands to TEDelayedScaling (whose file the excerpts leave out), which it still does."""
    from megatron_source import read_honoured_fields

    root = EXCERPTS / version / "megatron"
    read = read_honoured_fields(root)
    rows = _rows(version)
    assert set(read) == set(rows)
    for recipe, fields in rows.items():
        missing = fields - read[recipe]
        assert read[recipe] <= fields, (recipe, read[recipe] - fields)
        assert recipe == "delayed" and missing <= _VIA_TE_DELAYED or not missing, (recipe, missing)
    assert "TEDelayedScaling(" in (root / "core" / "fp8_utils.py").read_text(encoding="utf-8")

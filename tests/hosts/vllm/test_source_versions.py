"""vLLM releases through their own source: the ``vllm`` rows of ``stacks.FACTS`` read again
from the installed vLLM (``tests/hosts/vllm_source.py``; the other releases' wheels in
``tests/test_stacks_vllm_source.py``), the method's base classes as each release declares them,
and the method's refusal at load where a release lacks what it needs.

NeMo RL's releases pin vLLM 0.17.1 (v0.6.0), 0.20.0 (v0.7.0) and 0.25.1 (main 2026-08-22), whose
torch builds the registry does not have: their wheels are read, never imported. At load the
method asks the table for the running release's version; the installed vLLM 0.32 stands in for
each release's layers (its version string patched), so what is checked is the refusal, naming
the release and the minimum.
"""

from __future__ import annotations

import ast
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import vllm
from fake_gpu import linear, moe
from vllm_source import (
    MEASURED,
    WHEELS,
    SourceTree,
    VllmSource,
    citation_problems,
    read_source,
    row_readings,
)

from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts.vllm import api

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[3]
INSTALLED = str(vllm.__version__).split("+")[0]


@pytest.fixture(scope="module")
def installed_tree() -> SourceTree:
    return SourceTree.from_root(Path(vllm.__file__).resolve().parent.parent, INSTALLED)


@pytest.fixture(scope="module")
def sources(installed_tree, upstream_wheels) -> Callable[[str], VllmSource]:
    """Release -> what its source says, each parsed once: the installed one, and the
    downloaded wheels through conftest's ``upstream_wheels`` (a wheel that is absent skips
    the test asking for it; under CI=true it fails it)."""
    read = {INSTALLED: read_source(installed_tree)}

    def source(version: str) -> VllmSource:
        if version not in read:
            read[version] = read_source(SourceTree.from_wheel(upstream_wheels(WHEELS[version])))
        return read[version]

    return source


def test_the_installed_release_is_tested_and_its_rows_are_its_source(sources, installed_tree):
    assert INSTALLED in stacks.TESTED["vllm"]
    readings = row_readings(sources(INSTALLED))
    assert set(readings) == {f.name for f in stacks.FACTS if f.host == "vllm"} - set(MEASURED)
    wrong = {
        n: has
        for n, has in readings.items()
        if stacks.lookup("vllm", n, INSTALLED).present is not has
    }
    assert not wrong, wrong
    problems = [
        p
        for f in stacks.FACTS
        if f.host == "vllm"
        for p in citation_problems(f, {INSTALLED: installed_tree})
    ]
    assert not problems, problems
    # 0.32 dropped calculate_kv_scales; engine_kwargs never writes it.
    assert "calculate_kv_scales" not in sources(INSTALLED).engine_args
    assert set(api.ENGINE_ARGS_WRITTEN) <= sources(INSTALLED).engine_args


@pytest.mark.parametrize("version", [INSTALLED, *WHEELS])
def test_the_method_implements_every_abstract_method(sources, version):
    """The base classes' abstract methods, as each release declares them, are implemented by
    our classes with the same parameters (names, in order; a staticmethod has no receiver)."""
    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config
    from nemo_fp8_plugin.hosts.vllm.linear import NemoFp8LinearMethod
    from nemo_fp8_plugin.hosts.vllm.moe import NemoFp8MoEMethod

    read = sources(version)
    ours = {
        "QuantizationConfig": NemoFp8Config,
        "LinearMethodBase": NemoFp8LinearMethod,
        "FusedMoEMethodBase": NemoFp8MoEMethod,
    }
    assert set(read.abstract) == set(ours)
    for base, methods in read.abstract.items():
        assert methods, base
        for name, params in methods.items():
            impl = inspect.getattr_static(ours[base], name)
            assert name in ours[base].__dict__, (base, name)
            fn = impl.__func__ if isinstance(impl, (classmethod, staticmethod)) else impl
            got = [
                p.name
                for p in inspect.signature(fn).parameters.values()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
            ]
            # The receiver's name aside (vLLM declares some classmethods with ``self``).
            want = [p for p in params if p not in ("self", "cls")]
            assert got[1 : 1 + len(want)] == want or got[: len(want)] == want, (base, name, got)


def _our_vllm_imports() -> set[tuple[str, str]]:
    """(module, name) of every ``from vllm... import name`` in hosts/vllm's method modules,
    but those in an ``except ImportError:`` handler (an older release's name, used only
    where the newer one is missing) and those under ``if TYPE_CHECKING:`` (annotations only:
    never imported at run time)."""
    found: set[tuple[str, str]] = set()
    for path in (REPO / "nemo_fp8_plugin" / "hosts" / "vllm").glob("*.py"):
        if path.name == "adapter.py":
            # EngineArgs only, to judge engine configs (ENGINE_ARGS_WRITTEN is that check).
            continue
        tree = ast.parse(path.read_text())
        fallback = {
            id(n) for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler) for n in ast.walk(h)
        }
        fallback |= {
            id(n)
            for h in ast.walk(tree)
            if isinstance(h, ast.If) and ast.unparse(h.test) == "TYPE_CHECKING"
            for n in ast.walk(h)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("vllm")
                and id(node) not in fallback
            ):
                found.update((node.module, a.name) for a in node.names)
    return found


def test_api_uses_list_every_vllm_name_the_method_imports():
    listed = {(u.module, u.name) for u in api.API_USES}
    assert _our_vllm_imports() <= listed, _our_vllm_imports() - listed
    assert {u.feature for u in api.API_USES} == set(api.FEATURES)
    assert {f"nemo_fp8:{f}" for f in api.FEATURES} <= {f.name for f in stacks.FACTS}


def test_the_probe_finds_every_name_on_the_installed_release():
    """What an untested release is asked (:func:`api.probe`) is real: every name imports from
    the installed vLLM and takes the keywords; a name it lacks is reported."""
    for feature in api.FEATURES:
        assert api.probe(feature) == (), feature
    fake = api.ApiUse("kv", "vllm.model_executor.layers.quantization.kv_cache", "NoSuchName")
    real = api.API_USES
    try:
        api.API_USES = (*real, fake)
        api.probe.cache_clear()
        assert api.probe("kv") == (f"{fake.module}.NoSuchName",)
    finally:
        api.API_USES = real
        api.probe.cache_clear()


def _refused(build, env, recipe, version, minimum):
    with pytest.raises(FP8ConfigError) as err:
        build(env, recipe)
    text = str(err.value)
    assert err.value.key == "vllm" and err.value.value == version, text
    assert f"vLLM {version}" in text and f">= {minimum}" in text and "\n" not in text, text


def test_what_each_release_of_nemo_rl_serves(vllm_env, monkeypatch):
    """Under each release's version string: NeMo RL v0.6.0's vLLM 0.17.1 serves no FP8 linear
    layer (needs 0.20.0); v0.7.0's 0.20.0 serves block-FP8 dense layers and refuses experts
    (RoutedExperts from 0.25.1); main's 0.25.1 serves dense and refuses block-FP8 experts and
    MXFP8 layers (0.32.0)."""
    monkeypatch.setattr(vllm, "__version__", "0.17.1")
    _refused(linear, vllm_env, "fp8_blockwise", "0.17.1", "0.20.0")
    monkeypatch.setattr(vllm, "__version__", "0.20.0")
    assert type(linear(vllm_env, "fp8_blockwise").quant_method).__name__ == "NemoFp8LinearMethod"
    _refused(moe, vllm_env, "fp8_blockwise", "0.20.0", "0.25.1")
    monkeypatch.setattr(vllm, "__version__", "0.25.1")
    assert type(linear(vllm_env, "fp8_blockwise").quant_method).__name__ == "NemoFp8LinearMethod"
    _refused(moe, vllm_env, "fp8_blockwise", "0.25.1", "0.32.0")
    _refused(linear, vllm_env, "mxfp8", "0.25.1", "0.32.0")


def test_a_release_older_than_every_one_read_is_refused_at_load(monkeypatch):
    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    monkeypatch.setattr(vllm, "__version__", "0.11.0")
    with pytest.raises(FP8ConfigError) as err:
        NemoFp8Config.from_config({"quant_method": "nemo_fp8"})
    assert err.value.key == "vllm" and ">= 0.17.1" in str(err.value)


def test_an_untested_newer_release_is_checked_on_itself(vllm_env, monkeypatch):
    """vLLM 0.40 is newer than every release read: nothing is assumed from the newest row;
    the method asks the running vLLM for each name (here it has them: it loads, warning once
    that the release is untested), and refuses naming what it lacks."""
    from nemo_fp8_plugin.hosts.vllm import config

    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    assert stacks.lookup("vllm", "nemo_fp8:block_moe", "0.40.0").newer
    config._warn_untested.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = moe(vllm_env, "fp8_blockwise")
    assert type(layer.quant_method).__name__ == "NemoFp8MoEMethod"
    said = [str(w.message) for w in caught if "untested" in str(w.message)]
    assert len(said) == 1 and "0.40.0" in said[0] and "newer than every release read" in said[0]
    monkeypatch.setattr(api, "probe", lambda feature: ("vllm.x.y(z)",) if feature == "moe" else ())
    with pytest.raises(FP8ConfigError) as err:
        moe(vllm_env, "fp8_blockwise")
    assert "lacks vllm.x.y(z)" in str(err.value) and err.value.value == "0.40.0"
    config._warn_untested.cache_clear()

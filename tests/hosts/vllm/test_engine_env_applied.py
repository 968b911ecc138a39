"""Every program of ours that starts vLLM applies ``engine_env(spec)`` before the engine
starts: on a stock CUDA install (``VLLM_USE_DEEP_GEMM_E8M0=1``,
``VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=1`` by default) the ``nemo_fp8`` method would
otherwise refuse fp8_blockwise / fp8_subchannel at load on Hopper
(``test_contract_stock.py`` shows the refusal and that these variables avoid it).

The engine itself is replaced by a stand-in ``vllm`` module whose ``LLM`` records the
environment it starts in and stops the program: what is tested is the order (variables set,
then the engine), not vLLM.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
import types
from pathlib import Path

import pytest

from nemo_fp8_plugin.hosts.vllm import engine_env
from presets import BLOCK_PRESETS

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[3]
ENGINE_VARS = (
    "VLLM_USE_DEEP_GEMM",
    "VLLM_USE_DEEP_GEMM_E8M0",
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER",
)


class _EngineStarted(Exception):
    pass


@pytest.fixture
def started_env(monkeypatch):
    """A stand-in ``vllm`` whose ``LLM(...)`` records ``os.environ`` and stops; the kernel
    variables start unset (a stock install)."""
    import os

    seen: dict[str, str] = {}

    def llm(**kwargs):
        seen.update(os.environ)
        raise _EngineStarted

    stub = types.ModuleType("vllm")
    stub.LLM = llm
    monkeypatch.setitem(sys.modules, "vllm", stub)
    for name in ENGINE_VARS:
        monkeypatch.delenv(name, raising=False)
    # What the programs set themselves is undone after the test.
    monkeypatch.setattr(os, "environ", os.environ.copy())
    return seen


@pytest.mark.parametrize("recipe", BLOCK_PRESETS)
def test_gpu_vllm_refit_sets_engine_env_before_the_engine(started_env, recipe, tmp_path):
    path = REPO / "scripts" / "gpu_vllm_refit.py"
    spec = importlib.util.spec_from_file_location("gpu_vllm_refit_env", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_vllm_refit_env"] = module
    spec.loader.exec_module(module)
    want = engine_env(recipe)
    assert want  # both recipes need a variable on a stock install
    with pytest.raises(_EngineStarted):
        module.main(["--tiny", "--device", "cpu", "--recipe", recipe, "--steps", "1"])
    assert {k: started_env.get(k) for k in want} == want


def test_gpu_vllm_refit_keeps_a_variable_the_user_set(monkeypatch):
    path = REPO / "scripts" / "gpu_vllm_refit.py"
    spec = importlib.util.spec_from_file_location("gpu_vllm_refit_env2", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_vllm_refit_env2"] = module
    spec.loader.exec_module(module)
    from nemo_fp8_plugin import get_recipe

    environ = {"VLLM_USE_DEEP_GEMM_E8M0": "1"}
    assert module.apply_engine_env(get_recipe("fp8_blockwise"), environ) == {}
    assert environ == {"VLLM_USE_DEEP_GEMM_E8M0": "1"}
    environ = {}
    assert module.apply_engine_env(get_recipe("fp8_blockwise"), environ) == {
        "VLLM_USE_DEEP_GEMM_E8M0": "0"
    }


def test_refit_loop_example_sets_engine_env_before_the_engine(started_env):
    with pytest.raises(_EngineStarted):
        runpy.run_path(str(REPO / "examples" / "vllm" / "refit_loop.py"), run_name="__main__")
    want = engine_env({"recipe": "fp8_blockwise", "kv_cache": "fp8"})
    assert want and {k: started_env.get(k) for k in want} == want


def test_gpu_check_child_gets_engine_env(monkeypatch):
    from nemo_fp8_plugin.tools.gpu_check import vllm as part

    for name in ENGINE_VARS:
        monkeypatch.delenv(name, raising=False)
    env = part._child_env()
    want = engine_env({"recipe": part.CHILD_RECIPE, "kv_cache": "fp8"})
    assert want and {k: env.get(k) for k in want} == want
    # The child runs that recipe: the script's default --recipe.
    script = REPO / "scripts" / "gpu_vllm_refit.py"
    spec = importlib.util.spec_from_file_location("gpu_vllm_refit_env3", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_vllm_refit_env3"] = module
    spec.loader.exec_module(module)
    assert module.parse_args(["--tiny"]).recipe == part.CHILD_RECIPE

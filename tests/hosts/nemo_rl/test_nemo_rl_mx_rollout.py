"""MXFP8 rollouts on NeMo RL main: the linear kernel its refit lets vLLM keep.

NeMo RL main's MXFP8 generation patches vLLM's ModelOpt MXFP8 linear method
(``nemo_rl/models/generation/vllm/quantization/fp8.py``,
``process_weights_after_loading_mxfp8_linear``): its refit keeps weights in the [N, K] layout,
so it replaces vLLM's first choice on SM100, FlashInfer's CuTe-DSL kernel, with FlashInfer's
CUTLASS one, and stops at load on any other kernel. The kernel named here is read from that
function in the shared NeMo RL tree, not typed in.
"""

from __future__ import annotations

import ast

import pytest
import yaml

from conftest import shared_nemo_rl
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL
from nemo_fp8_plugin.hosts.vllm.rollout import KERNELS, rollout

pytestmark = pytest.mark.host

FP8_PY = "src/nemo_rl/models/generation/vllm/quantization/fp8.py"
MAIN_STACK = f"nemo-rl-{stacks.NEMO_RL_MAIN}"


def _refit_kernel() -> str:
    """The one MXFP8 linear kernel class NeMo RL main's refit accepts: the name its
    ``kernel_name != "..."`` check raises on anything but."""
    tree = ast.parse(shared_nemo_rl(FP8_PY).read_text())
    func = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "process_weights_after_loading_mxfp8_linear"
    )
    (name,) = {
        c.comparators[0].value
        for c in ast.walk(func)
        if isinstance(c, ast.Compare)
        and isinstance(c.left, ast.Name)
        and c.left.id == "kernel_name"
        and isinstance(c.ops[0], ast.NotEq)
        and isinstance(c.comparators[0], ast.Constant)
    }
    return name


def _apply(tmp_path, gpu: str):
    parent = shared_nemo_rl("examples/configs/grpo_math_8B_megatron.yaml")
    src = tmp_path / "child.yaml"
    src.write_text(yaml.safe_dump({"defaults": str(parent), "fp8": {"recipe": "mxfp8"}}))
    return apply_path(NEMO_RL, src, stack=MAIN_STACK, hardware=gpu)


def test_mxfp8_rollouts_on_main_name_the_kernel_its_refit_keeps(tmp_path):
    """MXFP8 trains on SM100 only (Transformer Engine), where vLLM would pick CuTe-DSL."""
    kept = next(k for k in KERNELS.values() if k.vllm_class == _refit_kernel())
    result = _apply(tmp_path, "b200")
    (checked,) = result.checks["rollout"]["gpus"]
    assert (checked["kernel"], checked["runs"], checked["matches"]) == (kept.label, True, True)
    vllm = stacks.get_stack(MAIN_STACK).versions["vllm"]
    picked = rollout("mxfp8", "b200", release=vllm, method="fp8").kernel
    assert picked is not None and checked["replaced"] == picked.label  # vLLM's own choice
    words = " ".join(map(str, result.notes))
    assert f": {kept.label}, e8m0 scales" in words
    assert "CuTe-DSL MXFP8, e8m0" not in words


def test_plain_vllm_keeps_its_own_mxfp8_choice():
    """vLLM 0.25.1's own choice, without NeMo RL's patch, stays the CuTe-DSL kernel on SM100:
    the swap is NeMo RL's, said on its path only."""
    vllm = stacks.get_stack(MAIN_STACK).versions["vllm"]
    picked = rollout("mxfp8", "b200", release=vllm, method="fp8")
    assert picked.kernel is not None and picked.kernel.vllm_class != _refit_kernel()

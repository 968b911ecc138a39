"""``hosts/vllm/rollout.py`` against vLLM 0.32's own kernel selection.

For every GPU the answer covers (H100/H200, B200/GB200, RTX PRO 6000), every recipe vLLM
generates with, and every setting of the three variables vLLM reads (each unset or 0, and the
values NeMo RL's ``use_deep_gemm: true`` sets), the installed vLLM picks its linear kernel on a
patched platform (``fake_gpu.py``: a stock CUDA install, DeepGEMM and FlashInfer present) for
both methods: this package's ``nemo_fp8`` (loads or refuses, naming a key) and vLLM's own
``fp8`` (what NeMo RL runs). :func:`rollout` must name the same kernel, the same refusal and the
scale grid the kernel object is set up for. The other releases' facts are checked against their
source in ``tests/test_stacks_vllm_source.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import vllm
from fake_gpu import GPUS, building, linear

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts.vllm import engine_env
from nemo_fp8_plugin.hosts.vllm.rollout import KERNEL_ENV, rollout
from nemo_fp8_plugin.registry import get_recipe
from presets import BLOCK_PRESETS, preset_names

pytestmark = pytest.mark.vllm

RELEASE = str(vllm.__version__).split("+")[0]
RECIPES = {
    **{name: name for name in preset_names(lambda row: row.vllm_generation)},
    "deepgemm_ue8m0": {"recipe": "fp8_blockwise", "generation_numerics": "vllm_deepgemm_ue8m0"},
}
"""The presets vLLM generates in, and block FP8 under vLLM's DeepGEMM (UE8M0) numerics."""
ENVS = [
    {k: v for k, v in zip(KERNEL_ENV, values) if v is not None}
    for values in itertools.product((None, "0"), repeat=len(KERNEL_ENV))
] + [{"VLLM_USE_DEEP_GEMM": "1", "VLLM_USE_DEEP_GEMM_E8M0": "0"}]  # NeMo RL's use_deep_gemm
CASES = [
    pytest.param(
        sm,
        name,
        env,
        id=f"sm{sm}-{name}-{'-'.join(f'{k[5:]}={v}' for k, v in env.items()) or 'stock'}",
    )
    for sm in GPUS
    for name in RECIPES
    for env in (ENVS if name != "mxfp8" else ENVS[:1])
]


def _deep_part(kernel):
    for part in (kernel, getattr(kernel, "fallback", None)):
        if part is not None and hasattr(part, "use_deep_gemm_e8m0"):
            return part
    return None


def _grid(kernel) -> tuple[str, str]:
    """(weights, activations) as the kernel object is set up: DeepGEMM's E8M0 mode
    requantizes weights to power-of-2 scales; the activation quantizer's ``use_ue8m0``."""
    deep = _deep_part(kernel)
    weights = "pow2" if deep is not None and deep.use_deep_gemm_e8m0 else "fp32"
    if not getattr(kernel, "apply_input_quant", True):
        return weights, ("mixed" if weights == "pow2" else "fp32")
    quant = getattr(kernel, "quant_fp8", None)
    return weights, ("pow2" if quant is not None and quant.use_ue8m0 else "fp32")


@pytest.mark.parametrize("sm,name,env", CASES)
def test_the_nemo_fp8_answer_is_vllms_choice(vllm_env, fake_gpu, sm, name, env):
    recipe = RECIPES[name]
    answer = rollout(recipe, f"sm{sm}", release=RELEASE, env=env)
    fake_gpu(sm, env=env)
    try:
        layer = linear(vllm_env, recipe)
    except FP8ConfigError as err:
        assert answer.refused == err.key, (answer, str(err))
        assert answer.kernel.vllm_class in str(err), (answer.kernel, str(err))
        assert not answer.matches
        return
    kernel = layer.quant_method._kernel
    assert answer.refused is None, (answer, type(kernel).__name__)
    assert type(kernel).__name__ == answer.kernel.vllm_class
    if answer.kernel.name.endswith("mxfp8"):
        return
    weights, acts = _grid(kernel)
    # The method makes the activation quantizer the recipe's; weights arrive on its grid.
    assert acts == answer.activation_scales, (weights, acts, answer)
    if answer.weight_scales == "pow2":
        assert weights == "pow2" or get_recipe(recipe).pow2_scales
    else:
        assert weights == "fp32"


def _vllm_fp8_linear(vcfg):
    """vLLM's own block-FP8 method (``quantization="fp8"``, 128x128 weight blocks, dynamic
    activations: NeMo RL's FP8_BLOCK_QUANT_KWARGS) on a real vLLM linear layer."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    config = Fp8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    )
    with building(vcfg):
        return MergedColumnParallelLinear(
            256,
            [256, 256],
            bias=False,
            quant_config=config,
            prefix="model.layers.0.mlp.gate_up_proj",
        )


@pytest.mark.parametrize("sm", GPUS)
@pytest.mark.parametrize(
    "env", ENVS, ids=lambda e: "-".join(f"{k[5:]}={v}" for k, v in e.items()) or "stock"
)
def test_the_fp8_answer_is_vllms_choice(vllm_env, fake_gpu, sm, env):
    """vLLM's own method runs what it picks: DeepGEMM with UE8M0 scales on a stock install
    (``use_deep_gemm: false`` in a NeMo RL config sets nothing), whatever the recipe."""
    answer = rollout("fp8_blockwise", f"sm{sm}", release=RELEASE, env=env, method="fp8")
    fake_gpu(sm, env=env)
    kernel = _vllm_fp8_linear(vllm_env).quant_method.fp8_linear
    assert type(kernel).__name__ == answer.kernel.vllm_class
    assert _grid(kernel) == (answer.weight_scales, answer.activation_scales)
    assert answer.refused is None


def test_a_stock_install_runs_deepgemm_ue8m0_where_nemo_rl_writes_use_deep_gemm_false(
    vllm_env, fake_gpu
):
    """The case behind the rollout notes: no variable set, a B200 runs DeepGEMM with
    power-of-2 scales, not CUTLASS with fp32 ones."""
    fake_gpu(100)
    kernel = _vllm_fp8_linear(vllm_env).quant_method.fp8_linear
    assert type(kernel).__name__ == "DeepGemmFp8BlockScaledMMKernel" and kernel.use_deep_gemm_e8m0
    answer = rollout("fp8_blockwise", "b200", release=RELEASE, method="fp8")
    assert (answer.kernel.name, answer.weight_scales, answer.matches) == ("deepgemm", "pow2", False)
    assert answer.needed == {"VLLM_USE_DEEP_GEMM": "0"}


@pytest.mark.parametrize("sm", GPUS)
@pytest.mark.parametrize("name", [*BLOCK_PRESETS, "deepgemm_ue8m0"])
def test_the_needed_variables_make_the_method_load_on_the_recipes_grid(
    vllm_env, fake_gpu, sm, name
):
    """What :func:`rollout` says to set is, on vLLM's own selection, a kernel the method loads
    with the recipe's grid (never one it then refuses); engine_env gives the same for the GPU."""
    recipe = RECIPES[name]
    spec = get_recipe(
        {"recipe": recipe, "training": "bf16"}
        if isinstance(recipe, str)
        else {**recipe, "training": "bf16"}
    )
    answer = rollout(spec, f"sm{sm}", release=RELEASE)
    env = dict(answer.needed)
    assert engine_env(spec, f"sm{sm}", release=RELEASE) == env
    fake_gpu(sm, env=env)
    layer = linear(vllm_env, spec.to_dict())
    weights, acts = _grid(layer.quant_method._kernel)
    want = "pow2" if spec.pow2_scales or name == "deepgemm_ue8m0" else "fp32"
    assert acts == want and (weights == want or spec.pow2_scales)


def test_qwen35_is_kept_off_deepgemm_on_blackwell(fake_gpu, tmp_path_factory):
    """should_auto_disable_deep_gemm: a Qwen3.5 text model on B200 gets CUTLASS."""
    answer = rollout(
        "fp8_subchannel", "b200", release=RELEASE, method="fp8", model_type="qwen3_5_text"
    )
    assert answer.kernel.name == "cutlass"
    fake_gpu(100)
    from vllm.utils.deep_gemm import should_auto_disable_deep_gemm

    assert should_auto_disable_deep_gemm("qwen3_5_text")
    fake_gpu(90)
    assert not should_auto_disable_deep_gemm("qwen3_5_text")
    assert (
        rollout(
            "fp8_subchannel", "h100", release=RELEASE, method="fp8", model_type="qwen3_5_text"
        ).kernel.name
        != "cutlass"
    )


def test_without_deepgemm_or_flashinfer_cutlass_runs(vllm_env, fake_gpu):
    for sm in GPUS:
        answer = rollout("fp8_blockwise", f"sm{sm}", release=RELEASE, deep_gemm_installed=False)
        fake_gpu(sm, deep_gemm_installed=False)
        kernel = linear(vllm_env, "fp8_blockwise").quant_method._kernel
        assert type(kernel).__name__ == answer.kernel.vllm_class == "CutlassFp8BlockScaledMMKernel"
    assert torch.get_default_dtype() == torch.float32

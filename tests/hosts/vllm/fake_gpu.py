"""A CUDA GPU as vLLM's kernel selection sees it, on this CPU machine; and the real vLLM
layers the GPU-branch contract tests build on it.

The default is a **stock vLLM CUDA install** (vLLM 0.32's wheel): DeepGEMM vendored,
FlashInfer installed, and vLLM's own environment defaults (``vllm/envs.py``:
``VLLM_USE_DEEP_GEMM=1``, ``VLLM_USE_DEEP_GEMM_E8M0=1``,
``VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=1``), which the fixture leaves unset so that vLLM's
defaults decide. A test states a variable only when it is what the test is about.

What stands in for what cannot install on a CPU machine, each against vLLM's real source:

* the CUDA platform: ``vllm.platforms.cuda`` cannot import without the CUDA build's
  ``vllm._C``; every vLLM module holds the one platform object, so its class (the CPU
  platform) is given ``PlatformEnum.CUDA``, a device capability, and
  ``CudaPlatformBase.support_deep_gemm`` compiled from the installed ``vllm/platforms/cuda.py``;
* the CUTLASS capability probes of ``vllm._C`` (``cutlass_scaled_mm_supports_fp8`` /
  ``_block_fp8``): the rules of vLLM's ``csrc/.../scaled_mm_entry.cu`` for a CUDA >= 12.8
  build (FP8 from SM89, block FP8 from SM90, SM100 and SM120 included);
* DeepGEMM and FlashInfer being installed: ``has_deep_gemm`` / ``has_flashinfer`` (and
  ``has_flashinfer_cutedsl`` for the MXFP8 kernels) answer True and ``flashinfer.gemm`` has
  its ``fp8_blockscale_gemm_sm90`` symbol, so vLLM's own probes
  (``has_flashinfer_fp8_blockscale_gemm``: SM90 only) decide; the kernels never run.
"""

from __future__ import annotations

import ast
import contextlib
import textwrap
import types
from pathlib import Path

import pytest
import torch
import vllm

# Modules that evaluate CUDA capabilities at import time are imported here, on the real
# (CPU) platform, before any test patches it.
import vllm._custom_ops as vllm_ops
import vllm.model_executor.kernels.linear.mxfp8.flashinfer as mxfp8_flashinfer
import vllm.model_executor.kernels.linear.scaled_mm.cutlass as cutlass_kernels
import vllm.model_executor.kernels.linear.scaled_mm.flashinfer
import vllm.model_executor.layers.fused_moe.oracle.fp8
import vllm.model_executor.layers.fused_moe.oracle.mxfp8
import vllm.model_executor.layers.quantization.online.fp8
import vllm.model_executor.layers.quantization.online.mxfp8
import vllm.model_executor.models.mixtral
import vllm.utils.deep_gemm as deep_gemm
import vllm.utils.flashinfer as flashinfer_utils
from vllm import envs
from vllm.platforms import PlatformEnum, current_platform
from vllm.platforms.interface import DeviceCapability

from nemo_fp8_plugin.hosts.vllm import quantization_config

GPUS = {
    90: "H100/H200",
    100: "B200/GB200",
    120: "RTX PRO 6000",
}
"""Compute capability -> the GPUs the contract tests stand for (data-center Hopper,
data-center Blackwell, workstation Blackwell)."""

GPU_PARAMS = [pytest.param(sm, id=f"sm{sm}-{name.replace(' ', '-')}") for sm, name in GPUS.items()]

VLLM_KERNEL_ENV = (
    "VLLM_USE_DEEP_GEMM",
    "VLLM_USE_DEEP_GEMM_E8M0",
    "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER",
)
"""The variables vLLM's block-FP8 kernel choice reads (unset: vLLM's defaults)."""


def _cuda_support_deep_gemm():
    """``CudaPlatformBase.support_deep_gemm``, compiled from the installed vLLM's source."""
    source = Path(vllm.__file__).with_name("platforms") / "cuda.py"
    text = source.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == "CudaPlatformBase":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "support_deep_gemm":
                    namespace: dict = {}
                    exec(textwrap.dedent(ast.get_source_segment(text, item)), namespace)
                    return classmethod(namespace["support_deep_gemm"])
    raise AssertionError("CudaPlatformBase.support_deep_gemm not found in vllm/platforms/cuda.py")


def _csrc_supports_fp8(cap: int) -> bool:  # scaled_mm_entry.cu, CUDA >= 12.8
    return cap >= 89


def _csrc_supports_block_fp8(cap: int) -> bool:  # scaled_mm_entry.cu, CUDA >= 12.8
    return cap >= 90


def _reset_caches() -> None:
    deep_gemm.is_deep_gemm_supported.cache_clear()
    deep_gemm.is_deep_gemm_e8m0_used.cache_clear()
    if "_oracle_cache" in deep_gemm.DeepGemmQuantScaleFMT.__dict__:
        delattr(deep_gemm.DeepGemmQuantScaleFMT, "_oracle_cache")
    flashinfer_utils.has_flashinfer_fp8_blockscale_gemm.cache_clear()
    flashinfer_utils.is_flashinfer_fp8_blockscale_gemm_supported.cache_clear()


def _flashinfer_submodules(installed: bool):
    """vLLM's ``_get_submodule`` with FlashInfer's block-scale GEMM module present."""
    real = flashinfer_utils._get_submodule
    gemm = types.SimpleNamespace(fp8_blockscale_gemm_sm90=object())

    def get(name: str):
        if installed and name == "flashinfer.gemm":
            return gemm
        return real(name)

    return get


def install(
    monkeypatch,
    sm: int,
    *,
    deep_gemm_installed: bool = True,
    flashinfer: bool = True,
    env: dict[str, str] | None = None,
) -> None:
    """Make vLLM see a CUDA GPU of capability ``sm``: a stock install by default; ``env``
    sets kernel variables (as ``engine_env`` or a user would), the others stay unset."""
    cls = type(current_platform)
    monkeypatch.setattr(cls, "_enum", PlatformEnum.CUDA)
    monkeypatch.setattr(
        cls,
        "get_device_capability",
        classmethod(lambda c, device_id=0: DeviceCapability(sm // 10, sm % 10)),
    )
    monkeypatch.setattr(cls, "support_deep_gemm", _cuda_support_deep_gemm())
    monkeypatch.setattr(vllm_ops, "cutlass_scaled_mm_supports_fp8", _csrc_supports_fp8)
    monkeypatch.setattr(vllm_ops, "cutlass_scaled_mm_supports_block_fp8", _csrc_supports_block_fp8)
    monkeypatch.setattr(
        cutlass_kernels, "CUTLASS_BLOCK_FP8_SUPPORTED", _csrc_supports_block_fp8(sm)
    )
    for name in VLLM_KERNEL_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(deep_gemm, "has_deep_gemm", lambda: deep_gemm_installed)
    monkeypatch.setattr(deep_gemm, "_lazy_init", lambda: None)
    monkeypatch.setattr(deep_gemm, "_fp8_gemm_nt_impl", object() if deep_gemm_installed else None)
    monkeypatch.setattr(mxfp8_flashinfer, "has_flashinfer", lambda: flashinfer)
    # FlashInfer's wheel ships its CuTe-DSL kernels (``flashinfer/cute_dsl``).
    monkeypatch.setattr(mxfp8_flashinfer, "has_flashinfer_cutedsl", lambda: flashinfer)
    monkeypatch.setattr(flashinfer_utils, "has_flashinfer", lambda: flashinfer)
    monkeypatch.setattr(flashinfer_utils, "_get_submodule", _flashinfer_submodules(flashinfer))
    _reset_caches()


@contextlib.contextmanager
def patched_platform(monkeypatch):
    """Around a test: the env cache off (an engine started in this process caches vLLM's
    variables), everything restored afterwards."""
    cached_envs = envs._is_envs_cache_enabled()
    if cached_envs:
        envs.disable_envs_cache()
    try:
        yield
    finally:
        monkeypatch.undo()
        _reset_caches()
        if cached_envs:
            envs.enable_envs_cache()


@contextlib.contextmanager
def building(vcfg):
    """What vLLM's model loader sets while it builds layers: the config and the default dtype."""
    from vllm.config import set_current_vllm_config

    old = torch.get_default_dtype()
    torch.set_default_dtype(vcfg.model_config.dtype)
    try:
        with set_current_vllm_config(vcfg):
            yield
    finally:
        torch.set_default_dtype(old)


_NAMES = iter(range(10**6))


def qcfg(recipe) -> dict:
    """The ``nemo_fp8`` quantization config the plugin writes for ``recipe``."""
    q = quantization_config(recipe)
    q.pop("_warnings")
    return q


def linear(vcfg, recipe, **overrides):
    """A real vLLM ``MergedColumnParallelLinear`` (gate|up, 2 x 256 x 256) on ``nemo_fp8``."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    with building(vcfg):
        return MergedColumnParallelLinear(
            256,
            [256, 256],
            bias=False,
            quant_config=NemoFp8Config.from_config({**qcfg(recipe), **overrides}),
            prefix=f"model.layers.{next(_NAMES)}.mlp.gate_up_proj",
        )


def moe(vcfg, recipe, **overrides):
    """vLLM's own Mixtral MoE block (4 experts, top 2, 256 x 256) on ``nemo_fp8``; returns
    its routed-experts layer."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.models.mixtral import MixtralMoE

    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    with building(vcfg):
        block = MixtralMoE(
            4,
            2,
            256,
            256,
            params_dtype=torch.bfloat16,
            quant_config=NemoFp8Config.from_config({**qcfg(recipe), **overrides}),
            prefix=f"contract.layers.{next(_NAMES)}.block_sparse_moe",
        )
    return next(m for m in block.modules() if isinstance(m, RoutedExperts))


def assert_refusal(err: pytest.ExceptionInfo, key: str, *words: str) -> None:
    """One line, naming ``key``, the vLLM version and each of ``words``."""
    text = str(err.value)
    assert err.value.key == key, text
    assert "\n" not in text and f"vLLM {vllm.__version__}" in text, text
    for word in words:
        assert word in text, (word, text)

"""``engine_env`` (hosts/vllm) for every built-in recipe and the variants that change it:
the exact variables, as literals (the reasons are in ``engine_env``'s docstring)."""

from __future__ import annotations

import pytest

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts.vllm import engine_env
from nemo_fp8_plugin.registry import list_recipes

EXPECTED = {
    "fp8_delayed": {},
    "fp8_current": {},
    "fp8_subchannel": {"VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"},
    "fp8_blockwise": {"VLLM_USE_DEEP_GEMM_E8M0": "0"},
    "mxfp8": {},
    "nvfp4": {},
}


def test_every_builtin_recipe_is_listed_here():
    assert sorted(r.name for r in list_recipes()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_engine_env_of_each_recipe(name):
    assert engine_env(name) == EXPECTED[name]


@pytest.mark.parametrize(
    "spec,want",
    [
        ({"recipe": "fp8_subchannel", "hardware": "hopper"}, EXPECTED["fp8_subchannel"]),
        ({"recipe": "fp8_subchannel", "hardware": "blackwell"}, {}),
        # DeepGEMM's E8M0 mode kept; on H100 FlashInfer's kernel (its own fp32 activation
        # scales below 32 tokens) is turned off instead.
        (
            {"recipe": "fp8_blockwise", "generation_numerics": "vllm_deepgemm_ue8m0"},
            EXPECTED["fp8_subchannel"],
        ),
        # Generation-only FP8 with fp32 scales runs on Blackwell too: CUTLASS there and on
        # Hopper (DeepGEMM's Blackwell kernels take UE8M0 scales only).
        ({"recipe": "fp8_blockwise", "training": "bf16"}, {"VLLM_USE_DEEP_GEMM": "0"}),
        (
            {"recipe": "fp8_blockwise", "training": "bf16", "hardware": "hopper"},
            EXPECTED["fp8_blockwise"],
        ),
        (
            {"recipe": "fp8_blockwise", "training": "bf16", "hardware": "blackwell"},
            {"VLLM_USE_DEEP_GEMM": "0"},
        ),
        ({"recipe": "fp8_blockwise", "generation": "bf16"}, {}),
        ({"recipe": "fp8_subchannel", "generation": "bf16"}, {}),
        ({"recipe": "fp8_blockwise", "pow2_scales": True}, EXPECTED["fp8_subchannel"]),
    ],
)
def test_engine_env_of_the_variants(spec, want):
    assert engine_env(spec) == want


@pytest.mark.parametrize(
    "release,want",
    [
        ("0.17.1", None),  # the nemo_fp8 method cannot load block FP8 there: refused
        ("0.20.0", {}),
        ("0.25.1", {"VLLM_USE_DEEP_GEMM": "0"}),
        ("0.34.0", {"VLLM_USE_DEEP_GEMM": "0"}),
    ],
)
def test_engine_env_follows_the_release(release, want):
    """On an RTX PRO 6000 vLLM runs DeepGEMM (UE8M0 only) from 0.25; before, CUTLASS, which
    keeps fp32 scales without any variable."""
    spec = {"recipe": "fp8_blockwise", "training": "bf16"}
    if want is None:
        with pytest.raises(FP8ConfigError, match=f"vLLM {release} cannot load"):
            engine_env(spec, "rtx pro 6000", release=release)
        return
    assert engine_env(spec, "rtx pro 6000", release=release) == want

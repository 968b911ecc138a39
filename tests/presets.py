"""Recipe lists for recipe-parametrized tests, from the registry (tests/ and tests/hosts/vllm import
this module; it imports the plugin's registry and capability table, no host)."""

from __future__ import annotations


def preset_names(keep=None) -> list[str]:
    """The registry's preset names (built-in and entry-point presets), in the registry's order,
    whose capability row ``keep(row)`` accepts (None: all). Every recipe-parametrized test takes
    its list from here, so a new preset is tested everywhere or fails loudly; a subset is a
    predicate on the capability row, and the test says why."""
    from nemo_fp8_plugin.capabilities import capability
    from nemo_fp8_plugin.registry import list_recipes

    return [s.name for s in list_recipes() if keep is None or keep(capability(s.scaling))]


FP8_PRESETS = preset_names(lambda row: not row.is_nvfp4)
"""The presets with FP8 (E4M3/E5M2) elements: what the FP8 paths of TE, megatron-core, NeMo 2
and Bridge build. NVFP4 (E2M1 elements, a second-level scale, fp4_recipe rather than fp8_recipe,
Blackwell only) has its own tests: tests/hosts/test_nvfp4_hosts.py and
tests/numerics/test_numerics_nvfp4.py."""

BLOCK_PRESETS = preset_names(lambda row: row.is_block)
"""The block-scaled FP8 presets (1x128 / 128x128 tiles): the ones vLLM's block-FP8 kernels
(DeepGEMM, CUTLASS, FlashInfer, Triton) serve."""

"""``engine_env`` for a vLLM release the ``nemo_fp8`` method cannot load the recipe on says so
(``FP8ConfigError`` naming the release and the minimum, from the stacks facts
``nemo_fp8:block_linear`` / ``nemo_fp8:mx_linear``, which tests/test_stacks_vllm_source.py
checks against each release's source) instead of answering ``{}`` as if nothing were needed."""

from __future__ import annotations

import pytest

from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts.vllm import engine_env

pytestmark = pytest.mark.torch_free

CASES = [("fp8_blockwise", "h100", "block_linear"), ("mxfp8", "b200", "mx_linear")]


@pytest.mark.parametrize("recipe, gpu, feature", CASES)
@pytest.mark.parametrize("release", stacks.TESTED["vllm"])
def test_engine_env_refuses_a_release_the_method_cannot_load(recipe, gpu, feature, release):
    served = stacks.lookup("vllm", f"nemo_fp8:{feature}", release)
    assert served.fact is not None
    if served.present:
        assert isinstance(engine_env(recipe, gpu, release=release), dict)
        return
    with pytest.raises(FP8ConfigError) as err:
        engine_env(recipe, gpu, release=release)
    assert err.value.key == "release" and err.value.value == release
    assert f"vLLM >= {served.fact.minimum}" in str(err.value)


def test_the_release_of_nemo_rl_v060_is_refused_for_block_fp8():
    with pytest.raises(FP8ConfigError, match="0.17.1"):
        engine_env("fp8_blockwise", "h100", release=stacks.release_version("0.6.0", "vllm"))


def test_bf16_generation_needs_nothing_on_any_release():
    assert (
        engine_env({"recipe": "fp8_blockwise", "generation": "bf16"}, "h100", release="0.17.1")
        == {}
    )

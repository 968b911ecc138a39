"""What the NeMo RL adapter says and writes about Transformer Engine follows the TE of the
release it writes for (each release's ``uv.lock``: v0.6.0 TE 2.14.0, v0.7.0 and main 2.15.0),
judged against that TE's own pure-Python wheel (``scripts/install.sh`` downloads it; read as
text, never installed)."""

from __future__ import annotations

import zipfile

import pytest
import yaml

from conftest import shared_nemo_rl, upstream_wheel
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL

pytestmark = pytest.mark.host

RELEASE_CONFIGS = {"0.6.0": "releases/v0.6.0/", "0.7.0": "releases/v0.7.0/"}
RECIPE_MODULE = "transformer_engine/common/recipe/__init__.py"


def _te_recipe_source(release: str) -> str:
    te = stacks.get_stack(f"nemo-rl-{release}").versions["transformer-engine"]
    wheel = upstream_wheel(f"transformer_engine-{te}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(RECIPE_MODULE).decode()


@pytest.mark.parametrize("release", sorted(RELEASE_CONFIGS))
def test_fp8_wgrad_advice_names_backward_override_only_where_te_reads_it(tmp_path, release):
    """``fp8_wgrad: false`` has no NeMo RL key; the nearest TE setting,
    ``NVTE_BACKWARD_OVERRIDE=high_precision``, is advised only where the release's TE reads the
    variable (its recipe module), else the warning says that TE has nothing for it."""
    parent = shared_nemo_rl(
        f"{RELEASE_CONFIGS[release]}examples/configs/grpo_math_8B_megatron.yaml"
    )
    src = tmp_path / "child.yaml"
    fp8 = {"recipe": "fp8_blockwise", "fp8_wgrad": False}
    src.write_text(yaml.safe_dump({"defaults": str(parent), "fp8": fp8}))
    result = apply_path(NEMO_RL, src, stack=f"nemo-rl-{release}")
    (warning,) = [str(w) for w in result.warnings if "fp8_wgrad=false" in str(w)]
    reads = "NVTE_BACKWARD_OVERRIDE" in _te_recipe_source(release)
    assert ("NVTE_BACKWARD_OVERRIDE=high_precision" in warning) is reads, warning
    te = stacks.get_stack(f"nemo-rl-{release}").versions["transformer-engine"]
    assert (f"Transformer Engine {te} has no setting for it" in warning) is not reads, warning


def test_nvfp4_writes_only_the_te_variables_the_releases_te_reads(tmp_path):
    """nvfp4 training (main only: the releases have no ``model_overrides``) pins every
    ``NVTE_NVFP4_*`` variable TE reads at import; those of a later TE (row-scaled activations
    from 2.16, "4over6" from 2.17) are not written for main, whose TE 2.15 never reads them."""
    release = stacks.NEMO_RL_MAIN
    parent = shared_nemo_rl("examples/configs/recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml")
    src = tmp_path / "child.yaml"
    src.write_text(yaml.safe_dump({"defaults": str(parent), "fp8": {"recipe": "nvfp4"}}))
    result = apply_path(NEMO_RL, src, stack=f"nemo-rl-{release}")
    written = result.data["policy"]["megatron_cfg"]["env_vars"]
    nvte = {k for k in written if k.startswith("NVTE_NVFP4_")}
    source = _te_recipe_source(release)
    assert nvte and all(f'"{k}"' in source for k in nvte), nvte

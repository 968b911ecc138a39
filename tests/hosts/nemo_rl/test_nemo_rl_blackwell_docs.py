"""docs/hosts/nemo_rl.md says what ``apply`` writes for ``use_deep_gemm`` on Blackwell: no key
(NeMo RL reads an absent one as ``false``: ``vllm_cfg.get("use_deep_gemm", False)`` in its
``fp8.py``), checked against ``apply`` on NVIDIA's v0.7.0 base config."""

from __future__ import annotations

import pytest
import yaml

from conftest import REPO, shared_nemo_rl
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL

pytestmark = pytest.mark.host

KEY = "use_deep_gemm"
FP8_PY = "releases/v0.7.0/nemo_rl/models/generation/vllm/quantization/fp8.py"


def _section(title: str) -> str:
    text = (REPO / "docs" / "hosts" / "nemo_rl.md").read_text()
    return text.split(f"\n### {title}\n", 1)[1].split("\n## ", 1)[0]


def test_blackwell_section_says_what_apply_writes_for_use_deep_gemm(tmp_path):
    parent = shared_nemo_rl("releases/v0.7.0/examples/configs/grpo_math_8B_megatron.yaml")
    src = tmp_path / "child.yaml"
    fp8 = {"recipe": "fp8_blockwise", "training": "bf16"}
    src.write_text(yaml.safe_dump({"defaults": str(parent), "fp8": fp8}))
    result = apply_path(NEMO_RL, src, stack="nemo-rl-0.7.0", hardware="b200")
    vllm_cfg = result.data["policy"]["generation"]["vllm_cfg"]
    assert KEY not in vllm_cfg  # nothing written: NeMo RL's default applies
    assert f'vllm_cfg.get("{KEY}", False)' in shared_nemo_rl(FP8_PY).read_text()
    section = " ".join(_section("Blackwell").split())
    assert f"writes no `{KEY}`" in section
    assert f"gets `{KEY}: false`" not in section

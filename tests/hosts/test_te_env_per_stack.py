"""The Transformer Engine variables a training host is told to set are those the stack's TE
reads: each one the recipe module of that TE's pure-Python wheel reads (``scripts/install.sh``
downloads the wheels; read as text, never installed). NVFP4 pins every ``NVTE_NVFP4_*`` TE
2.20 reads; TE 2.11 (the NeMo 2.7 stack's) reads three of them."""

from __future__ import annotations

import re
import zipfile

import pytest
import yaml

from conftest import REPO, upstream_wheel
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.table import get_adapter

pytestmark = pytest.mark.host

INPUTS = {
    "megatron": ("megatron_gpt_fp8_current.yaml", "precision"),
    "bridge": ("bridge_llama3_8b_pretrain_mxfp8.yaml", "mixed_precision"),
    "nemo2": ("nemo2_llama32_1b_finetune_fp8_blockwise.yaml", "precision"),
    "te": (None, "precision"),
}
"""Host -> a shipped example and the key its request is in."""

STACKS = [s.name for s in stacks.STACKS if s.release is None and "transformer-engine" in s.versions]


def _te_reads(version: str) -> set[str]:
    wheel = upstream_wheel(f"transformer_engine-{version}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        text = zf.read("transformer_engine/common/recipe/__init__.py").decode()
    return set(re.findall(r'"(NVTE_[A-Z0-9_]+)"', text))


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("host", sorted(INPUTS))
def test_nvfp4_variables_are_those_the_stacks_te_reads(tmp_path, host, stack):
    name, key = INPUTS[host]
    data = yaml.safe_load((REPO / "conf" / "examples" / name).read_text()) if name else {}
    data[key] = "nvfp4"
    src = tmp_path / (name or "te.yaml")
    src.write_text(yaml.safe_dump(data, sort_keys=False))
    result = apply_path(get_adapter(host), src, stack=stack)
    te = stacks.get_stack(stack).versions["transformer-engine"]
    nvfp4 = {v for v in _te_reads(te) if v.startswith("NVTE_NVFP4_")}
    assert set(result.env) == nvfp4, (host, stack, sorted(result.env))
    if host == "te":  # the description carries them (transformer_engine.env)
        assert set(result.data["transformer_engine"]["env"]) == nvfp4
        return
    words = " ".join(map(str, [*result.notes, *result.warnings]))
    assert all(v in words for v in nvfp4)
    unread = set(re.findall(r"\b(NVTE_NVFP4_[A-Z0-9_]+)=", words)) - nvfp4
    assert not unread, unread

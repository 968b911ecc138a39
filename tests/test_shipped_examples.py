"""Every shipped example config runs on its host as written, or says it is an overlay and how to
use it.

* Every YAML under ``conf/examples`` and ``examples`` opens with a comment that gives the command
  using it; a file with ``defaults:`` (a NeMo RL overlay) also says it is one, names its parent
  and where in a NeMo RL checkout it goes.
* The NeMo RL overlays (``examples/nemo_rl``) go where their header says in a checkout of each
  release (NVIDIA's configs from the shared test data), ``nemo-fp8 apply`` runs the header's
  command for that release, and NeMo RL's own loader of that release
  (``nemo_rl/utils/config.py``: ``load_config``, its resolvers) reads the output and resolves
  every interpolation, as ``examples/run_grpo.py`` does at start-up; the result asks for FP8.
* Every other example is loaded through its host's code by the test named here (megatron-core's
  ``TransformerConfig``, Bridge's ``finalize``, vLLM's ``EngineArgs``, NeMo-Run, the demo);
  a new example without such a test fails here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from conftest import NEMO_RL_RELEASES, REPO, nemo_rl_checkout, nemo_rl_config_module
from nemo_fp8_plugin.cli import main

pytestmark = pytest.mark.torch_free

EXAMPLES = sorted((REPO / "conf" / "examples").glob("*.yaml")) + sorted(
    (REPO / "examples").rglob("*.yaml")
)
NEMO_RL_OVERLAYS = sorted((REPO / "examples" / "nemo_rl").glob("*.yaml"))
COMMANDS = ("nemo-fp8 apply", "nemo-fp8 demo", "vllm serve", "nemo llm", "examples/run_grpo.py")

LOADED_BY = {
    "bridge_llama3_8b_pretrain_fp8_blockwise.yaml": "tests/hosts/test_contract_hosts.py",
    "bridge_llama3_8b_pretrain_mxfp8.yaml": "tests/hosts/test_contract_hosts.py",
    "demo_gpt_fp8_blockwise.yaml": "tests/hosts/test_contract_hosts.py",
    "llama3_8b_pretrain_fp8_blockwise.yaml": "tests/hosts/test_contract_hosts.py",
    "megatron_gpt_fp8_current.yaml": "tests/hosts/test_contract_hosts.py",
    "nemo2_llama32_1b_finetune_fp8_blockwise.yaml": "tests/hosts/nemo2/test_nemo2_adapter.py",
    "vllm_llama8b_fp8_blockwise.yaml": "tests/hosts/vllm/test_contract.py",
    "vllm_moonlight_fp8_kv.yaml": "tests/hosts/vllm/test_contract.py",
}
"""conf/examples file -> the test that feeds it (or apply's output) to the host's own code."""


def _header(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(ln for ln in lines[: next(i for i, ln in enumerate(lines) if ln[:1] != "#")])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_example_says_how_to_use_it(path):
    header = _header(path)
    assert any(c in header for c in COMMANDS), f"{path}: the header names no command using it"
    if "defaults" in yaml.safe_load(path.read_text()):
        prose = " ".join(ln.lstrip("# ") for ln in header.splitlines())
        assert "Overlay on NVIDIA's examples/configs/" in prose, path
        assert "Put this file in the checkout's examples/configs/" in prose, path


def test_every_conf_example_is_loaded_by_its_hosts_code():
    names = {p.name for p in (REPO / "conf" / "examples").glob("*.yaml")}
    assert names == set(LOADED_BY), names ^ set(LOADED_BY)
    for name, test in LOADED_BY.items():
        assert name in (REPO / test).read_text(), f"{test} does not load {name}"


def header_command(path: Path, verb: str) -> list[str]:
    """The header's ``nemo-fp8 apply ...`` (``verb`` "apply") or ``uv run ...`` line."""
    line = next(ln for ln in _header(path).splitlines() if verb in ln)
    return shlex.split(line.lstrip("# "))


@pytest.mark.host  # NeMo RL's own config loader, from each release's source
@pytest.mark.parametrize("release", list(NEMO_RL_RELEASES))
@pytest.mark.parametrize("overlay", NEMO_RL_OVERLAYS, ids=lambda p: p.name)
def test_nemo_rl_overlays_run_through_nemo_rls_own_loader(overlay, release, tmp_path, capsys):
    checkout = nemo_rl_checkout(release, tmp_path)
    apply = header_command(overlay, "nemo-fp8 apply")
    placed = checkout / apply[2]
    assert placed.parent.is_dir() and not placed.exists(), f"{overlay.name}: no place {apply[2]}"
    placed.write_text(overlay.read_text())
    parent = placed.parent / yaml.safe_load(overlay.read_text())["defaults"]
    assert parent.is_file(), f"{overlay.name}: NeMo RL {release} has no {parent.name} there"

    import os

    here = os.getcwd()
    os.chdir(checkout)  # the header's paths are the checkout's
    try:
        assert main([*apply[1:], "--stack", f"nemo-rl-{release}"]) == 0, capsys.readouterr().err
    finally:
        os.chdir(here)
    run = header_command(overlay, "examples/run_grpo.py")
    assert run[:3] == ["uv", "run", "examples/run_grpo.py"] and run[4] == apply[-1]

    nemo_rl = nemo_rl_config_module(release)
    from omegaconf import OmegaConf
    from omegaconf.basecontainer import BaseContainer

    saved = dict(BaseContainer._resolvers)  # NeMo RL's resolvers must not outlive this test
    try:
        nemo_rl.register_omegaconf_resolvers()
        config = OmegaConf.to_container(nemo_rl.load_config(checkout / run[4]), resolve=True)
    finally:
        BaseContainer._resolvers.clear()
        BaseContainer._resolvers.update(saved)
    for section in ("grpo", "policy", "loss_fn", "data", "cluster"):
        assert section in config, f"{overlay.name} on {release}: no {section} after loading"
    assert "fp8" not in config and "precision" not in config
    vllm = config["policy"]["generation"]["vllm_cfg"]
    assert vllm["precision"] == "fp8" and config["loss_fn"]["use_importance_sampling_correction"]
    assert config["policy"]["precision"] == "bfloat16"
    if re.search(r"kv_cache: fp8", overlay.read_text()):
        assert vllm["kv_cache_dtype"] == "fp8"
        assert config["policy"]["megatron_cfg"]["pipeline_model_parallel_size"] == 1

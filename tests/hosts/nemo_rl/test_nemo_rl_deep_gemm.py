"""Block-FP8 generation through NeMo RL and DeepGEMM, judged by NeMo RL's own code.

NeMo RL's ``init_fp8`` (``nemo_rl/models/generation/vllm/quantization/fp8.py`` at commit
7ea279abfbeb698b092856d0dab61e7cf39bc909, ``tests/fixtures/nemo_rl`` / ``../shared/data/nemo_rl``)
sets ``VLLM_USE_DEEP_GEMM=1`` and ``VLLM_USE_DEEP_GEMM_E8M0=0`` when ``use_deep_gemm`` is on:
DeepGEMM with fp32 block scales, which DeepGEMM on Blackwell (SM100) cannot take (UE8M0 scale
factors only). NeMo RL cannot be imported here (it needs Megatron-Bridge, Python >= 3.12 and
TE), so the one ``if`` statement of ``init_fp8`` that sets the variables is taken from its
source and run on the ``vllm_cfg`` the plugin writes.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import yaml

from conftest import nemo_rl_configs, shared_nemo_rl
from nemo_fp8_plugin.cli import main as cli_main
from nemo_fp8_plugin.config import load_config_chain
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL

pytestmark = pytest.mark.host

CONFIGS = nemo_rl_configs()
NEMO_RL_FP8 = "src/nemo_rl/models/generation/vllm/quantization/fp8.py"
KEY = "policy.generation.vllm_cfg.use_deep_gemm"


def nemo_rl_deep_gemm_env(vllm_cfg: dict) -> dict[str, str]:
    """What NeMo RL's ``init_fp8`` puts into the environment for this ``vllm_cfg``: its own
    ``if vllm_cfg.get("use_deep_gemm", ...)`` statement, compiled from its source."""
    source = shared_nemo_rl(NEMO_RL_FP8)
    tree = ast.parse(source.read_text())
    init = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "init_fp8"
    )
    (stmt,) = [
        n
        for n in ast.walk(init)
        if isinstance(n, ast.If) and "use_deep_gemm" in ast.unparse(n.test)
    ]
    env: dict[str, str] = {}
    fake_os = type("os", (), {"environ": env})
    is_mx = bool(vllm_cfg.get("is_mx", False))
    exec(
        compile(ast.Module(body=[stmt], type_ignores=[]), str(source), "exec"),
        {"os": fake_os, "vllm_cfg": vllm_cfg, "is_mx": is_mx},
    )
    return env


BLACKWELL_BLOCK = {"recipe": "fp8_blockwise", "pow2_scales": True}
"""Block FP8 that trains on Blackwell (TE emulates it with MXFP8 there: power-of-2 scales)."""


def _input(tmp_path, edit_vllm: dict | None = None, fp8: dict | None = None) -> Path:
    data = yaml.safe_load((CONFIGS / "grpo_math_8B_megatron.yaml").read_text())
    data["defaults"] = os.path.relpath(CONFIGS / data["defaults"], tmp_path)
    if fp8 is None:
        data["policy"]["precision"] = "fp8_blockwise"
    else:
        data["fp8"] = fp8
    if edit_vllm:
        data["policy"].setdefault("generation", {}).setdefault("vllm_cfg", {}).update(edit_vllm)
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _vllm_cfg(result, where: Path) -> dict:
    """vllm_cfg as NeMo RL sees it: apply's overlay at ``where`` with its defaults: chain (a
    key whose parent value is already right is not written)."""
    where.write_text(yaml.safe_dump(result.data, sort_keys=False))
    return load_config_chain(where)[1]["policy"]["generation"]["vllm_cfg"]


def test_the_upstream_statement_is_what_the_fact_says():
    assert nemo_rl_deep_gemm_env({"use_deep_gemm": True}) == {
        "VLLM_USE_DEEP_GEMM": "1",
        "VLLM_USE_DEEP_GEMM_E8M0": "0",
    }
    assert nemo_rl_deep_gemm_env({"use_deep_gemm": False}) == {}


@pytest.mark.parametrize("hardware", ["NVIDIA B200", "GB200", "b300"])
@pytest.mark.parametrize(
    "fp8",
    [
        BLACKWELL_BLOCK,
        {"recipe": "fp8_subchannel"},
        {"recipe": "fp8_blockwise", "training": "bf16"},  # FP8 rollouts only, fp32 scales
    ],
)
def test_blackwell_never_asks_for_deep_gemm_with_fp32_scales(tmp_path, hardware, fp8):
    result = apply_path(
        NEMO_RL, _input(tmp_path, fp8=fp8), output=tmp_path / "out.yaml", hardware=hardware
    )
    cfg = _vllm_cfg(result, tmp_path / "out.yaml")
    assert cfg["precision"] == "fp8" and cfg.get("use_deep_gemm") is False
    env = nemo_rl_deep_gemm_env(cfg)
    assert env.get("VLLM_USE_DEEP_GEMM") != "1"


@pytest.mark.parametrize("hardware", [None, "H100", "NVIDIA H200"])
def test_hopper_and_unstated_targets_keep_nvidias_deep_gemm(tmp_path, hardware):
    result = apply_path(NEMO_RL, _input(tmp_path), output=tmp_path / "out.yaml", hardware=hardware)
    assert (
        _vllm_cfg(result, tmp_path / "out.yaml")["use_deep_gemm"] is True
    )  # as grpo_math_8B_megatron_fp8.yaml


def test_the_cli_hardware_flag_reaches_the_deep_gemm_choice(tmp_path):
    src, out = _input(tmp_path, fp8=BLACKWELL_BLOCK), tmp_path / "out.yaml"
    assert (
        cli_main(
            ["apply", str(src), "--host", "nemo-rl", "--hardware", "NVIDIA B200", "-o", str(out)]
        )
        == 0
    )
    cfg = load_config_chain(out)[1]["policy"]["generation"]["vllm_cfg"]
    assert cfg["use_deep_gemm"] is False


def test_a_stated_deep_gemm_true_on_blackwell_is_refused(tmp_path):
    with pytest.raises(FP8ConfigError) as err:
        apply_path(
            NEMO_RL,
            _input(tmp_path, {"use_deep_gemm": True}, fp8=BLACKWELL_BLOCK),
            output=tmp_path / "out.yaml",
            hardware="b200",
        )
    assert err.value.key == KEY and "UE8M0" in str(err.value)
    assert "use_deep_gemm: false" in err.value.hint


@pytest.mark.parametrize("hardware", [None, "h100", "b200"])
def test_the_users_own_deep_gemm_false_is_kept(tmp_path, hardware):
    result = apply_path(
        NEMO_RL,
        _input(tmp_path, {"use_deep_gemm": False}, fp8=BLACKWELL_BLOCK),
        output=tmp_path / "out.yaml",
        hardware=hardware,
    )
    assert _vllm_cfg(result, tmp_path / "out.yaml")["use_deep_gemm"] is False
    assert nemo_rl_deep_gemm_env(_vllm_cfg(result, tmp_path / "out.yaml")) == {}
    if hardware != "b200":
        assert any("use_deep_gemm: false kept" in n for n in result.notes)

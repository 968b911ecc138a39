"""``explain --hardware`` shows what ``apply --hardware`` writes: every built-in recipe, every
host, every GPU generation the rollout tables answer for.

The hardware target changes keys (NeMo RL's ``use_deep_gemm``, vLLM's start-up variables and
rollout notes), so explain must spell with the target in the spec as apply does; a target the
recipe cannot run on is apply's refusal and every host section's. ``apply`` runs as the command
(in this process) and writes a file; the test diffs that file against the input with its own
flattening and compares with ``explain``'s host section, as ``tests/hosts/test_pipeline.py``
does for the examples without a target.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.explain import build_report
from nemo_fp8_plugin.registry import list_recipes

pytestmark = pytest.mark.torch_free

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "conf" / "examples"
FIXTURES = ROOT / "tests" / "fixtures"
HOST_CONFIGS = {
    "megatron": "megatron_gpt_fp8_current.yaml",
    "nemo2": "nemo2_llama32_1b_finetune_fp8_blockwise.yaml",
    "bridge": "bridge_llama3_8b_pretrain_fp8_blockwise.yaml",
    "nemo-rl": "nemo_rl_grpo_trimmed.yaml",  # tests/fixtures: no NeMo RL example runs alone
    "vllm": "vllm_llama8b_fp8_blockwise.yaml",
    "te": "megatron_gpt_fp8_current.yaml",
}
RECIPES = sorted(s.name for s in list_recipes())
GPUS = ("h100", "b200", "rtx pro 6000")


def _config(host: str, recipe: str, *, drop_deep_gemm: bool = False) -> dict:
    """The host's example with its request replaced by ``recipe`` (and, for NeMo RL, without
    the example's own ``use_deep_gemm``, so the target decides it)."""
    data = yaml.safe_load(
        ((EXAMPLES if host != "nemo-rl" else FIXTURES) / HOST_CONFIGS[host]).read_text()
    )
    data.pop("precision", None)
    data.pop("fp8", None)
    data["fp8"] = {"recipe": recipe}
    if drop_deep_gemm:
        data["policy"]["generation"]["vllm_cfg"].pop("use_deep_gemm")
    return data


def _leaves(node, prefix=""):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


CASES = [
    pytest.param(
        host, recipe, gpu, drop, id=f"{host}{'-no-deep-gemm' if drop else ''}-{recipe}-{gpu}"
    )
    for host in HOST_CONFIGS
    for drop in ((False, True) if host == "nemo-rl" else (False,))
    for recipe in RECIPES
    for gpu in GPUS
]


@pytest.mark.parametrize("host,recipe,gpu,drop", CASES)
def test_explain_with_hardware_shows_what_apply_writes(tmp_path, capsys, host, recipe, gpu, drop):
    source = _config(host, recipe, drop_deep_gemm=drop)
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(source))
    out = tmp_path / "out.yaml"
    rc = main(["apply", str(path), "--host", host, "--hardware", gpu, "-o", str(out)])
    err = capsys.readouterr().err
    try:
        section = build_report(path, hardware=gpu, host=host)["hosts"][host]
    except FP8ConfigError as refused:  # the config's own host refuses: so does apply
        assert rc == 2 and str(refused) in err, (str(refused), err)
        return
    if rc == 2:
        assert "refused" in section and section["refused"] in err, (section, err)
        return
    assert rc == 0 and "refused" not in section, (err, section)
    written = yaml.safe_load(out.read_text())
    if host == "te":  # a new document describing the recipe, not an edit
        assert section["keys"] == written
        return
    before, after = dict(_leaves(source)), dict(_leaves(written))
    changed = {k: v for k, v in after.items() if k not in before or before[k] != v}
    changed.pop("defaults", None)
    shown = dict(_leaves(section["keys"])) if section["keys"] else {}
    shown.pop("defaults", None)
    assert shown == changed
    for var, value in section.get("env", {}).items():
        assert host != "vllm" or f"{var}={value}" in err


def test_the_target_changes_what_nemo_rl_writes(tmp_path):
    """The case that went wrong: without the target in the spec, explain said
    ``use_deep_gemm: true`` for a B200, where apply writes nothing (false is NeMo RL's
    default)."""
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(_config("nemo-rl", "fp8_subchannel", drop_deep_gemm=True)))
    keys = dict(
        _leaves(build_report(path, hardware="b200", host="nemo-rl")["hosts"]["nemo-rl"]["keys"])
    )
    assert "policy.generation.vllm_cfg.use_deep_gemm" not in keys
    keys = dict(
        _leaves(build_report(path, hardware="h100", host="nemo-rl")["hosts"]["nemo-rl"]["keys"])
    )
    assert keys["policy.generation.vllm_cfg.use_deep_gemm"] is True


def test_the_header_describes_the_recipe_explained(tmp_path, capsys):
    """A preset changed by the request is not described with the preset's words:
    ``fp8_blockwise`` says "fp32 scales", which ``pow2_scales: true`` makes false."""
    path = tmp_path / "in.yaml"
    path.write_text("fp8: {recipe: fp8_blockwise, pow2_scales: true}\n")
    assert main(["explain", str(path)]) == 0
    header = capsys.readouterr().out.splitlines()[:4]
    assert not any("fp32 scales" in line for line in header), header
    assert any("pow2_scales: true" in line for line in header), header
    path.write_text("fp8: {recipe: fp8_blockwise}\n")
    assert main(["explain", str(path)]) == 0
    assert "fp32 scales" in capsys.readouterr().out.splitlines()[3]

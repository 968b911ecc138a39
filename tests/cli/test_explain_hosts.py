"""What ``explain`` (and ``apply``, ``doctor``) say is the config's host's own concern.

A recipe names both sides, but megatron-core, NeMo 2, Megatron-Bridge and Transformer Engine
only train, vLLM only generates and NeMo RL does both (``capabilities.HOST_SIDES``). For a
training-only config explain hides the generation-side fields and calls another host's
refusal of a config not written for it "not this host's"; a GPU the recipe cannot run on is
refused in the host's terms, with the recipe docs/recipes.md suggests for that host
(``fp8_subchannel`` for pretraining on Hopper, ``fp8_blockwise`` for RL).
"""

from __future__ import annotations

import json

import pytest

from nemo_fp8_plugin.cli import main

pytestmark = pytest.mark.torch_free

# One small config per host, in the shape detect_host reads (the recipe line is {recipe}).
SHAPES = {
    "megatron": "model: {{num_layers: 4, hidden_size: 256, ffn_hidden_size: 1024}}\n"
    "precision: {recipe}\n",
    "bridge": "model: {{num_layers: 4}}\nmixed_precision: {recipe}\n",
    "nemo2": "trainer: {{devices: 8}}\nprecision: {recipe}\n",
    "vllm": "model: meta-llama/Llama-3.1-8B\nmax_model_len: 4096\nprecision: {recipe}\n",
    "nemo-rl": "policy:\n  precision: {recipe}\n  megatron_cfg: {{enabled: true}}\n"
    "  generation: {{backend: vllm}}\n",
}
GENERATION_FIELDS = ("generation:", "kv_cache:", "generation_numerics:", "importance_sampling:")


def _config(tmp_path, host: str, recipe: str):
    path = tmp_path / f"{host}.yaml"
    path.write_text(SHAPES[host].format(recipe=recipe))
    return str(path)


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("host", ["megatron", "bridge", "nemo2"])
def test_a_training_only_config_hides_the_generation_side(host, tmp_path, capsys):
    cfg = _config(tmp_path, host, "fp8_blockwise")
    rc, out, _ = _run(capsys, "explain", cfg)
    assert rc == 0 and f"host: {host} (detected" in out
    fields = out[out.index("recipe fields:") :]
    assert not [f for f in GENERATION_FIELDS if f"  {f}" in fields]
    assert (
        f"(generation, kv_cache, generation_numerics, importance_sampling, router_replay: {host} only "
        in out
    )
    assert "(refused)" not in out and "nemo-rl (not this host's)" in out
    rc, everything, _ = _run(capsys, "explain", cfg, "--all-hosts")
    assert all(f in everything for f in GENERATION_FIELDS)
    assert "apply --host vllm: not this host's config: " in everything
    for generates in ("vllm", "nemo-rl"):  # hosts that generate keep the fields
        _, out, _ = _run(capsys, "explain", _config(tmp_path, generates, "fp8_blockwise"))
        assert "kv_cache:" in out and "only trains" not in out, generates


def test_a_host_refusing_the_recipe_itself_is_still_refused(tmp_path, capsys):
    """vLLM has no NVFP4 generation: that is vLLM's word on the recipe, on any config."""
    _, out, _ = _run(capsys, "explain", _config(tmp_path, "megatron", "nvfp4"))
    assert "vllm (refused)" in out and "nemo-rl (not this host's)" in out
    _, text, _ = _run(capsys, "explain", _config(tmp_path, "megatron", "nvfp4"), "--json")
    hosts = json.loads(text)["hosts"]
    assert hosts["vllm"]["refuses_recipe"] is True
    assert hosts["nemo-rl"]["refuses_recipe"] is False


# --------------------------------------------------------------------------- hardware


@pytest.mark.parametrize("host", ["megatron", "bridge", "nemo2"])
def test_mxfp8_on_hopper_for_a_training_host_speaks_training(host, tmp_path, capsys):
    """Not vLLM's kernels, and pretraining's recipe (docs/recipes.md: fp8_subchannel)."""
    cfg = _config(tmp_path, host, "mxfp8")
    key = "mixed_precision" if host == "bridge" else "precision"
    want = "mxfp8 cannot train on Hopper (SM90): MXFP8 training needs Blackwell (SM100/SM103); "
    want += f"the nearest recipe that trains there is fp8_subchannel: `{key}: fp8_subchannel`"
    rc, out, _ = _run(capsys, "explain", cfg, "--hardware", "h100")
    warning = next(ln for ln in out.splitlines() if ln.startswith("warning: --hardware h100:"))
    assert rc == 0 and warning == f"warning: --hardware h100: {want}"
    assert "note: on h100: training: cannot run on Hopper (SM90)" in out
    assert "generation: cannot run" not in out
    rc, _, err = _run(capsys, "apply", cfg, "--hardware", "h100", "-o", str(tmp_path / "o.yaml"))
    assert rc == 2 and err == f"nemo-fp8 apply: error: --hardware: {want}\n"
    rc, out, _ = _run(capsys, "doctor", cfg, "--hardware", "h100")
    assert rc == 1 and out.splitlines()[0] == f"verdict: cannot run here: {want}"
    for text in (warning, err, out):
        assert "vLLM" not in text and "fp8_blockwise" not in text


def test_mxfp8_on_hopper_for_nemo_rl_keeps_the_rl_recipe(tmp_path, capsys):
    """NeMo RL also generates: the move must have a vLLM FP8 path there (fp8_blockwise). Only
    NeMo RL's main snapshot generates in MXFP8 at all (a release refuses it first)."""
    cfg = _config(tmp_path, "nemo-rl", "mxfp8")
    rc, out, _ = _run(
        capsys, "explain", cfg, "--hardware", "h100", "--stack", "nemo-rl-main-2026-08-22"
    )
    assert (
        "the nearest recipe that runs there is fp8_blockwise: `policy.precision: fp8_blockwise`"
        in out
    )
    assert "vLLM's MXFP8 kernels" in out


def test_a_vllm_config_is_judged_for_generation_only(tmp_path, capsys):
    """fp8_blockwise's fp32 block scales stop Transformer Engine's training on B200, not vLLM's
    block-FP8 serving: apply writes it; mxfp8 on H100 is refused for vLLM's kernels."""
    cfg = _config(tmp_path, "vllm", "fp8_blockwise")
    rc, out, _ = _run(capsys, "explain", cfg, "--hardware", "b200")
    assert rc == 0 and "warning: --hardware b200" not in out
    out_file = tmp_path / "serve.yaml"
    rc, _, err = _run(capsys, "apply", cfg, "--hardware", "b200", "-o", str(out_file))
    assert rc == 0 and out_file.is_file(), err
    rc, out, _ = _run(capsys, "doctor", cfg, "--hardware", "b200")
    assert rc == 0 and "CANNOT" not in out and "Transformer Engine emulates" not in out
    cfg = _config(tmp_path, "vllm", "mxfp8")
    rc, _, err = _run(capsys, "apply", cfg, "--hardware", "h100", "-o", str(out_file))
    assert rc == 2 and "mxfp8 cannot generate on Hopper (SM90): vLLM's MXFP8 kernels" in err
    assert "`precision: fp8_blockwise`" in err and "train" not in err


def test_every_host_says_which_sides_it_runs():
    """A host added without its sides would be judged on both, silently."""
    from nemo_fp8_plugin.capabilities import HOST_SIDES, host_sides
    from nemo_fp8_plugin.hosts import ADAPTERS

    assert set(HOST_SIDES) == set(ADAPTERS)
    assert host_sides("nemo_rl") == host_sides("nemo-rl") == ("training", "generation")

"""A config already FP8 in a host's own keys gets the checks a requested recipe gets: NeMo RL's
start-up asserts, the keys the assumed release does not read, the ``--hardware`` target and the
rollout kernels, in ``explain``, ``apply`` and ``doctor`` alike (``hosts.check_native``).

NVIDIA's own FP8 configs of each release (shared test data, ``shared_nemo_rl``) are the bases;
nothing here writes a request, so every check runs on the native keys as NeMo RL reads them."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import shared_nemo_rl
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.cli import main

pytestmark = pytest.mark.torch_free

CONFIGS = {"0.6.0": "releases/v0.6.0/", "0.7.0": "releases/v0.7.0/", stacks.NEMO_RL_MAIN: ""}
STACK = {r.name: f"nemo-rl-{r.name}" for r in stacks.NEMO_RL_RELEASES}
RELEASES = list(CONFIGS)
FP8_BASE = "grpo_math_8B_megatron_fp8.yaml"  # NVIDIA's block FP8 end to end, every release


def _native(tmp_path, release: str, base: str = FP8_BASE, **top) -> str:
    """A child of NVIDIA's ``base`` of ``release`` changing only NeMo RL's own keys."""
    parent = shared_nemo_rl(f"{CONFIGS[release]}examples/configs/{base}")
    path = tmp_path / "native.yaml"
    path.write_text(yaml.safe_dump({"defaults": str(parent), **top}, sort_keys=False))
    return str(path)


def _all_refuse(capsys, src: str, stack: str, key: str) -> None:
    """explain and apply exit 2 with one line naming ``key``; doctor's verdict names it, exit 1."""
    for command in (["explain"], ["apply", "-o", src + ".out.yaml"]):
        assert main([*command, src, "--stack", stack]) == 2, command
        (line,) = capsys.readouterr().err.splitlines()
        assert key in line and "Traceback" not in line, line
    assert main(["doctor", src, "--stack", stack, "--hardware", "h100", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert key in report["verdict"]["reason"], report["verdict"]


@pytest.mark.parametrize("release", RELEASES)
def test_importance_sampling_off_with_fp8_generation(tmp_path, capsys, release):
    """NVIDIA's FP8 config with the correction turned off: NeMo RL stops at step 0 (grpo.py)."""
    src = _native(tmp_path, release, loss_fn={"use_importance_sampling_correction": False})
    _all_refuse(capsys, src, STACK[release], "loss_fn.use_importance_sampling_correction")


@pytest.mark.parametrize("release", RELEASES)
def test_fp8_kv_cache_with_pipeline_parallelism(tmp_path, capsys, release):
    """An FP8 KV cache in NeMo RL's keys over a pipeline-parallel policy."""
    policy = {
        "megatron_cfg": {"pipeline_model_parallel_size": 2},
        "generation": {"vllm_cfg": {"kv_cache_dtype": "fp8"}},
    }
    src = _native(tmp_path, release, policy=policy)
    _all_refuse(capsys, src, STACK[release], "policy.megatron_cfg.pipeline_model_parallel_size")


def test_blackwell_target_refused_for_fp32_block_training(tmp_path, capsys):
    """NVIDIA's block FP8 config trains with fp32 block scales: not on Blackwell. As for a
    requested recipe, explain warns (the config moved to another GPU), apply and doctor
    refuse."""
    src = _native(tmp_path, "0.7.0")
    args = ["--stack", STACK["0.7.0"], "--hardware", "b200"]
    assert main(["explain", src, *args]) == 0
    assert "warning: --hardware b200: fp8_blockwise cannot train on Blackwell" in (
        capsys.readouterr().out
    )
    assert main(["apply", src, *args, "-o", src + ".out.yaml"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--hardware" in line and "cannot train on Blackwell" in line
    assert main(["doctor", src, *args]) == 1
    assert "cannot train on Blackwell" in capsys.readouterr().out.splitlines()[0]


def test_rollout_kernels_stated_for_native_keys(tmp_path, capsys):
    """explain on NVIDIA's config says which kernel vLLM rolls out with, as for a request."""
    src = _native(tmp_path, "0.7.0")
    assert main(["explain", src, "--stack", STACK["0.7.0"], "--hardware", "h100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["native"]["recipe"] == "fp8_blockwise"
    rollout = report["hosts"]["nemo-rl"]["checks"]["rollout"]
    assert [g["arch"] for g in rollout["gpus"]] == ["hopper"]
    assert any("rollouts on vLLM 0.20.0" in n for n in report["notes"])


def test_is_mx_not_read_by_v070_is_read_back_as_block_rollouts(tmp_path, capsys):
    """v0.7.0 has no ``vllm_cfg.is_mx``: BF16 training with FP8 rollouts asking for MXFP8 is
    read as what v0.7.0 runs, 128x128 block FP8 rollouts, and says the key is ignored; main
    reads it as MXFP8."""
    policy = {"generation": {"vllm_cfg": {"precision": "fp8", "is_mx": True}}}
    top = {"policy": policy, "loss_fn": {"use_importance_sampling_correction": True}}
    key = "policy.generation.vllm_cfg.is_mx"
    src = _native(tmp_path, "0.7.0", "grpo_math_8B_megatron.yaml", **top)
    assert main(["explain", src, "--stack", STACK["0.7.0"], "--json"]) == 0
    native = json.loads(capsys.readouterr().out)["native"]
    assert native["recipe"] == "fp8_blockwise" and key not in native["read"]
    (ignored,) = native["ignored"]
    assert ignored.startswith(key) and "NeMo RL v0.7.0" in ignored and "128x128 block" in ignored
    assert main(["explain", src, "--stack", STACK["0.7.0"]]) == 0
    assert f"warning: {ignored}" in capsys.readouterr().out
    assert main(["explain", src, "--stack", STACK["0.7.0"], "--strict"]) == 2
    assert key in capsys.readouterr().err
    assert main(["apply", src, "--stack", STACK["0.7.0"], "-o", src + ".out.yaml"]) == 0
    assert ignored in capsys.readouterr().err
    assert main(["doctor", src, "--stack", STACK["0.7.0"], "--hardware", "h100"]) == 1
    assert key in capsys.readouterr().out.splitlines()[0]
    assert main(["explain", src, "--stack", STACK[stacks.NEMO_RL_MAIN], "--json"]) == 0
    native = json.loads(capsys.readouterr().out)["native"]
    assert native["recipe"] == "mxfp8" and native["read"][key] is True and not native["ignored"]


def test_doctor_asks_for_the_rollout_variable_v060_needs(tmp_path, capsys, monkeypatch):
    """v0.6.0 has no ``vllm_cfg.env_vars``: BF16 training with fp32 block rollouts on Blackwell
    needs VLLM_USE_DEEP_GEMM=0 where NeMo RL starts; doctor names it (in the verdict when
    judged for another GPU; not runnable when this shell is where the job starts)."""
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM", raising=False)
    policy = {"generation": {"vllm_cfg": {"precision": "fp8", "use_deep_gemm": False}}}
    src = _native(
        tmp_path,
        "0.6.0",
        "grpo_math_8B_megatron.yaml",
        policy=policy,
        loss_fn={"use_importance_sampling_correction": True},
    )
    assert main(["doctor", src, "--stack", STACK["0.6.0"], "--hardware", "b200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "VLLM_USE_DEEP_GEMM=0" in report["verdict"]["action"]
    (recipe,) = report["recipes"]
    assert {e["name"]: e["set"] for e in recipe["env"]} == {"VLLM_USE_DEEP_GEMM": False}


def test_megatron_keys_on_hopper(tmp_path, capsys):
    """megatron-core's own MXFP8 keys judged for an H100: explain warns, apply and doctor
    refuse."""
    src = tmp_path / "mx.yaml"
    src.write_text("model:\n  fp8: e4m3\n  fp8_recipe: mxfp8\n")
    assert main(["explain", str(src), "--hardware", "h100"]) == 0
    assert "warning: --hardware h100: mxfp8 cannot train on Hopper" in capsys.readouterr().out
    assert main(["apply", str(src), "--hardware", "h100", "-o", str(tmp_path / "o.yaml")]) == 2
    assert "Hopper" in capsys.readouterr().err
    assert main(["doctor", str(src), "--hardware", "h100"]) == 1
    assert "cannot run here: mxfp8 cannot train on Hopper" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("example", "host"),
    [
        ("megatron_gpt_fp8_current.yaml", "megatron"),
        ("nemo2_llama32_1b_finetune_fp8_blockwise.yaml", "nemo2"),
        ("bridge_llama3_8b_pretrain_mxfp8.yaml", "bridge"),
    ],
)
def test_training_hosts_own_keys_show_no_generation_fields(tmp_path, capsys, example, host):
    """apply's output for a host that only trains, explained: the recipe read back from its
    own keys without the generation-side fields (which it does not run)."""
    from conftest import REPO

    out = tmp_path / "out.yaml"
    assert main(["apply", str(REPO / "conf/examples" / example), "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "read from native keys:" in text, text
    assert "say nothing of generation" not in text
    assert "kv_cache:" not in text and "importance_sampling:" not in text
    assert f"{host} only trains; --all-hosts shows them" in text


def test_hardware_refusal_of_a_training_host_is_not_other_hosts(tmp_path, capsys):
    """mxfp8 on an H100 for a megatron config: apply --host megatron refuses; the other hosts
    are not this config's, not "refused"."""
    src = tmp_path / "m.yaml"
    src.write_text("model: {num_layers: 4}\nfp8: {recipe: mxfp8}\n")
    assert main(["explain", str(src), "--hardware", "h100", "--host", "megatron"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("other hosts"))
    assert "(refused)" not in line and "nemo-rl (not this host's)" in line, line


@pytest.mark.parametrize("release", ["0.6.0", "0.7.0"])
def test_nvfp4_refusal_names_the_release_first(tmp_path, capsys, release):
    """NVIDIA's 8B Megatron config packs sequences; the release cannot train NVFP4 at all, so
    the one line names the release, not the packing (which would only lead to this)."""
    parent = shared_nemo_rl(f"{CONFIGS[release]}examples/configs/grpo_math_8B_megatron.yaml")
    src = tmp_path / "nvfp4.yaml"
    src.write_text(yaml.safe_dump({"defaults": str(parent), "fp8": {"recipe": "nvfp4"}}))
    for command in (["explain"], ["apply", "-o", str(tmp_path / "o.yaml")]):
        assert main([*command, str(src), "--stack", STACK[release]]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert f"NeMo RL v{release} cannot train in NVFP4" in line, line
        assert "sequence_packing" not in line


def test_doctor_text_names_the_nemo_rl_release_always(capsys):
    """The release chosen with --stack, or assumed with nothing installed, and whether it is
    tested: in the text report, not only in --json."""
    assert main(["doctor", "--stack", "nemo-rl-0.6.0"]) == 0
    out = capsys.readouterr().out
    assert "  nemo-rl: NeMo RL v0.6.0 (chosen with --stack nemo-rl-0.6.0): tested" in out, out
    assert main(["doctor", "--stack", "nemo-rl-0.6.0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stack"]["nemo_rl"]["release"] == "0.6.0"
    assert main(["doctor"]) == 0  # nothing here names a release: the newest is assumed
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  nemo-rl: "))
    assert line.startswith("  nemo-rl: NeMo RL v0.7.0 (") and line.endswith(": tested"), line


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("policy.generation.vllm_cfg.kv_cache_dtype", ["fp8"]),
        ("loss_fn.use_importance_sampling_correction", "yes please"),
        ("policy.megatron_cfg.fp8_cfg.enabled", "on"),
    ],
)
def test_malformed_native_key_is_one_line(tmp_path, capsys, key, bad):
    """A malformed NeMo RL key is the user's mistake: one line naming it, exit 2, never read
    as its default (a string NeMo RL would test as true, a list as no FP8 KV cache)."""
    top: dict = {}
    node = top
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = bad
    src = _native(tmp_path, "0.7.0", **top)
    assert main(["explain", src, "--stack", STACK["0.7.0"]]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert key in line and "Traceback" not in line, line


def test_doctor_refuses_a_broken_interpolation_as_bad_input(tmp_path, capsys):
    """An interpolation that cannot be resolved is a mistake in the config, as explain says:
    doctor exits 2 with one line naming the key, not a "cannot run here" verdict."""
    top: dict = {"policy": {"generation": {"vllm_cfg": {"gpu_memory_utilization": "${nope.x}"}}}}
    top["fp8"] = {"recipe": "fp8_blockwise"}
    src = _native(tmp_path, "0.7.0", "grpo_math_8B_megatron.yaml", **top)
    for command in (["explain"], ["doctor", "--hardware", "h100"]):
        assert main([*command, src, "--stack", STACK["0.7.0"]]) == 2, command
        (line,) = capsys.readouterr().err.splitlines()
        assert "policy.generation.vllm_cfg.gpu_memory_utilization" in line, line
        assert "cannot resolve an interpolation" in line

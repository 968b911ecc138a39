"""``nemo-fp8 doctor`` on the CPU test machine (no GPU, no Transformer Engine installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest

from conftest import REPO, load_te_recipe_module
from nemo_fp8_plugin.cli import doctor, main

pytestmark = pytest.mark.host


def _json(capsys, *argv, rc=0):
    assert main(["doctor", *argv, "--json"]) == rc
    return json.loads(capsys.readouterr().out)


def test_reports_versions_and_what_it_could_not_check(capsys):
    assert main(["doctor", "-v"]) == 0
    text = capsys.readouterr().out
    assert "gpu: none visible" in text
    assert f"megatron-core      {metadata.version('megatron-core')}" in text
    assert "not checked: GPU architecture: no CUDA GPU visible to torch" in text
    assert "not checked: Transformer Engine at run time" in text
    assert text.count("recipe ") >= 5


def test_json_report(capsys):
    report = _json(capsys)
    assert report["packages"]["nemo-toolkit"] == metadata.version("nemo-toolkit")
    assert report["packages"]["transformer-engine"] is None
    assert report["machine"]["gpus"] == [] and report["machine"]["arch"] is None
    names = [r["recipe"] for r in report["recipes"]]
    assert {"fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8"} <= set(names)
    assert all(r["runnable"] is None for r in report["recipes"])  # nothing to judge against


@pytest.mark.parametrize(
    "hardware,runnable",
    [
        ("h100", {"mxfp8": False, "fp8_blockwise": None, "fp8_delayed": None}),
        ("b200", {"mxfp8": None, "fp8_blockwise": False, "fp8_subchannel": None}),
        ("l40s", {"fp8_subchannel": False, "fp8_current": None}),
    ],
)
def test_hardware_rules_for_a_target(capsys, hardware, runnable):
    """False = refused by the hardware rules; None = allowed, but TE / CUDA not checkable here."""
    report = _json(capsys, "--hardware", hardware)
    verdict = {r["recipe"]: r["runnable"] for r in report["recipes"]}
    for name, want in runnable.items():
        assert verdict[name] is want, name
    blockwise = next(r for r in report["recipes"] if r["recipe"] == "fp8_blockwise")
    if hardware == "b200":
        assert any("pow2_scales" in p for p in blockwise["problems"])


def test_env_var_state(capsys, tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: fp8_blockwise\n")
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    no_te = doctor.EXIT_NO_TE  # FP8 training asked for and no Transformer Engine here
    env = _json(capsys, str(cfg), rc=no_te)["recipes"][0]["env"]
    assert env == [
        {
            "name": "NVTE_FP8_BLOCK_SCALING_FP32_SCALES",
            "needed": "1",
            "value": None,
            "set": False,
            "te_default": False,
        }
    ]
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert _json(capsys, str(cfg), rc=no_te)["recipes"][0]["env"][0]["set"] is True


def test_variables_at_tes_default_are_not_listed_as_needed(capsys, tmp_path, monkeypatch):
    """NVFP4's seven NVTE_NVFP4_* variables equal TE's defaults: unset, nothing to do."""
    from nemo_fp8_plugin.capabilities import ENV_NVFP4

    for var in ENV_NVFP4.values():
        monkeypatch.delenv(var, raising=False)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: nvfp4\n")
    assert main(["doctor", str(cfg), "-v"]) == doctor.EXIT_NO_TE
    text = capsys.readouterr().out
    assert "needed in the training process: unset" not in text
    assert "env: 7 variable(s) unset here, which is fine: TE's default is" in text
    # the defaults table is TE's own: every entry is what TE 2.20.2 reads when unset
    te = load_te_recipe_module(tmp_path, name="te_recipe_defaults")
    nvfp4 = te.NVFP4BlockScaling
    for field, var in ENV_NVFP4.items():
        want = getattr(nvfp4, field)
        default = doctor.TE_ENV_DEFAULTS[var]
        assert want == (default == "1" if isinstance(want, bool) else default), var


def test_exit_code_3_when_training_is_asked_and_te_is_absent(capsys, tmp_path, monkeypatch):
    """A launch script can gate on doctor: FP8 training without Transformer Engine."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: fp8_blockwise\n")
    assert main(["doctor", str(cfg)]) == 3
    out = capsys.readouterr().out
    assert "works here: explain, apply, analyze and recipes (no host needed)" in out
    assert "FP8 emulation" in out and "nemo-fp8 demo" in out
    gen_only = tmp_path / "g.yaml"
    gen_only.write_text("fp8: {recipe: fp8_blockwise, training: bf16}\n")
    assert main(["doctor", str(gen_only)]) == 0  # no training check asked
    assert main(["doctor", str(cfg), "--hardware", "h100"]) == 0  # judged for another machine
    real_versions = doctor.package_versions
    monkeypatch.setattr(
        doctor, "package_versions", lambda: {**real_versions(), "transformer-engine": "2.20.2"}
    )
    monkeypatch.setattr(doctor, "_te_recipe_module", lambda: (None, "stand-in: not loaded"))
    assert main(["doctor", str(cfg)]) == 0


def test_effective_te_parameters_checked_with_te(capsys, tmp_path, monkeypatch):
    """With a Transformer Engine present (its real recipe module, imported with the variable
    unset), the doctor sees that TE would run fp8_blockwise with power-of-2 scales."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    te_recipe = load_te_recipe_module(tmp_path, name="te_recipe_for_doctor")
    real_versions = doctor.package_versions
    monkeypatch.setattr(
        doctor, "package_versions", lambda: {**real_versions(), "transformer-engine": "2.20.2"}
    )
    monkeypatch.setattr(doctor, "_te_recipe_module", lambda: (te_recipe, None))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: fp8_blockwise\n")
    r = _json(capsys, str(cfg), "--hardware", "h100", rc=1)["recipes"][0]
    assert r["env_effective"] is False
    assert any("NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in p for p in r["problems"])
    assert r["runnable"] is False


def test_config_without_fp8(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: bf16-mixed\n")
    assert main(["doctor", str(cfg)]) == 0
    assert "asks for no FP8 recipe" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["missing.yaml"], ["--hardware", "tpu"]])
def test_bad_input_exits_2(capsys, argv):
    assert main(["doctor", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nemo-fp8 doctor: error:") and "Traceback" not in err


def test_unknown_recipe_in_config_exits_2(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: fp8_bogus\n")
    assert main(["doctor", str(cfg)]) == 2
    assert "valid recipes" in capsys.readouterr().err


@pytest.mark.parametrize(
    "cap,arch",
    [
        ((8, 9), "ada"),
        ((9, 0), "hopper"),
        ((10, 0), "blackwell"),
        ((10, 3), "blackwell"),
        ((12, 0), "blackwell_sm120"),
        ((12, 1), "blackwell_sm120"),
        ((8, 0), None),
        ((7, 0), None),
    ],
)
def test_arch_of(cap, arch):
    assert doctor.arch_of(cap) == arch


@pytest.mark.slow
def test_doctor_imports_no_host():
    code = (
        "import sys; from nemo_fp8_plugin.cli.doctor import build_report; build_report(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'megatron', 'nemo', 'nemo_run', 'vllm', 'transformer_engine', 'lightning'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stderr


def test_exit_code_1_when_the_configs_recipe_cannot_run_here(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: mxfp8\n")
    assert main(["doctor", str(cfg), "--hardware", "h100"]) == 1
    assert "CANNOT run here" in capsys.readouterr().out
    assert main(["doctor", "--hardware", "h100"]) == 0  # a survey of every recipe judges none


def test_mxfp8_is_not_runnable_on_sm120(capsys):
    """TE refuses MXFP8 on SM 12.0+ (`_compute_mxfp8_support`); the plugin
    used to map sm120 to Blackwell and allow it."""
    assert main(["doctor", "--hardware", "rtx-pro-6000", "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    verdict = {r["recipe"]: r for r in report["recipes"]}
    assert verdict["mxfp8"]["runnable"] is False
    assert any("SM 12.0" in p for p in verdict["mxfp8"]["problems"])
    assert verdict["fp8_current"]["runnable"] is not False


# --------------------------------------------------------------------------- doctor's verdict


def test_reports_the_plugin_version_and_its_entry_points(capsys):
    import nemo_fp8_plugin

    report = _json(capsys)
    assert report["plugin"]["version"] == nemo_fp8_plugin.__version__
    groups = {ep["group"]: ep for ep in report["entry_points"]}
    assert set(groups) == {"nemo_run.cli", "vllm.general_plugins", "nemo_fp8_plugin.recipes"}
    # the test environment installs the package, so NeMo-Run and vLLM would find both
    assert groups["nemo_run.cli"]["visible"] and groups["vllm.general_plugins"]["visible"]
    assert groups["nemo_run.cli"]["host_version"] == metadata.version("nemo-run")
    assert groups["nemo_fp8_plugin.recipes"]["recipes"] == []
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert f"nemo-fp8-plugin {nemo_fp8_plugin.__version__}" in text
    assert "entry points visible: nemo_run.cli fp8, vllm.general_plugins nemo_fp8" in text
    assert main(["doctor", "-v"]) == 0
    text = capsys.readouterr().out
    assert "entry point nemo_run.cli fp8: visible" in text
    assert "entry point vllm.general_plugins nemo_fp8: visible" in text
    assert "no other package adds recipes" in text


def test_an_entry_point_vllm_would_skip_is_a_problem(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    vllm = next(ep for ep in _json(capsys)["entry_points"] if ep["group"] == "vllm.general_plugins")
    assert any("VLLM_PLUGINS" in p for p in vllm["problems"])
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin,nemo_fp8")
    vllm = next(ep for ep in _json(capsys)["entry_points"] if ep["group"] == "vllm.general_plugins")
    assert vllm["problems"] == []


def test_an_invisible_entry_point_says_how_to_install(capsys, monkeypatch):
    real = metadata.entry_points
    monkeypatch.setattr(
        doctor.metadata,
        "entry_points",
        lambda group: [] if group == "nemo_run.cli" else real(group=group),
    )
    nemo_run = next(ep for ep in _json(capsys)["entry_points"] if ep["group"] == "nemo_run.cli")
    assert nemo_run["visible"] is False and "pip install" in nemo_run["problems"][0]


def test_doctor_never_advises_running_itself(capsys):
    assert main(["doctor", "--hardware", "h100"]) == 0
    text = capsys.readouterr().out
    assert "nemo-fp8 doctor" not in text
    assert "not checked here: CUDA version" in text  # the check that note pointed at, made here
    assert "CANNOT run here: mxfp8, nvfp4" in text


# --------------------------------------------------------------------------- stacks


def _with_versions(monkeypatch, **versions):
    """The doctor sees these installed versions (others as installed here)."""
    real = doctor.package_versions()
    fake = {**real, **{k.replace("_", "-"): v for k, v in versions.items()}}
    monkeypatch.setattr(doctor, "package_versions", lambda: fake)
    return fake


def test_the_test_environment_is_the_nemo_2_7_stack(capsys):
    """This environment (NeMo 2.7.3, megatron-core 0.16.1, no TE) is the nemo-2.7 stack."""
    stack = _json(capsys)["stack"]
    assert stack["name"] == "nemo-2.7" and stack["matches"] and stack["tested"]
    assert stack["hosts"]["megatron-core"]["tested"] is True
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert (
        "stack: nemo-2.7 (detected from the installed packages): tested here: nemo-toolkit "
        "2.7.3, megatron-core 0.16.1; not installed here: transformer-engine"
    ) in text
    assert "megatron-core 0.16.1 (tested)" in text


def test_a_nemo_rl_container_is_detected(capsys, monkeypatch):
    """NeMo RL main's own versions (its uv.lock: TE 2.15.0+42b8400, vLLM 0.25.1; megatron-core
    built from its submodule): that release, found from vLLM and TE, and no version of the
    container's is advised to change."""
    _with_versions(
        monkeypatch,
        torch="2.11.0+cu130",
        transformer_engine="2.15.0+42b8400",
        vllm="0.25.1",
        megatron_core="0.20.0",
        nemo_toolkit=None,
        nemo_rl="0.6.0",
    )
    stack = _json(capsys)["stack"]
    assert stack["name"] == "nemo-rl-main-2026-08-22" and stack["matches"]
    assert stack["tested"] is False  # core 0.20: source only
    assert any("megatron-core 0.20.0 is not a version" in c for c in stack["differs"])
    assert not any("->" in c for c in stack["differs"])
    release = stack["nemo_rl"]
    assert release["release"] == "main-2026-08-22" and release["detected"] and release["tested"]
    assert "vLLM 0.25.1" in release["how"]


def test_an_untested_set_says_how_it_differs_and_never_to_change_a_pinned_version(
    capsys, monkeypatch
):
    """TE 2.17 with megatron-core 0.16.1 is no named stack; the nearest is nemo-2.7, whose
    TE range megatron-core 0.16.1 itself requires. A container pins its versions: the report
    describes the difference and advises no change of version."""
    _with_versions(monkeypatch, transformer_engine="2.17.0")
    stack = _json(capsys)["stack"]
    assert stack["name"] is None and stack["matches"] is False and stack["nearest"] == "nemo-2.7"
    assert "transformer-engine 2.17.0 is outside nemo-2.7's >=2.9,<2.12" in stack["differs"]
    assert any("transformer-engine 2.17.0 is not a version" in c for c in stack["differs"])
    assert "changes" not in stack
    for argv in (["doctor"], ["doctor", "-v"]):
        assert main(argv) == 0
        text = capsys.readouterr().out
        assert "stack: none of the named stacks" in text and "untested set" in text
        assert "transformer-engine 2.17.0 (UNTESTED)" in text
        assert "change" not in text and "->" not in text


def test_stack_flag_checks_against_a_named_stack(capsys):
    stack = _json(capsys, "--stack", "nemo-rl-0.7.0")["stack"]
    assert stack["name"] == "nemo-rl-0.7.0" and stack["how"] == "chosen with --stack"
    assert stack["matches"] is False
    # a released container's versions are its own: how they differ, never a change to make
    assert any(
        c.startswith("torch 2.13.0+cpu is outside nemo-rl-0.7.0's") for c in stack["differs"]
    )
    assert not any("->" in c for c in stack["differs"])
    assert main(["doctor", "--stack", "nemo-2.7"]) == 0
    assert "stack: nemo-2.7 (chosen with --stack): tested here: " in capsys.readouterr().out


def test_unknown_stack_is_bad_input(capsys):
    assert main(["doctor", "--stack", "nemo-9"]) == 2
    err = capsys.readouterr().err
    assert "--stack" in err and "nemo-rl-0.6" in err and "Traceback" not in err


def test_recipe_class_minimum_comes_from_the_stacks_table(capsys, monkeypatch):
    """TE 2.5 has no NVFP4BlockScaling (from 2.7): nvfp4 cannot run, the others can."""
    _with_versions(monkeypatch, transformer_engine="2.5.0")
    recipes = {r["recipe"]: r for r in _json(capsys, "--hardware", "b200")["recipes"]}
    assert recipes["nvfp4"]["runnable"] is False
    assert any(">= 2.7 (NVFP4BlockScaling), found 2.5.0" in p for p in recipes["nvfp4"]["problems"])
    assert not any("Transformer Engine >=" in p for p in recipes["mxfp8"]["problems"])


def test_a_vllm_config_is_checked_for_vllm_not_transformer_engine(capsys, monkeypatch):
    """A vLLM config runs no training: doctor names the variable vLLM reads at start-up
    (``engine_env``), not TE's ``NVTE_*`` ones, and does not fail for a missing TE."""
    from nemo_fp8_plugin.hosts.vllm import engine_env
    from nemo_fp8_plugin.registry import get_recipe

    cfg = str(REPO / "conf/examples/vllm_llama8b_fp8_blockwise.yaml")
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM_E8M0", raising=False)
    assert main(["doctor", cfg]) == 0  # no TE here, and none needed
    out = capsys.readouterr().out
    assert "env VLLM_USE_DEEP_GEMM_E8M0=0 needed where vLLM starts: unset in this shell" in out
    assert "NVTE_" not in out and "Transformer Engine at run time" not in out
    report = _json(capsys, cfg, rc=0)
    (verdict,) = report["recipes"]
    assert verdict["host"] == "vllm"
    assert {e["name"]: e["needed"] for e in verdict["env"]} == engine_env(
        get_recipe("fp8_blockwise")
    )
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", "0")
    assert _json(capsys, cfg, rc=0)["recipes"][0]["env"][0]["set"] is True


def test_a_vllm_config_the_method_refuses_cannot_run(capsys, tmp_path):
    """The recipe's own refusal for vLLM (``refuse_spec``) is doctor's verdict on a vLLM
    config: exit 1, the refusal as the problem."""
    from nemo_fp8_plugin.errors import FP8ConfigError
    from nemo_fp8_plugin.hosts.vllm import refuse_spec
    from nemo_fp8_plugin.registry import get_recipe

    refused = None
    for name in ("nvfp4", "fp8_delayed", "mxfp8", "fp8_current"):
        try:
            refuse_spec(get_recipe(name))
        except FP8ConfigError:
            refused = name
            break
    assert refused is not None, "no registered recipe is refused for vLLM generation"
    cfg = tmp_path / "v.yaml"
    cfg.write_text(f"model: meta-llama/Llama-3.1-8B\nmax_model_len: 4096\nprecision: {refused}\n")
    assert main(["doctor", str(cfg)]) == 1
    out = capsys.readouterr().out
    assert "CANNOT run here" in out and "problem:" in out


# --------------------------------------------------------------------------- the verdict


def test_the_first_line_is_the_verdict_and_what_was_not_checked_needs_v(capsys, monkeypatch):
    """This machine (no GPU, no Transformer Engine) cannot judge a recipe: one verdict line
    with the action, a screen of details, and the checks it could not make behind -v."""
    _with_versions(monkeypatch, nemo_toolkit=None)  # the main job's environment: no NeMo
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "verdict: cannot check here: no GPU is visible and Transformer Engine is not installed; "
        "run it on the machine that runs the job (in its container), or add --hardware GPU "
        "(h100, b200, ...) to judge the recipes for that GPU"
    )
    assert len(lines) <= 12, "\n".join(lines)
    assert not [ln for ln in lines if "not checked:" in ln]
    assert lines[-2].startswith("(-v lists the ") and lines[-1].startswith("works here: ")
    assert main(["doctor", "-v"]) == 0
    verbose = capsys.readouterr().out.splitlines()
    assert verbose[0] == lines[0] and len([ln for ln in verbose if "not checked:" in ln]) >= 10
    assert _json(capsys)["verdict"]["state"] == "cannot check here"


def test_a_stack_is_tested_only_for_the_hosts_installed(capsys, monkeypatch):
    """megatron-core 0.16.1 alone is the nemo-2.7 stack, but NeMo and Transformer Engine are
    not here: nothing of theirs is tested on this machine."""
    _with_versions(monkeypatch, nemo_toolkit=None, nemo_run=None)
    stack = _json(capsys)["stack"]
    assert stack["name"] == "nemo-2.7" and stack["installed"] == ["megatron-core"]
    assert stack["absent"] == ["nemo-toolkit", "transformer-engine"]
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert (
        "stack: nemo-2.7 (detected from the installed packages): tested here: megatron-core "
        "0.16.1; not installed here: nemo-toolkit, transformer-engine"
    ) in text
    assert "a tested stack" not in text


def _gpu(monkeypatch, name="NVIDIA H100 80GB HBM3", cap=(9, 0), cuda="12.9"):
    """The report sees this GPU (torch's own answers are all the probe reads)."""
    gpu = {
        "index": 0,
        "name": name,
        "capability": f"sm{cap[0]}{cap[1]}",
        "arch": doctor.arch_of(cap),
    }
    info = {"torch": "2.11.0", "cuda": cuda, "gpus": [gpu], "arch": gpu["arch"]}
    monkeypatch.setattr(doctor, "gpu_info", lambda: info)


def test_ready_on_a_machine_that_runs_the_recipe(capsys, tmp_path, monkeypatch):
    """An H100 with CUDA 12.9 and Transformer Engine 2.20.2 (its real recipe module, imported
    with the variable set, as TE reads it at import): the verdict is ready, exit 0."""
    _gpu(monkeypatch)
    _with_versions(monkeypatch, transformer_engine="2.20.2")
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    te_recipe = load_te_recipe_module(tmp_path, name="te_recipe_for_ready")
    monkeypatch.setattr(doctor, "_te_recipe_module", lambda: (te_recipe, None))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("precision: fp8_blockwise\n")
    assert main(["doctor", str(cfg)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "verdict: ready: fp8_blockwise can run on Hopper (SM90)"
    assert "recipe fp8_blockwise (block): can run here on hopper" in out
    assert "gpu: 1 x NVIDIA H100 80GB HBM3 (sm90, hopper)" in out[1]


def test_a_plugin_its_host_would_not_load_is_the_verdict(capsys, tmp_path, monkeypatch):
    """A NeMo 2 config where NeMo-Run is installed but cannot see the plugin's factories."""
    _gpu(monkeypatch)
    _with_versions(monkeypatch, transformer_engine="2.11.0")
    monkeypatch.setattr(doctor, "_te_recipe_module", lambda: (None, "stand-in: not loaded"))
    real = metadata.entry_points
    monkeypatch.setattr(
        doctor.metadata,
        "entry_points",
        lambda group: [] if group == "nemo_run.cli" else real(group=group),
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer: {devices: 8}\nprecision: fp8_current\n")
    assert main(["doctor", str(cfg)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(
        "verdict: cannot run here: nemo-run would not load the plugin's nemo_run.cli entry "
        "point: not visible: install the package"
    )

"""Retargeting a config between GPU generations.

`--hardware` / `hardware:` take GPU names, `nvidia-smi` names and `sm90`-style capabilities.
For each GPU generation: what runs, what cannot, the nearest recipe that can and the exact YAML
change. Exit codes: `explain` reports and exits 0 (2 with `--strict`), `apply` refuses with 2,
`doctor CONFIG` exits 1 ("cannot run here"). The suggested changes are applied and must run.
"""

from __future__ import annotations

import json

import pytest
import yaml

from nemo_fp8_plugin import FP8ConfigError, get_recipe
from nemo_fp8_plugin.capabilities import (
    ARCHS,
    CAPABILITIES,
    arch_by_name,
    host_sides,
)
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.config import find_fp8_request
from nemo_fp8_plugin.kinds import hardware_problems, side_summary
from nemo_fp8_plugin.registry import list_recipes

pytestmark = pytest.mark.torch_free

GPUS = {  # GPU -> (architecture, compute capability it stands for)
    "a100": ("ampere", (8, 0)),
    "l40s": ("ada", (8, 9)),
    "rtx-6000-ada": ("ada", (8, 9)),
    "h100": ("hopper", (9, 0)),
    "h200": ("hopper", (9, 0)),
    "b200": ("blackwell", (10, 0)),
    "gb200": ("blackwell", (10, 0)),
    "b300": ("blackwell", (10, 3)),
    "gb300": ("blackwell", (10, 3)),
    "rtx-pro-6000": ("blackwell_sm120", (12, 0)),
}

SPELLINGS = {
    "NVIDIA H100 80GB HBM3": "hopper",
    "NVIDIA H200": "hopper",
    "NVIDIA B200": "blackwell",
    "NVIDIA GB200": "blackwell",
    "NVIDIA B300 SXM6 AC": "blackwell",
    "NVIDIA GB300": "blackwell",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": "blackwell_sm120",
    "NVIDIA L40S": "ada",
    "NVIDIA RTX 6000 Ada Generation": "ada",
    "NVIDIA A100-SXM4-80GB": "ampere",
    "sm90": "hopper",
    "sm_90": "hopper",
    "SM100": "blackwell",
    "sm103": "blackwell",
    "sm120": "blackwell_sm120",
    "sm89": "ada",
    "sm80": "ampere",
    "Hopper": "hopper",
}

# Per GPU: a recipe a config written elsewhere uses that cannot run there, the recipe the
# message must point to (None: the fix is in place, or nothing runs), and one that runs.
MOVES = {
    "a100": ("fp8_current", None, None),
    "l40s": ("fp8_blockwise", "fp8_current", "fp8_delayed"),
    "rtx-6000-ada": ("mxfp8", "fp8_current", "fp8_current"),
    "h100": ("mxfp8", "fp8_blockwise", "fp8_blockwise"),
    "h200": ("nvfp4", "fp8_subchannel", "fp8_subchannel"),
    # both sides judged (no host): the in-place fix, power-of-2 scales (the RL choice; a
    # training host is pointed at fp8_subchannel first, tested below)
    "b200": ("fp8_blockwise", None, "nvfp4"),
    "gb200": ("fp8_blockwise", None, "mxfp8"),
    "b300": ("fp8_blockwise", None, "nvfp4"),
    "gb300": ("fp8_blockwise", None, "mxfp8"),
    "rtx-pro-6000": ("mxfp8", "fp8_current", "fp8_current"),
}


@pytest.mark.parametrize("gpu", GPUS)
def test_gpu_names_map_to_generations(gpu):
    arch, sm = GPUS[gpu]
    found = arch_by_name(gpu)
    assert found is not None and found.name == arch and sm in found.sm


@pytest.mark.parametrize("text, arch", SPELLINGS.items())
def test_nvidia_smi_names_and_sm_spellings(text, arch):
    assert arch_by_name(text).name == arch


def _write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("gpu", GPUS)
def test_each_gpu_on_all_three_commands(gpu, tmp_path, capsys):
    bad, instead, good = MOVES[gpu]
    cfg = _write(tmp_path, f"precision: {bad}\n")
    # explain: reports, exit 0; the message names the GPU, the nearest recipe and the change
    assert main(["explain", cfg, "--hardware", gpu]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith(f"warning: --hardware {gpu}:"))
    if instead:  # the config names its recipe by `precision:`: the move is told in that key
        assert f"precision: {instead}" in line
    elif GPUS[gpu][0] == "ampere":
        assert "no FP8 tensor cores" in line
    elif GPUS[gpu][0] == "blackwell":
        assert "pow2_scales: true" in line and "fp8_subchannel" not in line
    assert main(["explain", cfg, "--hardware", gpu, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    problems = [p for p in report["hardware"]["problems"] if p["level"] == "error"]
    assert problems and report["hardware"]["target"] == GPUS[gpu][0]
    assert set(report["hardware"]["runs"]) == {"training", "generation"}
    # explain --strict, apply: exit 2, one line naming the key
    for argv in (
        ["explain", cfg, "--hardware", gpu, "--strict"],
        ["apply", cfg, "--host", "megatron", "--hardware", gpu],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        # the key: the flag, or the field the fix changes (fp32 block scales on Blackwell)
        assert len(err.splitlines()) == 1 and ("--hardware" in err or "pow2_scales:" in err), err
    # doctor CONFIG: exit 1, "cannot run here"
    assert main(["doctor", cfg, "--hardware", gpu]) == 1
    assert "CANNOT run here" in capsys.readouterr().out
    if good is None:
        return
    ok = _write(tmp_path, f"precision: {good}\n", "ok.yaml")
    assert main(["apply", ok, "--host", "te", "--hardware", gpu]) == 0
    assert main(["doctor", ok, "--hardware", gpu]) == 0
    capsys.readouterr()


def test_the_fp8_block_hardware_key_is_judged_the_same_way(tmp_path, capsys):
    cfg = _write(tmp_path, "fp8: {recipe: mxfp8, hardware: h100}\n")
    assert main(["explain", cfg]) == 0
    assert "warning: fp8.hardware Hopper (SM90): mxfp8 cannot run" in capsys.readouterr().out
    assert main(["apply", cfg, "--host", "te"]) == 2
    assert capsys.readouterr().err.startswith("nemo-fp8 apply: error: fp8.hardware:")
    assert main(["doctor", cfg]) == 1


def test_an_h100_config_moved_to_b200_gets_one_clear_message():
    spec = get_recipe("fp8_blockwise")  # NVIDIA's Hopper RL recipe (fp32 block scales)
    problems = hardware_problems(spec, "blackwell")
    assert len(problems) == 1
    (p,) = problems
    assert p.level == "error" and p.key == "pow2_scales" and p.side == "training"
    assert p.change == "fp8: {recipe: fp8_blockwise, pow2_scales: true}"
    # both sides (RL): power-of-2 scales only; fp8_subchannel is not the RL choice
    assert "fp8_subchannel" not in p.message and "MXFP8" in p.message
    with pytest.raises(FP8ConfigError) as err:
        find_fp8_request({"precision": "fp8_blockwise"}, hardware="b200")
    assert err.value.key == "fp8.pow2_scales" and p.change in str(err.value)  # the key to change


@pytest.mark.parametrize("host", ["megatron", "nemo2", "bridge", "te"])
def test_a_training_host_on_b200_is_pointed_at_fp8_subchannel_first(host):
    """A host that only trains gets the pretraining recipe docs/recipes.md names for
    Blackwell first, then the power-of-2 fix; NeMo RL (both sides) gets the fix alone."""
    spec = get_recipe("fp8_blockwise")
    (p,) = hardware_problems(spec, "blackwell", host_sides(host))
    assert (p.level, p.side, p.recipe) == ("error", "training", "fp8_subchannel")
    subchannel = p.message.index("fp8: {recipe: fp8_subchannel}")
    assert subchannel < p.message.index("fp8: {recipe: fp8_blockwise, pow2_scales: true}")
    (rl,) = hardware_problems(spec, "blackwell", host_sides("nemo-rl"))
    assert rl.recipe == "fp8_blockwise" and "fp8_subchannel" not in rl.message


def _apply_change(config: dict, change: str) -> dict:
    """The YAML change a problem names, applied to a config that says `precision: X`."""
    block = yaml.safe_load(change)["fp8"]
    out = {k: v for k, v in config.items() if k != "precision"}
    out["fp8"] = block
    return out


@pytest.mark.parametrize("arch", [a.name for a in ARCHS if a.fp8])
@pytest.mark.parametrize(
    "request_",
    [{"precision": s.name} for s in list_recipes()]
    + [
        {"fp8": {"recipe": "mxfp8", "training": "bf16"}},
        {"fp8": {"recipe": "fp8_blockwise", "training": "bf16"}},
    ],
    ids=lambda r: json.dumps(r, separators=(",", ":")),
)
def test_every_suggested_change_runs_there(arch, request_):
    """Whatever cannot run on a GPU names a change; with the change applied the config is
    accepted for that GPU (no error left)."""
    spec = find_fp8_request(request_).spec
    for p in hardware_problems(spec, arch):
        if p.level != "error" or p.change is None:
            continue
        config = dict(request_)
        if "fp8" in config:  # keep what the user's block said, then apply the change
            config = {"fp8": {**config["fp8"], **yaml.safe_load(p.change)["fp8"]}}
        else:
            config = _apply_change(config, p.change)
        fixed = find_fp8_request(config, hardware=arch)  # raises if something still fails
        assert fixed.spec.hardware == arch
        if p.recipe:
            assert fixed.spec.name == p.recipe


def test_the_nearest_table_names_recipes_that_train_there():
    nearest = [(k, a, u, n) for k, row in CAPABILITIES.items() for (a, u), n in row.nearest.items()]
    assert len(nearest) >= 12  # every kind that cannot train somewhere names where to go
    for kind, arch, use, name in nearest:
        spec = get_recipe(name)
        if use == "train":
            spec = spec.replace(generation="bf16") if spec.scaling != "nvfp4" else spec
        assert arch in CAPABILITIES[spec.scaling].training_archs, (kind, arch, name)
        assert not [
            p
            for p in hardware_problems(spec, arch)
            if p.level == "error" and p.side != "generation"
        ], (kind, arch, name)


@pytest.mark.parametrize(
    "arch, runs",
    [
        (
            "hopper",
            {
                "training": "Float8BlockScaling on Hopper (SM90)",
                "generation": "vLLM block FP8 (128x128 weights) on Hopper (SM90)",
            },
        ),
        (
            "blackwell",
            {
                "training": "cannot run on Blackwell (SM100/SM103)",
                "generation": "vLLM block FP8 (128x128 weights) on Blackwell (SM100/SM103)",
            },
        ),
    ],
)
def test_what_each_side_runs(arch, runs):
    assert side_summary(get_recipe("fp8_blockwise"), arch) == runs


@pytest.mark.parametrize(
    "argv",
    [
        ["explain", "{cfg}", "--hardware", "tpu-v5"],
        ["apply", "{cfg}", "--host", "te", "--hardware", "tpu-v5"],
        ["doctor", "{cfg}", "--hardware", "tpu-v5"],
    ],
)
def test_an_unknown_hardware_is_one_line_naming_the_flag(argv, tmp_path, capsys):
    cfg = _write(tmp_path, "precision: fp8_current\n")
    assert main([a.format(cfg=cfg) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--hardware" in err and "tpu-v5" in err


def test_nvfp4_on_hopper_per_command(tmp_path, capsys):
    cfg = _write(tmp_path, "precision: nvfp4\n")
    assert main(["explain", cfg, "--hardware", "h200"]) == 0
    assert "nvfp4 cannot train on Hopper (SM90)" in capsys.readouterr().out
    assert main(["explain", cfg, "--hardware", "h200", "--strict"]) == 2
    assert main(["apply", cfg, "--host", "megatron", "--hardware", "h200"]) == 2
    # megatron only trains: the move is the training recipe, told in the config's own key
    assert capsys.readouterr().err.endswith(
        "trains there is fp8_subchannel: `precision: fp8_subchannel`\n"
    )
    assert main(["doctor", cfg, "--hardware", "h200"]) == 1

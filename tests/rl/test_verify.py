"""``verify_refit`` and ``nemo-fp8 verify-refit`` on files: a checkpoint ``nemo-fp8 export``
wrote (the trainer-side refit's bytes) and engines built with NeMo RL's own worker quantizer,
against the trainer's weights; seeded defects of one tile, recipe mismatches, missing
weights and unreadable input. The vLLM engine itself: tests/hosts/vllm/test_verify_refit.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import LLAMA_LINEARS
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.rl import export_fp8_checkpoint
from nemo_fp8_plugin.rl.verify import verify_refit

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
SPEC = {"recipe": "fp8_blockwise", "bf16_layers": {"first": 1}}


def trainer_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "self_attn.q_proj": (256, 256),
        "self_attn.k_proj": (128, 256),
        "self_attn.v_proj": (128, 256),
        "self_attn.o_proj": (256, 256),
        "mlp.gate_proj": (512, 256),
        "mlp.up_proj": (512, 256),
        "mlp.down_proj": (256, 512),
    }
    assert set(shapes) == set(LLAMA_LINEARS)
    sd = {"model.embed_tokens.weight": torch.randn(512, 256, generator=g)}
    for i in range(2):
        for mod, shape in shapes.items():
            sd[f"model.layers.{i}.{mod}.weight"] = torch.randn(shape, generator=g) * 0.05
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(256)
    sd["model.norm.weight"] = torch.ones(256)
    sd["lm_head.weight"] = torch.randn(512, 256, generator=g) * 0.05
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trainer")
    save_file(trainer_state_dict(), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(CONFIG))
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory, trainer) -> Path:
    out = tmp_path_factory.mktemp("export") / "fp8"
    export_fp8_checkpoint(trainer, out, SPEC)
    return out


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["verify-refit", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def with_defect(src: Path, dst: Path) -> Path:
    """A copy of ``src`` whose ``model.layers.1.mlp.down_proj.weight`` has one tile's codes
    changed: tile (1, 2), five codes two steps up."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    bits = tensors["model.layers.1.mlp.down_proj.weight"].view(torch.uint8).clone()
    bits[130:135, 300] += 2
    tensors["model.layers.1.mlp.down_proj.weight"] = bits.view(torch.float8_e4m3fn)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_an_exported_checkpoint_is_bit_equal_to_the_trainer(capsys, exported, trainer):
    report = verify_refit(exported, trainer, SPEC)
    assert report.ok
    # the 7 linear weights of each layer, the output head (BF16), embeddings and norms
    counts = report.counts
    assert counts["bit_equal"] == len(report.checks) and counts["bit_equal"] >= 15
    kinds = {c.name: c.kind for c in report.checks}
    assert kinds["model.layers.1.mlp.down_proj.weight"] == "fp8"
    assert kinds["model.layers.0.mlp.down_proj.weight"] == "high_precision"  # BF16 rule
    code, out, _ = run(capsys, exported, trainer, "--recipe", "fp8_blockwise")
    assert code == 1  # the CLI with the plain preset: layer 0 should have been FP8
    code, out, _ = run(capsys, exported, trainer / "model.safetensors", "--num-layers", "2")
    assert code == 1


def test_the_cli_passes_a_clean_refit(capsys, exported, trainer):
    code, out, err = run(capsys, exported, trainer, "--recipe", json.dumps(SPEC))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("19 weights: 19 bit-equal, 0 within ulp, 0 different, 0 missing")
    assert lines[-1] == "ok"
    code, out, _ = run(capsys, exported, trainer, "--recipe", json.dumps(SPEC), "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] and data["counts"]["bit_equal"] == 19


def test_a_seeded_one_tile_defect_fails_naming_the_weight_and_tile(
    capsys, exported, trainer, tmp_path
):
    bad = with_defect(exported, tmp_path / "bad")
    report = verify_refit(bad, trainer, SPEC)
    assert not report.ok
    (failed,) = report.failed()
    assert failed.name == "model.layers.1.mlp.down_proj.weight"
    assert failed.status == "different" and failed.tiles_different == 1
    assert failed.worst.tile == (1, 2) and failed.worst.codes_differing == 5
    assert report.counts["bit_equal"] == len(report.checks) - 1


def test_cli_exit_1_on_the_defect_and_json(capsys, exported, trainer, tmp_path):
    bad = with_defect(exported, tmp_path / "bad")
    code, out, err = run(capsys, bad, trainer, "--recipe", json.dumps(SPEC), "--json")
    assert code == 1 and err == ""
    data = json.loads(out)
    assert data["ok"] is False and data["counts"]["different"] == 1
    (row,) = [w for w in data["weights"] if w["status"] == "different"]
    assert row["worst"]["tile"] == [1, 2]


def test_nemo_rls_worker_quantizer_is_within_ulp_and_exact_refuses_it(capsys, trainer, tmp_path):
    # An engine fed by NeMo RL holds its worker quantizer's bytes (NeMo RL's own function,
    # from the shared source): within ulp of TE's, bit-equal under numerics nemo_rl.
    from test_nemo_rl_numerics import nemo_rl_cast

    cast = nemo_rl_cast()
    engine = {}
    for name, w in trainer_state_dict().items():
        if ".layers.1." in name and name.endswith("proj.weight"):
            engine[name], engine[name + "_scale_inv"] = cast(w)
        else:
            engine[name] = w
    te = verify_refit(engine, trainer, SPEC)
    assert te.ok and te.counts["within_ulp"] >= 1 and te.counts["different"] == 0
    assert not verify_refit(engine, trainer, SPEC, exact=True).ok
    nemo_rl = verify_refit(engine, trainer, SPEC, numerics="nemo_rl")
    assert nemo_rl.counts["bit_equal"] == len(nemo_rl.checks)
    save_file(engine, str(tmp_path / "engine.safetensors"))
    code, out, _ = run(
        capsys, tmp_path / "engine.safetensors", trainer, "--recipe", "fp8_blockwise"
    )
    assert code == 1  # layer 0 held in BF16 where the plain preset quantizes it


def test_missing_weights_on_either_side(exported, trainer):
    engine = load_file(str(exported / "model.safetensors"))
    del engine["model.layers.1.self_attn.o_proj.weight"]
    engine["model.layers.1.mlp.extra_proj.weight"] = engine["model.layers.1.mlp.up_proj.weight"]
    engine["model.layers.1.mlp.extra_proj.weight_scale_inv"] = engine[
        "model.layers.1.mlp.up_proj.weight_scale_inv"
    ]
    report = verify_refit(engine, trainer, SPEC)
    missing = {c.name: c.detail for c in report.checks if c.status == "missing"}
    assert missing == {
        "model.layers.1.self_attn.o_proj.weight": "the engine holds no weight of this name",
        "model.layers.1.mlp.extra_proj.weight": "the trainer has no weight of this name",
    }
    assert not report.ok


def test_fp8_where_the_rules_keep_bf16_is_different(exported, trainer):
    engine = load_file(str(exported / "model.safetensors"))
    report = verify_refit(engine, trainer, {"recipe": "fp8_blockwise", "bf16_layers": {"last": 1}})
    bad = {c.name: c.detail for c in report.failed()}
    assert bad["model.layers.1.mlp.up_proj.weight"].startswith("the engine holds FP8")
    assert bad["model.layers.0.mlp.up_proj.weight"].startswith("the engine holds bfloat16")


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["/nonexistent/engine", "TRAINER"], "ENGINE"),
        (["ENGINE", "/nonexistent/trainer"], "TRAINER"),
        (["ENGINE", "TRAINER", "--recipe", "fp8_blokwise"], "--recipe"),
        (["ENGINE", "TRAINER", "--recipe", "fp8_delayed"], "--recipe"),
        (["ENGINE", "TRAINER", "--recipe", "mxfp8", "--numerics", "nemo_rl"], "--numerics"),
        (["ENGINE", "TRAINER", "--num-layers", "0"], "--num-layers"),
        (["ENGINE", "ENGINE"], "TRAINER"),  # FP8 trainer weights
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, exported, trainer, argv, needle):
    argv = [{"ENGINE": exported, "TRAINER": trainer}.get(a, a) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith("nemo-fp8 verify-refit: error: "), err
    assert needle in err, err


def test_arguments_are_checked(exported, trainer):
    for kwargs, key in (
        ({"numerics": "TE"}, "numerics"),
        ({"exact": "yes"}, "exact"),
        ({"num_layers": 2.0}, "num_layers"),
    ):
        with pytest.raises(FP8ConfigError) as err:
            verify_refit(exported, trainer, SPEC, **kwargs)
        assert err.value.key == key
    with pytest.raises(FP8ConfigError) as err:
        verify_refit({"w": "not a tensor"}, trainer, SPEC)
    assert err.value.key == "engine"


@pytest.mark.parametrize("transposed", [False, True], ids=["E-2I-H", "E-H-2I"])
def test_a_trainers_expert_stack_is_cut_per_expert(transposed):
    """A trainer's whole stack (``experts.gate_up_proj`` ``[E, 2I, H]`` gate then up, or
    ``[E, H, 2I]`` as transposed fused checkpoints hold it; ``experts.down_proj``) against an
    engine record per expert: each expert's w1 / w3 / w2 is checked, none reported missing;
    a defect in expert 1's w3 is named."""
    from nemo_fp8_plugin.rl import quantize_for_refit

    g = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(3, 256, 128, generator=g) * 0.05).bfloat16()  # I = 128, H = 128
    down = (torch.randn(3, 128, 128, generator=g) * 0.05).bfloat16()
    stem = "model.layers.0.mlp.experts"
    per_expert = {}
    for e in range(3):
        per_expert[f"{stem}.{e}.w1.weight"] = gate_up[e, :128]
        per_expert[f"{stem}.{e}.w3.weight"] = gate_up[e, 128:]
        per_expert[f"{stem}.{e}.w2.weight"] = down[e]
    engine = dict(quantize_for_refit(per_expert.items(), "fp8_blockwise"))
    stack = gate_up.transpose(1, 2).contiguous() if transposed else gate_up
    trainer = {f"{stem}.gate_up_proj": stack, f"{stem}.down_proj": down}
    report = verify_refit(engine, trainer, "fp8_blockwise")
    assert report.ok and report.counts["bit_equal"] == 9, report.counts

    engine[f"{stem}.1.w3.weight"] = engine[f"{stem}.1.w3.weight"].clone()
    engine[f"{stem}.1.w3.weight"].view(torch.uint8)[:2, :2] ^= 0x08
    (bad,) = verify_refit(engine, trainer, "fp8_blockwise").failed()
    assert bad.name == f"{stem}.1.w3.weight" and bad.status == "different"

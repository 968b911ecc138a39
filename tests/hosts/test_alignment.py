"""Alignment checks before the run.

What each recipe's GEMMs need is read from Transformer Engine 2.20.2's own source in its wheel
(``assert_dim_for_fp8_exec``, ``get_align_size_for_quantization``, the block sizes of the
MXFP8 / NVFP4 / block quantizers' ``is_quantizable``); combined with TP, sequence and context
parallelism and packing, ``apply --host nemo-rl`` sets ``policy.make_sequence_length_divisible_by``
on NVIDIA's real NeMo RL configs, or refuses a value that cannot work; ``explain`` and
``doctor CONFIG`` report model sizes that break a recipe before any GPU is touched.
"""

from __future__ import annotations

import ast
import json

import pytest
import yaml

from conftest import nemo_rl_configs, upstream_file
from nemo_fp8_plugin import FP8ConfigError
from nemo_fp8_plugin.capabilities import CAPABILITIES, SCALING_KINDS, token_alignment
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.alignment import parallel_sizes
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL
from nemo_fp8_plugin.hosts.nemo_rl.values import resolved_value

pytestmark = pytest.mark.torch_free

MAIN = "nemo-rl-main-2026-08-22"  # the NeMo RL of tests/fixtures/nemo_rl: the one with every key

TE_WHEEL = "transformer_engine-2.20.2-*.whl"
CONFIGS = nemo_rl_configs()
MOONLIGHT = "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml"  # packing off
LLAMA_8B = "grpo_math_8B_megatron.yaml"  # packing on
KEY = "policy.make_sequence_length_divisible_by"

_TE_PREDICATE = {"mx": "mxfp8", "nvfp4": "nvfp4"}
"""The ``Recipe`` predicate of each scaling kind TE's alignment function tests (the others
fall through to its default)."""


@pytest.fixture(scope="module")
def te_src(tmp_path_factory):
    dest = tmp_path_factory.mktemp("te_align")

    def tree(member: str) -> ast.Module:
        return ast.parse(
            upstream_file(TE_WHEEL, f"transformer_engine/pytorch/{member}", dest).read_text()
        )

    return tree


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_token_alignment_is_tes_own(te_src):
    fn = _function(te_src("quantization.py"), "get_align_size_for_quantization")
    by_predicate, default = {}, None
    for node in fn.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Call):
            ret = node.body[0]
            if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Constant):
                by_predicate[node.test.func.attr] = ret.value.value
        elif isinstance(node, ast.Return) and isinstance(node.value, ast.Constant):
            default = node.value.value
    assert by_predicate == {"mxfp8": 32, "nvfp4": 128} and default == 16
    for kind in SCALING_KINDS:
        assert CAPABILITIES[kind].token_align == by_predicate.get(_TE_PREDICATE.get(kind), default)


def test_dimension_alignment_covers_tes_asserts(te_src):
    fn = _function(te_src("utils.py"), "assert_dim_for_fp8_exec")
    moduli = sorted(
        {
            n.right.value
            for n in ast.walk(fn)
            if isinstance(n, ast.BinOp)
            and isinstance(n.op, ast.Mod)
            and isinstance(n.right, ast.Constant)
        }
    )
    assert moduli == [8, 16]  # leading dims % 8, last dim % 16: every FP8 recipe
    constants = {
        t.id: n.value.value
        for n in te_src("constants.py").body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    for kind in SCALING_KINDS:
        assert CAPABILITIES[kind].dim_align % 16 == 0 and CAPABILITIES[kind].token_align % 8 == 0
    assert CAPABILITIES["mx"].dim_align == constants["MXFP8_BLOCK_SCALING_SIZE"] == 32
    assert CAPABILITIES["nvfp4"].dim_align % constants["NVFP4_BLOCK_SCALING_SIZE"] == 0
    # Float8BlockQuantizer.is_quantizable: last dim % self.block_len (set to 128 in __init__)
    init = _function(te_src("tensor/float8_blockwise_tensor.py"), "__init__")
    block_len = next(
        n.value.value
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        and isinstance(n.targets[0], ast.Attribute)
        and n.targets[0].attr == "block_len"
    )
    assert CAPABILITIES["block"].tile_align == block_len == 128


@pytest.mark.parametrize(
    "kind, tp, sp, cp, need",
    [
        ("block", 1, False, 1, 16),
        ("tensorwise", 4, True, 1, 64),
        ("mx", 2, True, 1, 64),
        ("mx", 1, False, 2, 128),
        ("nvfp4", 1, False, 1, 128),
        ("nvfp4", 8, False, 1, 128),
    ],
)
def test_token_alignment_with_parallelism(kind, tp, sp, cp, need):
    assert (
        token_alignment(kind, tensor_parallel=tp, sequence_parallel=sp, context_parallel=cp) == need
    )


# --------------------------------------------------------------------------- NeMo RL, real configs


def _input(tmp_path, base, fp8, policy=None, megatron=None):
    src = CONFIGS / base
    data = yaml.safe_load(src.read_text())
    data["defaults"] = str((src.parent / data["defaults"]).resolve())
    data["fp8"] = fp8
    data["policy"].update(policy or {})
    if megatron:
        data["policy"].setdefault("megatron_cfg", {}).update(megatron)
    path = tmp_path / "in.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(
    "fp8, megatron, need",
    [
        ({"recipe": "fp8_blockwise"}, {}, 16),
        (
            {"recipe": "fp8_blockwise"},
            {"tensor_model_parallel_size": 2, "sequence_parallel": True},
            32,
        ),
        ({"recipe": "mxfp8"}, {}, 32),
        ({"recipe": "mxfp8"}, {"context_parallel_size": 2}, 128),
        ({"recipe": "nvfp4"}, {}, 128),
    ],
)
def test_unpacked_moonlight_gets_the_sequence_alignment(tmp_path, fp8, megatron, need):
    """NVIDIA's Moonlight config runs without packing and pads to TP (1): too small for FP8."""
    src = _input(tmp_path, MOONLIGHT, fp8, megatron=megatron)
    result = apply_path(NEMO_RL, src, stack=MAIN)  # mxfp8 and nvfp4: main's keys
    assert result.data["policy"]["make_sequence_length_divisible_by"] == need
    note = next(n for n in result.notes if KEY in n)
    assert f"set to {need}" in note and "tensor_model_parallel_size" in note  # what it was


@pytest.mark.parametrize(
    "value, outcome",
    [
        (64, 64),
        (8, 16),
        (1, 16),
        (
            "${mul:16, ${policy.megatron_cfg.tensor_model_parallel_size}}",
            "${mul:16, ${policy.megatron_cfg.tensor_model_parallel_size}}",
        ),
        (24, "refused"),
        (0, "refused"),
        ("sixteen", "refused"),
    ],
)
def test_a_stated_value_is_kept_raised_or_refused(tmp_path, value, outcome):
    path = _input(
        tmp_path,
        MOONLIGHT,
        {"recipe": "fp8_blockwise"},
        policy={"make_sequence_length_divisible_by": value},
    )
    if outcome == "refused":
        with pytest.raises(FP8ConfigError) as err:
            apply_path(NEMO_RL, path)
        assert err.value.key == KEY and "multiple of 16" in str(err.value)
        assert main(["apply", str(path), "--host", "nemo-rl"]) == 2
        return
    out = apply_path(NEMO_RL, path).data
    assert out["policy"]["make_sequence_length_divisible_by"] == outcome


def test_packed_configs_are_left_to_nemo_rls_packer(tmp_path):
    result = apply_path(NEMO_RL, _input(tmp_path, LLAMA_8B, {"recipe": "fp8_blockwise"}))
    assert "make_sequence_length_divisible_by" not in result.data["policy"]
    assert any("pads packed sequences to a multiple of 128" in n for n in result.notes)


def test_dynamic_batching_rounding_is_aligned_too(tmp_path):
    result = apply_path(
        NEMO_RL,
        _input(
            tmp_path,
            MOONLIGHT,
            {"recipe": "nvfp4"},
            policy={"dynamic_batching": {"enabled": True, "sequence_length_round": 64}},
        ),
        stack=MAIN,
    )
    assert result.data["policy"]["dynamic_batching"]["sequence_length_round"] == 128


def test_bf16_training_needs_no_alignment(tmp_path):
    result = apply_path(
        NEMO_RL, _input(tmp_path, MOONLIGHT, {"recipe": "mxfp8", "training": "bf16"}), stack=MAIN
    )
    assert (
        result.data["policy"]["make_sequence_length_divisible_by"]
        == "${policy.megatron_cfg.tensor_model_parallel_size}"
    )


@pytest.mark.parametrize(
    "megatron, key",
    [
        ({"tensor_model_parallel_size": 3}, "policy.megatron_cfg.tensor_model_parallel_size"),
        # Moonlight's expert FFN 1408 / 8 = 176: not a multiple of MXFP8's 32
        ({"expert_tensor_parallel_size": 8}, "policy.megatron_cfg.expert_tensor_parallel_size"),
    ],
)
def test_a_tp_size_that_makes_alignment_impossible_is_refused(tmp_path, megatron, key, capsys):
    path = _input(tmp_path, MOONLIGHT, {"recipe": "mxfp8"}, megatron=megatron)
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, path)
    assert err.value.key == key and "Moonlight" in str(err.value)
    assert main(["apply", str(path), "--host", "nemo-rl"]) == 2
    err_line = capsys.readouterr().err.strip()
    assert len(err_line.splitlines()) == 1 and key in err_line


def test_parallel_sizes_resolve_interpolations():
    config = {
        "policy": {
            "megatron_cfg": {"tensor_model_parallel_size": "${mul:2, 2}", "sequence_parallel": True}
        }
    }
    sizes = parallel_sizes(config, resolved_value)
    assert (sizes.tensor_parallel, sizes.sequence_parallel, sizes.expert_tensor_parallel) == (
        4,
        True,
        4,
    )


# --------------------------------------------------------------------------- explain, doctor


def _hf_config(tmp_path, hidden, ffn):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "num_hidden_layers": 4,
                "hidden_size": hidden,
                "intermediate_size": ffn,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "vocab_size": 1024,
            }
        )
    )
    return path


def test_explain_and_doctor_report_model_sizes_before_the_run(tmp_path, capsys):
    model = _hf_config(tmp_path, 1008, 3072)  # 16-aligned, not 32
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"fp8: {{recipe: nvfp4, model: {model}}}\n")
    assert main(["explain", str(cfg)]) == 2
    # The key that names the model (the sizes are the file's, not the config's).
    assert "fp8.model: hidden_size 1008" in capsys.readouterr().err
    assert main(["doctor", str(cfg), "--json"]) == 1
    verdict = json.loads(capsys.readouterr().out)["recipes"][0]
    assert verdict["runnable"] is False
    assert any("model.hidden_size" in p for p in verdict["problems"])


def test_a_megatron_tp_split_is_judged_by_explain_and_doctor(tmp_path, capsys):
    cfg = tmp_path / "m.yaml"
    cfg.write_text(
        "precision: mxfp8\nmodel: {num_layers: 4, hidden_size: 4096, "
        "ffn_hidden_size: 11008, num_attention_heads: 32, "
        "tensor_model_parallel_size: 16}\n"
    )  # 11008 / 16 = 688, not a multiple of 32
    assert main(["explain", str(cfg)]) == 2
    assert "model.tensor_model_parallel_size" in capsys.readouterr().err
    assert main(["doctor", str(cfg)]) == 1
    assert "model.tensor_model_parallel_size" in capsys.readouterr().out
    cfg.write_text(cfg.read_text().replace("16}", "8}"))  # 1376 = 43 x 32
    assert main(["explain", str(cfg)]) == 0

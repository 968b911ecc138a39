"""explain on a config already FP8 in a host's own keys: each adapter's ``read_native`` maps
them back to our recipe. The property: for every registered recipe and host,
reading apply's own output gives back the recipe apply wrote, as far as the host's keys say
it (the same keys spelt again, the same name or one the keys cannot tell apart)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
import yaml

from conftest import NEMO_RL_TRIMMED, REPO, shared_nemo_rl
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import (
    NO_REQUEST,
    get_adapter,
    load_context,
    read_native,
    recipe_keys,
    run,
)
from nemo_fp8_plugin.registry import get_recipe, list_recipes

pytestmark = pytest.mark.torch_free

NEMO_RL_BASE = NEMO_RL_TRIMMED

_CONFIGS = {
    "megatron": {"model": {"num_layers": 4, "hidden_size": 256}},
    "bridge": {"model": {"num_layers": 4}},
    "nemo2": {"trainer": {"devices": 1}},
    "vllm": {"model": "some/model", "max_model_len": 128},
}

_VARIANTS = [
    {},
    {"bf16_layers": {"first": 1, "last": 1}},
    {"kv_cache": "fp8"},
    {"training": "bf16"},
]


def _config(host: str, request: dict) -> dict:
    if host == "nemo-rl":
        cfg = yaml.safe_load(NEMO_RL_BASE.read_text())
        cfg.pop("precision", None)
    else:
        cfg = json.loads(json.dumps(_CONFIGS[host]))
    cfg["fp8"] = request
    return cfg


def _applied(tmp_path, host: str, request: dict):
    """(the spec apply wrote, a context of apply's output), or None when apply refuses or
    writes no FP8 key (a BF16 side: nothing to read back)."""
    src = tmp_path / f"{host}.yaml"
    src.write_text(yaml.safe_dump(_config(host, request)))
    # NeMo RL: main, whose keys express every recipe (the releases' gaps are refused)
    stack = "nemo-rl-main-2026-08-22" if host == "nemo-rl" else None
    try:
        ctx = load_context(src, stack=stack)
        result = run(get_adapter(host), ctx)
    except FP8ConfigError:  # refused: the recipe or host cannot run it (the parity tests')
        return None
    if not result.written:
        return None
    out = tmp_path / f"{host}_out.yaml"
    out.write_text(yaml.safe_dump(result.data))
    return ctx.spec, load_context(out, stack=stack)


@pytest.mark.parametrize("host", ["megatron", "bridge", "nemo2", "vllm", "nemo-rl"])
def test_reading_applys_output_gives_back_the_recipe_it_wrote(tmp_path, host):
    checked = 0
    for recipe in list_recipes():
        for variant in _VARIANTS:
            got = _applied(tmp_path, host, {"recipe": recipe.name, **variant})
            if got is None:
                continue
            wrote, out = got
            reading = read_native(out, host)
            spelt = recipe_keys(host, wrote).keys
            if not spelt:
                assert reading is None, (host, recipe.name, variant)
                continue
            assert out.request is None and reading is not None, (host, recipe.name, variant)
            assert reading.spec is not None, (host, recipe.name, variant, reading.unmatched)
            names = [reading.spec.name] + [a.split(" ")[0] for a in reading.alike]
            assert wrote.name in names, (host, recipe.name, variant, names)
            assert recipe_keys(host, reading.spec).keys == spelt, (host, recipe.name, variant)
            checked += 1
    assert checked >= 6, host  # every host reads back most recipes


def test_a_bf16_config_reads_as_no_recipe(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {num_layers: 4, hidden_size: 256}\n")
    assert read_native(load_context(cfg), "megatron") is None
    out = _explain(cfg)
    assert NO_REQUEST in out


def _explain(path, *args) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "nemo_fp8_plugin", "explain", str(path), *args],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_nvidias_own_fp8_configs_read_as_fp8_blockwise():
    """NVIDIA's native FP8 NeMo RL configs (no precision:/fp8: request) were "no FP8 recipe
    requested ... runs in its own precision"."""
    configs = shared_nemo_rl("examples/configs")
    out = _explain(configs / "grpo_math_8B_megatron_fp8.yaml")
    assert "read from native keys: fp8_blockwise" in out and "no FP8 recipe requested" not in out
    assert "policy.megatron_cfg.fp8_cfg.fp8_recipe: blockwise" in out
    moon = load_context(configs / "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml")
    reading = read_native(moon, "nemo-rl")
    assert reading.spec.name == "fp8_blockwise"
    assert set(reading.spec.bf16_layers.modules) == {"*a_proj*", "*b_proj*"}
    assert "bf16_layers" in dict(reading.differs)


def test_an_fp8_kv_cache_in_native_keys_is_read(tmp_path):
    """As NVIDIA's grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.yaml (not in the source
    snapshot): FP8 weights and vllm_cfg.kv_cache_dtype: fp8 on top of the FP8 recipe, without
    pipeline parallelism (NeMo RL refuses an FP8 KV cache with it)."""
    parent = shared_nemo_rl("examples/configs/grpo_math_8B_megatron_fp8.yaml")
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(
        f"defaults: {parent}\npolicy:\n  generation:\n    vllm_cfg:\n      kv_cache_dtype: fp8\n"
        "  megatron_cfg:\n    pipeline_model_parallel_size: 1\n"
    )
    out = _explain(cfg)
    assert "read from native keys: fp8_blockwise" in out
    assert "differs from the fp8_blockwise preset: kv_cache: fp8" in out


@pytest.mark.parametrize(
    ("host", "text", "said"),
    [
        (
            "megatron",
            "model: {num_layers: 4, hidden_size: 256, fp8: e4m3, fp8_recipe: custom}\n",
            "model.fp8_recipe: 'custom'",
        ),
        (
            "vllm",
            "model: some/model\nmax_model_len: 64\nquantization: fp8\n",
            "quantization: 'fp8'",
        ),
        (
            "vllm",
            "model: some/model\nmax_model_len: 64\nkv_cache_dtype: fp8\n",
            "on unquantized weights",
        ),
        (
            "nemo-rl",
            "policy:\n  generation: {vllm_cfg: {precision: bfloat16}}\n  megatron_cfg:\n"
            "    enabled: true\n    fp8_cfg: {enabled: true, fp8: hybrid, fp8_recipe: delayed}\n",
            "fp8_cfg.fp8_recipe: 'delayed'",
        ),
        (
            "bridge",
            "mixed_precision: bf16_with_fp8_tilewise_mixed\n",
            "no recipe of that name in Megatron-Bridge",
        ),
    ],
)
def test_native_keys_no_recipe_of_ours_spells_are_named_not_raised(tmp_path, host, text, said):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    reading = read_native(load_context(cfg), host)
    assert reading is not None and reading.spec is None
    assert any(said in u for u in reading.unmatched), reading.unmatched
    out = _explain(cfg, "--host", host)
    assert said in out and "not a recipe of ours" in out


def test_the_same_keys_for_two_recipes_say_so(tmp_path):
    """megatron-core's fields do not carry fp8_blockwise's fp32 scales (an environment
    variable does): a subchannel config with e4m3 reads as both."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {num_layers: 4, hidden_size: 256, fp8: e4m3, fp8_recipe: blockwise}\n")
    reading = read_native(load_context(cfg), "megatron")
    assert reading.spec.name == "fp8_blockwise" and reading.differs == ()
    spec = get_recipe({"recipe": "fp8_subchannel", "fp8_format": "e4m3"})
    assert recipe_keys("megatron", spec).keys == recipe_keys("megatron", reading.spec).keys


def _ast_defaults(path, cls: str) -> dict:
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
            value = stmt.value
            if isinstance(value, ast.Call):  # field(default=...)
                value = next((k.value for k in value.keywords if k.arg == "default"), None)
            if isinstance(value, ast.Constant):
                out[stmt.target.id] = value.value
    return out


def test_nemo_rl_defaults_are_nemo_rls_own():
    """The recorded defaults apply leaves out are what NeMo RL's source reads absent keys as."""
    from nemo_fp8_plugin.hosts.nemo_rl.native import LOSS_DEFAULTS, REQUIRED, VLLM_CFG_DEFAULTS

    src = shared_nemo_rl("src/nemo_rl")
    loss = _ast_defaults(src / "algorithms/loss/loss_functions.py", "ClippedPGLossConfig")
    assert {k: loss[k] for k in LOSS_DEFAULTS} == LOSS_DEFAULTS
    fp8 = ast.parse((src / "models/generation/vllm/quantization/fp8.py").read_text())
    gets = {}
    for call in ast.walk(fp8):
        if (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "get"
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id == "vllm_cfg"
            and len(call.args) == 2
        ):
            gets[call.args[0].value] = ast.literal_eval(call.args[1])
    assert {k: gets[k] for k in VLLM_CFG_DEFAULTS} == VLLM_CFG_DEFAULTS
    # kv_cache_dtype has no default there: it must always be written where the chain lacks it
    assert "kv_cache_dtype" not in gets and "kv_cache_dtype" not in VLLM_CFG_DEFAULTS
    required = {
        node.slice.value
        for node in ast.walk(fp8)
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "vllm_cfg"
        and isinstance(node.slice, ast.Constant)
    }
    assert {k.rsplit(".", 1)[1] for k in REQUIRED} <= required


@pytest.mark.host
def test_megatron_defaults_are_megatron_cores_own():
    from importlib.metadata import distribution

    from nemo_fp8_plugin.hosts.megatron.native import DDP_DEFAULTS, TRANSFORMER_CONFIG_DEFAULTS

    dist = distribution("megatron-core")
    tc = _ast_defaults(
        dist.locate_file("megatron/core/transformer/transformer_config.py"), "TransformerConfig"
    )
    tc.setdefault("fp8", None)  # field(default=None): a Constant None is kept above
    assert {k: tc.get(k) for k in TRANSFORMER_CONFIG_DEFAULTS} == TRANSFORMER_CONFIG_DEFAULTS
    ddp = _ast_defaults(
        dist.locate_file("megatron/core/distributed/distributed_data_parallel_config.py"),
        "DistributedDataParallelConfig",
    )
    assert {k: ddp[k] for k in DDP_DEFAULTS} == DDP_DEFAULTS


@pytest.mark.host
def test_nemo2_plugin_defaults_are_nemos_own():
    from importlib.metadata import distribution

    from nemo_fp8_plugin.hosts.nemo2.native import PLUGIN_DEFAULTS

    path = distribution("nemo-toolkit").locate_file(
        "nemo/lightning/pytorch/plugins/mixed_precision.py"
    )
    tree = ast.parse(path.read_text())
    cls = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and n.name == "MegatronMixedPrecision"
    )
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args.args[-len(init.args.defaults) :]
    defaults = {
        a.arg: d.value for a, d in zip(args, init.args.defaults) if isinstance(d, ast.Constant)
    }
    assert {k: defaults[k] for k in PLUGIN_DEFAULTS} == PLUGIN_DEFAULTS


def test_bridge_defaults_are_bridges_own(tmp_path):
    from conftest import upstream_file
    from nemo_fp8_plugin.hosts.bridge.native import MIXED_PRECISION_DEFAULTS

    path = upstream_file(
        "megatron_bridge-0.6.2-*.whl", "megatron/bridge/training/mixed_precision.py", tmp_path
    )
    found = _ast_defaults(path, "MixedPrecisionConfig")
    for name in ("fp8", "fp4"):  # Optional[str] = None
        found.setdefault(name, None)
    assert {k: found.get(k, "?") for k in MIXED_PRECISION_DEFAULTS} == MIXED_PRECISION_DEFAULTS


def test_a_one_sided_host_says_the_other_sides_fields_are_the_presets(tmp_path):
    """A host that only trains: its generation-side fields are hidden, as for a requested
    recipe; --all-hosts shows them, saying they are the preset's."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {num_layers: 4, hidden_size: 256, fp8: e4m3, fp8_recipe: blockwise}\n")
    out = _explain(cfg)
    assert "megatron's keys say nothing of generation" not in out
    assert "kv_cache:" not in out and "megatron only trains; --all-hosts shows them" in out
    out = _explain(cfg, "--all-hosts")
    assert "megatron's keys say nothing of generation" in out and "kv_cache: auto" in out

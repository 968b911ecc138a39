"""Contract tests for the training hosts: every output judged by the host's own code.

For Transformer Engine, megatron-core, NeMo RL and Megatron-Bridge:

* TE: the environment variables TE's recipe module (and ``pytorch/quantization.py``) reads are
  enumerated from TE 2.20.2's own source with ``ast``, not from a list; each value TE's source
  distinguishes is set at import, and for every preset ``verify_host_recipe`` must refuse
  exactly when the recipe object megatron-core would build then differs from the one built
  with the variable as the plugin asks.
* megatron-core: every ``TransformerConfig`` the plugin writes (each preset, each example under
  ``conf/examples/`` meant for megatron-core) is built by megatron-core 0.16.1 itself, and the
  fields each ``fp8_recipe`` branch of ``get_fp8_recipe`` reads are taken from its source with
  ``ast`` (it is defined only when TE imports, so it cannot be called here): a field the plugin
  sets to a non-default value must be read by the branch of the recipe it writes, or the plugin
  must refuse the request.
* NeMo RL (not installable): every key ``apply --host nemo-rl`` writes, for each preset and each
  NeMo RL config in ``../shared/data/nemo_rl/examples/configs`` and the plugin's NeMo RL
  examples, is declared by a TypedDict or read (``.get``/subscript/``in``) somewhere in NeMo RL's
  source (``ast``); the free-form containers are judged by the code that reads them (TE's
  ``getenv`` names for ``env_vars``, megatron-core's ``TransformerConfig`` fields for
  ``model_overrides``); keys found nowhere are listed below with the reason they are written.
* Megatron-Bridge (not installable: Python >= 3.12, TE at import): both forms of
  ``ConfigContainer.model`` read from the 0.6.2 wheel's source, and the plugin's fields pushed
  through Bridge's own ``MixedPrecisionConfig.setup`` into each.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import enum
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import yaml
from vllm_source import WHEELS as VLLM_WHEELS
from vllm_source import SourceTree

from conftest import (
    NEMO_RL_RELEASES,
    NEMO_RL_TRIMMED,
    REPO,
    load_te_recipe_module,
    shared_nemo_rl,
    upstream_file,
    upstream_wheel,
)
from nemo_fp8_plugin import FP8ConfigError, get_recipe, stacks
from nemo_fp8_plugin.config import load_config
from nemo_fp8_plugin.hosts import apply_path, bridge, te
from nemo_fp8_plugin.hosts import megatron as mg
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL_ADAPTER
from nemo_fp8_plugin.registry import list_recipes

PRESETS = [s.name for s in list_recipes()]
TE_WHEEL = "transformer_engine-2.20.2-*.whl"
BRIDGE_WHEEL = "megatron_bridge-0.6.2-*.whl"
EXAMPLES = REPO / "conf" / "examples"


# =========================================================================== Transformer Engine

TE_SOURCES = (
    "transformer_engine/common/recipe/__init__.py",
    "transformer_engine/pytorch/quantization.py",
)

RUNTIME_ONLY = {
    "NVTE_UNFUSED_FP8_UPDATE": "read by pytorch/quantization.py when delayed-scaling amaxes are "
    "reduced, not at import: it picks TE's fused or unfused amax and "
    "scale update (the same formula), not a recipe field, so "
    "verify_host_recipe has nothing to compare",
}
"""Variables TE reads outside the recipe module's import, with why the recipe check ignores them."""


def _getenv_calls(tree: ast.AST):
    """``(name, default, node)`` for every ``os.getenv(NAME, ...)`` / ``os.environ.get(NAME,
    ...)`` / ``os.environ[NAME]`` with a literal name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            is_getenv = f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"
            is_get = (
                f.attr == "get" and isinstance(f.value, ast.Attribute) and f.value.attr == "environ"
            )
            if (is_getenv or is_get) and node.args and isinstance(node.args[0], ast.Constant):
                default = (
                    node.args[1].value
                    if len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    else None
                )
                yield node.args[0].value, default, node
        elif (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "environ"
            and isinstance(node.slice, ast.Constant)
        ):
            yield node.slice.value, None, node


def _te_variables(tmp_path_factory):
    """``{source member: {variable: sorted candidate values}}`` read from TE's own source.

    Candidate values are what the source distinguishes: the literals the ``getenv`` result is
    compared with (``== "1"``), else the strings of the module's tuple constants that validate
    such values (``_BACKWARD_OVERRIDES``, ...); the default itself is not a candidate."""
    dest = tmp_path_factory.mktemp("te_src")
    out = {}
    for member in TE_SOURCES:
        tree = ast.parse(upstream_file(TE_WHEEL, member, dest).read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        tuple_strings = {
            elt.value
            for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple)
            for elt in node.value.elts
            if isinstance(elt, ast.Constant) and isinstance(elt.value, str)
        }
        found: dict[str, set] = {}
        for name, default, node in _getenv_calls(tree):
            compared = set()
            up = parents.get(node)
            while isinstance(up, (ast.Call, ast.Attribute)):  # .upper(), int(...)
                up = parents.get(up)
            if isinstance(up, ast.Compare):
                compared = {c.value for c in up.comparators if isinstance(c, ast.Constant)}
            values = compared or tuple_strings
            found.setdefault(name, set()).update(v for v in values if v != default)
        out[member] = {k: sorted(v) for k, v in found.items()}
    return out


@pytest.fixture(scope="module")
def te_variables(tmp_path_factory):
    return _te_variables(tmp_path_factory)


def test_te_variables_come_from_its_source(te_variables):
    recipe_vars = te_variables[TE_SOURCES[0]]
    # The ones the plugin knows by name are among them (a TE that renamed one fails here).
    for var in (te.ENV_BLOCK_FP32_SCALES, te.ENV_CURRENT_POW2_SCALES, te.ENV_BACKWARD_OVERRIDE):
        assert var in recipe_vars, var
    assert set(recipe_vars[te.ENV_BACKWARD_OVERRIDE]) >= {"high_precision", "dequantized"}
    assert set(te_variables[TE_SOURCES[1]]) == set(RUNTIME_ONLY)


def _norm(value):
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return tuple((f.name, _norm(getattr(value, f.name))) for f in dataclasses.fields(value))
    return value


def _state(obj) -> dict:
    """Everything a TE recipe object carries: dataclass fields and the class-level quantizer
    parameters, normalized so objects of two imports of the module compare."""
    names = {f.name for f in dataclasses.fields(obj)} | {
        a for a in dir(obj) if a.startswith("fp8_")
    }
    return {n: _norm(getattr(obj, n)) for n in sorted(names) if not callable(getattr(obj, n))}


def _load_te(tmp_path_factory, monkeypatch, env: dict, name: str, variables):
    for var in variables:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    module = load_te_recipe_module(tmp_path_factory.mktemp("te"), name=name)
    monkeypatch.delitem(sys.modules, name)
    return module


def _host_state(spec, module):
    try:
        return _state(te.host_built_recipe(spec, module))
    except (AssertionError, ValueError) as exc:  # TE's own refusal (pydantic wraps asserts)
        return ("refused by TE", type(exc).__name__)


@pytest.mark.slow
def test_every_te_variable_against_every_preset(te_variables, tmp_path_factory, monkeypatch):
    """For each variable and value TE's recipe module distinguishes, and each preset: the
    plugin's check refuses (naming the variable) exactly when the object megatron-core would
    build differs from the one built with only the plugin's variables set."""
    variables = sorted(te_variables[TE_SOURCES[0]])
    fp8 = [get_recipe(n) for n in PRESETS if get_recipe(n).training == "fp8"]
    checked = refused = 0
    for spec in fp8:
        base_env = te.required_env(spec)
        base = _host_state(
            spec,
            _load_te(
                tmp_path_factory, monkeypatch, base_env, f"te_contract_base_{spec.name}", variables
            ),
        )
        assert not isinstance(base, tuple), spec.name
        for var in variables:
            for value in te_variables[TE_SOURCES[0]][var]:
                if base_env.get(var) == value:
                    continue
                env = {**base_env, var: value}
                module = _load_te(
                    tmp_path_factory,
                    monkeypatch,
                    env,
                    f"te_contract_{spec.name}_{checked}",
                    variables,
                )
                differs = _host_state(spec, module) != base
                checked += 1
                if differs:
                    refused += 1
                    with pytest.raises(FP8ConfigError) as err:
                        te.verify_host_recipe(spec, module, where="the contract test")
                    assert var in str(err.value), (spec.name, var, value, str(err.value))
                else:
                    te.verify_host_recipe(spec, module, where="the contract test")
    assert checked > 5 * len(fp8) and refused >= 2 * len(fp8)  # the override hits every recipe


# =========================================================================== megatron-core

MODEL = dict(num_layers=8, hidden_size=256, num_attention_heads=4, bf16=True)

MEGATRON_EXAMPLES = (
    "megatron_gpt_fp8_current.yaml",
    "demo_gpt_fp8_blockwise.yaml",
    "llama3_8b_pretrain_fp8_blockwise.yaml",
)
OTHER_EXAMPLES = {
    "bridge_llama3_8b_pretrain_fp8_blockwise.yaml": "bridge",
    "bridge_llama3_8b_pretrain_mxfp8.yaml": "bridge",
    "nemo2_llama32_1b_finetune_fp8_blockwise.yaml": "nemo2",
    "vllm_llama8b_fp8_blockwise.yaml": "vllm",
    "vllm_moonlight_fp8_kv.yaml": "vllm",
}


def test_every_example_is_assigned_to_a_host():
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert names == set(MEGATRON_EXAMPLES) | set(OTHER_EXAMPLES)


def _megatron_core_root() -> Path:
    import importlib.metadata as md

    return Path(str(md.distribution("megatron-core").locate_file("megatron")))


def _branch_reads_independently() -> dict[str, set[str]]:
    """The test's own reading of ``get_fp8_recipe`` (not the plugin's reader): per
    ``config.fp8_recipe == Fp8Recipe.<name>`` branch, the ``config.<field>`` reads in it, plus
    those of ``__init__`` of any megatron-core class the branch constructs with ``config=``."""
    root = _megatron_core_root()
    fp8_utils = ast.parse((root / "core" / "fp8_utils.py").read_text())
    ext = ast.parse((root / "core" / "extensions" / "transformer_engine.py").read_text())
    classes = {n.name: n for n in ext.body if isinstance(n, ast.ClassDef)}

    def reads(node, param="config"):
        return {
            n.attr
            for n in ast.walk(node)
            if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name)
            and n.value.id == param
        }

    fn = next(
        n
        for n in ast.walk(fp8_utils)
        if isinstance(n, ast.FunctionDef)
        and n.name == "get_fp8_recipe"
        and any(isinstance(s, ast.If) for s in ast.walk(n))
    )
    out: dict[str, set[str]] = {}
    for node in ast.walk(fn):
        if not isinstance(node, ast.If):
            continue
        tested = [
            c.comparators[0].attr
            for c in ast.walk(node.test)
            if isinstance(c, ast.Compare)
            and isinstance(c.left, ast.Attribute)
            and c.left.attr == "fp8_recipe"
            and isinstance(c.comparators[0], ast.Attribute)
        ]
        if not tested:
            continue
        got = out.setdefault(tested[0], set())
        for stmt in node.body:
            got |= reads(stmt)
            for call in (c for c in ast.walk(stmt) if isinstance(c, ast.Call)):
                if (
                    isinstance(call.func, ast.Name)
                    and call.func.id in classes
                    and any(k.arg == "config" for k in call.keywords)
                ):
                    init = next(
                        b
                        for b in classes[call.func.id].body
                        if isinstance(b, ast.FunctionDef) and b.name == "__init__"
                    )
                    got |= reads(init)
    return out


RECIPE_BRANCH_FIELDS = (
    "fp8_margin",
    "fp8_amax_history_len",
    "fp8_amax_compute_algo",
    "fp8_dot_product_attention",
    "fp8_multi_head_attention",
)
"""TransformerConfig fields only get_fp8_recipe hands to TE (megatron-core reads them nowhere
else, checked below)."""


def test_recipe_branch_fields_are_read_only_by_get_fp8_recipe():
    root = _megatron_core_root() / "core"
    for field in RECIPE_BRANCH_FIELDS:
        users = sorted(
            str(p.relative_to(root))
            for p in root.rglob("*.py")
            if f".{field}" in p.read_text(encoding="utf-8")
        )
        assert set(users) <= {"fp8_utils.py", "extensions/transformer_engine.py"}, (field, users)


def test_plugin_reader_agrees_with_the_source():
    from nemo_fp8_plugin.hosts.megatron.honoured import honoured_fp8_fields

    mine = _branch_reads_independently()
    theirs = honoured_fp8_fields()
    assert theirs.source == "installed"
    for recipe, fields in mine.items():
        assert {f for f in fields if f in RECIPE_BRANCH_FIELDS} == {
            f for f in theirs.fields[recipe] if f in RECIPE_BRANCH_FIELDS
        }, recipe


def _check_fields_are_honoured(fields: dict, where: str) -> None:
    from megatron.core.transformer import TransformerConfig

    branches = _branch_reads_independently()
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    recipe = fields["fp8_recipe"]
    for field in RECIPE_BRANCH_FIELDS:
        if field in fields and fields[field] != defaults[field]:
            assert field in branches[recipe], (where, recipe, field, fields[field])


def _variants():
    """Every preset, and each with one recipe-branch setting moved off its neutral value."""
    moves = {
        "margin": 2,
        "amax_history_len": 16,
        "amax_compute_algo": "max",
        "fp8_dot_product_attention": True,
    }
    for name in PRESETS:
        yield {"recipe": name}
        for key, value in moves.items():
            yield {"recipe": name, key: value}
        yield {"recipe": name, "fp8_dot_product_attention": True, "fp8_multi_head_attention": True}


def test_every_transformer_config_the_plugin_writes_is_built_and_honoured():
    """Each variant is either refused (naming the key megatron-core would drop) or written as a
    TransformerConfig megatron-core builds, whose recipe-branch fields its recipe reads."""
    from megatron.core.transformer import TransformerConfig

    built = refused = 0
    for override in _variants():
        try:
            spec = get_recipe(override)
        except FP8ConfigError:
            continue  # the spec itself refuses it (e.g. block scaling has no FP8 attention)
        if spec.training != "fp8":
            continue
        if mg.dropped_settings(spec):
            with pytest.raises(FP8ConfigError):
                mg.build_transformer_config(spec, **MODEL)
            refused += 1
            continue
        cfg = mg.build_transformer_config(spec, **MODEL)
        assert isinstance(cfg, TransformerConfig)
        _check_fields_are_honoured(dataclasses.asdict(cfg), str(override))
        built += 1
    assert built >= len(PRESETS) and refused > 0


@pytest.mark.parametrize("name", MEGATRON_EXAMPLES)
@pytest.mark.parametrize("preset", PRESETS)
def test_megatron_examples_with_every_preset_build(name, preset, tmp_path):
    from megatron.core.transformer import TransformerConfig

    data = yaml.safe_load((EXAMPLES / name).read_text())
    assert "precision" in data
    data["precision"] = preset
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    try:
        out = apply_path(mg.ADAPTER, path).data
    except FP8ConfigError as err:
        pytest.fail(f"{name} + {preset} refused: {err}")
    section = out[mg.section_path(out)[0]]
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    kwargs = {k: v for k, v in section.items() if k in names}
    for key, value in (("num_layers", 4), ("hidden_size", 128), ("num_attention_heads", 4)):
        kwargs.setdefault(key, value)
    cfg = mg._construct(TransformerConfig, mg._objects(kwargs), get_recipe(preset))
    scaling = get_recipe(preset).scaling
    # nvfp4 is megatron-core's fp4_recipe (FP8 off), the others its fp8_recipe
    field = "fp4_recipe" if scaling == "nvfp4" else "fp8_recipe"
    assert getattr(cfg, field) == mg.FP8_RECIPE[scaling]
    assert (cfg.fp8 is None) == (scaling == "nvfp4") and (cfg.fp4 is None) == (scaling != "nvfp4")
    _check_fields_are_honoured(kwargs, f"{name}+{preset}")


# =========================================================================== NeMo RL


def _typed_dict_fields_and_reads(src: Path):
    """(declared config field names, string keys read by ``.get``/subscript/``in``) across
    NeMo RL's source. Declared: fields of its TypedDicts, and of its pydantic ``BaseModel``
    configs (the loss configs, e.g. ``ClippedPGLossConfig``, moved from TypedDict to pydantic)."""
    trees = [ast.parse(p.read_text(encoding="utf-8")) for p in sorted(src.rglob("*.py"))]
    classes = [n for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)]
    typed = {"TypedDict", "BaseModel"}
    changed = True
    while changed:  # TypedDicts may subclass other TypedDicts
        changed = False
        for c in classes:
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", None) for b in c.bases}
            if c.name not in typed and bases & typed:
                typed.add(c.name)
                changed = True
    declared = {
        n.target.id
        for c in classes
        if c.name in typed
        for n in c.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    read = set()
    for t in trees:
        for n in ast.walk(t):
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in ("get", "pop", "setdefault")
                and n.args
                and isinstance(n.args[0], ast.Constant)
                and isinstance(n.args[0].value, str)
            ):
                read.add(n.args[0].value)
            elif (
                isinstance(n, ast.Subscript)
                and isinstance(n.slice, ast.Constant)
                and isinstance(n.slice.value, str)
            ):
                read.add(n.slice.value)
            elif (
                isinstance(n, ast.Compare)
                and isinstance(n.left, ast.Constant)
                and isinstance(n.left.value, str)
                and isinstance(n.ops[0], (ast.In, ast.NotIn))
            ):
                read.add(n.left.value)
    return declared, read


FREE_FORM = {
    "policy.megatron_cfg.env_vars": "environment variables NeMo RL sets in its Megatron workers "
    "before they import Transformer Engine: judged by TE's own "
    "getenv names",
    "policy.megatron_cfg.model_overrides": "merged into the Megatron-Bridge model provider "
    "(_merge_model_overrides): judged by megatron-core's "
    "TransformerConfig fields",
    "policy.generation.vllm_cfg.env_vars": "environment variables of NeMo RL's vLLM workers: "
    "judged by the names in the release's own vLLM's vllm/envs.py",
}

ROOT_SECTIONS = {
    "policy": "PolicyConfig",
    "loss_fn": "ClippedPGLossConfig",
}
"""Root sections of NeMo RL's master config -> the config class that declares their keys. The
master config itself (``nemo_rl/algorithms/grpo.py``, ``MasterConfig``) is not in the source
snapshot; the classes are, and the test checks they exist."""

NOT_IN_NEMO_RL = {}
"""Written keys NeMo RL's source neither declares nor reads, with why they are written anyway
(none today: a new entry needs a reason)."""


def _flatten(mapping, prefix=""):
    out = {}
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(_flatten(value, dotted))
        else:
            out[dotted] = value
    return out


REQUESTS = [
    *PRESETS,
    {
        "recipe": "fp8_blockwise",
        "kv_cache": "fp8",
        "bf16_layers": {"first": 1, "last": 1, "modules": ["*q_proj*"]},
        "importance_sampling": {"truncation": "icepop", "ratio_max": 5.0},
    },
    {"recipe": "mxfp8", "fp8_param": True, "importance_sampling": {"truncation": "tis"}},
    {"recipe": "fp8_current", "pow2_scales": True},
    {"recipe": "fp8_current", "pow2_scales": True, "bf16_layers": {"first": 0, "last": 0}},
    {"recipe": "fp8_blockwise", "training": "bf16"},
    # what the releases without model_overrides accept: edge layers kept for generation only
    {
        "recipe": "fp8_blockwise",
        "kv_cache": "fp8",
        "bf16_layers": {"first": 1, "last": 1, "modules": ["*q_proj*"], "applies_to": "generation"},
    },
]
"""Every preset, and requests that reach the keys presets leave alone (KV cache, module rules,
first/last layers, truncation, stated fp8_param, pow2 current scaling, generation only)."""


def _nemo_rl_inputs(tmp_path: Path, tree: str = ""):
    """(label, input file, its mapping) for each request x each NeMo RL config of the release
    whose shared tree is ``tree`` and each plugin NeMo RL example, with ``defaults:`` pointed at
    the real parents."""
    configs_dir = shared_nemo_rl(tree + "examples/configs")
    configs = sorted(configs_dir.rglob("*.yaml"))
    examples = [NEMO_RL_TRIMMED] + sorted((REPO / "examples" / "nemo_rl").glob("*.yaml"))
    out = []
    for n, request in enumerate(REQUESTS):
        for path in configs + examples:
            data = yaml.safe_load(path.read_text())
            if "defaults" in data:
                items = (
                    data["defaults"] if isinstance(data["defaults"], list) else [data["defaults"]]
                )
                if path in examples:  # meant to be copied next to the NeMo RL config it names
                    items = [str(next(configs_dir.rglob(Path(d).name))) for d in items]
                data["defaults"] = [str((path.parent / d).resolve()) for d in items]
            for key in ("precision", "fp8"):
                data.pop(key, None)
            if isinstance(data.get("policy"), dict) and str(
                data["policy"].get("precision", "")
            ).startswith(("fp8", "mxfp8")):
                data["policy"]["precision"] = "bfloat16"
            if isinstance(request, str):
                data["precision"] = request
            else:
                data["fp8"] = request
            dest = tmp_path / f"{n}__{path.stem}.yaml"
            dest.write_text(yaml.safe_dump(data, sort_keys=False))
            out.append((f"{path.name}+{request}", dest))
    return out


WRITTEN_PER_RELEASE = {
    "0.6.0": (
        "policy.generation.vllm_cfg.kv_cache_dtype",
        "policy.generation.vllm_cfg.quantization_ignored_layer_kws",
    ),
    "0.7.0": (
        "policy.generation.vllm_cfg.kv_cache_dtype",
        "policy.generation.vllm_cfg.quantization_ignored_layer_kws",
        "policy.generation.vllm_cfg.env_vars.VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER",
    ),
    "main-2026-08-22": (
        "policy.megatron_cfg.model_overrides.first_last_layers_bf16",
        "policy.generation.vllm_cfg.quantization_ignored_layer_kws",
        "policy.generation.vllm_cfg.env_vars.VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER",
    ),
}
"""Keys each release's requests must reach (so that the test sees every kind of key that release
reads: the BF16 edge layers of training only where ``model_overrides`` exists)."""


@pytest.mark.slow
@pytest.mark.parametrize("release", sorted(NEMO_RL_RELEASES))
def test_every_key_written_for_nemo_rl_is_known_to_nemo_rl(tmp_path, release):
    """Per NeMo RL release, applied for that release's stack: every key written is one that
    release's own source declares or reads (NeMo RL ignores the others silently)."""
    from megatron.core.transformer import TransformerConfig

    tree = NEMO_RL_RELEASES[release]
    src = shared_nemo_rl(tree + "nemo_rl" if tree else "src")
    declared, read = _typed_dict_fields_and_reads(src)
    classes = {
        n.name
        for p in src.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
        if isinstance(n, ast.ClassDef)
    }
    assert set(ROOT_SECTIONS.values()) <= classes
    known = declared | read | set(ROOT_SECTIONS)
    # NVTE_* variables judged by the release's own TE (its lock's), as vLLM's by its envs.py
    te = stacks.get_stack(f"nemo-rl-{release}").versions["transformer-engine"]
    te_vars = set(_te_variables_from_wheel(tmp_path, te))
    vllm_envs = SourceTree.from_wheel(
        upstream_wheel(VLLM_WHEELS[stacks.get_stack(f"nemo-rl-{release}").versions["vllm"]])
    ).read("vllm/envs.py")
    tc_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    written: dict[str, str] = {}
    applied = 0
    for label, src in _nemo_rl_inputs(tmp_path, tree):
        try:
            out = apply_path(
                NEMO_RL_ADAPTER,
                src,
                output=tmp_path / "out" / src.name,
                stack=f"nemo-rl-{release}",
            ).data
        except FP8ConfigError:
            continue  # refused (delayed scaling, DTensor training, a contradicting FP8 twin)
        applied += 1
        # The input as the plugin (and NeMo RL's OmegaConf) reads it: PyYAML alone reads 1e-8
        # as a string, which would look like a changed optimizer.adam_eps.
        before = _flatten(load_config(src, follow_defaults=False))
        for key, value in _flatten(out).items():
            if key != "defaults" and before.get(key, "<absent>") != value:
                written.setdefault(key, label)
    assert applied >= 30 and written
    for key in (
        *WRITTEN_PER_RELEASE[release],
        "policy.megatron_cfg.env_vars.NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES",
    ):
        assert key in written, key  # the requests reach every kind of key
    unknown = {}
    for key, label in sorted(written.items()):
        container = next((c for c in FREE_FORM if key.startswith(c + ".")), None)
        head = key[len(container) + 1 :] if container else None
        segments = container.split(".") if container else key.split(".")
        missing = [s for s in segments if s not in known]
        if container == "policy.megatron_cfg.env_vars" and head not in te_vars:
            missing.append(f"{head} (no getenv in TE {te})")
        if container == "policy.generation.vllm_cfg.env_vars" and f'"{head}"' not in vllm_envs:
            missing.append(f"{head} (not in that vLLM's envs.py)")
        if (
            container == "policy.megatron_cfg.model_overrides"
            and head.split(".")[0] not in tc_fields
        ):
            missing.append(f"{head} (no TransformerConfig field)")
        if missing and key not in NOT_IN_NEMO_RL:
            unknown[key] = (label, missing)
    assert unknown == {}, release


def _te_variables_from_wheel(tmp_path: Path, version: str) -> dict:
    """The variables TE ``version``'s recipe module reads (its pure-Python wheel)."""
    wheel = f"transformer_engine-{version}-*.whl"
    dest = tmp_path / f"te_src_{version}"
    tree = ast.parse(upstream_file(wheel, TE_SOURCES[0], dest).read_text())
    return {name: default for name, default, _ in _getenv_calls(tree)}


# =========================================================================== Megatron-Bridge


def _bridge_src(member: str, dest: Path) -> str:
    return upstream_file(BRIDGE_WHEEL, member, dest).read_text()


def test_bridge_source_reads_the_transformer_of_the_model_config_form(tmp_path):
    """Wherever Bridge 0.6.2 branches on ``isinstance(<cfg>.model, (GPTModelConfig, ...))`` it
    takes the TransformerConfig from ``.transformer``: the form the plugin reads."""
    seen = 0
    for member in ("megatron/bridge/training/config.py", "megatron/bridge/training/setup.py"):
        tree = ast.parse(_bridge_src(member, tmp_path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.If, ast.IfExp)):
                continue
            test = node.test
            if not (
                isinstance(test, ast.Call)
                and isinstance(test.func, ast.Name)
                and test.func.id == "isinstance"
            ):
                continue
            kinds = {n.id for n in ast.walk(test.args[1]) if isinstance(n, ast.Name)}
            if "GPTModelConfig" not in kinds:
                continue
            subject = ast.unparse(test.args[0])
            body = node.body if isinstance(node, ast.If) else [node.body]
            text = " ".join(ast.unparse(b) for b in body)
            assert f"{subject}.transformer" in text, (member, subject, text)
            seen += 1
    assert seen >= 2


def _bridge_mixed_precision(dest: Path, monkeypatch):
    """Bridge 0.6.2's real ``training/mixed_precision.py`` by file path (Bridge cannot install
    on CPU); the two provider names it imports for annotations only are megatron-core's
    TransformerConfig, which both Bridge providers subclass."""
    from megatron.core.transformer import TransformerConfig

    path = upstream_file(BRIDGE_WHEEL, "megatron/bridge/training/mixed_precision.py", dest)
    models = types.ModuleType("megatron.bridge.models")
    models.GPTModelProvider = models.T5ModelProvider = TransformerConfig
    monkeypatch.setitem(sys.modules, "megatron.bridge", types.ModuleType("megatron.bridge"))
    monkeypatch.setitem(sys.modules, "megatron.bridge.models", models)
    spec = importlib.util.spec_from_file_location("bridge_mp_contract", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("form", ["provider", "GPTModelConfig"])
def test_bridge_both_model_forms_for_every_preset(form, tmp_path, monkeypatch):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    sys.path.insert(0, str(Path(__file__).parent / "bridge"))  # its own folder
    from test_bridge_adapter import GPTModelConfigStandIn

    from nemo_fp8_plugin.hosts.bridge.callback import FP8ScaleRefreshBridgeCallback

    mp = _bridge_mixed_precision(tmp_path, monkeypatch)
    # Bridge's finalize() asks the installed TE for >= 2.7 when fp4 is set; the TE of the
    # contract is the 2.20.2 wheel (not installable here), which is.
    monkeypatch.setattr(mp, "is_te_min_version", lambda version, *a, **k: True)
    for name in PRESETS:
        spec = get_recipe(name)
        base = TransformerConfig(**MODEL)
        model = base if form == "provider" else GPTModelConfigStandIn(transformer=base)
        cfg = bridge.mixed_precision_config(spec, mp_module=mp)
        cfg.finalize()
        ddp = DistributedDataParallelConfig()
        cfg.setup(model, OptimizerConfig(), ddp)
        tc = bridge.transformer_config_of(model)
        assert tc is base
        for key, value in bridge.mixed_precision_fields(spec).keys.items():
            if hasattr(TransformerConfig, key) or key in {f.name for f in dataclasses.fields(tc)}:
                assert getattr(tc, key) == value, (name, key)
        assert ddp.fp8_param_gather == (spec.fp8_param and spec.scaling != "nvfp4")
        if spec.scaling == "nvfp4":  # FP4 parameters are the TransformerConfig's fp4_param
            assert (tc.fp4, tc.fp4_recipe, tc.fp4_param) == ("e2m1", "nvfp4", spec.fp8_param)
        dataclasses.replace(tc)  # megatron-core's validation of what Bridge pushed
        _check_fields_are_honoured(dataclasses.asdict(tc), f"bridge {form} {name}")
        state = types.SimpleNamespace(
            train_state=types.SimpleNamespace(step=0), cfg=types.SimpleNamespace(model=model)
        )
        FP8ScaleRefreshBridgeCallback(name).on_train_start(
            types.SimpleNamespace(state=state, model=[copy.copy(base)])
        )


def test_the_bridge_mxfp8_example_as_written():
    """conf/examples/bridge_llama3_8b_pretrain_mxfp8.yaml, the quick start's Bridge file: the
    block apply writes for a B200 is honoured by megatron-core."""
    path = EXAMPLES / "bridge_llama3_8b_pretrain_mxfp8.yaml"
    block = apply_path(bridge.ADAPTER, path, hardware="b200").data["mixed_precision"]
    assert block["fp8_recipe"] == "mxfp8"
    _check_fields_are_honoured(block, "bridge mxfp8 example")


@pytest.mark.parametrize("preset", PRESETS)
def test_bridge_example_with_every_preset(preset, tmp_path):
    data = yaml.safe_load((EXAMPLES / "bridge_llama3_8b_pretrain_fp8_blockwise.yaml").read_text())
    data["mixed_precision"] = preset
    path = tmp_path / "bridge.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    block = apply_path(bridge.ADAPTER, path).data["mixed_precision"]
    if get_recipe(preset).scaling == "nvfp4":  # the block too, as for every recipe
        assert block["fp4_recipe"] == "nvfp4"
    else:
        assert block["fp8_recipe"] == mg.FP8_RECIPE[get_recipe(preset).scaling]
    _check_fields_are_honoured(block, f"bridge example {preset}")

"""Megatron-Bridge registration against Bridge 0.6.2's real ``training/mixed_precision.py``.

Megatron-Bridge cannot be installed on a CPU machine (it needs Python >= 3.12 and imports
Transformer Engine at package import), so its ``mixed_precision.py`` is extracted from the
real wheel and loaded by file path. That file imports ``GPTModelProvider`` and
``T5ModelProvider`` from ``megatron.bridge.models`` (whose package needs TE) only for the
type annotation of ``MixedPrecisionConfig.setup``; the stub below provides exactly those two
names, as megatron-core's ``TransformerConfig`` (both Bridge classes subclass it). Everything
else the file imports is the real megatron-core 0.16.1 and torch; the registry, ``register``,
``get_mixed_precision_config``, ``finalize`` and ``setup`` under test are Bridge's own code.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import sys
import types

import pytest
import torch
import yaml
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import TransformerConfig

from conftest import load_te_recipe_module, upstream_file
from nemo_fp8_plugin import FP8ConfigError, RecipeRegistryError, get_recipe
from nemo_fp8_plugin.hosts import apply_path, bridge

pytestmark = pytest.mark.host

RECIPES = ["fp8_delayed", "fp8_current", "fp8_subchannel", "fp8_blockwise", "mxfp8"]
WHEEL = "megatron_bridge-0.6.2-*.whl"
MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4)


def _load_bridge_mixed_precision(dest, monkeypatch, name: str):
    path = upstream_file(WHEEL, "megatron/bridge/training/mixed_precision.py", dest)
    models = types.ModuleType("megatron.bridge.models")
    models.GPTModelProvider = TransformerConfig  # stub: annotation-only names (see docstring)
    models.T5ModelProvider = TransformerConfig
    monkeypatch.setitem(sys.modules, "megatron.bridge", types.ModuleType("megatron.bridge"))
    monkeypatch.setitem(sys.modules, "megatron.bridge.models", models)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


class _AllowList:
    """Records the prefix handed to Bridge's ``register_allowed_target_prefix``: Bridge's
    ``utils/instantiate_utils.py`` imports Megatron-LM's ``megatron.training``, which has no
    CPU-installable distribution; the real function's signature is checked statically below."""

    def __init__(self):
        self.prefixes = []

    def register_allowed_target_prefix(self, prefix):
        self.prefixes.append(prefix)


@pytest.fixture
def mp(tmp_path, monkeypatch):
    return _load_bridge_mixed_precision(tmp_path, monkeypatch, "bridge_mixed_precision_under_test")


@pytest.fixture
def registered(mp):
    allow = _AllowList()
    added = bridge.register(mp, instantiate_module=allow)
    return mp, added, allow


def test_register_adds_every_recipe_with_bridges_decorator(registered):
    mp, added, allow = registered
    for name in RECIPES:
        assert name in mp.MIXED_PRECISION_RECIPES
        assert name in added
    assert "fp8-blockwise" in mp.MIXED_PRECISION_RECIPES  # Bridge's hyphen alias
    assert "bf16_mixed" in mp.MIXED_PRECISION_RECIPES  # Bridge's own recipes untouched
    assert allow.prefixes == [bridge.TARGET_PREFIX]


def test_register_is_idempotent(registered):
    mp, _added, _allow = registered
    assert bridge.register(mp, instantiate_module=_AllowList()) == []


def test_a_name_taken_by_someone_else_is_refused(mp):
    def fp8_blockwise():  # another package's recipe of the same name
        return mp.bf16_mixed()

    mp.register(fp8_blockwise)
    with pytest.raises(RecipeRegistryError, match="defined twice"):
        bridge.register(mp, instantiate_module=_AllowList())


@pytest.mark.parametrize("alias", ["fp8_blockwise", "fp8-blockwise"])
def test_get_mixed_precision_config_returns_our_fields(registered, alias):
    mp = registered[0]
    cfg = mp.get_mixed_precision_config(alias)
    assert isinstance(cfg, mp.MixedPrecisionConfig)
    assert (cfg.fp8, cfg.fp8_recipe, cfg.bf16) == ("e4m3", "blockwise", True)
    assert cfg.params_dtype == torch.bfloat16 and cfg.fp8_param_gather is False


@pytest.mark.parametrize("name", RECIPES)
def test_bridge_setup_pushes_our_fields_onto_real_configs(registered, name):
    """Bridge's own finalize() + setup() onto megatron-core configs keeps every field, and the
    resulting TransformerConfig passes megatron-core's validation."""
    mp = registered[0]
    spec = get_recipe(name)
    cfg = mp.get_mixed_precision_config(name)
    cfg.finalize()
    model, optim, ddp = (
        TransformerConfig(**MODEL),
        OptimizerConfig(),
        DistributedDataParallelConfig(),
    )
    cfg.setup(model, optim, ddp)
    want = bridge.mixed_precision_fields(spec).keys
    for key, value in want.items():
        if hasattr(model, key):
            assert getattr(model, key) == value, key
    assert model.fp8_param == spec.fp8_param and model.bf16 is True
    assert optim.bf16 is True
    assert ddp.fp8_param_gather == spec.fp8_param
    dataclasses.replace(model)  # megatron-core's __post_init__ on the pushed values
    if name == "mxfp8":
        assert (
            cfg.reuse_grad_buf_for_mxfp8_param_ag is True
        )  # Bridge asserts it for MXFP8 + fp8 params


def test_overridden_spec_builds_too(mp):
    spec = get_recipe({"recipe": "fp8_blockwise", "bf16_layers": {"first": 1, "last": 2}})
    cfg = bridge.mixed_precision_config(spec, mp_module=mp)
    assert (
        cfg.first_last_layers_bf16,
        cfg.num_layers_at_start_in_bf16,
        cfg.num_layers_at_end_in_bf16,
    ) == (True, 1, 2)


def test_bridge_source_has_the_allow_list_function():
    """Static check against the real instantiate_utils.py (it cannot be imported on CPU)."""
    import tempfile
    from pathlib import Path

    path = upstream_file(
        WHEEL, "megatron/bridge/utils/instantiate_utils.py", Path(tempfile.mkdtemp())
    )
    tree = ast.parse(path.read_text())
    fn = next(
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name == "register_allowed_target_prefix"
    )
    assert [a.arg for a in fn.args.args] == ["prefix"]


# --------------------------------------------------------------------------- YAML


def _apply(tmp_path, text, name="in.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return apply_path(bridge.ADAPTER, path)


BRIDGE_YAML = """\
precision: fp8_blockwise
mixed_precision: bf16_mixed
model:
  tensor_model_parallel_size: 2
train:
  train_iters: 100
"""


def _build_block(mp, block):
    """Bridge's MixedPrecisionConfig from the YAML block, dtypes resolved as Bridge's
    instantiate resolves ``{_target_: torch.bfloat16, _call_: false}``."""
    fields = {
        k: (getattr(torch, v["_target_"].split(".")[1]) if isinstance(v, dict) else v)
        for k, v in block.items()
        if k != "_target_"
    }
    return mp.MixedPrecisionConfig(**fields)


def test_apply_writes_the_mixed_precision_block(tmp_path, registered):
    mp = registered[0]
    result = _apply(tmp_path, BRIDGE_YAML)
    out = result.data
    assert "precision" not in out and out["train"] == {"train_iters": 100}
    block = out["mixed_precision"]
    assert block["_target_"] == bridge.MIXED_PRECISION_TARGET
    assert any("NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in w for w in result.notes)
    built = _build_block(mp, block)
    reference = mp.get_mixed_precision_config("fp8_blockwise")
    assert dataclasses.asdict(built) == dataclasses.asdict(reference)
    assert _apply(tmp_path, yaml.safe_dump(out, sort_keys=False), "again.yaml").data == out


def test_apply_expands_a_registered_name(tmp_path):
    out = _apply(tmp_path, "mixed_precision: fp8_current\n").data
    assert out["mixed_precision"]["fp8_recipe"] == "tensorwise"
    assert out["mixed_precision"]["num_layers_at_end_in_bf16"] == 1


def test_apply_fp16_base_is_kept(tmp_path):
    block = _apply(tmp_path, "precision: mxfp8\nmixed_precision: fp16_mixed\n").data[
        "mixed_precision"
    ]
    # bf16: false is MixedPrecisionConfig's default, so it is not written
    assert block["fp16"] is True and block.get("bf16", False) is False
    assert block["fp8_recipe"] == "mxfp8"


@pytest.mark.parametrize(
    "text,key",
    [
        (
            "precision: fp8_blockwise\nmixed_precision: bf16_with_fp8_delayed_scaling_mixed\n",
            "mixed_precision",
        ),
        ("precision: fp8_blockwise\nmixed_precision: {fp8: hybrid}\n", "mixed_precision.fp8"),
        ("precision: fp8_blockwise\nmixed_precision: {fp4: e2m1}\n", "mixed_precision.fp4"),
        ("fp8: {recipe: fp8_blockwise, margin: 1}\n", "fp8.margin"),
        ("fp8: {recipe: fp8_blockwise, fp8_wgrad: false}\n", "fp8.fp8_wgrad"),
        (
            "fp8: {recipe: fp8_blockwise, bf16_layers: {first: 40}}\nmodel: {num_layers: 4}\n",
            "fp8.bf16_layers.first",
        ),
    ],
)
def test_apply_refuses_conflicts_and_dropped_settings(tmp_path, text, key):
    with pytest.raises(FP8ConfigError) as err:
        _apply(tmp_path, text)
    assert err.value.key == key


def test_native_keys_are_plain_data():
    keys = bridge.native_keys(get_recipe("mxfp8")).keys
    assert keys["mixed_precision"]["reuse_grad_buf_for_mxfp8_param_ag"] is True
    yaml.safe_dump(keys)  # serialisable as is


# --------------------------------------------------------------------------- TE in this process


@pytest.fixture
def te_unset(tmp_path, monkeypatch):
    """``transformer_engine.common.recipe`` importable as TE 2.20.2's real recipe module,
    imported with NVTE_FP8_BLOCK_SCALING_FP32_SCALES unset (a launch script that forgot it)."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    recipe = load_te_recipe_module(tmp_path, name="te_recipe_bridge_unset")
    monkeypatch.delitem(sys.modules, "te_recipe_bridge_unset")
    pkg, common = (
        types.ModuleType("transformer_engine"),
        types.ModuleType("transformer_engine.common"),
    )
    common.recipe, pkg.common = recipe, common
    monkeypatch.setitem(sys.modules, "transformer_engine", pkg)
    monkeypatch.setitem(sys.modules, "transformer_engine.common", common)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", recipe)
    return recipe


def test_registered_recipe_catches_the_fp32_scale_trap(registered, te_unset):
    """Bridge resolves ``mixed_precision: fp8_blockwise`` in the training process; with TE
    imported without the variable, the registered recipe refuses instead of training with
    power-of-2 scales."""
    mp = registered[0]
    with pytest.raises(FP8ConfigError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1") as err:
        mp.get_mixed_precision_config("fp8_blockwise")
    assert err.value.key == "pow2_scales" and "Megatron-Bridge" in str(err.value)
    with pytest.raises(FP8ConfigError, match="NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"):
        bridge.mixed_precision_config("fp8_blockwise", mp_module=mp)
    # power-of-2 scales are what fp8_subchannel asks for, and MXFP8 reads no variable
    assert mp.get_mixed_precision_config("fp8_subchannel").fp8_recipe == "blockwise"
    assert mp.get_mixed_precision_config("mxfp8").fp8_recipe == "mxfp8"


def test_apply_warning_does_not_promise_a_check_stock_bridge_lacks(tmp_path):
    (warning,) = [w for w in _apply(tmp_path, BRIDGE_YAML).notes if "NVTE_" in w]
    assert "pass nemo_fp8_plugin.hosts.bridge.callback.FP8ScaleRefreshBridgeCallback" in warning


# --------------------------------------------------------------------------- ConfigContainer.model: both forms


def _bridge_source(member):
    import tempfile
    from pathlib import Path

    return upstream_file(WHEEL, member, Path(tempfile.mkdtemp())).read_text()


@dataclasses.dataclass(kw_only=True)
class GPTModelConfigStandIn:
    """Megatron-LM's ``megatron.training.models.gpt.GPTModelConfig`` (what Bridge 0.6.2's
    ``ConfigContainer.model`` may hold next to its providers): Megatron-LM's ``megatron.training``
    has no CPU-installable distribution, so this reproduces the two things of its real source the
    plugin relies on: the ``transformer: TransformerConfig`` field and the
    ``__getattr__``/``__setattr__`` proxying to it (the Bridge wheel's own code, checked below,
    reads ``cfg.model.transformer`` for this form)."""

    transformer: TransformerConfig
    vocab_size: int | None = None
    seq_length: int = 1024

    def __getattr__(self, name):
        transformer = object.__getattribute__(self, "transformer")
        if hasattr(transformer, name):
            return getattr(transformer, name)
        raise AttributeError(name)

    def __setattr__(self, name, value):
        try:
            transformer = object.__getattribute__(self, "transformer")
        except AttributeError:
            object.__setattr__(self, name, value)
            return
        if hasattr(transformer, name):
            setattr(transformer, name, value)
        else:
            object.__setattr__(self, name, value)


def test_the_wheel_has_both_model_forms():
    """Bridge 0.6.2's ConfigContainer.model may be a provider (itself a TransformerConfig) or a
    GPTModelConfig / HybridModelConfig whose TransformerConfig is `.transformer`."""
    src = _bridge_source("megatron/bridge/training/config.py")
    tree = ast.parse(src)
    container = next(
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ConfigContainer"
    )
    model = next(
        n for n in container.body if isinstance(n, ast.AnnAssign) and n.target.id == "model"
    )
    names = {n.id for n in ast.walk(model.annotation) if isinstance(n, ast.Name)}
    assert {"GPTModelProvider", "GPTModelConfig", "HybridModelConfig"} <= names
    assert "self.model.transformer" in src


@pytest.mark.parametrize("form", ["provider", "GPTModelConfig"])
def test_transformer_config_of_both_forms(mp, form):
    """Bridge's own MixedPrecisionConfig.setup pushes our fields through either form; the
    plugin reads them back from the TransformerConfig wherever it lives."""
    base = TransformerConfig(**MODEL)
    model = base if form == "provider" else GPTModelConfigStandIn(transformer=base, vocab_size=256)
    cfg = bridge.mixed_precision_config("fp8_current", mp_module=mp)
    cfg.finalize()
    cfg.setup(model, OptimizerConfig(), DistributedDataParallelConfig())
    tc = bridge.transformer_config_of(model)
    assert tc is base and tc.fp8_recipe == "tensorwise" and tc.num_layers_at_start_in_bf16 == 1
    assert bridge.transformer_config_path(model) == (
        "model" if form == "provider" else "model.transformer"
    )


def _cfg_context(model, step=0):
    state = types.SimpleNamespace(
        train_state=types.SimpleNamespace(step=step), cfg=types.SimpleNamespace(model=model)
    )
    return types.SimpleNamespace(state=state, model=[torch.nn.Linear(2, 2)])


@pytest.mark.parametrize("form", ["provider", "GPTModelConfig"])
def test_callback_checks_the_runs_model_config_in_both_forms(mp, form):
    from nemo_fp8_plugin.hosts.bridge.callback import FP8ScaleRefreshBridgeCallback

    def model_for(recipe):
        base = TransformerConfig(**MODEL)
        model = base if form == "provider" else GPTModelConfigStandIn(transformer=base)
        cfg = bridge.mixed_precision_config(recipe, mp_module=mp)
        cfg.finalize()
        cfg.setup(model)
        return model

    FP8ScaleRefreshBridgeCallback("fp8_current").on_train_start(
        _cfg_context(model_for("fp8_current"))
    )
    with pytest.raises(FP8ConfigError) as err:
        FP8ScaleRefreshBridgeCallback("fp8_blockwise").on_train_start(
            _cfg_context(model_for("fp8_current"))
        )
    where = "model" if form == "provider" else "model.transformer"
    assert err.value.key in (f"{where}.fp8", f"{where}.fp8_recipe")
    assert "fp8_blockwise" in str(err.value) and "\n" not in str(err.value)
    bf16 = TransformerConfig(**MODEL)
    with pytest.raises(FP8ConfigError) as err:
        FP8ScaleRefreshBridgeCallback("mxfp8").on_train_start(
            _cfg_context(bf16 if form == "provider" else GPTModelConfigStandIn(transformer=bf16))
        )
    assert err.value.key == f"{where}.fp8"


GPT_CONFIG_YAML = """\
fp8: {recipe: fp8_blockwise, bf16_layers: {modules: ["*.linear_qkv"]}}
model:
  _target_: megatron.training.models.gpt.GPTModelConfig
  vocab_size: 32000
  transformer:
    _target_: megatron.core.transformer.TransformerConfig
    num_layers: 4
"""


def test_transformer_section_of_both_yaml_forms():
    gpt = yaml.safe_load(GPT_CONFIG_YAML)
    section, where = bridge.transformer_section(gpt)
    assert section is gpt["model"]["transformer"] and where == "model.transformer."
    provider = {"model": {"_target_": "megatron.bridge.models.llama.Llama3ModelProvider8B"}}
    section, where = bridge.transformer_section(provider)
    assert section is provider["model"] and where == "model."
    empty = {}
    section, where = bridge.transformer_section(empty)
    assert empty == {"model": {}} and where == "model."
    with pytest.raises(FP8ConfigError) as err:
        bridge.transformer_section({"model": {"_target_": "x.GPTModelConfig", "transformer": 3}})
    assert err.value.key == "model.transformer"


def test_layer_count_check_reads_the_nested_transformer(tmp_path):
    text = GPT_CONFIG_YAML.replace('modules: ["*.linear_qkv"]', "first: 5")
    with pytest.raises(FP8ConfigError) as err:
        _apply(tmp_path, text)
    assert err.value.key == "fp8.bf16_layers.first"
    assert "model.transformer.num_layers" in str(err.value)


def test_apply_puts_quant_recipe_in_the_nested_transformer(tmp_path):
    out = _apply(tmp_path, GPT_CONFIG_YAML).data
    assert "quant_recipe" not in out["model"]
    assert out["model"]["transformer"]["quant_recipe"]["patterns"] == ["*.linear_qkv"]

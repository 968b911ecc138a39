"""What a config may make a host import and call, and which files the plugin reads.

``_target_``: Megatron-Bridge refuses a ``_target_`` outside its allow-list;
``register()`` used to allow the whole ``nemo_fp8_plugin`` prefix, under which
``nemo_fp8_plugin.<module>.os.system`` resolves (the package's modules import ``os``).
Now it allows exactly the callables of :mod:`nemo_fp8_plugin.hosts.targets` (Bridge's exact
list, or that module as a prefix on a Bridge without one), and every ``_target_`` the plugin
writes names one of them. The FP8 fields are merged only into the host's own precision class,
named by its exact import path. Files: checkpoints are read from safetensors only, index
entries stay inside the checkpoint directory, and only regular files are opened.

Bridge's ``utils/instantiate_utils.py`` is the real file from the 0.6.2 wheel; it imports
Megatron-LM's ``megatron.training.config.instantiate_utils`` (no CPU-installable
distribution), stubbed below with an allow-list of the semantics Bridge's calls imply.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest
import yaml

from conftest import unblock_fifo_later, upstream_file
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.hosts import bridge, nemo2, targets

WHEEL = "megatron_bridge-0.6.2-*.whl"
GADGETS = [
    "nemo_fp8_plugin.hosts.megatron.os.system",
    "nemo_fp8_plugin.config.copy.deepcopy",
    "nemo_fp8_plugin.rl.export.shutil.rmtree",
    "nemo_fp8_plugin.hosts.targets.os.system",
    "nemo_fp8_plugin._io.os.replace",
]


class _Allowlist:
    """Megatron-LM's ``target_allowlist`` as Bridge 0.6.2 uses it: prefixes and exact
    names (``_TARGET_ALLOWLIST_MUTATORS``: add_prefix, add_exact, ...)."""

    def __init__(self, exact: bool = True):
        self.allowed_prefixes: set[str] = set()
        self.exact: set[str] = set()
        if not exact:  # an older Bridge: prefixes only
            self.add_exact = None

    def add_prefix(self, prefix):
        self.allowed_prefixes.add(prefix)

    def add_exact(self, name):
        self.exact.add(name)

    def is_allowed(self, target):
        return target in self.exact or any(target.startswith(p) for p in self.allowed_prefixes)


def _bridge_instantiate_utils(tmp_path, monkeypatch, *, exact: bool = True):
    """Bridge 0.6.2's real instantiate_utils.py, over a stub of Megatron-LM's module."""

    class InstantiationError(Exception):
        pass

    mlm = types.ModuleType("megatron.training.config.instantiate_utils")
    for name in (
        "InstantiationMode",
        "_call_target",
        "_convert_node",
        "_convert_target_to_string",
        "_extract_pos_args",
        "_filter_kwargs_for_target",
        "_is_target",
        "_Keys",
        "_locate",
        "_prepare_input_dict_or_list",
        "instantiate",
        "instantiate_node",
        "_resolve_target",
    ):
        setattr(mlm, name, object())
    mlm.InstantiationException = InstantiationError
    mlm.target_allowlist = _Allowlist(exact)
    training = types.ModuleType("megatron.training")
    config = types.ModuleType("megatron.training.config")
    training.config, config.instantiate_utils = config, mlm
    for name, module in (
        ("megatron.training", training),
        ("megatron.training.config", config),
        ("megatron.training.config.instantiate_utils", mlm),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    path = upstream_file(WHEEL, "megatron/bridge/utils/instantiate_utils.py", tmp_path)
    spec = importlib.util.spec_from_file_location("bridge_instantiate_utils_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, InstantiationError


def _no_recipes():
    return types.SimpleNamespace(MIXED_PRECISION_RECIPES={}, register=lambda f: f)


@pytest.mark.parametrize("exact", [True, False], ids=["exact-list", "prefix-only"])
def test_bridge_allows_the_plugins_callables_and_nothing_else(tmp_path, monkeypatch, exact):
    """Through Bridge's own ``_validate_target_prefix``: before, the package prefix let
    ``nemo_fp8_plugin.hosts.megatron.os.system`` through."""
    utils, refused = _bridge_instantiate_utils(tmp_path, monkeypatch, exact=exact)
    bridge.register(_no_recipes(), names=[], instantiate_module=utils)
    for target in bridge.ALLOWED_TARGETS:
        utils._validate_target_prefix(target=target, full_key="model.quant_recipe")
    for gadget in GADGETS:
        if not exact and gadget.startswith(bridge.TARGET_PREFIX + "."):
            # allowed by name under the prefix, and nothing there: the module imports nothing
            assert not hasattr(targets, gadget.split(".")[3])
            continue
        with pytest.raises(refused):
            utils._validate_target_prefix(target=gadget, full_key="model.quant_recipe")
    allow = utils.target_allowlist
    assert not any(p in ("nemo_fp8_plugin", "nemo_fp8_plugin.") for p in allow.allowed_prefixes)
    if exact:  # the exact list where Bridge has one: no prefix of ours at all
        assert set(bridge.ALLOWED_TARGETS) <= allow.exact
        assert not any(p.startswith("nemo_fp8_plugin") for p in allow.allowed_prefixes)


def test_the_wheel_has_the_exact_allow_list():
    """Bridge 0.6.2 re-exports megatron-core's ``target_allowlist`` with ``add_exact``."""
    import tempfile

    path = upstream_file(
        WHEEL, "megatron/bridge/utils/instantiate_utils.py", Path(tempfile.mkdtemp())
    )
    text = path.read_text()
    assert "target_allowlist," in text and '"add_exact"' in text
    # Private segments are refused whatever the allow-list: so the module's name is public.
    assert "private target path segments are not supported" in text
    assert not any(part.startswith("_") for part in bridge.TARGET_PREFIX.split("."))


def test_the_targets_module_holds_only_its_callables():
    tree = ast.parse(Path(targets.__file__).read_text())
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not imports, "hosts/targets.py must import nothing at module level"
    public = {n for n in vars(targets) if not n.startswith("_")}
    assert public == set(targets.__all__)
    assert [f"{bridge.TARGET_PREFIX}.{n}" for n in targets.__all__] == list(bridge.ALLOWED_TARGETS)
    for name in targets.__all__:
        fn = getattr(targets, name)
        assert callable(fn) and fn.__module__ == targets.__name__
        assert not [a for a in dir(fn) if not a.startswith("_")], name  # no path onwards


def _targets_in(node, found):
    if isinstance(node, dict):
        if isinstance(node.get("_target_"), str):
            found.add(node["_target_"])
        for value in node.values():
            _targets_in(value, found)
    elif isinstance(node, list):
        for value in node:
            _targets_in(value, found)
    return found


@pytest.mark.parametrize("host", ["bridge", "nemo2"])
def test_every_target_the_plugin_writes_is_allowed_and_resolves(tmp_path, capsys, host):
    cfg = tmp_path / "in.yaml"
    cfg.write_text(
        "fp8: {recipe: fp8_blockwise, bf16_layers: {modules: ['*.linear_qkv']}}\n"
        "model: {num_layers: 4}\n" + ("trainer: {}\n" if host == "nemo2" else "")
    )
    out = tmp_path / "out.yaml"
    assert main(["apply", str(cfg), "--host", host, "-o", str(out)]) == 0
    written = _targets_in(yaml.safe_load(out.read_text()), set())
    ours = {t for t in written if t.startswith("nemo_fp8_plugin")}
    assert ours, written  # the quant_recipe call
    assert ours <= set(bridge.ALLOWED_TARGETS), ours
    assert nemo2.QUANT_RECIPE_TARGET in bridge.ALLOWED_TARGETS
    for target in ours:
        module, _, name = target.rpartition(".")
        assert getattr(importlib.import_module(module), name) is getattr(targets, name)


@pytest.mark.host
def test_the_quant_recipe_target_builds_megatron_cores_recipe_config():
    from megatron.core.quantization.quant_config import RecipeConfig

    assert isinstance(targets.bf16_quant_recipe(["*.linear_qkv"]), RecipeConfig)


# --------------------------------------------------------------------------- merge targets


@pytest.mark.parametrize(
    "target, ok",
    [
        (None, True),
        (bridge.MIXED_PRECISION_TARGET, True),
        ("megatron.bridge.training.config.MixedPrecisionConfig", True),
        ("subprocess.Popen", False),
        ("os.system", False),
        ("evil.MixedPrecisionConfig", False),
        (["megatron.bridge.training.mixed_precision.MixedPrecisionConfig"], False),
    ],
)
def test_bridge_merges_only_into_its_own_class(tmp_path, capsys, target, ok):
    block = {"bf16": True} if target is None else {"_target_": target, "bf16": True}
    cfg = tmp_path / "in.yaml"
    cfg.write_text(yaml.safe_dump({"precision": "fp8_blockwise", "mixed_precision": block}))
    rc = main(["apply", str(cfg), "--host", "bridge", "-o", str(tmp_path / "out.yaml")])
    err = capsys.readouterr().err
    assert rc == (0 if ok else 2), err
    if not ok:
        assert "mixed_precision._target_" in err and "MixedPrecisionConfig" in err


def test_bridges_second_path_is_a_re_export():
    """``megatron.bridge.training.config`` imports the class from ``mixed_precision``."""
    import tempfile

    path = upstream_file(WHEEL, "megatron/bridge/training/config.py", Path(tempfile.mkdtemp()))
    tree = ast.parse(path.read_text())
    assert any(
        isinstance(n, ast.ImportFrom)
        and n.module == "megatron.bridge.training.mixed_precision"
        and "MixedPrecisionConfig" in [a.name for a in n.names]
        for n in tree.body
    )


@pytest.mark.parametrize(
    "plugins, ok",
    [
        ({"_target_": nemo2.PLUGIN_TARGET}, True),
        ({"_target_": "nemo.lightning.MegatronMixedPrecision"}, True),
        ([{"_target_": "some.OtherPlugin"}], True),
        ({"_target_": "evil.MegatronMixedPrecision"}, False),
        ([{"_target_": "os.MegatronMixedPrecisionLauncher"}], False),
        (
            {"_target_": "nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecisionX"},
            False,
        ),
    ],
)
def test_nemo2_merges_only_into_megatron_mixed_precision(tmp_path, capsys, plugins, ok):
    """Before, any ``_target_`` ending in ``MegatronMixedPrecision`` was taken for NeMo's."""
    cfg = tmp_path / "in.yaml"
    cfg.write_text(yaml.safe_dump({"precision": "fp8_current", "trainer": {"plugins": plugins}}))
    rc = main(["apply", str(cfg), "--host", "nemo2", "-o", str(tmp_path / "out.yaml")])
    err = capsys.readouterr().err
    assert rc == (0 if ok else 2), err
    if not ok:
        assert "trainer.plugins._target_" in err


@pytest.mark.host
def test_every_accepted_nemo2_path_is_nemos_class():
    classes = set()
    for path in nemo2.PLUGIN_TARGETS:
        module, _, name = path.rpartition(".")
        classes.add(getattr(importlib.import_module(module), name))
    assert len(classes) == 1


# --------------------------------------------------------------------------- checkpoint files


def _tiny_checkpoint(root: Path, files=("model.safetensors",), index=None):
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(files):
        save_file(
            {f"model.layers.{i}.mlp.down_proj.weight": torch.ones(128, 128)}, str(root / name)
        )
    if index is not None:
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (root / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 128,
                "intermediate_size": 128,
            }
        )
    )


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABSOLUTE", "sub/model.safetensors"])
def test_index_entries_stay_inside_the_checkpoint(tmp_path, capsys, entry):
    """Before, an index naming ``../outside.safetensors`` made analyze and export read it."""
    from nemo_fp8_plugin import FP8ConfigError
    from nemo_fp8_plugin.rl import export_fp8_checkpoint

    _tiny_checkpoint(tmp_path, files=("outside.safetensors",))  # a file beside the checkpoint
    (tmp_path / "ckpt" / "sub").mkdir(parents=True)
    _tiny_checkpoint(tmp_path / "ckpt" / "sub")
    if entry == "ABSOLUTE":
        entry = str(tmp_path / "outside.safetensors")
    _tiny_checkpoint(
        tmp_path / "ckpt",
        files=("model-1.safetensors",),
        index={
            "model.layers.0.mlp.down_proj.weight": "model-1.safetensors",
            "model.layers.9.mlp.down_proj.weight": entry,
        },
    )
    rc = main(["analyze", str(tmp_path / "ckpt"), "--no-progress", "--recipes", "fp8_blockwise"])
    err = capsys.readouterr().err
    assert rc == 2 and "CHECKPOINT" in err and "not a file of" in err, err
    with pytest.raises(FP8ConfigError, match="not a file of") as info:
        export_fp8_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert info.value.key == "source"
    assert not (tmp_path / "out").exists()


# A time limit of its own: a regression that reads the FIFO is unblocked by the writer
# after 3 s and fails here, and one that hangs costs 20 s, not the suite's 1200 s per test.
@pytest.mark.timeout(20)
@pytest.mark.parametrize("where", ["shard", "index-shard", "config.json"])
def test_a_fifo_in_a_checkpoint_is_refused_not_read(tmp_path, capsys, where):
    """A FIFO blocks its reader until someone writes: before, analyze and export hung."""
    from nemo_fp8_plugin import FP8ConfigError
    from nemo_fp8_plugin.rl import export_fp8_checkpoint

    ckpt = tmp_path / "ckpt"
    index = {
        "model.layers.0.mlp.down_proj.weight": "model.safetensors",
        "model.layers.1.mlp.down_proj.weight": "fifo.safetensors",
    }
    _tiny_checkpoint(ckpt, index=index if where == "index-shard" else None)
    fifo = ckpt / ("config.json" if where == "config.json" else "fifo.safetensors")
    if fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo)
    writer = unblock_fifo_later(fifo)
    if where != "config.json":
        rc = main(["analyze", str(ckpt), "--no-progress", "--recipes", "fp8_blockwise"])
        err = capsys.readouterr().err
        assert rc == 2 and "FIFO" in err, err
    with pytest.raises(FP8ConfigError, match="FIFO"):
        export_fp8_checkpoint(ckpt, tmp_path / "out")
    assert not writer.found_reader, "the FIFO was opened for reading"


@pytest.mark.slow
def test_activations_load_safetensors_only_never_a_pickle(tmp_path, capsys):
    """``--activations`` builds the model with transformers, which (before) fell back to
    ``pytorch_model.bin``, a pickle, when the safetensors file had another name."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=128,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=256,
    )
    model = transformers.LlamaForCausalLM(config)
    model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")  # what transformers would unpickle
    save_file(
        {k: v for k, v in state.items() if "proj" in k}, str(tmp_path / "weights.safetensors")
    )
    (tmp_path / "ids.json").write_text(json.dumps([[1, 2, 3, 4]]))
    rc = main(
        [
            "analyze",
            str(tmp_path),
            "--activations",
            "--samples",
            str(tmp_path / "ids.json"),
            "--no-progress",
            "--recipes",
            "fp8_blockwise",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--activations" in err, err

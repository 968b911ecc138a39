"""NeMo 2 adapter: the real ``nemo`` command (NeMo-Run 0.x, nemo-toolkit 2.7.3) on CPU.

Cost: every ``nemo`` start imports ``nemo.collections.llm`` (~30 s of CPU). The module
fixture starts two processes at once: the real ``nemo`` console script for ``nemo llm finetune
--factory llama32_1b_fp8_blockwise --to-yaml`` (the entry-point path as users type it), and
one process that runs NeMo-Run's ``nemo`` app object (the object that script calls) in-process
for the other invocations (the other recipes' factory variants, plugin factories by import
path, the callback factory, a pretrain variant, and YAML written by ``nemo-fp8 apply --host
nemo2`` loaded back with ``--yaml``), paying the import once. About 60 s of CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from nemo_fp8_plugin import FP8ConfigError, get_recipe
from nemo_fp8_plugin._io import dump_yaml
from nemo_fp8_plugin.hosts import apply_path, nemo2
from presets import FP8_PRESETS

pytestmark = pytest.mark.host

RECIPES = FP8_PRESETS
NEMO = Path(sys.executable).with_name("nemo")
THROUGH_THE_SCRIPT = "fp8_blockwise"
"""The recipe whose factory variant runs through the installed ``nemo`` script; the others run
through the same app object in one process."""
STOCK = "llama32_1b"  # Llama 3.2 1B: 16 layers
EXAMPLE = (
    Path(__file__).parents[3] / "conf" / "examples" / "nemo2_llama32_1b_finetune_fp8_blockwise.yaml"
)

EXPECTED = {  # MegatronMixedPrecision arguments each recipe must produce (NeMo's own names)
    "fp8_delayed": dict(
        fp8="hybrid",
        fp8_recipe="delayed",
        fp8_amax_history_len=1024,
        fp8_amax_compute_algo="max",
        fp8_param_gather=True,
        first_last_layers_bf16=False,
    ),
    "fp8_current": dict(
        fp8="hybrid",
        fp8_recipe="tensorwise",
        fp8_param_gather=True,
        first_last_layers_bf16=True,
        num_layers_at_start_in_bf16=1,
        num_layers_at_end_in_bf16=1,
    ),
    "fp8_subchannel": dict(
        fp8="hybrid", fp8_recipe="blockwise", fp8_param_gather=False, first_last_layers_bf16=False
    ),
    "fp8_blockwise": dict(
        fp8="e4m3",
        fp8_recipe="blockwise",
        fp8_param_gather=False,
        first_last_layers_bf16=False,
        num_layers_at_start_in_bf16=0,
        num_layers_at_end_in_bf16=0,
    ),
    "mxfp8": dict(
        fp8="e4m3",
        fp8_recipe="mxfp8",
        fp8_param_gather=True,
        reuse_grad_buf_for_mxfp8_param_ag=True,
        first_last_layers_bf16=False,
    ),
}

IN_PROCESS = textwrap.dedent("""
    import json, sys
    invocations = json.loads(sys.argv[1])
    sys.argv = ["nemo", "llm", "finetune"]  # as the console script sees it
    from nemo_run.__main__ import app  # the object the `nemo` console script runs

    def call(args):
        try:
            app(args=args, standalone_mode=False)
            return 0
        except SystemExit as exc:
            return exc.code or 0

    results = {}
    for name, args in invocations.items():
        results[name] = call(args)
    print("RESULTS " + json.dumps(results))
""")


def _plugin(doc):
    plugins = doc["trainer"]["plugins"]
    assert plugins["_target_"] == nemo2.PLUGIN_TARGET
    return plugins


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("nemo2")
    overlay_request = work / "overlay_request.yaml"
    overlay_request.write_text(
        "fp8:\n  recipe: fp8_blockwise\n  bf16_layers: {first: 2, modules: ['*.linear_qkv']}\n"
    )
    (work / "overlay.yaml").write_text(dump_yaml(apply_path(nemo2.ADAPTER, overlay_request).data))
    (work / "example.yaml").write_text(dump_yaml(apply_path(nemo2.ADAPTER, EXAMPLE).data))
    invocations = {
        f"plugin_{r}": [
            "llm",
            "finetune",
            "--factory",
            STOCK,
            f"trainer.plugins=nemo_fp8_plugin.hosts.nemo2.factories.{r}",
            "--to-yaml",
            f"plugin_{r}.yaml",
            "-y",
        ]
        for r in RECIPES
    }
    invocations["callback"] = [
        "llm",
        "finetune",
        "--factory",
        STOCK,
        "trainer.callbacks=[nemo_fp8_plugin.hosts.nemo2.factories.fp8_blockwise_callback]",
        "--to-yaml",
        "callback.yaml",
        "-y",
    ]
    invocations["pretrain"] = [
        "llm",
        "pretrain",
        "--factory",
        "llama31_8b_fp8_current",
        "--to-yaml",
        "pretrain.yaml",
        "-y",
    ]
    invocations["overlay"] = [
        "llm",
        "finetune",
        "--factory",
        STOCK,
        "--yaml",
        "overlay.yaml",
        "--to-yaml",
        "overlay_out.yaml",
        "-y",
    ]
    # The FP8 variant as the factory under the same overlay: its callback joins the stock ones.
    invocations["overlay_variant"] = [
        *("llm", "finetune", "--factory", f"{STOCK}_fp8_blockwise", "--yaml", "overlay.yaml"),
        *("--to-yaml", "overlay_variant_out.yaml", "-y"),
    ]
    invocations["example"] = [
        *("llm", "finetune", "--factory", STOCK, "--yaml", "example.yaml"),
        *("--to-yaml", "example_out.yaml", "-y"),
    ]
    # the other recipes' factory variants, through the same app object
    for r in RECIPES:
        if r != THROUGH_THE_SCRIPT:
            invocations[r] = [
                *("llm", "finetune", "--factory", f"{STOCK}_{r}"),
                *("--to-yaml", f"{r}.yaml", "-y"),
            ]
    import json

    env = dict(os.environ, NEMORUN_HOME=str(work / "nemorun"))
    r = THROUGH_THE_SCRIPT
    procs = {
        r: subprocess.Popen(
            [str(NEMO), "llm", "finetune", "--factory", f"{STOCK}_{r}"]
            + ["--to-yaml", f"{r}.yaml", "-y"],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    }
    procs["in_process"] = subprocess.Popen(
        [sys.executable, "-c", IN_PROCESS, json.dumps(invocations)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    logs = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        logs[name] = (proc.returncode, out)
    return work, logs


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.slow
def test_nemo_cli_variant_to_yaml(runs, recipe):
    """`nemo llm finetune --factory llama32_1b_<recipe> --to-yaml out.yaml -y`: the real command
    (fp8_blockwise), or the app object it runs."""
    work, logs = runs
    if recipe == THROUGH_THE_SCRIPT:
        rc, out = logs[recipe]
    else:
        work, results, out = _in_process(runs)
        rc = results[recipe]
    assert rc == 0, out[-3000:]
    doc = yaml.safe_load((work / f"{recipe}.yaml").read_text())
    plugin = _plugin(doc)
    for key, want in EXPECTED[recipe].items():
        assert plugin[key] == want, key
    assert plugin["precision"] == "bf16-mixed"  # the stock recipe's own plugin, kept
    callbacks = doc["trainer"]["callbacks"]
    assert {"_target_": nemo2.CALLBACK_TARGET, "recipe": recipe} in callbacks
    assert any(c["_target_"].endswith("TimingCallback") for c in callbacks)  # stock ones kept
    assert doc["model"]["config"]["_target_"].endswith("Llama32Config1B")
    assert "fp8" not in doc["model"]["config"]  # precision is never set on model.config


def _in_process(runs):
    work, logs = runs
    rc, out = logs["in_process"]
    assert rc == 0, out[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("RESULTS ")][-1]
    import json

    return work, json.loads(line[len("RESULTS ") :]), out


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.slow
def test_trainer_plugins_dotted_path(runs, recipe):
    work, results, out = _in_process(runs)
    assert results[f"plugin_{recipe}"] == 0, out[-3000:]
    plugin = _plugin(yaml.safe_load((work / f"plugin_{recipe}.yaml").read_text()))
    for key, want in EXPECTED[recipe].items():
        assert plugin[key] == want, key
    # The plugin alone checks nothing in the training process, and the factory says so.
    said = f"factories.{recipe} sets the precision plugin only" in out
    assert said == (recipe in ("fp8_current", "fp8_subchannel", "fp8_blockwise")), out[-3000:]


@pytest.mark.slow
def test_callback_factory_on_the_command_line(runs):
    work, results, out = _in_process(runs)
    assert results["callback"] == 0, out[-3000:]
    callbacks = yaml.safe_load((work / "callback.yaml").read_text())["trainer"]["callbacks"]
    assert callbacks == [{"_target_": nemo2.CALLBACK_TARGET, "recipe": "fp8_blockwise"}]


@pytest.mark.slow
def test_pretrain_variant(runs):
    work, results, out = _in_process(runs)
    assert results["pretrain"] == 0, out[-3000:]
    doc = yaml.safe_load((work / "pretrain.yaml").read_text())
    assert doc["_target_"] == "nemo.collections.llm.api.pretrain"
    plugin = _plugin(doc)
    assert (plugin["fp8_recipe"], plugin["num_layers_at_end_in_bf16"]) == ("tensorwise", 1)


@pytest.mark.slow
def test_applied_yaml_loads_back_through_nemo_run(runs):
    """`nemo-fp8 apply --host nemo2` output, given to `nemo llm finetune --yaml`."""
    work, results, out = _in_process(runs)
    assert results["overlay"] == 0, out[-3000:]
    doc = yaml.safe_load((work / "overlay_out.yaml").read_text())
    plugin = _plugin(doc)
    assert (plugin["fp8"], plugin["fp8_recipe"], plugin["num_layers_at_start_in_bf16"]) == (
        "e4m3",
        "blockwise",
        2,
    )
    quant = doc["model"]["config"]["quant_recipe"]
    assert quant == {"_target_": nemo2.QUANT_RECIPE_TARGET, "patterns": ["*.linear_qkv"]}
    # merged into the factory's own plugin, not a new one: the fields only the factory sets
    # (NeMo-Run's --to-yaml writes the arguments a Config was given) are still there
    assert (plugin["precision"], plugin["autocast_enabled"], plugin["grad_reduce_in_fp32"]) == (
        "bf16-mixed",
        False,
        True,
    )


@pytest.mark.slow
def test_overlay_on_the_fp8_variant_keeps_the_stock_callbacks(runs):
    """`--factory llama32_1b_fp8_blockwise --yaml OUT`, the form apply's note gives: the overlay's
    BF16 edge layer on the variant's plugin, the stock callbacks and the FP8 check together."""
    work, results, out = _in_process(runs)
    assert results["overlay_variant"] == 0, out[-3000:]
    doc = yaml.safe_load((work / "overlay_variant_out.yaml").read_text())
    plugin = _plugin(doc)
    assert (plugin["num_layers_at_start_in_bf16"], plugin["first_last_layers_bf16"]) == (2, True)
    assert (plugin["autocast_enabled"], plugin["grad_reduce_in_fp32"]) == (False, True)
    callbacks = [c["_target_"] for c in doc["trainer"]["callbacks"]]
    assert callbacks == ["nemo.utils.exp_manager.TimingCallback", nemo2.CALLBACK_TARGET]


@pytest.mark.slow
def test_the_shipped_nemo2_example_loads_through_nemo_run(runs):
    """conf/examples/nemo2_llama32_1b_finetune_fp8_blockwise.yaml through apply, then given to
    `nemo llm finetune --factory llama32_1b --yaml` as its header says: its own keys and the
    plugin's FP8 fields reach the recipe."""
    work, results, out = _in_process(runs)
    assert results["example"] == 0, out[-3000:]
    doc = yaml.safe_load((work / "example_out.yaml").read_text())
    assert doc["trainer"]["max_steps"] == 200
    plugin = _plugin(doc)
    assert (plugin["fp8"], plugin["fp8_recipe"]) == ("e4m3", "blockwise")


# --------------------------------------------------------------------------- no NeMo import


@pytest.mark.parametrize("recipe", RECIPES)
def test_plugin_fields(recipe):
    fields = nemo2.plugin_fields(get_recipe(recipe)).keys
    for key, want in EXPECTED[recipe].items():
        assert fields[key] == want, key


def _apply(tmp_path, text, name="in.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return apply_path(nemo2.ADAPTER, path)


NEMO_RUN_YAML = """\
precision: fp8_blockwise
trainer:
  devices: 8
  plugins:
    _target_: nemo.lightning.pytorch.plugins.mixed_precision.MegatronMixedPrecision
    precision: bf16-mixed
    grad_reduce_in_fp32: false
model:
  config:
    seq_length: 4096
"""


def test_apply_updates_the_existing_plugin_and_is_idempotent(tmp_path):
    result = _apply(tmp_path, NEMO_RUN_YAML)
    out = result.data
    plugin = out["trainer"]["plugins"]
    assert plugin["grad_reduce_in_fp32"] is False  # the config's own choice survives
    assert (plugin["fp8"], plugin["fp8_recipe"]) == ("e4m3", "blockwise")
    assert out["trainer"]["devices"] == 8 and out["model"] == {"config": {"seq_length": 4096}}
    assert "precision" not in out
    assert any(
        "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in w and "fp8_blockwise_callback" in w
        for w in map(str, result.notes)
    )
    assert _apply(tmp_path, yaml.safe_dump(out, sort_keys=False), "again.yaml").data == out


def test_without_a_plugin_apply_writes_an_overlay_that_merges(tmp_path):
    """No ``_target_`` (NeMo-Run would replace the factory's plugin with a new one) and every
    FP8 argument written (the factory's plugin, not NeMo's defaults, holds omitted ones)."""
    result = _apply(tmp_path, "precision: fp8_delayed\n")
    plugin = result.data["trainer"]["plugins"]
    assert "_target_" not in plugin and "precision" not in plugin
    assert plugin == nemo2.plugin_fields(get_recipe("fp8_delayed")).keys
    assert plugin["first_last_layers_bf16"] is False  # NeMo's default, written all the same
    again = _apply(tmp_path, yaml.safe_dump(result.data, sort_keys=False), "again.yaml")
    assert again.data == result.data


def test_apply_into_a_plugin_list_builds_a_whole_plugin(tmp_path):
    text = "precision: mxfp8\ntrainer: {plugins: [{_target_: some.OtherPlugin}]}\n"
    plugin = _apply(tmp_path, text).data["trainer"]["plugins"][1]
    assert plugin["_target_"] == nemo2.PLUGIN_TARGET
    assert plugin["params_dtype"] == "torch.bfloat16" and plugin["fp8_recipe"] == "mxfp8"


def test_apply_finds_the_plugin_in_a_list(tmp_path):
    text = (
        "precision: fp8_current\ntrainer:\n  plugins:\n  - {_target_: some.OtherPlugin}\n"
        f"  - {{_target_: {nemo2.PLUGIN_TARGET}, precision: bf16-mixed}}\n"
    )
    plugins = _apply(tmp_path, text).data["trainer"]["plugins"]
    assert plugins[0] == {"_target_": "some.OtherPlugin"}
    assert plugins[1]["fp8_recipe"] == "tensorwise"


@pytest.mark.parametrize(
    "native,key",
    [
        ("fp8_recipe: delayed", "trainer.plugins.fp8_recipe"),
        ("fp8: hybrid", "trainer.plugins.fp8"),
        ("fp4: e2m1", "trainer.plugins.fp4"),
        ("fp8_params: true", "trainer.plugins.fp8_params"),
    ],
)
def test_apply_refuses_conflicting_plugin_keys(tmp_path, native, key):
    text = (
        "precision: fp8_blockwise\ntrainer:\n  plugins:\n"
        f"    _target_: {nemo2.PLUGIN_TARGET}\n    precision: bf16-mixed\n    {native}\n"
    )
    with pytest.raises(FP8ConfigError) as err:
        _apply(tmp_path, text)
    assert err.value.key == key


def test_apply_refuses_a_foreign_plugin_and_dropped_settings(tmp_path):
    with pytest.raises(FP8ConfigError) as err:
        _apply(tmp_path, "precision: mxfp8\ntrainer: {plugins: {_target_: x.Y}}\n")
    assert err.value.key == "trainer.plugins"
    with pytest.raises(FP8ConfigError) as err:
        _apply(tmp_path, "fp8: {recipe: fp8_current, amax_epsilon: 1.0e-6}\n")
    assert err.value.key == "fp8.amax_epsilon"


def test_plugin_only_warning_names_the_variable_and_the_callback():
    text = nemo2.plugin_only_warning(get_recipe("fp8_blockwise"))
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in text
    assert (
        "trainer.callbacks=[nemo_fp8_plugin.hosts.nemo2.factories.fp8_blockwise_callback]" in text
    )
    assert nemo2.plugin_only_warning(get_recipe("mxfp8")) is None  # TE reads no variable for it


def test_apply_refuses_fp8_wgrad_false_and_too_many_bf16_layers(tmp_path):
    with pytest.raises(FP8ConfigError) as err:
        _apply(tmp_path, "fp8: {recipe: fp8_delayed, fp8_wgrad: false}\n")
    assert err.value.key == "fp8.fp8_wgrad"
    with pytest.raises(FP8ConfigError) as err:
        _apply(
            tmp_path,
            "fp8: {recipe: fp8_blockwise, bf16_layers: {first: 40}}\n"
            "model: {config: {num_layers: 4}}\n",
        )
    assert err.value.key == "fp8.bf16_layers.first"
    assert "model.config.num_layers) has 4" in str(err.value)


def test_native_keys():
    keys = nemo2.ADAPTER.spell(get_recipe("fp8_current")).keys
    assert keys["trainer"]["plugins"]["first_last_layers_bf16"] is True
    assert "model" not in keys

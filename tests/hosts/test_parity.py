"""Parity across entry points: every recipe, built-in and one from the
``nemo_fp8_plugin.recipes`` entry-point group, on every host, through every entry point that
host has, gets the same refusal (the same key) or the same keys; ``spell`` is exactly what
``merge`` writes; ``explain`` and ``apply`` agree on every check, the model-shape checks
included, whatever the working directory.

Entry points: ``apply`` (the pipeline on a fresh config of the host, asking ``precision:
<recipe>``), :func:`nemo_fp8_plugin.hosts.recipe_keys` (what code starting from a recipe
calls), and each host's own: NeMo 2's ``plugin_config`` (the ``trainer.plugins=...factories.
<recipe>`` factory) and ``FP8ScaleRefreshCallback``; Bridge's ``mixed_precision_config``
(what ``register`` adds) and ``FP8ScaleRefreshBridgeCallback``; megatron-core's
``build_transformer_config``; vLLM's ``engine_kwargs``.
"""

from __future__ import annotations

import copy
import json
import warnings
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import yaml

from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.dotted import flatten, get_path
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import (
    ADAPTERS,
    NO_DEFAULT,
    HostAdapter,
    _same_value,
    apply_mapping,
    get_adapter,
    mapping_context,
    recipe_keys,
    run,
)
from nemo_fp8_plugin.hosts.nemo_rl.checks import _same
from nemo_fp8_plugin.registry import ENTRY_POINT_GROUP, default_registry, list_recipes

pytestmark = pytest.mark.torch_free

_MISSING = object()

EP_RECIPE = "ep_blockwise_eps"
"""The entry-point recipe: block FP8 with an amax epsilon, which megatron-core (so NeMo 2 and
Bridge) drops, so they refuse it, while NeMo RL, vLLM and TE take it."""


@pytest.fixture(scope="module")
def entry_point_recipe(tmp_path_factory):
    """A recipe registered through the real entry-point loader (``registry.
    _load_entry_points``): a module on ``sys.path`` and an ``EntryPoint`` naming it."""
    import importlib.metadata as metadata
    import sys

    where = tmp_path_factory.mktemp("ep")
    (where / "parity_recipes.py").write_text(
        "from nemo_fp8_plugin.registry import get_recipe\n"
        "def make():\n"
        f"    return get_recipe('fp8_blockwise').replace(name='{EP_RECIPE}', amax_epsilon=1e-4,\n"
        "        description='block FP8 with an amax floor (a test entry point)')\n"
    )
    sys.path.insert(0, str(where))
    real = metadata.entry_points
    ep = EntryPoint(EP_RECIPE, "parity_recipes:make", ENTRY_POINT_GROUP)

    def entry_points(**kw):
        return [ep] if kw.get("group") == ENTRY_POINT_GROUP else real(**kw)

    metadata.entry_points = entry_points
    try:
        default_registry(reload=True)
        assert EP_RECIPE in default_registry()
        yield EP_RECIPE
    finally:
        metadata.entry_points = real
        sys.path.remove(str(where))
        default_registry(reload=True)


def _recipes() -> list[str]:
    return [s.name for s in list_recipes()] + [EP_RECIPE]


def fresh_config(host: str, recipe: str) -> dict:
    """A config of ``host`` with no native FP8 key, asking for ``recipe``."""
    return {
        "nemo2": {"trainer": {"max_steps": 1}, "precision": recipe},
        "bridge": {"mixed_precision": recipe},
        "megatron": {"model": {"num_layers": 8}, "precision": recipe},
        "nemo-rl": {
            "policy": {
                "precision": recipe,
                "megatron_cfg": {"enabled": True},
                "generation": {"backend": "vllm", "vllm_cfg": {}},
            }
        },
        "vllm": {"model": "m", "max_model_len": 4096, "precision": recipe},
        "te": {"precision": recipe},
    }[host]


def outcome(fn, *args):
    """``("ok", fn(*args))`` or ``("refused", key)``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return "ok", fn(*args)
    except FP8ConfigError as err:
        return "refused", err.key


def same_refusal(a, b, request_keys=()) -> bool:
    """Two outcomes agree: both pass, or both refuse naming the same key (a refusal of the
    recipe as a whole is keyed ``recipe`` where there is no config, by the request key in
    one)."""
    if a[0] != b[0]:
        return False
    if a[0] == "ok":
        return True
    return a[1] == b[1] or (a[1] == "recipe" and b[1] in request_keys)


def test_the_contract_is_enforced_at_construction():
    """A host class missing an abstract method cannot be built (vLLM's QuantizationConfig
    pattern), and ``follows_defaults`` / ``runtime`` are part of the base class."""

    class Half(HostAdapter):
        name = "half"

        def refuse(self, spec, ctx):
            return None

        def spell(self, spec, ctx=None, *, model=None):
            raise AssertionError

    with pytest.raises(TypeError, match="merge"):
        Half()  # type: ignore[abstract]
    assert HostAdapter.follows_defaults is False and HostAdapter.runtime == ""
    for name in ADAPTERS:
        adapter = get_adapter(name)
        assert isinstance(adapter, HostAdapter) and adapter.name == name
        assert ADAPTERS[name] == f"nemo_fp8_plugin.hosts.{name.replace('-', '_')}:ADAPTER"


@pytest.mark.parametrize("host", list(ADAPTERS))
def test_apply_and_recipe_keys_refuse_alike_and_spell_is_what_merge_writes(
    host, entry_point_recipe
):
    adapter = get_adapter(host)
    # recipe_keys has no config, so no NeMo RL release: it spells every key the plugin knows,
    # which is main's set; what each release cannot express is test_nemo_rl_releases.py's.
    stack = {"stack": "nemo-rl-main-2026-08-22"} if host == "nemo-rl" else {}
    for recipe in _recipes():
        config = fresh_config(host, recipe)
        applied = outcome(lambda a, c: apply_mapping(a, c, **stack), adapter, config)
        direct = outcome(recipe_keys, host, recipe)
        ctx = mapping_context(config, **stack)
        assert same_refusal(direct, applied, ctx.request.keys), (host, recipe, direct, applied)
        if applied[0] == "refused":
            continue
        result = applied[1]
        spelt = adapter.spell(ctx.spec, ctx)
        # Every key spell gives is in the output, as spelt, but one the config does not set
        # whose value is what the host does without it (its own default) ...
        for key, value in flatten(spelt.keys):
            written = get_path(result.data, key, _MISSING)
            if written is _MISSING and host == "nemo-rl" and _same(key, None, value):
                continue  # NeMo RL's merge leaves out what its absent value already says
            if written is _MISSING:
                assert get_path(config, key, _MISSING) is _MISSING, (host, recipe, key)
                meant = adapter.default(key, result.data)
                assert meant is not NO_DEFAULT and _same_value(meant, value), (host, recipe, key)
                continue
            assert written == value, (host, recipe, key)
        # ... and merge writes nothing else (but the request it consumes).
        leaves = {k for k, _ in flatten(spelt.keys)}
        extra = {k for k, _ in flatten(result.written)} - leaves - {"policy.precision"}
        assert not extra, (host, recipe, extra)
        assert result.env == spelt.env


def _host_entry_points(host: str):
    """The host's own entry points that start from a recipe, as ``name -> fn(recipe)``; each
    must refuse exactly as :func:`recipe_keys` does (the ones that import a host are called
    only where the refusal comes first: the keys are checked in the host's own tests)."""
    if host == "nemo2":
        from nemo_fp8_plugin.hosts import nemo2
        from nemo_fp8_plugin.hosts.nemo2.callback import FP8ScaleRefreshCallback

        return {
            "callback": lambda r: FP8ScaleRefreshCallback(recipe=r, verify_te=False),
            "plugin_config": nemo2.plugin_config,
        }
    if host == "bridge":
        from nemo_fp8_plugin.hosts import bridge
        from nemo_fp8_plugin.hosts.bridge.callback import FP8ScaleRefreshBridgeCallback

        return {
            "callback": lambda r: FP8ScaleRefreshBridgeCallback(recipe=r, verify_te=False),
            "mixed_precision_config": bridge.mixed_precision_config,
        }
    if host == "megatron":
        from nemo_fp8_plugin.hosts import megatron

        return {"build_transformer_config": megatron.build_transformer_config}
    if host == "vllm":
        from nemo_fp8_plugin.hosts import vllm

        return {"engine_kwargs": vllm.engine_kwargs}
    return {}


@pytest.mark.parametrize(
    "host",
    [
        pytest.param("nemo2", marks=[pytest.mark.slow, pytest.mark.host]),  # Lightning, NeMo
        "bridge",
        pytest.param("megatron", marks=[pytest.mark.slow, pytest.mark.host]),  # its source
        "vllm",
    ],
)
def test_every_entry_point_refuses_what_apply_refuses(host, entry_point_recipe):
    from nemo_fp8_plugin.registry import get_recipe

    for recipe in _recipes():
        direct = outcome(recipe_keys, host, recipe)
        for name, entry in _host_entry_points(host).items():
            if direct[0] == "ok" and name != "engine_kwargs":
                continue  # would build the host's object: the host's own tests do
            got = outcome(entry, get_recipe(recipe))
            assert same_refusal(direct, got), (host, name, recipe, direct, got)
            if name == "engine_kwargs" and got[0] == "ok":
                assert got[1] == recipe_keys(host, recipe).keys


@pytest.mark.slow
@pytest.mark.host  # importing the factories module registers them with NeMo-Run and NeMo
def test_the_plugin_factory_refuses_an_entry_point_recipe_that_apply_refuses(
    entry_point_recipe, tmp_path
):
    """``trainer.plugins=nemo_fp8_plugin.hosts.nemo2.factories.<recipe>`` built
    ``MegatronMixedPrecision`` for a recipe whose amax epsilon megatron-core drops, which
    ``apply --host nemo2`` and ``--factory <model>_<recipe>`` refuse (fails before the fix:
    the factory returned the plugin)."""
    from nemo_fp8_plugin.hosts.nemo2 import factories

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(fresh_config("nemo2", entry_point_recipe)))
    with pytest.raises(FP8ConfigError) as applied:
        run(get_adapter("nemo2"), mapping_context(yaml.safe_load(cfg.read_text())))
    with pytest.raises(FP8ConfigError) as factory:
        factories.plugin_factory(entry_point_recipe)()
    assert factory.value.key == applied.value.key == "amax_epsilon"


@pytest.mark.slow
@pytest.mark.host  # NeMo-Run's Config of NeMo's own MegatronMixedPrecision
def test_the_plugin_factory_builds_the_fields_apply_writes(entry_point_recipe):
    from nemo_fp8_plugin.hosts import nemo2
    from nemo_fp8_plugin.registry import get_recipe

    for recipe in _recipes():
        direct = outcome(recipe_keys, "nemo2", recipe)
        if direct[0] != "ok":
            continue
        built = nemo2.plugin_config(get_recipe(recipe))
        applied = apply_mapping(get_adapter("nemo2"), fresh_config("nemo2", recipe))
        plugin = applied.data["trainer"]["plugins"]
        adapter = get_adapter("nemo2")
        for key, value in direct[1].keys["trainer"]["plugins"].items():
            if key == "_target_" or key in nemo2.BF16_MIXED:
                continue
            # apply leaves out an argument at MegatronMixedPrecision's own default
            meant = plugin.get(key, adapter.default(f"trainer.plugins.{key}", applied.data))
            assert getattr(built, key) == value == meant, (recipe, key)


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err


def _error_key(err: str) -> str:
    """The key of a one-line CLI error (``nemo-fp8 apply: error: KEY: message``)."""
    (line,) = [ln for ln in err.splitlines() if ": error: " in ln]
    return line.split(": error: ", 1)[1].split(": ", 1)[0]


def _hf_config(where: Path, hidden: int) -> Path:
    path = where / "config.json"
    path.write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "num_hidden_layers": 4,
                "hidden_size": hidden,
                "intermediate_size": 3072,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "vocab_size": 1024,
            }
        )
    )
    return path


SIZES = {"num_layers": 4, "hidden_size": 1008, "ffn_hidden_size": 3072, "num_attention_heads": 8}
"""megatron-core sizes whose hidden size is 16-aligned but not a multiple of MXFP8's 32."""

SHAPES = {
    "megatron model:": ({"precision": "mxfp8", "model": SIZES}, "megatron", "model.hidden_size"),
    "Megatron-LM language_model:": (
        {"precision": "mxfp8", "language_model": SIZES},
        "megatron",
        "language_model.hidden_size",
    ),
    "NeMo 2 model.config": (
        {"precision": "mxfp8", "trainer": {"max_steps": 1}, "model": {"config": SIZES}},
        "nemo2",
        "model.config.hidden_size",
    ),
    "Bridge model.transformer": (
        {"mixed_precision": "mxfp8", "model": {"transformer": SIZES}},
        "bridge",
        "model.transformer.hidden_size",
    ),
    "model file next to the config": (
        {"fp8": {"recipe": "mxfp8", "model": "config.json"}, "model": {"num_layers": 4}},
        "megatron",
        "fp8.model",
    ),
}


@pytest.mark.parametrize("case", list(SHAPES))
def test_explain_and_apply_refuse_a_model_shape_alike_from_any_directory(
    case, tmp_path, monkeypatch, capsys
):
    """apply used to write what explain refused (a hidden size MXFP8's 32-element blocks
    cannot split), for megatron-core and Bridge configs and with a model file named relative
    to the config; explain named ``model.hidden_size`` for a ``language_model:`` layout."""
    config, host, key = SHAPES[case]
    here = tmp_path / "configs"
    here.mkdir()
    _hf_config(here, 1008)
    path = here / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a model file is found next to the config, not here
    code, err = _cli(capsys, "explain", path)
    assert code == 2 and _error_key(err) == key, err
    code, err = _cli(capsys, "apply", path, "--host", host)
    assert code == 2 and _error_key(err) == key, err


def test_explain_and_apply_agree_on_layer_counts_of_a_model_file_from_any_directory(
    tmp_path, monkeypatch, capsys
):
    """``bf16_layers.first`` beyond the layers of a model file named relative to the config:
    apply read the file relative to the working directory (not found elsewhere)."""
    here = tmp_path / "configs"
    here.mkdir()
    _hf_config(here, 1024)
    path = here / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "fp8": {
                    "recipe": "fp8_blockwise",
                    "model": "config.json",
                    "bf16_layers": {"first": 9},
                },
                "model": {"hidden_size": 1024},
            }
        )
    )
    monkeypatch.chdir(tmp_path)
    explained = _cli(capsys, "explain", path)
    applied = _cli(capsys, "apply", path, "--host", "megatron")
    assert explained[0] == applied[0] == 2
    assert _error_key(explained[1]) == _error_key(applied[1]) == "fp8.bf16_layers.first"


@pytest.mark.parametrize(
    "config",
    [
        fresh_config("nemo-rl", "fp8_blockwise"),
        fresh_config("nemo2", "fp8_blockwise"),
        fresh_config("bridge", "fp8_blockwise"),
    ],
    ids=["nemo-rl", "nemo2", "bridge"],
)
def test_apply_host_vllm_refuses_a_config_of_another_host(config, tmp_path, capsys):
    """``apply --host vllm`` on a NeMo RL or NeMo 2 config used to exit 0 and write
    vLLM's keys at its root, where that host never reads them."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    before = path.read_text()
    code, err = _cli(capsys, "apply", path, "--host", "vllm", "--in-place")
    assert code == 2 and _error_key(err) == "--host", err
    assert path.read_text() == before
    vllm = copy.deepcopy(fresh_config("vllm", "fp8_blockwise"))
    assert apply_mapping(get_adapter("vllm"), vllm).data["quantization"] == "nemo_fp8"

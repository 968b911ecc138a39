"""The TE precision file: written by ``apply`` for NeMo RL, parsed by megatron-core's own code,
and keeping in BF16 exactly the modules the generation side keeps in BF16.

Host code run for real (megatron-core 0.16.1 is installed; its ``quant_config.py`` schema is
the one Megatron-LM's ``--te-precision-config-file`` and NeMo RL's
``policy.megatron_cfg.te_precision_config_file`` load, unchanged through Megatron-LM main of
2026-08: ``git diff core_v0.16.1 main -- megatron/core/quantization/`` touches only a None
guard in ``utils.py``):

* ``megatron.core.quantization.utils.load_quantization_recipe`` reads the file (YAML ->
  ``RecipeConfig``) as both hosts do;
* ``get_quant_config_or_none`` matches each module name as ``GPTModel.__init__`` does after the
  model is built, and ``TEQuantizationParams.parse_from_config`` (the TE modules' ``finish_init``)
  parses the matched config: an empty ``training_recipe`` is BF16;
* ``is_first_last_bf16_layer`` decides the first/last layers from a real ``TransformerConfig``
  with the ``model_overrides`` apply wrote;
* NeMo RL's generation side: ``_get_params_in_layers`` is taken from NeMo RL's own
  ``nemo_rl/models/generation/vllm/quantization/fp8.py`` (the snapshot's file, its function
  extracted with ``ast`` and run: the module itself imports vLLM and CUDA code); its keyword rule
  is inline in ``init_fp8`` (``any(p in n for p in quantization_ignored_layer_kws)`` over
  ``model.``-prefixed names), restated in :func:`_keyword_ignored`.

No NeMo RL release has the key yet (it arrived after 0.7.0, NVIDIA-NeMo/RL PR #3654), so the
route is driven with an assumed NeMo RL 0.8.0 (``stacks.Assumed``) and, for the CLI, a stack
row added for the test.
"""

from __future__ import annotations

import ast
import dataclasses
from functools import cache
from pathlib import Path

import pytest
import yaml

from conftest import shared_nemo_rl
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.dotted import get_path
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import get_adapter, load_context, run
from nemo_fp8_plugin.hosts.megatron import rules as megatron_rules
from nemo_fp8_plugin.hosts.megatron.precision_file import (
    FILE_SUFFIX,
    NEMO_RL_KEY,
    precision_file_path,
    precision_recipe,
)
from nemo_fp8_plugin.hosts.nemo_rl import rules as nemo_rl_rules
from nemo_fp8_plugin.registry import get_recipe
from nemo_fp8_plugin.rules import describe_model
from nemo_fp8_plugin.rules.names import builtin_high_precision

pytestmark = pytest.mark.host

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "nemo_rl"
WITH_KEY = stacks.Assumed("nemo-rl-with-te-precision-file", {"nemo-rl": "0.8.0"}, "test")
WITHOUT_KEY = stacks.Assumed("nemo-rl-0.6", {"nemo-rl": "0.6.0"}, "test")

# Rule sets run over NVIDIA's own NeMo RL configs (as parents): MLA projections (the Moonlight
# example's), a per-leaf rule with first/last layers, and one that names a layer.
RULE_SETS = {
    "mla": {"modules": ["*a_proj*", "*b_proj*"]},
    "fc2-first-last": {"modules": ["*.linear_fc2"], "first": 1, "last": 2},
    "one-layer": {"modules": ["model.layers.3.*"]},
}


# --------------------------------------------------------------------------- host code


@cache
def _megatron():
    from megatron.core.extensions.transformer_engine import TEQuantizationParams
    from megatron.core.fp8_utils import is_first_last_bf16_layer
    from megatron.core.quantization.utils import get_quant_config_or_none, load_quantization_recipe
    from megatron.core.transformer.transformer_config import TransformerConfig

    return (
        load_quantization_recipe,
        get_quant_config_or_none,
        TEQuantizationParams,
        is_first_last_bf16_layer,
        TransformerConfig,
    )


@cache
def _nemo_rl_params_in_layers():
    """NeMo RL's own ``_get_params_in_layers``, from its source file (see the module doc)."""
    path = shared_nemo_rl("src/nemo_rl/models/generation/vllm/quantization/fp8.py")
    tree = ast.parse(path.read_text())
    (fn,) = [
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_get_params_in_layers"
    ]
    namespace: dict = {}
    exec(compile(ast.Module([fn], []), str(path), "exec"), namespace)
    return namespace["_get_params_in_layers"]


def _keyword_ignored(names, keywords) -> set[str]:
    # NeMo RL init_fp8: [n for n in param_names if any(p in n for p in kws)]
    return {n for n in names if any(k in n for k in keywords)}


def trainer_bf16(model, file: Path | None, overrides: dict) -> set[str]:
    """Megatron module names megatron-core runs in BF16 given the file and the first/last
    fields (routers and the output layer are never FP8 there and are left out)."""
    load, match, params, first_last, transformer_config = _megatron()
    recipe = load(str(file)) if file is not None else None
    config = transformer_config(
        num_layers=model.num_layers,
        hidden_size=64,
        num_attention_heads=4,
        first_last_layers_bf16=bool(overrides.get("first_last_layers_bf16", False)),
        num_layers_at_start_in_bf16=overrides.get("num_layers_at_start_in_bf16", 0),
        num_layers_at_end_in_bf16=overrides.get("num_layers_at_end_in_bf16", 0),
    )
    out = set()
    for name in model.megatron_linear_modules:
        if builtin_high_precision(name):
            continue
        layer = model.layer_of(name)
        if layer is not None and first_last(config, layer):
            out.add(name)
            continue
        found = match(name, recipe)
        if found is not None:
            training = params.parse_from_config(found).training_recipe
            if (
                training.fp8_quantization_recipe is None
                and training.fp4_quantization_recipe is None
            ):
                out.add(name)
    return out


def generation_bf16(model, vllm_cfg: dict) -> set[str]:
    """Hugging Face module names NeMo RL keeps out of vLLM's FP8 method."""
    names = [n for n in model.hf_linear_modules if not builtin_high_precision(n)]
    params = [n.removeprefix("model.") + ".weight" for n in names]
    ignored = _keyword_ignored(names, vllm_cfg.get("quantization_ignored_layer_kws", []))
    first = vllm_cfg.get("num_first_layers_in_bf16", 0)
    last = vllm_cfg.get("num_last_layers_in_bf16", 0)
    get_params_in_layers = _nemo_rl_params_in_layers()
    if first:
        ignored |= set(get_params_in_layers(params, list(range(first))))
    if last:
        layers = list(range(model.num_layers - last, model.num_layers))
        ignored |= set(get_params_in_layers(params, layers))
    return ignored & set(names)


def vllm_units(model, hf_names) -> set[str]:
    return {model.vllm_module(n) for n in hf_names}


# --------------------------------------------------------------------------- helpers


def _input(tmp_path: Path, name: str, parent: Path, fp8: dict | None = None) -> Path:
    if fp8 is None:  # a shipped example: its own request, pointed at its real parent
        data = yaml.safe_load((EXAMPLES / name).read_text())
    else:
        data = {"fp8": {"recipe": "fp8_blockwise", "bf16_layers": fp8}}
    data["defaults"] = str(parent)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _apply(src: Path, out: Path, assumed=WITH_KEY):
    ctx = load_context(str(src), output=out)
    ctx = dataclasses.replace(ctx, stack=assumed)
    return ctx, run(get_adapter("nemo-rl"), ctx)


def _resolved_output(out: Path, ctx) -> dict:
    """apply's output as NeMo RL reads it: its ``defaults:`` chain merged (the output's
    ``defaults:`` is relative to where apply would write it, ``ctx.output``)."""
    from nemo_fp8_plugin.config import load_config_chain

    data = yaml.safe_load(out.read_text())
    parent = data.get("defaults")
    if isinstance(parent, str) and not Path(parent).is_absolute():
        data["defaults"] = str((Path(ctx.output).parent / parent).resolve())
        out.write_text(yaml.safe_dump(data))
    return load_config_chain(out)[1]


def _cases():
    """(id, example name or None, parent, rule set or None) for every shipped example and
    every NVIDIA NeMo RL config with a Megatron policy and a generation section."""
    configs = shared_nemo_rl("examples/configs")
    # each example names its parent by file name ("copy next to NeMo RL's ...")
    cases = [
        (
            "example-" + p.stem,
            p.name,
            next(configs.rglob(yaml.safe_load(p.read_text())["defaults"])),
            None,
        )
        for p in sorted(EXAMPLES.glob("*.yaml"))
    ]
    for parent in sorted(configs.rglob("*.yaml")):
        for rid, rules in RULE_SETS.items():
            cases.append((f"{parent.stem}-{rid}", None, parent, rules))
    return cases


def _accepted(tmp_path, case):
    """The apply result for a case, or the reason apply refuses it."""
    cid, example, parent, rules = case
    src = _input(tmp_path, example or f"{cid}.yaml", parent, rules)
    out = tmp_path / "out" / f"{cid}.yaml"
    try:
        ctx, result = _apply(src, out)
    except FP8ConfigError as err:
        return None, None, str(err)
    if ctx.model is None or get_path(ctx.resolved, "policy.megatron_cfg", None) is None:
        return None, None, "no model description or no Megatron policy"
    if ctx.model.layer_kinds:  # hybrid (Nemotron-3's Mamba layers): said generation-only
        assert any("generation-only for a hybrid model" in n for n in result.notes) or not any(
            "training runs the modules" in w for w in result.warnings
        ), (cid, result.notes)
        return None, None, "hybrid model: module rules stay generation-only"
    return ctx, result, None


# --------------------------------------------------------------------------- tests


def test_the_file_is_read_by_megatron_core_and_keeps_the_rules_modules_bf16(tmp_path):
    configs = shared_nemo_rl("examples/configs")
    src = _input(
        tmp_path,
        "grpo_moonlight_fp8_e2e.yaml",
        configs / "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml",
    )
    out = tmp_path / "written" / "moonlight.yaml"
    ctx, result = _apply(src, out)
    path = precision_file_path(out)
    assert list(result.files) == [str(path)] and path.name == "moonlight.yaml" + FILE_SUFFIX
    assert get_path(result.data, NEMO_RL_KEY) == str(path.resolve())
    assert not [w for w in result.warnings if "training runs the modules" in w]
    path.parent.mkdir(parents=True)
    path.write_text(result.files[str(path)])
    load, match, params, _, _ = _megatron()
    recipe = load(str(path))
    assert [m.pattern for m in recipe.matchers] == [
        "decoder.layers.*.self_attention.linear_kv_down_proj",
        "decoder.layers.*.self_attention.linear_kv_up_proj",
    ]
    bf16 = trainer_bf16(ctx.model, path, {})
    assert len(bf16) == 2 * ctx.model.num_layers
    qkv = "decoder.layers.0.self_attention.linear_q_proj"
    assert qkv in ctx.model.megatron_linear_modules and match(qkv, recipe) is None


def test_the_cli_writes_the_file_next_to_the_output_atomically(tmp_path, monkeypatch, capsys):
    row = stacks.Stack("nemo-rl-0.8-test", "test", {"nemo-rl": "0.8.0"})
    monkeypatch.setattr(stacks, "STACKS", (*stacks.STACKS, row))
    configs = shared_nemo_rl("examples/configs")
    src = _input(
        tmp_path,
        "grpo_moonlight_fp8_e2e.yaml",
        configs / "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml",
    )
    out = tmp_path / "o" / "moon.yaml"
    out.parent.mkdir()
    assert main(["apply", str(src), "--host", "nemo-rl", "--stack", row.name, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    side = out.with_name("moon.yaml" + FILE_SUFFIX)
    assert f"wrote {side}" in err.replace(str(tmp_path) + "/", str(tmp_path) + "/")
    assert yaml.safe_load(out.read_text())["policy"]["megatron_cfg"][
        "te_precision_config_file"
    ] == str(side.resolve())
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, side.name])
    assert _megatron()[0](str(side)).matchers  # megatron-core reads what was written


def test_a_companion_path_that_cannot_be_written_is_refused_before_anything_is(
    tmp_path, monkeypatch, capsys
):
    row = stacks.Stack("nemo-rl-0.8-test", "test", {"nemo-rl": "0.8.0"})
    monkeypatch.setattr(stacks, "STACKS", (*stacks.STACKS, row))
    configs = shared_nemo_rl("examples/configs")
    src = _input(
        tmp_path,
        "grpo_moonlight_fp8_e2e.yaml",
        configs / "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml",
    )
    out = tmp_path / "moon.yaml"
    (tmp_path / ("moon.yaml" + FILE_SUFFIX)).mkdir()  # a directory where the file would go
    assert main(["apply", str(src), "--host", "nemo-rl", "--stack", row.name, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(errors) == 1 and "is a directory" in errors[0], err
    assert not out.exists()


def test_without_the_key_module_rules_stay_generation_only(tmp_path):
    configs = shared_nemo_rl("examples/configs")
    src = _input(
        tmp_path,
        "grpo_moonlight_fp8_e2e.yaml",
        configs / "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml",
    )
    _, result = _apply(src, tmp_path / "o.yaml", assumed=WITHOUT_KEY)
    assert result.files == {} and get_path(result.data, NEMO_RL_KEY) is None
    assert any("stay generation-only" in n and "nemo-rl 0.6.0" in n for n in result.notes)
    assert any("training runs the modules it matches in FP8" in w for w in result.warnings)


def test_layer_specific_rules_with_pipeline_parallelism_are_refused_naming_the_key(tmp_path):
    configs = shared_nemo_rl("examples/configs")
    src = _input(
        tmp_path,
        "eight_b.yaml",
        configs / "grpo_math_8B_megatron.yaml",  # pipeline_model_parallel_size: 2
        RULE_SETS["one-layer"],
    )
    with pytest.raises(FP8ConfigError) as err:
        _apply(src, tmp_path / "o.yaml")
    assert err.value.key == "policy.megatron_cfg.pipeline_model_parallel_size"
    assert "stage-local" in str(err.value)


def test_a_file_the_config_already_names_is_not_replaced(tmp_path):
    configs = shared_nemo_rl("examples/configs")
    src = _input(
        tmp_path,
        "moon.yaml",
        configs / "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml",
        RULE_SETS["mla"],
    )
    data = yaml.safe_load(src.read_text())
    data["policy"] = {"megatron_cfg": {"te_precision_config_file": "/elsewhere/mine.yaml"}}
    src.write_text(yaml.safe_dump(data))
    with pytest.raises(FP8ConfigError) as err:
        _apply(src, tmp_path / "o.yaml")
    assert err.value.key == NEMO_RL_KEY


def test_trainer_and_generation_keep_the_same_modules_bf16_for_every_config(tmp_path):
    """For every shipped example and every NVIDIA NeMo RL config apply accepts with the rule
    sets, megatron-core's reading of the written file (plus the first/last fields) keeps the
    same vLLM modules in BF16 as NeMo RL's generation side reads from the written keys."""
    checked, refused = [], []
    for case in _cases():
        ctx, result, why = _accepted(tmp_path, case)
        if ctx is None:
            refused.append((case[0], why))
            continue
        model = ctx.model
        files = list(result.files)
        file = None
        if files:
            file = Path(files[0])
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(result.files[files[0]])
        # what NeMo RL runs: the output with its defaults: chain (apply writes only what
        # changes; a parent may already hold the generation keys)
        out = tmp_path / "resolved" / f"{case[0]}.yaml"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(yaml.safe_dump(result.data))
        runs = _resolved_output(out, ctx)
        overrides = get_path(runs, "policy.megatron_cfg.model_overrides", None) or {}
        train = trainer_bf16(model, file, overrides)
        vllm_cfg = get_path(runs, "policy.generation.vllm_cfg", None) or {}
        gen = generation_bf16(model, vllm_cfg)
        train_units = vllm_units(model, {h for mg in train for h in model.hf_names(mg)})
        assert train_units == vllm_units(model, gen), case[0]
        for unit in vllm_units(model, gen):  # a fused GEMM has one precision
            assert set(model.vllm_members(unit)) <= gen, (case[0], unit)
        checked.append(case[0])
    examples = {"example-" + p.stem for p in EXAMPLES.glob("*.yaml")}
    assert len(examples) >= 3 and examples <= set(checked), (examples, refused)  # every one
    assert {
        "grpo-moonlight-16ba3b-4n8g-megatron-mla",
        "grpo_math_1B_megatron-fc2-first-last",
        "grpo_math_8B_megatron-fc2-first-last",
    } <= set(checked), (checked, refused)
    # a layer rule under pipeline parallelism is refused naming the key (not silently wrong)
    assert "pipeline_model_parallel_size: is 2" in dict(refused)["grpo_math_8B_megatron-one-layer"]
    assert len(checked) >= 20, (checked, refused)


def test_explain_says_module_rules_stay_generation_only_on_a_stack_without_the_key(
    tmp_path, capsys
):
    configs = shared_nemo_rl("examples/configs")
    src = _input(
        tmp_path,
        "grpo_moonlight_fp8_e2e.yaml",
        configs / "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml",
    )
    stack = "nemo-rl-main-2026-08-22"
    assert main(["explain", str(src), "--host", "nemo-rl", "--stack", stack]) == 0
    out = capsys.readouterr().out
    assert (
        "module rules stay generation-only: nemo-rl main-2026-08-22 has no "
        "policy.megatron_cfg.te_precision_config_file (from 0.8)" in out
    )


# --------------------------------------------------------------------------- Megatron-LM YAML

LM_CONFIG = (
    "fp8: {recipe: fp8_blockwise, model: llama3.1-8b, bf16_layers: {modules: [%s]}}\n"
    "language_model: {num_layers: 32}\n"
    "model_parallel: {pipeline_model_parallel_size: %d}\n"
)


def test_megatron_lm_yaml_cannot_carry_an_inline_quant_recipe():
    """Why the file: Megatron-LM's load_yaml (megatron/training/yaml_arguments.py, not in the
    megatron-core wheel) converts nested mappings with
    ``json.loads(json.dumps(config), object_hook=lambda item: SimpleNamespace(**item))``;
    megatron-core's matcher then fails on what an inline quant_recipe became."""
    import json
    from types import SimpleNamespace

    inline = {"configs": {"bf16": {}}, "matchers": {}}
    loaded = json.loads(json.dumps(inline), object_hook=lambda item: SimpleNamespace(**item))
    _, match, *_ = _megatron()
    with pytest.raises(AttributeError):
        match("decoder.layers.0.mlp.linear_fc2", loaded)


def test_megatron_lm_layout_gets_the_file_instead_of_an_inline_quant_recipe(tmp_path, capsys):
    src = tmp_path / "lm.yaml"
    src.write_text(LM_CONFIG % ("'*.linear_fc2'", 1))
    out = tmp_path / "out" / "lm.yaml"
    out.parent.mkdir()
    assert main(["apply", str(src), "--host", "megatron", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    data = yaml.safe_load(out.read_text())
    assert "quant_recipe" not in data["language_model"]
    side = precision_file_path(out)
    assert f"--te-precision-config-file {side.resolve()}" in err
    recipe = _megatron()[0](str(side))
    assert [m.pattern for m in recipe.matchers] == ["decoder.layers.*.mlp.linear_fc2"]


def test_the_model_layout_keeps_its_inline_quant_recipe(tmp_path):
    src = tmp_path / "m.yaml"
    src.write_text("fp8: {recipe: fp8_blockwise, bf16_layers: {modules: ['*.linear_fc2']}}\n")
    ctx = load_context(str(src), output=tmp_path / "o.yaml")
    result = run(get_adapter("megatron"), ctx)
    assert result.files == {}
    assert get_path(result.data, "model.quant_recipe.matchers.bf16_0.pattern")


def test_megatron_lm_layer_rules_under_pipeline_parallelism_are_refused(tmp_path):
    src = tmp_path / "lm.yaml"
    src.write_text(LM_CONFIG % ("'model.layers.3.*'", 4))
    ctx = load_context(str(src), output=tmp_path / "o.yaml")
    with pytest.raises(FP8ConfigError) as err:
        run(get_adapter("megatron"), ctx)
    assert err.value.key == "model_parallel.pipeline_model_parallel_size"


@pytest.mark.parametrize("pattern", ["model.layers.2.*", "model.layers.3.*", "*mtp_block*"])
def test_a_rule_without_megatron_names_and_no_model_is_refused_naming_the_rule(pattern):
    from nemo_fp8_plugin.hosts.megatron.precision_file import precision_recipe
    from nemo_fp8_plugin.registry import get_recipe

    spec = get_recipe(
        {
            "recipe": "fp8_blockwise",
            "bf16_layers": {"modules": ["*.linear_fc2", pattern]},
        }
    )
    with pytest.raises(FP8ConfigError) as err:
        precision_recipe(spec, None)
    assert err.value.key == "bf16_layers.modules[1]" and err.value.value == pattern
    # a rule holding for every layer translates without a model
    ok, _ = precision_recipe(
        get_recipe({"recipe": "fp8_blockwise", "bf16_layers": {"modules": ["*down_proj*"]}}), None
    )
    # (it also names MLA's linear_kv_down_proj: the name-only translation probes every leaf)
    assert "decoder.layers.*.mlp.linear_fc2" in [m["pattern"] for m in ok["matchers"].values()]


@pytest.mark.parametrize("pp, words", [("'2'", "stage-local"), ("two", "positive integer")])
def test_a_pipeline_size_that_is_not_an_int_is_read_or_refused(tmp_path, pp, words):
    """A quoted integer is read as one (and so refuses a layer rule as 2 does); any other
    value is refused naming the key: whether a layer rule can be written depends on it."""
    configs = shared_nemo_rl("examples/configs")
    src = _input(
        tmp_path, "eight_b.yaml", configs / "grpo_math_8B_megatron.yaml", RULE_SETS["one-layer"]
    )
    data = yaml.safe_load(src.read_text())
    data.setdefault("policy", {}).setdefault("megatron_cfg", {})
    data["policy"]["megatron_cfg"]["pipeline_model_parallel_size"] = yaml.safe_load(pp)
    src.write_text(yaml.safe_dump(data))
    with pytest.raises(FP8ConfigError) as err:
        _apply(src, tmp_path / "o.yaml")
    assert err.value.key == "policy.megatron_cfg.pipeline_model_parallel_size"
    assert words in str(err.value)


# --------------------------------------------------------------------------- records, not wording
# The route decides on the rules spellings' records (hosts.RuleIssue), never on their warnings'
# wording: each test rewords every warning a rules spelling produces (the records' copies too)
# and checks the decision is unchanged.

_REWORDED = {
    "cannot be translated": "has no translation",
    "it is passed as is": "it is written verbatim",
    "stage-local module names": "per-stage names",
    "training runs the modules it matches in FP8": "its modules stay FP8 in training",
}


def _reword(text: str) -> str:
    for old, new in _REWORDED.items():
        text = text.replace(old, new)
    return text


def _rewording(monkeypatch, module, name: str) -> None:
    """Replace ``module.name`` (a rules spelling) by one whose warnings are reworded."""
    spell = getattr(module, name)

    def reworded(*args, **kwargs):
        keys = spell(*args, **kwargs)
        issues = [
            dataclasses.replace(i, warning=_reword(i.warning))
            for i in getattr(keys, "rule_issues", [])
        ]
        out = dataclasses.replace(keys, warnings=[_reword(w) for w in keys.warnings])
        if hasattr(keys, "rule_issues"):
            out = dataclasses.replace(out, rule_issues=issues)
        return out

    monkeypatch.setattr(module, name, reworded)


def _spec(*modules: str):
    return get_recipe({"recipe": "fp8_blockwise", "bf16_layers": {"modules": list(modules)}})


@pytest.mark.parametrize("pattern", ["model.layers.3.*", "*mtp_block*"])
def test_a_reworded_untranslatable_warning_still_refuses_the_rule(monkeypatch, pattern):
    _rewording(monkeypatch, megatron_rules, "to_megatron")
    assert any(
        "has no translation" in w or "written verbatim" in w
        for w in megatron_rules.to_megatron(_spec("*.linear_fc2", pattern)).warnings
    )
    with pytest.raises(FP8ConfigError) as err:
        precision_recipe(_spec("*.linear_fc2", pattern), None)
    assert err.value.key == "bf16_layers.modules[1]" and err.value.value == pattern


def test_a_reworded_pipeline_warning_is_still_left_to_the_file_route(monkeypatch):
    model = describe_model("moonshotai/Moonlight-16B-A3B-Instruct")
    spec = _spec(*RULE_SETS["one-layer"]["modules"])
    _rewording(monkeypatch, megatron_rules, "to_megatron")
    assert any("per-stage names" in w for w in megatron_rules.to_megatron(spec, model).warnings)
    recipe, warnings = precision_recipe(spec, model, pipeline_parallel=1)
    assert recipe is not None and not any("per-stage names" in w for w in warnings)


def test_reworded_nemo_rl_training_warnings_still_move_into_the_file(monkeypatch, tmp_path):
    _rewording(monkeypatch, nemo_rl_rules, "to_nemo_rl")
    configs = shared_nemo_rl("examples/configs")
    src = _input(
        tmp_path,
        "grpo_moonlight_fp8_e2e.yaml",
        configs / "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml",
    )
    _, result = _apply(src, tmp_path / "written" / "moonlight.yaml")
    assert len(result.files) == 1 and get_path(result.data, NEMO_RL_KEY) is not None
    assert not [w for w in result.warnings if "stay FP8 in training" in w]

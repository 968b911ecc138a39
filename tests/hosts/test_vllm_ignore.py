"""``vllm_exclusions`` against each read vLLM release's own matching code, and the report
beside the recipe's rules (the Qwen3-MoE ``mlp.gate`` case).

Each release's ``is_layer_skipped`` (``utils/quant_utils.py``) and ModelOpt's
``is_layer_excluded`` / ``apply_vllm_mapper`` (``modelopt.py``) are compiled from the wheel
``scripts/install.sh`` downloads (never installed: these modules import CUDA-only parts of
vLLM at module level) and run on the same lists and modules as ours. The one stand-in: the
model's ``hf_to_vllm_mapper`` is identity for the families here (Llama and Qwen3-MoE map only
stacked q/k/v and gate/up names, which ``apply_list``'s rename mapper leaves alone; checked
against the real mappers in tests/hosts/vllm/test_ignore.py). The installed 0.32.0 is run for real
in tests/hosts/vllm/test_ignore.py.
"""

from __future__ import annotations

import ast
import fnmatch
import itertools
from collections.abc import Mapping
from types import MappingProxyType, SimpleNamespace
from typing import Literal

import pytest
from ignore_citations import CITED, check_cited_lines
from model_configs import QWEN3_MOE
from vllm_source import WHEELS

from conftest import upstream_file
from nemo_fp8_plugin import get_recipe, stacks
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts.vllm import ignore
from nemo_fp8_plugin.hosts.vllm.ignore import (
    ignore_list_report,
    packed_modules_mapping,
    release_rules,
    vllm_exclusions,
)
from nemo_fp8_plugin.rules.models import describe_model

pytestmark = pytest.mark.host

Q = "vllm/model_executor/layers/quantization"

LISTS = [
    ["mlp.gate"],
    ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"],
    ["model.layers.1.mlp.gate*"],
    ["*mlp.gate*"],
    ["self_attn"],
    ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"],
    ["model.layers.0.self_attn.qkv_proj"],
    ["model.layers.10.mlp.gate_proj", "model.layers.10.mlp.up_proj"],
    ["model.layers.1.mlp.experts.0.gate_proj"],
    ["model.layers.1*", "lm_head"],
    ["language_model.model.layers.2.self_attn.o_proj"],
    ["model.layers.2.self_attn.o_proj", "model.layers.3.mlp.down_proj"],
]


def _source(version: str, member: str, tmp_path_factory) -> str:
    dest = tmp_path_factory.mktemp(f"vllm-{version}")
    return upstream_file(WHEELS[version], member, dest).read_text()


@pytest.fixture(scope="module", params=list(WHEELS))
def release(request, tmp_path_factory):
    """(version, is_layer_skipped, is_layer_excluded, apply_vllm_mapper, sources) of a release."""
    version = request.param
    quant_utils = _source(version, f"{Q}/utils/quant_utils.py", tmp_path_factory)
    modelopt = _source(version, f"{Q}/modelopt.py", tmp_path_factory)
    ns = {"Mapping": Mapping, "MappingProxyType": MappingProxyType, "Literal": Literal}
    fn = [
        n
        for n in ast.parse(quant_utils).body
        if isinstance(n, ast.FunctionDef) and n.name == "is_layer_skipped"
    ]
    exec(compile(ast.Module(body=fn, type_ignores=[]), "quant_utils.py", "exec"), ns)
    (cls,) = [
        n
        for n in ast.parse(modelopt).body
        if isinstance(n, ast.ClassDef) and n.name == "ModelOptQuantConfigBase"
    ]
    methods = [
        n
        for n in cls.body
        if isinstance(n, ast.FunctionDef) and n.name in ("is_layer_excluded", "apply_vllm_mapper")
    ]
    for m in methods:  # type annotations name vLLM classes: drop them, nothing else
        m.returns = None
        for arg in m.args.args:
            arg.annotation = None
    ns["fnmatch"] = fnmatch.fnmatch
    exec(compile(ast.Module(body=methods, type_ignores=[]), "modelopt.py", "exec"), ns)
    return version, ns, tmp_path_factory


def _theirs(ns, method, entries, packed, mapper: bool):
    if method == "fp8":

        def skipped(prefix):
            try:
                return ns["is_layer_skipped"](prefix, list(entries), packed)
            except ValueError:
                return None

        return skipped
    cfg = SimpleNamespace(exclude_modules=list(entries), packed_modules_mapping=packed)
    if mapper:
        ns["apply_vllm_mapper"](cfg, SimpleNamespace(apply_list=list))

    def excluded(prefix):
        try:
            return ns["is_layer_excluded"](cfg, prefix)
        except ValueError:
            return None

    return excluded


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("method", ["fp8", "modelopt"])
def test_each_release_excludes_what_its_own_code_excludes(release, family, method):
    version, ns, _ = release
    model = describe_model("meta-llama/Llama-3.1-8B" if family == "llama" else QWEN3_MOE)
    packed = packed_modules_mapping(model)
    modules = [u for u, _ in model.vllm_modules if u != "lm_head"][: 12 * 4]
    mapper = release_rules(version).has_mapper(family)
    assert mapper is not None
    hits = 0
    for entries in LISTS:
        ours = vllm_exclusions(version, method, entries, modules, packed, family=family)
        theirs = _theirs(ns, method, entries, packed, mapper)
        for exclusion in ours:
            assert exclusion.excluded == theirs(exclusion.module), (version, entries, exclusion)
            hits += exclusion.excluded is not False
    assert hits >= 3  # the lists reach modules, not only misses


def test_the_fused_name_is_honoured_from_0_25_1(release):
    version, ns, _ = release
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    entries = ["model.layers.0.self_attn.qkv_proj"]
    (ours,) = vllm_exclusions(version, "fp8", entries, [entries[0]], packed)
    assert ours.excluded == ns["is_layer_skipped"](entries[0], entries, packed)
    assert ours.excluded is (version >= "0.25.1")


def test_every_cited_line_says_what_it_is_cited_for(release):
    """The ignore-list rows' ``path:line (release)`` citations of this release hold what each
    is cited for (whether the release has each row is read from its source in
    tests/test_stacks_vllm_source.py)."""
    version, _, tmp_path_factory = release
    check_cited_lines(version, lambda path: _source(version, path, tmp_path_factory))
    # DeepSeek-V2/V3 has no MAPPER row: its class has no mapper in any release read.
    deepseek = _source(version, "vllm/model_executor/models/deepseek_v2.py", tmp_path_factory)
    assert "hf_to_vllm_mapper = " not in deepseek


def test_the_rows_ignore_py_asks_are_the_rows_cited():
    asked = {
        *ignore.READ_IN_EVERY_RELEASE,
        ignore.FUSED_NAME_FIRST,
        ignore.MODELOPT_LM_HEAD,
        *(ignore.MAPPER.format(family=f) for f in ignore.MAPPER_FAMILIES),
    }
    assert asked == set(CITED)
    assert all(stacks.fact("vllm", name) is not None for name in asked)


# --------------------------------------------------------------------------- the report


@pytest.mark.parametrize("version", stacks.TESTED["vllm"])
def test_excluding_mlp_gate_also_excludes_gate_up_proj_through_modelopt(version):
    """Qwen3-MoE with dense layers (``mlp_only_layers``): the rules keep the routers
    (``mlp.gate``) in BF16; a ModelOpt list naming ``mlp.gate`` also excludes every dense
    layer's ``mlp.gate_up_proj`` (the substring fallback), the warning names them."""
    spec = get_recipe("fp8_blockwise")
    model = describe_model(QWEN3_MOE)
    records = ignore_list_report(
        spec, model, ["mlp.gate", "lm_head"], release=version, method="modelopt"
    )
    extra = {r.module: r for r in records if r.status == "extra"}
    assert set(extra) == {"model.layers.0.mlp.gate_up_proj", "model.layers.10.mlp.gate_up_proj"}
    for record in extra.values():
        assert record.entry == "mlp.gate" and record.how == "substring"
        assert record.members == (
            record.module.replace("gate_up_proj", "gate_proj"),
            record.module.replace("gate_up_proj", "up_proj"),
        )
        assert record.meant_bf16 is False and record.vllm_bf16 is True
    routers = [r for r in records if r.module.endswith(".mlp.gate")]
    assert len(routers) == 10 and all(r.status == "agrees" and r.meant_bf16 for r in routers)
    assert {r.status for r in records} == {"agrees", "extra"}
    assert records[0].to_dict()["module"] == "model.layers.0.self_attn.qkv_proj"
    assert all(r.note is None for r in records)  # a tested release


def test_the_same_name_through_fp8_excludes_nothing_and_the_routers_are_quantized():
    spec = get_recipe("fp8_blockwise")
    model = describe_model(QWEN3_MOE)
    records = ignore_list_report(spec, model, ["mlp.gate"], release="0.32.0", method="fp8")
    missing = [r.module for r in records if r.status == "missing"]
    assert missing == [f"model.layers.{i}.mlp.gate" for i in range(12) if i not in (0, 10)]
    assert not [r for r in records if r.status == "extra"]
    full = [f"model.layers.{i}.mlp.gate" for i in range(12) if i not in (0, 10)]
    assert all(
        r.status == "agrees" for r in ignore_list_report(spec, model, full, release="0.32.0")
    )


def test_shards_that_disagree_are_a_refusal_and_deepseek_routers_never_quantize():
    spec = get_recipe("fp8_blockwise")
    model = describe_model("meta-llama/Llama-3.1-8B")
    records = ignore_list_report(spec, model, ["model.layers.0.self_attn.q_proj"], release="0.32.0")
    (refused,) = [r for r in records if r.status == "refused"]
    assert refused.module == "model.layers.0.self_attn.qkv_proj" and refused.how == "mixed shards"
    deepseek = describe_model("deepseek-ai/DeepSeek-V3")
    routers = [
        r
        for r in ignore_list_report(spec, deepseek, [], release="0.32.0")
        if r.module.endswith(".mlp.gate")
    ]
    assert all(r.how == "never quantized" and r.status == "agrees" for r in routers)


def test_a_release_between_two_read_is_judged_by_the_rows_and_named_untested():
    between = release_rules("0.33.1")
    assert between.fused_name_first and between.modelopt_lm_head and not between.newer
    assert not between.tested and "0.33.1 is untested" in between.note
    assert release_rules("0.26.0").fused_name_first
    assert not release_rules("0.24.9").fused_name_first
    assert release_rules("0.32.0+cpu").tested and release_rules("0.32.0+cpu").note is None
    for bad in ("0.16.0", "latest", None):
        with pytest.raises(FP8ConfigError) as err:
            release_rules(bad)
        assert err.value.key == "vllm"
    with pytest.raises(FP8ConfigError, match=r"older than the oldest .*\(0\.17\.1\)"):
        release_rules("0.16.0")
    with pytest.raises(FP8ConfigError) as err:
        vllm_exclusions("0.32.0", "awq", [], [])
    assert err.value.key == "method"
    with pytest.raises(FP8ConfigError) as err:
        vllm_exclusions("0.32.0", "fp8", "mlp.gate", [])
    assert err.value.key == "entries"


def test_lm_head_follows_modelopts_list_from_0_25_1_only():
    for version, honoured in (("0.20.0", False), ("0.25.1", True)):
        (rec,) = vllm_exclusions(version, "modelopt", ["model.layers.0.mlp.down_proj"], ["lm_head"])
        assert rec.excluded is not honoured  # quantized from 0.25.1 unless listed
    assert list(itertools.chain(WHEELS)) == ["0.17.1", "0.20.0", "0.25.1", "0.34.0"]


NEWER = "0.40.0+cu128"


def test_a_release_newer_than_every_one_read_is_untested_and_assumes_nothing():
    """vLLM 0.40 is newer than every release read: what the rows describe (the fused name
    first, ModelOpt's lm_head, the mappers) is unknown, never taken from the newest release;
    a module one of them decides is ``unknown``, the others are what every possibility gives,
    and every record says the release is untested."""
    rules = release_rules(NEWER)
    assert rules.newer and not rules.tested
    assert rules.fused_name_first is None and rules.modelopt_lm_head is None
    assert rules.has_mapper("llama") is None and rules.has_mapper("deepseek") is False
    assert "newer than every release read" in rules.note and ignore.FUSED_NAME_FIRST in rules.note
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    fused, plain, shards, head = vllm_exclusions(
        NEWER,
        "fp8",
        ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"],
        [
            "model.layers.0.self_attn.qkv_proj",
            "model.layers.0.self_attn.o_proj",
            "model.layers.1.self_attn.qkv_proj",
            "lm_head",
        ],
        packed,
    )
    assert (fused.excluded, fused.how) == (None, "unknown")  # the fused name decides it
    assert (plain.excluded, plain.how) == (True, "exact")
    assert (shards.excluded, shards.how) == (False, "not matched")
    assert (head.excluded, head.how) == (True, "never quantized")  # Fp8Config: always
    assert all(e.note == rules.note for e in (fused, plain, shards, head))
    (modelopt_head,) = vllm_exclusions(NEWER, "modelopt", ["mlp.down_proj"], ["lm_head"])
    assert (modelopt_head.excluded, modelopt_head.how) == (None, "unknown")
    (listed_head,) = vllm_exclusions(NEWER, "modelopt", ["lm_head"], ["lm_head"])
    assert listed_head.excluded is True and listed_head.how == "unknown"  # excluded either way
    spec, model = get_recipe("fp8_blockwise"), describe_model(QWEN3_MOE)
    records = ignore_list_report(spec, model, ["mlp.gate"], release=NEWER, method="modelopt")
    assert all(r.note == rules.note and r.to_dict()["note"] == rules.note for r in records)
    assert [r.module for r in records if r.status == "unknown"] == ["lm_head"]
    assert len([r for r in records if r.status == "extra"]) == 2  # the substring fallback

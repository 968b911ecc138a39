"""NeMo RL by release: the key facts of ``stacks.FACTS`` against each release's own source,
a key written only for a release that reads it (one-line refusals naming the release), the
loss truncation as each release reads it, and ``--host`` against the config's shape.

The releases' source and configs are NVIDIA's (tags v0.6.0 and v0.7.0, main 7ea279a), read from
the shared test data through ``shared_nemo_rl``; NeMo RL does not install here, so they are
parsed with :mod:`ast`, never imported.
"""

from __future__ import annotations

import ast
import re

import pytest
import yaml
from nemo_rl_cases import RELEASE_CONFIGS, RELEASE_SOURCE, release_source_names

from conftest import shared_nemo_rl
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import apply_path
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL

pytestmark = pytest.mark.torch_free

SOURCE, CONFIGS = RELEASE_SOURCE, RELEASE_CONFIGS

STACK = {r.name: f"nemo-rl-{r.name}" for r in stacks.NEMO_RL_RELEASES}


def config_of(release: str, name: str):
    return shared_nemo_rl(f"{CONFIGS[release]}examples/configs/{name}")


@pytest.fixture(scope="module")
def source_names() -> dict[str, set[str]]:
    """Release -> the names its NeMo RL source declares or reads (all its files read here)."""
    return {release: release_source_names(release) for release in SOURCE}


KEY = re.compile(r"[a-z_]+(\.[a-z_0-9]+)+")

KEY_FACTS = [f for f in stacks.FACTS if f.host == "nemo-rl" and KEY.fullmatch(f.name)]


def test_the_table_has_the_keys_the_adapter_writes():
    names = {f.name for f in KEY_FACTS}
    for key in (
        "policy.generation.vllm_cfg.is_mx",
        "policy.megatron_cfg.model_overrides",
        "policy.megatron_cfg.fp8_cfg.fp8_recipe",
        "loss_fn.truncated_importance_sampling_type",
        "policy.quant_cfg",
    ):
        assert key in names, key
    assert all(isinstance(f.versions, stacks.Releases) for f in KEY_FACTS)


READ_AT = {
    # every release has some other ``env_vars`` (policy.megatron_cfg's, local variables)
    "policy.generation.vllm_cfg.env_vars": (
        "nemo_rl/models/generation/vllm/vllm_generation.py",
        'self.cfg["vllm_cfg"].get("env_vars", {})',
    ),
}
"""Key facts whose leaf name other code of every release uses too: the release has the key
when this file reads it this way."""


@pytest.mark.parametrize("fact", KEY_FACTS, ids=lambda f: f.name)
def test_each_key_fact_names_exactly_the_releases_whose_source_has_it(fact, source_names):
    """A release has a key when its source declares or reads every part of it (``fp8_cfg``
    and ``enabled`` for ``policy.megatron_cfg.fp8_cfg.enabled``); the fact must name exactly
    those releases (so v0.6.0's missing ``force_clear_fp8_caches``, v0.7.0's missing
    ``is_mx`` and ``model_overrides`` are facts, not guesses)."""
    parts = fact.name.split(".")
    for release, names in source_names.items():
        has = all(p in names for p in parts)
        if fact.name in READ_AT:  # a name the source also uses for something else
            path, text = READ_AT[fact.name]
            file = shared_nemo_rl(f"{SOURCE[release]}/{path}")
            has = file.is_file() and text in file.read_text()
        said = stacks.lookup("nemo-rl", fact.name, release).present
        assert said is has, (fact.name, release, [p for p in parts if p not in names])


def _first_truncation_test(release: str) -> str:
    """Which attribute ClippedPGLossFn.__init__ tests first to turn truncation on."""
    path = shared_nemo_rl(f"{SOURCE[release]}/nemo_rl/algorithms/loss/loss_functions.py")
    cls = next(
        n
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.ClassDef) and n.name == "ClippedPGLossFn"
    )
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    for node in ast.walk(init):
        if isinstance(node, ast.If):
            text = ast.unparse(node.test)
            found = re.fullmatch(r"self\.(truncated_importance_sampling_\w+) is not None", text)
            if found:
                return found.group(1)
    raise AssertionError(release)


@pytest.mark.parametrize("release", list(SOURCE))
def test_the_behaviour_facts_agree_with_each_release(release):
    by_type = _first_truncation_test(release) == "truncated_importance_sampling_type"
    fact = "loss_fn.truncated_importance_sampling_type turns truncation on"
    assert stacks.lookup("nemo-rl", fact, release).present is by_type
    setup = shared_nemo_rl(f"{SOURCE[release]}/nemo_rl/models/megatron/setup.py").read_text()
    conflict = "def _validate_model_override_conflicts" in setup
    assert (
        stacks.lookup("nemo-rl", "_validate_model_override_conflicts", release).present is conflict
    )
    worker = shared_nemo_rl(
        f"{SOURCE[release]}/nemo_rl/models/policy/workers/megatron_policy_worker.py"
    ).read_text()
    vl = "def _model_self_packs_for_cp" in worker and "Qwen3VLModel" in worker
    assert stacks.lookup("nemo-rl", "delegate_pack_to_model:qwen3-vl", release).present is vl
    fp8 = shared_nemo_rl(
        f"{SOURCE[release]}/nemo_rl/models/generation/vllm/quantization/fp8.py"
    ).read_text()
    e8m0_off = 'os.environ["VLLM_USE_DEEP_GEMM_E8M0"] = "0"' in fp8
    deep_gemm = "vllm_cfg.use_deep_gemm sets VLLM_USE_DEEP_GEMM_E8M0=0"
    assert stacks.lookup("nemo-rl", deep_gemm, release).present is e8m0_off
    grpo = ast.parse(shared_nemo_rl(f"{SOURCE[release]}/nemo_rl/algorithms/grpo.py").read_text())
    subscript = any(
        isinstance(n, ast.Subscript)
        and isinstance(n.slice, ast.Constant)
        and n.slice.value == "seq_logprob_error_threshold"
        for n in ast.walk(grpo)
    )
    required = "grpo.seq_logprob_error_threshold is read by subscript"
    assert stacks.lookup("nemo-rl", required, release).present is subscript
    # num_first/last_layers_in_bf16: the layer names are appended as one list (nested in
    # ignored_layers) or extended into it
    calls = {
        n.func.attr
        for n in ast.walk(ast.parse(fp8))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "bf16_params"
    }
    assert calls in ({"append"}, {"extend"}), calls
    reaches = "vllm_cfg.num_first_layers_in_bf16 reaches vLLM's ignored_layers"
    assert stacks.lookup("nemo-rl", reaches, release).present is (calls == {"extend"})


# --------------------------------------------------------------------------- the gate


def _child(tmp_path, release: str, base: str, fp8: dict, **top) -> object:
    """A config asking for ``fp8`` over NVIDIA's ``base`` of ``release``."""
    path = tmp_path / "child.yaml"
    data = {"defaults": str(config_of(release, base)), "fp8": fp8, **top}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


EIGHT_B = "grpo_math_8B_megatron.yaml"


@pytest.mark.parametrize(
    "fp8, key, what",
    [
        (
            {"recipe": "nvfp4", "hardware": "b200"},
            "fp8.recipe",
            "cannot train in NVFP4",
        ),
        ({"recipe": "mxfp8", "hardware": "b200"}, "fp8.generation", "cannot generate in MXFP8"),
        (
            {"recipe": "fp8_blockwise", "bf16_layers": {"first": 1}},
            "fp8.bf16_layers.first",
            "cannot keep training layers in BF16",
        ),
        (
            {"recipe": "fp8_current"},  # the preset keeps its first and last layers in BF16
            "fp8.bf16_layers.first",
            "cannot keep training layers in BF16",
        ),
    ],
    ids=["nvfp4", "mxfp8", "bf16-first", "fp8_current"],
)
@pytest.mark.parametrize("release", ["0.6.0", "0.7.0"])
def test_what_a_release_cannot_express_is_refused_naming_it(tmp_path, release, fp8, key, what):
    """Was: written anyway (``model_overrides``, ``is_mx``), which these releases never read:
    NVFP4 trained in BF16, MXFP8 rollouts ran block FP8, the edge layers stayed FP8."""
    top = {"policy": {"sequence_packing": {"enabled": False}}}  # nvfp4 is not packed
    src = _child(tmp_path, release, EIGHT_B, fp8, **top)
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src, stack=STACK[release])
    message = str(err.value)
    assert err.value.key == key and f"NeMo RL v{release} {what}" in message, message
    assert "\n" not in message and "--stack nemo-rl-main-2026-08-22" in message
    # main has the keys: written there (over main's own base config)
    main_src = _child(tmp_path, stacks.NEMO_RL_MAIN, EIGHT_B, fp8, **top)
    result = apply_path(NEMO_RL, main_src, stack=STACK[stacks.NEMO_RL_MAIN])
    written = str(result.written)
    assert "model_overrides" in written or "is_mx" in written


def test_training_edge_layers_for_generation_only_are_accepted_on_v0_7_0(tmp_path):
    """Accepted, as keywords: v0.7.0's layer counts never reach vLLM
    (test_nemo_rl_preflight.py runs NeMo RL's and vLLM's own code on both)."""
    fp8 = {"recipe": "fp8_blockwise", "bf16_layers": {"first": 1, "applies_to": "generation"}}
    result = apply_path(NEMO_RL, _child(tmp_path, "0.7.0", EIGHT_B, fp8), stack="nemo-rl-0.7.0")
    vllm_cfg = result.written["policy"]["generation"]["vllm_cfg"]
    assert vllm_cfg["quantization_ignored_layer_kws"] == ["layers.0."]
    assert "num_first_layers_in_bf16" not in vllm_cfg  # 0, as the parent has it


@pytest.mark.parametrize(
    "release, native, key",
    [
        ("0.7.0", {"is_mx": True}, "policy.generation.vllm_cfg.is_mx"),
        ("0.6.0", {"is_mx": True}, "policy.generation.vllm_cfg.is_mx"),
    ],
)
def test_a_native_key_the_release_does_not_read_is_refused(tmp_path, release, native, key):
    top = {"policy": {"generation": {"vllm_cfg": native}}}
    src = _child(tmp_path, release, EIGHT_B, {"recipe": "fp8_blockwise", "training": "bf16"}, **top)
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src, stack=STACK[release])
    assert err.value.key == key and f"NeMo RL v{release}" in str(err.value)
    assert "ignored silently" in str(err.value)


def test_force_clear_fp8_caches_is_a_v0_7_0_key(tmp_path):
    top = {"policy": {"megatron_cfg": {"fp8_cfg": {"force_clear_fp8_caches": True}}}}
    src = _child(tmp_path, "0.6.0", EIGHT_B, {"recipe": "fp8_blockwise"}, **top)
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src, stack="nemo-rl-0.6.0")
    assert err.value.key == "policy.megatron_cfg.fp8_cfg.force_clear_fp8_caches"
    src = _child(tmp_path, "0.7.0", EIGHT_B, {"recipe": "fp8_blockwise"}, **top)
    assert apply_path(NEMO_RL, src, stack="nemo-rl-0.7.0").written


# --------------------------------------------------------------------------- the loss truncation

TRUNCATION = "loss_fn.truncated_importance_sampling_"


def test_nvidias_v0_6_0_base_config_is_accepted(tmp_path):
    """Was refused ("fp8_blockwise as requested needs None"): v0.6.0's grpo_math_1B.yaml sets
    ``truncated_importance_sampling_type: tis`` with a null ratio, which v0.6.0 ignores
    (``loss_functions.py`` ~212: the ratio turns truncation on). Nothing of it is rewritten."""
    src = _child(tmp_path, "0.6.0", EIGHT_B, {"recipe": "fp8_blockwise"})
    result = apply_path(NEMO_RL, src, stack="nemo-rl-0.6.0")
    assert result.written["loss_fn"] == {"use_importance_sampling_correction": True}
    assert not any("truncation" in n for n in result.notes)


def test_the_configs_own_truncation_is_kept_and_shown(tmp_path, capsys):
    loss = {f"{TRUNCATION}type": "icepop", f"{TRUNCATION}ratio": 5.0, f"{TRUNCATION}ratio_min": 0.5}
    top = {"loss_fn": {k.split(".")[1]: v for k, v in loss.items()}}
    src = _child(tmp_path, "0.7.0", EIGHT_B, {"recipe": "fp8_blockwise"}, **top)
    result = apply_path(NEMO_RL, src, stack="nemo-rl-0.7.0")
    assert "truncated_importance_sampling_type" not in result.written["loss_fn"]
    (note,) = [n for n in result.notes if "truncation kept" in n]
    assert "icepop" in note and "5.0" in note
    assert main(["explain", str(src), "--stack", "nemo-rl-0.7.0"]) == 0
    assert "loss_fn truncation kept as your config states it: icepop" in capsys.readouterr().out
    # stated otherwise in the fp8: block: a real conflict, naming both
    stated = _child(
        tmp_path,
        "0.7.0",
        EIGHT_B,
        {"recipe": "fp8_blockwise", "importance_sampling": {"truncation": "tis"}},
        **top,
    )
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, stated, stack="nemo-rl-0.7.0")
    assert err.value.key == f"{TRUNCATION}type"
    assert "icepop ratio 5.0" in str(err.value) and "tis ratio 2.0" in str(err.value)


def test_a_type_without_a_ratio_is_inert_at_v0_6_0_and_refused_from_v0_7_0(tmp_path):
    top = {"loss_fn": {"truncated_importance_sampling_type": "tis"}}
    for release, refused in (("0.6.0", False), ("0.7.0", True), (stacks.NEMO_RL_MAIN, True)):
        src = _child(tmp_path, release, EIGHT_B, {"recipe": "fp8_blockwise"}, **top)
        if not refused:
            apply_path(NEMO_RL, src, stack=STACK[release])
            continue
        with pytest.raises(FP8ConfigError) as err:
            apply_path(NEMO_RL, src, stack=STACK[release])
        assert err.value.key == f"{TRUNCATION}ratio" and "loss_functions.py" in str(err.value)


def test_a_stated_truncation_is_written_over_an_inert_one(tmp_path):
    fp8 = {"recipe": "fp8_blockwise", "importance_sampling": {"truncation": "icepop"}}
    result = apply_path(NEMO_RL, _child(tmp_path, "0.6.0", EIGHT_B, fp8), stack="nemo-rl-0.6.0")
    loss = result.written["loss_fn"]
    assert (
        loss["truncated_importance_sampling_type"],
        loss["truncated_importance_sampling_ratio"],
    ) == (
        "icepop",
        2.0,
    )


# --------------------------------------------------------------------------- the user's choices


def test_the_configs_own_fp8_kv_cache_and_pow2_scales_stand(tmp_path):
    vllm = {"kv_cache_dtype": "fp8", "pow2_weight_scaling_factors": True}
    top = {
        "policy": {
            "generation": {"vllm_cfg": vllm},
            "megatron_cfg": {"pipeline_model_parallel_size": 1},
        }
    }
    src = _child(tmp_path, "0.7.0", EIGHT_B, {"recipe": "fp8_blockwise"}, **top)
    result = apply_path(NEMO_RL, src, stack="nemo-rl-0.7.0")
    assert result.data["policy"]["generation"]["vllm_cfg"]["kv_cache_dtype"] == "fp8"
    assert result.data["policy"]["generation"]["vllm_cfg"]["pow2_weight_scaling_factors"] is True
    kept = [n for n in result.notes if "kept as your config states it" in n]
    assert len(kept) == 2, result.notes
    # stated otherwise: refused, naming both values
    stated = _child(
        tmp_path, "0.7.0", EIGHT_B, {"recipe": "fp8_blockwise", "kv_cache": "auto"}, **top
    )
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, stated, stack="nemo-rl-0.7.0")
    assert err.value.key == "policy.generation.vllm_cfg.kv_cache_dtype"
    assert "'fp8'" in str(err.value) and "'auto'" in str(err.value)


# --------------------------------------------------------------------------- --host and the shape


def test_apply_host_megatron_on_a_nemo_rl_config_is_refused_and_force_overrides(tmp_path, capsys):
    """Was: exit 0, the request deleted and a root ``model: {fp8: ...}`` written, which NeMo RL
    ignores (a silent BF16 run)."""
    from conftest import NEMO_RL_TRIMMED as example
    from conftest import REPO

    out = tmp_path / "out.yaml"
    assert main(["apply", str(example), "--host", "megatron", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--host" in err
    assert "nemo-rl config" in err and "not a megatron one" in err and not out.exists()
    assert main(["apply", str(example), "--host", "megatron", "--force", "-o", str(out)]) == 0
    assert "--force: megatron's keys written into a nemo-rl config" in capsys.readouterr().err
    # a megatron-core model config is also a NeMo 2 / Bridge overlay: not refused
    model = REPO / "conf" / "examples" / "megatron_gpt_fp8_current.yaml"
    assert main(["apply", str(model), "--host", "nemo2", "-o", str(tmp_path / "n.yaml")]) == 0
    assert "--force" not in capsys.readouterr().err

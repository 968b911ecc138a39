"""Router replay (``fp8.router_replay`` -> ``policy.router_replay.enabled``) and sequence masking
(``importance_sampling.max_sequence_error`` -> ``grpo.seq_logprob_error_threshold``), written for
the NeMo RL releases that read them and judged by each release's own code.

NeMo RL does not install here (HOSTS.md): its functions are compiled from each release's source
in the shared test data (``shared_nemo_rl``) and run on the configuration ``apply`` writes,
resolved over its ``defaults:`` parents as NeMo RL resolves it (``nemo_rl_cases.resolved``).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from nemo_rl_cases import RELEASE_CONFIGS, RELEASE_SOURCE, resolved

from conftest import shared_nemo_rl
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.config import load_config_chain
from nemo_fp8_plugin.errors import ConflictingKeyError, FP8ConfigError
from nemo_fp8_plugin.hosts import apply_path, load_context, read_native
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL

pytestmark = pytest.mark.torch_free

MAIN = stacks.NEMO_RL_MAIN
STACK = {r.name: f"nemo-rl-{r.name}" for r in stacks.NEMO_RL_RELEASES}
MOONLIGHT = "recipes/llm/grpo-moonlight-16ba3b-4n8g-megatron.yaml"  # MoE, 64 experts
EIGHT_B = "grpo_math_8B_megatron.yaml"  # dense
REPLAY = "policy.router_replay.enabled"
THRESHOLD = "grpo.seq_logprob_error_threshold"


def _child(tmp_path: Path, release: str, base: str, fp8: dict, **top: Any) -> Path:
    parent = shared_nemo_rl(f"{RELEASE_CONFIGS[release]}examples/configs/{base}")
    path = tmp_path / f"child-{release}.yaml"
    path.write_text(yaml.safe_dump({"defaults": str(parent), "fp8": fp8, **top}, sort_keys=False))
    return path


def _written(tmp_path: Path, result) -> dict:
    """The output as NeMo RL resolves it (its parents merged, OmegaConf)."""
    out = tmp_path / "out.yaml"
    out.write_text(yaml.safe_dump(result.data, sort_keys=False))
    return resolved(out)


def _functions(release: str, path: str, names: tuple[str, ...], **ns: Any) -> dict[str, Any]:
    """``names`` compiled from NeMo RL ``release``'s ``path`` (its own code, imports left out)."""
    source = shared_nemo_rl(f"{RELEASE_SOURCE[release]}/{path}")
    tree = ast.parse(source.read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in body} == set(names), (release, path)
    for fn in body:  # annotations name NeMo RL's classes: dropped, nothing else
        fn.returns = None
        for arg in fn.args.args:
            arg.annotation = None
    exec(compile(ast.Module(body=body, type_ignores=[]), str(source), "exec"), ns)
    return ns


def _router_replay(release: str) -> dict[str, Any]:
    """NeMo RL's router_replay_enabled / configure_vllm_for_router_replay /
    validate_router_replay_config; the Megatron patch it installs at the end is stubbed (it
    imports megatron-core's RouterReplay, and changes no configuration)."""
    return _functions(
        release,
        "nemo_rl/models/megatron/router_replay.py",
        (
            "router_replay_enabled",
            "configure_vllm_for_router_replay",
            "validate_router_replay_config",
        ),
        _install_missing_route_fallback_patch=lambda: None,
    )


# --------------------------------------------------------------------------- router replay


@pytest.mark.parametrize("release", ["0.7.0", MAIN])
def test_router_replay_is_written_where_the_release_reads_it(tmp_path, release):
    """NeMo RL's own functions on the written config: replay on, vLLM asked for the routed
    experts (by NeMo RL itself: the plugin writes no vllm_kwargs), and nothing refused."""
    src = _child(tmp_path, release, MOONLIGHT, {"recipe": "fp8_blockwise", "router_replay": True})
    result = apply_path(NEMO_RL, src, stack=STACK[release])
    assert result.written["policy"]["router_replay"] == {"enabled": True}
    assert "vllm_kwargs" not in result.written["policy"]["generation"]
    policy = _written(tmp_path, result)["policy"]
    nemo_rl = _router_replay(release)
    assert nemo_rl["router_replay_enabled"](policy) is True
    nemo_rl["validate_router_replay_config"](policy)
    nemo_rl["configure_vllm_for_router_replay"](policy)
    assert policy["generation"]["vllm_kwargs"]["enable_return_routed_experts"] is True
    # read back, and no suggestion to turn it on once it is
    spec = read_native(load_context(tmp_path / "out.yaml", stack=STACK[release]), "nemo-rl").spec
    assert spec.router_replay is True
    assert not [n for n in result.notes if "router replay" in n]


def test_router_replay_is_refused_naming_v0_6_0(tmp_path):
    assert not (
        shared_nemo_rl(RELEASE_SOURCE["0.6.0"]) / "nemo_rl/models/megatron/router_replay.py"
    ).exists()
    src = _child(tmp_path, "0.6.0", MOONLIGHT, {"recipe": "fp8_blockwise", "router_replay": True})
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src, stack=STACK["0.6.0"])
    message = str(err.value)
    assert err.value.key == "fp8.router_replay" and "NeMo RL v0.6.0 cannot replay" in message
    assert "\n" not in message and "--stack nemo-rl-0.7.0" in message


def test_router_replay_needs_experts_and_rollouts(tmp_path):
    src = _child(tmp_path, "0.7.0", EIGHT_B, {"recipe": "fp8_blockwise", "router_replay": True})
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src, stack=STACK["0.7.0"])
    assert err.value.key == "fp8.router_replay" and "has no experts" in str(err.value)
    sft = tmp_path / "sft.yaml"
    sft.write_text(
        yaml.safe_dump(
            {
                "policy": {
                    "model_name": "moonshotai/Moonlight-16B-A3B-Instruct",
                    "megatron_cfg": {"enabled": True},
                },
                "fp8": {"recipe": "fp8_blockwise", "router_replay": True},
            }
        )
    )
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, sft, stack=STACK["0.7.0"])
    assert err.value.key == "fp8.router_replay" and "no policy.generation" in str(err.value)


@pytest.mark.parametrize(
    "top, fp8, key",
    [
        (
            {"policy": {"generation": {"backend": "megatron"}}},
            {"generation": "bf16"},
            "policy.generation.backend",
        ),
        (
            {"policy": {"megatron_cfg": {"enabled": False}, "dtensor_cfg": {"enabled": True}}},
            {"training": "bf16"},
            "policy.megatron_cfg.enabled",
        ),
        (
            {"policy": {"megatron_cfg": {"virtual_pipeline_model_parallel_size": 2}}},
            {},
            "policy.megatron_cfg.virtual_pipeline_model_parallel_size",
        ),
    ],
    ids=["not-vllm", "dtensor", "virtual-pipeline"],
)
@pytest.mark.parametrize("release", ["0.7.0", MAIN])
def test_what_nemo_rls_router_replay_refuses_is_refused_by_name(tmp_path, release, top, fp8, key):
    """The config NeMo RL's validate_router_replay_config raises on is refused, naming the key."""
    block = {"recipe": "fp8_blockwise", "router_replay": True, **fp8}
    src = _child(tmp_path, release, MOONLIGHT, block, **top)
    policy = load_config_chain(src)[1]["policy"]
    policy["router_replay"] = {"enabled": True}
    with pytest.raises(ValueError):
        _router_replay(release)["validate_router_replay_config"](policy)
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src, stack=STACK[release])
    assert err.value.key == key and "\n" not in str(err.value)


def test_router_replay_is_suggested_for_moe_fp8_rollouts_only(tmp_path):
    def suggested(base: str, fp8: dict, release: str = "0.7.0") -> list[str]:
        result = apply_path(NEMO_RL, _child(tmp_path, release, base, fp8), stack=STACK[release])
        return [n for n in result.notes if "router_replay: true" in n]

    (note,) = suggested(MOONLIGHT, {"recipe": "fp8_blockwise"})
    assert REPLAY in note and "mixture of experts generating in FP8" in note
    assert not suggested(EIGHT_B, {"recipe": "fp8_blockwise"})  # dense
    assert not suggested(MOONLIGHT, {"recipe": "fp8_blockwise", "generation": "bf16"})
    (old,) = suggested(MOONLIGHT, {"recipe": "fp8_blockwise"}, "0.6.0")
    assert "NeMo RL v0.7.0 on; NeMo RL v0.6.0 has none" in old


# --------------------------------------------------------------------------- sequence masking


class _Config(dict):
    """A resolved config read as NeMo RL's code reads it: ``cfg["grpo"]`` and ``cfg.grpo``."""

    def __getattr__(self, name: str) -> Any:
        value = self[name]
        return _Config(value) if isinstance(value, dict) else value

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        return _Config(value) if isinstance(value, dict) else value


def _nemo_rl_threshold(release: str, config: dict) -> Any:
    """The threshold as the release's GRPO loop reads it: the first expression of its grpo.py
    naming the key (v0.6.0 a subscript, v0.7.0 ``.get(..., None)``, main an attribute)."""
    tree = ast.parse(
        shared_nemo_rl(f"{RELEASE_SOURCE[release]}/nemo_rl/algorithms/grpo.py").read_text()
    )
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) and not isinstance(node, ast.keyword):
            continue
        expr = node.value
        text = ast.unparse(expr)
        if "seq_logprob_error_threshold" in text and text.startswith("master_config"):
            return eval(
                compile(ast.Expression(expr), "grpo.py", "eval"), {"master_config": _Config(config)}
            )
    raise AssertionError(release)


@pytest.mark.parametrize("release", list(STACK))
def test_the_threshold_is_written_and_read_as_each_release_reads_it(tmp_path, release):
    fp8 = {"recipe": "fp8_blockwise", "importance_sampling": {"max_sequence_error": 1.5}}
    result = apply_path(NEMO_RL, _child(tmp_path, release, EIGHT_B, fp8), stack=STACK[release])
    assert result.written["grpo"] == {"seq_logprob_error_threshold": 1.5}
    assert _nemo_rl_threshold(release, _written(tmp_path, result)) == 1.5
    spec = read_native(load_context(tmp_path / "out.yaml", stack=STACK[release]), "nemo-rl").spec
    assert spec.importance_sampling.max_sequence_error == 1.5


def _standalone(tmp_path: Path, release: str, drop: str, fp8: dict) -> Path:
    """NVIDIA's 8B GRPO config of ``release`` resolved into one file, ``drop`` removed."""
    data = load_config_chain(
        shared_nemo_rl(f"{RELEASE_CONFIGS[release]}examples/configs/{EIGHT_B}")
    )[1]
    data = dict(data)
    head, _, leaf = drop.rpartition(".")
    node = data
    for part in head.split(".") if head else ():
        node = node[part]
    del node[leaf]
    data["fp8"] = fp8
    path = tmp_path / "standalone.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_v0_6_0_gets_the_key_it_reads_without_a_default(tmp_path):
    src = _standalone(tmp_path, "0.6.0", THRESHOLD, {"recipe": "fp8_blockwise"})
    with pytest.raises(KeyError):
        _nemo_rl_threshold("0.6.0", load_config_chain(src)[1])
    result = apply_path(NEMO_RL, src, stack=STACK["0.6.0"])
    assert result.written["grpo"] == {"seq_logprob_error_threshold": None}
    assert _nemo_rl_threshold("0.6.0", _written(tmp_path, result)) is None
    src = _standalone(tmp_path, "0.7.0", THRESHOLD, {"recipe": "fp8_blockwise"})
    later = apply_path(NEMO_RL, src, stack=STACK["0.7.0"])  # .get(..., None): nothing to add
    assert (
        "grpo" not in later.written
        and _nemo_rl_threshold("0.7.0", _written(tmp_path, later)) is None
    )


def test_sequence_masking_needs_a_grpo_config(tmp_path):
    fp8 = {"recipe": "fp8_blockwise", "importance_sampling": {"max_sequence_error": 1.5}}
    src = _standalone(tmp_path, "0.7.0", "grpo", fp8)
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src, stack=STACK["0.7.0"])
    assert err.value.key == "fp8.importance_sampling.max_sequence_error"
    assert "GRPO only" in str(err.value)


def test_a_configs_own_threshold_stands_unless_the_block_states_one(tmp_path):
    top = {"grpo": {"seq_logprob_error_threshold": 2.0}}
    src = _child(tmp_path, "0.7.0", EIGHT_B, {"recipe": "fp8_blockwise"}, **top)
    result = apply_path(NEMO_RL, src, stack=STACK["0.7.0"])
    assert result.data["grpo"]["seq_logprob_error_threshold"] == 2.0
    assert any(f"{THRESHOLD}: 2.0 kept as your config states it" in n for n in result.notes)
    stated = {"recipe": "fp8_blockwise", "importance_sampling": {"max_sequence_error": 1.5}}
    with pytest.raises(ConflictingKeyError) as err:
        apply_path(NEMO_RL, _child(tmp_path, "0.7.0", EIGHT_B, stated, **top), stack=STACK["0.7.0"])
    assert err.value.key == THRESHOLD


def test_a_release_without_the_key_is_refused_naming_it(tmp_path, monkeypatch):
    """No release read lacks it (v0.5.0 did, not in the table): the table made to say v0.6.0
    lacks it, the refusal names the release and the field."""
    row = stacks.nemo_rl_key_fact(THRESHOLD)
    assert row is not None
    without = dataclasses.replace(row, versions=stacks._releases("0.7.0", MAIN))
    monkeypatch.setitem(stacks._BY_NAME, ("nemo-rl", THRESHOLD), without)
    fp8 = {"recipe": "fp8_blockwise", "importance_sampling": {"max_sequence_error": 1.5}}
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, _child(tmp_path, "0.6.0", EIGHT_B, fp8), stack=STACK["0.6.0"])
    assert err.value.key == "fp8.importance_sampling.max_sequence_error"
    assert "NeMo RL v0.6.0 cannot drop sequences" in str(err.value)


def test_modelopt_qat_takes_the_rl_options_too(tmp_path):
    """ModelOpt QAT leaves the loss as the config states, but router replay and sequence
    masking are policy and GRPO keys: written (Qwen3-30B-A3B's experts-w4a4 is a MoE recipe)."""
    fp8 = {
        "recipe": "nvfp4",
        "qat": "experts-w4a4",
        "router_replay": True,
        "importance_sampling": {"max_sequence_error": 1.5},
    }
    result = apply_path(NEMO_RL, _child(tmp_path, MAIN, MOONLIGHT, fp8), stack=STACK[MAIN])
    assert result.written["policy"]["router_replay"] == {"enabled": True}
    assert result.written["grpo"] == {"seq_logprob_error_threshold": 1.5}
    assert "quant_cfg" in result.written["policy"]

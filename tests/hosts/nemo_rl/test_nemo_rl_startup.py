"""NeMo RL's own FP8 start-up asserts, refused by ``apply`` / ``explain`` before NeMo RL stops at
step 0, each naming the key (``hosts/nemo_rl/startup.py``); the lines they cite are read in
each release's source (shared test data, ``shared_nemo_rl``)."""

from __future__ import annotations

import pytest
import yaml

from conftest import REPO, shared_nemo_rl
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import apply_path, load_context
from nemo_fp8_plugin.hosts.nemo_rl import ADAPTER as NEMO_RL
from nemo_fp8_plugin.hosts.nemo_rl.startup import ASSERTS, startup_problems

pytestmark = pytest.mark.torch_free

SOURCE = {"0.6.0": "releases/v0.6.0", "0.7.0": "releases/v0.7.0", stacks.NEMO_RL_MAIN: "src"}
CONFIGS = {"0.6.0": "releases/v0.6.0/", "0.7.0": "releases/v0.7.0/", stacks.NEMO_RL_MAIN: ""}
STACK = {r.name: f"nemo-rl-{r.name}" for r in stacks.NEMO_RL_RELEASES}

# What each cited line holds (NeMo RL's own condition), whatever the release's line numbers.
CONDITION = {
    "fp8_generation_needs_importance_sampling": "use_importance_sampling_correction",
    "fp8_kv_cache_not_dtensor": 'policy_config["dtensor_cfg"]["enabled"] == False',
    "fp8_kv_cache_not_async": "should_use_async_rollouts(",
    "fp8_kv_cache_needs_pipeline_size_1": '["pipeline_model_parallel_size"] == 1',
    "kv_cache_dtype_values": 'if kv_cache_dtype not in ["auto", "fp8", "fp8_e4m3"]',
    "truncation_needs_importance_sampling": "assert self.use_importance_sampling_correction",
    "truncation_ratio_positive": "assert",
    "truncation_type_known": "assert self.truncated_importance_sampling_type in (",
    "router_replay_needs_vllm": 'if generation.get("backend") != "vllm":',
    "router_replay_needs_megatron": 'if not megatron_cfg.get("enabled", False):',
    "router_replay_no_virtual_pipeline": "if vpp_size not in (None, 1):",
}


@pytest.mark.parametrize("name", sorted(ASSERTS))
def test_each_cited_line_is_the_releases_own_condition(name):
    """Every release named has the condition at the cited line; a release not named has it
    nowhere in the cited file (router replay: no such file at v0.6.0)."""
    assert set(ASSERTS[name]) <= set(SOURCE), name
    path = next(iter(ASSERTS[name].values()))[0]
    for release in set(SOURCE) - set(ASSERTS[name]):
        file = shared_nemo_rl(SOURCE[release]) / path
        assert not file.is_file() or CONDITION[name] not in file.read_text(), (name, release)
    for release, (path, line) in ASSERTS[name].items():
        lines = shared_nemo_rl(f"{SOURCE[release]}/{path}").read_text().splitlines()
        assert CONDITION[name] in lines[line - 1], (name, release, lines[line - 1])
        if name == "truncation_ratio_positive":  # the assert spans lines up to "> 0"
            assert "truncated_importance_sampling_ratio > 0" in "".join(lines[line - 1 : line + 3])


def _child(tmp_path, release: str, base: str, fp8: dict, **top):
    path = tmp_path / "child.yaml"
    parent = shared_nemo_rl(f"{CONFIGS[release]}examples/configs/{base}")
    path.write_text(yaml.safe_dump({"defaults": str(parent), "fp8": fp8, **top}, sort_keys=False))
    return path


def _refused(tmp_path, release, base, fp8, **top) -> FP8ConfigError:
    src = _child(tmp_path, release, base, fp8, **top)
    with pytest.raises(FP8ConfigError) as err:
        apply_path(NEMO_RL, src, stack=STACK[release])
    assert "\n" not in str(
        err.value
    ) and f"{stacks.release_label(release)} stops at start-up" in str(err.value)
    return err.value


RELEASES = list(SOURCE)
ASYNC = "recipes/llm/performance/grpo-llama3.1-8b-instruct-2n8g-async-1off.yaml"


@pytest.mark.parametrize("release", RELEASES)
def test_fp8_generation_without_importance_sampling(tmp_path, release):
    err = _refused(
        tmp_path,
        release,
        "grpo_math_8B_megatron.yaml",
        {"recipe": "fp8_blockwise", "importance_sampling": False},
    )
    assert err.key == "fp8.importance_sampling"
    assert ASSERTS["fp8_generation_needs_importance_sampling"][release][0] in str(err)


@pytest.mark.parametrize("release", RELEASES)
def test_fp8_kv_cache_with_pipeline_parallelism(tmp_path, capsys, release):
    """NVIDIA's grpo_math_8B_megatron.yaml has pipeline_model_parallel_size 2."""
    fp8 = {"recipe": "fp8_blockwise", "kv_cache": "fp8"}
    err = _refused(tmp_path, release, "grpo_math_8B_megatron.yaml", fp8)
    assert err.key == "policy.megatron_cfg.pipeline_model_parallel_size" and err.value == 2
    src = _child(tmp_path, release, "grpo_math_8B_megatron.yaml", fp8)
    for command in (["explain"], ["apply", "--host", "nemo-rl"]):  # explain refuses it too
        assert main([*command, str(src), "--stack", STACK[release]]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert "policy.megatron_cfg.pipeline_model_parallel_size" in line


@pytest.mark.parametrize("release", RELEASES)
def test_fp8_kv_cache_with_the_dtensor_policy(tmp_path, release):
    """grpo_math_1B.yaml trains with DTensor: FP8 generation only, with an FP8 KV cache."""
    fp8 = {"recipe": "fp8_blockwise", "training": "bf16", "kv_cache": "fp8"}
    err = _refused(tmp_path, release, "grpo_math_1B.yaml", fp8)
    assert err.key == "policy.dtensor_cfg.enabled"


@pytest.mark.parametrize("release", RELEASES)
def test_fp8_kv_cache_with_asynchronous_rollouts(tmp_path, release):
    err = _refused(tmp_path, release, ASYNC, {"recipe": "fp8_blockwise", "kv_cache": "fp8"})
    assert err.key == "policy.generation.vllm_cfg.async_engine"
    # the same config without the FP8 KV cache is fine
    apply_path(
        NEMO_RL, _child(tmp_path, release, ASYNC, {"recipe": "fp8_blockwise"}), stack=STACK[release]
    )


@pytest.mark.parametrize("value", [["fp8"], "fp8_e5m2", 8])
def test_a_kv_cache_dtype_nemo_rl_does_not_take(tmp_path, capsys, value):
    """Was: a TypeError traceback for a list (``hosts/nemo_rl/checks.py``); NeMo RL's init_fp8
    raises on anything but auto / fp8 / fp8_e4m3."""
    top = {"policy": {"generation": {"vllm_cfg": {"kv_cache_dtype": value}}}}
    src = _child(
        tmp_path, "0.7.0", "grpo_math_8B_megatron.yaml", {"recipe": "fp8_blockwise"}, **top
    )
    assert main(["apply", str(src), "--host", "nemo-rl"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "policy.generation.vllm_cfg.kv_cache_dtype" in err
    assert "Traceback" not in err


def test_doctor_can_list_every_problem_of_a_config():
    """``startup_problems`` states all of them on a whole config (for doctor): NVIDIA's FP8
    8B config given an FP8 KV cache, the DTensor policy and asynchronous rollouts."""
    ctx = load_context(shared_nemo_rl("examples/configs/grpo_math_8B_megatron_fp8.yaml"))
    config = yaml.safe_load(yaml.safe_dump(dict(ctx.resolved)))
    assert startup_problems(config, stacks.NEMO_RL_MAIN) == []  # NVIDIA's own: fine
    config["policy"]["generation"]["vllm_cfg"].update(kv_cache_dtype="fp8", async_engine=True)
    config["policy"]["dtensor_cfg"]["enabled"] = True
    config["loss_fn"]["use_importance_sampling_correction"] = False
    keys = [p.key for p in startup_problems(config, "0.7.0")]
    assert keys == [
        "loss_fn.use_importance_sampling_correction",
        "policy.dtensor_cfg.enabled",
        "policy.generation.vllm_cfg.async_engine",
        "policy.megatron_cfg.pipeline_model_parallel_size",
    ]


@pytest.mark.parametrize("release", RELEASES)
def test_the_shipped_rollouts_example_runs_on_every_release(tmp_path, release):
    """examples/nemo_rl/grpo_llama8b_fp8_rollouts.yaml (FP8 KV cache, ICE-POP) over each
    release's own 8B config: accepted (it sets pipeline_model_parallel_size 1)."""
    data = yaml.safe_load(
        (REPO / "examples" / "nemo_rl" / "grpo_llama8b_fp8_rollouts.yaml").read_text()
    )
    data["defaults"] = str(
        shared_nemo_rl(f"{CONFIGS[release]}examples/configs/grpo_math_8B_megatron.yaml")
    )
    src = tmp_path / "rollouts.yaml"
    src.write_text(yaml.safe_dump(data, sort_keys=False))
    result = apply_path(NEMO_RL, src, stack=STACK[release])
    vllm = result.data["policy"]["generation"]["vllm_cfg"]
    assert vllm["kv_cache_dtype"] == "fp8" and vllm["precision"] == "fp8"
    assert result.data["loss_fn"]["truncated_importance_sampling_type"] == "icepop"


def test_doctor_says_what_nemo_rl_would_stop_on(tmp_path, capsys):
    src = _child(
        tmp_path,
        "0.7.0",
        "grpo_math_8B_megatron.yaml",
        {"recipe": "fp8_blockwise", "kv_cache": "fp8"},
    )
    assert main(["doctor", str(src), "--hardware", "h100", "--json"]) == 1
    import json

    (verdict,) = json.loads(capsys.readouterr().out)["recipes"]
    assert verdict["runnable"] is False
    assert any(
        p.startswith("policy.megatron_cfg.pipeline_model_parallel_size:") and "grpo.py" in p
        for p in verdict["problems"]
    )

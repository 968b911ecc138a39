"""NeMo RL ``${...}`` interpolations are resolved within limits (``errors.LIMITS``:
``interpolations``, ``interpolation_depth``, ``interpolated_chars``), each past its limit one
line naming the key, before OmegaConf does the work: OmegaConf re-evaluates a reference each
time it is reached (``k0: ${k1}${k1}`` ... doubles per line: 12 lines took seconds, 18 over
five minutes), ``${mul:'abcdefghij',100000000}`` built a gigabyte, and 200 nested
``${add:1,...}`` ended in a RecursionError traceback. Each test failed before the change, but
the one marked as a guard."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts.nemo_rl.values import NEMO_RL_RESOLVERS, interpolated, resolved_value

KEY = "policy.megatron_cfg.tensor_model_parallel_size"
DEPTH = 32  # LIMITS.interpolation_depth


def _doubling(lines: int) -> dict:
    """``k0: ${k1}${k1}``, ..., ``k<lines>: x``: 2^lines evaluations for k0."""
    cfg: dict = {f"k{i}": f"${{k{i + 1}}}${{k{i + 1}}}" for i in range(lines)}
    cfg[f"k{lines}"] = "x"
    return cfg


def _chain(length: int) -> dict:
    cfg: dict = {f"k{i}": f"${{k{i + 1}}}" for i in range(length)}
    cfg[f"k{length}"] = 3
    return cfg


def _nested(levels: int) -> str:
    text = "1"
    for _ in range(levels):
        text = f"${{add:1,{text}}}"
    return text


def test_references_reached_exponentially_often_are_refused_before_omegaconf_runs():
    with pytest.raises(FP8ConfigError) as err:
        resolved_value(_doubling(12), "k0")  # 8,191 evaluations: about 2 s in OmegaConf
    assert err.value.key == "k0" and "evaluations" in str(err.value)
    assert resolved_value(_doubling(8), "k0") == "x" * 256  # 511: within the limit


def test_a_chain_as_long_as_the_depth_limit_resolves():
    """A guard (it passed before): each key read once is counted once."""
    assert resolved_value(_chain(DEPTH - 1), "k0") == 3


def test_a_chain_longer_than_the_depth_limit_is_refused():
    with pytest.raises(FP8ConfigError, match="references chained") as err:
        resolved_value(_chain(DEPTH + 5), "k0")
    assert err.value.key == "k0"


def test_deep_nesting_in_one_value_is_refused_not_a_recursion_error():
    with pytest.raises(FP8ConfigError, match="levels nested") as err:
        resolved_value({"a": _nested(200)}, "a")
    assert err.value.key == "a"
    assert resolved_value({"a": _nested(20)}, "a") == 21


@pytest.mark.parametrize(
    "value",
    ["${mul:'abcdefghij',1000000}", "${mul:${s},1000000}", "${mul:1000000,${s}}"],
)
def test_a_resolver_result_longer_than_the_limit_is_refused_before_it_is_built(value):
    with pytest.raises(FP8ConfigError, match="would build 10000000") as err:
        resolved_value({"a": value, "s": "abcdefghij"}, "a")
    assert err.value.key == "a"


def test_what_nemo_rl_configs_write_still_resolves():
    cfg = {
        "tp": 2,
        "policy": {
            "max_total_sequence_length": 4096,
            "train_micro_batch_size": 2,
            "logprob": "${mul:${policy.max_total_sequence_length}, ${policy.train_micro_batch_size}}",
            "generation": {"top_p": 1.0, "vllm_cfg": {"top_p": "${..top_p}"}},
            "sizes": [8, "${policy.sizes[0]}", "${tp}"],
        },
        "missing": "${nowhere}",
    }
    assert resolved_value(cfg, "policy.logprob") == 8192
    assert resolved_value(cfg, "policy.generation.vllm_cfg.top_p") == 1.0
    assert interpolated({"l": [8, "${l[0]}"], "m": {"a": 1, "b": "${.a}"}}) == {
        "l": [8, 8],
        "m": {"a": 1, "b": 1},
    }
    with pytest.raises(FP8ConfigError, match="nowhere") as err:
        resolved_value(cfg, "missing")
    assert "\n" not in str(err.value)


def test_a_reference_to_itself_is_one_error():
    with pytest.raises(FP8ConfigError, match="refers back to itself"):
        resolved_value({"a": "${b}", "b": "${a}"}, "a")


def test_resolvers_registered_before_are_kept():
    """A process that imported NeMo RL keeps NeMo RL's resolvers; one that did not is left
    without any. The resolver table is put back afterwards, whatever ran before in this worker."""
    from omegaconf.basecontainer import BaseContainer

    saved = dict(BaseContainer._resolvers)
    marker = object()
    try:
        for name in NEMO_RL_RESOLVERS:
            OmegaConf.clear_resolver(name)
        OmegaConf.register_new_resolver("mul", lambda a, b: marker, replace=True)
        assert resolved_value({"a": "${mul:2,3}"}, "a") == 6
        assert OmegaConf.create({"b": "${mul:2,3}"}).b is marker
        OmegaConf.clear_resolver("mul")
        assert resolved_value({"a": "${add:2,3}"}, "a") == 5
        assert not any(OmegaConf.has_resolver(name) for name in NEMO_RL_RESOLVERS)
    finally:
        BaseContainer._resolvers.clear()
        BaseContainer._resolvers.update(saved)


def test_the_cli_says_one_line(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    lines = "\n".join(f"k{i}: '${{k{i + 1}}}${{k{i + 1}}}'" for i in range(14))
    config.write_text(
        "policy:\n  precision: fp8_blockwise\n  model_name: meta-llama/Llama-3.1-8B\n"
        f"  megatron_cfg:\n    enabled: true\n    tensor_model_parallel_size: ${{k0}}\n"
        f"{lines}\nk14: '1'\n"
    )
    for command in (["explain"], ["apply", "--host", "nemo-rl"]):
        capsys.readouterr()
        rc = main([*command, str(config)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and KEY in err[0] and "evaluations" in err[0], err

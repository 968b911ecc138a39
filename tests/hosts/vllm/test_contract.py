"""Contract tests: vLLM itself judges everything the plugin writes or decides for it.

(a) **Engine configs.** Every engine config ``nemo-fp8 apply --host vllm`` and
``engine_kwargs`` can write (each recipe x KV cache ``auto``/``fp8`` x every vLLM example
under ``conf/examples/``, in both key spellings, with ``device: cpu``) goes through vLLM's
own code: ``EngineArgs(**kwargs)`` (the mapping of ``vllm.LLM``), the argument parser of
``vllm serve --config`` (``FlexibleArgumentParser`` + ``EngineArgs.add_cli_args``), vLLM's
quantization registry (``get_quantization_config``: our registered ``nemo_fp8``) and
``create_engine_config`` on this CPU machine.

The GPU branches (vLLM's kernel selection on a patched platform) are in
``test_contract_gpu.py`` and ``test_contract_stock.py`` (a stock install per GPU); the
emulation numerics in ``test_contract_emulation.py``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import tomllib
import vllm

# Modules that evaluate CUDA capabilities at import time are imported here, on the real
# (CPU) platform, before any test patches it.
import vllm.model_executor.layers.fused_moe.oracle.fp8
import vllm.model_executor.layers.fused_moe.oracle.mxfp8
import vllm.model_executor.layers.quantization.online.fp8
import vllm.model_executor.layers.quantization.online.mxfp8
import vllm.model_executor.models.mixtral
import yaml

from nemo_fp8_plugin.hosts import apply_mapping, get_adapter
from nemo_fp8_plugin.hosts.vllm import (
    QUANT_METHOD,
    engine_kwargs,
    quantization_config,
)
from nemo_fp8_plugin.registry import get_recipe, list_recipes
from tiny_models import LLAMA, llama_state_dict, write_checkpoint


def apply_vllm(config):
    """``apply --host vllm`` on a mapping: (output, warnings)."""
    result = apply_mapping(get_adapter("vllm"), config)
    return result.data, [str(w) for w in result.warnings]


pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[3]
# nvfp4 has no vLLM generation path: refused with the reason (test_nvfp4_is_refused_with_the_reason)
RECIPES = sorted(s.name for s in list_recipes() if s.scaling != "nvfp4")
EXAMPLES = sorted(p for p in (REPO / "conf" / "examples").glob("*.yaml") if "vllm" in p.name)
HF_NAME = "meta-llama/Llama-3.1-8B-Instruct"


# =========================================================================== (a) engine configs


def _qcfg(recipe) -> dict:
    q = quantization_config(recipe)
    q.pop("_warnings")
    return q


def _with_request(config: dict, recipe: str, kv: str) -> dict:
    """An example config with its recipe request replaced by (recipe, kv)."""
    config = dict(config)
    block = config.pop("fp8", None)
    config.pop("precision", None)
    block = dict(block) if isinstance(block, dict) else {}
    config["fp8"] = {**block, "recipe": recipe, "kv_cache": kv}
    return config


def _written(source: str, recipe: str, kv: str) -> tuple[dict, list[str]]:
    """The engine config the plugin writes for one case, and its warnings."""
    spec = {"recipe": recipe, "kv_cache": kv}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if source == "engine_kwargs":
            return {"model": HF_NAME, **engine_kwargs(spec)}, [str(w.message) for w in caught]
        if source == "engine_kwargs-cpu":
            return (
                {"model": HF_NAME, **engine_kwargs(spec, platform="cpu")},
                [str(w.message) for w in caught],
            )
    if source == "apply":
        return apply_vllm({"model": HF_NAME, "max_model_len": 4096, "fp8": spec})
    if source == "apply-hyphen":
        return apply_vllm(
            {"model": HF_NAME, "max-model-len": 4096, "tensor-parallel-size": 1, "fp8": spec}
        )
    if source == "apply-device-cpu":
        return apply_vllm({"model": HF_NAME, "device": "cpu", "fp8": spec})
    example = REPO / "conf" / "examples" / source.split(":", 1)[1]
    return apply_vllm(_with_request(yaml.safe_load(example.read_text()), recipe, kv))


SOURCES = [
    "engine_kwargs",
    "engine_kwargs-cpu",
    "apply",
    "apply-hyphen",
    "apply-device-cpu",
    *[f"example:{p.name}" for p in EXAMPLES],
]
CASES = [
    pytest.param(s, r, kv, id=f"{s}-{r}-{kv}")
    for s in SOURCES
    for r in RECIPES
    for kv in ("auto", "fp8")
]


def test_the_cases_cover_every_vllm_example_and_recipe():
    assert {p.name for p in EXAMPLES} >= {
        "vllm_llama8b_fp8_blockwise.yaml",
        "vllm_moonlight_fp8_kv.yaml",
    }
    assert set(RECIPES) >= {
        "fp8_blockwise",
        "fp8_subchannel",
        "mxfp8",
        "fp8_current",
        "fp8_delayed",
    }
    # Every example meant for vLLM is one `vllm serve --config` file naming a recipe.
    for example in EXAMPLES:
        data = yaml.safe_load(example.read_text())
        assert "model" in data and ("precision" in data or "fp8" in data), example


def test_nvfp4_is_refused_with_the_reason():
    """vLLM serves NVFP4 only from a ModelOpt / compressed-tensors checkpoint on Blackwell,
    which the plugin does not export: every way in refuses, naming the key, one line."""
    from nemo_fp8_plugin import FP8ConfigError

    for call in (
        lambda: engine_kwargs("nvfp4"),
        lambda: apply_vllm({"model": HF_NAME, "max_model_len": 4096, "fp8": {"recipe": "nvfp4"}}),
    ):
        with pytest.raises(FP8ConfigError) as err:
            call()
        assert err.value.key == "scaling" and "ModelOpt" in str(err.value)
        assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("contract-llama"), LLAMA, llama_state_dict())


@pytest.mark.parametrize("source,recipe,kv", CASES)
def test_every_engine_config_is_accepted_by_vllm(source, recipe, kv, tmp_path, tiny_dir):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization import get_quantization_config
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    written, found = _written(source, recipe, kv)
    spec = get_recipe({"recipe": recipe, "kv_cache": kv})
    fp8_generation = spec.generation == "fp8" and spec.scaling in ("block", "mx")
    assert "calculate_kv_scales" not in {k.replace("-", "_") for k in written}
    assert "device" not in written
    if source == "apply-device-cpu":
        assert any(w.startswith("vllm: device:") for w in found), found

    # 1. vllm.LLM(**mapping): EngineArgs is a dataclass; an unknown key is a TypeError.
    kwargs = {k.replace("-", "_"): v for k, v in written.items()}
    args = EngineArgs(**kwargs)
    # 2. `vllm serve --config FILE`: vLLM's own parser (unknown options exit).
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(written))
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    cli = EngineArgs.from_cli_args(parser.parse_args(["--config", str(path)]))
    assert cli.quantization == args.quantization
    assert cli.kv_cache_dtype == args.kv_cache_dtype
    assert cli.hf_overrides == args.hf_overrides

    if not fp8_generation:
        assert args.quantization is None
        assert not (args.hf_overrides or {}).get("quantization_config")
        return
    # 3. vLLM's quantization registry: the registered nemo_fp8 parses what we wrote.
    assert args.quantization == QUANT_METHOD
    qcfg = args.hf_overrides["quantization_config"]
    quant = get_quantization_config(args.quantization).from_config(qcfg)
    assert isinstance(quant, NemoFp8Config)
    assert quant.scheme == spec.scaling and quant.weight_block_size == list(spec.weight_block)
    assert quant.pow2_scales == bool(spec.pow2_scales)
    cpu = source in ("engine_kwargs-cpu", "apply-device-cpu")
    want_kv = "fp8_e4m3" if kv == "fp8" and not cpu else "auto"
    assert args.kv_cache_dtype == want_kv and qcfg["kv_cache_dtype"] == want_kv

    # 4. create_engine_config on this machine: the same mapping with the model replaced by
    # a local tiny checkpoint (no download) and a context length it has; every key the
    # plugin wrote is kept.
    local = {
        **kwargs,
        "model": str(tiny_dir),
        "max_model_len": 128,
        "skip_tokenizer_init": True,
        "tensor_parallel_size": 1,
    }
    vcfg = EngineArgs(**local).create_engine_config()
    assert vcfg.model_config.quantization == QUANT_METHOD
    assert isinstance(vcfg.quant_config, NemoFp8Config)
    assert vcfg.quant_config.scheme == spec.scaling
    assert vcfg.cache_config.cache_dtype == want_kv


def test_pyproject_floor_is_the_oldest_vllm_read_and_the_installed_one_is_tested():
    """The `vllm` extra's floor is the oldest release the tests read (NeMo RL v0.6.0's),
    the installed vLLM is one of the releases read, and the vLLM page names each of them;
    the APIs the method imports exist in the installed one."""
    from nemo_fp8_plugin.stacks import TESTED, parse_version

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["vllm"] == [f"vllm>={min(TESTED['vllm'], key=parse_version)}"]
    assert str(vllm.__version__).split("+")[0] in TESTED["vllm"]
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel, init_mxfp8_linear_kernel  # noqa: F401
    from vllm.model_executor.layers.attention import Attention, MLAAttention  # noqa: F401
    from vllm.model_executor.layers.fused_moe import RoutedExperts  # noqa: F401
    from vllm.model_executor.layers.fused_moe.oracle.mxfp8 import select_mxfp8_moe_backend  # noqa: F401

    page = (REPO / "docs" / "hosts" / "vllm.md").read_text()
    assert all(v in page for v in TESTED["vllm"]), TESTED["vllm"]

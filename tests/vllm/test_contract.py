"""Contract tests: vLLM itself judges everything the plugin writes or decides for it.

(a) **Engine configs.** Every engine config ``nemo-fp8 apply --host vllm`` and
``engine_kwargs`` can write (each recipe x KV cache ``auto``/``fp8`` x every vLLM example
under ``conf/examples/``, in both key spellings, with ``device: cpu``) goes through vLLM's
own code: ``EngineArgs(**kwargs)`` (the mapping of ``vllm.LLM``), the argument parser of
``vllm serve --config`` (``FlexibleArgumentParser`` + ``EngineArgs.add_cli_args``), vLLM's
quantization registry (``get_quantization_config``: our registered ``nemo_fp8``) and
``create_engine_config`` on this CPU machine.

(b) **GPU branches on CPU.** vLLM's real kernel selection (``init_fp8_linear_kernel``,
``init_mxfp8_linear_kernel``, the fused-MoE oracle and quant config), reached through real
vLLM layers (``MergedColumnParallelLinear``, Mixtral's ``MixtralMoE``) built with the
``nemo_fp8`` config, with the platform's compute capability patched to SM90 / SM100 and
the DeepGEMM variables on and off. Each test asserts which kernel vLLM picks for each
recipe, that the plugin refuses (one line naming the key and the vLLM version) or sets what
would otherwise change the numerics, and, where the chosen kernel's weight processing is
plain torch, that the loadable parameters and the plugin's scales survive it. No GPU kernel
runs.

What stands in for what cannot install on a CPU machine, each against vLLM's real source:

* the CUDA platform: ``vllm.platforms.cuda`` cannot import without the CUDA build's
  ``vllm._C``; every vLLM module holds the one platform object, so its class (the CPU
  platform) is given ``PlatformEnum.CUDA``, a device capability, and
  ``CudaPlatformBase.support_deep_gemm`` compiled from the installed ``vllm/platforms/cuda.py``;
* the CUTLASS capability probes of ``vllm._C`` (``cutlass_scaled_mm_supports_fp8`` /
  ``_block_fp8``): the rules of vLLM's ``csrc/.../scaled_mm_entry.cu`` for a CUDA >= 12.8
  build (FP8 from SM89, block FP8 from SM90, SM100 included);
* DeepGEMM and FlashInfer being installed: their ``has_*`` probes answer True (the kernels
  themselves never run).
"""

from __future__ import annotations

import ast
import contextlib
import tempfile
import textwrap
import warnings
from pathlib import Path

import pytest
import tomllib
import torch
import vllm

# Modules that evaluate CUDA capabilities at import time are imported here, on the real
# (CPU) platform, before any test patches it.
import vllm._custom_ops as vllm_ops
import vllm.model_executor.kernels.linear.mxfp8.flashinfer as mxfp8_flashinfer
import vllm.model_executor.kernels.linear.scaled_mm.cutlass as cutlass_kernels
import vllm.model_executor.kernels.linear.scaled_mm.flashinfer as block_flashinfer
import vllm.model_executor.layers.fused_moe.oracle.fp8
import vllm.model_executor.layers.fused_moe.oracle.mxfp8
import vllm.model_executor.layers.quantization.online.fp8
import vllm.model_executor.layers.quantization.online.mxfp8
import vllm.model_executor.models.mixtral
import vllm.utils.deep_gemm as deep_gemm
import yaml
from vllm import envs
from vllm.platforms import PlatformEnum, current_platform
from vllm.platforms.interface import DeviceCapability

from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.hosts import apply_mapping, get_adapter
from nemo_fp8_plugin.hosts.vllm import (
    QUANT_METHOD,
    TESTED_VLLM,
    engine_env,
    engine_kwargs,
    quantization_config,
)
from nemo_fp8_plugin.registry import get_recipe, list_recipes
from tiny_models import LLAMA, MIXTRAL, llama_state_dict, mixtral_state_dict, write_checkpoint


def apply_vllm(config):
    """``apply --host vllm`` on a mapping: (output, warnings)."""
    result = apply_mapping(get_adapter("vllm"), config)
    return result.data, result.warnings


pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
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
    assert "calculate_kv_scales" not in {k.replace("-", "_") for k in written}  # item 1
    assert "device" not in written  # item 2
    if source == "apply-device-cpu":
        assert any(w.startswith("device:") for w in found), found

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


def test_pyproject_floor_is_the_tested_vllm_and_its_apis_exist():
    """Item 15: the `vllm` extra's floor is the release whose APIs the code uses."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert extras["vllm"] == [f"vllm>={TESTED_VLLM}"]
    from packaging.version import Version

    assert Version(vllm.__version__) >= Version(TESTED_VLLM)
    # The APIs the method imports (all introduced by vLLM's 2026 refactors).
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel, init_mxfp8_linear_kernel  # noqa: F401
    from vllm.model_executor.layers.attention import Attention, MLAAttention  # noqa: F401
    from vllm.model_executor.layers.fused_moe import RoutedExperts  # noqa: F401
    from vllm.model_executor.layers.fused_moe.oracle.mxfp8 import select_mxfp8_moe_backend  # noqa: F401

    assert TESTED_VLLM in (REPO / "docs" / "hosts" / "vllm.md").read_text()


# =========================================================================== (b) GPU branches


def _cuda_support_deep_gemm():
    """``CudaPlatformBase.support_deep_gemm``, compiled from the installed vLLM's source."""
    source = Path(vllm.__file__).with_name("platforms") / "cuda.py"
    text = source.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == "CudaPlatformBase":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "support_deep_gemm":
                    namespace: dict = {}
                    exec(textwrap.dedent(ast.get_source_segment(text, item)), namespace)
                    return classmethod(namespace["support_deep_gemm"])
    raise AssertionError("CudaPlatformBase.support_deep_gemm not found in vllm/platforms/cuda.py")


def _csrc_supports_fp8(cap: int) -> bool:  # scaled_mm_entry.cu, CUDA >= 12.8
    return cap >= 89


def _csrc_supports_block_fp8(cap: int) -> bool:  # scaled_mm_entry.cu, CUDA >= 12.8
    return cap >= 90


def _reset_deep_gemm_caches() -> None:
    deep_gemm.is_deep_gemm_supported.cache_clear()
    deep_gemm.is_deep_gemm_e8m0_used.cache_clear()
    if "_oracle_cache" in deep_gemm.DeepGemmQuantScaleFMT.__dict__:
        delattr(deep_gemm.DeepGemmQuantScaleFMT, "_oracle_cache")


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(sm, deep_gemm=..., e8m0=..., flashinfer=..., flashinfer_block=...)``: the
    platform vLLM sees becomes a CUDA GPU of capability ``sm`` (90, 100)."""
    cls = type(current_platform)
    cached_envs = envs._is_envs_cache_enabled()
    if cached_envs:  # an engine started in this process caches vLLM's env variables
        envs.disable_envs_cache()

    def make(
        sm: int,
        *,
        deep_gemm_installed: bool = False,
        e8m0: bool = True,
        flashinfer: bool = False,
        flashinfer_block: bool = False,
    ):
        monkeypatch.setattr(cls, "_enum", PlatformEnum.CUDA)
        monkeypatch.setattr(
            cls,
            "get_device_capability",
            classmethod(lambda c, device_id=0: DeviceCapability(sm // 10, sm % 10)),
        )
        monkeypatch.setattr(cls, "support_deep_gemm", _cuda_support_deep_gemm())
        monkeypatch.setattr(vllm_ops, "cutlass_scaled_mm_supports_fp8", _csrc_supports_fp8)
        monkeypatch.setattr(
            vllm_ops, "cutlass_scaled_mm_supports_block_fp8", _csrc_supports_block_fp8
        )
        monkeypatch.setattr(
            cutlass_kernels, "CUTLASS_BLOCK_FP8_SUPPORTED", _csrc_supports_block_fp8(sm)
        )
        monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "1")  # vLLM 0.32's defaults, spelled out
        monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", "1" if e8m0 else "0")
        monkeypatch.setenv("VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER", "1" if flashinfer_block else "0")
        monkeypatch.setattr(deep_gemm, "has_deep_gemm", lambda: deep_gemm_installed)
        monkeypatch.setattr(deep_gemm, "_lazy_init", lambda: None)
        monkeypatch.setattr(
            deep_gemm, "_fp8_gemm_nt_impl", object() if deep_gemm_installed else None
        )
        monkeypatch.setattr(mxfp8_flashinfer, "has_flashinfer", lambda: flashinfer)
        monkeypatch.setattr(
            block_flashinfer,
            "is_flashinfer_fp8_blockscale_gemm_supported",
            lambda: flashinfer_block,
        )
        _reset_deep_gemm_caches()

    yield make
    monkeypatch.undo()
    _reset_deep_gemm_caches()
    if cached_envs:
        envs.enable_envs_cache()


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    """vLLM's config context (a tiny Mixtral, bf16: an MoE model, so vLLM also creates its
    expert-parallel group) and a one-rank gloo process group, as a worker has them; torn
    down after the module."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.engine.arg_utils import EngineArgs

    ckpt = write_checkpoint(
        tmp_path_factory.mktemp("contract-mixtral"), MIXTRAL, mixtral_state_dict()
    )
    vcfg = EngineArgs(
        model=str(ckpt),
        dtype="bfloat16",
        max_model_len=128,
        enforce_eager=True,
        skip_tokenizer_init=True,
    ).create_engine_config()
    started = not torch.distributed.is_initialized()
    with set_current_vllm_config(vcfg):
        if started:
            ps.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"file://{tempfile.mktemp()}",
            )
        ps.ensure_model_parallel_initialized(1, 1)
    yield vcfg
    if started:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


@contextlib.contextmanager
def _building(vcfg):
    """What vLLM's model loader sets while it builds layers: the config and the default dtype."""
    from vllm.config import set_current_vllm_config

    old = torch.get_default_dtype()
    torch.set_default_dtype(vcfg.model_config.dtype)
    try:
        with set_current_vllm_config(vcfg):
            yield
    finally:
        torch.set_default_dtype(old)


_NAMES = iter(range(10**6))


def _linear(vcfg, recipe, **overrides):
    """A real vLLM ``MergedColumnParallelLinear`` (gate|up, 2 x 256 x 256) on ``nemo_fp8``."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    with _building(vcfg):
        return MergedColumnParallelLinear(
            256,
            [256, 256],
            bias=False,
            quant_config=NemoFp8Config.from_config({**_qcfg(recipe), **overrides}),
            prefix=f"model.layers.{next(_NAMES)}.mlp.gate_up_proj",
        )


def _moe(vcfg, recipe, **overrides):
    """vLLM's own Mixtral MoE block (4 experts, top 2, 256 x 256) on ``nemo_fp8``; returns
    its routed-experts layer."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.models.mixtral import MixtralMoE

    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    with _building(vcfg):
        block = MixtralMoE(
            4,
            2,
            256,
            256,
            params_dtype=torch.bfloat16,
            quant_config=NemoFp8Config.from_config({**_qcfg(recipe), **overrides}),
            prefix=f"contract.layers.{next(_NAMES)}.block_sparse_moe",
        )
    return next(m for m in block.modules() if isinstance(m, RoutedExperts))


def _assert_refusal(err: pytest.ExceptionInfo, key: str, *words: str) -> None:
    text = str(err.value)
    assert err.value.key == key, text
    assert "\n" not in text and f"vLLM {vllm.__version__}" in text, text
    for word in words:
        assert word in text, (word, text)


def _activation_quantizer(kernel):
    """The ``QuantFP8`` a vLLM block kernel quantizes activations with."""
    return kernel.quant_fp8


# --------------------------------------------------------------------------- block linear


@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize(
    "deep_gemm_installed,e8m0",
    [(True, True), (True, False), (False, True)],
    ids=["deepgemm-e8m0", "deepgemm-fp32", "no-deepgemm"],
)
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_subchannel"])
def test_block_kernel_selection(vllm_env, fake_gpu, sm, deep_gemm_installed, e8m0, recipe):
    """Items 5 and 6: vLLM's choice for each recipe, and what the method does with it."""
    fake_gpu(sm, deep_gemm_installed=deep_gemm_installed, e8m0=e8m0)
    expected = (
        "DeepGemmFp8BlockScaledMMKernel" if deep_gemm_installed else "CutlassFp8BlockScaledMMKernel"
    )
    pow2 = get_recipe(recipe).pow2_scales
    refusal = None
    if deep_gemm_installed and sm >= 100 and not pow2:
        # DeepGEMM's Blackwell kernels take UE8M0 scale factors only (fp32 ones are cast).
        refusal = ("VLLM_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM=0")
    elif deep_gemm_installed and sm >= 100 and not e8m0:
        refusal = ("VLLM_USE_DEEP_GEMM_E8M0", "unset VLLM_USE_DEEP_GEMM_E8M0")
    elif deep_gemm_installed and e8m0 and not pow2:
        # DeepGEMM E8M0 would requantize the fp32 block scales to powers of two.
        refusal = ("VLLM_USE_DEEP_GEMM_E8M0", "VLLM_USE_DEEP_GEMM_E8M0=0")
        assert engine_env(recipe) == {"VLLM_USE_DEEP_GEMM_E8M0": "0"}  # what avoids it
    if refusal:
        with pytest.raises(FP8ConfigError) as err:
            _linear(vllm_env, recipe)
        _assert_refusal(err, refusal[0], expected, f"SM{sm}", refusal[1])
        return
    layer = _linear(vllm_env, recipe)
    kernel = layer.quant_method._kernel
    assert layer.quant_method.use_vllm and type(kernel).__name__ == expected
    quant = _activation_quantizer(kernel)
    # The activation scales the kernel will compute are the recipe's: pow2 or fp32.
    assert quant.use_ue8m0 is bool(pow2)
    ue8m0 = bool(pow2 and deep_gemm_installed and e8m0)
    assert getattr(kernel, "use_deep_gemm_e8m0", False) is ue8m0


def test_pow2_activation_scales_are_those_of_the_recipe(vllm_env, fake_gpu):
    """Item 6, made real: vLLM's own activation quantizer (``QuantFP8``, its torch path) in
    the kernel vLLM picked for ``fp8_subchannel`` produces the trainer's power-of-2 1x128
    scales and codes, bit for bit (vLLM builds it with ``use_ue8m0=False``: fp32 scales)."""
    from nemo_fp8_plugin.numerics import quantize_blockwise

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(33, 256, generator=gen) * torch.logspace(-3, 2, 256)).bfloat16()
    want = quantize_blockwise(x, block=(1, 128), pow2_scales=True)
    for deep_gemm_installed, e8m0 in ((False, True), (True, False)):  # CUTLASS; DeepGEMM fp32 mode
        fake_gpu(90, deep_gemm_installed=deep_gemm_installed, e8m0=e8m0)
        kernel = _linear(vllm_env, "fp8_subchannel").quant_method._kernel
        data, scale = _activation_quantizer(kernel).forward_native(x)
        assert torch.equal(scale.float(), want.scale_inv), type(kernel).__name__
        assert torch.equal(data.view(torch.uint8), want.data.view(torch.uint8))
    # fp8_blockwise keeps vLLM's fp32 scales (amax / 448: the last bit may differ from TE's
    # 1 / (448 / amax), see ../shared/NUMERICS.md), never powers of two.
    fake_gpu(90)
    kernel = _linear(vllm_env, "fp8_blockwise").quant_method._kernel
    _, scale = _activation_quantizer(kernel).forward_native(x)
    ref = quantize_blockwise(x, block=(1, 128)).scale_inv
    torch.testing.assert_close(scale.float(), ref, rtol=2e-7, atol=0)
    assert not torch.equal(torch.log2(scale), torch.log2(scale).round())


def test_flashinfer_block_kernel(vllm_env, fake_gpu):
    """FlashInfer's block kernel quantizes activations itself (fp32 scales; its DeepGEMM
    branch follows VLLM_USE_DEEP_GEMM_E8M0): pow2 activation scales are refused there."""
    name = "FlashInferFp8DeepGEMMDynamicBlockScaledKernel"
    fake_gpu(90, deep_gemm_installed=True, e8m0=False, flashinfer_block=True)
    layer = _linear(vllm_env, "fp8_blockwise")
    assert type(layer.quant_method._kernel).__name__ == name
    with pytest.raises(FP8ConfigError) as err:
        _linear(vllm_env, "fp8_subchannel")
    _assert_refusal(err, "pow2_scales", name, "SM90", "VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER")
    fake_gpu(90, deep_gemm_installed=True, e8m0=True, flashinfer_block=True)
    with pytest.raises(FP8ConfigError) as err:
        _linear(vllm_env, "fp8_blockwise")
    _assert_refusal(err, "VLLM_USE_DEEP_GEMM_E8M0", name)
    fake_gpu(100, deep_gemm_installed=True, e8m0=False, flashinfer_block=True)
    with pytest.raises(FP8ConfigError) as err:  # its DeepGEMM branch on Blackwell: UE8M0 only
        _linear(vllm_env, "fp8_blockwise")
    _assert_refusal(err, "VLLM_USE_DEEP_GEMM", name, "SM100")


def test_amax_epsilon_is_refused_on_vllm_kernels(vllm_env, fake_gpu):
    """Item 14: vLLM's activation quantizers have a fixed amax floor."""
    fake_gpu(90)
    with pytest.raises(FP8ConfigError) as err:
        _linear(vllm_env, "fp8_blockwise", amax_epsilon=1e-4)
    _assert_refusal(err, "amax_epsilon", "CutlassFp8BlockScaledMMKernel", "emulate")
    with pytest.raises(FP8ConfigError) as err:
        _moe(vllm_env, "fp8_blockwise", amax_epsilon=1e-4)
    _assert_refusal(err, "amax_epsilon", "emulate")


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_subchannel"])
@pytest.mark.parametrize(
    "sm,deep_gemm_installed,e8m0",
    [(90, False, True), (90, True, False), (90, True, True), (100, True, True)],
    ids=["sm90-cutlass", "sm90-deepgemm-fp32", "sm90-deepgemm-e8m0", "sm100-deepgemm-e8m0"],
)
def test_generation_numerics_on_vllm_kernels(
    vllm_env, fake_gpu, recipe, sm, deep_gemm_installed, e8m0
):
    """Issue 18: on vLLM's kernels the method checks that the kernel vLLM picked computes
    the ``generation_numerics`` asked for. ``trainer`` (TE's numerics) is computed by none of
    them: refused. ``vllm_deepgemm_ue8m0`` needs DeepGEMM in E8M0 mode, and with it is
    accepted whatever the recipe's scales (the fp32 recipe's refusal under ``vllm`` is what
    the user has now asked for); elsewhere refused. The same for the fused-MoE kernel, whose
    activation quantizer follows DeepGEMM's E8M0 mode."""
    fake_gpu(sm, deep_gemm_installed=deep_gemm_installed, e8m0=e8m0)
    kernel = (
        "DeepGemmFp8BlockScaledMMKernel" if deep_gemm_installed else "CutlassFp8BlockScaledMMKernel"
    )
    with pytest.raises(FP8ConfigError) as err:
        _linear(vllm_env, recipe, generation_numerics="trainer")
    _assert_refusal(err, "generation_numerics", kernel, "emulate", "generation_numerics: vllm")
    with pytest.raises(FP8ConfigError) as err:
        _moe(vllm_env, recipe, generation_numerics="trainer")
    _assert_refusal(err, "generation_numerics", "fused-MoE", "emulate")
    ue8m0_mode = deep_gemm_installed and e8m0
    if ue8m0_mode:
        layer = _linear(vllm_env, recipe, generation_numerics="vllm_deepgemm_ue8m0")
        assert layer.quant_method.use_vllm
        kern = layer.quant_method._kernel
        assert type(kern).__name__ == kernel and kern.use_deep_gemm_e8m0
        assert _activation_quantizer(kern).use_ue8m0
        _moe(vllm_env, recipe, generation_numerics="vllm_deepgemm_ue8m0")  # accepted
    else:
        with pytest.raises(FP8ConfigError) as err:
            _linear(vllm_env, recipe, generation_numerics="vllm_deepgemm_ue8m0")
        _assert_refusal(err, "generation_numerics", kernel, "VLLM_USE_DEEP_GEMM_E8M0=1")
        with pytest.raises(FP8ConfigError) as err:
            _moe(vllm_env, recipe, generation_numerics="vllm_deepgemm_ue8m0")
        _assert_refusal(err, "generation_numerics", "fused-MoE", "VLLM_USE_DEEP_GEMM_E8M0=1")


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_subchannel"])
def test_cutlass_weight_processing_keeps_parameters_and_scales(vllm_env, fake_gpu, recipe):
    """The CUTLASS block kernel's weight processing is plain torch: run it (vLLM's own
    ``process_weights_after_loading``) and check that the loadable parameters keep their
    identity and storage, that the plugin's quantization survives bit for bit, that the
    kernel's view aliases them, and that a refit lands where the kernel reads."""
    from nemo_fp8_plugin.numerics import quantize_blockwise

    fake_gpu(90)
    spec = get_recipe(recipe)
    layer = _linear(vllm_env, recipe)
    gen = torch.Generator().manual_seed(5)
    gate, up = ((0.05 * torch.randn(256, 256, generator=gen)).bfloat16() for _ in range(2))
    layer.weight.weight_loader(layer.weight, gate, 0)  # BF16: quantized on arrival
    layer.weight.weight_loader(layer.weight, up, 1)
    ids = {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()}
    ref = quantize_blockwise(torch.cat([gate, up]), block=(128, 128), pow2_scales=spec.pow2_scales)

    method = layer.quant_method
    method.process_weights_after_loading(layer)
    assert {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()} == ids
    assert torch.equal(layer.weight.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv.data, ref.scale_inv)
    view = method._view
    assert view.weight.data_ptr() == layer.weight.data_ptr()
    assert view.weight_scale_inv.data_ptr() == layer.weight_scale_inv.data_ptr()

    new = (0.08 * torch.randn(256, 256, generator=gen)).bfloat16()
    layer.weight.weight_loader(layer.weight, new, 1)  # a refit of the `up` shard
    method.after_refit(layer)
    ref2 = quantize_blockwise(
        torch.cat([gate, new]), block=(128, 128), pow2_scales=spec.pow2_scales
    )
    assert {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()} == ids
    assert method._view is view and torch.equal(view.weight_scale_inv.data, ref2.scale_inv)
    assert torch.equal(view.weight.data.view(torch.uint8), ref2.data.view(torch.uint8))


def test_deep_gemm_e8m0_requantization_is_why_fp32_recipes_are_refused(monkeypatch):
    """Item 5, with vLLM's own code: the in-place requantization DeepGEMM's weight processing
    runs with E8M0 on (``requant_weight_ue8m0_inplace``, plain torch) changes fp8_blockwise's
    fp32 block scales and dequantized weights, but leaves fp8_subchannel's power-of-2 weights
    dequantizing to the same values."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import requant_weight_ue8m0_inplace

    from nemo_fp8_plugin.numerics import quantize_blockwise
    from nemo_fp8_plugin.numerics.quantize import dequantize_fp32

    # vLLM compiles this helper for the GPU; its Python body is the same code.
    monkeypatch.setattr(
        deep_gemm,
        "per_block_cast_to_fp8",
        deep_gemm.per_block_cast_to_fp8._torchdynamo_orig_callable,
    )
    gen = torch.Generator().manual_seed(9)
    w = (0.05 * torch.randn(256, 384, generator=gen)).bfloat16()
    for pow2 in (False, True):
        q = quantize_blockwise(w, block=(128, 128), pow2_scales=pow2)
        data, scale = q.data.clone(), q.scale_inv.clone()
        requant_weight_ue8m0_inplace(data, scale, (128, 128))
        before = dequantize_fp32(q.data, q.scale_inv, (128, 128))
        after = dequantize_fp32(data, scale, (128, 128))
        if pow2:
            assert torch.equal(after, before)
        else:
            assert not torch.equal(scale, q.scale_inv) and not torch.equal(after, before)
            assert torch.equal(torch.log2(scale), torch.log2(scale).round())


# --------------------------------------------------------------------------- MXFP8 linear


@pytest.mark.parametrize(
    "sm,flashinfer,expected,accepted",
    [
        (90, False, "MarlinMxfp8LinearKernel", False),
        (90, True, "MarlinMxfp8LinearKernel", False),
        (100, False, "MarlinMxfp8LinearKernel", False),
        (100, True, "FlashInferCutlassMxfp8LinearKernel", True),
    ],
)
def test_mx_kernel_selection(vllm_env, fake_gpu, sm, flashinfer, expected, accepted):
    """Item 7: MXFP8 on a GPU without an MXFP8 GEMM is refused at load time from the
    platform's capability (no ``hardware:`` needed); vLLM would silently run weight-only."""
    fake_gpu(sm, flashinfer=flashinfer)
    if not accepted:
        with pytest.raises(FP8ConfigError) as err:
            _linear(vllm_env, "mxfp8")
        _assert_refusal(err, "scheme", expected, f"SM{sm}", "fp8_blockwise")
        return
    layer = _linear(vllm_env, "mxfp8")
    method = layer.quant_method
    assert type(method._kernel).__name__ == expected
    # Its weight processing (scale swizzle) is plain torch: run it; the layer's parameters
    # and E8M0 scales stay as loaded, the swizzled copy lives in the kernel's view.
    from nemo_fp8_plugin.numerics import quantize_mxfp8

    gen = torch.Generator().manual_seed(6)
    gate, up = ((0.05 * torch.randn(256, 256, generator=gen)).bfloat16() for _ in range(2))
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    ids = {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()}
    method.process_weights_after_loading(layer)
    ref = quantize_mxfp8(torch.cat([gate, up]), block=(1, 32))
    assert {n: (id(p), p.data_ptr()) for n, p in layer.named_parameters()} == ids
    assert torch.equal(layer.weight.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(
        layer.weight_scale_inv.data.view(torch.uint8), ref.scale_inv.view(torch.uint8)
    )
    assert method._view.weight.data_ptr() == layer.weight.data_ptr()
    assert method._view.weight_scale.numel() >= ref.scale_inv.numel()  # swizzled, padded


# --------------------------------------------------------------------------- fused MoE


@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize(
    "deep_gemm_installed,e8m0",
    [(True, True), (True, False), (False, True)],
    ids=["deepgemm-e8m0", "deepgemm-fp32", "no-deepgemm"],
)
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_subchannel"])
def test_block_moe_quant_config(vllm_env, fake_gpu, sm, deep_gemm_installed, e8m0, recipe):
    """vLLM's Triton fused-MoE kernel quantizes activations with UE8M0 scales exactly when
    DeepGEMM's E8M0 mode is on: the recipe must agree, or the method refuses."""
    fake_gpu(sm, deep_gemm_installed=deep_gemm_installed, e8m0=e8m0)
    ue8m0 = deep_gemm_installed and e8m0
    pow2 = bool(get_recipe(recipe).pow2_scales)
    if ue8m0 != pow2:
        with pytest.raises(FP8ConfigError) as err:
            _moe(vllm_env, recipe)
        _assert_refusal(err, "VLLM_USE_DEEP_GEMM_E8M0" if ue8m0 else "pow2_scales", f"SM{sm}")
        return
    layer = _moe(vllm_env, recipe)
    method = layer.quant_method
    assert type(method).__name__ == "NemoFp8MoEMethod" and method.use_vllm
    qc = method.get_fused_moe_quant_config(layer)  # what vLLM's runner asks for
    assert qc.use_fp8_w8a8 and qc.block_shape == [128, 128]
    assert qc.w1_scale is layer.w13_weight_scale_inv and qc.w2_scale is layer.w2_weight_scale_inv


@pytest.mark.parametrize(
    "sm,deep_gemm_installed,accepted",
    [(90, True, False), (90, False, False), (100, False, False), (100, True, True)],
)
def test_mx_moe_backend_selection(vllm_env, fake_gpu, sm, deep_gemm_installed, accepted):
    """Item 4 (GPU side): MXFP8 experts take the backend vLLM's own MXFP8 MoE oracle picks;
    one that keeps activations in BF16 (Marlin, emulation) is refused (item 7)."""
    fake_gpu(sm, deep_gemm_installed=deep_gemm_installed)
    if not accepted:
        with pytest.raises(FP8ConfigError) as err:
            _moe(vllm_env, "mxfp8")
        _assert_refusal(err, "scheme", f"SM{sm}", "fp8_blockwise")
        return
    layer = _moe(vllm_env, "mxfp8")
    method = layer.quant_method
    assert method._mx_backend.name == "DEEPGEMM"
    assert method.experts_cls.__name__ == "DeepGemmExperts"
    assert layer.w13_weight_scale_inv.dtype == torch.float8_e8m0fnu
    assert tuple(layer.w13_weight_scale_inv.shape) == (4, 512, 8)


# --------------------------------------------------------------------------- attention


def test_mla_attention_gets_the_kv_cache_method(vllm_env):
    """Item 10: vLLM's own KV-cache set-up (``_init_kv_cache_quant``, which MLAAttention calls
    like Attention) attaches NemoFp8KVCacheMethod to an MLA layer, and its scales survive
    vLLM's post-load step, so refreshed KV scales have somewhere to land."""
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.layers.attention.attention import _init_kv_cache_quant

    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config
    from nemo_fp8_plugin.hosts.vllm.methods import NemoFp8KVCacheMethod

    qcfg = {**_qcfg({"recipe": "fp8_blockwise", "kv_cache": "fp8"}), "kv_cache_dtype": "fp8_e4m3"}
    layer = MLAAttention.__new__(MLAAttention)  # the real class; its GPU backends stay unbuilt
    torch.nn.Module.__init__(layer)
    layer.kv_cache_dtype = "fp8_e4m3"
    with _building(vllm_env):
        _init_kv_cache_quant(
            layer, NemoFp8Config.from_config(qcfg), "model.layers.0.self_attn.mla_attn"
        )
    assert isinstance(layer.quant_method, NemoFp8KVCacheMethod)
    k_scale = layer.k_scale
    k_scale.data.fill_(0.25)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.k_scale is k_scale and layer._k_scale_float == 0.25


# =========================================================================== (c) emulation numerics
#
# On this machine (the real CPU platform) the method runs every GEMM through the numerics
# emulation; these tests use vLLM's real layers and loaders with it.


def _loaded_linear(vcfg, recipe, gate, up, *, bias=None, **overrides):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    from nemo_fp8_plugin.hosts.vllm.config import NemoFp8Config

    with _building(vcfg):
        layer = MergedColumnParallelLinear(
            256,
            [256, 256],
            bias=bias is not None,
            quant_config=NemoFp8Config.from_config({**_qcfg(recipe), **overrides}),
            prefix=f"model.layers.{next(_NAMES)}.mlp.gate_up_proj",
        )
    layer.weight.weight_loader(layer.weight, gate, 0)
    layer.weight.weight_loader(layer.weight, up, 1)
    if bias is not None:
        layer.bias.weight_loader(layer.bias, bias[:256], 0)
        layer.bias.weight_loader(layer.bias, bias[256:], 1)
    layer.quant_method.process_weights_after_loading(layer)
    assert not layer.quant_method.use_vllm  # the emulation backend
    return layer


def test_emulated_bias_is_added_in_fp32_before_the_cast(vllm_env):
    """Item 14: the trainer's emulated GEMM adds the bias in fp32, then casts (a GEMM
    epilogue); the engine's emulation does the same, not a bf16 add after the cast.
    Activations are quantized as vLLM does (``generation_numerics: vllm``, the default)."""
    from nemo_fp8_plugin.numerics import QTensor, fp8_gemm
    from nemo_fp8_plugin.numerics.vllm_numerics import quantize_activation_vllm

    gen = torch.Generator().manual_seed(11)
    gate, up = ((0.05 * torch.randn(256, 256, generator=gen)).bfloat16() for _ in range(2))
    bias = torch.randn(512, generator=gen).bfloat16()
    layer = _loaded_linear(vllm_env, "fp8_blockwise", gate, up, bias=bias)
    x = torch.randn(7, 256, generator=gen).bfloat16()
    got = layer(x)[0]
    a = quantize_activation_vllm(x)
    w = QTensor(layer.weight.data, layer.weight_scale_inv.data, "e4m3", (128, 128))
    want = fp8_gemm(a, w, out_dtype=torch.bfloat16, bias=bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    after_cast = fp8_gemm(a, w, out_dtype=torch.bfloat16) + bias  # the old engine-side order
    assert not torch.equal(after_cast, want)


def test_emulated_moe_bias_is_added_in_fp32_before_the_cast(vllm_env):
    """Item 14 for experts with biases (GPT-OSS style): the same order in each expert GEMM
    (activations quantized as vLLM's fused-MoE kernel does, the default numerics)."""
    from nemo_fp8_plugin.numerics import QTensor, fp8_gemm, quantize_blockwise
    from nemo_fp8_plugin.numerics.vllm_numerics import quantize_activation_vllm

    layer = _moe(vllm_env, "fp8_blockwise")
    method = layer.quant_method
    assert not method.use_vllm
    gen = torch.Generator().manual_seed(12)
    w13 = (0.05 * torch.randn(4, 512, 256, generator=gen)).bfloat16()
    w2 = (0.05 * torch.randn(4, 256, 256, generator=gen)).bfloat16()
    q13, q2 = (quantize_blockwise(w, block=(128, 128)) for w in (w13, w2))
    layer.w13_weight.data.copy_(q13.data)
    layer.w13_weight_scale_inv.data.copy_(q13.scale_inv)
    layer.w2_weight.data.copy_(q2.data)
    layer.w2_weight_scale_inv.data.copy_(q2.scale_inv)
    layer.w13_bias = torch.randn(4, 512, generator=gen).bfloat16()
    layer.w2_bias = torch.randn(4, 256, generator=gen).bfloat16()
    x = torch.randn(3, 256, generator=gen).bfloat16()
    topk_ids = torch.tensor([[0, 2], [1, 2], [3, 0]])
    topk_weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.125, 0.875]])
    got = method._emulated_experts(layer, x, topk_weights, topk_ids)

    def gemm(inp, q, e, b):
        return fp8_gemm(
            quantize_activation_vllm(inp),
            QTensor(q.data[e], q.scale_inv[e], "e4m3", (128, 128)),
            out_dtype=torch.bfloat16,
            bias=b,
        )

    want = torch.zeros(3, 256)
    for t in range(3):
        for slot in range(2):
            e = int(topk_ids[t, slot])
            h = gemm(x[t : t + 1], q13, e, layer.w13_bias[e])
            h = torch.nn.functional.silu(h[:, :256]) * h[:, 256:]
            want[t] += topk_weights[t, slot] * gemm(h, q2, e, layer.w2_bias[e])[0].float()
    assert torch.equal(got, want.bfloat16())


def test_amax_epsilon_reaches_the_engine(vllm_env):
    """Item 14: ``amax_epsilon`` travels in the ``nemo_fp8`` config; weights quantized on
    arrival match the trainer's refit quantizer with it; emulated activations use it under
    ``generation_numerics: trainer`` (TE's numerics), and vLLM's fixed floor under the
    default ``vllm`` (vLLM's quantizer has no amax floor to set)."""
    from nemo_fp8_plugin.numerics import QTensor, fp8_gemm, quantize_blockwise
    from nemo_fp8_plugin.numerics.vllm_numerics import quantize_activation_vllm
    from nemo_fp8_plugin.rl import quantize_for_refit

    spec = get_recipe({"recipe": "fp8_blockwise", "amax_epsilon": 1e-3})
    qcfg = quantization_config(spec)
    assert qcfg["amax_epsilon"] == 1e-3
    gen = torch.Generator().manual_seed(13)
    gate, up = ((0.05 * torch.randn(256, 256, generator=gen)).bfloat16() for _ in range(2))
    gate[:128, :128] *= 1e-4  # one tile with amax < eps
    layer = _loaded_linear(
        vllm_env, "fp8_blockwise", gate, up, amax_epsilon=1e-3, generation_numerics="trainer"
    )
    trainer = dict(
        quantize_for_refit(
            [
                ("model.layers.1.mlp.gate_proj.weight", gate),
                ("model.layers.1.mlp.up_proj.weight", up),
            ],
            spec,
            num_layers=4,
        )
    )
    want_w = torch.cat(
        [
            trainer["model.layers.1.mlp.gate_proj.weight"],
            trainer["model.layers.1.mlp.up_proj.weight"],
        ]
    )
    want_s = torch.cat(
        [
            trainer["model.layers.1.mlp.gate_proj.weight_scale_inv"],
            trainer["model.layers.1.mlp.up_proj.weight_scale_inv"],
        ]
    )
    assert torch.equal(layer.weight.data.view(torch.uint8), want_w.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv.data, want_s)
    no_eps = quantize_blockwise(torch.cat([gate, up]), block=(128, 128))
    assert not torch.equal(layer.weight_scale_inv.data, no_eps.scale_inv)

    x = torch.randn(5, 256, generator=gen).bfloat16()
    x[2] *= 1e-5  # a row whose activation groups have amax < eps
    w = QTensor(layer.weight.data, layer.weight_scale_inv.data, "e4m3", (128, 128))
    want = fp8_gemm(quantize_blockwise(x, block=(1, 128), eps=1e-3), w, out_dtype=torch.bfloat16)
    assert torch.equal(layer(x)[0], want)
    assert not torch.equal(
        want, fp8_gemm(quantize_blockwise(x, block=(1, 128)), w, out_dtype=torch.bfloat16)
    )
    # The default numerics: the same weights (the trainer's bytes), vLLM's activations.
    default = _loaded_linear(vllm_env, "fp8_blockwise", gate, up, amax_epsilon=1e-3)
    assert torch.equal(default.weight.data.view(torch.uint8), want_w.view(torch.uint8))
    vllm_want = fp8_gemm(quantize_activation_vllm(x), w, out_dtype=torch.bfloat16)
    assert torch.equal(default(x)[0], vllm_want)
    assert not torch.equal(vllm_want, want)

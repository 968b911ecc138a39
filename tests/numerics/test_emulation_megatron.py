"""FP8 emulation of real megatron-core layers (ColumnParallelLinear / RowParallelLinear, TP=1).

Uses megatron-core 0.16.1 as installed: a one-rank gloo group, ``initialize_model_parallel(1,
1)`` and the inference RNG tracker (HOSTS.md), and megatron's own ``MLP`` block built from
``ColumnParallelLinear`` (fc1) and ``RowParallelLinear`` (fc2).
"""

from __future__ import annotations

import megatron.core  # noqa: F401 - a real host; missing it is a failure
import pytest
import torch

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.numerics import (
    LayerEmulator,
    convert_to_fp8_emulation,
    emulated_linear,
    emulated_modules,
    fused_mode,
    is_fp8_emulated,
    revert_fp8_emulation,
)
from presets import FP8_PRESETS

pytestmark = pytest.mark.host


@pytest.fixture(autouse=True)
def seeded():
    """Every random tensor and layer initialisation of a test is reproducible."""
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def megatron_env(megatron_cpu):
    from megatron.core import tensor_parallel

    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    with fused_mode(False):
        yield


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=1,
        hidden_size=128,
        ffn_hidden_size=256,
        num_attention_heads=4,
        use_cpu_initialization=True,
        add_bias_linear=True,
        bias_activation_fusion=False,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _mlp(cfg):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    torch.manual_seed(0)
    return MLP(cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))


@pytest.mark.parametrize("recipe", FP8_PRESETS)
def test_megatron_mlp_runs_the_recipe(megatron_env, recipe):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    cfg = _config()
    mlp = _mlp(cfg)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    x = torch.randn(
        32, 2, 128, generator=torch.Generator().manual_seed(2), requires_grad=True
    )  # [s, b, h]
    plain_out, plain_bias = mlp(x)
    convert_to_fp8_emulation(mlp, get_recipe(recipe))
    assert mlp.linear_fc1 is fc1 and type(fc1) is ColumnParallelLinear
    assert type(fc2) is RowParallelLinear and is_fp8_emulated(fc1) and is_fp8_emulated(fc2)
    assert [n for n, _ in emulated_modules(mlp)] == ["linear_fc1", "linear_fc2"]
    assert set(fc1.fp8_states) == (
        {"input", "weight", "grad_output"} if recipe == "fp8_delayed" else set()
    )

    out, bias = mlp(x)
    assert bias is fc2.bias and out.shape == plain_out.shape  # the (output, bias) contract
    # the same computation spelled out: skip_bias_add GEMMs, bias + GELU, second GEMM
    spec = get_recipe(recipe)
    e1, e2 = LayerEmulator(spec), LayerEmulator(spec)
    x2 = x.detach().clone().requires_grad_()
    h, b1 = emulated_linear(x2, fc1.weight, None, e1), fc1.bias
    want = emulated_linear(torch.nn.functional.gelu(h + b1), fc2.weight, None, e2)
    assert torch.equal(out, want)
    assert not torch.equal(out, plain_out)

    (out.sum() + bias.sum()).backward()
    want.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)

    revert_fp8_emulation(mlp)
    assert not is_fp8_emulated(fc1) and "_forward_impl" not in fc1.__dict__
    assert not hasattr(fc1, "fp8_states")
    again, _ = mlp(x)
    assert torch.equal(again, plain_out)


def test_gradient_accumulation_fusion_adds_into_main_grad(megatron_env):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    cfg = _config()
    torch.manual_seed(1)
    layer = ColumnParallelLinear(
        128, 128, config=cfg, init_method=cfg.init_method, bias=False, gather_output=False
    )
    layer.gradient_accumulation_fusion = True
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    convert_to_fp8_emulation(layer, get_recipe("fp8_current"), module_filter=lambda n, m: True)
    x = torch.randn(16, 1, 128, generator=torch.Generator().manual_seed(3))
    out, _ = layer(x)
    out.sum().backward()
    assert layer.weight.grad is None
    assert layer.weight.main_grad.abs().sum() > 0
    first = layer.weight.main_grad.clone()
    out, _ = layer(x)
    out.sum().backward()
    torch.testing.assert_close(layer.weight.main_grad, 2 * first)


def test_tensor_parallel_layers_are_refused(megatron_env):
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    cfg = _config()
    layer = RowParallelLinear(
        128,
        128,
        config=cfg,
        init_method=cfg.init_method,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=True,
    )

    class TwoRanks:
        def size(self):
            return 2

    layer.tp_group = TwoRanks()
    holder = torch.nn.ModuleDict({"proj": layer})
    with pytest.raises(FP8ConfigError, match="tensor-parallel size 2"):
        convert_to_fp8_emulation(holder, get_recipe("fp8_blockwise"))


def test_default_filter_keeps_output_layer_high_precision(megatron_env):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    cfg = _config()
    holder = torch.nn.ModuleDict(
        {
            "proj": ColumnParallelLinear(
                128, 128, config=cfg, init_method=cfg.init_method, bias=False
            ),
            "output_layer": ColumnParallelLinear(
                128, 256, config=cfg, init_method=cfg.init_method, bias=False
            ),
        }
    )
    convert_to_fp8_emulation(holder, get_recipe("fp8_blockwise"))
    assert is_fp8_emulated(holder["proj"]) and not is_fp8_emulated(holder["output_layer"])


def test_megatron_bf16_emulation(megatron_env):
    from nemo_fp8_plugin.numerics import (
        bf16_linear,
        convert_to_bf16_emulation,
        is_bf16_emulated,
        revert_bf16_emulation,
    )

    mlp = _mlp(_config())
    x = torch.randn(16, 2, 128, generator=torch.Generator().manual_seed(4))
    plain, _ = mlp(x)
    convert_to_bf16_emulation(mlp)
    assert is_bf16_emulated(mlp.linear_fc1) and is_bf16_emulated(mlp.linear_fc2)
    out, bias = mlp(x)
    h = bf16_linear(x, mlp.linear_fc1.weight, None) + mlp.linear_fc1.bias
    want = bf16_linear(torch.nn.functional.gelu(h), mlp.linear_fc2.weight, None)
    assert torch.equal(out, want) and bias is mlp.linear_fc2.bias
    revert_bf16_emulation(mlp)
    assert torch.equal(mlp(x)[0], plain)

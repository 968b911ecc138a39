"""NeMo RL's vLLM-side refit quantizer: :func:`quantize_weight_nemo_rl` against NeMo RL's own
``cast_tensor_to_fp8_blockwise``, compared byte for byte.

The reference is compiled from the real ``nemo_rl/models/generation/vllm/quantization/fp8.py``
of the NeMo RL snapshot. That module cannot be imported here: at import it needs ray, vLLM's
CUDA-only modules (``vllm.triton_utils``, the fused-MoE runner, the v1 engine core), accelerate
and transformers. So only the function's own source (and the ``FP8Config`` dataclass whose
global instance it reads, ``global_fp8_config``, which NeMo RL's ``init_fp8`` sets in the worker)
is taken from the file by ``ast`` and run with the real torch; its ``print`` on padding is
replaced by a no-op so the test output stays readable. Nothing of the function's arithmetic is
changed.
"""

from __future__ import annotations

import ast
import dataclasses

import pytest
import torch

from conftest import shared_nemo_rl
from nemo_fp8_plugin.errors import FP8ConfigError
from nemo_fp8_plugin.numerics.nemo_rl_numerics import quantize_weight_nemo_rl
from nemo_fp8_plugin.numerics.quantize import quantize_blockwise

FP8_PY = "src/nemo_rl/models/generation/vllm/quantization/fp8.py"


def nemo_rl_cast(pow2: bool = False):
    """NeMo RL's ``cast_tensor_to_fp8_blockwise`` with ``global_fp8_config`` set as
    ``init_fp8`` sets it (``use_weight_pow2_scale`` = ``pow2``)."""
    fp8_py = shared_nemo_rl(FP8_PY)
    tree = ast.parse(fp8_py.read_text())
    wanted = {"cast_tensor_to_fp8_blockwise", "FP8Config"}
    nodes = [
        n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted
    ]
    assert {n.name for n in nodes} == wanted
    namespace = {
        "torch": torch,
        "dataclass": dataclasses.dataclass,
        "field": dataclasses.field,
        "print": lambda *a, **k: None,
    }
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(fp8_py), "exec"), namespace)
    namespace["global_fp8_config"] = namespace["FP8Config"](use_weight_pow2_scale=pow2)
    fn = namespace["cast_tensor_to_fp8_blockwise"]

    def cast(w: torch.Tensor):
        # NeMo RL's load_weights: cast(v.to(torch.float), weight_block_size=[128, 128]),
        # then torch.squeeze(scale, dim=-1)
        data, scale = fn(w.to(torch.float), weight_block_size=[128, 128])
        return data, torch.squeeze(scale, dim=-1)

    return cast


def same(ours, theirs):
    (d1, s1), (d2, s2) = ours, theirs
    assert d1.dtype == d2.dtype == torch.float8_e4m3fn and s1.dtype == s2.dtype == torch.float32
    assert d1.shape == d2.shape and s1.shape == s2.shape
    assert torch.equal(d1.view(torch.uint8), d2.view(torch.uint8))
    assert torch.equal(s1.view(torch.int32), s2.view(torch.int32))


SHAPES = [(128, 128), (256, 384), (100, 200), (129, 127), (1, 1), (300, 64), (64, 300)]


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_random_weights_match_nemo_rl_bit_for_bit(shape, pow2):
    gen = torch.Generator().manual_seed(hash(shape) % 2**31)
    for scale in (1e-3, 0.05, 3.0):
        w = (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)
        same(quantize_weight_nemo_rl(w, pow2_scales=pow2), nemo_rl_cast(pow2)(w))


def edge_weights():
    base = torch.randn(200, 300, generator=torch.Generator().manual_seed(7)) * 0.02
    cases = {}
    w = base.clone()
    w[:128, :128] = 0.0  # an all-zero tile: scale 1
    cases["zero tile"] = w
    w = base.clone()
    w[5, 7] = float("nan")  # the whole tile NaN
    cases["nan"] = w
    w = base.clone()
    w[130, 260] = float("inf")
    w[3, 3] = -float("inf")
    cases["inf"] = w
    w = base.clone()
    w[:128, 128:256] = 1e-39  # a subnormal amax: stored scale 0
    w[:128, :128] = 1e-45
    cases["subnormal"] = w
    w = base.clone()
    w[-1, -1] = 5.0  # the padding value raises the partial tiles' amax
    cases["large last element"] = w
    w = base.clone()
    w[0, 0] = 1e30  # saturation of the other codes' neighbours
    w[150, 10] = 448.0 * 3
    cases["huge"] = w
    cases["all zero"] = torch.zeros(130, 130)
    cases["constant"] = torch.full((128, 256), -0.75)
    return cases


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("case", sorted(edge_weights()))
def test_edge_inputs_match_nemo_rl_bit_for_bit(case, pow2):
    w = edge_weights()[case]
    for dtype in (torch.float32, torch.bfloat16):
        x = w.to(dtype)
        same(quantize_weight_nemo_rl(x, pow2_scales=pow2), nemo_rl_cast(pow2)(x))


def test_the_edge_rules_are_what_the_docstring_says():
    cases = edge_weights()
    data, scale = quantize_weight_nemo_rl(cases["nan"])
    assert torch.isnan(data[:128, :128].float()).all() and torch.isnan(scale[0, 0])
    assert not torch.isnan(data[:128, 128:].float()).any()
    _, scale = quantize_weight_nemo_rl(cases["subnormal"])
    assert scale[0, 1] == 0.0 and scale[0, 0] == 0.0
    _, scale = quantize_weight_nemo_rl(cases["zero tile"])
    assert scale[0, 0] == 1.0
    # padding with the last element: the last tile's amax is 5, not the tile's own values
    _, scale = quantize_weight_nemo_rl(cases["large last element"])
    assert scale[-1, -1] == torch.reciprocal(
        torch.tensor(448.0) * torch.reciprocal(torch.tensor(5.0))
    )


def test_not_te_block_quantization():
    """On a large random BF16 weight NeMo RL's quantizer and TE's differ in some tile scales by
    an ulp or two (reciprocal-times-448 vs a correctly rounded division) and in the codes of those
    tiles: the reason rl-check has both weight paths."""
    w = (torch.randn(1024, 1024, generator=torch.Generator().manual_seed(3)) * 0.02).to(
        torch.bfloat16
    )
    data, scale = quantize_weight_nemo_rl(w)
    te = quantize_blockwise(w, (128, 128), "e4m3", False, 0.0)
    differ = scale != te.scale_inv
    assert 0 < int(differ.sum()) < scale.numel()
    ulp = (scale.view(torch.int32) - te.scale_inv.view(torch.int32)).abs()
    assert 1 <= int(ulp.max()) <= 2
    assert not torch.equal(data.view(torch.uint8), te.data.view(torch.uint8))


@pytest.mark.parametrize(
    "args, key",
    [
        ((torch.zeros(4),), "weight"),
        ((torch.zeros(2, 2, 2),), "weight"),
        ((torch.zeros(4, 4, dtype=torch.int32),), "weight"),
        ((torch.zeros(4, 4), (128, 64)), "block"),
        ((torch.zeros(4, 4), (0, 0)), "block"),
    ],
)
def test_bad_input_names_the_argument(args, key):
    with pytest.raises(FP8ConfigError) as err:
        quantize_weight_nemo_rl(*args)
    assert err.value.key == key

"""Short CPU training runs: every recipe's FP8 emulation tracks the BF16 run.

A small MLP (widths multiples of 128, so block recipes have whole tiles) learns a fixed
random teacher network for 300 AdamW steps with BF16 activations and fp32 master weights,
as in mixed-precision training. The FP8 run differs from the BF16 run only in its GEMMs;
both start from the same seed and see the same batches. The FP8 run's final loss (mean of
the last 30 steps) must be within 5% of the BF16 run's, and both must have learned.

The BF16 GEMM is computed as what a BF16 tensor-core GEMM computes: operands rounded to
BF16, exact products, fp32 accumulation, output rounded to BF16. (``torch.matmul`` on bf16
tensors is hundreds of times slower than fp32 on CPUs without native BF16, such as this
test machine's.) One thread: with tiny GEMMs OpenMP synchronisation costs more than it
saves, and far more on a shared machine.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.numerics import convert_to_fp8_emulation, fused_mode
from presets import FP8_PRESETS

RECIPES = FP8_PRESETS
STEPS = 300
BATCH = 128


class BF16Linear(nn.Linear):
    """A linear layer with a BF16 GEMM (see the module docstring)."""

    def forward(self, x):
        out = torch.nn.functional.linear(
            x.bfloat16().float(), self.weight.bfloat16().float(), self.bias.bfloat16().float()
        )
        return out.to(torch.bfloat16)


def make_model(linear=nn.Linear) -> nn.Module:
    return nn.Sequential(linear(128, 256), nn.GELU(), linear(256, 256), nn.GELU(), linear(256, 128))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train(recipe: str | None) -> tuple[float, float]:
    torch.manual_seed(1234)
    teacher = make_model()
    for p in teacher.parameters():
        p.requires_grad_(False)
    model = make_model(nn.Linear if recipe else BF16Linear)
    if recipe is not None:
        convert_to_fp8_emulation(model, get_recipe(recipe))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    data = torch.Generator().manual_seed(99)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 128, generator=data)
        with torch.no_grad():
            target = teacher(x)
        pred = model(x.to(torch.bfloat16))
        loss = torch.nn.functional.mse_loss(pred.float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses[0], sum(losses[-30:]) / 30


@pytest.fixture(scope="module")
def bf16_run():
    with fused_mode(False):
        return train(None)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.slow
def test_fp8_emulated_training_tracks_bf16(bf16_run, recipe):
    start, bf16_final = bf16_run
    assert bf16_final < 0.3 * start
    with fused_mode(False):
        _, fp8_final = train(recipe)
    assert abs(fp8_final - bf16_final) <= 0.05 * bf16_final, (recipe, fp8_final, bf16_final)

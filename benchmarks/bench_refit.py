"""Refit quantizer benchmark (issue 7 §2): GB/s of ``quantize_for_refit`` vs a copy.

Quantizes the linear weights of transformer layers shaped like Llama-3-8B's (hidden 4096,
8 KV heads of 128, MLP 14336; bf16) with the recipe's block FP8 layout, and clones the
same tensors in the same run as the copy baseline. Bytes moved: refit 2 B read + 1 B
written per element (+ the fp32 scales, counted), copy 2 B + 2 B. Both the eager
reference and the fused (torch.compile) path are timed; each timing is the best of
several interleaved rounds. ``--device cuda`` runs it on a GPU (Triton kernels through the
same torch.compile code) and ``--check`` first verifies, weight by weight, that the fused
output on that device is bit-identical to the eager reference computed on the CPU. Usage::

    .venv/bin/python benchmarks/bench_refit.py [--layers 1] [--recipe fp8_blockwise]
        [--device cpu|cuda] [--check] [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.numerics import fused_mode
from nemo_fp8_plugin.rl import quantize_for_refit


def layer_weights(layers: int, hidden: int, kv: int, ffn: int,
                  device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
              "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden),
              "mlp.down_proj": (hidden, ffn)}
    return {f"model.layers.{i}.{n}.weight":
            (torch.randn(*s, generator=gen) * 0.02).bfloat16().to(device)
            for i in range(layers) for n, s in shapes.items()}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_exact(weights: dict, spec) -> int:
    """Fused output on the weights' device == eager reference on the CPU, bit for bit."""
    cpu = {n: t.cpu() for n, t in weights.items()}
    fast = dict(quantize_for_refit(weights, spec, keep_bf16=lambda n: False, fused=True))
    ref = dict(quantize_for_refit(cpu, spec, keep_bf16=lambda n: False, fused=False))
    assert fast.keys() == ref.keys()
    for name, want in ref.items():
        got = fast[name].cpu()
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if got.element_size() == 1:
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got, want), f"{name}: fused output differs from the CPU reference"
    return len(ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--recipe", default="fp8_blockwise")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="quarter-width layers")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--check", action="store_true",
                        help="verify fused == CPU eager reference first")
    args = parser.parse_args()
    dims = (1024, 256, 3584) if args.quick else (4096, 1024, 14336)
    weights = layer_weights(args.layers, *dims, device=args.device)
    spec = get_recipe(args.recipe)
    elems = sum(t.numel() for t in weights.values())

    if args.check:
        with fused_mode(True, min_numel=0):
            print(f"check: {check_exact(weights, spec)} tensors bit-identical to the CPU "
                  f"reference on {args.device}")

    def copy():
        for t in weights.values():
            t.clone()
        sync(args.device)

    out_bytes = {}

    def refit(fused: bool):
        def run():
            total = 0
            for _, t in quantize_for_refit(weights, spec, keep_bf16=lambda n: False,
                                           fused=fused):
                total += t.numel() * t.element_size()
            sync(args.device)
            out_bytes[fused] = total
        return run

    runs = {"copy (clone)": copy, "refit eager": refit(False), "refit fused": refit(True)}
    with fused_mode(True, min_numel=0):
        runs["refit fused"]()  # compiles one kernel per weight shape; not timed
        best = {k: float("inf") for k in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                if name == "refit eager" and best[name] < float("inf") and args.rounds > 2:
                    continue  # the eager path is slow; one round is enough to place it
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    copy_gbs = elems * 4 / best["copy (clone)"] / 1e9
    print(f"# bench_refit  recipe {spec.name}  {args.layers} layer(s)  {elems / 1e6:.1f}M "
          f"weights (bf16)  device {args.device}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}")
    print(f"{'case':<16}{'best s':>10}{'GB/s':>9}{'x copy':>9}")
    for name, t in best.items():
        moved = elems * 4 if name.startswith("copy") else elems * 2 + out_bytes[name.endswith("fused")]
        gbs = moved / t / 1e9
        print(f"{name:<16}{t:>10.3f}{gbs:>9.2f}{gbs / copy_gbs:>9.2f}")


if __name__ == "__main__":
    main()

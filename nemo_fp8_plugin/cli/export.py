"""``nemo-fp8 export CHECKPOINT -o OUT``: a Hugging Face safetensors checkpoint quantized to
block FP8 (or MXFP8) in the layout vLLM loads natively
(:func:`nemo_fp8_plugin.rl.export_fp8_checkpoint`)."""

from __future__ import annotations

import argparse
import re
import sys

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

# The library's argument names, as this command spells them.
_FLAGS = {
    "source": "CHECKPOINT",
    "out_dir": "-o",
    "spec": "--recipe",
    "max_shard_bytes": "--max-shard-size",
    "config": "--model-config",
}


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write an FP8 checkpoint that vLLM loads natively",
        description="Quantize the linear weights of a Hugging Face safetensors checkpoint "
        "with the recipe's generation-side layout (block FP8 with _scale_inv tensors for "
        "fp8_blockwise / fp8_subchannel, MXFP8 for mxfp8), one tensor at a time, and write "
        "a checkpoint directory with the matching quantization_config. The output is built "
        "under a temporary name and renamed into place when complete.",
    )
    p.add_argument(
        "checkpoint",
        metavar="CHECKPOINT",
        help="a checkpoint directory, or its one *.safetensors file",
    )
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="directory to create")
    p.add_argument(
        "--recipe",
        default="fp8_blockwise",
        metavar="NAME",
        help="block or mx recipe (default fp8_blockwise)",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GiB",
        metavar="SIZE",
        help="largest safetensors file written, in bytes or with a unit (500MB, 5GiB; "
        "default 5GiB)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace OUT if it is an existing directory"
    )
    p.add_argument(
        "--no-copy-other-files",
        action="store_true",
        help="do not copy the tokenizer and other non-weight files",
    )
    p.add_argument(
        "--model-config",
        default=None,
        metavar="PATH",
        help="the model's Hugging Face config.json (default: the one in CHECKPOINT's "
        "directory); the output's config.json is this one with its quantization_config",
    )
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


_SIZE_DIGITS = 40
"""Most digits a size may have (2**63 bytes has 19): more is a typo, refused before any
arithmetic on it."""


def parse_size(text: str, key: str) -> int:
    """``"500MB"`` -> 500_000_000, ``"5GiB"`` -> 5 * 2**30, ``"1024"`` -> 1024; at most
    :data:`~nemo_fp8_plugin.rl.export.MAX_SHARD_BYTES`."""
    from fractions import Fraction

    from ..errors import FP8ConfigError, format_value

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise FP8ConfigError(
            f"expected a size such as 500MB or 5GiB, got {format_value(text)}", key=key
        )
    number = match.group(1)
    limit = 2**63 - 1  # a file offset is a signed 64-bit number (rl.export.MAX_SHARD_BYTES)
    # exact arithmetic (a float overflows at 400 digits and rounds long before)
    size = int(Fraction(number) * _UNITS[unit]) if len(number) <= _SIZE_DIGITS else limit + 1
    if size <= 0:
        raise FP8ConfigError("the size must be positive", key=key, value=text)
    if size > limit:
        raise FP8ConfigError(
            f"{format_value(text, 40)} is more than the largest size, {limit} bytes",
            key=key,
        )
    return size


def _flags_for(text: str | None) -> str | None:
    """The library's argument spellings in a message, as this command's flags."""
    if text is None:
        return None
    return text.replace("overwrite=True", "--overwrite").replace("config=", "--model-config PATH")


def run(args: argparse.Namespace) -> int:
    from .._io import dump_json
    from ..errors import FP8ConfigError

    max_bytes = parse_size(args.max_shard_size, "--max-shard-size")
    from .._io import shown_path
    from ..rl import export_fp8_checkpoint

    try:
        result = export_fp8_checkpoint(
            args.checkpoint,
            args.output,
            args.recipe,
            max_shard_bytes=max_bytes,
            overwrite=args.overwrite,
            config=args.model_config,
            copy_other_files=not args.no_copy_other_files,
            progress=False if args.no_progress else None,
        )
    except FP8ConfigError as err:
        flag = _FLAGS.get(err.key or "")
        if flag is None:
            raise
        raise FP8ConfigError(
            _flags_for(err.bare_message) or "",
            key=flag,
            value=err.value,
            hint=_flags_for(err.hint),
        ) from None
    for name in result.skipped:
        print(
            f"nemo-fp8 export: note: {shown_path(name)} of the checkpoint directory not "
            f"copied (only its regular files are)",
            file=sys.stderr,
        )
    for name in result.outside:
        print(
            f"nemo-fp8 export: note: {shown_path(name)} of the checkpoint directory not "
            f"copied (a symbolic link out of it)",
            file=sys.stderr,
        )
    if args.json:
        sys.stdout.write(
            dump_json(
                {
                    "path": str(result.path),
                    "quantized": result.quantized,
                    "passed_through": result.passed_through,
                    "shards": result.shards,
                    "bytes": result.bytes,
                    "quantization_config": result.quantization_config,
                }
            )
        )
    else:
        print(
            f"wrote {shown_path(result.path)}: {result.quantized} weights in FP8, {result.passed_through} "
            f"tensors as they came, {result.shards} shard{'s' if result.shards != 1 else ''}, "
            f"{result.bytes / 1e9:.2f} GB"
        )
        print("\n".join(next_steps(result, args.recipe)))
    return 0


WORKER = "nemo_fp8_plugin.hosts.vllm.worker.NemoFp8WorkerExtension"
"""The worker extension a refitting engine names (``hosts.vllm.worker.WORKER_EXTENSION``,
spelled here so that this command imports no vLLM code)."""


def next_steps(result, recipe: str) -> list[str]:
    """How to serve and refit what was written: vLLM's own ``fp8`` method reads a block-FP8
    export on a GPU; this plugin's ``nemo_fp8`` method (the one an MXFP8 export names) reads
    it on any platform vLLM runs on, the CPU included, and takes refits in place."""
    import json
    import shlex

    from .._io import shown_path
    from ..hosts.vllm import engine_env

    path = shown_path(result.path)
    env = "".join(f"{k}={v} " for k, v in engine_env(recipe).items())
    serve = f"{env}vllm serve {shlex.quote(path)}"
    python = f'vllm.LLM(model={json.dumps(path)}, quantization="nemo_fp8"'
    if result.quantization_config.get("quant_method") == "fp8":
        lines = [
            f"serve it with vLLM's own fp8 method (GPU): {serve}",
            f"or with this plugin's nemo_fp8 method (any platform, CPU included): {serve} "
            f"--quantization nemo_fp8, in Python {python})",
        ]
    else:
        lines = [
            f"serve it with this plugin's nemo_fp8 method, which its config.json names (any "
            f"platform, CPU included): {serve}, in Python {python})"
        ]
    return lines + [
        f'refit it in place every RL step: {python}, worker_extension_cls="{WORKER}"); see '
        f'docs/hosts/vllm.md ("Refit") and examples/vllm/refit_loop.py'
    ]

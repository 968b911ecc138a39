"""``nemo-fp8 verify-refit ENGINE TRAINER``: does the generation engine hold, after a refit,
the FP8 weights the trainer's weights give under the recipe?
(:func:`nemo_fp8_plugin.rl.verify.verify_refit`). Exit 0 when every weight is bit-equal or
within the scale difference of two faithful quantizers, 1 when one differs or is missing, 2
on input that cannot be read."""

from __future__ import annotations

import argparse
import sys

# The library's argument names, as this command spells them.
_FLAGS = {
    "engine": "ENGINE",
    "trainer": "TRAINER",
    "spec": "--recipe",
    "numerics": "--numerics",
    "num_layers": "--num-layers",
}

_SHOWN = {"within_ulp": "within ulp", "bit_equal": "bit-equal"}


def register(sub) -> None:
    p = sub.add_parser(
        "verify-refit",
        help="check that a rollout engine holds the trainer's FP8 weights after a refit",
        description="Requantize the trainer's weights with the recipe's numerics and compare "
        "them, weight by weight and tile by tile, with what the engine holds: an exported "
        "checkpoint (nemo-fp8 export) or a dump of a running nemo_fp8 engine "
        "(nemo_fp8_plugin.rl.verify.dump_engine_weights). Each weight is bit-equal, within "
        "ulp (scales within two fp32 ulps and codes within one step: how NeMo RL's worker "
        "quantizer and Transformer Engine's differ), different (with its worst tile) or "
        "missing. Exit status 1 when one is different or missing.",
    )
    p.add_argument(
        "engine",
        metavar="ENGINE",
        help="what the engine holds: a checkpoint directory or .safetensors file in the export "
        "layout (<name> float8 with <name>_scale_inv)",
    )
    p.add_argument(
        "trainer",
        metavar="TRAINER",
        help="the trainer's weights: a Hugging Face checkpoint directory or .safetensors file "
        "(high precision)",
    )
    p.add_argument(
        "--recipe",
        default="fp8_blockwise",
        metavar="RECIPE",
        help="the recipe the refit claims (its tiles, scales and BF16 rules): a name, or an "
        'fp8: block as JSON such as \'{"recipe": "fp8_blockwise", "bf16_layers": '
        '{"first": 1}}\' (default fp8_blockwise)',
    )
    p.add_argument(
        "--numerics",
        choices=("te", "nemo_rl"),
        default="te",
        help="how the trainer's weights are requantized: te, Transformer Engine's (the "
        "plugin's refit and nemo_fp8 method; default), or nemo_rl, NeMo RL's vLLM worker "
        "quantizer",
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        metavar="N",
        help="the model's layer count, for bf16_layers.last (default: TRAINER's config.json)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="count a weight within ulp as a difference (exit 1)",
    )
    p.add_argument("--json", action="store_true", help="print every weight's result as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._io import dump_json
    from ..errors import FP8ConfigError

    try:
        from ..rl.verify import verify_refit

        report = verify_refit(
            args.engine,
            args.trainer,
            args.recipe,
            numerics=args.numerics,
            num_layers=args.num_layers,
            exact=args.exact,
        )
    except FP8ConfigError as err:
        flag = _FLAGS.get((err.key or "").split(".")[0])
        if flag is None:
            raise
        raise FP8ConfigError(err.bare_message, key=flag, value=err.value, hint=err.hint) from None
    if args.json:
        sys.stdout.write(dump_json(report.to_dict()))
        return 0 if report.ok else 1
    counts = report.counts
    print(
        f"{len(report.checks)} weights: {counts['bit_equal']} bit-equal, "
        f"{counts['within_ulp']} within ulp, {counts['different']} different, "
        f"{counts['missing']} missing (recipe {report.recipe}, numerics {report.numerics})"
    )
    for check in report.checks:
        if check.status != "bit_equal":
            status = _SHOWN.get(check.status, check.status)
            print(f"{status:<10}  {check.name}: {check.detail}")
    print("ok" if report.ok else f"FAILED: {len(report.failed())} weights")
    return 0 if report.ok else 1

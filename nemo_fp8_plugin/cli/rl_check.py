"""``nemo-fp8 rl-check``: end-to-end FP8 RL on the CPU, four arms, mismatch tables."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "rl-check",
        help="run a tiny GRPO loop in BF16 and FP8 arms and print mismatch tables",
        description="Train a tiny causal LM by GRPO on a toy task with a verifiable reward, "
        "with rollouts from a separate generation engine refit after every step, in "
        "four arms: bf16; fp8-gen (FP8 generation only); fp8-e2e (FP8 generation "
        "and training, the same recipe); fp8-gen-is (FP8 generation with the "
        "importance-sampling correction). Prints one table per arm and a summary: "
        "token_mult_prob_error, gen_kl_error, final reward, and the refit share of "
        "step time. CPU only; the full check takes a few minutes, --quick under a "
        "minute.",
    )
    p.add_argument(
        "--quick", action="store_true", help="the short form CI runs (fewer, smaller steps)"
    )
    p.add_argument(
        "--arms",
        default=None,
        help="comma-separated subset of bf16,fp8-gen,fp8-e2e,fp8-gen-is (default: all)",
    )
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per arm")
    p.add_argument("--seed", type=int, default=None, help="seed (default 0)")
    p.add_argument(
        "--recipe",
        default=None,
        help="block recipe of the FP8 arms (default fp8_blockwise; fp8_subchannel "
        "for power-of-2 scales)",
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the per-step records and the summary as JSON",
    )
    p.add_argument("--quiet", action="store_true", help="no per-step progress on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._io import check_output_file
    from ..errors import FP8ConfigError
    from ..registry import get_recipe
    from ..tools.rl_check import ARMS, FULL, QUICK, render_tables, run_check, with_overrides
    from ._args import name_list

    check_output_file(args.json, "--json")
    arms = tuple(
        name_list(args.arms, "--arms", noun="arm", hint=f"one or more of {', '.join(ARMS)}") or ARMS
    )
    for arm in arms:
        if arm not in ARMS:
            raise FP8ConfigError(
                f"unknown arm {arm!r}", key="--arms", value=arm, hint=f"one of {', '.join(ARMS)}"
            )
    if args.steps is not None and not 1 <= args.steps <= 100_000:
        raise FP8ConfigError(
            f"must be in [1, 100000], got {args.steps}", key="--steps", value=args.steps
        )
    # torch seeds each stream with seed + 1 ... seed + 4: keep all of them in its range
    if args.seed is not None and not 0 <= args.seed <= 2**32 - 5:
        raise FP8ConfigError(
            f"must be in [0, {2**32 - 5}], got {args.seed}", key="--seed", value=args.seed
        )
    if args.recipe is not None:
        try:
            spec = get_recipe(args.recipe)
        except FP8ConfigError as err:
            raise FP8ConfigError(
                err.bare_message, key="--recipe", value=args.recipe, hint=err.hint
            ) from None
        if spec.scaling != "block":
            raise FP8ConfigError(
                f"{args.recipe} is {spec.scaling} scaling; rl-check's FP8 "
                f"generation engine is block FP8 (NeMo RL's vLLM path)",
                key="--recipe",
                value=args.recipe,
                hint="use fp8_blockwise or fp8_subchannel",
            )
    settings = with_overrides(
        QUICK if args.quick else FULL, steps=args.steps, seed=args.seed, recipe=args.recipe
    )
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    results = run_check(settings, arms=arms, progress=progress)
    sys.stdout.write(render_tables(results, settings))
    if args.json:
        from dataclasses import asdict

        from ..tools.harness import environment, write_json

        write_json(
            args.json,
            {
                "environment": environment(),
                "settings": asdict(settings),
                "summary": [r.summary() for r in results],
                "steps": {r.name: [asdict(s) for s in r.steps] for r in results},
            },
        )
    return 0

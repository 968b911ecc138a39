"""``nemo-fp8 rl-check``: end-to-end FP8 RL on the CPU, seven arms over seeds, tables and curves."""

from __future__ import annotations

import argparse
import sys

_ARM_HELP = "bf16,fp8-gen,fp8-gen-is,fp8-e2e,fp8-e2e-is,fp8-e2e-is-kv,fp8-e2e-te-refit"


def register(sub) -> None:
    p = sub.add_parser(
        "rl-check",
        help="run a tiny GRPO loop in BF16 and FP8 arms over seeds; mismatch, reward, costs",
        description="Train a tiny causal LM by GRPO on a task with a verifiable reward and "
        "answers of 16 tokens (the running sum of the prompt's digits: each answer token "
        "follows from the one before, so a mismatch compounds), with rollouts from a "
        "separate generation engine refit after every step, in seven arms: bf16; fp8-gen "
        "(FP8 generation only); fp8-gen-is (the same with token-level TIS, ratio 2); fp8-e2e "
        "(FP8 generation and training); fp8-e2e-is (NVIDIA's recipe: end to end plus TIS); "
        "fp8-e2e-is-kv (plus an FP8 KV cache and FP8 queries with per-step q/k/v scales); "
        "fp8-e2e-te-refit (fp8-e2e with weights quantized on the trainer, bit-identical to "
        "its own). The engine quantizes activations as vLLM does and, except in "
        "fp8-e2e-te-refit, the refit BF16 weights as NeMo RL's vLLM worker does; the trainer "
        "quantizes as Transformer Engine does. Prints the final reward on held-out prompts "
        "(mean and 95% interval over seeds) against bf16 and NVIDIA's comparison "
        "(fp8-e2e-is vs fp8-gen-is), each verdict with its margin, the power per arm for a "
        "0.03 reward gap, the mismatch metrics against NeMo RL's nightly checks, a per-layer "
        "attribution of the mismatch, the measured cost of each phase and the CPU it ran on. "
        "CPU only; see docs/rl.md for the run times; --quick is a smoke run of about a "
        "minute.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="the smoke run CI runs (2 seeds, 3 small steps, answers of 8 tokens): too short "
        "to learn, so it checks the machinery, not FP8",
    )
    p.add_argument(
        "--arms", default=None, help=f"comma-separated subset of {_ARM_HELP} (default: all)"
    )
    p.add_argument(
        "--steps", default=None, metavar="N", help="GRPO steps per arm and seed (default 12)"
    )
    p.add_argument("--seeds", default=None, metavar="N", help="number of seeds (default 10)")
    p.add_argument("--seed", default=None, metavar="N", help="first seed (default 0)")
    p.add_argument(
        "--jobs",
        default=None,
        metavar="N",
        help="seeds run in parallel processes (default: as many as there are seeds and CPU "
        "cores; the records are the same, only the timings differ)",
    )
    p.add_argument(
        "--recipe",
        default=None,
        help="block recipe of the FP8 arms (default fp8_blockwise; fp8_subchannel "
        "for power-of-2 scales)",
    )
    p.add_argument(
        "--generation-numerics",
        default=None,
        metavar="NAME",
        help="how the engine quantizes activations: vllm (default, as vLLM's QuantFP8), "
        "vllm_deepgemm_ue8m0, or trainer (the trainer's own numerics, not what a GPU does)",
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the settings, the summary and every step's record as JSON",
    )
    p.add_argument(
        "--png",
        default=None,
        metavar="PATH",
        help="write the reward and token_mult_prob_error curves (default with --json: "
        "the JSON path with .png)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace a read-only (e.g. 0444) --json or --png file; without it one is refused",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


def _int(text: str | None, key: str, lo: int, hi: int) -> int | None:
    from ..errors import FP8ConfigError

    if text is None:
        return None
    try:
        value = int(text, 10)
    except ValueError:
        raise FP8ConfigError(f"expected an integer, got {text!r}", key=key, value=text) from None
    if not lo <= value <= hi:
        raise FP8ConfigError(f"must be in [{lo}, {hi}], got {value}", key=key, value=value)
    return value


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .._io import check_output_file, same_file
    from ..capabilities import capability
    from ..errors import FP8ConfigError
    from ..registry import get_recipe
    from ..tools.rl_check import ARMS, FULL, LIMITS, QUICK, run_check, with_overrides
    from ._args import name_list

    # Every check before any work: a typo must not cost a finished run its results.
    png = args.png
    if png is None and args.json is not None:
        png = str(Path(args.json).with_suffix(".png"))
        if png == args.json:
            png = args.json + ".png"
    for path, key in ((args.json, "--json"), (png, "--png")):
        check_output_file(path, key, read_only_ok=args.force)  # its folder too
    if args.json is not None and png is not None and same_file(args.json, png):
        raise FP8ConfigError("--json and --png name the same file", key="--png", value=png)
    arms = tuple(
        name_list(args.arms, "--arms", noun="arm", hint=f"one or more of {', '.join(ARMS)}") or ARMS
    )
    for arm in arms:
        if arm not in ARMS:
            raise FP8ConfigError(
                f"unknown arm {arm!r}", key="--arms", value=arm, hint=f"one of {', '.join(ARMS)}"
            )
    if len(set(arms)) != len(arms):
        raise FP8ConfigError("an arm is named twice", key="--arms", value=args.arms)
    steps = _int(args.steps, "--steps", *LIMITS["steps"])
    seeds = _int(args.seeds, "--seeds", *LIMITS["seeds"])
    seed = _int(args.seed, "--seed", *LIMITS["seed"])
    jobs = _int(args.jobs, "--jobs", 1, 64)
    numerics = args.generation_numerics
    if numerics is not None:
        from ..spec import GENERATION_NUMERICS

        if numerics not in GENERATION_NUMERICS:
            raise FP8ConfigError(
                f"unknown generation numerics {numerics!r}",
                key="--generation-numerics",
                value=numerics,
                hint=f"one of {', '.join(GENERATION_NUMERICS)}",
            )
    if args.recipe is not None:
        try:
            spec = get_recipe(args.recipe)
        except FP8ConfigError as err:
            raise FP8ConfigError(
                err.bare_message, key="--recipe", value=args.recipe, hint=err.hint
            ) from None
        from ..capabilities import capability

        if not capability(spec.scaling).is_block:
            raise FP8ConfigError(
                f"{args.recipe} is {spec.scaling} scaling; rl-check's FP8 "
                f"generation engine is block FP8 (NeMo RL's vLLM path)",
                key="--recipe",
                value=args.recipe,
                hint="use fp8_blockwise or fp8_subchannel",
            )
    if png is not None:
        from ..tools.harness import pyplot

        pyplot()  # a missing matplotlib fails now, not when the results are ready
    settings = with_overrides(
        QUICK if args.quick else FULL,
        steps=steps,
        seeds=seeds,
        seed=seed,
        recipe=args.recipe,
        generation_numerics=numerics,
    )
    if jobs is None:
        import os

        jobs = max(1, min(settings.seeds, os.cpu_count() or 1))
    result = run_check(settings, arms=arms, progress=not args.quiet, jobs=jobs)
    from ..tools.harness import environment, write_json
    from ..tools.rl_check import SEED_THREADS
    from ..tools.rl_check_report import plot_curves, render_tables, summarize, to_json

    summary = summarize(result)
    machine = environment()
    # the harness records this process's torch threads; every seed runs at SEED_THREADS
    machine.update(seed_threads=SEED_THREADS, seed_processes=jobs)
    sys.stdout.write(render_tables(result, summary, machine))
    if args.json:
        write_json(args.json, {"environment": machine, **to_json(result, summary)})
    if png is not None:
        plot_curves(result, png)
    return 0

"""What the scale-refresh callback costs a resumed NeMo 2 (Lightning) run, on CPU.

    .venv/bin/python benchmarks/bench_refresh.py [--steps 50] [--rounds 3] [--width 512]
        [--batch 64] [--calibration-steps 4] [--json out.json]

A two-layer MLP (``--width``; ``--batch`` rows a step) under the ``fp8_delayed`` emulation
trains 3 steps and is checkpointed; then, ``--rounds`` times and interleaved, the run is
resumed for ``--steps`` steps twice: plainly (the baseline) and with
:class:`FP8ScaleRefreshCallback` (a refresh of ``--calibration-steps`` passes before the first
step, and an ``after_optimizer_step`` hook that does nothing, so what is measured is the
callback's own cost). Each arm runs once untimed first (a process's first ``fit`` pays one-off
costs). Reported:

* ``fit_ratio``: best resumed ``fit`` time with the callback / best without, the same run's
  baseline (the machine is shared: a ratio of two measurements taken side by side is what
  carries over);
* the callback's own accounting, median over the rounds: ``refresh_seconds``,
  ``hook_seconds``, ``step_seconds`` and ``overhead_fraction`` = (refresh + hook) / step time
  (``tests/test_callbacks.py`` checks that it is recorded and consistent, never its value).

A benchmark, not a test: CI never runs it; figures and how they were taken are in
docs/performance.md.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from nemo_fp8_plugin import get_recipe
from nemo_fp8_plugin.hosts.nemo2.callback import FP8ScaleRefreshCallback
from nemo_fp8_plugin.numerics import convert_to_fp8_emulation
from nemo_fp8_plugin.tools.harness import environment, interleaved, ratio, write_json

STAT_KEYS = ("refresh_seconds", "hook_seconds", "step_seconds", "overhead_fraction")


def _module(width: int):
    import lightning.pytorch as pl

    torch.manual_seed(0)
    net = convert_to_fp8_emulation(
        nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)),
        get_recipe("fp8_delayed"),
    )

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):  # the refresh's calibration passes call the module
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    return Lit()


def _fit(root: Path, width: int, data, max_steps: int, callbacks, ckpt: Path | None = None):
    import lightning.pytorch as pl

    trainer = pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=str(root),
    )
    trainer.fit(_module(width), data, ckpt_path=None if ckpt is None else str(ckpt))
    return trainer


def run(steps: int, rounds: int, width: int, batch: int, calibration_steps: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    batches = torch.randn(steps * batch, width, generator=gen) * 1000.0  # above E4M3's 448
    data = torch.utils.data.DataLoader(batches, batch_size=batch)
    stats: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on dataloader workers, per fit
        root = Path(tmp)
        ckpt = root / "resume.ckpt"
        _fit(root, width, data, 3, []).save_checkpoint(ckpt)

        def baseline():
            _fit(root, width, data, 3 + steps, [], ckpt)

        def with_callback():
            cb = FP8ScaleRefreshCallback(
                "fp8_delayed",
                calibration_steps=calibration_steps,
                after_optimizer_step=lambda trainer, module: None,
            )
            _fit(root, width, data, 3 + steps, [cb], ckpt)
            stats.append(dict(cb.stats))

        baseline(), with_callback()  # warm-up: the first fit of a process pays one-off costs
        stats.clear()
        times = interleaved({"baseline": baseline, "callback": with_callback}, rounds)
    best = {name: min(ts) for name, ts in times.items()}
    return {
        "steps": steps,
        "rounds": rounds,
        "width": width,
        "batch": batch,
        "calibration_steps": calibration_steps,
        "fit_s": {
            name: {"best": best[name], "median": statistics.median(ts)}
            for name, ts in times.items()
        },
        "fit_ratio": ratio(best["callback"], best["baseline"]),
        "callback_stats": {k: statistics.median(s[k] for s in stats) for k in STAT_KEYS},
    }


def render(result: dict, env: dict) -> str:
    cb = result["callback_stats"]
    return "\n".join(
        [
            f"# bench_refresh  torch {env['torch']}  threads {env['threads']}  "
            f"width {result['width']}  batch {result['batch']}  {result['steps']} resumed steps x "
            f"{result['rounds']} rounds",
            f"resumed fit, best of rounds: baseline {result['fit_s']['baseline']['best']:.3f} s, "
            f"with the callback {result['fit_s']['callback']['best']:.3f} s "
            f"(x{result['fit_ratio']:.3f})",
            f"callback accounting (median): refresh {cb['refresh_seconds'] * 1e3:.1f} ms, "
            f"hook {cb['hook_seconds'] * 1e3:.3f} ms, steps {cb['step_seconds']:.3f} s, "
            f"overhead fraction {100 * cb['overhead_fraction']:.2f}%",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="steps after the resume")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per arm")
    parser.add_argument("--width", type=int, default=512, help="width of the two linear layers")
    parser.add_argument("--batch", type=int, default=64, help="rows per step")
    parser.add_argument(
        "--calibration-steps", type=int, default=4, help="calibration passes of the refresh"
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if min(args.steps, args.rounds, args.width, args.batch, args.calibration_steps) < 1:
        parser.error("--steps, --rounds, --width, --batch and --calibration-steps must be >= 1")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one line per fit otherwise
    env = environment()
    result = run(args.steps, args.rounds, args.width, args.batch, args.calibration_steps)
    print(render(result, env))
    if args.json:
        write_json(args.json, {"environment": env, **result})


if __name__ == "__main__":
    main()

"""Wall time of the config-only commands and of `explain` on large models.

    .venv/bin/python benchmarks/bench_explain.py [--repeat 5] [--json]

Measured in one run, each as the median wall and CPU (user + system) time of ``--repeat``
fresh processes:

* baseline: ``python -c pass`` (interpreter start-up, the floor every command pays);
* ``nemo-fp8 recipes``, ``nemo-fp8 explain`` (the example config), ``nemo-fp8 apply --host
  megatron``, and ``nemo-fp8 explain`` of an 80-layer Llama-3.1-70B config with first/last
  and module rules (per-layer table for both sides, every host's spelling);
* in-process (no start-up): ``build_report`` + ``render_text`` of that 70B config and of a
  DeepSeek-V3 config (61 layers, 256 experts: 44k Hugging Face module names), median of
  ``--repeat`` calls after one warm-up, with the model table's caches cleared each time.

Also checks that the config-only commands import no torch. Ratios are against the baseline
of the same run; absolute times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "conf" / "examples" / "llama3_8b_pretrain_fp8_blockwise.yaml"

LLAMA_70B = """\
precision: fp8_blockwise
fp8:
  bf16_layers:
    first: 1
    last: 1
    modules: ["*down_proj*", "output_layer"]
model:
  name: meta-llama/Llama-3.1-70B-Instruct
"""

DEEPSEEK_V3 = """\
precision: fp8_blockwise
fp8:
  model: deepseek-ai/DeepSeek-V3
  bf16_layers:
    last: 1
    modules: ["*kv_a_proj*", "*.router"]
"""


def _child_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_cli(args: list[str], repeat: int) -> tuple[float, float]:
    """Median wall time and median CPU time (user + system) of fresh processes. CPU time is
    the steadier figure on a loaded machine."""
    walls, cpus = [], []
    for _ in range(repeat):
        c, t = _child_cpu(), time.perf_counter()
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True)
        walls.append(time.perf_counter() - t)
        cpus.append(_child_cpu() - c)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(args)} failed: {proc.stderr[-2000:]}")
    return statistics.median(walls), statistics.median(cpus)


def imports_torch(args: list[str]) -> bool:
    code = (
        "import sys, runpy, contextlib, io\n"
        f"sys.argv = ['nemo-fp8', *{args!r}]\n"
        "from nemo_fp8_plugin.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): main(sys.argv[1:])\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1] == "True"


def in_process(path: Path, repeat: int) -> float:
    from nemo_fp8_plugin.explain import build_report, render_text
    from nemo_fp8_plugin.rules import models

    render_text(build_report(path))  # warm-up: imports
    times = []
    for _ in range(repeat):
        models._builtin.cache_clear()  # a fresh description and resolution each time
        t = time.perf_counter()
        render_text(build_report(path))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "llama70b.yaml"
        big.write_text(LLAMA_70B)
        dsv3 = Path(tmp) / "deepseek_v3.yaml"
        dsv3.write_text(DEEPSEEK_V3)
        cmds = {
            "python -c pass (baseline)": ["-c", "pass"],
            "nemo-fp8 recipes": ["-m", "nemo_fp8_plugin", "recipes"],
            "nemo-fp8 explain (example, Llama-3.1-8B)": [
                "-m",
                "nemo_fp8_plugin",
                "explain",
                str(EXAMPLE),
            ],
            "nemo-fp8 apply --host megatron": [
                "-m",
                "nemo_fp8_plugin",
                "apply",
                str(EXAMPLE),
                "--host",
                "megatron",
            ],
            "nemo-fp8 explain (Llama-3.1-70B, 80 layers)": [
                "-m",
                "nemo_fp8_plugin",
                "explain",
                str(big),
            ],
            "nemo-fp8 explain --json (DeepSeek-V3)": [
                "-m",
                "nemo_fp8_plugin",
                "explain",
                str(dsv3),
                "--json",
            ],
        }
        rows = {name: run_cli(cmd, args.repeat) for name, cmd in cmds.items()}
        base = rows["python -c pass (baseline)"]
        torch_free = {
            name: not imports_torch(cmd[2:])
            for name, cmd in cmds.items()
            if cmd[:2] == ["-m", "nemo_fp8_plugin"]
        }
        inproc = {
            "build_report + render_text, Llama-3.1-70B": in_process(big, args.repeat),
            "build_report + render_text, DeepSeek-V3": in_process(dsv3, args.repeat),
        }
    if args.json:
        print(
            json.dumps(
                {
                    "processes_wall_cpu_s": rows,
                    "torch_free": torch_free,
                    "in_process_s": inproc,
                    "load_average": os.getloadavg(),
                },
                indent=2,
            )
        )
        return
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| command | wall s | x baseline | CPU s | x baseline | imports torch |")
    print("|---|---|---|---|---|---|")
    for name, (wall, cpu) in rows.items():
        tf = "-" if name not in torch_free else ("no" if torch_free[name] else "YES")
        print(
            f"| {name} | {wall:.3f} | {wall / base[0]:.1f} | {cpu:.3f} | {cpu / base[1]:.1f} | {tf} |"
        )
    print()
    print(f"| in process | wall (s, median of {args.repeat}) |")
    print("|---|---|")
    for name, t in inproc.items():
        print(f"| {name} | {t:.3f} |")


if __name__ == "__main__":
    main()

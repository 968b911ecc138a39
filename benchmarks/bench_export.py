"""Checkpoint export benchmark: ``export_fp8_checkpoint`` against a same-run
safetensors copy of the same files.

Writes a synthetic Llama-shaped bf16 checkpoint (hidden 4096, MLP 14336, 8 KV heads, four
layers and a 32000-token tied embedding: 1.92 GB in shards with a
``model.safetensors.index.json``; ``--quick``: 52 MB of quarter-width layers) into a temporary
directory under ``--workdir`` (default: the system temp directory), removes it afterwards,
and prints export and copy seconds, GB/s, their ratio (best, median, per-round median, and the
per-round median over the rounds at load average below 1.5: only those count), the load
average at each round, a stage profile (read, read+quantize, whole export), the first
export's time (kernel builds) and the export's peak resident memory measured in a fresh
Python. Usage::

    .venv/bin/python benchmarks/bench_export.py [--quick] [--workdir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse

from nemo_fp8_plugin.tools.bench_export import bench_export, render_export
from nemo_fp8_plugin.tools.harness import write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="52 MB instead of 1.9 GB")
    parser.add_argument("--workdir", default=None, help="where the temporary checkpoint goes")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    result = bench_export(quick=args.quick, workdir=args.workdir)
    env = result["environment"]
    print(f"# bench_export  torch {env['torch']}  threads {env['threads']}  cpu {env['cpu']}")
    print(render_export(result))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()

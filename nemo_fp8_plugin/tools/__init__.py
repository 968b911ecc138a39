"""Tooling apart from the product: benchmarks, the GPU check, the demo and rl-check.

* :mod:`.harness`: what they all share (timing with device sync, the environment record,
  arm records, JSON / PNG output);
* :mod:`.bench` (``nemo-fp8 bench``), :mod:`.gpu_check` (``scripts/gpu_check.sh``),
  :mod:`.demo` (``nemo-fp8 demo``), :mod:`.rl_check` with :mod:`.rl_check_model`,
  :mod:`.rl_check_report` and :mod:`.rl_check_stats` (``nemo-fp8 rl-check``).

Nothing in the product imports from here; the CLI subcommands and ``benchmarks/`` do.
"""

"""Tooling apart from the product: benchmarks, the GPU check, the demo and rl-check.

Nothing in the product imports from here; the CLI subcommands do.
"""

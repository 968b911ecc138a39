"""Checkpoint export benchmark: :func:`~nemo_fp8_plugin.rl.export_fp8_checkpoint`
against a same-run safetensors copy of the same files, and its peak memory.

A synthetic Llama-shaped checkpoint (hidden 4096, 8 KV heads of 128, MLP 14336, bf16, in
several shards with a ``model.safetensors.index.json``; about 2 GB, or about 50 MB of
quarter-width layers with ``quick``) is written into a temporary directory, which is removed
afterwards. Two arms, interleaved so machine load hits both:

- ``export``: ``export_fp8_checkpoint(src, out, "fp8_blockwise")``;
- ``copy``: each shard read with ``safetensors.torch.load_file`` and written with
  ``save_file`` (what copying a checkpoint through the library costs: the disk-speed floor).

The first export is timed apart (``first_export_s``: one-off kernel builds and compiles),
then each arm runs ``rounds`` times (5; 1 with ``quick``); each output is removed, and the
page cache's dirty pages flushed (``os.sync``), between runs, outside the timed region. ``ratio`` is export throughput over copy throughput (same input bytes, so
``copy_s / export_s`` of the best runs; ``ratio_paired_median`` is the median over rounds of
each export against the copy run right after it). The peak resident memory of one export is measured
in a fresh Python (:func:`measure_export_memory`) against the bound the tests hold it to:
twice the largest tensor plus 300 MB above the interpreter's baseline.

torch and safetensors are imported inside the functions (the CLI imports this module first).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .harness import environment, median, ratio, timed, timing_summary

__all__ = [
    "bench_export",
    "render_export",
    "measure_export_memory",
    "write_synthetic_checkpoint",
    "RSS_SLACK_BYTES",
]

RSS_SLACK_BYTES = 300 * 2**20
"""Fixed part of the memory bound: peak RSS above baseline < 2 x largest tensor + this."""

FULL = {"hidden": 4096, "intermediate": 14336, "kv_heads": 8, "layers": 4, "vocab": 32000}
"""The full benchmark's model: four Llama-3-8B layers and a Llama-2 vocabulary (tied
embeddings): 1.92 GB of bf16 weights."""
QUICK = {"hidden": 1024, "intermediate": 2816, "kv_heads": 2, "layers": 2, "vocab": 4096}
"""``quick``: quarter-width layers, 52 MB."""


def _llama_shapes(
    hidden: int, intermediate: int, kv_heads: int, layers: int, vocab: int
) -> list[tuple[str, tuple[int, ...]]]:
    kv = kv_heads * 128
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (intermediate, hidden)),
            (p + "mlp.up_proj.weight", (intermediate, hidden)),
            (p + "mlp.down_proj.weight", (hidden, intermediate)),
        ]
    out.append(("model.norm.weight", (hidden,)))
    return out


def write_synthetic_checkpoint(
    directory: str | os.PathLike,
    shapes: list[tuple[str, tuple[int, ...]]],
    *,
    shard_bytes: int,
    config: dict[str, Any] | None = None,
    seed: int = 0,
) -> dict[str, int]:
    """Write ``shapes`` (name, shape) as a bf16 Hugging Face checkpoint: shards of about
    ``shard_bytes`` each, ``model.safetensors.index.json`` when there are several, and
    ``config.json``. Memory: one shard at a time. Returns ``bytes`` (tensor data),
    ``largest`` (bytes of the largest tensor), ``tensors`` and ``shards``."""
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = 2 * _numel(shape)
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    weight_map: dict[str, str] = {}
    total = largest = 0
    for i, group in enumerate(groups, start=1):
        file = (
            "model.safetensors"
            if len(groups) == 1
            else f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        )
        tensors = {}
        for name, shape in group:
            t = torch.randn(shape, generator=gen).mul_(0.02).to(torch.bfloat16)
            tensors[name] = t
            weight_map[name] = file
            total += 2 * t.numel()
            largest = max(largest, 2 * t.numel())
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        del tensors
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
    cfg.update(config or {})
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"bytes": total, "largest": largest, "tensors": len(shapes), "shards": len(groups)}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_CHILD = r"""
import json, os, sys, tempfile, time

args = json.loads(sys.argv[1])


def status():
    out = {}
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


import torch
from nemo_fp8_plugin.rl import export_fp8_checkpoint

# Warm-up on a tiny state dict: the modules an export imports lazily (recipes, rules, the
# quantizers) belong to the interpreter's baseline, not to the export's own memory.
with tempfile.TemporaryDirectory(dir=args["scratch"]) as tmp:
    export_fp8_checkpoint(
        {"model.layers.0.mlp.down_proj.weight": torch.ones(128, 128, dtype=torch.bfloat16)},
        os.path.join(tmp, "warm"),
        args["spec"],
        config={"model_type": "llama", "num_hidden_layers": 1},
        progress=False,
    )
reset = True
try:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")
except OSError:
    reset = False
base = status()
t0 = time.perf_counter()
result = export_fp8_checkpoint(args["source"], args["out"], args["spec"], progress=False)
seconds = time.perf_counter() - t0
end = status()
print(json.dumps({
    "baseline_bytes": base["VmRSS"],
    "peak_bytes": end["VmHWM"],
    "delta_bytes": end["VmHWM"] - base["VmRSS"],
    "hwm_reset": reset,
    "seconds": seconds,
    "shards": result.shards,
    "quantized": result.quantized,
    "bytes": result.bytes,
}))
"""


def measure_export_memory(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    spec: str = "fp8_blockwise",
    *,
    timeout: float = 900,
) -> dict[str, Any]:
    """Export ``source`` to ``out_dir`` in a fresh Python and return its peak resident memory
    above the baseline taken after imports and a tiny warm-up export: ``delta_bytes``
    (``peak_bytes`` = VmHWM at the end, reset to the current RSS at the baseline where the
    kernel allows, ``hwm_reset``; ``baseline_bytes`` = VmRSS then), with the export's
    ``seconds``, ``shards``, ``quantized`` and ``bytes``. Linux only (``/proc/self``)."""
    out_dir = Path(out_dir)
    payload = json.dumps(
        {"source": str(source), "out": str(out_dir), "spec": spec, "scratch": str(out_dir.parent)}
    )
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # this checkout first on the path
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONWARNINGS", "ignore")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, payload],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=str(out_dir.parent),  # not this directory: `-c` puts the cwd first on sys.path
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the export child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _copy_checkpoint(src: Path, dst: Path) -> None:
    """The baseline: every shard through safetensors (load_file, save_file), the small
    files as they are."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in sorted(src.iterdir()):
        if f.suffix == ".safetensors":
            save_file(load_file(str(f)), str(dst / f.name), metadata={"format": "pt"})
        else:
            shutil.copyfile(f, dst / f.name)


QUIET_LOAD = 1.5
"""Ratios count only for rounds that started and ended with the 1-minute load average below
this (the machine is shared; an oversubscribed CPU moves both arms unevenly)."""


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _synthetic(src: Path, model: dict[str, int], quick: bool) -> tuple[dict[str, int], float]:
    config = {
        "hidden_size": model["hidden"],
        "intermediate_size": model["intermediate"],
        "num_hidden_layers": model["layers"],
        "num_attention_heads": model["hidden"] // 128,
        "num_key_value_heads": model["kv_heads"],
        "head_dim": 128,
        "vocab_size": model["vocab"],
        "tie_word_embeddings": True,
    }
    t0 = time.perf_counter()
    info = write_synthetic_checkpoint(
        src, _llama_shapes(**model), shard_bytes=(8 if quick else 500) * 2**20, config=config
    )
    return info, time.perf_counter() - t0


def _clean(root: Path) -> None:
    for d in root.iterdir():
        if d.name != "src":
            shutil.rmtree(d)
    # start each run with no dirty pages queued for the disk by the one before, so neither
    # arm pays for the other's write-back
    os.sync()


def stage_profile(src: Path) -> dict[str, float]:
    """Seconds of the export's stages, one run each: ``read_s`` (every source tensor
    streamed and summed, which touches every byte), ``read_quantize_s`` (streamed through
    ``quantize_for_refit``, output dropped); the rest of an export is writing."""
    import torch

    from ..rl.export import quantizer_threads
    from ..rl.refit import quantize_for_refit
    from ..rl.safetensors_io import plan, stream_entries

    entries = plan(sorted(src.glob("*.safetensors")))
    t0 = time.perf_counter()
    for _, tensor in stream_entries(entries, lambda n: None):
        torch.sum(tensor.view(torch.uint8).reshape(-1)[:: 4096 // tensor.element_size()])
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with quantizer_threads():
        for _ in quantize_for_refit(stream_entries(entries, lambda n: None), "fp8_blockwise"):
            pass
    return {"read_s": read_s, "read_quantize_s": time.perf_counter() - t0}


def _rounds(src: Path, root: Path, rounds: int) -> tuple[dict[str, list[float]], dict]:
    from ..rl import export_fp8_checkpoint

    counter = iter(range(10**9))
    last: dict[str, Any] = {}

    def export() -> None:
        last["result"] = export_fp8_checkpoint(
            src, root / f"export-{next(counter)}", "fp8_blockwise", progress=False
        )

    def copy() -> None:
        _copy_checkpoint(src, root / f"copy-{next(counter)}")

    samples: dict[str, list[float]] = {"export": [], "copy": [], "load": []}
    last["first_s"] = timed(export)[0]
    last["output_bytes"] = sum(f.stat().st_size for f in last["result"].path.glob("*.safetensors"))
    last["shards"] = last["result"].shards
    _clean(root)
    for _ in range(rounds):
        load = [_load()]
        for name, fn in (("export", export), ("copy", copy)):
            samples[name] += timed(fn)
            _clean(root)
        load.append(_load())
        samples["load"].append(max((x for x in load if x is not None), default=float("nan")))
    return samples, last


def bench_export(quick: bool = False, workdir: str | None = None) -> dict:
    """Time ``export_fp8_checkpoint`` against a same-run safetensors copy of a synthetic
    Llama-shaped checkpoint (about 2 GB; 50 MB with ``quick``) written under ``workdir``
    (default: the system temp directory) and removed afterwards.

    Returns the figures: ``ratio`` (export throughput / copy throughput, best runs) and
    ``ratio_paired_median`` (per round), ``ratio_quiet_median`` (the per-round ratios of the
    rounds at load below :data:`QUIET_LOAD`, None without one), ``load_samples`` (the
    highest 1-minute load average seen at each round's start and end), ``export_s`` /
    ``copy_s`` (best run) and their medians, ``stages`` (:func:`stage_profile`),
    ``first_export_s``, ``checkpoint_bytes``, ``output_bytes``, ``export_gbps`` /
    ``copy_gbps`` (checkpoint bytes per second), ``peak_rss_bytes`` (above baseline, fresh
    process) with ``largest_tensor_bytes`` and ``rss_bound_bytes``, counts, ``rounds``,
    ``quick`` and ``environment``.
    """
    if not isinstance(quick, bool):
        raise TypeError(f"quick must be True or False, not {type(quick).__name__}")
    if workdir is not None and not isinstance(workdir, (str, os.PathLike)):
        raise TypeError(f"workdir must be a path or None, not {type(workdir).__name__}")
    rounds = 1 if quick else 5
    root = Path(tempfile.mkdtemp(prefix="nemo-fp8-bench-export-", dir=workdir))
    try:
        src = root / "src"
        info, write_s = _synthetic(src, QUICK if quick else FULL, quick)
        samples, last = _rounds(src, root, rounds)
        stages = stage_profile(src)
        memory = measure_export_memory(src, root / "memory")
        _clean(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _figures(info, write_s, samples, last, stages, memory, quick, rounds)


def _figures(info, write_s, samples, last, stages, memory, quick, rounds) -> dict:
    export_t, copy_t = timing_summary(samples["export"]), timing_summary(samples["copy"])
    gb = info["bytes"] / 1e9
    per_round = [c / e for e, c in zip(samples["export"], samples["copy"]) if e > 0]
    quiet = [r for r, load in zip(per_round, samples["load"]) if load < QUIET_LOAD]
    return {
        "quick": quick,
        "rounds": rounds,
        "checkpoint_bytes": info["bytes"],
        "tensors": info["tensors"],
        "source_shards": info["shards"],
        "output_shards": last["shards"],
        "output_bytes": last["output_bytes"],
        "write_synthetic_s": write_s,
        "first_export_s": last["first_s"],
        "export_s": export_t["best_s"],
        "export_median_s": export_t["median_s"],
        "copy_s": copy_t["best_s"],
        "copy_median_s": copy_t["median_s"],
        "export_gbps": gb / export_t["best_s"],
        "copy_gbps": gb / copy_t["best_s"],
        "ratio": ratio(copy_t["best_s"], export_t["best_s"]),
        "ratio_median": ratio(copy_t["median_s"], export_t["median_s"]),
        # each round's export against the copy run right after it: load that changes
        # between rounds cancels out
        "ratio_paired_median": median(per_round),
        "ratio_quiet_median": median(quiet),
        "quiet_rounds": len(quiet),
        "load_samples": samples["load"],
        "export_samples_s": samples["export"],
        "copy_samples_s": samples["copy"],
        "stages": stages,
        "peak_rss_bytes": memory["delta_bytes"],
        "peak_rss_hwm_reset": memory["hwm_reset"],
        "largest_tensor_bytes": info["largest"],
        "rss_bound_bytes": 2 * info["largest"] + RSS_SLACK_BYTES,
        "environment": environment(),
    }


def render_export(result: dict) -> str:
    """The figures of :func:`bench_export` as a small markdown table."""
    mb = 1e6

    def r(value) -> str:
        return "n/a" if value is None else f"{value:.2f}x"

    rows = [
        (
            "checkpoint",
            f"{result['checkpoint_bytes'] / 1e9:.2f} GB, {result['tensors']} tensors, "
            f"{result['source_shards']} shards",
        ),
        (
            "export (best / median)",
            f"{result['export_s']:.2f} s / {result['export_median_s']:.2f} s, "
            f"{result['export_gbps']:.2f} GB/s",
        ),
        (
            "copy (best / median)",
            f"{result['copy_s']:.2f} s / {result['copy_median_s']:.2f} s, "
            f"{result['copy_gbps']:.2f} GB/s",
        ),
        (
            "ratio export / copy (best, median, per-round median)",
            f"{r(result['ratio'])}, {r(result['ratio_median'])}, "
            f"{r(result.get('ratio_paired_median'))}",
        ),
        (
            f"per-round median at load < {QUIET_LOAD}",
            f"{r(result.get('ratio_quiet_median'))} ({result.get('quiet_rounds', 0)} of "
            f"{result['rounds']} rounds)",
        ),
        (
            "load average per round",
            ", ".join(f"{x:.1f}" for x in result.get("load_samples", [])),
        ),
        (
            "stages: read / read+quantize / whole export (median)",
            f"{result['stages']['read_s']:.2f} s / {result['stages']['read_quantize_s']:.2f} s"
            f" / {result['export_median_s']:.2f} s",
        ),
        ("first export (kernel builds included)", f"{result['first_export_s']:.2f} s"),
        ("output", f"{result['output_bytes'] / 1e9:.2f} GB in {result['output_shards']} shards"),
        (
            "peak RSS above baseline",
            f"{result['peak_rss_bytes'] / mb:.0f} MB (bound "
            f"{result['rss_bound_bytes'] / mb:.0f} MB = 2 x {result['largest_tensor_bytes'] / mb:.0f}"
            f" MB + 300 MiB)",
        ),
    ]
    lines = ["| export benchmark | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"

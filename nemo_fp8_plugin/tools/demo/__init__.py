"""``nemo-fp8 demo``: train a real megatron-core GPT on CPU in BF16 and under each FP8 recipe.

Every arm starts from the same weights and sees the same batches; only the precision of
the linear layers' GEMM operands differs, as on a GPU: the BF16 arm rounds them to BF16
and the FP8 arms quantize them with the recipe's tiles, formats and scales through the
bit-exact reference in :mod:`nemo_fp8_plugin.numerics`. Products accumulate in fp32 in
both, so the loss gap is the recipe's numerical effect.

Why the BF16 arm is emulated too: this CPU multiplies BF16 matrices about 7x slower than
fp32 ones (no AVX512-BF16), which would make the step-time ratio meaningless; rounding
operands to BF16 and multiplying in fp32 is numerically what a GPU BF16 GEMM with fp32
accumulation does, and costs the same on both sides of the ratio.

Over 600 lines on purpose: the demo command end to end (settings, arms, table, plot), one
script a user reads top to bottom.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..harness import ArmRecord, Stopwatch, environment, pyplot, ratio, write_json, write_png

__all__ = [
    "TrainSettings",
    "ArmResult",
    "load_demo_config",
    "run_demo",
    "default_config",
    "pick_threads",
    "load_average",
    "QUIET_LOAD",
]


QUIET_LOAD = 1.5
"""Load average (one minute) below which a run's step-time ratios count."""


def load_average() -> float | None:
    """The one-minute load average, None where the OS has none."""
    import os

    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def pick_threads() -> tuple[int, str]:
    """torch's intra-op threads for the whole run (every arm the same, so ratios stay
    fair) and why: ``OMP_NUM_THREADS`` / ``NEMO_FP8_CPU_THREADS`` when set, else one per
    core this process may use that the load average leaves idle. On an oversubscribed
    machine torch's threads wait for each other at every op (measured: a 1024x512 clone
    0.7 ms on one thread, 69 ms on two at load 10)."""
    import os

    from ...numerics import _cpu

    for name in ("NEMO_FP8_CPU_THREADS", "OMP_NUM_THREADS"):
        raw = os.environ.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw), f"${name}"
    cores = _cpu.available_cores()
    load = load_average() or 0.0
    return _cpu.idle_threads(cores, load), f"{cores} cores at load {load:.2f}"


def default_config() -> Path:
    """The embedded default: ``conf/examples/demo_gpt_fp8_blockwise.yaml``."""
    from ..._resources import conf_dir

    return conf_dir("examples") / "demo_gpt_fp8_blockwise.yaml"


@dataclass(frozen=True)
class TrainSettings:
    """Training loop settings (the ``train:`` block of the demo config)."""

    steps: int = 200
    """Optimizer steps per arm."""
    micro_batch_size: int = 8
    """Sequences per step."""
    lr: float = 2e-3
    """Peak AdamW learning rate (linear warmup, cosine decay to 10%)."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    seed: int = 1234
    """Seed of the initial weights and of the batch order (same for every arm)."""
    eval_batches: int = 4
    """Held-out batches the final loss is measured on."""
    corpus_bytes: int = 2_000_000
    """Bytes of the standard library's source used as the corpus."""


@dataclass
class ArmResult(ArmRecord[float]):
    """One training run: ``name`` is ``bf16`` or a recipe name, ``steps`` the training loss
    of each step, ``completed`` false when Ctrl-C stopped it (see :class:`ArmRecord`)."""

    eval_loss: float | None = None
    """Loss on the held-out batches after training (None if interrupted before the end)."""
    bf16_modules: int = 0
    """Linear modules kept in BF16 by the recipe's rules."""
    linear_modules: int = 0
    """Linear modules in the model."""
    step_cpu_seconds: list[float] = field(default_factory=list)
    """CPU seconds this process spent in each step (``time.process_time``, all threads):
    on a shared machine wall time also counts the time slices other processes took, CPU
    time does not."""
    load_average: float | None = None
    """One-minute load average when the arm finished (the machine may be shared: step
    ratios count only below :data:`QUIET_LOAD`)."""

    @property
    def losses(self) -> list[float]:
        """Training loss per step."""
        return self.steps

    @property
    def step_time_s(self) -> float | None:
        """Median seconds per training step, the first steps (one-off allocation) left out."""
        return self.steady_step_s()

    @property
    def step_cpu_s(self) -> float | None:
        """Median CPU seconds per step, the same steps left out as :attr:`step_time_s`."""
        times = self.step_cpu_seconds
        if not times:
            return None
        kept = sorted(times[min(5, len(times) // 2) :])
        mid = len(kept) // 2
        return kept[mid] if len(kept) % 2 else (kept[mid - 1] + kept[mid]) / 2


def load_demo_config(path: str | Path):
    """The demo's YAML: ``precision``/``fp8`` (the recipe of interest), ``model``, ``train``."""
    from ...config import resolve_config
    from ...errors import FP8ConfigError, format_value
    from .model import GPTSettings

    config, request = resolve_config(path)
    top = ("precision", "fp8", "model", "train")
    for key in config:
        if key not in top:  # `trian:` or a host's `trainer:` would otherwise be ignored
            from ...errors import suggest

            near = suggest(key, top)
            raise FP8ConfigError(
                "unknown key: the demo reads only " + ", ".join(top),
                key=str(key),
                hint=f"did you mean {near!r}?" if near else None,
            )
    blocks = {}
    for key, cls in (("model", GPTSettings), ("train", TrainSettings)):
        raw = config.get(key) or {}
        if not isinstance(raw, dict):
            raise FP8ConfigError(f"expected a mapping, got {format_value(raw)}", key=key)
        allowed = set(cls.__dataclass_fields__)
        for k, v in raw.items():
            if k not in allowed:
                raise FP8ConfigError(
                    "unknown key",
                    key=f"{key}.{k}",
                    hint=f"valid keys: {', '.join(sorted(allowed))}",
                )
            want = type(getattr(cls(), k))
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or (want is int and not isinstance(v, int))
            ):
                raise FP8ConfigError(
                    f"expected a {want.__name__}, got {format_value(v)}", key=f"{key}.{k}", value=v
                )
            if v <= 0 and k != "weight_decay":
                raise FP8ConfigError(
                    f"must be positive, got {format_value(v)}", key=f"{key}.{k}", value=v
                )
        blocks[key] = cls(**raw)
    _check_ranges(blocks["model"], blocks["train"])
    return blocks["model"], blocks["train"], request


_DEMO_RANGES = {
    # key: (low, high); far beyond what a CPU demo runs, short of what crashes or never ends
    "model.num_layers": (1, 64),
    "model.hidden_size": (1, 8192),
    "model.ffn_hidden_size": (1, 32768),
    "model.num_attention_heads": (1, 128),
    "model.seq_length": (2, 8192),
    "model.vocab_size": (256, 65536),  # 256: byte tokens
    "train.steps": (1, 100_000),
    "train.micro_batch_size": (1, 4096),
    "train.lr": (0, 10.0),
    "train.warmup_steps": (1, 100_000),
    "train.weight_decay": (0.0, 10.0),
    "train.grad_clip": (0, 1e6),
    "train.seed": (0, 2**32 - 2),  # seed + 1 seeds the batches
    "train.eval_batches": (1, 10_000),
    "train.corpus_bytes": (1, 10**9),
}
"""Inclusive ranges of the demo config's values (``lr`` and ``grad_clip`` must also be > 0)."""


def _check_ranges(gpt, train) -> None:
    """Every value of the demo config in range, with the key named: out-of-range seeds,
    sizes and rates otherwise surface as tracebacks from torch or megatron-core, or as a
    model no machine holds."""
    from ...errors import FP8ConfigError

    for key, (low, high) in _DEMO_RANGES.items():
        section, name = key.split(".")
        value = getattr(gpt if section == "model" else train, name)
        if not low <= value <= high:
            raise FP8ConfigError(f"must be in [{low}, {high}], got {value}", key=key, value=value)
    if gpt.hidden_size % gpt.num_attention_heads:
        raise FP8ConfigError(
            f"must be a multiple of model.num_attention_heads "
            f"({gpt.num_attention_heads}), got {gpt.hidden_size}",
            key="model.hidden_size",
            value=gpt.hidden_size,
        )
    params = (
        gpt.num_layers * (4 * gpt.hidden_size**2 + 2 * gpt.hidden_size * gpt.ffn_hidden_size)
        + gpt.vocab_size * gpt.hidden_size
    )
    if params > 2 * 10**9:
        raise FP8ConfigError(
            f"the model would have about {params / 1e9:.1f}B parameters, more "
            f"than the 2B a CPU demo holds",
            key="model.num_layers",
            value=gpt.num_layers,
            hint="shrink num_layers or hidden_size",
        )
    if train.micro_batch_size * gpt.seq_length > 2**22:
        raise FP8ConfigError(
            f"{train.micro_batch_size} x {gpt.seq_length} tokens per step is more than {2**22}",
            key="train.micro_batch_size",
            value=train.micro_batch_size,
        )
    _check_memory(gpt, train)


def _activation_bytes(gpt, train) -> dict[str, int]:
    """A step's largest fp32 buffers, by the key that drives each (an estimate from the
    shapes, kept on the high side: forward values saved for backward, and their grads)."""
    tokens = train.micro_batch_size * gpt.seq_length
    return {
        # attention scores and probabilities, per layer, all saved for backward
        "model.seq_length": 2
        * gpt.num_layers
        * train.micro_batch_size
        * gpt.num_attention_heads
        * gpt.seq_length**2
        * 4,
        # logits, their softmax and gradient
        "model.vocab_size": 3 * tokens * gpt.vocab_size * 4,
        # the saved hidden states and MLP activations of every layer
        "model.num_layers": gpt.num_layers
        * tokens
        * (12 * gpt.hidden_size + 2 * gpt.ffn_hidden_size)
        * 4,
    }


def _memory_limit() -> int:
    """The machine's physical memory (64 GiB where it cannot be read)."""
    import os

    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return 64 * 2**30


def _check_memory(gpt, train) -> None:
    """Each value may be in range while their product is not: refuse, before the model is
    built, a step whose buffers alone outgrow the machine's memory (it would fail after
    minutes of work, or be killed)."""
    from ...errors import FP8ConfigError

    need = _activation_bytes(gpt, train)
    total, limit = sum(need.values()), _memory_limit()
    if total > limit:
        key = max(need, key=need.__getitem__)
        raise FP8ConfigError(
            f"one training step needs about {total / 2**30:,.0f} GiB of activations "
            f"({key} drives most of it), more than this machine's {limit / 2**30:,.0f} GiB",
            key=key,
            value=getattr(gpt, key.split(".")[1]),
            hint="shrink train.micro_batch_size, model.seq_length or the model",
        )


def _lr_at(step: int, train: TrainSettings) -> float:
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
    return train.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _loss(model, batch):
    import torch

    tokens, labels = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    return model(tokens, positions, attention_mask=None, labels=labels).float().mean()


def _convert(model, arm: str, spec, num_layers: int):
    """Put ``model``'s linear layers in the arm's precision; returns (bf16 modules, linears)."""
    from ...numerics import convert_to_bf16_emulation, convert_to_fp8_emulation, emulated_modules
    from ...rules import module_filter

    linear_names = [
        n
        for n, m in model.named_modules()
        if type(m).__name__ in ("ColumnParallelLinear", "RowParallelLinear")
    ]
    if spec is None:
        convert_to_bf16_emulation(model)
        return len(linear_names), len(linear_names)
    keep_fp8 = module_filter(spec, num_layers=num_layers, side="training")
    convert_to_fp8_emulation(model, spec, module_filter=keep_fp8)
    fp8 = sum(1 for _ in emulated_modules(model))
    # Layers the rules keep out of FP8 run like the BF16 arm, as they would on a GPU
    # (the converter leaves FP8-emulated layers alone).
    convert_to_bf16_emulation(model)
    return len(linear_names) - fp8, len(linear_names)


class StopRequest:
    """Ctrl-C as a request: the first SIGINT asks the training loop to stop after the step
    in flight (so no file is ever being written when it lands); a second one interrupts
    at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopRequest:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def run_arm(
    result: ArmResult,
    spec,
    gpt,
    train: TrainSettings,
    data,
    *,
    progress: bool = True,
    stop: StopRequest | None = None,
) -> ArmResult:
    """Train one arm from the shared seed into ``result``; returns early (``completed``
    false) when ``stop`` is requested."""
    import torch

    from .model import build_gpt

    model = build_gpt(gpt, train.seed)
    arm = result.name
    result.bf16_modules, result.linear_modules = _convert(model, arm, spec, gpt.num_layers)
    params_decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    params_other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": params_decay, "weight_decay": train.weight_decay},
            {"params": params_other, "weight_decay": 0.0},
        ],
        lr=train.lr,
        betas=(0.9, 0.95),
    )
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=train.steps,
            desc=f"{arm:>14}",
            unit="step",
            leave=True,
            dynamic_ncols=True,
            disable=None,  # no bar when stderr is no terminal: no \r updates in a log
        )
    try:
        model.train()
        for step, batch in enumerate(data.train_batches(train.steps)):
            if stop is not None and stop.requested:
                return result
            for group in opt.param_groups:
                group["lr"] = _lr_at(step, train)
            cpu_start = time.process_time()
            with Stopwatch() as sw:
                loss = _loss(model, batch)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
            result.step_seconds.append(sw.seconds)
            result.step_cpu_seconds.append(time.process_time() - cpu_start)
            value = float(loss.detach())
            result.steps.append(value)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{value:.3f}")
        result.load_average = load_average()
        model.eval()
        with torch.no_grad():
            evals = [float(_loss(model, b)) for b in data.eval]
        result.eval_loss = sum(evals) / len(evals)
        result.completed = True
    finally:
        if bar is not None:
            bar.close()
    return result


def _arms(request, recipes: list[str] | None):
    """(arm name, spec or None for BF16) in run order; the config's own recipe (with its
    overrides) replaces the preset of the same name."""
    from ...errors import FP8ConfigError
    from ...registry import default_registry

    reg = default_registry()
    names = list(recipes) if recipes else reg.names()
    arms = [("bf16", None)]
    for name in names:
        if name == "bf16":
            continue
        if name not in reg:
            raise reg.unknown(name, key="--recipes")
        spec = (
            request.spec if (request is not None and request.spec.name == name) else reg.get(name)
        )
        arms.append((name, spec))
    if len(arms) == 1:
        raise FP8ConfigError("no FP8 recipe to compare", key="--recipes", value=recipes)
    return arms


def summarize(results: list[ArmResult]) -> list[dict[str, Any]]:
    """Table rows: loss gap and step-time ratio are relative to the BF16 arm."""
    base = next((r for r in results if r.name == "bf16"), None)
    rows = []
    for r in results:
        gap = None
        if base is not None and base.eval_loss and r.eval_loss is not None:
            gap = (r.eval_loss - base.eval_loss) / base.eval_loss
        step_ratio = ratio(r.step_time_s, base.step_time_s if base is not None else None)
        cpu_ratio = ratio(r.step_cpu_s, base.step_cpu_s if base is not None else None)
        rows.append(
            {
                "recipe": r.name,
                "final_loss": r.eval_loss,
                "loss_gap_vs_bf16": gap,
                "step_time_s": r.step_time_s,
                "step_time_vs_bf16": step_ratio,
                "step_cpu_s": r.step_cpu_s,
                "step_cpu_vs_bf16": cpu_ratio,
                "bf16_modules": r.bf16_modules,
                "linear_modules": r.linear_modules,
                "steps_done": len(r.losses),
                "completed": r.completed,
                "load_average": r.load_average,
            }
        )
    return rows


def load_note(rows: list[dict[str, Any]]) -> str:
    """The line under the table: the highest load average an arm finished at, and whether
    the step-time ratios count (only below :data:`QUIET_LOAD`)."""
    loads = [r["load_average"] for r in rows if r.get("load_average") is not None]
    if not loads:
        return "load average: unknown; step-time ratios count only on a quiet machine"
    worst = max(loads)
    verdict = (
        "the step-time ratios count"
        if worst < QUIET_LOAD
        else f"the step-time ratios do not count (they need load < {QUIET_LOAD})"
    )
    return f"load average up to {worst:.2f} during the run: {verdict}"


TABLE_COLUMNS = (
    ("recipe", "<"),
    ("final loss", ">"),
    ("gap vs BF16", ">"),
    ("step time vs BF16", ">"),
    ("CPU time vs BF16", ">"),
    ("BF16 linears", ">"),
)
"""The table's columns, (header, alignment): each column is as wide as its widest cell."""

COLUMN_GAP = "  "
"""Between two columns: two spaces, so a header of several words never reads as running
into the next one."""


def _table_cells(row: dict[str, Any]) -> list[str]:
    """One row's cells, in :data:`TABLE_COLUMNS` order."""

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    def times(value):
        return "-" if value is None else f"{value:.2f}x"

    return [
        row["recipe"],
        fmt(row["final_loss"], ".4f"),
        fmt(row["loss_gap_vs_bf16"], "+.2%"),
        times(row["step_time_vs_bf16"]),
        times(row.get("step_cpu_vs_bf16")),
        f"{row['bf16_modules']}/{row['linear_modules']}",
    ]


def render_table(rows: list[dict[str, Any]]) -> str:
    """The summary table (header, one line per arm) and the load note under it."""
    cells = [_table_cells(row) for row in rows]
    widths = [
        max(len(header), *(len(c[i]) for c in cells)) if cells else len(header)
        for i, (header, _) in enumerate(TABLE_COLUMNS)
    ]

    def line(values: list[str]) -> str:
        return COLUMN_GAP.join(
            f"{v:{align}{w}}" for v, w, (_, align) in zip(values, widths, TABLE_COLUMNS)
        ).rstrip()

    lines = [line([header for header, _ in TABLE_COLUMNS])]
    for row, values in zip(rows, cells):
        done = "" if row["completed"] else f"  (stopped after {row['steps_done']} steps)"
        lines.append(line(values) + done)
    lines.append(load_note(rows))
    return "\n".join(lines)


SMOOTHING_STEPS = 10
"""Steps of the trailing mean the plot draws (a single step's loss is one batch's)."""


def trailing_mean(values: list[float], window: int = SMOOTHING_STEPS) -> list[float]:
    """The mean of the last ``window`` values (fewer at the start) at every position."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def gap_curves(results: list[ArmResult], window: int = SMOOTHING_STEPS) -> dict[str, list[float]]:
    """Per FP8 arm, its training loss minus the BF16 arm's at the same step (same weights and
    batches, so the difference is the recipe's), as a trailing mean over ``window`` steps;
    as long as both arms ran. Empty without a BF16 arm."""
    base = next((r.losses for r in results if r.name == "bf16"), None)
    if not base:
        return {}
    gaps = {}
    for r in results:
        if r.name == "bf16" or not r.losses:
            continue
        gaps[r.name] = trailing_mean([a - b for a, b in zip(r.losses, base)], window)
    return gaps


def plot_curves(results: list[ArmResult]):
    """Two panels: every arm's training loss (the overlapping curves) and, beside it, each FP8
    arm's gap to the BF16 arm (:func:`gap_curves`), where the recipes tell apart."""
    plt = pyplot()
    fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(13, 5), dpi=110)
    colors = plt.get_cmap("tab10")
    gaps = gap_curves(results)
    for i, r in enumerate(r for r in results if r.losses):
        bf16 = r.name == "bf16"
        color = "black" if bf16 else colors(i)
        smooth = trailing_mean(r.losses)
        x = range(1, len(smooth) + 1)
        ax_loss.plot(x, smooth, label=r.name, linewidth=2.2 if bf16 else 1.2, color=color)
        if r.name in gaps:
            ax_gap.plot(range(1, len(gaps[r.name]) + 1), gaps[r.name], label=r.name, color=color)
    ax_loss.set_ylabel(f"training loss ({SMOOTHING_STEPS}-step mean)")
    ax_loss.set_title("training loss per arm", fontsize=10)
    ax_gap.axhline(0.0, color="black", linewidth=0.8)
    ax_gap.set_ylabel(f"loss minus BF16 loss ({SMOOTHING_STEPS}-step mean)")
    ax_gap.set_title("gap to BF16 (same weights and batches)", fontsize=10)
    for ax in (ax_loss, ax_gap):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax_loss.legend()
    fig.suptitle("megatron-core GPT on CPU: BF16 vs FP8 recipes (emulated)")
    return fig


def write_outputs(out_dir: Path, report: dict[str, Any], results: list[ArmResult]) -> list[Path]:
    """``results.json`` and ``loss_curves.png`` in ``out_dir``, each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [write_json(out_dir / "results.json", report)]
    fig = plot_curves(results)
    written.append(write_png(out_dir / "loss_curves.png", fig, bbox_inches="tight"))
    return written


def run_demo(
    config: str | Path | None = None,
    *,
    recipes: list[str] | None = None,
    steps: int | None = None,
    out_dir: str | Path = "nemo-fp8-demo",
    progress: bool = True,
    log=print,
) -> dict[str, Any]:
    """Train the BF16 arm and one arm per recipe; write the JSON and PNG; return the report.

    Ctrl-C stops the arm in flight after its current step; what ran so far is written and
    returned with ``interrupted: true``.
    """
    import dataclasses

    from .data import ByteBatches, stdlib_corpus

    config = Path(config) if config else default_config()
    gpt, train, request = load_demo_config(config)
    if steps is not None:
        if steps < 1:
            from ...errors import FP8ConfigError

            raise FP8ConfigError(f"must be positive, got {steps}", key="--steps", value=steps)
        train = dataclasses.replace(
            train, steps=steps, warmup_steps=min(train.warmup_steps, max(1, steps // 10))
        )
    arms = _arms(request, recipes)
    out_dir = Path(out_dir)
    data = ByteBatches(
        stdlib_corpus(train.corpus_bytes),
        gpt.seq_length,
        train.micro_batch_size,
        train.seed,
        eval_batches=train.eval_batches,
    )
    log(f"nemo-fp8 demo: {config}")
    log(
        f"  model: megatron-core GPTModel, {gpt.num_layers} layers, hidden {gpt.hidden_size}, "
        f"{train.steps} steps x {train.micro_batch_size}x{gpt.seq_length} bytes of Python stdlib source"
    )
    log(f"  arms: {', '.join(a for a, _ in arms)}; output: {out_dir.resolve()}")
    import torch

    threads, why = pick_threads()
    torch.set_num_threads(threads)
    log(f"  threads: {threads} ({why})")
    results: list[ArmResult] = []
    interrupted = False
    report: dict[str, Any] = {}
    env = environment()

    def snapshot():
        report.clear()
        report.update(
            config=str(config),
            model=asdict(gpt),
            train=asdict(train),
            recipe_requested=request.spec.name if request else None,
            environment=env,
            threads=threads,
            threads_reason=why,
            quiet_load=QUIET_LOAD,
            interrupted=interrupted,
            rows=summarize(results),
            curves={r.name: r.losses for r in results},
        )
        return write_outputs(out_dir, report, results)

    pyplot()  # import before training: a Ctrl-C or a missing package must not strike mid-write

    with StopRequest() as stop:
        try:
            for name, spec in arms:
                result = ArmResult(name=name)
                results.append(result)
                run_arm(result, spec, gpt, train, data, progress=progress, stop=stop)
                if stop.requested:
                    break
                snapshot()  # a crash later still leaves every finished arm on disk
        except KeyboardInterrupt:  # a second Ctrl-C
            pass
        interrupted = stop.requested
    written = snapshot()
    log("")
    log(render_table(report["rows"]))
    log("")
    for path in written:
        log(f"wrote {path}")
    if interrupted:
        log("interrupted: the table and files hold the arms that ran")
    return report

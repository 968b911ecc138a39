"""``--activations``: every linear layer's inputs and GEMM output, through forward pre-hooks.

A ``transformers`` model built from the checkpoint's own ``config.json`` runs a few samples
on CPU; a forward pre-hook on each ``nn.Linear`` (routers and the output head excepted)
quantizes the layer's input with the recipe's activation role and its weight with the
weight role, and records both the input's error and the error of the GEMM with both
operands quantized. The activation modules' names are joined to the checkpoint's by
:func:`join_activation_names` (models may drop or add a prefix).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import FP8ConfigError
from ..rules.names import builtin_high_precision
from .metrics import ErrorStats, quantize_dequantize, quantizer_key
from .scan import progress_bar

if TYPE_CHECKING:
    import torch

    from ..spec import RecipeSpec

__all__ = ["SAMPLE_TEXTS", "load_samples", "activation_stats", "join_activation_names"]

SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "In 1969, Apollo 11 landed on the Moon and Neil Armstrong stepped onto its surface.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
    "Die Katze sitzt auf der Matte, und der Hund schlaeft im Garten.",
    "Compute 17 * 23 = 391, then subtract 91 to get 300; divide by 3 for 100.",
    "Transformers use self-attention to weigh the relevance of every token to every other token.",
    "SELECT name, COUNT(*) FROM users WHERE active = 1 GROUP BY name ORDER BY 2 DESC;",
)
"""Built-in samples for ``--activations`` when no ``--samples`` file is given: prose, code,
numbers, another language, so that the inputs of every layer see varied statistics."""


def load_samples(samples: str | Path | None) -> tuple[list[str] | None, list[list[int]] | None]:
    if samples is None:
        return list(SAMPLE_TEXTS), None
    from .._io import read_user_bytes, read_user_json

    path = Path(samples).expanduser()
    if path.suffix == ".json":
        # a regular file within LIMITS.config_bytes, nesting and digits bounded
        data = read_user_json(path, key="--samples", what="samples file")
        if isinstance(data, dict):
            data = data.get("input_ids")
        if (
            isinstance(data, list)
            and data
            and all(isinstance(s, list) and s for s in data)
            and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for s in data for t in s
            )
        ):
            return None, data
        raise FP8ConfigError(
            f'{path}: expected a JSON list of token-id lists (or {{"input_ids": [...]}})',
            key="--samples",
            value=str(path),
        )
    try:
        text = read_user_bytes(path, key="--samples", what="samples file").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FP8ConfigError(
            f"cannot read {path} ({exc})", key="--samples", value=str(path)
        ) from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise FP8ConfigError(
            f"{path} holds no text (one sample per line)", key="--samples", value=str(path)
        )
    return lines, None


def _quiet_import(name: str) -> ModuleType:
    """Import a third-party package with its import-time noise (deprecation warnings, a
    torchao shared-library notice printed through logging) logged at debug level instead of
    reaching the user's terminal."""
    import importlib
    import io
    import logging
    import warnings
    from contextlib import redirect_stderr

    log = logging.getLogger(__name__)
    buffer = io.StringIO()
    quiet = [logging.getLogger(n) for n in ("torchao", "transformers", "torch")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(record=True) as caught, redirect_stderr(buffer):
            warnings.simplefilter("always")
            module = importlib.import_module(name)
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    for w in caught:
        log.debug("while importing %s: %s", name, w.message)
    if buffer.getvalue().strip():
        log.debug("while importing %s: %s", name, buffer.getvalue().strip())
    return module


def activation_stats(
    checkpoint: Path,
    specs: Sequence[RecipeSpec],
    samples: str | Path | None,
    max_tokens: int,
    progress: bool | None,
) -> tuple[dict[str, dict[str, ErrorStats]], dict[str, dict[str, ErrorStats]], dict[str, Any]]:
    """Per linear module (HF name) and recipe, the quantization error of its inputs and of
    its GEMM's output (input and weight both quantized), and run information."""
    import torch

    try:
        transformers = _quiet_import("transformers")
    except ImportError:
        raise FP8ConfigError(
            "--activations needs the transformers package",
            key="--activations",
            hint="pip install transformers",
        ) from None
    model_dir = checkpoint if checkpoint.is_dir() else checkpoint.parent
    if not (model_dir / "config.json").is_file():
        raise FP8ConfigError(
            f"--activations builds the model from {model_dir / 'config.json'}, "
            f"which does not exist",
            key="--activations",
            value=str(model_dir),
        )
    from .._io import regular_entries

    regular_entries(model_dir, key="--activations")  # transformers would block on a FIFO
    texts, token_ids = load_samples(samples)
    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        archs = getattr(config, "architectures", None) or []
        cls = (
            transformers.AutoModelForCausalLM
            if any(a.endswith("ForCausalLM") for a in archs)
            else transformers.AutoModel
        )
        # safetensors only: never a pickle (pytorch_model.bin) found beside or instead of it
        model = cls.from_pretrained(
            str(model_dir), local_files_only=True, use_safetensors=True
        ).float()
    except Exception as exc:  # transformers raises many types for an unusable config/weights
        raise FP8ConfigError(
            f"transformers cannot build the model in {model_dir} on this machine "
            f"({type(exc).__name__}: {exc})",
            key="--activations",
            value=str(model_dir),
        ) from None
    model.eval()
    if texts is not None:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                str(model_dir), local_files_only=True
            )
        except Exception as exc:
            raise FP8ConfigError(
                f"no usable tokenizer in {model_dir} ({exc}); pass token ids "
                f"with --samples FILE.json",
                key="--samples",
            ) from None
        batches = [
            tokenizer(t, return_tensors="pt", truncation=True, max_length=max_tokens)["input_ids"]
            for t in texts
        ]
    else:
        assert token_ids is not None  # load_samples gives texts or token ids
        vocab = getattr(config, "vocab_size", None)
        for ids in token_ids:
            if vocab and max(ids) >= vocab:
                raise FP8ConfigError(
                    f"token id {max(ids)} is outside the vocabulary ({vocab})",
                    key="--samples",
                    value=max(ids),
                )
        batches = [torch.tensor([ids[:max_tokens]]) for ids in token_ids]

    stats: dict[str, dict[str, ErrorStats]] = {}
    outputs: dict[str, dict[str, ErrorStats]] = {}
    problems: dict[str, str] = {}
    hooks = []
    groups: dict[tuple, list] = {}
    for spec in specs:
        groups.setdefault((quantizer_key(spec, "input"), quantizer_key(spec, "weight")), []).append(
            spec
        )
    weight_dq: dict[tuple[str, tuple], Any] = {}

    def make_hook(name: str) -> Callable[[torch.nn.Linear, tuple[Any, ...]], None]:
        def hook(module: torch.nn.Linear, args: tuple[Any, ...]) -> None:
            if not args or not isinstance(args[0], torch.Tensor) or name in problems:
                return
            x = args[0].detach()
            x2 = x.reshape(-1, x.shape[-1]).float()
            if x2.numel() == 0:
                return
            if not bool(torch.isfinite(x2).all()):
                problems[name] = "non-finite inputs"
                return
            w = module.weight.detach().float()
            row_sig = x2.square().sum(dim=-1)
            y = x2 @ w.t()
            y_sig = y.square().sum(dim=-1)
            per_in, per_out = stats.setdefault(name, {}), outputs.setdefault(name, {})
            for (_, w_key), group in groups.items():
                dq_x = quantize_dequantize(x2, group[0], "input")
                if (name, w_key) not in weight_dq:
                    weight_dq[(name, w_key)] = quantize_dequantize(w, group[0], "weight")
                # The FP8 GEMM: both operands quantized, accumulated in high precision.
                y_q = dq_x @ weight_dq[(name, w_key)].t()
                for spec in group:
                    per_in.setdefault(spec.name, ErrorStats()).add(x2, dq_x, row_sig)
                    per_out.setdefault(spec.name, ErrorStats()).add(y, y_q, y_sig)

        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not builtin_high_precision(name):
            hooks.append(module.register_forward_pre_hook(make_hook(name)))
    try:
        with torch.no_grad():
            for ids in progress_bar(batches, len(batches), "activations", progress):
                model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    tokens = sum(int(b.numel()) for b in batches)
    return stats, outputs, {"samples": len(batches), "tokens": tokens, "problems": problems}


def join_activation_names(weight_modules: list[str], act_names: Iterable[str]) -> dict[str, str]:
    """Activation module name -> checkpoint module name (models may drop or add a prefix
    such as ``model.`` or ``bert.``)."""
    weights = set(weight_modules)
    out = {}
    for a in act_names:
        if a in weights:
            out[a] = a
            continue
        hits = [w for w in weight_modules if w.endswith("." + a) or a.endswith("." + w)]
        if len(hits) == 1:
            out[a] = hits[0]
    return out

"""``nemo-fp8 analyze``: how much each linear layer of a checkpoint loses under each FP8 recipe,
and which layers to keep in BF16.

Weights are streamed one tensor at a time from ``.safetensors`` files (``safe_open``: the
model is never in memory as a whole), quantized with the reference quantizers of
:mod:`nemo_fp8_plugin.numerics` exactly as the recipe's weight role does it, and compared
with the original:

* ``sqnr_db`` = 10 log10(sum x^2 / sum (x - dq(q(x)))^2), the signal-to-quantization-noise
  ratio over the whole tensor;
* ``max_rel_err`` = the largest per-row ||x - dq(q(x))|| / ||x|| (rows are output channels
  for weights and tokens for activations): the worst single dot product's relative error,
  which an elementwise maximum (always ~1 from values that flush to zero) would not show;
  ``min_row_sqnr_db`` = -20 log10(max_rel_err) is the same in dB. A few huge outliers carry
  most of a tensor's energy, so they lift ``sqnr_db`` while the rows they crush are ruined;
  the worst row shows it.

With ``activations=True`` a ``transformers`` model built from the checkpoint's own
``config.json`` runs a few samples on CPU; forward pre-hooks record every linear layer's
input, quantized with the recipe's activation role (1x128 tiles for block scaling), and the
GEMM's output with both operands quantized (``outputs``): an outlier input channel crushes
its tile's other channels, which the input's own SQNR hides (the outlier dominates it) and
the output shows when, as in real LLMs, the outlier channel meets small weights.

A module is flagged for a recipe when its weight or input SQNR, or its worst row's, is below
the threshold, or its GEMM output's SQNR is below the threshold minus
:data:`OUTPUT_MARGIN_DB`
(default :data:`DEFAULT_THRESHOLD_DB`, justified in ``docs/analyze.md``); the flagged
modules become a ``bf16_layers`` rule set per recipe.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .errors import FP8ConfigError
from .rules.names import builtin_high_precision, layer_index

__all__ = ["DEFAULT_THRESHOLD_DB", "SAMPLE_TEXTS", "analyze_checkpoint", "checkpoint_files",
           "suggest_bf16_layers", "render_text", "write_heatmap", "ErrorStats"]

DEFAULT_THRESHOLD_DB = 25.0
"""Flag a module whose SQNR under a recipe is below this (dB). E4M3's 3 mantissa bits give
~31 dB on well-scaled data; 25 dB (torchao's floor for FP8 casts) is 4x that noise power."""

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

_KINDS = ("weights", "activations", "outputs")
_KIND_WORDS = {"weights": "weight", "activations": "input", "outputs": "output"}
_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_FP8_DTYPES = {"F8_E4M3", "F8_E5M2", "F8_E8M0"}
_EMBEDDING = re.compile(r"(?:^|\.)(?:embed_tokens|word_embeddings|position_embeddings|"
                        r"token_type_embeddings|wte|wpe|embeddings?)(?:\.|$)")


@dataclass
class ErrorStats:
    """Running quantization error of one tensor (or of one layer's inputs over batches)."""

    signal: float = 0.0
    noise: float = 0.0
    max_rel_err: float = 0.0
    rows: int = 0

    @property
    def sqnr_db(self) -> float:
        if self.noise == 0.0:
            return math.inf if self.signal > 0 else math.nan
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)

    def add(self, x, dq, row_signal=None) -> None:
        """Accumulate ``x`` [rows, cols] against its quantize-dequantize ``dq``.
        ``row_signal`` (sum of x^2 per row) may be passed when several recipes share ``x``."""
        xf = x.float()
        # Per-row sums in fp32 (rows are at most a few ten thousand elements), totals in fp64.
        row_sig = xf.square().sum(dim=-1) if row_signal is None else row_signal
        row_err = (xf - dq.float()).square().sum(dim=-1)
        self.signal += float(row_sig.double().sum())
        self.noise += float(row_err.double().sum())
        nz = row_sig > 0
        if bool(nz.any()):
            self.max_rel_err = max(self.max_rel_err, float((row_err[nz] / row_sig[nz]).sqrt().max()))
        self.rows += int(xf.shape[0])

    @property
    def min_row_sqnr_db(self) -> float:
        """The worst row's SQNR, ``-20 log10(max_rel_err)``."""
        return -20.0 * math.log10(self.max_rel_err) if self.max_rel_err > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        """``sqnr_db`` is None when there is no noise at all (``exact``) or no signal."""
        db, row = self.sqnr_db, self.min_row_sqnr_db
        out: dict[str, Any] = {"sqnr_db": round(db, 4) if math.isfinite(db) else None,
                               "max_rel_err": self.max_rel_err,
                               "min_row_sqnr_db": round(row, 4) if math.isfinite(row) else None}
        if self.noise == 0.0 and self.signal > 0:
            out["exact"] = True
        return out


# --------------------------------------------------------------------------- recipes


def _quantizer_key(spec, role: str) -> tuple:
    """Recipes that quantize a role identically share one key (delayed and current scaling
    quantize a weight alike; see :func:`_quantize`)."""
    block = spec.weight_block if role == "weight" else spec.activation_block
    kind = "tensor" if spec.scaling in ("delayed", "tensorwise") else spec.scaling
    return (kind, block, spec.pow2_scales if kind != "mx" else True)


def _quantize(x, spec, role: str):
    """Quantize-dequantize ``x`` (2-D) as the recipe quantizes a ``role`` operand."""
    from .numerics import quantize_blockwise, quantize_mxfp8, quantize_per_tensor

    block = spec.weight_block if role == "weight" else spec.activation_block
    if spec.scaling in ("delayed", "tensorwise"):
        # Delayed scaling's weight scale comes from the amax history, which for a weight at
        # steady state equals its current amax: current scaling is the faithful stand-in.
        q = quantize_per_tensor(x, "e4m3", pow2_scales=spec.pow2_scales)
    elif spec.scaling == "block":
        q = quantize_blockwise(x, block=block, fmt="e4m3", pow2_scales=spec.pow2_scales)
    else:
        q = quantize_mxfp8(x, block=block, fmt="e4m3")
    return q.dequantize()


def _stats_for(mats, specs, role: str, into: dict[str, "ErrorStats"] | None = None):
    """Error of ``mats`` (2-D tensors) under each recipe, quantizing once per distinct
    quantizer."""
    out = into if into is not None else {}
    by_key: dict[tuple, list] = {}
    for spec in specs:
        by_key.setdefault(_quantizer_key(spec, role), []).append(spec)
    for m in mats:
        row_sig = m.float().square().sum(dim=-1)
        for group in by_key.values():
            dq = _quantize(m, group[0], role)
            for spec in group:
                out.setdefault(spec.name, ErrorStats()).add(m, dq, row_sig)
    return out


def _resolve_recipes(recipes: Iterable[Any] | None):
    from .registry import default_registry, get_recipe

    if recipes is None:
        return [s for s in (default_registry().get(n) for n in sorted(default_registry().names()))]
    out = []
    for r in recipes:
        try:
            spec = get_recipe(r)
        except FP8ConfigError as err:  # the user typed it in --recipes, so name that
            raise FP8ConfigError(err.bare_message, key="--recipes", value=r, hint=err.hint) from None
        if spec.name not in [s.name for s in out]:
            out.append(spec)
    if not out:
        raise FP8ConfigError("no recipe to analyze", key="--recipes")
    return out


# --------------------------------------------------------------------------- checkpoint


def checkpoint_files(path: str | Path) -> list[Path]:
    """The ``.safetensors`` files of a checkpoint (a file, or a directory with or without a
    ``model.safetensors.index.json``)."""
    path = Path(path).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FP8ConfigError(f"checkpoint not found: {path}", key="CHECKPOINT", value=str(path))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FP8ConfigError(f"{index} is not a readable safetensors index ({exc})",
                                 key="CHECKPOINT", value=str(index)) from None
        files = [path / n for n in names]
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise FP8ConfigError(f"{index} names {missing[0].name}, which is not in {path}",
                                 key="CHECKPOINT", value=str(missing[0]))
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FP8ConfigError(f"no .safetensors files in {path}", key="CHECKPOINT", value=str(path),
                             hint="analyze reads Hugging Face safetensors checkpoints")
    return files


def _open(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error types; the file is the user's
        raise FP8ConfigError(f"{file} is not a readable safetensors file ({exc})",
                             key="CHECKPOINT", value=str(file)) from None


def _skip_reason(name: str, shape: list[int], dtype: str) -> str | None:
    if not name.endswith(".weight"):
        return "not a weight"
    if dtype in _FP8_DTYPES:
        return "already FP8"
    if dtype not in _FLOAT_DTYPES:
        return f"not a float tensor ({dtype})"
    if len(shape) not in (2, 3):
        return f"{len(shape)}-D, not a linear weight"
    if any(d == 0 for d in shape):
        return "empty"
    module = name[: -len(".weight")]
    if _EMBEDDING.search(module):
        return "embedding (not an FP8 GEMM)"
    builtin = builtin_high_precision(module)
    if builtin == "output_head":
        return "output head (never FP8 on any host)"
    if builtin == "router":
        return "MoE router (kept in high precision)"
    return None


def _scan(files: list[Path]) -> tuple[list[tuple[Path, str, list[int], str]], list[dict]]:
    """(file, name, shape, dtype) of every candidate weight, and the tensors skipped, from the
    headers alone."""
    todo, skipped = [], []
    for file in files:
        with _open(file) as f:
            try:
                keys = list(f.keys())
                for name in keys:
                    sl = f.get_slice(name)
                    shape, dtype = list(sl.get_shape()), str(sl.get_dtype())
                    reason = _skip_reason(name, shape, dtype)
                    if reason is None:
                        todo.append((file, name, shape, dtype))
                    elif reason != "not a weight":
                        skipped.append({"name": name, "shape": shape, "dtype": dtype,
                                        "reason": reason})
            except FP8ConfigError:
                raise
            except Exception as exc:
                raise FP8ConfigError(f"{file} is not a readable safetensors file ({exc})",
                                     key="CHECKPOINT", value=str(file)) from None
    return todo, skipped


def _progress(iterable, total: int, desc: str, enabled: bool | None):
    try:
        from tqdm import tqdm
    except ImportError:  # the analyze extra brings tqdm; without it, no bar
        return iterable
    return tqdm(iterable, total=total, desc=desc, unit="tensor", file=sys.stderr,
                disable=None if enabled is None else not enabled, leave=False)


def _weight_stats(tensor, specs) -> dict[str, ErrorStats]:
    import torch

    x = tensor if tensor.dtype in (torch.float32, torch.bfloat16, torch.float16) else tensor.float()
    mats = [x] if x.dim() == 2 else list(x)  # 3-D: a stack of expert matrices, one by one
    return _stats_for(mats, specs, "weight")


# --------------------------------------------------------------------------- activations


def _load_samples(samples: str | Path | None) -> tuple[list[str] | None, list[list[int]] | None]:
    if samples is None:
        return list(SAMPLE_TEXTS), None
    path = Path(samples).expanduser()
    if not path.is_file():
        raise FP8ConfigError(f"samples file not found: {path}", key="--samples", value=str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FP8ConfigError(f"cannot read {path} ({exc})", key="--samples", value=str(path)) from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise FP8ConfigError(f"{path} is not valid JSON ({exc})", key="--samples") from None
        if isinstance(data, dict):
            data = data.get("input_ids")
        if (isinstance(data, list) and data and all(isinstance(s, list) and s for s in data)
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                        for s in data for t in s)):
            return None, data
        raise FP8ConfigError(f"{path}: expected a JSON list of token-id lists (or "
                             f"{{\"input_ids\": [...]}})", key="--samples", value=str(path))
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise FP8ConfigError(f"{path} holds no text (one sample per line)", key="--samples",
                             value=str(path))
    return lines, None


def _activation_stats(checkpoint: Path, specs, samples, max_tokens: int, progress: bool | None):
    """Per linear module (HF name) and recipe, the quantization error of its inputs and of
    its GEMM's output (input and weight both quantized), and run information."""
    import torch

    try:
        import transformers
    except ImportError:
        raise FP8ConfigError("--activations needs the transformers package", key="--activations",
                             hint="pip install transformers") from None
    model_dir = checkpoint if checkpoint.is_dir() else checkpoint.parent
    if not (model_dir / "config.json").is_file():
        raise FP8ConfigError(f"--activations builds the model from {model_dir / 'config.json'}, "
                             f"which does not exist", key="--activations", value=str(model_dir))
    texts, token_ids = _load_samples(samples)
    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        archs = getattr(config, "architectures", None) or []
        cls = (transformers.AutoModelForCausalLM if any(a.endswith("ForCausalLM") for a in archs)
               else transformers.AutoModel)
        model = cls.from_pretrained(str(model_dir), local_files_only=True).float()
    except Exception as exc:  # transformers raises many types for an unusable config/weights
        raise FP8ConfigError(f"transformers cannot build the model in {model_dir} on this machine "
                             f"({type(exc).__name__}: {exc})", key="--activations",
                             value=str(model_dir)) from None
    model.eval()
    if texts is not None:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except Exception as exc:
            raise FP8ConfigError(f"no usable tokenizer in {model_dir} ({exc}); pass token ids "
                                 f"with --samples FILE.json", key="--samples") from None
        batches = [tokenizer(t, return_tensors="pt", truncation=True, max_length=max_tokens)["input_ids"]
                   for t in texts]
    else:
        vocab = getattr(config, "vocab_size", None)
        for ids in token_ids:
            if vocab and max(ids) >= vocab:
                raise FP8ConfigError(f"token id {max(ids)} is outside the vocabulary ({vocab})",
                                     key="--samples", value=max(ids))
        batches = [torch.tensor([ids[:max_tokens]]) for ids in token_ids]

    stats: dict[str, dict[str, ErrorStats]] = {}
    outputs: dict[str, dict[str, ErrorStats]] = {}
    problems: dict[str, str] = {}
    hooks = []
    groups: dict[tuple, list] = {}
    for spec in specs:
        groups.setdefault((_quantizer_key(spec, "input"), _quantizer_key(spec, "weight")), []).append(spec)
    weight_dq: dict[tuple[str, tuple], Any] = {}

    def make_hook(name: str):
        def hook(module, args):
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
            for (in_key, w_key), group in groups.items():
                dq_x = _quantize(x2, group[0], "input")
                if (name, w_key) not in weight_dq:
                    weight_dq[(name, w_key)] = _quantize(w, group[0], "weight")
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
            for ids in _progress(batches, len(batches), "activations", progress):
                model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    tokens = sum(int(b.numel()) for b in batches)
    return stats, outputs, {"samples": len(batches), "tokens": tokens, "problems": problems}


def _join_activation_names(weight_modules: list[str], act_names: Iterable[str]) -> dict[str, str]:
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


# --------------------------------------------------------------------------- suggestion


def _unit(name: str) -> str:
    """One routed expert cannot stay BF16 alone (hosts run all experts of a layer as one
    grouped GEMM): expert projections collapse to the layer's experts."""
    return re.sub(r"\.experts\.\d+\.[^.]+$", ".experts.*", name)


def suggest_bf16_layers(modules: list[str], flagged: Iterable[str]) -> dict[str, Any]:
    """A ``bf16_layers`` mapping that keeps exactly the flagged modules (and the experts
    sharing their grouped GEMM) in BF16, in the fewest rules: whole leading/trailing layers
    as ``first``/``last``, a module kind flagged in every layer as one layer-wildcard glob,
    the rest by name. Empty when nothing is flagged."""
    flagged = set(flagged)
    if not flagged:
        return {}
    by_layer: dict[int, list[str]] = {}
    for m in modules:
        li = layer_index(m)
        if li is not None:
            by_layer.setdefault(li, []).append(m)
    layers = sorted(by_layer)
    first = 0
    for li in layers:
        if li == first and all(m in flagged for m in by_layer[li]):
            first += 1
        else:
            break
    last = 0
    if layers:
        n = layers[-1] + 1
        for li in reversed(layers):
            if li == n - 1 - last and li >= first and all(m in flagged for m in by_layer[li]):
                last += 1
            else:
                break
    covered_layers = set(range(first)) | set(range(layers[-1] + 1 - last, layers[-1] + 1) if last else ())
    rest_units = [u for u in dict.fromkeys(_unit(m) for m in modules if m in flagged)
                  if layer_index(u) not in covered_layers]
    from .rules.resolve import template

    all_units = list(dict.fromkeys(_unit(m) for m in modules))
    by_template: dict[str, list[str]] = {}
    for u in all_units:
        if layer_index(u) not in covered_layers:
            by_template.setdefault(template(u), []).append(u)
    patterns: list[str] = []
    done: set[str] = set()
    for u in rest_units:
        t = template(u)
        if t in done:
            continue
        group = by_template.get(t, [])
        hit = [g for g in group if g in rest_units]
        if layer_index(u) is not None and len(group) > 1 and len(hit) == len(group):
            patterns.append(t)
            done.add(t)
        else:
            patterns.append(u)
    out: dict[str, Any] = {}
    if first:
        out["first"] = first
    if last:
        out["last"] = last
    if patterns:
        out["modules"] = list(dict.fromkeys(patterns))
    return out


# --------------------------------------------------------------------------- driver


def analyze_checkpoint(checkpoint: str | Path, *, recipes: Iterable[Any] | None = None,
                       threshold_db: float = DEFAULT_THRESHOLD_DB, activations: bool = False,
                       samples: str | Path | None = None, max_tokens: int = 128,
                       progress: bool | None = None) -> dict[str, Any]:
    """Analyze a safetensors checkpoint; returns the report ``--json`` prints.

    Args:
        checkpoint: a ``.safetensors`` file or a checkpoint directory.
        recipes: recipe names or specs (default: every registered recipe).
        threshold_db: flag modules whose weight or input SQNR is below this.
        activations: also run the model (built by ``transformers`` from the checkpoint's
            ``config.json``) on ``samples`` and measure each linear layer's inputs.
        samples: a text file (one sample per line) or a JSON file of token-id lists;
            default :data:`SAMPLE_TEXTS`.
        max_tokens: tokens per sample (longer ones are truncated).
        progress: show a progress bar on stderr (None: only on a terminal).
    """
    if not isinstance(threshold_db, (int, float)) or isinstance(threshold_db, bool) \
            or not math.isfinite(threshold_db):
        raise FP8ConfigError(f"expected a number of dB, got {threshold_db!r}", key="--threshold",
                             value=threshold_db)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise FP8ConfigError(f"expected a positive integer, got {max_tokens!r}", key="--max-tokens",
                             value=max_tokens)
    specs = _resolve_recipes(recipes)
    checkpoint = Path(checkpoint).expanduser()
    files = checkpoint_files(checkpoint)
    todo, skipped = _scan(files)
    if activations and samples is not None:
        _load_samples(samples)  # a bad samples file fails before the long weight pass
    import torch

    rows: list[dict[str, Any]] = []
    handles: dict[Path, Any] = {}
    try:
        for file, name, shape, dtype in _progress(todo, len(todo), "weights", progress):
            if file not in handles:
                for h in handles.values():
                    h.__exit__(None, None, None)
                handles = {file: _open(file).__enter__()}
            try:
                tensor = handles[file].get_tensor(name)
            except Exception as exc:
                raise FP8ConfigError(f"{file}: cannot read tensor {name} ({exc})", key="CHECKPOINT",
                                     value=str(file)) from None
            if not bool(torch.isfinite(tensor).all()):
                skipped.append({"name": name, "shape": shape, "dtype": dtype,
                                "reason": "non-finite values"})
                continue
            module = name[: -len(".weight")]
            stats = _weight_stats(tensor, specs)
            del tensor
            rows.append({"module": module, "layer": layer_index(module), "shape": shape,
                         "dtype": dtype, "weights": {k: v.to_dict() for k, v in stats.items()}})
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)

    if not rows:  # a report of nothing would read as "all clear"
        why = "; ".join(f"{s['name']} ({s['reason']})" for s in skipped[:5])
        more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        raise FP8ConfigError("no linear weight to analyze" + (
            f": every 2-D weight was skipped: {why}{more}" if skipped else
            ": the checkpoint holds no 2-D floating-point `.weight` tensor"),
            key="CHECKPOINT", value=str(checkpoint))
    rows.sort(key=lambda r: _natural(r["module"]))
    act_info = None
    if activations:
        act, out, act_info = _activation_stats(checkpoint, specs, samples, max_tokens, progress)
        joined = _join_activation_names([r["module"] for r in rows], act)
        by_module = {r["module"]: r for r in rows}
        for a_name, w_name in joined.items():
            by_module[w_name]["activations"] = {k: v.to_dict() for k, v in act[a_name].items()}
            by_module[w_name]["outputs"] = {k: v.to_dict() for k, v in out[a_name].items()}
        act_info["unmatched_modules"] = sorted(set(act) - set(joined))

    modules = [r["module"] for r in rows]
    suggestions, summary = {}, {}
    for spec in specs:
        flagged = []
        for r in rows:
            if _is_flagged(r, spec.name, threshold_db):
                flagged.append(r["module"])
                r.setdefault("flagged", []).append(spec.name)
        suggestions[spec.name] = suggest_bf16_layers(modules, flagged)
        summary[spec.name] = {"flagged": len(flagged), **_summary(rows, spec.name, "weights", "weight")}
        if any("activations" in r for r in rows):
            summary[spec.name].update(_summary(rows, spec.name, "activations", "input"))
            summary[spec.name].update(_summary(rows, spec.name, "outputs", "output"))
    report: dict[str, Any] = {
        "checkpoint": str(checkpoint), "files": [str(f) for f in files],
        "recipes": [s.name for s in specs], "threshold_db": float(threshold_db),
        "modules": rows, "skipped": skipped, "summary": summary, "suggestions": suggestions,
    }
    if act_info is not None:
        report["activations"] = act_info
    return report


OUTPUT_MARGIN_DB = 3.0
"""An FP8 GEMM quantizes two operands, each adding its own noise: the output's ideal SQNR is
~3 dB below one operand's, so outputs are held to ``threshold - OUTPUT_MARGIN_DB``."""


def _is_flagged(row: dict[str, Any], recipe: str, threshold_db: float) -> bool:
    """Below the threshold: a weight or input (tensor or worst row), or the GEMM output
    (tensor; a single token's output row can be small by cancellation, so it is reported but
    not judged)."""
    for kind in ("weights", "activations"):
        if kind in row and any(v is not None and v < threshold_db for v in
                               (row[kind][recipe]["sqnr_db"], row[kind][recipe]["min_row_sqnr_db"])):
            return True
    if "outputs" in row:
        v = row["outputs"][recipe]["sqnr_db"]
        if v is not None and v < threshold_db - OUTPUT_MARGIN_DB:
            return True
    return False


def _natural(name: str) -> list:
    """Sort key putting layer 2 before layer 10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _summary(rows, recipe: str, kind: str, word: str) -> dict[str, Any]:
    """Lowest (tensor or row) SQNR with its module, and the median tensor SQNR."""
    lows = [(v, r["module"]) for r in rows if kind in r
            for v in (_judged(r[kind][recipe], kind),) if v is not None]
    med = sorted(v for r in rows if kind in r
                 for v in (r[kind][recipe]["sqnr_db"],) if v is not None)
    if not lows:
        return {}
    low, module = min(lows)
    return {f"min_{word}_sqnr_db": low, f"worst_{word}_module": module,
            f"median_{word}_sqnr_db": med[len(med) // 2] if med else None}


# --------------------------------------------------------------------------- output


def suggestion_yaml(report: dict[str, Any], recipe: str) -> str:
    """The ready-to-paste ``fp8:`` block for one recipe's suggestion."""
    from ._io import dump_yaml

    block: dict[str, Any] = {"recipe": recipe}
    if report["suggestions"].get(recipe):
        block["bf16_layers"] = report["suggestions"][recipe]
    return dump_yaml({"fp8": block})


def _lowest(stats: dict[str, Any]) -> float | None:
    vals = [v for v in (stats.get("sqnr_db"), stats.get("min_row_sqnr_db")) if v is not None]
    return min(vals) if vals else None


def _judged(stats: dict[str, Any], kind: str) -> float | None:
    """The value the flagging judges: the lower of tensor and worst-row SQNR for weights and
    inputs, the tensor SQNR for GEMM outputs."""
    return stats.get("sqnr_db") if kind == "outputs" else _lowest(stats)


def _fmt_db(v) -> str:
    return "  -   " if v is None else f"{v:6.1f}"


def render_text(report: dict[str, Any], *, max_rows: int = 40) -> str:
    recipes = report["recipes"]
    rows = report["modules"]
    lines = [f"checkpoint: {report['checkpoint']} ({len(report['files'])} file(s), "
             f"{len(rows)} linear weights, {len(report['skipped'])} tensors skipped)",
             f"threshold: {report['threshold_db']} dB (flag a module below it under a recipe)"]
    has_act = any("activations" in r for r in rows)
    if report.get("activations"):
        a = report["activations"]
        lines.append(f"activations: {a['samples']} samples, {a['tokens']} tokens")
    width = max([len(r["module"]) for r in rows] + [6])

    def worst(r):
        vals = [_judged(r[kind][n], kind) for kind in _KINDS if kind in r for n in recipes]
        vals = [v for v in vals if v is not None]
        return min(vals) if vals else math.inf

    shown = rows if len(rows) <= max_rows else sorted(rows, key=worst)[:max_rows]
    if len(shown) < len(rows):
        lines.append(f"the {len(shown)} modules with the lowest SQNR (all {len(rows)} with --json):")
    cw = 16 if has_act else 8
    head = f"  {'module':<{width}}  " + "  ".join(f"{n[:cw]:>{cw}}" for n in recipes)
    lines.append(head)
    lines.append("  (dB: the lower of the tensor's SQNR and its worst row's"
                 + ("; weight/input/GEMM output, the output judged at the threshold - "
                    f"{OUTPUT_MARGIN_DB:g} dB" if has_act else "") + "; * = flagged)")
    for r in shown:
        cells = []
        for n in recipes:
            cell = "/".join(_fmt_db(_judged(r[kind][n], kind)).strip() for kind in _KINDS if kind in r)
            cells.append(f"{cell + ('*' if n in r.get('flagged', []) else ' '):>{cw + 1}}")
        lines.append(f"  {r['module']:<{width}} " + " ".join(cells))
    if report["skipped"]:
        reasons: dict[str, list[str]] = {}
        for s in report["skipped"]:
            reasons.setdefault(s["reason"], []).append(s["name"])
        for why, names in reasons.items():
            # a NaN weight must be visible by name; long lists of norms and biases need not be
            shown_names = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            lines.append(f"skipped ({why}): {shown_names}")
    for n in recipes:
        s = report["summary"][n]
        text = f"{n}: {s['flagged']} flagged"
        for word in ("weight", "input", "output"):
            if f"min_{word}_sqnr_db" in s:
                text += (f"; {word} SQNR median {_fmt_db(s[f'median_{word}_sqnr_db']).strip()} dB, "
                         f"lowest {_fmt_db(s[f'min_{word}_sqnr_db']).strip()} dB "
                         f"({s[f'worst_{word}_module']})")
        lines.append(text)
        if report["suggestions"][n]:
            lines.append("  suggested config:")
            lines += ["    " + ln for ln in suggestion_yaml(report, n).splitlines()]
        else:
            lines.append("  no module below the threshold: no bf16_layers needed")
    return "\n".join(lines) + "\n"


def write_heatmap(report: dict[str, Any], path: str | Path, *, max_rows: int = 400) -> Path:
    """A PNG heat map, module x recipe (the lower of tensor and worst-row SQNR, for weights;
    input and GEMM-output columns too with activations), written atomically. Expert projections are shown per layer at their worst; beyond
    ``max_rows`` modules of the same kind are merged across layers at their worst."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import io

    import matplotlib.pyplot as plt
    import numpy as np

    from ._io import atomic_write_bytes
    from .rules.resolve import template

    recipes = report["recipes"]
    has_act = any("activations" in r for r in report["modules"])
    kinds = _KINDS if has_act else ("weights",)
    columns = [(n, kind) for kind in kinds for n in recipes]
    labels = [f"{n}\n({_KIND_WORDS[kind]})" for n, kind in columns]

    def rows_by(key):
        merged: dict[str, list[float]] = {}
        for r in report["modules"]:
            vals = []
            for n, kind in columns:
                v = _judged(r[kind][n], kind) if kind in r else None
                vals.append(np.nan if v is None else v)
            k = key(r["module"])
            merged[k] = vals if k not in merged else list(np.fmin(merged[k], vals))
        return merged

    merged = rows_by(lambda m: re.sub(r"\.experts\.\d+\.", ".experts.*.", m))
    if len(merged) > max_rows:
        merged = rows_by(lambda m: template(re.sub(r"\.experts\.\d+\.", ".experts.*.", m)))
    names = list(merged)
    data = np.array([merged[n] for n in names], dtype=float).reshape(len(names), len(columns))
    height = min(max(3.0, 0.18 * len(names) + 1.5), 200.0)
    width = max(6.0, 1.6 * len(columns) + 0.07 * max([len(n) for n in names] + [10]))
    fig, ax = plt.subplots(figsize=(width, height))
    try:
        shown = np.clip(data, 0.0, 45.0)
        im = ax.imshow(np.ma.masked_invalid(shown), aspect="auto", cmap="viridis", vmin=0, vmax=45,
                       interpolation="nearest")
        thr = report["threshold_db"]
        limits = np.array([thr - OUTPUT_MARGIN_DB if kind == "outputs" else thr for _, kind in columns])
        below = np.argwhere(np.nan_to_num(data, nan=np.inf) < limits[None, :])
        if len(below):
            ax.scatter(below[:, 1], below[:, 0], marker="x", color="red", s=18,
                       label=f"flagged (< {thr:g} dB; outputs < {thr - OUTPUT_MARGIN_DB:g} dB)")
            ax.legend(loc="upper right", fontsize=7, framealpha=0.8)
        ax.set_xticks(range(len(columns)), labels, fontsize=7)
        ax.set_yticks(range(len(names)), names, fontsize=6)
        ax.set_title(f"FP8 quantization SQNR (dB) -- {Path(report['checkpoint']).name}", fontsize=9)
        fig.colorbar(im, ax=ax, label="SQNR (dB)", shrink=0.6)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
    finally:
        plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())

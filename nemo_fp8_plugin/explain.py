"""What a config resolves to, as one report: the recipe, findings, and (with the rules and
host modules) the per-layer decisions and each host's native keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import FP8Request, resolve_config
from .errors import ConflictingKeyError, FP8ConfigError
from .registry import default_registry

__all__ = ["build_report", "render_text"]


def build_report(path: str | Path, *, hardware: str | None = None, model: str | None = None,
                 model_config: str | Path | None = None, strict: bool = False) -> dict[str, Any]:
    """The report ``nemo-fp8 explain`` prints; the ``--json`` output is exactly this.

    ``model`` (a built-in model name) or ``model_config`` (a Hugging Face ``config.json`` or
    checkpoint directory) override the model the config names. ``strict`` turns every
    rule and host warning into an :class:`FP8ConfigError`.
    """
    config, request = resolve_config(path, hardware=hardware)
    report: dict[str, Any] = {"config": str(path)}
    if request is None:
        warning = ("no FP8 recipe requested (no `precision:`, `policy.precision:`, "
                   "`mixed_precision:` or `fp8:` naming one); the config runs in its own precision")
        near_misses = _near_request_keys(config)
        if near_misses:
            warning += "; " + "; ".join(near_misses)
        report.update(recipe=None, keys=[], warnings=[warning])
        return report
    report.update(_recipe_section(request))
    description, model_warnings = _model_section(request, config, Path(path), model, model_config)
    report["warnings"] += model_warnings
    if description is not None:
        report["model"] = description.name
        report["model_description"] = description.summary()
        for finding in request.spec.check_dims(description.dims()):
            if finding.level == "error":  # MXFP8 cannot run on a partial 32-element block
                raise FP8ConfigError(finding.message, key=finding.key,
                                     hint=f"recipe {request.spec.name!r} on model {description.name}")
            report["warnings"].append(f"{finding.key}: {finding.message}")
        try:
            layers, rule_warnings, notes = _layers_section(request.spec, description)
        except FP8ConfigError as err:  # rules contradicting the model: name the config key
            raise (err.with_prefix("fp8") if "fp8" in request.keys else err) from None
        report["layers"] = layers
        report["warnings"] += rule_warnings
        if notes:
            report["notes"] = notes
    report["hosts"] = _hosts_section(request, model=description)
    _refuse_native_conflicts(Path(path), hardware)
    if strict:
        _raise_strict(report)
    return report


def _near_request_keys(config: dict) -> list[str]:
    """``precison: fp8_blockwise``: a key one typo away from a request key, holding one of
    our recipe names, is almost certainly the request that was meant."""
    from .errors import suggest

    reg = default_registry()
    out = []
    for section, keys in ((config, ("precision", "mixed_precision", "fp8")),
                          (config.get("policy"), ("precision",))):
        if not isinstance(section, dict):
            continue
        for key, value in section.items():
            if key in keys or not isinstance(key, str) or not isinstance(value, str):
                continue
            near = suggest(key, keys)
            if near and value.replace("-", "_") in reg:
                where = "policy." if section is not config else ""
                out.append(f"`{where}{key}: {value}` looks like `{where}{near}:` misspelt")
    return out


def _model_section(request: FP8Request, config: dict, path: Path, model: str | None,
                   model_config: str | Path | None):
    """The model description the per-layer rules resolve against, and why there is none."""
    from .rules import describe_model

    if model_config is not None:
        return describe_model(str(model_config), key="--model-config"), []
    if model is not None:
        return describe_model(model, key="--model"), []
    named = request.model
    if named is None and isinstance(config.get("model"), str):  # vLLM engine configs: `model: <id>`
        named = config["model"]
    if named is not None:
        try:
            return describe_model(named, key="model", base_dir=path.parent), []
        except FP8ConfigError as err:
            return None, [f"{err}; per-layer decisions are not shown"]
    sizes = _megatron_model_fields(config)
    if sizes is not None:
        try:
            return describe_model(sizes, key="model"), []
        except FP8ConfigError as err:
            return None, [f"{err}; per-layer decisions are not shown"]
    if not request.spec.bf16_layers.empty:
        return None, ["the config names no model: pass --model NAME or --model-config PATH to see "
                      "which layers the bf16_layers rules keep in BF16"]
    return None, []


def _megatron_model_fields(config: dict) -> dict | None:
    """A ``model:`` section with megatron-core fields (``num_layers``, ``hidden_size``, ...)."""
    model = config.get("model")
    for node in (model, model.get("config") if isinstance(model, dict) else None):
        if isinstance(node, dict) and isinstance(node.get("num_layers"), int) \
                and isinstance(node.get("hidden_size"), int):
            return node
    return None


def _layers_section(spec, description) -> tuple[list[dict], list[str], list[str]]:
    """Every module's decision on both sides, and the rule warnings (a pattern that matches
    nothing on any side is reported once)."""
    from .rules import SIDES, resolve

    resolutions = {side: resolve(spec, description, side) for side in SIDES}
    layers = [d.to_dict() for side in SIDES for d in resolutions[side].decisions]
    active = [s for s in SIDES if spec.bf16_layers.acts_on(s)
              and (spec.training if s == "training" else spec.generation) == "fp8"]
    nowhere = set.intersection(*(set(resolutions[s].unmatched_rules) for s in active)) \
        if active else set()
    warnings, notes = [], []
    for label in sorted(nowhere):
        warnings.append(f"{label} matches no module of {description.name} (a typo?)")
    for side in active:
        for w in resolutions[side].warnings:
            if not any(w.startswith(label + " matches no") for label in nowhere):
                warnings.append(w)
        notes += [n for n in resolutions[side].notes if n not in notes]
    return layers, warnings, notes


def _raise_strict(report: dict[str, Any]) -> None:
    found = list(report.get("warnings", []))
    for host, spelling in report.get("hosts", {}).items():
        found += [w if f"host {host}" in w else f"{host}: {w}" for w in spelling.get("warnings", [])]
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise FP8ConfigError(found[0] + more, key="--strict",
                             hint="fix the rules, or drop --strict to see every warning")


def _refuse_native_conflicts(path: Path, hardware: str | None) -> None:
    """A native FP8 key already in the config that contradicts the recipe (``trainer.plugins.fp8:
    hybrid`` next to ``precision: fp8_blockwise``) is an error now, as ``apply`` would make it.

    Each host's ``apply`` holds the knowledge of its own keys, so it is asked; only its
    :class:`ConflictingKeyError` counts. Its other refusals say the config is not for that
    host, which is no contradiction.
    """
    from .hosts import HOSTS, host_module

    for name in HOSTS:
        try:
            host_module(name).apply_file(path, hardware=hardware)
        except ConflictingKeyError as err:
            raise ConflictingKeyError(f"{err.bare_message} (host {name})", key=err.key,
                                      value=err.value, hint=err.hint) from None
        except FP8ConfigError:
            pass  # not this host's config (a training config given to the NeMo RL adapter)


def _hosts_section(request: FP8Request, model=None) -> dict[str, Any]:
    """Each host's native spelling of the recipe (plain data, no host import)."""
    from .hosts import available_hosts, host_module

    out: dict[str, Any] = {}
    for name in available_hosts():
        out[name] = host_module(name).native_keys(request.spec, model=model).to_dict()
    return out


def _recipe_section(request: FP8Request) -> dict[str, Any]:
    spec = request.spec
    reg = default_registry()
    base = spec.name
    return {
        "recipe": spec.to_dict(),
        "recipe_source": reg.source(base) if base in reg else "derived",
        "keys": list(request.keys),
        "model": request.model,
        "warnings": [f"{f.key}: {f.message}" for f in spec.findings() if f.level == "warning"],
    }


def render_text(report: dict[str, Any]) -> str:
    lines = [f"config: {report['config']}"]
    recipe = report.get("recipe")
    if recipe is None:
        lines += [f"warning: {w}" for w in report.get("warnings", [])]
        return "\n".join(lines) + "\n"
    lines.append(f"recipe: {recipe['name']}  (requested by {', '.join(report['keys'])}; "
                 f"{report['recipe_source']})")
    lines.append(f"  {recipe['description']}")
    for key, value in recipe.items():
        if key in ("name", "description"):
            continue
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        lines.append(f"  {key:<26} {value}")
    model = report.get("model_description")
    if model is not None:
        lines.append(f"model: {model['name']} ({model['family']}, {model['num_layers']} layers"
                     + (f", {model['num_experts']} experts" if model["num_experts"] else "")
                     + f"; {model['source']})")
    if report.get("layers"):
        from .rules import render_layer_table

        lines += render_layer_table(report["layers"])
    for host, spelling in report.get("hosts", {}).items():
        lines.append(f"host {host}:")
        for key, value in _flatten(spelling.get("keys", {})):
            lines.append(f"  {key} = {value}")
        for key, value in spelling.get("env", {}).items():
            lines.append(f"  env {key}={value}")
        for w in spelling.get("warnings", []):
            lines.append(f"  warning: {w}")
    for w in report.get("warnings", []):
        lines.append(f"warning: {w}")
    for n in report.get("notes", []):
        lines.append(f"note: {n}")
    return "\n".join(lines) + "\n"


def _flatten(mapping: dict, prefix: str = ""):
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            yield from _flatten(value, dotted)
        else:
            yield dotted, value

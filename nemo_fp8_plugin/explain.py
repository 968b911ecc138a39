"""What a config resolves to, as one report: the recipe, findings, and (with the rules and
host modules) the per-layer decisions and each host's native keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import FP8Request, resolve_config
from .registry import default_registry

__all__ = ["build_report", "render_text"]


def build_report(path: str | Path, *, hardware: str | None = None) -> dict[str, Any]:
    """The report ``nemo-fp8 explain`` prints; the ``--json`` output is exactly this."""
    config, request = resolve_config(path, hardware=hardware)
    report: dict[str, Any] = {"config": str(path)}
    if request is None:
        report.update(recipe=None, keys=[], warnings=[
            "no FP8 recipe requested (no `precision:`, `policy.precision:`, `mixed_precision:` "
            "or `fp8:` naming one); the config runs in its own precision"])
        return report
    report.update(_recipe_section(request))
    report["hosts"] = _hosts_section(request)
    return report


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
    return "\n".join(lines) + "\n"


def _flatten(mapping: dict, prefix: str = ""):
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            yield from _flatten(value, dotted)
        else:
            yield dotted, value

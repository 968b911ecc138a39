"""What a config resolves to, as one report: the recipe, findings, the per-layer decisions,
and for every host exactly what ``nemo-fp8 apply --host <host>`` writes (the same pipeline,
:func:`nemo_fp8_plugin.hosts.run`, on the same loaded config).

Over 600 lines on purpose: the report and its text rendering are one pair; a section added to
one is added to the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .capabilities import SIDES, host_sides
from .errors import ConflictingKeyError, FP8ConfigError
from .hosts import detect_host
from .registry import default_registry

if TYPE_CHECKING:
    from .config import FP8Request

__all__ = ["build_report", "render_text", "detect_host"]


def build_report(
    path: str | Path,
    *,
    hardware: str | None = None,
    model: str | None = None,
    model_config: str | Path | None = None,
    strict: bool = False,
    host: str | None = None,
    stack: str | None = None,
) -> dict[str, Any]:
    """The report ``nemo-fp8 explain`` prints; the ``--json`` output is exactly this.
    ``stack``: the ``--stack`` name the host versions are assumed from (None: detected).

    ``model`` (a built-in model name) or ``model_config`` (a Hugging Face ``config.json`` or
    checkpoint directory) override the model the config names. ``host`` overrides the host
    detected from the config's shape (:func:`detect_host`): what that host's ``apply`` refuses,
    ``explain`` refuses; another host's refusal is reported in its section. A native key
    contradicting the recipe is refused whichever host it belongs to. ``strict`` turns every
    rule and host warning into an :class:`FP8ConfigError`. A refusal naming a NeMo RL release
    that was assumed or detected says how it was decided, as ``apply``'s does.
    """
    from .hosts.nemo_rl.releases import release_hint
    from .stacks import assumed_versions

    try:
        return _build_report(
            path,
            hardware=hardware,
            model=model,
            model_config=model_config,
            strict=strict,
            host=host,
            stack=stack,
        )
    except FP8ConfigError as err:
        raise release_hint(err, assumed_versions(stack).release) from None


def _build_report(
    path: str | Path,
    *,
    hardware: str | None,
    model: str | None,
    model_config: str | Path | None,
    strict: bool,
    host: str | None,
    stack: str | None,
) -> dict[str, Any]:
    from .hosts import ADAPTERS, get_adapter, load_context

    # A target the recipe cannot run on is reported below (an error only under --strict).
    ctx = load_context(
        path,
        hardware=hardware,
        model=model,
        model_config=model_config,
        check_hardware=False,
        stack=stack,
    )
    own = get_adapter(host).name if host is not None else detect_host(ctx.resolved)
    report: dict[str, Any] = {"config": str(path), "host": own}
    if ctx.stack is not None:
        report["stack"] = {
            "name": ctx.stack.label,
            "how": ctx.stack.how,
            "versions": dict(ctx.stack.versions),
            "nemo_rl": ctx.stack.release.summary(),
        }
    request = ctx.request
    if request is None:
        report = _no_request(report, ctx, own)
        if strict and "native" in report:  # its warnings are errors as a request's are
            _raise_strict(report)
        return report
    report.update(_recipe_section(request))
    refusal = None
    if request.hardware is not None:
        _hardware_section(report, request, hardware, own)
        ctx, refusal = _with_hardware(ctx, own)
    report["warnings"] += list(ctx.model_notes)
    description = ctx.model
    if description is not None:
        from .hosts import check_model_shape, get_adapter

        report["model"] = description.name
        report["model_description"] = description.summary()
        # The check apply runs (hosts.run), so both refuse the same model, naming one key.
        shape = check_model_shape(ctx, get_adapter(own) if own is not None else None)
        report["warnings"] += [str(w) for w in shape]
    if description is not None and request.spec.qat is not None:
        report.setdefault("notes", []).append(_QAT_NO_TABLES.format(request.spec.qat.preset))
    elif description is not None:
        try:
            layers, rule_warnings, notes = _layers_section(request.spec, description)
        except FP8ConfigError as err:  # rules contradicting the model: name the config key
            raise (err.with_prefix("fp8") if "fp8" in request.keys else err) from None
        report["layers"] = layers
        report["warnings"] += rule_warnings
        _lint_section(report, request.spec, description)
        if notes:
            report.setdefault("notes", []).extend(notes)
    report["hosts"] = _hosts_section(ctx, own, list(ADAPTERS), refusal)
    if strict:
        _raise_strict(report)
    return report


def _no_request(report: dict[str, Any], ctx, own: str | None) -> dict[str, Any]:
    """The report of a config asking for no recipe: the recipe its host's own FP8 keys
    already spell (``native``, :func:`nemo_fp8_plugin.hosts.read_native`), else the one
    no-request warning with any near-miss request key."""
    from .hosts import NO_REQUEST, read_native

    reading = read_native(ctx, own)
    if reading is not None:  # already FP8 in the host's own keys
        native = reading.summary()
        if reading.spec is not None:
            native["spec"] = reading.spec.to_dict()
        report.update(recipe=None, keys=[], warnings=[], native=native)
        _native_checks(report, ctx, reading)
        return report
    warning = NO_REQUEST
    near_misses = _near_request_keys(dict(ctx.resolved))
    if near_misses:
        warning += "; " + "; ".join(near_misses)
    report.update(recipe=None, keys=[], warnings=[warning])
    return report


def _native_checks(report: dict[str, Any], ctx, reading) -> None:
    """The checks ``apply`` runs on a config already FP8 in its host's own keys
    (:func:`~nemo_fp8_plugin.hosts.check_native`): its refusals are explain's; the
    ``--hardware`` target is reported as for a requested recipe (a warning, ``hardware``), and
    what the host's checks find (the rollout kernels) joins the warnings and notes."""
    from .config import FP8Request
    from .hosts import ApplyResult, check_native, get_adapter
    from .spec import normalize_hardware

    fits = True
    if reading.spec is not None and ctx.hardware is not None:
        arch = normalize_hardware(ctx.hardware, key="--hardware")
        request = FP8Request(reading.spec, keys=(), hardware=arch, hardware_key="--hardware")
        _hardware_section(report, request, ctx.hardware, reading.host)
        fits = not any(p["level"] == "error" for p in report["hardware"]["problems"])
    result = ApplyResult(data=None, requested=False)
    check_native(get_adapter(reading.host), ctx, reading, result, target=fits)
    shown = {*reading.ignored, *reading.unmatched}  # the native lines say these
    report["warnings"] += [str(w) for w in result.warnings if w.text not in shown]
    notes = [str(n) for n in result.notes[1:]]  # the first: the native lines' own note
    if notes:
        report.setdefault("notes", []).extend(notes)
    report["hosts"] = {reading.host: result.summary()}


def _hardware_section(
    report: dict[str, Any], request: FP8Request, flag: str | None, own: str | None
) -> None:
    """``report["hardware"]``: what each side runs on the stated target and what cannot run,
    with the nearest recipe and the YAML change; every problem is also a warning (an error
    under ``--strict``), so ``explain`` reports a config moved to another GPU rather than
    refusing it (``apply`` refuses, ``doctor`` exits 1). Problems are judged for the sides
    the config's host ``own`` runs (:func:`~nemo_fp8_plugin.capabilities.host_sides`), as
    ``apply`` refuses them; ``runs`` names both sides."""
    from .capabilities import arch_label, host_sides
    from .kinds import hardware_problems, side_summary

    spec, arch = request.spec, request.hardware
    assert arch is not None
    target = flag if request.hardware_key == "--hardware" else None
    name = target or arch_label(arch)
    sides = host_sides(own)
    problems = hardware_problems(spec, arch, sides, request.keys)
    if report["recipe"] is not None:  # None: read from the host's own keys
        report["recipe"]["hardware"] = arch
    report["hardware"] = {
        "target": arch,
        "stated_by": request.hardware_key,
        "gpu": target,
        "runs": side_summary(spec, arch),
        "problems": [
            {
                "level": p.level,
                "key": p.key,
                "side": p.side,
                "message": p.message,
                "recipe": p.recipe,
                "change": p.change,
            }
            for p in problems
        ],
    }
    report["warnings"] += [f"{request.hardware_key} {name}: {p.message}" for p in problems]
    runs = report["hardware"]["runs"]
    report.setdefault("notes", []).append(
        f"on {name}: " + "; ".join(f"{side}: {runs[side]}" for side in sides)
    )


def _near_request_keys(config: dict) -> list[str]:
    """``precison: fp8_blockwise``: a key one typo away from a request key, holding one of
    our recipe names, is almost certainly the request that was meant."""
    from .errors import suggest

    reg = default_registry()
    out = []
    for section, keys in (
        (config, ("precision", "mixed_precision", "fp8")),
        (config.get("policy"), ("precision",)),
    ):
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


_QAT_NO_TABLES = (
    "per-layer tables not shown: under ModelOpt QAT (preset {}) the ModelOpt quant_cfg file "
    "decides which modules quantize, and the rollout keeps policy.generation.real_quant_ignore "
    "in BF16"
)
"""Why ``explain`` shows no per-layer table for a ``qat`` request (the TE rules do not apply)."""


def _layers_section(spec, description) -> tuple[list[dict], list[str], list[str]]:
    """Every module's decision on both sides, and the rule warnings (a pattern that matches
    nothing on any side is reported once)."""
    from .rules import SIDES, resolve

    resolutions = {side: resolve(spec, description, side) for side in SIDES}
    layers = [d.to_dict() for side in SIDES for d in resolutions[side].decisions]
    active = [
        s
        for s in SIDES
        if spec.bf16_layers.acts_on(s)
        and (spec.training if s == "training" else spec.generation) == "fp8"
    ]
    nowhere = (
        set.intersection(*(set(resolutions[s].unmatched_rules) for s in active))
        if active
        else set()
    )
    warnings: list[str] = []
    notes: list[str] = []
    for label in sorted(nowhere):
        warnings.append(f"{label} matches no module of {description.name} (a typo?)")
    # A side's own "matches no" line for a rule reported above is dropped: found through the
    # resolution's record of where it put that line (one probe per rule).
    for side in active:
        res = resolutions[side]
        dropped = {res.unmatched_at[label] for label in nowhere}
        warnings += [w for i, w in enumerate(res.warnings) if i not in dropped]
        notes = list(dict.fromkeys([*notes, *res.notes]))
    return layers, warnings, notes


def _lint_section(report: dict[str, Any], spec, description) -> None:
    """``report["lint"]``: rules matching more than their words say (a ``*`` continuing a
    name), each with the modules it hits; informative, never a warning."""
    from .rules.lint import overreaching_rules

    lint = [r.line for r in overreaching_rules(spec, description)]
    if lint:
        report["lint"] = lint


def _with_hardware(ctx, own: str | None):
    """``(ctx, None)`` with the hardware target in the spec, as ``apply`` has it for the
    config's host ``own`` (the host keys depend on it: NeMo RL's ``use_deep_gemm``, vLLM's
    variables), or ``(ctx, why)`` when that host cannot run the recipe there: ``apply``
    refuses, in the host's terms, and so does every host section (the hardware section says
    what would run)."""
    import dataclasses

    from .hosts.hardware import targeted

    try:
        request = targeted(ctx.request, own)
    except FP8ConfigError as err:
        return ctx, str(err)
    return dataclasses.replace(ctx, request=request), None


def _hosts_section(
    ctx, own: str | None, names: list[str], refusal: str | None = None
) -> dict[str, Any]:
    """Every host's result of the apply pipeline on this config, the config's own host
    first. The own host's refusals propagate (``apply`` would refuse the same way); a
    hardware target the recipe cannot run on is every host's refusal (``refusal``).
    Another host's refusal says whether that host refuses the recipe itself
    (``refuses_recipe``: whatever the config) or only this config, which is not written
    for it. The model-shape warnings are the report's, not repeated per host."""
    from .hosts import get_adapter, run

    out: dict[str, Any] = {}
    for name in ([own] if own else []) + [n for n in names if n != own]:
        adapter = get_adapter(name)
        if refusal is not None:  # the target GPU's, for this config's host: not another's
            out[name] = {"refused": refusal, "refuses_recipe": own is None or name == own}
            continue
        try:
            result = run(adapter, ctx)
            # the pipeline's own warnings (the model's shape) name no host: shown once, above
            result.warnings = [w for w in result.warnings if w.host]
            out[name] = result.summary()
        except ConflictingKeyError:
            raise
        except FP8ConfigError as err:
            if name == own:
                raise
            out[name] = {"refused": str(err), "refuses_recipe": _refuses_recipe(adapter, ctx)}
    return out


def _refuses_recipe(adapter, ctx) -> bool:
    """Whether ``adapter`` refuses the config's recipe on its own, with no config around it
    (:func:`~nemo_fp8_plugin.hosts.recipe_keys`' refusal)."""
    try:
        adapter.refuse(ctx.spec, None)
    except FP8ConfigError:
        return True
    return False


def _raise_strict(report: dict[str, Any]) -> None:
    found = list(report.get("warnings", []))
    for section in report.get("hosts", {}).values():
        found += section.get("warnings", [])  # each names its host
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise FP8ConfigError(
            found[0] + more,
            key="--strict",
            hint="fix the rules, or drop --strict to see every warning",
        )


def _recipe_section(request: FP8Request) -> dict[str, Any]:
    spec = request.spec
    reg = default_registry()
    base = spec.name
    recipe = spec.to_dict()
    if base in reg:
        recipe["description"] = _described(reg.get(base).to_dict(), recipe)
    return {
        "recipe": recipe,
        "recipe_source": reg.source(base) if base in reg else "derived",
        "keys": list(request.keys),
        "model": request.model,
        "warnings": [f"{f.key}: {f.message}" for f in spec.findings() if f.level == "warning"],
    }


_GENERATION_SIDE = (
    "generation",
    "kv_cache",
    "generation_numerics",
    "importance_sampling",
    "router_replay",
)
"""Recipe fields only a host that generates reads (vLLM, NeMo RL): hidden for a config whose
host only trains, unless ``--all-hosts`` / ``--full``."""


_SCALAR_FIELDS_SKIPPED = ("name", "description", "hardware")
"""Fields that never make a preset's description wrong (the target has its own section)."""


def _described(preset: dict[str, Any], recipe: dict[str, Any]) -> str:
    """The preset's description when the recipe is the preset; otherwise what the request
    changed, since the preset's words (``fp32 scales``) may no longer hold."""
    changed = [
        (k, v)
        for k, v in recipe.items()
        if k not in _SCALAR_FIELDS_SKIPPED and not isinstance(v, dict) and preset.get(k) != v
    ]
    if not changed:
        return str(preset["description"])
    spelt = ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in changed)
    return f"the preset {recipe['name']} changed by the request ({spelt}); its fields below"


_WIDTH = 100
"""Text view width: recipe fields are packed into lines of this many characters."""

_LONG_VALUE = 120
"""A value spelled longer than this is abridged in the default text view (``--full``: whole)."""


def render_text(
    report: dict[str, Any], *, all_hosts: bool = False, full: bool = False, host_given: bool = False
) -> str:
    """The report for a person: warnings first, then the recipe, the model and its layer
    table, then what ``apply`` writes for the config's own host (detected, or ``--host``),
    other hosts in one line each. ``all_hosts`` shows every host's keys; ``full`` also lists
    every recipe field on its own line and every value whole; ``host_given``: the host came
    from ``--host``, not from the config's shape. ``--json`` has everything."""
    own = report.get("host")
    hosts = report.get("hosts", {})
    from ._io import shown_path

    lines = [f"config: {shown_path(report['config'])}"]
    # which host versions the keys below assume (--stack, else the installed ones)
    stack = (
        f"stack: {report['stack']['name']} ({report['stack']['how']})" if "stack" in report else ""
    )
    recipe = report.get("recipe")
    if recipe is None and "native" in report:
        native = _native_lines(report, full, all_hosts)
        return "\n".join(lines + ([stack] if stack else []) + native) + "\n"
    if recipe is None:
        lines += [stack] if stack else []
        lines += [f"warning: {w}" for w in report.get("warnings", [])]
        return "\n".join(lines) + "\n"
    if own is not None:
        how = "--host" if host_given else "detected from the config's shape; --host NAME to choose"
        lines.append(f"host: {own} ({how})")
    else:
        lines.append("host: none detected from the config's shape (--host NAME shows one)")
    if stack:
        lines[-1] += f"; {stack}"
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    if own is not None and own in hosts:
        lines += [f"warning: {w}" for w in hosts[own].get("warnings", [])]
    # A host that only trains reads no generation-side field: they are hidden for it.
    trains_only = (
        not (all_hosts or full) and own is not None and "generation" not in host_sides(own)
    )
    recipe_lines = _recipe_lines(report, full=full, only_trains=own if trains_only else None)
    lines += recipe_lines[:2]  # name and description
    # What changes and what to check lead; the recipe's fields, the model and its
    # per-layer decisions follow.
    shown = list(hosts) if (all_hosts or full) else [h for h in hosts if h == own]
    for host in shown:
        lines += _host_lines(
            host, hosts[host], own=host == own, full=full, warnings=host != own, detected=own
        )
    rest = [h for h in hosts if h not in shown]
    if rest:
        summary = ", ".join(_host_summary(hosts[h], h, detected=own) for h in rest)
        label = "other hosts" if shown else "hosts"
        lines.append(f"{label} (--host NAME or --all-hosts shows their keys): {summary}")
    lines += ["recipe fields:", *recipe_lines[2:]]
    lines += _model_lines(report, own, all_hosts=all_hosts, full=full)
    lines += [f"lint: {n}" for n in report.get("lint", [])]
    lines += [f"note: {n}" for n in report.get("notes", [])]
    return "\n".join(lines) + "\n"


def _native_lines(report: dict[str, Any], full: bool, all_hosts: bool = False) -> list[str]:
    """A config asking for no recipe but already FP8 in its host's own keys: the recipe they
    spell (what differs from the preset, what the keys cannot tell apart), the keys read,
    and the FP8 keys that map to no recipe of ours. A host that only trains reads no
    generation-side field: they are hidden for it, as for a requested recipe."""
    from .hosts import NO_REQUEST

    native = report["native"]
    host = native["host"]
    read = ", ".join(f"{k}: {_spell(v, full=full)}" for k, v in native["read"].items())
    lines = [f"host: {report.get('host') or host} (its FP8 keys read as {host}'s)"]
    spec = native.get("spec")
    if spec is not None:
        lines.append(f"read from native keys: {spec['name']}  ({read})")
        lines.append(f"  {spec['description']}")
        if native["differs"]:
            changed = ", ".join(
                f"{k}: {_spell(v, full=full)}" for k, v in native["differs"].items()
            )
            lines.append(f"  differs from the {spec['name']} preset: {changed}")
        if native["alike"]:
            lines.append(f"  the same keys also spell: {', '.join(native['alike'])}")
    else:
        lines.append(f"FP8 in native keys, but no recipe of ours: {read or '(see below)'}")
    sides = host_sides(host)
    trains_only = sides == ("training",) and not (all_hosts or full)
    if spec is not None and len(sides) == 1 and not trains_only:
        other = "generation" if sides == ("training",) else "training"
        lines.append(
            f"  ({host}'s keys say nothing of {other}: the {other} fields below are the preset's)"
        )
    lines += [f"  not a recipe of ours: {u}" for u in native["unmatched"]]
    lines += [f"warning: {u}" for u in native.get("ignored", [])]
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    lines.append(
        f"note: {NO_REQUEST}: FP8 in {host}'s own keys, which nemo-fp8 apply leaves as they are"
        if spec is None
        else "note: no `precision:`/`fp8:` request: the config is already FP8 in "
        f"{host}'s own keys, and nemo-fp8 apply leaves it as it is"
    )
    if spec is not None:
        lines += [
            "recipe fields:",
            *_recipe_lines(
                {"recipe": spec, "keys": [], "recipe_source": ""},
                full=full,
                only_trains=host if trains_only else None,
            )[2:],
        ]
    lines += [f"note: {n}" for n in report.get("notes", [])]
    return lines


_DELAYED_ONLY = ("amax_history_len", "amax_compute_algo", "margin", "reduce_amax")
"""Recipe fields only delayed scaling reads (its amax history); shown for other recipes with
``--full`` only."""


def _recipe_lines(
    report: dict[str, Any], *, full: bool, only_trains: str | None = None
) -> list[str]:
    """The recipe: name, where it came from, what it is, its fields (those that matter for its
    kind of scaling; every field with ``full``). ``only_trains``: the config's host, when it
    runs training only (its generation-side fields are hidden)."""
    from .capabilities import capability

    recipe = report["recipe"]
    lines = [
        f"recipe: {recipe['name']}  (requested by {', '.join(report['keys'])}; "
        f"{report['recipe_source']})",
        f"  {recipe['description']}",
    ]
    fields = [(k, v) for k, v in recipe.items() if k not in ("name", "description")]
    if full:
        return lines + [f"  {k:<26} {_spell(v, full=True)}" for k, v in fields]
    groups = _inapplicable(recipe, capability(recipe["scaling"]), only_trains)
    hidden = {k for names, _ in groups for k in names}
    lines += _packed(
        [f"{k}: {_spell(v, full=False)}" for k, v in fields if k not in hidden], indent="  "
    )
    for names, why in groups:
        more = "" if "--all-hosts" in why else "; --full shows them"
        lines.append(f"  ({', '.join(names)}: {why}{more})")
    return lines


_TILES = ("activation_block", "weight_block", "gradient_block")
_TRAINING_ONLY = ("fp8_wgrad", "fp8_dot_product_attention", "fp8_multi_head_attention", "fp8_param")
_GENERATION_ONLY = ("kv_cache", "generation_numerics")


def _inapplicable(
    recipe: dict[str, Any], row, only_trains: str | None = None
) -> list[tuple[tuple[str, ...], str]]:
    """The recipe fields that do not apply to this recipe, grouped with why (its kind of
    scaling, from the capability row; a side it leaves in BF16; the generation side when the
    config's host ``only_trains``)."""
    groups: list[tuple[tuple[str, ...], str]] = []
    if not row.is_delayed:
        groups.append((_DELAYED_ONLY, "read by delayed scaling only"))
    if row.per_tensor and all(recipe.get(k) is None for k in _TILES):
        groups.append((_TILES, f"{recipe['scaling']} scaling has one scale per tensor, no tiles"))
    if recipe.get("training") == "bf16":
        groups.append((_TRAINING_ONLY, "training runs in BF16"))
    if only_trains is not None:
        why = f"{only_trains} only trains; --all-hosts shows them"
        groups.append((_GENERATION_SIDE, why))
    elif recipe.get("generation") == "bf16":
        groups.append((_GENERATION_ONLY, "generation runs in BF16"))
    return groups


def _model_lines(report: dict[str, Any], own: str | None, *, all_hosts: bool, full: bool):
    """The model and the per-layer decisions of the sides ``own`` runs. A side where every
    module is FP8 but the built-in BF16 ones (output head, router) says so in one line
    (``full`` shows the table anyway)."""
    from .rules import render_layer_table

    lines = []
    model = report.get("model_description")
    if model is not None:
        lines.append(
            f"model: {model['name']} ({model['family']}, {model['num_layers']} layers"
            + (f", {model['num_experts']} experts" if model["num_experts"] else "")
            + f"; {model['source']})"
        )
    if not report.get("layers"):
        return lines
    sides = host_sides(own) if not (all_hosts or full) else SIDES
    for side in ("training", "generation"):
        rows = [d for d in report["layers"] if d["side"] == side and side in sides]
        table = render_layer_table(rows)
        uniform = all(
            d.get("rule") in (None, "-") or str(d["rule"]).startswith("builtin:") for d in rows
        )
        if rows and not full and all(d.get("precision") == "bf16" for d in rows):
            lines.append(table[0])
            lines.append(f"  every module in BF16 (the recipe's {side} side); --full lists them")
        elif rows and uniform and not full:
            builtin = sorted(
                {str(d["rule"])[8:] for d in rows if d.get("rule", "-") not in (None, "-")}
            )
            lines.append(table[0])
            lines.append(
                "  every module in FP8"
                + (f" but the built-in BF16 ones ({', '.join(builtin)})" if builtin else "")
                + "; --full lists them"
            )
        else:
            lines += table
    hidden = sorted({d["side"] for d in report["layers"]} - set(sides))
    if hidden:
        lines.append(
            f"({' and '.join(hidden)} side not shown: {own} does not run it; --all-hosts shows it)"
        )
    return lines


def _host_lines(
    host: str,
    section: dict[str, Any],
    *,
    own: bool,
    full: bool,
    warnings: bool,
    detected: str | None = None,
) -> list[str]:
    """One host's section: what ``apply --host`` writes, in the spelling it writes it.
    ``detected``: the config's own host; another host that refuses only this config (not
    the recipe) is "not this host's", with the reason."""
    if "refused" in section:
        state = "refused" if _refuses(section, host, detected) else "not this host's config"
        return [f"apply --host {host}: {state}: {section['refused']}"]
    lines = [f"apply --host {host} writes{' (this config' + chr(39) + 's host)' if own else ''}:"]
    for key, value in _flatten(section.get("keys", {})):
        lines.append(f"  {key}: {_spell(value, full=full)}")
    if section.get("removed"):
        lines.append(f"  removes: {', '.join(section['removed'])}")
    where = (
        "in vLLM's environment, read when it starts: no engine argument"
        if host == "vllm"
        else "in the training process's environment"
    )
    rollout_env = section.get("checks", {}).get("rollout", {}).get("needed", {})
    for key, value in section.get("env", {}).items():
        # what the rollouts need goes where NeMo RL starts: its Ray workers inherit it
        here = "where NeMo RL starts, for its vLLM workers" if key in rollout_env else where
        lines.append(f"  env: {key}={value} ({here})")
    if warnings:
        lines += [f"  warning: {w}" for w in section.get("warnings", [])]
    lines += [f"  note: {n}" for n in section.get("notes", [])]
    return lines


def _refuses(section: dict[str, Any], host: str, detected: str | None) -> bool:
    """A refusal that is the host's own word on the recipe, not on a config written for
    another host (``detected``)."""
    return detected is None or host == detected or bool(section.get("refuses_recipe", True))


def _host_summary(section: dict[str, Any], host: str, detected: str | None = None) -> str:
    if "refused" in section:
        state = "refused" if _refuses(section, host, detected) else "not this host's"
        return f"{host} ({state})"
    count = sum(1 for _ in _flatten(section.get("keys", {})))
    warned = len(section.get("warnings", []))
    more = f", {warned} warning{'s' if warned != 1 else ''}" if warned else ""
    return f"{host} ({count} key{'s' if count != 1 else ''}{more})"


def _spell(value: Any, *, full: bool) -> str:
    """``value`` as YAML spells it in flow style (``true``, ``null``, ``'1'``, ``[128, 128]``):
    the spelling ``apply`` writes. A long list is abridged unless ``full``."""
    import yaml

    text = yaml.safe_dump(
        value, default_flow_style=True, width=1 << 20, allow_unicode=True, sort_keys=False
    ).strip()
    if text.endswith("\n..."):
        text = text[:-4].strip()
    elif text.endswith("..."):
        text = text[:-3].strip()
    if full or len(text) <= _LONG_VALUE or not isinstance(value, list) or len(value) < 3:
        return text
    first, last = (_spell(v, full=True) for v in (value[0], value[-1]))
    return f"[{first}, ..., {last}]  ({len(value)} items; --full lists them)"


def _packed(items: list[str], *, indent: str) -> list[str]:
    lines: list[str] = []
    line = ""
    for item in items:
        if line and len(indent) + len(line) + 2 + len(item) > _WIDTH:
            lines.append(indent + line)
            line = ""
        line = f"{line}  {item}" if line else item
    if line:
        lines.append(indent + line)
    return lines


def _flatten(mapping: dict, prefix: str = ""):
    for key, value in mapping.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            yield from _flatten(value, dotted)
        else:
            yield dotted, value

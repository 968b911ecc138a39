"""``nemo-fp8 doctor [CONFIG]``: can this machine run the FP8 recipe(s), and is it set up?

Reports, for the machine it runs on:

* the stack: which named stack (:data:`nemo_fp8_plugin.stacks.STACKS`: ``nemo-rl-0.6``,
  ``nemo-2.7``, ``latest``) the installed host versions are, whether each version is one the
  plugin is tested against, and, when the set is no named stack, what to change to make it the
  nearest one (``--stack NAME`` checks against a named stack instead);
* GPU architecture and CUDA (from torch, when torch is installed), and the versions of
  torch, Transformer Engine, megatron-core, NeMo, NeMo-Run, Megatron-Bridge and vLLM (from
  package metadata: no host is imported), and of this plugin;
* whether the plugin's entry points (NeMo-Run's ``nemo_run.cli``, vLLM's
  ``vllm.general_plugins``) are visible to those hosts here, and which recipes other packages
  add through the ``nemo_fp8_plugin.recipes`` group;
* for each recipe (the one CONFIG asks for, else every registered recipe): whether it can run
  here under the hardware rules (MXFP8 needs Blackwell; block scaling needs Hopper with CUDA
  >= 12.9 or Blackwell with power-of-2 scales; ...) and the Transformer Engine version;
* the environment variables the recipe needs (``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``, ...):
  whether they are set in this shell, and, when Transformer Engine is importable, whether
  TE's effective quantizer parameters in this process match the recipe. A vLLM config
  (which runs no training) is checked for what vLLM needs instead: the variables vLLM reads
  when it starts (``VLLM_USE_DEEP_GEMM_E8M0=0``, ...: ``engine_env``), the recipe's refusals
  for vLLM, and vLLM's version; no Transformer Engine check, no exit 3.

Whatever it could not check (no GPU, no TE) is listed plainly under "not checked". Exit code
0 when it could report (even if a recipe cannot run here), 2 for bad input.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings
from importlib import metadata
from typing import Any

from ..stacks import DISTRIBUTIONS

PACKAGES = DISTRIBUTIONS
"""Reported package -> distribution names that provide it (first installed one wins): the
stacks table's. The oldest Transformer Engine each scaling kind needs is a fact of that table
too (the recipe class's entry, asked through :func:`nemo_fp8_plugin.stacks.lookup`)."""

MIN_CUDA_BLOCK = (12, 9)
"""Block-scaled GEMMs on Hopper need cuBLAS from CUDA 12.9."""

ENTRY_POINTS = (
    (
        "nemo_run.cli",
        "fp8",
        "nemo_fp8_plugin.hosts.nemo2.factories",
        "nemo-run",
        "NeMo-Run loads it when the `nemo` command starts (the <model>_<recipe> factories)",
    ),
    (
        "vllm.general_plugins",
        "nemo_fp8",
        "nemo_fp8_plugin.hosts.vllm:register",
        "vllm",
        "vLLM loads it in every process it starts (the nemo_fp8 quantization method)",
    ),
)
"""The plugin's own entry points: (group, name, target, host package, what loading does)."""


def register(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this machine against the FP8 recipe(s) before a run",
        description="Report GPU, CUDA and host-package versions, whether each recipe (the "
        "config's, else all) can run on this machine, and whether the environment "
        "variables it needs are set and effective. Says what it could not check. "
        "Exit code 1 when the config's recipe cannot run here.",
    )
    p.add_argument("config", nargs="?", default=None, help="a YAML config (optional)")
    p.add_argument(
        "--hardware",
        default=None,
        help="judge the recipes for this GPU (h100, b200, ...) instead of this machine's",
    )
    p.add_argument(
        "--stack",
        default=None,
        metavar="NAME",
        help="check the installed versions against this named stack (nemo-rl-0.6, nemo-2.7, "
        "latest) instead of the one they match",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=run)


# --------------------------------------------------------------------------- probes


def package_versions() -> dict[str, str | None]:
    """Installed version of each package of :data:`PACKAGES`, None when absent."""
    from ..stacks import installed_versions

    return installed_versions()


def stack_report(versions: dict[str, str | None], stack: str | None = None) -> dict[str, Any]:
    """Which named stack ``versions`` is (or, with ``stack``, how it differs from that one),
    whether each version is tested, and what to change when the set is no tested stack."""
    from ..stacks import TESTED, Stack, get_stack, match_stack, misfits

    match = match_stack(versions)
    have = {h: v for h, v in versions.items() if v}
    named: Stack | None
    name: str | None
    if stack is not None:
        named = get_stack(stack)
        changes = misfits(named, have)
        name, how = named.name, "chosen with --stack"
        is_it = not changes
    else:
        named = match.stack or match.nearest
        changes = list(match.changes)
        name = match.stack.name if match.stack is not None else None
        how = "detected from the installed packages"
        is_it = match.stack is not None
    hosts = {
        host: {
            "version": version,
            "tested": host not in match.untested,
            "tested_versions": list(TESTED.get(host, ())),
        }
        for host, version in have.items()
    }
    for host, version in match.untested.items():
        tested = ", ".join(TESTED[host])
        changes.append(
            f"{host} {version} is not a version the plugin is tested against (tested: {tested}); "
            f"its facts come from upstream source only"
        )
    return {
        "name": name,
        "how": how,
        "matches": is_it,
        "tested": is_it and not match.untested,
        "nearest": named.name if named is not None else None,
        "hosts": hosts,
        "changes": changes,
    }


def plugin_info() -> dict[str, Any]:
    """This plugin's version and where it is imported from."""
    from pathlib import Path

    import nemo_fp8_plugin

    try:
        installed: str | None = metadata.version("nemo-fp8-plugin")
    except metadata.PackageNotFoundError:
        installed = None
    return {
        "version": getattr(nemo_fp8_plugin, "__version__", None),
        "installed": installed,
        "path": str(Path(nemo_fp8_plugin.__file__).parent),
    }


def entry_points(versions: dict[str, str | None]) -> list[dict[str, Any]]:
    """Whether each of the plugin's entry points is visible to the host that loads it (package
    metadata only: nothing is loaded), and the recipes other packages add."""
    out: list[dict[str, Any]] = []
    for group, name, target, host, loads in ENTRY_POINTS:
        found = [ep for ep in metadata.entry_points(group=group) if ep.name == name]
        visible = any(ep.value == target for ep in found)
        problems = []
        if not visible:
            problems.append(
                f"not visible: install the package (`pip install nemo-fp8-plugin`, or "
                f"`pip install -e .` in a checkout) so {host} can find it"
                if not found
                else f"{group} {name} names {found[0].value}, not "
                f"{target} (another package, or a stale install)"
            )
        if (
            host == "vllm"
            and os.environ.get("VLLM_PLUGINS") is not None
            and name not in {p.strip() for p in os.environ["VLLM_PLUGINS"].split(",")}
        ):
            problems.append(
                f"VLLM_PLUGINS={os.environ['VLLM_PLUGINS']!r} leaves {name} out: "
                "vLLM will not load it"
            )
        out.append(
            {
                "group": group,
                "name": name,
                "target": target,
                "visible": visible,
                "host": host,
                "host_version": versions.get(host),
                "loads": loads,
                "problems": problems,
            }
        )
    from ..registry import ENTRY_POINT_GROUP

    others = [
        {
            "name": ep.name,
            "target": ep.value,
            "distribution": ep.dist.name if ep.dist is not None else None,
        }
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
    ]
    out.append({"group": ENTRY_POINT_GROUP, "recipes": others})
    return out


def _version_tuple(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = []
    for piece in text.replace("+", ".").split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


def arch_of(capability: tuple[int, ...]) -> str | None:
    """SM capability -> the spec's architecture name (None for GPUs without FP8), from the
    capability table (:func:`nemo_fp8_plugin.capabilities.arch_of_capability`)."""
    from ..capabilities import arch_of_capability

    arch = arch_of_capability(capability[0], capability[1])
    return arch.name if arch is not None and arch.fp8 else None


def gpu_info() -> dict[str, Any]:
    """GPU name, capability, architecture and CUDA version torch was built with."""
    info: dict[str, Any] = {"torch": None, "cuda": None, "gpus": [], "arch": None}
    try:
        with warnings.catch_warnings():  # torch.cuda's pynvml deprecation notice is noise here
            warnings.simplefilter("ignore", FutureWarning)
            import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver is reported as "no GPU"
        count = 0
    for i in range(count):
        cap = tuple(torch.cuda.get_device_capability(i))
        info["gpus"].append(
            {
                "index": i,
                "name": torch.cuda.get_device_name(i),
                "capability": f"sm{cap[0]}{cap[1]}",
                "arch": arch_of(cap),
            }
        )
    if info["gpus"]:
        info["arch"] = info["gpus"][0]["arch"]
    return info


def _te_recipe_module():
    """TE's recipe module as a training process would import it, or (None, reason)."""
    try:
        from transformer_engine.common import recipe
    except Exception as exc:  # ImportError, or TE's own load-time checks
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".strip()
    return recipe, None


# --------------------------------------------------------------------------- report


def check_recipe(
    spec,
    arch: str | None,
    versions: dict,
    gpu: dict,
    te_module,
    te_reason: str | None,
    hardware_given: bool,
    host: str | None = None,
) -> dict[str, Any]:
    """One recipe's verdict: ``runnable`` (True / False / None = not checked) and why.

    ``host`` is the host the config is written for (:func:`nemo_fp8_plugin.hosts.detect_host`).
    A vLLM config runs no training: Transformer Engine and its ``NVTE_*`` variables are not
    its concern; the variables vLLM reads at start-up (``engine_env``) and vLLM's version are.
    """
    from ..capabilities import capability
    from ..errors import FP8ConfigError
    from ..hosts.te import TE_RECIPE_CLASS, required_env, verify_host_recipe
    from ..stacks import lookup

    problems: list[str] = []
    notes: list[str] = []
    not_checked: list[str] = []
    runnable: bool | None = True
    if arch is None:
        runnable = None
        not_checked.append(
            "hardware rules: no GPU here (pass --hardware to judge for a target GPU)"
        )
    else:
        try:
            judged = spec.replace(hardware=arch)
            # a finding that points at this command is checked below, not advised
            notes += [
                f"{f.key}: {f.message}"
                for f in judged.findings()
                if f.level == "warning" and "nemo-fp8 doctor" not in f.message
            ]
        except FP8ConfigError as err:
            runnable = False
            problems.append(str(err))
    if capability(spec.scaling).is_block and arch == "hopper":
        cuda = _version_tuple(gpu.get("cuda"))
        if cuda is None:
            not_checked.append("CUDA version (torch reports none)")
        elif cuda < MIN_CUDA_BLOCK:
            runnable = False
            problems.append(
                f"block scaling on Hopper needs CUDA >= 12.9; torch here is built "
                f"with CUDA {gpu.get('cuda')}"
            )
    if host == "vllm":
        return _vllm_verdict(spec, versions, runnable, problems, notes, not_checked, hardware_given)
    te_version = versions.get("transformer-engine")
    if spec.training == "fp8":
        has_class = lookup("transformer-engine", TE_RECIPE_CLASS[spec.scaling], te_version)
        if te_version is None:
            if runnable:
                runnable = None
            not_checked.append("Transformer Engine version (not installed here)")
        elif has_class.present is False and has_class.fact is not None:
            runnable = False
            problems.append(
                f"{spec.scaling} scaling needs Transformer Engine >= "
                f"{has_class.fact.minimum} ({TE_RECIPE_CLASS[spec.scaling]}), found {te_version}"
            )
    env = []
    for var, want in required_env(spec).items():
        have = os.environ.get(var)
        env.append(_env_entry(var, want, have))
    effective: bool | None = None
    # NVFP4's TE defaults come from NVTE_NVFP4_* at import, as block/current scaling's do.
    if spec.training == "fp8" and (
        capability(spec.scaling).te_env is not None or capability(spec.scaling).is_nvfp4
    ):
        if te_module is None:
            not_checked.append(f"TE's effective quantizer parameters ({te_reason})")
        else:
            try:
                verify_host_recipe(spec, te_module, where="this process", te_version=te_version)
                effective = True
            except FP8ConfigError as err:
                effective = False
                runnable = False  # it would run, with the wrong scales: the callback refuses it
                problems.append(str(err))
    if hardware_given and arch is not None:
        notes.append(f"judged for --hardware {arch}, not for this machine")
    return {
        "recipe": spec.name,
        "scaling": spec.scaling,
        "training": spec.training,
        "host": host,
        "runnable": runnable,
        "problems": problems,
        "notes": notes,
        "env": env,
        "env_effective": effective,
        "not_checked": not_checked,
    }


def _vllm_verdict(
    spec,
    versions: dict,
    runnable: bool | None,
    problems: list[str],
    notes: list[str],
    not_checked: list[str],
    hardware_given: bool,
) -> dict[str, Any]:
    """The verdict for a vLLM config: the generation side only. Its variables are the ones
    vLLM reads when it starts (``engine_env``: DeepGEMM's E8M0 mode, FlashInfer's block
    kernel), checked in this shell; the recipe's own refusals for vLLM (``refuse_spec``) are
    problems; vLLM's version is named, or listed as not checked."""
    from ..errors import FP8ConfigError
    from ..hosts.vllm import engine_env, refuse_spec

    try:
        refuse_spec(spec)
    except FP8ConfigError as err:
        runnable = False
        problems.append(str(err))
    if versions.get("vllm") is None:
        if runnable:
            runnable = None
        not_checked.append("vLLM version (not installed here)")
    env = [
        dict(_env_entry(var, want, os.environ.get(var)), where="where vLLM starts")
        for var, want in engine_env(spec).items()
    ]
    if hardware_given:
        notes.append("judged for --hardware, not for this machine")
    return {
        "recipe": spec.name,
        "scaling": spec.scaling,
        "training": spec.training,
        "host": "vllm",
        "runnable": runnable,
        "problems": problems,
        "notes": notes,
        "env": env,
        "env_effective": None,
        "not_checked": not_checked,
    }


def build_report(
    config: str | None = None, hardware: str | None = None, stack: str | None = None
) -> dict[str, Any]:
    """The doctor report (the ``--json`` output)."""
    from ..registry import list_recipes
    from ..spec import normalize_hardware

    target = normalize_hardware(hardware, key="--hardware") if hardware else None
    stated, dims, host = None, [], None
    if config is not None:
        from ..hosts import detect_host, load_context
        from ..hosts.alignment import dimension_findings
        from ..hosts.nemo_rl.values import resolved_value

        # A target the config states that its recipe cannot run on is a verdict (exit 1),
        # not bad input; model sizes the recipe's GEMMs cannot take are one too.
        ctx = load_context(config, check_hardware=False)
        host = detect_host(ctx.resolved)
        request = ctx.request
        specs = [request.spec] if request is not None else []
        stated = request.hardware if request is not None else None
        if request is not None and ctx.model is not None:
            dims = dimension_findings(request.spec, ctx.model, ctx.resolved, resolved_value)
    else:
        specs = list_recipes()
    versions = package_versions()
    stack_info = stack_report(versions, stack)
    gpu = gpu_info()
    arch = target or gpu["arch"] or stated
    te_module, te_reason = (None, "Transformer Engine is not installed")
    if versions.get("transformer-engine"):
        te_module, te_reason = _te_recipe_module()
    machine_not_checked = []
    if not gpu["gpus"]:
        machine_not_checked.append(
            "GPU architecture: no CUDA GPU visible to torch"
            if gpu["torch"]
            else "GPU: torch is not installed"
        )
    if te_module is None and host != "vllm":  # a vLLM config runs no TE
        machine_not_checked.append(f"Transformer Engine at run time: {te_reason}")
    return {
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "gpus": gpu["gpus"],
            "arch": gpu["arch"],
            "cuda": gpu["cuda"],
            "target_arch": arch,
        },
        "packages": versions,
        "stack": stack_info,
        "plugin": plugin_info(),
        "entry_points": entry_points(versions),
        "config": config,
        "recipes": [
            _with_dims(
                check_recipe(
                    s, arch, versions, gpu, te_module, te_reason, target is not None, host
                ),
                dims,
            )
            for s in specs
        ],
        "not_checked": machine_not_checked,
    }


def _with_dims(verdict: dict[str, Any], dims) -> dict[str, Any]:
    """A recipe's verdict with the model dimensions its GEMMs cannot take (errors: it cannot
    run, whatever the GPU) and those that cost (warnings)."""
    for f in dims:
        if f.level == "error":
            verdict["runnable"] = False
            verdict["problems"].append(f"{f.key}: {f.message}")
        else:
            verdict["notes"].append(f"{f.key}: {f.message}")
    return verdict


def _stack_lines(stack: dict[str, Any]) -> list[str]:
    if stack["matches"]:
        state = "a tested stack" if stack["tested"] else "a named stack, with untested versions"
        lines = [f"stack: {stack['name']} ({stack['how']}): {state}"]
    elif stack["how"] == "chosen with --stack":
        lines = [f"stack: {stack['name']} (chosen with --stack): the installed versions differ"]
    else:
        nearest = f"; nearest: {stack['nearest']}" if stack["nearest"] else ""
        lines = [f"stack: none of the named stacks ({stack['how']}){nearest}: untested set"]
    lines += [f"  change: {c}" for c in stack["changes"]]
    return lines


def render_text(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"python {m['python']} on {m['platform']}"]
    if m["gpus"]:
        for g in m["gpus"]:
            lines.append(
                f"gpu {g['index']}: {g['name']} ({g['capability']}, {g['arch'] or 'pre-Ada'})"
            )
    else:
        lines.append("gpu: none visible")
    lines.append(f"cuda (torch build): {m['cuda'] or 'none'}")
    lines += _stack_lines(report["stack"])
    hosts = report["stack"]["hosts"]
    for name, version in report["packages"].items():
        state = ""
        if version and name in hosts and hosts[name]["tested_versions"]:
            state = " (tested)" if hosts[name]["tested"] else " (UNTESTED)"
        lines.append(f"{name:<18} {version or 'not installed'}{state}")
    plugin = report["plugin"]
    lines.append(
        f"{'nemo-fp8-plugin':<18} {plugin['version']} (imported from {plugin['path']}"
        + ("" if plugin["installed"] else "; not installed as a package")
        + ")"
    )
    for ep in report["entry_points"]:
        if "recipes" in ep:
            names = ", ".join(f"{r['name']} ({r['distribution']})" for r in ep["recipes"])
            lines.append(
                f"entry point group {ep['group']}: "
                + (
                    f"recipes from other packages: {names}"
                    if names
                    else "no other package adds recipes"
                )
            )
            continue
        state = "visible" if ep["visible"] else "NOT visible"
        host = (
            f"{ep['host']} {ep['host_version']} is installed: {ep['loads']}"
            if ep["host_version"]
            else f"{ep['host']} is not installed here"
        )
        lines.append(f"entry point {ep['group']} {ep['name']}: {state}; {host}")
        for p in ep["problems"]:
            lines.append(f"  problem: {p}")
    if report["config"]:
        from .._io import shown_path

        lines.append(f"config: {shown_path(report['config'])}")
        if not report["recipes"]:
            lines.append("  asks for no FP8 recipe")
    verdict = {True: "can run here", False: "CANNOT run here", None: "not fully checked"}
    for r in report["recipes"]:
        where = f" on {m['target_arch']}" if m["target_arch"] else ""
        lines.append(f"recipe {r['recipe']} ({r['scaling']}): {verdict[r['runnable']]}{where}")
        for p in r["problems"]:
            lines.append(f"  problem: {p}")
        for n in r["notes"]:
            lines.append(f"  note: {n}")
        lines += _env_lines(r["env"])
        if r["env_effective"] is not None:
            te_state = "match the recipe" if r["env_effective"] else "DO NOT match the recipe"
            lines.append(f"  TE quantizer parameters in this process: {te_state}")
        for n in r["not_checked"]:
            lines.append(f"  not checked: {n}")
    for n in report["not_checked"]:
        lines.append(f"not checked: {n}")
    lines += _works_here(report)
    if len(report["recipes"]) > 1:
        groups = {
            v: [r["recipe"] for r in report["recipes"] if r["runnable"] is v]
            for v in (True, False, None)
        }
        parts = [
            f"{label}: {', '.join(groups[v])}"
            for v, label in ((True, "can run here"), (False, "cannot"), (None, "not fully checked"))
            if groups[v]
        ]
        lines.append(f"summary: {'; '.join(parts)}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from .._io import dump_json

    report = build_report(args.config, hardware=args.hardware, stack=args.stack)
    sys.stdout.write(dump_json(report) if args.json else render_text(report))
    # A config's own recipe that cannot run here fails the check, so scripts can gate a launch
    # on it; without a config the report surveys every recipe and judges none.
    if args.config and any(r["runnable"] is False for r in report["recipes"]):
        return 1
    # FP8 training asked for, and no Transformer Engine here to run it: not a verdict on the
    # recipe, but a launch script gating on doctor must not go ahead (docs/recipes.md). With
    # --hardware the report judges another machine, whose TE this one cannot see.
    if args.config and not args.hardware and _training_without_te(report):
        return EXIT_NO_TE
    return 0


EXIT_NO_TE = 3
"""``doctor CONFIG``'s exit code when the config trains in FP8 and Transformer Engine is not
installed and no ``--hardware`` moves the judgement elsewhere (1: the recipe cannot run here;
2: bad input; 0: nothing found against it)."""

TE_ENV_DEFAULTS = {
    "NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0",
    "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": "0",
    "NVTE_NVFP4_DISABLE_RHT": "0",
    "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "0",
    "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "0",
    "NVTE_NVFP4_ROW_SCALED_ACTIVATION": "0",
    "NVTE_NVFP4_4OVER6": "none",
    "NVTE_NVFP4_4OVER6_E4M3_USE_256": "all",
    "NVTE_NVFP4_4OVER6_ERR_MODE": "MAE",
}
"""The value TE 2.20.2 reads when a variable is unset (``os.getenv(NAME, default)`` in
``transformer_engine/common/recipe/__init__.py``): an unset variable whose default is what the
recipe needs is no action for the user."""


def _env_entry(var: str, want: str, have: str | None) -> dict[str, Any]:
    """One variable of a recipe: what it needs, what this shell has, and whether TE's
    default (when unset) already gives it."""
    return {
        "name": var,
        "needed": want,
        "value": have,
        "set": have == want,
        "te_default": TE_ENV_DEFAULTS.get(var) == want,
    }


def _env_lines(env: list[dict[str, Any]]) -> list[str]:
    """A line per variable the user must act on; variables left unset whose TE default is
    the value needed are summed up on one line rather than listed as "needed: unset"."""
    lines, by_default = [], []
    for e in env:
        if e["value"] is None and e.get("te_default"):
            by_default.append(e["name"])
            continue
        state = "set" if e["set"] else (f"is {e['value']!r}" if e["value"] is not None else "unset")
        where = e.get("where", "in the training process")
        lines.append(f"  env {e['name']}={e['needed']} needed {where}: {state} in this shell")
    if by_default:
        lines.append(
            f"  env: {len(by_default)} variable(s) unset here, which is fine: TE's default is "
            f"the value the recipe needs ({', '.join(by_default)})"
        )
    return lines


def _training_without_te(report: dict[str, Any]) -> bool:
    # a vLLM config generates only: its FP8 training flag is for a trainer it does not run
    trains = any(r.get("training") == "fp8" and r.get("host") != "vllm" for r in report["recipes"])
    return trains and not report["packages"].get("transformer-engine")


def _works_here(report: dict[str, Any]) -> list[str]:
    """What does run on this machine, whatever the GPU checks say: the config tools need no
    host, the FP8 emulation and the demo need torch (and megatron-core for the demo)."""
    packages = report["packages"]
    works = ["explain, apply, analyze and recipes (no host needed)"]
    if packages.get("torch"):
        works.append("FP8 emulation (nemo_fp8_plugin.numerics) on torch " + packages["torch"])
        if packages.get("megatron-core"):
            works.append("nemo-fp8 demo (megatron-core " + packages["megatron-core"] + ")")
    return ["works here: " + "; ".join(works)]

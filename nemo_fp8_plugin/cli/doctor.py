"""``nemo-fp8 doctor [CONFIG]``: can this machine run the FP8 recipe(s), and is it set up?

Reports, for the machine it runs on:

* the stack: which named stack (:data:`nemo_fp8_plugin.stacks.STACKS`: ``nemo-rl-0.7.0``,
  ``nemo-2.7``, ``latest``, ...) the installed host versions are (and which NeMo RL release), whether each version is one the
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

The first line is the verdict (:func:`verdict`): ``ready``, ``cannot run here`` or ``cannot
check here`` (no GPU, no Transformer Engine: this is not the machine that trains), with the one
action; the details follow, and what could not be checked is listed with ``-v``. A stack is
"tested" for the hosts installed here only, and a version a container pins is described, never
to be changed. Exit code 0 when it could report (even if a recipe cannot run here), 1 when
the config's recipe cannot run here, 2 for bad input, 3 (:data:`EXIT_NO_TE`).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings
from importlib import metadata
from typing import Any

from ..stacks import DISTRIBUTIONS, parse_version

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
        help="check the installed versions against this named stack (nemo-rl-0.7.0, "
        "nemo-2.7, latest, ...) instead of the one they match",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also list every check this machine could not make, and each recipe in full",
    )
    p.set_defaults(run=run)


# --------------------------------------------------------------------------- probes


def package_versions() -> dict[str, str | None]:
    """Installed version of each package of :data:`PACKAGES`, None when absent."""
    from ..stacks import installed_versions

    return installed_versions()


def stack_report(versions: dict[str, str | None], stack: str | None = None) -> dict[str, Any]:
    """Which named stack ``versions`` is (or, with ``stack``, how it differs from that one):
    the one place doctor matches stacks. ``tested`` holds for the hosts installed here only
    (``installed``; ``absent``: the stack's hosts this machine lacks, so nothing of theirs is
    checked); ``differs`` describes each installed version outside the stack's range and
    each untested one: a container pins its versions, so nothing here says to change one."""
    from ..stacks import TESTED, Stack, assumed_versions, detect_nemo_rl, get_stack, match_stack

    match = match_stack(versions)
    have = {h: v for h, v in versions.items() if v}
    named: Stack | None
    if stack is not None:
        named, how = get_stack(stack), "chosen with --stack"
    else:
        named, how = match.stack or match.nearest, "detected from the installed packages"
    differs = (
        [
            f"{host} {have[host]} is outside {named.name}'s {rng.label}"
            for host, rng in named.ranges.items()
            if host in have and not rng.contains(have[host])
        ]
        if named is not None
        else []
    )
    is_it = named is not None and not differs and (stack is not None or match.stack is not None)
    differs += [
        f"{host} {version} is not a version the plugin is tested against (tested: "
        f"{', '.join(TESTED[host])}): its facts come from upstream source only"
        for host, version in match.untested.items()
    ]
    pinned = list(named.versions) if named is not None else []
    return {
        "name": named.name if named is not None and (is_it or stack is not None) else None,
        "how": how,
        "matches": is_it,
        "tested": is_it and not match.untested,
        "nearest": named.name if named is not None else None,
        "installed": [h for h in pinned if h in have],
        "absent": [h for h in pinned if h not in have],
        "hosts": {
            host: {
                "version": version,
                "tested": host not in match.untested,
                "tested_versions": list(TESTED.get(host, ())),
            }
            for host, version in have.items()
        },
        "differs": differs,
        # the release assumed (--stack's, else found from the versions, else the newest),
        # and whether it is tested
        "nemo_rl": (
            assumed_versions(stack).release if stack is not None else detect_nemo_rl(versions)
        ).summary(),
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
    keys: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One recipe's verdict: ``runnable`` (True / False / None = not checked) and why.

    ``host`` is the host the config is written for (:func:`nemo_fp8_plugin.hosts.detect_host`):
    the hardware rules judge the sides it runs, in its terms (``keys``: the config's request
    keys, where a move to another recipe is spelled).
    A vLLM config runs no training: Transformer Engine and its ``NVTE_*`` variables are not
    its concern; the variables vLLM reads at start-up (``engine_env``) and vLLM's version are.
    """
    from ..capabilities import capability, host_sides
    from ..errors import FP8ConfigError
    from ..hosts.te import TE_RECIPE_CLASS, required_env, verify_host_recipe
    from ..kinds import hardware_problems
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
        for found in hardware_problems(spec, arch, host_sides(host), keys):
            if found.level == "error":
                runnable = False
                problems.append(f"{found.key}: {found.message}")
            elif "nemo-fp8 doctor" not in found.message:  # what it points at is checked below
                notes.append(f"{found.key}: {found.message}")
    if capability(spec.scaling).is_block and arch == "hopper":
        cuda = parse_version(gpu.get("cuda"))
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
    judged = f"judged for --hardware {arch}, not for this machine" if hardware_given else None
    return {
        "recipe": spec.name,
        "scaling": spec.scaling,
        "training": spec.training,
        "host": host,
        "runnable": runnable,
        "problems": problems,
        "notes": notes,
        "judged": judged if arch is not None else None,
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
    return {
        "recipe": spec.name,
        "scaling": spec.scaling,
        "training": spec.training,
        "host": "vllm",
        "runnable": runnable,
        "problems": problems,
        "notes": notes,
        "judged": "judged for --hardware, not for this machine" if hardware_given else None,
        "env": env,
        "env_effective": None,
        "not_checked": not_checked,
    }


def build_report(
    config: str | None = None, hardware: str | None = None, stack: str | None = None
) -> dict[str, Any]:
    """The doctor report (the ``--json`` output); ``verdict`` first (:func:`verdict`)."""
    from ..registry import list_recipes
    from ..spec import normalize_hardware

    target = normalize_hardware(hardware, key="--hardware") if hardware else None
    stated, dims, host, preflight, native = None, [], None, None, None
    keys: tuple[str, ...] = ()
    if config is not None:
        from ..hosts import detect_host, load_context
        from ..hosts.alignment import dimension_findings
        from ..hosts.nemo_rl.values import resolved_value

        # A target the config states that its recipe cannot run on is a verdict (exit 1),
        # not bad input; model sizes the recipe's GEMMs cannot take are one too.
        ctx = load_context(config, check_hardware=False, stack=stack)
        host = detect_host(ctx.resolved)
        request = ctx.request
        native = _native_reading(ctx, host) if request is None else None
        if native is not None and native.spec is not None:  # the keys' recipe is the request
            from ..config import FP8Request

            request = FP8Request(native.spec, keys=())
        specs = [request.spec] if request is not None else []
        stated = request.hardware if request is not None else None
        keys = request.keys if request is not None else ()
        if request is not None and ctx.model is not None:
            dims = dimension_findings(request.spec, ctx.model, ctx.resolved, resolved_value)
        if native is not None:
            dims = [*dims, *_native_findings(native)]
        if host == "nemo-rl" and (request is not None or native is not None):
            from ._doctor_nemo_rl import nemo_rl_run

            refused, preflight = nemo_rl_run(config, ctx, hardware, stack)
            dims = [*dims, *refused]
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
    report: dict[str, Any] = {
        "verdict": {},
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
        "host": host,
        "recipes": [
            _with_dims(
                check_recipe(
                    s, arch, versions, gpu, te_module, te_reason, target is not None, host, keys
                ),
                dims,
            )
            for s in specs
        ],
        "not_checked": machine_not_checked,
    }
    if native is not None and native.spec is None:  # FP8 keys that run no recipe of ours
        report["recipes"].append(_with_dims(_unread_recipe(native, host), dims))
    if preflight is not None:
        from ._doctor_nemo_rl import with_preflight

        checked = report["recipes"][0]
        for var, want in with_preflight(checked, preflight).items():
            entry = _env_entry(var, want, os.environ.get(var))
            checked["env"].append(
                dict(entry, where="where NeMo RL starts (its workers inherit it)")
            )
            if not entry["set"] and target is None:  # this shell is where the job starts
                checked["runnable"] = False
                checked["problems"].append(
                    f"{var}: {entry['value'] or 'unset'} in this shell, and the rollouts "
                    f"need {var}={want} where NeMo RL starts (its workers inherit it)"
                )
    from ._doctor_view import verdict

    report["verdict"] = verdict(report, hardware_given=target is not None)
    return report


def _native_reading(ctx, host: str | None):
    """The recipe a config asking for none spells in its host's own FP8 keys
    (:func:`~nemo_fp8_plugin.hosts.read_native`), or None: doctor checks it as the recipe."""
    from ..hosts import read_native

    return read_native(ctx, host)


def _native_findings(native) -> list:
    """A native key the assumed host release does not read, and FP8 keys no recipe of ours
    spells: errors (the run would not be what the keys say)."""
    from ..spec import Finding

    return [Finding("error", native.host, line) for line in (*native.ignored, *native.unmatched)]


def _unread_recipe(native, host: str | None) -> dict[str, Any]:
    """The verdict entry of a config FP8 in its host's own keys that spell no recipe of ours
    (its problems are the native findings, added by :func:`_with_dims`)."""
    read = ", ".join(f"{k}: {v}" for k, v in native.read)
    return {
        "recipe": f"{native.host}'s own FP8 keys ({read})",
        "scaling": None,
        "training": None,
        "host": host,
        "runnable": True,
        "problems": [],
        "notes": [],
        "judged": None,
        "env": [],
        "env_effective": None,
        "not_checked": [],
    }


def _with_dims(checked: dict[str, Any], dims) -> dict[str, Any]:
    """A recipe's verdict with the model dimensions its GEMMs cannot take (errors: it cannot
    run, whatever the GPU) and those that cost (warnings)."""
    for f in dims:
        if f.level == "error":
            checked["runnable"] = False
            checked["problems"].append(f"{f.key}: {f.message}")
        else:
            checked["notes"].append(f"{f.key}: {f.message}")
    return checked


def run(args: argparse.Namespace) -> int:
    from .._io import dump_json
    from ._doctor_view import render_text, training_without_te

    report = build_report(args.config, hardware=args.hardware, stack=args.stack)
    text = dump_json(report) if args.json else render_text(report, verbose=args.verbose)
    sys.stdout.write(text)
    # A config's own recipe that cannot run here fails the check, so scripts can gate a launch
    # on it; without a config the report surveys every recipe and judges none.
    if args.config and any(r["runnable"] is False for r in report["recipes"]):
        return 1
    # FP8 training asked for, and no Transformer Engine here to run it: not a verdict on the
    # recipe, but a launch script gating on doctor must not go ahead (docs/recipes.md). With
    # --hardware the report judges another machine, whose TE this one cannot see.
    if args.config and not args.hardware and training_without_te(report):
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

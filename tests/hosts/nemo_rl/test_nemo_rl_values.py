"""``${...}`` in a NeMo RL config resolved with NeMo RL's resolvers, under the installed
OmegaConf (2.3) and under OmegaConf 2.4 from its real wheel (``.cache/upstream``), where
``register_new_resolver`` prints a five-line deprecation warning per config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from conftest import IN_CI, REPO, UPSTREAM
from nemo_fp8_plugin.hosts.nemo_rl.values import interpolated

CONFIG = {"tp": 2, "policy": {"divisible_by": "${mul:8, ${tp}}", "top": "${max:${tp}, 3}"}}
RESOLVED = {"tp": 2, "policy": {"divisible_by": 16, "top": 3}}


def test_the_installed_omegaconf_resolves_nemo_rl_interpolations():
    assert interpolated(CONFIG) == RESOLVED


def test_omegaconf_2_4_resolves_them_without_a_deprecation_warning(tmp_path):
    wheels = sorted(UPSTREAM.glob("omegaconf-2.4.*-py3-none-any.whl"))
    if not wheels:
        reason = (
            f"omegaconf 2.4's wheel not in {UPSTREAM} (pip download --no-deps omegaconf==2.4.0)"
        )
        if IN_CI:
            pytest.fail(reason)
        pytest.skip(reason)
    with zipfile.ZipFile(wheels[-1]) as zf:
        zf.extractall(tmp_path / "site")
    code = (
        "import json, sys, omegaconf\n"
        "from nemo_fp8_plugin.hosts.nemo_rl.values import interpolated\n"
        f"out = interpolated({CONFIG!r})\n"
        "print(json.dumps([omegaconf.__version__, out]))\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{REPO}")
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    version, out = json.loads(proc.stdout)
    assert version.startswith("2.4") and out == RESOLVED
    assert "deprecated" not in proc.stderr, proc.stderr

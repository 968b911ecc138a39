"""The stacks table (``nemo_fp8_plugin.stacks``): versions, ranges, the one lookup, detection,
and ``--stack`` on the config-only commands (torch-free)."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, nemo_rl_configs
from nemo_fp8_plugin import stacks
from nemo_fp8_plugin.cli import main
from nemo_fp8_plugin.errors import FP8ConfigError


@pytest.mark.parametrize(
    "text,want",
    [
        ("2.14.1", (2, 14, 1)),
        ("2.20.2+cu12", (2, 20, 2)),
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
        (
            {
                "nemo-rl": "0.6.0",
                "torch": "2.11.0+cu129",
                "transformer-engine": "2.14.1",
                "vllm": "0.25.1",
                "megatron-core": "0.20.1",
            },
            "nemo-rl-0.6",
        ),
        ({"vllm": "0.32.0", "torch": "2.13.0"}, "latest"),
        ({"transformer-engine": "2.20.2", "megatron-core": "0.20.0"}, "latest"),
        ({"megatron-core": "0.16.1", "transformer-engine": "2.20.2"}, None),  # no container
        ({"torch": "2.13.0"}, None),  # no host a stack pins
    ],
)
def test_match_stack(versions, want):
    m = stacks.match_stack(versions)
    assert (m.stack.name if m.stack else None) == want


def test_an_unmatched_set_names_the_nearest_stack_and_the_change():
    m = stacks.match_stack({"megatron-core": "0.16.1", "transformer-engine": "2.20.2"})
    assert m.nearest is not None and m.nearest.name == "nemo-2.7"
    assert m.changes == ("transformer-engine 2.20.2 -> 2.11.0 (>=2.9,<2.12) for stack nemo-2.7",)


def test_every_stack_pins_versions_inside_its_own_ranges():
    for s in stacks.STACKS:
        for host, rng in s.ranges.items():
            assert rng.contains(s.versions[host]), (s.name, host)
        assert stacks.match_stack(s.versions).stack is s


def test_unknown_stack_is_a_config_error():
    with pytest.raises(FP8ConfigError) as err:
        stacks.get_stack("nemo-rl-9")
    assert err.value.key == "--stack" and "nemo-rl-0.6" in err.value.hint


# --------------------------------------------------------------------------- --stack on the CLI


CONFIG = "precision: fp8_blockwise\nmodel: {num_layers: 4}\n"


def test_explain_names_the_stack_it_assumed(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG)
    assert main(["explain", str(cfg), "--stack", "nemo-rl-0.6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"config: {cfg}"
    assert lines[1].startswith("host: megatron (")
    assert lines[1].endswith("; stack: nemo-rl-0.6 (chosen with --stack)")
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
    assert main(["explain", str(path), "--stack", "nemo-rl-0.6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "stack: nemo-rl-0.6 (chosen with --stack)"  # asks for no recipe


# --------------------------------------------------------------------------- docs


DOCS = REPO / "docs" / "hosts"


@pytest.mark.parametrize("page", ["te.md", "megatron.md", "nemo2.md", "bridge.md", "nemo_rl.md"])
def test_host_pages_state_the_tested_versions_per_stack(page):
    text = (DOCS / page).read_text()
    section = text.split("## Tested versions per stack", 1)[1]
    rows = {
        s.name: ln
        for s in stacks.STACKS
        for ln in section.splitlines()
        if ln.startswith(f"| `{s.name}`")
    }
    assert rows, page
    header = section.split("\n|---", 1)[0]
    for name, row in rows.items():  # the versions the page states for a stack are the table's
        te = stacks.get_stack(name).versions.get("transformer-engine")
        if te and "Transformer Engine" in header:
            assert te.rsplit(".", 1)[0] in row or "2.9 to 2.11" in row, (page, name, row)
    if page == "te.md":
        assert all(v in section for v in stacks.TESTED["transformer-engine"])

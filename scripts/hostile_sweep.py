#!/usr/bin/env python3
"""Run hostile and careless inputs through the ``nemo-fp8`` CLI and report how
each ended: ``ok`` (exit 0 with the expected result, or exit 2 with one error line naming
what it should), or what broke (a traceback, several lines, a wrong exit code, a leftover
temp file, a changed input). Each case runs in a child process with a timeout.

    python scripts/hostile_sweep.py [--only SUBSTRING] [--python PYTHON]

Prints one line per case and a summary; exits 1 when any case broke.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO
"""Where the package the children import lives (a test may point it at another tree)."""
BASE = "precision: fp8_blockwise\n"


def _cli(python: str) -> list[str]:
    return [python, "-m", "nemo_fp8_plugin"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SOURCE) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class Case:
    def __init__(
        self,
        name,
        argv,
        *,
        expect_rc=(0, 2),
        needle=None,
        env=None,
        shell=None,
        check=None,
        timeout=120,
    ):
        self.name, self.argv, self.expect_rc, self.needle = name, argv, expect_rc, needle
        self.env, self.shell, self.check, self.timeout = env or {}, shell, check, timeout


def cases(tmp: Path) -> list[Case]:
    out: list[Case] = []
    cfg = tmp / "c.yaml"
    cfg.write_text(BASE)

    # streams
    out.append(
        Case(
            "recipes | head -1",
            None,
            expect_rc=(0,),
            shell="{cli} recipes | head -1 >/dev/null; exit ${{PIPESTATUS[0]}}",
        )
    )
    out.append(
        Case(
            "recipes >&- (stdout closed)",
            None,
            expect_rc=(2,),
            needle="standard output",
            shell="{cli} recipes >&-",
        )
    )
    out.append(
        Case(
            "explain >&- (stdout closed)",
            None,
            expect_rc=(2,),
            needle="standard output",
            shell=f"{{cli}} explain {cfg} >&-",
        )
    )
    uni = tmp / "uni.yaml"
    uni.write_text("# café\nprecision: fp8_blockwise\nname: 'naïve'\n", encoding="utf-8")
    out.append(
        Case(
            "PYTHONIOENCODING=ascii apply non-ASCII",
            ["apply", uni, "--host", "megatron"],
            expect_rc=(2,),
            needle="encoding",
            env={"PYTHONIOENCODING": "ascii"},
        )
    )
    out.append(
        Case(
            "PYTHONIOENCODING=ascii explain non-ASCII",
            ["explain", uni],
            env={"PYTHONIOENCODING": "ascii"},
        )
    )
    # file names
    out.append(
        Case(
            "-o name with a non-UTF-8 byte",
            [
                "apply",
                cfg,
                "--host",
                "megatron",
                "-o",
                os.fsdecode(str(tmp).encode() + b"/out\xff.yaml"),
            ],
            expect_rc=(0,),
        )
    )
    # deep / huge model configs
    deep = tmp / "deep"
    deep.mkdir()
    (deep / "config.json").write_text("[" * 5000 + "]" * 5000)
    out.append(
        Case(
            "--model-config deeply nested",
            ["explain", cfg, "--model-config", deep / "config.json"],
            expect_rc=(2,),
            needle="--model-config",
        )
    )
    fp8model = tmp / "fp8model.yaml"
    fp8model.write_text(f"fp8:\n  recipe: fp8_blockwise\n  model: {deep / 'config.json'}\n")
    out.append(
        Case(
            "fp8.model deeply nested config.json",
            ["explain", fp8model],
            expect_rc=(2,),
            needle="model",
        )
    )
    big = tmp / "big"
    big.mkdir()
    (big / "config.json").write_text('{"num_hidden_layers": ' + "9" * 5000 + "}")
    out.append(
        Case(
            "--model-config 5000-digit integer",
            ["explain", cfg, "--model-config", big / "config.json"],
            expect_rc=(2,),
            needle="--model-config",
        )
    )
    out.append(
        Case(
            "--model 100k characters",
            ["explain", cfg, "--model", "x" * 100_000],
            expect_rc=(2,),
            needle="--model",
            check=lambda p: len(p.stderr) < 2000 or f"message of {len(p.stderr)} bytes",
        )
    )
    # -o JSON
    for name, text in [
        ("1 and '1'", "precision: fp8_blockwise\nm:\n  1: a\n  '1': b\n"),
        ("true and 'true'", "precision: fp8_blockwise\nm:\n  true: a\n  'true': b\n"),
        ("null and 'null'", "precision: fp8_blockwise\nm:\n  null: a\n  'null': b\n"),
        ("NaN", "precision: fp8_blockwise\nlr: .nan\n"),
        ("!!binary", "precision: fp8_blockwise\nblob: !!binary aGVsbG8=\n"),
    ]:
        src = tmp / f"j{len(out)}.yaml"
        src.write_text(text)
        res = tmp / f"j{len(out)}.json"

        def strict_json(p, res=res):
            if p.returncode == 0:
                try:
                    json.loads(
                        res.read_text(),
                        parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)),
                    )
                except Exception as exc:
                    return f"wrote invalid JSON: {exc}"
                return "wrote a result" if "b'" not in res.read_text() else "wrote b'...'"
            return True

        out.append(
            Case(
                f"-o OUT.json: {name}",
                ["apply", src, "--host", "megatron", "-o", res],
                expect_rc=(2,),
                check=strict_json,
            )
        )
    # read-only outputs
    ro = tmp / "ro.yaml"
    ro.write_text(BASE)
    ro.chmod(0o444)
    out.append(
        Case(
            "--in-place on a 0444 file",
            ["apply", ro, "--host", "megatron", "--in-place"],
            expect_rc=(2,),
            needle=str(ro),
        )
    )
    ro_out = tmp / "ro_out.yaml"
    ro_out.write_text("old\n")
    ro_out.chmod(0o444)
    out.append(
        Case(
            "-o a 0444 file",
            ["apply", cfg, "--host", "megatron", "-o", ro_out],
            expect_rc=(2,),
            needle=str(ro_out),
        )
    )
    # defaults:
    for i, (parent_name, ref) in enumerate([("b.YAML", "b.YAML"), ("b.json", "b.json")]):
        d = tmp / f"defaults{i}"
        d.mkdir()
        (d / parent_name).write_text(
            '{"fp8": {"recipe": "nonexistent_recipe"}}'
            if parent_name.endswith("json")
            else "fp8:\n  recipe: nonexistent_recipe\n"
        )
        (d / "child.yaml").write_text(f"defaults: {ref}\nprecision: fp8_blockwise\n")
        out.append(
            Case(
                f"defaults: {ref} (parent followed and checked)",
                ["explain", d / "child.yaml"],
                expect_rc=(2,),
            )
        )
    d = tmp / "defaults_list"
    d.mkdir()
    (d / "child.yaml").write_text("defaults: [a.yaml, 3]\nprecision: fp8_blockwise\n")
    (d / "a.yaml").write_text("x: 1\n")
    out.append(
        Case(
            "defaults: list with a non-string",
            ["explain", d / "child.yaml"],
            expect_rc=(2,),
            needle="defaults",
        )
    )
    sur = tmp / "sur.json"
    sur.write_text('{"precision": "fp8_blockwise", "name": "\\ud83d\\ude00"}')
    out.append(Case("JSON with a surrogate pair", ["explain", sur], expect_rc=(0,)))
    # bench --json FIFO with no reader: refused before any work
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    out.append(
        Case(
            "bench --json FIFO (no reader)",
            ["bench", "--quick", "--json", fifo],
            expect_rc=(2,),
            needle="--json",
            timeout=20,
        )
    )
    # demo: each value in range, product huge
    demo = tmp / "demo.yaml"
    demo.write_text(
        "precision: fp8_blockwise\nmodel:\n  num_layers: 4\n  hidden_size: 1024\n"
        "  ffn_hidden_size: 4096\n  num_attention_heads: 128\n  seq_length: 8192\n"
        "  vocab_size: 65536\ntrain:\n  micro_batch_size: 512\n  steps: 1\n"
    )
    out.append(
        Case(
            "demo with a terabyte-sized model",
            ["demo", demo, "--out", tmp / "demo_out", "--recipes", "fp8_blockwise"],
            expect_rc=(2,),
            needle="GiB",
            timeout=60,
        )
    )
    return out


def run_case(case: Case, python: str) -> tuple[str, str]:
    cli = " ".join(_cli(python))
    env = _env(**case.env)
    try:
        if case.shell:
            proc = subprocess.run(
                ["bash", "-c", case.shell.format(cli=cli)],
                capture_output=True,
                env=env,
                timeout=case.timeout,
            )
        else:
            proc = subprocess.run(
                _cli(python) + [os.fspath(a) for a in case.argv],
                capture_output=True,
                env=env,
                timeout=case.timeout,
            )
    except subprocess.TimeoutExpired:
        return "broke", f"no answer within {case.timeout} s"
    proc.stderr = proc.stderr.decode("utf-8", "replace")
    if "Traceback" in proc.stderr:
        return "broke", "traceback: " + proc.stderr.strip().splitlines()[-1][:200]
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    if proc.returncode not in case.expect_rc:
        return "broke", f"exit {proc.returncode}: {proc.stderr.strip()[:200]}"
    if proc.returncode == 2 and len(lines) != 1:
        return "broke", f"{len(lines)} error lines"
    if case.needle and proc.returncode == 2 and case.needle not in proc.stderr:
        return "broke", f"message does not name {case.needle!r}: {proc.stderr.strip()[:200]}"
    if case.check is not None:
        verdict = case.check(proc)
        if verdict is not True:
            return "broke", str(verdict)
    return "ok", f"exit {proc.returncode}" + (f": {lines[0][:120]}" if lines else "")


_SIGTERM_MID_WRITE = """
import os, signal, sys
real = os.fsync
def fsync_then_sigterm(fd):
    real(fd)
    os.kill(os.getpid(), signal.SIGTERM)
os.fsync = fsync_then_sigterm
from nemo_fp8_plugin.cli import main
sys.exit(main(sys.argv[1:]))
"""


def sigterm_case(tmp: Path, python: str) -> tuple[str, str]:
    """SIGTERM while apply writes (between the temp file's fsync and its rename): nothing
    is left behind, neither a ``.NAME.nemo-fp8-write-XXXXXXXX.tmp`` nor a half-written result."""
    cfg = tmp / "sig.yaml"
    cfg.write_text(BASE)
    out = tmp / "sigout"
    out.mkdir()
    proc = subprocess.run(
        [
            python,
            "-c",
            _SIGTERM_MID_WRITE,
            "apply",
            str(cfg),
            "--host",
            "megatron",
            "-o",
            str(out / "r.yaml"),
        ],
        env=_env(),
        capture_output=True,
        timeout=120,
    )
    left = [p.name for p in out.iterdir()]
    if left:
        return "broke", f"exit {proc.returncode}, left {left}"
    return "ok", f"exit {proc.returncode}, nothing left"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None)
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    broke = tried = 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        todo = [(c.name, lambda c=c: run_case(c, args.python)) for c in cases(tmp)]
        todo.append(("SIGTERM during apply -o", lambda: sigterm_case(tmp, args.python)))
        for name, fn in todo:
            if args.only and args.only not in name:
                continue
            tried += 1
            verdict, detail = fn()
            broke += verdict != "ok"
            print(f"{verdict:5}  {name}: {detail}", flush=True)
    print(f"\n{tried} cases tried, {tried - broke} ok, {broke} broke")
    return 1 if broke else 0


if __name__ == "__main__":
    sys.exit(main())

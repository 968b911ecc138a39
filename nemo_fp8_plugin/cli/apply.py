"""``nemo-fp8 apply CONFIG --host H``: rewrite a config into a host's native FP8 keys."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub) -> None:
    from ..hosts import HOSTS
    from ._args import add_model_options

    p = sub.add_parser(
        "apply",
        help="rewrite a config into a host's native FP8 keys",
        description="Rewrite a config that says `precision: <recipe>` (or has an `fp8:` block) "
        "into the host's own keys. Only the keys the host needs change: comments, "
        "key order, quoting, number spelling and blank lines of the file stay as "
        "written. Running it on its own output changes nothing; a config that "
        "already sets conflicting native FP8 keys is refused. `nemo-fp8 explain` "
        "shows the same result before you write it.",
    )
    p.add_argument("config", help="path to a YAML (or JSON) config")
    add_model_options(p)
    # `nemo_rl` is how the package and its docs spell NeMo RL; accept it next to `nemo-rl`.
    p.add_argument(
        "--host",
        default=None,
        choices=list(HOSTS),
        type=lambda name: name.replace("_", "-") if name.replace("_", "-") in HOSTS else name,
        help="target host (default: detected from the config's shape, as explain does)",
    )
    where = p.add_argument_group("where the result goes (default: standard output)")
    where.add_argument(
        "-o",
        "--output",
        default=None,
        metavar="PATH",
        help="write the result to PATH, atomically (`-`: standard output; a "
        "name ending in .json writes JSON); PATH may not be CONFIG or a "
        "file its defaults: chain names",
    )
    where.add_argument(
        "--in-place",
        action="store_true",
        help="edit CONFIG itself, atomically (a parent named by its defaults: is never written)",
    )
    where.add_argument(
        "--diff",
        action="store_true",
        help="print a unified diff of CONFIG and the result; write nothing",
    )
    where.add_argument(
        "--force",
        action="store_true",
        help="replace a read-only (e.g. 0444) output file, and write --host's keys into a "
        "config whose shape is another host's; without it both are refused",
    )
    p.add_argument(
        "--strict", action="store_true", help="treat rules the host cannot express as errors"
    )
    p.add_argument(
        "--stack",
        default=None,
        metavar="NAME",
        help="write for this named stack's host versions (nemo-rl-0.6.0, nemo-rl-0.7.0, "
        "nemo-rl-main-2026-08-22, nemo-2.7, latest; default: the installed versions, and for "
        "NeMo RL the release they identify, else v0.7.0)",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="also feed the result to the host's own code where the host is installed "
        "(megatron-core's TransformerConfig, vLLM's EngineArgs, NeMo's plugin, "
        "TE's recipe) and say what was checked",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .._io import check_output_file
    from ..errors import FP8ConfigError
    from ..hosts import get_adapter, load_context
    from ..hosts import run as run_pipeline
    from ..roundtrip import render, unified_diff

    target = _target(args)
    check_output_file(
        target, "--in-place" if args.in_place else "--output", read_only_ok=args.force
    )
    # --diff shows the edit --in-place would make (relative references stay as they are)
    ctx = load_context(
        args.config,
        hardware=args.hardware,
        model=args.model,
        model_config=args.model_config,
        strict=args.strict,
        output=Path(args.config) if args.diff else target,
        stack=args.stack,
        host_forced=args.force and args.host is not None,
        host=args.host,
    )
    if target is not None and not args.in_place:
        _refuse_own_files(Path(args.config), target, ctx.sources)
    detected = _detected_host(ctx) if args.host is None else None
    adapter = get_adapter(args.host if detected is None else detected)
    try:
        result = run_pipeline(adapter, ctx)  # its own refusals (a mistyped section...) first
    except FP8ConfigError as err:  # a refusal naming an assumed host release says so
        raise adapter.refusal(err, ctx) from None
    other = _forced_host(adapter, ctx) if args.host is not None else None
    # What apply says besides the output: printed once the output is rendered and written, so a
    # refusal on the way (a file that cannot be edited in place, a companion refused) stays the
    # one line that names it. The first line: which host release the keys are written for.
    said: list[str] = list(adapter.preamble(ctx))
    if args.stack is not None and ctx.stack is not None:
        said.append(ctx.stack.line)
    if detected is not None:
        said.append(f"host: {detected} (detected from the config's shape)")
    if other is not None:
        said.append(
            f"--force: {adapter.name}'s keys written into a {other} config "
            f"(from its shape); {other} may not read them"
        )
    checks = adapter.validate(result, ctx) if args.validate and result.requested else []
    source = _read_text(Path(args.config))
    written, removed = result.written or {}, list(result.removed)
    # An edit of the input is applied to the file as written, keeping all the pipeline does
    # not change; a host whose output is a new document reports it written whole.
    fmt = "json" if target is not None and target.suffix.lower() == ".json" else result.fmt
    text = render(
        source,
        raw=ctx.raw,
        data=result.data,
        written=written,
        removed=removed,
        source_fmt=ctx.fmt,
        fmt=fmt,
        edit=result.edit,
        where=str(args.config),
    )
    from . import printable_path

    # one line each, whatever file names they quote
    said += [f"warning: {printable_path(str(w))}" for w in result.warnings]
    said += [f"note: {printable_path(str(n))}" for n in result.notes]  # informational
    said += [f"env: {line}" for line in adapter.env_lines(result)]  # no config key holds these
    said += [f"checked: {line}" for line in checks]
    if args.diff:
        said += [f"note: would also write {printable_path(path)}" for path in result.files]
    wrote: list[str] = []
    if target is not None and not args.diff:
        wrote = _write_with_companions(args, target, text, source, result.files, ctx.sources)
    for line in said:
        print(f"nemo-fp8 apply: {line}", file=sys.stderr)
    for line in wrote:  # last, as before: what is on disk now
        print(line, file=sys.stderr)
    if args.diff:
        sys.stdout.write(
            unified_diff(
                source,
                text,
                name=printable_path(str(args.config)),
                label=f"nemo-fp8 apply --host {adapter.name}",
            )
        )
    elif target is None:
        sys.stdout.write(text)
    return 0


def _write_with_companions(args, target: Path, text: str, source: str, files, sources) -> list[str]:
    """Write the output and the adapter's companion files (the TE precision file) as one
    step: every companion is checked as ``-o`` is (and refused when it is the input, a file
    of its ``defaults:`` chain or the output itself) before anything is written; then the
    output is renamed into place first and the companions after it, and a failure before
    that (a full disk, a signal) leaves none of them changed. Returns the lines saying what
    was written, for the caller to print after its own."""
    from .._io import atomic_write_files, check_companion_file, same_file
    from ..errors import FP8ConfigError
    from . import printable_path

    config = Path(args.config)
    for path, body in files.items():
        if same_file(path, target):
            raise FP8ConfigError(
                f"{path} (written beside the output) is the output itself",
                key="--output",
                value=str(path),
            )
        _refuse_own_files(config, Path(path), sources, what=f"{path} (written beside the output)")
        check_companion_file(path, "--output", text=body, force=args.force)
    unchanged = args.in_place and text == source
    writes = [] if unchanged else [(target, text.encode("utf-8"))]
    atomic_write_files(writes + [(path, body.encode("utf-8")) for path, body in files.items()])
    lines = [
        f"{printable_path(str(config))} unchanged"
        if unchanged
        else f"wrote {printable_path(str(target))}"
    ]
    return lines + [f"wrote {printable_path(str(path))}" for path in files]


def _forced_host(adapter, ctx) -> str | None:
    """``--host`` against the config's shape: refused naming both hosts
    (:func:`~nemo_fp8_plugin.hosts.refuse_other_host`), unless ``--force``; then the host the
    shape names, for the command to say so (None: the shapes agree). A host whose output is a
    new document, not an edit of the config, takes any shape."""
    from ..hosts import refuse_other_host, shape_mismatch

    if not adapter.edits_config:
        return None
    refuse_other_host(adapter, ctx)
    return shape_mismatch(adapter, ctx)


def _detected_host(ctx) -> str:
    """The host ``explain`` would pick for this config (:func:`detect_host`); a config whose
    shape names none is refused with the choices."""
    from ..errors import FP8ConfigError
    from ..hosts import HOSTS, detect_host

    host = detect_host(ctx.resolved)
    if host is None:
        raise FP8ConfigError(
            "the config's shape names no host (no policy:, trainer:, mixed_precision:, "
            "model: section or vLLM engine options)",
            key="--host",
            hint=f"pass --host, one of {', '.join(HOSTS)}",
        )
    return host


def _target(args: argparse.Namespace) -> Path | None:
    """The file the result is written to (None: standard output)."""
    from ..errors import FP8ConfigError

    output = None if args.output in (None, "-") else Path(args.output)
    if args.diff and (output is not None or args.in_place):
        raise FP8ConfigError(
            "--diff prints the change and writes nothing",
            key="--output" if output is not None else "--in-place",
            hint="drop --diff to write, or drop the output",
        )
    if args.in_place:
        config = Path(args.config)
        if args.output == "-" or (output is not None and not _same(output, config)):
            raise FP8ConfigError(
                "--in-place writes CONFIG itself",
                key="--output",
                value=args.output,
                hint="drop -o, or drop --in-place",
            )
        return config
    return output


def _same(a: Path, b: Path) -> bool:
    from .._io import same_file

    return same_file(a, b)


def _refuse_own_files(config: Path, target: Path, sources, *, what: str = "") -> None:
    """``-o`` naming the input, or a file of its ``defaults:`` chain, would overwrite what the
    result was made from (a parent overwritten by its child's result makes the chain loop);
    so would a file written beside the output (``what`` names it) that is one of them."""
    from ..errors import FP8ConfigError

    if not target.exists():
        return
    subject = f"{what} is" if what else "names"
    if _same(target, config):
        raise FP8ConfigError(
            f"{subject} the input config; the result would overwrite it",
            key="--output",
            value=str(target),
            hint="write another file" + ("" if what else ", or pass --in-place to edit the config"),
        )
    for parent in sources[1:]:  # the defaults: chain, read once by the command
        if _same(target, parent):
            raise FP8ConfigError(
                f"{subject} {parent}, a parent of {config} through defaults:; "
                f"overwriting it would change (or loop) the chain",
                key="--output",
                value=str(target),
                hint="write another file",
            )


def _read_text(path: Path) -> str:
    """The config as written, newlines untouched (the safe loader has accepted it)."""
    with open(path, encoding="utf-8", newline="") as fh:
        return fh.read()

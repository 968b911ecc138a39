"""Argument helpers shared by the subcommands (stdlib only: imported before any work)."""

from __future__ import annotations


def name_list(
    text: str | None, key: str, *, noun: str = "recipe", hint: str | None = None
) -> list[str] | None:
    """``"a, b"`` -> ``["a", "b"]``; None when the flag was not given. A flag given with no
    name at all (``--recipes ""`` or ``","``) is an error, not a silent "all of them"."""
    from ..errors import FP8ConfigError

    if text is None:
        return None
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise FP8ConfigError(f"no {noun} named", key=key, value=text, hint=hint)
    return names


HARDWARE_HELP = "target GPU (h100, h200, b200, ...) or architecture for the hardware checks"
"""``--hardware``'s help for commands that check a config's recipe against a target."""


def add_model_options(parser, *, hardware_help: str = HARDWARE_HELP) -> None:
    """The options every config command shares: ``--hardware``, ``--model``,
    ``--model-config`` (one spelling and one help text for ``apply``, ``explain`` and
    ``doctor``; the values go to :func:`nemo_fp8_plugin.hosts.load_context`)."""
    parser.add_argument("--hardware", default=None, help=hardware_help)
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="resolve the per-layer rules against this built-in model (HF id or short "
        "name such as llama3.1-8b), overriding the model the config names",
    )
    parser.add_argument(
        "--model-config",
        default=None,
        metavar="PATH",
        help="resolve the per-layer rules against a Hugging Face config.json (or a "
        "checkpoint directory holding one); nothing is downloaded",
    )

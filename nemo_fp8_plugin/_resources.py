"""Where the YAML the package ships lives: ``conf/`` in a source checkout or editable
install, ``nemo_fp8_plugin/_conf/`` inside a built wheel (pyproject force-includes it)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["conf_dir"]


def conf_dir(sub: str) -> Path:
    """``conf/<sub>`` (``recipes`` or ``examples``) wherever this installation keeps it."""
    packaged = Path(__file__).with_name("_conf") / sub
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "conf" / sub

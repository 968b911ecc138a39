"""The package version, in the core layer so that every layer may read it without importing
the package face (``nemo_fp8_plugin/__init__.py``)."""

__version__ = "0.1.0"
"""The release version (``pyproject.toml``'s ``version``)."""

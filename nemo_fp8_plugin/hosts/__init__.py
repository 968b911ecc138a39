"""Host adapters: one per host, one contract, one pipeline.

Every host subclasses :class:`~.contract.HostAdapter` once, as ``ADAPTER`` in its own module
``nemo_fp8_plugin.hosts.<host>`` (:data:`~.table.ADAPTERS`). The contract and its records are
:mod:`.contract`; what a command loads once (the config, its request and model, the host its
shape names) is :mod:`.context`; the pipeline and the one writer are :mod:`.pipeline`.

Nothing here imports a host: each adapter imports its host inside the functions that need it.
"""

from __future__ import annotations

from .context import (
    detect_host,
    load_context,
    mapping_context,
    model_sizes_section,
    refuse_other_host,
    shape_mismatch,
)
from .contract import (
    DELETE,
    NO_DEFAULT,
    NO_REQUEST,
    ApplyResult,
    HostAdapter,
    HostContext,
    Message,
    NativeRecipe,
    RuleIssueKind,
    Spelling,
    Write,
    same_value,
)
from .pipeline import (
    apply_mapping,
    apply_path,
    check_model_shape,
    check_native,
    diff_written,
    model_shape_findings,
    native_context,
    read_native,
    recipe_keys,
    refuse_recipe,
    run,
    write,
)
from .table import ADAPTERS, HOSTS, adapters, available_hosts, get_adapter

__all__ = [
    "ADAPTERS",
    "HOSTS",
    "DELETE",
    "NO_DEFAULT",
    "NO_REQUEST",
    "ApplyResult",
    "HostAdapter",
    "HostContext",
    "Message",
    "NativeRecipe",
    "RuleIssueKind",
    "Spelling",
    "Write",
    "same_value",
    "adapters",
    "available_hosts",
    "get_adapter",
    "detect_host",
    "load_context",
    "mapping_context",
    "model_sizes_section",
    "refuse_other_host",
    "shape_mismatch",
    "apply_mapping",
    "apply_path",
    "check_model_shape",
    "diff_written",
    "model_shape_findings",
    "read_native",
    "check_native",
    "native_context",
    "recipe_keys",
    "refuse_recipe",
    "run",
    "write",
]

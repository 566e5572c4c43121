"""indexer_q: DeepSeek-V4's indexer-Q projection fused into one CuTe DSL kernel.

Re-exports only; nothing heavy is imported until a name is used.
"""
from __future__ import annotations

__version__ = "0.1.0"

_EXPORTS = {
    "prepare_weights": ("api", "prepare_weights"),
    "fused_indexer_q": ("api", "fused_indexer_q"),
    "quantize_act_fp8": ("api", "quantize_act_fp8"),
    "IndexerQWeights": ("weights", "IndexerQWeights"),
    "InvalidInputError": ("validate", "InvalidInputError"),
    "UnsupportedArchError": ("arch", "UnsupportedArchError"),
    "KernelUnavailableError": ("dispatch", "KernelUnavailableError"),
    "SUPPORTED_ARCHES": ("constants", "SUPPORTED_ARCHES"),
    "detect_arch": ("arch", "detect_arch"),
    "Tactic": ("tactics", "Tactic"),
    "valid_tactics": ("tactics", "valid_tactics"),
    "set_tactic_table": ("table", "set_tactic_table"),
}
_SUBMODULES = ("api", "arch", "constants", "env", "reference", "testing", "validate", "weights", "dispatch",
               "cli", "tactics", "table", "jit")

__all__ = sorted(_EXPORTS) + ["reference", "__version__"]


def __getattr__(name):
    import importlib

    if name in _EXPORTS:
        mod, attr = _EXPORTS[name]
        value = getattr(importlib.import_module(f"{__name__}.{mod}"), attr)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))

"""Device -> kernel arch. The one map from compute capability to arch lives here.

``INDEXER_Q_ARCH`` (read at call time) overrides detection, e.g. to force ``sm_90a``.
"""
from __future__ import annotations

import functools
import os

from .constants import ARCH_BY_CAPABILITY, SUPPORTED_ARCHES  # noqa: F401  (the one map)
from .validate import InvalidInputError
ENV_ARCH = "INDEXER_Q_ARCH"


class UnsupportedArchError(InvalidInputError):
    """The GPU (or the INDEXER_Q_ARCH override) is not one indexer_q has kernels for."""


def check_arch(arch: str, name: str = "arch") -> str:
    if arch not in SUPPORTED_ARCHES:
        raise UnsupportedArchError(
            f"{name}: expected one of {', '.join(SUPPORTED_ARCHES)}, got {arch!r}")
    return arch


def arch_override():
    """The INDEXER_Q_ARCH override (validated), or None when unset/empty."""
    value = os.environ.get(ENV_ARCH, "").strip()
    return check_arch(value, ENV_ARCH) if value else None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    """A device's compute capability, asked once per process (it runs on every call)."""
    import torch

    return tuple(torch.cuda.get_device_capability(index))


def detect_arch(device=None) -> str:
    """The kernel arch for a CUDA device ("sm_90a" for H100/H200, "sm_100a" for B200/GB200).

    INDEXER_Q_ARCH, when set, wins. Raises UnsupportedArchError for a CPU device or a GPU
    whose compute capability is not in ARCH_BY_CAPABILITY."""
    override = arch_override()
    if override is not None:
        return override
    import torch

    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        raise UnsupportedArchError(f"device: expected a CUDA device, got {dev}")
    if not torch.cuda.is_available():
        raise UnsupportedArchError(f"device: expected a CUDA device, got {dev} but CUDA is not available")
    cap = _capability(dev.index if dev.index is not None else torch.cuda.current_device())
    arch = ARCH_BY_CAPABILITY.get(cap)
    if arch is None:
        name = torch.cuda.get_device_name(dev)
        supported = ", ".join(f"sm_{a}{b}" for a, b in ARCH_BY_CAPABILITY)
        raise UnsupportedArchError(
            f"device: expected a GPU of compute capability {supported} "
            f"({', '.join(SUPPORTED_ARCHES)}), got {name} (sm_{cap[0]}{cap[1]}); "
            f"set {ENV_ARCH} only if you know the kernels run there")
    return arch

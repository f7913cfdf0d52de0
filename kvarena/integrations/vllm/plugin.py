"""The ``vllm.general_plugins`` entry point: registers kvarena's backend in every vLLM process.

vLLM swallows a plugin whose module fails to import (it logs and runs on with its own
backend), so this module imports nothing at import time; :func:`register` does the
imports and turns any failure into a ``RuntimeError`` that stops the engine, never a
silent fallback.
"""

from __future__ import annotations

import os

__all__ = ["register", "BACKEND_PATH", "SUPPORTED_VLLM", "cpu_mode"]

#: the class vLLM resolves for the CUSTOM slot (and the CPU slot in CPU mode).
BACKEND_PATH = "kvarena.integrations.vllm.backend.KVArenaAttentionBackend"
#: (major, minor) releases whose v1 attention-backend API this backend is written against.
SUPPORTED_VLLM = ((0, 32), (0, 33))


def cpu_mode() -> bool:
    """``KVARENA_VLLM_CPU``: "1" takes vLLM's CPU backend slot too, "0" or unset does not."""
    value = os.environ.get("KVARENA_VLLM_CPU", "0").strip()
    if value not in ("0", "1", ""):
        raise ValueError(f"KVARENA_VLLM_CPU: expected 0 or 1, got {value!r}")
    return value == "1"


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside :data:`SUPPORTED_VLLM`: its backend API changes between releases."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        raise RuntimeError(f"kvarena: cannot read the vLLM version {version!r}") from None
    if (major, minor) not in SUPPORTED_VLLM:
        names = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VLLM)
        raise RuntimeError(
            f"kvarena: vLLM {version} is not supported by kvarena's attention backend (written "
            f"against the v1 backend API of vLLM {names}); install a supported vLLM or uninstall "
            "kvarena's plugin (VLLM_PLUGINS lists the plugins vLLM loads)")


def register() -> None:
    """Register :data:`BACKEND_PATH` as the CUSTOM backend (and the CPU one in CPU mode).

    Safe to call more than once (vLLM loads general plugins once per process). Raises
    ``RuntimeError`` naming the cause when anything fails.
    """
    try:
        take_cpu = cpu_mode()
        import vllm
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        check_vllm_version(vllm.__version__)
        from kvarena.integrations.vllm import backend  # import errors surface here, loudly

        register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
        if take_cpu:
            register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
        backend.log_registered(cpu=take_cpu)
    except Exception as exc:
        if str(exc).startswith("kvarena:"):
            raise RuntimeError(str(exc)) from exc
        raise RuntimeError(
            f"kvarena: the vLLM plugin failed to register KVArenaAttentionBackend: "
            f"{type(exc).__name__}: {exc}") from exc

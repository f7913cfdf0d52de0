"""The on-disk cache of compile results, keyed by content (``KVARENA_CHECK_CACHE``)."""

from __future__ import annotations

import functools
import json
import os


def _cache_dir() -> str | None:
    where = os.environ.get("KVARENA_CHECK_CACHE", "")
    if where in ("0", "off"):
        return None
    return where or os.path.join(os.path.expanduser("~"), ".cache", "kvarena", "check")


@functools.lru_cache(maxsize=1)
def _own_source_hash() -> str:
    """SHA-256 over this package's sources (the launch tables and the parsing of compiles)."""
    import hashlib

    digest = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


def _cache_key(parts: list) -> str:
    import hashlib

    import triton

    payload = [_own_source_hash(), triton.__version__, os.environ.get("TRITON_PTXAS_PATH", ""), *parts]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=repr).encode()).hexdigest()


def _cache_get(key: str) -> dict | None:
    where = _cache_dir()
    path = where and os.path.join(where, key[:2], key + ".json")
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # a torn or foreign file: compile again


def _cache_put(key: str, value: dict) -> None:
    where = _cache_dir()
    if not where:
        return
    path = os.path.join(where, key[:2], key + ".json")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)  # atomic: a reader sees the old file, the new one, or none
    except OSError:
        pass  # a read-only home: the check still runs, uncached

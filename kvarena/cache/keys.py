"""Cache keys, cache policies and a process-stable content hash.

``content_hash`` turns a value (strings, bytes, numbers, ``None``, tuples, lists,
dicts and tensors, nested freely) into a SHA-256 hex digest of a canonical,
type-tagged encoding. It never uses Python's built-in ``hash()`` (salted per
process for ``str``/``bytes``) nor an object's address, so the digest is equal
across processes, machines of the same byte order and Python versions for equal
content, and anything it cannot encode by content raises ``TypeError``.

``CacheKey`` names one cached feature: which component produced it, from which
input, under which weights/adapters and with which settings that would make an
old entry stale (dtype, quantization, tokenizer, template, max length).

``CachePolicy`` is the static configuration of one cache pool, validated on
construction; its ``class_name`` is checked by the pool registry
(:func:`kvarena.cache.handle.make_pool`), not here.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from kvarena.argcheck import is_integral

__all__ = ["CacheKey", "CachePolicy", "check_names", "content_hash"]

# Type tags of the canonical encoding. One byte each; never reuse a tag for a
# different meaning, or digests written by older versions would change meaning.
_T_NONE = b"N"
_T_BOOL = b"B"
_T_INT = b"I"
_T_FLOAT = b"F"
_T_COMPLEX = b"C"
_T_STR = b"S"
_T_BYTES = b"Y"
_T_TUPLE = b"T"
_T_LIST = b"L"
_T_DICT = b"D"
_T_TENSOR = b"X"
_T_DTYPE = b"d"

_ENCODING_VERSION = b"kvarena.content_hash.v1\x00"


def _u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def _float_bytes(x: float) -> bytes:
    # One canonical NaN (NaN payloads and signs are not content); -0.0 and 0.0 stay
    # distinct, as their bit patterns (and e.g. 1/x) differ.
    if math.isnan(x):
        return b"nan"
    return struct.pack(">d", x)


def _tensor_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """Return the canonical (dense, contiguous, CPU) tensor and a byte view of it."""
    if t.is_quantized:
        raise TypeError("content_hash: quantized tensors are not supported (dequantize first)")
    if t.device.type == "meta":
        raise TypeError("content_hash: a meta tensor has no data to hash")
    t = t.detach()
    if t.layout != torch.strided:
        try:
            t = t.to_dense()
        except (RuntimeError, NotImplementedError) as exc:
            raise TypeError(f"content_hash: cannot hash a tensor with layout {t.layout}") from exc
    t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # Reinterpret the elements as raw bytes in torch (works for bf16 and float8, which
    # numpy cannot represent), then hand numpy only the uint8 view.
    flat = t.reshape(-1).view(torch.uint8)
    return t, memoryview(flat.numpy()).cast("B")


class _Encoder:
    """Feeds the canonical encoding of a value into a hash object."""

    __slots__ = ("_path",)

    def __init__(self) -> None:
        self._path: set[int] = set()  # ids of the containers being encoded (cycle guard)

    def feed(self, h: Any, obj: Any) -> None:
        if obj is None:
            h.update(_T_NONE)
        elif isinstance(obj, bool):
            h.update(_T_BOOL + (b"\x01" if obj else b"\x00"))
        elif isinstance(obj, numbers.Integral):
            digits = str(int(obj)).encode("ascii")
            h.update(_T_INT + _u64(len(digits)) + digits)
        elif isinstance(obj, float):
            h.update(_T_FLOAT + _float_bytes(float(obj)))
        elif isinstance(obj, complex):
            h.update(_T_COMPLEX + _float_bytes(obj.real) + _float_bytes(obj.imag))
        elif isinstance(obj, str):
            data = obj.encode("utf-8", "surrogatepass")
            h.update(_T_STR + _u64(len(data)) + data)
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            data = bytes(obj)
            h.update(_T_BYTES + _u64(len(data)) + data)
        elif isinstance(obj, torch.Tensor):
            canon, data = _tensor_bytes(obj)
            dtype = str(canon.dtype).encode("ascii")
            h.update(_T_TENSOR + _u64(len(dtype)) + dtype + _u64(canon.dim()))
            for size in canon.shape:
                h.update(_u64(size))
            h.update(_u64(data.nbytes))
            h.update(data)
        elif isinstance(obj, torch.dtype):
            name = str(obj).encode("ascii")
            h.update(_T_DTYPE + _u64(len(name)) + name)
        elif isinstance(obj, (tuple, list)):
            self._enter(obj)
            try:
                h.update((_T_TUPLE if isinstance(obj, tuple) else _T_LIST) + _u64(len(obj)))
                for item in obj:
                    self.feed(h, item)
            finally:
                self._path.discard(id(obj))
        elif isinstance(obj, Mapping):
            self._enter(obj)
            try:
                # Order independence: digest each key and each value on its own, then
                # feed the pairs sorted by key digest.
                pairs = []
                for k, v in obj.items():
                    kh = hashlib.sha256()
                    self.feed(kh, k)
                    vh = hashlib.sha256()
                    self.feed(vh, v)
                    pairs.append((kh.digest(), vh.digest()))
                pairs.sort()
                h.update(_T_DICT + _u64(len(pairs)))
                for kd, vd in pairs:
                    h.update(kd + vd)
            finally:
                self._path.discard(id(obj))
        else:
            raise TypeError(
                f"content_hash: cannot hash an object of type {type(obj).__qualname__} by "
                "content; expected str, bytes, int, float, complex, bool, None, torch.dtype, "
                "torch.Tensor, or tuples/lists/dicts of these"
            )

    def _enter(self, obj: Any) -> None:
        if id(obj) in self._path:
            raise ValueError("content_hash: the value contains itself (a cyclic container)")
        self._path.add(id(obj))


def content_hash(obj: Any) -> str:
    """Hash a value by content, stably across processes and Python versions.

    Parameters
    ----------
    obj : object
        ``None``, ``bool``, integers (any ``numbers.Integral``), ``float``,
        ``complex``, ``str``, ``bytes``/``bytearray``/``memoryview``,
        ``torch.dtype``, ``torch.Tensor`` (any device, dtype, strides or sparse
        layout), or tuples, lists and mappings of these, nested to any depth.

    Returns
    -------
    str
        A 64-character SHA-256 hex digest.

    Raises
    ------
    TypeError
        For any other type (anywhere inside ``obj``), for quantized tensors and
        for meta tensors (which have no data): an object is never hashed by its
        address.
    ValueError
        For a container that contains itself.

    Notes
    -----
    The encoding is type-tagged: ``True``, ``1`` and ``1.0`` hash differently, as
    do a tuple and a list with the same items. Mappings are order-independent.
    A tensor hashes its dtype, shape and element bytes, so equal values give equal
    digests whatever the strides, storage offset, device, conjugate/negative bits or
    ``requires_grad``; a change of one element, of the dtype, or of the shape (same
    bytes, other shape) changes the digest. Floats compare by bit pattern except
    that every NaN is one value (``0.0`` and ``-0.0`` differ). Tensor bytes are
    taken in the machine's byte order (little-endian on every platform torch
    supports).

    Examples
    --------
    >>> import torch
    >>> from kvarena import content_hash
    >>> content_hash("hello")[:16]                    # the same in every process
    'c64bd9e83a94ab9d'
    >>> content_hash({"ids": [1, 2], "n": 3}) == content_hash({"n": 3, "ids": [1, 2]})
    True
    >>> content_hash(1) == content_hash(1.0), content_hash((1, 2)) == content_hash([1, 2])
    (False, False)
    >>> content_hash(torch.arange(8.0)[::2]) == content_hash(torch.tensor([0.0, 2.0, 4.0, 6.0]))
    True
    >>> content_hash(object())
    Traceback (most recent call last):
        ...
    TypeError: content_hash: cannot hash an object of type object by content; ...
    """
    h = hashlib.sha256(_ENCODING_VERSION)
    _Encoder().feed(h, obj)
    return h.hexdigest()


def _check_str(name: str, value: Any, *, allow_none: bool = False, non_empty: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, str):
        expected = "a str or None" if allow_none else "a str"
        raise TypeError(f"{name} must be {expected}, got {type(value).__qualname__}")
    if non_empty and not value:
        raise ValueError(f"{name} must be a non-empty str")


def _freeze(value: Any) -> Any:
    """Turn lists into tuples, recursively (so that a key stays hashable)."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass(frozen=True)
class CacheKey:
    """Identity of one cached feature (an encoder output, an embedding, ...).

    Two keys are equal, and have equal :attr:`hash`, exactly when every field is
    equal. Every field that would make a cached value stale belongs in the key, so
    that a changed setting is a miss rather than a wrong hit.

    Parameters
    ----------
    component_id : str
        The producing component (e.g. ``"text_encoder"``); used by
        ``FeatureCache.invalidate_components``. Non-empty.
    content_hash : str
        Digest of the input (e.g. :func:`content_hash` of the token ids). Non-empty.
    weights_version : str
        Version of the component's weights; ``FeatureCache.invalidate_weights(v)``
        drops every entry whose version differs from ``v``.
    adapter_versions : tuple, default ()
        The adapter stack (e.g. ``(("style_lora", "v3"), ("id_lora", "v1"))``); order
        is significant. Lists are frozen into tuples; items must be hashable by
        :func:`content_hash` (str, numbers, None, tuples of these, ...).
    dtype : str or torch.dtype or None, default None
        Output dtype; a ``torch.dtype`` is stored by name (``"bfloat16"``), and a
        leading ``"torch."`` is dropped from a string.
    quantization : str or None, default None
        Quantization scheme of the component, if any (``"fp8_e4m3"``, ``"int8"``).
    tokenizer : str or None, default None
        Tokenizer identity/version.
    template : str or None, default None
        Prompt/chat template identity (or its text).
    max_length : int or None, default None
        Truncation/padding length of the input, ``>= 0``.

    Raises
    ------
    TypeError, ValueError
        On construction, for a field of the wrong type or value (the message names
        the field).

    Examples
    --------
    >>> import torch
    >>> from kvarena import CacheKey
    >>> key = CacheKey.from_content("text_encoder", [101, 2023, 102], "w1",
    ...                             dtype=torch.bfloat16, max_length=77)
    >>> key.dtype, key.max_length, len(key.hash)
    ('bfloat16', 77, 64)
    >>> same = CacheKey.from_content("text_encoder", [101, 2023, 102], "w1",
    ...                              dtype="torch.bfloat16", max_length=77)
    >>> same == key, same.hash == key.hash
    (True, True)
    >>> CacheKey("text_encoder", key.content_hash, "w2", dtype="bfloat16", max_length=77) == key
    False
    """

    component_id: str
    content_hash: str
    weights_version: str
    adapter_versions: tuple = ()
    dtype: str | None = None
    quantization: str | None = None
    tokenizer: str | None = None
    template: str | None = None
    max_length: int | None = None
    _digest: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_str("component_id", self.component_id, non_empty=True)
        _check_str("content_hash", self.content_hash, non_empty=True)
        _check_str("weights_version", self.weights_version)
        adapters = self.adapter_versions
        if isinstance(adapters, (str, bytes)) or not isinstance(adapters, (tuple, list)):
            raise TypeError(
                "adapter_versions must be a tuple (or list) of adapter versions, got "
                f"{type(adapters).__qualname__}"
            )
        adapters = _freeze(adapters)
        try:
            content_hash(adapters)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"adapter_versions must hold hashable content: {exc}") from None
        object.__setattr__(self, "adapter_versions", adapters)
        dtype = self.dtype
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype)
        _check_str("dtype", dtype, allow_none=True)
        if dtype is not None and dtype.startswith("torch."):
            dtype = dtype[len("torch.") :]
        object.__setattr__(self, "dtype", dtype)
        _check_str("quantization", self.quantization, allow_none=True)
        _check_str("tokenizer", self.tokenizer, allow_none=True)
        _check_str("template", self.template, allow_none=True)
        if self.max_length is not None:
            if not is_integral(self.max_length):
                raise TypeError(
                    f"max_length must be an int >= 0 or None, got {type(self.max_length).__qualname__}"
                )
            if self.max_length < 0:
                raise ValueError(f"max_length must be >= 0, got {self.max_length}")
            object.__setattr__(self, "max_length", int(self.max_length))
        fields_ = (
            ("component_id", self.component_id),
            ("content_hash", self.content_hash),
            ("weights_version", self.weights_version),
            ("adapter_versions", self.adapter_versions),
            ("dtype", self.dtype),
            ("quantization", self.quantization),
            ("tokenizer", self.tokenizer),
            ("template", self.template),
            ("max_length", self.max_length),
        )
        object.__setattr__(self, "_digest", content_hash(("kvarena.CacheKey", 1, fields_)))

    @property
    def hash(self) -> str:
        """str: SHA-256 hex digest of the fields, equal across processes for equal keys.

        Examples
        --------
        >>> from kvarena import CacheKey
        >>> key = CacheKey("vae", "ab12", "w1")
        >>> key.hash[:16]                                 # the same in every process
        'ae852ed42ec8b930'
        >>> key.hash == CacheKey("vae", "ab12", "w1").hash
        True
        >>> key.hash == CacheKey("vae", "ab12", "w2").hash     # other weights: other digest
        False
        """
        return self._digest

    @classmethod
    def from_content(
        cls, component_id: str, content: Any, weights_version: str, **fields: Any
    ) -> CacheKey:
        """Build a key whose ``content_hash`` is :func:`content_hash` of ``content``.

        Parameters
        ----------
        component_id : str
            See :class:`CacheKey`.
        content : object
            The component's input (token ids, pixel tensor, prompt text, ...).
        weights_version : str
            See :class:`CacheKey`.
        **fields
            The other :class:`CacheKey` fields.

        Returns
        -------
        CacheKey
        """
        return cls(component_id, content_hash(content), weights_version, **fields)


def _check_budget(name: str, value: Any) -> int:
    if not is_integral(value):
        raise TypeError(f"{name} must be an int >= 0 (bool is not accepted), got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


@dataclass(frozen=True)
class CachePolicy:
    """Static configuration of one cache pool, validated on construction.

    Parameters
    ----------
    class_name : str
        The pool class (``"feature"``, ``"residual"``, ``"slab_kv"``,
        ``"paged_kv"``); checked by the registry, not here.
    max_bytes : int
        Byte budget of the pool, ``>= 0``.
    block_bytes : int, default 0
        Bytes per KV block (0: derived from a layout), ``>= 0``.
    reuse_across_requests : bool, default True
        ``False`` turns a ``FeatureCache`` off (nothing stored, every get misses).
    training_mode_disables_recycle : bool, default False
        KV slab pools keep every slab (training / self-forcing).
    per_component : mapping of str to int, default {}
        Per-class extras, e.g. ``{"window": 6, "sinks": 1}`` for slab pools. Values
        are ints ``>= 0``. Stored as a read-only mapping sorted by key, so
        ``policy.per_component.get("window")`` works and the policy stays hashable.

    Raises
    ------
    TypeError
        For a field of the wrong type (budgets must be ``int``; ``bool`` is not
        accepted as one). The message names the field.
    ValueError
        For a negative budget or ``per_component`` value, or an empty ``class_name``.

    Examples
    --------
    >>> from kvarena import CachePolicy
    >>> policy = CachePolicy("slab_kv", max_bytes=1 << 20, per_component={"window": 6, "sinks": 1})
    >>> dict(policy.per_component), policy.per_component.get("window"), policy.block_bytes
    ({'sinks': 1, 'window': 6}, 6, 0)
    >>> policy == CachePolicy("slab_kv", 1 << 20, per_component={"sinks": 1, "window": 6})
    True
    >>> CachePolicy("feature", max_bytes=-1)
    Traceback (most recent call last):
        ...
    ValueError: max_bytes must be >= 0, got -1
    """

    class_name: str
    max_bytes: int
    block_bytes: int = 0
    reuse_across_requests: bool = True
    training_mode_disables_recycle: bool = False
    per_component: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_str("class_name", self.class_name, non_empty=True)
        object.__setattr__(self, "max_bytes", _check_budget("max_bytes", self.max_bytes))
        object.__setattr__(self, "block_bytes", _check_budget("block_bytes", self.block_bytes))
        for name in ("reuse_across_requests", "training_mode_disables_recycle"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        per = self.per_component
        if per is None:
            per = {}
        if not isinstance(per, Mapping):
            raise TypeError(
                f"per_component must be a mapping of str to int, got {type(per).__qualname__}"
            )
        checked: dict[str, int] = {}
        for k, v in per.items():
            if not isinstance(k, str):
                raise TypeError(f"per_component keys must be str, got {k!r}")
            if not is_integral(v):
                raise TypeError(f"per_component[{k!r}] must be an int >= 0, got {v!r}")
            if v < 0:
                raise ValueError(f"per_component[{k!r}] must be >= 0, got {v}")
            checked[k] = int(v)
        frozen = MappingProxyType(dict(sorted(checked.items())))
        object.__setattr__(self, "per_component", frozen)

    def __hash__(self) -> int:
        return hash(
            (
                self.class_name,
                self.max_bytes,
                self.block_bytes,
                self.reuse_across_requests,
                self.training_mode_disables_recycle,
                tuple(self.per_component.items()),
            )
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CachePolicy):
            return NotImplemented
        return (
            self.class_name == other.class_name
            and self.max_bytes == other.max_bytes
            and self.block_bytes == other.block_bytes
            and self.reuse_across_requests == other.reuse_across_requests
            and self.training_mode_disables_recycle == other.training_mode_disables_recycle
            and dict(self.per_component) == dict(other.per_component)
        )

    def __reduce__(self) -> Any:
        # MappingProxyType does not pickle; rebuild from a plain dict.
        return (
            CachePolicy,
            (
                self.class_name,
                self.max_bytes,
                self.block_bytes,
                self.reuse_across_requests,
                self.training_mode_disables_recycle,
                dict(self.per_component),
            ),
        )


def check_names(name: str, names: Any) -> Iterable[str]:
    """Validate an iterable of str (not a bare str) passed as argument ``name``; used by the
    caches and the integrations' ``invalidate_components``."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise TypeError(
            f"{name} must be an iterable of str (e.g. a set), got {type(names).__qualname__}"
        )
    out = list(names)
    for n in out:
        if not isinstance(n, str):
            raise TypeError(f"{name} must hold str items, got {n!r}")
    return out

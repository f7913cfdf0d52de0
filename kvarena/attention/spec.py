"""``AttentionSpec``: the per-layer constants of attention, validated once.

Every option of block-table attention that is not per-step data (block tables, lengths)
lives in one frozen dataclass. It is the single source of truth for the op's
parameters: the public op builds one from its keywords, a KV pool builds one per layer
at construction, the custom op's schema is generated from its fields, and the
launchers, the torch path and the oracle read the normalized values from it. Adding an
option is one field here plus its kernel code.

Normalization (so that equal meanings compare equal and every value fits the kernels):

* ``softcap`` of 0 or ``inf`` means off and is stored as ``None`` (``c * tanh(s / c)``
  tends to ``s`` as ``c`` grows).
* ``window_left``, ``chunk_size`` and ``sink_tokens`` at or above ``2**31 - 1`` are
  stored as ``2**31 - 1``: sequence lengths are int32, so a larger value selects the
  same keys.
* ``scale=None`` stays ``None`` and means ``head_dim ** -0.5`` (see :meth:`scale_for`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from kvarena.argcheck import INT_LIMIT, check_bool, check_int, check_opt_float, check_opt_int

__all__ = ["AttentionSpec", "BACKENDS", "INT_LIMIT", "check_backend", "check_bool", "check_int"]

#: The backends every op accepts: ``"auto"`` = Triton on CUDA, torch on CPU.
BACKENDS = ("auto", "torch", "triton")


def check_backend(backend) -> str:
    """``backend`` if it is one of :data:`BACKENDS`; else ``ValueError`` naming it."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return backend


def _opt_count(name: str, value, minimum: int) -> int | None:
    """None, or an int ``>= minimum`` capped at :data:`INT_LIMIT`."""
    value = check_opt_int(name, value, minimum)
    return None if value is None else min(int(value), INT_LIMIT)


def _op(schema: str) -> dict:
    """Field metadata: the field's type in the custom op's schema."""
    return {"schema": schema}


@dataclass(frozen=True)
class AttentionSpec:
    """The constants of one attention layer, validated on construction.

    Parameters
    ----------
    scale : float, optional
        Softmax scale; ``None`` = ``head_dim ** -0.5``. Finite.
    causal : bool, default True
        Query at position p sees keys ``t <= p`` (queries are bottom-right aligned).
    chunk_size : int, optional
        With ``causal``: block-causal, ``t // chunk_size <= p // chunk_size``. ``>= 1``.
    window_left : int, optional
        Sliding window: ``t >= p - window_left`` (or ``t < sink_tokens``). ``>= 0``;
        vLLM's ``sliding_window=W`` is ``window_left=W - 1``.
    sink_tokens : int, default 0
        With a window, keys ``t < sink_tokens`` stay visible. ``>= 0``.
    softcap : float, optional
        ``softcap * tanh(scores / softcap)``; ``None``, 0 or ``inf`` = off, else ``> 0``.
    backend : {"auto", "torch", "triton"}, default "auto"
        ``"auto"``: Triton on CUDA tensors, the torch path on CPU and under autograd.
    num_splits : int, optional
        Split-KV count of the Triton path (``None`` = heuristic; 1 = never split).
    deterministic : bool, default False
        Triton split size independent of the batch (bitwise batch-invariant).
    return_lse : bool, default False
        Also return the fp32 natural-log sum-exp of each query row.
    sink_logits : Tensor ``[H_q]``, optional
        Learned attention-sink logits (gpt-oss): one per query head, added to each row's
        softmax denominator as a key whose value is zero, so ``out = sum_t e^{s_t} v_t /
        (e^{sink} + sum_t e^{s_t})`` and ``lse`` includes it. float32 (float64 with fp64
        inputs). Not ``sink_tokens`` (keys kept visible by a window). A learned tensor,
        not a constant: left out of ``==`` and ``hash``.
    rope_cos, rope_sin : Tensor ``[P, D / 2]``, optional
        RoPE on read: the pool stores un-rotated keys and the kernels rotate queries and
        keys as they load them, by table row = position (fp32, last dim contiguous, on
        q's device; both or neither). A 1-D RoPE table has one row per token position;
        Wan's 3-D RoPE is the ``[frames * H * W, D / 2]`` table whose row for token
        ``f * H * W + r`` joins the frame frequencies of f and the height/width ones of r
        (:func:`kvarena.attention.rope.wan_rope_table`). Left out of ``==``.
    rope_interleaved : bool, default False
        Rotation pairs: ``(2i, 2i + 1)`` (GPT-J, Wan's complex pairs) when True, else
        ``(i, i + D/2)`` (GPT-NeoX, Llama's ``rotate_half``).
    rope_positions : {"absolute", "virtual"}, default "absolute"
        Which positions a pool gives: "absolute", the key's logical token index (and the
        query's); "virtual" (SlabKVCache), the index in the ``[sinks | window]``
        concatenation of the keys a chunk sees, its queries right after (LongLive 2), so
        positions stay below ``sink_tokens + window_tokens`` however long the rollout.

    Raises
    ------
    TypeError
        A field of the wrong type (the message names it).
    ValueError
        A field out of range (the message names it and the expected range).

    Examples
    --------
    >>> from kvarena import AttentionSpec
    >>> spec = AttentionSpec(window_left=127, softcap=50.0)
    >>> spec.replace(softcap=0).softcap is None       # 0 means off
    True
    >>> spec.scale_for(128) == 128 ** -0.5
    True
    >>> AttentionSpec(window_left=-1)
    Traceback (most recent call last):
    ...
    ValueError: window_left: expected None or an int >= 0, got -1
    """

    scale: float | None = field(default=None, metadata=_op("float?"))
    causal: bool = field(default=True, metadata=_op("bool"))
    chunk_size: int | None = field(default=None, metadata=_op("int?"))
    window_left: int | None = field(default=None, metadata=_op("int?"))
    sink_tokens: int = field(default=0, metadata=_op("int"))
    softcap: float | None = field(default=None, metadata=_op("float?"))
    backend: str = field(default="auto", metadata=_op("str"))
    num_splits: int | None = field(default=None, metadata=_op("int?"))
    deterministic: bool = field(default=False, metadata=_op("bool"))
    sink_logits: torch.Tensor | None = field(default=None, compare=False, repr=False, metadata=_op("Tensor?"))
    rope_cos: torch.Tensor | None = field(default=None, compare=False, repr=False, metadata=_op("Tensor?"))
    rope_sin: torch.Tensor | None = field(default=None, compare=False, repr=False, metadata=_op("Tensor?"))
    rope_interleaved: bool = field(default=False, metadata=_op("bool"))
    rope_positions: str = field(default="absolute", metadata=_op("str"))
    # Not an op argument: the op always computes the lse; the wrappers drop it.
    return_lse: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        scale = check_opt_float("scale", self.scale)
        if scale is not None and not math.isfinite(scale):
            raise ValueError(f"scale: expected None or a finite float, got {self.scale!r}")
        set_(self, "scale", scale)
        check_bool("causal", self.causal)
        set_(self, "chunk_size", _opt_count("chunk_size", self.chunk_size, 1))
        set_(self, "window_left", _opt_count("window_left", self.window_left, 0))
        set_(self, "sink_tokens", min(int(check_int("sink_tokens", self.sink_tokens, 0)), INT_LIMIT))
        softcap = check_opt_float("softcap", self.softcap)
        if softcap is not None and not softcap >= 0:  # negative or NaN
            raise ValueError(f"softcap: expected None, 0 / inf (off) or a float > 0, got {self.softcap!r}")
        set_(self, "softcap", softcap if softcap is not None and 0 < softcap < math.inf else None)
        check_backend(self.backend)
        set_(self, "num_splits", _opt_count("num_splits", self.num_splits, 1))
        check_bool("deterministic", self.deterministic)
        check_bool("return_lse", self.return_lse)
        s = self.sink_logits
        if s is not None:
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"sink_logits: expected None or a 1-D float32 tensor [H_q], got {type(s).__name__}")
            if s.dim() != 1 or s.dtype not in (torch.float32, torch.float64):
                raise ValueError(f"sink_logits: expected a 1-D float32 tensor [H_q], got {s.dtype} of shape "
                                 f"{tuple(s.shape)}")

        check_bool("rope_interleaved", self.rope_interleaved)
        if self.rope_positions not in ("absolute", "virtual"):
            raise ValueError(f"rope_positions: expected 'absolute' or 'virtual', got {self.rope_positions!r}")
        c, sn = self.rope_cos, self.rope_sin
        if (c is None) != (sn is None):
            raise ValueError("rope_cos/rope_sin: give both tables or neither")
        if c is not None:
            for name, t in (("rope_cos", c), ("rope_sin", sn)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name}: expected a [P, D/2] float32 tensor, got {type(t).__name__}")
                if t.dim() != 2 or t.dtype != torch.float32 or t.shape[0] < 1 or t.shape[1] < 1:
                    raise ValueError(f"{name}: expected a [P, D/2] float32 tensor (P >= 1), got {t.dtype} of "
                                     f"shape {tuple(t.shape)}")
                if t.shape[1] > 1 and t.stride(1) != 1:
                    raise ValueError(f"{name}: the last dimension must be contiguous, got strides {t.stride()}")
            if sn.shape != c.shape or sn.device != c.device or sn.stride() != c.stride():
                raise ValueError(f"rope_sin: expected rope_cos's shape {tuple(c.shape)}, strides {c.stride()} and "
                                 f"device {c.device} (the kernels index both with one row stride), got "
                                 f"{tuple(sn.shape)}, {sn.stride()} on {sn.device}")

    @property
    def rope_mode(self) -> int:
        """0: no RoPE on read; 1: half-split pairs; 2: interleaved pairs (the kernel's ROPE)."""
        if self.rope_cos is None:
            return 0
        return 2 if self.rope_interleaved else 1

    def scale_for(self, head_dim: int) -> float:
        """The softmax scale at ``head_dim`` (``scale``, else ``head_dim ** -0.5``)."""
        return head_dim**-0.5 if self.scale is None else self.scale

    def replace(self, **changes) -> AttentionSpec:
        """A copy with ``changes`` applied and validated.

        Raises
        ------
        TypeError
            A name that is not a field of AttentionSpec (listed in the message).
        """
        unknown = sorted(set(changes) - _FIELD_NAMES)
        if unknown:
            raise TypeError(
                f"{unknown[0]}: not an attention option (AttentionSpec has {sorted(_FIELD_NAMES)})"
            )
        return dataclasses.replace(self, **changes)

    @property
    def with_lse(self) -> AttentionSpec:
        """This spec with ``return_lse=True``, made once per spec (the merge paths need it per
        layer). Not cached while torch.compile traces (dynamo would trace the store)."""
        if self.return_lse:
            return self
        made = self.__dict__.get("_with_lse")
        if made is None:
            made = dataclasses.replace(self, return_lse=True)
            if not torch.compiler.is_compiling():
                object.__setattr__(self, "_with_lse", made)
        return made

    def op_args(self) -> tuple:
        """The fields that the custom op takes, in schema order."""
        return tuple(getattr(self, f.name) for f in _OP_FIELDS)

    @classmethod
    def from_op_args(cls, args) -> AttentionSpec:
        """Inverse of :meth:`op_args`."""
        return cls(**{f.name: a for f, a in zip(_OP_FIELDS, args)})

    @classmethod
    def op_schema(cls) -> str:
        """The op-argument fields as a ``torch.library`` schema fragment."""
        return ", ".join(f"{f.metadata['schema']} {f.name}" for f in _OP_FIELDS)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(AttentionSpec))
_OP_FIELDS = tuple(f for f in dataclasses.fields(AttentionSpec) if "schema" in f.metadata)

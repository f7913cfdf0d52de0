"""The forward attention kernel's per-tile math: scores, online softmax, dot operands, RoPE.

``@triton.jit`` helpers only, called by keyword from the key loops (:mod:`attn_tiles`) and the
kernel (:mod:`paged_attention`). The records below group the values that travel together
through the loops; they are built in the kernel and read by field here (a ``NamedTuple`` in
a Triton function is a compile-time grouping: the generated code is that of its fields).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from kvarena.kernels.fp8 import _fp8e4m3_decode
from kvarena.kernels.widen import to_fp32

# ----------------------------------------------------------------------------- records


class ScoreScale(NamedTuple):
    """How raw Q.K^T scores become exp2-domain logits: scalars, or per query row
    ``[BLOCK_M]`` when the fp16 dots' row gains are folded in (``ROWS``)."""

    log2: object  # softmax scale times log2(e)
    softcap_inv: object  # softmax scale / softcap (HAS_SOFTCAP)
    softcap_log2: object  # softcap times log2(e) (HAS_SOFTCAP)


class RopeTable(NamedTuple):
    """The rotary tables ``[n_pos, D/2]`` fp32 (None pointers when ``ROPE`` is 0)."""

    cos: object
    sin: object
    stride: object  # of a table row
    n_pos: object  # table rows (positions are clamped into them)


class OnlineSoftmax(NamedTuple):
    """A query tile's online-softmax state: row max ``m``, row sum ``l`` (exp2 domain), the
    fp32 accumulator ``acc`` and ``bad_w``, the weight on visible non-finite values (GUARD)."""

    m: object
    l: object
    acc: object
    bad_w: object


# ----------------------------------------------------------------------------- helpers


@triton.jit
def _tanh(x):
    # tl has no tanh in every supported Triton version; exp2 saturates cleanly:
    # x -> +inf gives 1 - 2/inf = 1, x -> -inf gives 1 - 2/1 = -1.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _upcast(x, UPCAST: tl.constexpr):
    """``x`` widened to fp32 under ``UPCAST`` (the interpreter lane; False when compiled),
    exactly: bf16 subnormals through their bits (:func:`kernels.widen.to_fp32`); else ``x``."""
    if UPCAST:
        x = to_fp32(x)
    return x


@triton.jit
def _fp8_to(x, dtype: tl.constexpr, NATIVE: tl.constexpr):
    """An fp8 K or V tile in ``dtype`` (the dot's input type). ``NATIVE`` (sm_89+): the
    hardware conversion, 2 elements per instruction, giving the value itself; else (sm_80,
    which has no fp8 type, and the interpreter) the shift decode of uint8 bytes, giving the
    value / 256."""
    if NATIVE:
        y = x.to(dtype)
    else:
        y = _fp8e4m3_decode(x).to(dtype)
    return y


@triton.jit
def _rope_index(d, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr):
    """Per head-dim index d: its rotation partner, frequency index and the partner term's sign.

    ROPE 1 (halves, GPT-NeoX / Llama): pairs (i, i + D/2); ROPE 2 (interleaved, GPT-J /
    Wan's complex pairs): pairs (2i, 2i + 1). ``rot(x)[d] = x[d] cos f(d) + sign(d)
    x[partner(d)] sin f(d)``, the standard rotation of each pair.
    """
    if ROPE == 1:
        lo = d < HEAD_DIM // 2
        pd = tl.where(lo, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
        fi = tl.where(lo, d, d - HEAD_DIM // 2)
        sg = tl.where(lo, -1.0, 1.0)
    else:
        pd = d ^ 1
        fi = d // 2
        sg = tl.where((d % 2) == 0, -1.0, 1.0)
    return pd, fi, sg


@triton.jit
def _rotate(x, xp, pos, fi, sg, ok, rope: RopeTable):
    """fp32 rotation of tile ``x`` (partner values ``xp``) at table rows ``pos``; the index
    tiles broadcast over the tile. Rows are clamped into the table (the hosts validate
    positions; the clamp keeps a bad one from reading outside it)."""
    row = tl.minimum(tl.maximum(pos, 0), rope.n_pos - 1).to(tl.int64) * rope.stride
    c = tl.load(rope.cos + row + fi, mask=ok, other=0.0)
    sn = tl.load(rope.sin + row + fi, mask=ok, other=0.0)
    return to_fp32(x) * c + sg * to_fp32(xp) * sn


@triton.jit
def _online_probs(s, m_i, l_i):
    """The online-softmax update of a score tile ``s``: the new row max, row sum, the
    rescale ``alpha`` of the old accumulator and the tile's probabilities ``pr``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; subtracting 0 instead keeps
    # exp2(-inf - (-inf)) = NaN out of alpha and pr.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)  # [BLOCK_M]
    pr = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    return m_new, l_i * alpha + tl.sum(pr, 1), alpha, pr


@triton.jit
def _softmax_step(s, v, vcol, m_i, l_i, acc, bad_w, GUARD: tl.constexpr, guard_now, FP8: tl.constexpr):
    """One online-softmax step over masked scores ``s`` and values ``v``.

    ``GUARD`` (constexpr) and ``guard_now`` (this tile is a boundary tile): a key invisible to a row has pr = 0 there, but 0 * NaN (or inf) in the
    P.V dot is NaN, so the tile's non-finite values are zeroed and the rows that see
    such a key (pr > 0) accumulate weight in ``bad_w``, which turns their output to NaN
    as it would have been. Only boundary tiles need it (every row sees every key of an
    interior tile).
    """
    m_new, l_i, alpha, pr = _online_probs(s=s, m_i=m_i, l_i=l_i)
    if GUARD and guard_now:
        v_ok = tl.abs(v) < float("inf")  # [BLOCK_N, HEAD_DIM_PAD]; False for NaN
        key_bad = tl.max(tl.where(v_ok, 0.0, 1.0), 1)  # [BLOCK_N]
        if FP8:
            # A non-finite V scale (a NaN row, or a poisoned slot loaded for the tile) too.
            vcol_ok = tl.abs(vcol) < float("inf")
            key_bad = tl.maximum(key_bad, tl.where(vcol_ok, 0.0, 1.0))
            vcol = tl.where(vcol_ok, vcol, 0.0)
        bad_w += tl.sum(pr * key_bad[None, :], 1)
        v = tl.where(v_ok, v, 0.0)
    if FP8:
        # fp8 values: the per-key V scale (times 256 after the shift decode) goes on P's
        # columns, in fp32, before P is rounded to the dot's input dtype (as P alone is).
        acc = acc * alpha[:, None] + tl.dot((pr * vcol[None, :]).to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc, bad_w


@triton.jit
def _scale_scores(s, kcol, scale: ScoreScale, HAS_SOFTCAP: tl.constexpr, FP8: tl.constexpr, FOLD: tl.constexpr,
                  ROWS: tl.constexpr):
    """Raw dot scores in the exp2 domain: the fp8 key scales on the columns, then softcap or scale.

    fp8 keys: the dot ran on the widened bytes (exact in its dtype; value / 256 after the
    shift decode) and the per-key scale ``kcol`` (times 256 there) multiplies each fp32 score
    column. ``FOLD`` (the page loop) multiplies by one factor per score, the key's scale
    times the softmax scale (or softcap's); the block loop keeps two multiplies, since
    folding spills the Wan chunk with an fp8 history beside its own keys (Triton 3.9: 16 B
    at 255 registers). ``ROWS``: ``scale.log2`` and ``scale.softcap_inv`` are per query row
    ``[BLOCK_M]`` (the fp16 dots' row gains folded in, :func:`_f16_queries`), else scalars.
    """
    if ROWS:
        sc = scale.log2[:, None]
        ci = scale.softcap_inv[:, None]
    else:
        sc = scale.log2
        ci = scale.softcap_inv
    if FP8 and FOLD:
        if HAS_SOFTCAP:
            s = scale.softcap_log2 * _tanh(s * (kcol[None, :] * ci))
        else:
            s = s * (kcol[None, :] * sc)
    else:
        if FP8:
            s = s * kcol[None, :]
        if HAS_SOFTCAP:
            s = scale.softcap_log2 * _tanh(s * ci)
        else:
            s = s * sc
    return s


@triton.jit
def _scores(q, kt, kcol, scale: ScoreScale, HAS_SOFTCAP: tl.constexpr, FP8: tl.constexpr, FOLD: tl.constexpr,
            ROWS: tl.constexpr):
    # [BLOCK_M, BLOCK_N] fp32 scores in the exp2 domain (fp32 inputs: full IEEE dots).
    return _scale_scores(s=tl.dot(q, kt, input_precision="ieee"), kcol=kcol, scale=scale, HAS_SOFTCAP=HAS_SOFTCAP,
                         FP8=FP8, FOLD=FOLD, ROWS=ROWS)


@triton.jit
def _dot_operand(x, dot_dtype: tl.constexpr, UPCAST: tl.constexpr, FP8: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """A loaded K^T or V tile as a dot's operand: fp8 widened to the dot's dtype, or fp32
    under ``UPCAST``."""
    if FP8:
        x = _fp8_to(x=x, dtype=dot_dtype, NATIVE=FP8_NATIVE)
    else:
        x = _upcast(x=x, UPCAST=UPCAST)
    return x


@triton.jit
def _key_operand(kt, kp, kpos, fi, sg, rot_ok, rope: RopeTable, dot_dtype: tl.constexpr, UPCAST: tl.constexpr,
                 FP8: tl.constexpr, FP8_NATIVE: tl.constexpr, ROPE: tl.constexpr):
    """A loaded K^T tile ``[HEAD_DIM_PAD, BLOCK_N]`` as the Q.K^T dot's operand, for the page
    loop and the block loop alike: rotated (RoPE: in fp32 with the partner tile ``kp`` at
    positions ``kpos``, fp8 widened first, then rounded to the dot's dtype), else as
    :func:`_dot_operand` makes it."""
    if ROPE != 0:
        if FP8:
            kt = _fp8_to(x=kt, dtype=tl.float32, NATIVE=FP8_NATIVE)
            kp = _fp8_to(x=kp, dtype=tl.float32, NATIVE=FP8_NATIVE)
        kt = _rotate(x=kt, xp=kp, pos=kpos[None, :], fi=fi[:, None], sg=sg[:, None], ok=rot_ok,
                     rope=rope).to(dot_dtype)
    else:
        kt = _dot_operand(x=kt, dot_dtype=dot_dtype, UPCAST=UPCAST, FP8=FP8, FP8_NATIVE=FP8_NATIVE)
    return kt


@triton.jit
def _fp8_column_scales(ks_ptrs, vs_ptrs, key_ok, MASKED: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """The per-key K and V scales ``[BLOCK_N]`` of an fp8 tile (times 256 after the shift
    decode, which gives value / 256); ``MASKED``: keys outside ``key_ok`` read 0."""
    if MASKED:
        kcol = tl.load(ks_ptrs, mask=key_ok, other=0.0)
        vcol = tl.load(vs_ptrs, mask=key_ok, other=0.0)
    else:
        kcol = tl.load(ks_ptrs)
        vcol = tl.load(vs_ptrs)
    if not FP8_NATIVE:
        kcol = kcol * 256.0
        vcol = vcol * 256.0
    return kcol, vcol

"""The fp8 KV rules in one place: the store's quantizer (per-row or static scales), the
read-back used by a denoising step, the scale checks, and the uint8 views an arena hands
the ops."""

from __future__ import annotations

import torch

from kvarena.attention.backend import needs_grad
from kvarena.attention.checks import check_disjoint, check_no_overlap, check_values, require_tensor
from kvarena.attention.dtypes import FP8_CACHE_DTYPES, KERNEL_DTYPES

__all__ = [
    "FP8_MAX",
    "FP8_MIN_SCALE",
    "fp8_row_scales",
    "quantize_fp8",
    "dequantize_fp8",
    "fp8_round_trip",
    "check_kv_scales",
    "refuse_fp8_grad",
    "as_bytes",
    "from_bytes",
]

#: Largest finite float8_e4m3fn value; quantized values saturate there.
FP8_MAX = 448.0


# fp32(1 / 448): the scale is amax * this constant, ONE fp32 multiply, so that every backend
# (torch, the Triton kernel on GPU and in the interpreter) computes the same bits (a
# division would be div.full.f32, 2 ulp, in a Triton kernel).
_INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))


# Smallest scale: the smallest normal fp32. All-zero rows (amax 0) get it and store zeros;
# a scale that is itself subnormal could be flushed to 0 on a GPU and divide by zero.
FP8_MIN_SCALE = 2.0**-126


def fp8_row_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-row fp8 scale of ``x [..., D]``: ``max(amax * fp32(1/448), 2**-126)`` in fp32.

    A row holding a NaN gets a NaN scale (so all of it dequantizes to NaN, as a NaN in a
    float cache would poison the rows that see it); an inf makes amax and the scale inf,
    which dequantizes the row to NaN as well.
    """
    xf = x.float()
    nan = torch.isnan(xf)
    amax = torch.where(nan, torch.zeros((), device=x.device), xf.abs()).amax(-1)
    scale = torch.clamp_min(amax * torch.tensor(_INV_FP8_MAX, dtype=torch.float32, device=x.device), FP8_MIN_SCALE)
    return torch.where(nan.any(-1), torch.full_like(scale, float("nan")), scale)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [..., D] / scale [...]`` rounded to float8_e4m3fn (nearest-even, saturating at +-448).

    fp32 IEEE division, then torch's own cast: what the Triton store kernel's explicit
    rounding helper is checked against bit for bit.
    """
    sc = scale.float()
    y = x.float() / (sc[..., None] if sc.dim() else sc)
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x8 [..., D]`` (fp8) times ``scale [...]`` (or a 0-dim static scale), in ``dtype``."""
    sc = scale.to(dtype)
    return x8.to(dtype) * (sc[..., None] if sc.dim() else sc)


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """What an fp8 store of ``x [..., D]`` reads back, in ``x``'s dtype: quantized by the store's
    rule (each row's :func:`fp8_row_scales`, or the 0-dim static ``scale``) and dequantized
    in fp32, so attention over it sees exactly the values a store followed by a read sees."""
    sc = fp8_row_scales(x) if scale is None else scale
    return dequantize_fp8(quantize_fp8(x, sc), sc, torch.float32).to(x.dtype)


def check_kv_scales(k_cache: torch.Tensor, k_scale, v_scale, q_dtype: torch.dtype, what: str = "q") -> tuple | None:
    """The fp8 rule of a cache pair: ``(k_scale, v_scale)`` for fp8 caches, None for float ones.

    fp8 caches need both scales: fp32 ``[num_blocks, block_size, H_kv]`` (per token and kv
    head; any strides) or 0-dim fp32 static scales, on the caches' device; their inputs are
    float16, bfloat16 or float32. Float caches take no scales.
    """
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale: only fp8 caches take scales; k_cache is {k_cache.dtype}")
        return None
    if q_dtype not in KERNEL_DTYPES:
        raise TypeError(f"{what}: fp8 caches take float16, bfloat16 or float32 inputs, got {q_dtype}")
    want = tuple(k_cache.shape[:3])
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None:
            raise ValueError(f"{name}: an fp8 cache ({k_cache.dtype}) needs its fp32 scales: a "
                             f"[num_blocks, block_size, H_kv] = {list(want)} tensor or a 0-dim static scale")
        require_tensor(name, t)
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected float32 scales, got {t.dtype}")
        if t.dim() and tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape {want} ([num_blocks, block_size, H_kv]) or a 0-dim static "
                             f"scale, got {tuple(t.shape)}")
        if t.device != k_cache.device:
            raise ValueError(f"{name}: expected the caches' device {k_cache.device}, got {t.device}")
    if k_scale.dim() != v_scale.dim():
        raise ValueError("v_scale: k_scale and v_scale must both be per-token tensors or both 0-dim static scales")
    if k_scale.dim():
        check_no_overlap("k_scale", k_scale)
        check_no_overlap("v_scale", v_scale)
        check_disjoint("v_scale", v_scale, "k_scale", k_scale)
    elif check_values(k_scale):
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not 0 < float(t) < float("inf"):
                raise ValueError(f"{name}: a static scale must be finite and > 0, got {float(t)}")
    return k_scale, v_scale


def as_bytes(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as a uint8 view (None and 0-dim tensors, static fp8 scales, as they are).

    An arena's fp8 bytes and fp32 scales are views of one uint8 buffer; torch.compile's
    aot_autograd refuses mutated graph inputs that are views of one base in two dtypes,
    while uint8 views of the uint8 buffer are plain. The pools hand the ops such views
    (``ArenaRegion.op_views``) and the ops view them back with :func:`from_bytes`.
    """
    return t if t is None or t.dim() == 0 or t.dtype == torch.uint8 else t.view(torch.uint8)


def from_bytes(k_cache, v_cache, k_scale, v_scale):
    """fp8 caches and scales given as uint8 views (a pool's ``op_views``, a custom op's
    arguments) viewed back as float8_e4m3fn / fp32: ``(k_cache, v_cache, kv_scales or None)``."""
    if k_scale is None:
        return k_cache, v_cache, None
    if k_cache.dtype == torch.uint8:
        k_cache, v_cache = k_cache.view(FP8_CACHE_DTYPES[0]), v_cache.view(FP8_CACHE_DTYPES[0])
    if k_scale.dtype == torch.uint8:
        k_scale, v_scale = k_scale.view(torch.float32), v_scale.view(torch.float32)
    return k_cache, v_cache, (k_scale, v_scale)


def refuse_fp8_grad(kv_scales, *tensors) -> None:
    """fp8 caches are for inference: a call that needs gradients is a ValueError."""
    if kv_scales is not None and needs_grad(*tensors):
        raise ValueError("k_cache: fp8 KV caches have no backward (quantization is not differentiable and "
                         "no kernel computes it); run under torch.no_grad() or use a float layout to train")

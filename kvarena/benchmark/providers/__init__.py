"""Provider implementations: the data of a case and one callable per provider.

Every provider of a case reads the *same* tensors: one arena of K/V pages with the
sequence's pages scattered at random (``make_data``). A provider is built once per case
by ``build(provider, case, data)``, which returns a :class:`Bench`: ``fn()`` is what gets
timed, ``to_ref(out)`` turns its result into kvarena's layout for the correctness check
(outside the timing). ``build`` raises :class:`Skip` with a reason when a provider cannot
run here (library not installed, backend refused, ...).

What each provider times
------------------------
kvarena
    The per-layer call the pools make, with the spec and path the pool launches: decode
    as ``PagedKVCache.forward`` attends (``dispatch.attend``); a chunk's ``commit`` step as
    ``SlabKVCache.forward(commit=True)`` (``dispatch.store`` of the chunk into its slab,
    then ``dispatch.attend`` non-causal over the visible slabs), its ``denoise`` step as
    ``forward(commit=False)`` (``dispatch.attend`` with the step's own K/V after the
    history: one launch); ``guarded`` chunks as ``paged_attention(chunk_size=chunk)``.
    Triton on CUDA (or with ``backend="triton"`` under the interpreter), the PyTorch path
    on CPU. The public op runs once, untimed, to check the data (as FlashInfer's ``plan``
    before the timed ``run``); the overhead table (:mod:`kvarena.benchmark.overhead`)
    reports what its checks cost per call. Host maxima are passed, so the call never reads
    the device. ``-pool<L>`` decode cases time ``PagedKVCache.forward`` itself on the last
    layer of a real ``L``-layer arena (checks, store and attend).
gather_sdpa[_flash|_efficient]
    Gather the block table's pages into contiguous K/V (``index_select``), then
    ``scaled_dot_product_attention``; the suffixed ones force one backend through
    ``torch.nn.attention.sdpa_kernel``. The gather is timed: it is what a framework
    without a paged kernel pays.
sdpa_contiguous
    SDPA on K/V that are already contiguous (gathered once, untimed): docs/contract.md's 0.9x
    target baseline for chunk attention, where CUDA forces the flash backend; decode takes
    SDPA's own dispatch. GQA heads are expanded beforehand (untimed) where a forced backend
    cannot take them.
sdpa_cudnn
    The same with the cuDNN backend (CUDA only).
copy (decode)
    ``dst.copy_(src)`` of half the K/V bytes the step reads: as many bytes moved (read +
    write) as the step reads, so ``copy time / kvarena time`` is the fraction of this run's
    copy bandwidth.
gather_flex, flex_contiguous
    FlexAttention (compiled on CUDA, eager on CPU where it materializes the scores).
flash_attn
    ``flash_attn_with_kvcache`` when importable: paged when the page is a multiple of
    256 tokens (FlashAttention-2's requirement), else on the contiguous K/V.
flashinfer
    FlashInfer's paged decode / prefill wrappers on the same arena (NHD layout).
copy_, shift_left (store cases)
    ``slab.copy_(k)``: the floor for writing one chunk. ``shift_left``: Self-Forcing's
    window buffer (see :mod:`kvarena.benchmark.recycle`): clone the retained non-sink
    tokens one chunk to the left, then write the new chunk at the end.

The modules: :mod:`.data` (the case's tensors, :class:`Bench`, :class:`Skip`, the work of a
call), :mod:`.kvarena_calls` (the kvarena providers), :mod:`.baselines` (the others); this
package is the registry (:func:`build`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvarena.benchmark.cases import Case
from kvarena.benchmark.providers.baselines import (
    _contiguous,
    _copy,
    _flash_attn,
    _flashinfer,
    _flex,
    _sdpa,
    _store_copy,
    _store_shift_left,
)
from kvarena.benchmark.providers.data import Bench, CaseData, Skip, make_data, work_of
from kvarena.benchmark.providers.kvarena_calls import _kvarena, _kvarena_plain

__all__ = ["Skip", "Bench", "CaseData", "make_data", "build", "work_of", "rel_err"]


_BUILDERS: dict[str, Callable[..., Bench]] = {
    "kvarena": _kvarena,
    "kvarena_plain": _kvarena_plain,
    "gather_sdpa": lambda c, d: _sdpa(c, d, gather=True, backend=None),
    "gather_sdpa_flash": lambda c, d: _sdpa(c, d, gather=True, backend="flash"),
    "gather_sdpa_efficient": lambda c, d: _sdpa(c, d, gather=True, backend="efficient"),
    "sdpa_contiguous": _contiguous,
    "sdpa_cudnn": lambda c, d: _sdpa(c, d, gather=False, backend="cudnn"),
    "copy": _copy,
    "gather_flex": lambda c, d: _flex(c, d, gather=True),
    "flex_contiguous": lambda c, d: _flex(c, d, gather=False),
    "flash_attn": _flash_attn,
    "flashinfer": _flashinfer,
    "copy_": _store_copy,
    "shift_left": _store_shift_left,
}
# Providers that take kvarena's backend choice (``kvarena bench --backend``).
_KVARENA = frozenset({"kvarena", "kvarena_plain"})


def build(provider: str, case: Case, data: CaseData, backend: str = "auto") -> Bench:
    """Build ``provider`` for ``case`` on ``data``; ``backend`` is kvarena's (``"auto"``,
    ``"torch"`` or ``"triton"``: the interpreter on CPU), ignored by the other providers.

    Raises
    ------
    KeyError
        For an unknown provider name.
    Skip
        When the provider cannot run here (the reason is the message).
    """
    if provider not in _BUILDERS:
        raise KeyError(f"provider: expected one of {sorted(_BUILDERS)}, got {provider!r}")
    if provider in _KVARENA:
        return _BUILDERS[provider](case, data, backend=backend)
    return _BUILDERS[provider](case, data)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max |ref|`` in fp32 (nan when shapes differ; NaN anywhere gives nan)."""
    if tuple(out.shape) != tuple(ref.shape):
        return math.nan
    o, r = out.float(), ref.float()
    denom = r.abs().max().item()
    return (o - r).abs().max().item() / (denom if denom > 0 else 1.0)

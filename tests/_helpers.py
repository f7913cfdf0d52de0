"""Helpers and fixtures shared by several test modules (imported by them, not a plugin).

The one home of the tests' tolerances (``TOL``, ``LSE_TOL`` and the named exceptions),
of the comparators (``assert_close``, ``assert_lse_close``, ``assert_attention_close``),
of the NaN-poisoned paged-attention case builder (``paged_case``, ``paged_case_ref``) and
of the one marker for "runs Triton kernels" (``gpu``: ``GPU``, ``TRITON``, ``gpu_test`` for
the kernel lane, ``INTERPRETER``, ``interpreter_test`` for the interpreter-only tests) and
of the run-again-under-inference-mode fixture (``grad_mode``).

A fixture here applies only to a module that imports it. The one ``seed`` fixture is
conftest's (every module gets it).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ------------------------------------------------------------------- the gpu marker
# One marker says "this test runs Triton kernels": ``gpu`` (pyproject.toml). ``-m gpu``
# selects the kernel tests, ``-m "not gpu"`` the fast CPU-only rest. Two kinds:
#
# * the kernel lane (``GPU``, ``TRITON``, ``gpu_test``): the test builds its tensors on
#   DEVICE, so it runs the kernels on CUDA where there is one (bench/gpu.sh runs these),
#   else through the Triton interpreter on CPU (conftest sets TRITON_INTERPRET=1 there);
# * interpreter-only (``INTERPRETER``, ``interpreter_test``): the test runs the kernels on
#   CPU tensors through the interpreter, or pins what the interpreter does (a patched
#   decode, a KVARENA_ARCH plan, a CPU-lane-only buffer trick); on a CUDA machine without
#   TRITON_INTERPRET=1 it is skipped, so ``-m gpu`` there runs exactly the kernel lane.
kernel_lane = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or the Triton interpreter (TRITON_INTERPRET=1)",
)
interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
#: The marks of a kernel-lane test or parameter: ``pytestmark = [*GPU]``, ``marks=GPU``.
GPU = (pytest.mark.gpu, kernel_lane)
#: The marks of an interpreter-only kernel test or parameter: ``marks=INTERPRETER``.
INTERPRETER = (pytest.mark.gpu, interpreter_only)
#: The ``backend="triton"`` parameter of a test parametrized over backends.
TRITON = pytest.param("triton", marks=GPU, id="triton")


def gpu_test(func):
    """Decorator: a kernel-lane test (marked ``gpu``, skipped off the kernel lane)."""
    return pytest.mark.gpu(kernel_lane(func))


def interpreter_test(func):
    """Decorator: an interpreter-only kernel test (marked ``gpu``, skipped without the
    interpreter, i.e. on a CUDA machine)."""
    return pytest.mark.gpu(interpreter_only(func))


def device_for(backend: str) -> str:
    """Where a test parametrized over backends builds its tensors: DEVICE for "triton"."""
    return DEVICE if backend == "triton" else "cpu"

# ------------------------------------------------------------------- tolerances
# The project standard for an op's output: relative L2 error ||out - ref|| / ||ref|| against
# a reference computed in fp64 on the same (dtype-rounded) inputs, keyed by the inputs' dtype.
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# An op's lse (fp32 for every input dtype, fp64 for fp64): |lse - ref| / (1 + |ref|) on the
# rows where ref is finite, keyed by the inputs' dtype; -inf rows (a query that sees no key)
# must match exactly.
LSE_TOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}
# merge_attention_states against its oracle, which rounds to the output dtype as the kernel
# does: one rescale-and-add per element, so the error is about one rounding of the output
# (eps: fp16 9.8e-4, bf16 7.8e-3), and the fp32 lse about one fp32 rounding. Deliberately
# stricter than TOL / LSE_TOL, which budget a whole attention.
MERGE_TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
MERGE_LSE_TOL = dict.fromkeys((torch.float32, torch.float16, torch.bfloat16), 1e-6)
# A whole example model (every layer, many steps) against a dense recomputation in the same
# dtype: the max abs error of its outputs / logits, not one op's relative error vs fp64.
MODEL_TOL = {torch.float32: 1e-4, torch.float64: 1e-9}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny tensors: intra-op threads only add spin-wait overhead (worst on a loaded box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["as_is", "inference_mode"])
def grad_mode(request: pytest.FixtureRequest) -> str:
    """Runs a test as written ("as_is") and again under ``torch.inference_mode()`` (where
    serving code runs: the tensors the test makes are inference tensors, which have no
    version counter). A module opts in with ``pytestmark = pytest.mark.usefixtures("grad_mode")``;
    a test that needs autograd or a subprocess pins ``as_is`` with
    ``@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)``."""
    if request.param == "as_is":
        yield request.param
        return
    with torch.inference_mode():
        yield request.param


def blob(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of ``nbytes`` bytes (a value of known size)."""
    return torch.empty(nbytes, dtype=torch.uint8)


# ------------------------------------------------------------------- comparators


def _f64(got: torch.Tensor, ref: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    ref = torch.as_tensor(ref)
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    return got.detach().double(), ref.detach().to(device=got.device, dtype=torch.float64)


def _where(mask: torch.Tensor, k: int = 5) -> list[list[int]]:
    return mask.nonzero()[:k].tolist()


def _assert_same_nonfinite(g: torch.Tensor, r: torch.Tensor, what: str) -> torch.Tensor:
    """NaN / inf in ``g`` only where ``r`` has the same value; returns ``r``'s finite mask."""
    fin = torch.isfinite(r)
    same = (g == r) | (torch.isnan(g) & torch.isnan(r))
    bad = (torch.isfinite(g) != fin) | (~fin & ~same)
    if bad.any():
        raise AssertionError(
            f"{what}: {int(bad.sum())} non-finite entries differ from the reference, first at "
            f"{_where(bad)} (got {g[bad][:5].tolist()}, ref {r[bad][:5].tolist()})"
        )
    return fin


def _at(err: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, *,
                 tol: float | None = None) -> None:
    """``out`` within ``TOL[dtype]`` (or ``tol``) of ``ref`` in relative L2 norm.

    ``ref`` is normally the fp64 reference; ``dtype`` is the op's input dtype. A NaN or inf
    in ``out`` fails unless ``ref`` holds the same value there; the finite entries are then
    compared. The message gives the relative error, the max abs diff and where it is.
    """
    tol = TOL[dtype] if tol is None else tol
    g, r = _f64(out, ref, what)
    fin = _assert_same_nonfinite(g, r, what)
    diff = torch.where(fin, g - r, 0.0)
    err = (diff.norm() / torch.where(fin, r, 0.0).norm().clamp_min(1e-30)).item()
    if not err <= tol:
        absd = diff.abs()
        at = _at(absd)
        raise AssertionError(
            f"{what}: relative error {err:.3e} > {tol:.1e} ({dtype}); max abs diff "
            f"{absd.max().item():.3e} at {at} (got {g[at].item():.6g}, ref {r[at].item():.6g})"
        )


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, *,
                     tol: float | None = None) -> None:
    """``|lse - ref| / (1 + |ref|) <= LSE_TOL[dtype]`` (or ``tol``) where ``ref`` is finite.

    ``dtype`` is the op's input dtype. The -inf rows (queries that see no key) must be the
    same set; a NaN fails unless ``ref`` has NaN there.
    """
    tol = LSE_TOL[dtype] if tol is None else tol
    g, r = _f64(lse, ref, what)
    fin = _assert_same_nonfinite(g, r, f"{what} (lse; -inf = a row that sees no key)")
    err = torch.where(fin, (g - r).abs() / (1 + r.abs()), 0.0)
    if err.numel() and not err.max().item() <= tol:
        at = _at(err)
        raise AssertionError(
            f"{what}: lse error {err.max().item():.3e} > {tol:.1e} ({dtype}) at {at} "
            f"(got {g[at].item():.9g}, ref {r[at].item():.9g})"
        )


def assert_attention_close(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor,
                           ref_lse: torch.Tensor, dtype: torch.dtype, what: str, *,
                           lse_tol: float | None = None) -> None:
    """An attention result (out, lse) against the reference: ``assert_close`` on out,
    ``assert_lse_close`` on lse, and every row that sees no key (lse -inf) exactly 0."""
    assert_close(out, ref_out, dtype, what)
    assert_lse_close(lse, ref_lse, dtype, what, tol=lse_tol)
    empty = torch.isneginf(torch.as_tensor(ref_lse)).to(out.device)
    nonzero = (out.detach() != 0).reshape(*empty.shape, -1).any(-1) & empty
    assert not nonzero.any(), f"{what}: a row that sees no key is not 0, at {_where(nonzero)}"


# ------------------------------------------------------------------- paged attention cases


def paged_case(lens: list[int], q_lens: list[int], *, dtype: torch.dtype, group: int, h_kv: int,
               head_dim: int, block_size: int, seed: int, kv_start: list[int] | None = None,
               cu: bool = True, q_scale: float = 1.0, kv_scale: float = 1.0,
               device: str = DEVICE) -> dict:
    """One paged-attention case laid out like the arena, NaN wherever the op must not read.

    The caches are layer 1 of an arena ``[blocks, layers=2, k/v, block_size, H_kv, D]``
    (strided per-layer views) holding twice the blocks needed plus one, used in random
    order; unused blocks, slots past seq_len and slots below ``kv_start`` are NaN.
    Block-table padding holds ids far out of range (alternately above and below), so a
    stray read shows up as NaN or, in the interpreter, as a crash. ``q`` is a strided view
    (a head slice of a wider projection output). Deterministic for a given ``seed``.

    Returns the op's arguments by name: q, k_cache, v_cache, block_table, seq_lens,
    cu_seqlens_q (None when ``cu`` is False), kv_start (None when not given), and the host
    maxima max_seqlen_q, max_seqlen_k.
    """
    gen = torch.Generator().manual_seed(seed)
    b = len(lens)
    h_q = h_kv * group
    n_blocks_seq = [-(-n // block_size) for n in lens]
    max_blocks = max(n_blocks_seq) + 2  # padding columns
    pool = 2 * sum(n_blocks_seq) + 1
    arena = torch.full((pool, 2, 2, block_size, h_kv, head_dim), float("nan"), dtype=dtype)
    k_cache, v_cache = arena[:, 1, 0], arena[:, 1, 1]
    perm = torch.randperm(pool, generator=gen).tolist()
    table = torch.full((b, max_blocks), 0, dtype=torch.int32)
    starts = list(kv_start) if kv_start is not None else [0] * b
    nxt = 0
    for i, n in enumerate(lens):
        for j in range(max_blocks):
            if j < n_blocks_seq[i]:
                table[i, j] = perm[nxt]
                nxt += 1
            else:  # padding: ids far out of range must never be dereferenced
                table[i, j] = 10**8 + j if (i + j) % 2 else -(10**6)
        for t in range(starts[i], n):
            blk, row = int(table[i, t // block_size]), t % block_size
            k_cache[blk, row] = (torch.randn(h_kv, head_dim, generator=gen) * kv_scale).to(dtype)
            v_cache[blk, row] = torch.randn(h_kv, head_dim, generator=gen).to(dtype)
    q_buf = (torch.randn(sum(q_lens), h_q + 1, head_dim, generator=gen) * q_scale).to(dtype)
    q = q_buf[:, 1:]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    if device != "cpu":
        arena = arena.to(device)
        k_cache, v_cache = arena[:, 1, 0], arena[:, 1, 1]
    return dict(
        q=q.to(device), k_cache=k_cache, v_cache=v_cache, block_table=table.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu_seqlens.to(device) if cu else None,
        kv_start=torch.tensor(starts, dtype=torch.int32, device=device) if kv_start is not None else None,
        max_seqlen_q=max(q_lens), max_seqlen_k=max(lens),
    )


def paged_case_ref(case: dict, **opts) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp64 oracle's (out, lse) on a ``paged_case`` (inputs upcast to fp64 for every
    dtype, so the op's own rounding is what a comparison measures)."""
    from kvarena.attention.reference import paged_attention_ref

    return paged_attention_ref(
        case["q"].double(), case["k_cache"].double(), case["v_cache"].double(), case["block_table"],
        case["seq_lens"], case["cu_seqlens_q"], kv_start=case["kv_start"], return_lse=True, **opts,
    )


def poisoned_fp8_caches(nb: int, bs: int, h: int, d: int, device="cpu"):
    """fp8 caches ``[nb, bs, h, d]`` full of NaN bytes and NaN scales ``[nb, bs, h]``: a
    read of an unwritten slot shows. Returns ``k, v, k_scale, v_scale``."""
    k = torch.full((nb, bs, h, d), 0x7F, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    ks = torch.full((nb, bs, h), float("nan"), device=device)
    return k, k.clone(), ks, ks.clone()


def paged_fp8_case(lens, q_lens, *, dtype, group, h_kv=2, d=80, bs=48, static=False, seed=0, device="cpu") -> dict:
    """fp8 caches written by store_kv (torch path) in scattered blocks; the rest poisoned.
    Built on the CPU, then moved to ``device`` (the same bytes). Returns q, kc, vc, ks, vs,
    table, lens, cu (the op's arguments) and full_k, full_v (the unquantized keys/values
    per sequence)."""
    from kvarena import store_kv

    g = torch.Generator().manual_seed(seed)
    per = [-(-n // bs) for n in lens]
    nb = sum(per) + 3
    kc, vc, ks, vs = poisoned_fp8_caches(nb, bs, h_kv, d)
    if static:
        ks, vs = torch.tensor(0.02), torch.tensor(0.01)
    ids = torch.randperm(nb, generator=g)
    table = torch.zeros(len(lens), max(per), dtype=torch.int32)
    full_k, full_v, at = [], [], 0
    for b, n in enumerate(lens):
        table[b, : per[b]] = ids[at : at + per[b]].int()
        at += per[b]
        k = torch.randn(n, h_kv, d, generator=g).to(dtype)
        v = torch.randn(n, h_kv, d, generator=g).to(dtype)
        slots = (table[b, : per[b]].long()[:, None] * bs + torch.arange(bs)).flatten()[:n]
        store_kv(k, v, kc, vc, slots, backend="torch", k_scale=ks, v_scale=vs)
        full_k.append(k)
        full_v.append(v)
    q = torch.randn(sum(q_lens), h_kv * group, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    c = dict(q=q, kc=kc, vc=vc, ks=ks, vs=vs, table=table, lens=torch.tensor(lens, dtype=torch.int32), cu=cu)
    return {**{n: t.to(device) for n, t in c.items()}, "full_k": full_k, "full_v": full_v}


# ------------------------------------------------------------------- threads


def run_threads(target: Callable[[int], object], n: int) -> list[BaseException]:
    """Run ``target(i)`` for ``i < n`` on ``n`` threads with a tiny switch interval.

    Returns the exceptions the threads raised (the caller asserts there are none).
    """
    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    return errors

"""The registry of benchmark cases and of the providers that run on them.

One registry serves both front ends: ``kvarena bench`` (``kvarena.benchmark.cli``) and
the pytest-benchmark suite under ``bench/``. Cases are plain frozen dataclasses with no
torch objects (dtypes are names), so this module is importable without torch.

Case kinds
----------
decode
    AR decode over a paged cache: one query per sequence, ``batch`` sequences of
    ``context`` keys each, pages of ``block_size`` tokens scattered at random in the
    arena (so "paged" is not secretly contiguous).
chunk
    Slab chunk attention of a causal video DiT: a chunk of ``chunk`` queries attends to
    ``sinks`` sink slabs plus the ``window`` newest slabs, its own included (full
    attention: every key is visible). A slab is one page of ``chunk`` tokens, or
    ``chunk / page_tokens`` pages when token-granular sinks/windows put an edge inside a
    slab (``-p<page>`` cases: the same keys read through frame-sized pages).
train
    A denoising step's forward + backward (Self-Forcing-style training): the chunk's
    queries over the cached history (``sinks`` + ``window - 1`` slabs, a constant) and
    the step's own K/V (given, with gradients); timed is forward plus the gradients of
    q, k and v. kvarena: the Triton backward on CUDA (the torch path's autograd on CPU);
    baseline: SDPA (flash on CUDA) forward + backward over the same keys made contiguous.
store
    Storing one chunk's K/V of one layer into the cache (kvarena's in-place slab write)
    against a plain ``copy_`` (the floor) and the shift-left copy window (the baseline
    of Self-Forcing/LongLive, which moves the retained window every chunk).

Sets
----
quick
    Tiny CPU shapes (2-4 heads, head_dim 64, 64-512 keys) that run in seconds, for the
    smoke test and for a laptop.
gpu
    docs/contract.md's realistic shapes, sized so that one H200 finishes the whole set in about
    three minutes (``bench/gpu.sh`` gives the benchmarks a 3-minute slot).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = [
    "Case",
    "PROVIDERS",
    "BASELINE",
    "SETS",
    "cases",
    "providers_for",
    "default_set",
]


@dataclass(frozen=True)
class Case:
    """One benchmark shape.

    Parameters
    ----------
    kind : {"decode", "chunk", "train", "store"}
    name : str
        Unique, filterable with ``--cases`` (substring match).
    h_q, h_kv, head_dim : int
        Query heads, KV heads (GQA when they differ) and head dimension.
    dtype : str
        A ``torch`` dtype name, e.g. ``"bfloat16"``.
    batch : int
        Sequences (decode) or rollouts (chunk, store).
    context : int
        Keys per sequence (decode only).
    block_size : int
        Page size in tokens (decode); chunk cases use ``chunk`` as the page size.
    chunk : int
        Tokens per chunk = slab (chunk, store).
    window : int
        Chunks attended and kept, the newest included (chunk, store).
    sinks : int
        Sink chunks kept forever (chunk, store).
    page_tokens : int
        Chunk cases: rows per page (0: the whole slab); must divide ``chunk``.
    model : str
        A label for the table and the plot (e.g. ``"wan1.3b"``).
    kv_dtype : str
        Storage dtype of kvarena's cache when it differs from ``dtype``:
        ``"float8_e4m3fn"`` (per-token fp32 scales). The other providers read the same
        values dequantized to ``dtype``; ``kvarena_plain`` is kvarena on that copy (the
        same-run baseline of what fp8 storage buys).
    rope : bool
        Chunk cases: RoPE on read. kvarena stores un-rotated keys and rotates q and k by an
        interleaved table (virtual positions, one row per visible key) as it reads them;
        the other providers, ``kvarena_plain`` included, read keys and queries rotated
        beforehand (untimed): the same attention, and the cost of rotating on read.
    skip_providers : tuple of str
        Providers of the kind that are reported as skipped on this case (to keep a set
        within its time budget, e.g. FlexAttention compiles once per shape on CUDA).
    """

    kind: str
    name: str
    h_q: int
    h_kv: int
    head_dim: int
    dtype: str = "bfloat16"
    batch: int = 1
    context: int = 0
    block_size: int = 16
    chunk: int = 0
    window: int = 0
    sinks: int = 0
    page_tokens: int = 0
    model: str = ""
    skip_providers: tuple[str, ...] = ()
    kv_dtype: str = ""
    rope: bool = False

    @property
    def kv_tokens(self) -> int:
        """Keys each query row reads: the context (decode) or sinks + window chunks."""
        if self.kind == "decode":
            return self.context
        return (self.sinks + self.window) * self.chunk

    @property
    def page(self) -> int:
        """Tokens per page of the arena: ``block_size`` for decode, the slab otherwise."""
        return self.block_size if self.kind == "decode" else (self.page_tokens or self.chunk)

    def as_dict(self) -> dict:
        """The fields plus ``kv_tokens``, for reports."""
        d = asdict(self)
        d["kv_tokens"] = self.kv_tokens
        return d


# Providers per kind, kvarena first: its output is the reference the others are checked
# against, so it must run before them.
PROVIDERS: dict[str, tuple[str, ...]] = {
    "decode": (
        "kvarena",
        "gather_sdpa",
        "gather_sdpa_flash",
        "gather_sdpa_efficient",
        "gather_flex",
        "flash_attn",
        "flashinfer",
        "kvarena_plain",
    ),
    "chunk": (
        "kvarena",
        "sdpa_contiguous",
        "gather_sdpa",
        "gather_sdpa_flash",
        "gather_sdpa_efficient",
        "flex_contiguous",
        "flash_attn",
        "flashinfer",
        "kvarena_plain",
    ),
    "train": ("kvarena", "sdpa_contiguous"),
    "store": ("kvarena", "copy_", "shift_left"),
}

# The same-run baseline each kind's ratio column is computed against (speedup =
# baseline time / provider time). Chunk: docs/contract.md's target is >= 0.9x SDPA on
# contiguous data (flash backend on CUDA).
BASELINE: dict[str, str] = {
    "decode": "gather_sdpa",
    "chunk": "sdpa_contiguous",
    "train": "sdpa_contiguous",
    "store": "shift_left",
}


_FP8 = "float8_e4m3fn"


def _decode(batch: int, context: int, *, h_q=32, h_kv=8, head_dim=128, dtype="bfloat16",
            block_size=16, model="decode-32q8kv", skip=(), kv_dtype="") -> Case:
    ctx = f"{context // 1024}k" if context >= 1024 and context % 1024 == 0 else str(context)
    name = f"decode-b{batch}-ctx{ctx}" + ("-fp8" if kv_dtype else "")
    return Case("decode", name, h_q, h_kv, head_dim, dtype, batch=batch, context=context,
                block_size=block_size, model=model, skip_providers=tuple(skip), kv_dtype=kv_dtype)


def _chunk(model: str, h_q: int, h_kv: int, chunk: int, window: int, *, sinks=1, head_dim=128,
           dtype="bfloat16", kind="chunk", page=0, kv_dtype="", rope=False) -> Case:
    name = (f"{kind}-{model}-w{window}" + (f"-p{page}" if page else "") + ("-fp8" if kv_dtype else "")
            + ("-rope" if rope else ""))
    return Case(kind, name, h_q, h_kv, head_dim, dtype, chunk=chunk, window=window, sinks=sinks,
                page_tokens=page, model=model, kv_dtype=kv_dtype, rope=rope)


def _gpu_set() -> list[Case]:
    out: list[Case] = []
    # Slab chunk attention first (the runner stops starting rows at --budget-s): Wan-1.3B
    # (12 heads, chunk 3 frames x 1560 = 4680) over a window sweep, then one point per
    # other model; one sink chunk each. 0.7-9 TFLOP per call.
    out += [_chunk("wan1.3b", 12, 12, 4680, w) for w in (2, 4, 8)]
    # The w8 keys through 1560-token (one-frame) pages: what a token-granular sink/window
    # costs the kernel (more blocks, a partial key tile per page), against w8 above.
    out.append(_chunk("wan1.3b", 12, 12, 4680, 8, page=1560))
    # The w8 keys stored as fp8 (per-token scales): against kvarena on bf16 in the same run.
    out.append(_chunk("wan1.3b", 12, 12, 4680, 8, kv_dtype=_FP8))
    # The w8 chunk with RoPE on read (un-rotated keys, virtual positions) against kvarena on
    # keys rotated beforehand, same run.
    out.append(_chunk("wan1.3b", 12, 12, 4680, 8, rope=True))
    out.append(_chunk("wan5b", 24, 24, 7040, 4))
    out.append(_chunk("matrixgame", 12, 12, 2640, 6))
    out.append(_chunk("magi1", 24, 8, 12150, 4))
    # A training step's attention (forward + backward), Wan-1.3B chunk over a 4- and an
    # 8-chunk window (history 3 / 7 slabs + the step's own keys).
    out += [_chunk("wan1.3b", 12, 12, 4680, w, kind="train") for w in (4, 8)]
    # Storing one chunk of one layer (the recycling step in isolation).
    out.append(_chunk("wan1.3b", 12, 12, 4680, 4, kind="store"))
    out.append(_chunk("magi1", 24, 8, 12150, 4, kind="store"))
    # AR decode, 32 q / 8 kv heads, d128, page 16. batch x context <= 2M tokens (8 GiB of
    # bf16 K+V per layer at 8 x 128 x 2 B x 2); B x ctx >= 256K is where docs/contract.md's 85%
    # of copy bandwidth target applies. FlexAttention (compiled per shape on CUDA, ~10 s
    # each) runs on the batch-16 sweep only, to fit the 3-minute slot of bench/gpu.sh.
    k = 1024
    for batch, contexts in (
        (1, (1 * k, 4 * k, 16 * k, 64 * k, 128 * k)),
        (16, (1 * k, 4 * k, 16 * k, 64 * k, 128 * k)),
        (64, (1 * k, 4 * k, 16 * k, 32 * k)),
        (256, (1 * k, 2 * k, 4 * k, 8 * k)),
    ):
        skip = () if batch == 16 else ("gather_flex",)
        out += [_decode(batch, c, skip=skip) for c in contexts]
    # fp8 KV decode (bandwidth bound: half the bytes), each against kvarena on bf16 and the
    # gathered-SDPA baseline on the same values, same run.
    fp8_skip = ("gather_flex", "gather_sdpa_flash", "gather_sdpa_efficient")
    out += [_decode(b, c, skip=fp8_skip, kv_dtype=_FP8) for b, c in ((1, 128 * k), (16, 16 * k), (64, 8 * k))]
    return out


def _quick_set() -> list[Case]:
    # Tiny CPU shapes: 4 q / 2 kv heads (GQA stays exercised), d64, fp32 accumulation on
    # bf16 data as on the GPU. Each provider call takes well under 10 ms on 2 cores.
    tiny = dict(h_q=4, h_kv=2, head_dim=64, model="tiny")
    out = [_decode(2, c, **tiny) for c in (128, 256, 512)]
    out += [_chunk("tiny", 4, 2, 64, w, head_dim=64) for w in (2, 3)]
    out.append(_chunk("tiny", 4, 2, 64, 3, head_dim=64, page=16))
    out.append(_chunk("tiny", 4, 2, 64, 3, head_dim=64, kind="train"))
    out.append(_chunk("tiny", 4, 2, 64, 3, head_dim=64, kind="store"))
    out.append(_decode(2, 256, **tiny, kv_dtype=_FP8))
    out.append(_chunk("tiny", 4, 2, 64, 3, head_dim=64, kv_dtype=_FP8))
    out.append(_chunk("tiny", 4, 2, 64, 3, head_dim=64, rope=True))
    return out


SETS = {"quick": _quick_set, "gpu": _gpu_set}


def default_set(device: str) -> str:
    """``"gpu"`` for a CUDA device, ``"quick"`` otherwise (realistic shapes do not fit a CPU)."""
    return "gpu" if str(device).startswith("cuda") else "quick"


def cases(set_name: str = "quick", only: str | list[str] | None = None) -> list[Case]:
    """The cases of one set, optionally filtered.

    Parameters
    ----------
    set_name : {"quick", "gpu"}
    only : str or list of str, optional
        Keep cases whose name contains any of these substrings (a comma-separated string
        is split).

    Returns
    -------
    list of Case
    """
    if set_name not in SETS:
        raise KeyError(f"set_name: expected one of {sorted(SETS)}, got {set_name!r}")
    selected = SETS[set_name]()
    if only:
        parts = [p.strip() for p in (only.split(",") if isinstance(only, str) else only)]
        parts = [p for p in parts if p]
        selected = [c for c in selected if any(p in c.name for p in parts)]
    return selected


def providers_for(case: Case) -> tuple[str, ...]:
    """Providers that run on ``case``, kvarena (the reference) first (``kvarena_plain`` only
    on cases where kvarena reads its cache another way: fp8 storage, RoPE on read)."""
    return tuple(p for p in PROVIDERS[case.kind] if p != "kvarena_plain" or case.kv_dtype or case.rope)

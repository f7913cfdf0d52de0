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
decode ``-pool32``
    The same decode step through a real 32-layer ``PagedKVCache`` arena (``layers=32``):
    one layer's pages are strided views spread over the whole arena, and the timed call
    is the pool's ``forward`` (store + attend, its per-layer checks included), against the
    compact per-case arena of the plain decode cases.
chunk
    Slab chunk attention of a causal video DiT: a chunk of ``chunk`` queries attends to
    ``sinks`` sink slabs plus the ``window`` newest slabs, its own included (full
    attention: every key is visible). A slab is one page of ``chunk`` tokens, or
    ``chunk / page_tokens`` pages when token-granular sinks/windows put an edge inside a
    slab (``-p<page>`` cases: the same keys read through frame-sized pages). ``step``
    says which call of ``SlabKVCache.forward`` is timed, with the spec and path that call
    launches: ``commit`` (``commit=True``: store the chunk's clean K/V into its slab, then
    attend over the visible slabs), ``denoise`` (``commit=False``: the committed history
    plus the step's own K/V, one launch), or ``guarded`` (the same keys as ``commit``
    through ``paged_attention(chunk_size=chunk)``, block-causal: the guarded page path a
    caller of the functional op gets, not what the pool launches).
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
    smoke test, a laptop and ``bench/gpu.sh --dry-run``; the same kinds, steps and
    variants as the gpu set.
gpu
    docs/contract.md's realistic shapes. The goal rows come first (``goal=True``: decode
    at B x ctx >= 256K, the Wan-1.3B denoise and commit steps at windows 4 and 8, a
    training step), so that a run cut by its time budget still has them; then the rest.

Baselines
---------
Each kind has one or more same-run baselines (``BASELINES``); every row reports its
time ratio to each (baseline time / row time) and its max error against each baseline's
output. Decode: SDPA on K/V gathered contiguous beforehand, and a device copy of the
bytes the step reads (the bandwidth ceiling of this very case: the ratio is the fraction
of copy bandwidth). Chunks: SDPA with the flash and the cuDNN backends on contiguous K/V.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = [
    "Case",
    "PROVIDERS",
    "BASELINE",
    "BASELINES",
    "NO_OUTPUT",
    "STEPS",
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
    step : str
        Chunk cases: ``"commit"``, ``"denoise"`` or ``"guarded"`` (see the module notes).
    layers : int
        Decode cases: 0 for the compact per-case arena, else the layers of a real
        ``PagedKVCache`` whose last layer is timed through ``forward``.
    goal : bool
        A row docs/contract.md sets a target for; the gpu set runs these first.
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
    step: str = ""
    layers: int = 0
    goal: bool = False

    def __post_init__(self) -> None:
        if self.kind not in PROVIDERS:
            raise ValueError(f"kind: expected one of {sorted(PROVIDERS)}, got {self.kind!r}")
        if self.step not in (STEPS if self.kind == "chunk" else ("",)):
            raise ValueError(f"step: expected one of {STEPS} for a chunk case, '' otherwise; got {self.step!r} "
                             f"for a {self.kind} case")

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


STEPS = ("commit", "denoise", "guarded")

# Providers per kind, the same-run baselines first (every later row is compared with
# their outputs and times), then kvarena, then the other libraries.
PROVIDERS: dict[str, tuple[str, ...]] = {
    "decode": (
        "sdpa_contiguous",
        "copy",
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
        "sdpa_contiguous",
        "sdpa_cudnn",
        "kvarena",
        "gather_sdpa",
        "gather_sdpa_efficient",
        "flex_contiguous",
        "flash_attn",
        "flashinfer",
        "kvarena_plain",
    ),
    "train": ("sdpa_contiguous", "kvarena"),
    "store": ("shift_left", "copy_", "kvarena"),
}

# The same-run baselines of each kind: ratio columns are baseline time / row time, error
# columns the max relative error against the baseline's output. The first is the primary
# one (``BASELINE``). Decode: SDPA on contiguous K/V (gathered untimed) and a device copy
# of the bytes the step reads. Chunk: docs/contract.md's target is >= 0.9x SDPA on
# contiguous data, flash backend (``sdpa_contiguous`` on CUDA) and cuDNN (``sdpa_cudnn``).
BASELINES: dict[str, tuple[str, ...]] = {
    "decode": ("sdpa_contiguous", "copy"),
    "chunk": ("sdpa_contiguous", "sdpa_cudnn"),
    "train": ("sdpa_contiguous",),
    "store": ("shift_left",),
}
BASELINE: dict[str, str] = {kind: names[0] for kind, names in BASELINES.items()}
# Providers whose output is not an attention result (no error column of their own).
NO_OUTPUT = frozenset({"copy"})


_FP8 = "float8_e4m3fn"


def _decode(batch: int, context: int, *, h_q=32, h_kv=8, head_dim=128, dtype="bfloat16",
            block_size=16, model="decode-32q8kv", skip=(), kv_dtype="", layers=0, goal=False) -> Case:
    ctx = f"{context // 1024}k" if context >= 1024 and context % 1024 == 0 else str(context)
    name = f"decode-b{batch}-ctx{ctx}" + ("-fp8" if kv_dtype else "") + (f"-pool{layers}" if layers else "")
    return Case("decode", name, h_q, h_kv, head_dim, dtype, batch=batch, context=context,
                block_size=block_size, model=model, skip_providers=tuple(skip), kv_dtype=kv_dtype,
                layers=layers, goal=goal)


def _chunk(model: str, h_q: int, h_kv: int, chunk: int, window: int, *, sinks=1, head_dim=128,
           dtype="bfloat16", kind="chunk", page=0, kv_dtype="", rope=False, step="commit",
           goal=False) -> Case:
    step = step if kind == "chunk" else ""
    name = (f"{kind}-{model}-w{window}" + (f"-{step}" if step else "") + (f"-p{page}" if page else "")
            + ("-fp8" if kv_dtype else "") + ("-rope" if rope else ""))
    return Case(kind, name, h_q, h_kv, head_dim, dtype, chunk=chunk, window=window, sinks=sinks,
                page_tokens=page, model=model, kv_dtype=kv_dtype, rope=rope, step=step, goal=goal)


def _gpu_set() -> list[Case]:
    k = 1024
    wan = dict(model="wan1.3b", h_q=12, h_kv=12, chunk=4680)

    def wan13(window, **kw):
        return _chunk(wan["model"], wan["h_q"], wan["h_kv"], wan["chunk"], window, **kw)

    # Goal rows first (the runner stops starting rows at --budget-s): decode at B x ctx >=
    # 256K, page 16 (32 q / 8 kv heads, d128; 85% of copy bandwidth is the target), the
    # Wan-1.3B denoise and commit steps (12 heads, chunk 3 frames x 1560 = 4680, one sink
    # chunk) at windows 4 and 8 (70% of the bf16 matmul rate), a training step.
    out = [_decode(b, c, goal=True) for b, c in ((16, 16 * k), (64, 8 * k), (256, 4 * k), (16, 64 * k), (1, 256 * k))]
    out += [wan13(w, step=s, goal=True) for w in (4, 8) for s in ("denoise", "commit")]
    out.append(_chunk("wan1.3b", 12, 12, 4680, 4, kind="train", goal=True))
    # The same decode step through a real 32-layer PagedKVCache arena (its pages spread
    # over the whole arena, the pool's forward timed), next to decode-b16-ctx16k above.
    out.append(_decode(16, 16 * k, layers=32))
    # The rest. Wan-1.3B: the guarded page path (what paged_attention(chunk_size=...) runs,
    # not the pool), a shorter window, token-granular pages (1560-token frames: a partial
    # key tile per page), fp8 history and RoPE on read (denoising steps, as the pool runs
    # them: the step's own keys are never fp8), each against kvarena on the plain keys.
    out.append(wan13(8, step="guarded"))
    out.append(wan13(2, step="commit"))
    out.append(wan13(8, step="commit", page=1560))
    out.append(wan13(8, step="denoise", kv_dtype=_FP8))
    out.append(wan13(8, step="denoise", rope=True))
    out.append(_chunk("wan5b", 24, 24, 7040, 4, step="denoise"))
    out.append(_chunk("matrixgame", 12, 12, 2640, 6, step="denoise"))
    out.append(_chunk("magi1", 24, 8, 12150, 4, step="denoise"))
    out.append(_chunk("magi1", 24, 8, 12150, 4, step="commit"))
    out.append(_chunk("wan1.3b", 12, 12, 4680, 8, kind="train"))
    # Storing one chunk of one layer (the recycling step in isolation).
    out.append(_chunk("wan1.3b", 12, 12, 4680, 4, kind="store"))
    out.append(_chunk("magi1", 24, 8, 12150, 4, kind="store"))
    # Decode sweep. batch x context <= 2M tokens (8 GiB of bf16 K+V per layer).
    for batch, contexts in ((1, (1 * k, 4 * k, 16 * k, 64 * k, 128 * k)), (16, (1 * k, 4 * k, 128 * k)),
                            (64, (1 * k, 4 * k, 32 * k)), (256, (1 * k, 2 * k, 8 * k))):
        out += [_decode(batch, c) for c in contexts]
    # fp8 KV decode (bandwidth bound: half the bytes), each against kvarena on bf16 and the
    # baselines on the same values, same run.
    out += [_decode(b, c, kv_dtype=_FP8) for b, c in ((1, 128 * k), (16, 16 * k), (64, 8 * k))]
    # FlexAttention compiles once per shape on CUDA (15-40 s): bench/gpu.sh runs this set
    # with --skip-providers for it and gives it a capped slot of its own.
    return out


def _quick_set() -> list[Case]:
    # Tiny CPU shapes: 4 q / 2 kv heads (GQA stays exercised), d64, fp32 accumulation on
    # bf16 data as on the GPU. Each provider call takes well under 10 ms on 2 cores. The
    # kinds, steps and variants of the gpu set, in its order (goal rows first).
    tiny = dict(h_q=4, h_kv=2, head_dim=64, model="tiny")
    out = [_decode(2, 256, **tiny, goal=True)]
    out += [_chunk("tiny", 4, 2, 64, 3, head_dim=64, step=s, goal=True) for s in ("denoise", "commit")]
    out.append(_chunk("tiny", 4, 2, 64, 3, head_dim=64, kind="train", goal=True))
    out.append(_decode(2, 256, **tiny, layers=32))
    out.append(_chunk("tiny", 4, 2, 64, 3, head_dim=64, step="guarded"))
    out.append(_chunk("tiny", 4, 2, 64, 2, head_dim=64, step="commit"))
    out.append(_chunk("tiny", 4, 2, 64, 3, head_dim=64, step="commit", page=16))
    out.append(_chunk("tiny", 4, 2, 64, 3, head_dim=64, step="denoise", kv_dtype=_FP8))
    out.append(_chunk("tiny", 4, 2, 64, 3, head_dim=64, step="denoise", rope=True))
    out.append(_chunk("tiny", 4, 2, 64, 3, head_dim=64, kind="store"))
    out += [_decode(2, c, **tiny) for c in (128, 512)]
    out.append(_decode(2, 256, **tiny, kv_dtype=_FP8))
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
    """Providers that run on ``case``, the kind's baselines first, then kvarena
    (``kvarena_plain`` only on cases where kvarena reads its cache another way: fp8
    storage, RoPE on read)."""
    return tuple(p for p in PROVIDERS[case.kind] if p != "kvarena_plain" or case.kv_dtype or case.rope)

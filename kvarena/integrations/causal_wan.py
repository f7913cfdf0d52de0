"""A drop-in for the ``kv_cache`` dicts of causal Wan-style video DiTs.

Self-Forcing, CausVid and LongLive give every transformer block a dict of K/V tensors
plus a token offset ``current_start``, and the block's self-attention writes its new keys
into the dict (rolling the window with copies) and attends to a slice of it. With this
adapter the pipeline opens one :class:`CausalStep` per model call and passes it where the
list of dicts went; block ``i`` calls ``kv_cache[i](q, k, v, current_start)``:

>>> import torch
>>> from kvarena.integrations.causal_wan import CausalKVCache
>>> kv = CausalKVCache(num_layers=2, num_kv_heads=2, head_dim=8, frame_tokens=4, frames_per_chunk=3,
...                    sink_frames=1, window_frames=5, max_rollouts=1, dtype=torch.float32)
>>> q, k = torch.randn(1, 12, 2, 8), torch.randn(1, 12, 2, 8)
>>> with kv.step(clean=False) as layers:          # a denoising step: writes nothing
...     noisy = [layers[i](q, k, k, current_start=0) for i in range(2)]
>>> with kv.step(clean=True) as layers:           # the clean pass commits every layer
...     clean = [layers[i](q, k, k, current_start=0) for i in range(2)]
>>> torch.allclose(noisy[1], clean[1], atol=1e-6), kv.pool.chunk_indices(0)
(True, [0])

What the model no longer has to know: the chunk index (derived from ``current_start``;
a first call of several chunks, e.g. conditioning frames, or a recache of resident
chunks is one multi-chunk step), whether the call is a denoising step or the clean pass
(the step says so), and where the step's metadata lives (in the step object the model was
handed, so an activation-checkpoint recompute after later steps uses its own step's).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Hashable, Sequence

import torch

from kvarena.argcheck import check_bool, check_int, is_int
from kvarena.attention.spec import AttentionSpec
from kvarena.cache.arena import KVLayout
from kvarena.cache.keys import CachePolicy
from kvarena.cache.slab import SlabKVCache, SlabMetadata

__all__ = ["CausalKVCache", "CausalStep"]


class CausalKVCache:
    """Slab KV of a causal video DiT, in frames; the arena sized in rollouts.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        The model's self-attention (K/V heads; queries may have a multiple of them).
    frame_tokens : int
        Tokens per latent frame (Wan 1.3B at 480p: 1560).
    frames_per_chunk : int
        Frames per chunk (``num_frame_per_block``); a slab holds one chunk.
    sink_frames : int, default 0
        Frames from the start kept visible forever (``sink_size``).
    window_frames : int, optional
        Frames a chunk attends back from its end, its own included; ``None``: all.
        Self-Forcing's ``local_attn_size`` counts the sink in: ``window_frames =
        local_attn_size - sink_size``. At least ``frames_per_chunk``.
    max_rollouts : int, default 1
        Namespaces held at once (a rollout; each CFG branch is one).
    max_frames : int, optional
        Frames per rollout; required when every slab stays (``window_frames=None`` or
        ``training=True``), else unused.
    max_run_chunks : int, default 1
        Most chunks one step plans (a conditioning prefill or a recache); each extra
        chunk may hold one more slab during that step.
    training : bool, default False
        Never recycle (a rollout whose chunks a backward pass still reads).
    dtype : torch.dtype, default bfloat16
    device : torch.device or str, optional
    backend : {"auto", "torch", "triton"}, default "auto"

    Attributes
    ----------
    pool : SlabKVCache
        The slab pool (``pool.arena`` is the one arena).
    slabs_per_rollout : int
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        frame_tokens: int,
        frames_per_chunk: int,
        sink_frames: int = 0,
        window_frames: int | None = None,
        max_rollouts: int = 1,
        max_frames: int | None = None,
        max_run_chunks: int = 1,
        training: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
        backend: str = "auto",
    ) -> None:
        ft = check_int("frame_tokens", frame_tokens, 1)
        fpc = check_int("frames_per_chunk", frames_per_chunk, 1)
        sink = check_int("sink_frames", sink_frames, 0)
        rollouts = check_int("max_rollouts", max_rollouts, 1)
        runs = check_int("max_run_chunks", max_run_chunks, 1)
        check_bool("training", training)
        st = ft * fpc
        if window_frames is not None:
            check_int("window_frames", window_frames, fpc)
        layout = KVLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
        per = {"sink_tokens": sink * ft, "slab_tokens": st}
        if window_frames is not None:
            per["window_tokens"] = window_frames * ft
        if window_frames is None or training:
            if max_frames is None:
                raise ValueError("max_frames: required when every slab stays (window_frames=None or training=True)")
            slabs = math.ceil(check_int("max_frames", max_frames, 1) / fpc) + 1
        else:
            # The most slabs a rollout holds, whatever the first chunk's frame count (a pool on
            # the meta device answers without memory).
            probe = SlabKVCache(CachePolicy("slab_kv", max_bytes=1 << 40, per_component=per), layout=layout,
                                slab_tokens=st, device="meta")
            slabs = max(probe.slabs_per_rollout(f * ft, runs) for f in range(1, fpc + 1))
        policy = CachePolicy("slab_kv", max_bytes=rollouts * slabs * layout.block_bytes(st), per_component=per,
                             training_mode_disables_recycle=training)
        self.pool = SlabKVCache(policy, layout=layout, slab_tokens=st, device=device,
                                attention=AttentionSpec(backend=backend))
        self.frame_tokens = ft
        self.slabs_per_rollout = slabs

    @classmethod
    def from_self_forcing(cls, *, local_attn_size: int, sink_size: int, num_frame_per_block: int,
                          frame_seq_length: int, **kwargs) -> CausalKVCache:
        """The adapter for Self-Forcing / LongLive's settings (``local_attn_size=-1``: global).

        ``local_attn_size`` counts the sink frames in: it must be -1 or at least
        ``sink_size + num_frame_per_block`` (a chunk's queries see their whole chunk besides
        the sinks); each argument is checked under its own name.
        """
        sink = check_int("sink_size", sink_size, 0)
        fpc = check_int("num_frame_per_block", num_frame_per_block, 1)
        check_int("frame_seq_length", frame_seq_length, 1)
        if not is_int(local_attn_size):
            raise TypeError(f"local_attn_size: expected -1 (global attention) or an int, got {local_attn_size!r}")
        if local_attn_size != -1 and local_attn_size < sink + fpc:
            raise ValueError(f"local_attn_size: expected -1 (global attention) or at least sink_size + "
                             f"num_frame_per_block = {sink} + {fpc} = {sink + fpc} frames (the sinks plus a whole "
                             f"chunk), got {local_attn_size}")
        window = None if local_attn_size == -1 else local_attn_size - sink_size
        return cls(frame_tokens=frame_seq_length, frames_per_chunk=num_frame_per_block, sink_frames=sink_size,
                   window_frames=window, **kwargs)

    def step(self, namespaces: Sequence[Hashable] | None = None, *, clean: bool) -> CausalStep:
        """One model call's K/V: ``clean=False`` a denoising step, ``clean=True`` the clean pass.

        ``namespaces``: one per batch row (default ``0 .. B-1``). Planned at its first
        attention call from ``current_start`` and the call's token count (or explicitly
        with :meth:`CausalStep.plan`, e.g. before ``torch.compile``d code runs).
        """
        return CausalStep(self, None if namespaces is None else tuple(namespaces), check_bool("clean", clean))

    def reset(self, namespaces: Sequence[Hashable] | None = None) -> None:
        """Forget rollouts (all by default), freeing their slabs: a new video."""
        for ns in self.pool.namespaces() if namespaces is None else namespaces:
            self.pool.clear_namespace(ns)

    @property
    def used_bytes(self) -> int:
        return self.pool.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.pool.free_bytes


def _holding(info) -> tuple | None:
    """What a namespace holds (chunk records and slots, retired ones, the newest chunk): equal
    before and after a plan that claimed nothing."""
    if info is None:
        return None
    return (info.last_chunk, tuple((c.index, c.slot, c.serial) for c in info.chunks),
            tuple((c.index, c.slot, c.serial) for c in info.retired))


class _LayerKV:
    """What block ``layer`` receives as its ``kv_cache``: call it instead of the cache dict logic."""

    __slots__ = ("_step", "layer")

    def __init__(self, step: CausalStep, layer: int) -> None:
        self._step, self.layer = step, layer

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, current_start: int, **options):
        """Attention of ``q [B, T, H_q, D]`` for tokens ``current_start ..`` over the cached
        history and ``k, v [B, T, H_kv, D]`` (RoPE already applied); returns ``[B, T, H_q, D]``."""
        return self._step.attend(self.layer, q, k, v, current_start, **options)


class CausalStep(Sequence):
    """One model call: indexable per layer, a context manager that checks the clean pass.

    Attributes
    ----------
    clean : bool
    meta : SlabMetadata or None
        The step's plan (None until planned).
    """

    def __init__(self, cache: CausalKVCache, namespaces: tuple | None, clean: bool) -> None:
        self._cache = cache
        self._namespaces = namespaces
        self.clean = clean
        self.meta: SlabMetadata | None = None
        self._tokens: tuple[int, int] | None = None
        self._undo: dict = {}  # namespace -> its snapshot before the plan (None: the plan made it)
        self._done = [False] * cache.pool.layout.num_layers
        self._layers = tuple(_LayerKV(self, i) for i in range(cache.pool.layout.num_layers))

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, layer):
        return self._layers[layer]

    def plan(self, current_start: int, n_tokens: int, batch: int = 1) -> SlabMetadata:
        """Plan the step for tokens ``[current_start, current_start + n_tokens)`` of each rollout.

        ``batch``: the rows, when the step was made without namespaces (rollouts ``0 ..
        batch-1``). Planning again with the same tokens returns the same metadata.
        """
        if self.meta is not None:
            if (current_start, n_tokens) != self._tokens:
                raise ValueError(
                    f"current_start: this step was planned for tokens {self._tokens[0]} .. "
                    f"{sum(self._tokens)}, got a call for {current_start} .. {current_start + n_tokens}"
                )
            return self.meta
        names = self._namespaces
        if names is None:
            names = self._namespaces = tuple(range(check_int("batch", batch, 1)))
        pool = self._cache.pool
        batch = {ns: pool.chunks_for_tokens(ns, current_start, n_tokens) for ns in names}
        undo = {ns: (pool.snapshot(ns), _holding(pool.rollout_info(ns))) if ns in pool else None for ns in names}
        self.meta = pool.plan(batch)
        self._tokens, self._undo = (current_start, n_tokens), undo
        return self.meta

    def roll_back(self) -> None:
        """Undo the step's plan after a model call that raised (an OOM, a hook, Ctrl-C):
        a rollout the plan started is dropped (a short first chunk is not pinned at its
        length), an older one goes back to where it was before the plan. One thing cannot
        come back: a slab the plan recycled (its bytes are taken over in place); that
        chunk stays planned, as a retry of the same chunk plans it. The step is spent
        after it. Called by ``__exit__`` when the ``with`` block raises."""
        pool = self._cache.pool
        for ns, before in self._undo.items():
            if before is None:
                pool.clear_namespace(ns)
                continue
            snap, held = before
            if _holding(pool.rollout_info(ns)) == held:
                continue  # the plan claimed nothing here: a restore would only stale other steps' metadata
            with contextlib.suppress(ValueError):  # a recycled slab: see above
                pool.restore(ns, snap)
        self._undo = {}

    def attend(self, layer: int, q, k, v, current_start: int, **options):
        """``q [B, T, H_q, D]``, ``k, v [B, T, H_kv, D]`` of tokens ``current_start ..``."""
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError(f"q: expected a [B, T, H_q, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
        if self.meta is None:
            self._check_first_call(layer, q, k, v, int(current_start), options)
        meta = self.plan(int(current_start), int(q.shape[1]), int(q.shape[0]))
        out = self._cache.pool.forward(q, k, v, meta, layer, commit=self.clean, **options)
        self._done[layer] = True
        return out

    def _check_first_call(self, layer: int, q, k, v, current_start: int, options: dict) -> None:
        """Before the step's plan (which may recycle a slab in place): everything the pool's
        forward would refuse in this call, so a refused first call leaves the cache as it was."""
        pool = self._cache.pool
        names = self._namespaces if self._namespaces is not None else tuple(range(q.shape[0]))
        batch = {ns: pool.chunks_for_tokens(ns, current_start, q.shape[1]) for ns in names}  # the plan's own checks
        pool.check_forward(batch, q, k, v, layer, commit=self.clean, **options)

    def __enter__(self) -> CausalStep:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.roll_back()
            return
        if self.clean and self.meta is not None and not all(self._done):
            missing = [i for i, d in enumerate(self._done) if not d]
            raise RuntimeError(
                f"clean step: layers {missing} never attended, so their K/V were not committed; the next "
                "chunk would find this one missing at those layers"
            )

"""``CausalWanRollout``: Self-Forcing's causal inference on diffusers' ``WanTransformer3DModel``.

See :mod:`kvarena.integrations.diffusers` for the call pattern and ``docs/diffusers.md``
for what differs between Self-Forcing's ``CausalWanModel`` and diffusers' Wan and how each
difference is handled here.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvarena.argcheck import is_int
from kvarena.integrations.causal_wan import CausalKVCache
from kvarena.integrations.diffusers._checks import (
    ChunkShape,
    check_bool,
    check_call,
    check_int,
    inspect_transformer,
)
from kvarena.integrations.diffusers._processors import CrossAttention, Live, LiveCall, SelfAttention
from kvarena.integrations.diffusers._prompts import PromptCache
from kvarena.integrations.diffusers._rope import ChunkRotary, chunk_rotary

__all__ = ["CausalWanRollout", "RolloutStep"]


class RolloutStep:
    """One transformer call on one chunk: ``with rollout.step(start_frame=f0, clean=...):``.

    Attributes
    ----------
    start_frame : int
    clean : bool
        True: the call commits its K/V (Self-Forcing's clean pass); False: writes nothing.
    branch : int
        Which of the rollout's ``branches`` (independent rollouts, e.g. CFG's uncond) it runs.
    frames : int or None
        The chunk's latent frames, once the call ran.
    """

    def __init__(self, rollout: CausalWanRollout, start_frame: int, clean: bool, branch: int) -> None:
        self._rollout = rollout
        self.start_frame, self.clean, self.branch = start_frame, clean, branch
        self.frames: int | None = None
        self.state = "new"  # "open" (entered), "called" (the transformer ran), "closed"
        self._layers = None

    def __enter__(self) -> RolloutStep:
        self._rollout._open(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._rollout._close_step(self, exc_type is None)

    def __repr__(self) -> str:
        return (f"RolloutStep(start_frame={self.start_frame}, clean={self.clean}, branch={self.branch}, "
                f"state={self.state!r})")


def _check_window(local_attn_size: Any, sink: int, fpc: int) -> int:
    if not is_int(local_attn_size):
        raise TypeError(f"local_attn_size: expected -1 (global attention) or an int, got {local_attn_size!r}")
    if local_attn_size != -1 and local_attn_size < sink + fpc:
        raise ValueError(f"local_attn_size: expected -1 (global attention) or at least sink_size + "
                         f"num_frame_per_block = {sink + fpc} frames, got {local_attn_size}")
    return local_attn_size


class CausalWanRollout:
    """Causal chunk-by-chunk rollouts of a diffusers ``WanTransformer3DModel`` on a slab KV cache.

    Construction installs kvarena's processors on every block's ``attn1`` / ``attn2``;
    inside ``with rollout.step(...)`` one transformer call attends causally, outside a
    step the transformer is unchanged; :meth:`close` restores the original processors.

    Parameters
    ----------
    transformer : diffusers.WanTransformer3DModel
        Text-to-video, temporal patch 1 (Wan 2.1 / Self-Forcing / CausVid layout).
    num_frame_per_block : int
        Latent frames per chunk. Only a rollout's first chunk (``start_frame=0``) may be
        shorter (1 .. ``num_frame_per_block`` frames: an image-to-video first frame,
        Self-Forcing's ``independent_first_frame``); the later chunks continue from it.
    local_attn_size : int, default -1
        Self-Forcing's window in frames, the sink included; -1: attend to everything.
    sink_size : int, default 0
        First frames kept visible forever.
    max_frames : int, optional
        The longest rollout in frames; required for global attention (it sizes the arena).
        With a window the arena holds the window and the rollout may run past it.
    batch_size : int, default 1
        Rows per transformer call (each row its own rollout; CFG as one batched call:
        ``batch_size=2`` with ``[cond; uncond]`` rows, one plan for both).
    branches : int, default 1
        Independent sequences of calls (CFG as two calls per step: ``branches=2`` and
        ``rollout.step(..., branch=1)`` for the uncond call).
    latent_size : (int, int), optional
        Latent height and width: builds the arena now (else at the first step).
    prompt_cache_bytes : int, default 1 GiB
        Budget of the cross-attention K/V cache (LRU over prompts).
    backend : {"auto", "torch", "triton"}, default "auto"

    Attributes
    ----------
    kv_cache : CausalKVCache or None
        The self-attention cache (None until the first step without ``latent_size``).
    prompt_cache : kvarena.FeatureCache
    """

    def __init__(self, transformer: Any, *, num_frame_per_block: int, local_attn_size: int = -1,
                 sink_size: int = 0, max_frames: int | None = None, batch_size: int = 1, branches: int = 1,
                 latent_size: tuple[int, int] | None = None, prompt_cache_bytes: int = 1 << 30,
                 backend: str = "auto") -> None:
        self._geom = inspect_transformer(transformer)
        self.num_frame_per_block = check_int("num_frame_per_block", num_frame_per_block, 1)
        self.sink_size = check_int("sink_size", sink_size, 0)
        self.local_attn_size = _check_window(local_attn_size, self.sink_size, self.num_frame_per_block)
        if max_frames is None and local_attn_size == -1:
            raise ValueError("max_frames: required with global attention (local_attn_size=-1): it sizes the arena")
        self.max_frames = None if max_frames is None else check_int("max_frames", max_frames, 1)
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.branches = check_int("branches", branches, 1)
        self._backend = backend
        self._prompts = PromptCache(transformer, check_int("prompt_cache_bytes", prompt_cache_bytes, 0))
        self._transformer = transformer
        self._live = Live()
        self._active: RolloutStep | None = None
        self._pending: weakref.ref | None = None
        self._committed = [0] * self.branches
        self._kv: CausalKVCache | None = None
        self._grid: tuple[int, int] | None = None
        self._rotary: dict[tuple[int, int, int, int], ChunkRotary] = {}
        self._closed = False
        if latent_size is not None:
            self._build_cache(self._latent_grid(latent_size))
        self._originals = self._install()
        self._hooks = (transformer.register_forward_pre_hook(self._before_call, with_kwargs=True),
                       transformer.register_forward_hook(self._after_call, always_call=True))

    # ------------------------------------------------------------------ setup
    def _latent_grid(self, latent_size: Any) -> tuple[int, int]:
        _, ph, pw = self._geom.patch
        if (not isinstance(latent_size, (tuple, list)) or len(latent_size) != 2
                or any(not is_int(s) or s < 1 for s in latent_size)
                or latent_size[0] % ph or latent_size[1] % pw):
            raise ValueError(f"latent_size: expected (height, width) of the latents, multiples of the patch "
                             f"({ph}, {pw}), got {latent_size!r}")
        return latent_size[0] // ph, latent_size[1] // pw

    def _install(self) -> dict[int, tuple[Any, Any]]:
        blocks = self._transformer.blocks
        for block in blocks:
            for attn in (block.attn1, block.attn2):
                if isinstance(attn.processor, (SelfAttention, CrossAttention)):
                    raise ValueError("transformer: another CausalWanRollout's processors are installed on it; "
                                     "close() that rollout first")
        originals = {}
        for i, block in enumerate(blocks):
            originals[i] = (block.attn1.processor, block.attn2.processor)
            block.attn1.set_processor(SelfAttention(self._live, i, originals[i][0]))
            block.attn2.set_processor(CrossAttention(self._live, i, originals[i][1]))
        return originals

    def _build_cache(self, grid: tuple[int, int]) -> CausalKVCache:
        # Normal tensors even when the first step runs under torch.inference_mode(): an
        # inference-tensor arena could not be written by a later step outside it.
        with torch.inference_mode(False), torch.no_grad():
            return self._make_cache(grid)

    def _make_cache(self, grid: tuple[int, int]) -> CausalKVCache:
        g = self._geom
        self._kv = CausalKVCache.from_self_forcing(
            local_attn_size=self.local_attn_size, sink_size=self.sink_size,
            num_frame_per_block=self.num_frame_per_block, frame_seq_length=grid[0] * grid[1],
            num_layers=g.num_layers, num_kv_heads=g.heads, head_dim=g.head_dim,
            max_rollouts=self.batch_size * self.branches, max_frames=self.max_frames,
            dtype=g.dtype, device=g.device, backend=self._backend)
        self._grid = grid
        return self._kv

    # ------------------------------------------------------------------ public surface
    def step(self, *, start_frame: int, clean: bool, branch: int = 0) -> RolloutStep:
        """One model call on the chunk whose first latent frame is ``start_frame``.

        ``start_frame`` must be where the branch's committed frames end (0 for a new
        rollout): a denoising step (``clean=False``) and the clean pass (``clean=True``)
        of one chunk share it; the clean pass moves it on by the chunk's frames.
        """
        if self._closed:
            raise RuntimeError("rollout: closed; build a new CausalWanRollout")
        check_int("start_frame", start_frame, 0)
        check_bool("clean", clean)
        check_int("branch", branch, 0)
        if branch >= self.branches:
            raise ValueError(f"branch: expected 0 .. {self.branches - 1} (the rollout's branches), got {branch}")
        step = RolloutStep(self, start_frame, clean, branch)
        self._pending = weakref.ref(step)
        return step

    def committed_frames(self, branch: int = 0) -> int:
        """Frames of ``branch`` committed so far (the next chunk's ``start_frame``)."""
        return self._committed[branch]

    def reset(self) -> None:
        """Forget every rollout (free its slabs): the next video. Prompt K/V stay cached
        (they are keyed by content); ``rollout.prompt_cache.clear()`` drops them."""
        if self._active is not None:
            raise RuntimeError("reset: a step is open; call it after the `with rollout.step(...)` block")
        if self._kv is not None:
            self._kv.reset([(b, r) for b in range(self.branches) for r in range(self.batch_size)])
        self._committed = [0] * self.branches

    def close(self) -> None:
        """Restore the transformer's original processors and drop the hooks and the cache."""
        if self._closed:
            return
        if self._active is not None:
            raise RuntimeError("close: a step is open; call it after the `with rollout.step(...)` block")
        self.reset()
        for hook in self._hooks:
            hook.remove()
        for i, block in enumerate(self._transformer.blocks):
            block.attn1.set_processor(self._originals[i][0])
            block.attn2.set_processor(self._originals[i][1])
        self._kv, self._closed = None, True

    def __enter__(self) -> CausalWanRollout:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    @property
    def kv_cache(self) -> CausalKVCache | None:
        return self._kv

    @property
    def prompt_cache(self):
        return self._prompts.cache

    @property
    def used_bytes(self) -> int:
        """Bytes of self-attention K/V held (0 before the arena exists)."""
        return 0 if self._kv is None else self._kv.used_bytes

    # ------------------------------------------------------------------ steps
    def _open(self, step: RolloutStep) -> None:
        if step.state != "new":
            raise RuntimeError(f"step: {step!r} was already used; make a new rollout.step(...) per call")
        if self._active is not None:
            raise RuntimeError(f"step: {self._active!r} is still open; steps do not nest")
        if self._closed:
            raise RuntimeError("rollout: closed; build a new CausalWanRollout")
        step.state, self._active = "open", step

    def _close_step(self, step: RolloutStep, ok: bool) -> None:
        self._live.call = None
        self._active = None
        called, step.state = step.state == "called", "closed"
        if not called:
            return
        if ok:
            step._layers.__exit__(None, None, None)  # a clean step: every layer committed
            if step.clean:
                self._committed[step.branch] = step.start_frame + step.frames
        else:
            step._layers.roll_back()  # a call that raised inside the model: forget its plan

    def _check_chunk(self, step: RolloutStep, shape: ChunkShape) -> None:
        b, start, f, fpc = step.branch, step.start_frame, shape.frames, self.num_frame_per_block
        nxt = self._committed[b]
        if start != nxt:
            what = "it repeats a committed chunk" if start < nxt else "it skips frames"
            raise ValueError(f"start_frame: branch {b} has committed frames 0 .. {nxt - 1}, so its next chunk starts at "
                             f"frame {nxt}; got {start} ({what})" if nxt else
                             f"start_frame: branch {b} has no committed frame, so its chunk starts at frame 0; got "
                             f"{start} ({what})")
        if f > fpc or (f != fpc and start != 0):
            raise ValueError(f"hidden_states: expected {fpc} latent frames per chunk (num_frame_per_block), got {f}; "
                             "only a rollout's first chunk (start_frame=0) may be shorter")
        if start + f > self._geom.rope_frames:
            raise ValueError(f"start_frame: the chunk ends at frame {start + f}, past the transformer's RoPE table "
                             f"({self._geom.rope_frames} frames, rope_max_seq_len)")
        if self.local_attn_size == -1 and start + f > self.max_frames:
            raise ValueError(f"start_frame: the chunk ends at frame {start + f}, past max_frames={self.max_frames} "
                             "(global attention keeps every frame; the arena was sized for max_frames)")
        grid = (shape.height, shape.width)
        if self._grid is not None and grid != self._grid and any(self._committed):
            raise ValueError(f"hidden_states: the rollout holds frames of {self._grid[0]} x {self._grid[1]} patches, "
                             f"got {grid[0]} x {grid[1]}; reset() before a video of another size")

    def _chunk_rotary(self, start: int, shape: ChunkShape) -> ChunkRotary:
        key = (start, shape.frames, shape.height, shape.width)
        rot = self._rotary.get(key)
        if rot is None:
            if len(self._rotary) >= 8:
                self._rotary.clear()
            with torch.inference_mode(False), torch.no_grad():  # normal tensors: see _build_cache
                rot = self._rotary[key] = chunk_rotary(self._transformer.rope, *key)
        return rot

    def _before_call(self, module, args: tuple, kwargs: dict) -> None:
        """The transformer's forward pre-hook: check the call, plan the step, publish it."""
        step = self._active
        if step is None:
            pending = self._pending() if self._pending is not None else None
            if pending is not None and pending.state == "new":
                raise RuntimeError("step: rollout.step(...) was made but not entered; call the transformer inside "
                                   "`with rollout.step(...):` (outside a step it runs bidirectionally)")
            return None
        if step.state != "open":
            raise RuntimeError(f"step: {step!r} already ran its transformer call; one call per step")
        call = check_call(self._geom, args, kwargs, self.batch_size, module)
        shape = call.shape
        self._check_chunk(step, shape)
        rotary = self._chunk_rotary(step.start_frame, shape)
        prompt = self._prompts.keys_for(call.encoder_hidden_states)
        kv = self._kv  # built (or rebuilt for another latent size) after everything that may raise
        if kv is None or (shape.height, shape.width) != self._grid:
            kv = self._build_cache((shape.height, shape.width))
        start_token = step.start_frame * shape.frame_tokens
        names = [(step.branch, r) for r in range(shape.batch)]
        layers = kv.step(names, clean=step.clean)
        layers.plan(start_token, shape.frames * shape.frame_tokens, shape.batch)  # last: it may recycle a slab
        self._live.call = LiveCall(layers=layers, current_start=start_token, rotary=rotary, prompt=prompt)
        step.state, step.frames, step._layers = "called", shape.frames, layers
        return None

    def _after_call(self, module, args, output) -> None:
        self._live.call = None

"""kvarena.integrations.causal_wan: the drop-in for causal Wan-style ``kv_cache`` dicts.

The reference is an independent re-statement of the rolling cache that Self-Forcing /
CausVid / LongLive keep per block (a fixed ``[B, cache_size, H, D]`` buffer: sink tokens
at its head, the newest tokens after them, rolled left by copies when a new chunk would
overflow it; a call attends the last ``max_attention_size`` tokens written).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _helpers import assert_close, grad_mode, one_torch_thread  # noqa: F401 - fixtures

from kvarena.integrations.causal_wan import CausalKVCache

pytestmark = pytest.mark.usefixtures("grad_mode")  # each test as written and under torch.inference_mode()
FT, FPC, LAYERS, H_Q, H_KV, D = 2, 3, 2, 4, 2, 16  # frame tokens, frames per chunk, ...


class RollingCache:
    """One block's K/V as the Self-Forcing family keeps it (written for this test)."""

    def __init__(self, b: int, size: int, sink: int, dtype) -> None:
        self.k = torch.zeros(b, size, H_KV, D, dtype=dtype)
        self.v = torch.zeros(b, size, H_KV, D, dtype=dtype)
        self.size, self.sink = size, sink
        self.global_end = self.local_end = 0

    def __call__(self, q, k, v, current_start: int):
        n = q.shape[1]
        end = current_start + n
        local_end = self.local_end + end - self.global_end
        if end > self.global_end and local_end > self.size:  # new tokens overflow: roll left
            evict = local_end - self.size
            keep = self.local_end - evict - self.sink
            src = slice(self.sink + evict, self.sink + evict + keep)
            self.k[:, self.sink : self.sink + keep] = self.k[:, src].clone()
            self.v[:, self.sink : self.sink + keep] = self.v[:, src].clone()
            local_end -= evict
        self.k[:, local_end - n : local_end] = k
        self.v[:, local_end - n : local_end] = v
        lo = max(0, local_end - self.size)
        kk, vv = self.k[:, lo:local_end], self.v[:, lo:local_end]
        g = H_Q // H_KV
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).double(), kk.repeat_interleave(g, 2).transpose(1, 2).double(),
            vv.repeat_interleave(g, 2).transpose(1, 2).double())
        self.global_end, self.local_end = max(end, self.global_end), local_end
        return out.transpose(1, 2)


@pytest.mark.parametrize(
    "first_frames, sink, local_attn",
    [pytest.param(1, 1, 6, id="i2v-first-frame-sink1-local6"), pytest.param(3, 1, 5, id="t2v-sink1-local5"),
     pytest.param(1, 2, 7, id="i2v-sink2-local7")],
)
def test_rollout_equals_the_rolling_kv_cache(seed, first_frames, sink, local_attn) -> None:
    """Denoising steps and clean passes, chunk by chunk: kvarena (nothing copied) equals the
    rolling cache (which copies the window every chunk), on every layer."""
    dtype = torch.float64
    kv = CausalKVCache.from_self_forcing(local_attn_size=local_attn, sink_size=sink, num_frame_per_block=FPC,
                                         frame_seq_length=FT, num_layers=LAYERS, num_kv_heads=H_KV, head_dim=D,
                                         max_rollouts=2, dtype=dtype)
    ref = [RollingCache(2, local_attn * FT, sink * FT, dtype) for _ in range(LAYERS)]
    start = 0
    for c in range(9):
        n = (first_frames if c == 0 else FPC) * FT
        for clean in (False, False, True):
            with kv.step(["cond", "uncond"], clean=clean) as layers:
                for layer in range(LAYERS):
                    q = torch.randn(2, n, H_Q, D, dtype=dtype)
                    k, v = torch.randn(2, n, H_KV, D, dtype=dtype), torch.randn(2, n, H_KV, D, dtype=dtype)
                    got = layers[layer](q, k, v, current_start=start)
                    assert_close(got, ref[layer](q, k, v, start), dtype, f"chunk {c} clean={clean} layer {layer}")
        assert kv.used_bytes <= 2 * kv.slabs_per_rollout * kv.pool.slab_bytes
        start += n


@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)  # a backward pass: needs autograd
def test_checkpoint_recompute_uses_its_own_step(seed) -> None:
    """A training rollout: chunk c's loss is backpropagated after chunk c+1 was planned and
    committed; the recompute inside torch.utils.checkpoint reads chunk c's step, so the
    gradients equal those of the same step run without checkpointing."""
    kv = CausalKVCache(num_layers=1, num_kv_heads=H_KV, head_dim=D, frame_tokens=FT, frames_per_chunk=FPC,
                       sink_frames=1, window_frames=6, training=True, max_frames=30, dtype=torch.float64)
    n = FPC * FT
    for c in range(3):  # a history
        with kv.step(clean=True) as layers:
            x = torch.randn(1, n, H_KV, D, dtype=torch.float64)
            layers[0](x.repeat(1, 1, 2, 1), x, x, current_start=c * n)
    q = torch.randn(1, n, H_Q, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, n, H_KV, D, dtype=torch.float64, requires_grad=True)
    step = kv.step(clean=False)

    def attn(q, k):
        return step[0](q, k, k, current_start=3 * n)

    plain = torch.autograd.grad(attn(q, k).square().sum(), (q, k))
    loss = torch.utils.checkpoint.checkpoint(attn, q, k, use_reentrant=False).square().sum()
    with kv.step(clean=True) as later:  # the next chunk moves on before the backward
        x = torch.randn(1, n, H_KV, D, dtype=torch.float64)
        later[0](x.repeat(1, 1, 2, 1), x, x, current_start=3 * n)
        later2 = kv.step(clean=True)
        later2.plan(4 * n, n)
    got = torch.autograd.grad(loss, (q, k))
    for name, g, r in zip("qk", got, plain):
        assert_close(g, r, torch.float64, f"d/d{name} after checkpoint recompute")


def test_first_call_of_several_chunks_is_one_multi_chunk_step(seed) -> None:
    """Conditioning frames (1 frame + 2 chunks) in ONE clean call, then chunk by chunk."""
    dtype = torch.float64
    kv = CausalKVCache(num_layers=1, num_kv_heads=H_KV, head_dim=D, frame_tokens=FT, frames_per_chunk=FPC,
                       sink_frames=1, window_frames=5, max_run_chunks=3, dtype=dtype)
    ref = RollingCache(1, 6 * FT, FT, dtype)
    start = 0
    for n in ((1 + 2 * FPC) * FT, FPC * FT, FPC * FT):
        q = torch.randn(1, n, H_Q, D, dtype=dtype)
        k, v = torch.randn(1, n, H_KV, D, dtype=dtype), torch.randn(1, n, H_KV, D, dtype=dtype)
        with kv.step(clean=True) as layers:
            got = layers[0](q, k, v, current_start=start)
        if start == 0:
            assert layers.meta.chunk_ranges == (range(0, 3),)
            # the rolling cache runs the prefill chunk by chunk (block-causal)
            want = torch.cat([ref(q[:, a:b], k[:, a:b], v[:, a:b], a) for a, b in ((0, FT), (FT, 4 * FT), (4 * FT, n))], 1)
        else:
            want = ref(q, k, v, start)
        assert_close(got, want, dtype, f"call at {start}")
        start += n


def test_misuse_is_a_clear_error() -> None:
    kv = CausalKVCache(num_layers=2, num_kv_heads=H_KV, head_dim=D, frame_tokens=FT, frames_per_chunk=FPC,
                       sink_frames=1, window_frames=4, dtype=torch.float32)
    q, k = torch.randn(1, FPC * FT, H_Q, D), torch.randn(1, FPC * FT, H_KV, D)
    with pytest.raises(ValueError, match="current_start.*first call starts at token 0"):
        kv.step(clean=False)[0](q, k, k, current_start=FT)
    with pytest.raises(RuntimeError, match=r"layers \[1\] never attended"), kv.step(clean=True) as layers:
        layers[0](q, k, k, current_start=0)
    kv.reset()
    with kv.step(clean=True) as layers:
        for i in range(2):
            layers[i](q, k, k, current_start=0)
    with pytest.raises(ValueError, match="not a chunk boundary"):
        kv.step(clean=False)[0](q, k, k, current_start=FT)
    step = kv.step(clean=False)
    step[0](q, k, k, current_start=FPC * FT)
    with pytest.raises(ValueError, match="planned for tokens 6 .. 12"):
        step[1](q, k, k, current_start=0)
    with pytest.raises(ValueError, match="max_frames"):
        CausalKVCache(num_layers=1, num_kv_heads=1, head_dim=8, frame_tokens=1, frames_per_chunk=1)
    with pytest.raises(ValueError, match="window_frames"):
        CausalKVCache(num_layers=1, num_kv_heads=1, head_dim=8, frame_tokens=1, frames_per_chunk=3, window_frames=2)


@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)  # a subprocess: the grad mode does not reach it
def test_integrations_import_nothing_heavy() -> None:
    code = ("import sys, kvarena, kvarena.integrations; "
            "bad = [m for m in ('transformers', 'diffusers', 'kvarena.integrations.causal_wan') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def _state(kv: CausalKVCache, names) -> tuple:
    """What a refused call must leave as it was (public state): chunks, bytes, the arena."""
    return [kv.pool.chunk_indices(ns) for ns in names], kv.used_bytes, kv.pool.arena.buffer.clone()


@pytest.mark.parametrize("case", ["fp64-k", "rows-of-another-batch", "uncommitted-history", "bad-option"])
def test_a_refused_first_call_plans_nothing(case: str, seed) -> None:
    """Issue 27 #4: the step planned at its first call before the pool's forward checked the
    call, so a refused call (fp64 k: TypeError) had already planned the next chunk and
    recycled a slab in place (chunk_indices [0, 2, 3] -> [0, 3, 4]). Everything is checked
    before the plan now; the same call with valid inputs then runs as on an untouched cache."""
    dtype = torch.float32
    caches = [CausalKVCache(num_layers=LAYERS, num_kv_heads=H_KV, head_dim=D, frame_tokens=FT, frames_per_chunk=FPC,
                            sink_frames=1, window_frames=2 * FPC, max_rollouts=2, dtype=dtype) for _ in range(2)]
    kv, twin = caches
    n = FPC * FT
    names = ["cond", "uncond"]
    for c in range(4):
        q, k = torch.randn(2, n, H_Q, D, dtype=dtype), torch.randn(2, n, H_KV, D, dtype=dtype)
        for cache in caches:
            step = cache.step(names, clean=True)
            for layer in range(LAYERS if (c < 3 or case != "uncommitted-history") else 1):  # chunk 3: layer 0 only
                step[layer](q, k, k, current_start=c * n)
    q, k = torch.randn(2, n, H_Q, D, dtype=dtype), torch.randn(2, n, H_KV, D, dtype=dtype)
    before = _state(kv, names)
    assert before[0] == [[0, 2, 3]] * 2
    call = dict(layer=1, k=k, rows=q.shape[0], opts={})
    if case == "fp64-k":
        call["k"], exc, text = k.double(), TypeError, "^k: expected the layout's input dtype torch.float32"
    elif case == "rows-of-another-batch":
        call["rows"], exc, text = 1, ValueError, r"^q: expected shape \(2, 6, 4, 16\)"
    elif case == "uncommitted-history":
        exc, text = RuntimeError, "chunk 3 of namespace 'cond' is in the history but was never committed at layer 1"
    else:
        call["opts"], exc, text = {"window_left": 3}, TypeError, "^window_left: the slab pool's visibility"
    with pytest.raises(exc, match=text):
        kv.step(names, clean=False)[call["layer"]](q[: call["rows"]], call["k"][: call["rows"]], k[: call["rows"]],
                                                   current_start=4 * n, **call["opts"])
    after = _state(kv, names)
    assert after[:2] == before[:2], f"{case}: the refused call changed the cache: {before[:2]} -> {after[:2]}"
    assert torch.equal(after[2], before[2]), f"{case}: the refused call wrote into the arena"
    if case == "uncommitted-history":
        return  # the history stays uncommitted at layer 1: refused again, nothing to compare
    got = kv.step(names, clean=False)[1](q, k, k, current_start=4 * n)
    want = twin.step(names, clean=False)[1](q, k, k, current_start=4 * n)
    assert torch.equal(got, want), f"{case}: the next call differs by {(got - want).abs().max().item():.3e}"


@pytest.mark.parametrize("clean", [False, True], ids=["denoising", "clean-pass"])
def test_a_model_call_that_raises_is_rolled_back(clean: bool, seed) -> None:
    """Issue 41 sweep: an exception inside the model after layer 0 attended (an OOM in its
    MLP, Ctrl-C) left the step planned: a first chunk of 1 frame stayed pinned at 1 frame,
    so the first chunk of 3 frames was then refused. The ``with`` block's exit rolls the
    plan back; the rollout then runs as on an untouched cache (vs the rolling reference)."""
    dtype = torch.float64
    kv = CausalKVCache(num_layers=LAYERS, num_kv_heads=H_KV, head_dim=D, frame_tokens=FT, frames_per_chunk=FPC,
                       sink_frames=1, window_frames=2 * FPC, max_rollouts=1, dtype=dtype)
    refs = [RollingCache(1, (1 + 2 * FPC) * FT, FT, dtype) for _ in range(LAYERS)]
    short = torch.randn(1, FT, H_Q, D, dtype=dtype), torch.randn(1, FT, H_KV, D, dtype=dtype)
    with pytest.raises(RuntimeError, match="injected"), kv.step(clean=clean) as layers:
        layers[0](short[0], short[1], short[1], current_start=0)
        raise RuntimeError("injected failure after layer 0")
    assert kv.pool.namespaces() == [] and kv.used_bytes == 0, kv.pool.namespaces()
    n = FPC * FT
    for c in range(3):
        q, k, v = (torch.randn(1, n, h, D, dtype=dtype) for h in (H_Q, H_KV, H_KV))
        if c == 2:  # chunk 2 fails once, after layer 0 attended, then runs
            before = [kv.pool.chunk_indices(0), kv.used_bytes]
            with pytest.raises(RuntimeError, match="injected"), kv.step(clean=clean) as layers:
                layers[0](q, k, v, current_start=c * n)
                raise RuntimeError("injected failure after layer 0")
            assert [kv.pool.chunk_indices(0), kv.used_bytes] == before, "the failed step stayed planned"
        with kv.step(clean=True) as layers:
            for layer in range(LAYERS):
                assert_close(layers[layer](q, k, v, current_start=c * n), refs[layer](q, k, v, c * n), dtype,
                             f"chunk {c} layer {layer}")


def test_a_rolled_back_step_that_claimed_nothing_keeps_other_steps_fresh(seed) -> None:
    """A failed step that only re-planned chunks the namespace already held (a second
    denoising call of a chunk) has nothing to undo: the roll-back must not stale the
    metadata of the step before it, which a checkpoint recompute still reads (bit-equal)."""
    dtype = torch.float64
    kv = CausalKVCache(num_layers=LAYERS, num_kv_heads=H_KV, head_dim=D, frame_tokens=FT, frames_per_chunk=FPC,
                       max_frames=3 * FPC, dtype=dtype)
    n = FPC * FT
    q, k, v = (torch.randn(1, n, h, D, dtype=dtype) for h in (H_Q, H_KV, H_KV))
    with kv.step(clean=True) as layers:
        for layer in range(LAYERS):
            layers[layer](q, k, v, current_start=0)
    earlier = kv.step(clean=False)
    first = earlier[1](q, k, v, current_start=n)  # plans chunk 1
    with pytest.raises(RuntimeError, match="injected"), kv.step(clean=False) as layers:
        layers[0](q, k, v, current_start=n)  # the same chunk: nothing new claimed
        raise RuntimeError("injected failure after layer 0")
    assert torch.equal(earlier[1](q, k, v, current_start=n), first), "the earlier step's recompute differs"


@pytest.mark.parametrize(("kw", "exc", "text"), [
    pytest.param(dict(local_attn_size=2), ValueError,
                 r"^local_attn_size: expected -1 \(global attention\) or at least sink_size \+ num_frame_per_block "
                 r"= 1 \+ 3 = 4", id="window-shorter-than-sink-plus-chunk"),
    pytest.param(dict(local_attn_size=0), ValueError, "^local_attn_size: ", id="local-attn-0"),
    pytest.param(dict(local_attn_size=6.0), TypeError, "^local_attn_size: expected -1", id="local-attn-float"),
    pytest.param(dict(sink_size=-1), ValueError, "^sink_size: expected an int >= 0", id="negative-sink"),
    pytest.param(dict(num_frame_per_block=0), ValueError, "^num_frame_per_block: expected an int >= 1",
                 id="empty-block"),
    pytest.param(dict(frame_seq_length=0), ValueError, "^frame_seq_length: expected an int >= 1", id="empty-frame"),
])
def test_from_self_forcing_names_the_callers_arguments(kw, exc, text) -> None:
    """Issue 27 #5: local_attn_size=2, sink_size=1, num_frame_per_block=3 complained about
    window_frames, an argument the caller never passed; now the caller's argument and rule."""
    args = dict(local_attn_size=6, sink_size=1, num_frame_per_block=FPC, frame_seq_length=FT, num_layers=1,
                num_kv_heads=H_KV, head_dim=D, **{"dtype": torch.float32})
    with pytest.raises(exc, match=text) as err:
        CausalKVCache.from_self_forcing(**{**args, **kw})
    assert "window_frames" not in str(err.value) and "frame_tokens" not in str(err.value), str(err.value)

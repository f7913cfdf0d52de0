"""kvarena.integrations.diffusers: Self-Forcing-style rollouts of diffusers' WanTransformer3DModel.

Parity is against tests/integrations/_diffusers_reference.py: Self-Forcing's causal inference restated
as one masked full-sequence call of the same transformer (no cache, plain torch attention,
diffusers' own RoPE over the whole sequence). Every call of every chunk (denoising steps
and the clean pass) must agree to 1e-4 relative in fp32; a wrong window must not.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import grad_mode, interpreter_test, one_torch_thread  # noqa: F401 - fixtures

pytest.importorskip("diffusers", reason="the diffusers extra is not installed (pip install 'kvarena[diffusers]')")

from _diffusers_reference import SelfForcingReference, rel_err  # noqa: E402
from diffusers import WanTransformer3DModel  # noqa: E402

from kvarena.integrations.diffusers import (  # noqa: E402
    CausalWanRollout,
    convert_self_forcing_state_dict,
    wan_config_from_state_dict,
)
from kvarena.integrations.diffusers.convert import BLOCK_NAMES, TOP_NAMES  # noqa: E402

pytestmark = pytest.mark.usefixtures("grad_mode")  # each test as written and under torch.inference_mode()
ROOT = Path(__file__).resolve().parents[2]
C, TEXT, LAT_H, LAT_W = 4, 24, 6, 10  # latent channels, text width, latent size (3 x 5 patches)
FS = (LAT_H // 2) * (LAT_W // 2)
TOL = 1e-4


def tiny_wan(seed: int = 0, **over) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=C, out_channels=C,
               text_dim=TEXT, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True, rope_max_seq_len=64)
    cfg.update(over)
    model = WanTransformer3DModel(**cfg).eval()
    with torch.no_grad():  # diffusers zero-inits nothing here, but make every table non-trivial
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_wan()


def call(model, x, t, emb):
    return model(hidden_states=x, timestep=t, encoder_hidden_states=emb, return_dict=False)[0]


def lat(b: int, f: int) -> torch.Tensor:
    return torch.randn(b, C, f, LAT_H, LAT_W)


def roll(model, *, fpc, local, sink, frames, batch=1, steps=2, refs=(), emb=None):
    """Self-Forcing's call pattern on the rollout and on each reference: ``steps`` denoising
    calls per chunk, then the clean pass; returns the relative errors per reference."""
    refs = [SelfForcingReference(model, local_attn_size=lo, sink_size=si, frame_tokens=FS) for lo, si in
            (refs or [(local, sink)])]
    emb = torch.randn(batch, 7, TEXT) if emb is None else emb
    errs: list[list[float]] = [[] for _ in refs]
    history: list = []
    with torch.no_grad(), CausalWanRollout(model, num_frame_per_block=fpc, local_attn_size=local, sink_size=sink,
                                           max_frames=sum(frames), batch_size=batch) as rollout:
        start = 0
        for f in frames:
            for k in range(steps + 1):
                clean = k == steps
                x = lat(batch, f)
                t = torch.zeros(batch) if clean else torch.rand(batch) * 1000
                with rollout.step(start_frame=start, clean=clean):
                    got = call(model, x, t, emb)
                for ref, e in zip(refs, errs):
                    e.append(rel_err(got, ref(history, x, t, emb)))
            history.append((x, t))
            start += f
        assert rollout.committed_frames() == sum(frames)
    return errs


def test_global_attention_matches_reference(model, seed):
    """local_attn_size=-1, 3 chunks of 2 frames of 3 x 5 patches, 2 rows."""
    (errs,) = roll(model, fpc=2, local=-1, sink=0, frames=[2, 2, 2], batch=2)
    assert max(errs) < TOL, errs


def test_window_with_sink_matches_and_wrong_window_does_not(model, seed):
    """Window of 4 frames with 1 sink frame over 5 chunks of 2: the window moves by 2 frames
    while C - S = 3 frames, so windows do not align to chunks; a reference with a window of 5
    (the negative control) must disagree once frames leave it."""
    errs, wrong = roll(model, fpc=2, local=4, sink=1, frames=[2] * 5, refs=[(4, 1), (5, 1)])
    assert max(errs) < TOL, errs
    assert max(wrong) > 1e-2, wrong


def test_short_first_chunk(model, seed):
    """An image-to-video style first chunk of 1 frame, then chunks of 3 (window 5, sink 1)."""
    (errs,) = roll(model, fpc=3, local=5, sink=1, frames=[1, 3, 3, 3], steps=1)
    assert max(errs) < TOL, errs


def test_cfg_two_branches_equal_one_batched_plan(model, seed):
    """CFG: cond/uncond as two branches (two calls a step) and as one [cond; uncond] batch."""
    cond, uncond = torch.randn(1, 7, TEXT), torch.randn(1, 7, TEXT)
    ref = SelfForcingReference(model, local_attn_size=3, sink_size=1, frame_tokens=FS)
    history: list = []
    errs = []
    with torch.no_grad(), \
            CausalWanRollout(copy.deepcopy(model), num_frame_per_block=2, local_attn_size=3, sink_size=1,
                             batch_size=2) as one, \
            CausalWanRollout(model, num_frame_per_block=2, local_attn_size=3, sink_size=1, branches=2) as two:
        for start in (0, 2, 4):
            for clean in (False, True):
                x, t = lat(1, 2), torch.full((1,), 0.0 if clean else 700.0)
                outs = []
                for branch, emb in enumerate((cond, uncond)):
                    with two.step(start_frame=start, clean=clean, branch=branch):
                        outs.append(call(model, x, t, emb))
                with one.step(start_frame=start, clean=clean):
                    both = call(one._transformer, x.expand(2, -1, -1, -1, -1), t.expand(2), torch.cat([cond, uncond]))
                errs.append(rel_err(torch.cat(outs), both))
                errs.append(rel_err(outs[0], ref(history, x, t, cond)))
            history.append((x, t))
    assert max(errs) < TOL, errs


def test_fused_projections(model, seed):
    """diffusers' fuse_qkv_projections (to_qkv / to_kv): the same rollout."""
    fused = copy.deepcopy(model)
    fused.fuse_qkv_projections()
    plain = copy.deepcopy(model)
    emb = torch.randn(1, 7, TEXT)
    errs = []
    with torch.no_grad(), CausalWanRollout(plain, num_frame_per_block=2, local_attn_size=3) as a, \
            CausalWanRollout(fused, num_frame_per_block=2, local_attn_size=3) as b:
        for start in (0, 2, 4):
            for clean in (False, True):
                x, t = lat(1, 2), torch.full((1,), 0.0 if clean else 400.0)
                with a.step(start_frame=start, clean=clean):
                    want = call(plain, x, t, emb)
                with b.step(start_frame=start, clean=clean):
                    errs.append(rel_err(call(fused, x, t, emb), want))
    assert max(errs) < TOL, errs


@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)  # the test switches modes itself
def test_a_rollout_begun_under_inference_mode_goes_on_outside_it(model, seed):
    """The arena (and RoPE tables) built at a first step under torch.inference_mode() were
    inference tensors: the next step under no_grad died writing them ("Inplace update to
    inference tensor outside InferenceMode"). The mixed rollout equals a no_grad one."""
    emb = torch.randn(1, 7, TEXT)
    chunks = [(lat(1, 2), torch.tensor([300.0])) for _ in range(4)]
    outs = []
    for first_mode in (torch.no_grad, torch.inference_mode):
        got = []
        with CausalWanRollout(model, num_frame_per_block=2, local_attn_size=4, sink_size=1) as r:
            for i, (x, t) in enumerate(chunks):
                with (first_mode() if i == 0 else torch.no_grad()), r.step(start_frame=2 * i, clean=True):
                    got.append(call(model, x, t, emb).clone())
        outs.append(torch.stack(got))
    assert torch.equal(outs[0], outs[1]), f"{rel_err(outs[1], outs[0]):.2e} off the no_grad rollout"


def test_outside_a_step_the_transformer_is_unchanged_and_close_restores(model, seed):
    plain = copy.deepcopy(model)
    before = dict(model.attn_processors)
    x, t, emb = lat(1, 3), torch.tensor([321.0]), torch.randn(1, 5, TEXT)
    with torch.no_grad():
        rollout = CausalWanRollout(model, num_frame_per_block=3, max_frames=9)
        assert all(a is not b for a, b in zip(model.attn_processors.values(), before.values()))
        with rollout.step(start_frame=0, clean=True):
            call(model, x, t, emb)
        assert torch.equal(call(model, x, t, emb), call(plain, x, t, emb))  # bidirectional, as before
        rollout.close()
        assert all(a is b for a, b in zip(model.attn_processors.values(), before.values()))
        assert torch.equal(call(model, x, t, emb), call(plain, x, t, emb))
        with pytest.raises(RuntimeError, match="closed"):
            rollout.step(start_frame=0, clean=False)


def test_prompt_kv_projected_once_per_prompt_and_weights(model, seed):
    layers = len(model.blocks)
    emb, other = torch.randn(1, 7, TEXT), torch.randn(1, 7, TEXT)
    m = copy.deepcopy(model)
    with torch.no_grad(), CausalWanRollout(m, num_frame_per_block=2, max_frames=8) as rollout:
        cache = rollout.prompt_cache
        for start in (0, 2):
            for clean in (False, False, True):
                with rollout.step(start_frame=start, clean=clean):
                    call(m, lat(1, 2), torch.tensor([10.0]), emb)
        assert (cache.misses, cache.hits) == (layers, 5 * layers)
        with rollout.step(start_frame=4, clean=False):  # a prompt switch (LongLive): a new key
            call(m, lat(1, 2), torch.tensor([10.0]), other)
        assert cache.misses == 2 * layers
        m.blocks[0].attn2.to_k.weight.mul_(1.5)  # new weights: new keys, never a stale hit
        with rollout.step(start_frame=4, clean=False):
            call(m, lat(1, 2), torch.tensor([10.0]), other)
        assert cache.misses == 3 * layers


def _assign_other_weights(m, emb):
    """load_state_dict(..., assign=True): new Parameter objects (another model's attn2 K/V)."""
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    other = tiny_wan(seed=5).state_dict()
    sd.update({k: other[k].clone() for k in sd if ".attn2.to_k." in k or ".attn2.to_v." in k})
    m.load_state_dict(sd, assign=True)
    return emb


def _peft_fuse(m, emb):
    """A LoRA merged as PEFT merges it: ``base_layer.weight.data += B @ A * scale`` (no version bump)."""
    g = torch.Generator().manual_seed(3)
    for block in m.blocks:
        for lin in (block.attn2.to_k, block.attn2.to_v):
            out_f, in_f = lin.weight.shape
            delta = torch.randn(out_f, 2, generator=g) @ torch.randn(2, in_f, generator=g) * 0.1
            lin.weight.data += delta.to(lin.weight.dtype)
    return emb


def _edit_prompt(m, emb):
    """The same embedding object, edited through ``.data`` (no version bump)."""
    emb.data[:, 2:5] += 1.0
    return emb


FRESHNESS = [("load_state_dict-assign", _assign_other_weights), ("peft-fuse-data", _peft_fuse),
             ("prompt-edited-through-data", _edit_prompt)]


@pytest.mark.parametrize("change", [c for _, c in FRESHNESS], ids=[n for n, _ in FRESHNESS])
def test_prompt_kv_fresh_after_writes_no_version_counter_sees(model, seed, change):
    """The prompt K/V after each write is what the changed model computes, never the cached
    K/V of before (the stale answer is shown to differ, so the check can fail)."""
    m = copy.deepcopy(model)
    emb = torch.randn(1, 7, TEXT)
    x, t = lat(1, 2), torch.tensor([300.0])
    with torch.no_grad(), CausalWanRollout(m, num_frame_per_block=2, max_frames=4) as rollout:
        with rollout.step(start_frame=0, clean=False):
            before = call(m, x, t, emb)  # projects and caches the prompt's K/V
        emb = change(m, emb)
        with rollout.step(start_frame=0, clean=False):
            got = call(m, x, t, emb)
    with torch.no_grad():
        want = SelfForcingReference(m, local_attn_size=-1, sink_size=0, frame_tokens=FS)([], x, t, emb)
    assert rel_err(before, want) > 1e-2, "the change does not move the output: the test could not fail"
    err = rel_err(got, want)
    assert err < TOL, f"{err:.2e} off the changed model (stale prompt K/V?); before the change: {rel_err(before, want):.2e}"


FINGERPRINT_CASES = [("bf16-subnormal-bit", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)]


@pytest.mark.parametrize("dtype", [d for _, d in FINGERPRINT_CASES], ids=[n for n, _ in FINGERPRINT_CASES])
def test_fingerprint_sees_one_bit_and_ignores_strides(seed, dtype):
    """The prompt key's fingerprint: one flipped low bit (here of a tiny value) anywhere is a
    new value; the same values in another layout, or a copy, are the same value."""
    from kvarena.integrations.diffusers._fingerprint import fingerprint

    x = (torch.randn(37, 19) * 1e-39).to(dtype) if dtype == torch.bfloat16 else torch.randn(37, 19, dtype=dtype)
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()]
    base = fingerprint([x])
    for i, j in ((0, 0), (36, 18), (17, 4)):
        y = x.clone()
        y.view(bits)[i, j] ^= 1
        assert fingerprint([y]) != base, f"a flipped bit at {(i, j)} kept the fingerprint"
    assert fingerprint([x.t().contiguous().t()]) == base == fingerprint([x.clone()])
    assert fingerprint([x.reshape(19, 37)]) != base  # the shape is part of it


def test_fingerprint_is_the_same_hashed_together_alone_or_in_chunks(seed, monkeypatch):
    """Tensors of one shape are hashed together, a big one in row chunks: each value is
    what it is hashed alone (so a key never depends on what else a call holds)."""
    from kvarena.integrations.diffusers import _fingerprint as fp

    ts = [torch.randn(5, 7).bfloat16(), torch.randn(5, 7).bfloat16(), torch.randn(7), torch.randn(5, 7),
          torch.randn(3, 4, 7).half(), torch.randn(0, 3), torch.randn(7, 5).bfloat16().t()]
    together = [v[1:] for v in fp.fingerprint(ts)]
    alone = [fp.fingerprint([t])[0][1:] for t in ts]
    assert together == alone
    monkeypatch.setattr(fp, "_CHUNK", 40)  # 5 x 7 alone per chunk, 12 x 7 in row chunks
    assert [v[1:] for v in fp.fingerprint(ts)] == together


def test_fingerprint_reads_a_wrapper_subclass_through_its_inner_tensors(seed):
    """A quantized weight is a tensor subclass (torchao's hold data and scales inside): the
    fingerprint flattens it, so a write to an inner tensor is a new value (it raised)."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    from kvarena.integrations.diffusers._fingerprint import fingerprint

    a, b = torch.randn(5, 7), torch.randn(5, 7)
    w = two_tensor.TwoTensor(a, b)
    base = fingerprint([w])
    b.data[2, 3] += 1.0
    assert fingerprint([w]) != base, "a write to an inner tensor kept the fingerprint"
    assert fingerprint([two_tensor.TwoTensor(a.clone(), b.clone())]) == fingerprint([w])


def _state(rollout, names):
    kv = rollout.kv_cache
    return (rollout.used_bytes, [kv.pool.chunk_indices(ns) for ns in names], rollout.committed_frames(),
            rollout.prompt_cache.stats()["entries"])


BAD_CALLS = [
    ("hidden_states", lambda x, t, e: (x[:, :, :1], t, e)),            # 1 frame after the first chunk
    ("hidden_states", lambda x, t, e: (x.expand(2, -1, -1, -1, -1), t, e)),  # batch 2, rollout of 1
    ("hidden_states", lambda x, t, e: (x[..., :5], t, e)),             # width not a patch multiple
    ("timestep", lambda x, t, e: (x, t[:, None].expand(1, 2), e)),     # Self-Forcing's [B, F]
    ("encoder_hidden_states", lambda x, t, e: (x, t, e[..., :5])),
    ("hidden_states", lambda x, t, e: (x.double(), t, e)),             # dtype: the transformer's is fp32
    ("encoder_hidden_states", lambda x, t, e: (x, t, e.double())),
    ("hidden_states", lambda x, t, e: (x.to("meta"), t, e)),           # device: the transformer's is cpu
    ("timestep", lambda x, t, e: (x, t.to("meta"), e)),
    ("encoder_hidden_states", lambda x, t, e: (x, t, e.to("meta"))),
]


BAD_CALL_IDS = ["frames", "batch", "width", "timestep-2d", "text-dim", "latent-fp64", "emb-fp64", "latent-device",
                "timestep-device", "emb-device", "timestep-bool"]


@pytest.mark.parametrize("name,bad", BAD_CALLS, ids=[f"{n}-{i}" for n, i in zip([n for n, _ in BAD_CALLS], BAD_CALL_IDS)])
def test_bad_call_names_the_argument_and_leaves_the_cache(model, seed, name, bad):
    emb = torch.randn(1, 7, TEXT)
    ref = SelfForcingReference(model, local_attn_size=4, sink_size=1, frame_tokens=FS)
    with torch.no_grad(), CausalWanRollout(model, num_frame_per_block=2, local_attn_size=4, sink_size=1) as rollout:
        x0, t0 = lat(1, 2), torch.zeros(1)
        with rollout.step(start_frame=0, clean=True):
            call(model, x0, t0, emb)
        names = [(0, 0)]
        before = _state(rollout, names)
        x, t = lat(1, 2), torch.tensor([500.0])
        with pytest.raises((ValueError, TypeError), match=name), rollout.step(start_frame=2, clean=True):
            call(model, *bad(x, t, emb))
        assert _state(rollout, names) == before
        with rollout.step(start_frame=2, clean=False):  # the rollout goes on as if nothing happened
            got = call(model, x, t, emb)
        assert rel_err(got, ref([(x0, t0)], x, t, emb)) < TOL


REFUSED_DTYPES = [("latent-fp64", lambda x, e: (x.double(), e), "hidden_states"),
                  ("latent-fp16", lambda x, e: (x.half(), e), "hidden_states"),
                  ("emb-fp64", lambda x, e: (x, e.double()), "encoder_hidden_states")]


@pytest.mark.parametrize("bad,name", [c[1:] for c in REFUSED_DTYPES], ids=[c[0] for c in REFUSED_DTYPES])
def test_a_refused_dtype_recycles_no_slab(model, seed, bad, name):
    """Past the window (chunks [0, 2, 3] resident, chunk 1 recycled), a call of the next chunk
    refused for its dtype names the argument and leaves the chunks as they were; the valid
    call after it gives what it gives without the refused one."""
    emb, t = torch.randn(1, 7, TEXT), torch.tensor([400.0])
    x = lat(1, 2)
    outs, chunks = [], []
    for refuse in (False, True):
        torch.manual_seed(seed)
        with torch.no_grad(), CausalWanRollout(model, num_frame_per_block=2, local_attn_size=4, sink_size=1) as r:
            for start in (0, 2, 4, 6):
                with r.step(start_frame=start, clean=True):
                    call(model, lat(1, 2), torch.zeros(1), emb)
            before = _state(r, [(0, 0)])
            if refuse:
                with pytest.raises((TypeError, ValueError), match=f"{name}.*dtype"), \
                        r.step(start_frame=8, clean=False):
                    call(model, *bad(x, emb)[:1], t, bad(x, emb)[1])
                assert _state(r, [(0, 0)]) == before, f"the refused call changed {before} to {_state(r, [(0, 0)])}"
            chunks.append(before[1])
            with r.step(start_frame=8, clean=False):
                outs.append(call(model, x, t, emb))
    assert chunks[0] == [[0, 2, 3]], chunks
    assert torch.equal(outs[0], outs[1]), f"{rel_err(outs[1], outs[0]):.2e} off the rollout without the refused call"


def test_a_transformer_moved_to_another_dtype_is_refused_before_planning(model, seed):
    """The cache was made for fp32: after ``.double()`` the call is refused naming the
    transformer (not a dtype error from inside the kernels), and nothing is planned."""
    m = copy.deepcopy(model)
    emb = torch.randn(1, 7, TEXT)
    with torch.no_grad(), CausalWanRollout(m, num_frame_per_block=2, max_frames=4, latent_size=(LAT_H, LAT_W)) as r:
        m.double()
        with pytest.raises(ValueError, match="transformer.*float64"), r.step(start_frame=0, clean=True):
            call(m, lat(1, 2).double(), torch.zeros(1), emb.double())
        assert r.used_bytes == 0 and r.kv_cache.pool.namespaces() == []


def test_fp32_inputs_under_autocast_are_accepted(seed):
    """The dtype rule defers to autocast (it casts the convolution's and the projections'
    inputs itself): a bf16 transformer fed fp32 latents and prompt under autocast runs, and
    agrees with bf16 inputs without autocast (bf16 tolerance)."""
    m = tiny_wan().to(torch.bfloat16)
    emb, x = torch.randn(1, 7, TEXT), lat(1, 2)
    outs = []
    for auto in (False, True):
        with torch.no_grad(), CausalWanRollout(m, num_frame_per_block=2, max_frames=4) as r, \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=auto), r.step(start_frame=0, clean=True):
            outs.append(call(m, x if auto else x.bfloat16(), torch.zeros(1), emb if auto else emb.bfloat16()))
    assert rel_err(outs[1], outs[0]) < 1e-2, rel_err(outs[1], outs[0])


def test_a_refused_short_first_call_pins_no_chunk(model, seed):
    """A first call of 1 frame refused for its dtype must not hold chunk 0 at 1 frame: the
    valid first chunk of 2 frames then runs and matches the reference."""
    emb, t = torch.randn(1, 7, TEXT), torch.tensor([400.0])
    ref = SelfForcingReference(model, local_attn_size=-1, sink_size=0, frame_tokens=FS)
    with torch.no_grad(), CausalWanRollout(model, num_frame_per_block=2, max_frames=4) as r:
        with pytest.raises((TypeError, ValueError), match="hidden_states.*dtype"), r.step(start_frame=0, clean=False):
            call(model, lat(1, 1).double(), t, emb)
        held = [] if r.kv_cache is None else r.kv_cache.pool.namespaces()
        assert r.used_bytes == 0 and held == [], f"the refused call left {held} planned"
        x = lat(1, 2)
        with r.step(start_frame=0, clean=False):
            got = call(model, x, t, emb)
    with torch.no_grad():
        want = ref([], x, t, emb)
    assert rel_err(got, want) < TOL, rel_err(got, want)


def _raise_once_in_block(m, layer: int):
    """A failure inside the model after the step was planned (an OOM in block ``layer``'s
    MLP, a user's hook, Ctrl-C): a forward hook that raises on its first call."""
    def hook(module, args, output):
        handle.remove()
        raise RuntimeError("injected failure after attention")
    handle = m.blocks[layer].ffn.register_forward_hook(hook)


@pytest.mark.parametrize("clean", [False, True], ids=["denoising", "clean-pass"])
def test_a_call_failing_inside_the_model_leaves_nothing_planned(model, seed, clean):
    """A first call of 1 frame dies in block 1 (block 0 attended, and committed in a clean
    pass): nothing stays planned, so the first chunk of 2 frames runs after it; then chunk 1
    dies the same way and its retry matches the reference."""
    m = copy.deepcopy(model)
    emb, t = torch.randn(1, 7, TEXT), torch.tensor([0.0 if clean else 400.0])
    x0, x1 = lat(1, 2), lat(1, 2)
    ref = SelfForcingReference(m, local_attn_size=-1, sink_size=0, frame_tokens=FS)
    with torch.no_grad(), CausalWanRollout(m, num_frame_per_block=2, max_frames=6) as r:
        _raise_once_in_block(m, 1)
        with pytest.raises(RuntimeError, match="injected"), r.step(start_frame=0, clean=clean):
            call(m, lat(1, 1), t, emb)
        assert r.used_bytes == 0 and r.kv_cache.pool.namespaces() == [], r.kv_cache.pool.namespaces()
        with r.step(start_frame=0, clean=True):
            call(m, x0, torch.zeros(1), emb)
        before = _state(r, [(0, 0)])
        _raise_once_in_block(m, 1)
        with pytest.raises(RuntimeError, match="injected"), r.step(start_frame=2, clean=clean):
            call(m, lat(1, 2), t, emb)
        assert _state(r, [(0, 0)]) == before, f"the failed call changed {before} to {_state(r, [(0, 0)])}"
        with r.step(start_frame=2, clean=False):
            got = call(m, x1, t, emb)
    with torch.no_grad():
        want = ref([(x0, torch.zeros(1))], x1, t, emb)
    assert rel_err(got, want) < TOL, rel_err(got, want)


def test_bad_start_frame_and_step_misuse(model, seed):
    emb, t = torch.randn(1, 7, TEXT), torch.tensor([1.0])
    with torch.no_grad(), CausalWanRollout(model, num_frame_per_block=2, max_frames=4) as rollout:
        with pytest.raises(ValueError, match="start_frame"), rollout.step(start_frame=2, clean=False):
            call(model, lat(1, 2), t, emb)  # skips chunk 0
        with rollout.step(start_frame=0, clean=True):
            call(model, lat(1, 2), t, emb)
        before = _state(rollout, [(0, 0)])
        for start in (0, 4):  # repeats chunk 0, skips chunk 1
            with pytest.raises(ValueError, match="start_frame"), rollout.step(start_frame=start, clean=True):
                call(model, lat(1, 2), t, emb)
        step = rollout.step(start_frame=2, clean=False)
        with pytest.raises(RuntimeError, match="not entered"):
            call(model, lat(1, 2), t, emb)
        assert _state(rollout, [(0, 0)]) == before
        with step:
            call(model, lat(1, 2), t, emb)  # a denoising step of chunk 1: plans (holds) its slab
            after = _state(rollout, [(0, 0)])
            with pytest.raises(RuntimeError, match="one call per step"):
                call(model, lat(1, 2), t, emb)
            assert _state(rollout, [(0, 0)]) == after
        with pytest.raises(RuntimeError, match="already used"), step:
            pass
        for kw, err, name in ((dict(start_frame=-1, clean=True), ValueError, "start_frame"),
                              (dict(start_frame=0, clean=1), TypeError, "clean"),
                              (dict(start_frame=0, clean=True, branch=1), ValueError, "branch")):
            with pytest.raises(err, match=name):
                rollout.step(**kw)
        with rollout.step(start_frame=2, clean=True):
            call(model, lat(1, 2), t, emb)
        with pytest.raises(ValueError, match="max_frames"), rollout.step(start_frame=4, clean=False):
            call(model, lat(1, 2), t, emb)  # global attention: the arena holds max_frames=4


def test_bad_construction_names_the_argument(model):
    with pytest.raises(TypeError, match="transformer"):
        CausalWanRollout(torch.nn.Linear(2, 2), num_frame_per_block=2, max_frames=4)
    with pytest.raises(ValueError, match="transformer"):
        CausalWanRollout(tiny_wan(patch_size=(2, 2, 2)), num_frame_per_block=2, max_frames=4)
    for kw, name in ((dict(local_attn_size=2, sink_size=1), "local_attn_size"), (dict(max_frames=None), "max_frames"),
                     (dict(max_frames=4, batch_size=0), "batch_size"), (dict(max_frames=4, latent_size=(5, 4)),
                                                                         "latent_size")):
        with pytest.raises((TypeError, ValueError), match=name):
            CausalWanRollout(model, num_frame_per_block=2, **kw)
    assert all(type(p).__module__.startswith("diffusers") for p in model.attn_processors.values())
    with CausalWanRollout(model, num_frame_per_block=2, max_frames=4), pytest.raises(ValueError, match="another"):
        CausalWanRollout(model, num_frame_per_block=2, max_frames=4)


def test_memory_flat_after_the_window_and_reset(model, seed):
    emb = torch.randn(1, 7, TEXT)
    with torch.no_grad(), CausalWanRollout(model, num_frame_per_block=2, local_attn_size=4, sink_size=1,
                                           latent_size=(LAT_H, LAT_W)) as rollout:
        used = []
        for start in range(0, 16, 2):
            with rollout.step(start_frame=start, clean=True):
                call(model, lat(1, 2), torch.zeros(1), emb)
            used.append(rollout.used_bytes)
        assert used[-1] == used[-4] > 0 and rollout.kv_cache.free_bytes >= 0, used
        rollout.reset()
        assert rollout.used_bytes == 0 and rollout.committed_frames() == 0
        with rollout.step(start_frame=0, clean=False):
            call(model, lat(1, 2), torch.ones(1), emb)


def test_bf16_transformer_gets_a_bf16_cache(seed):
    m = tiny_wan().to(torch.bfloat16)
    emb = torch.randn(1, 7, TEXT, dtype=torch.bfloat16)
    with torch.no_grad(), CausalWanRollout(m, num_frame_per_block=2, max_frames=4) as rollout:
        for start in (0, 2):
            with rollout.step(start_frame=start, clean=True):
                out = call(m, lat(1, 2).bfloat16(), torch.zeros(1), emb)
        assert rollout.kv_cache.pool.layout.dtype == torch.bfloat16 and out.dtype == torch.bfloat16


@interpreter_test
def test_triton_interpreter_lane_one_tiny_rollout(model, seed):
    """The Triton kernels (interpreter on CPU) against the torch path on one tiny rollout."""
    emb = torch.randn(1, 7, TEXT)
    outs = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(7)
        m = copy.deepcopy(model)
        got = []
        with torch.no_grad(), CausalWanRollout(m, num_frame_per_block=1, local_attn_size=2, sink_size=1,
                                               backend=backend) as rollout:
            for start in range(3):
                for clean in (False, True):
                    with rollout.step(start_frame=start, clean=clean):
                        got.append(call(m, lat(1, 1), torch.full((1,), 0.0 if clean else 600.0), emb))
        outs[backend] = torch.stack(got)
    assert rel_err(outs["triton"], outs["torch"]) < TOL


# ---------------------------------------------------------------------------- weights

def _to_original(sd: dict) -> dict:
    """diffusers names -> Self-Forcing's, from the issue's table (written out here, in reverse)."""
    top = {"condition_embedder.time_embedder.linear_1": "time_embedding.0",
           "condition_embedder.time_embedder.linear_2": "time_embedding.2",
           "condition_embedder.time_proj": "time_projection.1",
           "condition_embedder.text_embedder.linear_1": "text_embedding.0",
           "condition_embedder.text_embedder.linear_2": "text_embedding.2",
           "proj_out": "head.head", "scale_shift_table": "head.modulation", "patch_embedding": "patch_embedding"}
    block = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
             "attn1.to_out.0": "self_attn.o", "attn1.norm_q": "self_attn.norm_q", "attn1.norm_k": "self_attn.norm_k",
             "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
             "attn2.to_out.0": "cross_attn.o", "attn2.norm_q": "cross_attn.norm_q", "attn2.norm_k": "cross_attn.norm_k",
             "norm2": "norm3", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2", "scale_shift_table": "modulation"}
    out = {}
    for name, value in sd.items():
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            mod = next(m for m in sorted(block, key=len, reverse=True) if rest == m or rest.startswith(m + "."))
            out[f"blocks.{i}.{block[mod]}{rest[len(mod):]}"] = value
        else:
            mod = next(m for m in sorted(top, key=len, reverse=True) if name == m or name.startswith(m + "."))
            out[f"{top[mod]}{name[len(mod):]}"] = value
    return out


def test_converter_maps_self_forcing_names_back_exactly(model):
    sd = model.state_dict()
    original = _to_original(sd)
    assert "blocks.1.self_attn.o.weight" in original and "head.modulation" in original
    back = convert_self_forcing_state_dict(original)
    assert back.keys() == sd.keys() and all(back[k] is original[n] for n, k in zip(original, back))
    # A Self-Forcing training checkpoint: {"generator": {"model.<name>": ...}, "generator_ema": ...}.
    ema = {f"model._fsdp_wrapped_module.{k}": v + 1 for k, v in original.items()}
    ckpt = {"generator": {f"model.{k}": v for k, v in original.items()}, "generator_ema": ema}
    for use_ema, plus in ((False, 0), (True, 1)):
        got = convert_self_forcing_state_dict(ckpt, use_ema=use_ema)
        assert all(torch.equal(got[k], sd[k] + plus) for k in sd)
    fresh = WanTransformer3DModel(**wan_config_from_state_dict(back, attention_head_dim=16)).eval()
    fresh.load_state_dict(back, strict=True)
    x, t, emb = lat(1, 2), torch.tensor([99.0]), torch.randn(1, 7, TEXT)
    with torch.no_grad():
        assert torch.equal(call(fresh, x, t, emb), call(model, x, t, emb))
    # diffusers' own single-file converter agrees on every name.
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    assert convert_wan_transformer_to_diffusers(dict(original)).keys() == back.keys()
    with pytest.raises(ValueError, match="no diffusers counterpart"):
        convert_self_forcing_state_dict({**original, "blocks.0.mystery.weight": torch.zeros(1)})
    assert convert_self_forcing_state_dict({**original, "x.y": torch.zeros(1)}, strict=False).keys() == sd.keys()
    assert "ffn.0" in BLOCK_NAMES and "head.head" in TOP_NAMES


BAD_CONVERT_ARGS = [
    ("use_ema-str", dict(use_ema="false"), TypeError, "use_ema"),
    ("use_ema-int", dict(use_ema=0), TypeError, "use_ema"),
    ("strict-none", dict(strict=None), TypeError, "strict"),
]
BAD_CONFIG_ARGS = [
    ("head_dim-0", dict(attention_head_dim=0), ValueError, "attention_head_dim"),
    ("head_dim-neg", dict(attention_head_dim=-16), ValueError, "attention_head_dim"),
    ("head_dim-float", dict(attention_head_dim=16.0), TypeError, "attention_head_dim"),
    ("head_dim-bool", dict(attention_head_dim=True), TypeError, "attention_head_dim"),
    ("head_dim-not-divisor", dict(attention_head_dim=24), ValueError, "attention_head_dim"),
]


@pytest.mark.parametrize("kw,err,name", [c[1:] for c in BAD_CONVERT_ARGS], ids=[c[0] for c in BAD_CONVERT_ARGS])
def test_converter_refuses_bad_flags_naming_them(model, kw, err, name):
    """A string "false" is truthy: it must not silently pick the EMA weights."""
    ckpt = {"generator": dict(_to_original(model.state_dict())), "generator_ema": {}}
    with pytest.raises(err, match=name):
        convert_self_forcing_state_dict(ckpt, **kw)


@pytest.mark.parametrize("kw,err,name", [c[1:] for c in BAD_CONFIG_ARGS], ids=[c[0] for c in BAD_CONFIG_ARGS])
def test_config_reader_refuses_a_bad_head_dim_naming_it(model, kw, err, name):
    """0 was a ZeroDivisionError and -16 a config with -2 heads."""
    with pytest.raises(err, match=name):
        wan_config_from_state_dict(model.state_dict(), **kw)


# ---------------------------------------------------------------------------- the example

@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)  # a subprocess: the grad mode does not reach it
def test_example_runs():
    """The example end to end on its tiny model: every chunk generated, memory flat after the
    window (no timing assertion: the time is what CI's log reports)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "diffusers_self_forcing.py"), "--frames", "8",
                          "--num-frame-per-block", "2", "--steps", "1000,500", "--local-attn-size", "4",
                          "--sink-size", "1", "--no-progress"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "chunk 4/4" in res.stdout and "memory flat after the window: yes" in res.stdout, res.stdout


# ---------------------------------------------------------------------------- Self-Forcing's own code

@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)  # Self-Forcing's own model: as it runs
@pytest.mark.skipif(not os.environ.get("KVARENA_SELF_FORCING_SRC"),
                    reason="set KVARENA_SELF_FORCING_SRC to a Self-Forcing checkout (github.com/guandeh17/Self-Forcing)")
@pytest.mark.parametrize("local,sink,wrong", [(-1, 0, 6), (4, 1, 5)], ids=["global", "window4-sink1"])
def test_matches_self_forcing_own_causal_model(local, sink, wrong):
    """Self-Forcing's CausalWanModel (its kv_cache rule, causal_rope_apply, zero-padded prompt),
    its weights converted into a diffusers Wan, both run on the same noise: every call agrees;
    a rollout with a wrong window (the negative control) does not."""
    import _self_forcing_harness as sf

    causal = sf.load_causal_model(os.environ["KVARENA_SELF_FORCING_SRC"])
    heads, hd, text_len, fpc, frames = 2, 16, 16, 2, 10
    orig, size = sf.build(causal, dim=heads * hd, heads=heads, layers=2, in_dim=C, text_dim=TEXT, text_len=text_len,
                          ffn_dim=32, freq_dim=16, local_attn_size=local, sink_size=sink, frame_tokens=FS)
    sd = convert_self_forcing_state_dict({"generator": {f"model.{k}": v for k, v in orig.state_dict().items()}})
    ours = WanTransformer3DModel(**wan_config_from_state_dict(sd, attention_head_dim=hd)).eval()
    ours.load_state_dict(sd, strict=True)
    other = copy.deepcopy(ours)
    prompt = torch.randn(1, 5, TEXT)
    padded = torch.nn.functional.pad(prompt, (0, 0, 0, text_len - 5))  # Self-Forcing pads to text_len itself
    kv, cross = sf.caches(orig, 1, size, heads, hd, text_len)
    errs, bad = [], []
    with torch.no_grad(), CausalWanRollout(ours, num_frame_per_block=fpc, local_attn_size=local, sink_size=sink,
                                           max_frames=frames) as rollout, \
            CausalWanRollout(other, num_frame_per_block=fpc, local_attn_size=wrong, sink_size=sink) as control:
        for start in range(0, frames, fpc):
            for t in (1000.0, 625.0, 0.0):  # two denoising calls, then the clean pass (context_noise 0)
                x = lat(1, fpc)
                want = sf.call(orig, x, t, prompt, kv, cross, start * FS)
                for r, m, e in ((rollout, ours, errs), (control, other, bad)):
                    with r.step(start_frame=start, clean=t == 0.0):
                        e.append(rel_err(call(m, x, torch.full((1,), t), padded), want))
    print(f"self-forcing parity {local=} {sink=}: max rel err per chunk "
          f"{[f'{max(errs[i:i + 3]):.1e}' for i in range(0, len(errs), 3)]}; window {wrong}: {max(bad):.1e}")
    assert max(errs) < TOL, errs
    assert max(bad) > 1e-2, bad

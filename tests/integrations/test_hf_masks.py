"""Issue 29 #4: 4-D attention masks under ``attn_implementation="kvarena"``.

transformers hands a user's 4-D mask to the attention function as is. kvarena reads one
whose query rows each see one interval of keys (packed causal blocks, prefix-LM, windows,
padding) into kvarena sequences for its kernels, and serves any other (holes, per-head
masks, additive biases) by the exact masked path. Every kind, boolean and additive, on the
7 tiny families of test_hf, against transformers' eager given the same mask
(additive: eager adds it; a boolean is eager's additive form, False = finfo.min): every
logit within 1e-4 (fp32), rows that see no key included (eager averages every value there).
Which path each kind takes is asserted through :func:`read_4d`. transformers'
test_custom_4d_attention_mask, packed sequences in a 4-D mask with position_ids (equal to
each sequence alone), gradients, and the refusals.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from _helpers import grad_mode, one_torch_thread  # noqa: F401 - fixtures

transformers = pytest.importorskip("transformers", minversion="5.0")
from test_hf import MODELS, TOL  # noqa: E402
from test_hf import _model as _fresh_model  # noqa: E402

from kvarena.integrations import hf  # noqa: E402
from kvarena.integrations.hf.masked import Blocks, read_4d  # noqa: E402

B, S = 3, 13  # odd sizes; longer than the families' window (6)
MIN = torch.finfo(torch.float32).min
# transformers 5.2x renames the forward's past_key_values to cache (still accepted, with a warning)
# Every test runs as written and under torch.inference_mode() (the grad_mode fixture).
pytestmark = [pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
              pytest.mark.usefixtures("grad_mode")]


@pytest.fixture(scope="module", autouse=True)
def _registered():
    hf.register()
    yield


@functools.cache
def _model(name: str):
    with torch.inference_mode(False):  # shared by the tests run as written (autograd) and under inference mode
        return _fresh_model(name)


def _causal(n: int) -> torch.Tensor:
    return torch.tril(torch.ones(n, n, dtype=torch.bool))


def _packed(gen) -> torch.Tensor:
    """Each row: causal blocks of random lengths (packed sequences)."""
    m = torch.zeros(B, 1, S, S, dtype=torch.bool)
    for b in range(B):
        cuts = sorted({0, S, *torch.randint(1, S, (3,), generator=gen).tolist()})
        for a, e in zip(cuts, cuts[1:]):
            m[b, 0, a:e, a:e] = _causal(e - a)
    return m


def _prefix_lm(gen) -> torch.Tensor:
    """A bidirectional prefix of random length per row, causal after it."""
    m = _causal(S).repeat(B, 1, 1, 1)
    for b in range(B):
        p = int(torch.randint(2, S - 2, (1,), generator=gen))
        m[b, 0, :p, :p] = True
    return m


def _window(gen) -> torch.Tensor:
    """A causal window of random width per row, wider or narrower than the layers' own."""
    pos = torch.arange(S)
    w = torch.randint(2, 9, (B, 1, 1, 1), generator=gen)
    k, q = pos[None, None, None, :], pos[None, None, :, None]
    return (k <= q) & (k > q - w)


def _left_padded(gen) -> torch.Tensor:
    """A causal mask over a left-padded batch: the padding queries see no key at all."""
    pad = torch.tensor([0, 4, 9])
    pos = torch.arange(S)
    return _causal(S)[None, None] & (pos >= pad[:, None])[:, None, None, :] & (pos >= pad[:, None])[:, None, :, None]


def _holes(gen) -> torch.Tensor:
    """Causal, then random keys hidden from random queries (a query keeps its own key)."""
    m = _causal(S).repeat(B, 1, 1, 1)
    m &= torch.rand(B, 1, S, S, generator=gen) > 0.3
    return m | torch.eye(S, dtype=torch.bool)


def _per_head(gen) -> torch.Tensor:
    """A different causal window per query head (4 heads)."""
    pos = torch.arange(S)
    w = torch.tensor([2, 3, 5, 8])[None, :, None, None]
    return (pos <= pos[:, None])[None, None] & (pos[None, None, None, :] > pos[None, None, :, None] - w)


def _bias(gen) -> torch.Tensor:
    """An additive causal bias (ALiBi-like slopes plus noise): float values, not 0 / min."""
    pos = torch.arange(S, dtype=torch.float32)
    bias = -0.3 * (pos[:, None] - pos[None, :]).clamp(min=0) + 0.1 * torch.randn(B, 1, S, S, generator=gen)
    return torch.where(_causal(S), bias, MIN)


KINDS = {  # name: (builder, the path it takes: Blocks or the masked path's reason)
    "packed": (_packed, Blocks),
    "prefix-lm": (_prefix_lm, Blocks),
    "window": (_window, Blocks),
    "left-padded": (_left_padded, Blocks),
    "holes": (_holes, "holes"),
    "per-head": (_per_head, "per-head"),
    "bias": (_bias, "bias"),
}


def _additive(mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, 0.0, MIN) if mask.dtype == torch.bool else mask


def _logits(model, impl: str, ids, mask, **kw):
    model.set_attn_implementation(impl)
    return model(ids, attention_mask=mask, use_cache=False, **kw).logits


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("name", list(MODELS))
def test_4d_mask_equals_eager(name: str, kind: str) -> None:
    """Boolean and additive forms of each kind (random, per row): logits equal eager's on
    the eager form of the same mask, and the path is the one the kind should take."""
    gen = torch.Generator().manual_seed(len(name) * 31 + len(kind))
    build, path = KINDS[kind]
    mask = build(gen)
    ids = torch.randint(1, 128, (B, S), generator=gen)
    got_path = read_4d(mask, B, 4, S, S)
    assert (isinstance(got_path, Blocks) if path is Blocks else got_path == path), f"{kind}: read as {got_path}"
    model = _model(name)
    with torch.no_grad():
        want = _logits(model, "eager", ids, _additive(mask))
        assert want.isfinite().all()
        forms = {"additive": _additive(mask)} if mask.dtype != torch.bool else {"bool": mask,
                                                                                "additive": _additive(mask)}
        for form, m in forms.items():
            got = _logits(model, "kvarena", ids, m)
            err = (got - want).abs().max().item()
            assert err <= TOL, f"{name} {kind} {form}: max logit error {err:.2e} > {TOL}"


def test_blocks_reading() -> None:
    """The reading itself: a causal block is one causal sequence (kv_start its first key,
    seq_len one past its last), a causal window one causal sequence with that window, rows
    that see the same keys one bidirectional sequence, a row that sees nothing none."""
    m = torch.zeros(1, 1, 12, 12, dtype=torch.bool)
    m[0, 0, :3, :3] = _causal(3)  # rows 0-2: a causal block
    m[0, 0, 3:6, 3:6] = True  # rows 3-5: a bidirectional block
    for q in range(6, 11):  # rows 6-10: a causal block from key 6 under a window of 3
        m[0, 0, q, max(6, q - 2) : q + 1] = True
    # row 11 sees nothing
    got = read_4d(m, 2, 4, 12, 12)  # the batch broadcast to 2 rows
    assert isinstance(got, Blocks) and got.any_empty
    assert got.real[:, 11].logical_not().all() and got.real[:, :11].all()
    (plain, win), (full,) = got.causal, got.full
    assert (plain.window, win.window, full.window) == (None, 3, None)
    want = {"plain": (range(0, 3), [0, 0], [3, 3], [0, 3, 6], 3),
            "win": (range(6, 11), [6, 6], [11, 11], [0, 5, 10], 5),
            "full": (range(3, 6), [3, 3], [6, 6], [0, 3, 6], 3)}
    for what, seqs in (("plain", plain), ("win", win), ("full", full)):
        rows, starts, ends, cu, longest = want[what]
        which = torch.zeros(2, 12, dtype=torch.bool)
        which[:, list(rows)] = True
        assert torch.equal(seqs.which, which), (what, seqs.which)
        assert seqs.rows[:, 0].tolist() == [0, 1], (what, seqs.rows)
        assert (seqs.kv_start.tolist(), seqs.seq_lens.tolist(), seqs.cu_q.tolist(), seqs.max_q) == (
            starts, ends, cu, longest), (what, seqs)


def test_fully_masked_rows_and_extra_columns() -> None:
    """A query row that sees no key gets eager's answer (finite "masked" values: the average
    of every value; gpt-oss's sink: 0), and a mask wider than the keys is cut to them (as
    sdpa reads it: a static cache's mask covers every slot)."""
    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(4))
    mask = _additive(_packed(torch.Generator().manual_seed(5)))
    mask[1, 0, 4] = MIN  # one query sees nothing
    for name in ("llama-gqa", "gptoss-sinks"):
        model = _model(name)
        with torch.no_grad():
            want = _logits(model, "eager", ids, mask)
            wide = torch.cat([mask, torch.full((B, 1, S, 3), 0.0)], -1)
            got = _logits(model, "kvarena", ids, wide)
        err = (got - want).abs().max().item()
        assert err <= TOL, f"{name}: max logit error {err:.2e} > {TOL}"


def _custom_4d_data():
    """transformers' _get_custom_4d_mask_test_data: three sequences sharing a 3-token prefix,
    packed into one row whose last three tokens do not see each other (holes)."""
    ids = torch.tensor([[10, 11, 12, 13], [10, 11, 12, 14], [10, 11, 12, 15]])
    pos = torch.tensor([[0, 1, 2, 3]] * 3)
    ids_shared = torch.cat([ids[0][:-1], ids[:, -1]]).unsqueeze(0)
    mask = torch.tensor([[[[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                           [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 1]]]])
    mask = mask.eq(0).float() * MIN
    return ids, pos, ids_shared, mask, torch.tensor([[0, 1, 2, 3, 3, 3]])


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_custom_4d_attention_mask(name: str) -> None:
    """transformers' test_custom_4d_attention_mask: the shared-prefix row's last 3 logits
    equal the 3 separate sequences' last logits (softmax-normalized, transformers' rtol 1e-3
    / atol 1e-4), and the shared-prefix logits equal eager's within 1e-4."""
    ids, pos, ids_shared, mask, pos_shared = _custom_4d_data()
    model = _model(name)
    with torch.no_grad():
        want = _logits(model, "eager", ids_shared, mask, position_ids=pos_shared)
        model.set_attn_implementation("kvarena")
        alone = model(ids, position_ids=pos).logits[:, -1]
        got = _logits(model, "kvarena", ids_shared, mask, position_ids=pos_shared)
    torch.testing.assert_close(torch.softmax(got[0, -3:], -1), torch.softmax(alone, -1), rtol=1e-3, atol=1e-4)
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{name}: shared-prefix logits differ from eager's by {err:.2e}"


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_4d_mask_with_position_ids_equals_each_sequence_alone(name: str) -> None:
    """Padding-free packing as a 4-D mask: causal blocks plus position_ids restarting per
    sequence (kvarena's kernels, one sequence per block); each sequence's logits equal the
    sequence run alone (and eager's packed logits), within 1e-4."""
    gen = torch.Generator().manual_seed(9)
    lens = (4, 6, 3)  # one row, 13 tokens; none longer than the window (a 4-D mask is not windowed)
    ids = torch.randint(1, 128, (1, sum(lens)), generator=gen)
    mask = torch.zeros(1, 1, sum(lens), sum(lens), dtype=torch.bool)
    pos, a = [], 0
    for n in lens:
        mask[0, 0, a : a + n, a : a + n] = _causal(n)
        pos += list(range(n))
        a += n
    assert isinstance(read_4d(mask, 1, 4, sum(lens), sum(lens)), Blocks)
    model = _model(name)
    with torch.no_grad():
        want = _logits(model, "eager", ids, _additive(mask), position_ids=torch.tensor([pos]))
        got = _logits(model, "kvarena", ids, mask, position_ids=torch.tensor([pos]))
        a = 0
        for n in lens:
            alone = _logits(model, "kvarena", ids[:, a : a + n], None)
            err = (got[:, a : a + n] - alone).abs().max().item()
            assert err <= TOL, f"{name}: sequence at {a} differs from itself alone by {err:.2e}"
            a += n
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{name}: packed logits differ from eager's by {err:.2e}"


@pytest.mark.parametrize("kind", ["packed", "bias"])
@pytest.mark.parametrize("name", ["llama-gqa", "gemma2-window-softcap", "gptoss-sinks"])
@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)  # autograd
def test_4d_mask_gradients_equal_eager(name: str, kind: str) -> None:
    """Gradients through both paths (the kernels' for packed blocks, the masked path for a
    bias; a bias that requires grad gets eager's gradient too): every parameter of the first
    layer within 1e-5 relative of eager's."""
    gen = torch.Generator().manual_seed(11)
    mask = _additive(KINDS[kind][0](gen))
    ids = torch.randint(1, 128, (B, S), generator=gen)
    model = _fresh_model(name)
    grads = {}
    for impl in ("eager", "kvarena"):
        model.zero_grad()
        m = mask.clone().requires_grad_(kind == "bias")
        _logits(model, impl, ids, m).square().mean().backward()
        params = [p.grad.flatten() for p in model.model.layers[0].parameters() if p.grad is not None]
        grads[impl] = torch.cat(params + ([m.grad.flatten()] if kind == "bias" else []))
    err = ((grads["kvarena"] - grads["eager"]).norm() / grads["eager"].norm()).item()
    assert err <= 1e-5, f"{name} {kind}: gradient relative error {err:.2e}"


@pytest.mark.parametrize("kind", ["packed", "bias"])
def test_bf16_4d_mask_as_close_to_fp32_as_eager(kind: str) -> None:
    """bf16 Llama, both paths: kvarena's logits are as close to an fp32 eager oracle as
    eager-bf16's (within 1.5x its error), on the same mask (the mask kept in fp32)."""
    gen = torch.Generator().manual_seed(13)
    mask = _additive(KINDS[kind][0](gen))
    ids = torch.randint(1, 128, (B, S), generator=gen)
    model = _fresh_model("llama-gqa")
    with torch.no_grad():
        oracle = _logits(model, "eager", ids, mask)
        model.to(torch.bfloat16)
        errs = {impl: (_logits(model, impl, ids, mask).float() - oracle).abs().max().item()
                for impl in ("eager", "kvarena")}
    assert errs["kvarena"] <= 1.5 * errs["eager"], errs


def test_4d_mask_refusals() -> None:
    """A 4-D mask with KVArenaCache is a kvarena: error, the cache unchanged; a mask of the
    wrong shape or dtype names what it expects."""
    model = _model("llama-gqa")
    model.set_attn_implementation("kvarena")
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    cache = hf.KVArenaCache(model.config, block_size=4)
    with torch.no_grad():
        model(ids[:, :4], past_key_values=cache)
        with pytest.raises(NotImplementedError, match="^kvarena: a 4-D attention mask with KVArenaCache"):
            model(ids[:, 4:], attention_mask=torch.ones(2, 1, 3, 7, dtype=torch.bool), past_key_values=cache)
        assert cache.get_seq_length() == 4 and [cache.pool.seq_len(n) for n in cache._names] == [4, 4]
        model(ids[:, 4:], past_key_values=cache)  # the next valid step runs
        with pytest.raises(NotImplementedError, match=r"^kvarena: a 4-D attention mask of shape \(2, 1, 7, 5\) for "
                                                      r"2 rows, 4 heads, 7 queries and 7 keys"):
            model(ids, attention_mask=torch.ones(2, 1, 7, 5, dtype=torch.bool))
        with pytest.raises(NotImplementedError, match=r"^kvarena: a 4-D attention mask of dtype torch.int64"):
            model(ids, attention_mask=torch.ones(2, 1, 7, 7, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ["gemma2-window-softcap", "gptoss-sinks"])
def test_4d_blocks_on_the_triton_path(name: str) -> None:
    """The kernels' reading of a 4-D mask through the Triton kernels (interpreter): packed
    blocks with a prefix-LM row and a row that sees nothing; within 1e-4 of eager."""
    gen = torch.Generator().manual_seed(3)
    mask = _packed(gen)[:1, :, :9, :9].clone()
    mask[0, 0, :3, :3] = True
    mask[0, 0, 5] = False
    ids = torch.randint(1, 128, (1, 9), generator=gen)
    assert isinstance(read_4d(mask, 1, 4, 9, 9), Blocks)
    hf.register(backend="triton")
    try:
        model = _model(name)
        with torch.no_grad():
            want = _logits(model, "eager", ids, _additive(mask))
            got = _logits(model, "kvarena", ids, mask)
    finally:
        hf.register()
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{name} triton: max logit error {err:.2e} > {TOL}"


@pytest.mark.parametrize("name", ["llama-gqa", "gemma3"])
def test_custom_mask_function_is_served_as_its_4d_mask(name: str) -> None:
    """A mask function composed with ``or_mask_function`` (Gemma 3's bidirectional image
    tokens) reaches the hook with ``use_vmap``: the hook returns transformers' own boolean
    mask (padding folded in), which the attention function serves like a user's 4-D mask
    (here by the kernels: every row sees one interval); logits equal eager's on that mask."""
    from transformers.masking_utils import causal_mask_function, or_masks, sdpa_mask

    def image(batch_idx, head_idx, q_idx, kv_idx):  # tokens 3..7 attend each other both ways
        return (q_idx >= 3) & (q_idx < 8) & (kv_idx >= 3) & (kv_idx < 8)

    fn = or_masks(causal_mask_function, image)
    pad = torch.ones(B, S, dtype=torch.long)
    pad[1, :4] = 0  # left padding that cuts into the image block
    mask = hf.kvarena_mask(B, S, S, mask_function=fn, attention_mask=pad, use_vmap=True)
    want = sdpa_mask(batch_size=B, q_length=S, kv_length=S, mask_function=fn, attention_mask=pad.bool(),
                     allow_is_causal_skip=False, use_vmap=True)
    assert torch.equal(mask, want), "the hook's mask is not transformers' own"
    assert isinstance(read_4d(mask, B, 4, S, S), Blocks)
    ids = torch.randint(1, 128, (B, S), generator=torch.Generator().manual_seed(5))
    model = _model(name)
    with torch.no_grad():
        ref = _logits(model, "eager", ids, _additive(mask))
        got = _logits(model, "kvarena", ids, mask)
    err = (got - ref).abs().max().item()
    assert err <= TOL, f"{name}: max logit error {err:.2e} > {TOL}"


def test_a_mask_function_is_read_on_every_batch_row() -> None:
    """A mask function that departs from causal only in a middle batch row (an image block in
    row 1 of 3, as Gemma 3's block overlays do) is not read as causal: the hook hands over
    transformers' own 4-D mask, row 1's block included."""
    from transformers.masking_utils import causal_mask_function, or_masks, sdpa_mask

    def block_in_row_1(batch_idx, head_idx, q_idx, kv_idx):
        return (batch_idx == 1) & (q_idx >= 2) & (q_idx < 6) & (kv_idx >= 2) & (kv_idx < 6)

    fn = or_masks(causal_mask_function, block_in_row_1)
    got = hf.kvarena_mask(3, S, S, mask_function=fn)
    assert got.dim() == 4, "read as one rule for every row"
    assert torch.equal(got, sdpa_mask(batch_size=3, q_length=S, kv_length=S, mask_function=fn,
                                      allow_is_causal_skip=False))
    assert bool(got[1, 0, 2, 5]) and not bool(got[0, 0, 2, 5])


@pytest.mark.parametrize("grad_mode", ["as_is"], indirect=True)  # enters inference mode itself
@pytest.mark.parametrize("form", ["bool", "additive"])
def test_4d_mask_changed_in_place_under_inference_mode_is_read_again(form: str) -> None:
    """Issue 41 #1: a 4-D mask made under inference mode (no version counter) died with
    "Inference tensors do not track version counter"; a memo keyed by the mask alone would
    serve its old reading after an in-place edit. Both forwards equal eager's."""
    gen = torch.Generator().manual_seed(17)
    model = _model("qwen3")
    ids = torch.randint(1, 128, (B, S), generator=gen)
    with torch.inference_mode():
        first, second = _packed(gen), _window(gen)
        mask = first.clone() if form == "bool" else _additive(first)
        for step, new in (("packed", first), ("window, edited in place", second)):
            mask.copy_(new if form == "bool" else _additive(new))
            want = _logits(model, "eager", ids, _additive(new))
            got = _logits(model, "kvarena", ids, mask)
            err = (got - want).abs().max().item()
            assert got.isfinite().all() and err <= TOL, f"{form} {step}: max logit error {err:.2e} > {TOL}"


def test_a_4d_mask_is_not_kept_alive_by_its_reading() -> None:
    """Issue 41's sweep: the reading memoized per mask held the mask itself (a [B, 1, Q, KV]
    tensor, large for a long prefill) until the next 4-D mask came. Now it holds it weakly:
    the caller's last reference frees it."""
    import gc
    import weakref

    gen = torch.Generator().manual_seed(5)
    model = _model("llama-gqa")
    ids = torch.randint(1, 128, (B, S), generator=gen)
    mask = _packed(gen)
    with torch.no_grad():
        _logits(model, "kvarena", ids, mask)
    ref = weakref.ref(mask)
    del mask
    gc.collect()
    assert ref() is None, "the 4-D mask is still referenced after the forward"

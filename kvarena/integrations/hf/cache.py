""":class:`KVArenaCache`: a transformers ``Cache`` whose K/V live in a kvarena paged arena."""

from __future__ import annotations

import warnings
import weakref

import torch

from kvarena.argcheck import check_bool, check_int, is_int, is_integral
from kvarena.attention.batch import KeySet, QueryRows
from kvarena.integrations.hf._common import (
    _HANDOFF,
    NAME,
    _cache_base,
    _cache_class,
    _layer_base,
    _sink_logits,
    _unsupported,
)
from kvarena.integrations.hf.attention import _check_packed
from kvarena.integrations.hf.layers import _ArenaLayer
from kvarena.integrations.hf.positions import RowPositions

__all__ = ["DEFAULT_MAX_TOKENS_PER_ROW", "KVArenaCache"]

#: Tokens per row the arena holds when neither ``max_tokens`` nor ``max_bytes`` is given:
#: ``batch x min(max_position_embeddings, DEFAULT_MAX_TOKENS_PER_ROW)``.
DEFAULT_MAX_TOKENS_PER_ROW = 1 << 15

#: transformers' layer types whose layers store K/V through the cache's ``update``.
_KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

#: What makes or reshapes the arena's own tensors (the pool, its block tables) runs outside
#: inference mode: a tensor made under ``torch.inference_mode()`` cannot be written outside
#: it, and the same cache serves steps in and out of inference mode. (The step's K/V, made
#: by the model, are written into the arena by the pool's forward in the caller's mode:
#: writing into a normal tensor is allowed in either.)
_pool_state = torch.inference_mode(False)  # a decorator: a fresh context per call


class KVArenaCache:  # the transformers Cache base is mixed in at first use (see __new__)
    """A transformers ``Cache`` whose K/V live in a kvarena ``PagedKVCache`` arena.

    Pass it as ``generate(cache=KVArenaCache(model.config))`` (``past_key_values=`` on
    transformers 5.x before ``cache=``) on a model using ``attn_implementation="kvarena"``
    (another implementation is a ``ValueError`` naming it, at the first layer: it would
    attend only the new tokens). Per step: one
    ``plan`` (at the step's first attention call, not per layer), padding tokens never
    stored, every layer's new K/V stored into the arena and attended through the block
    tables; beam search / ``num_return_sequences`` reorder rows with ``fork`` (blocks
    shared by reference count), assisted decoding's ``crop`` is ``truncate``, ``reset()``
    frees every block. A full arena raises ``CacheFullError`` with the cache unchanged, and
    any other refused step (an unsupported input, another implementation's attention, a
    call the pool refuses) leaves it as it was before the step: length, rows and blocks.

    transformers' ``Cache`` API: ``layers[i]`` (``keys`` / ``values``: gathered copies of
    the arena in transformers' layout ``[B, H_kv, get_seq_length(), D]`` and the model's
    dtype, each row's stored tokens right-aligned, 0 where nothing is stored: padding,
    released blocks; see ``_ArenaLayer``), ``batch_size`` (rows; -1 before the first step),
    ``get_max_length()`` (-1: no per-row maximum), ``has_previous_state`` (no linear
    attention layer: the ValueError ``DynamicCache`` raises), ``is_croppable``.

    Parameters
    ----------
    config : PretrainedConfig
        The model's (its ``num_hidden_layers``, ``max_position_embeddings`` and
        ``_attn_implementation`` are read).
    max_tokens, max_bytes : int, optional
        Arena size in tokens (all rows together) or bytes. Neither: sized at the first
        update for ``batch x min(max_position_embeddings, DEFAULT_MAX_TOKENS_PER_ROW)``
        tokens; it does not grow (a later, bigger batch may hit ``CacheFullError``).
    block_size : int, default 16
    dtype, device : optional
        Default: the first update's K/V dtype and device (the model's).
        ``dtype=torch.float8_e4m3fn`` stores fp8 K/V with per-(token, kv head) scales
        (52% of bf16's bytes); the model's own dtype stays the input dtype (inference).
    free_out_of_window : bool, optional
        Release blocks older than the sliding window (``PagedKVCache(free_out_of_window=
        True)``). None: on when the model slides (``config.sliding_window`` set and some
        ``config.layer_types`` entry, or every layer when absent, ``"sliding_attention"``).
        Mistral-style models (every layer slides) then hold about a window per row; models
        that mix sliding and full layers (Gemma 2/3, gpt-oss) get layer groups
        (:func:`kvarena.group_layers` of ``config.layer_types``): the sliding groups hold
        about a window per row, the full ones the whole history.
    rollback_tokens : int, default 64
        With the release on: how far ``crop`` (assisted decoding) can always go back from
        the longest length a step started from (a crop does not renew the margin).
    """

    def __new__(cls, *args, **kwargs):
        base = _cache_base()
        if not issubclass(cls, base):
            cls = _cache_class(cls, base)
        return object.__new__(cls)

    def __init__(self, config, *, max_tokens: int | None = None, max_bytes: int | None = None,
                 block_size: int = 16, dtype=None, device=None, free_out_of_window: bool | None = None,
                 rollback_tokens: int = 64) -> None:
        self.num_layers = check_int("config.num_hidden_layers", config.num_hidden_layers, 1)
        layer_cls = _cache_class(_ArenaLayer, _layer_base())
        _cache_base().__init__(self, layers=[layer_cls(self, i) for i in range(self.num_layers)])
        self.config = config
        self._max_tokens = None if max_tokens is None else check_int("max_tokens", max_tokens, 1)
        self._max_bytes = None if max_bytes is None else check_int("max_bytes", max_bytes, 1)
        self.block_size = check_int("block_size", block_size, 1)
        self._dtype, self._device = dtype, device
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is not None and len(types) != self.num_layers:
            types = None  # not one entry per layer: not a layout transformers would use either
        sliding = [window is not None and (types is None or t == "sliding_attention") for t in types or
                   [None] * self.num_layers]
        if free_out_of_window is None:
            free_out_of_window = any(sliding)
        check_bool("free_out_of_window", free_out_of_window)
        if free_out_of_window and not any(sliding):
            raise ValueError("free_out_of_window: the model has no sliding layer (config.sliding_window unset or "
                             "no 'sliding_attention' in config.layer_types); nothing leaves a window")
        self._sliding = sliding
        # The layers that attend each step: those config.layer_types marks as attention
        # (every layer when it names none). A step is complete once all of them attended.
        kv = [t in _KV_LAYER_TYPES for t in types or ()]
        self._step_layers = sum(kv) if any(kv) else self.num_layers
        self._attended: set[int] = set()  # the layers the step in progress attended
        self._release = (int(window) - 1, check_int("rollback_tokens", rollback_tokens, 0)) if free_out_of_window else None
        self.pool = None
        self._names: list = []  # namespace of each batch row
        self._next_name = 0
        self._len = 0  # padded length (what transformers counts: pads included)
        self._positions = RowPositions()  # which of them hold a stored token, per row (what crop counts by)
        self._meta = None
        self._step_rows = None
        self._packed = False
        self._pending: set[int] = set()  # hand-offs not attended yet
        # The step in progress, to undo if it is refused or stops between layers: (length,
        # rows, each row's pool length, whether the pool was made for it, the positions'
        # mark); None between steps (once every layer of the step attended).
        self._undo = None

    # What transformers asks.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """transformers' length (positions, padding included) of layer ``layer_idx``: mid-step,
        before that layer's attention, its length before the step (as DynamicCache's layer,
        which that layer's update has not reached yet)."""
        self._settle(layer_idx)
        if self._undo is not None and layer_idx not in self._attended:
            return self._undo[0]
        return self._len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        self._settle(layer_idx)
        return self._len + query_length, 0

    def _settle(self, layer_idx=None) -> None:
        """Undo what a forward that stopped left behind, before anyone reads the length.

        A hand-off still pending when transformers asks for the length (a forward starts)
        was attended by another implementation, which may have failed outside kvarena (sdpa
        given this cache). A step in progress that layer ``layer_idx`` already attended (or,
        ``layer_idx`` None: between steps, any step in progress) did not reach its last
        layer: an exception between layers (the model's MLP, a hook, an OOM, Ctrl-C)
        stopped it, and the length is asked for by the next forward (or a reorder / crop /
        reset). Either way the step is undone: the retry sees the cache as before it.
        (A layer that asks for the length before its own attention, mid-step, changes
        nothing.)"""
        if self._pending:
            self._abort_step()
        elif self._undo is not None and (layer_idx is None or layer_idx in self._attended):
            self._undo_stopped()

    def _undo_stopped(self) -> None:
        """Undo the step in progress, which stopped between layers (see :meth:`_settle`), with
        a warning: a retry is served right, and a model that runs fewer attention layers
        than its config names (each step would be undone) does not go unnoticed."""
        warnings.warn(f"kvarena: the last step on this KVArenaCache stopped after {len(self._attended)} of its "
                      f"{self._step_layers} attention layers (an exception between layers?); it is undone, the "
                      "cache is as before it", RuntimeWarning, stacklevel=4)
        self._abort_step()

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.pool is not None

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:  # the base class's all([]) would call it recurrent
        return [False] * self.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers

    def __len__(self) -> int:
        return self.num_layers

    @property
    def batch_size(self) -> int:
        """Rows held (after the first step; ``-1`` before it and after ``reset()``)."""
        return len(self._names) if self._names else -1

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """``-1``, as transformers' ``DynamicCache``: no per-row maximum (the arena's tokens are
        shared by the rows; a step past them raises ``CacheFullError``)."""
        if layer_idx is not None:
            self._layer_index(layer_idx)
        return -1

    def _layer_index(self, layer_idx) -> int:
        if not is_integral(layer_idx) or not (
                0 <= layer_idx < self.num_layers):
            raise ValueError(f"layer_idx: expected an int in [0, {self.num_layers}), got {layer_idx!r}")
        return int(layer_idx)

    def _read(self, layer: int, j: int):
        """Layer ``layer``'s K (``j == 0``) or V as ``[B, H_kv, get_seq_length(), D]`` in the
        model's dtype: a gathered copy, each row's stored tokens right-aligned (oldest first);
        what the arena does not hold (left padding, blocks released out of the window) is 0."""
        pool = self.pool
        if pool is None or not self._names:
            return None
        from kvarena.attention.fp8 import dequantize_fp8

        region, lay, bs = pool.region, pool.layout, pool.block_size
        g, _slot = lay.group_of(layer)
        h, d = lay.layer_shape(layer)
        data = region.k(layer) if j == 0 else region.v(layer)  # [blocks, bs, H, D]
        scales = region.kv_scales(layer)
        out = torch.zeros(len(self._names), self._len, h, d, dtype=lay.input_dtype, device=pool.device)
        for i, name in enumerate(self._names):
            n = min(pool.seq_len(name), self._len) if name in pool else 0
            if n == 0:
                continue
            blocks = pool.block_ids(name, g)[: -(-n // bs)]
            ids = torch.tensor([max(b, 0) for b in blocks], dtype=torch.long, device=pool.device)
            x = data[ids].reshape(-1, h, d)[:n]
            if lay.is_fp8:
                sc = scales[j]
                sc = sc[ids].reshape(-1, h)[:n] if sc.dim() else sc
                x = dequantize_fp8(x, sc, torch.float32)
            held = torch.tensor([b >= 0 for b in blocks], device=pool.device).repeat_interleave(bs)[:n]
            out[i, self._len - n :] = torch.where(held[:, None, None], x.to(lay.input_dtype), 0)
        return out.transpose(1, 2)

    # The arena.
    @_pool_state
    def _make_pool(self, key: torch.Tensor, batch: int) -> None:
        from kvarena.cache.arena import KVLayout, group_layers
        from kvarena.cache.keys import CachePolicy
        from kvarena.cache.paged import PagedKVCache

        dtype = self._dtype or key.dtype
        device = torch.device(self._device) if self._device is not None else key.device
        inp = None
        if dtype == torch.float8_e4m3fn:  # fp8 storage; the model's dtype in and out
            inp = key.dtype if key.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
        # Mixed sliding / full layers with the release on: a block list per group, so the
        # sliding groups return their old blocks (equal-size groups: no byte is wasted).
        groups = group_layers(self._sliding) if self._release is not None and not all(self._sliding) else None
        layout = KVLayout(num_layers=self.num_layers, num_kv_heads=key.shape[1], head_dim=key.shape[3], dtype=dtype,
                          input_dtype=inp, groups=groups)
        if self._max_bytes is not None:
            max_bytes = self._max_bytes
        else:
            tokens = self._max_tokens
            if tokens is None:
                per_row = min(int(getattr(self.config, "max_position_embeddings", 0) or DEFAULT_MAX_TOKENS_PER_ROW),
                              DEFAULT_MAX_TOKENS_PER_ROW)
                tokens = batch * per_row
            blocks = -(-tokens // self.block_size) + batch  # a partly filled block per row
            max_bytes = blocks * len(layout.layer_groups) * layout.block_bytes(self.block_size)
        release = {}
        if self._release is not None:  # sliding layers keep a window (+ rollback) per row
            from kvarena.attention.spec import AttentionSpec

            specs = [AttentionSpec(window_left=self._release[0] if s else None) for s in self._sliding]
            release = dict(attention=specs, free_out_of_window=True, rollback_tokens=self._release[1])
        self.pool = PagedKVCache(CachePolicy("paged_kv", max_bytes), layout=layout, block_size=self.block_size,
                                 device=device, **release)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Hand the new K/V to the attention function (stored there, where the padding is known).

        A refusal here (or in the attention function, or in the pool) undoes the step in
        progress: the cache is as it was before the step's first layer.
        """
        try:
            return self._update(key_states, value_states, layer_idx)
        except BaseException:
            self._abort_step()
            raise

    def _update(self, key_states, value_states, layer_idx):
        impl = getattr(self.config, "_attn_implementation", None)
        if layer_idx == 0 and not self._pending and self._undo is not None:
            self._undo_stopped()  # the last step stopped between layers (see _settle): undone first
        if impl != NAME or self._pending:
            # The config it was made with says so, or the last hand-off was never attended by
            # kvarena (a model other than the config's, on another implementation): the step
            # that hand-off belongs to is undone (by update's caller).
            raise ValueError(f"kvarena: KVArenaCache needs attn_implementation='kvarena', the model uses "
                             f"{impl if impl != NAME else 'another implementation'!r}; its attention would see "
                             "only the new tokens")
        if not is_int(layer_idx) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"kvarena: layer_idx {layer_idx!r} is not a layer of this {self.num_layers}-layer cache")
        if self.pool is not None and (key_states.shape[1], key_states.shape[3]) != self.pool.layout.layer_shape(
                layer_idx):
            h, d = self.pool.layout.layer_shape(layer_idx)
            raise _unsupported(f"an arena made for other heads (this KVArenaCache holds {h} kv heads of dim {d} at "
                               f"layer {layer_idx}, the model gives {key_states.shape[1]} of dim "
                               f"{key_states.shape[3]}; another model? make a new KVArenaCache)")
        if layer_idx == 0:  # a new step
            b = key_states.shape[0]
            if self._names and len(self._names) != b:
                raise ValueError(f"kvarena: the cache holds {len(self._names)} rows, this step has {b}; "
                                 "call reset() before a generate with another batch size")
            lens = {} if self.pool is None else {n: self.pool.seq_len(n) for n in self._names if n in self.pool}
            self._undo = (self._len, list(self._names), lens, self.pool is None, self._positions.mark())
            if self.pool is None:
                self._make_pool(key_states, b)
            if not self._names:
                self._names = [self._fresh() for _ in range(b)]
            self._len += key_states.shape[2]
            self._meta = None
            _HANDOFF.clear()
        _HANDOFF[id(key_states)] = (weakref.ref(key_states), weakref.ref(self), layer_idx)
        self._pending.add(id(key_states))
        return key_states, value_states

    @_pool_state
    def _abort_step(self) -> None:
        """Undo the step in progress (a refused or failed call): the length, the rows, the
        pool's lengths and the hand-offs as they were before its first layer."""
        undo, self._undo = self._undo, None
        self._pending.clear()
        self._attended.clear()
        for key in [key for key, h in _HANDOFF.items() if h[1]() is self]:
            del _HANDOFF[key]
        if undo is None:
            return
        length, names, lens, new_pool, positions = undo
        self._positions.rollback(positions)
        if new_pool:
            self.pool = None  # made for this step: forgotten with it
        elif self._meta is not None:  # planned: each row back to its length (the step's blocks freed)
            for name in self._names:
                if name not in self.pool:
                    continue
                if name not in lens:
                    self.pool.free_namespace(name)
                elif self.pool.seq_len(name) != lens[name]:
                    self.pool.truncate(name, lens[name])
        self._len, self._names, self._meta, self._step_rows, self._packed = length, names, None, None, False

    def _held(self, name) -> bool:
        """Whether row ``name`` is in the pool: a row is added by the first plan that gives it a
        token, so a row that has been padding only so far (next to right padding or holes,
        which plan only the real tokens) is not, and holds nothing."""
        return self.pool is not None and name in self.pool

    def _fresh(self):
        self._next_name += 1
        return self._next_name

    def _rows(self, query, key, value, rows):
        """q/k/v as the pool takes them, in its input dtype: transformers' ``[B, S]`` rows
        flattened (a padded plan), or the real rows ``rows [B, S]`` packed in row order."""
        b, h_q, s, d = query.shape
        if rows is None:
            qf = query.transpose(1, 2).reshape(b * s, h_q, d)
            kf = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
            vf = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
        else:  # one gather per tensor and layer
            qf, kf, vf = query.transpose(1, 2)[rows], key.transpose(1, 2)[rows], value.transpose(1, 2)[rows]
        dtype = self.pool.layout.input_dtype
        return qf.to(dtype), kf.to(dtype), vf.to(dtype)

    def _attend(self, layer: int, *args):
        """Layer ``layer``'s attention in the step in progress (see :meth:`_attend_layer`); once
        every layer of the step attended, the step is complete: nothing of it is undone
        any more."""
        got = self._attend_layer(layer, *args)
        self._attended.add(layer)
        if len(self._attended) >= self._step_layers:
            self._undo = None
            self._attended.clear()
        return got

    def _attend_layer(self, layer: int, query, key, value, kv_start, scaling, causal, window, softcap, s_aux,
                      backend, position_ids, forward=None):
        self._pending.discard(id(key))
        if getattr(kv_start, "_kvarena_segments", None) is not None:
            raise _unsupported("packed sequences with KVArenaCache")
        b, h_q, s, d = query.shape
        opts = dict(scale=scaling, window_left=None if window is None else window - 1,
                    softcap=softcap, backend=backend)
        if s_aux is not None:
            opts["sink_logits"] = _sink_logits(s_aux, query.dtype)
        if self._meta is None:
            # The step's plan: each row's real new tokens (its left padding among them is
            # never stored). One plan for all layers.
            past = self._len - s  # padded
            pack = getattr(kv_start, "_kvarena_pack", None)
            if pack is not None:  # right padding or holes: each row's real new tokens, wherever they are
                new = pack.q_real.sum(1).tolist()
            else:
                pads = kv_start.tolist() if kv_start is not None else [0] * b
                new = [s - min(s, max(0, p - past)) for p in pads]
            if not causal:
                raise _unsupported("a bidirectional layer with KVArenaCache")
            _check_packed(position_ids, kv_start, b, s, self._len, forward)
            # Inference: a padded plan, so q/k/v/out keep transformers' [B, S] rows (no
            # gather or scatter per layer). Under autograd, or with padding other than left
            # padding, the real rows are packed: the differentiable paths read each row's own
            # k/v at its position, and the padded plan takes each row's new tokens last.
            grad = torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)
            packed = pack is not None or grad
            rows = None
            if pack is not None:
                rows = pack.q_real.to(query.device)
            elif packed:  # [B, S]: the real rows, gathered on every layer
                rows = ((past + torch.arange(s)[None, :]) >= torch.tensor(pads)[:, None]).to(query.device)
            qf, kf, vf = self._rows(query, key, value, rows)
            batch = {self._names[i]: new[i] for i in range(b) if new[i] > 0} if packed else dict(zip(self._names, new))
            # What the pool's forward would refuse, before the plan: a step it would refuse
            # (fp8 under autograd, a backend that cannot run) plans nothing.
            self.pool.check_forward(batch, qf, kf, vf, layer, pad_to=None if packed else s, **opts)
            with torch.inference_mode(False):  # see _pool_state
                self._meta = self.pool.plan(batch, pad_to=None if packed else s)
            if pack is not None:
                self._positions.append(pack.q_real)
            else:  # left padding: each row's real tokens are the step's last new[i] positions
                self._positions.append(s if min(new) == s else torch.arange(s)[None, :] >= s - torch.tensor(new)[:, None])
            self._packed, self._step_rows = packed, rows
        else:
            qf, kf, vf = self._rows(query, key, value, self._step_rows)
        # This layer's mask kind (full or sliding): padding queries, or a hole in its window,
        # are read per query after the store (see _unpad), differentiable only through q.
        pack = getattr(kv_start, "_kvarena_pack", None)
        per_query = None if pack is None else pack.per_query
        if per_query is not None and torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            raise _unsupported("under autograd with KVArenaCache, padding queries that follow a real token or a "
                               "padding hole inside a sliding window (transformers' cache serves them)")
        out = self.pool.forward(qf, kf, vf, self._meta, layer, **opts).to(query.dtype)
        if not self._packed:
            return out.view(b, s, h_q, d), None
        full = query.new_zeros(b, s, h_q, d)
        if per_query is not None:  # padding queries, or a hole in a window: as eager (see _unpad)
            full[per_query[3]] = self._attend_per_query(layer, query, per_query, opts).to(query.dtype)
        else:
            full[self._step_rows] = out
        return full, None

    def _attend_per_query(self, layer: int, query, per_query, opts):
        """Each query of ``per_query`` (see :func:`_unpad`) as its own sequence over its row's
        blocks, after the step's K/V were stored: ``kv_start`` is its window (positions in the
        pool are the real tokens' ranks, padding never stored). Through the pool's public
        seam: its block table of the rows' namespaces and its :meth:`attend` (no host sync)."""
        rows, lens, starts, which = per_query
        pool = self.pool
        held = [name for name in self._names if name in pool]  # see _held
        if held:
            index = {name: i for i, name in enumerate(held)}
            table = pool.block_table(held, pool.layout.group_of(layer)[0])
            # a row the pool holds nothing of has no key (lens 0): any table row serves it
            of_row = torch.tensor([index.get(name, 0) for name in self._names], device=pool.device)
            table = table[of_row[rows[:, 0].long()]]
        else:
            table = torch.zeros(rows.shape[0], 1, dtype=torch.int32, device=pool.device)
        max_k = max([1, *(pool.seq_len(name) for name in held)])  # a host bound of lens: no sync
        q = query.transpose(1, 2)[which].to(pool.layout.input_dtype)
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        opts = {k: v for k, v in opts.items() if k != "window_left"}  # the window is kv_start
        return pool.attend(q, layer, KeySet(table, lens, max_k, kv_start=starts), QueryRows(cu, 1), **opts)

    # Beams, assisted decoding, reset.
    @_pool_state
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i becomes a copy of row ``beam_idx[i]`` (shared blocks, no K/V copied). All rows
        or none: a refused call (``beam_idx`` not 1-D row indices) changes nothing."""
        self._settle()  # between steps: a step that stopped between layers is undone
        if not self._names:
            return  # no rows yet: nothing to reorder (as DynamicCache before its first update)
        index = self._row_index(beam_idx)
        src = [self._names[i] for i in index]
        new = [self._fresh() for _ in src]
        made = []
        try:
            for s_name, d_name in zip(src, new):
                if self._held(s_name):
                    self.pool.fork(s_name, d_name)
                    made.append(d_name)
        except BaseException:  # the forks made so far are dropped: the rows are as they were
            for name in made:
                self.pool.free_namespace(name)
            raise
        for name in self._names:
            if self._held(name):
                self.pool.free_namespace(name)
        self._names = new
        self._positions.reorder(index)
        self._meta = None

    def _row_index(self, beam_idx) -> list[int]:
        """``beam_idx`` as row indices, checked: 1-D integers in ``[0, rows)``."""
        rows = len(self._names)
        want = f"beam_idx: expected a 1-D integer tensor of row indices in [0, {rows}), got "
        try:
            idx = torch.as_tensor(beam_idx)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(want + repr(beam_idx)) from None
        integral = not (idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool)
        if idx.dim() != 1 or not integral or (idx.numel() and not (int(idx.min()) >= 0 and int(idx.max()) < rows)):
            shown = idx.tolist() if idx.numel() <= 16 else "..."
            raise ValueError(f"{want}{tuple(idx.shape)} {idx.dtype} {shown}")
        return idx.tolist()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.reorder_cache(torch.arange(len(self._names)).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(torch.as_tensor(indices).reshape(-1))

    @_pool_state
    def crop(self, n: int) -> None:
        """Assisted decoding's rollback, counted in positions as transformers' ``DynamicCache``
        counts them (the sequence axis, padding included): ``n < 0`` drops the newest ``-n``
        positions (transformers >= 5.2x), ``n > 0`` keeps the first ``n`` (the older meaning),
        ``0`` does nothing. Each row keeps its stored tokens among the positions kept (a
        right-padded row drops its padding positions, which hold nothing, first)."""
        if not is_integral(n):
            raise TypeError(f"n: expected an int, got {n!r}")
        n = int(n)
        self._settle()  # between steps: a step that stopped between layers is undone
        if -n > self._len:
            raise ValueError(f"n: crop({n}) drops {-n} tokens, the cache holds {self._len}")
        keep = self._len + n if n <= 0 else min(n, self._len)
        if keep >= self._len:
            return
        gone = self._positions.real_after(keep, len(self._names))
        targets = [(name, self.pool.seq_len(name) - g) for name, g in zip(self._names, gone) if self._held(name)]
        for name, n_tokens in targets:  # all rows or none: a refused row leaves the others as they were
            self.pool.check_truncate(name, n_tokens)
        for name, n_tokens in targets:
            self.pool.truncate(name, n_tokens)
        self._positions.cut(keep)
        self._len = keep
        self._meta = None

    @_pool_state
    def reset(self) -> None:
        """Free every block and forget the rows: the object serves a new generate."""
        if self.pool is not None:
            for name in self.pool.namespaces():
                self.pool.free_namespace(name)
        self._names, self._len, self._meta, self._undo = [], 0, None, None
        self._attended.clear()
        self._positions.clear()
        self._pending.clear()

    @property
    def used_bytes(self) -> int:
        return 0 if self.pool is None else self.pool.used_bytes

"""Hugging Face ``transformers`` (>= 5) on kvarena's attention.

:func:`register` adds the attention implementation ``"kvarena"`` and its mask hook, so any
decoder whose attention goes through ``transformers.AttentionInterface`` runs kvarena's
block-table attention (Triton on CUDA, the PyTorch path on CPU)::

    from kvarena.integrations import hf
    hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvarena")
    # or: model.set_attn_implementation("kvarena")
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)

With transformers' own cache, the dense K/V ``[B, H_kv, L, D]`` a layer hands over is
attended in place as a paged cache with one block per row (a strided view: nothing is
copied); left padding becomes ``kv_start``. Options map one to one: ``scaling`` ->
``scale``, ``sliding_window=W`` -> ``window_left=W - 1`` (HF's window sees ``kv > q - W``),
``softcap`` -> ``softcap``, gpt-oss's ``s_aux`` -> ``sink_logits``.

What it cannot serve is an error whose message starts with ``kvarena:`` and names it,
never a silent fallback to another implementation: 4-D custom masks, mask functions that
need vmap (``or_mask_function`` / ``and_mask_function``), right padding or padding holes,
packed sequences (``position_ids`` restarting inside a row), dropout while training.
"""

from __future__ import annotations

import torch

from kvarena.attention.ops import paged_attention
from kvarena.attention.spec import check_backend

__all__ = ["register", "kvarena_attention", "kvarena_mask"]

NAME = "kvarena"


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"kvarena: {what} is not supported by the kvarena attention implementation")


def kvarena_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask hook: what the attention function needs from the 2-D padding mask.

    Returns None (no padding among the layer's keys) or the number of left-padding keys
    per row, int32 ``[B]``, which the attention function passes on as ``kv_start``. Runs
    once per forward and mask kind (not per layer); reading the mask is its one host sync.
    The causal / sliding / chunked pattern itself comes to the attention function as
    options, so only the padding is taken from here.
    """
    if kwargs.get("use_vmap"):
        raise _unsupported("a custom mask function (or_mask_function / and_mask_function, which need vmap)")
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise _unsupported(f"a {attention_mask.dim()}-D padding mask in the mask hook")
    if attention_mask.shape[1] < kv_length:
        raise _unsupported(f"a padding mask of {attention_mask.shape[1]} columns for {kv_length} keys "
                           "(a static cache longer than the mask)")
    keep = attention_mask[:, attention_mask.shape[1] - kv_length :].bool()  # the layer's keys, oldest first
    if bool(keep.all()):
        return None
    n_real = keep.sum(1)
    # Left padding: each row is zeros then ones, so its ones are exactly its last n_real keys.
    tail = torch.arange(kv_length, device=keep.device)[None, :] >= (kv_length - n_real)[:, None]
    if not torch.equal(keep, tail):
        raise _unsupported("right padding or a padding hole inside a row (only left padding is")
    return (kv_length - n_real).to(torch.int32)


def _check_packed(position_ids: torch.Tensor | None, kv_start: torch.Tensor | None, b: int, s: int, n: int) -> None:
    """Prefill rows whose positions restart inside (packed sequences) would be attended as
    one sequence: refuse them. One check per position_ids tensor (all layers share it)."""
    if position_ids is None or s < 2:
        return
    key = (id(position_ids), position_ids._version)
    if _checked_positions.get(key) is position_ids:
        return
    pos = position_ids.expand(b, s) if position_ids.dim() == 2 else position_ids
    real = torch.ones(b, s, dtype=torch.bool, device=pos.device)
    if kv_start is not None:
        real = (n - s + torch.arange(s, device=pos.device))[None, :] >= kv_start.to(pos.device)[:, None]
    step_ok = (pos[:, 1:] - pos[:, :-1] == 1) | ~real[:, :-1] | ~real[:, 1:]
    if not bool(step_ok.all()):
        raise _unsupported("packed sequences (position_ids that restart inside a row)")
    _checked_positions.clear()
    _checked_positions[key] = position_ids


_checked_positions: dict = {}


def kvarena_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                      scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                      softcap: float | None = None, s_aux: torch.Tensor | None = None, *, backend: str = "auto",
                      **kwargs):
    """The attention function ``transformers`` calls per layer.

    Parameters
    ----------
    query : Tensor ``[B, H_q, S, D]``
    key, value : Tensor ``[B, H_kv, L, D]``
        The layer's whole K/V (past and new), as transformers' cache returns it.
    attention_mask : None or int32 ``[B]``
        What :func:`kvarena_mask` returned (left padding per row).

    Returns
    -------
    ``(out [B, S, H_q, D], None)``.
    """
    if dropout and module.training:
        raise _unsupported("attention dropout while training")
    if attention_mask is not None and not (
        isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1 and attention_mask.dtype == torch.int32
    ):
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise _unsupported(f"an attention mask that did not come from its mask hook (got {shape}; a 4-D custom mask?)")
    b, h_q, s, d = query.shape
    n = key.shape[2]
    _check_packed(kwargs.get("position_ids"), attention_mask, b, s, n)
    q = query.transpose(1, 2).reshape(b * s, h_q, d)
    # One block per row: [B, L, H_kv, D] strided views of the dense cache, no copy.
    k_cache, v_cache = key.transpose(1, 2), value.transpose(1, 2)
    dev = query.device
    table = torch.arange(b, dtype=torch.int32, device=dev)[:, None]
    lens = torch.full((b,), n, dtype=torch.int32, device=dev)
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=dev)
    sink = None
    if s_aux is not None:
        sink = s_aux.to(torch.float64 if query.dtype == torch.float64 else torch.float32)
    out = paged_attention(
        q, k_cache, v_cache, table, lens, cu, scale=scaling,
        causal=bool(kwargs.get("is_causal", getattr(module, "is_causal", True))),
        window_left=None if sliding_window is None else sliding_window - 1, softcap=softcap,
        kv_start=attention_mask, max_seqlen_q=s, max_seqlen_k=n, sink_logits=sink, backend=backend,
    )
    return out.view(b, s, h_q, d), None


def register(*, backend: str = "auto") -> None:
    """Register ``"kvarena"`` with transformers' attention and mask interfaces (idempotent).

    ``backend``: kvarena's (``"auto"``: Triton on CUDA, the PyTorch path on CPU; a later
    call with another value replaces the registration).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    check_backend(backend)

    def attention(module, query, key, value, attention_mask, **kwargs):
        return kvarena_attention(module, query, key, value, attention_mask, backend=backend, **kwargs)

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, kvarena_mask)

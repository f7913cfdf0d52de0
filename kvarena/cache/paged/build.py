"""The device side of a paged plan: the step's rows gathered from the block table into
:class:`PagedMetadata` (packed, padded or into the CUDA-graph buffers), one upload each."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from operator import add

import torch

from kvarena.attention.batch import KeySet, QueryRows
from kvarena.cache._meta import upload
from kvarena.cache.paged.meta import GraphBuffers, PagedMetadata
from kvarena.cache.paged.table import BatchRows, SeqRecord

__all__ = ["StepRows", "graph_meta", "packed_meta", "padded_meta"]

#: Up to this many slots (rows times layer groups) a decode step's slots are computed on
#: the host from the records (one list comprehension per group, in the upload); past it a
#: gather on the device costs less (measured on CPU: 1 group x 256 rows host, 6 x 256 device).
_HOST_SLOTS = 1024


@dataclass(frozen=True)
class StepRows:
    """The planned batch on the host: its namespaces (records, table rows) and new-token
    counts, their lengths before and after the step."""

    batch: BatchRows
    news: tuple
    old_lens: list[int]
    lens: list[int]
    #: max(lens)
    longest: int
    max_blocks: int
    #: The version every row is stamped with.
    version: int
    #: The rows the plan decided in full (the others appended within their record's
    #: ``limit``: their slots are ``bases[g] + position``).
    slow: list[int]

    @property
    def namespaces(self) -> tuple:
        return self.batch.names

    @property
    def seqs(self) -> tuple[SeqRecord, ...]:
        return self.batch.records

    @property
    def versions(self) -> tuple:
        return (self.version,) * len(self.news)


@dataclass(frozen=True)
class _Gathered:
    """A packed batch's rows on the device."""

    table: torch.Tensor  # [G, B, max_blocks]
    slot_rows: tuple  # per group [total_q], the pool's slot dtype
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    total_q: int
    longest: int
    slots: torch.Tensor | None = None  # [G, total_q] when computed as one tensor


def _keys(tables, seq_lens, max_k: int) -> tuple:
    return tuple(KeySet(t, seq_lens, max_k) for t in tables)


def _host_slots(pool, step: StepRows, groups: int) -> list[int]:
    """The slots of a decode step (one new token a row, at its old length), group by group."""
    bs, seqs, olds, batch = pool.block_size, step.seqs, step.old_lens, step.batch
    out = []
    for g in range(groups):
        slots = list(map(add, batch.take(pool._table.state.bases[g]), olds))
        for i in step.slow:
            pos = olds[i]
            slots[i] = seqs[i].blocks[g][pos // bs] * bs + pos % bs
        out += slots
    return out


def _gather(pool, step: StepRows) -> _Gathered:
    bs, dev, dt = pool.block_size, pool.device, pool._slot_dtype
    seqs, news = step.seqs, step.news
    nseq = len(seqs)
    total_q = sum(news)
    groups = pool._ngroups
    decode = total_q == nseq  # one new token a row: its position is the row's old length
    host = decode and dt is torch.int32 and groups * nseq <= _HOST_SLOTS  # the slots from the records
    # Rows r0, r0 + 1, .. (namespaces planned in the order they were made): the step's table is
    # a view of the persistent one, with no gather and no upload of the rows.
    batch = step.batch
    consecutive, first = batch.consecutive, batch.first
    # One upload: rows (unless consecutive) | seq_lens | cu_seqlens_q (unless decode) |
    # slots (host) or old lengths.
    head = () if consecutive else batch.rows
    cu = () if decode else accumulate(news, initial=0)
    tail = _host_slots(pool, step, groups) if host else step.old_lens
    packed = upload([*head, *step.lens, *cu, *tail], torch.int32, dev)
    sizes = (len(head), nseq, 0 if decode else nseq + 1) + ((nseq,) * groups if host else (nseq,))
    parts = packed.split_with_sizes(sizes)  # (Tensor.split's Python wrapper costs twice as much)
    rows_t, seq_lens, cu_t = parts[:3]
    if decode:
        cu_t = pool._table.iota(nseq + 1)
    if consecutive:
        table = pool._table.data[:, first : first + nseq, : step.max_blocks]  # [G, B, max_blocks]
    else:
        table = pool._table.data[:, :, : step.max_blocks].index_select(1, rows_t)
    tail_t = parts[3]
    if host:
        return _Gathered(table, parts[3:], seq_lens, cu_t, total_q, step.longest)
    # Slot of every new token: token i of row b sits at position old_len[b] + i - cu[b] and
    # goes to block_table[g, b, pos // bs], row pos % bs.
    if decode:
        pos = tail_t.to(dt)
        col = (pos // bs).long().view(1, nseq, 1).expand(groups, nseq, 1)
        slots = table.to(dt).gather(2, col)[:, :, 0] * bs + pos % bs
    else:
        q_lens = cu_t[1:] - cu_t[:-1]
        row_of = torch.repeat_interleave(torch.arange(nseq, device=dev), q_lens, output_size=total_q)
        pos = torch.arange(total_q, device=dev) - cu_t[:-1].long()[row_of] + tail_t.long()[row_of]
        slots = (table.long()[:, row_of, pos // bs] * bs + pos % bs).to(dt)  # [G, total_q]
    return _Gathered(table, slots.unbind(0), seq_lens, cu_t, total_q, step.longest, slots)


def packed_meta(pool, step: StepRows) -> PagedMetadata:
    """Metadata of a packed batch: row b's queries are its new tokens."""
    got = _gather(pool, step)
    table, seq_lens, cu_t, total_q, longest = got.table, got.seq_lens, got.cu_seqlens_q, got.total_q, got.longest
    slots = got.slot_rows
    tables = table.unbind(0)
    max_q = max(step.news)
    return PagedMetadata(
        slot_mapping=slots[0], block_table=tables[0], slot_mappings=slots, block_tables=tables,
        seq_lens=seq_lens, cu_seqlens_q=cu_t, max_seqlen_q=max_q, max_seqlen_k=longest, total_q=total_q,
        num_seqs=len(step.seqs), namespaces=step.namespaces, num_tokens=total_q,
        keys=_keys(tables, seq_lens, longest), rows=QueryRows(cu_t, max_q),
        _owner=pool._cache_id, _versions=step.versions, _epoch=pool._epoch,
    )


def graph_meta(pool, step: StepRows, g: GraphBuffers, generation: int) -> PagedMetadata:
    """Metadata of a graph plan: the batch written into the fixed buffers ``g``."""
    got = _gather(pool, step)
    nseq, total_q = len(step.seqs), got.total_q
    g.slot_mapping[:, :total_q].copy_(torch.stack(got.slot_rows) if got.slots is None else got.slots)
    g.slot_mapping[:, total_q:].fill_(-1)
    g.block_table[:, :nseq, : got.table.shape[2]].copy_(got.table)
    g.block_table[:, nseq:].zero_()
    g.seq_lens[:nseq].copy_(got.seq_lens)
    g.seq_lens[nseq:].zero_()
    return PagedMetadata(
        slot_mapping=g.slot_mapping[0], block_table=g.block_table[0], slot_mappings=tuple(g.slot_mapping),
        block_tables=tuple(k.block_table for k in g.keys), seq_lens=g.seq_lens, cu_seqlens_q=g.cu_seqlens_q,
        max_seqlen_q=g.q_per_seq, max_seqlen_k=g.max_blocks * pool.block_size, _longest=got.longest,
        total_q=g.max_batch * g.q_per_seq, num_seqs=g.max_batch, namespaces=step.namespaces, num_tokens=total_q,
        keys=g.keys, rows=g.rows,
        _owner=pool._cache_id, _versions=step.versions, _epoch=pool._epoch, _graph_gen=generation,
    )


def padded_meta(pool, step: StepRows, pad_to: int) -> PagedMetadata:
    """Metadata of a padded batch: row b's ``pad_to`` queries, its new tokens last."""
    bs, dev = pool.block_size, pool.device
    nseq = len(step.seqs)
    lens, news = step.lens, step.news
    total_q = nseq * pad_to
    packed = upload([*step.batch.rows, *lens, *step.old_lens, *news], torch.int32, dev)
    rows, seq_lens = packed[:nseq], packed[nseq : 2 * nseq]
    olds, new_t = packed[2 * nseq : 3 * nseq].long(), packed[3 * nseq :].long()
    # At least one column: a batch of padding only (no row holds a token) still indexes it.
    max_blocks = max(step.max_blocks, 1)
    table = pool._table.data[:, :, :max_blocks].index_select(1, rows.long())  # [G, B, max_blocks]
    j = torch.arange(pad_to, device=dev)[None, :]  # [1, S]
    first = pad_to - new_t[:, None]  # [B, 1]: the first real query row
    pos = olds[:, None] + j - first  # [B, S] token position; < old_len on padding rows
    real = j >= first
    col = (pos.clamp(min=0) // bs).clamp(max=max(max_blocks - 1, 0))  # [B, S]
    blk = table.long().gather(2, col.expand(table.shape[0], -1, -1).clamp(max=max_blocks - 1))  # [G, B, S]
    slots = torch.where(real, blk * bs + pos.clamp(min=0) % bs, torch.full_like(blk, -1))
    slots = slots.reshape(table.shape[0], -1).to(pool._slot_dtype)  # [G, B * S]
    cu = torch.arange(0, (nseq + 1) * pad_to, pad_to, dtype=torch.int32, device=dev)
    tables = tuple(table)
    return PagedMetadata(
        slot_mapping=slots[0], block_table=table[0], slot_mappings=tuple(slots), block_tables=tables,
        seq_lens=seq_lens, cu_seqlens_q=cu, max_seqlen_q=pad_to, max_seqlen_k=step.longest, total_q=total_q,
        num_seqs=nseq, namespaces=step.namespaces, num_tokens=sum(news),
        keys=_keys(tables, seq_lens, step.longest), rows=QueryRows(cu, pad_to),
        _owner=pool._cache_id, _versions=step.versions, _epoch=pool._epoch, pad_to=pad_to,
    )

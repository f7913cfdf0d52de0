"""The paged pool's block-table rows: one record per namespace and the persistent device
table ``[G, rows, cols]`` its block lists are mirrored into.

Changed entries are queued on the host and written with one ``index_put_`` at
:meth:`BlockTable.flush` (the plan calls it once per step); the table doubles its rows or
columns when a namespace needs more, a re-allocation between steps.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from kvarena.cache._meta import next_version, upload

__all__ = ["FREED", "BatchRows", "BlockTable", "RowState", "SeqRecord", "cdiv"]

#: A released (out-of-window) block in a sequence's block list.
FREED = -1


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints."""
    return -(-a // b)


class RowState:
    """The hot fields of the namespaces' records, one flat array per field indexed by table
    row: what a decode step reads and writes for every row, as slices when the batch's rows
    are consecutive (no per-record attribute walk; the arrays stay in few cache lines)."""

    __slots__ = ("lens", "limit", "version", "bases")

    def __init__(self, rows: int, groups: int) -> None:
        #: Tokens per row's namespace.
        self.lens = _zeros(rows)
        #: See :attr:`SeqRecord.limit`.
        self.limit = _zeros(rows)
        #: The version the row's metadata is stamped with.
        self.version = _zeros(rows)
        #: Per layer group: the slot of position 0 of the block being filled (while limit > 0).
        self.bases = [_zeros(rows) for _ in range(groups)]

    def grow(self, rows: int) -> None:
        """Room for ``rows`` rows (the new ones zero)."""
        extra = _zeros(rows - len(self.lens))
        for arr in (self.lens, self.limit, self.version, *self.bases):
            arr.extend(extra)


def _zeros(n: int) -> array:
    return array("q", bytes(8 * n))


class _RowField:
    """A record's field kept in one of its table's :class:`RowState` arrays, at its row."""

    def __init__(self, array_name: str, doc: str) -> None:
        self.array_name = array_name
        self.__doc__ = doc

    def __get__(self, rec, owner=None):
        if rec is None:
            return self
        return getattr(rec._state, self.array_name)[rec.row]

    def __set__(self, rec, value: int) -> None:
        getattr(rec._state, self.array_name)[rec.row] = value


class SeqRecord:
    """One namespace: its block list per layer group, its table row, and (in the table's
    :class:`RowState`, at its row) its length, the version its metadata is stamped with
    and the length it can grow to by plain appends."""

    __slots__ = ("blocks", "row", "released", "_state")

    def __init__(self, row: int, groups: int, state: RowState) -> None:
        self.blocks: list[list[int]] = [[] for _ in range(groups)]  # per layer group
        self.row = row  # the same row of every group's table
        self._state = state
        self.seq_len = 0
        self.version = next_version()
        # free_out_of_window, per group: blocks [sink blocks, released) are FREED (one run,
        # since releases only ever extend it), so each plan scans only the newly dead blocks.
        self.released = [0] * groups
        self.limit = 0
        self.bases = [0] * groups

    seq_len = _RowField("lens", "Tokens of the namespace.")
    version = _RowField("version", "The version the namespace's metadata is stamped with.")
    limit = _RowField("limit", """A plan whose new tokens end at <= limit takes no block, copies none and
        releases none (WindowRules.refresh); 0 = unknown, the plan decides in full. Whatever
        changes the record's blocks outside a plan resets it.""")

    @property
    def bases(self) -> list[int]:
        """While limit > 0, per group: position p < limit of the block being filled sits at
        slot bases[g] + p."""
        return [b[self.row] for b in self._state.bases]

    @bases.setter
    def bases(self, per_group) -> None:
        for arr, base in zip(self._state.bases, per_group):
            arr[self.row] = base


@dataclass(frozen=True)
class BatchRows:
    """A batch's namespaces resolved to their records and table rows."""

    names: tuple
    #: Per namespace its record, None for one the plan creates.
    records: tuple
    rows: list
    #: Rows ``first, first + 1, ..`` in the batch's order (slices of the table and the
    #: row arrays serve the batch).
    consecutive: bool
    #: The table's row generation they were resolved at.
    generation: int

    @property
    def first(self) -> int:
        return self.rows[0]

    def take(self, arr: array) -> list:
        """``arr``'s entries (a :class:`RowState` array) at the batch's rows, in its order."""
        if self.consecutive:
            return arr[self.first : self.first + len(self.rows)].tolist()
        return [arr[r] for r in self.rows]

    def put(self, arr: array, values) -> None:
        """``arr[rows[i]] = values[i]`` for the batch's rows."""
        if self.consecutive:
            arr[self.first : self.first + len(self.rows)] = array("q", values)
        else:
            for r, x in zip(self.rows, values):
                arr[r] = x


class BlockTable:
    """The device table ``[groups, rows, cols]`` (int32), its free rows and the rows' hot
    fields (:class:`RowState`)."""

    def __init__(self, groups: int, rows: int, cols: int, device: torch.device) -> None:
        self.groups = groups
        self.device = device
        self.data = torch.zeros(groups, rows, cols, dtype=torch.int32, device=device)
        self.free_rows = list(range(rows - 1, -1, -1))
        self.pending: dict[tuple[int, int, int], int] = {}  # (group, row, col) -> block
        self.state = RowState(rows, groups)
        self._iota = torch.arange(rows + 1, dtype=torch.int32, device=device)
        # Bumped whenever a row is taken or given back: a resolved batch of an older
        # generation may name a namespace that moved or is gone.
        self._generation = 0
        self._last: BatchRows | None = None

    def iota(self, n: int) -> torch.Tensor:
        """``arange(n)`` (int32, on the table's device): a view of one tensor kept for it (never
        written), e.g. a decode step's ``cu_seqlens_q``."""
        if n > self._iota.numel():
            self._iota = torch.arange(2 * n, dtype=torch.int32, device=self.device)
        return self._iota[:n]

    def rows_of(self, names: tuple, seqs: dict) -> BatchRows:
        """``names`` resolved to records and rows. The last batch is kept: a decode loop that
        plans the same namespaces step after step compares one tuple (identical names
        compare by identity) instead of looking each one up."""
        last = self._last
        if last is not None and last.generation == self._generation and last.names == names:
            return last
        records = tuple(map(seqs.get, names))
        if None in records:
            # A new namespace takes a row at this plan: resolve again next time.
            return BatchRows(names, records, [], False, -1)
        rows = [r.row for r in records]
        first = rows[0]
        got = BatchRows(names, records, rows, rows == list(range(first, first + len(rows))), self._generation)
        self._last = got
        return got

    def new_seq(self) -> SeqRecord:
        """A record on a free row (the table doubles its rows when none is left)."""
        if not self.free_rows:
            old = self.data
            g, rows, cols = old.shape
            self.data = torch.zeros(g, 2 * rows, cols, dtype=torch.int32, device=self.device)
            self.data[:, :rows] = old
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
            self.state.grow(2 * rows)
        self._generation += 1
        return SeqRecord(self.free_rows.pop(), self.groups, self.state)

    def ensure_cols(self, n_blocks: int) -> None:
        """At least ``n_blocks`` columns (doubling)."""
        cols = self.data.shape[2]
        if n_blocks <= cols:
            return
        while cols < n_blocks:
            cols *= 2
        old = self.data
        self.data = torch.zeros(*old.shape[:2], cols, dtype=torch.int32, device=self.device)
        self.data[:, :, : old.shape[2]] = old

    def set_entries(self, seq: SeqRecord, group: int, start: int) -> None:
        """Queue ``seq``'s entries of ``group`` from column ``start`` on."""
        blocks = seq.blocks[group]
        seq.limit = 0
        for j in range(start, len(blocks)):
            self.pending[(group, seq.row, j)] = max(blocks[j], 0)  # a released block: entry 0, never read

    def set_entry(self, group: int, row: int, col: int, block: int) -> None:
        self.pending[(group, row, col)] = block

    def flush(self) -> None:
        """Write the queued entries (one upload, one ``index_put_`` into the flat table)."""
        if not self.pending:
            return
        _g, rows, cols = self.data.shape
        flat = [(g * rows + r) * cols + c for g, r, c in self.pending]  # into the contiguous table
        packed = upload([*flat, *self.pending.values()], torch.int64, self.device)
        self.pending.clear()
        n = len(flat)
        self.data.view(-1).index_put_((packed[:n],), packed[n:].to(torch.int32))

    def free_row(self, seq: SeqRecord) -> None:
        """``seq``'s row back to the free rows (its block lists emptied)."""
        seq.blocks = [[] for _ in range(self.groups)]
        seq.limit = 0
        self.free_rows.append(seq.row)
        self._generation += 1

"""The paged pool's block-table rows: one record per namespace and the persistent device
table ``[G, rows, cols]`` its block lists are mirrored into.

Changed entries are queued on the host and written with one ``index_put_`` at
:meth:`BlockTable.flush` (the plan calls it once per step); the table doubles its rows or
columns when a namespace needs more, a re-allocation between steps.
"""

from __future__ import annotations

import torch

from kvarena.cache._meta import next_version, upload

__all__ = ["FREED", "BlockTable", "SeqRecord", "cdiv"]

#: A released (out-of-window) block in a sequence's block list.
FREED = -1


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints."""
    return -(-a // b)


class SeqRecord:
    """One namespace: its block list per layer group, its length, its table row, the
    version its metadata is stamped with and the length it can grow to by plain appends."""

    __slots__ = ("blocks", "seq_len", "row", "version", "released", "limit", "bases")

    def __init__(self, row: int, groups: int) -> None:
        self.blocks: list[list[int]] = [[] for _ in range(groups)]  # per layer group
        self.seq_len = 0
        self.row = row  # the same row of every group's table
        self.version = next_version()
        # free_out_of_window, per group: blocks [sink blocks, released) are FREED (one run,
        # since releases only ever extend it), so each plan scans only the newly dead blocks.
        self.released = [0] * groups
        # A plan whose new tokens end at <= limit takes no block, copies none and releases
        # none (WindowRules.refresh); 0 = unknown, the plan decides in full. Whatever changes
        # the record's blocks outside a plan resets it.
        self.limit = 0
        # While limit > 0, per group: position p < limit of the block being filled sits at
        # slot bases[g] + p.
        self.bases = [0] * groups


class BlockTable:
    """The device table ``[groups, rows, cols]`` (int32) and its free rows."""

    def __init__(self, groups: int, rows: int, cols: int, device: torch.device) -> None:
        self.groups = groups
        self.device = device
        self.data = torch.zeros(groups, rows, cols, dtype=torch.int32, device=device)
        self.free_rows = list(range(rows - 1, -1, -1))
        self.pending: dict[tuple[int, int, int], int] = {}  # (group, row, col) -> block

    def new_seq(self) -> SeqRecord:
        """A record on a free row (the table doubles its rows when none is left)."""
        if not self.free_rows:
            old = self.data
            g, rows, cols = old.shape
            self.data = torch.zeros(g, 2 * rows, cols, dtype=torch.int32, device=self.device)
            self.data[:, :rows] = old
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return SeqRecord(self.free_rows.pop(), self.groups)

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

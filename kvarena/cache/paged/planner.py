"""Host planning of a paged step: the batch's checks, what it needs (blocks, copy-on-write
copies, out-of-window releases) and the window rules of ``truncate``, changing nothing.

Layer groups that release alike (the same window, or none) stay alike: every operation
(plan, fork, copy-on-write, truncate, allocate) treats them the same way, so their block
lists have equal lengths, released runs and per-index reference counts, only other ids. A
plan decides for one group per class and applies to all.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from kvarena.argcheck import check_bool
from kvarena.cache.arena import _check_int
from kvarena.cache.paged.meta import GraphBuffers
from kvarena.cache.paged.table import FREED, SeqRecord, cdiv

__all__ = ["DeadBlocks", "GroupClass", "StepNeeds", "WindowRules", "check_batch"]


@dataclass(frozen=True)
class DeadBlocks:
    """A group's blocks of one sequence that no future query can see: their indices, and
    the end of the group's released run once they are released."""

    indices: list
    end: int


@dataclass(frozen=True)
class StepNeeds:
    """What a plan of a batch needs, before anything changes."""

    #: Blocks to take (new ones plus copy-on-write copies, over every group).
    need: int
    #: Blocks free once the plan's releases are applied.
    available: int
    #: The longest sequence's blocks after the step.
    max_blocks: int
    #: ``{(namespace, group): DeadBlocks}`` the plan releases first.
    dead: dict
    #: Namespaces that take blocks (new, growing or copy-on-write).
    touched: frozenset


@dataclass(frozen=True)
class GroupClass:
    """Layer groups that release alike: the one a plan decides for, and all of them."""

    rep: int
    groups: tuple

    @property
    def mult(self) -> int:
        return len(self.groups)


_INT = {int}


def check_batch(batch, graph: bool, pad_to: int | None, buffers: GraphBuffers | None) -> tuple[tuple, tuple]:
    """``plan``'s argument checks; returns the batch's namespaces and new-token counts, as two
    tuples in the mapping's order."""
    check_bool("graph", graph)
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch: expected a mapping of namespace -> n_new_tokens, got {type(batch).__name__}")
    if not batch:
        raise ValueError("batch: expected at least one namespace")
    if pad_to is not None:
        pad_to = _check_int("pad_to", pad_to, 1)
        if graph:
            raise ValueError("pad_to: not with graph=True (graph plans have their own fixed rows)")
    # Two tuples, not (namespace, count) pairs: a decode step of B rows then costs a few
    # C-level passes over B, not B tuples built and unzipped.
    names, news = tuple(batch), tuple(batch.values())
    # Every count a plain int in range (the common step): a few C-level passes; otherwise
    # item by item, for the message of the first bad one.
    if not (set(map(type, news)) == _INT and min(news) >= (0 if pad_to else 1) and (
            pad_to is None or max(news) <= pad_to)):
        news = tuple(_check_int(f"batch[{ns!r}]", n, 0 if pad_to else 1) for ns, n in zip(names, news))
        for ns, n in zip(names, news):
            if pad_to is not None and n > pad_to:
                raise ValueError(f"batch[{ns!r}]: {n} new tokens do not fit pad_to = {pad_to} rows")
    if graph:
        if buffers is None:
            raise ValueError("graph: this PagedKVCache was made without graph_capacity=")
        if len(names) > buffers.max_batch:
            raise ValueError(f"batch: {len(names)} namespaces exceed graph_capacity max_batch {buffers.max_batch}")
        for ns, n in zip(names, news):
            if n != buffers.q_per_seq:
                raise ValueError(f"batch[{ns!r}]: graph plans take exactly q_per_seq = {buffers.q_per_seq} "
                                 f"tokens, got {n}")
    return names, news


class WindowRules:
    """Per layer group: the ``(window_left, sink_tokens)`` its blocks are released by, or
    None (it keeps every block), and the host counting of a plan under them."""

    def __init__(self, limits: Sequence, rollback: int, block_size: int) -> None:
        self.limits = list(limits)
        self.groups = len(self.limits)
        self.block_size = block_size
        # What a release keeps per group: (window + rollback margin, sink tokens), or None.
        self.keep = [None if lim is None else (lim[0] + rollback, lim[1]) for lim in self.limits]
        self.releases = any(k is not None for k in self.keep)
        classes: dict = {}
        for g, keep in enumerate(self.keep):
            classes.setdefault(keep, []).append(g)
        self.classes = [GroupClass(gs[0], tuple(gs)) for gs in classes.values()]
        self.sliding = [c for c in self.classes if self.keep[c.rep] is not None]

    @staticmethod
    def of(free: bool, layout, specs: Sequence, groups: int) -> list:
        """The release limits of ``free_out_of_window=free`` (the widest window and sinks over
        each group's layers; None for a group with a full-attention layer)."""
        if not free:
            return [None] * groups
        if not specs:
            raise ValueError("free_out_of_window: needs a layout (the layers' attention specs)")
        out = []
        for grp in layout.layer_groups:
            gspecs = [specs[i] for i in grp.layers]
            full = [i for i, sp in zip(grp.layers, gspecs) if sp.window_left is None]
            out.append(None if full else (max(sp.window_left for sp in gspecs), max(sp.sink_tokens for sp in gspecs)))
        if all(lim is None for lim in out):
            full = next(i for i, sp in enumerate(specs) if sp.window_left is None)
            hint = ("no group of layout.groups has only sliding layers" if layout.groups is not None else
                    "group the layers (KVLayout(groups=kvarena.group_layers(...))) so the sliding ones release "
                    "on their own")
            raise ValueError(f"free_out_of_window: layer {full} sees the whole history (window_left None); {hint}")
        return out

    def dead_blocks(self, seq: SeqRecord, group: int) -> DeadBlocks:
        """``seq``'s live blocks of ``group`` no query at a position >= seq_len can see, among
        those not released yet (O(blocks that died since the last plan))."""
        w, sinks = self.keep[group]
        bs = self.block_size
        blocks, released = seq.blocks[group], seq.released[group]
        end = min(max(0, seq.seq_len - w) // bs, len(blocks))  # blocks j < end: tokens < seq_len - w
        start = max(cdiv(sinks, bs), released)
        return DeadBlocks([j for j in range(start, end) if blocks[j] != FREED], max(released, end))

    def _dead(self, items, seqs: Mapping) -> dict:
        dead: dict = {}  # (namespace, group) -> DeadBlocks
        bs = self.block_size
        for ns, _n in items if self.sliding else ():
            seq = seqs.get(ns)
            if seq is None:
                continue
            for cls in self.sliding:
                # Blocks j < end hold only tokens < seq_len - window: O(1) when none died.
                end = min((seq.seq_len - self.keep[cls.rep][0]) // bs, len(seq.blocks[cls.rep]))
                if end > seq.released[cls.rep]:
                    for g in cls.groups:
                        dead[ns, g] = self.dead_blocks(seq, g)
        return dead

    def count(self, items, seqs: Mapping[Hashable, SeqRecord], allocator) -> StepNeeds:
        """What a plan of ``items`` needs, changing nothing (call under the pool's lock)."""
        bs = self.block_size
        refs = allocator._ref  # read-only here (the hot loop: a plan visits every row of every class)
        dead = self._dead(items, seqs)
        drops: dict[int, int] = {}  # block id -> references those releases drop
        for (ns, g), d in dead.items():
            for j in d.indices:
                b = seqs[ns].blocks[g][j]
                drops[b] = drops.get(b, 0) + 1
        need = 0
        pending_drop: dict[int, int] = {}  # (the class representatives' block ids)
        max_blocks = 0
        touched = set()
        for ns, n in items:
            seq = seqs.get(ns)
            old = seq.seq_len if seq is not None else 0
            n_blocks = cdiv(old + n, bs)
            max_blocks = max(max_blocks, n_blocks)
            first = old // bs
            before = need
            for cls in self.classes:
                blocks = seq.blocks[cls.rep] if seq is not None else ()
                have = len(blocks)
                if n_blocks > have:
                    need += cls.mult * (n_blocks - have)
                for j in range(first, min(have, n_blocks)):
                    b = blocks[j]
                    # References after this plan's releases (a fork's dead copy of the block).
                    if refs.get(b, 0) - drops.get(b, 0) - pending_drop.get(b, 0) > 1:
                        need += cls.mult
                        pending_drop[b] = pending_drop.get(b, 0) + 1
            if need > before or seq is None:
                touched.add(ns)
        # Dead blocks whose every reference this plan releases come back before the step
        # takes any (the releases are applied first).
        returning = sum(1 for b, c in drops.items() if refs.get(b, 0) == c)
        return StepNeeds(need, allocator.num_free + returning, max_blocks, dead, frozenset(touched))

    def refresh(self, seq: SeqRecord, refs: Mapping[int, int]) -> None:
        """Set ``seq.limit``: the length ``seq`` can grow to by plans that take no block, copy
        none and release none. That is the end of the block its next token goes to when
        every group holds that block unshared (``refs``: the allocator's reference counts),
        lowered to the length at which a sliding group's next block leaves the window; 0
        when the block is missing or shared. With it ``seq.bases``, the slot of position 0
        of that block per group.

        A plan of ``n >= 1`` tokens from ``seq_len`` with ``seq_len + n <= limit`` writes
        into that block only, and ``seq_len`` is below the length where :meth:`count` would
        release anything."""
        bs = self.block_size
        j = seq.seq_len // bs
        out = (j + 1) * bs
        for cls in self.classes:
            blocks = seq.blocks[cls.rep]
            if j >= len(blocks) or blocks[j] < 0 or refs.get(blocks[j], 0) > 1:
                seq.limit = 0
                return
            keep = self.keep[cls.rep]
            if keep is not None:
                # A block dies once (seq_len - window) // bs passes the released run.
                out = min(out, (seq.released[cls.rep] + 1) * bs + keep[0])
        seq.limit = out
        seq.bases = [(blocks[j] - j) * bs for blocks in seq.blocks]

    def growing(self, slow: list, recs: tuple, olds: list, news: tuple) -> tuple[frozenset, list]:
        """``slow``'s rows (indices into ``recs``, ``olds`` and ``news``) split into those that
        only open one new block in every group and the others: a decode step crossing a page
        boundary (the length at a block end, every block up to it held, 1 to ``block_size``
        new tokens) in a pool without window rules.

        A growing row needs exactly one fresh block per group, no copy-on-write (its blocks
        all lie before the new tokens) and no release: what :meth:`count` would find for it,
        without counting it. Its record is then set by :meth:`opened`, not :meth:`refresh`."""
        if self.sliding:
            return frozenset(), slow
        bs = self.block_size
        grow, others = [], []
        for i in slow:
            r, old = recs[i], olds[i]
            at = old // bs
            if r is not None and old == at * bs and 0 < news[i] <= bs and all(len(b) == at for b in r.blocks):
                grow.append(i)
            else:
                others.append(i)
        return frozenset(grow), others

    def opened(self, seq: SeqRecord, n: int, new: list) -> None:
        """:meth:`refresh` for a :meth:`growing` row whose step of ``n`` tokens appended the
        fresh blocks ``new`` (one per group): the new block, held unshared, takes the next
        tokens up to its end; a step that fills it leaves ``limit`` 0."""
        bs = self.block_size
        if n < bs:
            col = len(seq.blocks[0]) - 1
            seq.limit = (col + 1) * bs
            seq.bases = [(b - col) * bs for b in new]
        else:
            seq.limit = 0

    def check_truncate(self, seq: SeqRecord, n_tokens: int) -> None:
        """Raise unless every group of ``seq`` still holds what a truncate to ``n_tokens`` needs."""
        bs = self.block_size
        keep = cdiv(n_tokens, bs)
        for g, lim in enumerate(self.limits):
            if lim is None or not n_tokens:
                continue
            # The next query (position n_tokens) needs its window and the sinks back; the
            # sink blocks are never released, the others were in one run.
            w, sinks = lim
            lo = max(0, n_tokens - w) // bs
            first = max(lo, cdiv(sinks, bs))
            if first < min(keep, seq.released[g]):
                where = f" of layer group {g}" if self.groups > 1 else ""
                raise ValueError(
                    f"n_tokens: rolling back to {n_tokens} tokens needs block {first}{where} (tokens "
                    f"{first * bs}..), released out of the window at an earlier plan; "
                    f"reachable lengths: {self.min_len(seq)} and on, or one whose window holds only "
                    "sink blocks")

    def min_len(self, seq: SeqRecord) -> int:
        """The shortest length past every group's released run that ``truncate`` can reach."""
        out = 0
        for g, lim in enumerate(self.limits):
            if lim is not None and seq.released[g] > cdiv(lim[1], self.block_size):
                out = max(out, min(seq.seq_len, seq.released[g] * self.block_size + lim[0]))
        return out

"""Which of transformers' positions hold a token :class:`~.cache.KVArenaCache` stored.

transformers counts positions: the sequence axis, padding included (``get_seq_length``,
``crop``). The arena stores only real tokens, so a row with right padding or holes holds
fewer tokens than positions, at positions no length can tell. :class:`RowPositions`
keeps, step by step, which positions of each row are real: what ``crop`` counts by (a
crop keeps the first ``keep`` positions, so each row keeps its real tokens among them).
"""

from __future__ import annotations

import torch


class RowPositions:
    """Per step, which of its positions are real in each row: an int ``n`` (``n`` positions,
    real in every row: a decode step) or a CPU bool tensor ``[B, n]``. Consecutive all-real
    steps are one int, so a long generation keeps a few entries (a beam step reorders only
    the tensors)."""

    def __init__(self) -> None:
        self._steps: list = []
        self._total = 0

    def __len__(self) -> int:
        """Positions logged (transformers' length)."""
        return self._total

    def append(self, real: torch.Tensor | int) -> None:
        """Log a step: ``real`` bool ``[B, n]`` (True = a stored token), or ``n`` when every
        position of every row is real."""
        if isinstance(real, torch.Tensor):
            real = real.to("cpu", torch.bool)
            if bool(real.all()):
                real = real.shape[1]
        if isinstance(real, int) and self._steps and isinstance(self._steps[-1], int):
            self._steps[-1] += real
        else:
            self._steps.append(real)
        self._total += real if isinstance(real, int) else real.shape[1]

    def mark(self) -> tuple:
        """A point to :meth:`rollback` to (the step in progress undone)."""
        return len(self._steps), self._total, self._steps[-1] if self._steps else None

    def rollback(self, mark: tuple) -> None:
        n, self._total, last = mark
        del self._steps[n:]
        if isinstance(last, int):  # an all-real step merged into it
            self._steps[-1] = last

    def real_after(self, keep: int, rows: int) -> list[int]:
        """Per row, the real positions at or after position ``keep`` (what ``crop`` to
        ``keep`` positions drops)."""
        out = [0] * rows
        left = self._total - keep
        for step in reversed(self._steps):
            if left <= 0:
                break
            if isinstance(step, int):
                k = min(left, step)
                out = [x + k for x in out]
            else:
                k = min(left, step.shape[1])
                out = [x + int(c) for x, c in zip(out, step[:, step.shape[1] - k :].sum(1).tolist())]
            left -= k
        return out

    def cut(self, keep: int) -> None:
        """Forget the positions at or after ``keep``."""
        while self._total > keep:
            step = self._steps[-1]
            n = step if isinstance(step, int) else step.shape[1]
            k = min(n, self._total - keep)
            if k == n:
                self._steps.pop()
            else:
                self._steps[-1] = n - k if isinstance(step, int) else step[:, : n - k]
            self._total -= k

    def reorder(self, index: list[int]) -> None:
        """Row ``i`` becomes row ``index[i]`` (beam search)."""
        self._steps = [s if isinstance(s, int) else s[index] for s in self._steps]

    def clear(self) -> None:
        self._steps, self._total = [], 0

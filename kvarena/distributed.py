"""Context parallelism over ``torch.distributed``: one rollout's KV across ranks.

:class:`ContextParallel` names the process group and the scheme; a KV pool built with it
(``SlabKVCache(..., context_parallel=cp)``) takes each rank's contiguous sequence shard
of a step's rows and returns the same shard of the output, equal to the single-process
pool on the full tensors. Retained KV never moves: only the step's q / k / v / out cross
ranks.

``mode="heads"`` (Ulysses, as xDiT's USP and MAGI-1's ``cp_ulysses``): an ``all_to_all``
turns the sequence shards of q, k, v into head shards (every rank then holds all the
step's tokens for ``H / N`` heads), the rank's pool stores and attends its heads only
(an arena of ``max_bytes / N``), and a second ``all_to_all`` turns the output back into
sequence shards. Attention needs no log-sum-exp exchange; ``N`` must divide ``H_kv``.

``mode="tokens"`` (vLLM's decode context parallel, ring-attention's LSE merge without
the ring): each rank stores its rows of every chunk (``split_sizes(slab_tokens)``), the
step's queries are all-gathered, every rank attends all of them over its keys, and each
rank's partial ``(out, lse)`` rows go back to their owner, merged there in rank order
(bitwise repeatable). Any ``N`` (no head constraint); K/V never cross ranks at all.

The collectives are torch's functional, autograd-aware ones
(``torch.distributed._functional_collectives.all_to_all_single_autograd``), so gradients
flow back through them and ``torch.compile`` can trace them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kvarena.argcheck import is_int

__all__ = ["CommStats", "ContextParallel"]

_MODES = ("heads", "tokens")


@dataclass
class CommStats:
    """Bytes this rank sent to other ranks (its own share, which stays, is not counted).

    Attributes
    ----------
    calls : int
        Collectives issued.
    bytes_sent : int
        Total bytes sent to the other ranks of the group.
    per_layer : dict of int to int
        ``bytes_sent`` by the layer whose ``forward`` sent them.
    """

    calls: int = 0
    bytes_sent: int = 0
    per_layer: dict = field(default_factory=dict)

    def add(self, layer: int, nbytes: int) -> None:
        self.calls += 1
        self.bytes_sent += nbytes
        self.per_layer[layer] = self.per_layer.get(layer, 0) + nbytes

    def reset(self) -> None:
        """Zero every counter."""
        self.calls = self.bytes_sent = 0
        self.per_layer = {}


class ContextParallel:
    """A process group and a context-parallel scheme for kvarena's KV pools.

    Parameters
    ----------
    group : ProcessGroup or DeviceMesh, optional
        The ranks that share one rollout (a sub-group too: shards follow the rank within
        the group; ranks outside it never call). A 1-D ``DeviceMesh`` gives its group.
        None: the default group (``torch.distributed`` must be initialized).
    mode : {"heads", "tokens"}, default "heads"
        ``"heads"``: Ulysses, sequence shards to head shards and back (the group size
        must divide the layout's ``num_kv_heads``). ``"tokens"``: each rank stores its
        share of every chunk's tokens; queries all-gathered, partial attentions merged.

    Attributes
    ----------
    group : ProcessGroup
    mode : str
    world_size, rank : int
        The group's size and this process's rank in it.
    stats : CommStats
        What this rank's pools sent.

    Raises
    ------
    TypeError
        ``group`` of another type, or a multi-dimensional mesh.
    ValueError
        ``mode`` not one of the two; ``torch.distributed`` not initialized; this process
        not in ``group``.
    """

    def __init__(self, group=None, *, mode: str = "heads") -> None:
        if not isinstance(mode, str) or mode not in _MODES:
            raise ValueError(f"mode: expected 'heads' or 'tokens', got {mode!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized (call "
                             "torch.distributed.init_process_group first)")
        if group is None:
            group = dist.group.WORLD
        elif group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on a rank outside it
            raise ValueError("group: this process is not in the group (ranks outside it never call)")
        elif _is_mesh(group):
            if group.ndim != 1:
                raise TypeError(f"group: expected a 1-D DeviceMesh, got a {group.ndim}-D one")
            group = group.get_group()
        elif not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group: expected None, a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("group: this process is not in the group (ranks outside it never call)")
        self.group = group
        self.mode = mode
        self.world_size = dist.get_world_size(group)
        self.rank = rank
        self.stats = CommStats()

    def split_sizes(self, n: int) -> list[int]:
        """Contiguous shard sizes of ``n`` rows: ``n // N`` each, the first ``n % N`` ranks one more."""
        if not is_int(n) or n < 0:
            raise ValueError(f"n: expected an int >= 0, got {n!r}")
        q, r = divmod(n, self.world_size)
        return [q + (i < r) for i in range(self.world_size)]

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous shard of ``x`` along ``dim`` (a view)."""
        sizes = self.split_sizes(x.shape[dim])
        return x.narrow(dim, sum(sizes[: self.rank]), sizes[self.rank])

    # ------------------------------------------------------------------ collectives
    def _a2a(self, flat: torch.Tensor, out_splits: list[int], in_splits: list[int], layer: int) -> torch.Tensor:
        if self.world_size == 1:
            return flat
        from torch.distributed._functional_collectives import (
            all_to_all_single_autograd,
            wait_tensor,
        )

        own = in_splits[self.rank]
        self.stats.add(layer, (sum(in_splits) - own) * flat.element_size())
        # Waited here (autograd-aware): the result feeds Triton launches and views, which
        # read the storage directly, and the very next op consumes it anyway.
        return wait_tensor(all_to_all_single_autograd(flat, out_splits, in_splits, self.group))

    def to_heads(self, x: torch.Tensor, n_rows: int, layer: int) -> torch.Tensor:
        """``[B, T_r, H, *rest]`` sequence shards -> ``[B, T, H / N, *rest]`` head shards.

        ``T_r`` is this rank's share of ``n_rows`` (:meth:`split_sizes`); head block ``r``
        (heads ``r * H / N ..``) goes to rank ``r``.
        """
        n = self.world_size
        if n == 1:
            return x
        b, t_r, h = x.shape[:3]
        rest = tuple(x.shape[3:])
        hs = h // n
        send = x.reshape(b, t_r, n, hs, *rest).movedim(2, 0).contiguous()  # [N, B, T_r, H/N, *rest]
        return self._rows_from_all(send.reshape(-1), b, t_r, (hs, *rest), n_rows, layer)  # [B, T, H/N, *rest]

    def to_tokens(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """``[B, T, H / N, *rest]`` head shards -> ``[B, T_r, H, *rest]`` sequence shards."""
        n = self.world_size
        if n == 1:
            return y
        b, hs, rest = y.shape[0], y.shape[2], tuple(y.shape[3:])
        got = self.scatter_rows(y, layer)  # [N, B, T_r, H/N, *rest]: head block s from rank s
        return got.movedim(0, 2).reshape(b, got.shape[2], n * hs, *rest)

    def all_fit(self, ok: bool, device) -> bool:
        """True when ``ok`` is true on every rank (an all-reduce of one int; not counted in
        ``stats``, which counts the layers' traffic)."""
        if self.world_size == 1:
            return bool(ok)
        flag = torch.tensor([int(bool(ok))], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def all_gather(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """``x`` (the same shape on every rank) -> ``[N, *x.shape]``, rank order."""
        n = self.world_size
        if n == 1:
            return x[None]
        m = x.numel()
        return self._a2a(x.reshape(-1).repeat(n), [m] * n, [m] * n, layer).view(n, *x.shape)

    # ------------------------------------------------------------------ rows
    def scatter_rows(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """``[B, T, *rest]`` on every rank -> ``[N, B, T_r, *rest]``: this rank's rows of
        every rank's ``y``, in rank order."""
        n = self.world_size
        b, t, rest = y.shape[0], y.shape[1], tuple(y.shape[2:])
        sizes = self.split_sizes(t)
        t_r = sizes[self.rank]
        if n == 1:
            return y[None]
        per = math.prod(rest)
        send = torch.cat([p.reshape(-1) for p in y.split(sizes, dim=1)])  # rank s's rows, in rank order
        recv = self._a2a(send, [b * t_r * per] * n, [b * s * per for s in sizes], layer)
        return recv.view(n, b, t_r, *rest)

    def gather_rows(self, x: torch.Tensor, n_rows: int, layer: int) -> torch.Tensor:
        """``[B, T_r, *rest]`` shards -> ``[B, T, *rest]`` on every rank (an all-gather of
        uneven contiguous shards)."""
        n = self.world_size
        if n == 1:
            return x
        b, t_r = x.shape[0], x.shape[1]
        return self._rows_from_all(x.reshape(-1).repeat(n), b, t_r, tuple(x.shape[2:]), n_rows, layer)

    def _rows_from_all(self, send: torch.Tensor, b: int, t_r: int, item: tuple, n_rows: int, layer: int):
        """Send ``send`` (``N`` equal parts of ``[B, T_r, *item]``, part ``s`` to rank ``s``)
        and join what every rank sent here along the rows: ``[B, T, *item]``."""
        per = math.prod(item)
        sizes = self.split_sizes(n_rows)
        recv = self._a2a(send, [b * t * per for t in sizes], [b * t_r * per] * self.world_size, layer)
        return torch.cat([p.view(b, t, *item) for p, t in zip(recv.split([b * t * per for t in sizes]), sizes)], 1)

    def __repr__(self) -> str:
        return f"ContextParallel(mode={self.mode!r}, world_size={self.world_size}, rank={self.rank})"


def _is_mesh(obj) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without device meshes
        return False
    return isinstance(obj, DeviceMesh)

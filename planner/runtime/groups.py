"""Process groups of one run: a ("pp", "dp", "cp", "tp") DeviceMesh in Megatron rank order.

tp is the innermost dimension, then cp, then dp, then pp (Megatron-Core's tp-cp-dp-pp): global rank =
((pp*dp + dp_rank)*cp + cp_rank)*tp + tp_rank, so the ranks of one tensor-parallel group are adjacent (one
node), as Megatron lays them out. Gradients are reduced (and a sharded optimizer sharded) over the data-
and context-parallel ranks together, Megatron's data-parallel-with-cp group.
Parameters shared between pipeline stages (a tied embedding and LM head) get one more group per
(dp, tp) coordinate holding the pipeline ranks that own a copy: Megatron's embedding group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["Coords", "Groups", "coords_of", "global_rank", "make_groups", "make_shared_groups"]

MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True, kw_only=True, slots=True)
class Coords:
    """Where one global rank sits in the (pp, dp, cp, tp) grid."""

    rank: int
    pp: int
    dp: int
    tp: int
    pp_size: int
    dp_size: int
    tp_size: int
    cp: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        world = self.pp_size * self.dp_size * self.cp_size * self.tp_size
        if not 0 <= self.rank < world:
            raise ValueError(f"rank {self.rank} is outside a world of pp*dp*cp*tp = {world}")

    def peer(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` with this rank's dp, cp and tp coordinates."""
        return global_rank(pp_rank, self.dp, self.tp, dp_size=self.dp_size, tp_size=self.tp_size, cp=self.cp,
                           cp_size=self.cp_size)

    @property
    def dp_cp(self) -> int:
        """This rank's index in its data-parallel-with-cp group (gradient reduction, optimizer shards)."""
        return self.dp * self.cp_size + self.cp


def global_rank(pp: int, dp: int, tp: int, *, dp_size: int, tp_size: int, cp: int = 0, cp_size: int = 1) -> int:
    return ((pp * dp_size + dp) * cp_size + cp) * tp_size + tp


def coords_of(rank: int, *, pp_size: int, dp_size: int, tp_size: int, cp_size: int = 1) -> Coords:
    rest, tp = divmod(rank, tp_size)
    rest, cp = divmod(rest, cp_size)
    pp, dp = divmod(rest, dp_size)
    return Coords(rank=rank, pp=pp, dp=dp, tp=tp, cp=cp, pp_size=pp_size, dp_size=dp_size, tp_size=tp_size,
                  cp_size=cp_size)


@dataclass(kw_only=True, slots=True)
class Groups:
    """The mesh and the groups this rank belongs to."""

    coords: Coords
    mesh: DeviceMesh
    pp_group: Any
    dp_group: Any
    tp_group: Any
    tp_mesh: DeviceMesh
    cp_group: Any = None
    grad_group: Any = None
    """The data-parallel-with-cp group: gradients are averaged over it (the dp group when cp = 1)."""
    shared: dict[str, Any] = field(default_factory=dict)
    """Canonical parameter name -> group of the pipeline ranks holding a copy (this rank's dp, tp)."""


def make_groups(*, device_type: str, pp: int, dp: int, tp: int, cp: int = 1) -> Groups:
    """Build the mesh; every rank must call this (it creates process groups, a collective setup)."""
    mesh = init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=MESH_DIMS)
    coords = coords_of(dist.get_rank(), pp_size=pp, dp_size=dp, tp_size=tp, cp_size=cp)
    expect = [mesh.get_local_rank(name) for name in MESH_DIMS]
    if expect != [coords.pp, coords.dp, coords.cp, coords.tp]:  # the layout is the contract with the plan
        raise RuntimeError(f"DeviceMesh put rank {coords.rank} at {expect}, expected "
                           f"{[coords.pp, coords.dp, coords.cp, coords.tp]}")
    grad_group = mesh.get_group("dp")
    if cp > 1:  # every rank creates every (pp, tp) coordinate's group, in the same order
        for p in range(pp):
            for t in range(tp):
                ranks = [global_rank(p, d, t, dp_size=dp, tp_size=tp, cp=c, cp_size=cp)
                         for d in range(dp) for c in range(cp)]
                group = dist.new_group(ranks)
                if coords.rank in ranks:
                    grad_group = group
    return Groups(coords=coords, mesh=mesh, pp_group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"),
                  tp_group=mesh.get_group("tp"), tp_mesh=mesh["tp"], cp_group=mesh.get_group("cp"),
                  grad_group=grad_group)


def make_shared_groups(groups: Groups, holders: dict[str, Iterable[int]]) -> None:
    """For each parameter held by several pipeline ranks, a group of those ranks per (dp, tp).

    Every rank calls new_group for every group in the same order (a torch.distributed rule), and
    keeps the ones it belongs to. Parameters with the same set of holders share one group.
    """
    c = groups.coords
    by_holders: dict[tuple[int, ...], list[str]] = {}
    for name, ranks in sorted(holders.items()):
        key = tuple(sorted(set(ranks)))
        if len(key) > 1:
            by_holders.setdefault(key, []).append(name)
    for key, names in sorted(by_holders.items()):
        for dp in range(c.dp_size):
            for cp in range(c.cp_size):
                for tp in range(c.tp_size):
                    ranks = [global_rank(pp, dp, tp, dp_size=c.dp_size, tp_size=c.tp_size, cp=cp, cp_size=c.cp_size)
                             for pp in key]
                    group = dist.new_group(ranks)
                    if c.rank in ranks:
                        groups.shared.update(dict.fromkeys(names, group))

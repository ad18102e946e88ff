"""Copy insertion (docs/lowering.md#2-copy-insertion-shardflowlowercopy_insertion), the second lowering pass: a COPY
wherever a node reads a value held by another sub-mesh (a pipeline stage boundary), in the pass of the value's role.
Identical copies collapse; nothing goes in front of a Replicate, which moves its data itself.
:func:`cross_submesh_reads` is what it removes, and what every later pass refuses.
"""

from __future__ import annotations

import dataclasses

from shardflow.lower.dynamic import DNode, DynamicGraph, GraphBuilder, NodeKind, PassError, PassName, copied_id, require
from shardflow.parallel.mesh import SubMesh
from shardflow.parallel.ops import ReplicateOp


def _moves_between_submeshes(n: DNode) -> bool:
    """Copies, Replicate and its backward move data between sub-meshes themselves; the gradient-norm sum
    reads, on each device, whatever gradient pieces that device holds."""
    return n.kind in (NodeKind.COPY, NodeKind.SELECT, NodeKind.SUMSQ) or isinstance(n.op, ReplicateOp)


def cross_submesh_reads(dg: DynamicGraph) -> list[tuple[str, str]]:
    """(node, value) for every read of a value held by another sub-mesh by a node that does not move data
    between sub-meshes itself: what copy insertion removes, and what every later pass refuses."""
    return [
        (n.name, v)
        for n in dg.nodes
        if not _moves_between_submeshes(n)
        for v in n.inputs
        if dg.values[v].group != n.group
    ]


def copy_insertion(dg: DynamicGraph) -> DynamicGraph:
    """A COPY in front of every read of a value held by another sub-mesh (see the module docstring).
    Raises PassError if pass expansion has not run, this pass has, or (after) a cross-sub-mesh read is left."""
    require(dg.done, PassName.COPY_INSERTION, (PassName.PASS_EXPANSION,))
    g = GraphBuilder(dg.values)
    copies: dict[tuple[str, SubMesh], str] = {}
    for n in dg.nodes:
        moves_itself = _moves_between_submeshes(n)
        ins = []
        for vid in n.inputs:
            v = g.values[vid]
            if v.group == n.group or moves_itself:
                ins.append(vid)
                continue
            key = (vid, n.group)
            if key not in copies:
                out = g.value(copied_id(vid, n.group), v.tensor, v.role, v.type, v.sharding, n.group)
                g.nodes.append(
                    DNode(
                        f"{v.task} copy {vid} {v.group}->{n.group}",
                        v.task,
                        NodeKind.COPY,
                        (vid,),
                        (out,),
                        n.group,
                        n.src,
                        micro=n.micro,
                    )
                )
                copies[key] = out
            ins.append(copies[key])
        g.nodes.append(n if tuple(ins) == n.inputs else dataclasses.replace(n, inputs=tuple(ins)))
    out = dataclasses.replace(dg, values=g.values, nodes=tuple(g.nodes), done=dg.done + (PassName.COPY_INSERTION,))
    if bad := cross_submesh_reads(out):
        raise PassError(f"copy insertion left {bad[0][0]!r} reading {bad[0][1]!r} from another sub-mesh")
    return out

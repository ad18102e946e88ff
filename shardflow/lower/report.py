"""Reports on lowered plans: bytes per rank against the bandwidth-optimal bound, and a Graphviz view of a PCG."""

from __future__ import annotations

from typing import Mapping

from shardflow.graph.graph import TensorRole
from shardflow.lower.program import Program
from shardflow.parallel.collectives import CommKind, bound_bytes
from shardflow.parallel.pcg import PCG


def bytes_rows(programs: Mapping[int, Program]) -> list[tuple[int, str, str, int, int, int]]:
    """(rank, kind, axis, count, planned bytes, bound bytes) per rank and (kind, axis), per step."""
    rows: dict[tuple[int, str, str], list[int]] = {}
    for r, p in sorted(programs.items()):
        for c in p.comms:
            if c.kind == CommKind.RECV:
                continue
            acc = rows.setdefault((r, c.kind, c.axis), [0, 0, 0])
            acc[0] += 1
            acc[1] += c.nbytes
            acc[2] += bound_bytes(c.kind, c.type.nbytes, len(c.members), c.root == r)
    return [(r, k, a, n, planned, bound) for (r, k, a), (n, planned, bound) in rows.items()]


def bytes_table(programs: Mapping[int, Program]) -> str:
    lines = [f"{'rank':>4}  {'kind':<15}{'axis':<6}{'count':>6}{'bytes/step':>14}{'bound':>14}"]
    for r, k, a, n, planned, bound in bytes_rows(programs):
        lines.append(f"{r:>4}  {k:<15}{a or '-':<6}{n:>6}{planned:>14,}{bound:>14,}")
    return "\n".join(lines)


def pcg_dot(pcg: PCG) -> str:
    """Graphviz source: one box per compute op, one ellipse per parallel op, edges labelled with the tensor's
    parallel shape; edges that cross sub-meshes (stage copies) are dashed red."""
    lines = ["digraph pcg {", "  rankdir=TB; node [fontname=monospace fontsize=10]; edge [fontsize=9];"]
    producer = {}
    for name, t in pcg.tensors.items():
        if t.role != TensorRole.ACTIVATION:
            lines.append(f'  "{name}" [shape=note label="{name}\\n{t.pshape}"];')
            producer[name] = (name, t.group)
    for n in pcg.nodes:
        shape = "ellipse style=filled fillcolor=lightblue" if n.is_parallel else "box"
        where = f"\\n@{n.group}" if n.group.fixed else ""
        lines.append(f'  "{n.name}" [shape={shape} label="{n.op.describe()}{where}"];')
        for t in n.inputs:
            src, group = producer[t]
            style = " style=dashed color=red" if group != n.group and not n.is_parallel else ""
            lines.append(f'  "{src}" -> "{n.name}" [label="{pcg.tensors[t].pshape}"{style}];')
        for o in n.outputs:
            producer[o] = (n.name, n.group)
    lines.append("}")
    return "\n".join(lines)

"""``shardflow`` command line. ``shardflow plan`` prints the PCG and per-rank programs of a model under a strategy,
proven deadlock-free; no process starts. ``shardflow train`` trains a GPT across local processes (checkpoints,
``--resume``); ``shardflow export`` writes a checkpoint as safetensors; ``shardflow generate`` samples text from one.

Errors a user can fix (bad mesh, strategy that does not fit the model, unsupported op, ...) end with one
paragraph on stderr and exit status 2, never a traceback from inside the library.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from collections import Counter
from typing import Sequence

import torch

from shardflow.capture import CaptureError, capture
from shardflow.graph.graph import ComputationGraph
from shardflow.graph.ops import OpError
from shardflow.lower import lower_step
from shardflow.lower.dynamic import PassError, UpdateRule
from shardflow.lower.comm_lowering import lowering_summary
from shardflow.lower.passes import PASSES, LowerContext, pass_table, run_passes
from shardflow.lower.program import programs_json
from shardflow.lower.report import bytes_table, pcg_dot
from shardflow.lower.verify import PlanVerificationError
from shardflow.models import GPT, MLP, GPTConfig
from shardflow.parallel.mesh import Mesh
from shardflow.parallel.pcg import PCG, build_pcg, placements_text
from shardflow.parallel.shape import ShardingError
from shardflow.strategy import Plan, PlanError, make_plan, resolve
from shardflow.strategy.presets import default_mesh
from shardflow.train.config import TrainConfig
from shardflow.train.data import DataError

USER_ERRORS = (PlanError, ShardingError, OpError, CaptureError, PassError, PlanVerificationError, DataError,
               ValueError, FileNotFoundError)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=("gpt", "mlp"), default="gpt", help="built-in model to capture (default gpt)")
    g.add_argument("--layers", type=int, default=2, help="transformer blocks (gpt) or linear layers (mlp)")
    g.add_argument("--heads", type=int, default=4, help="attention heads (gpt)")
    g.add_argument("--embd", type=int, default=64, help="embedding width C (gpt) or hidden width (mlp)")
    g.add_argument("--vocab", type=int, default=65, help="vocabulary size V (gpt) or classes (mlp)")
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sequence T (gpt)")
    g.add_argument("--batch-size", type=int, default=8, help="sequences (gpt) or rows (mlp) per step, B")


def model_graph(args: argparse.Namespace) -> tuple[torch.nn.Module, ComputationGraph]:
    """Build the chosen built-in model and capture it with example inputs of the run's shapes."""
    torch.manual_seed(0)
    if args.model == "gpt":
        model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers,
                              n_head=args.heads, n_embd=args.embd))
        tokens = torch.zeros(args.batch_size, args.seq_len, dtype=torch.long)
        return model, capture(model, {"idx": tokens, "targets": tokens})
    model = MLP(d_in=args.embd, hidden=4 * args.embd, d_out=args.vocab, n_layers=args.layers)
    x = torch.zeros(args.batch_size, args.embd)
    return model, capture(model, {"x": x, "y": torch.zeros(args.batch_size, dtype=torch.long)})


def load_plan(path: str) -> Plan:
    """``Plan.load`` with errors that name the file and say how to fix it (raises PlanError)."""
    p = Path(path)
    fix = ("write a JSON or TOML object with tables modules, inputs and ops (docs/concepts.md), or use --strategy "
           "instead of --plan")
    if not p.is_file():
        raise PlanError(f"plan file {p}: No such file (or not a file); pass --plan with a JSON or TOML plan file, "
                        f"or use --strategy instead")
    try:
        return Plan.load(p)
    except PlanError as e:
        raise PlanError(f"plan file {p}: {e}") from None
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as e:  # bad JSON/TOML, not an object
        raise PlanError(f"cannot read plan file {p} ({type(e).__name__}: {e}); {fix}") from None


def plan_pcg(graph: ComputationGraph, mesh: Mesh, strategy: str, plan_file: str | None,
             strict: bool = False) -> tuple[Plan, PCG]:
    """The plan (``plan_file``, else the preset ``strategy``) and its PCG; ``strict``: a rule's refusal is an error
    instead of a redistribution."""
    plan = load_plan(plan_file) if plan_file else make_plan(graph, mesh, strategy)
    return plan, build_pcg(graph, mesh, resolve(plan, graph, mesh), strict=strict)


def summary(pcg: PCG) -> str:
    """One line: devices, tensors, the parallel ops by kind, and the redistributions inserted where rules refused."""
    kinds = Counter(n.op.kind for n in pcg.parallel_nodes)
    ops = ", ".join(f"{k} ×{v}" for k, v in sorted(kinds.items())) or "none"
    n = len(pcg.redistributions)
    redistributed = (f"; {n} redistribution{'s' * (n != 1)} where a rule refused "
                     f"({sum(r.nbytes for r in pcg.redistributions):,} bytes per device)" if n else "")
    return (f"mesh {pcg.mesh} ({pcg.mesh.size} devices); {len(pcg.nodes) - len(pcg.parallel_nodes)} compute ops; "
            f"parallel ops: {ops}{redistributed}")


def redistributions_json(pcg: PCG) -> list[dict]:
    """The PCG's redistributions: node, op, module, input, tensor, placements from and to, parallel ops, bytes per
    device (forward), reason."""
    return [{"node": r.node, "op": r.op.describe(), "module": r.scope, "input": r.index, "tensor": r.tensor,
             "from": placements_text(r.src, r.group), "to": placements_text(r.dst, r.group),
             "ops": [op.describe() for op in r.ops], "bytes": r.nbytes, "reason": r.reason}
            for r in pcg.redistributions]


def cmd_plan(args: argparse.Namespace) -> int:
    mesh = Mesh.parse(args.mesh) if args.mesh else default_mesh(args.strategy, args.nproc)
    _, graph = model_graph(args)
    if args.graph:
        print(graph.listing())
        return 0
    plan, pcg = plan_pcg(graph, mesh, args.strategy, args.plan, args.strict)
    if args.passes or args.dump_after:
        dump = {args.dump_after: lambda g: print(g.listing())} if args.dump_after else None
        _, records = run_passes(pcg, LowerContext(args.optimizer), dump=dump)
        if args.passes:
            print(pass_table(records))
        return 0
    step = lower_step(pcg, args.optimizer)  # proves the programs agree (raises PlanVerificationError)
    if args.rank is not None and args.rank not in step.programs:
        raise ValueError(f"--rank {args.rank}: mesh {mesh} has ranks 0..{mesh.size - 1}; pass one of them, or omit "
                         f"--rank to show every rank")
    ranks = [args.rank] if args.rank is not None else sorted(step.programs)
    programs = {r: step.programs[r] for r in ranks}
    comms = sum(len(p.comms) for p in step.programs.values())
    proof = (f"verified: {mesh.size} ranks, {len(lowering_summary(step.programs))} communication kinds, "
             f"{comms} communication endpoints; every send has its recv, every collective agrees on members, "
             f"shape and dtype, every pair of ranks shares one order, no deadlock")
    if args.format == "json":
        doc = json.loads(programs_json(programs))
        doc.update(strategy=plan.name, mesh=str(mesh), summary=summary(pcg), verified=True,
                   collectives=lowering_summary(step.programs), redistributions=redistributions_json(pcg))
        print(json.dumps(doc, indent=1))
        return 0
    if args.format == "dot":
        out = Path(args.out or "pcg.dot")
        if not out.parent.is_dir():
            raise ValueError(f"--out {out}: directory {out.parent} does not exist; create it or write elsewhere")
        out.write_text(pcg_dot(pcg))
        msg = f"wrote {out}"
        if shutil.which("dot"):
            svg = out.with_suffix(".svg")
            subprocess.run(["dot", "-Tsvg", str(out), "-o", str(svg)], check=True, timeout=120)
            msg += f" and {svg}"
        print(msg)
        return 0
    print(f"# strategy {plan.name}: {summary(pcg)}")
    print(pcg.listing())
    print()
    if pcg.redistributions:
        print(pcg.redistribution_listing())
        print()
    for r in ranks:
        print(programs[r].listing())
        print()
    print("# bytes sent per rank per step (bound: bandwidth-optimal)")
    print(bytes_table(programs))
    print(f"# {proof}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from shardflow.train.command import main as train_main
    return train_main(TrainConfig.from_args(args))


def cmd_export(args: argparse.Namespace) -> int:
    from shardflow.train.checkpoint import export
    from shardflow.train.recipe import GPT_MODEL
    out, ck = export(args.checkpoint, args.out, GPT_MODEL)
    print(f"wrote {out}: the weights of {ck.path} (step {ck.step}) under {GPT_MODEL.name}'s parameter names, model "
          f"config in its metadata")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from shardflow.train.generate import main as generate_main
    return generate_main(args.checkpoint, args.prompt, args.tokens, args.temperature, args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardflow", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print the parallel computation graph of a model under a strategy (no processes)")
    add_model_args(p)
    p.add_argument("--strategy", default="tp", help="single, dp, tp, sp, pp or a combination such as dp,tp (default tp)")
    p.add_argument("--mesh", help="device mesh as axis=size pairs, e.g. dp=2,tp=2 (default: the strategy's axis "
                                  "with --nproc devices)")
    p.add_argument("--nproc", type=int, default=2, help="devices when --mesh is not given (default 2)")
    p.add_argument("--plan", help="a user plan (JSON or TOML: per-module placements) instead of --strategy")
    p.add_argument("--graph", action="store_true", help="print the captured computation graph instead")
    p.add_argument("--strict", action="store_true",
                   help="refuse the strategy where a sharding rule refuses its inputs (the error names the parallel "
                        "op to insert) instead of inserting the cheapest redistribution")
    p.add_argument("--format", choices=("text", "json", "dot"), default="text",
                   help="text: PCG + per-rank programs + bytes + proof; json: the same, machine-readable; "
                        "dot: the PCG as Graphviz (SVG too when Graphviz is installed)")
    p.add_argument("--rank", type=int, help="show only this rank's program")
    p.add_argument("--passes", action="store_true",
                   help="list the lowering passes in order with their time and the size of the graph each returned")
    p.add_argument("--dump-after", metavar="PASS", choices=[str(x.name) for x in PASSES],
                   help="print the graph after this lowering pass (" + ", ".join(str(x.name) for x in PASSES) + ")")
    p.add_argument("--out", help="file for --format dot (default pcg.dot)")
    p.add_argument("--optimizer", choices=tuple(map(str, UpdateRule)), default=str(UpdateRule.SGD),
                   help="optimizer whose state slots the update step carries (default sgd)")
    p.set_defaults(func=cmd_plan)
    t = sub.add_parser("train", help="train a GPT on text across local processes with a chosen strategy")
    TrainConfig.add_arguments(t)
    t.set_defaults(func=cmd_train)
    ck_help = ("a checkpoint (RUN_DIR/checkpoints/step_N), a checkpoint directory or a run directory (its newest "
               "complete checkpoint)")
    e = sub.add_parser("export", help="write a checkpoint's weights as one safetensors file for the plain GPT module")
    e.add_argument("--checkpoint", required=True, help=ck_help)
    e.add_argument("--out", required=True, help="the .safetensors file to write (model config in its metadata)")
    e.set_defaults(func=cmd_export)
    g = sub.add_parser("generate", help="sample text from a checkpoint of shardflow train (one process)")
    g.add_argument("--checkpoint", required=True, help=ck_help)
    g.add_argument("--prompt", required=True, help="text to continue (characters of the training text)")
    g.add_argument("--tokens", type=int, default=200, help="characters to sample (default 200)")
    g.add_argument("--temperature", type=float, default=1.0, help="softmax temperature; 0 = greedy (default 1.0)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler (default 0)")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"shardflow {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

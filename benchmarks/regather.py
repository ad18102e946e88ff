"""Regathering activations (``--regather-activations``, docs/lowering.md#regathering-activations): what sequence
parallelism holds at its peak and how long its step takes, keeping each column group's all-gathered input from the
forward for the backward (the default) or gathering it again in the backward (Megatron-LM's way), predicted on the
shipped ``h100`` spec (``Pipeline.predict``).

Two models, each under ``--ac none`` and ``--ac selective``:

* a GPT of 4 blocks, width 128, 4 heads, vocabulary 128, 16 sequences of 128 tokens, float32, AdamW, ``sp`` on tp=4
  — small enough to replay whole; beside it the screening estimate's peak (``shardflow.simulator.analytic``);
* the Llama 3 70B shape (80 layers, width 8192, 64 heads, 8 key/value heads, MLP 28672, vocabulary 128256) on 256
  H100s as ``fsdp,sp`` on ``fsdp=32,tp=8``, 512 sequences of 8192 tokens (2 per device, as
  ``benchmarks/search.py``), bf16 with float32 master weights, AdamW; built on the meta device and predicted as the
  search predicts it: copies of 3 and 4 blocks, drawn as a line to 80 (``extrapolate``,
  docs/search.md#folding-repeated-blocks).

Usage::

    python benchmarks/regather.py              # writes the section "Regathering activations" of docs/benchmarks.md
    python benchmarks/regather.py --no-write   # prints it only
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import machine, write_section  # noqa: E402

from shardflow.api import optimizer_config  # noqa: E402
from shardflow.capture import at_dtype, capture  # noqa: E402
from shardflow.graph.blocks import keep_blocks  # noqa: E402
from shardflow.lower import LowerOptions  # noqa: E402
from shardflow.lower.dynamic import ActivationCheckpointing  # noqa: E402
from shardflow.models import GPT, GPTConfig  # noqa: E402
from shardflow.parallel.mesh import Mesh  # noqa: E402
from shardflow.pipeline import Pipeline  # noqa: E402
from shardflow.simulator.analytic import Profile, estimate  # noqa: E402
from shardflow.simulator.estimate import cost_model, extrapolate  # noqa: E402
from shardflow.simulator.machine import MachineSpec  # noqa: E402

SPEC = MachineSpec.named("h100")
ACS = (ActivationCheckpointing.NONE, ActivationCheckpointing.SELECTIVE)
MIB, GIB = 2**20, 2**30


def gpt_rows() -> list[str]:
    """The GPT's rows: per checkpointing, peak (MiB) and step (ms) kept and regathered, the estimate's peak."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, block_size=128, n_layer=4, n_head=4, n_embd=128))
    ids = torch.randint(0, 128, (16, 128))
    graph = capture(model, {"idx": ids, "targets": ids})
    mesh, optimizer = Mesh.parse("tp=4"), optimizer_config("adamw", 1e-3)
    profile = Profile.of(graph, 4, SPEC)
    rows = []
    for ac in ACS:
        got, est = {}, {}
        for regather in (False, True):
            opts = dataclasses.replace(LowerOptions(), ac=ac, regather_activations=regather)
            got[regather] = Pipeline.planned(graph, mesh, opts, optimizer, "sp").predict(SPEC, ids.numel())
            est[regather] = estimate(profile, mesh, "sp", opts, 2, SPEC).peak_bytes
        kept, again = (max(got[r].peak_bytes) for r in (False, True))
        rows.append(
            f"| GPT 4 × 128, sp tp=4 | {ac} | {kept / MIB:,.1f} MiB | {again / MIB:,.1f} MiB "
            f"| {got[False].step_seconds * 1e3:,.3f} ms | {got[True].step_seconds * 1e3:,.3f} ms "
            f"| {kept / est[False]:.2f} / {again / est[True]:.2f} |"
        )
    return rows


def llama70b_rows() -> list[str]:
    """The 70B shape's rows, each predicted through its 3- and 4-block copies (seconds, GiB)."""
    from search import SIZES

    from shardflow.runtime.materialize import materialize
    from shardflow.search import cut_blocks
    from shardflow.train.config import TrainConfig, step_options
    from shardflow.train.config import optimizer_config as train_optimizer
    from shardflow.train.family import Feed
    from shardflow.train.recipe import build_model

    world = 256
    cfg = TrainConfig(
        **SIZES["70B"], vocab_size=128256, seq_len=8192, batch_size=2 * world, dtype="bf16", optimizer="adamw"
    )
    mesh = Mesh.parse("fsdp=32,tp=8")
    base = step_options(cfg, cost_model(SPEC, mesh))
    _, _, module = build_model(cfg, cfg.vocab_size, None)
    materialize(module, cfg.seed)
    ids = torch.zeros(cfg.batch_size, cfg.seq_len, dtype=torch.long)
    module, inputs, _ = at_dtype(module, Feed.CAUSAL_LM.inputs(ids, ids), torch.bfloat16)
    with cut_blocks(module, 4):
        four = capture(module, inputs)
    copies = {3: keep_blocks(four, 3), 4: four}
    rows = []
    for ac in ACS:
        got = {}
        for regather in (False, True):
            opts = dataclasses.replace(base, ac=ac, regather_activations=regather)
            less, more = (
                Pipeline.planned(copies[k], mesh, opts, train_optimizer(cfg), "fsdp,sp").predict(
                    SPEC, ids.numel(), exact=False
                )
                for k in (3, 4)
            )
            got[regather] = extrapolate(less, more, 3, 4, cfg.layers)
        kept, again = (max(got[r].peak_bytes) for r in (False, True))
        rows.append(
            f"| Llama 3 70B shape, fsdp,sp fsdp=32,tp=8 (256 H100s) | {ac} | {kept / GIB:,.0f} GiB "
            f"| {again / GIB:,.0f} GiB | {got[False].step_seconds:,.2f} s | {got[True].step_seconds:,.2f} s | |"
        )
    return rows


def section() -> str:
    m = machine()
    date = datetime.date.today().isoformat()
    head = (
        "## Regathering activations\n\n"
        f"`python benchmarks/regather.py` ({date}, {m['cores']} cores, torch {torch.__version__}): sequence "
        "parallelism keeping each column group's all-gathered input for the backward (*kept*, the default) or "
        "gathering it again there (*regathered*, `--regather-activations`; docs/lowering.md#regathering-activations), "
        "predicted on the shipped `h100` spec. The last column: the replay's peak ÷ the screening estimate's, kept / "
        "regathered (docs/search.md#screening: the estimate counts pieces).\n\n"
        "| model, plan | checkpointing | peak, kept | peak, regathered | step, kept | step, regathered "
        "| peak ÷ estimate |\n|---|---|---:|---:|---:|---:|---:|\n"
    )
    return head + "\n".join(gpt_rows() + llama70b_rows()) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print the section only")
    args = ap.parse_args(argv)
    text = section()
    print(text)
    if not args.no_write:
        write_section(ROOT / "docs" / "benchmarks.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What ``shardflow train`` shows on the console. Rank 0 prints a banner, one line every ``--log-every`` steps (and at
every validation and the last step: loss, validation loss, tokens/s per device, MFU, gradient norm, peak memory,
data wait, step time), a progress bar between those lines when its output is a terminal (plain lines when piped),
the checkpoints it saves and the final verdict; the other ranks print none of it. Rank 0 launched on a terminal
writes to it directly and tees everything into its log (:func:`tee_to_log`).
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from shardflow.graph.flops import TRAINING_FACTOR
from shardflow.lower.dynamic import ActivationCheckpointing
from shardflow.lower.pass_expansion import recomputed_blocks
from shardflow.lower.report import bytes_rows
from shardflow.lower.schedule import schedule_of
from shardflow.simulator.estimate import Prediction
from shardflow.train.checkpoint import Checkpoint
from shardflow.train.config import placement
from shardflow.train.metrics import Meter, memory_source

CLEAR = "\r\x1b[K"  # back to the start of the terminal line and clear it
_BAR = 30  # characters of the progress bar


class Tee:
    """Writes to the terminal and to the rank's log file (rank 0 launched on a terminal)."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.log.write(text.replace(CLEAR, ""))
        return self.stream.write(text)

    def flush(self):
        self.log.flush()
        self.stream.flush()

    def isatty(self):
        return self.stream.isatty()


def tee_to_log() -> None:
    """When the launcher let this rank write to the terminal itself (``SHARDFLOW_TEE`` names its log), copy
    stdout and stderr into that log."""
    tee = os.environ.get("SHARDFLOW_TEE")
    if tee:
        log = open(tee, "w", buffering=1)
        sys.stdout, sys.stderr = Tee(sys.stdout, log), Tee(sys.stderr, log)


class Console:
    """Rank 0's console during training (``lead``: this process prints; elsewhere every method is silent)."""

    def __init__(self, lead: bool, steps: int, log_every: int):
        self.lead, self.steps, self.log_every = lead, steps, log_every
        self.bar = lead and sys.__stdout__.isatty()

    def say(self, text: str) -> None:
        """One line (rank 0 only)."""
        if self.lead:
            print(text, flush=True)

    def banner(self, s, steps, baseline: float, device: torch.device) -> None:
        """Data, model, strategy, mesh and this rank's device, the plan's communication per optimizer step (lowest
        rank's programs of ``steps``, the lowered micro-steps of one step in order: one, the step, unless
        ``--accumulate``) and the unigram baseline. ``s``: the run's :class:`~shardflow.train.recipe.Setup`."""
        if not self.lead:
            return
        n_params = sum(p.numel() for p in s.model.parameters())
        cfg = s.cfg
        c = s.corpus
        self.say(
            f"shardflow train: {c.source}, {len(c.train):,} train / {len(c.val):,} val tokens "
            f"({c.chars / len(c.tokens):.2f} characters per token)"
        )
        self.say(f"tokenizer: {c.tokenizer.describe()} (cached with the tokens in {c.cache})")
        mixed = (
            "; bfloat16 parameters and compute, float32 master weights, gradient reductions and optimizer state"
            if cfg.dtype == "bf16"
            else ""
        )
        schedule = (
            f" ({cfg.warmup_steps} warm-up steps, then {cfg.lr_schedule}"
            + (f" to {cfg.lr_min_ratio:g}×" if cfg.lr_schedule != "constant" else "")
            + ")"
            if cfg.warmup_steps or cfg.lr_schedule != "constant"
            else ""
        )
        self.say(
            f"model: {s.family.describe(s.config)}, context {cfg.seq_len}: {n_params:,} parameters; optimizer "
            f"{cfg.optimizer} lr {cfg.lr}{schedule}{mixed}"
        )
        micro = (
            f" in {cfg.accumulate} micro-steps of {cfg.batch_size // cfg.accumulate} (gradients reduced after the last)"
            if cfg.accumulate > 1
            else ""
        )
        if cfg.microbatches > 1:
            sched = schedule_of(steps[-1].dg, s.pipeline.options.schedule)
            micro += (
                f"; {sched.microbatches} microbatches of {cfg.batch_size // (cfg.accumulate * cfg.microbatches)}"
                f" per step, {sched.kind} over {sched.stages} stage(s) ("
                + (f"{sched.virtual} chunks per stage, " if sched.virtual > 1 else "")
                + f"bubble {sched.bubble:.0%})"
            )
        options = s.pipeline.options
        ac = ""
        if options.ac != ActivationCheckpointing.NONE:
            blocks, selective = recomputed_blocks(s.pcg, options.ac, options.ac_blocks)
            recomputed = len(set(blocks.values()))
            flags = f"--ac {options.ac}" + (
                f" --ac-blocks {options.ac_blocks}" if options.ac_blocks is not None else ""
            )
            how = (
                f", {recomputed - len(selective)} whole and {len(selective)} selectively"
                if options.ac == ActivationCheckpointing.SELECTIVE
                else ""
            )
            ac = f"; {recomputed} blocks recomputed in the backward{how} ({flags})"
        self.say(
            f"{cfg.placement} on mesh {s.mesh} ({s.mesh.size} devices; buffers on {device}); batch "
            f"{cfg.batch_size}×{cfg.seq_len}{micro}{ac}"
        )
        lowest = min(steps[-1].programs)
        per: dict[str, tuple[int, int]] = {}
        for step in steps:
            for r, kind, axis, n, planned, _ in bytes_rows(step.programs):
                if r == lowest:
                    was = per.get(f"{kind}/{axis or '-'}", (0, 0))
                    per[f"{kind}/{axis or '-'}"] = (was[0] + n, was[1] + planned)
        comm = ", ".join(f"{k} ×{n} ({b / 2**20:.2f} MiB)" for k, (n, b) in per.items()) or "no communication"
        self.say(f"plan (rank {lowest}, per step{', all micro-steps' if len(steps) > 1 else ''}): {comm}")
        if s.pcg.redistributions:
            self.say(s.pcg.redistribution_listing())
        self.say(f"unigram baseline (validation): {baseline:.4f} nats/token")
        if s.eval_batches < cfg.eval_batches:
            self.say(
                f"validation: {s.eval_batches} batches per measurement, not --eval-batches {cfg.eval_batches}: "
                f"they hold the {len(c.val):,} tokens of the validation split"
            )
        self.say(f"run directory: {cfg.run_dir}")

    def resumed(self, ck: Checkpoint, start: int) -> None:
        """Where a resumed run continues from."""
        how = placement(ck.train.get("strategy"), ck.train.get("plan"))
        self.say(f"resumed from {ck.path} (step {start}; written under {how} on mesh {ck.mesh})")

    def nothing_to_do(self, ck: Checkpoint) -> bool:
        """Whether the checkpoint ``--resume`` found is already at ``--steps`` (says so on rank 0)."""
        if ck.step < self.steps:
            return False
        self.say(
            f"shardflow train: {ck.path} is at step {ck.step}, --steps is {self.steps}: nothing to train; raise "
            f"--steps to continue"
        )
        return True

    def metrics(self, meter: Meter, outputs: list[Path]) -> None:
        """The banner's lines on the metrics: the files they go to (``outputs``), how MFU is estimated (model FLOPs
        per token, the peak used and where it came from) and which memory is read."""
        if not self.lead:
            return
        self.say(f"metrics → {', '.join(map(str, outputs))}")
        self.say(
            f"MFU = model FLOPs {meter.flops / meter.tokens / 1e6:,.3f} MFLOP/token ({TRAINING_FACTOR} × the "
            f"forward's linear, matmul, attention and conv ops in the captured graph; causal attention counted "
            f"whole) ÷ peak {meter.peak.tflops:.4g} TFLOP/s per device ({meter.peak.source})"
        )
        self.say(f"memory: {memory_source(meter.device)}, MiB")

    def logs(self, record: dict[str, Any], last: bool) -> bool:
        """Whether the step of ``record`` gets a line: every ``--log-every`` steps, at a validation, at the end
        (the same on every rank: the memory of every process is gathered for those lines)."""
        return record["step"] % self.log_every == 0 or last or "val_loss" in record

    def step(self, record: dict[str, Any], last: bool) -> None:
        """After each step: a line every ``--log-every`` steps, at a validation and at the end (:meth:`logs`); on a
        terminal a progress bar in between. ``record``: the step's metrics (:mod:`shardflow.train.metrics`), with
        the memory at the steps that get a line."""
        if not self.lead:
            return
        n, loss, tps = record["step"], record["loss"], record["tokens_per_s_per_device"]
        if self.logs(record, last):
            val = f"  val {record['val_loss']:.4f}" if "val_loss" in record else ""
            norm = f"  |g| {record['grad_norm']:.3g}" if "grad_norm" in record else ""
            experts = (
                f"  experts {record['expert_tokens_min']}/{record['expert_tokens_mean']:.0f}/"
                f"{record['expert_tokens_max']} tok"
                if "expert_tokens_min" in record
                else ""
            )
            print(
                f"{CLEAR if self.bar else ''}step {n:>5}/{self.steps}  loss {loss:.4f}{val}  "
                f"{tps:,.0f} tok/s/dev  MFU {record['mfu_pct']:.2f}%{norm}  lr {record['lr']:.3g}  mem {record['mem_mib']:,.0f} MiB  "
                f"data {record['data_s'] * 1000:.1f} ms  {record['step_s'] * 1000:.0f} ms/step{experts}",
                flush=True,
            )
        elif self.bar:
            done = n * _BAR // self.steps
            sys.__stdout__.write(
                f"{CLEAR}[{'#' * done}{'.' * (_BAR - done)}] step {n}/{self.steps}  "
                f"loss {loss:.4f}  {tps:,.0f} tok/s/dev"
            )
            sys.__stdout__.flush()

    def saved(self, path, size: int, seconds: float) -> None:
        """A checkpoint was committed: its directory, size (bytes) and the seconds the save took."""
        self.say(f"checkpoint {path} ({size / 2**20:.2f} MiB, {seconds:.2f} s)")

    def predicted(self, prediction: tuple[Prediction | None, str] | None) -> None:
        """The simulator's predicted step time and peak memory (docs/simulator.md), where it came from."""
        if not self.lead or prediction is None:
            return
        pred, note = prediction
        if pred is None:
            self.say(f"predicted: {note}")
            return
        self.say(
            f"predicted: {pred.step_seconds * 1e3:.4g} ms/step, {pred.tokens_per_second_per_device:,.0f} tok/s/dev, "
            f"peak buffers {max(pred.peak_bytes) / 2**20:,.1f} MiB per rank ({note})"
        )

    def versus(self, prediction: tuple[Prediction | None, str] | None, step_times: list[float]) -> None:
        """At the end: the predicted step time against the measured median (the steps after the first two, whose
        set-up the prediction leaves out; every step when there are fewer)."""
        if not self.lead or prediction is None or prediction[0] is None or not step_times:
            return
        pred = prediction[0]
        steady = step_times[2:] or step_times
        measured = statistics.median(steady)
        self.say(
            f"step time: predicted {pred.step_seconds * 1e3:.4g} ms, measured {measured * 1e3:.4g} ms (median of "
            f"{len(steady)} steps, data loading apart): {(pred.step_seconds - measured) / measured:+.0%}"
        )

    def done(self, final: float, baseline: float) -> None:
        """The last validation loss against the unigram baseline (nats/token)."""
        verdict = "below" if final < baseline else "NOT below"
        self.say(f"done: validation loss {final:.4f} nats/token, {verdict} the unigram baseline {baseline:.4f}")

"""The metrics of `shardflow train`, without training: model FLOPs counted from captured graphs against torch's FLOP
counter on the eager models and against PaLM's closed form; a record's rates and MFU; the peak FLOP/s and the peak
memory this machine reports. (End to end — metrics.jsonl, the console, TensorBoard, resume: test_train.py.)"""

import os
import re
from pathlib import Path

import pytest
import torch
from test_cnn import images, resnet
from test_hf_models import model_and_batch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from shardflow.capture import capture
from shardflow.graph.flops import forward_flops, training_flops
from shardflow.models import GPT, GPTConfig
from shardflow.train.metrics import (
    PEAK_MATMUL,
    SMALLEST_MATMUL,
    Meter,
    Peak,
    measure_peak_tflops,
    peak_memory_mib,
)

CPU = torch.device("cpu")


def gpt_and_batch(n_layer=2, n_head=4, n_embd=32, vocab=11, B=3, T=8):
    """A GPT (lm_head not tied to wte) and a batch of B sequences of T tokens."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=T, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(1))
    return model, {"idx": ids, "targets": ids}


def eager_forward_flops(model, batch) -> int:
    """torch's FlopCounterMode over the eager forward (2 FLOPs per multiply-add; mm, bmm, addmm, convolution),
    with sdpa on its math backend: decomposed into the two matmuls the counter sees (it does not count the fused
    CPU kernel), the causal square computed and counted whole. Less a rotary embedding's table (``inv_freq @
    positions``: a buffer and an arange, no input), which the capture folds into a constant — computed once, not in
    the step, so no model FLOPs; transformers before 5.23 makes it with a matmul the counter sees (128 FLOPs in the
    tiny Llama, found on the GPU machine's transformers 5.17)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**batch)
    folded = sum(sum(c.values()) for m, c in counter.get_flop_counts().items() if m.endswith(".rotary_emb"))
    return counter.get_total_flops() - folded


@pytest.mark.parametrize("name", ["gpt", "LlamaForCausalLM", "GPT2LMHeadModel", "resnet"])
def test_forward_flops_of_the_graph_are_torchs_count_of_the_eager_model(name):
    """Linear (nanoGPT layout; Hugging Face GPT-2's Conv1D, captured as addmm), causal sdpa (grouped-query in
    Llama: 4 query heads over 2 key/value heads), convolutions with strides and 1×1 shortcuts (ResNet): equal."""
    model, batch = {"gpt": gpt_and_batch, "resnet": lambda: (resnet(), images())}.get(
        name, lambda: model_and_batch(name)
    )()
    assert forward_flops(capture(model, batch)) == eager_forward_flops(model, batch)


def test_training_flops_of_a_gpt_are_palms_closed_form():
    """PaLM appendix B (and torchtitan's get_num_flop_per_token): 6·N + 12·L·H·Q·T per token, N the weights of
    the matmuls (q, k, v, proj: 4·C², MLP: 8·C² per layer; the untied lm_head V·C; no embeddings, no biases) and
    H·Q = C; the causal mask not halved."""
    L, H, C, V, B, T = 2, 4, 32, 11, 3, 8
    model, batch = gpt_and_batch(L, H, C, V, B, T)
    n = L * 12 * C * C + V * C
    assert training_flops(capture(model, batch)) == (6 * n + 12 * L * C * T) * B * T


def test_record_rates_and_mfu():
    """8 TFLOP per step of 1000 tokens on 4 devices in 0.5 s: 2000 tokens/s, 500 per device, 4 TFLOP/s per device,
    50 % of an 8 TFLOP/s peak. Without a peak (ranks that write nothing) or a gradient norm, those keys are left
    out."""
    meter = Meter(tokens=1000, devices=4, flops=8 * 10**12, peak=Peak(8.0, "--peak-tflops"), device=CPU)
    assert meter.record(7, 3.5, step_s=0.5, data_s=0.1, grad_norm=1.25, lr=2e-3) == pytest.approx(
        {
            "step": 7,
            "loss": 3.5,
            "step_s": 0.5,
            "data_s": 0.1,
            "tokens_per_s": 2000.0,
            "tokens_per_s_per_device": 500.0,
            "tflops_per_device": 4.0,
            "mfu_pct": 50.0,
            "grad_norm": 1.25,
            "lr": 2e-3,
        }
    )
    quiet = Meter(1000, 4, 8 * 10**12, None, CPU).record(7, 3.5, 0.5, 0.1, None, 2e-3)
    assert "mfu_pct" not in quiet and "grad_norm" not in quiet


def test_peak_is_the_flag_or_measured():
    assert Peak.of(0.5, CPU) == Peak(0.5, "--peak-tflops")
    measured, n = measure_peak_tflops(CPU)  # about a second on a core: 2·n³ FLOPs, best of 3
    # A core of this machine does ~0.03-0.1 TFLOP/s in float32; a unit slip (GFLOP/s, FLOP/s) lands far outside.
    sides = [SMALLEST_MATMUL * 2**k for k in range(8) if SMALLEST_MATMUL * 2**k <= PEAK_MATMUL]
    assert 1e-3 < measured < 20 and n in sides, (measured, n)
    # --dtype bf16's peak: its matmuls in bfloat16, which a CPU without native bfloat16 computes ~100× slower than
    # float32 (2.4e-4 TFLOP/s measured on one; the side then stays small, so this takes a second there too)
    assert 1e-5 < measure_peak_tflops(CPU, torch.bfloat16)[0] < 20
    assert re.fullmatch(
        r"measured at start-up: best of 3 bfloat16 (\d+)×\1 matmuls on cpu", Peak.of(0, CPU, torch.bfloat16).source
    )
    # a matmul slower than the limit stops the side growing: the smallest is measured
    assert measure_peak_tflops(CPU, torch.float32, slow_s=0.0)[1] == 256


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's /proc")
def test_peak_memory_is_at_least_what_the_process_holds_and_at_most_the_machine():
    x = torch.ones(64 * 2**20)  # 256 MiB, every page written
    page = os.sysconf("SC_PAGE_SIZE")
    held = int(Path("/proc/self/statm").read_text().split()[1]) * page / 2**20  # resident now, MiB
    machine = os.sysconf("SC_PHYS_PAGES") * page / 2**20
    # the kernel's resident counters lag by a few pages (per-CPU caches): 4 MiB of slack; a unit slip is 1024×
    assert x.numel() * 4 / 2**20 <= held <= peak_memory_mib(CPU) + 4 <= machine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_peak_and_memory_on_a_cuda_device():
    """What a CUDA device reports (the executors keep their buffers on the CPU today; this is for the API)."""
    gpu = torch.device("cuda")
    x = torch.ones(64 * 2**20, device=gpu)  # 256 MiB
    assert peak_memory_mib(gpu) >= x.numel() * 4 / 2**20
    assert 1 < measure_peak_tflops(gpu)[0] < 10_000  # float32 on current GPUs: tens of TFLOP/s

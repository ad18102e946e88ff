"""Capture through torch.export: models nobody here wrote (Hugging Face, built from tiny configs with random
init) and our own GPT arrive as core ATen and lift to shardflow's ops with the eager numbers."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from shardflow.capture import CaptureError, capture, wide_floats
from shardflow.graph import ComputationGraph
from shardflow.graph import ops as O
from shardflow.models.gpt import GPT, GPTConfig
from shardflow.reference import run_backward, weights_of

transformers = pytest.importorskip("transformers")

TOL = 1e-12  # float64, same ops in the same order: equal to rounding


def hf_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def hf_gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=96,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        use_cache=False,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def batch(vocab=96, B=2, T=8, seed=0):
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def eager(model, b):
    model.zero_grad()
    out = model(**b)
    loss = getattr(out, "loss", out)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def check_against_eager(model: nn.Module, b: dict, graph: ComputationGraph) -> None:
    """Loss and every weight gradient of the captured graph equal eager PyTorch's (float64)."""
    w = weights_of(model, graph)
    env, grads = run_backward(graph, b, w)
    loss, ref = eager(model, b)
    assert abs(float(env[graph.loss]) - float(loss)) <= TOL
    for name in graph.weights:
        assert torch.allclose(grads[name], ref[name], rtol=0, atol=1e-10), name


@pytest.mark.parametrize("make", [hf_llama, hf_gpt2], ids=["llama", "gpt2"])
def test_hugging_face_models_capture_with_eager_numbers(make):
    torch.manual_seed(0)
    model = make().double()
    b = batch()
    with wide_floats():
        graph = capture(model, b)
        check_against_eager(model, b, graph)
    assert graph.inputs == ("input_ids", "labels")
    params = dict(model.named_parameters())  # tied weights (GPT-2's lm_head) once, under export's name
    assert len(graph.weights) == len(params)
    assert all(graph.tensors[w].dtype == "float64" for w in graph.weights)
    scopes = {n.scope for n in graph.nodes}
    assert any(s.endswith("self_attn.q_proj") or s.endswith("attn.c_attn") for s in scopes)


def test_llama_lifts_to_rules_not_the_fallback():
    """Every ATen op of the tiny Llama has a rule (no generic Aten op), and sdpa stays whole with GQA."""
    torch.manual_seed(0)
    graph = capture(hf_llama(), batch())
    assert [n.op.describe() for n in graph.nodes if isinstance(n.op, O.Aten)] == []
    attn = [n.op for n in graph.nodes if isinstance(n.op, O.Attention)]
    # its traced forward builds the causal mask as a tensor and repeats the 2 key/value heads over the 4 query
    # heads; the eager forward calls sdpa with is_causal and enable_gqa, and so does the lifted graph
    assert len(attn) == 2 and all(a.causal and not a.mask and a.gqa for a in attn)
    assert not any(isinstance(n.op, O.Expand) for n in graph.nodes)
    linears = [n for n in graph.nodes if isinstance(n.op, O.Linear)]
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + lm_head


class _Attention(nn.Module):
    """Attention of [B, T, C] inputs with 4 query heads and 2 key/value heads repeated as Hugging Face's repeat_kv
    does, under ``mask`` (a buffer, so a constant of the capture)."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.q, self.kv = nn.Linear(16, 16), nn.Linear(16, 16)
        self.register_buffer("mask", mask)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, 4, 4).transpose(1, 2)
        k, v = (t.view(B, T, 2, 4).transpose(1, 2) for t in self.kv(x).split(8, dim=-1))
        k, v = (t[:, :, None].expand(B, 2, 2, T, 4).reshape(B, 4, T, 4) for t in (k, v))
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).square().mean()


def _masks(T: int) -> dict[str, tuple[torch.Tensor, bool]]:
    """name → (a [1, 1, T, T] mask, whether it is the causal one)."""
    lower = torch.ones(T, T, dtype=torch.bool).tril()
    ninf = torch.zeros(T, T, dtype=torch.float64).masked_fill(~lower, float("-inf"))
    band = lower & ~torch.ones(T, T, dtype=torch.bool).tril(-3)  # sliding window: not causal
    tiny = torch.zeros(T, T, dtype=torch.float64).masked_fill(~lower, torch.finfo(torch.float64).min)
    return {
        "causal bool": (lower, True),
        "causal -inf": (ninf, True),
        "window": (band, False),
        "finfo.min": (tiny, False),
    }


@pytest.mark.parametrize("name", list(_masks(6)))
def test_causal_mask_and_repeated_heads_lift_to_flags(name):
    """A constant mask equal to the causal one lifts to ``causal`` (no mask), and then key/value heads repeated by
    unsqueeze-expand-reshape to ``gqa`` on the unrepeated heads (the copies and their ops dropped); any other mask
    stays, with the repeated heads. The numbers are eager's either way."""
    mask, causal = _masks(6)[name]
    torch.manual_seed(0)
    model = _Attention(mask[None, None]).double()
    b = {"x": torch.randn(3, 6, 16, dtype=torch.float64)}
    graph = capture(model, b)
    check_against_eager(model, b, graph)
    (attn,) = [n for n in graph.nodes if isinstance(n.op, O.Attention)]
    assert (attn.op.causal, attn.op.mask, attn.op.gqa) == (causal, not causal, causal)
    assert [graph.tensors[t].shape[1] for t in attn.inputs[1:3]] == [2 if causal else 4] * 2
    assert any(isinstance(n.op, O.Expand) for n in graph.nodes) is not causal
    assert bool(graph.constants) is not causal  # the causal mask is no constant of the graph


def test_our_gpt_captures_with_eager_numbers():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_embd=16, n_head=2)).double()
    idx = torch.randint(0, 32, (2, 8))
    b = {"idx": idx, "targets": idx}
    graph = capture(model, b)
    assert graph.inputs == ("idx", "targets")
    assert graph.weights == tuple(dict(model.named_parameters()))
    check_against_eager(model, b, graph)


def test_rotary_tables_and_masks_are_folded():
    """Position ids, rotary cos/sin and the causal mask depend on no input: they are constants, not nodes."""
    torch.manual_seed(0)
    graph = capture(hf_llama(), batch())
    ops = {n.op.kind for n in graph.nodes}
    assert not {"cumsum", "arange"} & {n.op.describe() for n in graph.nodes}
    assert graph.by_role("constant")
    unary = {n.op.fn for n in graph.nodes if isinstance(n.op, O.Unary)}
    assert not {"cos", "sin"} & unary  # the rotary tables were folded
    assert "attention" in ops


def test_a_large_fold_of_equal_rows_is_computed_for_one_row(monkeypatch):
    """Above FOLD_BY_ROW_ABOVE elements, an element-wise fold whose operands repeat one row along dim 0 (a Hugging
    Face model's attention mask [B, 1, T, T], made for each of B equal rows) is computed for one row and expanded;
    rows that differ are computed whole. The graph is the one folded whole: the mask found causal, no constant."""
    from shardflow.capture import lift

    le = torch.ops.aten.le.Tensor
    q, k = torch.arange(8).reshape(1, 1, 8, 1), torch.arange(8).reshape(1, 1, 1, 8)
    monkeypatch.setattr(lift, "FOLD_BY_ROW_ABOVE", 0)
    rows = lift._fold(le, (k.expand(4, 1, 1, 8).contiguous(), q), {})
    assert rows.stride(0) == 0 and torch.equal(rows, (k <= q).expand(4, 1, 8, 8))
    differ = torch.arange(4).reshape(4, 1, 1, 1) + k
    assert lift._fold(le, (differ, q), {}).stride(0) != 0 and torch.equal(lift._fold(le, (differ, q), {}), differ <= q)
    flat = lift._fold(torch.ops.aten.view.default, (rows.transpose(0, 2), [32, 8]), {})  # no view of the expansion
    assert torch.equal(flat, (k <= q).expand(4, 1, 8, 8).transpose(0, 2).reshape(32, 8))
    torch.manual_seed(0)
    model, b = hf_llama(), batch(B=4, T=16)
    monkeypatch.setattr(lift, "FOLD_BY_ROW_ABOVE", 2**62)
    whole = capture(model, b)
    monkeypatch.setattr(lift, "FOLD_BY_ROW_ABOVE", 0)
    fold, expanded = lift._fold, []

    def spy(target, args, kwargs):
        out = fold(target, args, kwargs)
        expanded.extend([tuple(out.shape)] if isinstance(out, torch.Tensor) and out.ndim and not out.stride(0) else [])
        return out

    monkeypatch.setattr(lift, "_fold", spy)
    assert capture(model, b) == whole
    assert (4, 1, 16, 16) in expanded  # the mask


def test_meta_model_and_batch_give_the_same_graph():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_embd=16, n_head=2))
    idx = torch.randint(0, 32, (2, 8))
    real = capture(model, {"idx": idx, "targets": idx})
    with torch.device("meta"):
        meta_model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_embd=16, n_head=2))
    m = idx.to("meta")
    meta = capture(meta_model, {"idx": m, "targets": m})
    assert meta.listing() == real.listing()


def test_json_round_trip_keeps_aten_ops():
    class Cum(nn.Module):
        def forward(self, x):
            return torch.cumprod(x, 1).sum()

    graph = capture(Cum(), {"x": torch.randn(2, 3)})
    assert any(isinstance(n.op, O.Aten) for n in graph.nodes)
    assert ComputationGraph.from_json(graph.to_json()) == graph


def test_loss_contract():
    class NotScalar(nn.Module):
        def forward(self, x):
            return x * 2

    with pytest.raises(CaptureError, match="not a scalar loss"):
        capture(NotScalar(), {"x": torch.randn(2, 3)})
    assert capture(NotScalar(), {"x": torch.randn(2, 3)}, loss=False).loss is None


def test_export_failure_names_the_source_line_and_fix():
    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # branches on a value: export cannot trace it
                return x.sum()
            return -x.sum()

    with pytest.raises(
        CaptureError,
        match=r"torch.export cannot capture DataDependent at .*test_export_capture.py:\d+"
        r".*Usual fix",
    ):
        capture(DataDependent(), {"x": torch.randn(2, 3)})


def test_attention_dropout_is_refused_with_the_config_fix():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=96,
        n_embd=32,
        n_layer=1,
        n_head=2,
        n_positions=16,
        use_cache=False,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(CaptureError, match="attention dropout .* attn_pdrop=0.0"):
        capture(model, batch())


def test_one_tensor_under_two_names_stays_two_inputs():
    """``{"idx": t, "targets": t}``: export alone would make one input of them; each node reads its own."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_embd=16, n_head=2))
    idx = torch.randint(0, 32, (2, 8))
    graph = capture(model, {"idx": idx, "targets": idx})
    (emb,) = [n for n in graph.nodes if isinstance(n.op, O.Embedding) and "transformer.wte.weight" in n.inputs]
    assert emb.inputs[0] == "idx"
    assert any("targets" in n.inputs for n in graph.nodes)


class _MultiQuery(nn.Module):
    """Falcon's layout in small: ``x @ W.T`` (+ bias) linears (``FalconLinear``), and sdpa on 4 query heads and one
    key/value head that sdpa broadcasts over them (multi-query attention; no ``enable_gqa``), with or without a
    mask."""

    def __init__(self, mask: torch.Tensor | None):
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.kv = nn.Linear(16, 8, bias=False)
        self.mask = mask

    def forward(self, x):  # x [B, T, 16]
        B, T, _ = x.shape
        q = (x @ self.q.weight.T + self.q.bias).view(B, T, 4, 4).transpose(1, 2)  # [B, 4, T, 4]
        k, v = (x @ self.kv.weight.t()).view(B, T, 2, 1, 4).transpose(1, 3).unbind(2)  # [B, 1, T, 4] each
        causal = self.mask is None
        return (
            nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=causal).square().mean()
        )


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
def test_one_broadcast_key_value_head_and_x_at_w_transposed_lift_to_gqa_and_linears(masked):
    """One key/value head broadcast over the query heads lifts to grouped-query attention (Hkv = 1; capture refused
    it before); ``x @ W.T`` and ``x @ W.t()`` by a parameter lift to linears reading W as ``[out, in]`` (tensor
    parallelism's column/row pairs), not to a matmul of a permuted weight. Numbers: eager's."""
    torch.manual_seed(0)
    mask = torch.randn(1, 1, 6, 6, dtype=torch.float64) if masked else None
    model = _MultiQuery(mask).double()
    b = {"x": torch.randn(3, 6, 16, dtype=torch.float64)}
    graph = capture(model, b)
    check_against_eager(model, b, graph)
    (attn,) = [n for n in graph.nodes if isinstance(n.op, O.Attention)]
    assert (attn.op.gqa, attn.op.mask) == (True, masked)
    assert [graph.tensors[t].shape[1] for t in attn.inputs] == [4, 1, 1] + ([1] if masked else [])
    linears = [n for n in graph.nodes if isinstance(n.op, O.Linear)]
    assert [(n.inputs[1], n.op.transposed) for n in linears] == [("q.weight", False), ("kv.weight", False)]
    assert not any(
        isinstance(n.op, (O.Matmul, O.Permute)) and graph.tensors[n.inputs[-1]].role.name == "WEIGHT"
        for n in graph.nodes
    )


class KeyStates(nn.Module):
    """DeepSeek-V3's key states: a new empty tensor whose two slices of the last dim are written by ``copy_`` (the
    second from a broadcast source), read by a nonlinear loss."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6, dtype=torch.float64)
        self.b = nn.Linear(4, 2, dtype=torch.float64)

    def forward(self, x):  # x [B, T, 4]
        rot = self.b(x[:, :1])  # [B, 1, 2], broadcast over T by copy_
        k = x.new_empty(*x.shape[:-1], 8)
        k[..., :6].copy_(self.a(x))
        k[..., 6:].copy_(rot)
        return k.tanh().pow(2).sum()


def test_copy_into_slices_of_a_new_tensor_lifts_to_a_cat():
    """The slice_scatter of a copy that functionalization makes of ``k[..., :n].copy_(v)`` lifts to a cat of the
    written values (the expand of the broadcast one): no generic op, the empty tensor read by nothing, and the
    gradient eager PyTorch computes (ATen's copy has no derivative: autograd refused the generic op's backward)."""
    torch.manual_seed(0)
    model, b = KeyStates(), {"x": torch.randn(2, 3, 4, dtype=torch.float64)}
    graph = capture(model, b)
    assert [n.op.kind for n in graph.nodes if isinstance(n.op, (O.Aten, O.Cat))] == ["cat"]
    assert not any(t.shape == (2, 3, 8) for t in graph.constants.values())
    check_against_eager(model, b, graph)


def test_nodes_keep_their_source_line():
    """Each node names the model's line that made it (what planning's errors quote), and keeps it through JSON."""
    graph = capture(KeyStates(), {"x": torch.randn(2, 3, 4, dtype=torch.float64)})
    (cat,) = [n for n in graph.nodes if isinstance(n.op, O.Cat)]
    assert re.fullmatch(r".*/tests/test_export_capture\.py:\d+ \(k\[\.\.\., 6:\]\.copy_\(rot\)\)", cat.source)
    assert ComputationGraph.from_json(graph.to_json()) == graph


class TwoDims(nn.Module):
    """Slices of a zero tensor written along two dims in turn: the second write's parts are not the first's."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x):  # x [2, 3, 4]
        h = x @ self.w
        k = x.new_zeros(2, 3, 4)
        k[:, 1:].copy_(h[:, :2])
        k[..., :2].copy_(h[..., 2:].sin())
        return k.tanh().pow(2).sum()


def test_slices_written_along_two_dims_keep_each_write():
    torch.manual_seed(0)
    model, b = TwoDims(), {"x": torch.randn(2, 3, 4, dtype=torch.float64)}
    graph = capture(model, b)
    assert not any(isinstance(n.op, O.Aten) for n in graph.nodes)
    check_against_eager(model, b, graph)


class _Reverse(torch.autograd.Function):
    """Gradient reversal (domain-adversarial training): the identity forward, the negated gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


class _Adversarial(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return (_Reverse.apply(self.a(x)) ** 2).sum()


def test_a_custom_autograd_function_is_refused_naming_it_and_the_fix():
    """Export keeps a custom Function's forward only: differentiating it would give the identity's gradient where the
    model asks for the reversed one, so capture refuses by name; torch's own Functions (checkpointing) pass."""
    with pytest.raises(CaptureError) as e:
        capture(_Adversarial(), {"x": torch.randn(2, 4)})
    msg = str(e.value)
    assert "_Adversarial calls the torch.autograd.Function _Reverse (at " in msg and "test_export_capture.py:" in msg
    assert "ignore _Reverse.backward" in msg and "(1 + l) * x.detach() - l * x" in msg
    assert torch.autograd.Function.apply.__func__ is torch.autograd.Function.__dict__["apply"].__func__  # restored

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=True).sum()

    assert capture(Checkpointed(), {"x": torch.randn(2, 4)}).weights == ("a.weight", "a.bias")


def test_a_model_under_a_path_named_shardflow_keeps_its_lines():
    """A frame is the model's unless it lies in torch's or shardflow's package: a model (or a checkout of it) under
    a directory whose name merely contains "shardflow" keeps its source lines (a clone in .../shardflow/ lost them)."""
    import importlib
    import traceback

    export = importlib.import_module("shardflow.capture.export")  # the module (the package names a function so)

    mine = traceback.FrameSummary("/home/u/shardflow-runs/model.py", 7, "forward", line="y = x @ w")
    ours = traceback.FrameSummary(export.__file__, 1, "capture", line="export(module)")
    theirs = traceback.FrameSummary(torch.__file__, 1, "f", line="f()")
    assert export._model_line([mine, ours, theirs]) == "/home/u/shardflow-runs/model.py:7 (y = x @ w)"
    assert export._model_line([ours, theirs]) == ""

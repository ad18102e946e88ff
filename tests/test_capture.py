"""torch.fx capture: whole models, one small module per supported function family, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardflow.capture import CaptureError, capture
from shardflow.graph import ComputationGraph, TensorRole
from shardflow.models import GPT, GPTConfig, MLP
from shardflow.reference import run_backward, weights_of

CFG = GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16)


def gpt_case(B=2, T=6):
    torch.manual_seed(0)
    model = GPT(CFG)
    inputs = {"idx": torch.randint(0, CFG.vocab_size, (B, T)), "targets": torch.randint(0, CFG.vocab_size, (B, T))}
    return model, inputs


def mlp_case(B=4):
    torch.manual_seed(0)
    model = MLP(d_in=8, hidden=12, d_out=5, n_layers=3)
    return model, {"x": torch.randn(B, 8), "y": torch.randint(0, 5, (B,))}


def assert_same_graph(a: ComputationGraph, b: ComputationGraph) -> None:
    assert a == b
    # Equality looks at constant values and dtypes, not just names.
    if a.constants:
        k = next(iter(a.constants))
        changed = dict(a.constants) | {k: a.constants[k] + 1}
        assert ComputationGraph(a.tensors, a.nodes, a.outputs, a.loss, changed) != a


# --- whole models ------------------------------------------------------------------------------------------
def test_gpt_captures_whole():
    model, inputs = gpt_case(T=6)
    g = capture(model, inputs)
    assert g.inputs == ("idx", "targets")
    assert g.weights == tuple(dict(model.named_parameters()))
    assert g.tensors["idx"].dtype == "int64" and g.tensors["idx"].shape == (2, 6)
    kinds = [n.op.describe() for n in g.nodes]
    assert kinds.count("gelu") == sum(k.startswith("attention") for k in kinds) == CFG.n_layer
    listing = g.listing()
    for op in ("embedding", "layer_norm", "linear(bias=True)", "linear(bias=False)", "attention(causal=True",
               "permute(dims=(0, 2, 1, 3))", "reshape", "gelu", "dropout", "cross_entropy", "loss: loss"):
        assert op in listing, op
    # positions: torch.arange(T) folded into a constant read by the wpe embedding
    (pos,) = g.by_role("constant")
    assert torch.equal(g.constants[pos], torch.arange(6))
    # scopes: module path of leaf modules (call_module) and of functions/methods inside modules
    scopes = {n.scope for n in g.nodes}
    assert {"transformer.wte", "transformer.h.0.attn.q", "transformer.h.1.mlp.gelu", "lm_head"} <= scopes
    assert {n.scope for n in g.nodes if n.op.kind == "attention"} == {"transformer.h.0.attn", "transformer.h.1.attn"}
    assert g.tensors[g.loss].shape == ()


def test_mlp_captures_whole():
    model, inputs = mlp_case()
    g = capture(model, inputs)
    assert g.weights == tuple(f"layers.{i}.{p}" for i in range(3) for p in ("weight", "bias"))
    assert [n.op.describe() for n in g.nodes] == [
        "linear(bias=True)", "relu", "linear(bias=True)", "relu", "linear(bias=True)", "cross_entropy(reduction='mean')"
    ]
    assert [n.scope for n in g.nodes if n.op.kind == "linear"] == ["layers.0", "layers.1", "layers.2"]
    assert g.loss == g.outputs[0]


@pytest.mark.parametrize("case", [gpt_case, mlp_case])
def test_json_round_trip(case):
    model, inputs = case()
    g = capture(model, inputs)
    assert_same_graph(ComputationGraph.from_json(g.to_json()), g)


def test_graph_file_roles_are_typed_and_checked():
    """A graph file's tensor roles load as TensorRole members (spelled as before in the file); a role that is
    not one is refused, naming the tensor and the roles."""
    model, inputs = mlp_case()
    d = capture(model, inputs).to_json()
    g = ComputationGraph.from_json(d)
    assert {t.role for t in g.tensors.values()} == set(TensorRole) - {TensorRole.CONSTANT}
    assert all(type(t.role) is TensorRole for t in g.tensors.values())
    assert {t["role"] for t in g.to_json()["tensors"]} == {"input", "weight", "activation"}
    d["tensors"][0]["role"] = "wieght"
    with pytest.raises(ValueError, match=r"tensor 'x': role 'wieght' is not one of \['input', 'weight', "):
        ComputationGraph.from_json(d)


def test_tied_parameters_are_one_weight():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, idx, y):
            return F.cross_entropy(self.head(self.wte(idx)), y)

    model = Tied()
    inputs = {"idx": torch.randint(0, 10, (5,)), "y": torch.randint(0, 10, (5,))}
    g = capture(model, inputs)
    assert g.weights == ("wte.weight",)
    assert [n.inputs[1] for n in g.nodes[:2]] == ["wte.weight", "wte.weight"]
    _, grads = run_backward(g, inputs, weights_of(model, g))
    model(**inputs).backward()
    torch.testing.assert_close(grads["wte.weight"], model.wte.weight.grad)


def test_buffers_become_constants_and_outputs_can_be_a_tuple():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))

        def forward(self, x):
            h = self.lin(x) * self.scale
            return h, h.sum()

    g = capture(M(), {"x": torch.randn(2, 3)}, loss=False)
    assert g.loss is None and len(g.outputs) == 2
    (c,) = g.by_role("constant")
    assert c == "scale" and torch.equal(g.constants[c], torch.tensor([1.0, 2.0, 3.0]))


def test_loss_needs_exactly_one_scalar_output():
    class Two(nn.Module):
        def forward(self, x):
            return x.sum(), x.mean()

    with pytest.raises(CaptureError, match="exactly one scalar"):
        capture(Two(), {"x": torch.randn(2, 3)})
    assert capture(Two(), {"x": torch.randn(2, 3)}, loss=False).outputs == ("sum", "mean")


# --- meta evaluation: graph tensors are never computed, folded constants are ------------------------------
def on_meta(inputs: dict) -> dict:
    return {k: v.to("meta") for k, v in inputs.items()}


def test_meta_example_inputs_give_the_same_graph():
    model, inputs = gpt_case(T=6)
    g = capture(model, inputs)
    g_meta = capture(model, on_meta(inputs))
    assert_same_graph(g_meta, g)
    assert g_meta.listing() == g.listing()
    # the positions torch.arange(T, device=idx.device) still fold to a real constant
    (pos,) = g_meta.by_role("constant")
    assert g_meta.constants[pos].device.type == "cpu" and torch.equal(g_meta.constants[pos], torch.arange(6))


def test_huge_meta_batch_is_captured_without_allocating_it():
    model, _ = gpt_case()
    B = 1 << 40  # idx alone would take 8 TiB per position
    idx = torch.empty(B, 6, dtype=torch.long, device="meta")
    g = capture(model, {"idx": idx, "targets": idx})
    assert g.tensors["idx"].shape == (B, 6) and g.tensors[g.loss].shape == ()
    (logits,) = next(n for n in g.nodes if n.scope == "lm_head").outputs
    assert g.tensors[logits].shape == (B, 6, CFG.vocab_size)


def test_model_on_meta_device_gives_the_same_graph():
    model, inputs = gpt_case(T=6)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta_model = GPT(CFG)
    assert_same_graph(capture(meta_model, on_meta(inputs)), capture(model, inputs))


class Folded(nn.Module):
    """``forward(x [B, T, 4]) -> scalar``: positions, a causal-mask buffer sliced to T and a scale folded from them."""

    def __init__(self, block_size=8):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.wpe = nn.Embedding(block_size, 4)
        self.register_buffer("tril", torch.tril(torch.ones(block_size, block_size)))

    def forward(self, x):
        B, T, C = x.size()
        pos = torch.arange(T, device=x.device)  # [T]
        keep = self.tril.narrow(0, 0, T).narrow(1, 0, T) * 2 - 1 + torch.arange(T) / T  # [T, T], folded, real
        h = self.lin(x) + self.wpe(pos)  # [B, T, 4]
        att = torch.softmax(h @ h.transpose(1, 2) * keep, dim=-1)  # [B, T, T]
        return (att @ h).sum()


@pytest.mark.parametrize("meta", [False, True], ids=["real", "meta"])
def test_folded_constants_keep_their_values(meta):
    torch.manual_seed(0)
    model = Folded().double()
    inputs = {"x": torch.randn(3, 5, 4, dtype=torch.float64)}
    g = capture(model, on_meta(inputs) if meta else inputs)
    consts = {n: g.constants[n] for n in g.by_role("constant")}
    assert all(v.device.type == "cpu" for v in consts.values())
    keep = torch.tril(torch.ones(5, 5, dtype=torch.float64)) * 2 - 1 + torch.arange(5) / 5
    assert any(v.shape == (5, 5) and torch.equal(v, keep) for v in consts.values()), consts
    assert any(torch.equal(v, torch.arange(5)) for v in consts.values()), consts
    # the graph, run on the real inputs, computes what the module computes
    env, grads = run_backward(g, inputs, weights_of(model, g))
    loss = model(**inputs)
    loss.backward()
    torch.testing.assert_close(env[g.loss], loss.detach(), rtol=0, atol=1e-10)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-10)


def test_folded_indices_out_of_range_are_caught():
    model, inputs = gpt_case(T=CFG.block_size + 2)  # positions 0..9 into wpe's 8 rows
    with pytest.raises(CaptureError, match=r"transformer\.wpe.*span \[0, 9\] but the embedding has 8 rows"):
        capture(model, on_meta(inputs))


def test_forward_needing_values_names_the_node():
    class Item(nn.Module):
        def forward(self, x):
            return x * x.sum().item()

    with pytest.raises(CaptureError, match=r"fx node 'item'.*meta.*needs those values") as e:
        capture(Item(), {"x": torch.randn(2, 3)}, loss=False)
    assert "call_method item" in str(e.value)


def test_meta_buffer_read_as_constant_is_an_error():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("scale", torch.ones(3))

        def forward(self, x):
            return (self.lin(x) * self.scale).sum()

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(CaptureError, match="'scale'.*has no value"):
        capture(model, {"x": torch.randn(2, 3)})


# --- one small module per function family: the graph matches eager PyTorch ---------------------------------
class Fam(nn.Module):
    """``forward(x [4, 6]) -> scalar``: a parameter ``w [4, 6]`` and the expression ``fn(self, x * w)``."""

    def __init__(self, fn):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.fn = fn

    def forward(self, x):
        return self.fn(x * self.w).sum()


def chunk_family(h):
    a, b, c = h.chunk(3, dim=1)  # tuple unpacking of a chunk
    return a * b + c + torch.chunk(h, 2)[1].sum()


FAMILIES = {
    "scalar_right": lambda h: (h + 1) * 2 - 3 / 1.5,
    "scalar_left": lambda h: 1 + 2 * h,
    "rsub_rdiv": lambda h: (1 - h) + 2 / (h * h + 1),
    "scalar_from_size": lambda h: h / h.size(-1) + h * h.shape[0],
    "sub_div_neg": lambda h: -(h - h.tanh()) / (h * h + 1) + torch.neg(h) - torch.sub(h, 1),
    "torch_and_method_arith": lambda h: torch.add(h, h).mul(h).div(2) + torch.mul(h, h) + torch.div(h, 2),
    "bmm": lambda h: torch.bmm(h.view(2, 2, 6), h.view(2, 6, 2)) + h.view(2, 2, 6) @ h.view(2, 6, 2),
    "matmul_T": lambda h: torch.matmul(h, h.T) + h.matmul(h.transpose(0, 1)),
    "permute": lambda h: h.view(2, 2, 3, 2).permute(3, 1, 0, 2).reshape(-1, 4) * torch.permute(h, (1, 0)).reshape(6, 4),
    "split": lambda h: torch.split(h, [2, 4], dim=1)[0].sum() * h.split(2)[1],
    "chunk": chunk_family,
    "softmax": lambda h: torch.softmax(h, -1) + F.softmax(h, dim=0) + h.softmax(1),
    "sum_mean_keepdim": lambda h: h.sum(-1, keepdim=True) * h.mean(0, keepdim=True) + h.mean() + torch.sum(h, (0, 1)),
    "tanh_relu": lambda h: torch.tanh(h) + F.relu(h) + h.relu() + torch.relu(h) + F.tanh(h) * F.gelu(h),
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "layer_norm_no_affine": lambda h: F.layer_norm(h, (6,)) + F.layer_norm(h, (4, 6), eps=1e-3),
    "dropout_p0": lambda h: F.dropout(h, 0.0) + F.dropout(h, 0.5, training=False),
    "contiguous": lambda h: h.T.contiguous().view(24),
    "constant_tensor": lambda h: h * torch.arange(h.size(1)) + torch.ones(4, 1),
}


@pytest.mark.parametrize("fn", FAMILIES.values(), ids=FAMILIES.keys())
def test_function_family_matches_eager(fn):
    torch.manual_seed(0)
    model = Fam(fn).double()
    inputs = {"x": torch.randn(4, 6, dtype=torch.float64)}
    g = capture(model, inputs)
    env, grads = run_backward(g, inputs, weights_of(model, g))
    loss = model(**inputs)
    loss.backward()
    # float64 and the same kernels on the same values: only summation order may differ
    torch.testing.assert_close(env[g.loss], loss.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(grads["w"], model.w.grad, rtol=0, atol=1e-10)


def test_functional_layers_read_parameters():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Parameter(torch.randn(7, 4))
            self.proj = nn.Linear(4, 4)
            self.ln = nn.LayerNorm(4)

        def forward(self, idx):
            h = F.embedding(idx, self.emb)
            h = F.linear(h, self.proj.weight, self.proj.bias)
            return F.layer_norm(h, (4,), self.ln.weight, self.ln.bias).sum()

    model = M()
    g = capture(model, {"idx": torch.tensor([[1, 2], [3, 6]])})
    assert [n.op.kind for n in g.nodes] == ["embedding", "linear", "layer_norm", "reduce"]
    assert set(g.weights) == set(dict(model.named_parameters()))


# --- errors ----------------------------------------------------------------------------------------------
class Wrap(nn.Module):
    """``inner`` under the path ``body``; forward(x) returns inner(x)."""

    def __init__(self, inner):
        super().__init__()
        self.body = inner

    def forward(self, x):
        return self.body(x)


class Sin(nn.Module):
    def forward(self, x):
        return torch.sin(x).sum()


def test_unsupported_module_names_path_type_and_supported():
    model = Wrap(nn.Sequential(nn.Linear(4, 4), nn.Conv1d(1, 1, 1)))
    with pytest.raises(CaptureError) as e:
        capture(model, {"x": torch.randn(2, 1, 4)})
    msg = str(e.value)
    assert "'body.1'" in msg and "Conv1d" in msg and "supported modules" in msg and "nn.Linear" in msg


def test_unsupported_function_names_path_op_and_supported():
    with pytest.raises(CaptureError) as e:
        capture(Wrap(Sin()), {"x": torch.randn(2, 4)})
    msg = str(e.value)
    assert "torch.sin" in msg and "'body'" in msg and "supported functions" in msg and "torch.matmul" in msg


class SDPA(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x, **self.kw).sum()


@pytest.mark.parametrize("kw, bad", [
    ({"attn_mask": torch.ones(3, 3, dtype=torch.bool)}, "attn_mask"),
    ({"dropout_p": 0.1}, "dropout_p"),
])
def test_sdpa_mask_and_dropout_rejected(kw, bad):
    with pytest.raises(CaptureError, match=bad) as e:
        capture(SDPA(**kw), {"x": torch.randn(1, 2, 3, 4)})
    assert "scaled_dot_product_attention" in str(e.value)


class CE(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, x, y):
        return F.cross_entropy(x, y, **self.kw)


@pytest.mark.parametrize("kw", [{"label_smoothing": 0.1}, {"ignore_index": 0}, {"reduction": "none"}])
def test_cross_entropy_options_rejected(kw):
    with pytest.raises(CaptureError, match=next(iter(kw))):
        capture(CE(**kw), {"x": torch.randn(3, 4), "y": torch.tensor([0, 1, 2])}, loss=False)


def test_tensor_indexing_rejected():
    class Index(nn.Module):
        def forward(self, x):
            return x[:, 0].sum()

    with pytest.raises(CaptureError, match="indexing"):
        capture(Index(), {"x": torch.randn(2, 3)})


def test_dtype_or_shape_mismatch_with_eager_is_caught():
    class Half(nn.Module):
        def forward(self, idx):  # int64 * 0.5 is float32 in PyTorch; the scalar op keeps int64
            return (idx * 0.5).sum()

    with pytest.raises(CaptureError, match="but PyTorch gives float32"):
        capture(Half(), {"idx": torch.tensor([1, 2])})


def test_example_inputs_must_match_forward_args():
    model, inputs = mlp_case()
    with pytest.raises(CaptureError, match=r"missing \['y'\], unexpected \['z'\]"):
        capture(model, {"x": inputs["x"], "z": inputs["y"]})

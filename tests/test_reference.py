"""The reference interpreter on captured graphs equals eager PyTorch: loss and every parameter gradient."""

from __future__ import annotations

import pytest
import torch

from shardflow.capture import capture
from shardflow.graph import GraphBuilder
from shardflow.models import GPT, MLP, GPTConfig
from shardflow.reference import run_backward, run_forward, weights_of

CFG = GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16)

# float64: the interpreter calls the same torch kernels on the same values as the module, so only the
# summation order inside a kernel could differ; float32 gets the usual single-precision tolerance.
TOLERANCES = {torch.float64: dict(rtol=0.0, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def gpt(dtype):
    torch.manual_seed(0)
    model = GPT(CFG).to(dtype)
    inputs = {"idx": torch.randint(0, CFG.vocab_size, (2, 8)), "targets": torch.randint(0, CFG.vocab_size, (2, 8))}
    return model, inputs


def mlp(dtype):
    torch.manual_seed(0)
    model = MLP(d_in=8, hidden=12, d_out=5, n_layers=3).to(dtype)
    return model, {"x": torch.randn(6, 8, dtype=dtype), "y": torch.randint(0, 5, (6,))}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("case", [gpt, mlp])
def test_loss_and_every_gradient_match_eager(case, dtype):
    model, inputs = case(dtype)
    graph = capture(model, inputs)
    env, grads = run_backward(graph, inputs, weights_of(model, graph))
    loss = model(**inputs)
    loss.backward()
    torch.testing.assert_close(env[graph.loss], loss.detach(), **TOLERANCES[dtype])
    params = dict(model.named_parameters())
    assert grads.keys() == params.keys()
    for name, p in params.items():
        torch.testing.assert_close(grads[name], p.grad, **TOLERANCES[dtype], msg=lambda m: f"{name}: {m}")


def test_gpt_logits_capture_matches_eager():
    model, inputs = gpt(torch.float64)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = model

        def forward(self, idx):
            return self.gpt.logits(idx)

    graph = capture(Logits(), {"idx": inputs["idx"]}, loss=False)
    env = run_forward(graph, {"idx": inputs["idx"]}, weights_of(Logits(), graph))
    torch.testing.assert_close(env[graph.outputs[0]], model.logits(inputs["idx"]).detach(), rtol=0, atol=1e-10)


def test_run_forward_returns_every_tensor():
    model, inputs = mlp(torch.float32)
    graph = capture(model, inputs)
    env = run_forward(graph, inputs, weights_of(model, graph))
    assert env.keys() == graph.tensors.keys()
    assert all(tuple(env[n].shape) == t.shape for n, t in graph.tensors.items())


def test_unused_weight_gets_zero_gradient():
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    w = b.weight("w", (3,))
    b.weight("unused", (4,))  # read by nothing
    loss = b.sum(b.mul(x, w))
    graph = b.build([loss], loss)
    _, grads = run_backward(graph, {"x": torch.ones(2, 3)}, {"w": torch.ones(3), "unused": torch.ones(4)})
    assert torch.equal(grads["w"], torch.full((3,), 2.0)) and torch.equal(grads["unused"], torch.zeros(4))


def test_errors_name_the_tensor_and_expected_shape():
    model, inputs = mlp(torch.float32)
    graph = capture(model, inputs)
    weights = weights_of(model, graph)
    with pytest.raises(KeyError, match=r"'y' \(expected int64\[6\]\)"):
        run_forward(graph, {"x": inputs["x"]}, weights)
    with pytest.raises(KeyError, match=r"'layers.2.bias' \(expected float32\[5\]\)"):
        run_forward(graph, inputs, {k: v for k, v in weights.items() if k != "layers.2.bias"})
    with pytest.raises(KeyError, match="unknown input"):
        run_forward(graph, {**inputs, "z": inputs["x"]}, weights)
    with pytest.raises(ValueError, match=r"input 'x' is float32\[6, 7\], expected float32\[6, 8\]"):
        run_forward(graph, {**inputs, "x": torch.randn(6, 7)}, weights)
    with pytest.raises(KeyError, match=r"'layers.0.weight' \(expected float32\[12, 8\]\)"):
        weights_of(MLP(d_in=8, hidden=12, d_out=5, n_layers=3).layers[1:], graph)


def test_run_backward_needs_a_loss():
    model, inputs = mlp(torch.float32)
    graph = capture(model, inputs, loss=False)
    with pytest.raises(ValueError, match="needs a graph with a loss"):
        run_backward(graph, inputs, weights_of(model, graph))

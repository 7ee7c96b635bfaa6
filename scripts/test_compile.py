"""torch.compile computes what eager computes: the fused MoE layer and whole models, forward and every gradient.

    python scripts/test_compile.py

Run under every torch the project meets: the pinned one (requirements.txt) and the GPU image's 2.11
(`.ci/run` runs this file in a second venv with torch 2.11). The two trace custom autograd Functions
differently: under 2.11 a Function whose forward returns an in-place result or a no-op `.to()` gets a wrong
gradient (kernels/backend.py: cast), and only a compiled-vs-eager comparison shows it.

Tolerance: 1e-5 absolute on values of size ~0.1-10 in fp32 (compiled graphs fuse and reorder elementwise ops:
differences of a few ulps, ~1e-7 measured). The models compile with backend="aot_eager" (the traced forward
and backward graphs, where the 2.11 fault lies, without inductor's minute of code generation per model); the
layer compiles with inductor, fullgraph. Everything compiled is built with the engines for torch.compile
(train.engines.engines_for(..., compiled=True): the fused experts on a grouped engine, since the CPU experts
engine reads host values a fullgraph compile cannot hold).
"""
import torch

from testlib import Skip, run
from test_moe_fused import ENGINE_FUNCTIONS, assert_bf16_as_close_as_sorted, assert_close, fwd_bwd, pair, with_engines
from train.engines import engines_for, grouped_experts_for
from model.model_minimind import MiniMindConfig, MiniMindForCausalLM


def test_fused_layer_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) traces the fused layer built with the compiled engines (the grouped engine on
    torch's grouped_mm through custom ops where it takes the sizes) forward and backward in one graph (no
    data-dependent shape, no host read)."""
    ref, layers = pair(4, 2)
    fused = with_engines(layers["plain"], compiled=True)
    assert fused.experts.engine is grouped_experts_for("cpu", torch.float32, 32, 24, compiled=True)
    x, g = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    want = fwd_bwd(ref, x, g)
    got = fwd_bwd(torch.compile(fused, fullgraph=True), x, g)
    assert_close(want[0], got[0], 1e-5, "compiled forward")
    assert_close(want[1], got[1], 1e-5, "compiled grad x")
    for n, p in fused.named_parameters():
        assert_close(want[2][n], p.grad, 1e-5, f"compiled grad {n}")


def test_cuda_fused_layer_compiled():
    """On CUDA, where the graph holds the Triton permute / combine and the grouped GEMMs: the compiled fused
    layer equals the sorted layer within 1e-5 in fp32, and under bf16 autocast is no further from fp64 than
    the sorted layer (test_moe_fused.py's BF16_MARGIN)."""
    if not torch.cuda.is_available():
        raise Skip("needs CUDA")
    ref, layers = pair(8, 2)
    ref.cuda(), layers["plain"].cuda()
    fused = with_engines(layers["plain"], "cuda", torch.float32, compiled=True)
    assert fused.experts.engine in ENGINE_FUNCTIONS["grouped"]
    compiled = torch.compile(fused, fullgraph=True)

    def run_compiled(x, g):  # fwd_bwd's triple, the gradients named as the layer's own parameters
        y, grad_x, _ = fwd_bwd(compiled, x, g)
        return y, grad_x, {n: p.grad for n, p in fused.named_parameters()}

    x, g = torch.randn(4, 64, 32, device="cuda"), torch.randn(4, 64, 32, device="cuda")
    want, got = fwd_bwd(ref, x, g), run_compiled(x, g)
    assert_close(want[0], got[0], 1e-5, "cuda fp32 compiled forward")
    assert_close(want[1], got[1], 1e-5, "cuda fp32 compiled grad x")
    for n in want[2]:
        assert_close(want[2][n], got[2][n], 1e-5, f"cuda fp32 compiled grad {n}")
    assert_bf16_as_close_as_sorted(ref, run_compiled, x, g, "cuda compiled")


def loss_and_grads(model, call, ids):
    model.zero_grad(set_to_none=True)
    loss = call(ids, labels=ids).loss  # (the LM loss plus the router's aux loss)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_models_compiled_gradients_equal_eager():
    """Tiny models built with the trainer's CPU engines for torch.compile (fused MoE: one graph; sorted MoE: a
    graph break at its host read; dense), compiled: the loss and every parameter's gradient equal eager's
    within 1e-5."""
    for use_moe, impl, fullgraph in ((True, "fused", True), (True, "sorted", False), (False, "sorted", True)):
        torch.manual_seed(0)
        config = MiniMindConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                vocab_size=64, use_moe=use_moe, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, moe_impl=impl)
        model = MiniMindForCausalLM(config, engines_for(config, "cpu", torch.float32, compiled=True)).train()
        ids = torch.randint(0, 64, (2, 16))
        eager_loss, eager_grads = loss_and_grads(model, model, ids)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
        loss, grads = loss_and_grads(model, compiled, ids)
        what = f"use_moe={use_moe} moe_impl={impl}"
        assert_close(eager_loss, loss, 1e-5, f"{what} loss")
        for n, grad in eager_grads.items():
            assert_close(grad, grads[n], 1e-5, f"{what} grad {n}")


TESTS = [test_fused_layer_compiles_without_graph_breaks, test_models_compiled_gradients_equal_eager,
         test_cuda_fused_layer_compiled]

if __name__ == "__main__":
    run(TESTS)

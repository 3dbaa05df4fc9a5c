"""The public ops called eagerly take their kernels directly (moe_kernels._ext.eager): outputs and gradients
equal the registered custom ops' bit for bit, no registered op is dispatched, and the registered op takes over
under torch.compile and in the checking mode."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_kernels as mk
from moe_kernels import _ext
from moe_kernels.testing import assert_exact

pytestmark = pytest.mark.gpu


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _both(monkeypatch, fn, *inputs):
    """fn on the eager path and on the registered ops: (outputs and input grads) twice, and the ops dispatched."""
    results, dispatched = [], []
    for eager in (True, False):
        if not eager:
            monkeypatch.setattr(_ext, "eager", lambda t: None)
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        with _Ops() as ops:
            outs = fn(*xs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            diff = [o for o in outs if o.requires_grad]
            if diff:
                gen = torch.Generator().manual_seed(3)
                grads = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in diff]
                torch.autograd.backward(diff, grads)
        results.append([o.detach() for o in outs] + [x.grad for x in xs if x.grad is not None])
        dispatched.append({n for n in ops.names if n.startswith("moe_kernels.")})
        monkeypatch.undo()
    return results, dispatched


ROUTER = {
    "softmax": dict(),
    "pre-softmax": dict(pre_softmax=True),
    "deepseek": dict(score="sigmoid", num_groups=4, group_topk=2, scaling_factor=2.5, bias=True),
    "sqrtsoftplus": dict(score="sqrtsoftplus", normalize=False),
}


@pytest.mark.parametrize("name", list(ROUTER))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_topk_eager_equals_registered(cuda, monkeypatch, name, dtype):
    kw = dict(ROUTER[name])
    bias = torch.randn(32, device=cuda) * 0.1 if kw.pop("bias", False) else None
    logits = torch.randn(70, 32).to(cuda, dtype)
    (eager, registered), (d_eager, d_registered) = _both(
        monkeypatch, lambda x: mk.router_topk(x, 4, expert_bias=bias, **kw), logits)
    assert not d_eager and "moe_kernels.router_topk" in d_registered, (d_eager, d_registered)
    for i, (a, b) in enumerate(zip(eager, registered)):
        assert_exact(a, b, f"router_topk {name}: output {i}")


@pytest.mark.parametrize("T", [0, 1, 200])
def test_losses_and_counts_eager_equal_registered(cuda, monkeypatch, T):
    E, k, S = 16, 4, (T if T else 1)
    scores = torch.softmax(torch.randn(T, E), -1).to(cuda)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(cuda, torch.int32) if T else \
        torch.zeros(0, k, dtype=torch.int32, device=cuda)
    counts = mk.tokens_per_expert(idx, E)
    cases = {
        "aux_loss": (lambda s: mk.aux_loss(s, counts, k, 1e-2), scores),
        "aux_loss int64 counts": (lambda s: mk.aux_loss(s, counts.long(), k, 1e-2), scores),
        "seq_aux_loss": (lambda s: mk.seq_aux_loss(s, idx, 1e-3, seq_len=S), scores),
        "z_loss": (lambda x: mk.z_loss(x, 1e-3), torch.randn(T, E).to(cuda)),
        "tokens_per_expert": (lambda i: mk.tokens_per_expert(i, E), idx),
    }
    for name, (fn, x) in cases.items():
        (eager, registered), (d_eager, d_registered) = _both(monkeypatch, fn, x)
        assert not d_eager and d_registered, (name, d_eager, d_registered)
        for i, (a, b) in enumerate(zip(eager, registered)):
            assert_exact(a, b, f"{name} (T={T}): output {i}")


def test_loss_double_backward_still_works_eagerly(cuda):
    # create_graph: the eager backward switches to the same differentiable composition as the registered op.
    x = torch.randn(8, 6, device=cuda, requires_grad=True)
    (g,) = torch.autograd.grad(mk.z_loss(x, 0.1), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.square().sum(), x)
    with _ext.reference_ops():
        xr = x.detach().cpu().requires_grad_()
        (gr,) = torch.autograd.grad(mk.z_loss(xr, 0.1), xr, create_graph=True)
        (ggr,) = torch.autograd.grad(gr.square().sum(), xr)
    torch.testing.assert_close(gg.cpu(), ggr, rtol=1e-4, atol=1e-7)


def test_checking_mode_and_compile_take_the_registered_ops(cuda, checks_on):
    logits = torch.randn(9, 8, device=cuda)
    assert _ext.eager(logits) is None  # the checking mode validates values in the registered ops
    mk.set_checks(False)
    f = torch.compile(lambda x: mk.router_topk(x, 2)[0] * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(logits), mk.router_topk(logits, 2)[0] * 2)

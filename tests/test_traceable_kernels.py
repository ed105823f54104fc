"""TraceableKernels: the plain Triton launch on real tensors, the wrap_triton launch while traced."""
import types

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megacoat.kernels import TraceableKernels


class _Kernel:
    """Stands in for a Triton JIT function: records which launch path ran."""

    def __init__(self, calls, tag):
        self.calls, self.tag = calls, tag

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.tag, grid, len(args), sorted(kw)))


def _kernels(calls):
    k = TraceableKernels(types.SimpleNamespace(my_kernel=_Kernel(calls, "plain")))
    k._wrap = lambda kernel: _Kernel(calls, "wrapped")
    return k


def test_real_tensors_launch_the_kernel_directly():
    calls = []
    k = _kernels(calls)
    x = torch.randn(5)
    k.my_kernel[(3,)](x, torch.nn.Parameter(torch.ones(2)), 7, BLOCK=16)
    assert calls == [("plain", (3,), 3, ["BLOCK"])]
    assert k.my_kernel is k.my_kernel  # one launcher per kernel, reused


def test_fake_tensors_launch_through_wrap_triton():
    calls = []
    k = _kernels(calls)
    with FakeTensorMode():
        x = torch.empty(5)
        k.my_kernel[(2,)](x, 4)
    k.my_kernel[(1,)](torch.zeros(1))
    assert [c[0] for c in calls] == ["wrapped", "plain"]

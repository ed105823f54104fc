"""GPU checks of the operations features where the GPU path differs from the CPU one:
recomputation inside torch.compile'd bf16 layers, and --dry-run sizes against a real GPU build."""
import pytest
import torch

from megacoat.config import parse_args
from megacoat.training.planner import _grad_bytes, _master_bytes, _state_bytes, _weight_bytes, plan_run

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "1000",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--num-workers", "0", "--eval-interval", "0",
         "--eval-iters", "0", "--bf16", "--torch-compile"]


def _grads(extra):
    from megacoat.training.trainer import Trainer
    tr = Trainer(parse_args(FLAGS + extra))
    tr.optimizer.zero_grad()
    loss = tr.forward_backward(tr._next_micro_batches(tr.data_iterators().train))
    torch.cuda.synchronize()
    return loss.item(), {n: p.main_grad.detach().float().clone() for n, p in tr.model.named_parameters()}


def test_recompute_in_compiled_bf16_layers():
    ref_loss, ref = _grads([])
    loss, full = _grads(["--recompute-granularity", "full"])
    assert loss == ref_loss
    for n in ref:  # the same compiled graph runs again: identical
        assert torch.equal(full[n], ref[n]), n
    loss, sel = _grads(["--recompute-granularity", "selective"])  # the attention core runs eagerly
    assert abs(loss - ref_loss) <= 1e-3 * abs(ref_loss)
    for n in ref:
        err = (sel[n] - ref[n]).abs().max().item()
        assert err <= 2e-2 * ref[n].abs().max().item() + 1e-6, (n, err)


def test_dry_run_sizes_equal_a_gpu_build():
    from megacoat.training.trainer import Trainer
    flags = FLAGS + ["--use-distributed-optimizer", "--ddp-bucket-size", "200000"]
    (plan,) = plan_run(parse_args(flags), 1, 1000, torch.device("cuda"))
    for fmt, extra in (("fp32", []), ("fp8", ["--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8",
                                              "--exp-avg-sq-dtype", "fp8"])):
        opt = Trainer(parse_args(flags + extra)).optimizer
        assert (plan.weights, plan.grads, plan.master[fmt], plan.states[fmt]) == \
            (_weight_bytes(opt), _grad_bytes(opt), _master_bytes(opt), _state_bytes(opt)), fmt

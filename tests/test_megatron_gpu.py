"""GPU: megatron-core's own forward on CUDA (no CPU patches) equals megacoat's after conversion.

Needs megatron-core: `pip install --no-deps megatron-core` (offline: the wheel carried in
.whl/megatron-core/, see docs/migrating-from-megatron.md). Skipped without CUDA or megatron-core.
"""
import os
import socket

import pytest
import torch

pytestmark = pytest.mark.gpu
mcore = pytest.importorskip("megatron.core", reason="needs megatron-core (pip install --no-deps megatron-core)")

from test_megatron_checkpoint import (GPT2, LLAMA, SEQ, VOCAB, build_mcore, megatron_args,  # noqa: E402
                                      megatron_split, save_torch_format, weights)

import megacoat  # noqa: E402
from megacoat.convert.megatron import megatron_to_megacoat  # noqa: E402


@pytest.fixture(scope="module")
def mcore_cuda():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    if started:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind,dtype,tol", [(LLAMA, torch.float32, 2e-4), (GPT2, torch.float32, 2e-4),
                                            (LLAMA, torch.bfloat16, 3e-2)], ids=["llama-fp32", "gpt2-fp32", "llama-bf16"])
def test_megatron_core_cuda_logits_equal_megacoat(mcore_cuda, tmp_path, kind, dtype, tol):
    model = build_mcore(kind)
    sd = weights(model)
    src = save_torch_format(str(tmp_path / "mlm"), megatron_split(sd, 2, 2, 4, kind["swiglu"], kind["tied"]),
                            megatron_args(kind, model, 2, 2))
    out = megatron_to_megacoat(src, str(tmp_path / "mc"), log=lambda s: None)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0)).cuda()
    model = model.cuda().to(dtype)
    pos = torch.arange(SEQ, device="cuda").expand_as(tokens)
    with torch.no_grad():
        theirs = model(tokens, pos, None)[..., :VOCAB].float()  # megatron-core's own causal mask path
        ours = megacoat.load_model(out, device="cuda", dtype=dtype)(tokens).float()
    scale = theirs.abs().max().item()
    err = (ours - theirs).abs().max().item()
    assert err <= tol * max(scale, 1.0), f"max |diff| {err:.3g} vs logits scale {scale:.3g}"
    # Same prediction wherever megatron-core's top logit is clear of the runner-up.
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 4 * tol * max(scale, 1.0)
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])

"""precision/handoff.py and precision/layer_ops.py: an FP8 linear's grad-amax token taken by `value_of` or by the
residual `add` gets max |dy| as its gradient, so the linear's backward gives exactly the numbers of its own amax
pass, in eager and compiled code (where a token left behind would get zeros); each recipe's linears hand tokens only
to the operations of that recipe that return them."""
import pytest
import torch

from megacoat.precision import handoff
from megacoat.precision.handoff import Handoff, PendingAdd
from megacoat.precision.layer_ops import RESIDUAL, ROPE, CoatLayerOps, LayerOps, layer_ops
from megacoat.precision.linear import Fp8WeightCache, fp8_linear
from megacoat.precision.recipe import Fp8Recipe

COAT = Fp8Recipe()


def _data(shape, seed, scale=1.0):
    return (scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(torch.bfloat16)


def _consume(consumer, x, w, r):
    """(output, dx, dw) of r + linear(x) (or of linear(x) through value_of), the token given to `consumer`."""
    y, token = fp8_linear(x, w, None, Fp8WeightCache("e4m3"), COAT, grad_amax_token=True)
    if consumer == "add":
        return handoff.add(r, y, token)
    return handoff.value_of(Handoff(y, token=token)) * 2


@pytest.mark.parametrize("consumer", ["add", "value_of"])
@pytest.mark.parametrize("compiled", [False, True])
def test_token_taken_by_value_of_or_add_gives_the_linears_own_amax_pass(consumer, compiled):
    x0, w0, r = _data((6, 3, 32), 1), _data((48, 32), 2, 0.05), _data((6, 3, 48), 3)
    g = _data((6, 3, 48), 4, 3.0)
    runs = []
    for mode in ("pass", "token"):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        if mode == "pass":  # no token: the linear reduces its output gradient itself
            y = fp8_linear(x, w, None, Fp8WeightCache("e4m3"), COAT)
            out = r + y if consumer == "add" else y * 2
        else:
            fn = torch.compile(_consume, backend="aot_eager", fullgraph=True) if compiled else _consume
            out = fn(consumer, x, w, r)
        out.backward(g)
        runs.append((out.detach(), x.grad, w.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_the_tokens_gradient_is_the_amax_of_the_consumers_input_gradient():
    """A wrong amax would change the codes: too small saturates, too large wastes range."""
    y = _data((5, 40), 5).requires_grad_(True)
    token = torch.empty(()).requires_grad_(True)
    g = _data((5, 40), 6, 2.0)
    dy, t = torch.autograd.grad(handoff.value_of(Handoff(y * 1, token=token)), (y, token), g)
    assert torch.equal(dy, g) and t.shape == () and t == g.float().abs().amax()
    dy, t = torch.autograd.grad(handoff.add(y * 1, y * 2, token), (y, token), g)
    assert torch.equal(dy, g + 2 * g) and t == g.float().abs().amax()


def test_a_handoff_is_no_tensor_and_views_keep_what_it_carries():
    h = Handoff(torch.zeros(4, 6), amax=torch.ones(()), token=torch.empty(()))
    v = h.view(2, 2, 6)
    assert v.shape == (2, 2, 6) and v.amax is h.amax and v.token is h.token
    with pytest.raises(TypeError):
        torch.relu(h)  # an operation cannot take the tensor and leave the token behind
    assert handoff.split(torch.ones(2))[1:] == (None, None)


@pytest.mark.parametrize("recipe,ops_type,tokens_to", [
    (None, LayerOps, ()),
    (Fp8Recipe(fp8_activations=False), LayerOps, (ROPE,)),
    (Fp8Recipe(), CoatLayerOps, (ROPE, RESIDUAL)),
])
def test_each_recipe_hands_tokens_to_its_own_consumers(recipe, ops_type, tokens_to):
    ops = layer_ops(recipe)
    assert type(ops) is ops_type and ops.defers_residual_add == (ops_type is CoatLayerOps)
    for consumer in (ROPE, RESIDUAL, None):
        impl = ops.linear_impl(consumer)
        assert (impl is None) == (recipe is None)
        if impl is not None:
            assert impl.with_token == (consumer in tokens_to), consumer


def test_coat_residual_add_is_left_to_the_next_norm_only_when_one_follows():
    ops = layer_ops(COAT)
    s, b, token = _data((4, 32), 7), _data((4, 32), 8), torch.empty(())
    pending = ops.residual_add(s, Handoff(b, token=token), into_norm=True)
    assert isinstance(pending, PendingAdd) and pending.stream is s and pending.branch is b and pending.token is token
    assert torch.equal(ops.residual_add(s, Handoff(b, token=token), into_norm=False), s + b)
    assert torch.equal(layer_ops(None).residual_add(s, b, into_norm=True), s + b)

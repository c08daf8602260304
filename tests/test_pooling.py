"""The built-in CNNs' max pool (felix.client.pooling): the channels-last kernel on the CPU gives
the plain pool's output and gradients to the bit, so runs keep their results, only faster."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from felix.client.pooling import MaxPool2d
from felix.client.stacked_chain import _chain_of, _layers
from felix.scenario.models import kws_cnn, small_cnn

SETTINGS = [
    ((32, 16, 32, 32), {"kernel_size": 2}),
    ((32, 32, 16, 16), {"kernel_size": 2}),
    ((5, 3, 9, 11), {"kernel_size": 2}),  # odd sizes: the last row and column dropped
    ((4, 6, 10, 10), {"kernel_size": 3, "stride": 2, "padding": 1}),
    ((4, 6, 11, 11), {"kernel_size": 2, "ceil_mode": True}),
    ((2, 4, 12, 12), {"kernel_size": 2, "dilation": 2}),
]


def _input(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """After a ReLU, with windows of equal values (zeros and a positive constant) where the first
    maximum decides which input the gradient reaches, and a NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.relu(torch.randn(*shape, generator=g))
    x[:, :, : shape[2] // 2, : shape[3] // 3] = 0.5
    x[:, :, -2:, :] = 0.0
    x[0, 0, 1, 1] = float("nan")
    return x


@pytest.mark.parametrize("shape,kw", SETTINGS, ids=[str(s) for s, _ in SETTINGS])
def test_output_and_gradient_equal_the_plain_pool_to_the_bit(
    shape: tuple[int, ...], kw: dict[str, Any]
) -> None:
    base = _input(shape, seed=sum(shape))
    plain, fast = nn.MaxPool2d(**kw), MaxPool2d(**kw)
    a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
    ya, yb = plain(a), fast(b)
    torch.testing.assert_close(ya, yb, rtol=0, atol=0, equal_nan=True)
    assert yb.is_contiguous()
    grad = torch.randn(ya.shape, generator=torch.Generator().manual_seed(1))
    ya.backward(grad)
    yb.backward(grad)
    assert b.grad is not None and b.grad.is_contiguous()
    assert a.grad is not None and torch.equal(a.grad, b.grad)
    with torch.no_grad():  # evaluation: the forward alone
        torch.testing.assert_close(plain(base), fast(base), rtol=0, atol=0, equal_nan=True)


def test_where_the_channels_last_kernel_does_not_apply_it_is_the_plain_pool() -> None:
    x = _input((1, 3, 8, 8), seed=3)[0]  # unbatched
    torch.testing.assert_close(MaxPool2d(2)(x), F.max_pool2d(x, 2), rtol=0, atol=0, equal_nan=True)
    y = torch.relu(torch.randn(2, 3, 8, 8))
    out, idx = MaxPool2d(2, return_indices=True)(y)
    ref_out, ref_idx = F.max_pool2d(y, 2, return_indices=True)
    assert torch.equal(out, ref_out) and torch.equal(idx, ref_idx)
    # under vmap (the cohort trainer maps a model over its stack) the plain op and its batching rule
    stack = torch.relu(torch.randn(4, 2, 3, 8, 8))
    assert torch.equal(torch.func.vmap(MaxPool2d(2))(stack), torch.func.vmap(nn.MaxPool2d(2))(stack))


@pytest.mark.parametrize(
    "make,shape", [(small_cnn, (3, 32, 32)), (kws_cnn, (1, 24, 32))], ids=["small_cnn", "kws_cnn"]
)
def test_a_cnn_trains_to_the_same_bits_as_with_the_plain_pool(make, shape) -> None:
    torch.manual_seed(0)
    fast = make(shape, 10)
    plain = copy.deepcopy(fast)
    for name, m in list(plain.named_modules()):
        if type(m) is MaxPool2d:
            parent = plain.get_submodule(name.rpartition(".")[0])
            setattr(parent, name.rpartition(".")[2], nn.MaxPool2d(m.kernel_size))
    assert sum(type(m) is MaxPool2d for m in fast.modules()) >= 2
    assert not any(type(m) is MaxPool2d for m in plain.modules())
    x = torch.rand(96, *shape)
    x[:, :, : shape[1] // 3, :] = 1.0  # flat regions: equal activations, ties in the pools
    y = torch.randint(0, 10, (96,))
    for model in (fast, plain):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for s in range(0, 96, 32):
            opt.zero_grad()
            F.cross_entropy(model(x[s : s + 32]), y[s : s + 32]).backward()
            opt.step()
    for (name, p), q in zip(fast.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert fast.state_dict().keys() == plain.state_dict().keys()  # no state of its own


def test_the_stacked_chain_kernel_still_reads_the_cnns_pools() -> None:
    """The GPU cohort trainer's kernel recognises this pool as a max pool (and a user's subclass of
    ``nn.MaxPool2d``, whose forward may differ, still not)."""
    for model in (small_cnn((3, 32, 32), 10), kws_cnn((1, 24, 32), 10)):
        found = _chain_of(model)
        layers = _layers(found) if found is not None else None
        assert layers is not None and [layer.kind for layer in layers].count("pool") >= 2

    class Custom(nn.MaxPool2d):
        pass

    model = small_cnn((3, 32, 32), 10)
    model.features[2] = Custom(2)
    found = _chain_of(model)
    assert found is not None and _layers(found) is None


def test_the_engine_benchmarks_bare_loop_pools_with_torchs_own_module() -> None:
    """The bare loop is the loop a user would write: torch's ``nn.MaxPool2d``, same parameters."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import engine_speed
    finally:
        sys.path.pop(0)
    model = small_cnn((3, 32, 32), 10)
    x = torch.rand(4, 3, 32, 32)
    before = model(x)
    engine_speed.plain_pools(model)
    pools = [m for m in model.modules() if isinstance(m, nn.MaxPool2d)]
    assert len(pools) == 2 and all(type(m) is nn.MaxPool2d for m in pools)
    assert torch.equal(model(x), before)

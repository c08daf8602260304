"""A hand-written stacked forward and backward for chains of Flatten / Linear / ReLU / Conv2d /
MaxPool2d: the MLP, the small CNN and the FeLiX authors' CNN.

functorch's ``vmap(grad(...))`` costs a few milliseconds per call in Python and dispatch (pytree
flattening, batching rules, a fresh autograd graph per call, copies between its physical layouts):
on a CPU more than the arithmetic of one step of ten MLP clients, and on a GPU the whole of a
cohort step, whose kernels take far less. For a model that is a chain of these layers
the cohort trainer uses this kernel instead. It issues the very operations vmap's batching rules
produce for such a chain:

- ``Linear``: ``bmm`` against the transposed weight with the bias added after; ``bmm`` for the input
  and weight gradients and a sum over the batch for the bias;
- ``Conv2d``: one grouped convolution (the clients' input channels side by side, ``groups`` = the
  number of clients) without bias, the bias added after; ``convolution_backward`` with the same
  grouping for the input and weight gradients, and the bias gradient as a sum over batch and space;
- ``MaxPool2d``: ``max_pool2d_with_indices`` and its backward on the same grouped layout;
- ``ReLU``: ``relu`` and ``threshold_backward``.

So every gradient, per-sample loss and logit is bit-identical to the vmap path: :meth:`StackedChain.of`
checks that on a probe input before the trainer relies on it (on the device it will train on), and
tests/test_cohort.py checks it for every objective.

The plain objective's masked cross-entropy has a hand-written backward too (:func:`masked_ce_grad`);
any other objective's loss (``Objective.loss``, written for one client) runs under ``vmap``,
forward only, on the stacked logits, and autograd differentiates it with respect to the logits
(:func:`autograd_head`), a graph of a few element-wise operations.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from felix.client.pooling import MaxPool2d

log = logging.getLogger("felix.cohort")

Aux = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # per-sample losses [K, B], loss [K], statistic [K]
# The objective's loss on stacked logits and its gradient: (logits, y, mask, extra) -> (d loss / d logits, aux)
# (``mask`` ``None``: every sample of the batch is real, so the products with a mask of ones can be left out)
HeadGrad = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]], tuple[torch.Tensor, Aux]
]


def masked_ce_grad(
    logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, extra: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, Aux]:
    """The plain objective's masked-mean cross-entropy of every client, and its gradient with respect
    to the logits, with no autograd graph: the forward and backward operations autograd would run for
    ``cross_entropy`` (``log_softmax``, ``nll_loss``), the product with the mask, the sum and the
    division, in the same order (bit-identical; checked in :meth:`StackedChain.of`).

    ``mask`` ``None`` says every sample of the batch is real (most steps): the products with a mask
    of ones are then left out, and the mask's sums come from :func:`_full_batch`, made once by the
    same operations, so the result is the same bits as with a mask of ones."""
    K, B, C = logits.shape
    flat_y = y.flatten()
    logp = torch.log_softmax(logits.reshape(K * B, C), 1)
    # nll_loss's own forward (F.nll_loss's), whose total weight feeds its backward as in autograd:
    # a tensor already on the device, so a step makes no host-to-device copy (on a GPU, a stream sync).
    per, total_weight = torch.ops.aten.nll_loss_forward(logp, flat_y, None, 0, -100)
    per = per.view(K, B)
    if mask is None:
        msum, g_per = _full_batch(K, B, logits.device)
        loss = per.sum(1) / msum
    else:
        msum = mask.sum(1)
        loss = (per * mask).sum(1) / msum
        g_per = ((torch.ones_like(loss) / msum).unsqueeze(1).expand(K, B) * mask).reshape(K * B)
    g_logp = torch.ops.aten.nll_loss_backward(g_per, logp, flat_y, None, 0, -100, total_weight)
    g = torch.ops.aten._log_softmax_backward_data(g_logp, logp, 1, logits.dtype)
    return g.view(K, B, C), (per, loss, loss)


@functools.lru_cache(maxsize=512)
def _ones(K: int, B: int, device: torch.device) -> torch.Tensor:
    """A mask of ones ``[K, B]``, made once per shape (read only)."""
    return torch.ones(K, B, device=device)


@functools.lru_cache(maxsize=512)
def _full_batch(K: int, B: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`masked_ce_grad`'s mask sums ``[K]`` and loss gradient ``[K * B]`` for a mask of ones,
    computed by the masked path's own operations (so the same bits), once per shape."""
    mask = _ones(K, B, device)
    msum = mask.sum(1)
    g_per = (torch.ones(K, device=device) / msum).unsqueeze(1).expand(K, B) * mask
    return msum, g_per.reshape(K * B)


def autograd_head(head: Callable[..., tuple[torch.Tensor, Aux]]) -> HeadGrad:
    """A head gradient for any objective: ``head`` (a vmapped per-client loss returning
    ``(loss [K], aux)``) differentiated by autograd with respect to the stacked logits."""

    def head_grad(
        logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, extra: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Aux]:
        if mask is None:
            mask = _ones(logits.shape[0], logits.shape[1], logits.device)
        leaf = logits.detach().requires_grad_()
        with torch.enable_grad():
            loss, aux = head(leaf, y, mask, extra)
            (g,) = torch.autograd.grad(loss.sum(), leaf)
        return g, aux

    return head_grad


Pair = tuple[int, int]


def _pair(v: int | tuple[int, ...]) -> Pair:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


@dataclass(frozen=True)
class _Layer:
    """One layer of a chain. ``grouped``: its input is in the grouped image layout ``[B, K*C, H, W]``
    (after a convolution) rather than stacked ``[K, B, ...]``."""

    kind: str  # "flatten" | "linear" | "relu" | "conv" | "pool"
    weight: str = ""
    bias: str | None = None
    grouped: bool = False
    stride: Pair = (1, 1)
    padding: Pair = (0, 0)
    dilation: Pair = (1, 1)
    kernel: Pair = (1, 1)  # the pool's window
    ceil_mode: bool = False


def _chain_of(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The layers that are ``model``'s whole forward pass, in order, each with its parameter-name
    prefix; ``None`` when the model does not say.

    Only what a model states is trusted, since a module's ``forward`` cannot be read: an
    ``nn.Sequential`` itself, or a model that declares ``sequential_forward``: the name of one
    attribute (its forward is ``self.<attribute>(x)``, as felix's ``mlp`` does) or a tuple of names
    applied in turn (``("features", "classifier")``: its forward is
    ``self.classifier(self.features(x))``), each an ``nn.Sequential`` or a single layer."""
    if type(model) is nn.Sequential:
        return [(f"{i}.", m) for i, m in enumerate(model)]
    attr = getattr(type(model), "sequential_forward", None)
    names = (attr,) if isinstance(attr, str) else attr
    if not isinstance(names, tuple) or not names or not all(isinstance(n, str) for n in names):
        return None
    layers: list[tuple[str, nn.Module]] = []
    for name in names:
        part = getattr(model, name, None)
        if type(part) is nn.Sequential:
            layers += [(f"{name}.{i}.", m) for i, m in enumerate(part)]
        elif isinstance(part, nn.Module):
            layers.append((f"{name}.", part))
        else:
            return None
    return layers


def _layers(chain: list[tuple[str, nn.Module]]) -> list[_Layer] | None:
    """The chain as kernel layers, or ``None`` if any layer is one the kernel does not handle."""
    layers: list[_Layer] = []
    grouped = False
    for prefix, m in chain:
        if type(m) is nn.Flatten and m.start_dim == 1 and m.end_dim == -1:
            layers.append(_Layer("flatten", grouped=grouped))
            grouped = False
        elif type(m) is nn.Linear and not grouped:
            layers.append(_Layer("linear", f"{prefix}weight", None if m.bias is None else f"{prefix}bias"))
        elif type(m) is nn.ReLU:
            layers.append(_Layer("relu", grouped=grouped))
        elif (
            type(m) is nn.Conv2d
            and m.groups == 1
            and m.padding_mode == "zeros"
            and not isinstance(m.padding, str)
            and (grouped or not layers or all(layer.kind == "relu" for layer in layers))
        ):
            layers.append(
                _Layer(
                    "conv",
                    f"{prefix}weight",
                    None if m.bias is None else f"{prefix}bias",
                    grouped=grouped,
                    stride=_pair(m.stride),
                    padding=_pair(m.padding),  # type: ignore[arg-type]
                    dilation=_pair(m.dilation),
                )
            )
            grouped = True
        elif (
            isinstance(m, nn.MaxPool2d)
            and type(m) in (nn.MaxPool2d, MaxPool2d)
            and grouped
            and not m.return_indices
        ):
            layers.append(
                _Layer(
                    "pool",
                    grouped=True,
                    kernel=_pair(m.kernel_size),
                    stride=_pair(m.stride if m.stride is not None else m.kernel_size),
                    padding=_pair(m.padding),
                    dilation=_pair(m.dilation),
                    ceil_mode=m.ceil_mode,
                )
            )
        else:
            return None
    if grouped or not any(layer.kind == "linear" for layer in layers):
        return None  # the logits must come out of a Linear, stacked [K, B, classes]
    return layers


class StackedChain:
    """The stacked kernel for one model; build it with :meth:`of` (``None`` when it does not apply)."""

    def __init__(self, layers: list[_Layer], head: HeadGrad) -> None:
        self.layers = layers
        self.head = head
        # Linear and ReLU only: each sample's logits are its own row of the products, whichever
        # samples share a batch (the cohort probe packs samples of many clients into one).
        self.dense = all(layer.kind in ("flatten", "linear", "relu") for layer in layers)
        # The first layer with parameters needs no input gradient.
        self._first_param = next(i for i, layer in enumerate(layers) if layer.kind in ("linear", "conv"))

    @classmethod
    def of(
        cls, model: nn.Module, head: HeadGrad, sample_shape: tuple[int, ...] | None = None
    ) -> StackedChain | None:
        """The kernel for ``model`` if it is a chain the kernel handles and it reproduces the vmap
        path bit for bit on the model's device (else ``None``: use vmap). A chain with convolutions
        needs ``sample_shape`` (one sample's, e.g. ``(3, 32, 32)``) for that check."""
        found = _chain_of(model)
        layers = _layers(found) if found is not None else None
        if found is None or layers is None:
            return None
        if sample_shape is None:
            if any(layer.kind == "conv" for layer in layers):
                return None
            first = next(m for _, m in found if type(m) is nn.Linear)
            sample_shape = (first.in_features,)
        chain = cls(layers, head)
        classes = next(m for _, m in reversed(found) if type(m) is nn.Linear).out_features
        try:
            same = _bit_identical(chain, model, tuple(sample_shape), classes)
        except RuntimeError as e:  # e.g. a sample shape the model's layers do not fit
            log.info("stacked-chain kernel: its check failed (%s); training with vmap", e)
            return None
        if same:
            return chain
        log.info("stacked-chain kernel: not bit-identical to vmap on this device; training with vmap")
        return None

    def bind(self, params: dict[str, torch.Tensor]) -> Bound:
        """``params`` (stacked ``[K, ...]``) with the views its products read, for reuse over steps."""
        weights: list[torch.Tensor | None] = []
        biases: list[torch.Tensor | None] = []
        for layer in self.layers:
            b = None if layer.bias is None else params[layer.bias]
            if layer.kind == "linear":
                weights.append(params[layer.weight].transpose(1, 2))
                biases.append(None if b is None else b.unsqueeze(1))
            elif layer.kind == "conv":
                weights.append(params[layer.weight])  # grouped at each use (see Bound)
                biases.append(b)
            else:
                weights.append(None)
                biases.append(None)
        return Bound(params, weights, biases)

    def _run(
        self, bound: Bound, x: torch.Tensor, keep: bool = True
    ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """Every layer's input, then the logits, and by layer what the backward reads besides them
        (a pool's argmax indices, a convolution's grouped weight): ``x`` is ``[K, B, ...]``,
        parameters ``[K, ...]``. With ``keep`` false (a forward pass alone) only the logits come
        back and each activation is freed once the next is made, as in vmap's forward: a probe's
        stacked batch (256 samples of up to 64 clients) would otherwise hold every layer's
        activations at once."""
        K, B = x.shape[0], x.shape[1]
        acts = [x]
        saved: dict[int, torch.Tensor] = {}
        h = x
        for i, layer in enumerate(self.layers):
            w, b = bound.weights[i], bound.biases[i]
            if layer.kind == "flatten":
                # [B, K*C, H, W] -> [K, B, C*H*W] (a view: the products read it strided)
                h = h.reshape(B, K, -1).transpose(0, 1) if layer.grouped else h.flatten(2)
            elif layer.kind == "linear":
                h = torch.bmm(h, w)  # type: ignore[arg-type]
                if b is not None:
                    h = h + b
            elif layer.kind == "conv":
                if not layer.grouped:  # [K, B, C, H, W] -> [B, K*C, H, W]
                    h = h.movedim(0, 1).reshape(B, K * h.shape[2], *h.shape[3:])
                    if keep:
                        acts[i] = h
                grouped = w.flatten(0, 1)  # type: ignore[union-attr]
                if keep:
                    saved[i] = grouped
                h = torch.ops.aten.convolution(
                    h, grouped, None, layer.stride, layer.padding, layer.dilation, False, [0, 0], K
                )
                if b is not None:  # [B, K*out, H, W] + [K, out] per client, through views
                    h = (h.unflatten(1, b.shape) + b[None, :, :, None, None]).flatten(1, 2)
            elif layer.kind == "pool":
                pool = (layer.kernel, layer.stride, layer.padding, layer.dilation, layer.ceil_mode)
                if keep:
                    h, saved[i] = torch.ops.aten.max_pool2d_with_indices(h, *pool)
                else:  # the same maxima, without the indices a backward needs
                    h = torch.ops.aten.max_pool2d(h, *pool)
            else:
                h = torch.relu(h)
            if keep:
                acts.append(h)
        return (acts if keep else [h]), saved

    def forward(self, params: dict[str, torch.Tensor] | Bound, x: torch.Tensor) -> torch.Tensor:
        """Stacked logits ``[K, B, classes]`` (the vmapped ``functional_call``'s)."""
        bound = params if isinstance(params, Bound) else self.bind(params)
        return self._run(bound, x, keep=False)[0][-1]

    @torch.no_grad()
    def grad(
        self,
        params: dict[str, torch.Tensor] | Bound,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        extra: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], Aux]:
        """Every client's gradient of its own batch loss, as ``vmap(grad(loss, has_aux=True))``;
        ``mask`` ``None``: every sample is real."""
        K, B = x.shape[0], x.shape[1]
        bound = params if isinstance(params, Bound) else self.bind(params)
        acts, saved = self._run(bound, x)
        g, aux = self.head(acts[-1], y, mask, extra)
        grads: dict[str, torch.Tensor] = {}
        for i in range(len(self.layers) - 1, self._first_param - 1, -1):
            layer, inp = self.layers[i], acts[i]
            if layer.kind == "linear":
                grads[layer.weight] = torch.bmm(g.transpose(1, 2), inp)
                if layer.bias is not None:
                    grads[layer.bias] = g.sum(1)
                if i > self._first_param:
                    g = torch.bmm(g, bound.params[layer.weight])
            elif layer.kind == "conv":
                w = bound.params[layer.weight]
                if layer.bias is not None:  # vmap's: a sum of the batched gradient over batch and space
                    grads[layer.bias] = g.view(B, K, -1, *g.shape[2:]).sum((0, 3, 4))
                gi, gw, _ = torch.ops.aten.convolution_backward(
                    g,
                    inp,
                    saved[i],
                    None,
                    layer.stride,
                    layer.padding,
                    layer.dilation,
                    False,
                    [0, 0],
                    K,
                    [i > self._first_param, True, False],
                )
                grads[layer.weight] = gw.view(w.shape)
                g = gi
            elif layer.kind == "pool":
                g = torch.ops.aten.max_pool2d_with_indices_backward(
                    g,
                    inp,
                    layer.kernel,
                    layer.stride,
                    layer.padding,
                    layer.dilation,
                    layer.ceil_mode,
                    saved[i],
                )
            elif layer.kind == "relu":
                g = torch.ops.aten.threshold_backward(g, acts[i + 1], 0)
            else:  # flatten
                g = g.transpose(0, 1).reshape(inp.shape) if layer.grouped else g.view(inp.shape)
        return grads, aux


@dataclass(frozen=True)
class Bound:
    """A stack's parameters with the views its products read (each Linear's transposed weight and
    broadcastable bias, each convolution's stacked weight and bias), by layer. They
    are views, so the optimiser's in-place steps show through: the cohort trainer binds once per
    stack shape instead of making these views again at every step (each view is one more dispatched
    operation, and a small model's step on a CPU is dozens of them). A convolution's weight is
    grouped (``[K * out, in, kh, kw]``) once per step, for the forward and the backward, and its bias
    is added through views: the cohort trainer's stacked parameters are column blocks of one flat
    buffer, where such a grouping is a copy, which would not see the steps."""

    params: dict[str, torch.Tensor]
    weights: list[torch.Tensor | None]
    biases: list[torch.Tensor | None]


def _bit_identical(
    chain: StackedChain, model: nn.Module, sample_shape: tuple[int, ...], classes: int
) -> bool:
    """Whether ``chain`` with :func:`masked_ce_grad` reproduces ``vmap(grad(...))`` of ``model`` and
    the plain objective bit for bit (a padded batch, three perturbed copies of the weights). Seeded
    by its own generator, so checking leaves the global random stream, and with it the run,
    untouched."""
    gen = torch.Generator().manual_seed(0)
    names = [n for n, _ in model.named_parameters()]
    params = {
        n: p.detach().cpu().unsqueeze(0).repeat(3, *[1] * p.dim())
        + 0.01 * torch.randn(3, *p.shape, generator=gen)
        for n, p in model.named_parameters()
    }
    dev = next(model.parameters()).device
    params = {n: t.to(dev) for n, t in params.items()}
    x = torch.randn(3, 5, *sample_shape, generator=gen).to(dev)
    y = torch.randint(0, classes, (3, 5), generator=gen).to(dev)
    mask = torch.ones(3, 5, device=dev)
    mask[1, 3:] = 0

    def loss(
        p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, m: torch.Tensor
    ) -> tuple[torch.Tensor, Aux]:
        per = F.cross_entropy(functional_call(model, p, (x,)), y, reduction="none")
        value = (per * m).sum() / m.sum()
        return value, (per, value, value)

    want, want_aux = vmap(grad(loss, has_aux=True))(params, x, y, mask)
    got, got_aux = StackedChain(chain.layers, masked_ce_grad).grad(params, x, y, mask, {})
    return all(torch.equal(got[n], want[n]) for n in names) and all(
        torch.equal(a, b) for a, b in zip(got_aux, want_aux)
    )

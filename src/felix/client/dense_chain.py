"""A hand-written stacked forward and backward for dense chains (Flatten / Linear / ReLU).

On a CPU, functorch's ``vmap(grad(...))`` costs a couple of milliseconds per call in Python and
dispatch (pytree flattening, batching rules, a fresh autograd graph per call): more than the
arithmetic of one step of ten MLP clients (issue 10). For a model that is a plain chain of these
three layers the cohort trainer uses this kernel instead (on a GPU too: fewer, larger launches). It issues the very operations vmap's
batching rules produce for such a chain: ``bmm`` against the transposed weight with the bias added
after, ``bmm`` for the input and weight gradients, a sum over the batch for the bias, and
``threshold_backward`` for ReLU. So every gradient, per-sample loss and logit is bit-identical to the
vmap path; :meth:`DenseChain.of` checks that on a probe input before the trainer relies on it,
and tests/test_cohort.py checks it for every objective.

The plain objective's masked cross-entropy has a hand-written backward too (:func:`masked_ce_grad`);
any other objective's loss (``Objective.cohort_loss``, written for one client) runs under ``vmap``,
forward only, on the stacked logits, and autograd differentiates it with respect to the logits
(:func:`autograd_head`), a graph of a few element-wise operations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

log = logging.getLogger("felix.cohort")

Aux = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # per-sample losses [K, B], loss [K], statistic [K]
# The objective's loss on stacked logits and its gradient: (logits, y, mask, extra) -> (d loss / d logits, aux)
HeadGrad = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, Aux]
]


def masked_ce_grad(
    logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, extra: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, Aux]:
    """The plain objective's masked-mean cross-entropy of every client, and its gradient with respect
    to the logits, with no autograd graph: the forward and backward operations autograd would run for
    ``cross_entropy`` (``log_softmax``, ``nll_loss``), the product with the mask, the sum and the
    division, in the same order (bit-identical; checked in :meth:`DenseChain.of`)."""
    K, B, C = logits.shape
    flat_y = y.flatten()
    logp = torch.log_softmax(logits.reshape(K * B, C), 1)
    per = F.nll_loss(logp, flat_y, reduction="none").view(K, B)
    msum = mask.sum(1)
    loss = (per * mask).sum(1) / msum
    g_per = (torch.ones_like(loss) / msum).unsqueeze(1).expand(K, B) * mask
    g_logp = torch.ops.aten.nll_loss_backward(
        g_per.reshape(K * B), logp, flat_y, None, 0, -100, torch.tensor(float(K * B), device=logits.device)
    )
    g = torch.ops.aten._log_softmax_backward_data(g_logp, logp, 1, logits.dtype)
    return g.view(K, B, C), (per, loss, loss)


def autograd_head(head: Callable[..., tuple[torch.Tensor, Aux]]) -> HeadGrad:
    """A head gradient for any objective: ``head`` (a vmapped per-client loss returning
    ``(loss [K], aux)``) differentiated by autograd with respect to the stacked logits."""

    def head_grad(
        logits: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, extra: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Aux]:
        leaf = logits.detach().requires_grad_()
        with torch.enable_grad():
            loss, aux = head(leaf, y, mask, extra)
            (g,) = torch.autograd.grad(loss.sum(), leaf)
        return g, aux

    return head_grad


@dataclass(frozen=True)
class _Layer:
    kind: str  # "flatten" | "linear" | "relu"
    weight: str = ""
    bias: str | None = None


def _chain_of(model: nn.Module) -> tuple[str, nn.Sequential] | None:
    """The ``nn.Sequential`` that is ``model``'s whole forward pass, with its parameter-name prefix.

    Only two shapes are trusted, since a module's ``forward`` cannot be read: an ``nn.Sequential``
    itself, or a model that declares ``sequential_forward = "<attribute>"`` (its forward is
    ``self.<attribute>(x)``, as felix's ``mlp`` does)."""
    if type(model) is nn.Sequential:
        return "", model
    attr = getattr(type(model), "sequential_forward", None)
    if isinstance(attr, str):
        inner = getattr(model, attr, None)
        if type(inner) is nn.Sequential:
            return f"{attr}.", inner
    return None


class DenseChain:
    """The stacked kernel for one model; build it with :meth:`of` (``None`` when it does not apply)."""

    def __init__(self, layers: list[_Layer], head: HeadGrad) -> None:
        self.layers = layers
        self.head = head
        # The first layer with parameters needs no input gradient.
        self._first_param = next(i for i, layer in enumerate(layers) if layer.kind == "linear")

    @classmethod
    def of(cls, model: nn.Module, head: HeadGrad) -> DenseChain | None:
        """The kernel for ``model`` if it is a chain of ``Flatten(1, -1)``, ``Linear`` and ``ReLU``
        and it reproduces the vmap path bit for bit on this machine (else ``None``: use vmap)."""
        found = _chain_of(model)
        if found is None:
            return None
        prefix, seq = found
        layers: list[_Layer] = []
        for i, m in enumerate(seq):
            if type(m) is nn.Flatten and m.start_dim == 1 and m.end_dim == -1:
                layers.append(_Layer("flatten"))
            elif type(m) is nn.Linear:
                layers.append(
                    _Layer("linear", f"{prefix}{i}.weight", None if m.bias is None else f"{prefix}{i}.bias")
                )
            elif type(m) is nn.ReLU:
                layers.append(_Layer("relu"))
            else:
                return None
        linears = [m for m in seq if type(m) is nn.Linear]
        if not linears:
            return None
        chain = cls(layers, head)
        if _bit_identical(chain, model, linears[0].in_features, linears[-1].out_features):
            return chain
        log.info("dense-chain kernel: not bit-identical to vmap on this device; training with vmap")
        return None

    def _run(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's input, then the logits: ``x`` is ``[K, B, ...]``, parameters ``[K, ...]``."""
        acts = [x]
        h = x
        for layer in self.layers:
            if layer.kind == "flatten":
                h = h.flatten(2)
            elif layer.kind == "linear":
                h = torch.bmm(h, params[layer.weight].transpose(1, 2))
                if layer.bias is not None:
                    h = h + params[layer.bias].unsqueeze(1)
            else:
                h = torch.relu(h)
            acts.append(h)
        return acts

    def forward(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Stacked logits ``[K, B, classes]`` (the vmapped ``functional_call``'s)."""
        return self._run(params, x)[-1]

    @torch.no_grad()
    def grad(
        self,
        params: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor,
        extra: dict[str, torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], Aux]:
        """Every client's gradient of its own batch loss, as ``vmap(grad(loss, has_aux=True))``."""
        acts = self._run(params, x)
        g, aux = self.head(acts[-1], y, mask, extra)
        grads: dict[str, torch.Tensor] = {}
        for i in range(len(self.layers) - 1, self._first_param - 1, -1):
            layer, inp = self.layers[i], acts[i]
            if layer.kind == "linear":
                grads[layer.weight] = torch.bmm(g.transpose(1, 2), inp)
                if layer.bias is not None:
                    grads[layer.bias] = g.sum(1)
                if i > self._first_param:
                    g = torch.bmm(g, params[layer.weight])
            elif layer.kind == "relu":
                g = torch.ops.aten.threshold_backward(g, acts[i + 1], 0)
            else:
                g = g.view(inp.shape)
        return grads, aux


def _bit_identical(chain: DenseChain, model: nn.Module, in_features: int, classes: int) -> bool:
    """Whether ``chain`` with :func:`masked_ce_grad` reproduces ``vmap(grad(...))`` of ``model`` and
    the plain objective bit for bit (a padded batch, three perturbed copies of the weights). Seeded
    by its own generator, so checking leaves the global random stream, and with it the run,
    untouched."""
    gen = torch.Generator().manual_seed(0)
    names = [n for n, _ in model.named_parameters()]
    params = {
        n: p.detach().unsqueeze(0).repeat(3, *[1] * p.dim()) + 0.01 * torch.randn(3, *p.shape, generator=gen)
        for n, p in model.named_parameters()
    }
    params = {n: t.to(next(model.parameters()).device) for n, t in params.items()}
    dev = params[names[0]].device
    x = torch.randn(3, 5, in_features, generator=gen).to(dev)
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
    got, got_aux = DenseChain(chain.layers, masked_ce_grad).grad(params, x, y, mask, {})
    return all(torch.equal(got[n], want[n]) for n in names) and all(
        torch.equal(a, b) for a, b in zip(got_aux, want_aux)
    )

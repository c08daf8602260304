"""One forward pass over the test set per evaluated model, read by every measure of it.

A run judges a model version in up to three ways: its accuracy and loss (every evaluation), the
per-class accuracies and losses a stream reweights to the current class mix
(``felix.metrics.freshness``), and the confusion matrix of the per-client measures
(``felix.metrics.per_client``). Each used to run its own pass over the test set, with its own
copy of the model. Here one pass keeps the logits of the version last evaluated, and each measure
reads them: a version evaluated for its accuracy and then for the per-client measures costs one
pass, and every measure sees the same logits.

The pass runs on one thread when the model's single-client work does
(``felix.client.trainer.thread_invariant``): MKL rounds the test set's products differently on
two threads, and a last-bit change of a logit can flip a tied prediction and so the time to a
target; on one thread the evaluation gives the same bits at any ``run.threads``.

With ``run.workers`` (:meth:`TestPass.spread`) the batches are shared out over the workers, each
forwarding whole batches on its own copy of the model and one thread, and the sums are added up
batch by batch in order afterwards as before: a batch's logits do not depend on which worker
computed them, so the evaluation gives the bits of one worker on one thread (accuracy is a count;
the loss is summed in the same order).
"""

from __future__ import annotations

import copy
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import NDArray

from felix.client.trainer import autocast, one_thread, thread_invariant
from felix.client.weights import ModelWeights, weights_for
from felix.client.workers import Workers
from felix.metrics.classification import confusion_matrix

__all__ = ["LabelledSet", "TestPass"]


class LabelledSet(Protocol):
    """A test set as the evaluators read it (``felix.scenario.datasets.ArrayDataset`` is one): the
    metrics layer needs its tensors, not the scenario layer that loads them."""

    x: torch.Tensor  # N x sample shape
    y: torch.Tensor  # int64 labels, N

    def __len__(self) -> int: ...

    @property
    def num_classes(self) -> int: ...


class TestPass:
    """The logits of the test set under a model's weights, one pass per distinct weights.

    ``model`` must carry its factory's buffers: a parameters-only vector (``client.buffers:
    local``) is evaluated with them. The test set is copied to ``device`` once."""

    __test__ = False  # not a pytest class, whatever its name

    def __init__(
        self,
        model: torch.nn.Module,
        test: LabelledSet,
        device: str,
        batch_size: int = 1000,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model.to(device)
        self.test = test
        self.device = device
        self.batch_size = batch_size
        self.autocast_dtype = autocast_dtype
        self.x, self.y = test.x.to(device), test.y.to(device)
        self.num_classes = test.num_classes
        self.single_thread = thread_invariant(self.model, device)
        self._models = [self.model]  # one per worker (spread): each forwards whole batches
        self._workers: Workers | None = None
        self._layouts: dict[tuple[int, int], ModelWeights] = {}  # by (worker, vector size)
        self._weights: np.ndarray | None = None  # the weights the kept logits belong to
        self._logits: list[torch.Tensor] = []  # per batch of ``batch_size`` test samples
        self.passes = 0  # forward passes run (a measure of the sharing)

    def __len__(self) -> int:
        return len(self.test)

    def spread(self, workers: Workers) -> None:
        """Forward the test batches on ``workers`` (``run.workers``), each worker on its own copy of
        the model. Each worker forwards on one thread: the bits of ``run.threads`` 1, as for every
        piece of a run on workers."""
        self._workers = workers
        self._models = [self.model, *(copy.deepcopy(self.model) for _ in range(workers.n - 1))]

    def batches(self, weights: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(logits, labels)`` per test batch under ``weights``: the kept ones when ``weights``
        are those of the last pass, else a new pass."""
        w = np.asarray(weights)
        if self._weights is None or not np.array_equal(self._weights, w):
            self._logits = self._forward(w)
            self._weights = np.array(w, copy=True)
            self.passes += 1
        bs = self.batch_size
        return [(lg, self.y[k * bs : (k + 1) * bs]) for k, lg in enumerate(self._logits)]

    @torch.no_grad()
    def _forward(self, weights: np.ndarray) -> list[torch.Tensor]:
        flat = torch.from_numpy(np.array(weights, dtype=np.float32)).to(self.device)
        for w, model in enumerate(self._models):  # read-only in a forward pass: one vector for all
            key = (w, int(flat.numel()))
            if key not in self._layouts:
                self._layouts[key] = weights_for(model, key[1])
            self._layouts[key].load(flat)
            self._layouts[key].set_kept(None)
            model.eval()
        starts = range(0, len(self.test), self.batch_size)
        if self._workers is None:
            return [self._batch(0, s) for s in starts]
        return self._workers.map(self._batch, starts)

    def _batch(self, worker: int, start: int) -> torch.Tensor:
        """The logits of the test batch at ``start`` on ``worker``'s model (grad mode is per thread)."""
        with torch.no_grad(), one_thread(self.single_thread), autocast(self.device, self.autocast_dtype):
            return self._models[worker](self.x[start : start + self.batch_size]).float()

    def accuracy_loss(self, weights: np.ndarray) -> tuple[float, float]:
        """The test accuracy and mean cross-entropy loss (the sums kept on the device)."""
        correct = torch.zeros((), dtype=torch.long, device=self.device)
        loss = torch.zeros((), device=self.device)
        with one_thread(self.single_thread):
            for logits, yb in self.batches(weights):
                loss += F.cross_entropy(logits, yb, reduction="sum")
                correct += (logits.argmax(1) == yb).sum()
        return int(correct.cpu()) / len(self.test), float(loss.cpu()) / len(self.test)

    def per_class(self, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The accuracy and mean loss on each class's test samples (NaN for a class with none)."""
        c = self.num_classes
        correct = torch.zeros(c, dtype=torch.float64, device=self.device)
        loss = torch.zeros(c, dtype=torch.float64, device=self.device)
        with one_thread(self.single_thread):
            for logits, yb in self.batches(weights):
                per = F.cross_entropy(logits, yb, reduction="none").double()
                correct += torch.bincount(yb, weights=(logits.argmax(1) == yb).double(), minlength=c)
                loss += torch.bincount(yb, weights=per, minlength=c)
        counts = torch.bincount(self.y, minlength=c).double().cpu().numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            return correct.cpu().numpy() / counts, loss.cpu().numpy() / counts

    def confusion(self, weights: np.ndarray) -> NDArray[np.int64]:
        """The confusion matrix (true class x predicted class)."""
        preds = torch.cat([logits.argmax(1).cpu() for logits, _ in self.batches(weights)])
        return confusion_matrix(self.test.y.numpy(), preds.numpy(), self.num_classes)

"""``run.executor: ray``: one simulated run's cohorts spread over Ray actors.

The engine hands a cohort of training (or eval) tasks to its cohort executor and waits for the
updates (:class:`felix.sim.simulation.CohortExecutor`). The local executor is the in-process
:class:`~felix.client.cohort.CohortTrainer`; this one splits each cohort into shares, one per actor
(one per GPU, or per ``run.threads`` CPUs), and each actor trains its share with its own
``CohortTrainer``. What travels:

- the clients' data once: put in the object store at start and handed to every actor, which keeps
  it (a client whose data is replaced by augmentation goes through the object store once, by identity);
- each model version's weights (and any read-only aux array, e.g. SCAFFOLD's server control) once:
  put in the object store the first time a task carries them, fetched once by each actor that needs
  them and cached there; a task spec names them by key;
- per task a small spec: client index, key of its weights and aux, and its generator's seed;
- per task back: its update and its client's new objective state.

Results are bit-identical to the local cohort path for the same seed: the tasks get the same
generators, and the cohort trainer's arithmetic for one client does not depend on which other
clients share its vectorised pass (checked on CPU at one thread, tests/test_cohort_executor.py),
so training a share on each actor gives each client the update the whole cohort gives it. On a GPU
batched kernels may pick another algorithm for another batch count; there identity is to be
checked, not assumed (docs/ray.md).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from felix.client.cohort import CohortTask, CohortTrainer
from felix.client.schedule import task_steps
from felix.client.trainer import ClientData, TrainConfig
from felix.config import ConfigError
from felix.core.types import ClientUpdate
from felix.distributed.ray_runtime import session
from felix.strategies.objectives import Objective

log = logging.getLogger("felix.ray")

CACHED_ARRAYS = 16  # model versions (and aux arrays) kept in the object store / on each actor
PROBE_BATCH = 256  # CohortTrainer.probe's default chunk


@dataclass(frozen=True)
class Ref:
    """A large value by key: the actor takes it from its cache, or fetches it by the object reference
    that comes with the call under the same key."""

    key: int


@dataclass(frozen=True)
class TaskSpec:
    """One training task as an actor receives it: small, everything large named by key."""

    data: int | Ref  # index into the actor's client data, or a replaced (augmented) client's data
    weights: Ref
    aux: dict[str, Ref | np.ndarray]
    state: dict[str, Any]
    seed: int | torch.Tensor  # the generator's seed, or its whole state when it was already used


def generator_seed(g: torch.Generator) -> int | torch.Tensor:
    """``g``'s seed when it is fresh (the engine's case), else its state: an actor rebuilds the same generator."""
    seed = g.initial_seed()
    if torch.equal(torch.Generator().manual_seed(seed).get_state(), g.get_state()):
        return seed
    return g.get_state()


def make_generator(seed: int | torch.Tensor) -> torch.Generator:
    g = torch.Generator()
    if isinstance(seed, torch.Tensor):
        g.set_state(seed)
        return g
    return g.manual_seed(seed)


def split_shares(steps: list[int], shares: int) -> list[tuple[list[int], int]]:
    """Task indices per actor, each share in cohort order, and a *companion* per share: the index
    of a task the share trains too and throws away (-1: none needed).

    The cohort trainer stacks, at each step, the clients still stepping; a client alone in the stack
    takes another code path than one with company (a convolution of one group instead of grouped
    ones: not the same bits). In the whole cohort only the longest task is ever alone, from the
    step the second longest ends. A share keeps that pattern with a companion: a copy of its own
    longest task (so that task always has company), or, in the share holding the whole cohort's
    longest task, a copy of the cohort's second longest (so it is alone from the same step). Tasks
    go largest first to the least loaded share."""
    load = [0] * shares
    out: list[list[int]] = [[] for _ in range(shares)]
    for k in sorted(range(len(steps)), key=lambda k: -steps[k]):  # stable: ties keep cohort order
        a = min(range(shares), key=lambda a: load[a])
        out[a].append(k)
        load[a] += max(steps[k], 1)
    first, second = out[0][0], (sorted(range(len(steps)), key=lambda k: -steps[k]) + [-1])[1]
    result = []
    for share in out:
        if not share:
            continue
        if first in share:
            companion = -1 if second in share or second < 0 else second
        else:
            companion = share[0]
        result.append((sorted(share), companion))
    return result


class CohortActor:
    """One Ray actor: a cohort trainer, every client's data, and the arrays it has fetched."""

    def __init__(
        self,
        model: nn.Module,
        objective: Objective,
        cfg: TrainConfig,
        num_classes: int,
        device: str,
        autocast: torch.dtype | None,
        threads: int | None,
        datas: list[ClientData],
    ) -> None:
        if threads is not None:
            torch.set_num_threads(threads)  # the driver's thread count: the same arithmetic
        shape = tuple(datas[0].x.shape[1:]) if datas else None
        self.trainer = CohortTrainer(model, objective, cfg, num_classes, device, autocast, shape)
        self.datas = datas
        self.cache: OrderedDict[int, Any] = OrderedDict()  # arrays, the most recently used last
        self.replaced: dict[int, ClientData] = {}  # replaced clients' data, kept like the initial data

    def _resolve(self, refs: dict[int, Any]) -> None:
        import ray

        missing = [k for k in refs if k not in self.cache and k not in self.replaced]
        for k, v in zip(missing, ray.get([refs[k] for k in missing])):
            if isinstance(v, ClientData):
                self.replaced[k] = v
            else:
                self.cache[k] = v
        for k in refs:
            if k in self.cache:
                self.cache.move_to_end(k)
        while len(self.cache) > max(CACHED_ARRAYS, len(refs)):
            self.cache.popitem(last=False)

    def _value(self, v: Any) -> Any:
        return self.cache[v.key] if isinstance(v, Ref) else v

    def _data(self, d: int | Ref) -> ClientData:
        return self.datas[d] if isinstance(d, int) else self.replaced[d.key]

    def train(self, specs: list[TaskSpec], refs: dict[int, Any]) -> list[tuple[ClientUpdate, dict[str, Any]]]:
        self._resolve(refs)
        seen: set[int] = set()
        tasks = []
        for s in specs:  # a companion arrives as the same object as its task: it gets its own state
            state = s.state if id(s) not in seen else copy.deepcopy(s.state)
            seen.add(id(s))
            tasks.append(
                CohortTask(
                    self._value(s.weights),
                    self._data(s.data),
                    state,
                    {k: self._value(v) for k, v in s.aux.items()},
                    make_generator(s.seed),
                )
            )
        updates = self.trainer.train(tasks)
        return [(u, t.state) for u, t in zip(updates, tasks)]

    def ready(self) -> bool:
        return True

    def probe(self, specs: list[tuple[Ref, int | Ref]], refs: dict[int, Any]) -> list[ClientUpdate]:
        self._resolve(refs)
        return self.trainer.probe([self._value(w) for w, _ in specs], [self._data(d) for _, d in specs])


class RayCohortExecutor:
    """Trains the engine's cohorts on Ray actors; see the module docstring. ``close`` ends the actors
    (and a local Ray instance this executor started)."""

    def __init__(
        self,
        trainer: CohortTrainer,
        datas: list[ClientData],
        actors: int | None = None,
        address: str | None = None,
        threads: int | None = 1,
    ) -> None:
        self._stack = contextlib.ExitStack()
        self.ray = self._stack.enter_context(session(address))
        try:
            self._start(trainer, datas, actors, threads)
        except BaseException:
            self._stack.close()
            raise

    def _start(
        self, trainer: CohortTrainer, datas: list[ClientData], actors: int | None, threads: int | None
    ) -> None:
        gpu = trainer.device.type == "cuda"
        capacity = self.ray.cluster_resources()
        per_cpu = float(threads or 1)
        room = int(capacity.get("GPU", 0)) if gpu else int(capacity.get("CPU", 0) // per_cpu)
        actors = room if actors is None else actors
        if not 1 <= actors <= room:  # more would wait for resources forever
            raise ConfigError(
                f"run.executor ray: {actors} cohort actors of {'1 GPU' if gpu else f'{per_cpu:g} CPUs'} "
                f"each do not fit the Ray cluster ({capacity.get('GPU', 0):g} GPUs, "
                f"{capacity.get('CPU', 0):g} CPUs)"
            )
        self._ids: dict[int, int] = {id(d): k for k, d in enumerate(datas)}
        self._datas = datas  # keeps the indexed objects alive, so their ids stay theirs
        self._shipped: OrderedDict[int, tuple[Any, int, Any]] = OrderedDict()  # id(obj) -> (obj, key, ref)
        self._data_shipped: dict[int, tuple[ClientData, int, Any]] = {}
        self._keys = itertools.count()
        self.cfg = trainer.cfg
        model = copy.deepcopy(trainer.model).to("cpu")
        cls = self.ray.remote(CohortActor).options(num_cpus=per_cpu, num_gpus=1 if gpu else 0)
        data_ref = self.ray.put(datas)
        self.actors = [
            cls.remote(
                model,
                trainer.objective,
                trainer.cfg,
                trainer.num_classes,
                "cuda" if gpu else str(trainer.device),
                trainer.autocast,
                threads,
                data_ref,
            )
            for _ in range(actors)
        ]
        self.ray.get([a.ready.remote() for a in self.actors])  # started (or failed) before the run, not in it
        log.info(
            "run.executor ray: %d cohort actors (%s each)", actors, "1 GPU" if gpu else f"{per_cpu:g} CPUs"
        )

    # ------------------------------------------------------------------ what travels
    def _array(self, a: np.ndarray, refs: dict[int, Any]) -> Ref | np.ndarray:
        """A read-only array (a model version, the server's aux) by key, put once; a writable one by value."""
        if a.flags.writeable:
            return a
        hit = self._shipped.get(id(a))
        if hit is None or hit[0] is not a:
            hit = (a, next(self._keys), self.ray.put(a))
            self._shipped[id(a)] = hit
            while len(self._shipped) > CACHED_ARRAYS:
                self._shipped.popitem(last=False)
        self._shipped.move_to_end(id(a))
        refs[hit[1]] = hit[2]
        return Ref(hit[1])

    def _weights(self, a: np.ndarray, refs: dict[int, Any]) -> Ref:
        r = self._array(a, refs)
        if isinstance(r, Ref):
            return r
        key = next(self._keys)  # a writable array cannot be cached by identity: this call only
        refs[key] = self.ray.put(np.asarray(a, dtype=np.float32))
        return Ref(key)

    def _data(self, d: ClientData, refs: dict[int, Any]) -> int | Ref:
        k = self._ids.get(id(d))
        if k is not None and self._datas[k] is d:
            return k
        hit = self._data_shipped.get(id(d))
        if hit is None or hit[0] is not d:
            hit = (d, next(self._keys), self.ray.put(d))
            self._data_shipped[id(d)] = hit
        refs[hit[1]] = hit[2]
        return Ref(hit[1])

    # ------------------------------------------------------------------ the engine's interface
    def _run(self, method: str, specs: list[Any], steps: list[int], refs: dict[int, Any]) -> list[Any]:
        """Each actor trains its share, then its companion, whose result is dropped."""
        shares = split_shares(steps, len(self.actors))
        pending = []
        for actor, (members, companion) in zip(self.actors, shares):
            sent = [specs[k] for k in members + ([companion] if companion >= 0 else [])]
            pending.append(getattr(actor, method).remote(sent, {k: refs[k] for k in self._used(sent, refs)}))
        out: list[Any] = [None] * len(specs)
        for (members, _), results in zip(shares, self.ray.get(pending)):
            for k, r in zip(members, results):
                out[k] = r
        return out

    @staticmethod
    def _used(specs: list[Any], refs: dict[int, Any]) -> set[int]:
        used: set[int] = set()

        def walk(v: Any) -> None:
            if isinstance(v, Ref):
                used.add(v.key)
            elif isinstance(v, TaskSpec):
                for x in (v.data, v.weights, *v.aux.values()):
                    walk(x)
            elif isinstance(v, tuple):
                for x in v:
                    walk(x)

        for s in specs:
            walk(s)
        return used & refs.keys()

    def train(self, tasks: list[CohortTask]) -> list[ClientUpdate]:
        refs: dict[int, Any] = {}
        specs = [
            TaskSpec(
                self._data(t.data, refs),
                self._weights(t.weights, refs),
                {k: self._array(np.asarray(v), refs) for k, v in t.aux_in.items()},
                t.state,
                generator_seed(t.generator),
            )
            for t in tasks
        ]
        steps = [task_steps(len(t.data), self.cfg) for t in tasks]
        results = self._run("train", specs, steps, refs)
        updates = []
        for t, (u, state) in zip(tasks, results):
            t.state.clear()
            t.state.update(state)
            updates.append(u)
        return updates

    def probe(self, weights: list[np.ndarray], datas: list[ClientData]) -> list[ClientUpdate]:
        refs: dict[int, Any] = {}
        specs = [(self._weights(w, refs), self._data(d, refs)) for w, d in zip(weights, datas)]
        return self._run("probe", specs, [-(-len(d) // PROBE_BATCH) for d in datas], refs)

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
        self.actors = []
        self._shipped.clear()
        self._data_shipped.clear()
        self._stack.close()

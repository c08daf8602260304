#!/usr/bin/env bash
# Issue 10's GPU check, one short script (about 5 minutes on an H200). From the repo root:
#
#     bash benchmarks/gpu_check.sh
#
# Needs the CIFAR-10 archive at .gpu/cifar10-jpeg.tar.gz (or $CIFAR) and the MobiPerf trace at
# ../shared/traces/, shared/traces/ or .gpu/ (mobiperf-300.json), or $TRACE (without one the run
# falls back to an always-available trace and says so). Prints JSON lines, and appends them to
# $OUT/gpu_check.jsonl when $OUT is set:
#   1. cohort vs sequential training of the same tasks on the GPU (felix CNN, fp32): largest
#      difference, and the times of the sequential trainer, the cohort trainer (its stacked-chain
#      kernel, if it checks out bit-identical to vmap on the GPU) and the cohort trainer with vmap.
#      kernel_vs_vmap_max_abs_diff must be 0. max_abs_weight_diff (cohort vs sequential) measures
#      this problem's sensitivity as much as the engine: the 1,000-sample client's 31 steps on random
#      labels are chaotic (on a CPU, perturbing its start weights by 1e-7 relative moved its update
#      by 20% in 3 of 8 draws, the sequential trainer alone: benchmarks/start_sensitivity.py).
#      On a GPU also the stream syncs of one cohort pass (torch.cuda.set_sync_debug_mode): a few per
#      advance (its batch plan in, its updates out), none per lockstep step;
#   2. engine_speed for felix-cifar10 / felix: cohort auto over 500 aggregations, then the
#      sequential engine (cohort 1) over 50, each with its bare sequential loop and the split of
#      its wall time (train / probes / evaluation / other, rows per lockstep step);
#   3. a torch.profiler operator table of 20 more cohort aggregations ($PROFILE_AGGS), sorted by
#      CUDA time, in $OUT/gpu_profile.txt (or /tmp): whether a lockstep step waits on the host.
set -euo pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
CIFAR=${CIFAR:-.gpu/cifar10-jpeg.tar.gz}
export DEVICE=${DEVICE:-cuda}  # DEVICE=cpu AGGS=1,1 PROFILE_AGGS=1 LIMIT=1500: a (slow) dry run without a GPU
AGGS=${AGGS:-500,50}
LIMIT=${LIMIT:-420}  # seconds for step 2 and 3 (about 4 minutes on an H200)
[ -f "$CIFAR" ] || { echo "gpu_check: CIFAR-10 archive $CIFAR not found (set CIFAR=...)" >&2; exit 2; }
SINK=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT"; SINK="$OUT/gpu_check.jsonl"; fi
TRACE_SET=()
for t in "${TRACE:-}" ../shared/traces/mobiperf-300.json shared/traces/mobiperf-300.json .gpu/mobiperf-300.json; do
  if [ -n "$t" ] && [ -f "$t" ]; then TRACE_SET=(--set "trace.path=$t"); break; fi
done
if [ ${#TRACE_SET[@]} -eq 0 ]; then
  echo "gpu_check: no MobiPerf trace found; using trace.kind=always" >&2
  TRACE_SET=(--set trace.kind=always)
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

timeout 150 python - <<'PY' | tee -a "$SINK"
import copy, json, time
from unittest import mock
import numpy as np, torch
from torch.nn.utils import parameters_to_vector
from felix.client.cohort import CohortTask, CohortTrainer
from felix.strategies.objectives import make_objective
from felix.client.trainer import ClientData, LocalTrainer, TrainConfig
from felix.scenario.models import make_model
import os
device = os.environ["DEVICE"]
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
model = make_model("felix_cnn", (3, 32, 32), 10, seed=1)
w0 = parameters_to_vector(model.parameters()).detach().numpy()
g = torch.Generator().manual_seed(0)
sizes = [5, 40, 333, 64, 1000, 17, 250, 96]
datas = [ClientData(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)) for n in sizes]
out = {"check": "cohort_vs_sequential", "device": device, "torch": torch.__version__, "sizes": sizes}
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def timed(f):
    f()  # first call: allocator, kernels' first launch
    sync(); t0 = time.perf_counter()
    r = f()
    sync()
    return r, round(time.perf_counter() - t0, 4)


for name, params in (("ce", {}), ("federage", {"alpha": 0.3}), ("scaffold", {"num_clients": 8})):
    cfg = TrainConfig(lr=0.04, batch_size=32, drop_last=True)
    seq = LocalTrainer(copy.deepcopy(model), make_objective(name, **params), cfg, 10, device)
    coh = CohortTrainer(copy.deepcopy(model), make_objective(name, **params), cfg, 10, device,
                        sample_shape=(3, 32, 32))  # the stacked-chain kernel, if it checks out here
    with mock.patch("felix.client.cohort.StackedChain.of", return_value=None):
        coh_vmap = CohortTrainer(copy.deepcopy(model), make_objective(name, **params), cfg, 10, device)
    tasks = lambda: [CohortTask(w0, d, {}, {}, torch.Generator().manual_seed(k)) for k, d in enumerate(datas)]
    a, t_seq = timed(lambda: [seq.train(w0, d, {}, {}, torch.Generator().manual_seed(k)) for k, d in enumerate(datas)])
    b, t_coh = timed(lambda: coh.train(tasks()))
    v, t_vmap = timed(lambda: coh_vmap.train(tasks()))
    out[name] = {"max_abs_weight_diff": max(float(np.abs(x.delta - y.delta).max()) for x, y in zip(a, b)),
                 "max_rel_utility_diff": max(abs(x.stat_utility - y.stat_utility) / max(x.stat_utility, 1e-12)
                                             for x, y in zip(a, b)),
                 "kernel": coh.chain is not None,
                 "kernel_vs_vmap_max_abs_diff": max(float(np.abs(x.delta - y.delta).max()) for x, y in zip(b, v)),
                 "sequential_s": t_seq, "cohort_s": t_coh, "cohort_vmap_s": t_vmap}
    if device.startswith("cuda"):
        import warnings
        before = (coh.stats.advances, coh.stats.lockstep_steps)
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            coh.train(tasks())
        torch.cuda.set_sync_debug_mode("default")
        out[name].update(syncs=sum("synchroniz" in str(w.message) for w in caught),
                         advances=coh.stats.advances - before[0],
                         lockstep_steps=coh.stats.lockstep_steps - before[1])
print(json.dumps(out), flush=True)
PY

timeout "$LIMIT" python benchmarks/engine_speed.py --scenario felix-cifar10 --preset felix \
  --set "run.device=$DEVICE" --set "dataset.root=$CIFAR" "${TRACE_SET[@]}" \
  --cohort auto,1 --aggregations "$AGGS" --bare-repeats 1 --json \
  --profile "${OUT:-/tmp}/gpu_profile.txt" --profile-aggregations "${PROFILE_AGGS:-20}" | tee -a "$SINK"

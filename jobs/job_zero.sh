#!/bin/bash
# Sharded data parallelism on ONE node, all its GPUs: DDP, ZeRO stages 1-3 (labkit's own, --strategy zero)
# and PyTorch FSDP2 (--strategy fsdp) train the same model one after the other; a table compares their
# samples/s and peak memory per rank.
#
# Usage (from the repository root):
#   sbatch jobs/job_zero.sh                                   # 1 node, 4 GPUs (the #SBATCH lines below)
#   sbatch --gres=gpu:8 jobs/job_zero.sh                      # all 8 GPUs of a bigger node
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_zero.sh   # CPU partition, tiny sizes (gloo)
#   bash jobs/job_zero.sh                                     # no SLURM: torchrun on this machine
#
# Environment (all optional; defaults in brackets):
#   MODEL [resnet32]   DATASET [cifar10]   EPOCHS [2]   BATCH_SIZE [128, per rank]   BASE_LR [0.1]
#   OPTIMIZER [adam; or sgd]   RUNS ["ddp zero-1 zero-2 zero-3 fsdp"]   NPROC [the GPUs; 2 on CPU]
#   EXTRA_ARGS: more `labkit train` flags, e.g. "--zero-prefetch" (with RUNS=zero-3)
#   RESUME [0]: 1 continues the checkpoints in LABKIT_OUT (a requeued job does so by itself)
#   Pre-emption and time limits: see jobs/lib/run.sh (--signal=B:USR1@120 below: checkpoint, requeue)
#   LABKIT_QUICK=1: lenet on the offline mnist-sample, a few steps, CPU/gloo
#   LABKIT_OUT: results folder [runs/zero-<jobid>], one sub-folder per run; PYTHON [python3]
#
# Results: <LABKIT_OUT>/<run>/summary.json and metrics.jsonl, and <LABKIT_OUT>/summary.json comparing them:
#   labkit.results.load_run("runs/zero-<jobid>/zero-3").summary["metrics"]["peak_memory_gb"]
#   labkit bench zero --ranks 2,4 measures the training state beside ZeRO's formulas
#
#SBATCH --job-name=labkit-zero
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:4
#SBATCH --time=02:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=zero-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python="${PYTHON:-python3}"
quick="${LABKIT_QUICK:-0}"

source jobs/lib/ranks.sh  # sets gpus, device (cuda|cpu), backend (nccl|gloo), nproc
source jobs/lib/run.sh    # run_ranks; resume=(--resume) on a requeued run

if [[ "$quick" != 0 ]]; then
    sizes=(--model "${MODEL:-lenet}" --dataset "${DATASET:-mnist-sample}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-32}" --base-lr "${BASE_LR:-0.01}" --train-size 256 --test-size 128
           --max-steps 3 --log-every 1)
else
    sizes=(--model "${MODEL:-resnet32}" --dataset "${DATASET:-cifar10}" --epochs "${EPOCHS:-2}"
           --batch-size "${BATCH_SIZE:-128}" --base-lr "${BASE_LR:-0.1}" --augment)
fi
out="${LABKIT_OUT:-runs/zero-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"
read -r -a extra <<< "${EXTRA_ARGS:-}"
read -r -a runs <<< "${RUNS:-ddp zero-1 zero-2 zero-3 fsdp}"

echo "labkit ZeRO/FSDP job ${SLURM_JOB_ID:-(no SLURM)} on $(hostname): $nproc rank(s) on $device ($backend)"
for run in "${runs[@]}"; do
    case "$run" in
        ddp) strategy=(--strategy ddp) ;;
        zero-[123]) strategy=(--strategy zero --zero-stage "${run#zero-}") ;;
        fsdp) strategy=(--strategy fsdp) ;;
        *) echo "labkit: error: RUNS: unknown run '$run'; use ddp, zero-1, zero-2, zero-3, fsdp" >&2; exit 2 ;;
    esac
    cmd=("$python" -m labkit.dist.torchrun --standalone --nnodes 1 --nproc-per-node "$nproc"
         -m labkit train "${strategy[@]}" --optimizer "${OPTIMIZER:-adam}" --device "$device" --backend "$backend"
         "${sizes[@]}" --name "$run-$nproc-ranks" --out "$out/$run" "${resume[@]}" "${extra[@]}")
    echo "+ ${cmd[*]}"
    run_ranks "$out/$run" "${cmd[@]}"
done

"$python" - "$out" "$nproc" "${runs[@]}" <<'PY'
import sys

from labkit.results import RunWriter, host_environment, load_run

out, nproc, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
loaded = [load_run(f"{out}/{name}") for name in names]
runs = {name: run.summary["metrics"] for name, run in zip(names, loaded)}
print(f"{'run':<8}{'samples/s':>12}{'peak memory per rank (MB)':>28}{'test acc':>10}")
for name, m in runs.items():
    print(f"{name:<8}{m['samples_per_sec']:>12.1f}{m['peak_memory_gb'] * 1000:>28.1f}{m['final_test_acc']:>10.3f}")
RunWriter(out).finish("zero-job", "bench", {"ranks": nproc, "runs": names},
                      {name: {k: m[k] for k in ("samples_per_sec", "peak_memory_gb", "final_test_acc")}
                       for name, m in runs.items()},
                      host=host_environment(loaded[0]))  # the ranks' host: no torch to import here
PY
echo "results: $out/summary.json"

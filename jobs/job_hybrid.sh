#!/bin/bash
# The hybrid strategy FlexFlow found for AlexNet (seed 000) on ONE node: convolutions replicated on every
# GPU (data parallel), the fully-connected layers and the loss on GPU 0 only; features gathered to rank 0
# and their gradient scattered back (labkit train --strategy hybrid). Then the same training with plain
# DDP into <out>/ddp, to compare loss convergence and samples/sec (notebook 03 plots both).
#
# Usage (from the repository root):
#   sbatch jobs/job_hybrid.sh                                    # 1 node, 2 GPUs (the seed's setting)
#   sbatch --gres=gpu:4 jobs/job_hybrid.sh                       # 4 ranks
#   COMPARE_DDP=0 sbatch jobs/job_hybrid.sh                      # the hybrid run only
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_hybrid.sh    # CPU partition, tiny sizes (gloo)
#   bash jobs/job_hybrid.sh                                      # no SLURM: torchrun on this machine
#
# Environment (all optional; defaults in brackets):
#   DATASET [cifar10]   EPOCHS [10]   BATCH_SIZE [128, per rank]   OPTIMIZER [adam]   BASE_LR [0.001]
#   (alexnet_small has no normalisation layers; plain SGD with momentum needs a small LR to stay stable)
#   NPROC [the GPUs of the node; 2 on CPU]   COMPARE_DDP [1]
#   RESUME [0]: 1 continues the checkpoints in LABKIT_OUT (a requeued job does so by itself)
#   Pre-emption and time limits: see jobs/lib/run.sh (--signal=B:USR1@120 below: checkpoint, requeue)
#   LABKIT_QUICK=1: alexnet_small on the offline synthetic-cifar10, 1 short epoch, CPU/gloo
#   LABKIT_OUT: results folder [runs/hybrid-<jobid>]; PYTHON [python3]
#
# Results: <LABKIT_OUT>/summary.json, metrics.jsonl (hybrid) and <LABKIT_OUT>/ddp/ (DDP); in a notebook:
#   labkit.results.plot_metric(labkit.results.load_runs([out, out + "/ddp"]), y="train_loss")
#
#SBATCH --job-name=labkit-hybrid
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:2
#SBATCH --time=01:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=hybrid-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python="${PYTHON:-python3}"
quick="${LABKIT_QUICK:-0}"

source jobs/lib/ranks.sh  # sets gpus, device (cuda|cpu), backend (nccl|gloo), nproc
source jobs/lib/run.sh    # run_ranks; resume=(--resume) on a requeued run

if [[ "$quick" != 0 ]]; then
    sizes=(--dataset "${DATASET:-synthetic-cifar10}" --epochs "${EPOCHS:-1}" --batch-size "${BATCH_SIZE:-16}"
           --max-steps 6 --train-size 256 --test-size 128 --log-every 2)
else
    sizes=(--dataset "${DATASET:-cifar10}" --epochs "${EPOCHS:-10}" --batch-size "${BATCH_SIZE:-128}" --augment)
fi
out="${LABKIT_OUT:-runs/hybrid-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"
launch=("$python" -m labkit.dist.torchrun --standalone --nnodes 1 --nproc-per-node "$nproc" -m labkit train
        --model alexnet_small --device "$device" --backend "$backend" "${sizes[@]}"
        --optimizer "${OPTIMIZER:-adam}" --base-lr "${BASE_LR:-0.001}")

echo "labkit hybrid job ${SLURM_JOB_ID:-(no SLURM)} on $(hostname): $nproc rank(s) on $device ($backend)"
runs=(hybrid)
[[ "${COMPARE_DDP:-1}" != 0 ]] && runs+=(ddp)
results=()
for run in "${runs[@]}"; do
    dir="$out"
    [[ "$run" == ddp ]] && dir="$out/ddp"
    cmd=("${launch[@]}" --strategy "$run" --out "$dir" "${resume[@]}")
    echo "+ ${cmd[*]}"
    run_ranks "$dir" "${cmd[@]}"
    results+=("$dir/summary.json")
done
echo "results: ${results[*]}"

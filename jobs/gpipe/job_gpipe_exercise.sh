#!/bin/bash
# GPipe hands-on, part 1: YOUR GPipe version of the ResNet-50 MNIST training (mnist_gpipe_exercise.py),
# on one node with 2 GPUs. Until you complete its TODOs it runs as plain PyTorch on the first GPU.
#
# Usage (from the repository root):
#   labkit check gpipe-exercise jobs/gpipe/mnist_gpipe_exercise.py   # first: is it complete and correct?
#   sbatch jobs/gpipe/job_gpipe_exercise.sh                  # 1 node, 2 GPUs
#   SBATCH_GRES=none sbatch jobs/gpipe/job_gpipe_exercise.sh # a CPU partition (2 CPU partitions)
#   bash jobs/gpipe/job_gpipe_exercise.sh                    # no SLURM: on this machine
#   LABKIT_QUICK=1 bash jobs/gpipe/job_gpipe_exercise.sh     # a few CPU steps on the offline MNIST sample
# Compare its throughput and memory lines with those of job_pytorch.sh (note: batch 512 here, 256 there).
#
# Environment (all optional; defaults in brackets):
#   BATCHSIZE [512; 16 with LABKIT_QUICK=1]   EPOCHS [1]   DATASET [mnist; mnist-sample with LABKIT_QUICK=1]
#   DEVICES [cuda:0 cuda:1 with 2 GPUs, else cpu cpu]   LABKIT_OUT [runs/gpipe-exercise-<jobid>]   PYTHON [python3]
# MNIST must be on disk (once, on the login node): labkit data fetch mnist
# pre-emption: none (the seed's plain PyTorch script keeps no checkpoint; labkit train --resume does)
#
#SBATCH --job-name=gpipe-exercise
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:2
#SBATCH --time=00:30:00
#SBATCH --output=gpipe-exercise-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}"
python="${PYTHON:-python3}"
args=(--out "${LABKIT_OUT:-runs/gpipe-exercise-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}" --epochs "${EPOCHS:-1}")
[[ -n "${BATCHSIZE:-}" ]] && args+=(--batchsize "$BATCHSIZE")
[[ -n "${DATASET:-}" ]] && args+=(--dataset "$DATASET")
if [[ -n "${DEVICES:-}" ]]; then read -r -a devices <<< "$DEVICES"; args+=(--devices "${devices[@]}"); fi

echo "+ $python jobs/gpipe/mnist_gpipe_exercise.py ${args[*]}"
"$python" jobs/gpipe/mnist_gpipe_exercise.py "${args[@]}"

#!/bin/bash
# GPipe hands-on, part 1: the plain PyTorch reference -- ResNet-50 on MNIST on ONE GPU (mnist_pytorch.py).
#
# Usage (from the repository root):
#   sbatch jobs/gpipe/job_pytorch.sh                        # 1 node, 1 GPU
#   BATCHSIZE=128 sbatch jobs/gpipe/job_pytorch.sh          # another batch size (default 256)
#   SBATCH_GRES=none sbatch jobs/gpipe/job_pytorch.sh       # a CPU partition
#   bash jobs/gpipe/job_pytorch.sh                          # no SLURM: on this machine (GPU if present)
#   LABKIT_QUICK=1 bash jobs/gpipe/job_pytorch.sh           # a few CPU steps on the offline MNIST sample
# Then make mnist_gpipe_exercise.py use GPipe and compare: sbatch jobs/gpipe/job_gpipe_exercise.sh
#
# Environment (all optional; defaults in brackets):
#   BATCHSIZE [256; 8 with LABKIT_QUICK=1]   EPOCHS [1]   DATASET [mnist; mnist-sample with LABKIT_QUICK=1]
#   LABKIT_OUT: results folder [runs/gpipe-pytorch-<jobid>]; PYTHON [python3]
# MNIST must be on disk (once, on the login node): labkit data fetch mnist
# pre-emption: none (the seed's plain PyTorch script keeps no checkpoint; labkit train --resume does)
#
#SBATCH --job-name=gpipe-pytorch
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:1
#SBATCH --time=00:30:00
#SBATCH --output=gpipe-pytorch-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}"
python="${PYTHON:-python3}"
args=(--out "${LABKIT_OUT:-runs/gpipe-pytorch-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}" --epochs "${EPOCHS:-1}")
[[ -n "${BATCHSIZE:-}" ]] && args+=(--batchsize "$BATCHSIZE")
[[ -n "${DATASET:-}" ]] && args+=(--dataset "$DATASET")

echo "+ $python jobs/gpipe/mnist_pytorch.py ${args[*]}"
"$python" jobs/gpipe/mnist_pytorch.py "${args[@]}"

#!/bin/bash
# GPipe hands-on, part 2: the answer (mnist_gpipe_answer.py) with its knobs -- ResNet-50 on MNIST split over
# 2 GPUs of one node by torchgpipe. Experiment with balancing by time vs memory, the number of
# micro-batches and the batch size (how far can you go with GPipe, and without?).
#
# Usage (from the repository root):
#   sbatch jobs/gpipe/job_gpipe_answer.sh                                # 1 node, 2 GPUs, the defaults
#   BALANCE_BY=memory NUM_MICROBATCHES=4 sbatch jobs/gpipe/job_gpipe_answer.sh
#   BATCHSIZE=2048 sbatch jobs/gpipe/job_gpipe_answer.sh                 # a batch plain PyTorch cannot hold?
#   SBATCH_GRES=none sbatch jobs/gpipe/job_gpipe_answer.sh               # a CPU partition
#   bash jobs/gpipe/job_gpipe_answer.sh                                  # no SLURM: on this machine
#   LABKIT_QUICK=1 bash jobs/gpipe/job_gpipe_answer.sh                   # a few CPU steps, offline data
#
# Environment (all optional; defaults in brackets):
#   BALANCE_BY [time; or memory]   NUM_MICROBATCHES [8; 4 with LABKIT_QUICK=1]
#   BATCHSIZE [512; 16 with LABKIT_QUICK=1]   EPOCHS [1]   DATASET [mnist; mnist-sample with LABKIT_QUICK=1]
#   DEVICES [cuda:0 cuda:1 with 2 GPUs, else cpu cpu]   LABKIT_OUT [runs/gpipe-answer-<jobid>]   PYTHON [python3]
# MNIST must be on disk (once, on the login node): labkit data fetch mnist
# pre-emption: none (the seed's plain PyTorch script keeps no checkpoint; labkit train --resume does)
#
#SBATCH --job-name=gpipe-answer
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:2
#SBATCH --time=00:30:00
#SBATCH --output=gpipe-answer-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/../..}"
python="${PYTHON:-python3}"
args=(--out "${LABKIT_OUT:-runs/gpipe-answer-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}" --epochs "${EPOCHS:-1}"
      --balance_by "${BALANCE_BY:-time}")
[[ -n "${NUM_MICROBATCHES:-}" ]] && args+=(--num_microbatches "$NUM_MICROBATCHES")
[[ -n "${BATCHSIZE:-}" ]] && args+=(--batchsize "$BATCHSIZE")
[[ -n "${DATASET:-}" ]] && args+=(--dataset "$DATASET")
if [[ -n "${DEVICES:-}" ]]; then read -r -a devices <<< "$DEVICES"; args+=(--devices "${devices[@]}"); fi

echo "+ $python jobs/gpipe/mnist_gpipe_answer.py ${args[*]}"
"$python" jobs/gpipe/mnist_gpipe_answer.py "${args[@]}"

#!/bin/bash
# Data-parallel training (DistributedDataParallel) on ONE node: torchrun starts one rank per GPU.
#
# Usage (from the repository root):
#   sbatch jobs/job_ddp.sh                                   # 1 node, 4 GPUs (the #SBATCH lines below)
#   sbatch --gres=gpu:1 jobs/job_ddp.sh                      # 1 GPU
#   sbatch --gres=gpu:8 jobs/job_ddp.sh                      # all 8 GPUs of a bigger node
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_ddp.sh   # CPU partition, tiny sizes (gloo)
#   bash jobs/job_ddp.sh                                     # no SLURM: torchrun on this machine
#   jobs/job_ddp_multinode.sh does the same on several nodes.
#
# Environment (all optional; defaults in brackets):
#   MODEL [resnet32]   DATASET [cifar10]   EPOCHS [20]   BATCH_SIZE [128, per rank]   BASE_LR [0.1]
#   WARMUP_EPOCHS [2]  (the LR is scaled by the number of ranks: --scale-lr, linear scaling + warm-up)
#   NPROC [the GPUs of the node; 2 on CPU]   ALLREDUCE [ddp; or native, ring, tree, ...]
#   MAX_RESTARTS [0]: torchrun restarts the ranks after a failure and they --resume from the last epoch
#   RESUME [0]: 1 continues the checkpoint in LABKIT_OUT (a requeued job does so by itself)
#   Pre-emption and time limits: see jobs/lib/run.sh (--signal=B:USR1@120 below: checkpoint, requeue)
#   EXTRA_ARGS: more `labkit train` flags, e.g. "--optimizer kfac --kfac-update-freq 10"
#   LABKIT_QUICK=1: lenet on the offline mnist-sample, 1 short epoch, CPU/gloo
#   LABKIT_OUT: results folder [runs/ddp-<jobid>]; PYTHON [python3]
#
# Results: <LABKIT_OUT>/summary.json and metrics.jsonl; in Python or a notebook:
#   labkit.results.load_run("runs/ddp-<jobid>").summary["metrics"]["samples_per_sec"]
#   or submit and follow from a notebook: labkit.launch.slurm.sbatch("jobs/job_ddp.sh", env={"EPOCHS": "5"})
#
#SBATCH --job-name=labkit-ddp
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:4
#SBATCH --time=02:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=ddp-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python="${PYTHON:-python3}"
quick="${LABKIT_QUICK:-0}"

source jobs/lib/ranks.sh  # sets gpus, device (cuda|cpu), backend (nccl|gloo), nproc
source jobs/lib/run.sh    # run_ranks; resume=(--resume) on a requeued run

if [[ "$quick" != 0 ]]; then
    sizes=(--model "${MODEL:-lenet}" --dataset "${DATASET:-mnist-sample}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-32}" --base-lr "${BASE_LR:-0.05}" --train-size 512 --test-size 256
           --log-every 4)
else
    sizes=(--model "${MODEL:-resnet32}" --dataset "${DATASET:-cifar10}" --epochs "${EPOCHS:-20}"
           --batch-size "${BATCH_SIZE:-128}" --base-lr "${BASE_LR:-0.1}" --scale-lr
           --warmup-epochs "${WARMUP_EPOCHS:-2}" --augment)
fi
out="${LABKIT_OUT:-runs/ddp-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"
restarts="${MAX_RESTARTS:-0}"
if (( restarts > 0 )); then
    resume=(--resume)
    # a fresh rendezvous store per restart (a shared one hands out the dead ranks' addresses)
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
fi

read -r -a extra <<< "${EXTRA_ARGS:-}"
cmd=("$python" -m labkit.dist.torchrun --standalone --nnodes 1 --nproc-per-node "$nproc"
     --max-restarts "$restarts"
     -m labkit train --strategy ddp --allreduce "${ALLREDUCE:-ddp}" --device "$device" --backend "$backend"
     "${sizes[@]}" --out "$out" "${resume[@]}" "${extra[@]}")

echo "labkit ddp job ${SLURM_JOB_ID:-(no SLURM)} on $(hostname): $nproc rank(s) on $device ($backend)"
echo "+ ${cmd[*]}"
run_ranks "$out" "${cmd[@]}"
echo "results: $out/summary.json"

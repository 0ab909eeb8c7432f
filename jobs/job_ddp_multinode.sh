#!/bin/bash
# Data-parallel training (DistributedDataParallel) on SEVERAL nodes: srun starts one torchrun per node,
# the torchruns meet at a c10d rendezvous on the job's first node, each starts one rank per GPU.
#
# Usage (from the repository root):
#   sbatch jobs/job_ddp_multinode.sh                         # 2 nodes × 4 GPUs = 8 ranks
#   sbatch --nodes=4 jobs/job_ddp_multinode.sh               # 4 nodes × 4 GPUs = 16 ranks
#   sbatch --nodes=2 --gres=gpu:1 jobs/job_ddp_multinode.sh  # 2 nodes × 1 GPU
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_ddp_multinode.sh   # CPU nodes, tiny sizes (gloo)
#   bash jobs/job_ddp_multinode.sh                           # no SLURM: one node, torchrun on this machine
#   One node only? jobs/job_ddp.sh is the same without the rendezvous.
#
# Environment (all optional; defaults in brackets):
#   MODEL [resnet32]   DATASET [cifar10]   EPOCHS [20]   BATCH_SIZE [128, per rank]   BASE_LR [0.1]
#   WARMUP_EPOCHS [2]  (the LR is scaled by the number of ranks: --scale-lr, linear scaling + warm-up)
#   NPROC [ranks per node: the node's GPUs; on CPU 1, or 2 without SLURM]   ALLREDUCE [ddp; or native, ring, tree, ...]
#   RDZV_PORT [29500 + job id mod 1000]   MAX_RESTARTS [0]   EXTRA_ARGS: more `labkit train` flags
#   RESUME [0]: 1 continues the checkpoint in LABKIT_OUT (a requeued job does so by itself)
#   Pre-emption and time limits: see jobs/lib/run.sh (--signal=B:USR1@120 below: checkpoint, requeue)
#   LABKIT_QUICK=1: lenet on the offline mnist-sample, 1 short epoch, CPU/gloo
#   LABKIT_OUT: results folder, on a file system all nodes share [runs/ddp-multinode-<jobid>]
#
# Results: <LABKIT_OUT>/summary.json (written by global rank 0) and metrics.jsonl:
#   labkit.results.load_run("runs/ddp-multinode-<jobid>").summary["metrics"]
#
#SBATCH --job-name=labkit-ddp-multinode
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:4
#SBATCH --time=02:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=ddp-multinode-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python="${PYTHON:-python3}"
quick="${LABKIT_QUICK:-0}"

cpu_ranks=$([[ -n "${SLURM_JOB_ID:-}" ]] && echo 1 || echo 2)  # CPU: 1 rank per node under SLURM, 2 without
source jobs/lib/ranks.sh  # sets gpus, device (cuda|cpu), backend (nccl|gloo), nproc
source jobs/lib/run.sh    # run_ranks; resume=(--resume) on a requeued run
source jobs/lib/rdzv.sh   # nnodes; rdzv (torchrun rendezvous flags) and run_nodes for several nodes

if [[ "$quick" != 0 ]]; then
    sizes=(--model "${MODEL:-lenet}" --dataset "${DATASET:-mnist-sample}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-32}" --base-lr "${BASE_LR:-0.05}" --train-size 512 --test-size 256
           --log-every 4)
else
    sizes=(--model "${MODEL:-resnet32}" --dataset "${DATASET:-cifar10}" --epochs "${EPOCHS:-20}"
           --batch-size "${BATCH_SIZE:-128}" --base-lr "${BASE_LR:-0.1}" --scale-lr
           --warmup-epochs "${WARMUP_EPOCHS:-2}" --augment)
fi
out="${LABKIT_OUT:-runs/ddp-multinode-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"
restarts="${MAX_RESTARTS:-0}"
if (( restarts > 0 )); then
    resume=(--resume)
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # a fresh rendezvous store per restart
fi
read -r -a extra <<< "${EXTRA_ARGS:-}"
train=(-m labkit train --strategy ddp --allreduce "${ALLREDUCE:-ddp}" --device "$device" --backend "$backend"
       "${sizes[@]}" --out "$out" "${resume[@]}" "${extra[@]}")

cmd=("$python" -m labkit.dist.torchrun "${rdzv[@]}" --nproc-per-node "$nproc" --max-restarts "$restarts"
     "${train[@]}")

echo "labkit ddp job ${SLURM_JOB_ID:-(no SLURM)}: $nnodes node(s) × $nproc rank(s) on $device ($backend)"
echo "+ ${cmd[*]}"
run_ranks "$out" "${cmd[@]}"
echo "results: $out/summary.json"

#!/bin/bash
# Parallelisms composed on a device mesh (labkit train --mesh dp=D,tp=T,pp=P): one node or several.
# srun starts one torchrun per node; the torchruns meet at a c10d rendezvous on the job's first node, each starts
# one rank per GPU. The mesh's last dimension changes fastest, so tp's ranks are the GPUs of one node.
#
# Usage (from the repository root):
#   sbatch --nodes=1 jobs/job_mesh.sh                          # 1 node × 4 GPUs: --mesh tp=4
#   sbatch jobs/job_mesh.sh                                    # 2 nodes × 4 GPUs: --mesh dp=2,tp=4
#   MESH=pp=2,dp=2,tp=2 sbatch jobs/job_mesh.sh                # 8 ranks: a pipeline stage per node
#   MESH=dp=8 EXTRA_ARGS="--dp-shard fsdp" sbatch jobs/job_mesh.sh   # FSDP2 over every rank
#   EXTRA_ARGS="--sync diloco --sync-every 64" sbatch jobs/job_mesh.sh   # a replica group per node, meeting every 64 steps
#   LABKIT_OUT=runs/mesh-<jobid> RESUME=1 sbatch --nodes=1 jobs/job_mesh.sh  # that dp=2,tp=4 run continued on tp=4
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_mesh.sh    # CPU nodes, tiny sizes (gloo)
#   bash jobs/job_mesh.sh                                      # no SLURM: one node, torchrun on this machine
#
# Environment (all optional; defaults in brackets):
#   MESH [tp=<ranks per node>,dp=<nodes>; quick: dp=<all ranks>]: the product must be nodes × ranks per node
#   MODEL [gpt-small]   DATASET [text-sample]   EPOCHS [1]   BATCH_SIZE [16, per data-parallel rank]
#   BASE_LR [3e-4]      OPTIMIZER [adam]
#   NPROC [ranks per node: the node's GPUs; on CPU 1, or 2 without SLURM]
#   RDZV_PORT [29500 + job id mod 1000]   EXTRA_ARGS: more `labkit train` flags (e.g. --sequence-parallel)
#   RESUME [0]: 1 continues the checkpoint in LABKIT_OUT, on this --mesh or another one it reshards to
#     (labkit/train/reshard.py: not across a pp split, ZeRO/FSDP or DiLoCo); a requeued job does so by itself
#   Pre-emption and time limits: see jobs/lib/run.sh (--signal=B:USR1@120 below: checkpoint, requeue)
#   LABKIT_QUICK=1: lenet on the offline mnist-sample, 1 short epoch, --mesh dp=<all ranks>, CPU/gloo
#   LABKIT_OUT: results folder, on a file system all nodes share [runs/mesh-<jobid>]
#
# Results: <LABKIT_OUT>/summary.json (written by global rank 0), metrics.jsonl, checkpoint.rank<r>.pt per rank:
#   labkit.results.load_run("runs/mesh-<jobid>").summary["metrics"]
#
#SBATCH --job-name=labkit-mesh
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:4
#SBATCH --time=02:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=mesh-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python="${PYTHON:-python3}"
quick="${LABKIT_QUICK:-0}"

cpu_ranks=$([[ -n "${SLURM_JOB_ID:-}" ]] && echo 1 || echo 2)  # CPU: 1 rank per node under SLURM, 2 without
source jobs/lib/ranks.sh  # sets gpus, device (cuda|cpu), backend (nccl|gloo), nproc
source jobs/lib/run.sh    # run_ranks; resume=(--resume) on a requeued run
source jobs/lib/rdzv.sh   # nnodes; rdzv (torchrun rendezvous flags) and run_nodes for several nodes

if [[ "$quick" != 0 ]]; then
    mesh="${MESH:-dp=$((nnodes * nproc))}"
    sizes=(--model "${MODEL:-lenet}" --dataset "${DATASET:-mnist-sample}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-32}" --base-lr "${BASE_LR:-0.05}" --train-size 512 --test-size 256
           --log-every 4)
else
    mesh="${MESH:-tp=$nproc,dp=$nnodes}"
    sizes=(--model "${MODEL:-gpt-small}" --dataset "${DATASET:-text-sample}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-16}" --optimizer "${OPTIMIZER:-adam}" --base-lr "${BASE_LR:-3e-4}")
fi
out="${LABKIT_OUT:-runs/mesh-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"
read -r -a extra <<< "${EXTRA_ARGS:-}"
train=(-m labkit train --mesh "$mesh" --device "$device" --backend "$backend" "${sizes[@]}" --out "$out"
       "${resume[@]}" "${extra[@]}")

cmd=("$python" -m labkit.dist.torchrun "${rdzv[@]}" --nproc-per-node "$nproc" "${train[@]}")

echo "labkit mesh job ${SLURM_JOB_ID:-(no SLURM)}: $nnodes node(s) × $nproc rank(s) on $device ($backend), --mesh $mesh"
echo "+ ${cmd[*]}"
run_ranks "$out" "${cmd[@]}"
echo "results: $out/summary.json"

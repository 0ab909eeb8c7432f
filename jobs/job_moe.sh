#!/bin/bash
# Many experts: expert parallelism (labkit train --mesh dp=D,ep=E --model gpt-moe-...), the experts of a mixture
# of experts spread over the ep ranks, tokens dispatched to them and combined with all-to-all. Notebook 10.
# srun starts one torchrun per node; the torchruns meet at a c10d rendezvous on the job's first node, each starts
# one rank per GPU: ep over the GPUs of a node (the all-to-all stays inside it), dp over the nodes.
#
# Usage (from the repository root):
#   sbatch --nodes=1 jobs/job_moe.sh                           # 1 node × 4 GPUs: --mesh dp=1,ep=4
#   sbatch jobs/job_moe.sh                                     # 2 nodes × 4 GPUs: --mesh dp=2,ep=4
#   MESH=ep=8 sbatch jobs/job_moe.sh                           # the all-to-all across the nodes
#   MODEL=gpt-moe-tiny-top2 sbatch jobs/job_moe.sh             # top-2 routing, capacity factor 1.25
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_moe.sh     # CPU nodes, tiny sizes (gloo)
#   bash jobs/job_moe.sh                                       # no SLURM: one node, torchrun on this machine
#
# Environment (all optional; defaults in brackets):
#   MESH [dp=<nodes>,ep=<ranks per node>; quick: ep=<all ranks>]: the product must be nodes × ranks per node,
#     and the model's experts per layer a multiple of ep (gpt-moe-small 8, gpt-moe-tiny 4)
#   MODEL [gpt-moe-small; quick: gpt-moe-tiny]   DATASET [text-sample]   SEQ_LEN [quick: 16]   EPOCHS [1]
#   BATCH_SIZE [16, per data-parallel rank; quick: 4]   BASE_LR [3e-4]   OPTIMIZER [adam]
#   NPROC [ranks per node: the node's GPUs; on CPU 1, or 2 without SLURM]
#   RDZV_PORT [29500 + job id mod 1000]   EXTRA_ARGS: more `labkit train` flags
#   RESUME [0]: 1 continues the checkpoint in LABKIT_OUT (same --mesh; a requeued job does so by itself)
#   Pre-emption and time limits: see jobs/lib/run.sh (--signal=B:USR1@120 below: checkpoint, requeue)
#   LABKIT_QUICK=1: gpt-moe-tiny on the offline text-sample, sequences of 16 tokens, 1 short epoch, CPU/gloo
#   LABKIT_OUT: results folder, on a file system all nodes share [runs/moe-<jobid>]
#
# Results: <LABKIT_OUT>/summary.json (written by global rank 0), metrics.jsonl, checkpoint.rank<r>.pt per rank:
#   labkit.results.load_run("runs/moe-<jobid>").summary["metrics"]
#
#SBATCH --job-name=labkit-moe
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:4
#SBATCH --time=02:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=moe-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python="${PYTHON:-python3}"
quick="${LABKIT_QUICK:-0}"

cpu_ranks=$([[ -n "${SLURM_JOB_ID:-}" ]] && echo 1 || echo 2)  # CPU: 1 rank per node under SLURM, 2 without
source jobs/lib/ranks.sh  # sets gpus, device (cuda|cpu), backend (nccl|gloo), nproc
source jobs/lib/run.sh    # run_ranks; resume=(--resume) on a requeued run
source jobs/lib/rdzv.sh   # nnodes; rdzv (torchrun rendezvous flags) and run_nodes for several nodes

if [[ "$quick" != 0 ]]; then
    mesh="${MESH:-ep=$((nnodes * nproc))}"  # every rank in the one ep group, across the nodes too
    sizes=(--model "${MODEL:-gpt-moe-tiny}" --dataset "${DATASET:-text-sample}" --seq-len "${SEQ_LEN:-16}"
           --epochs "${EPOCHS:-1}" --batch-size "${BATCH_SIZE:-4}" --train-size 64 --test-size 16 --log-every 4)
else
    mesh="${MESH:-dp=$nnodes,ep=$nproc}"  # ep over the ranks of a node (the mesh's last dimension is the fastest)
    sizes=(--model "${MODEL:-gpt-moe-small}" --dataset "${DATASET:-text-sample}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-16}" --optimizer "${OPTIMIZER:-adam}" --base-lr "${BASE_LR:-3e-4}")
fi
out="${LABKIT_OUT:-runs/moe-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"
read -r -a extra <<< "${EXTRA_ARGS:-}"
train=(-m labkit train --mesh "$mesh" --device "$device" --backend "$backend" "${sizes[@]}" --out "$out"
       "${resume[@]}" "${extra[@]}")

cmd=("$python" -m labkit.dist.torchrun "${rdzv[@]}" --nproc-per-node "$nproc" "${train[@]}")

echo "labkit moe job ${SLURM_JOB_ID:-(no SLURM)}: $nnodes node(s) × $nproc rank(s) on $device ($backend), --mesh $mesh"
echo "+ ${cmd[*]}"
run_ranks "$out" "${cmd[@]}"
echo "results: $out/summary.json"

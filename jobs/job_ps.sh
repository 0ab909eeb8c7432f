#!/bin/bash
# Parameter-server training on ONE node: rank 0 (and up to PS_SERVERS-1) holds the parameters, the other
# ranks are workers that push gradients and pull parameters; synchronous, asynchronous or stale-synchronous.
#
# Usage (from the repository root):
#   sbatch jobs/job_ps.sh                                         # 1 node, 4 GPUs: 1 server + 3 workers, sync
#   PS_MODE=ssp MAX_STALENESS=2 sbatch jobs/job_ps.sh             # stale synchronous parallel
#   PS_MODE=async PS_SLOW_WORKER=3:4 sbatch jobs/job_ps.sh        # asynchronous, rank 3 four times slower
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_ps.sh         # CPU partition, tiny sizes (gloo)
#   bash jobs/job_ps.sh                                           # no SLURM: torchrun on this machine
#
# Environment (all optional; defaults in brackets):
#   MODEL [resnet20]   DATASET [cifar10]   EPOCHS [10]   BATCH_SIZE [128, per worker]   BASE_LR [0.05]
#   PS_MODE [sync; async, ssp]   PS_SERVERS [1]   MAX_STALENESS [2, ssp only]   PS_SLOW_WORKER [none; RANK:FACTOR]
#   NPROC [the GPUs of the node; 2 on CPU: one server, one worker]
#   async and ssp receive pushes from whichever worker comes first, which NCCL cannot do: they run the
#   ranks on the CPU with gloo (sync uses the GPUs with NCCL)
#   EXTRA_ARGS: more `labkit train` flags, e.g. "--optimizer lars"
#   RESUME [0]: 1 continues the checkpoint in LABKIT_OUT (a requeued job does so by itself)
#   Pre-emption and time limits: see jobs/lib/run.sh (--signal=B:USR1@120 below: checkpoint, requeue)
#   LABKIT_QUICK=1: lenet on the offline mnist-sample, 1 short epoch, CPU/gloo
#   LABKIT_OUT: results folder [runs/ps-<jobid>]; PYTHON [python3]
#
# Results: <LABKIT_OUT>/summary.json, metrics.jsonl and ps-record.json (every update: worker, clock,
# staleness, time); in Python or a notebook:
#   labkit.results.load_run("runs/ps-<jobid>").summary["metrics"]["samples_per_sec"]
#   or submit and follow from a notebook: labkit.launch.slurm.sbatch("jobs/job_ps.sh", env={"PS_MODE": "async"})
#
#SBATCH --job-name=labkit-ps
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:4
#SBATCH --time=02:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=ps-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python="${PYTHON:-python3}"
quick="${LABKIT_QUICK:-0}"
mode="${PS_MODE:-sync}"

min_gpus=2  # a server and at least one worker
source jobs/lib/ranks.sh  # sets gpus, device (cuda|cpu), backend (nccl|gloo), nproc
source jobs/lib/run.sh    # run_ranks; resume=(--resume) on a requeued run
if [[ "$mode" != sync && "$device" == cuda ]]; then
    echo "--ps-mode $mode needs a receive from any source: running the $nproc ranks on the CPU with gloo"
    device=cpu; backend=gloo
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi

if [[ "$quick" != 0 ]]; then
    sizes=(--model "${MODEL:-lenet}" --dataset "${DATASET:-mnist-sample}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-32}" --base-lr "${BASE_LR:-0.05}" --train-size 512 --test-size 256
           --log-every 4)
else
    sizes=(--model "${MODEL:-resnet20}" --dataset "${DATASET:-cifar10}" --epochs "${EPOCHS:-10}"
           --batch-size "${BATCH_SIZE:-128}" --base-lr "${BASE_LR:-0.05}" --augment)
fi
out="${LABKIT_OUT:-runs/ps-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"
ps=(--strategy ps --ps-mode "$mode" --ps-servers "${PS_SERVERS:-1}" --ps-record "$out/ps-record.json")
if [[ "$mode" == ssp ]]; then
    ps+=(--max-staleness "${MAX_STALENESS:-2}")
fi
if [[ -n "${PS_SLOW_WORKER:-}" ]]; then
    ps+=(--ps-slow-worker "$PS_SLOW_WORKER")
fi

read -r -a extra <<< "${EXTRA_ARGS:-}"
cmd=("$python" -m labkit.dist.torchrun --standalone --nnodes 1 --nproc-per-node "$nproc"
     -m labkit train "${ps[@]}" --device "$device" --backend "$backend" "${sizes[@]}" --out "$out" "${resume[@]}"
     "${extra[@]}")

echo "labkit ps job ${SLURM_JOB_ID:-(no SLURM)} on $(hostname): $nproc rank(s) on $device ($backend), mode $mode"
echo "+ ${cmd[*]}"
run_ranks "$out" "${cmd[@]}"
echo "results: $out/summary.json"

#!/bin/bash
# Model parallelism in ONE process on ONE node: the flat model is cut into stages, one per GPU, and
# activations cross from GPU to GPU (labkit train --strategy model-parallel); with MP_SPLIT_SIZE the batch
# is fed as micro-batches so the GPUs overlap ("pipelined inputs"). Then, with SWEEP=1, the split-size sweep
# (labkit bench model-parallel --part sweep): throughput vs micro-batch size, plotted.
#
# Usage (from the repository root):
#   sbatch jobs/job_model_parallel.sh                                    # 1 node, 2 GPUs, alexnet_small on CIFAR10
#   sbatch --gres=gpu:4 jobs/job_model_parallel.sh                       # 4 stages on 4 GPUs
#   MP_SPLIT_SIZE=32 SWEEP=1 sbatch jobs/job_model_parallel.sh           # + the split-size sweep into <out>/sweep
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_model_parallel.sh    # CPU partition, tiny sizes
#   bash jobs/job_model_parallel.sh                                      # no SLURM: on this machine
#   (one process drives every GPU of the node: there is no multi-node form)
#
# Environment (all optional; defaults in brackets):
#   MODEL [alexnet_small]   DATASET [cifar10]   EPOCHS [5]   BATCH_SIZE [256]   OPTIMIZER [adam]   BASE_LR [0.001]
#   MP_DEVICES [the GPUs of the node; 2 stages on the CPU without GPUs]
#   MP_SPLIT_SIZE [64; 0 = the whole batch at once]   MP_BALANCE_BY [params; or time]
#   MP_SPLIT_POINTS: cut before these layer indices instead, e.g. "8 14"
#   SWEEP [0]: also run the split-size sweep   SPLIT_SIZES [8 16 32 64 128 256]
#   LABKIT_QUICK=1: lenet on the offline mnist-sample, a few steps, 2 CPU "devices"
#   RESUME [0]: 1 continues the checkpoint in LABKIT_OUT (a requeued job does so by itself)
#   Pre-emption and time limits: see jobs/lib/run.sh (--signal=B:USR1@120 below: checkpoint, requeue)
#   LABKIT_OUT: results folder [runs/model-parallel-<jobid>]; PYTHON [python3]
#
# Results: <LABKIT_OUT>/summary.json, metrics.jsonl (and sweep/ with split_size_sweep.png); in a notebook:
#   labkit.results.load_run("runs/model-parallel-<jobid>")
#
#SBATCH --job-name=labkit-model-parallel
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:2
#SBATCH --time=01:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=model-parallel-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python="${PYTHON:-python3}"
quick="${LABKIT_QUICK:-0}"
source jobs/lib/run.sh    # run_ranks; resume=(--resume) on a requeued run

source jobs/lib/gpus.sh   # visible_gpus: what torch will see
gpus=0
if [[ "$quick" == 0 ]]; then
    gpus="$(visible_gpus)"
fi
if (( gpus > 0 )); then
    device=cuda; stages="${MP_DEVICES:-$gpus}"
    (( gpus == 1 )) && echo "only one GPU: nothing to split across; request --gres=gpu:2 or more"
else
    # CPU: every stage is the CPU; it runs and is correct, but nothing overlaps (no speed-up)
    device=cpu; stages="${MP_DEVICES:-2}"
fi

split=()
if [[ "$quick" != 0 ]]; then
    sizes=(--model "${MODEL:-lenet}" --dataset "${DATASET:-mnist-sample}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-32}" --optimizer "${OPTIMIZER:-sgd}" --base-lr "${BASE_LR:-0.05}"
           --max-steps 8 --train-size 512
           --test-size 256 --log-every 2)
    split_size="${MP_SPLIT_SIZE:-8}"
    sweep_sizes=(--model lenet --dataset mnist-sample --batch-size 32 --split-sizes 8 16 --steps 2 --rounds 1)
else
    sizes=(--model "${MODEL:-alexnet_small}" --dataset "${DATASET:-cifar10}" --epochs "${EPOCHS:-5}"
           --batch-size "${BATCH_SIZE:-256}" --optimizer "${OPTIMIZER:-adam}" --base-lr "${BASE_LR:-0.001}" --augment)
    split_size="${MP_SPLIT_SIZE:-64}"
    read -r -a split_sizes <<< "${SPLIT_SIZES:-8 16 32 64 128 256}"
    sweep_sizes=(--model "${MODEL:-alexnet_small}" --dataset "${DATASET:-cifar10}" --batch-size "${BATCH_SIZE:-256}"
                 --split-sizes "${split_sizes[@]}" --steps 10 --rounds 3)
fi
(( split_size > 0 )) && split=(--mp-split-size "$split_size")
if [[ -n "${MP_SPLIT_POINTS:-}" ]]; then
    read -r -a points <<< "$MP_SPLIT_POINTS"
    placement=(--mp-split-points "${points[@]}")
else
    placement=(--mp-devices "$stages" --mp-balance-by "${MP_BALANCE_BY:-params}")
fi
out="${LABKIT_OUT:-runs/model-parallel-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"
cmd=("$python" -m labkit train --strategy model-parallel --device "$device" "${placement[@]}" "${split[@]}"
     "${sizes[@]}" --out "$out")

echo "labkit model-parallel job ${SLURM_JOB_ID:-(no SLURM)} on $(hostname): $stages stage(s) on $device"
cmd+=("${resume[@]}")
echo "+ ${cmd[*]}"
run_ranks "$out" "${cmd[@]}"
if [[ "${SWEEP:-0}" != 0 ]]; then
    sweep=("$python" -m labkit bench model-parallel --part sweep --device "$device" --mp-devices "$stages"
           "${sweep_sizes[@]}" --out "$out/sweep")
    echo "+ ${sweep[*]}"
    "${sweep[@]}"
fi
echo "results: $out/summary.json"

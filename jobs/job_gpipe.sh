#!/bin/bash
# GPipe with labkit's trainer: one process drives all GPUs of ONE node, the model cut into partitions
# (labkit train --strategy gpipe). The seed's hands-on versions are in jobs/gpipe/.
#
# Usage (from the repository root):
#   sbatch jobs/job_gpipe.sh                                         # 1 node, 2 GPUs, ResNet-50 on MNIST
#   sbatch --gres=gpu:4 jobs/job_gpipe.sh                            # 4 partitions on 4 GPUs
#   NUM_MICROBATCHES=16 CHECKPOINT_MODE=always sbatch jobs/job_gpipe.sh
#   SWEEP=1 sbatch jobs/job_gpipe.sh                                 # + the micro-batch sweep (labkit bench gpipe)
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_gpipe.sh         # CPU partition, tiny sizes
#   bash jobs/job_gpipe.sh                                           # no SLURM: on this machine
#
# Environment (all optional; defaults in brackets):
#   MODEL [resnet50]   DATASET [mnist]   EPOCHS [1]   BATCH_SIZE [512]   NUM_MICROBATCHES [8]
#   BALANCE_BY [time; or memory]   CHECKPOINT_MODE [except_last; always, never]
#   PARTITIONS [the GPUs of the node; 2 CPU partitions without GPUs]
#   SWEEP [0]: also run `labkit bench gpipe sweep` (throughput and peak memory vs micro-batches) into <out>/sweep
#   LABKIT_QUICK=1: lenet on the offline mnist-sample, a few steps, CPU
#   RESUME [0]: 1 continues the checkpoint in LABKIT_OUT (a requeued job does so by itself)
#   Pre-emption and time limits: see jobs/lib/run.sh (--signal=B:USR1@120 below: checkpoint, requeue)
#   LABKIT_OUT: results folder [runs/gpipe-<jobid>]; PYTHON [python3]
#
# Results: <LABKIT_OUT>/summary.json, metrics.jsonl; in a notebook: labkit.results.load_run("runs/gpipe-<jobid>")
#
#SBATCH --job-name=labkit-gpipe
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:2
#SBATCH --time=01:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=gpipe-%j.out

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
if (( gpus > 0 )); then device=cuda; partitions="${PARTITIONS:-$gpus}"; else device=cpu; partitions="${PARTITIONS:-2}"; fi

if [[ "$quick" != 0 ]]; then
    sizes=(--model "${MODEL:-lenet}" --dataset "${DATASET:-mnist-sample}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-32}" --num-microbatches "${NUM_MICROBATCHES:-4}" --max-steps 8
           --train-size 512 --test-size 256 --log-every 2)
else
    sizes=(--model "${MODEL:-resnet50}" --dataset "${DATASET:-mnist}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-512}" --num-microbatches "${NUM_MICROBATCHES:-8}")
fi
out="${LABKIT_OUT:-runs/gpipe-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"
cmd=("$python" -m labkit train --strategy gpipe --device "$device" --partitions "$partitions"
     --balance-by "${BALANCE_BY:-time}" --checkpoint-mode "${CHECKPOINT_MODE:-except_last}" "${sizes[@]}" --out "$out")

echo "labkit gpipe job ${SLURM_JOB_ID:-(no SLURM)} on $(hostname): $partitions partition(s) on $device"
cmd+=("${resume[@]}")
echo "+ ${cmd[*]}"
run_ranks "$out" "${cmd[@]}"
if [[ "${SWEEP:-0}" != 0 ]]; then
    sweep=("$python" -m labkit bench gpipe sweep --device "$device" --partitions "$partitions" --out "$out/sweep"
           --checkpoint always never)
    if [[ "$quick" != 0 ]]; then
        sweep+=(--model lenet --dataset mnist-sample --batch-size 32 --chunks 1 4 --steps 2)
    else
        sweep+=(--model "${MODEL:-resnet50}" --dataset "${DATASET:-mnist}" --batch-size "${BATCH_SIZE:-512}"
                --chunks 1 2 4 8 16 --steps 10)
    fi
    echo "+ ${sweep[*]}"
    "${sweep[@]}"
fi
echo "results: $out/summary.json"

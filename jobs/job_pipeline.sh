#!/bin/bash
# Pipeline schedules across processes: one stage per rank on ONE node, torch.distributed.pipelining's
# GPipe (fill-drain) and 1F1B schedules one after the other, each with its measured per-rank timeline
# (labkit train --strategy pipeline --schedule gpipe|1f1b --pipeline-trace ...).
#
# Usage (from the repository root):
#   sbatch jobs/job_pipeline.sh                                      # 1 node, 4 GPUs: 4 stages (NCCL)
#   sbatch --gres=gpu:2 jobs/job_pipeline.sh                         # 2 stages
#   SCHEDULES=1f1b NUM_MICROBATCHES=16 sbatch jobs/job_pipeline.sh
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_pipeline.sh      # CPU partition, tiny sizes (gloo)
#   bash jobs/job_pipeline.sh                                        # no SLURM: torchrun on this machine
#
# Environment (all optional; defaults in brackets):
#   SCHEDULES ["gpipe 1f1b"]   MODEL [resnet50]   DATASET [mnist]   EPOCHS [1]   BATCH_SIZE [256]
#   NUM_MICROBATCHES [8]   BALANCE: layers per stage, e.g. "12 11" [as even as possible]
#   NPROC [the GPUs of the node, at least 2; 2 on CPU]   TRACE_STEPS [3]
#   LABKIT_QUICK=1: lenet on the offline mnist-sample, a few steps, CPU/gloo
#   LABKIT_OUT: results folder [runs/pipeline-<jobid>], one sub-folder per schedule; PYTHON [python3]
#
# Results: <LABKIT_OUT>/<schedule>/summary.json, metrics.jsonl and timeline.json; in a notebook:
#   from labkit.viz.pipeline import load_trace, compare_schedules
#   compare_schedules({s: load_trace(f"runs/pipeline-<jobid>/{s}/timeline.json") for s in ("gpipe", "1f1b")})
#
#SBATCH --job-name=labkit-pipeline
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:4
#SBATCH --time=01:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=pipeline-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python="${PYTHON:-python3}"
quick="${LABKIT_QUICK:-0}"

min_gpus=2  # a single GPU cannot hold two NCCL ranks: then the stages run on the CPU with gloo
source jobs/lib/ranks.sh  # sets gpus, device (cuda|cpu), backend (nccl|gloo), nproc
source jobs/lib/run.sh    # run_ranks; resume=(--resume) on a requeued run

if [[ "$quick" != 0 ]]; then
    sizes=(--model "${MODEL:-lenet}" --dataset "${DATASET:-mnist-sample}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-32}" --num-microbatches "${NUM_MICROBATCHES:-4}" --max-steps 6
           --train-size 512 --test-size 256 --log-every 2)
else
    sizes=(--model "${MODEL:-resnet50}" --dataset "${DATASET:-mnist}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-256}" --num-microbatches "${NUM_MICROBATCHES:-8}")
fi
balance=()
if [[ -n "${BALANCE:-}" ]]; then read -r -a layers <<< "$BALANCE"; balance=(--balance "${layers[@]}"); fi
out="${LABKIT_OUT:-runs/pipeline-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"

echo "labkit pipeline job ${SLURM_JOB_ID:-(no SLURM)} on $(hostname): $nproc stage(s) on $device ($backend)"
for schedule in ${SCHEDULES:-gpipe 1f1b}; do
    cmd=("$python" -m labkit.dist.torchrun --standalone --nnodes 1 --nproc-per-node "$nproc"
         -m labkit train --strategy pipeline --schedule "$schedule" --device "$device" --backend "$backend"
         "${sizes[@]}" "${balance[@]}" --trace-steps "${TRACE_STEPS:-3}"
         --pipeline-trace "$out/$schedule/timeline.json" --out "$out/$schedule")
    echo "+ ${cmd[*]}"
    run_ranks "$out/$schedule" "${cmd[@]}" "${resume[@]}"
done
echo "results: $out/<schedule>/summary.json and timeline.json"

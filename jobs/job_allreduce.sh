#!/bin/bash
# All-reduce on one node: check every labkit algorithm against the backend's own all-reduce, then time them
# all on the same ranks, in one launch (NCCL on GPUs, one rank per GPU; gloo on CPU) next to the fitted
# alpha-beta cost model.
#
# Usage (from the repository root):
#   sbatch jobs/job_allreduce.sh                                  # all GPUs of the node (4 requested), NCCL
#   sbatch --gres=gpu:2 jobs/job_allreduce.sh                     # fewer GPUs
#   ALLREDUCE_SIZES=1MiB,1GiB sbatch jobs/job_allreduce.sh        # other vector sizes
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_allreduce.sh  # CPU partition, tiny sizes
#   bash jobs/job_allreduce.sh                                    # no SLURM: this machine (GPUs or CPU)
#
# Environment (all optional; defaults in brackets):
#   ALLREDUCE_RANKS [the GPUs of the node; 2 CPU ranks with fewer than 2 GPUs]
#   ALLREDUCE_ALGO [all; or e.g. ring,tree]
#   ALLREDUCE_SIZES [1KiB,64KiB,1MiB,16MiB,256MiB on GPUs; 1KiB,64KiB,1MiB,16MiB on CPU; 1KiB,64KiB quick]
#   ALLREDUCE_REPEATS [10 on GPUs; 5 on CPU; 2 quick]
#   LABKIT_QUICK=1: CPU, tiny sizes     LABKIT_OUT: results folder [runs/allreduce-<jobid>]; PYTHON [python3]
#
# pre-emption: none (a few minutes of measurements, nothing to continue: run it again); a configuration
# error (e.g. an unknown ALLREDUCE_ALGO) is one `labkit: error:` line and exit code 2
#
# Results: <LABKIT_OUT>/summary.json and metrics.jsonl (records of kind "bench", "cost-model", "trace");
# in notebook 01: labkit.results.load_run("runs/allreduce-<jobid>")
#
#SBATCH --job-name=labkit-allreduce
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:4
#SBATCH --time=00:30:00
#SBATCH --output=allreduce-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python="${PYTHON:-python3}"
quick="${LABKIT_QUICK:-0}"

source jobs/lib/gpus.sh  # visible_gpus: the GPUs torch in this job will see, without starting Python
gpus=0
if [[ "$quick" == 0 ]]; then
    gpus="$(visible_gpus)"
fi
if (( gpus >= 2 )); then
    device=cuda; ranks="${ALLREDUCE_RANKS:-$gpus}"
    sizes="${ALLREDUCE_SIZES:-1KiB,64KiB,1MiB,16MiB,256MiB}"; repeats="${ALLREDUCE_REPEATS:-10}"
else
    # Fewer than 2 GPUs: ranks cannot each own one, so they run on the CPU with gloo.
    device=cpu; ranks="${ALLREDUCE_RANKS:-2}"
    sizes="${ALLREDUCE_SIZES:-1KiB,64KiB,1MiB,16MiB}"; repeats="${ALLREDUCE_REPEATS:-5}"
fi
if [[ "$quick" != 0 ]]; then
    sizes="${ALLREDUCE_SIZES:-1KiB,64KiB}"; repeats="${ALLREDUCE_REPEATS:-2}"
fi
algo="${ALLREDUCE_ALGO:-all}"
out="${LABKIT_OUT:-runs/allreduce-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"

echo "labkit all-reduce job ${SLURM_JOB_ID:-(no SLURM)} on $(hostname): $ranks ranks on $device"
# one launch: --verify checks every algorithm first (a mismatch: exit 1, nothing timed), then the same ranks time them
bench=("$python" -m labkit.dist.torchrun --standalone --nnodes 1 --nproc-per-node "$ranks" -m labkit allreduce
       bench --verify --algo "$algo" --sizes "$sizes" --repeats "$repeats" --device "$device" --out "$out")
echo "+ ${bench[*]}"
"${bench[@]}"
echo "results: $out/summary.json"

#!/bin/bash
# SGD, then SGD + K-FAC, on ONE node (the seed-004 CIFAR-10 ResNet-32 experiment): torchrun, one rank per GPU.
#
# Usage (from the repository root):
#   sbatch jobs/job_kfac.sh                                   # 1 node, 4 GPUs (the #SBATCH lines below)
#   sbatch --gres=gpu:1 jobs/job_kfac.sh                      # 1 GPU; --gres=gpu:2 / gpu:8 for the other columns
#   SBATCH_GRES=none LABKIT_QUICK=1 sbatch jobs/job_kfac.sh   # CPU partition, tiny sizes (gloo)
#   bash jobs/job_kfac.sh                                     # no SLURM: torchrun on this machine
#   CIFAR-10 must be on disk first (login node): labkit data fetch cifar10
#
# Both runs use the seed's flags: --base-lr 0.1 --batch-size 128 --epochs 100 --lr-decay 35 75 90, with
# --kfac-update-freq 0 (plain SGD, as the seed writes it) and then --kfac-update-freq 10 (K-FAC).
#
# Environment (all optional; defaults in brackets):
#   MODEL [resnet32]   DATASET [cifar10]   EPOCHS [100]   BATCH_SIZE [128, per rank]   BASE_LR [0.1]
#   LR_DECAY ["35 75 90"]   WARMUP_EPOCHS [5]   WEIGHT_DECAY [5e-4]   KFAC_UPDATE_FREQ [10]
#   NPROC [the GPUs; 2 on CPU]   (as the seed's kfac_pytorch example: LR × ranks, 5 warm-up epochs, crops/flips)
#   EXTRA_ARGS: more `labkit train` flags for both runs, e.g. "--kfac-method inverse"
#   RUNS ["sgd kfac"]: the runs, in order; "kfac" alone skips the SGD baseline
#   LABKIT_QUICK=1: lenet on the offline mnist-sample, 1 short epoch, CPU/gloo
#   LABKIT_OUT: results folder [runs/kfac-<jobid>]; PYTHON [python3]
#
# Results: <LABKIT_OUT>/sgd/ and <LABKIT_OUT>/kfac/ (summary.json + metrics.jsonl each), and
# <LABKIT_OUT>/summary.json comparing them (validation accuracy, time, samples/sec); in a notebook:
#   labkit.results.load_run("runs/kfac-<jobid>/kfac").records_of("epoch")
#
#SBATCH --job-name=labkit-kfac
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:4
#SBATCH --time=08:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=kfac-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
python="${PYTHON:-python3}"
quick="${LABKIT_QUICK:-0}"

source jobs/lib/ranks.sh  # sets gpus, device (cuda|cpu), backend (nccl|gloo), nproc
source jobs/lib/run.sh    # run_ranks; resume=(--resume) on a requeued run

read -r -a decay <<< "${LR_DECAY:-35 75 90}"
if [[ "$quick" != 0 ]]; then
    sizes=(--model "${MODEL:-lenet}" --dataset "${DATASET:-mnist-sample}" --epochs "${EPOCHS:-1}"
           --batch-size "${BATCH_SIZE:-32}" --base-lr "${BASE_LR:-0.05}" --train-size 512 --test-size 256
           --log-every 4)
    freq="${KFAC_UPDATE_FREQ:-2}"
else
    sizes=(--model "${MODEL:-resnet32}" --dataset "${DATASET:-cifar10}" --epochs "${EPOCHS:-100}"
           --batch-size "${BATCH_SIZE:-128}" --base-lr "${BASE_LR:-0.1}" --lr-decay "${decay[@]}"
           --scale-lr --warmup-epochs "${WARMUP_EPOCHS:-5}" --weight-decay "${WEIGHT_DECAY:-5e-4}" --augment)
    freq="${KFAC_UPDATE_FREQ:-10}"
fi
out="${LABKIT_OUT:-runs/kfac-${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)}}"
read -r -a extra <<< "${EXTRA_ARGS:-}"
read -r -a runs <<< "${RUNS:-sgd kfac}"
(( ${#runs[@]} )) || { echo "labkit: error: RUNS is empty; use sgd, kfac or both" >&2; exit 2; }
for run in "${runs[@]}"; do
    [[ "$run" == sgd || "$run" == kfac ]] || { echo "labkit: error: RUNS: unknown run '$run'; use sgd, kfac" >&2; exit 2; }
done

echo "labkit K-FAC job ${SLURM_JOB_ID:-(no SLURM)} on $(hostname): $nproc rank(s) on $device ($backend)"
for run in "${runs[@]}"; do
    update=0
    [[ "$run" == kfac ]] && update="$freq"
    cmd=("$python" -m labkit.dist.torchrun --standalone --nnodes 1 --nproc-per-node "$nproc"
         -m labkit train --strategy ddp --device "$device" --backend "$backend" "${sizes[@]}"
         --optimizer kfac --kfac-update-freq "$update" --name "$run-$nproc-ranks" --out "$out/$run" "${extra[@]}")
    echo "+ ${cmd[*]}"
    run_ranks "$out/$run" "${cmd[@]}" "${resume[@]}"
done

"$python" - "$out" "$nproc" "${runs[@]}" <<'EOF'
import sys

from labkit.results import RunWriter, host_environment, load_run

out, nproc, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
runs = {name: load_run(f"{out}/{name}") for name in names}
keys = ("final_test_acc", "best_test_acc", "time_s", "samples_per_sec")
metrics = {name: {k: run.summary["metrics"].get(k) for k in keys} for name, run in runs.items()}
print(f"validation accuracy, {nproc} rank(s):")
for name, m in metrics.items():
    print(f"  {name:<5} final {m['final_test_acc']:.2%}  best {m['best_test_acc']:.2%}  "
          f"time {m['time_s']:.0f} s  {m['samples_per_sec']:.1f} samples/sec")
top = "kfac" if "kfac" in runs else names[-1]
config = {"world_size": nproc, "runs": {name: f"{out}/{name}" for name in runs},
          "train": runs[top].summary["config"]}
# top level: the K-FAC run's numbers (what a single-run summary holds); per run below
RunWriter(out, append=True).finish("kfac-vs-sgd", "comparison", config, {**metrics[top], **metrics},
                                   host=host_environment(runs[top]))  # the ranks' host: no torch to import here
EOF
echo "results: $out/summary.json (${runs[*]/#/$out/})"

# Sourced by the job scripts (after they cd to the repository root): where do the ranks run?
#
# Sets
#   gpus      GPUs this job sees (jobs/lib/gpus.sh; 0 with LABKIT_QUICK=1, or where nvidia-smi is missing)
#   device    cuda | cpu          backend   nccl | gloo
#   nproc     ranks on this node: $NPROC, else one per GPU, else $cpu_ranks (default 2) CPU ranks
# Reads
#   min_gpus  fewer GPUs than this run on the CPU instead (default 1; 2 where ranks must each own a GPU)
#   cpu_ranks CPU ranks when there is no GPU (default 2)
# CPU ranks get one thread each (OMP_NUM_THREADS=1 unless set), so they do not fight over the cores.
source jobs/lib/gpus.sh
gpus=0
if [[ "${LABKIT_QUICK:-0}" == 0 ]]; then
    gpus="$(visible_gpus)"
fi
if (( gpus >= ${min_gpus:-1} )); then
    device=cuda; backend=nccl; nproc="${NPROC:-$gpus}"
else
    device=cpu; backend=gloo; nproc="${NPROC:-${cpu_ranks:-2}}"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi

# Sourced by the job scripts: visible_gpus prints how many GPUs torch in this job will see.
#
# torch sees CUDA_VISIBLE_DEVICES when it is set (SLURM sets it for --gres=gpu:N): its ids up to the first invalid
# one (-1, or an empty list: none), never more than the node has. nvidia-smi -L lists every GPU of the node
# whatever CUDA_VISIBLE_DEVICES says, so it is only the count where nothing restricts visibility (then
# SLURM_GPUS_ON_NODE, the job's allocation, when SLURM gives it). 0 where nvidia-smi is missing.
visible_gpus() {
    local node=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        node="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    fi
    if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
        local count=0 id
        local IFS=,
        for id in ${CUDA_VISIBLE_DEVICES// /}; do
            [[ -z "$id" || "$id" == -* ]] && break
            count=$((count + 1))
        done
        echo $(( count < node ? count : node ))
    elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]] && (( node > 0 )); then
        echo $(( SLURM_GPUS_ON_NODE < node ? SLURM_GPUS_ON_NODE : node ))
    else
        echo "$node"
    fi
}

# Sourced by the job scripts whose ranks may span nodes: sets nnodes, rdzv (torchrun's rendezvous flags) and
# run_nodes (run.sh starts one torchrun per node).
#
# In a SLURM job every node's torchrun meets at the allocation's first node, at the address the other nodes reach
# it by (its NodeAddr, else its name), on port RDZV_PORT (default 29500 + job id mod 1000, so two jobs sharing a
# node do not collide), each waiting up to RDZV_READ_TIMEOUT s (300) for it. Without SLURM: this machine alone,
# `torchrun --standalone`.
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    nnodes="${SLURM_NNODES:-1}"
    head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    head_addr="$(scontrol show node "$head_node" -o 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2 || true)"
    head_addr="${head_addr:-$head_node}"
    port="${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}"
    run_nodes="$nnodes"
    # read_timeout: how long a node's torchrun waits for the store on the first node (torch's default, 60 s, is
    # shorter than a busy node can take to start the head's launcher: the job then dies before any rank starts)
    rdzv=(--nnodes "$nnodes" --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$head_addr:$port"
          --rdzv-conf "read_timeout=${RDZV_READ_TIMEOUT:-300}")
else
    nnodes=1
    rdzv=(--standalone --nnodes 1)
fi

#!/bin/bash
# JupyterLab on a compute node, reached from your own computer through an ssh tunnel.
#
# Usage:
#   sbatch jobs/job_jupyter.sh                     # from the repository root on the login node
#   cat jupyter-<jobid>.out                        # shows the ssh command and the URL to open
#   scancel <jobid>                                # when done (it also stops at the time limit)
#
#   sbatch --gres=none jobs/job_jupyter.sh         # on a CPU partition (or SBATCH_GRES=none)
#   sbatch --time=8:00:00 jobs/job_jupyter.sh      # a longer session
#   bash jobs/job_jupyter.sh                       # no SLURM: JupyterLab on this machine
#
# Environment (all optional):
#   JUPYTER_PORT   port on the compute node      (default: a free port picked at start)
#   LOGIN_HOST     the host you ssh to           (default: the host the job was submitted from)
#   NOTEBOOK_DIR   folder JupyterLab opens       (default: the directory you submitted from)
#   LABKIT_QUICK   passed on to the notebooks' kernels (1 = tiny CPU sizes)
#
# Security: the server listens on 127.0.0.1 only and requires a token generated for this job,
# so other users of the node cannot reach it; the tunnel carries your traffic over ssh. The
# token is printed in this job's output file, which the job first makes readable by you only.
#
#SBATCH --job-name=labkit-jupyter
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=8
#SBATCH --gres=gpu:1
#SBATCH --time=04:00:00
#SBATCH --signal=B:TERM@60
#SBATCH --output=jupyter-%j.out

set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"

notebook_dir="${NOTEBOOK_DIR:-$PWD}"
port="${JUPYTER_PORT:-$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
# Read by jupyter_server from the environment, so the token never shows in `ps` output.
JUPYTER_TOKEN="$(python -c 'import secrets; print(secrets.token_urlsafe(32))')"
export JUPYTER_TOKEN
user="${USER:-$(id -un)}"
node="${SLURMD_NODENAME:-$(hostname -s)}"

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    # slurmstepd created the output file with the submitter's umask: close it before the token.
    stdout_file="$(scontrol show job "${SLURM_JOB_ID}" 2>/dev/null | sed -n 's/^ *StdOut=//p' || true)"
    if [[ -f "${stdout_file}" ]]; then chmod 600 "${stdout_file}"; fi
fi

echo "JupyterLab for labkit on ${node}, port ${port} (listening on 127.0.0.1 only)."
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    login="${LOGIN_HOST:-${SLURM_SUBMIT_HOST:-login}}"
    echo "1. On your own computer, open the tunnel and leave it running:"
    echo "   ssh -N -L ${port}:localhost:${port} -J ${user}@${login} ${user}@${node}"
    echo "2. Then open in your browser:"
    echo "   http://localhost:${port}/lab?token=${JUPYTER_TOKEN}"
    echo "3. When done: scancel ${SLURM_JOB_ID} (the job also ends at its time limit)."
else
    echo "1. From another computer, open a tunnel and leave it running:"
    echo "   ssh -N -L ${port}:localhost:${port} ${user}@$(hostname -f)"
    echo "2. Open in your browser (on this machine or through the tunnel):"
    echo "   http://localhost:${port}/lab?token=${JUPYTER_TOKEN}"
    echo "3. When done: Ctrl-C."
fi

root_flag=()
[[ "$(id -u)" == 0 ]] && root_flag=(--allow-root)  # containers often run as root

python -m jupyterlab --no-browser --ip=127.0.0.1 --port="${port}" --ServerApp.port_retries=0 \
    --ServerApp.root_dir="${notebook_dir}" "${root_flag[@]}" &
server=$!

# scancel and the time limit (--signal above, 60 s early) send SIGTERM: stop the server so it
# shuts its kernels down, then end the job with success.
stop() {
    echo "Stopping JupyterLab (job ending)."
    kill -TERM "${server}" 2>/dev/null || true
    wait "${server}" 2>/dev/null || true
    echo "JupyterLab stopped."
    exit 0
}
trap stop TERM INT USR1
wait "${server}"

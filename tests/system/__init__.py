"""End-to-end layers: a real one-node SLURM cluster and JupyterLab in a headless browser."""

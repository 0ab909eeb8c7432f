"""Helpers the notebooks call to run an experiment in one cell (training on forked gloo ranks, the sharding and parameter-server comparisons)."""

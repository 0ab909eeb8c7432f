def bubble_seconds(stage_times, stage_messages, microbatches):
    """Idle seconds of one fill-and-drain pipeline step (p stages, m micro-batches)."""
    p = len(stage_times)
    tau = 0.0  # TODO: the pace of the pipeline: the slowest stage, its message included
    return tau  # TODO: how many tau-long slots are idle on each stage?

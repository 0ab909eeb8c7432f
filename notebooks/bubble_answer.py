def bubble_seconds(stage_times, stage_messages, microbatches):
    tau = max(t + c for t, c in zip(stage_times, stage_messages))
    return (len(stage_times) - 1) * tau

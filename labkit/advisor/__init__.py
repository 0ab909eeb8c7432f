"""The strategy advisor (``labkit advise``, ``parallelize(model, "auto")``): a module per step; no torch on import.

What the measurement found on a 2-core machine, and why :mod:`.measure` times as it does:

* A collective costs more after computing (the ranks' threads go to sleep, the ranks drift apart). On 2 gloo
  ranks an all-reduce of 4 bytes took 0.3 ms back to back, 0.9 ms after 1 ms of computing and 2.2 ms after
  10 ms; one of 245 KB (LeNet's gradients) 2.2, 2.3 and 3.2 ms; the fastest single all-reduce of 1 MB 0.7 ms,
  back-to-back ones 2.4 ms each. So ``measure_link`` times each call after ``WORK_S`` (10 ms) of computing,
  neither back to back nor just after a barrier.
* The kinds differ: a 512 KB reduce-scatter took 2.6 ms, one ring step of as many bytes 0.4 ms; hence a fit per
  kind (``fit_kind``).
* A layer timed alone is not timed as the loop runs it (between two timed calls the worker threads sleep, and
  waking them costs more than a small layer's work), so the layers give the shape and ``labkit train``'s own
  step the level (``loop_costs``).
* A window shorter than a scheduler time slice is luck on a shared machine, and other programs only slow a
  window down: each level is the lower quartile of 9 windows of at least 50 ms (a median of 5 once caught a
  slow spell: LeNet 2x).
* A plan's ranks share the cores' caches, memory bandwidth and, on a shared machine, the cores' time: κ
  (``_together_rank``) was 1.1 on an idle machine and 1.5 to 2.2 for LeNet and AlexNet-small at 64 samples at
  one thread with other programs busy (κ = 1: nothing shared; 2: two processes get what one would).
"""

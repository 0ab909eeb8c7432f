"""The strategy advisor (``labkit advise``, ``labkit.parallelize(model, "auto")``): profile a model, price every
strategy on a topology, search, validate, apply, each in a module of its own (the package alone loads no torch)."""

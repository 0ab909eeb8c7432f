"""The strategy advisor (``labkit advise``, ``labkit.parallelize(model, "auto")``): profile a model, price every
strategy on a device topology, search, validate, apply. Importing this package is cheap (no torch); import its
modules (``labkit.advisor.advise``, ``.validate``, ``.search``, ...) for their parts."""

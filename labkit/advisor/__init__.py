"""The strategy advisor (``labkit advise``, ``parallelize(model, "auto")``): a module per step; no torch on import."""

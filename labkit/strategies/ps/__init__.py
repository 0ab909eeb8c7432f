"""The parameter server (``--strategy ps``): the strategy, the server's side, a worker's side and their options."""

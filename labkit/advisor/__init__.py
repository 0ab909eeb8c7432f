"""The strategy advisor: profile a model, price every strategy on a device topology, search, validate, apply.

    labkit advise --model alexnet_small --dataset synthetic-cifar10 --ranks 2 --validate
    par = labkit.parallelize("lenet", "auto", dataset="mnist-sample", ranks=2)   # .model, .strategy, .command

Importing this package is cheap (no torch); import its modules (``labkit.advisor.advise``, ``.validate``, ``.mesh``,
...) for their parts.
"""

"""Datasets and loaders: torchvision and offline sets, tensor-resident loaders, text, what is on disk and the ``labkit data`` command."""

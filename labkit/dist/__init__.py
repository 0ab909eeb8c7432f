"""The lowest layer: process groups, where a rank sits, which backend carries what, the mesh's shape, torchrun and the N-rank test helper."""

"""Start real multi-process runs from a notebook: locally through torchrun (:mod:`.local`) or as a SLURM batch job (:mod:`.slurm`)."""

"""K-FAC: the preconditioner (:mod:`.preconditioner`), its per-layer factors, linear algebra, KL clip, distributed work split, KAISA fraction and options."""

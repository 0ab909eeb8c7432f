"""Training: the one loop (:mod:`.loop`), a run built from its configuration (:mod:`.run`), the ``labkit train`` command and what a run keeps."""

"""``python -m labkit`` is the same as the ``labkit`` command.

A rank started by torchrun (``TORCHELASTIC_RUN_ID`` set) leaves with ``os._exit`` once the command has
returned: by then its results and checkpoint are closed on disk and its process group is torn down
(``labkit.dist.group.distributed`` ends with a barrier and ``destroy_process_group``), and what is left —
the interpreter's finalisation of torch's and gloo's C++ objects and threads — now and then aborted a
finished rank ("terminate called without an active exception", SIGABRT), failing a job whose work was done.
"""
import os
import sys

from labkit.cli import main

code = main()
if os.environ.get("TORCHELASTIC_RUN_ID"):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)

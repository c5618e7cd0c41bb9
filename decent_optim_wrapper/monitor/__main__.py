"""``python -m decent_optim_wrapper.monitor``: see :mod:`~decent_optim_wrapper.monitor.cli`."""

import os
import sys

from decent_optim_wrapper.monitor.cli import STUCK, main

code = main()
if any(thread.is_alive() for thread in STUCK):
    # A store client blocked in its handshake would abort the interpreter's exit ("terminate called
    # without an active exception"): leave at once, the error already said.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)

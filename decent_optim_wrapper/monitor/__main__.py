"""``python -m decent_optim_wrapper.monitor``: see :mod:`~decent_optim_wrapper.monitor.cli`."""

import sys

from decent_optim_wrapper.monitor.cli import main

sys.exit(main())

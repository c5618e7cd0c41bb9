"""``python -m decent_optim_wrapper.plan``: see :mod:`decent_optim_wrapper.plan.cli`."""

import sys

from decent_optim_wrapper.plan.cli import main

sys.exit(main())

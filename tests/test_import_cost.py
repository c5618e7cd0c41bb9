"""What ``import decent_optim_wrapper`` loads: nothing that only sharded training or an integration needs
(``benchmarks/costs/run.py import_time`` times it; this checks the cause, untimed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.pure

#: Modules a plain import must leave unloaded: DTensor (which pulls in sympy, seconds at every start-up),
#: FSDP, and the integrations with their frameworks.
NOT_AT_IMPORT = (
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "sympy",
    "decent_optim_wrapper.integrations.accelerate",
    "decent_optim_wrapper.integrations.lightning",
    "decent_optim_wrapper.integrations.transformers",
    "accelerate",
    "lightning",
    "transformers",
)


def test_importing_the_library_loads_nothing_only_sharding_or_an_integration_needs():
    script = f"import sys, decent_optim_wrapper; print([m for m in {NOT_AT_IMPORT!r} if m in sys.modules])"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=110, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr

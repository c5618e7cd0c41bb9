"""Watching a running elastic job: ``python -m decent_optim_wrapper.monitor --store HOST:PORT --job NAME``.

* :mod:`~decent_optim_wrapper.monitor.view` -- the members' status records merged into one view.
* :mod:`~decent_optim_wrapper.monitor.terminal` -- that view as a table that refreshes.
* :mod:`~decent_optim_wrapper.monitor.web` -- that view as a web page (``--serve PORT``).
* :mod:`~decent_optim_wrapper.monitor.cli` -- the command line.

Imports: :mod:`decent_optim_wrapper.engine`'s public face only. It only reads the store.
"""

from decent_optim_wrapper.monitor.view import fleet_view, read_view

__all__ = ["fleet_view", "read_view"]

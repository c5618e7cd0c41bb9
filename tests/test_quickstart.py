"""The main job (examples/quickstart.py) runs end to end on a few steps, table and figure included."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist
from helpers import load_script

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def _short_run() -> list:
    quickstart = load_script(QUICKSTART)
    results = quickstart.run(list(quickstart.METHODS), steps=30, batch_size=16, lr=0.05, log_every=10)
    return [asdict(r) for r in results] if dist.get_rank() == 0 else []


def test_quickstart_trains_every_method_and_writes_a_figure(pool, tmp_path, capsys):
    results = [SimpleNamespace(**r) for r in pool(2).run(_short_run)[0]]
    assert [r.method for r in results] == ["ring", "ring-module", "one-peer-exp", "complete", "ddp"]
    by_method = {r.method: r for r in results}
    # the two front-ends run the same recursion with the same optimizer: the same losses
    assert by_method["ring-module"].losses == by_method["ring"].losses
    for r in results:
        assert len(r.losses) == 30 and r.losses[-1] < r.losses[0]  # it learns
        assert 0.0 <= r.accuracy <= 1.0 and r.ms_per_iteration > 0 and r.bytes_per_step > 0
        assert (r.final_distance == 0.0) == (r.method == "ddp")
    quickstart = load_script(QUICKSTART)
    quickstart.print_table(results, 2)
    assert "avg-model acc" in capsys.readouterr().out
    figure = tmp_path / "fig.png"
    quickstart.plot(results, figure)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

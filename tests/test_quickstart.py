"""The main job (examples/quickstart.py) runs end to end on a few steps, table and figure included.

The split itself and the method names are checked without workers in test_data_split.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist
from helpers import load_script

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def _short_run(methods: list[str] | None = None, steps: int = 30, **data) -> list:
    quickstart = load_script(QUICKSTART)
    methods = list(quickstart.METHODS) if methods is None else methods
    results = quickstart.run(methods, steps=steps, batch_size=16, lr=0.05, log_every=10, **data)
    return [asdict(r) for r in results] if dist.get_rank() == 0 else []


def test_quickstart_trains_every_method_and_writes_a_figure(pool, tmp_path, capsys):
    results = [SimpleNamespace(**r) for r in pool(2).run(_short_run)[0]]
    assert [r.method for r in results] == [
        "ring",
        "ring-module",
        "ring@bf16",
        "one-peer-exp",
        "complete",
        "ddp",
    ]
    by_method = {r.method: r for r in results}
    # the two front-ends run the same recursion with the same optimizer: the same losses
    assert by_method["ring-module"].losses == by_method["ring"].losses
    # the engine counts what bf16 gossip sends: half the bytes of fp32 gossip (the exact first round
    # of each group is left out of the count)
    assert by_method["ring@bf16"].bytes_per_step == by_method["ring"].bytes_per_step / 2
    for r in results:
        assert len(r.losses) == 30 and r.losses[-1] < r.losses[0]  # it learns
        assert 0.0 <= r.accuracy <= 1.0 and r.ms_per_iteration > 0 and r.bytes_per_step > 0
        assert (r.final_distance == 0.0) == (r.method == "ddp")
        assert (r.split, r.alpha) == ("iid", None)
    quickstart = load_script(QUICKSTART)
    quickstart.print_table(results, 2)
    assert "avg-model acc" in capsys.readouterr().out
    figure = tmp_path / "fig.png"
    quickstart.plot(results, figure)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quickstart_trains_compressed_gossip_on_a_label_skewed_split(pool, capsys):
    methods = ["ring@bf16", "ring", "ddp"]
    results = pool(2).run(_short_run, methods, steps=10, split="dirichlet", alpha=0.1)[0]
    results = [SimpleNamespace(**r) for r in results]
    assert [r.method for r in results] == methods
    by_method = {r.method: r for r in results}
    for r in results:
        assert (r.split, r.alpha) == ("dirichlet", 0.1)
        assert len(r.losses) == 10 and all(map(math.isfinite, r.losses))
        assert 0.0 <= r.accuracy <= 1.0
    # the engine counts what bf16 gossip sends: fewer bytes than the same topology uncompressed
    assert 0 < by_method["ring@bf16"].bytes_per_step < by_method["ring"].bytes_per_step
    quickstart = load_script(QUICKSTART)
    quickstart.print_table(results, 2)
    out = capsys.readouterr().out
    assert "dirichlet(alpha=0.1) split" in out and "ring@bf16" in out


def test_quickstart_trains_with_gradient_tracking_on_both_front_ends(pool, capsys):
    methods = ["ring-gt", "ring-module-gt", "ring-gt@bf16", "ring", "ring@bf16"]
    results = pool(2).run(_short_run, methods, steps=10, split="dirichlet", alpha=0.1)[0]
    results = [SimpleNamespace(**r) for r in results]
    assert [r.method for r in results] == methods
    by_method = {r.method: r for r in results}
    for r in results:
        assert len(r.losses) == 10 and all(map(math.isfinite, r.losses))
        assert 0.0 <= r.accuracy <= 1.0 and r.final_distance > 0
    # both front-ends track the same way (the module one per bucket inside backward): the same losses
    assert by_method["ring-module-gt"].losses == by_method["ring-gt"].losses
    # tracking changes the update: the tracked run is not the plain one
    assert by_method["ring-gt"].losses != by_method["ring"].losses
    # the tracker travels beside the parameters, compressed like them: twice the bytes
    assert by_method["ring-gt"].bytes_per_step == 2 * by_method["ring"].bytes_per_step
    assert by_method["ring-gt@bf16"].bytes_per_step == 2 * by_method["ring@bf16"].bytes_per_step
    quickstart = load_script(QUICKSTART)
    quickstart.print_table(results, 2)
    assert "ring-module-gt" in capsys.readouterr().out

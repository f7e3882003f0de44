"""``clawcomm bench --calibrate``: each figure the median of several rounds,
their spread recorded in the model file and printed, a warning when the
spread is large or shared memory comes out slower than TCP."""

from __future__ import annotations

import json

from clawcomm.bench import calibrate
from clawcomm.cli import main
from clawcomm.cost_model import CostModel


def test_the_median_and_the_spread_of_the_rounds_and_their_warnings():
    rounds = [{"shm_alpha": a, "net_alpha": 10e-6} for a in (2e-6, 3e-6, 2.5e-6, 29e-6, 2.2e-6)]
    median, spread = calibrate.summarise(rounds)
    assert median == {"shm_alpha": 2.5e-6, "net_alpha": 10e-6}
    assert spread["shm_alpha"]["spread"] == 29 / 2 and spread["net_alpha"]["spread"] == 1.0
    model = CostModel(shm_alpha=median["shm_alpha"], net_alpha=median["net_alpha"])
    (warning,) = calibrate.warnings_of(model, spread)
    assert warning.startswith("shm_alpha varied 14.50x over 5 rounds")
    slow = CostModel(shm_alpha=20e-6, net_alpha=10e-6)
    calm = {k: {"rounds": [1.0], "spread": 1.0} for k in ("shm_alpha", "net_alpha")}
    (warning,) = calibrate.warnings_of(slow, calm)
    assert "shared memory came out slower than TCP (alpha 20.0 us against 10.0 us)" in warning


def test_calibrate_writes_the_median_and_the_spread(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(calibrate, "ROUNDS", 3)  # (the ranks are forked: they see it too)
    path = tmp_path / "model.json"
    assert main(["bench", "--calibrate", str(path)]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert data["rounds"] == 3
    for key in ("shm_alpha", "shm_beta", "net_alpha", "net_beta", "gamma"):
        rounds = data["spread"][key]["rounds"]
        assert len(rounds) == 3 and sorted(rounds)[1] == data[key]
    assert "the median of 3 rounds" in out and "spread (largest round" in out
    CostModel.load(str(path))  # still a model file

"""Calibration files (config/calibration): parsing, sources, and how sim.calibration applies them."""

from __future__ import annotations

import pytest

from config import ConfigError, load_config
from config.calibration import (CALIBRATION_DIR, CalibrationError, dump_calibration, load_calibration,
                                parse_calibration)

SHIPPED = sorted(CALIBRATION_DIR.glob("*.yaml"))


def doc(**costs):
    return {"format": "tidal-calibration/1", "name": "t", "device": "test", "measured": "2026-12-01",
            "weight_gb": 2.0, "costs": costs}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_calibration_parses_and_cites_a_source_for_each_cost(path):
    cal = load_calibration(path)
    assert cal.name == path.stem
    assert all(cost.source for cost in [*cal.costs.values(), *cal.weight_sync.values()])


def test_the_seed_presets_take_their_switch_costs_from_the_judgement_calibration():
    sim = load_config("sim/qwen35-35b-dynamic").sim
    got = (sim.calibration, sim.deactivate_s, sim.hybrid_sync_s, sim.activate_s, sim.rebalance_s, sim.broadcast_sync_s)
    assert got == ("qwen35-35b-judgement", 1.5, 1.5, 0.25, 0.25, 5.0)


def test_a_calibration_fills_the_costs_it_gives_at_the_weight_size_asked(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(dump_calibration(parse_calibration(doc(deactivate_s={"fixed_s": 1.0, "per_gb_s": 0.5, "source": "s"},
                                                           activate_s={"fixed_s": 0.1, "source": "s"}))))
    at_file_size = load_config("tiny-cpu", [f"sim.calibration={path}", "sim.hybrid_sync_s=7"]).sim
    assert (at_file_size.deactivate_s, at_file_size.activate_s, at_file_size.hybrid_sync_s) == (2.0, 0.1, 7.0)
    scaled = load_config("tiny-cpu", [f"sim.calibration={path}", "sim.calibration_weight_gb=4"]).sim
    assert scaled.deactivate_s == 3.0


def test_a_cost_the_config_sets_itself_wins_over_the_calibration():
    sim = load_config("sim/qwen35-35b-dynamic", ["sim.deactivate_s=9"]).sim
    assert (sim.deactivate_s, sim.hybrid_sync_s) == (9.0, 1.5)


def test_dump_and_load_give_back_the_same_calibration(tmp_path):
    cal = parse_calibration(doc(hybrid_sync_s={"fixed_s": 0.1, "per_gb_s": 0.02, "source": "measured on x: wake + load"}))
    (tmp_path / "c.yaml").write_text(dump_calibration(cal))
    assert load_calibration(tmp_path / "c.yaml") == cal


def test_a_cost_without_its_source_is_refused():
    with pytest.raises(CalibrationError) as err:
        parse_calibration(doc(deactivate_s={"fixed_s": 1.0}), where="f.yaml")
    assert str(err.value) == "f.yaml: costs.deactivate_s.source: every number needs its source"


def test_an_unknown_switch_cost_is_refused_naming_the_known_ones():
    with pytest.raises(CalibrationError) as err:
        parse_calibration(doc(sleep_s={"fixed_s": 1.0, "source": "s"}), where="f.yaml")
    assert str(err.value) == ("f.yaml: costs.sleep_s: unknown switch cost (known: deactivate_s, hybrid_sync_s, "
                              "activate_s, rebalance_s, broadcast_sync_s)")


def test_naming_a_calibration_that_does_not_exist_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", ["sim.calibration=nowhere"])
    assert str(err.value) == "sim: no file or calibration named 'nowhere' (shipped: cpu-weight-sync, qwen35-35b-judgement)"


# ---- the per-transport weight-sync model (``weight_sync``)

SYNC = {"collective": {"fixed_s": 0.5, "per_gb_s": 0.25, "source": "measured: gloo"},
        "in_rank": {"fixed_s": 0.0, "per_gb_s": 0.05, "source": "measured: copy_"}}


def test_a_weight_sync_model_alone_is_a_calibration_and_round_trips(tmp_path):
    cal = parse_calibration({**doc(), "costs": None, "weight_sync": SYNC})
    assert (cal.costs, sorted(cal.weight_sync)) == ({}, ["collective", "in_rank"])
    assert cal.sync_seconds("collective") == 0.5 + 0.25 * 2.0
    assert cal.sync_seconds("in_rank", 10.0) == pytest.approx(0.5)
    (tmp_path / "c.yaml").write_text(dump_calibration(cal))
    assert load_calibration(tmp_path / "c.yaml") == cal
    assert "\ncosts:" not in (tmp_path / "c.yaml").read_text()


def test_an_unknown_transport_in_the_model_is_refused_naming_the_known_ones():
    with pytest.raises(CalibrationError) as err:
        parse_calibration({**doc(), "weight_sync": {"nccl": {"fixed_s": 1.0, "source": "s"}}}, where="f.yaml")
    assert str(err.value) == "f.yaml: weight_sync.nccl: unknown transport (known: collective, in_rank, object_store)"


def test_a_transport_without_its_source_is_refused():
    with pytest.raises(CalibrationError) as err:
        parse_calibration({**doc(), "weight_sync": {"in_rank": {"per_gb_s": 0.1}}}, where="f.yaml")
    assert str(err.value) == "f.yaml: weight_sync.in_rank.source: every number needs its source"


def test_a_calibration_with_neither_costs_nor_a_model_is_refused():
    with pytest.raises(CalibrationError, match="costs must be a non-empty mapping"):
        parse_calibration({**doc(), "weight_sync": {}}, where="f.yaml")


def test_asking_the_model_for_a_transport_it_lacks_names_those_it_has():
    cal = parse_calibration({**doc(), "weight_sync": SYNC})
    with pytest.raises(CalibrationError) as err:
        cal.sync_seconds("object_store")
    assert str(err.value) == "calibration t: no weight_sync entry for transport 'object_store' (it has: collective, in_rank)"

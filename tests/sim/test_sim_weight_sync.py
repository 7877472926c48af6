"""The twin's weight syncs: a per-GB model by transport (a calibration's ``weight_sync``), the
transports ``sim.broadcast_transport`` / ``sim.hybrid_transport`` pick from it, and the transport
named in the twin's output."""

from __future__ import annotations

import pytest

from config import ConfigError, load_config
from config.calibration import dump_calibration, load_calibration, parse_calibration
from sim import simulate

SEED = "sim/qwen35-35b-dynamic"


def model_file(tmp_path, **extra):
    """A calibration with a weight-sync model of all three transports (and ``extra`` top-level keys)."""
    doc = {"format": "tidal-calibration/1", "name": "model", "device": "test", "measured": "2026-12-01",
           "weight_gb": 2.0,
           "weight_sync": {"collective": {"fixed_s": 0.5, "per_gb_s": 0.25, "source": "c"},
                           "in_rank": {"fixed_s": 0.1, "per_gb_s": 0.05, "source": "i"},
                           "object_store": {"fixed_s": 0.02, "per_gb_s": 4.0, "source": "o"}}, **extra}
    path = tmp_path / "model.yaml"
    path.write_text(dump_calibration(parse_calibration(doc)))
    return path


def sim_of(*overrides: str, preset: str = SEED):
    return load_config(preset, list(overrides)).sim


@pytest.mark.parametrize(("transports", "gb", "broadcast", "hybrid"), [
    ((), None, 0.5 + 0.25 * 2.0, 0.1 + 0.05 * 2.0),                                  # defaults, the file's size
    ((), 8.75, 0.5 + 0.25 * 8.75, 0.1 + 0.05 * 8.75),                               # the size asked
    (("sim.broadcast_transport=object_store",), 8.75, 0.02 + 4.0 * 8.75, 0.1 + 0.05 * 8.75),
    (("sim.hybrid_transport=object_store",), 8.75, 0.5 + 0.25 * 8.75, 0.02 + 4.0 * 8.75),
])
def test_the_syncs_are_fixed_plus_per_gb_times_the_weights_of_the_named_transport(tmp_path, transports, gb, broadcast,
                                                                                  hybrid):
    size = [f"sim.calibration_weight_gb={gb}"] if gb is not None else []
    sim = sim_of(f"sim.calibration={model_file(tmp_path)}", *size, *transports)
    assert (sim.broadcast_sync_s, sim.hybrid_sync_s) == pytest.approx((broadcast, hybrid))


def test_a_sync_the_config_sets_itself_wins_over_the_model(tmp_path):
    sim = sim_of(f"sim.calibration={model_file(tmp_path)}", "sim.broadcast_sync_s=7", "sim.calibration_weight_gb=4")
    assert (sim.broadcast_sync_s, sim.hybrid_sync_s) == pytest.approx((7.0, 0.1 + 0.05 * 4))


def test_the_model_wins_over_the_same_files_fixed_costs_and_the_other_costs_still_apply(tmp_path):
    path = model_file(tmp_path, costs={"broadcast_sync_s": {"fixed_s": 9.0, "source": "s"},
                                       "hybrid_sync_s": {"fixed_s": 9.0, "source": "s"},
                                       "deactivate_s": {"fixed_s": 0.7, "per_gb_s": 0.1, "source": "d"}})
    sim = sim_of(f"sim.calibration={path}")
    assert (sim.broadcast_sync_s, sim.hybrid_sync_s, sim.deactivate_s) == pytest.approx((1.0, 0.2, 0.9))


def test_a_calibration_without_a_model_keeps_its_fixed_costs_and_the_seed_preset_its_figures():
    sim = sim_of()
    assert (sim.calibration, sim.broadcast_transport, sim.hybrid_transport) == \
        ("qwen35-35b-judgement", "collective", "in_rank")
    assert (sim.broadcast_sync_s, sim.hybrid_sync_s) == (5.0, 1.5)
    assert not load_calibration("qwen35-35b-judgement").weight_sync


@pytest.mark.parametrize(("override", "message"), [
    ("sim.broadcast_transport=nccl", "sim: broadcast_transport: unknown transport 'nccl' (known: collective, object_store)"),
    ("sim.hybrid_transport=collective", "sim: hybrid_transport: unknown transport 'collective' (known: in_rank, object_store)"),
])
def test_an_unknown_transport_is_a_one_line_error_naming_the_known_ones(tmp_path, override, message):
    with pytest.raises(ConfigError) as err:
        sim_of(f"sim.calibration={model_file(tmp_path)}", override)
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:  # without a calibration: the schema's own check
        sim_of(override, preset="tiny-cpu")
    assert str(err.value).startswith(f"sim.{override.split('.')[1].split('=')[0]}: Input should be ")


def test_a_transport_the_model_lacks_is_an_error_unless_its_sync_is_set(tmp_path):
    path = tmp_path / "partial.yaml"
    path.write_text(dump_calibration(parse_calibration(
        {"format": "tidal-calibration/1", "name": "partial", "device": "test", "measured": "2026-12-01",
         "weight_gb": 1.0, "weight_sync": {"collective": {"fixed_s": 0.5, "source": "c"},
                                           "in_rank": {"fixed_s": 0.1, "source": "i"}}})))
    with pytest.raises(ConfigError) as err:
        sim_of(f"sim.calibration={path}", "sim.broadcast_transport=object_store")
    assert str(err.value) == ("sim: broadcast_transport: calibration partial has no weight_sync entry for "
                              "'object_store' (it has: collective, in_rank); set broadcast_sync_s or another transport")
    sim = sim_of(f"sim.calibration={path}", "sim.broadcast_transport=object_store", "sim.broadcast_sync_s=3")
    assert (sim.broadcast_sync_s, sim.broadcast_transport) == (3.0, "object_store")


def test_the_twins_output_names_each_syncs_transport_with_its_cost_and_count(tmp_path):
    cfg = load_config(SEED, [f"sim.calibration={model_file(tmp_path)}", "sim.calibration_weight_gb=8.75",
                             "sim.broadcast_transport=object_store"])
    result = simulate(cfg, steps=12)
    hybrid_syncs = sum(kind == "hybrid_sync" for _, kind in result.transition_kinds())
    assert hybrid_syncs > 0
    assert result.to_json()["weight_sync"] == {
        "broadcast": {"transport": "object_store", "seconds_each": pytest.approx(0.02 + 4.0 * 8.75), "syncs": 12,
                      "total_s": pytest.approx(12 * (0.02 + 4.0 * 8.75))},
        "hybrid_sync": {"transport": "in_rank", "seconds_each": pytest.approx(0.1 + 0.05 * 8.75), "syncs": hybrid_syncs,
                        "total_s": pytest.approx(hybrid_syncs * (0.1 + 0.05 * 8.75))},
    }
    assert result.weight_sync_line() == f"weight sync: broadcast object_store 35 s × 12, hybrid in_rank 0.537 s × {hybrid_syncs}"


def test_the_model_changes_the_twins_wall_clock_by_what_the_syncs_cost(tmp_path):
    """A dearer broadcast transport makes the run longer: the model reaches the simulator."""
    path = model_file(tmp_path)
    cheap = simulate(load_config(SEED, [f"sim.calibration={path}", "sim.calibration_weight_gb=8.75"]), steps=12)
    dear = simulate(load_config(SEED, [f"sim.calibration={path}", "sim.calibration_weight_gb=8.75",
                                       "sim.broadcast_transport=object_store"]), steps=12)
    assert dear.wall_clock_s > cheap.wall_clock_s + 12 * (35.02 - 2.6875) * 0.5


def test_a_static_run_has_no_hybrid_sync_to_name():
    result = simulate(load_config("sim/qwen35-35b-static-16-16"), steps=3)
    assert list(result.to_json()["weight_sync"]) == ["broadcast"]
    assert result.weight_sync_line() == "weight sync: broadcast collective 5 s × 3"


def test_the_shipped_cpu_calibration_models_every_transport_with_a_source():
    cal = load_calibration("cpu-weight-sync")
    assert sorted(cal.weight_sync) == ["collective", "in_rank", "object_store"]
    assert all(c.source and (c.fixed_s > 0 or c.per_gb_s > 0) for c in cal.weight_sync.values())
    sim = sim_of("sim.calibration=cpu-weight-sync", preset="tiny-cpu")
    assert sim.broadcast_sync_s == pytest.approx(cal.weight_sync["collective"].seconds(cal.weight_gb))
    assert sim.hybrid_sync_s == pytest.approx(cal.weight_sync["in_rank"].seconds(cal.weight_gb))

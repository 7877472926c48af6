"""bench_control_plane's counting: actor calls per step from the driver, and the before/after table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from bench_control_plane import StepTimes, over_rounds, per_round, ray_calls, side_by_side  # noqa: E402


def steps_starting_at(*starts: float) -> list[StepTimes]:
    return [StepTimes(i, start, {}, {}) for i, start in enumerate(starts, 1)]


def test_calls_are_counted_in_the_cycle_of_their_step_without_the_first_and_the_last_step():
    steps = steps_starting_at(0.0, 10.0, 20.0, 30.0, 40.0)
    calls = [[1.0, "stats"],  # step 1: start-up, not measured
             [10.0, "stats"], [15.0, "train"],  # step 2
             [20.5, "stats"], [21.0, "train"], [29.9, "broadcast"],  # step 3
             [30.0, "train"],  # step 4
             [41.0, "train"]]  # step 5, the last: no successor, not measured
    assert ray_calls(calls, steps) == {"per_step": 2, "each_step": [2, 3, 1],
                                       "by_method": {"stats": 1, "train": 1}}


def figures(calls: float, in_process: float, ray: float) -> dict:
    return {"setups": {"thread-embedded": {"ray_calls": {"per_step": calls}, "control": in_process},
                       "ray-server": {"control": ray}}}


def test_the_side_by_side_table_has_one_column_per_tree_and_the_change():
    lines = side_by_side({"baseline abc": figures(32, 0.40, 0.80), "this tree (def)": figures(8, 0.10, 0.60)})
    assert lines == [
        "| figure | baseline abc | this tree (def) | change |",
        "|---|---:|---:|---:|",
        "| `overhead.ray_calls_per_step` | 32 | 8 | -75% |",
        "| `overhead.seconds_per_step_in_process` | 0.400 | 0.100 | -75% |",
        "| `overhead.seconds_per_step_ray_runner` | 0.800 | 0.600 | -25% |",
    ]


def _round(control: float, ray_control: float, calls: float) -> dict:
    return {"steps": 10, "load_average": control * 10,
            "setups": {"thread-embedded": {"label": "in-process", "control": control, "cycle": 2 * control,
                                           "ray_calls": {"per_step": calls, "by_method": {"train": 2}}},
                       "ray-server": {"label": "ray", "control": ray_control, "cycle": 3 * ray_control,
                                      "ray_calls": {"per_step": 0, "by_method": {}}}}}


def test_rounds_combine_into_medians_per_setup_and_keep_each_rounds_headline():
    combined = over_rounds([_round(0.30, 0.9, 7), _round(0.10, 0.5, 6), _round(0.20, 0.7, 6)])
    inproc, ray = combined["setups"]["thread-embedded"], combined["setups"]["ray-server"]
    assert (inproc["control"], inproc["cycle"], inproc["ray_calls"]["per_step"], ray["control"]) == (0.20, 0.40, 6, 0.7)
    assert [r["seconds_per_step_in_process"] for r in combined["rounds"]] == [0.30, 0.10, 0.20]
    assert combined["load_average"] == 2.0  # the last round's
    line, blank = per_round({"baseline a": over_rounds([_round(0.4, 1, 9)] * 2), "this": combined})
    assert (line, blank) == ("Rounds, baseline and this tree alternated (medians above), in-process overhead s per "
                             "round: baseline a 0.400, 0.400; this 0.300, 0.100, 0.200.", "")
    assert per_round({"this": over_rounds([_round(0.1, 0.5, 6)])}) == []


def test_the_counter_records_every_actor_call_the_process_makes(tmp_path):
    (tmp_path / "two_calls.py").write_text(textwrap.dedent("""\
        import ray

        @ray.remote(num_cpus=0)
        class Echo:
            def say(self, x):
                return x

        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
        echo = Echo.remote()
        assert ray.get([echo.say.remote(1), echo.say.options(name="again").remote(2)]) == [1, 2]
        ray.shutdown()
        """))
    out = tmp_path / "calls.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "TIDAL_COUNT_RAY_CALLS": str(out),
           "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, str(BENCH / "ray_call_counter.py"), "two_calls"], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [name for _t, name in json.loads(out.read_text())] == ["say", "say"]


def test_write_puts_the_three_figures_and_the_baseline_into_results_json(tmp_path, monkeypatch):
    import bench_control_plane
    import results_io
    import run_all

    monkeypatch.setattr(results_io, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(run_all, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(run_all, "BENCH", tmp_path)

    def setup(label: str, calls: float, control: float) -> dict:
        return {"label": label, "control": control, "ray_calls": {"per_step": calls}}

    def tree(calls: float, in_process: float, ray: float) -> dict:
        return {"load_average": 1.0, "setups": {
            "thread-embedded": setup("in-process, embedded Prefect (default)", calls, in_process),
            "thread-server": setup("in-process, Prefect server", calls, in_process),
            "ray-server": setup("RayTaskRunner, Prefect server", 0, ray)}}

    bench_control_plane.write_figures({"baseline abc": tree(32, 0.6, 1.2), "this tree": tree(8, 0.12, 0.9)}, "cmd")
    overhead = json.loads((tmp_path / "results.json").read_text())["overhead"]
    assert {k: overhead[k] for k in ("ray_calls_per_step", "seconds_per_step_in_process",
                                     "seconds_per_step_ray_runner")} == {
        "ray_calls_per_step": 8, "seconds_per_step_in_process": 0.12, "seconds_per_step_ray_runner": 0.9}
    assert json.loads((tmp_path / "results" / "overhead.json").read_text())["before"] == {"baseline abc": {
        "ray_calls_per_step": 32, "seconds_per_step_in_process": 0.6, "seconds_per_step_ray_runner": 1.2}}

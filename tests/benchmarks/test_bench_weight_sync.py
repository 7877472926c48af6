"""benchmarks/bench_weight_sync.py at its smallest (``--quick``: 1M and 5M parameters, one sync each)
through ``main --write``: every transport timed, within one node and across two, for each size; the
JSON's keys, the RESULTS.md section; and the benchmark's own check that every receiver holds what the
trainer sent (a sync that delivers other weights raises)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_weight_sync  # noqa: E402
from driver_support import detached  # noqa: E402

SIZES = ("1m",)


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One ``--quick`` run as ``--write`` leaves it: (figures, RESULTS.md text, every sync's detail)."""
    tmp = tmp_path_factory.mktemp("bench_weight_sync")
    results, figures, detail = tmp / "RESULTS.md", tmp / "weight_sync.json", tmp / "detail.json"
    results.write_text("# Benchmark results\n\n<!-- multinode -->\nkept\n<!-- /multinode -->\n")
    with detached():  # the bench attaches this process to clusters of its own
        code = bench_weight_sync.main(["--quick", "--write", str(results), "--json-out", str(figures),
                                       "--json", str(detail)])
    assert code == 0
    return json.loads(figures.read_text()), results.read_text(), json.loads(detail.read_text())


@pytest.mark.slow
def test_every_transport_is_timed_for_every_size_and_topology(written):
    data, _, _ = written
    for size in SIZES:
        for topology, transports in (("one_node", ("object_store", "collective", "in_rank")),
                                     ("two_nodes", ("object_store", "collective"))):
            figures = data[topology]
            for transport in transports:
                assert positive(figures[f"{transport}_s_{size}"]), (topology, transport, size)
                assert positive(figures[f"{transport}_gb_per_s_{size}"]), (topology, transport, size)
            assert positive(figures[f"collective_formation_s_{size}"])
            assert figures[f"speedup_collective_vs_object_store_{size}"] == pytest.approx(
                figures[f"object_store_s_{size}"] / figures[f"collective_s_{size}"], rel=0.01)
        assert f"in_rank_s_{size}" not in data["two_nodes"]  # a hybrid lives in its trainer rank
    assert data["params"] == {"1m": 1_000_000}
    assert data["wire_bytes"] == {"1m": 2_000_000}  # bf16 on the wire
    assert data["dtype"] == "bfloat16" and data["replicas"] == 2
    assert "--quick" in data["command"] and data["date"]


@pytest.mark.slow
def test_the_replicas_ran_where_each_topology_puts_them_and_the_section_has_the_table(written):
    _, text, detail = written
    assert "<!-- multinode -->\nkept\n<!-- /multinode -->" in text
    section = text.split("<!-- weight_sync -->")[1].split("<!-- /weight_sync -->")[0]
    assert "python benchmarks/bench_weight_sync.py --quick" in section
    assert section.count("| one node |") == len(SIZES) and section.count("| two nodes |") == len(SIZES)
    assert "n/a" in section and "bus bandwidth" in section.lower()
    for size in SIZES:
        for topology in ("one_node", "two_nodes"):
            for transport in ("object_store", "collective"):
                xs = detail["sizes"][size][topology][transport]["all_s"]
                assert len(xs) == 1 and all(positive(x) for x in xs)


def test_the_model_has_exactly_the_asked_parameters_and_the_digest_sees_one_changed_value():
    for n in (1_000_000, 10_000_000, 500_000_000, 12_345):
        assert sum(math.prod(s) for _, s in bench_weight_sync.model_shapes(n)) == n
    a = [torch.randn(3, 4).to(torch.bfloat16), torch.randn(5).to(torch.bfloat16)]
    b = [t.clone() for t in a]
    assert bench_weight_sync.digest(a) == bench_weight_sync.digest(b)
    bench_weight_sync._stamp(b[0], 7)
    assert bench_weight_sync.digest(a) != bench_weight_sync.digest(b)
    assert bench_weight_sync.parse_size("500m") == 500_000_000 and bench_weight_sync.parse_size("2k") == 2000

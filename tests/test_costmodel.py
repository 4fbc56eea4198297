"""The cost model (scripts/lib/costmodel.py): its formulas, the limits where strategies must agree, what it
picks, and its validation against measurements (scripts/validate_sim.sh runs it on shaped links:
tests/test_validate_sim.py, slow)."""

import math
from dataclasses import replace

import pytest

import costmodel
from costmodel import Cluster, Link

C = Cluster(per_host=8, intra_bw=100e9, intra_lat=2e-6, inter_bw=10e9, inter_lat=20e-6)


def test_ring_and_tree_formulas():
    link = Link(lat=1e-3, bw=1e6)
    # all_reduce of 4 MB on 4 ranks: 2 x 3 steps of (1 ms + 1 MB / 1 MB/s)
    assert costmodel.ring_steps_time(4, 4e6, link, 2) == pytest.approx(6 * (1e-3 + 1.0))
    assert costmodel.ring_steps_time(4, 4e6, link, 2, messages=4) == pytest.approx(4 * 6 * (1e-3 + 0.25))
    assert costmodel.tree_all_reduce_time(8, 4e6, link) == pytest.approx(2 * 3 * 1e-3 + 2 * 7 / 8 * 4.0)
    assert costmodel.ring_steps_time(1, 4e6, link, 2) == 0.0


def test_on_one_host_hybrid_strategies_reduce_to_their_flat_selves():
    for flat, hybrid in (("zero3", "hsdp3"), ("zero2", "hsdp2"), ("ddp", "ddp_hierarchical")):
        a = costmodel.step_comm_time(flat, 1e9, 1, C, units=24)
        b = costmodel.step_comm_time(hybrid, 1e9, 1, C, units=24)
        assert b["replicas"] == 0.0 and b["total"] == pytest.approx(a["total"]), (flat, hybrid)


def test_across_hosts_only_one_shard_crosses():
    hosts, params = 64, 1e9
    t = costmodel.step_comm_time("hsdp3", params, hosts, C, units=1, comm_bytes=4)
    # the replicas' all_reduce of 4 Psi / G bytes over 64 hosts, the host's network shared by G rings
    expected = 2 * (hosts - 1) * (C.inter_lat + 4 * params / C.per_host / hosts / (C.inter_bw / C.per_host))
    assert t["replicas"] == pytest.approx(expected)
    # Bandwidth: a host's network carries 2 (R-1)/R x 4 Psi (G rings of 1/G) under hsdp3, against
    # 3 (N-1)/N x 4 Psi for zero3's world rings: about 2/3. Latency: R-1 steps across, not N-1.
    no_latency = replace(C, inter_lat=0.0, intra_lat=0.0)
    across = costmodel.step_comm_time("hsdp3", params, hosts, no_latency, units=1, comm_bytes=4)["replicas"]
    zero3 = costmodel.step_comm_time("zero3", params, hosts, no_latency, units=1, comm_bytes=4)["total"]
    assert across / zero3 == pytest.approx((2 * 63 / 64) / (3 * 511 / 512))
    many_units = [costmodel.step_comm_time(s, params, hosts, C, units=80)["total"] for s in ("hsdp3", "zero3")]
    assert many_units[0] < many_units[1] / 2


def test_memory_formulas_and_the_shard_size_that_fits():
    psi = 1e9
    assert costmodel.state_bytes_per_rank("zero3", psi, 4, 8) == pytest.approx(16 * psi / 32)
    assert costmodel.state_bytes_per_rank("hsdp3", psi, 4, 8) == pytest.approx(16 * psi / 8)
    assert costmodel.state_bytes_per_rank("zero2", psi, 4, 8) == pytest.approx(2 * psi + 14 * psi / 32)
    rows = costmodel.evaluate(70e9, 80, 128, costmodel.CLUSTERS["ib"])
    assert rows["hsdp3"]["shard"] == 32 and rows["hsdp3"]["fits"]  # 16 x 70e9 / 32 = 35 GB <= 40 GB
    assert not rows["ddp"]["fits"] and not rows["zero2"]["fits"]


def test_recommendations():
    pick, rows = costmodel.recommend(70e9, 80, 128, costmodel.CLUSTERS["ib"])
    assert pick == "hsdp3"
    assert costmodel.recommend(1e9, 24, 2048, costmodel.CLUSTERS["ethernet"])[0] == "hsdp3"
    assert costmodel.recommend(1e13, 80, 2, costmodel.CLUSTERS["ib"])[0] is None  # nothing fits 16 ranks
    assert all(math.isfinite(r["total"]) for r in rows.values())


def test_validation_passes_its_own_predictions_and_fails_a_third_off():
    m = {"hosts": 2, "per_host": 2, "params": 1 << 20, "messages": 2, "intra_lat": 1e-4, "intra_bw": 1e9,
         "inter_lat": 2e-3, "inter_bw": 25e6, "measured": {"ddp": 1.0, "zero3": 1.0, "ddp_hierarchical": 1.0, "hsdp3": 1.0}}
    m["measured"] = costmodel.predict_measured(m)
    assert costmodel.validate(m)[0]
    m["measured"] = {k: v * 1.5 for k, v in m["measured"].items()}  # predictions 33% low
    ok, text = costmodel.validate(m)
    assert not ok and "| ddp |" in text


def test_command_line(capsys):
    assert costmodel.main(["recommend", "--params", "7e9", "--hosts", "16", "--cluster", "ethernet"]) == 0
    out = capsys.readouterr().out
    assert "pick: " in out and "hsdp3" in out
    assert costmodel.main(["table"]) == 0
    assert "| 16,384 |" in capsys.readouterr().out


def test_levels_in_series_add_a_world_rings_hop_within_the_host_and_nothing_else():
    at_once = Cluster(per_host=2, intra_bw=4e6, intra_lat=0.0, inter_bw=1e6, inter_lat=0.0)
    series = replace(at_once, levels_in_series=True)
    psi = 1e6
    # ddp over 2 hosts x 2: 2 x 3 steps of psi/4 x 4 bytes; in series each step also pays its hop in the host
    assert costmodel.step_comm_time("ddp", psi, 2, at_once, comm_bytes=4)["total"] == pytest.approx(6 * psi / 1e6)
    assert costmodel.step_comm_time("ddp", psi, 2, series, comm_bytes=4)["total"] == pytest.approx(
        6 * psi * (1 / 1e6 + 1 / 4e6))
    # rings within a host and the replicas' rings (one rank per host) cross one level: unchanged
    for strategy in ("ddp_hierarchical", "hsdp3"):
        assert costmodel.step_comm_time(strategy, psi, 2, series, units=1)["total"] == pytest.approx(
            costmodel.step_comm_time(strategy, psi, 2, at_once, units=1)["total"])
    # what scripts/bench_mesh.py calibrates is priced in series; the tabulated GPU clusters are not
    assert Cluster.calibrated({"per_host": 2, "intra_bw": 4e6, "intra_lat": 0.0, "inter_bw": 1e6,
                               "inter_lat": 0.0}) == replace(series, codec_s=0.0)
    assert not any(c.levels_in_series for c in costmodel.CLUSTERS.values())


def test_wires_are_priced_by_their_bytes_and_the_all_to_all_by_what_leaves_each_host():
    two_by_two = Cluster(per_host=2, intra_bw=1e12, intra_lat=0.0, inter_bw=1e6, inter_lat=0.0)
    psi = 1e6
    plain = costmodel.step_comm_time("zero3", psi, 2, two_by_two, units=1, comm_bytes=4)
    # world rings of 4 ranks over 2 hosts: 3 steps of psi/4 x 4 bytes out of each host, three times
    assert plain["total"] == pytest.approx(3 * 3 * psi / 1e6)
    int8 = 1 + 4 / 256
    # int8 weights: the gathers' bytes x int8/4; int8 gradients: an all-to-all whose G (N-G) = 4
    # chunks of psi/4 leave each host (4 against the ring's 3), at int8's bytes
    both = costmodel.step_comm_time("zero3", psi, 2, two_by_two, units=1, comm_bytes=4,
                                    grad_wire="int8", param_wire="int8")
    assert both["total"] == pytest.approx((2 * 3 + 4) * psi / 4 * int8 / 1e6)
    # hpZ: the backward gather within the host costs (next to) nothing here
    zeropp = costmodel.step_comm_time("zero3", psi, 2, two_by_two, units=1, comm_bytes=4,
                                      grad_wire="int8", param_wire="int8", secondary=True)
    assert zeropp["total"] == pytest.approx((3 + 4) * psi / 4 * int8 / 1e6, rel=1e-3)
    # what validate prices for scripts/bench_mesh.py's zero3_zeropp pattern
    m = {"hosts": 2, "per_host": 2, "params": psi, "messages": 1, "intra_bw": 1e12, "intra_lat": 0.0,
         "inter_bw": 1e6, "inter_lat": 0.0, "measured": {"zero3": 1.0, "zero3_zeropp": 1.0}}
    predicted = costmodel.predict_measured(m)
    assert predicted["zero3_zeropp"] == pytest.approx(zeropp["total"])
    assert predicted["zero3_zeropp"] < predicted["zero3"] / 4


def test_diloco_pays_its_outer_step_once_a_round_and_zero_within_a_worker_as_hsdp_within_a_host():
    hosts, params = 16, 1e9
    h8, h16 = (costmodel.step_comm_time("diloco", params, hosts, C, sync_every=h, units=24) for h in (8, 16))
    assert h8["replicas"] == pytest.approx(2 * h16["replicas"]) and h8["replicas"] > 0
    # ZeRO-3 in each worker (a host): hsdp3's collectives within the host every step, its all_reduce
    # across the hosts 1/H of the steps; ZeRO-3's next forward gathers the written shards, no gather more
    zero = costmodel.step_comm_time("diloco", params, hosts, C, sync_every=8, units=24, options={"inner": "zero3"})
    hsdp = costmodel.step_comm_time("hsdp3", params, hosts, C, units=24)
    assert zero["group"] == pytest.approx(hsdp["group"]) and zero["replicas"] == pytest.approx(hsdp["replicas"] / 8)
    assert costmodel.state_bytes_per_rank("diloco", params, hosts, 8, options={"inner": "zero3"}) == \
        pytest.approx((16 + 8) * params / 8)  # hsdp3's state and the outer weights and momentum, over the host


def test_diloco_workers_run_the_first_inner_strategy_that_fits():
    ib = costmodel.CLUSTERS["ib"]
    assert costmodel.diloco_worker("diloco", 1e9, 8, ib) == ("ddp", ib.per_host)
    # 70B: (16 + 8) x 70e9 / S <= 40 GB takes S = 64 ranks, 8 hosts; at 64 ranks that leaves 1 worker: none
    assert costmodel.diloco_worker("diloco", 70e9, 128, ib) == ("zero3", 64)
    assert costmodel.diloco_worker("diloco", 70e9, 8, ib) is None

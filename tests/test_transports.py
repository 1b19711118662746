"""NIC profiles name their transport and say where each posting cost comes from (sim/deploy/profiles)."""

from __future__ import annotations

import pytest
from kvferry.sim.deploy import hardware


@pytest.mark.parametrize("name", hardware.names("nic") + hardware.names("fabric"))
def test_every_profile_names_its_transport_and_its_sources(name: str) -> None:
    p = hardware.nic(name)
    assert p.transport in hardware.TRANSPORTS
    assert p.transport != "unstated" or name == "nic-400g-vllm-fit"  # kept to reproduce old results
    assert p.post_cost_source and p.per_desc_source
    assert set(p.estimates) <= {"bandwidth_gbps", "latency_us", "post_cost_us", "per_desc_us"}


def test_cuda_ipc_costs_twenty_times_rdma_verbs_a_descriptor() -> None:
    ipc, ib = hardware.nic("nvlink-cuda-ipc"), hardware.nic("nic-400g")
    assert ipc.per_desc_us == pytest.approx(2.98e6 / 294_912, rel=0.01)  # our H100 measurement
    assert ipc.per_desc_us / ib.per_desc_us == pytest.approx(20, rel=0.01)  # vLLM #55434's ratio
    assert "per_desc_us" in ib.estimates and "per_desc_us" not in ipc.estimates
    assert "55434" in ib.per_desc_source and "294,912" in ipc.per_desc_source


def test_a_bad_transport_is_refused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "x.toml").write_text(
        'kind = "nic"\nname = "x"\ntransport = "pigeon"\nbandwidth_gbps = 1.0\nlatency_us = 1.0\n'
        "post_cost_us = 1.0\nper_desc_us = 1.0\n"
    )
    monkeypatch.setattr(hardware, "folder", lambda: tmp_path)
    with pytest.raises(hardware.ProfileError, match="transport must be one of cuda_ipc, ib_verbs, efa"):
        hardware.nic("x")


def test_efa_and_tcp_profiles_cite_published_figures_and_say_they_are_estimates() -> None:
    efa, tcp = hardware.nic("nic-efa-400g"), hardware.nic("nic-tcp-100g")
    assert (efa.transport, tcp.transport) == ("efa", "tcp")
    # libfabric's fi_rdm_tagged_bw over EFA: 1.50 us a 64 B transfer; UCX tcp: 13.2 us a message.
    assert efa.per_desc_us == 1.5 and "ofiwg/libfabric#5694" in efa.per_desc_source
    assert tcp.per_desc_us == 13.2 and "openucx/ucx#7880" in tcp.per_desc_source
    for p in (efa, tcp):
        assert {"latency_us", "post_cost_us", "per_desc_us"} <= set(p.estimates)
    # What a descriptor costs on each transport, as cited: verbs < EFA < cuda_ipc < TCP.
    ib, ipc = hardware.nic("nic-400g"), hardware.nic("nvlink-cuda-ipc")
    assert ib.per_desc_us < efa.per_desc_us < ipc.per_desc_us < tcp.per_desc_us
    # Not fitted to the published NIXL figures kept for checking (2.43 us a descriptor, vLLM's).
    assert efa.per_desc_us != hardware.nic("nic-400g-vllm-fit").per_desc_us


@pytest.mark.parametrize("name", ["nic-efa-400g", "nic-tcp-100g"])
def test_a_deployment_runs_on_the_new_profiles(name: str) -> None:
    from kvferry.sim.deploy import workload as wl
    from kvferry.sim.deploy.run import simulate
    from kvferry.sim.deploy.spec import DeploySpec

    spec = DeploySpec(model="qwen3-8b", prefill_tp=2, decode_tp=1, flow="direct", nic=name)
    r = simulate(spec, wl.Arrivals(requests=wl.poisson(4.0, 6, 256, 4, seed=1)))
    assert r.completed == 6 and not r.violations
    fab = hardware.fabric_spec(hardware.gpu("h100"), hardware.nic(name))
    assert fab.nic.per_desc_ns == round(hardware.nic(name).per_desc_us * 1000)

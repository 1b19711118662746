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

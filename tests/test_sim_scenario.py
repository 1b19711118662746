"""Scenario files: every shipped file loads, round-trips, and bad fields get errors naming them."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.sim import scenario as sc
from kvferry.sim.faults import draw_personality
from kvferry.sim.rng import Streams, derive_seed

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted((ROOT / "scenarios").glob("*.toml")) + sorted((ROOT / "tests" / "scenarios").glob("*.toml"))


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_shipped_scenarios_load_and_round_trip(path: Path) -> None:
    s = sc.load(path)
    assert sc.parse(tomllib.loads(sc.dump(s))) == s


def test_the_four_required_scenarios_exist() -> None:
    names = {p.stem for p in (ROOT / "scenarios").glob("*.toml")}
    assert {"quickstart", "heterogeneous-tp", "crash-and-restart", "lossy-control-plane"} <= names


def test_a_presets_name_alone_is_refused_not_run_as_the_tiny_model() -> None:
    with pytest.raises(sc.ScenarioError, match=r"\[model\]\.name: 'qwen3-8b' is a preset: write preset"):
        sc.parse({"model": {"name": "qwen3-8b"}})


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"faults": {"ctrl_drop": 1.5}}, "[faults].ctrl_drop: expected a probability in [0, 1], got 1.5"),
        ({"faults": {"ctrl_drp": 0.1}}, "[faults].ctrl_drp: unknown field (did you mean 'ctrl_drop'?)"),
        ({"topology": {"prefill_tp": 3}}, "[topology].prefill_tp: TP 3 does not divide 8 KV heads"),
        ({"topology": {"decode_layout": "nhd"}}, "[topology].decode_layout: expected one of"),
        ({"model": {"num_layers": 0}}, "[model].num_layers: must be >= 1"),
        ({"model": {"preset": "gpt-9"}}, "[model].preset: unknown model preset 'gpt-9'"),
        ({"workload": {"room": [{"tokens": 10, "chunks": [4, 4]}]}}, "room[0].chunks: lengths sum to 8"),
        ({"workload": {"tokens_max": 1 << 30}}, "does not fit the prefill pool"),
        ({"workload": {"tokens_min": 50, "tokens_max": 10}}, "[workload].tokens_min: 50 > tokens_max 10"),
        (
            {"faults": {"event": [{"kind": "link_down", "node": "prefill0"}]}},
            "event[0].peer: a link_down event",
        ),
        ({"faults": {"event": [{"kind": "crash", "node": "decode7"}]}}, "event[0].node: expected one of"),
        ({"faults": {"event": [{"kind": "meteor", "node": "decode0"}]}}, "event[0].kind: expected one of"),
        ({"hooks": ["nope"]}, "hooks: unknown planted bug 'nope'"),
        ({"fabric": {"profile": "ethernet"}}, "[fabric].profile: expected one of"),
        ({"seed": -1}, "scenario: seed: must be >= 0"),
        ({"phases": {"liveness_us": "soon"}}, "[phases].liveness_us: expected an integer"),
        ({"timeouts": {"fence_ns": 0}}, "[timeouts].fence_ns: must be >= 1"),
        ({"timeouts": {"fence_ns": 10_000_000}}, "[timeouts]: fence_ns 10000000 must exceed the longest"),
    ],
)
def test_errors_point_at_the_field(doc: dict, needle: str) -> None:
    with pytest.raises(sc.ScenarioError) as e:
        sc.parse(doc)
    assert needle in str(e.value)


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[faults\nx=1")
    with pytest.raises(sc.ScenarioError, match="not valid TOML"):
        sc.load(bad)
    with pytest.raises(sc.ScenarioError, match="no such file"):
        sc.load(tmp_path / "missing.toml")


def test_streams_are_named_and_independent() -> None:
    a, b = Streams(5), Streams(5)
    x = [a["workload"].random() for _ in range(3)]
    b["faults.control"].random()  # drawing from another stream shifts nothing
    assert x == [b["workload"].random() for _ in range(3)]
    assert derive_seed(5, "workload") != derive_seed(6, "workload")
    assert derive_seed(5, "workload") == derive_seed(5, "workload")


@settings(max_examples=40)
@given(st.integers(0, 2**32))
def test_swarm_personality_is_a_function_of_the_seed_and_round_trips(seed: int) -> None:
    base = sc.parse({"faults": {"swarm": True}})
    p1 = draw_personality(base, Streams(seed))
    p2 = draw_personality(base, Streams(seed))
    assert p1 == p2 and not p1.faults.swarm
    assert sc.parse(tomllib.loads(sc.dump(p1))) == p1


# [deploy]: DeploySpec knobs for `kvferry select` (sim/scenario_deploy.py).
PRESET = {"model": {"preset": "qwen3-8b"}, "topology": {"prefill_tp": 2, "decode_tp": 2}}


def test_a_deploy_table_loads_typed_and_round_trips() -> None:
    deploy = {"gpu": "h200", "page_allocator": "lowest-first", "max_batch": 64, "proxy_hop_ms": 7}
    s = sc.parse({**PRESET, "deploy": deploy})
    assert s.deploy == {**deploy, "proxy_hop_ms": 7.0}
    assert type(s.deploy["proxy_hop_ms"]) is float  # an integer is a number, stored as the spec's float
    assert sc.parse(tomllib.loads(sc.dump(s))) == s
    assert s != sc.parse(PRESET) and hash(s) == hash(sc.parse(PRESET))  # still hashable


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_a_scenario_without_deploy_loads_and_dumps_as_before(path: Path) -> None:
    s = sc.load(path)
    assert s.deploy == {} and "[deploy]" not in sc.dump(s)
    data = tomllib.loads(path.read_text())
    assert sc.parse({**data, "deploy": {}}, where=str(path)) == s
    hash(s)  # the new field keeps a Scenario hashable


@pytest.mark.parametrize(
    ("deploy", "needle"),
    [
        ({"gpuu": "h200"}, "[deploy].gpuu: unknown field (did you mean 'gpu'? known: gpu, nic, "),
        ({"colour": 1}, "[deploy].colour: unknown field (known: gpu, nic, staging_chunks, max_batch"),
        ({"prefill_tp": 2}, "[deploy].prefill_tp: not a [deploy] key: it belongs in [topology].prefill_tp"),
        ({"model": "qwen3-8b"}, "[deploy].model: not a [deploy] key: it belongs in [model]"),
        ({"chunk_tokens": 512}, "[deploy].chunk_tokens: not a [deploy] key: it belongs in [workload]"),
        ({"seed": 3}, "[deploy].seed: not a [deploy] key: it belongs at the top level"),
        ({"flow": "ring"}, "[deploy].flow: not a [deploy] key: kvferry select runs and compares every"),
        ({"max_batch": True}, "[deploy].max_batch: expected an integer, got True"),
        ({"max_batch": 1.5}, "[deploy].max_batch: expected an integer, got 1.5"),
        ({"gpu": 5}, "[deploy].gpu: expected a string, got 5"),
        ({"proxy_hop_ms": "5"}, "[deploy].proxy_hop_ms: expected a number, got '5'"),
        ({"ttft_slo_ms": False}, "[deploy].ttft_slo_ms: expected a number, got False"),
        ({"ttft_slo_ms": float("nan")}, "[deploy].ttft_slo_ms: expected a finite number, got nan"),
        ({"page_allocator": "buddy"}, "[deploy]: page_allocator: expected one of sglang, lowest-first"),
        ({"gpu": "a100"}, "[deploy]: unknown hardware profile 'a100'"),
        ({"decode_ep": 2}, "[deploy]: decode_ep must divide decode_instances (1), got 2"),
        ({"weight_bytes": 4}, "[deploy]: weight_bytes must be 1 (FP8) or 2 (BF16), got 4"),
    ],
)
def test_deploy_errors_name_the_file_and_the_key(deploy: dict, needle: str) -> None:
    with pytest.raises(sc.ScenarioError) as e:
        sc.parse({**PRESET, "deploy": deploy}, where="x.toml")
    assert str(e.value).startswith("x.toml: [deploy]") and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_deploy_needs_a_preset_model() -> None:
    with pytest.raises(sc.ScenarioError, match=r"\[deploy\]: needs a model preset .* 'sim-tiny' is not one"):
        sc.parse({"deploy": {"gpu": "h200"}})
    assert sc.parse({"deploy": {}}) == sc.parse({})  # an empty table asks for nothing


def test_a_field_added_to_deployspec_is_a_deploy_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import dataclass

    from kvferry.sim import scenario_deploy
    from kvferry.sim.deploy.spec import DeploySpec

    @dataclass(frozen=True, slots=True)
    class Wider(DeploySpec):
        decode_reserved_tokens: int = 0

    monkeypatch.setattr(scenario_deploy, "DeploySpec", Wider)
    s = sc.parse({**PRESET, "deploy": {"decode_reserved_tokens": 512}})
    assert s.deploy == {"decode_reserved_tokens": 512}
    with pytest.raises(sc.ScenarioError, match=r"decode_reserved_tokens: expected an integer, got 1\.5"):
        sc.parse({**PRESET, "deploy": {"decode_reserved_tokens": 1.5}})

"""The most every configuration sustains (sim/deploy/capacity.py, ``max_rates``): narrowed by
steady-state runs for each configuration, never above what its prefill instances compute by hand,
more prefill instances sustaining more, in the table, the JSON and the plot."""

from __future__ import annotations

import json
import re

import pytest
from kvferry.sim.deploy.capacity import MAX_RATES, Workload, search
from kvferry.sim.deploy.spec import DeploySpec
from typer.testing import CliRunner

# As tests/test_capacity.py: one prefill step per request, decode never what limits.
ONE_STEP = DeploySpec(
    model="qwen3-8b", prefill_tp=1, decode_tp=1, flow="direct", chunk_tokens=2048, ttft_slo_ms=1000.0
)
ISL, OSL = 2048, 2
W = Workload(ISL, OSL, duration_s=6.0, warmup_s=1.5)


def _mu() -> float:
    return 1e9 / ONE_STEP.roofline("prefill").prefill_ns(ISL, 0)


def test_every_configuration_gets_its_maximum_rate_within_its_hand_capacity() -> None:
    mu = _mu()
    cap = search(ONE_STEP, [(1, 1)], lambda s: ["direct"], W, None, max_instances=2, max_rate_steps=4,
                 max_rates="all")  # fmt: skip
    by = {(c.prefill, c.decode): c for c in cap.candidates}
    assert sorted(by) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for (p, _d), c in by.items():
        assert c.max_rps is not None and c.max_rps_below is not None, c.name
        assert 0 < c.max_rps <= c.max_rps_below <= c.bound_rps * 1.000001
        assert c.max_rps <= p * mu * 1.05, (c.name, c.max_rps, p * mu)  # what p instances compute
    # The smallest one was narrowed by its own runs; the others started from a smaller one's result.
    assert by[(1, 1)].max_rps_runs > 0 and by[(1, 1)].max_rps_from == ""
    assert by[(2, 1)].max_rps > by[(1, 1)].max_rps  # twice the prefill serves more
    for c in by.values():
        assert c.max_rps_from in ("", "1P x TP1 + 1D x TP1", "2P x TP1 + 1D x TP1", "1P x TP1 + 2D x TP1")
        if c.max_rps_from:  # no run of its own met more: the smaller one's rate, not above it
            src = next(o for o in cap.candidates if o.name == c.max_rps_from)
            assert c.max_rps == src.max_rps
    assert cap.answer is not None and cap.reason.startswith("most requests per second per GPU")


def test_the_table_does_not_depend_on_the_workers() -> None:
    """Each narrowing tries one rate a run, whatever ``jobs``: one worker or two take the same
    runs, so every configuration gets the same interval from the same number of runs."""

    def table(jobs: int) -> list[tuple[str, float | None, float | None, int]]:
        cap = search(ONE_STEP, [(1, 1)], lambda s: ["direct"], W, None, max_instances=2, max_rate_steps=4,
                     max_rates="all", jobs=jobs)  # fmt: skip
        return sorted((c.name, c.max_rps, c.max_rps_below, c.max_rps_runs) for c in cap.candidates)

    one = table(1)
    assert sum(runs for *_, runs in one) > len(one)  # narrowed by runs, not taken from the bounds
    assert table(2) == one


def test_with_a_rate_each_simulated_configuration_gets_its_maximum_and_all_asks_for_every_one() -> None:
    rate = 1.5 * _mu()  # one prefill instance cannot; two can
    cap = search(ONE_STEP, [(1, 1)], lambda s: ["direct"], W, rate, max_instances=2, max_rate_steps=1)
    assert cap.answer is not None and (cap.answer.prefill, cap.answer.decode) == (2, 1)
    for c in cap.candidates:
        # Simulated at the rate (the answer, or one that missed it): narrowed; ruled out by its bound: not.
        assert (c.max_rps is not None) == (c.met is not None), c.name
    every = search(ONE_STEP, [(1, 1)], lambda s: ["direct"], W, rate, max_instances=2, max_rate_steps=1,
                   max_rates="all")  # fmt: skip
    assert all(c.max_rps is not None for c in every.candidates)
    one = next(c for c in every.candidates if (c.prefill, c.decode) == (1, 1))
    assert one.met is None and one.max_rps is not None and one.max_rps < rate  # below its bound, below R
    d = every.as_dict()["candidates"]
    assert all(x["max_rps_from"] in ("simulated",) or x["max_rps_from"].endswith("TP1") for x in d)
    with pytest.raises(ValueError, match="max_rates must be one of"):
        search(ONE_STEP, [(1, 1)], lambda s: ["direct"], W, rate, max_rates="some")


def test_the_cli_reports_every_maximum_in_the_json_and_refuses_an_unknown_choice() -> None:
    from kvferry.cli import _register, app

    _register()
    runner = CliRunner()
    base = ["select", "--model", "qwen3-8b", "--prefill-tp", "1", "--decode-tp", "1", "--flows", "direct",
            "--isl", "2048", "--osl", "2", "--chunk-tokens", "2048", "--ttft-slo-ms", "1000",
            "--capacity", "--max-instances", "2", "--duration-s", "6", "--warmup-s", "1.5",
            "--max-rate-steps", "1", "--jobs", "1"]  # fmt: skip
    bad = runner.invoke(app, [*base, "--max-rates", "some"])
    assert bad.exit_code == 2 and "--max-rates: expected one of simulated, all" in bad.output
    assert MAX_RATES == ("simulated", "all")
    got = runner.invoke(app, [*base, "--max-rates", "all", "--json"])
    assert got.exit_code == 0, got.output
    out = json.loads(got.stdout)
    assert len(out["candidates"]) == 4
    assert all(c["max_rps"] is not None and c["max_rps_from"] for c in out["candidates"])


def test_the_table_and_the_plot_show_every_maximum(tmp_path) -> None:
    from kvferry.cli import _register, app

    _register()
    png = tmp_path / "cap.png"
    args = ["select", "--model", "qwen3-8b", "--prefill-tp", "1", "--decode-tp", "1", "--flows", "direct",
            "--isl", "2048", "--osl", "2", "--chunk-tokens", "2048", "--ttft-slo-ms", "1000",
            "--capacity", "--max-instances", "2", "--duration-s", "6", "--warmup-s", "1.5",
            "--max-rate-steps", "1", "--jobs", "1", "--max-rates", "all", "--plot", str(png)]  # fmt: skip
    r = CliRunner().invoke(app, args, env={"COLUMNS": "300"})  # one line a row
    assert r.exit_code == 0, r.output
    assert "maximum sustainable rate per configuration" in r.stdout
    for name in ("1P x TP1 + 1D x TP1", "1P x TP1 + 2D x TP1", "2P x TP1 + 1D x TP1", "2P x TP1 + 2D x TP1"):
        assert name in r.stdout
    assert "more configurations not simulated" in r.stdout and " 0 more configurations" in r.stdout
    # No run is judged at a rate: no latency or verdict columns, and the most a GPU beside the most.
    assert "TTFT p50" not in r.stdout and "verdict" not in r.stdout and "req/s a GPU" in r.stdout
    rows = re.findall(r"(\dP x TP1 \+ \dD x TP1)[ *]*│ (\d+) .*│ ([\d.]+)-[\d.]+[ ^]*│ ([\d.]+) +│", r.stdout)
    assert len(rows) == 4, r.stdout
    for name, gpus, most, per_gpu in rows:
        # both cells rounded: the most to 0.01, the most a GPU to 0.001
        assert float(per_gpu) == pytest.approx(float(most) / int(gpus), abs=0.005 / int(gpus) + 5e-4), name
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_while_narrowing_the_others_keeps_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.sim.deploy import capacity

    real, calls = capacity.max_rate, []

    def interrupted_after_the_answer(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(capacity, "max_rate", interrupted_after_the_answer)
    cap = search(ONE_STEP, [(1, 1)], lambda s: ["direct"], W, 1.5 * _mu(), max_instances=2, max_rate_steps=1,
                 max_rates="all")  # fmt: skip
    assert cap.answer is not None and (cap.answer.prefill, cap.answer.decode) == (2, 1)
    assert cap.answer.max_rps is not None
    assert cap.reason.endswith("(interrupted: 3 maximum rates not narrowed)"), cap.reason

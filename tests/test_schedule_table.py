"""The schedule table is the one source of every schedule's lag, versions and shape rule: a row added
to it reaches the run config, the delay simulator and the pipeline stage, and the docs' table is
its text."""
from pathlib import Path

import pytest
import torch
from torch import nn

from asyncpp_ext.pipeline.stage import StageHost
from asyncpp_ext.schedule import table
from asyncpp_ext.training.config import ConfigError, RunConfig
from asyncpp_ext.training.simulate import DelaySimulator, stage_delay

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


class _LagTwo(table.ScheduleSpec):
    """A made-up schedule: 2bw's generator and shape rule, every stage two steps behind."""

    def stage_lags(self, stages):
        return tuple(table.StageLag(2, 3) for _ in range(stages))


@pytest.fixture
def lag_two(monkeypatch):
    monkeypatch.setitem(table.SCHEDULES, "lag2", _LagTwo("lag2", "2bw", "two steps behind"))
    return "lag2"


def test_the_core_rows_and_their_lags():
    assert list(table.SCHEDULES) == ["sync", "gpipe", "1f1b", "2bw", "pipedream"]
    lags = {n: [(s.lag, s.versions) for s in spec.stage_lags(3)] for n, spec in table.SCHEDULES.items()}
    assert lags["2bw"] == [(1, 2)] * 3 and lags["1f1b"] == lags["sync"] == [(0, 1)] * 3
    assert lags["pipedream"] == [(2, 3), (1, 2), (0, 1)]
    assert [n for n, s in table.SCHEDULES.items() if s.lag_per_stage] == ["pipedream"]
    with pytest.raises(ValueError, match=r"2bw needs microbatches >= stages \(got m=1, S=2\)"):
        table.schedule_spec("2bw").check(2, 1)


def test_an_added_row_reaches_config_simulator_and_stage(lag_two):
    cfg = RunConfig()
    cfg.pipeline.schedule, cfg.pipeline.stages, cfg.pipeline.microbatches = lag_two, 2, 1
    with pytest.raises(ConfigError, match="needs microbatches >= stages"):  # the core's rule of its kind
        cfg.validate()
    cfg.pipeline.microbatches = 2
    cfg.validate()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    sim = DelaySimulator(model, torch.optim.SGD(model.parameters(), lr=0.1), lag_two)
    assert sim.delays == [2] * 4 and stage_delay(lag_two, 1, 2) == 2
    host = StageHost(nn.Sequential(nn.Linear(4, 4)), stage=0, stages=2, schedule=lag_two, microbatches=2,
                     optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1), loss_fn=None,
                     batch_source=lambda step: None)
    assert host.num_versions == 3 and len(host.flat) == 3


def test_the_design_docs_table_is_the_tables_text():
    assert table.markdown_table() in DESIGN.read_text(), (
        "docs/design.md §2.3 must hold asyncpp_ext.schedule.table.markdown_table() verbatim:\n"
        + table.markdown_table())

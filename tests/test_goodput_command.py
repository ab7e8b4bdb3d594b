"""`make goodput`'s command line (`python -m tests.real_engine.goodput`): the grid's options reach
the simulated run too (it ran the whole grid whatever was asked, 2026-12-06), and a bad
`--fractions` is a usage error naming the option. Nothing is started: the simulated run is
replaced by a stub that records what it was asked."""

from __future__ import annotations

from pathlib import Path

import pytest
from pd_router_dev.goodput import sim

from tests.real_engine import goodput


def test_the_grid_options_reach_the_simulated_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[list[str]] = []

    def stub(argv: list[str]) -> int:
        seen.append(argv)
        raise SystemExit(0)  # before a result is read

    monkeypatch.setattr(goodput.simulated, "main", stub)
    with pytest.raises(SystemExit):
        goodput.main(
            ["--sim-only", "--mixes", "short", "--fractions", "0.5,0.9", "--no-extras", "--out", str(tmp_path)]
        )
    (argv,) = seen
    assert argv[argv.index("--mixes") + 1] == "short"
    assert argv[argv.index("--fractions") + 1] == "0.5,0.9"
    assert argv[argv.index("--cells") + 1] == "grid"  # --no-extras


def test_cells_pick_what_runs_and_a_bad_one_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for main in (sim.main, goodput.main):
        with pytest.raises(SystemExit) as bad:
            main(["--cells", "grid,chats"])
        assert bad.value.code == 2
        assert "--cells: each of grid, chat, alternating: 'grid,chats'" in capsys.readouterr().err
        with pytest.raises(SystemExit) as both:
            main(["--cells", "chat", "--no-extras"])
        assert both.value.code == 2
        assert "--no-extras and --cells: give one" in capsys.readouterr().err
    seen: list[list[str]] = []

    def stub(argv: list[str]) -> int:
        seen.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(goodput.simulated, "main", stub)
    with pytest.raises(SystemExit):
        goodput.main(["--sim-only", "--cells", "chat", "--out", str(tmp_path)])
    assert seen[0][seen[0].index("--cells") + 1] == "chat"


@pytest.mark.parametrize("main", [sim.main, goodput.main], ids=["simulated", "sweep"])
def test_bad_fractions_are_a_usage_error(main, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as bad:
        main(["--fractions", "0.5,x"])
    assert bad.value.code == 2
    assert "--fractions: not numbers: '0.5,x'" in capsys.readouterr().err

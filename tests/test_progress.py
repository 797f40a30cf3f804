"""Progress on a terminal is tqdm's bar; in a log, a line at the start, at each tenth and at the end."""

from __future__ import annotations

from numscope._progress import LogLines, progress


def test_a_log_gets_a_line_per_tenth_and_the_last_figures(capsys) -> None:
    bar = progress(total=400, desc="  fp32", enabled=True)  # pytest's stderr is not a terminal
    assert isinstance(bar, LogLines)
    for step in range(1, 401):
        bar.n = step
        bar.set_postfix(loss=f"{5 - step / 100:.3f}", refresh=False)
        bar.refresh()
    bar.close()
    bar.close()  # once
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "fp32: started, 400"
    assert lines[1:10] == [f"fp32: {40 * k}/400 (loss={5 - 40 * k / 100:.3f})" for k in range(1, 10)]
    assert lines[10].startswith("fp32: done 400/400 in ") and lines[10].endswith("s (loss=1.000)")
    assert len(lines) == 11


def test_iteration_and_a_disabled_bar(capsys) -> None:
    assert list(progress(["a", "b", "c"], desc="report")) == ["a", "b", "c"]
    with progress(total=2, desc="data", enabled=False) as bar:
        bar.update()
    err = capsys.readouterr().err
    assert err.splitlines() == ["report: started, 3", "report: 1/3", "report: 2/3", "report: done 3/3 in 0s"]

"""The synthetic backward-error study at a small size."""

import math

import pytest

from numscope.study import StudyFormat, backward_error_study, crossover, read_csv, run_study, study_table


@pytest.fixture(scope="module")
def small_rows():
    return backward_error_study((1.5, 2, math.inf), ("int8", "int8:row", "fp8_e4m3", "mxfp8_e4m3"), size=64)


def _mean(rows, dof, fmt):
    return next(r.mean for r in rows if r.dof == dof and r.format == fmt)


def test_fp8_beats_int8_per_tensor_on_heavy_tails_and_loses_on_gaussian(small_rows):
    for dof in (1.5, 2):
        assert _mean(small_rows, dof, "fp8_e4m3") < _mean(small_rows, dof, "int8 per tensor")
    assert _mean(small_rows, math.inf, "int8 per tensor") < _mean(small_rows, math.inf, "fp8_e4m3")
    found = crossover(small_rows, "int8 per tensor", "fp8_e4m3")
    assert found is not None and found > 2


def test_int8_error_grows_with_tail_weight(small_rows):
    assert _mean(small_rows, 1.5, "int8 per tensor") > 5 * _mean(small_rows, math.inf, "int8 per tensor")


def test_table_lists_every_format(small_rows):
    table = study_table(small_rows)
    for name in ("int8 per tensor", "int8 per row", "fp8_e4m3", "mxfp8_e4m3", "inf"):
        assert name in table


def test_study_formats_parse_and_reject_bad_specs():
    assert StudyFormat.parse("int8:row").label == "int8 per row"
    with pytest.raises(ValueError, match="allowed: tensor, row"):
        StudyFormat.parse("int8:diagonal")
    with pytest.raises(ValueError, match="brings its own scaling"):
        StudyFormat.parse("nvfp4:row")


def test_run_study_writes_png_and_csv(tmp_path):
    formats = ("int8", "nvfp4")
    rows, png, csv_path = run_study(tmp_path, dofs=(2, math.inf), formats=formats, size=32, trials=1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_csv(csv_path) == rows

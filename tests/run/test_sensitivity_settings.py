"""analyze's sensitivity settings (numscope.run.SensitivitySettings): one frozen object whose defaults are
``numscope analyze``'s, checked on construction with errors that name the setting as the Python API does;
the command line names the flag instead."""

from __future__ import annotations

import pytest

from numscope.cli import main as cli_main
from numscope.errors import SettingsError
from numscope.run import SensitivitySettings


@pytest.mark.parametrize(
    ("given", "setting"),
    [
        ({"batches": -1}, "batches"),
        ({"batches": True}, "batches"),
        ({"granularity": "layer"}, "granularity"),
        ({"formats": 4}, "formats"),
        ({"formats": []}, "formats"),
        ({"early": 0}, "early"),
        ({"early": "soon"}, "early"),
        ({"method": "fast"}, "method"),
        ({"granularity": "site", "method": "local"}, "method"),
        ({"kinds": ()}, "kinds"),
        ({"kinds": ("linear", 3)}, "kinds"),
        ({"stacks": ()}, "stacks"),
        ({"stacks": ("te", "jax")}, "stacks"),
    ],
)
def test_a_bad_setting_is_refused_by_its_api_name(given: dict, setting: str) -> None:
    with pytest.raises(SettingsError) as raised:
        SensitivitySettings(**given)
    assert raised.value.setting == f"SensitivitySettings.{setting}"
    assert str(raised.value).startswith(f"SensitivitySettings.{setting}: ")


def test_defaults_and_the_method_each_granularity_implies() -> None:
    settings = SensitivitySettings()
    assert (settings.batches, settings.granularity, settings.formats, settings.early) == (
        None,
        "operand",
        "auto",
        None,
    )
    assert settings.resolved_method == "local"
    assert SensitivitySettings(granularity="site").resolved_method == "one_at_a_time"
    assert SensitivitySettings(formats=["fp8_e4m3", "int8"]).formats == ("fp8_e4m3", "int8")  # hashable
    assert settings.kinds is None  # every kind of site
    assert SensitivitySettings(kinds="linear").kinds == ("linear",)
    assert settings.stacks is None and SensitivitySettings(stacks="te").stacks == ("te",)  # no shape rule


def test_the_command_line_names_the_flag_of_a_setting(tmp_path, capsys) -> None:
    """A settings error from the library reaches the user under the flag that set it, every setting named in
    the message translated (one table in the CLI), not under the Python name."""
    text = tmp_path / "t.txt"
    text.write_text(
        "\n\n".join(f"paragraph {i} of a small text for a tokenizer to learn from." for i in range(40))
    )
    argv = [
        "analyze",
        "--model",
        "tiny-bert",
        "--text",
        str(text),
        "--steps",
        "4",
        "--out",
        str(tmp_path / "o"),
    ]
    assert cli_main([*argv, "--candidates", "fp8_e4m3", "--sensitivity-formats", "int4"]) == 2
    err = capsys.readouterr().err
    assert "--sensitivity-formats: int4: not among the observed candidates" in err
    assert "SensitivitySettings" not in err
    assert cli_main([*argv, "--sensitivity", "0", "--sensitivity-early", "2"]) == 2
    err = capsys.readouterr().err
    assert "--sensitivity-early:" in err and "--sensitivity >= 1" in err and "SensitivitySettings" not in err


def test_analyze_refuses_anything_but_the_settings_object(tmp_path) -> None:
    from numscope.run import DataSettings, analyze

    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(f"paragraph {i} of a small text." for i in range(40)), encoding="utf-8")
    with pytest.raises(SettingsError, match=r"analyze\(sensitivity=\): a numscope.run.SensitivitySettings"):
        analyze("tiny-bert", DataSettings(text=(str(text),)), tmp_path / "o", sensitivity=2)

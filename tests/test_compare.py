import pytest
import torch

from utils.compare import max_abs_diff, report_close


def test_max_abs_diff_value():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    b = torch.tensor([[1.0, 2.5], [2.0, 4.0]])
    assert max_abs_diff(a, b) == pytest.approx(1.0)
    assert max_abs_diff(a, a) == 0.0


def test_max_abs_diff_shape_mismatch():
    with pytest.raises(ValueError, match=r"actual \(2\).*expected \(3\)"):
        max_abs_diff(torch.zeros(2), torch.zeros(3))


def test_report_close_prints_and_returns(capsys):
    a = torch.zeros(3)
    d = report_close("ours vs torch", a + 2e-7, a, atol=1e-5)
    assert d == pytest.approx(2e-7, rel=1e-3)
    assert capsys.readouterr().out == "ours vs torch: max |diff| = 2.0e-07 <= 1e-05\n"


def test_report_close_raises_above_tolerance_and_on_nan():
    with pytest.raises(AssertionError, match="exceeds"):
        report_close("x", torch.ones(2), torch.zeros(2), atol=1e-5)
    with pytest.raises(AssertionError):
        report_close("x", torch.tensor([float("nan")]), torch.zeros(1))


def test_sanitizer_masks_only_the_noise():
    import configparser
    import re
    from pathlib import Path

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).parent / "nbval_sanitize.cfg")
    section = cfg["rounding noise of a checked difference"]
    rx, rep = section["regex"], section["replace"]
    assert re.sub(rx, rep, "a: max |diff| = 2.4e-07 <= 1e-05") == \
        re.sub(rx, rep, "a: max |diff| = 9.5e-08 <= 1e-05")
    # The bound is still compared, and a plain number elsewhere is untouched.
    assert re.sub(rx, rep, "a: max |diff| = 2.4e-07 <= 1e-05") != \
        re.sub(rx, rep, "a: max |diff| = 2.4e-07 <= 1e-06")
    assert re.sub(rx, rep, "max |diff| = 0.22") == "max |diff| = 0.22"

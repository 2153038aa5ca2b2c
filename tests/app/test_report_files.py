"""``coalescence report``'s settings and checks (:mod:`coalescence.app.report`): refused before
anything is read or drawn, each naming its option."""

from __future__ import annotations

import argparse

import pytest

from coalescence.app.report import ReportSettings, image_path, write_report_files
from coalescence.errors import ConfigError


def test_a_report_writes_a_page_an_image_or_both():
    with pytest.raises(ConfigError, match="give the HTML file written") as refused:
        ReportSettings()
    assert refused.value.field == "output"
    assert ReportSettings(image="chart.svg").output is None


def test_an_image_path_needs_an_image_suffix():
    assert image_path("chart.PNG") == "chart.PNG"
    with pytest.raises(argparse.ArgumentTypeError, match=r"'chart.jpg' has no image suffix; accepted suffixes: \.png, \.svg"):
        image_path("chart.jpg")


def test_an_empty_method_list_is_refused_before_the_source_is_read(tmp_path):
    with pytest.raises(ConfigError, match="give at least one method") as refused:
        write_report_files(tmp_path / "missing.json", ReportSettings(output=tmp_path / "r.html", method=" , "))
    assert refused.value.field == "method" and not (tmp_path / "r.html").exists()

"""gpumagic._format: the one duration format every display uses (issue 15 item 6)."""

from __future__ import annotations

import pytest

from gpumagic._format import duration


@pytest.mark.parametrize("seconds, text", [
    (None, "-"),                 # a job's run time not known
    (-3, "0.0 s"),               # a deadline just passed reads as no time left
    (0, "0.0 s"),
    (1.24, "1.2 s"),             # a sync done in 1.2 s
    (9.94, "9.9 s"),
    (9.96, "10 s"),              # what rounds to 10.0 is said in whole seconds
    (42, "42 s"),
    (59.4, "59 s"),              # a shutdown due in 59 s
    (60, "1 min"),
    (75.2, "1 min 15 s"),        # a transfer's ETA
    (599, "9 min 59 s"),
    (600, "10 min"),             # from 10 min on, whole minutes
    (1800, "30 min"),            # the guard's idle time
    (3599, "59 min"),            # rounded down under an hour: time left is never overstated
    (3600, "1 h"),
    (3725, "1 h 2 min"),         # a job's run time
    (10740, "2 h 59 min"),       # a budget's time left
    (86400 + 3 * 3600, "1 d 3 h"),
])
def test_duration_reads_each_size_at_its_useful_precision(seconds, text):
    assert duration(seconds) == text


def test_one_duration_format_in_the_package():
    """The three formatters that were (jobs' 1:02:05, sync's 1m15s, budget's 59 min) are one:
    every display module imports gpumagic._format.duration."""
    from gpumagic.notebook import display
    from gpumagic.notebook.magics import budget as budget_magics
    from gpumagic.remote import jobs

    assert display.duration is duration and budget_magics.duration is duration
    assert jobs.duration is duration
    assert not hasattr(display, "format_seconds") and not hasattr(jobs, "format_duration")


def test_count_says_one_file_and_two_files():
    from gpumagic._format import count

    assert [count(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]
    assert count(1, "cache", "caches") == "1 cache" and count(3, "cache", "caches") == "3 caches"


@pytest.mark.parametrize("seconds, text", [
    (-1, "0 s"),
    (0.5, "0.5 s"),              # a sandbox session's idle stop in a test
    (3, "3 s"),
    (4, "4 s"),                  # "under 4 s of training lost"
    (35.4, "35 s"),
    (180, "3 min"),              # "unreachable 3 min: connection refused"
    (1800, "30 min"),            # "it stops after 30 min with no notebook attached"
    (5400, "90 min"),
    (7200, "2 h"),
    (9000, "2.5 h"),
])
def test_rough_duration_says_how_long_to_the_unit_that_matters(seconds, text):
    from gpumagic._format import rough_duration

    assert rough_duration(seconds) == text


def test_one_rough_duration_format_in_the_package():
    """The two ``_span`` (machine.py's idle time, move.py's lost line) are one: _format.rough_duration."""
    from gpumagic import machine
    from gpumagic._format import rough_duration
    from gpumagic.remote.move import loss

    assert machine.rough_duration is rough_duration and loss.rough_duration is rough_duration
    assert not hasattr(machine, "_span") and not hasattr(loss, "_span")

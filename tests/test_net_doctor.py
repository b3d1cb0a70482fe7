"""``%gpu doctor --net`` (``machine.net.doctor``): verdicts and hints from recorded
measurements, and the check itself from the test sshd against stand-in sites on this
computer (one fast, one slow, one that never answers): nothing leaves the computer."""

from __future__ import annotations

import time

import pytest

from gpumagic.net import doctor
from gpumagic.net.catalog import Target
from gpumagic.net.standin import StandInSite

HF = Target("huggingface.co", "https://huggingface.co/x", "hf")
HF_MIRROR = Target("hf-mirror.com", "https://hf-mirror.com/x", "hf", "hf-mirror")
PYPI = Target("pypi.org", "https://pypi.org/simple/torch/", "pip")
GITHUB = Target("github.com", "https://github.com/x")
TUNA = Target("pypi.tuna.tsinghua.edu.cn", "https://pypi.tuna.tsinghua.edu.cn/simple/torch/", "pip", "tuna",
              configured=True)

FAST = {"status": "ok", "ttfb": 0.05, "bytes": 24_000_000, "seconds": 2.0}      # 12 MB/s
SLOW = {"status": "ok", "ttfb": 0.4, "bytes": 160_000, "seconds": 2.0}         # 80 KB/s
SILENT = {"status": "timeout", "bytes": 0}


def lines(targets, raw, **kw):
    return [r.line for r in doctor.verdicts(targets, raw, timeout=4, proxy_on=kw.get("proxy_on", False),
                                            turbo=kw.get("turbo", False))]


def test_a_timed_out_upstream_names_the_fast_mirror_and_its_command():
    assert lines([HF, HF_MIRROR], [SILENT, FAST]) == [
        "huggingface.co timed out (no answer within 4 s); hf-mirror.com 12 MB/s: `%gpu mirrors hf`",
        "hf-mirror.com 12 MB/s, first byte 0.05 s (hf mirror)"]


def test_a_slow_upstream_without_a_mirror_says_try_the_proxy():
    assert lines([GITHUB], [SLOW]) == ["github.com slow (80 KB/s, first byte 0.40 s); try `%gpu proxy on`"]
    assert lines([GITHUB], [SLOW], turbo=True) == [
        "github.com slow (80 KB/s, first byte 0.40 s); try `%gpu proxy on` (or AutoDL's "
        "`source /etc/network_turbo` in the cell)"]
    assert lines([GITHUB], [SLOW], proxy_on=True) == [
        "github.com slow (80 KB/s, first byte 0.40 s); the proxy is on: check that it reaches this site "
        "from your computer"]


def test_an_upstream_whose_mirror_is_in_use_needs_nothing_and_a_bad_mirror_in_use_says_off():
    assert lines([PYPI, TUNA], [SILENT, FAST]) == [
        "pypi.org timed out (no answer within 4 s); pip uses pypi.tuna.tsinghua.edu.cn (12 MB/s): nothing to do",
        "pypi.tuna.tsinghua.edu.cn 12 MB/s, first byte 0.05 s (pip mirror, in use)"]
    assert lines([TUNA], [SILENT]) == [
        "pypi.tuna.tsinghua.edu.cn timed out (no answer within 4 s) (pip mirror, in use); "
        "`%gpu mirrors pip off` goes back to the upstream"]


def test_unreachable_and_http_errors_and_a_small_file_judged_by_its_first_byte():
    raw = [{"status": "error", "error": "Name or service not known", "bytes": 0},
           {"status": "http", "http": 403, "ttfb": 0.1},
           {"status": "ok", "ttfb": 0.1, "bytes": 5000, "seconds": 0.001, "complete": True}]
    out = doctor.verdicts([GITHUB, PYPI, HF], raw, timeout=4, proxy_on=False)
    assert [r.status for r in out] == ["error", "http", "ok"]
    assert out[0].line == "github.com unreachable (Name or service not known); try `%gpu proxy on`"
    assert out[1].detail == "answered HTTP 403"
    assert out[2].detail == "5,000 bytes, first byte 0.10 s" and out[2].rate is None


def test_default_targets_are_the_upstreams_the_mirrors_in_use_and_the_defaults():
    names = [t.name for t in doctor.default_targets({"pip": "https://mirrors.aliyun.com/pypi/simple/"})]
    assert names == ["pypi.org", "download.pytorch.org", "huggingface.co", "github.com", "conda-forge",
                     "mirrors.aliyun.com", "pypi.tuna.tsinghua.edu.cn", "hf-mirror.com",
                     "mirrors.tuna.tsinghua.edu.cn"]


@pytest.fixture
def sites():
    s = {k: StandInSite(k).start() for k in ("fast", "slow", "silent")}
    yield s
    for site in s.values():
        site.stop()


def test_doctor_net_from_the_machine_gives_each_verdict_and_is_bounded_by_its_timeouts(machine, sites):
    targets = [Target("huggingface.co", sites["silent"].url, "hf"),
               Target("hf-mirror.com", sites["fast"].url, "hf", "hf-mirror"),
               Target("pypi.org", sites["slow"].url, "pip")]
    timeout, read = 1.5, 0.5
    start = time.monotonic()
    report = machine.net.doctor(targets, timeout=timeout, read_time=read)
    wall = time.monotonic() - start
    hf, mirror, pypi = report.results
    assert hf.status == "timeout" and sites["silent"].requests == 1
    assert hf.line == "huggingface.co timed out (no answer within 1.5 s); hf-mirror.com " \
                      f"{mirror.detail.split(',')[0]}: `%gpu mirrors hf`"
    assert mirror.status == "ok" and mirror.rate > doctor.SLOW_RATE
    assert pypi.status == "slow" and pypi.rate < doctor.SLOW_RATE
    assert pypi.hint == "try `%gpu proxy on`"
    # the three ran at once: the check took one timeout, not three
    assert report.seconds <= timeout + read + 0.6, report.seconds
    assert wall < timeout + read + 5, wall
    assert report.text.splitlines()[0].startswith(f"network from {machine.name} (")


def test_gpu_doctor_net_on_the_sandbox_shows_the_stand_ins(ip, capsys):
    ip.run_line_magic("gpu", "connect --sandbox")
    capsys.readouterr()
    ip.run_line_magic("gpu", "doctor --net")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("network from sandbox (")
    body = "\n".join(out[1:])
    assert "huggingface.co timed out (no answer within 4 s); hf-mirror.com " in body and "`%gpu mirrors hf`" in body
    assert "github.com slow (" in body and "try `%gpu proxy on`" in body
    assert "pypi.org " in body and len(out) == 7

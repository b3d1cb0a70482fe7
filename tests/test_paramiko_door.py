"""The one door to paramiko's private internals (``gpumagic.ssh._paramiko``).

Every private name gpumagic uses must exist in the installed paramiko, the import-time probe
must notice when one does not, and the public-API path taken then must still run cells,
sync and tunnels correctly (the same tests, in a process where the door is shut).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import paramiko
import pytest

from gpumagic.ssh import _paramiko

ROOT = Path(__file__).resolve().parents[1]


def test_every_private_name_used_exists_in_the_installed_paramiko():
    assert _paramiko.MISSING == []
    assert _paramiko.probe() == []
    assert _paramiko.FAST is (os.environ.get("GPUMAGIC_PARAMIKO_PRIVATE", "1") != "0")


def test_probe_names_a_private_name_that_a_paramiko_release_removed(monkeypatch):
    monkeypatch.delattr(paramiko.Channel, "_send_eof")
    monkeypatch.delattr(paramiko.Transport, "_next_channel")
    assert _paramiko.probe() == ["Transport._next_channel", "Channel._send_eof"]


#: paramiko attributes that its documentation does not name (no ``#:`` comment, no method),
#: that the door must list and that no other module may touch, whatever the object is called.
#: (The documented ones the door also probes, like ``Channel.closed`` or ``Transport.active``,
#: and generic words like ``lock`` that gpumagic's own classes use, are not searched for.)
UNDOCUMENTED = {"in_buffer", "status_event", "out_buffer_cv", "out_window_size",
                "out_max_packet_size", "clear_to_send", "clear_to_send_lock",
                "clear_to_send_timeout", "saved_exception", "channel_events", "channels_seen"}


def test_the_door_lists_every_undocumented_name_it_guards():
    listed = {n for names in _paramiko.PRIVATE_NAMES.values() for n in names}
    assert UNDOCUMENTED - listed == set()


def _private_attributes(tree: ast.AST, names: set[str]):
    """(line, name) of every ``x.name`` (any ``x``: ``self.chan``, ``c``, ``t``) in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            yield node.lineno, node.attr


def test_no_module_but_the_door_touches_paramikos_private_names():
    # The door's private names ("_send_eof") and the undocumented ones, read as attributes
    # of any object anywhere else in the package (the syntax tree, not a pattern over lines:
    # the receiver's name does not matter, and comments and docstrings do not count).
    names = {n for names in _paramiko.PRIVATE_NAMES.values() for n in names if n.startswith("_")}
    names |= UNDOCUMENTED
    offenders = []
    for path in sorted((ROOT / "gpumagic").rglob("*.py")):
        if path.name == "_paramiko.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        offenders += [f"{path.relative_to(ROOT)}:{line}: .{name}"
                      for line, name in _private_attributes(tree, names)]
    assert offenders == []


def test_the_private_name_finder_sees_any_receiver():
    tree = ast.parse("c.status_event.wait(0.2)\nwith self.chan.lock:\n    self.chan.out_buffer_cv.wait()\n"
                     "# chan.in_buffer in a comment\n")
    assert sorted(_private_attributes(tree, UNDOCUMENTED)) == [(1, "status_event"), (3, "out_buffer_cv")]


def test_the_pinned_paramiko_range_admits_the_installed_release():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    spec = re.search(r'"paramiko>=([\d.]+),<([\d.]+)"', text)
    assert spec, "pyproject.toml must pin paramiko to a range"
    low, high = (tuple(int(x) for x in v.split(".")) for v in spec.groups())
    installed = tuple(int(x) for x in paramiko.__version__.split(".")[:2])
    assert low <= installed < high


# The public-API path: a representative set of the suite's own tests, run where
# GPUMAGIC_PARAMIKO_PRIVATE=0 shuts the door (as a paramiko without those names would).
# Left out, because they test what only the door gives: key exchanges during transfers
# (paramiko's transport thread then waits on itself for 30 s), closing a channel given up on
# while opening, the server's own refusal text (paramiko keeps one generic text per
# transport: "Connect failed"), and uploads racing a service that closes: paramiko's public
# send can put DATA after the channel's CLOSE, and sshd then drops the whole connection
# (measured: 2-5 of 30 clients lost their answer that way).
PUBLIC_PATH_TESTS = {  # one subprocess each, so pytest-xdist runs the three at once
    "execution": ["tests/test_execution.py"],
    "tunnel": [
        "tests/test_tunnel.py::test_twenty_parallel_5mb_downloads_complete_with_correct_bytes",
        "tests/test_tunnel.py::test_killed_ssh_connection_next_request_through_same_url_succeeds",
        "tests/test_tunnel.py::test_server_that_speaks_first_reaches_a_client_that_has_not_sent_anything",
        "tests/test_tunnel.py::test_client_reading_slowly_gets_every_byte_of_more_than_a_window",
        "tests/test_tunnel.py::test_clients_that_reset_at_once_are_not_faults",
        "tests/test_tunnel.py::test_refused_remote_port_is_recorded_and_raised_when_the_block_ends",
        "tests/test_tunnel.py::test_slow_connection_does_not_stall_others",
    ],
    "sync": ["tests/test_sync.py"],
}


@pytest.mark.timeout(900)
@pytest.mark.skipif(not _paramiko.FAST, reason="this process already takes the public path")
@pytest.mark.parametrize("part", sorted(PUBLIC_PATH_TESTS))
@pytest.mark.slow(300, reason="a whole test file again in a subprocess, with paramiko's private door shut")
def test_cells_sync_and_tunnels_work_through_the_public_api_alone(part):
    env = {**os.environ, "GPUMAGIC_PARAMIKO_PRIVATE": "0"}
    env.pop("PYTEST_ADDOPTS", None)
    check = subprocess.run([sys.executable, "-c", "from gpumagic.ssh import _paramiko; print(_paramiko.FAST)"],
                           cwd=ROOT, env=env, capture_output=True, text=True, encoding="utf-8")
    assert check.stdout.strip() == "False", check.stderr
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-x", *PUBLIC_PATH_TESTS[part]], cwd=ROOT, env=env, capture_output=True, text=True, encoding="utf-8")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\d+ passed", run.stdout), run.stdout[-2000:]

"""Fuzz every magic's argument line: it succeeds, or raises exactly ``UsageError`` or a
``GpumagicError`` (a short message), and never anything else (a traceback).

Lines are drawn (hypothesis, fixed seed, bounded examples, no deadline) from each
sub-command's own option names, a few ordinary values, and hostile tokens: NaN, infinities,
negative and huge numbers, digits that are not ASCII, lone quotes and backslashes, other
scripts, emoji, empty and very long words.  They run against a server of their own with a
stand-in ``shutdown`` (so nothing can power this computer off), in a temporary working
directory and data directory; ``~/.ssh`` is put back after each example.

What is kept out, and why (each is covered by its own tests elsewhere):

* host names the client or the machine would look up in DNS (``connect``/``install-key``
  targets, ``-J``, ``tunnel --remote-host``): slow where DNS is slow; hostile targets are
  the hosts module's cases;
* ``keygen --passphrase`` (asks on the terminal);
* ``doctor --sample N`` with a valid N (waits N seconds), and ``doctor --net`` (it measures
  sites on the internet: tests/test_net_doctor.py measures stand-ins);
* ``sync --delete``, ``wrapup --clean``, and path words with ``/``, ``..`` or ``~`` (the
  machine is this computer: a drawn line must not delete or write outside the temporary
  directories);
* mail servers and webhook URLs other than a closed port on 127.0.0.1 (``budget notify``
  sends from the machine at once).
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from IPython.core.error import UsageError  # noqa: E402
from IPython.utils.capture import capture_output  # noqa: E402

from gpumagic.budget import notify  # noqa: E402
from gpumagic.notebook import magics  # noqa: E402
from gpumagic.errors import GpumagicError  # noqa: E402

from conftest import CLIENT_HOME, add_client_entry, install_shutdown, make_server  # noqa: E402

ALIAS = "fuzzgpu"
HOSTILE = ["nan", "NaN", "inf", "-inf", "Infinity", "-5", "-1", "0", "1e400", "1e308", "-1e400",
           "²", "١٢", "1_000", "0x10", "'", '"', "\\", "\\n", "ü", "Ω≈ç", "😀", "''", '""', "x" * 3000,
           "--", "-", "=", "%", "$(id)", "a b", "\t", ",", ":", "nan,inf", "1,,2", "30 minutes", "\u200b"]
VALID = ["1", "2", "30", "0.5", "30m", "+1h", "-2h", "12:00", "all", "x", "j1", "runs", "CNY", "hour",
         "10,20", "nan,oom", ALIAS]
SETTINGS = settings(derandomize=True, max_examples=int(os.environ.get("GPUMAGIC_FUZZ_EXAMPLES", "30")),
                    deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.filter_too_much, HealthCheck.data_too_large])


#: Words that are not host names a resolver would look up, for the positional target of
#: connect and install-key (hostile targets are the hosts module's cases).
NOT_A_HOST = ["-5", "'", "''", "\\", "--", "=", "%", "\t", ",", ":"]
#: Words with "/", "~" or ".." never reach sync (the machine is this computer).
PATH_UNSAFE = {w for w in HOSTILE if any(c in w for c in "/~") or ".." in w}

#: Ordinary values per option (drawn most of the time; a hostile word otherwise).
VALUES = {
    "--host": [ALIAS], "--name": ["n2", ALIAS], "--cwd": ["/tmp", "work"], "--user": ["root"],
    "-l": ["root"], "--identity": ["k1"], "-i": ["k1"], "--key": ["k1"], "--fake-gpu": ["h200-load", "inforom"],
    "--save": ["gm-fuzz2"], "--hostname": ["203.0.113.10", "127.0.0.1"], "--comment": ["me@laptop"],
    "--path": ["k1", "/", "/index.html"], "--expect-gpu": ["H200", "A100"], "--expect-count": ["1", "8"],
    "--sample": ["0"], "--watch": ["2"], "--exclude": ["*.pyc", "build/"], "--lines": ["5", "0"], "-n": ["5"],
    "--rate": ["2.5", "0"], "--currency": ["CNY"], "--billing": ["hour", "minute"], "--platform": ["autodl", "lambda"],
    "--storage-gb": ["100"], "--storage-rate-month": ["0.3"], "--storage-rate-day": ["0.01"], "--image-gb": ["20"],
    "--image-rate-month": ["0.2"], "--image-rate-day": ["0.01"], "--ip-rate": ["0.1"], "--started-at": ["-2h", "12:00"],
    "--alert": ["10,20"], "--limit": ["50"], "--hours": ["200"], "--spot-rate": ["1"], "--card-price": ["2000"],
    "--power-w": ["350"], "--kwh-price": ["0.2"], "--resale": ["800"], "--idle": ["30m"], "--deadline": ["+1h", "23:30"],
    "--grace": ["10m"], "--poll": ["30"], "--local-port": ["0", "18765"], "--remote-host": ["localhost", "127.0.0.1"],
    "--logdir": ["runs"], "--out": ["t", "res"], "--timeout": ["30", "0.5"], "--env": ["A=1", "B=x y"],
    "--job": ["j1", "j2"], "--stop-on": ["nan,oom", "traceback"], "--then-shutdown": ["0", "10"],
    "--port": ["22", "1"], "-p": ["1"], "--jump": [], "--alive-interval": ["30"], "--alive-count": ["3"],
    "--card": ["H200", "4090", "24GB"], "--batch": ["1", "8"], "--seq": ["512", "2048"], "--lora": ["0", "16"],
    "--pull": [":rsrc/ pulled/", f"{ALIAS}:rsrc pulled2"], "--mail": ["me@example.com"], "--smtp": ["127.0.0.1:1"],
    "--from": ["me@example.com"], "--webhook": ["http://127.0.0.1:1/hook", "ask"], "--chat-id": ["42"],
    "--retries": ["0", "1"], "--backoff": ["0", "0.1"], "--local": ["1", "18765"], "--remote-port": ["18766", "18767"],
    "--keep": ["ckpt/", "rsrc"], "--keep-every": ["5m", "0.5", "30s"], "--keep-to": ["kept", "kept2/"],
    "--keep-last": ["3", "1"], "--keep-settle": ["0", "10s"],
    # the fuzz's own machine (refused: the job's own), a name not connected, and n2 (connected
    # by a drawn `connect --name n2`: then a standby is armed)
    "--fallback": [ALIAS, "n2", "nosuch"], "--resume-arg": ["--resume {checkpoint}", "--ckpt={checkpoint}"],
}
#: ``%%remote``'s options of ``--keep``, fuzzed as their own entry (``%%remote --keep``).
KEEP_OPTIONS = {"--keep", "--keep-every", "--keep-to", "--keep-last", "--keep-settle"}
#: Options whose value must never be hostile (the value reaches DNS or waits that long).
SAFE_VALUES_ONLY = {"--remote-host", "--sample", "--smtp", "--webhook"}


#: name -> dict(cmd: the magic's words, fn: its parser's function, positional: ordinary values
#: of each positional argument, exclude: options never drawn, banned: hostile words never drawn,
#: hostile_positional: whether positional arguments may be hostile)
def _specs():
    from gpumagic.notebook.magics import jobs as jobs_magics
    from gpumagic.notebook.magics import kernel as kernel_magics
    from gpumagic.notebook.magics import net as net_magics
    from gpumagic.notebook.magics import rent as rent_magics

    m = magics
    return {
        "connect": dict(cmd="connect", fn=m._connect, positional=[[ALIAS, "--sandbox"]],
                        exclude={"-J", "--jump"}, hostile_positional=False),
        "disconnect": dict(cmd="disconnect", fn=m._disconnect, positional=[[ALIAS, "sandbox", "n2"]]),
        "hosts": dict(cmd="hosts", fn=m._hosts),
        "forget": dict(cmd="forget", fn=m._forget, positional=[["127.0.0.1:22", "203.0.113.10:41022"]]),
        "cd": dict(cmd="cd", fn=m._cd, positional=[["/tmp", "~", ".", "..", "rsrc"]]),
        "keygen": dict(cmd="keygen", fn=m._keygen, exclude={"--passphrase"}),
        "add-host": dict(cmd="add-host", fn=m._add_host, positional=[["gm-fuzz", "Host", "*"]],
                         always=["--hostname"]),
        "install-key": dict(cmd="install-key", fn=m._install_key, positional=[[ALIAS]],
                            exclude={"-J", "--jump"}, hostile_positional=False),
        "status": dict(cmd="status", fn=m._status),
        "doctor": dict(cmd="doctor", fn=m._doctor, exclude={"--net"}),
        "sync": dict(cmd="sync", fn=m._sync, exclude={"--delete"}, banned=PATH_UNSAFE,
                     positional=[["src", "src/", ":rsrc/", f"{ALIAS}:rsrc"], ["dst", ":rdst", f"{ALIAS}:rdst/"]]),
        "jobs": dict(cmd="jobs", fn=m._jobs),
        "logs": dict(cmd="logs", fn=m._logs, positional=[["j1", "j2"]]),
        "attach": dict(cmd="attach", fn=m._attach, positional=[["j1"]]),
        "kill": dict(cmd="kill", fn=m._kill, positional=[["j1", "j2"]]),
        # names no job of the fuzz has: a record-less move or resume is refused behind the parser
        "job move": dict(cmd="job move", fn=jobs_magics._job_move, positional=[["nosuch", "gone-1"]],
                         always=["--to"]),
        "job resume": dict(cmd="job resume", fn=jobs_magics._job_resume, positional=[["nosuch", "gone-1"]]),
        "budget": dict(cmd="budget", fn=m._budget_meter),
        "budget set": dict(cmd="budget set", fn=m._budget_set, always=["--rate"]),
        "budget estimate": dict(cmd="budget estimate", fn=m._budget_estimate, always=["--hours"]),
        "budget history": dict(cmd="budget history", fn=m._budget_history),
        "budget guard": dict(cmd="budget guard", fn=m._budget_guard),
        "tunnel": dict(cmd="tunnel", fn=m._tunnel_port, positional=[["18766", "1", "22"]]),
        "tunnel tensorboard": dict(cmd="tunnel tensorboard", fn=m._tunnel_tensorboard),
        "tunnel jupyter": dict(cmd="tunnel jupyter", fn=m._tunnel_jupyter),
        "tunnel list": dict(cmd="tunnel list", fn=m._tunnel_list),
        "tunnel close": dict(cmd="tunnel close", fn=m._tunnel_close, positional=[["all", "18766", "R18766"]]),
        "tunnel --reverse": dict(cmd="tunnel --reverse", fn=m._tunnel_reverse, positional=[["1", "18765"]]),
        # nothing listens on the drawn local ports: `proxy on` is refused behind its parser
        "proxy on": dict(cmd="proxy on", fn=net_magics._proxy_on),
        "proxy off": dict(cmd="proxy off", fn=net_magics._proxy_off),
        "mirrors": dict(cmd="mirrors", fn=net_magics._mirrors, positional=[["hf", "npm"], ["off", "nosuch", "hf-mirror"]]),
        "fit": dict(cmd="fit", fn=m._fit, positional=[["7B", "350M", "1.5e9"]]),
        "wrapup": dict(cmd="wrapup", fn=m._wrapup, exclude={"--clean"}, banned=PATH_UNSAFE),
        "budget notify": dict(cmd="budget notify", fn=m._budget_notify),
        # `kernel start` and the rest would start real kernels; listing and stopping (a session
        # that does not exist) go through the same dispatcher and option checks.
        "kernel list": dict(cmd="kernel list", fn=kernel_magics._list),
        "kernel stop": dict(cmd="kernel stop", fn=kernel_magics._stop, positional=[["nosuch", "a"]]),
        # no platform has a key in the fuzz's data dir (and no keychain is read): refused behind the parser
        "offers": dict(cmd="offers", fn=rent_magics._offers),
        "rent": dict(cmd="rent", fn=rent_magics._rent, always=["--name"]),
        "stop": dict(cmd="stop", fn=rent_magics._stop, positional=[["nosuch", "r1"]]),
        "start": dict(cmd="start", fn=rent_magics._start, positional=[["nosuch", "r1"]]),
        "release": dict(cmd="release", fn=rent_magics._release, positional=[["nosuch", "r1"]]),
        "rentals": dict(cmd="rentals", fn=rent_magics._rentals),
        "provider login": dict(cmd="provider login", fn=rent_magics._provider_login,
                               positional=[["runpod", "lambda"]]),
        "provider logout": dict(cmd="provider logout", fn=rent_magics._provider_logout,
                                positional=[["runpod", "lambda"]]),
        "%%remote": dict(cmd="%%remote", fn=m.GpuMagics.remote, exclude=KEEP_OPTIONS),
        # a job whose checkpoints are kept (a keeper thread per drawn job, stopped at the end)
        "%%remote --keep": dict(cmd="%%remote", fn=m.GpuMagics.remote, always=["--job", "--keep"],
                                exclude={"--torchrun", "--torchrun-args", "--hosts", "--each", "--same-dir",
                                         "--same-dir-hash", "--kernel"}, banned=PATH_UNSAFE),
    }


SPECS = _specs()


@st.composite
def arg_lines(draw, spec: dict) -> str:
    """Mostly ordinary words with a hostile one here and there: deep enough to get past the
    parser to the code behind it."""
    banned = spec.get("banned", set())
    hostile = [w for w in HOSTILE if w not in banned]
    hostile_positional = spec.get("hostile_positional", True)

    def value(ordinary: list[str], may_be_hostile: bool = True) -> str:
        if not ordinary or (may_be_hostile and draw(st.integers(0, 9)) < 3):
            return draw(st.sampled_from(hostile if may_be_hostile else NOT_A_HOST))
        return draw(st.sampled_from(ordinary))

    words = []
    for ordinary in spec.get("positional", []):
        if draw(st.integers(0, 9)) < 9:
            words.append(value(ordinary, hostile_positional) if hostile_positional or draw(st.booleans())
                         else draw(st.sampled_from(ordinary)))
    actions = [a for a in spec["fn"].parser._actions if a.option_strings
               and not set(a.option_strings) & spec.get("exclude", set())]
    always = spec.get("always", [])
    for a in actions:
        if not (set(a.option_strings) & set(always)) and draw(st.integers(0, 9)) >= 3:
            continue
        opt = draw(st.sampled_from(a.option_strings))
        if a.nargs == 0:
            words.append(opt)
            continue
        ordinary = next((VALUES[o] for o in a.option_strings if o in VALUES), None) or list(a.choices or []) or VALID
        safe_only = bool(set(a.option_strings) & SAFE_VALUES_ONLY)
        v = draw(st.sampled_from(ordinary)) if safe_only else value(ordinary)
        words.append(f"{opt}={v}" if draw(st.integers(0, 9)) == 0 else f"{opt} {shlex.quote(v)}"
                     if draw(st.booleans()) else f"{opt} {v}")
    if draw(st.integers(0, 9)) == 0:  # a stray word
        words.insert(draw(st.integers(0, len(words))), value([], True))
    return " ".join(words)


@pytest.fixture(scope="module")
def fuzz(_ipython, tmp_path_factory):
    """A server of its own (stand-in shutdown, a python3 without Jupyter/TensorBoard), a temp
    working directory and data directory, and getpass answering "" (no terminal here)."""
    base = tmp_path_factory.mktemp("fuzz")
    server = make_server(ALIAS, fake_gpu="h200-idle")
    # where not root, with a stand-in sudo too: --then-shutdown and the guard are armed, not refused
    install_shutdown(server, '#!/bin/sh\necho "$*" >> "$(dirname "$0")/../shutdown-calls"\n')
    if Path("/usr/bin/python3").exists():  # jupyter/tensorboard missing: refused at once
        server.install_bin("python3", '#!/bin/sh\nexec /usr/bin/python3 "$@"\n')
    add_client_entry(server, ALIAS)
    remote_dir = Path(server.env["HOME"]) / "work"
    (remote_dir / "rsrc").mkdir(parents=True)
    (remote_dir / "rsrc" / "r.txt").write_text("remote\n", encoding="utf-8")
    local = base / "cwd"
    (local / "src").mkdir(parents=True)
    (local / "src" / "a.txt").write_text("local\n", encoding="utf-8")
    saved = {"cwd": os.getcwd(), "data": os.environ.get("GPUMAGIC_DATA_DIR"), "getpass": getpass.getpass}
    os.chdir(local)
    os.environ["GPUMAGIC_DATA_DIR"] = str(base / "data")
    getpass.getpass = lambda prompt="": ""
    _ipython._gpumagic.fleet.close_all()
    from gpumagic.rent import KeyStore, Renter

    _ipython._gpumagic.state.renter = Renter(keys=KeyStore(base / "data" / "keys", use_keyring=False))
    try:
        yield _ipython, server, remote_dir
    finally:
        _ipython._gpumagic.state.renter = None
        getpass.getpass = saved["getpass"]
        os.chdir(saved["cwd"])
        if saved["data"] is None:
            os.environ.pop("GPUMAGIC_DATA_DIR", None)
        else:
            os.environ["GPUMAGIC_DATA_DIR"] = saved["data"]
        fleet = _ipython._gpumagic.fleet
        for m in list(fleet.machines.values()):
            try:
                if m.is_connected:
                    m.tunnels.close_all(stop_service=True)
                    m.budget.cancel_guard()
                    notify.disable(m)  # stops a spending watcher a drawn line armed
            except GpumagicError:
                pass
        fleet.close_all()
        for name, w in list(_ipython._gpumagic.status_watchers.items()):
            w.stop()
        server.stop()


#: sub-command -> outcome -> count (shown with -s: how deep the drawn lines got)
OUTCOMES: dict[str, dict[str, int]] = {}


def _snapshot(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def _restore(root: Path, saved: dict[Path, bytes]) -> None:
    for p in list(root.rglob("*")) if root.exists() else []:
        if p.is_file() and p not in saved:
            p.unlink()
    for p, data in saved.items():
        if not p.exists() or p.read_bytes() != data:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            p.chmod(0o600)


def _run_one(ip, server, remote_dir: Path, name: str, line: str) -> None:
    fleet = ip._gpumagic.fleet
    m = fleet.machines.get(ALIAS)
    if m is None or not m.is_connected or fleet.default != ALIAS:
        with capture_output():
            ip.run_line_magic("gpu", f"connect {ALIAS}")
        m = fleet.get(ALIAS)
    m.cwd = str(remote_dir)  # a drawn `cd /` must never make `sync` write outside the temp dirs
    ssh = _snapshot(CLIENT_HOME / ".ssh")
    outcome = "success"
    try:
        with capture_output():
            if SPECS[name]["cmd"] == "%%remote":
                ip.run_cell_magic("remote", line, "x=1")
            else:
                ip.run_line_magic("gpu", f"{SPECS[name]['cmd']} {line}")
    except UsageError as e:
        assert type(e) is UsageError, (name, line, type(e))
        outcome = "UsageError"
    except GpumagicError as e:
        outcome = type(e).__name__
    except Exception as e:  # noqa: BLE001
        import traceback

        raise AssertionError(f"%gpu {name} {line!r} raised {type(e).__name__}: {e}\n"
                             + "".join(traceback.format_exception(e))) from None
    finally:
        OUTCOMES.setdefault(name, {}).setdefault(outcome, 0)
        OUTCOMES[name][outcome] += 1
        _restore(CLIENT_HOME / ".ssh", ssh)
        for t in list(m.tunnels):  # a drawn `tunnel PORT` keeps listening otherwise
            m.tunnels.close(t.local_port, stop_service=True)
        for r in m.tunnels.reverse_tunnels():  # and a drawn `tunnel --reverse N`
            m.tunnels.close_reverse(r.id)


@pytest.mark.timeout(600)
@pytest.mark.slow(300, reason="a magic's drawn argument lines, run for real (wrapup's pulls compare every file by sha256)")
@pytest.mark.parametrize("name", list(SPECS))
def test_any_argument_line_is_success_usage_error_or_gpumagic_error(fuzz, name):
    ip, server, remote_dir = fuzz

    @SETTINGS
    @given(line=arg_lines(SPECS[name]))
    def check(line):
        _run_one(ip, server, remote_dir, name, line)

    check()


def test_the_fuzz_got_past_the_parser_of_every_subcommand():
    """Runs after the fuzz above (same module): drawn lines reached the code behind each parser
    (a success or a gpumagic error), not only the parser's own UsageError.  ``-s`` shows how
    each sub-command's lines ended."""
    if len(OUTCOMES) < len(SPECS):
        pytest.skip("run with the fuzz tests above")
    for name, counts in OUTCOMES.items():
        print(f"\n{name}: {counts}", end="")
    assert [name for name, counts in OUTCOMES.items() if set(counts) == {"UsageError"}] == []


def test_every_subcommand_is_fuzzed():
    names = {v["cmd"] for v in SPECS.values()}
    assert set(magics.SUBCOMMANDS) <= {n.split()[0] for n in names}
    assert {"budget set", "budget estimate", "budget history", "budget guard", "budget notify", "tunnel jupyter",
            "tunnel tensorboard", "tunnel list", "tunnel close", "%%remote"} <= names
    assert KEEP_OPTIONS <= {o for a in magics.GpuMagics.remote.parser._actions for o in a.option_strings}


def test_the_snapshot_puts_ssh_back(tmp_path):
    (tmp_path / "a").write_text("1", encoding="utf-8")
    saved = _snapshot(tmp_path)
    (tmp_path / "a").write_text("2", encoding="utf-8")
    (tmp_path / "b").write_text("new", encoding="utf-8")
    _restore(tmp_path, saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"] and (tmp_path / "a").read_text(encoding="utf-8") == "1"


# -- what the fuzz found, each kept as a plain test -------------------------------------------


@pytest.mark.parametrize("line", ["jobs --host=--", "budget --host=--", "tunnel tensorboard --out=--",
                                  "status --host=-- --text"])
def test_an_option_given_as_equals_double_dash_is_a_usage_error(ip, line):
    # Python < 3.12's argparse parses `--host=--` as the value [] (a list)
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", line)
    assert type(e.value) is UsageError and "expected one value, not '--'" in str(e.value)


def test_env_given_as_equals_double_dash_is_a_usage_error(ip):
    with pytest.raises(UsageError, match="argument --env: expected one value"):
        ip.run_cell_magic("remote", "--env=--", "true")


def test_keygen_with_a_file_name_too_long_is_one_error(ip, tmp_path, monkeypatch):
    from gpumagic.keys import LocalFileError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(LocalFileError) as e:
        ip.run_line_magic("gpu", "keygen --path " + "x" * 3000)
    assert "File name too long" in e.value.message and "--path" in e.value.hint
    assert list(tmp_path.iterdir()) == []


def test_pull_into_a_path_under_a_file_is_one_sync_error(machine, tmp_path):
    from gpumagic.errors import SyncError

    remote = tmp_path / "remote"
    (remote / "d").mkdir(parents=True)
    (remote / "d" / "f.txt").write_text("x", encoding="utf-8")
    (tmp_path / "nan").write_text("a file, not a directory", encoding="utf-8")
    with pytest.raises(SyncError) as e:
        machine.pull(str(remote / "d"), str(tmp_path / "nan"))
    assert e.value.message == (f"cannot copy into {tmp_path / 'nan' / 'd'} on this computer: part of that "
                               "path is a file, not a directory")
    assert (tmp_path / "nan").read_text(encoding="utf-8") == "a file, not a directory"


def test_cd_dash_and_tilde_give_one_directory(machine):
    home = machine.run("echo $HOME", quiet=True).stdout.strip()
    assert machine.cd("~") == os.path.realpath(home)
    assert machine.cd("/tmp") == os.path.realpath("/tmp")
    with pytest.raises(GpumagicError, match="no directory -"):
        machine.cd("-")  # a directory named "-", not the previous one with two lines of output
    assert machine.cwd == os.path.realpath("/tmp")


# -- issue 31: the kinds the fuzz of the README's magics found, each with its exact input ----


def _connected(ip):
    with capture_output():
        ip.run_line_magic("gpu", "connect testgpu")
    return ip._gpumagic.fleet.get()


def test_a_lone_surrogate_for_a_byte_is_that_byte_in_cd_cwd_env_and_a_shell_cell(ip, tmp_path):
    """``\\udcff`` is os.fsdecode's stand-in for the byte 0xff (a file name that is not UTF-8):
    `%gpu cd`, --cwd, --env and a bash cell send it as that byte, so all four name one file."""
    (tmp_path / os.fsdecode(b"d\xff")).mkdir()
    m = _connected(ip)
    name = str(tmp_path / "d\udcff")
    with capture_output():
        ip.run_line_magic("gpu", f"cd {shlex.quote(name)}")
    assert os.fsencode(m.cwd) == os.fsencode(os.path.realpath(tmp_path)) + b"/d\xff"
    ip.run_cell_magic("remote", f"--cwd {shlex.quote(name)} --env 'A=x\udcff' --out r",
                      "{ printf '%s|%s|' \"$PWD\" \"$A\"; ls -d ../d\udcff; } | od -An -tx1")
    r = ip.user_ns["r"]  # od: the bytes as the machine has them (output is shown as UTF-8)
    assert r.exit_code == 0
    assert bytes.fromhex("".join(r.stdout.split())) == os.fsencode(m.cwd) + b"|x\xff|../d\xff\n"


@pytest.mark.parametrize("line,cell", [("--python", "print('\udcff')"),
                                       ("--python --job j31", "x = 1\nprint('\udcff')")])
def test_a_lone_surrogate_in_a_python_cell_or_job_is_one_error_naming_the_line(ip, line, cell):
    _connected(ip)
    with pytest.raises(GpumagicError) as e:
        ip.run_cell_magic("remote", line, cell)
    where = "line 2" if "\n" in cell else "line 1"
    assert e.value.message == (f"{where} of the cell holds a lone surrogate U+DCFF (text from a broken "
                               "decode), and Python source must be UTF-8")
    assert "b'\\xff'" in e.value.hint


@pytest.mark.parametrize("line", ["cd /tmp/\ud800", "--cwd /tmp/\ud800", "--env A=\ud800", "--job j31 --env A=\ud800",
                                  "--job j31 --cwd /tmp/\ud800", "--job j31"])
def test_a_lone_surrogate_no_encoding_carries_is_one_error(ip, line):
    _connected(ip)
    with pytest.raises(GpumagicError, match="holds a lone surrogate U[+]D800 .*which no encoding can send"):
        if line.startswith("cd "):
            ip.run_line_magic("gpu", line)
        else:
            ip.run_cell_magic("remote", line, "echo \ud800" if line == "--job j31" else "true")
    assert not [j for j in ip._gpumagic.fleet.get().jobs() if j.name == "j31"]  # nothing started


def test_a_shell_job_sends_a_lone_surrogate_as_its_byte(ip, tmp_path):
    m = _connected(ip)
    out = tmp_path / "job.out"
    with capture_output():
        ip.run_cell_magic("remote", "--job j31b --no-alerts", f"printf 'x\udcff' > {shlex.quote(str(out))}")
    m.job("j31b").wait(timeout=30)
    assert out.read_bytes() == b"x\xff"


LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "intermediate_size": 11008, "vocab_size": 32000}
BAD_CONFIGS = {  # the field's JSON text -> what the one-line error says
    '"num_attention_heads": 0': "num_attention_heads is 0, not a whole number from 1 to 2147483647",
    '"hidden_size": NaN': "hidden_size is NaN, not a whole number from 1 to 2147483647",
    '"hidden_size": Infinity': "hidden_size is Infinity, not a whole number from 1 to 2147483647",
    '"num_hidden_layers": "32"': 'num_hidden_layers is "32", not a whole number from 1 to 2147483647',
    '"intermediate_size": "11008"': 'intermediate_size is "11008", not a whole number from 1 to 2147483647',
    '"vocab_size": 1e400': "vocab_size is Infinity, not a whole number from 1 to 2147483647",
    '"vocab_size": 99999999999999999999': "vocab_size is 99999999999999999999, not a whole number from 1",
    '"attention_dropout": "0.1"': 'attention_dropout is "0.1", not a probability from 0 to 1',
    '"hidden_size": 2147483647': "describes 368937283T parameters, more than the 1000T of any model",
}


@pytest.mark.parametrize("field", list(BAD_CONFIGS))
def test_fit_on_a_bad_config_names_the_field_and_the_file(ip, tmp_path, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(LLAMA)[:-1] + ", " + field + "}", encoding="utf-8")
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", f"fit {path} --card H200")
    assert type(e.value) is UsageError
    assert str(e.value).startswith("bad.json") and BAD_CONFIGS[field] in str(e.value), str(e.value)
    assert len(str(e.value).splitlines()) == 2  # the message and its hint


@pytest.mark.parametrize("text,says", [
    ("[" * 100_000 + "]" * 100_000, "it is nested deeper than Python's parser follows"),
    ('{"vocab_size": ' + "9" * 5000 + "}", "a number in it is too long (Exceeds the limit (4300 digits)"),
])
def test_fit_on_a_config_json_cannot_read_is_one_error(ip, tmp_path, text, says):
    path = tmp_path / "config.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(UsageError, match=f"cannot read {path} as JSON: ") as e:
        ip.run_line_magic("gpu", f"fit {tmp_path}")
    assert says in str(e.value)


@pytest.mark.parametrize("arg,says", [("x" * 5000, '"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx..." (5000 characters) as a path: '
                                                   "File name too long"),
                                      ("1e99999999", "'1e99999999' is more than 1000T parameters"),
                                      ("1e400", "'1e400' is more than 1000T parameters")])
def test_fit_on_a_huge_count_or_an_over_long_argument_is_one_usage_error(ip, tmp_path, monkeypatch, arg, says):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", f"fit {arg} --card H200")
    assert says in str(e.value)


def test_connect_with_a_name_of_5000_characters_is_one_error_before_a_sandbox_starts(ip):
    from gpumagic.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        ip.run_line_magic("gpu", "connect --sandbox --name " + "n" * 5000)
    assert e.value.message == "the machine name (--name) is 5000 characters long (at most 100)"
    assert ip._gpumagic.fleet.machines == {}


def test_keygen_with_a_nul_in_its_path_is_one_error(ip, tmp_path, monkeypatch):
    # a NUL in any argument of any magic is one usage error (issue 43), before anything is made
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", "keygen --path k\x001")
    assert type(e.value) is UsageError and str(e.value) == "an argument holds a NUL character ('k\\x001'): remove it"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("line", ["""--job t31 --torchrun 1 --torchrun-args "'" """,
                                  """--job t31 --hosts a --each "'" """])
def test_a_quoted_list_option_with_an_unclosed_quote_is_a_usage_error(ip, line):
    with pytest.raises(UsageError) as e:
        ip.run_cell_magic("remote", line, "print(1)")
    assert type(e.value) is UsageError and "No closing quotation" in str(e.value)
    assert "close the quote" in str(e.value)


def test_a_torchrun_cell_command_line_with_an_unclosed_quote_is_one_error():
    from gpumagic.errors import JobError
    from gpumagic.remote import distributed

    class NoMachine:
        name = "m"

    with pytest.raises(JobError, match=r"cannot split the cell's command line after '!' \("):
        distributed.start([NoMachine()], "t31", "!python train.py --tag 'x")  # asks no machine

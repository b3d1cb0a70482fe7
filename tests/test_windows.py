"""The laptop side on Windows and macOS, proven on Linux (issue 26).

No Windows machine is here: what can be proven is proven by reading (the syntax-tree guard
check of :mod:`posix_guard`), by the paths' own rules (``ntpath``, ``PureWindowsPath``), and
by running gpumagic with Windows' traits (no ``os.getuid``, ``fcntl``, ``pwd``, ...).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from posix_guard import laptop_modules, unguarded

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpumagic"


# -- 1. no POSIX-only call unguarded ----------------------------------------------------


def test_no_posix_only_call_on_the_laptop_side_is_unguarded():
    modules = laptop_modules(PACKAGE)
    assert len(modules) > 50 and PACKAGE / "sync" / "agent.py" in modules
    assert not any("remote/programs" in p.as_posix() or p.name == "sandbox.py" for p in modules)
    found = [str(u) for p in modules for u in unguarded(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize("source", [
    "import fcntl\n",
    "from pwd import getpwnam\n",
    "from os import getuid\n",
    "import os\nos.getuid()\n",
    "import os as _os\n_os.killpg(1, 9)\n",
    "import signal\nsignal.signal(signal.SIGHUP, None)\n",
    "import select\np = select.poll()\n",
    "import os, sys\nif sys.platform == 'win32':\n    os.getuid()\n",
    "import os\nif os.name == 'posix':\n    pass\nelse:\n    os.setsid()\n",
    "import os\ntry:\n    os.fork()\nexcept OSError:\n    pass\n",  # Windows raises AttributeError
    "try:\n    import termios\nexcept AttributeError:\n    pass\n",
    "import os\nif hasattr(os, 'getuid') or True:\n    os.geteuid()\n",
    "import os\ndef f():\n    if os.name == 'nt':\n        pass\n    os.getuid()\n",  # no early exit
    "import os\nx = os.getuid() if os.name == 'nt' else 0\n",
    "import signal\nsignal.SIGKILL\n",
    "import resource\n",
])
def test_guard_check_finds_what_windows_would_reach(source):
    assert len(unguarded(source)) == 1


@pytest.mark.parametrize("source", [
    "try:\n    import fcntl\nexcept ImportError:\n    fcntl = None\n",
    "import os\nif os.name == 'posix':\n    os.getuid()\n",
    "import os\nif os.name == 'nt':\n    pass\nelse:\n    os.setsid()\n",
    "import os, sys\nif not sys.platform.startswith('win'):\n    os.killpg(1, 9)\n",
    "import sys\nif sys.platform != 'win32':\n    import pwd\n",
    "import os\nif hasattr(os, 'getuid') and os.getuid() == 0:\n    pass\n",
    "import os\nuid = os.getuid() if hasattr(os, 'getuid') else 0\n",
    "import os\ndef f():\n    if os.name == 'nt':\n        return 0\n    return os.getuid()\n",
    "import select\nif hasattr(select, 'poll'):\n    select.poll()\nelse:\n    select.select([], [], [], 0)\n",
    "import os, signal\ntry:\n    os.killpg(1, signal.SIGKILL)\nexcept (OSError, AttributeError):\n    pass\n",
    "import os\n_POSIX = os.name != 'nt' and True\nif _POSIX:\n    os.getuid()\n",
    "import platform, os\nif platform.system() != 'Windows':\n    os.fork()\n",
    "import os\nos.getpid(); os.kill(1, 15); os.name\n",  # these exist on Windows
    "import signal\nsignal.SIGTERM, signal.SIGINT\n",
])
def test_guard_check_accepts_a_guard_with_a_windows_branch(source):
    assert unguarded(source) == []


# -- the budget ledger's lock ---------------------------------------------------------------


def test_two_processes_recording_at_once_lose_no_record(tmp_path):
    """Two notebooks record 40 rentals each into one ledger at the same moment: every
    one of the 80 is there.  Each update reads, changes and writes the whole file, so without
    the lock (filelock: flock here, msvcrt.locking on Windows) writers overwrite each other."""
    path = tmp_path / "ledger.json"
    go = tmp_path / "go"
    code = textwrap.dedent("""
        import os, sys, time
        from gpumagic.budget import Ledger, Prices, set_prices
        from gpumagic.budget.ledger import record_rental
        path, go, me = sys.argv[1:]
        ledger = Ledger(path)
        set_prices(ledger, me, Prices(rate=1.0))
        open(go + "." + me, "w", encoding="utf-8").close()
        while not os.path.exists(go):
            time.sleep(0.001)
        for i in range(40):
            with ledger.update() as machines:
                record_rental(machines[me], i * 1000.0, i * 1000.0 + 10, machines[me].prices)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), str(go), name], env=env)
             for name in ("a", "b")]
    try:
        for name in ("a", "b"):
            while not Path(f"{go}.{name}").exists():
                assert all(p.poll() is None for p in procs)
                time.sleep(0.01)
        go.touch()
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    from gpumagic.budget import Ledger

    machines = Ledger(path).machines()
    assert sorted(machines) == ["a", "b"]
    assert [len(machines[m].rentals) for m in ("a", "b")] == [40, 40]


# -- 3. Windows paths ------------------------------------------------------------------------

PROJ = "C:\\Users\\学生\\proj\\"
KEY = "C:\\Users\\学生\\.ssh\\id_ed25519"


def test_sync_line_from_windows_keeps_the_drive_local_and_its_trailing_backslash():
    from gpumagic.notebook.magics import split_args
    from gpumagic.sync.plan import copies_contents, destination_root, local_seps, transfer

    words = split_args(f"{PROJ} :/root/proj/", windows=True)
    assert words == [PROJ, ":/root/proj/"]  # backslashes are separators there, not escapes
    t = transfer(*words, windows=True)
    assert (t.pull, t.src.host, t.src.path, t.dst.host, t.dst.path) == (False, None, PROJ, "", "/root/proj/")
    seps = local_seps(windows=True)
    assert seps == "/\\" and copies_contents(PROJ, seps=seps)  # a trailing \ is rsync's trailing /
    assert destination_root(PROJ, "/root/proj/", src_seps=seps) == "/root/proj/"
    assert destination_root(PROJ.rstrip("\\"), "/root/ws", src_seps=seps) == "/root/ws/proj"
    pull = transfer(":/root/runs/", "C:\\Users\\学生\\runs\\", windows=True)
    assert pull.pull and pull.dst.path == "C:\\Users\\学生\\runs\\" and pull.dst.host is None


@pytest.mark.parametrize("text, host, path", [
    ("C:\\data", None, "C:\\data"),
    ("C:/data/", None, "C:/data/"),
    ("c:proj", None, "c:proj"),         # drive-relative: a drive still, never a machine named c
    ("C:", None, "C:"),
    ("\\\\nas\\share\\学生\\", None, "\\\\nas\\share\\学生\\"),    # UNC
    ("\\\\?\\C:\\very\\long", None, "\\\\?\\C:\\very\\long"),
    ("data\\x:y", None, "data\\x:y"),   # a separator before the colon: local (rsync's rule)
    ("gpu:C:/x", "gpu", "C:/x"),        # a machine's name is longer than a letter
    (":/root/proj", "", "/root/proj"),
])
def test_endpoint_on_windows_a_single_letter_is_a_drive(text, host, path):
    from gpumagic.sync.plan import parse_endpoint

    e = parse_endpoint(text, windows=True)
    assert (e.host, e.path) == (host, path)


def test_endpoint_off_windows_a_single_letter_is_a_machine():
    from gpumagic.sync.plan import parse_endpoint

    assert parse_endpoint("c:proj", windows=False).host == "c"
    assert parse_endpoint("C:\\data", windows=False).host == "C"  # on Linux a backslash is a name


@pytest.mark.parametrize("src, contents, name", [
    ("C:\\Users\\学生\\proj", False, "proj"),
    ("C:\\Users\\学生\\proj\\", True, None),
    ("C:\\Users\\学生\\proj/", True, None),
    ("C:\\", True, None),
    ("C:", True, None),                  # the drive's current folder, like "."
    ("C:proj", False, "proj"),
    ("\\\\nas\\share\\data", False, "data"),
    ("..\\data\\.", True, None),
])
def test_windows_source_paths_follow_rsyncs_trailing_slash_rule(src, contents, name):
    from gpumagic.sync.plan import copies_contents, destination_root

    assert copies_contents(src, seps="/\\") is contents
    assert destination_root(src, "/ws", src_seps="/\\") == ("/ws" if contents else f"/ws/{name}")


def test_identity_file_given_as_a_windows_path_is_kept_whole():
    from gpumagic.notebook.magics import split_args
    from gpumagic.ssh.config import SshConfig
    from gpumagic.ssh.hosts import resolve

    line = f"gpu -i {KEY} -p 41022"
    assert split_args(line, windows=True) == ["gpu", "-i", KEY, "-p", "41022"]
    assert split_args('gpu -i "C:\\Users\\学生 王\\.ssh\\id"', windows=True)[2] == "C:\\Users\\学生 王\\.ssh\\id"
    assert split_args(line, windows=False)[2] == "C:Users学生.sshid_ed25519"  # what sh would make of it
    spec = resolve("gpu", config=SshConfig.from_text("", home="C:\\Users\\学生"), identity_file=KEY, port=41022)
    assert spec.identity_files == (KEY,)
    unc = "\\\\nas\\keys\\学生\\id_ed25519"
    assert resolve("gpu", config=SshConfig.from_text(""), identity_file=unc).identity_files == (unc,)


def test_pasted_ssh_line_from_powershell_keeps_windows_paths(monkeypatch):
    from gpumagic import localpath
    from gpumagic.ssh.hosts import parse_ssh_command

    monkeypatch.setattr(localpath, "on_windows", lambda windows=None: True if windows is None else windows)
    cmd = parse_ssh_command(f"ssh -i {KEY} -p 41022 root@203.0.113.10")
    assert (cmd.keys, cmd.port, cmd.user, cmd.host) == ((KEY,), 41022, "root", "203.0.113.10")


@pytest.mark.parametrize("env, home", [
    ({"USERPROFILE": "C:\\Users\\学生", "HOME": "/ignored"}, "C:\\Users\\学生"),
    ({"HOMEDRIVE": "D:", "HOMEPATH": "\\Users\\学生"}, "D:\\Users\\学生"),
])
def test_tilde_is_userprofile_on_windows(env, home):
    from gpumagic import localpath
    from gpumagic.ssh.config import tilde_expand

    assert localpath.home_dir(windows=True, env=env) == home
    assert tilde_expand("~/.ssh/id_ed25519", home, windows=True) == home + "\\.ssh\\id_ed25519"
    assert tilde_expand("~\\.ssh\\id_ed25519", home, windows=True) == home + "\\.ssh\\id_ed25519"
    assert tilde_expand("~", home, windows=True) == home
    assert tilde_expand(KEY, home, windows=True) == KEY
    # POSIX keeps OpenSSH's own result, backslash and all
    assert tilde_expand("~/.ssh/id", "/home/me", windows=False) == "/home/me/.ssh/id"
    assert tilde_expand("~", "/home/me", windows=False) == "/home/me/"


def test_ssh_config_files_openssh_for_windows_reads(monkeypatch):
    from gpumagic import localpath
    from gpumagic.ssh.config import SshConfig

    env = {"USERPROFILE": "C:\\Users\\学生", "PROGRAMDATA": "C:\\ProgramData"}
    home = localpath.home_dir(windows=True, env=env)
    assert localpath.ssh_config_files(home, windows=True, env=env) == (
        "C:\\Users\\学生\\.ssh\\config", "C:\\ProgramData\\ssh\\ssh_config")
    assert localpath.ssh_system_dir(windows=True, env={}) == "C:\\ProgramData\\ssh"
    assert localpath.ssh_config_files("/home/me", windows=False) == ("/home/me/.ssh/config", "/etc/ssh/ssh_config")
    # SshConfig reads those two on Windows (the platform patched where it is asked)
    monkeypatch.setattr(localpath, "on_windows", lambda windows=None: True if windows is None else windows)
    monkeypatch.setenv("PROGRAMDATA", "D:\\ProgramData")
    config = SshConfig(home="C:\\Users\\学生")
    assert (config.path, config.system) == ("C:\\Users\\学生\\.ssh\\config", "D:\\ProgramData\\ssh\\ssh_config")


# -- 6. CRLF cells -------------------------------------------------------------------------

BASH_CELL = 'x=1\necho "[$x]"\nfor i in a b; do\n  echo "$i"\ndone\ncd /tmp && pwd\nprintf \'crlf\\r\\nlf\\n\'\n'
PY_CELL = 'import sys\nname = "x"\nif name:\n    print(f"[{name}]")\ntext = """a\nb"""\nprint(repr(text))\n' \
          'sys.stdout.write("crlf\\r\\nlf\\n")\n'


def test_crlf_cells_run_as_their_lf_twins_and_output_keeps_its_own_line_endings(machine):
    from gpumagic.remote.execution import cell_argv

    for cell, python in ((BASH_CELL, False), (PY_CELL, True)):
        crlf = cell.replace("\n", "\r\n")
        assert cell_argv(crlf, python=python) == cell_argv(cell, python=python)
        lf, windows = (machine.run(c, python=python, quiet=True) for c in (cell, crlf))
        assert (windows.exit_code, windows.stdout, windows.stderr) == (lf.exit_code, lf.stdout, lf.stderr) == (
            0, lf.stdout, "")
        assert lf.stdout.endswith("crlf\r\nlf\n")  # what the program wrote, CR and all
    assert lf.stdout == "[x]\n'a\\nb'\ncrlf\r\nlf\n"
    assert cell_argv("printf 'a\rb'", python=False)[-1] == "printf 'a\rb'"  # a lone CR is the cell's own


# -- 7. the sandbox off Linux ------------------------------------------------------------------


def test_sandbox_on_windows_says_in_one_line_that_it_needs_a_linux_machine(ip, monkeypatch, tmp_path):
    from gpumagic.errors import SandboxError
    from gpumagic.ssh import sandbox

    made = []
    monkeypatch.setattr(sandbox, "remove_stale_sandbox_dirs", lambda *a: made.append("cleaned"))
    monkeypatch.setattr(sandbox.tempfile, "TemporaryDirectory", lambda *a, **k: made.append("tmp"))
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(SandboxError) as e:
        ip.run_line_magic("gpu", "connect --sandbox")
    msg = e.value.message
    assert "\n" not in msg and "Linux machine" in msg and "`wsl --install`" in msg
    assert "Jupyter inside it" in msg and "Binder" in msg
    assert made == []  # refused before anything was made (no temp dir, no os.getuid)
    assert e.value._render_traceback_()[0].startswith("SandboxError: the sandbox needs a Linux machine")
    with pytest.raises(SandboxError):
        sandbox.SshServer(tmp_path).start()  # the test kit's servers too


def test_sandbox_on_macos_runs_its_own_sshd_config_or_names_the_missing_sshd(tmp_path, monkeypatch):
    from gpumagic.errors import SandboxError
    from gpumagic.ssh import sandbox

    monkeypatch.setattr(sys, "platform", "darwin")
    made = []
    real_makedirs = os.makedirs
    monkeypatch.setattr(os, "makedirs", lambda p, *a, **k: made.append(p) or real_makedirs(p, *a, **k))
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # even as root: no /run/sshd on a Mac
    with sandbox.SshServer(tmp_path / "mac") as server:
        assert sandbox._parent_death_signal() is None  # prctl is Linux's
        r = subprocess.run(server.ssh_command("echo", "up"), capture_output=True, encoding="utf-8", timeout=30)
        assert (r.returncode, r.stdout) == (0, "up\n")
    assert "/run/sshd" not in made
    monkeypatch.setattr(sandbox, "SSHD_CANDIDATES", ())
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxError) as e:
        sandbox.find_sshd()
    assert "/usr/sbin/sshd is missing" in e.value.message and "brew install openssh" in e.value.hint


# -- 2. encodings -------------------------------------------------------------------------------


def test_ssh_config_with_gbk_bytes_in_comments_still_connects(sshd, tmp_path):
    """A config saved by Notepad on Chinese Windows (GBK, cp936): OpenSSH reads bytes, and so
    does gpumagic, so a comment that is not UTF-8 never stops a connect."""
    import gpumagic

    config = tmp_path / "config"
    config.write_bytes("# 我的服务器\n".encode("gbk") + b"Host gbk \xff\n" + "  # 学生的 GPU, 价格 ￥2/小时\n".encode("gbk")
                      + (f"  HostName {sshd.host}\n  Port {sshd.port}\n  User {sshd.user}\n"
                         f"  IdentityFile {sshd.client_key}\n  IdentitiesOnly yes\n"
                         f"  UserKnownHostsFile {sshd.known_hosts}\n").encode())
    with pytest.raises(UnicodeDecodeError):
        config.read_bytes().decode("utf-8")
    g = subprocess.run(["ssh", "-G", "-F", str(config), "gbk"], capture_output=True, timeout=30)
    assert g.returncode == 0 and f"port {sshd.port}".encode() in g.stdout.splitlines()  # the judge
    m = gpumagic.connect(f"ssh -F {config} gbk")
    try:
        assert m.run("echo 连接", quiet=True).stdout == "连接\n"
    finally:
        m.close()


def test_gitignore_saved_on_chinese_windows_is_read_as_git_reads_it():
    """GBK comment, CRLF line endings, a GBK-encoded name: read as bytes (UTF-8 where it is,
    the rest kept as surrogate escapes, as in names), so it matches what git matches."""
    from gpumagic.sync.ignore import IgnoreRules, ignore_file_lines

    gbk_name = os.fsdecode("数据".encode("gbk"))  # a folder Windows wrote in the locale's encoding
    data = "# 模型文件\r\n*.pt\r\n".encode("gbk") + "数据/\r\n".encode("gbk") + "日志/\r\n".encode("utf-8")
    assert ignore_file_lines(data) == ["*.pt", gbk_name + "/", "日志/"]
    rules = IgnoreRules()
    rules.add_file(".gitignore", data)
    assert [rules.ignored(p, d) for p, d in [("model.pt", False), (gbk_name, True), ("日志", True),
                                             ("a.txt", False)]] == [True, True, True, False]


# -- the laptop side with Windows' traits ------------------------------------------------------


def test_connect_cell_push_pull_budget_and_tunnel_without_posix_only_calls(sshd, client_home, tmp_path):
    """tests/windows_traits.py: gpumagic's modules get no os.getuid/geteuid/killpg/setsid/fork,
    no select.poll, no signal.SIGKILL/SIGHUP and no fcntl/pwd/grp (the standard library keeps
    its own); a whole session still works."""
    import json

    (tmp_path / "data").mkdir()
    os.chmod(tmp_path / "data", 0o777)  # as Windows reports every folder
    env = {**os.environ, "HOME": str(client_home), "PYTHONPATH": str(ROOT),
           "GPUMAGIC_DATA_DIR": str(tmp_path / "data"), "SMOKE_SSHD_PORT": str(sshd.port)}
    r = subprocess.run([sys.executable, "-X", "warn_default_encoding", "-W", "error::EncodingWarning",
                        str(ROOT / "tests" / "windows_traits.py"), str(tmp_path)],
                       capture_output=True, encoding="utf-8", env=env, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["agent_lock"] is None and seen["cell"] == "cell-ran\n"
    assert seen["pushed"] == 2 and seen["remote"] == "./sub/数据.txt\n./train.py\nprint('train')\n"
    assert seen["pulled"] == ["result.txt", "sub/数据.txt", "train.py"]
    assert seen["pulled_result"] == "from-machine\n"
    assert (seen["budget_rate"], seen["ledger_machines"], seen["rentals"]) == (2.5, ["testgpu"], 1)
    assert seen["tunnel_banner"].startswith("SSH-2.0")
    # gpumagic did reach for them, and took its other branch each time
    assert {"import fcntl", "import pwd", "os.getuid", "select.poll"} <= set(seen["asked"]), seen["asked"]
    assert (tmp_path / "data").stat().st_mode & 0o777 == 0o777  # left to its ACL, as on Windows


# -- 4, 5. modes, case and normalisation: the rules ----------------------------------------------

NFC, NFD = "caf\u00e9", "cafe\u0301"


def _entries(*specs):
    from gpumagic.sync.plan import Entry

    return {s[0]: Entry(s[0], s[1], 1, 0, s[2] if len(s) > 2 else 0) for s in specs}


def test_a_push_without_modes_keeps_the_machines_and_picks_new_ones_by_content():
    from gpumagic.sync.laptop import BY_CONTENT, machine_modes, mode_by_content

    laptop = _entries((".", "d", 0o777), ("run.sh", "f", 0o666), ("new.sh", "f", 0o666), ("ro.txt", "f", 0o444),
                      ("data", "d", 0o777), ("new", "d", 0o777), ("link", "l", 0o777))
    machine = _entries((".", "d", 0o700), ("run.sh", "f", 0o755), ("ro.txt", "f", 0o640), ("data", "d", 0o750))
    modes = {p: e.mode for p, e in machine_modes(laptop, machine).items()}
    assert modes == {".": 0o700, "run.sh": 0o755, "new.sh": BY_CONTENT, "ro.txt": 0o640, "data": 0o750,
                     "new": 0o755, "link": 0o777}
    assert (mode_by_content(b"#!/bin/sh\n"), mode_by_content(b"print(1)"), mode_by_content(b"")) == (0o755, 0o644, 0o644)


def test_names_one_file_on_a_folding_folder_are_clashes_named_together():
    from gpumagic.sync.laptop import LocalFs, clashes

    ntfs, apfs, ext4 = LocalFs(modes=False, case=False), LocalFs(case=False, normalization=False), LocalFs()
    paths = ["Model.pt", "model.pt", NFC, NFD, "Data", "Data/a", "data", "data/a", "x/README", "x/readme.md"]
    assert clashes(paths, ntfs) == [["Data", "data"], ["Model.pt", "model.pt"]]  # NTFS keeps NFC and NFD apart
    assert clashes(paths, apfs) == [["Data", "data"], ["Model.pt", "model.pt"], sorted([NFC, NFD])]
    assert clashes(paths, ext4) == []
    assert clashes(["a", "a/B", "A", "A/b"], apfs) == [["A", "a"]]  # the folders, not what is in them


def test_rename_clashes_numbers_the_later_names_and_what_lies_under_them():
    from gpumagic.sync.laptop import LocalFs, renamed

    fs = LocalFs(case=False, normalization=False)
    got = renamed(["Model.pt", "model.pt", "model (2).pt", "Data", "Data/x", "data", "data/x", "notes", "NOTES"], fs)
    assert got == {"model.pt": "model (3).pt", "data": "data (2)", "data/x": "data (2)/x", "notes": "notes (2)"}


def test_laptop_names_take_the_machines_spelling_where_the_folder_folds():
    from gpumagic.sync.laptop import LocalFs, respelled

    laptop = _entries(("A.txt", "f"), (NFD, "f"), ("Only-here", "f"), ("b.txt", "f"))
    machine = ["a.txt", NFC, "b.txt", "B.txt"]
    assert sorted(respelled(laptop, machine, LocalFs(case=False, normalization=False))) == sorted(
        ["a.txt", NFC, "Only-here", "b.txt"])
    assert sorted(respelled(laptop, machine, LocalFs())) == sorted(laptop)  # ext4: every spelling its own


def test_probe_reads_what_the_folder_keeps(tmp_path):
    from gpumagic.sync.laptop import LocalFs, platform_default, probe

    os.utime(tmp_path, ns=(5, 1_000_000_007))
    assert probe(str(tmp_path / "not" / "yet")) == LocalFs() and os.listdir(tmp_path) == []
    assert tmp_path.stat().st_mtime_ns == 1_000_000_007  # set back: a sync compares folders' mtimes
    assert platform_default("win32") == LocalFs(modes=False, case=False)
    assert platform_default("darwin") == LocalFs(case=False, normalization=False)


# -- 4, 5. on real laptop-like file systems (FUSE: tests/casefold_fs.py) ---------------------------


def _fuse_refusal() -> str | None:
    """Why a FUSE file system cannot be mounted here, or None."""
    import shutil

    if shutil.which("fusermount3") is None:
        return "no fusermount3: install Debian's fuse3 (scripts/_packages.sh does, as root)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy cannot load libfuse3 ({e}): pip install mfusepy, apt-get install fuse3"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as e:
        return f"FUSE is not allowed for this user: /dev/fuse: {e.strerror} (a plain user without FUSE rights)"
    return None


def _mount(base: Path, *flags: str):
    reason = _fuse_refusal()
    if reason:
        pytest.skip(reason)
    backing, mnt = base / "backing", base / "laptop"
    backing.mkdir(parents=True)
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "casefold_fs.py"), *flags, str(backing), str(mnt)],
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not os.path.ismount(mnt):
        if proc.poll() is not None:
            pytest.skip(f"FUSE mount refused here: {proc.stderr.read().decode('utf-8', 'replace').strip()}")
        assert time.monotonic() < deadline, "the FUSE file system did not mount within 30 s"
        time.sleep(0.02)
    return proc, backing, mnt


def _unmount(proc, mnt: Path) -> None:
    subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, timeout=30)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def ntfs(tmp_path_factory):
    """A folder as Windows' Python sees NTFS: case-insensitive (and preserving), every file
    0o666, every folder 0o777, chmod kept nowhere, no symlinks.  Yields (backing, mounted)."""
    proc, backing, mnt = _mount(tmp_path_factory.mktemp("ntfs"), "--windows")
    yield backing, mnt
    _unmount(proc, mnt)


@pytest.fixture(scope="module")
def hfs(tmp_path_factory):
    """A folder as macOS keeps one: case- and normalisation-insensitive, new names in NFD (HFS+)."""
    proc, backing, mnt = _mount(tmp_path_factory.mktemp("hfs"), "--unicode", "--nfd")
    yield backing, mnt
    _unmount(proc, mnt)


def _remote(machine, script: str) -> str:
    return machine.run(script, quiet=True, check=True).stdout


def test_the_probe_reads_the_laptop_file_systems(ntfs, hfs):
    from gpumagic.sync.laptop import LocalFs, probe

    assert probe(str(ntfs[1])) == LocalFs(modes=False, case=False)
    assert probe(str(hfs[1])) == LocalFs(case=False, normalization=False)
    assert os.listdir(ntfs[0]) == [] and os.listdir(hfs[0]) == []  # the probe leaves nothing


def test_pull_of_model_pt_and_model_pt_into_a_case_insensitive_folder_refuses_then_renames(machine, ntfs):
    from gpumagic.errors import SyncError

    _remote(machine, "rm -rf clash && mkdir -p clash/Data clash/data && printf big > clash/Model.pt && "
                     "printf small > clash/model.pt && echo a > clash/Data/x && echo b > clash/data/x && echo k > clash/keep")
    dst = ntfs[1] / "pull"
    with pytest.raises(SyncError) as e:
        machine.pull(":clash/", f"{dst}/")
    assert "Data and data" in e.value.message and "nothing was written" in e.value.message
    assert "--rename-clashes" in e.value.hint and "1 more" in e.value.message
    assert not dst.exists()
    summary = machine.pull(":clash/", f"{dst}/", rename_clashes=True)
    assert summary.renamed == {"model.pt": "model (2).pt", "data": "data (2)", "data/x": "data (2)/x"}
    got = {p.relative_to(dst).as_posix(): p.read_text(encoding="utf-8") for p in dst.rglob("*") if p.is_file()}
    assert got == {"Model.pt": "big", "model (2).pt": "small", "Data/x": "a\n", "data (2)/x": "b\n", "keep": "k\n"}


def test_push_from_a_case_insensitive_folder_updates_a_txt_and_never_deletes_it(machine, ntfs):
    _remote(machine, "rm -rf ci && mkdir ci && echo old > ci/a.txt && echo keep > ci/Keep.md")
    src = ntfs[1] / "push"
    src.mkdir()
    (src / "A.txt").write_text("new text\n", encoding="utf-8")
    (src / "KEEP.md").write_text("keep\n", encoding="utf-8")
    os.utime(src / "KEEP.md", (0, int(_remote(machine, "stat -c %Y ci/Keep.md"))))
    summary = machine.push(f"{src}/", ":ci/", delete=True)
    assert summary.deleted == [] and summary.files_sent == 1
    assert _remote(machine, "cd ci && ls && cat a.txt") == "Keep.md\na.txt\nnew text\n"
    again = machine.push(f"{src}/", ":ci/", delete=True)
    assert (again.files_sent, again.deleted) == (0, [])


def test_nfc_and_nfd_cafe_are_one_file_never_sent_twice_or_deleted(machine, hfs):
    import unicodedata

    _remote(machine, f"rm -rf nf && mkdir nf && echo menu > nf/{NFC}")
    mtime = int(_remote(machine, f"stat -c %Y nf/{NFC}"))
    here = hfs[1] / "nf"
    here.mkdir()
    (here / NFC).write_text("menu\n", encoding="utf-8")  # stored as NFD, as HFS+ does
    os.utime(here / NFC, (mtime, mtime))
    assert [unicodedata.is_normalized("NFD", n) for n in os.listdir(here)] == [True]
    push = machine.push(f"{here}/", ":nf/", delete=True)
    pull = machine.pull(":nf/", f"{here}/", delete=True)
    assert (push.files_sent, push.deleted, pull.files_sent, pull.deleted) == (0, [], 0, [])
    assert _remote(machine, "ls nf") == f"{NFC}\n" and os.listdir(here) == [NFD]


def test_push_from_windows_keeps_machine_modes_and_picks_new_ones_by_content(machine, ntfs):
    import stat as st

    _remote(machine, "rm -rf modes fresh && mkdir modes && printf '#!/bin/sh\\necho 1\\n' > modes/run.sh && "
                     "chmod 755 modes/run.sh && echo secret > modes/key.txt && chmod 600 modes/key.txt")
    src = ntfs[1] / "modes"
    (src / "sub").mkdir(parents=True)
    (src / "run.sh").write_text("#!/bin/sh\necho changed\n", encoding="utf-8")
    (src / "key.txt").write_text("new secret\n", encoding="utf-8")
    (src / "new.sh").write_text("#!/usr/bin/env python3\nprint(1)\n", encoding="utf-8")
    (src / "notes.txt").write_text("notes\n", encoding="utf-8")
    (src / "sub" / "big.bin").write_bytes(b"#!" + b"x" * (3 << 20))  # a large file: on its own channel
    assert st.S_IMODE(os.stat(src / "run.sh").st_mode) == 0o666  # what Windows reports
    machine.push(f"{src}/", ":modes/")
    machine.push(f"{src}/", ":fresh/")  # into an empty folder: the streaming push
    want = "644 notes.txt\n600 key.txt\n755 new.sh\n755 run.sh\n755 sub\n755 sub/big.bin\n"
    assert _remote(machine, "cd modes && stat -c '%a %n' notes.txt key.txt new.sh run.sh sub sub/big.bin") == want
    assert _remote(machine, "cd fresh && stat -c '%a %n' notes.txt key.txt new.sh run.sh sub sub/big.bin") == \
        want.replace("600 key.txt", "644 key.txt")
    assert _remote(machine, "cat modes/run.sh") == "#!/bin/sh\necho changed\n"


def test_pull_onto_windows_names_the_symlinks_it_cannot_make_in_one_line(machine, ntfs):
    from gpumagic.sync.engine import summary_text

    _remote(machine, "rm -rf ln && mkdir -p ln/ckpt && echo w > ln/ckpt/3.pt && ln -s ckpt/3.pt ln/latest.pt")
    dst = ntfs[1] / "ln"
    summary = machine.pull(":ln/", f"{dst}/")
    assert summary.links_refused == {"latest.pt": "ckpt/3.pt"} and summary.links == 0
    assert (dst / "ckpt" / "3.pt").read_text(encoding="utf-8") == "w\n" and not os.path.lexists(dst / "latest.pt")
    lines = [ln for ln in summary_text(summary).splitlines() if "symlink" in ln]
    assert len(lines) == 1 and "latest.pt -> ckpt/3.pt" in lines[0] and "Developer Mode" in lines[0]

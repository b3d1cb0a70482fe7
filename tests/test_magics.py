"""The IPython layer, driven through a real InteractiveShell."""

import _thread
import threading
import uuid

import pytest
from IPython.core.error import UsageError

from gpumagic.errors import NotConnected, RemoteCommandError
from gpumagic.notebook.magics import SUBCOMMANDS


def test_gpu_alone_and_help_list_every_subcommand(ip, capsys):
    ip.run_line_magic("gpu", "")
    alone = capsys.readouterr().out
    ip.run_line_magic("gpu", "help")
    assert capsys.readouterr().out == alone
    for name in SUBCOMMANDS:
        assert f"%gpu {name}" in alone
    assert "%%remote" in alone


def test_unknown_subcommand_is_a_usage_error_naming_the_valid_ones(ip):
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", "conect mygpu")
    assert type(e.value) is UsageError
    assert "'conect'" in str(e.value) and "connect" in str(e.value) and "disconnect" in str(e.value)


#: ``%gpu LINE`` -> the whole message: the table's name for it, the valid names in table order.
UNKNOWN = {
    "kernel frobnicate": "unknown sub-command 'frobnicate' of %gpu kernel; valid: start, list, attach, push, pull, "
                         "interrupt, restart, stop, autorun, install, uninstall; `%gpu kernel help` says what each "
                         "does",
    "budget sett --rate 1": "unknown sub-command 'sett' of %gpu budget (did you mean set?); valid: set, estimate, "
                            "history, guard, notify, none (the meter); `%gpu budget help` says what each does",
    "tunnel tensorbord": "unknown sub-command 'tensorbord' of %gpu tunnel (did you mean tensorboard?); valid: "
                         "tensorboard, jupyter, list, --reverse, close, PORT; `%gpu tunnel help` says what each does",
    "--host a status": "unknown sub-command '--host' of %gpu; valid: " + ", ".join(SUBCOMMANDS)
                       + "; `%gpu help` says what each does",
}


@pytest.mark.parametrize("line", UNKNOWN)
def test_an_unknown_subcommand_of_any_table_names_the_valid_ones(_ipython, line):
    with pytest.raises(UsageError) as e:
        _ipython.run_line_magic("gpu", line)
    assert type(e.value) is UsageError and str(e.value) == UNKNOWN[line]
    assert str(e.value).startswith("unknown sub-command")


@pytest.mark.parametrize("group", ["kernel", "budget", "tunnel"])
def test_a_group_lists_its_subcommands_for_help_and_help_name_is_name_dash_h(_ipython, capsys, group):
    from gpumagic.notebook.magics import budget, kernel, tunnel

    table = {"kernel": kernel.KERNEL, "budget": budget.BUDGET, "tunnel": tunnel.TUNNEL}[group]
    shown = []
    for line in [f"{group} -h", f"{group} --help", f"{group} help"] + ([] if group == "budget" else [group]):
        assert _ipython.run_line_magic("gpu", line) is None
        shown.append(capsys.readouterr().out)
    assert shown == [table.help_text() + "\n"] * len(shown)
    assert [name for name in table if f"\n  %gpu {group} {name}" not in shown[0]] == []
    first = next(iter(table))
    _ipython.run_line_magic("gpu", f"help {group} {first}")
    via_help = capsys.readouterr().out
    _ipython.run_line_magic("gpu", f"{group} {first} -h")
    assert via_help == capsys.readouterr().out and via_help.startswith(f"usage: %gpu {group} {first}")


@pytest.mark.parametrize("line", ["kernel stop", "kernel list --bogus", "kernel push", "kernel start ../x",
                                  "kernel attach a b", "kernel autorun sideways", "budget --bogus",
                                  "budget set --rate abc", "tunnel close", "tunnel 99999", "tunnel 8000 --local-port x",
                                  "tunnel list extra"])
def test_bad_arguments_of_group_subcommands_are_exactly_usage_error_before_any_connection(_ipython, line):
    _ipython._gpumagic.fleet.close_all()  # refused by the parser, not by NotConnected
    with pytest.raises(UsageError) as e:
        _ipython.run_line_magic("gpu", line)
    assert type(e.value) is UsageError


def test_remote_help_reads_as_one_section_per_mode(_ipython):
    text = _ipython.object_inspect_text("%%remote")  # what `%%remote?` shows
    headings = ["a cell (the default):", "every mode:", "a detached job (--job NAME):",
                "torchrun and fan-out (with --job NAME):", "a live Python session (--kernel [NAME]):"]
    at = [text.index(f"\n{h}\n") for h in headings]
    assert at == sorted(at) and "\noptions:\n" not in text  # every option is in a mode's section

    def section(opt: str) -> str:
        where = text.index(f"\n  {opt} ")
        return max((i, h) for i, h in zip(at, headings) if i < where)[1]

    assert {o: section(o) for o in ("--python", "--timeout", "--host", "--out", "--job", "--then-shutdown",
                                    "--torchrun", "--each", "--same-dir-hash", "--kernel")} == {
        "--python": headings[0], "--timeout": headings[0], "--host": headings[1], "--out": headings[1],
        "--job": headings[2], "--then-shutdown": headings[2], "--torchrun": headings[3], "--each": headings[3],
        "--same-dir-hash": headings[3], "--kernel": headings[4]}


def test_remote_help_shows_real_options(ip):
    doc = ip.find_cell_magic("remote").__doc__
    for opt in ("--python", "--host", "--cwd", "--env", "--timeout", "--no-raise-error", "--out"):
        assert opt in doc


def test_bad_arguments_are_exactly_usage_error(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    for line, cell in [("--timeout soon", "true"), ("--env NOEQUALS", "true"), ("--bogus", "true")]:
        with pytest.raises(UsageError) as e:
            ip.run_cell_magic("remote", line, cell)
        assert type(e.value) is UsageError
    with pytest.raises(UsageError):
        ip.run_line_magic("gpu", "connect")


@pytest.mark.parametrize("line, named", [
    ("--sandbox root@127.0.0.1:39785", "'root@127.0.0.1:39785'"),
    ("--sandbox ssh -p 39785 root@127.0.0.1", "'ssh -p 39785 root@127.0.0.1'"),
    ("--sandbox -p 2222 -l ubuntu", "-p, -l"),
    ("--sandbox --trust-new-host", "--trust-new-host"),
])
def test_sandbox_with_what_only_a_machine_takes_is_one_usage_error_and_starts_nothing(_ipython, line, named):
    """``%gpu connect --sandbox root@127.0.0.1:39785`` ignored the target and connected to a sandbox."""
    _ipython._gpumagic.fleet.close_all()
    with pytest.raises(UsageError) as e:
        _ipython.run_line_magic("gpu", f"connect {line}")
    assert type(e.value) is UsageError
    assert str(e.value) == (f"--sandbox starts a local sshd of its own and takes no {named}: drop --sandbox to "
                            "connect to a machine, or drop the rest to try the sandbox")
    assert _ipython._gpumagic.fleet.machines == {}


def test_remote_cell_streams_and_out_stores_the_result(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_cell_magic("remote", "--out res", "echo to-stdout; echo to-stderr >&2")
    seen = capsys.readouterr()
    assert "to-stdout" in seen.out and "to-stderr" in seen.err
    res = ip.user_ns["res"]
    assert (res.stdout, res.stderr, res.exit_code) == ("to-stdout\n", "to-stderr\n", 0)


def test_python_cell_runs_on_the_remote_python(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_cell_magic("remote", "--python --out r", "import sys\nprint(sys.argv[0], 6 * 7)")
    assert ip.user_ns["r"].stdout == "-c 42\n"


def test_failing_cell_raises_with_exit_code_and_no_raise_error_opts_out(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(RemoteCommandError) as e:
        ip.run_cell_magic("remote", "", "echo bad >&2; exit 4")
    assert e.value.exit_code == 4 and "exited with code 4" in str(e.value)
    assert ip.run_cell_magic("remote", "--no-raise-error --out r", "exit 4") is None
    assert ip.user_ns["r"].exit_code == 4


def test_failed_python_cell_renders_the_remote_error_not_gpumagic_frames(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    result = ip.run_cell("%%remote --python\nraise ValueError('remote boom')")
    assert not result.success
    shown = capsys.readouterr()
    text = shown.out + shown.err
    assert "ValueError: remote boom" in text
    assert "execution.py" not in text and "gpumagic/notebook/magics" not in text


def test_interrupted_cell_reraises_keyboard_interrupt(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    token = "gm" + uuid.uuid4().hex[:12]
    threading.Timer(1.5, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        ip.run_cell_magic("remote", "", f"sleep 60 & wait # {token}")
    ip.run_cell_magic("remote", "--out r", f"pgrep -f '{token[:-1]}[{token[-1]}]' || echo none")
    assert ip.user_ns["r"].stdout == "none\n"


def test_several_machines_last_connected_is_default_and_host_picks(ip, sshd):
    ip.run_line_magic("gpu", "connect testgpu --name one --cwd /tmp")
    ip.run_line_magic("gpu", "connect testgpu --name two --cwd /")
    ip.run_cell_magic("remote", "--out a", "pwd")
    ip.run_cell_magic("remote", "--host one --out b", "pwd")
    assert (ip.user_ns["a"].stdout, ip.user_ns["b"].stdout) == ("/\n", "/tmp\n")
    with pytest.raises(NotConnected) as e:
        ip.run_cell_magic("remote", "--host three", "pwd")
    assert "one, two" in e.value.message


def test_cd_sets_the_directory_and_rejects_missing_ones(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", "cd /usr")
    ip.run_line_magic("gpu", "cd lib")
    ip.run_cell_magic("remote", "--out r", "pwd")
    assert ip.user_ns["r"].stdout == "/usr/lib\n"
    with pytest.raises(RemoteCommandError) as e:
        ip.run_line_magic("gpu", "cd /no/such/place")
    assert "/no/such/place" in e.value.message


def test_hosts_lists_config_aliases_and_connected_machines(ip, capsys, sshd):
    ip.run_line_magic("gpu", "connect testgpu --name work")
    ip.run_line_magic("gpu", "hosts")
    out = capsys.readouterr().out
    assert "testgpu" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("work"))
    assert f"127.0.0.1:{sshd.port}" in line and "connected (default)" in line


def test_disconnect_and_forget(ip, capsys, client_home, sshd):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("gpu", "disconnect")
    assert "disconnected from testgpu" in capsys.readouterr().out
    with pytest.raises(NotConnected):
        ip.run_cell_magic("remote", "", "true")
    kh = client_home / ".ssh" / "known_hosts"
    before = kh.read_text(encoding="utf-8")
    kh.write_text(before + "[203.0.113.10]:41022 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n", encoding="utf-8")
    ip.run_line_magic("gpu", "forget 203.0.113.10:41022")
    assert "removed 1 line(s) for [203.0.113.10]:41022" in capsys.readouterr().out
    assert kh.read_text(encoding="utf-8") == before


def test_connected_magic_unknown_host_prints_fingerprint_and_trust_option(ip, capsys, sshd, client_home):
    kh = client_home / ".ssh" / "known_hosts"
    saved = kh.read_text(encoding="utf-8")
    kh.write_text("", encoding="utf-8")
    try:
        result = ip.run_cell("%gpu connect testgpu")
        text = "".join(capsys.readouterr())
        assert not result.success
        assert "UnknownHostKey" in text and "SHA256:" in text and "--trust-new-host" in text
        assert kh.read_text(encoding="utf-8") == ""
        ip.run_line_magic("gpu", "connect testgpu --trust-new-host")
        assert "trusted new host" in capsys.readouterr().out
        assert f"[127.0.0.1]:{sshd.port} ssh-ed25519" in kh.read_text(encoding="utf-8")
    finally:
        kh.write_text(saved, encoding="utf-8")


def test_quoted_arguments_are_read_like_a_shell_would(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_cell_magic("remote", "", "mkdir -p '/tmp/gm dir'")
    ip.run_cell_magic("remote", "--cwd '/tmp/gm dir' --env 'GREETING=hello there' --env X=a\\ b --out r",
                      'pwd; echo "$GREETING|$X"')
    assert ip.user_ns["r"].stdout == "/tmp/gm dir\nhello there|a b\n"
    with pytest.raises(UsageError) as e:
        ip.run_cell_magic("remote", "--cwd '/tmp/gm dir", "pwd")
    assert type(e.value) is UsageError and "quote" in str(e.value)


def test_out_must_be_a_variable_name(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    for bad in ("1bad", "class", "a-b"):
        with pytest.raises(UsageError) as e:
            ip.run_cell_magic("remote", f"--out {bad}", "true")
        assert "not a Python variable name" in str(e.value)


def test_missing_cwd_is_named_not_an_exit_code(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(RemoteCommandError) as e:
        ip.run_cell_magic("remote", "--cwd /no/such/place", "pwd")
    assert e.value.message == "no directory /no/such/place on testgpu"


def test_no_raise_error_still_says_the_exit_code(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_cell_magic("remote", "--no-raise-error", "exit 3")
    assert "(exit code 3)" in capsys.readouterr().err


def test_interrupt_shows_one_line_not_gpumagic_frames(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    threading.Timer(1.0, _thread.interrupt_main).start()
    result = ip.run_cell("%%remote\nsleep 30")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    shown = "".join(capsys.readouterr())
    assert "KeyboardInterrupt: interrupted; the cell's processes on testgpu were stopped" in shown
    assert "execution.py" not in shown and "Traceback" not in shown


def test_output_neither_shown_nor_asked_for_is_not_kept_in_memory(ip, capsys):
    # Issue 43: 400 MB printed raised the notebook's peak memory to 824 MB, all of it kept for
    # a result nobody asked for.  Without --out only the last 64 KiB of each stream is kept (the
    # failure hint's and the error's); shown here: max_display_bytes.
    import tracemalloc

    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("config", "GpuMagics.max_display_bytes = 1000")
    tracemalloc.start()
    try:
        ip.run_cell_magic("remote", "--python", "import sys\nfor _ in range(480):\n"
                          "    sys.stdout.write('y' * 65535 + '\\n')\nsys.stdout.flush()")  # 30 MiB
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        ip.run_line_magic("config", "GpuMagics.max_display_bytes = 5000000")
    seen = capsys.readouterr()
    assert seen.out.count("y") == 1000
    assert "31,456,280 more characters were not displayed" in seen.err, seen.err
    assert peak < 10 * 2 ** 20, peak  # was over 30 MiB: every character kept


def test_a_failed_cells_hint_reads_the_end_of_a_long_output(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("config", "GpuMagics.max_display_bytes = 1000")
    try:
        with pytest.raises(RemoteCommandError) as e:
            ip.run_cell_magic("remote", "--python", "import sys\nsys.stderr.write('x' * 5000000)\n"
                              "raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')")
    finally:
        ip.run_line_magic("config", "GpuMagics.max_display_bytes = 5000000")
    assert "batch size" in (e.value.hint or "").lower(), e.value.hint
    assert e.value.stderr.endswith("CUDA out of memory. Tried to allocate 2.00 GiB\n")
    assert len(e.value.stderr) == 64 * 1024


def test_huge_output_is_capped_in_the_notebook_but_kept_by_out(ip, capsys):
    ip.run_line_magic("gpu", "connect testgpu")
    ip.run_line_magic("config", "GpuMagics.max_display_bytes = 1000")
    try:
        ip.run_cell_magic("remote", "--python --out big", "import sys; sys.stdout.write('x' * 5000)")
    finally:
        ip.run_line_magic("config", "GpuMagics.max_display_bytes = 5000000")
    seen = capsys.readouterr()
    assert seen.out.count("x") == 1000
    assert "4,000 more characters were not displayed" in seen.err
    assert ip.user_ns["big"].stdout == "x" * 5000


# -- issue 8: every numeric option refuses NaN, +-inf and out-of-range values ----------------


@pytest.mark.parametrize("line, option", [
    ("budget set --limit inf", "--limit"),
    ("budget set --limit nan", "--limit"),
    ("budget set --limit -5", "--limit"),
    ("budget set --rate 1e308", "--rate"),
    ("budget guard --poll nan", "--poll"),
    ("budget estimate --hours nan", "--hours"),
    ("tunnel ²", "port"),
    ("tunnel 8000 --local-port 70000", "--local-port"),
    ("status --watch inf", "--watch"),
    ("logs train -n 1e3", "-n/--lines"),
    ("connect testgpu -p 99999", "-p/--port"),
    ("fit 7B --batch ١٢", "--batch"),
    ("fit 7B --lora 99999999999999999999", "--lora"),
    ("fit 7B --seq nan", "--seq"),
    ("budget notify --backoff nan", "--backoff"),
    ("budget notify --retries -1", "--retries"),
])
def test_numeric_option_refuses_nan_inf_and_out_of_range_naming_the_option(ip, line, option, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("GPUMAGIC_DATA_DIR", str(tmp_path))
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", line)
    assert type(e.value) is UsageError
    assert str(e.value).startswith(f"argument {option}: "), str(e.value)
    assert list(tmp_path.iterdir()) == []  # nothing stored


@pytest.mark.parametrize("value", ["nan", "inf", "1e400"])
def test_then_shutdown_refuses_nan_inf_and_1e400(ip, value):
    with pytest.raises(UsageError) as e:
        ip.run_cell_magic("remote", f"--job j --then-shutdown {value}", "true")
    assert type(e.value) is UsageError
    assert str(e.value).startswith(f"argument --then-shutdown: '{value}' is ")
    assert "minutes, from 0 to 43,200" in str(e.value)


def test_tunnel_close_superscript_two_is_a_usage_error(ip):
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", "tunnel close ²")
    assert type(e.value) is UsageError
    assert str(e.value) == ("`%gpu tunnel close ²`: give an ID from `%gpu tunnel list` (a local port "
                            "number, or R and a port for a reverse tunnel) or `all`")


def test_shared_number_type_accepts_plain_numbers_only():
    import argparse

    from gpumagic.notebook.magics import LOCAL_PORT, MONEY, number

    assert MONEY("2.5") == 2.5 and MONEY("0") == 0.0 and MONEY("1e3") == 1000.0
    assert LOCAL_PORT("0") == 0 and LOCAL_PORT("65535") == 65535
    for bad in ("nan", "NaN", "inf", "-inf", "1e400", "²", "١٢", "1_000", "", " ", "0x10", "-1", "1e10"):
        with pytest.raises(argparse.ArgumentTypeError):
            MONEY(bad)
    for bad in ("1.5", "70000", "-1", "1e3"):
        with pytest.raises(argparse.ArgumentTypeError):
            LOCAL_PORT(bad)
    above = number(0, 10, above=True)
    with pytest.raises(argparse.ArgumentTypeError, match="above 0, at most 10"):
        above("0")


def _all_magic_parsers():
    """Every function with a magic_arguments parser, in every module of the magics package."""
    import importlib
    import pkgutil

    from gpumagic.notebook import magics

    fns = {}
    for info in pkgutil.iter_modules(magics.__path__):
        module = importlib.import_module(f"{magics.__name__}.{info.name}")
        fns.update({f"{info.name}.{name}": fn for name, fn in vars(module).items() if hasattr(fn, "parser")})
    fns["%%remote"] = magics.GpuMagics.remote
    return fns


def test_every_numeric_option_of_every_magic_uses_the_shared_type():
    """The whole kind: no option is parsed with a bare int/float (which take nan and inf)."""
    checked = []
    for name, fn in _all_magic_parsers().items():
        for action in fn.parser._actions:
            if action.type is not None:
                assert getattr(action.type, "__qualname__", "") == "number.<locals>.convert", (
                    name, action.option_strings or action.dest, action.type)
                checked.append(action.dest)
            if isinstance(action.default, (int, float)) and not isinstance(action.default, bool):
                assert action.type is not None, (name, action.dest)
    assert {"limit", "rate", "poll", "hours", "then_shutdown", "port", "local_port", "timeout", "batch", "retries",
            "backoff"} <= set(checked)


@pytest.mark.parametrize("line", ["fit 7B --card H200 --out 1x", "wrapup --out class", "tunnel 8000 --out 1x",
                                  "tunnel jupyter --out 1x"])
def test_every_out_option_refuses_a_name_that_is_not_a_variable(ip, line):
    before = dict(ip.user_ns)
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", line)
    assert type(e.value) is UsageError
    name = line.rsplit(" ", 1)[1]
    assert str(e.value) == f"--out {name!r} is not a Python variable name; e.g. --out result"
    assert ip.user_ns.keys() == before.keys()  # nothing stored


def test_dash_h_of_every_subcommand_prints_help_and_returns_none(ip, capsys):
    for name in SUBCOMMANDS:
        if name in ("budget", "tunnel", "kernel", "proxy", "job", "provider"):  # groups: their -h lists their sub-commands
            continue
        assert ip.run_line_magic("gpu", f"{name} -h") is None
        assert capsys.readouterr().out.startswith(f"usage: %gpu {name}"), name
    for sub in ("set", "estimate", "history", "guard", "notify"):
        assert ip.run_line_magic("gpu", f"budget {sub} -h") is None
        assert capsys.readouterr().out.startswith(f"usage: %gpu budget {sub}"), sub
    for sub in ("on", "off"):
        assert ip.run_line_magic("gpu", f"proxy {sub} -h") is None
        assert capsys.readouterr().out.startswith(f"usage: %gpu proxy {sub}"), sub
    assert ip.run_line_magic("gpu", "tunnel --reverse -h") is None  # as the other tunnel sub-commands
    assert "%gpu tunnel --reverse [--remote-port P]" in capsys.readouterr().out
    assert ip.run_line_magic("gpu", "proxy -h") is None
    assert capsys.readouterr().out.startswith("%gpu proxy: lend this computer's proxy")
    assert ip.run_cell_magic("remote", "--job j -h", "exit 1") is None
    assert capsys.readouterr().out.startswith("usage: %%remote [--python]")  # a cell magic: two %


# -- %reload_ext gpumagic: one of each post-cell hook, never a stale one -----------------------

HOOKS = ("_budget_post_run_cell", "_tunnel_faults_post_run_cell")


def _hooks(ip, prefix):
    return [cb for cb in ip.events.callbacks["post_run_cell"] if getattr(cb, "__qualname__", "").startswith(prefix)]


def test_reload_ext_leaves_one_of_each_hook_and_a_stale_one_never_runs(ip, monkeypatch):
    import sys

    old = {p: _hooks(ip, p) for p in HOOKS}
    assert [len(v) for v in old.values()] == [1, 1]
    old_magics = ip._gpumagic
    ip.run_line_magic("reload_ext", "gpumagic")
    ip.run_line_magic("reload_ext", "gpumagic")
    new = {p: _hooks(ip, p) for p in HOOKS}
    assert [len(v) for v in new.values()] == [1, 1]
    assert ip._gpumagic is not old_magics and old_magics.closed
    # what each hook calls, recorded: once per cell, for the loaded extension only
    seen = []
    budget_hook, tunnel_hook = new[HOOKS[0]][0], new[HOOKS[1]][0]
    monkeypatch.setattr(sys.modules[budget_hook.__module__], "budget_alert_hook",
                        lambda magics, **kw: seen.append(("budget", magics)) or [])
    monkeypatch.setattr(sys.modules[tunnel_hook.__module__], "_all_tunnels",
                        lambda fleet: seen.append(("tunnel", fleet)) or [])
    ip.run_cell("1 + 1")
    assert seen == [("budget", ip._gpumagic), ("tunnel", ip._gpumagic.fleet)]
    seen.clear()
    old[HOOKS[0]][0]()  # a stale hook someone kept does nothing
    old[HOOKS[1]][0]()
    assert seen == []


def test_unload_ext_removes_the_hooks_and_closes_the_machines(ip):
    ip.run_line_magic("gpu", "connect testgpu")
    m = ip._gpumagic.fleet.get()
    try:
        ip.run_line_magic("unload_ext", "gpumagic")
        assert [len(_hooks(ip, p)) for p in HOOKS] == [0, 0]
        assert not m.is_connected
    finally:
        ip.run_line_magic("load_ext", "gpumagic")
    assert [len(_hooks(ip, p)) for p in HOOKS] == [1, 1]
    ip.run_line_magic("gpu", "connect testgpu")
    assert ip.run_cell_magic("remote", "--out r", "echo back") is None and ip.user_ns["r"].stdout == "back\n"


@pytest.mark.parametrize("line, value", [
    ('--job r1 --keep ckpt/ --resume-arg "--resume={checkpoint}"', "--resume={checkpoint}"),
    ('--job r1 --keep ckpt/ --resume-arg --resume', "--resume"),
    ('--job r1 --keep ckpt/ --resume-arg "--resume {checkpoint}"', "--resume {checkpoint}"),
    ('--job r1 --keep ckpt/ --resume-arg="--resume={checkpoint}"', "--resume={checkpoint}"),
])
def test_an_option_value_that_starts_with_a_dash_is_the_options_value(line, value):
    # a user's trial: argparse read "--resume={checkpoint}" as an option ("expected one argument")
    from gpumagic.notebook.magics import GpuMagics
    from gpumagic.notebook.magics._args import parse

    args = parse(GpuMagics.remote, line, cell=True)
    assert args.resume_arg == value and args.job == "r1" and args.keep == "ckpt/"


def test_an_option_missing_its_value_before_another_option_is_still_an_error():
    from gpumagic.notebook.magics import GpuMagics
    from gpumagic.notebook.magics._args import parse

    with pytest.raises(UsageError, match="--cwd: expected one argument"):
        parse(GpuMagics.remote, "--cwd --job r1", cell=True)

"""``%gpu mirrors pip|hf|conda [NAME]`` and ``off`` (``machine.mirrors``) against a machine of
its own (sshd, HOME): the change is shown, seen by the tools that read it (pip's own
``pip config``, ``huggingface_hub`` imported in a live session, conda's YAML), and undone.
Nothing is downloaded: setting a mirror only writes configuration."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest
import yaml

from conftest import add_client_entry, make_server
from gpumagic.errors import ConfigError
from gpumagic.net import catalog


@pytest.fixture(scope="module")
def mirrored():
    server = make_server("mirrored")
    add_client_entry(server, "mirrored")
    yield server
    server.stop()


@pytest.fixture
def m(mirrored):
    import gpumagic

    machine = gpumagic.connect("mirrored")
    yield machine
    machine.close()


def pip_index(machine, user_only=False) -> str:
    r = machine.run(f"python3 -m pip --disable-pip-version-check config {'--user ' if user_only else ''}"
                    "get global.index-url", quiet=True)
    return r.stdout.strip() if r.exit_code == 0 else "(not set)"


def test_every_mirror_in_the_data_file_names_its_source_and_ships_with_the_package():
    data = json.loads((resources.files("gpumagic.net") / "mirrors.json").read_text(encoding="utf-8"))
    assert set(data["mirrors"]) == set(catalog.KINDS)
    for m in catalog.mirrors():
        assert m.url.startswith("https://") and m.source.startswith("https://"), m
    assert "net/mirrors.json" in open("pyproject.toml", encoding="utf-8").read()
    with pytest.raises(ConfigError) as e:
        catalog.mirror("pip", "nosuch")
    assert str(e.value).splitlines()[0] == "no pip mirror named 'nosuch'"
    assert e.value.hint.startswith("use one of: tuna, aliyun")


def test_pip_mirror_is_set_per_user_shown_and_off_puts_back_what_was_there(m, mirrored):
    conf = mirrored.dir / "home" / ".config" / "pip" / "pip.conf"
    change = m.net.mirrors("pip", "tuna")
    assert change.before == "(not set)" and change.after == "https://pypi.tuna.tsinghua.edu.cn/simple"
    assert pip_index(m) == "https://pypi.tuna.tsinghua.edu.cn/simple"  # pip itself agrees
    assert change.file == str(conf) and change.text.splitlines()[-1] == "  undo: `%gpu mirrors pip off`"
    undo = m.net.mirrors_off("pip")
    assert undo.before == "https://pypi.tuna.tsinghua.edu.cn/simple" and undo.after == "(not set)"

    # a value of the user's own comes back after off
    conf.write_text("[global]\nindex-url = https://pypi.example.org/simple\n", encoding="utf-8")
    assert m.net.mirrors("pip", "aliyun").before == "https://pypi.example.org/simple"
    assert m.net.mirrors_off("pip").after == "https://pypi.example.org/simple"
    assert pip_index(m, user_only=True) == "https://pypi.example.org/simple"
    conf.unlink()


def test_hf_mirror_is_seen_by_huggingface_hub_in_a_session_started_after_it_and_off_removes_it(m):
    change = m.net.mirrors("hf")
    assert change.after == "https://hf-mirror.com" and "`%gpu kernel stop NAME`" in change.note
    assert m.run("echo $HF_ENDPOINT", quiet=True).stdout == "https://hf-mirror.com\n"
    k = m.kernel("hf")
    try:
        out = k.execute("from huggingface_hub import constants; print(constants.ENDPOINT)", output=None)
        assert out.stdout.strip() == "https://hf-mirror.com"
        m.net.mirrors_off("hf")
        assert m.run("echo \"[$HF_ENDPOINT]\"", quiet=True).stdout == "[]\n"
        k.stop()
        k = m.kernel("hf")  # a session started after off
        out = k.execute("from huggingface_hub import constants; print(constants.ENDPOINT)", output=None)
        assert out.stdout.strip() == "https://huggingface.co"
    finally:
        k.stop()


def test_conda_mirror_writes_condarc_that_yaml_reads_and_off_restores_the_file(m, mirrored):
    rc = mirrored.dir / "home" / ".condarc"
    original = "channels:\n  - defaults\ndefault_channels:\n  - https://repo.example.org/pkgs/main\nssl_verify: true\n"
    rc.write_text(original, encoding="utf-8")
    change = m.net.mirrors("conda", "tuna")
    data = yaml.safe_load(rc.read_text(encoding="utf-8"))
    assert data["channel_alias"] == "https://mirrors.tuna.tsinghua.edu.cn/anaconda/cloud"
    assert data["default_channels"] == ["https://mirrors.tuna.tsinghua.edu.cn/anaconda/pkgs/main",
                                        "https://mirrors.tuna.tsinghua.edu.cn/anaconda/pkgs/r"]
    assert data["channels"] == ["defaults"] and data["ssl_verify"] is True
    assert change.before == "https://repo.example.org/pkgs/main"
    m.net.mirrors_off("conda")
    assert yaml.safe_load(rc.read_text(encoding="utf-8")) == yaml.safe_load(original)
    rc.unlink()
    m.net.mirrors("conda")
    m.net.mirrors_off("conda")
    assert not rc.exists()  # there was none before


def test_gpu_mirrors_magic_shows_the_change_lists_and_refuses_bad_names(ip, mirrored, capsys):
    from IPython.core.error import UsageError

    ip.run_line_magic("gpu", "connect mirrored")
    capsys.readouterr()
    ip.run_line_magic("gpu", "mirrors pip")
    out = capsys.readouterr().out
    assert re.match(r"pip mirror tuna \(Tsinghua University TUNA; source https://mirrors\.tuna\.tsinghua\.edu\.cn/"
                    r"help/pypi/\):\n  pip's global\.index-url: \(not set\) -> https://pypi\.tuna\.tsinghua\.edu\.cn/"
                    r"simple   \(.*pip\.conf on the machine\)\n  undo: `%gpu mirrors pip off`\n$", out), out
    ip.run_line_magic("gpu", "mirrors")
    out = capsys.readouterr().out
    assert "in use: https://pypi.tuna.tsinghua.edu.cn/simple" in out and "known: tuna, aliyun" in out
    ip.run_line_magic("gpu", "mirrors off")
    out = capsys.readouterr().out
    assert "pip mirror off:" in out and "-> (not set)" in out
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", "mirrors pip nosuch")
    assert str(e.value).startswith("no pip mirror named 'nosuch'; use one of: tuna")
    with pytest.raises(UsageError):
        ip.run_line_magic("gpu", "mirrors npm")

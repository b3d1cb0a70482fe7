"""Tunnel links where the notebook server is not on the user's computer (issue 17 case 3)."""

from types import SimpleNamespace

import pytest

from gpumagic.errors import ConfigError
from gpumagic.notebook import display, links

LOCAL_SERVER = {"hostname": "localhost", "base_url": "/", "pid": 1}
TB = "http://127.0.0.1:6006/"


@pytest.mark.parametrize("env, server, expected", [
    ({}, LOCAL_SERVER, TB),                                                 # a laptop
    ({}, None, TB),                                                         # no server found
    ({"JUPYTERHUB_SERVICE_PREFIX": "/user/jovyan/"}, LOCAL_SERVER, "/user/jovyan/proxy/6006/"),
    ({"JUPYTERHUB_SERVICE_PREFIX": "/user/ab-cd-1x2y/", "BINDER_LAUNCH_HOST": "https://mybinder.org/"},
     LOCAL_SERVER, "/user/ab-cd-1x2y/proxy/6006/"),                         # Binder
    ({"BINDER_REPO_URL": "https://github.com/x/y"}, LOCAL_SERVER, "/proxy/6006/"),
    ({}, {"hostname": "0.0.0.0", "base_url": "/lab-a/", "pid": 1}, "/lab-a/proxy/6006/"),  # a lab server
    ({}, {"ip": "gpu-lab.example.edu", "base_url": "/", "pid": 1}, "/proxy/6006/"),
    ({"GPUMAGIC_LINKS": "local", "JUPYTERHUB_SERVICE_PREFIX": "/user/jovyan/"}, LOCAL_SERVER, TB),
    ({"GPUMAGIC_LINKS": "proxy"}, LOCAL_SERVER, "/proxy/6006/"),            # the override
    ({"GPUMAGIC_LINKS": "PROXY "}, {"hostname": "127.0.0.1", "base_url": "/nb"}, "/nb/proxy/6006/"),
])
def test_browser_url_goes_through_the_server_proxy_where_the_server_is_elsewhere(env, server, expected):
    assert links.browser_url(TB, env, server) == expected


def test_the_path_and_query_follow_the_proxy_prefix():
    env = {"JUPYTERHUB_SERVICE_PREFIX": "/user/jovyan/"}
    assert links.browser_url("http://127.0.0.1:8888/lab?token=x", env, {}) == "/user/jovyan/proxy/8888/lab?token=x"


def test_a_bad_override_is_a_one_line_error_naming_the_choices():
    with pytest.raises(ConfigError, match="GPUMAGIC_LINKS='sometimes' is not a link mode") as e:
        links.browser_url(TB, {"GPUMAGIC_LINKS": "sometimes"}, {})
    assert "auto (the default), local" in e.value.hint


def test_the_tunnel_message_and_the_tensorboard_iframe_follow_the_rule(monkeypatch):
    t = SimpleNamespace(name="TensorBoard", target="localhost:6006", url=TB, local_port=6006)
    monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", "/user/jovyan/")
    monkeypatch.delenv("GPUMAGIC_LINKS", raising=False)
    r = display.tunnel_opened(t, "m", inline=True)
    assert "<a href='/user/jovyan/proxy/6006/'" in r.html
    assert "<iframe src='/user/jovyan/proxy/6006/'" in r.html and "127.0.0.1" not in r.html
    assert r.text.startswith("TensorBoard on m (localhost:6006) -> /user/jovyan/proxy/6006/ "
                             "(through the notebook server's proxy; http://127.0.0.1:6006/ on the server)")
    monkeypatch.setenv("GPUMAGIC_LINKS", "local")
    r = display.tunnel_opened(t, "m", inline=True)
    assert "<iframe src='http://127.0.0.1:6006/'" in r.html


def test_binder_installs_tensorboard_and_the_server_proxy():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    reqs = (root / "binder" / "requirements.txt").read_text(encoding="utf-8").split()
    assert ".[tutorials]" in reqs and "jupyter-server-proxy" in reqs
    tutorials = next(ln for ln in (root / "pyproject.toml").read_text(encoding="utf-8").splitlines()
                     if ln.startswith("tutorials = ["))
    assert '"tensorboard>=' in tutorials  # through the extra the quickstart installs too

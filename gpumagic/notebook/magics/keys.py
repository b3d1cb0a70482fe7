"""First-time set-up: ``%gpu keygen``, ``add-host`` and ``install-key``."""

from __future__ import annotations

import getpass
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display as ipy_display

from ... import keys as setup
from .. import widgets
from ._args import PORT, number, parse
from .connect import _print_add_host, split_pasted_ssh

if TYPE_CHECKING:
    from . import GpuMagics


def _ask_new_passphrase() -> str:
    first = getpass.getpass("Passphrase for the new key: ")
    if not first:
        raise UsageError("empty passphrase: leave out --passphrase for a key without one")
    if getpass.getpass("Same passphrase again: ") != first:
        raise UsageError("the two passphrases differ; run keygen again")
    return first


@magic_arguments()
@argument("--path", metavar="FILE", help="private key file (default ~/.ssh/id_ed25519; FILE.pub gets the public key)")
@argument("--comment", metavar="TEXT", help="comment at the end of the public key (default user@host)")
@argument("--passphrase", action="store_true", help="encrypt the private key; asks for the passphrase (not echoed)")
def _keygen(magics: GpuMagics, line: str):
    args = parse(_keygen, line, "keygen")
    passphrase = _ask_new_passphrase() if args.passphrase else None
    pair = setup.keygen(args.path, comment=args.comment, passphrase=passphrase)
    show_public_key(pair, magics.shell)


@magic_arguments()
@argument("name", help="the alias: then `ssh NAME`, VS Code Remote-SSH and `%%gpu connect NAME` work")
@argument("--hostname", required=True, metavar="H", help="address or DNS name of the machine")
@argument("-p", "--port", type=PORT, help="SSH port")
@argument("-l", "--user", help="login user")
@argument("-i", "--key", metavar="FILE", help="private key file (IdentityFile)")
@argument("-J", "--jump", metavar="JUMP", help="ProxyJump host(s), comma-separated")
@argument("--alive-interval", type=number(0, 86400, integer=True, what="seconds"), default=30, metavar="S",
          help="ServerAliveInterval in seconds (default 30; 0 leaves it out)")
@argument("--alive-count", type=number(0, 1000, integer=True, what="a count"), default=3, metavar="N", help="ServerAliveCountMax (default 3)")
@argument("--replace", action="store_true", help="replace an existing Host NAME block (shows the old one)")
def _add_host(magics: GpuMagics, line: str):
    args = parse(_add_host, line, "add-host")
    interval = args.alive_interval or None
    result = setup.add_host(args.name, args.hostname, port=args.port, user=args.user, key=args.key,
                            jump=args.jump, server_alive_interval=interval,
                            server_alive_count_max=args.alive_count if interval else None,
                            replace=args.replace)
    _print_add_host(result)


@magic_arguments()
@argument("target", nargs="?", help="[user@]host[:port], a ~/.ssh/config alias, or the platform's ssh line")
@argument("-i", "--key", metavar="FILE", help="private key whose .pub to install (default: the host's IdentityFile or ~/.ssh/id_ed25519)")
@argument("-p", "--port", type=PORT, help="SSH port")
@argument("-l", "--user", help="login user")
@argument("-J", "--jump", metavar="JUMP", help="ProxyJump host(s)")
@argument("--trust-new-host", action="store_true", help="add an unknown host key to known_hosts (never a changed one)")
def _install_key(magics: GpuMagics, line: str):
    pasted, line = split_pasted_ssh(line, with_value=("--key",))
    args = parse(_install_key, line, "install-key")
    args.target = pasted or args.target
    if not args.target:
        raise UsageError("name the machine: `%gpu install-key root@203.0.113.10:41022` "
                         "or paste its ssh line after install-key")
    r = setup.install_key(args.target, key=args.key, port=args.port, user=args.user, jump=args.jump,
                          trust_new_host=args.trust_new_host, password_prompt=getpass.getpass)
    where = f"{r.spec.user}@{r.spec.address}"
    if r.state == "added":
        print(f"added key {r.fingerprint} to ~/.ssh/authorized_keys on {where}")
    else:
        print(f"key {r.fingerprint} was already in ~/.ssh/authorized_keys on {where}; nothing added")
    print(f"key login to {where} works" + ("" if r.used_password else " (no password was needed)"))


def show_public_key(pair: "setup.KeyPair", shell=None) -> None:
    """Show the key: the widget plus its text fallback in a kernel, plain text otherwise."""
    text = setup.public_key_text(pair)
    in_kernel = shell is not None and getattr(shell, "kernel", None) is not None
    view = widgets.public_key_widget(pair) if in_kernel else None
    if view is None:
        print(text)
        return
    ipy_display({"text/plain": text, "text/html": widgets.public_key_html(pair),
                 "application/vnd.jupyter.widget-view+json": {
                     "version_major": 2, "version_minor": 0, "model_id": view.model_id}}, raw=True)

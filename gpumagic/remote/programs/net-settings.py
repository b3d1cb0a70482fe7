# net-settings.py COMMAND ARGS...: read and change the machine's network settings for
# gpumagic/net/ (`%gpu proxy`, `%gpu mirrors`).  Runs under the user's own python3 (a cell's
# environment), so `python -m pip` is the pip the user's cells run.  Prints one JSON object.
#
#   read                      pip's index URLs, ~/.condarc's URLs, ~/.gpumagic/env, the login
#                             shell, whether /etc/network_turbo (AutoDL's accelerator) exists
#   env-set NAME VALUE        set NAME in ~/.gpumagic/env (what gpumagic adds to every cell,
#   env-unset NAME            session and job: HF_ENDPOINT); prints before/after
#   pip-set URL | pip-off     global.index-url per user with `pip config --user` (the per-user
#                             pip.conf where pip has no `config`); off restores what was there
#   conda-set BASE | conda-off   default_channels and channel_alias in ~/.condarc (a marked
#                             block; the keys it replaces are kept and put back by off)
#   block-set NAME=VALUE...   the proxy's variables as a marked block in the login shell's
#   block-remove              start-up file; remove takes it out of every such file
#
# Every file is written whole to a temporary name and renamed over the old one (its mode
# kept; a symlinked dotfile is written where the link points).  What each change replaced is
# kept in ~/.gpumagic/net-state.json, so that off puts back what was there.
import configparser
import json
import os
import re
import subprocess
import sys
import tempfile

HOME = os.path.expanduser("~")
GM = os.path.join(HOME, ".gpumagic")
ENV_FILE = os.path.join(GM, "env")
STATE_FILE = os.path.join(GM, "net-state.json")
CONDARC = os.path.join(HOME, ".condarc")
PROXY_BEGIN = "# >>> gpumagic proxy >>> (`%gpu proxy on --persist`; `%gpu proxy off` removes it)"
PROXY_END = "# <<< gpumagic proxy <<<"
CONDA_BEGIN = "# >>> gpumagic mirrors >>> (`%gpu mirrors conda off` removes it)"
CONDA_END = "# <<< gpumagic mirrors <<<"
CONDA_KEYS = ("channel_alias", "default_channels")


def read_text(path):
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_text(path, text, mode=0o600):
    """Write ``text`` to ``path`` atomically, keeping an existing file's mode."""
    path = os.path.realpath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".gpumagic-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def load_state():
    try:
        return json.loads(read_text(STATE_FILE) or "{}")
    except ValueError:
        return {}


def save_state(state):
    write_text(STATE_FILE, json.dumps(state, indent=1, sort_keys=True) + "\n")


# -- ~/.gpumagic/env -------------------------------------------------------------------------

def env_entries():
    out = {}
    for line in (read_text(ENV_FILE) or "").splitlines():
        k, sep, v = line.partition("=")
        if sep and k.strip():
            out[k.strip()] = v
    return out


def env_write(entries):
    write_text(ENV_FILE, "".join(f"{k}={v}\n" for k, v in entries.items()))


def cmd_env_set(name, value):
    entries = env_entries()
    before = entries.get(name)
    entries[name] = value
    env_write(entries)
    return {"before": before, "after": value, "file": ENV_FILE}


def cmd_env_unset(name):
    entries = env_entries()
    before = entries.pop(name, None)
    env_write(entries)
    return {"before": before, "after": None, "file": ENV_FILE}


# -- pip ---------------------------------------------------------------------------------------

def pip(*args):
    """(exit status, stdout, stderr) of ``python -m pip ARGS`` with this python."""
    r = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                       capture_output=True, text=True, encoding="utf-8", errors="replace")
    return r.returncode, r.stdout.strip(), r.stderr.strip()


def user_pip_conf():
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(HOME, ".config")
    return os.path.join(base, "pip", "pip.conf")


def pip_view():
    """(pip has `config`, the per-user global.index-url, the one in effect): one run of
    `pip config debug`, which lists every file pip reads, in its order (global, user, site,
    PIP_CONFIG_FILE), with its values, and the PIP_ variables, which win."""
    status, out, _ = pip("config", "debug")
    if status != 0:
        value = conf_get(user_pip_conf())
        return False, value, value
    variant, user, effective, env_value = "", None, None, None
    for line in out.splitlines():
        if not line.startswith(" "):
            variant = line.rstrip(":")
            continue
        body = line.strip()
        if variant == "env_var" and body.startswith("PIP_INDEX_URL="):
            env_value = body.split("=", 1)[1].strip("'\"")
            continue
        if body.startswith("global.index-url:"):
            value = body.split(":", 1)[1].strip()
            effective = value
            if variant == "user":
                user = value
    return True, user, env_value or effective


def pip_get(user_only=False):
    """global.index-url as pip sees it (``user_only``: the per-user files alone); None unset."""
    _, user, effective = pip_view()
    return user if user_only else effective


def conf_get(path):
    c = configparser.RawConfigParser()
    c.read([path] if path else [], encoding="utf-8")
    return c.get("global", "index-url", fallback=None)


def conf_set(path, value):
    c = configparser.RawConfigParser()
    c.read([path], encoding="utf-8")
    if value is None:
        if c.has_section("global"):
            c.remove_option("global", "index-url")
    else:
        if not c.has_section("global"):
            c.add_section("global")
        c.set("global", "index-url", value)
    import io
    buf = io.StringIO()
    c.write(buf)
    write_text(path, buf.getvalue(), 0o644)


def pip_set_user(value, has_config):
    """Set (None: unset) the per-user global.index-url; the file written."""
    if has_config:
        if value is None:
            status, out, err = pip("config", "--user", "unset", "global.index-url")
        else:
            status, out, err = pip("config", "--user", "set", "global.index-url", value)
        if status != 0 and value is not None:
            raise SystemExit(fail(f"pip config failed: {err or out}"))
        where = out.replace("Writing to ", "").strip() if out.startswith("Writing to") else user_pip_conf()
        return where
    conf_set(user_pip_conf(), value)
    return user_pip_conf()


def cmd_pip_set(url):
    state = load_state()
    has_config, user, before = pip_view()
    if "pip" not in state:  # the first change keeps what was there before gpumagic
        state["pip"] = {"user_before": user}
    where = pip_set_user(url, has_config)
    state["pip"]["set"] = url
    save_state(state)
    return {"before": before, "after": pip_view()[2], "file": where, "pip_config": has_config}


def cmd_pip_off():
    state = load_state()
    mine = state.pop("pip", None)
    has_config, user, before = pip_view()
    note = ""
    where = user_pip_conf()
    if mine is None:
        note = "gpumagic had not set a pip mirror on this machine"
    elif user != mine.get("set"):
        note = "the per-user index-url was changed since gpumagic set it: left as it is"
    else:
        where = pip_set_user(mine.get("user_before"), has_config)
    save_state(state)
    return {"before": before, "after": pip_view()[2] if mine else before, "file": where, "note": note}


# -- conda -------------------------------------------------------------------------------------

def split_block(text, begin, end):
    """(text without the marked block, the block's lines or None)."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if ln.rstrip("\n") == begin]
    if not starts:
        return text, None
    i = starts[0]
    j = next((k for k in range(i, len(lines)) if lines[k].rstrip("\n") == end), len(lines) - 1)
    return "".join(lines[:i] + lines[j + 1:]), lines[i + 1:j]


def take_top_level_keys(text, keys):
    """(text without the top-level YAML keys ``keys`` and their lines, those lines)."""
    kept, taken, taking = [], [], False
    for ln in text.splitlines(keepends=True):
        if ln[:1] in (" ", "\t", "-"):  # an indented line or a list item: the key above's
            (taken if taking else kept).append(ln)
            continue
        body = ln.strip()
        if body and not body.startswith("#"):
            taking = body.split(":", 1)[0].strip() in keys
            (taken if taking else kept).append(ln)
        else:
            kept.append(ln)
    return "".join(kept), "".join(taken)


def conda_urls(text):
    return re.findall(r"https?://[^\s'\"]+", text or "")


def cmd_conda_set(base):
    state = load_state()
    old = read_text(CONDARC)
    text, _ = split_block(old or "", CONDA_BEGIN, CONDA_END)
    text, taken = take_top_level_keys(text, CONDA_KEYS)
    if "conda" not in state:
        state["conda"] = {"existed": old is not None, "taken": taken}
    base = base.rstrip("/")
    block = (f"{CONDA_BEGIN}\nchannel_alias: {base}/cloud\ndefault_channels:\n"
             f"  - {base}/pkgs/main\n  - {base}/pkgs/r\n{CONDA_END}\n")
    new = (text if not text or text.endswith("\n") else text + "\n") + block
    write_text(CONDARC, new, 0o644)
    state["conda"]["written"] = new
    save_state(state)
    return {"before": conda_urls(old), "after": conda_urls(new), "file": CONDARC}


def cmd_conda_off():
    state = load_state()
    mine = state.pop("conda", None)
    old = read_text(CONDARC)
    note = ""
    if mine is None and (old is None or CONDA_BEGIN not in old):
        note = "gpumagic had not set a conda mirror on this machine"
    elif old is not None:
        text, _ = split_block(old, CONDA_BEGIN, CONDA_END)
        taken = (mine or {}).get("taken", "")
        text = text + (taken if not text or text.endswith("\n") else "\n" + taken)
        if mine is not None and not mine.get("existed") and not text.strip():
            os.unlink(os.path.realpath(CONDARC))
        else:
            write_text(CONDARC, text, 0o644)
    save_state(state)
    return {"before": conda_urls(old), "after": conda_urls(read_text(CONDARC)), "file": CONDARC, "note": note}


# -- the proxy's block in the login shell's start-up file --------------------------------------

def shell_files():
    """(the start-up file of the login shell, its syntax), and every file a block may be in."""
    shell = os.path.basename(os.environ.get("SHELL", "") or "sh")
    fish = os.path.join(os.environ.get("XDG_CONFIG_HOME") or os.path.join(HOME, ".config"),
                        "fish", "conf.d", "gpumagic-proxy.fish")
    table = {"bash": (os.path.join(HOME, ".bashrc"), "sh"), "zsh": (os.path.join(HOME, ".zshrc"), "sh"),
             "fish": (fish, "fish"), "tcsh": (os.path.join(HOME, ".tcshrc"), "csh"),
             "csh": (os.path.join(HOME, ".cshrc"), "csh")}
    mine = table.get(shell, (os.path.join(HOME, ".profile"), "sh"))
    every = [p for p, _ in table.values()] + [os.path.join(HOME, ".profile")]
    return mine, every


def quote(value, syntax):
    if syntax == "fish":
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return "'" + value.replace("'", "'\\''") + "'"


def cmd_block_set(*pairs):
    (path, syntax), _ = shell_files()
    lines = []
    for pair in pairs:
        k, _, v = pair.partition("=")
        if syntax == "fish":
            lines.append(f"set -gx {k} {quote(v, syntax)}")
        elif syntax == "csh":
            lines.append(f"setenv {k} {quote(v, syntax)}")
        else:
            lines.append(f"export {k}={quote(v, syntax)}")
    old = read_text(path) or ""
    text, _ = split_block(old, PROXY_BEGIN, PROXY_END)
    text = text if not text or text.endswith("\n") else text + "\n"
    write_text(path, text + PROXY_BEGIN + "\n" + "\n".join(lines) + "\n" + PROXY_END + "\n", 0o644)
    return {"file": path}


def cmd_block_remove():
    _, every = shell_files()
    removed = []
    for path in dict.fromkeys(every):
        old = read_text(path)
        if old is None or PROXY_BEGIN not in old:
            continue
        text, _ = split_block(old, PROXY_BEGIN, PROXY_END)
        if path.endswith("gpumagic-proxy.fish") and not text.strip():
            os.unlink(os.path.realpath(path))
        else:
            write_text(path, text, 0o644)
        removed.append(path)
    return {"removed": removed}


# -- read ----------------------------------------------------------------------------------------

def pip_urls():
    """index-url and extra-index-url from pip's files (global, user, site) and environment."""
    files = ["/etc/pip.conf", "/etc/xdg/pip/pip.conf", os.path.join(HOME, ".pip", "pip.conf"),
             user_pip_conf(), os.path.join(sys.prefix, "pip.conf")]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(os.environ["PIP_CONFIG_FILE"])
    c = configparser.RawConfigParser(strict=False)
    try:
        c.read(files, encoding="utf-8")
    except configparser.Error:
        pass
    urls = []
    for section in ("global", "install", "download"):
        for key in ("index-url", "extra-index-url"):
            urls += c.get(section, key, fallback="").split()
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        urls += os.environ.get(var, "").split()
    index = os.environ.get("PIP_INDEX_URL") or c.get("global", "index-url", fallback=None)
    return index, list(dict.fromkeys(urls))


def cmd_read():
    index, urls = pip_urls()
    return {"pip_index": index, "pip_urls": urls, "conda_urls": conda_urls(read_text(CONDARC)),
            "env": env_entries(), "turbo": os.path.exists("/etc/network_turbo"),
            "state": sorted(load_state())}


def fail(message):
    print(json.dumps({"error": message}))
    return 1


COMMANDS = {"read": cmd_read, "env-set": cmd_env_set, "env-unset": cmd_env_unset,
            "pip-set": cmd_pip_set, "pip-off": cmd_pip_off, "conda-set": cmd_conda_set,
            "conda-off": cmd_conda_off, "block-set": cmd_block_set, "block-remove": cmd_block_remove}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        raise SystemExit(fail(f"usage: net-settings.py {'|'.join(COMMANDS)} ARGS"))
    try:
        print(json.dumps(COMMANDS[sys.argv[1]](*sys.argv[2:])))
    except OSError as e:
        raise SystemExit(fail(f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")))

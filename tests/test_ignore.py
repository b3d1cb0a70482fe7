""".gitignore / .gpuignore read as git reads them, with git itself as the judge.

A corpus of ignore files (BOM, CRLF, trailing spaces, escapes, negation, directory-only
rules, nested files, anchoring, bad patterns) and of paths is laid out in a real directory,
``git init``-ed; what ``git ls-files --others --exclude-standard`` and ``git check-ignore``
say is what gpumagic must do: the local walk (push), the remote listing (pull) and real
transfers over sshd.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpumagic.sync import plan as sync_plan
from gpumagic.errors import ConfigError, GpumagicError
from gpumagic.sync.ignore import IgnoreRules

BOM = b"\xef\xbb\xbf"

#: Ignore files of the corpus: path -> bytes, exactly as saved (CRLF, BOM and all).
GITIGNORE = {
    ".gitignore": BOM + b"\r\n".join([
        b"secrets.env",            # first line, after the BOM (the case)
        b"*.log",
        b"!important.log",
        b"build/",                 # directory only: the file "build" elsewhere is kept
        b"/root_only.txt",         # anchored to this directory
        b"docs/*.md",              # a slash in the middle anchors too
        b"**/cache/",
        b"a/**/z.txt",
        b"trailing.txt   ",        # unescaped trailing spaces are stripped
        b"space\\ ",               # "\ " keeps one: matches "space "
        b"two\\  \\  ",            # "two  " + escaped space: "two   "
        b"\\#hash.txt",            # escaped '#': a pattern, not a comment
        b"#comment.txt",           # a comment
        b"\\!bang.txt",            # escaped '!': a literal name
        b"[abc]x.dat",
        b"[!q]y.dat",
        b"tab.txt\t",              # git strips spaces only: this names "tab.txt<TAB>"
        b"\\",                     # a bad pattern: git ignores the line
        b"[unclosed",              # never matches in git
        b"*.tmp",
        b"!keep/*.tmp",
        b"nested/deep/",
        b"  lead.txt",             # leading spaces are part of the name
        b"star\\*.txt",            # escaped '*': literal
        b"q?.bin",
        b"*.pyc",
        b"dironly/",
        b"",
    ]) + b"\r\n",
    "sub/.gitignore": b"\n".join([
        b"!*.log",                 # deeper file wins: logs under sub/ are kept
        b"local.txt",
        b"/anchored.txt",          # relative to sub/
        b"deep/",
        b"!cache/",                # cannot re-include: **/cache/ above still applies? (git decides)
        b"x/y",                    # anchored to sub/
    ]),                            # no final newline
    "sub/inner/.gitignore": BOM + b"*.csv\n!keep.csv\n",
    "keep/.gitignore": b"\\!*\n",
}

#: Files of the corpus (directories follow from them).
FILES = [
    "secrets.env", "sub/secrets.env", "train.py", "run.log", "important.log", "sub/run.log",
    "sub/inner/run.log", "build/out.o", "src/build", "src/build.py", "root_only.txt",
    "sub/root_only.txt", "docs/a.md", "docs/deep/b.md", "sub/docs/c.md", "cache/c.bin",
    "sub/cache/d.bin", "a/z.txt", "a/b/c/z.txt", "b/a/z.txt", "trailing.txt", "trailing.txt  x",
    "space ", "space", "two   ", "two  ", "#hash.txt", "comment.txt", "#comment.txt", "!bang.txt",
    "bang.txt", "ax.dat", "dx.dat", "qy.dat", "ry.dat", "tab.txt", "tab.txt\t", "x.tmp",
    "keep/x.tmp", "keep/!x", "keep/y.txt", "nested/deep/n.txt", "sub/nested/deep/n.txt",
    "lead.txt", "  lead.txt", "star*.txt", "starx.txt", "q1.bin", "q12.bin", "m.pyc",
    "sub/pkg/m.pyc", "dironly/d.txt", "sub/dironly", "sub/local.txt", "sub/inner/local.txt",
    "local.txt", "sub/anchored.txt", "sub/inner/anchored.txt", "anchored.txt", "sub/deep/f.txt",
    "deep/f.txt", "sub/x/y", "x/y", "sub/inner/data.csv", "sub/inner/keep.csv", "data.csv",
    "[unclosed", "\\",
]

GPUIGNORE = {
    ".gpuignore": BOM + b"data/\r\n*.ckpt  \r\n!best.ckpt\r\n/out\r\n",
    "sub/.gpuignore": b"*.npy\n!keep.npy\n",
}
GPU_FILES = ["data/a.csv", "sub/data/b.csv", "m.ckpt", "best.ckpt", "runs/m.ckpt", "out/log.txt",
             "sub/out/log.txt", "sub/a.npy", "sub/keep.npy", "a.npy", "train.py"]


def _git(repo: Path, *args: str, input: bytes | None = None) -> bytes:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    return subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True,
                          check=True, env=env).stdout


def _lay_out(root: Path, ignore_files: dict[str, bytes], files: list[str]) -> Path:
    for rel in files:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rel.encode() + b"\n")
    for rel, data in ignore_files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def _git_kept_files(root: Path, judge_files: dict[str, bytes]) -> set[str]:
    """Files git would add (untracked, not ignored), judged in a copy whose ignore files are
    ``judge_files`` (as .gitignore)."""
    repo = root.parent / (root.name + "-git")
    shutil.copytree(root, repo, symlinks=True)
    for p in list(repo.rglob(".gpuignore")):
        p.unlink()
    for rel, data in judge_files.items():
        (repo / rel).write_bytes(data)
    _git(repo, "init", "-q")
    out = _git(repo, "ls-files", "-z", "--others", "--exclude-standard")
    kept = {p for p in out.decode().split("\0") if p}
    return {p for p in kept if posixpath_name(p) != ".gitignore" or p in judge_files}


def posixpath_name(p: str) -> str:
    return p.rsplit("/", 1)[-1]


def _git_ignored(repo: Path, paths: list[str]) -> set[str]:
    out = subprocess.run(["git", "-C", str(repo), "check-ignore", "--no-index", "--stdin", "-z"],
                         input="\0".join(paths).encode() + b"\0", capture_output=True,
                         env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1",
                              "GIT_CONFIG_GLOBAL": os.devnull})
    assert out.returncode in (0, 1), out.stderr
    return {p for p in out.stdout.decode().split("\0") if p}


def _walked_files(root: Path) -> set[str]:
    listing = sync_plan.walk_local(root, IgnoreRules())
    return {rel for rel, e in listing.entries.items() if e.kind == "f"}


def _all_paths(files: list[str]) -> list[str]:
    out = set(files)
    for f in files:
        parts = f.split("/")
        for i in range(1, len(parts)):
            out.add("/".join(parts[:i]))
    return sorted(out)


def _as_gitignore(files: dict[str, bytes]) -> dict[str, bytes]:
    return {str(Path(rel).with_name(".gitignore")): data for rel, data in files.items()}


def test_corpus_is_large_enough():
    lines = sum(len(d.splitlines()) for d in {**GITIGNORE, **GPUIGNORE}.values())
    assert lines >= 25 and len(FILES) + len(GPU_FILES) >= 50


def test_walk_keeps_exactly_what_git_keeps(tmp_path):
    root = _lay_out(tmp_path / "proj", GITIGNORE, FILES)
    want = _git_kept_files(root, GITIGNORE)
    assert "secrets.env" not in want and "sub/secrets.env" not in want  # the judge agrees
    assert _walked_files(root) == want


def test_each_path_is_ignored_exactly_when_git_check_ignore_says_so(tmp_path):
    root = _lay_out(tmp_path / "proj", GITIGNORE, FILES)
    _git(root, "init", "-q")
    paths = _all_paths(FILES)
    ignored = _git_ignored(root, paths)
    rules = IgnoreRules()
    for rel in GITIGNORE:
        rules.add_file(rel, (root / rel).read_bytes())
    ours = {p for p in paths if rules.covers(p, (root / p).is_dir())}
    assert ours == ignored
    assert {"secrets.env", "build", "space ", "two   ", "#hash.txt", "!bang.txt", "  lead.txt",
            "star*.txt", "sub/nested/deep"} <= ignored
    assert not {"tab.txt", "two  ", "src/build", "comment.txt", "starx.txt", "[unclosed"} & ignored


def test_gpuignore_has_the_same_syntax_and_wins_over_gitignore_of_its_directory(tmp_path):
    root = _lay_out(tmp_path / "proj", GPUIGNORE, GPU_FILES)
    want = _git_kept_files(root, _as_gitignore(GPUIGNORE))
    want = {p.replace(".gitignore", ".gpuignore") for p in want}
    assert "m.ckpt" not in want and "best.ckpt" in want
    assert _walked_files(root) == want
    # with both files in one directory, .gpuignore's lines come after .gitignore's
    both = tmp_path / "both"
    _lay_out(both, {".gitignore": b"*.ckpt\n", ".gpuignore": b"!best.ckpt\nrun*/\n"},
             ["m.ckpt", "best.ckpt", "runs/x", "train.py"])
    assert _walked_files(both) == {".gitignore", ".gpuignore", "best.ckpt", "train.py"}


def test_a_bad_exclude_pattern_is_a_one_line_error_naming_it():
    with pytest.raises(GpumagicError) as e:
        IgnoreRules(["*.log", "\\"])
    assert "'\\\\'" in e.value.message and "--exclude" in e.value.message
    assert "\n" not in str(e.value.message)
    # bad lines in ignore files are skipped, as git skips them
    rules = IgnoreRules()
    rules.add_file(".gitignore", b"\\\n*.log\n")
    assert rules.ignored("a.log", False)


def test_magic_sync_with_a_bad_exclude_is_one_line(ip, tmp_path, capsys):
    from IPython.core.error import UsageError

    (tmp_path / "p").mkdir()
    ip.run_line_magic("gpu", "connect testgpu")
    with pytest.raises(UsageError) as e:
        ip.run_line_magic("gpu", f"sync {tmp_path}/p/ :{tmp_path}/r --exclude \\\\")
    assert type(e.value) is UsageError  # exactly: IPython then shows the line, no traceback
    assert "bad --exclude pattern '\\\\'" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "r").exists()


def test_push_and_pull_over_ssh_honour_the_corpus_like_git(machine, tmp_path):
    root = _lay_out(tmp_path / "proj", GITIGNORE, FILES)
    want = _git_kept_files(root, GITIGNORE)
    remote = tmp_path / "remote"
    machine.push(str(root) + "/", str(remote))
    pushed = {str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file()}
    assert pushed == want
    assert not (remote / "secrets.env").exists()
    # pull, asked to honour them: the remote tree holds everything; its ignore files (BOM,
    # CRLF) come with the listing
    full = _lay_out(tmp_path / "remote-full", GITIGNORE, FILES)
    back = tmp_path / "back"
    machine.pull(str(full) + "/", str(back), ignore_files=True)
    assert {str(p.relative_to(back)) for p in back.rglob("*") if p.is_file()} == want


def test_character_classes_match_the_bytes_git_matches(tmp_path):
    root = tmp_path / "classes"
    root.mkdir()
    _git(root, "init", "-q")
    names = [b"x" + bytes([b]) for b in range(1, 256) if b != ord("/")]
    for cls in ("alnum", "alpha", "blank", "cntrl", "digit", "graph", "lower", "print", "punct",
                "space", "upper", "xdigit"):
        (root / ".gitignore").write_text(f"x[[:{cls}:]]\n", encoding="utf-8")
        out = subprocess.run(["git", "-C", str(root), "check-ignore", "--no-index", "--stdin", "-z"],
                             input=b"\0".join(names) + b"\0", capture_output=True)
        want = {n for n in out.stdout.split(b"\0") if n}
        rules = IgnoreRules()
        rules.add_file(".gitignore", f"x[[:{cls}:]]\n".encode())
        ours = {n for n in names if rules.ignored(n.decode("utf-8", "surrogateescape"), False)}
        assert ours == want, cls


def test_random_patterns_match_exactly_what_git_matches(tmp_path):
    """Fuzzing against git: 250 random patterns of wildcard-heavy characters (a fixed seed),
    each in a root or nested .gitignore, over a tree of awkward names."""
    import random

    rng = random.Random(20250101)
    root = tmp_path / "fuzz"
    dirs = ["a", "b", "ab", "a/b", "b/a", "a/a", "a/b/a", "1", "é"]
    names = ["a", "b", "ab", "a b", "a.b", "1", "a1", "[a]", "!a", "-", "^", "é", "a\\b", "*", "?",
             ":", "a ", " a", "aa", "a\tb"]
    paths = set()
    for d in dirs:
        (root / d).mkdir(parents=True, exist_ok=True)
    for d in [""] + dirs:
        for n in rng.sample(names, 8):
            rel = f"{d}/{n}" if d else n
            if not (root / rel).is_dir():
                (root / rel).write_bytes(b"")
    for p in root.rglob("*"):
        paths.add(str(p.relative_to(root)))
    paths = sorted(paths)
    _git(root, "init", "-q")
    alphabet = ["a", "b", "/", "*", "*", "?", "[", "]", "!", "^", "-", "\\", ":", " ", ".", "1",
                "**", "[:alpha:]", "[:digit:]", "é", "\t"]
    wrong = []
    for _ in range(250):
        pat = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
        data = ("*\n!" + pat if rng.random() < 0.2 else pat) + "\n"
        where = rng.choice(["", "a"])
        for d in ("", "a"):
            (root / d / ".gitignore").unlink(missing_ok=True)
        (root / where / ".gitignore").write_text(data, encoding="utf-8")
        want = _git_ignored(root, paths)
        rules = IgnoreRules()
        rules.add_file(f"{where}/.gitignore" if where else ".gitignore", data.encode())
        ours = {p for p in paths if rules.covers(p, (root / p).is_dir())}
        if ours != want:
            wrong.append((data, where, sorted(want ^ ours)[:4]))
        # the walk's judges (one regex per file first) say what covers() says, for the
        # ignore file and for the same pattern given as --exclude
        try:
            excluded = [IgnoreRules([ln for ln in data.splitlines() if ln.strip()], use_files=False)]
        except ConfigError:  # a pattern git never matches: refused as --exclude
            excluded = []
        for r in [rules, *excluded]:
            judged = {p for p in paths if _judged(r, p, (root / p).is_dir())}
            if judged != {p for p in paths if r.covers(p, (root / p).is_dir())}:
                wrong.append(("judge", data, where, r is not rules))
    assert wrong == []


def _judged(rules: IgnoreRules, rel: str, is_dir: bool) -> bool:
    """Whether the walk leaves ``rel`` out: it or a folder above it ignored by the judge
    of its folder (IgnoreRules.folder)."""
    parts = rel.split("/")
    for i in range(1, len(parts) + 1):
        judge = rules.folder("/".join(parts[:i - 1]))
        if judge is not None and judge(parts[i - 1], is_dir or i < len(parts)):
            return True
    return False


def test_gitignore_saved_with_a_bom_keeps_its_first_line_secret(machine, tmp_path):
    src = tmp_path / "proj"
    src.mkdir()
    (src / ".gitignore").write_bytes(BOM + b"secrets.env\r\n*.ckpt\r\n")
    (src / "secrets.env").write_text("TOKEN=hunter2\n", encoding="utf-8")
    (src / "train.py").write_text("print(1)\n", encoding="utf-8")
    machine.push(str(src) + "/", str(tmp_path / "remote"))
    assert sorted(os.listdir(tmp_path / "remote")) == [".gitignore", "train.py"]

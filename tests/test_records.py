"""The records gpumagic keeps here are typed, with a schema version (:mod:`gpumagic._stored`):
the keep records (:class:`gpumagic.remote.keep.KeepRecord`) and those a move reads
(:mod:`gpumagic.remote.move.store`, ``.reaching``, ``.moving``); the files gpumagic wrote before
they were typed still load.

The JSON below is what the dict-based code (commit ae9a282) wrote, byte for byte, through its
own functions: ``move.record_start``, ``record_keep``, ``update_start`` (as a standby, a GPU
loss and a move left it), ``note_push``, ``note_seen``/``note_failed``; a ``Keeper``'s
``_load``, ``_promote`` (three checkpoints, one with no mtime recorded), ``_prune`` (``--keep-last
2``) and ``_save``.  No sshd: these are files on this computer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumagic.remote import move
from gpumagic.remote import keep
from gpumagic.remote.keep import KeepOptions, record_dir

#: A job's start record on the machine it left, after a standby was armed, a GPU was seen gone,
#: and the job moved away (``cleanup`` pending: the machine did not answer).
START_LEFT = '''{
 "checkpoint": null,
 "cleanup": "pending",
 "command": "python3 train.py --steps 60",
 "cwd": "proj",
 "fallback": "b",
 "format": "gpumagic-job-start",
 "gpu_lost": {
  "at": 1765000200.0,
  "why": "its GPU is gone"
 },
 "gpu_ok_at": 1796675396.6765678,
 "gpus": [
  {
   "index": 0,
   "uuid": "GPU-1"
  }
 ],
 "job": "train",
 "keep": {
  "every": 2.0,
  "last": 3,
  "path": "ckpt/",
  "settle": 10.0,
  "to": "/tmp/kept"
 },
 "machine": "a",
 "moved_at": 1765000300.0,
 "moved_from": null,
 "moved_to": "b",
 "options": {
  "alerts": true,
  "env": {
   "SEED": "1"
  },
  "python": false,
  "resume_arg": "--resume {checkpoint}",
  "stop_on": [
   "nan"
  ],
  "then_shutdown": null
 },
 "seen_running": null,
 "src": "/tmp/tmpzlzh8vqe/proj",
 "started": 1796675396.6765678,
 "version": 1
}'''

#: The start record of a torchrun job on the machine it moved to, after it ended there.
START_ARRIVED = '''{
 "checkpoint": "ckpt/step-10.json",
 "command": "!python3 train.py",
 "cwd": "work",
 "earlier_logs": [
  "/data/keep/a/train.logs/1765000000000/log"
 ],
 "ended": "exited 0",
 "format": "gpumagic-job-start",
 "gpu_lost": null,
 "gpu_ok_at": 1796675637.267057,
 "gpus": null,
 "job": "train",
 "keep": null,
 "machine": "b",
 "moved_from": "a",
 "moved_to": null,
 "options": {
  "alerts": false,
  "env": {},
  "python": true,
  "resume_arg": "--resume {checkpoint}",
  "stop_on": [],
  "then_shutdown": 10.0
 },
 "resumed_at": 1765000400.0,
 "seam": "--- gpumagic: job train moved from a to b ---",
 "seen_running": 1765000500.0,
 "src": "/home/me/proj",
 "started": 1796675637.267057,
 "torchrun": {
  "args": [
   "--master-port",
   "29501"
  ],
  "hosts": [
   "b"
  ],
  "nproc": 2
 },
 "version": 1
}'''

#: ``@reach.json`` and ``@pushes.json`` had no version field.
REACH = '''{
 "failing_since": 1765000100.0,
 "format": "gpumagic-reach",
 "last_seen": 1765000000.0,
 "why": "connection refused"
}'''

PUSHES = '''{
 "format": "gpumagic-pushes",
 "pushes": [
  {
   "at": 1796675396.6713076,
   "local": "/tmp/tmpzlzh8vqe/proj",
   "remote": "~/proj"
  }
 ]
}'''

#: A keep record: three checkpoints kept, the oldest pruned, the job ended.
KEEP = """{
 "error": "",
 "every": 2.0,
 "files": {
  "hf/checkpoint-5/model.bin": {
   "kept_at": 1796676475.262621,
   "pruned": false,
   "sig": [
    9,
    1765000100000000000,
    12
   ]
  },
  "step-10.pt": {
   "kept_at": 1796676475.2610524,
   "pruned": true,
   "sig": [
    7,
    1765000000123456789,
    11
   ],
   "written_at": 1765000000.5
  },
  "step-20.pt": {
   "kept_at": 1796676475.2633722,
   "pruned": false,
   "sig": [
    8,
    1765000200000000000,
    13
   ],
   "written_at": 1765000200.0
  }
 },
 "format": "gpumagic-keep",
 "job": "train",
 "kept_count": 3,
 "last": 2,
 "last_kept": {
  "at": 1796676475.2633722,
  "path": "step-20.pt"
 },
 "last_look": 1765000300.0,
 "local": "/tmp/tmpuaunr6ty/kept",
 "log": "/tmp/tmpuaunr6ty/data/keep/a/train.logs/1796676475260/log",
 "machine": "a",
 "path": "ckpt/",
 "run": 1,
 "started": 1796676475.2606833,
 "state": "the job ended",
 "version": 1
}"""


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUMAGIC_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def _put(machine: str, name: str, text: str) -> Path:
    folder = record_dir(machine)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text, encoding="utf-8")
    return folder / name


def test_a_start_record_written_before_the_records_were_typed_loads_with_every_field(data_dir):
    _put("a", "train.job.json", START_LEFT)
    rec = move.start_record("a", "train")
    assert rec == move.StartRecord(
        machine="a", job="train", started=1796675396.6765678, command="python3 train.py --steps 60", cwd="proj",
        src="/tmp/tmpzlzh8vqe/proj", gpus=[move.HeldGpu(0, "GPU-1")], gpu_ok_at=1796675396.6765678,
        gpu_lost=move.GpuGone(1765000200.0, "its GPU is gone"),
        options=move.RunOptions(python=False, env={"SEED": "1"}, stop_on=["nan"], then_shutdown=None, alerts=True,
                                resume_arg="--resume {checkpoint}"),
        keep=KeepOptions("ckpt/", every=2.0, to="/tmp/kept", last=3, settle=10.0),
        moved_to="b", moved_at=1765000300.0, cleanup="pending", fallback="b", version=1)
    # what a move builds from it
    options = move.job_options(rec)
    assert (options.cwd, dict(options.env), tuple(options.stop_on), options.resume_arg) == (
        "proj", {"SEED": "1"}, ("nan",), "--resume {checkpoint}")
    assert [r.job for r in move.pending_cleanups("a")] == ["train"]


def test_a_moved_torchrun_record_written_before_the_records_were_typed_loads(data_dir):
    _put("b", "train.job.json", START_ARRIVED)
    rec = move.start_record("b", "train")
    assert rec is not None and rec.torchrun == move.TorchrunLayout(2, ("--master-port", "29501"), ("b",))
    assert (rec.moved_from, rec.checkpoint, rec.resumed_at, rec.ended, rec.seen_running) == (
        "a", "ckpt/step-10.json", 1765000400.0, "exited 0", 1765000500.0)
    assert rec.earlier_logs == ["/data/keep/a/train.logs/1765000000000/log"] and rec.gpus is None
    assert rec.options.python and rec.options.then_shutdown == 10.0 and not rec.options.alerts
    assert move.torchrun_form(rec) == "!python3 train.py"


@pytest.mark.parametrize("text", [START_LEFT, START_ARRIVED], ids=["left", "arrived"])
def test_an_update_keeps_every_value_of_a_record_written_before_the_records_were_typed(data_dir, text):
    """Whatever the old code wrote, an update writes back unchanged (an older gpumagic reading
    the file after this one updated it finds what it wrote), plus the fields it left out as null."""
    old = json.loads(text)
    path = _put(old["machine"], "train.job.json", text)
    assert move.update_start(old["machine"], "train", seen_running=1765000600.0) is not None
    new = json.loads(path.read_text(encoding="utf-8"))
    assert new["seen_running"] == 1765000600.0
    assert {k: v for k, v in new.items() if k in old and k != "seen_running"} == \
        {k: v for k, v in old.items() if k != "seen_running"}
    assert all(new[k] in (None, []) for k in set(new) - set(old)), {k: new[k] for k in set(new) - set(old)}


def test_reach_and_pushes_written_without_a_version_load_as_version_0(data_dir, tmp_path):
    _put("a", "@reach.json", REACH)
    r = move.reach("a")
    assert (r.last_seen, r.failing_since, r.why, r.version) == (1765000000.0, 1765000100.0, "connection refused", 0)
    _put("a", "@pushes.json", PUSHES)
    assert move.store._pushes("a") == [move.Push("/tmp/tmpzlzh8vqe/proj", "~/proj", 1796675396.6713076)]
    move.note_seen("a", at=1765000200.0)  # written back with today's version
    saved = json.loads((record_dir("a") / "@reach.json").read_text(encoding="utf-8"))
    assert saved == {"format": "gpumagic-reach", "version": move.ReachRecord.VERSION, "last_seen": 1765000200.0,
                     "failing_since": None, "why": ""}


def test_fields_a_newer_gpumagic_wrote_survive_an_update_by_this_one(data_dir):
    old = json.loads(START_LEFT)
    old["pinned"] = {"by": "a later feature"}
    path = _put("a", "train.job.json", json.dumps(old))
    move.update_start("a", "train", cleanup="done")
    new = json.loads(path.read_text(encoding="utf-8"))
    assert new["pinned"] == {"by": "a later feature"} and new["cleanup"] == "done"


def test_a_damaged_start_record_counts_as_none(data_dir):
    _put("a", "bad.job.json", '{"format": "gpumagic-job-start", "version": 1, "machine": "a"}')  # no job
    _put("a", "worse.job.json", '{"format": "gpumagic-job-start", "machine": "a", "job": "worse", "keep": {"path": ""}}')
    assert move.start_record("a", "bad") is None and move.start_record("a", "worse") is None
    assert move.start_records("a") == []


def test_an_update_of_a_field_that_does_not_exist_is_refused(data_dir):
    _put("a", "train.job.json", START_LEFT)
    with pytest.raises(TypeError):
        move.update_start("a", "train", movd_to="c")


def test_a_record_saved_and_loaded_is_the_same_record(data_dir):
    rec = move.StartRecord(machine="m", job="j", started=1.5, command="true", cwd="~/w", gpus=[move.HeldGpu(None, "GPU-9")],
                           keep=KeepOptions("out/", every=5.0, to="/k", last=None, settle=0.0),
                           torchrun=move.TorchrunLayout("auto"), earlier_logs=["/l"], seam="---")
    rec.save(move.start_path("m", "j"))
    assert move.start_record("m", "j") == rec
    mover = move.Mover(pid=12, host="laptop", to="b", what="resume", since=3.0)
    mover.save(record_dir("m") / "j.job.mover")
    assert move.Mover.load(record_dir("m") / "j.job.mover") == mover


def test_a_keep_record_written_before_the_records_were_typed_loads_and_saves_the_same(data_dir):
    path = _put("a", "train.json", KEEP)
    rec = keep.record_of("a", "train")
    assert rec is not None and (rec.job, rec.run, rec.path, rec.every, rec.last, rec.state, rec.kept_count) == (
        "train", 1, "ckpt/", 2.0, 2, "the job ended", 3)
    assert rec.last_kept == keep.LastKept("step-20.pt", 1796676475.2633722) and rec.last_look == 1765000300.0
    assert rec.files["step-10.pt"] == keep.KeptFile((7, 1765000000123456789, 11), 1796676475.2610524, True,
                                                     1765000000.5)
    assert rec.files["hf/checkpoint-5/model.bin"].written_at is None
    # what a move and `%gpu jobs` read of it: the newest checkpoint not pruned, by its mtime there
    assert move.newest_kept(rec) == ("step-20.pt", 1796676475.2633722)
    assert move.newest_written(rec) == 1765000200.0
    assert [r.job for r in keep.records("a")] == ["train"] and keep.next_run("a", "train") == 2
    rec.save(path)  # the same JSON, key for key (a file without written_at keeps none)
    assert json.loads(path.read_text(encoding="utf-8")) == json.loads(KEEP)


def test_a_keep_record_from_before_runs_and_write_times_were_recorded_reads_as_run_1(data_dir):
    old = json.loads(KEEP)
    del old["run"]
    for f in old["files"].values():
        f.pop("written_at", None)
    _put("a", "train.json", json.dumps(old))
    rec = keep.record_of("a", "train")
    assert rec is not None and rec.run == 1 and keep.next_run("a", "train") == 2
    assert move.newest_written(rec) == 1796676475.2633722  # its arrival here, as the dict code read it

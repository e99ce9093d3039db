"""The one safe writer: planted symlinks are never followed, existing files need overwrite, directories
that are not teraio's are never removed, and a failed write leaves nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from teraio.planner.hardware import HardwareModel
from teraio.planner.safe_io import (
    OutputError,
    append_line,
    artifact_kind,
    atomic_writer,
    check_output_dir,
    replace_dir,
    write_json,
    write_text,
)
from tests.planner.planner_cases import pyramid


@pytest.fixture
def shared_dir(tmp_path: Path) -> Path:
    """A world-writable directory without the sticky bit: anyone could plant links in it."""
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    return d


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text("precious")
    return v


def test_planted_symlinks_at_old_temp_names_are_not_followed(shared_dir, victim):
    """The old writers used fixed temp names ('.plan.json.tmp'): a link there overwrote its target."""
    for name in (".plan.json.tmp", ".hw.json.tmp", f".teraio-calibrate-{os.getpid()}"):
        (shared_dir / name).symlink_to(victim)
    write_text(shared_dir / "plan.json", "{}")
    HardwareModel().save(shared_dir / "hw.json")
    assert victim.read_text() == "precious"
    assert json.loads((shared_dir / "plan.json").read_text()) == {}
    assert HardwareModel.load(shared_dir / "hw.json") == HardwareModel()
    # Only the outputs and the planted links: no temporary file left.
    assert sorted(p.name for p in shared_dir.iterdir()) == sorted(
        [".plan.json.tmp", ".hw.json.tmp", f".teraio-calibrate-{os.getpid()}", "plan.json", "hw.json"]
    )


def test_symlink_at_the_target_is_replaced_not_followed(shared_dir, victim):
    link = shared_dir / "out.json"
    link.symlink_to(victim)
    with pytest.raises(OutputError, match="exists; pass --force"):
        write_json(link, {"a": 1})
    write_json(link, {"a": 1}, overwrite=True)
    assert victim.read_text() == "precious"
    assert not link.is_symlink() and json.loads(link.read_text()) == {"a": 1}


def test_existing_file_needs_overwrite_and_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")
    with pytest.raises(OutputError, match="--force"):
        write_text(target, "new")
    assert target.read_text() == "old"
    with pytest.raises(RuntimeError, match="boom"), atomic_writer(target, overwrite=True) as f:
        f.write("half")
        raise RuntimeError("boom")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError, match="Circular"):  # unserialisable: fails before any file exists
        write_json(tmp_path / "g.json", loop)
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


@pytest.mark.parametrize(
    ("path", "fragment"),
    [("", "empty path"), ("nodir/x.json", "does not exist"), (".", "names a directory")],
)
def test_bad_output_paths(tmp_path, monkeypatch, path, fragment):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError, match=fragment):
        write_text(path, "x")


def test_append_line_refuses_a_planted_link(shared_dir, victim):
    (shared_dir / "stats.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        append_line(shared_dir / "stats.jsonl", "{}")
    assert victim.read_text() == "precious"
    append_line(shared_dir / "ok.jsonl", '{"a": 1}')
    append_line(shared_dir / "ok.jsonl", '{"a": 2}')
    assert (shared_dir / "ok.jsonl").read_text() == '{"a": 1}\n{"a": 2}\n'


# ------------------------------------------------------------------------------------- directories
def test_profile_save_refuses_a_project_directory_and_removes_nothing(tmp_path):
    """The old save rmtree'd any directory holding a meta.json: a project lost its sources."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('hi')")
    (project / "meta.json").write_text("{}")
    with pytest.raises(OutputError, match="not a teraio profile.*--force"):
        pyramid().save(project)
    assert (project / "src" / "main.py").read_text() == "print('hi')"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]


def test_profile_save_force_moves_a_foreign_directory_aside(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    pyramid().save(project, force=True)
    assert artifact_kind(project) == "profile"
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("project.replaced-")]
    assert len(kept) == 1 and (kept[0] / "notes.txt").read_text() == "mine"


def test_profile_save_replaces_a_profile_and_leaves_no_temporaries(tmp_path):
    out = tmp_path / "prof"
    pyramid().save(out)
    pyramid(fingerprint="second").save(out)
    from teraio.planner.profile import Profile

    assert Profile.load(out).fingerprint == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["prof"]
    # An empty directory is fine too.
    (tmp_path / "empty").mkdir()
    pyramid().save(tmp_path / "empty")
    assert artifact_kind(tmp_path / "empty") == "profile"


def test_a_profile_with_an_extra_file_is_not_a_profile(tmp_path):
    out = pyramid().save(tmp_path / "prof")
    (out / "README").write_text("notes")
    assert artifact_kind(out) is None
    with pytest.raises(OutputError):
        check_output_dir(out, ("profile",))


def _profile_set(out: Path) -> Path:
    """A two-graph profile set as ``teraio profile`` writes it (index.json plus graphN/ profiles)."""

    def populate(d: Path) -> None:
        for g in ("graph0", "graph1"):
            (d / g).mkdir()
            pyramid(fingerprint=g).write_files(d / g)
        (d / "index.json").write_text(json.dumps({"graphs": ["graph0", "graph1"]}))

    return replace_dir(out, "profile-set", populate)


@pytest.mark.parametrize(
    "files",
    [
        {"meta.json": '{"my": "settings"}'},  # only a user's meta.json: was taken for a profile
        {"index.json": '{"x": 1}'},  # only an index.json: was taken for a profile set
        {"index.json": '{"graphs": []}'},
        {"meta.json": "{}", "ops.parquet": "x", "tensors.parquet": "y"},  # all the names, not teraio's meta
        {"meta.json": "[1, 2]", "ops.parquet": "x", "tensors.parquet": "y"},
        {"meta.json": "not json", "ops.parquet": "x", "tensors.parquet": "y"},
        {
            "meta.json": '{"schema_version": "1", "fingerprint": "f", "num_fwd_ops": 1}',
            "ops.parquet": "x",
            "tensors.parquet": "y",
        },
    ],
)
def test_files_with_teraio_names_are_not_an_artefact(tmp_path, files):
    """Before, a directory was teraio's when every file had a teraio name: a lone meta.json was replaced."""
    d = tmp_path / "mine"
    d.mkdir()
    for name, text in files.items():
        (d / name).write_text(text)
    assert artifact_kind(d) is None
    for kinds in (("profile",), ("profile", "profile-set")):
        with pytest.raises(OutputError, match="not a teraio profile"):
            check_output_dir(d, kinds)
    with pytest.raises(OutputError, match="--force"):
        pyramid().save(d)
    assert {p.name: p.read_text() for p in d.iterdir()} == files
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


def test_an_incomplete_profile_is_not_a_profile(tmp_path):
    out = pyramid().save(tmp_path / "prof")
    (out / "tensors.parquet").unlink()  # teraio's meta.json, but a file missing
    assert artifact_kind(out) is None
    (tmp_path / "only_meta").mkdir()
    (tmp_path / "only_meta" / "meta.json").write_bytes((out / "meta.json").read_bytes())
    assert artifact_kind(tmp_path / "only_meta") is None


def test_profile_set_needs_its_index_and_graph_profiles(tmp_path):
    out = _profile_set(tmp_path / "set")
    assert artifact_kind(out) == "profile-set"
    _profile_set(out)  # replaces a profile set without force, leaving nothing else
    assert [p.name for p in tmp_path.iterdir()] == ["set"]
    index = (out / "index.json").read_text()
    (out / "index.json").write_text(json.dumps({"graphs": ["graph0"]}))  # does not name graph1
    assert artifact_kind(out) is None
    (out / "index.json").write_text(index)
    (out / "graph1" / "meta.json").write_text("{}")  # a graph that is not a teraio profile
    assert artifact_kind(out) is None
    only_index = tmp_path / "only_index"
    only_index.mkdir()
    (only_index / "index.json").write_text(index)  # teraio's index, but no graph profiles
    assert artifact_kind(only_index) is None


def test_profile_meta_keys_are_the_ones_profiles_require():
    from teraio.planner.profile import META_REQUIRED
    from teraio.planner.safe_io import PROFILE_META_KEYS

    assert tuple(PROFILE_META_KEYS) == tuple(META_REQUIRED)


def test_replace_dir_failure_keeps_the_old_directory(tmp_path):
    out = pyramid().save(tmp_path / "prof")
    before = sorted(p.name for p in out.iterdir())

    def populate(d: Path) -> None:
        (d / "ops.parquet").write_text("x")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        replace_dir(out, "profile", populate)
    assert sorted(p.name for p in out.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["prof"]


def test_output_dir_that_is_a_file_or_symlink(tmp_path, victim):
    with pytest.raises(OutputError, match="not a directory"):
        check_output_dir(victim, ("profile",))
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(OutputError, match="symbolic link"):
        pyramid().save(tmp_path / "link")


def _estimate_dir(path: Path, plans: tuple[str, ...] = ("plan-greedy.json",)) -> Path:
    """An estimate artefact as ``teraio estimate --out`` lays it out (with stand-in plan contents)."""

    def populate(d: Path) -> None:
        (d / "profile").mkdir()
        pyramid().write_files(d / "profile")
        (d / "hardware.json").write_text(json.dumps(HardwareModel().to_dict()))
        for name in plans:
            (d / name).write_text("{}")
        (d / "estimate.json").write_text(
            json.dumps({"estimate_schema_version": 1, "plan_files": list(plans)})
        )

    return replace_dir(path, "estimate", populate)


def test_an_estimate_is_replaced_only_when_it_is_exactly_teraios(tmp_path):
    out = _estimate_dir(tmp_path / "est")
    assert artifact_kind(out) == "estimate"
    _estimate_dir(out, ("plan-greedy.json", "plan-ilp.json"))  # replaces an estimate without force
    assert [p.name for p in tmp_path.iterdir()] == ["est"]
    assert sorted(p.name for p in out.iterdir()) == [
        "estimate.json",
        "hardware.json",
        "plan-greedy.json",
        "plan-ilp.json",
        "profile",
    ]
    (out / "plan-other.json").write_text("{}")  # a plan estimate.json does not name: not teraio's layout
    assert artifact_kind(out) is None
    with pytest.raises(OutputError, match="not a teraio estimate"):
        _estimate_dir(out)
    (out / "plan-other.json").unlink()
    (out / "estimate.json").write_text(json.dumps({"plan_files": ["plan-greedy.json", "plan-ilp.json"]}))
    assert artifact_kind(out) is None  # no teraio key: someone else's estimate.json
    (out / "estimate.json").write_text(
        json.dumps({"estimate_schema_version": 1, "plan_files": ["plan-greedy.json", "plan-ilp.json"]})
    )
    (out / "profile" / "notes.txt").write_text("mine")  # the profile is not teraio's any more
    assert artifact_kind(out) is None


# ------------------------------------------------------------------------------------------- inputs
def test_inputs_are_read_only_when_regular_files_and_up_to_a_limit(tmp_path):
    """A plan that was a link to /dev/zero read without end (7.3 GB in 25 s); a FIFO blocked forever."""
    import time

    from teraio.planner.safe_io import InputError, load_json, read_input

    os.mkfifo(tmp_path / "fifo")  # nobody writes to it: opening it for reading without O_NONBLOCK blocks
    (tmp_path / "zero").symlink_to("/dev/zero")
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(1 << 20)  # sparse: no disk used
    t0 = time.perf_counter()
    for name, fragment in [
        ("fifo", "is a FIFO (named pipe), not a regular file"),
        ("zero", "is a character device, not a regular file"),
        ("big.json", "larger than 4096 bytes"),
        ("missing", "does not exist"),
        (".", "is a directory"),
    ]:
        with pytest.raises(InputError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            read_input(tmp_path / name, limit_nbytes=4096, what="plan")
    assert time.perf_counter() - t0 < 30  # none of them blocked (generous: a loaded machine passes)
    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(InputError, match="nests too deeply"):
        load_json(tmp_path / "deep.json")
    for text in ('{"a": NaN}', '{"a": Infinity}', '{"a": -Infinity}'):
        (tmp_path / "c.json").write_text(text)
        with pytest.raises(InputError, match="not a number teraio accepts"):
            load_json(tmp_path / "c.json")
    (tmp_path / "ok.json").write_text('{"a": 1e30}')
    assert load_json(tmp_path / "ok.json") == {"a": 1e30}  # a finite number parses; its loader bounds it


def test_create_subdir_is_complete_or_absent_and_never_replaces(tmp_path):
    """PrivateDir.create_subdir (checkpoints): a failure in populate leaves nothing; a name that appears
    while it is populated is left alone (renameat2 RENAME_NOREPLACE) and the staged files go."""
    from teraio.planner.private_dir import PrivateDir

    def write(d):
        with d.open_new("a.bin") as f:
            f.write(b"x" * 10)

    with PrivateDir.open(tmp_path) as parent:
        parent.create_subdir("ok", write)
        assert (tmp_path / "ok" / "a.bin").read_bytes() == b"x" * 10

        def fails(d):
            write(d)
            raise RuntimeError("populate failed")

        with pytest.raises(RuntimeError):
            parent.create_subdir("bad", fails)

        def someone_else_creates_it(d):
            write(d)
            (tmp_path / "raced").mkdir()
            (tmp_path / "raced" / "theirs.txt").write_text("keep")

        with pytest.raises(OutputError, match="appeared while it was being written"):
            parent.create_subdir("raced", someone_else_creates_it)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok", "raced"]
    assert [p.name for p in (tmp_path / "raced").iterdir()] == ["theirs.txt"]

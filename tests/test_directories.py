"""directories.py: the output directories a command makes, and removes again when it fails."""
import os
import pytest

from asyncpp_ext.directories import make_directories, missing_directories, remove_directories


def test_made_outermost_first_and_removed_while_empty(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    missing = missing_directories(target)
    assert missing == [tmp_path / "a", tmp_path / "a" / "b", target]
    made = make_directories(missing)
    assert made == missing and target.is_dir() and missing_directories(target) == []
    (tmp_path / "a" / "kept.txt").write_text("an output put in place")
    remove_directories(made)
    assert not (tmp_path / "a" / "b").exists() and (tmp_path / "a" / "kept.txt").exists()


def test_a_directory_that_cannot_be_made_takes_those_made_before_it_away(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "file").write_text("in the way")
    missing = [tmp_path / "x", tmp_path / "x" / "y", tmp_path / "a" / "file" / "z"]
    with pytest.raises(NotADirectoryError):
        make_directories(missing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_file_made_owner_only_gets_the_mode_a_plain_open_gives(tmp_path):
    import stat
    import tempfile

    from asyncpp_ext.directories import chmod_as_created

    fd, name = tempfile.mkstemp(dir=tmp_path)  # mkstemp: 0600, whatever the umask
    os.close(fd)
    before = os.umask(0o027)
    try:
        chmod_as_created(name)
        assert stat.S_IMODE(os.stat(name).st_mode) == 0o640
    finally:
        os.umask(before)
    assert os.umask(before) == before  # the process's umask is as it was

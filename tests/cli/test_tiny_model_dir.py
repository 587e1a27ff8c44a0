"""``pdserve make-tiny-model DIR`` writes only where it may: a new or empty directory, or one it
wrote before (a restarted init container writes again). An empty DIR (which was the current
directory) and a directory holding other files are refused in one error line, untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.main import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(argv)
    return status, capsys.readouterr().err


def test_writes_anew_and_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "tiny"
    assert run(["make-tiny-model", str(target), "--with-eagle3-draft"], capsys)[0] == 0
    first = (target / "model.safetensors").read_bytes()
    assert run(["make-tiny-model", str(target), "--with-eagle3-draft"], capsys)[0] == 0
    assert (target / "model.safetensors").read_bytes() == first and (target / "draft").is_dir()


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_dir_argument_is_refused(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, err = run(["make-tiny-model", name], capsys)
    assert status == 2 and err == "error: DIR must not be empty\n"


def test_a_directory_with_other_files_is_left_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "README.md").write_text("mine")
    (tmp_path / "config.json").write_text("{}")
    status, err = run(["make-tiny-model", str(tmp_path)], capsys)
    assert status == 2
    assert err == (f"error: {tmp_path} holds files the tiny checkpoint does not write "
                   "(README.md): give a new or empty directory\n")
    assert (tmp_path / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json"]


def test_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("x")
    status, err = run(["make-tiny-model", str(tmp_path / "f")], capsys)
    assert status == 2 and "exists and is not a directory" in err

"""The command line's answers to user mistakes and to untrusted names: output paths it cannot
publish, missing containers, findings that must reach a CI log whole, grouped findings that say
what they group, and names that must not break a Markdown step summary."""

from __future__ import annotations

import json
import os
import socket
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, assert_clean, cli_env, run_cli, tree_digests

FSDP2 = FIXTURES / "dcp" / "fsdp2"
MODEL = FIXTURES / "safetensors" / "model.safetensors"


def _pack(tmp_path_factory, src: Path, name: str) -> Path:
    out = tmp_path_factory.mktemp(name) / f"{name}.ckz"
    r = run_cli("compress", src, "-o", out, "-q")
    assert r.code == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """A compressed copy of the FSDP2 checkpoint (a directory target)."""
    return _pack(tmp_path_factory, FSDP2, "fsdp2")


@pytest.fixture(scope="module")
def packed_file(tmp_path_factory) -> Path:
    """A compressed single-file checkpoint (its target is one file)."""
    return _pack(tmp_path_factory, MODEL, "model")


# -- A: output paths ----------------------------------------------------------------------------


def test_missing_parent_directories_are_created_as_decompress_does(tmp_path, packed):
    """export, compress and delta create once failed with an internal error on an -o whose parent
    did not exist; decompress and delta apply (and convert, reshard) create the parents, so these
    now do too."""
    cases = [
        (["export", FSDP2, "-o", tmp_path / "a" / "b" / "model.safetensors"], "a/b/model.safetensors"),
        (["compress", FSDP2, "-o", tmp_path / "c" / "d" / "x.ckz"], "c/d/x.ckz"),
        (["delta", "create", FSDP2, FSDP2, "-o", tmp_path / "e" / "f" / "x.delta"], "e/f/x.delta"),
        (["decompress", packed, "-o", tmp_path / "g" / "h" / "restored"], "g/h/restored"),
    ]
    for args, made in cases:
        r = run_cli(*args, "-q")
        assert_clean(r, 0)
        assert (tmp_path / made).exists(), (args, r.stderr)
    assert tree_digests(tmp_path / "g" / "h" / "restored") == tree_digests(FSDP2)
    leftovers = [p.name for p in tmp_path.rglob("*") if "ckpttool-tmp" in p.name]
    assert leftovers == []


@pytest.mark.parametrize(
    "argv",
    [
        ["export", FSDP2, "-o", "{below}"],
        ["compress", FSDP2, "-o", "{below}"],
        ["delta", "create", FSDP2, FSDP2, "-o", "{below}"],
        ["decompress", "{packed}", "-o", "{below}"],
        ["convert", FSDP2, "-o", "{below}"],
        ["reshard", FSDP2, "-o", "{below}", "--dp", "2"],
    ],
    ids=["export", "compress", "delta-create", "decompress", "convert", "reshard"],
)
def test_an_output_below_a_regular_file_is_a_usage_error(argv, tmp_path, packed):
    """-o somefile.txt/x was an internal error (NotADirectoryError, FileExistsError) after all the
    work; now it is refused first, naming the path and the file in the way."""
    blocker = tmp_path / "somefile.txt"
    blocker.write_text("keep me")
    below = blocker / "sub" / "x"
    r = run_cli(*[str(a).format(below=below, packed=packed) for a in argv], cwd=tmp_path)
    assert_clean(r, 2)
    assert f"-o {below}" in r.stderr and f"{blocker} is a file, not a directory" in r.stderr, r.stderr
    assert "hint:" in r.stderr
    assert blocker.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["somefile.txt"]


@pytest.mark.parametrize(
    "argv",
    [
        ["compress", FSDP2, "-o", "{dir}", "--force"],
        ["delta", "create", FSDP2, FSDP2, "-o", "{dir}", "--force"],
        ["export", FSDP2, "-o", "{dir}", "--force"],
        ["decompress", "{packed_file}", "-o", "{dir}", "--force"],
    ],
    ids=["compress", "delta-create", "export", "decompress-one-file"],
)
def test_a_one_file_output_onto_a_directory_is_refused_even_with_force(argv, tmp_path, packed_file):
    """compress -o DIR --force was an internal error (IsADirectoryError from the final rename)."""
    target = tmp_path / "adir"
    target.mkdir()
    (target / "inside.txt").write_text("keep me")
    r = run_cli(*[str(a).format(dir=target, packed_file=packed_file) for a in argv])
    assert_clean(r, 2)
    assert f"-o {target} is a directory" in r.stderr and "hint: give a file path" in r.stderr, r.stderr
    assert (target / "inside.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]


def test_decompress_onto_the_working_directory_is_refused(tmp_path, packed):
    """decompress x.ckz -o . --force was an internal error (EBUSY renaming "."); -o naming the
    working directory (or a directory holding it) would delete the directory the user is in."""
    here = tmp_path / "work" / "inner"
    here.mkdir(parents=True)
    (here / "keep.txt").write_text("keep me")
    before = tree_digests(tmp_path)
    for out, says in (
        (".", "-o .: expected the name of a new directory"),
        ("..", "-o ..: expected the name of a new directory"),
        (str(tmp_path / "work"), f"-o {tmp_path / 'work'} holds the current working directory"),
    ):
        r = run_cli("decompress", packed, "-o", out, "--force", cwd=here)
        assert_clean(r, 2)
        assert says in r.stderr and "hint:" in r.stderr, (out, r.stderr)
    assert tree_digests(tmp_path) == before


def test_an_operating_system_error_is_one_clean_line_naming_the_path(capsys):
    """An OSError the library does not anticipate (a full or read-only disk, permissions) is the
    environment's answer, not a bug: exit 3 and the path, never "internal error"."""
    import typer

    from ckpttool.cli import _handles_errors

    @_handles_errors
    def command() -> None:
        raise PermissionError(13, "Permission denied", "/data/ckpt/step_1000/.metadata")

    with pytest.raises(typer.Exit) as exit_info:
        command()
    assert exit_info.value.exit_code == 3
    err = capsys.readouterr().err
    assert "/data/ckpt/step_1000/.metadata: permission denied" in err, err
    assert "internal error" not in err and "bug" not in err


# -- B: a missing container -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (["decompress", "nope.ckz", "-o", "out"], "nope.ckz"),
        (["delta", "apply", FSDP2, "nope.delta", "-o", "out"], "nope.delta"),
        (["delta", "info", "nope.delta"], "nope.delta"),
    ],
    ids=["decompress", "delta-apply", "delta-info"],
)
def test_a_missing_container_is_not_found_not_damaged(argv, name, tmp_path):
    """A container that is not there read as "cut short or damaged" with a hint about an
    interrupted copy; it is a path that does not exist, as 'verify /nonexistent' says."""
    r = run_cli(*argv, cwd=tmp_path)
    assert_clean(r, 3)
    assert f"error: {name}: no such file" in r.stderr, r.stderr
    assert "cut short" not in r.stderr and "interrupted" not in r.stderr, r.stderr
    assert "hint: check the path" in r.stderr
    assert list(tmp_path.iterdir()) == []  # no output, no temporary
    like = run_cli("verify", tmp_path / "nonexistent")  # what a missing input gives elsewhere
    assert like.code == r.code and "no such file" in like.stderr


def test_a_directory_given_as_a_container_says_so(tmp_path):
    r = run_cli("decompress", FSDP2, "-o", tmp_path / "out")
    assert_clean(r, 3)
    assert f"{FSDP2}: is a directory; expected a file written by" in r.stderr, r.stderr
    assert "cut short" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_decompress_refusal_names_a_compressed_checkpoint_not_a_delta(tmp_path, packed):
    """-o holding the input was refused as "holds the delta" for a .ckz."""
    ckz = tmp_path / "x.ckz"
    shutil.copy(packed, ckz)
    r = run_cli("decompress", ckz, "-o", tmp_path, "--force")
    assert_clean(r, 2)
    assert f"-o {tmp_path} holds the compressed checkpoint {ckz}" in r.stderr, r.stderr
    assert "delta" not in r.stderr
    assert ckz.read_bytes() == packed.read_bytes()


# -- C: findings reach a log whole, with their hints ----------------------------------------------


@pytest.fixture
def truncated(tmp_path) -> Path:
    path = tmp_path / "trunc"
    shutil.copytree(FSDP2, path)
    os.truncate(path / "__1_0.distcp", 51_753)
    return path


# (the end of the file's last record, its size as saved: 103,506 bytes; the message named the end
# of the first record past the cut, 53,306, which said nothing of how much was lost)
MESSAGE = (
    "__1_0.distcp is 51,753 bytes but .metadata places data through byte 103,506: cut short (a copy or save "
    "interrupted), or another file in its place"
)


def test_piped_human_output_never_cuts_a_finding(truncated):
    """Piped at the default 80 columns the finding was cut ("… places dat…") and its hint never
    shown. Off a terminal each finding now stays whole on one line, its hint on the next."""
    r = run_cli("verify", truncated, env={"COLUMNS": "80"})
    assert r.code == 1, r.stderr
    lines = r.stdout.splitlines()
    row = next(ln for ln in lines if "truncated-file" in ln)
    assert row.split(None, 2) == ["ERROR", "truncated-file", MESSAGE], row
    after = lines[lines.index(row) + 1]
    assert after.strip() == "hint: restore the file from its source; 'ckpttool verify' lists every damaged file"
    assert "…" not in r.stdout
    assert all(ln == ln.rstrip() for ln in lines)  # no padding to the table's width


def _on_a_terminal(*args: str | os.PathLike[str], columns: int) -> tuple[int, str]:
    """Run the CLI with stdout on a pseudo-terminal ``columns`` wide; its exit code and output."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpttool", *map(str, args)],
        stdout=follower,
        stderr=subprocess.DEVNULL,
        env=cli_env(COLUMNS=str(columns), TERM="xterm"),
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    text = b"".join(chunks).decode().replace("\r\n", "\n")
    return proc.wait(timeout=120), re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)  # (bold, dim: styles, not colours)


def test_terminal_output_wraps_a_finding_within_the_width(truncated):
    """On a terminal the FINDING column wraps at the terminal's width (no ellipsis): every word of
    the message and of its hint is there, and no line is wider than the terminal."""
    code, text = _on_a_terminal("verify", truncated, columns=80)
    assert code == 1, text
    lines = text.splitlines()
    assert all(len(ln) <= 80 for ln in lines), text
    start = next(i for i, ln in enumerate(lines) if "truncated-file" in ln)
    column = lines[start].index("__1_0.distcp")
    cell = []
    for ln in lines[start:]:
        if not ln.strip() or (cell and not ln.startswith(" ")):  # a blank line or the next finding
            break
        cell.append(ln[column:].strip())
    assert (
        " ".join(cell)
        == MESSAGE + " hint: restore the file from its source; 'ckpttool verify' lists every damaged file"
    )
    assert "…" not in text


# -- D: a grouped line says what it groups -----------------------------------------------------------


def test_grouped_findings_without_files_or_items_list_what_they_are(tmp_path):
    """Four missing-state warnings grouped into "4 findings (...): " and listed nothing, in the
    human output and in the GitHub step summary and annotations."""
    path = FIXTURES / "rankshards" / "pipeline"
    missing = "no optimizer state, RNG state, dataloader position, LR scheduler state in the checkpoint"
    r = run_cli("verify", path)
    assert r.code == 0, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if "missing-state" in ln)
    assert row.endswith(f"4 findings (training state a resume needs is absent): {missing}"), row
    assert "hint: save it with the checkpoint" in r.stdout

    summary = tmp_path / "summary.md"
    gh = run_cli("verify", path, env={"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary)})
    assert gh.code == 0, gh.stderr
    rows = [ln for ln in summary.read_text().splitlines() if "missing-state" in ln]
    assert len(rows) == 1 and rows[0].endswith(f": {missing} |"), rows
    assert (
        f"::warning title=ckpttool missing-state::4 findings (training state a resume needs is absent): {missing}"
        in (gh.stderr)
    )


def test_group_line_lists_names_once_and_messages_when_there_are_none():
    from ckpttool.reports import Group
    from ckpttool.verify import Finding

    named = Group(
        "missing-file",
        "error",
        tuple(
            Finding(rule="missing-file", severity="error", message=f"{n} is missing", file=n, rank=r)
            for r, n in enumerate("aabcd")
        ),
    )
    assert named.line == "5 findings (a file the checkpoint needs is absent), ranks 0, 1, 2, 3, 4: a, b, c, d"
    mixed = Group(
        "corrupt-file",
        "error",
        (
            Finding(rule="corrupt-file", severity="error", message="x.pt: bad zip", file="x.pt"),
            Finding(rule="corrupt-file", severity="error", message="the index is damaged"),
            Finding(rule="corrupt-file", severity="error", message="the index, again, is damaged"),
            Finding(rule="corrupt-file", severity="error", message="y.pt: bad zip", file="y.pt"),
        ),
    )
    assert mixed.line.endswith(": x.pt; the index is damaged; the index, again, is damaged; y.pt"), mixed.line
    assert mixed.hints == []


# -- E: a hostile name keeps a Markdown row one row ----------------------------------------------------


def test_a_newline_in_a_tensor_name_keeps_the_step_summary_row_one_row(tmp_path):
    """The step summary escaped "|" but not a newline: a tensor named "evil\\nname|x" split its
    row in two (and could forge one). Every row is now one line; the name shows its escapes."""
    import numpy as np
    from safetensors.numpy import save_file

    bad = np.array([1.0, float("nan")], dtype=np.float32)
    ckpt = tmp_path / "hostile.safetensors"
    save_file({"evil\nname|x": bad, "two\r\n| error | `forged` | row": bad, "ok": np.ones(2, np.float32)}, ckpt)
    summary = tmp_path / "summary.md"
    r = run_cli("verify", ckpt, "--deep", env={"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(summary)})
    assert r.code == 1, r.stderr
    text = summary.read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert len(rows) == 1 + 3, text  # the header, two nonfinite findings, the grouped missing-state
    assert all(ln.endswith(" |") and ln.count(" | ") == 2 for ln in rows), text  # escaped pipes are "\|"
    assert not any("forged" in ln and ln.startswith("| error | `forged`") for ln in text.splitlines())
    assert "evil\\\\nname\\|x" in text, text  # the newline as \n (its backslash escaped), the pipe as \|
    # the human output keeps the names on one line too
    row = next(ln for ln in r.stdout.splitlines() if "evil" in ln)
    assert "evil\\nname|x: 1 NaN" in row, r.stdout
    assert not any(ln.startswith("| error") for ln in r.stdout.splitlines())


def test_step_summary_cells_escape_markup_and_junit_stays_well_formed():
    import xml.etree.ElementTree as ET

    from ckpttool.reports import github_annotations, github_summary, junit
    from ckpttool.verify import Finding, VerifyReport

    report = VerifyReport(
        path="ck\npt",
        format="dcp",
        findings=[
            Finding(
                rule="nonfinite",
                severity="error",
                message="a\\|b<!-- c\x1b[2J\x00: 1 NaN",
                item="a\\|b<!-- c\x1b[2J\x00",
            )
        ],
    )
    text = github_summary(report)
    row = next(ln for ln in text.splitlines() if "nonfinite" in ln)
    assert row == "| error | `nonfinite` | a\\\\\\|b\\<!-- c\\\\x1b\\[2J\\\\x00: 1 NaN |", row
    assert "`ck\\npt`" in text
    # a backtick in the path: the span's fence is longer than any run inside it (it ended the span)
    for path, span in (("ck`pt", "``ck`pt``"), ("`a``b", "``` `a``b ```")):
        for failing in (report, VerifyReport(path=path, error="no metadata")):
            failing.path = path
            line = next(ln for ln in github_summary(failing).splitlines() if ln.startswith("`"))
            assert line.startswith((span + " ", span + ":")), line
    root = ET.fromstring(junit(report).split("?>", 1)[1])  # parses: no raw control characters
    assert root.get("failures") == "1"
    # the annotations spelled ESC and NUL out raw (a terminal showing the Actions log ran them)
    (line,) = github_annotations(report).splitlines()
    assert line.isprintable() and "c\\x1b[2J\\x00: 1 NaN" in line, line
    # an entity in a name rendered as the bidi override it spells (the cells spell such characters out)
    spoof = VerifyReport(path="ck", format="dcp", findings=[Finding(rule="nonfinite", severity="error", message="w&#8238;x: 1 NaN")])
    assert "w\\&#8238;x" in github_summary(spoof)


def test_junit_and_annotations_spell_out_a_hostile_checkpoint_path_and_file_name():
    """The JUnit testcases named the checkpoint by its raw path: an escape character made the file
    malformed XML, a byte that is not UTF-8 an internal error after stdout had said "ok". A
    newline in a file name became GitHub's %0A, a real line break in the annotation."""
    import xml.etree.ElementTree as ET

    from ckpttool.reports import github_annotations, junit
    from ckpttool.verify import Finding, VerifyReport

    for path in ("ck\x1b[31mpt", "ck\udcffpt"):  # (a non-UTF-8 byte, as os.fsdecode gives it)
        report = VerifyReport(path=path, format="dcp", findings=[])
        text = junit(report)
        text.encode()  # (it raised UnicodeEncodeError)
        root = ET.fromstring(text.split("?>", 1)[1])
        assert all(path not in case.get("name", "") for case in root), text
    extra = [Finding(rule="extra-file", severity="warning", message=f"{n}: not part of the checkpoint", file=n) for n in ("a", "b", "c", "nl\nx")]
    lines = github_annotations(VerifyReport(path="ck", format="dcp", findings=extra)).splitlines()
    assert len(lines) == 1 and "%0A" not in lines[0] and lines[0].endswith("a, b, c, nl\\nx"), lines


_COMMAND = re.compile(r"##(vso)?\[|^\s*::")
"""what a CI runner reads as a command in a line of its log (GitHub's ``##[name]`` anywhere and
``::name::`` at the start, Azure's ``##vso[name]``)"""


@pytest.mark.parametrize("colour", ["", "1"])
def test_a_tensor_name_never_becomes_a_ci_runner_command(tmp_path, colour):
    """A tensor named "x ##[stop-commands]tok" in the findings table (or in --json) made the GitHub
    runner ignore every ::error ckpttool wrote after it; with FORCE_COLOR (colour in the CI log)
    rich wrapped the table at 80 columns and a name's "::error::…" started a line of its own, a
    forged annotation. The only commands in the output are now ckpttool's own annotations."""
    import numpy as np
    from safetensors.numpy import save_file

    bad = np.array([1.0, float("nan")], dtype=np.float32)
    words = " ".join(["::error::forged"] * 12)
    ckpt = tmp_path / "ck.safetensors"
    save_file({"x ##[stop-commands]tok": bad, f"y {words}": bad, "z ##vso[task.complete]": bad}, ckpt)
    env = {"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"), "FORCE_COLOR": colour,
           "COLUMNS": "80"}  # fmt: skip
    for json_out in ([], ["--json"]):
        r = run_cli("verify", ckpt, "--deep", *json_out, env=env)
        assert r.code == 1, r.stderr
        ours = [ln for ln in r.stderr.splitlines() if ln.startswith(("::error title=ckpttool ", "::warning title="))]
        assert len(ours) == 4, r.stderr  # three nonfinite findings, one missing-state
        others = [ln for ln in (r.stdout + "\n" + r.stderr).splitlines() if ln not in ours]
        assert not [ln for ln in others if _COMMAND.search(re.sub(r"\x1b\[[0-9;]*m", "", ln))], r.stdout
        if not json_out:
            assert "x \\x23#[stop-commands]tok" in r.stdout  # spelled out, not dropped
        else:
            names = {f["item"] for f in json.loads(r.stdout)["findings"] if f["rule"] == "nonfinite"}
            assert "x ##[stop-commands]tok" in names  # JSON reads the \u0023 back as "#"


def test_paths_in_a_command_s_last_line_are_text_not_markup(tmp_path):
    """seal printed "sealed … : smx/…" for a checkpoint at "sm[red]x" (the tag taken as a colour),
    and with --out "sm[/].json" wrote the seal, then exited 3 with "internal error: MarkupError"."""
    ck = tmp_path / "sm[red]x"
    shutil.copytree(FSDP2, ck)
    (tmp_path / "sm[").mkdir()
    out = tmp_path / "sm[/].json"  # (the file "].json" in the folder "sm[")
    r = run_cli("seal", ck, "--out", out)
    assert r.code == 0, r.stderr
    assert r.stdout.rstrip().endswith(str(out)), r.stdout
    r = run_cli("export", ck, "-o", tmp_path / "sm[/]out.safetensors")
    assert r.code == 0, r.stderr
    assert r.stdout.rstrip().endswith("sm[/]out.safetensors"), r.stdout


def test_a_note_on_stderr_is_never_wrapped_in_a_log(tmp_path):
    """export's note of the values it leaves out was wrapped at 80 columns on stderr (no terminal):
    a line began with the next word of a name, "::error::…", which the runner took for a command."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.ones(2), **{f"o{i} ::error::forged-by-note": i for i in range(6)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    r = run_cli("export", tmp_path / "ck", "-o", tmp_path / "out.safetensors", env={"FORCE_COLOR": "1", "COLUMNS": "60"})
    assert r.code == 0, r.stderr
    (note,) = [ln for ln in r.stderr.splitlines() if "not written" in ln]
    assert len(note) > 60 and "forged-by-note" in note, r.stderr


def test_a_narrow_terminal_still_shows_every_finding(truncated):
    """At 24 columns rich shrank the FINDING column to nothing: the findings' text and hints were
    gone. A terminal too narrow to wrap a finding gets it on one line instead."""
    code, text = _on_a_terminal("verify", truncated, columns=24)
    assert code == 1, text
    assert MESSAGE in text and "hint: restore the file from its source" in text, text


def test_a_megabyte_name_does_not_make_github_drop_the_summary():
    """Two NaN tensors with names of a million characters made a 2.4 MB step summary (GitHub drops
    one over 1 MiB whole) and 2.4 MB annotation lines. Each line is cut there; --json and the
    report files keep the names whole."""
    from ckpttool.reports import github_annotations, github_summary
    from ckpttool.verify import Finding, VerifyReport

    names = ["a" * 1_200_000, "b" * 1_200_000]
    report = VerifyReport(
        path="ck",
        format="safetensors",
        findings=[Finding(rule="nonfinite", severity="error", message=f"{n}: 1 NaN", item=n) for n in names],
    )
    summary, notes = github_summary(report), github_annotations(report)
    assert len(summary) < 5000 and summary.count("…") == 2, len(summary)
    assert all(len(ln) < 1100 for ln in notes.splitlines()) and len(notes.splitlines()) == 2


def test_json_keys_spelled_alike_are_both_kept():
    """A tensor named "a\\udcff" (a lone surrogate: pickle allows it in a DCP .metadata) is spelled
    "a\\xff" in JSON, the name of another tensor: its statistics overwrote the other's."""
    from ckpttool.cli._output import dumps

    assert json.loads(dumps({"a\udcff": 1, "a\\xff": 2})) == {"a\\udcff": 1, "a\\xff": 2}
    assert json.loads(dumps({"a\\xff": 2, "a\udcff": 1})) == {"a\\xff": 2, "a\\udcff": 1}
    assert json.loads(dumps({"b\udcff": 1})) == {"b\\xff": 1}


def test_a_file_name_that_is_not_utf8_is_shown_by_its_bytes(tmp_path):
    """A sealed file whose name is not UTF-8, then deleted: the JSON report named it with a lone
    surrogate ("\\udcff"), which jq and other strict readers turn into U+FFFD (the name lost), and
    the human report showed "\\udcff" where the byte was 0xff. Both spell the byte: \\xff."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ck)
    odd = os.path.join(os.fsencode(ck), b"extra_\xff.bin")
    with open(odd, "wb") as fh:
        fh.write(b"x")
    assert run_cli("seal", ck).code == 0
    os.unlink(odd)
    r = run_cli("verify", ck, "--json")
    assert r.code == 1, r.stderr
    report = json.loads(r.stdout)  # (read as strict UTF-8)
    assert [f["file"] for f in report["findings"]] == ["extra_\\xff.bin"], report["findings"]
    assert "\\udc" not in r.stdout
    human = run_cli("verify", ck)
    assert human.code == 1 and "extra_\\xff.bin: in the seal but not on disk" in human.stdout, human.stdout
    # the seal itself keeps the name exactly (it must find the file again): a second seal after
    # the file comes back verifies clean
    with open(odd, "wb") as fh:
        fh.write(b"x")
    assert run_cli("verify", ck).code == 0


def test_a_grouped_line_keeps_the_files_of_one_item_found_in_several():
    """Each rank's copy of one tensor failing its CRC: the line listed the tensor's name once,
    and which files (and that the list went on) was lost."""
    from ckpttool.reports import Group
    from ckpttool.verify import Finding

    found = tuple(
        Finding(rule="checksum-mismatch", severity="error", message="bad", file=f"__{r}_0.distcp", item="model.pos", rank=r)
        for r in range(8)
    )
    line = Group("checksum-mismatch", "error", found).line
    assert line.endswith(
        "ranks 0, 1, 2, 3, 4, 5, 6, 7: model.pos in __0_0.distcp, model.pos in __1_0.distcp, model.pos in __2_0.distcp, "
        "model.pos in __3_0.distcp, model.pos in __4_0.distcp, model.pos in __5_0.distcp … (2 more; --json lists every "
        "finding)"
    ), line


def test_hostile_names_reach_no_terminal_raw_in_ls_inspect_or_diff(tmp_path):
    """Tensor names are the checkpoint's to choose: an escape sequence in one (``\\x1b]...``: set
    the title, rewrite the screen) or a newline (a forged row) is shown spelled out, in every
    human output; the JSON keeps the name as it is."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    hostile = "w\x1b[2J\x1b]0;owned\x07\nforged | row\u202e"
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({hostile: np.zeros(4, np.float32), "ok": np.ones(2, np.float32)}, a)
    nan = np.array([float("nan"), 1, 1, 1], np.float32)
    save_file({hostile: nan, "ok": np.ones(2, np.float32), f"new{hostile}": np.ones(1, np.float32)}, b)
    for argv in (("ls", a), ("inspect", a), ("diff", a, b), ("verify", b, "--deep")):
        r = run_cli(*argv)
        assert r.code in (0, 1), (argv, r.stderr)
        for text in (r.stdout, r.stderr):
            assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, (argv, text)
            assert "forged" not in text or all(
                "forged" not in ln or "\\n" in ln for ln in text.splitlines()
            ), (argv, text)  # the name never starts a line of its own
        if argv[0] != "inspect":
            assert "w\\x1b[2J" in r.stdout, (argv, r.stdout)
    listed = json.loads(run_cli("ls", a, "--json").stdout)
    assert hostile in {i["name"] for i in listed["items"]}


def test_outputs_that_are_links_devices_or_too_long_are_refused_before_work(tmp_path):
    """-o naming a dangling symbolic link replaced it without --force; a FIFO (or, as root, a device
    node such as /dev/null) was replaced with --force; a name the file system takes but not its
    temporary sibling's longer one failed after the work, exit 3. All are refused first, exit 2."""
    src = FIXTURES / "dcp" / "fsdp2"
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    r = run_cli("convert", src, "-o", link, "--to", "dcp")
    assert r.code == 2 and "is a symbolic link to" in r.stderr and "which does not exist" in r.stderr, r.stderr
    assert link.is_symlink() and not link.exists()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for extra in ((), ("--force",)):
        r = run_cli("reshard", src, "-o", fifo, "--dp", "2", *extra)
        assert r.code == 2 and "is a named pipe" in r.stderr, r.stderr
    r = run_cli("export", src, "-o", fifo, "--force")
    assert r.code == 2 and "is a named pipe" in r.stderr, r.stderr
    long = tmp_path / ("a" * 240)
    r = run_cli("convert", src, "-o", long, "--to", "dcp")
    assert r.code == 2 and "too long for this file system" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "fifo"]


def test_a_step_summary_inside_the_checkpoint_is_not_appended_to(tmp_path):
    """GITHUB_STEP_SUMMARY naming a file of the checkpoint got the Markdown appended to it, a data
    file modified by verify (exit 0). --report and --junit refused such paths; the summary, the
    runner's file, is now left alone with a warning, and the verdict stands."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "dcp" / "fsdp2", ckpt)
    target = ckpt / "__1_0.distcp"
    before = target.read_bytes()
    r = run_cli("verify", ckpt, env={"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(target)})
    assert r.code == 0 and target.read_bytes() == before, r.stderr
    assert "the step summary was not written: GITHUB_STEP_SUMMARY is inside the checkpoint" in " ".join(r.stderr.split())
    # a hard link to a checkpoint file, outside it: the same file (the path check let it through)
    linked = tmp_path / "summary.md"
    os.link(target, linked)
    r = run_cli("verify", ckpt, env={"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(linked)})
    assert r.code == 0 and target.read_bytes() == before, r.stderr
    assert "GITHUB_STEP_SUMMARY is a hard link to" in " ".join(r.stderr.split()), r.stderr
    one = tmp_path / "one" / "train_state.pt"  # (a checkpoint of one file: that file)
    one.parent.mkdir()
    shutil.copy2(FIXTURES / "torch" / "train_state.pt", one)
    kept = one.read_bytes()
    os.link(one, tmp_path / "one.md")
    r = run_cli("verify", one, env={"GITHUB_ACTIONS": "true", "GITHUB_STEP_SUMMARY": str(tmp_path / "one.md")})
    assert r.code == 0 and one.read_bytes() == kept and "is a hard link to" in " ".join(r.stderr.split()), r.stderr


def test_a_torch_dist_save_without_its_metadata_is_named_by_the_path_given(tmp_path):
    """The DCP reader names the iteration folder by the path it was given; the save directory's
    reader then prefixed it with the iteration's name again ("iter_0000003/ck/iter_0000003: …")."""
    ck = tmp_path / "ck"
    shutil.copytree(FIXTURES / "megatron" / "dist_tp2pp2", ck)
    (ck / "iter_0000003" / ".metadata").unlink()
    r = run_cli("convert", "ck", "-o", "out", cwd=tmp_path)
    assert r.code == 3 and r.stderr.startswith("error: ck/iter_0000003: DCP checkpoint without .metadata"), r.stderr
    r = run_cli("convert", ".", "-o", tmp_path / "out", cwd=ck)
    assert r.code == 3 and r.stderr.startswith("error: iter_0000003: DCP checkpoint without .metadata"), r.stderr


def test_a_write_refused_names_the_output_not_its_hidden_temporary():
    """-o where the file system refuses the write though access() allowed it (root on sysfs, a
    network file system's server-side permissions): the error named the writer's hidden temporary
    ('/sys/.out.ckpttool-tmp-host-1-…: permission denied'), a name the user never gave."""
    import errno

    from ckpttool.io import os_error_line
    from ckpttool.io import published_as

    tmp = "/data/.out.ckpttool-tmp-node7-123-0a1b2c3d"
    said = os_error_line(PermissionError(errno.EACCES, "Permission denied", tmp))
    assert said == "/data/out: permission denied while writing it (nothing was published)", said
    assert published_as(tmp + "/iter_0000003/common.pt") == "/data/out/iter_0000003/common.pt"
    # the seal's own temporary inside the staging directory (a disk full as the seal is written)
    inner = tmp + "/.ckpttool.manifest.json.ckpttool-tmp-node7-123-9f8e7d6c"
    assert published_as(inner) == "/data/out/ckpttool.manifest.json", published_as(inner)
    assert published_as("/data/.hidden/model.pt") is None and published_as("/data/out") is None
    said = os_error_line(PermissionError(errno.EACCES, "Permission denied", "/data/.hidden"))
    assert said == "/data/.hidden: permission denied", said


@pytest.mark.parametrize("argv", [["convert", "--to", "dcp"], ["reshard", "--dp", "2"]], ids=["convert", "reshard"])
def test_a_refused_staging_directory_is_said_of_the_output(argv, tmp_path, monkeypatch):
    """The whole path: the file system refuses the writer's hidden staging directory (access()
    said yes), and the command's one line names -o, exit 3, nothing left behind."""
    import errno

    from typer.testing import CliRunner

    from ckpttool.cli import app
    from ckpttool.io import TMP_MARKER

    real = os.mkdir

    def refused(path, *args, **kwargs):
        if TMP_MARKER in os.fspath(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refused)
    out = tmp_path / "out"
    r = CliRunner().invoke(app, [argv[0], str(FSDP2), "-o", str(out), *argv[1:]])
    said = " ".join(r.output.split())
    assert r.exit_code == 3 and f"error: {out}: permission denied while writing it (nothing was published)" in said, said
    assert TMP_MARKER not in said and "Traceback" not in said and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["convert", FSDP2, "-o", "{dir}", "--to", "safetensors", "--force"],
        ["reshard", FSDP2, "-o", "{dir}", "--dp", "2", "--force"],
        ["reshard", FSDP2, "-o", "{dir}", "--dp", "2", "--force", "--dry-run"],
    ],
    ids=["convert", "reshard", "reshard --dry-run"],
)
def test_force_replaces_an_earlier_output_not_a_directory_of_other_data(argv, tmp_path):
    """--force replaced whatever directory -o named: a typo's neighbour, a home directory, a
    dataset went with the publishing rename. Now only a checkpoint (an earlier output) or an
    empty directory is replaced; anything else is refused before any work, left as it was."""
    other = tmp_path / "data"
    (other / "sub").mkdir(parents=True)
    (other / "notes.txt").write_text("keep me")
    before = tree_digests(other)
    r = run_cli(*[str(a).replace("{dir}", str(other)) for a in argv])
    assert_clean(r, 2, "is a directory that holds no checkpoint ckpttool reads (notes.txt, sub/)", "--force replaces")
    assert tree_digests(other) == before and (other / "sub").is_dir()
    assert run_cli(*[str(a).replace("{dir}", str(tmp_path / "empty")) for a in argv]).code == 0
    (tmp_path / "empty").mkdir(exist_ok=True)
    assert run_cli(*[str(a).replace("{dir}", str(tmp_path / "empty")) for a in argv]).code == 0
    if "--dry-run" not in argv:  # an earlier output is replaced
        assert registry_format(tmp_path / "empty") in ("safetensors", "dcp")
        assert run_cli(*[str(a).replace("{dir}", str(tmp_path / "empty")) for a in argv]).code == 0


@pytest.mark.parametrize(
    ("setup", "said"),
    [
        ("file", "is a file; this command writes a directory"),
        ("run", "holds emptydir/, iter_0000001/, tensorboard/ and 1 more beside the checkpoint in it"),
        ("project", "holds code/ beside the checkpoint in it"),
        ("sealed", "holds iter_0000003/extra.txt beside the checkpoint in it"),
        ("beside", "holds train.py beside the checkpoint in it"),
    ],
)
def test_force_replaces_no_data_beside_a_checkpoint(setup, said, tmp_path):
    """--force replaced any directory in which a checkpoint was detected, whatever else it held (a
    run's directory: its other saves, its logs; a project: its code beside a model file), and a
    plain file, with a directory. It replaces an earlier output only: every file its seal lists,
    or, unsealed, every file its format accounts for (and a save directory's tracker)."""
    out = tmp_path / "out"
    if setup == "file":
        out.write_text("my notes")
    elif setup == "run":
        shutil.copytree(FIXTURES / "megatron" / "legacy_tp2pp2", out)
        shutil.copytree(out / "iter_0000003", out / "iter_0000001")
        (out / "tensorboard").mkdir()
        (out / "tensorboard" / "events").write_text("ev")
        (out / "train.log").write_text("log")
        (out / "emptydir").mkdir()
    elif setup == "project":
        (out / "code").mkdir(parents=True)
        (out / "code" / "train.py").write_text("print(1)")
        shutil.copy2(FIXTURES / "safetensors" / "model.safetensors", out)
    elif setup == "beside":  # a DeepSpeed save (its zero_to_fp32.py is its own) and a script beside it
        shutil.copytree(FIXTURES / "deepspeed" / "zero2", out)
        (out / "train.py").write_text("print(1)")
    else:  # an earlier output, sealed, with a file added to its iteration since
        assert run_cli("reshard", FIXTURES / "megatron" / "legacy_tp2pp2", "-o", out, "--to", "megatron-dist").code == 0
        (out / "iter_0000003" / "extra.txt").write_text("mine")
    before = tree_digests(out) if out.is_dir() else out.read_bytes()
    r = run_cli("reshard", FIXTURES / "dcp" / "fsdp2", "-o", out, "--dp", "2", "--force")
    assert_clean(r, 2, said, "--force replaces")
    assert (tree_digests(out) if out.is_dir() else out.read_bytes()) == before


@pytest.mark.parametrize(
    "argv",
    [
        ("reshard", FIXTURES / "megatron" / "legacy_tp2pp2", "--to", "megatron-dist"),
        ("reshard", FIXTURES / "megatron" / "legacy_tp2pp2", "--tp", "1", "--pp", "1"),
        ("reshard", FIXTURES / "deepspeed" / "zero2", "--to", "deepspeed-universal"),
        ("reshard", FIXTURES / "deepspeed" / "zero2", "--dp", "1"),
        ("reshard", FIXTURES / "dcp" / "fsdp2", "--dp", "2"),
    ],
)
@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "unsealed"])
def test_force_replaces_an_earlier_output_of_every_kind(argv, sealed, tmp_path):
    """An earlier output is replaced, sealed or not, its save directory's tracker and seal with it."""
    out = tmp_path / "out"
    flags = () if sealed else ("--no-seal",)
    assert run_cli(*argv[:2], "-o", out, *argv[2:], *flags).code == 0
    r = run_cli(*argv[:2], "-o", out, *argv[2:], *flags, "--force")
    assert r.code == 0, r.stderr
    if sealed:  # one that lost a file since (verify said so): written again
        lost = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "ckpttool.manifest.json")[-1]
        lost.unlink()
        r = run_cli(*argv[:2], "-o", out, *argv[2:], "--force")
        assert r.code == 0 and lost.is_file(), r.stderr


def registry_format(path):
    from ckpttool import registry

    return registry.detect(path).name


def test_a_file_or_folder_of_a_checkpoint_names_the_checkpoint(tmp_path):
    """A DCP checkpoint's .metadata, or a universal checkpoint's zero/ folder, given alone: "not a
    checkpoint format" with every format's reason (the .metadata: "not a torch.save file (magic
    8004957d)"), or "a folder of 4 checkpoints (torch)" of 4 of zero/'s 18 parameter folders. Each
    names the checkpoint it is part of; a folder that is no file of the checkpoint above it (a folder
    kept beside a model) is not called part of it."""
    dcp = FIXTURES / "dcp" / "fsdp2"
    for part, what in ((dcp / ".metadata", "file"), (dcp / "__0_0.distcp", "file")):
        assert_clean(run_cli("verify", part), 3, f"{part}: one {what} of the dcp checkpoint {dcp}: give that")
    universal = FIXTURES / "deepspeed" / "universal" / "global_step3_universal"
    r = run_cli("inspect", universal / "zero")
    assert_clean(r, 3, f"one folder of the deepspeed checkpoint {universal}: give that")
    assert f"hint: give the checkpoint it is part of: {universal}" in r.stderr
    beside = tmp_path / "m"
    (beside / "notes").mkdir(parents=True)
    (beside / "notes" / "x.txt").write_text("x")
    shutil.copy2(FIXTURES / "safetensors" / "model.safetensors", beside)
    assert_clean(run_cli("verify", beside / "notes"), 3, "not a checkpoint format ckpttool reads")


def test_a_folder_of_checkpoints_names_them_and_the_one_to_give(tmp_path):
    """A run's output folder (checkpoint-90, checkpoint-500, … or step_10, step_20) given where one
    checkpoint was meant got "not a checkpoint format ckpttool reads" and every format's reason
    why not, and a hint to give "the one holding the metadata file". It is said to be a folder of
    checkpoints, they are named in the order of their numbers, and the last is the one to give."""
    run = tmp_path / "run"
    run.mkdir()
    for n in (90, 500, 1000):
        shutil.copytree(FIXTURES / "hf" / "trainer" / "checkpoint-3", run / f"checkpoint-{n}")
    (run / "runs").mkdir()  # (a tensorboard folder beside them: not a checkpoint)
    for command in ("inspect", "verify"):
        r = run_cli(command, run)
        assert_clean(r, 3, f"{run}: a folder of 3 checkpoints (safetensors), not one: checkpoint-90, checkpoint-500, checkpoint-1000")
        assert f"hint: give one of them; the last by the number in its name is {run / 'checkpoint-1000'}" in r.stderr
        assert "megatron" not in r.stderr, r.stderr  # (not every format's reason)
    two = tmp_path / "two"  # (names holding digits, not a run's numbered saves: no "last by its number")
    for name in ("fsdp2", "mesh2x2"):
        shutil.copytree(FIXTURES / "dcp" / name, two / name)
    r = run_cli("verify", two)
    assert_clean(r, 3, "a folder of 2 checkpoints (dcp), not one: fsdp2, mesh2x2")
    assert f"hint: give one of them, such as {two / 'fsdp2'}" in r.stderr, r.stderr
    r = run_cli("inspect", FIXTURES / "hf" / "trainer")
    assert_clean(r, 3, "a folder holding the checkpoint checkpoint-3 (safetensors), not a checkpoint itself")
    assert f"hint: give the checkpoint itself: {FIXTURES / 'hf' / 'trainer' / 'checkpoint-3'}" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_clean(run_cli("inspect", empty), 3, "not a checkpoint format ckpttool reads")
    # detect, which readers call on the folders above a rank file, does not look into sub-folders
    from ckpttool import registry
    from ckpttool.errors import FormatNotRecognizedError

    with pytest.raises(FormatNotRecognizedError, match="not a checkpoint format ckpttool reads"):
        registry.detect(run)


@pytest.mark.parametrize("where", ["name", "folder"])
def test_an_output_name_longer_than_file_systems_allow_is_a_usage_error(where, tmp_path):
    """A 300-byte output name raised ENAMETOOLONG from the first look at the path, which the CLI
    reported as a failed write (exit 3, "check free space"): it is the user's path (exit 2)."""
    long = "x" * 300
    out = tmp_path / long if where == "name" else tmp_path / long / "out"
    r = run_cli("reshard", FIXTURES / "dcp" / "fsdp2", "-o", out, "--dp", "2")
    assert_clean(r, 2, "is 300 bytes, more than the 255 file systems allow")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fixture", ["dcp/fsdp2_hf", "deepspeed/zero2", "hf/trainer/checkpoint-3", "megatron/legacy_tp2pp2"])
def test_force_replaces_an_earlier_decompressed_checkpoint(fixture, tmp_path):
    """decompress restores a checkpoint with the files its writers keep beside the data (DeepSpeed's
    zero_to_fp32.py, a Trainer's config and state, DCP's per-rank Hugging Face shards): unsealed,
    it is still an earlier output that --force replaces."""
    packed, out = tmp_path / "c.ckz", tmp_path / "out"
    assert run_cli("compress", FIXTURES / fixture, "-o", packed).code == 0
    assert run_cli("decompress", packed, "-o", out).code == 0
    r = run_cli("decompress", packed, "-o", out, "--force")
    assert r.code == 0, r.stderr


def test_a_loop_of_symbolic_links_is_named_as_such(tmp_path):
    """A loop of links in an output or input path was "internal error: RuntimeError: Symlink loop"
    (Python 3.11's Path.resolve), "this is a bug"; as an input, "no such file or directory"."""
    (tmp_path / "loop2").symlink_to("loop1")
    (tmp_path / "loop1").symlink_to("loop2")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    src, loop = FIXTURES / "dcp" / "fsdp2", tmp_path / "loop1"
    said = "its symbolic links form a loop (too many levels of symbolic links)"
    for argv in (
        ["reshard", src, "--dp", "2", "-o", loop / "out"],
        ["convert", src, "--to", "torch", "-o", loop / "out"],
        ["export", src, "-o", loop / "x.safetensors"],
        ["verify", src, "--report", loop / "r.json"],
    ):
        assert_clean(run_cli(*argv), 2, said)
    # as the checkpoint: its reader says it, exit 3, and the reports asked for are written
    assert_clean(run_cli("reshard", loop, "-o", tmp_path / "out", "--dp", "2"), 3, f"{loop}: {said}")
    r = run_cli("verify", loop, "--report", tmp_path / "r.json")
    assert r.code == 3 and f"{loop}: {said}" in r.stderr
    assert said in json.loads((tmp_path / "r.json").read_text())["error"]["message"]
    (tmp_path / "r.json").unlink()
    assert_clean(run_cli("seal", src, "--out", loop / "s.json"), 2, said)
    for command in ("inspect", "verify", "ls"):
        assert_clean(run_cli(command, loop), 3, f"{loop}: {said}")
        assert_clean(run_cli(command, tmp_path / "dangling"), 3, "is a symbolic link to", "which does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "loop1", "loop2"]
    # a FIFO named as a temporary never hangs the sweep of stale temporaries (it hung on opening it)
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / ".r.json.ckpttool-tmp-nohost-999999-abcd1234")
    os.mkfifo(fifo / f".r.json.ckpttool-tmp-{socket.gethostname()}-999999-abcd1234")
    assert run_cli("verify", src, "--report", fifo / "r.json", timeout=60).code == 0


def test_reports_replace_earlier_reports_only(tmp_path):
    """--report and --junit replaced any file at their path: a tracker named by mistake was lost."""
    src = FIXTURES / "dcp" / "fsdp2"
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("3")
    for flag in ("--report", "--junit"):
        assert_clean(run_cli("verify", src, flag, tracker), 2, f"{flag} {tracker} exists and is not a", "not replaced")
        assert tracker.read_text() == "3"
    report, junit = tmp_path / "r.json", tmp_path / "j.xml"
    junit.write_text("<?xml version='1.0'?>\n<testsuites><testsuite name='pytest'/></testsuites>\n")  # another tool's
    (tmp_path / "empty.json").touch()
    for _ in range(2):  # an earlier report of its own is replaced
        assert run_cli("verify", src, "--report", report, "--junit", junit).code == 0
        assert json.loads(report.read_text())["ok"] is True and "ckpttool verify" in junit.read_text()
    assert run_cli("verify", src, "--report", tmp_path / "empty.json").code == 0
    assert_clean(run_cli("verify", src, "--junit", report), 2, "is not a JUnit XML report")


@pytest.mark.parametrize("argv", [("inspect",), ("verify",), ("seal",), ("diff",), ("convert", "--to", "torch", "-o", "out")])
def test_a_container_given_as_a_checkpoint_says_how_to_restore_it(argv, tmp_path, packed_file):
    """A file written by compress (or delta create) given where a checkpoint was meant got "not a
    checkpoint format ckpttool reads" and seven formats' reasons: it is named, with the command
    that restores it."""
    args = [*argv[:1], packed_file, *argv[1:]]
    if argv[0] == "diff":
        args = ["diff", packed_file, FIXTURES / "dcp" / "fsdp2"]
    before = tree_digests(packed_file.parent)
    r = run_cli(*args, cwd=tmp_path)
    assert_clean(r, 3, f"{packed_file}: a ckpttool container (written by 'ckpttool compress' or 'ckpttool delta create'), not a checkpoint")
    assert f"hint: restore it first: ckpttool decompress {packed_file} -o DIR" in r.stderr, r.stderr
    assert "megatron" not in r.stderr, r.stderr
    assert tree_digests(packed_file.parent) == before


@pytest.mark.parametrize(
    "argv",
    [("verify", MODEL, "--report", "-"), ("verify", MODEL, "--junit", "-"), ("compress", MODEL, "-o", "-"),
     ("convert", MODEL, "--to", "torch", "-o", "-"), ("export", FSDP2, "-o", "-")],
)  # fmt: skip
def test_a_dash_for_an_output_is_refused_not_a_file_named_dash(argv, tmp_path):
    """`verify --report -` (meant as stdout) wrote a file named '-' into the working directory."""
    r = run_cli(*argv, cwd=tmp_path)
    assert r.code == 2 and "-: ckpttool writes its outputs to files, not to standard output" in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())


def test_export_force_replaces_an_earlier_export_not_other_data(tmp_path):
    """export --force replaced any file named *.safetensors, notes or a config among them, where
    compress, seal --out and the reports refuse to replace other data."""
    other = tmp_path / "x.safetensors"
    other.write_text("data\n")
    assert_clean(run_cli("export", FSDP2, "-o", other, "--force"), 2, "exists and is not a safetensors file (5 bytes): not replaced")
    assert other.read_text() == "data\n"
    earlier = tmp_path / "y.safetensors"
    assert run_cli("export", FSDP2, "-o", earlier).code == 0
    assert run_cli("export", FSDP2, "-o", earlier, "--force", "--kind", "param").code == 0
    empty = tmp_path / "z.safetensors"
    empty.touch()
    assert run_cli("export", FSDP2, "-o", empty, "--force").code == 0


@pytest.mark.parametrize(
    ("argv", "code"),
    [(("inspect", "/nonexistent", "--json"), 3), (("ls", "/nonexistent", "--json"), 3),
     (("diff", "/nonexistent", MODEL, "--json"), 3), (("seal", "/nonexistent", "--json"), 3),
     (("convert", MODEL, "--to", "torch", "-o", "-", "--json"), 2), (("export", "/nonexistent", "-o", "x.safetensors", "--json"), 3)],
)  # fmt: skip
def test_an_error_under_json_is_a_json_document_too(argv, code, tmp_path):
    """Only verify printed JSON on an error: every other command printed nothing on stdout under
    --json, and a script reading it failed on empty input instead of the reason."""
    r = run_cli(*argv, cwd=tmp_path)
    assert r.code == code and "error:" in r.stderr, (r.code, r.stderr)
    doc = json.loads(r.stdout)
    assert doc["schema_version"] == 1 and doc["error"]["exit_code"] == code and doc["error"]["message"], doc
    assert doc["error"]["message"] in r.stderr.replace("\n", " ") or doc["error"]["message"][:40] in r.stderr
    assert json.loads(run_cli("verify", "/nonexistent", "--json").stdout)["ok"] is False  # (verify's own report)


def test_verify_refusing_its_options_under_json_prints_its_report(tmp_path):
    """An option verify refuses before it reads anything (--report -): under --json its report on
    stdout says it did not judge, and why; one document, not the other commands' error one."""
    r = run_cli("verify", MODEL, "--report", "-", "--json", cwd=tmp_path)
    assert r.code == 2 and "not to standard output" in r.stderr, (r.code, r.stderr)
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["findings"] == [] and "exit_code" not in doc["error"], doc
    assert "--report -: ckpttool writes its outputs to files, not to standard output" == doc["error"]["message"]
    assert not list(tmp_path.iterdir())

"""The coordinator command: inspect, verify and bench."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import VECTORS

from coordinator.cli import main
from coordinator.events import EVENT_NAMES

REFERENCE = VECTORS / "reference.flysess"


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_verify_accepts_a_valid_envelope() -> None:
    """verify exits 0 and names the checkpoint."""
    code, out, _ = run("verify", str(REFERENCE))
    assert code == 0
    assert "ok" in out and "ckpt-41" in out


def test_verify_reports_code_and_check_of_a_corrupt_envelope(tmp_path: Path) -> None:
    """verify exits 1 and prints the error code and the failed check."""
    data = bytearray(REFERENCE.read_bytes())
    data[100] ^= 1
    bad = tmp_path / "bad.flysess"
    bad.write_bytes(bytes(data))
    code, _, err = run("verify", str(bad))
    assert code == 1
    assert "envelope.corrupt" in err and "prefix-digest" in err


def test_verify_a_missing_file_exits_3(tmp_path: Path) -> None:
    """An unreadable file is not 'corrupt': it has its own exit status."""
    code, _, err = run("verify", str(tmp_path / "nope.flysess"))
    assert code == 3
    assert "cannot access" in err


def test_verify_an_empty_file_is_corrupt(tmp_path: Path) -> None:
    """A zero-byte file fails the length check (it cannot even be mapped)."""
    empty = tmp_path / "empty.flysess"
    empty.write_bytes(b"")
    code, _, err = run("verify", str(empty))
    assert code == 1
    assert "length" in err


def test_inspect_prints_layout_and_manifest() -> None:
    """inspect shows every payload with offset and digest, and the manifest."""
    code, out, _ = run("inspect", str(REFERENCE))
    assert code == 0
    for text in ("table", "footer", "agent-fly-a", "executor-fly-a", '"checkpointId": "ckpt-41"'):
        assert text in out


def test_inspect_json_is_machine_readable() -> None:
    """inspect --json prints one JSON object with layout, digest and manifest."""
    code, out, _ = run("inspect", "--json", str(REFERENCE))
    assert code == 0
    document = json.loads(out)
    assert document["layout"]["payloadCount"] == 5
    assert document["manifest"]["checkpointId"] == "ckpt-41"
    assert len(document["prefixDigest"]) == 64


def test_bad_command_line_exits_2() -> None:
    """An unknown subcommand is a usage error."""
    code, _, _ = run("frobnicate")
    assert code == 2


def test_bench_envelope_json_reports_ours_beside_baseline() -> None:
    """A small bench run reports every metric with its same-run baseline and verdict."""
    code, out, _ = run("bench", "envelope", "--size", "8MiB", "--runs", "1", "--json")
    assert code == 0
    document = json.loads(out)
    metrics = {r["metric"]: r for r in document["results"]}
    assert set(metrics) == {
        "envelope.verify_1gib",
        "envelope.encode_1gib",
        "envelope.decode_rss_mib",
        "envelope.refuse_hostile_ms",
    }
    for name in ("envelope.verify_1gib", "envelope.encode_1gib"):
        result = metrics[name]
        assert result["baseline"] > 0
        assert result["ratio"] == pytest.approx(result["ours"] / result["baseline"], rel=1e-3)
    assert metrics["envelope.decode_rss_mib"]["baseline"] is None


def test_console_script_runs_as_a_module() -> None:
    """`python -m coordinator verify` works as the installed command does."""
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "verify", str(REFERENCE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_verify_refuses_an_envelope_whose_manifest_is_not_a_checkpoint() -> None:
    """A valid envelope with an incomplete manifest is not a restorable checkpoint."""
    code, _, err = run("verify", str(VECTORS / "no-payloads.flysess"))
    assert code == 1
    assert "manifest.invalid" in err


def test_inspect_survives_hostile_manifest_values(tmp_path: Path) -> None:
    """Odd field types and control characters are shown escaped, never executed."""
    from conftest import minimal_manifest

    from coordinator import envelope

    payloads = [("p", b"x")]
    manifest = minimal_manifest(payloads, sourceScope="x", checkpointId="\x1b[31mred")
    path = tmp_path / "odd.flysess"
    path.write_bytes(envelope.encode(manifest, payloads))
    code, out, _ = run("inspect", str(path))
    assert code == 0
    assert "\x1b" not in out
    assert "\\u001b[31mred" in out


def test_verify_a_fifo_does_not_block(tmp_path: Path) -> None:
    """A path that is not a regular file is unreadable (exit 3), not a hang."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code, _, err = run("verify", str(fifo))
    assert code == 3
    assert "not a regular file" in err


def test_bench_refuses_zero_runs() -> None:
    """--runs must be at least 1."""
    code, _, _ = run("bench", "envelope", "--runs", "0")
    assert code == 2


def make_store(path: Path, commits: int) -> None:
    from storekit import checkpoint

    from coordinator.store import SyncStore

    with SyncStore(path) as store:
        for index in range(commits):
            store.commit(*checkpoint(index))


def test_ls_marks_the_high_water(tmp_path: Path) -> None:
    """ls lists generations newest first, the high water marked with *."""
    make_store(tmp_path, 4)
    code, out, _ = run("ls", str(tmp_path))
    assert code == 0
    lines = out.splitlines()
    assert lines[1].startswith("session session-1")
    assert lines[2].lstrip().startswith("*") and "ckpt-3" in lines[2]
    assert "ckpt-1" in out and "ckpt-0" not in out


def test_ls_groups_by_session_and_marks_what_a_restore_abandoned(tmp_path: Path) -> None:
    """Each session has its own high water; a restore's abandoned timeline is marked."""
    import msgspec
    from storekit import checkpoint

    from coordinator.store import SyncStore

    with SyncStore(tmp_path) as store:
        for index in range(3):
            store.commit(*checkpoint(index))
        manifest, payloads = checkpoint(9, checkpoint_id="b-9")
        scope = msgspec.structs.replace(manifest.source_scope, session_id="other", epoch="b")
        store.commit(msgspec.structs.replace(manifest, source_scope=scope), payloads)
        store.fork_epoch("session-1", "epoch-2", "ckpt-1")
    code, out, _ = run("ls", str(tmp_path))
    assert code == 0
    lines = out.splitlines()
    other = lines.index("session other (epoch b, high water b-9)")
    mine = lines.index("session session-1 (epoch epoch-2, high water ckpt-1)")
    assert lines[other + 1].split()[:2] == ["*", "b-9"]
    assert lines[mine + 1].split()[:2] == ["x", "ckpt-2"]
    assert lines[mine + 2].split()[:2] == ["*", "ckpt-1"]
    document = json.loads(run("ls", "--json", str(tmp_path))[1])
    assert document["highWater"] is None  # several sessions: each has its own
    assert {s["sessionId"]: s["highWater"] for s in document["sessions"]} == {
        "other": "b-9",
        "session-1": "ckpt-1",
    }
    code, _, err = run("restore", str(tmp_path), "--to", str(tmp_path.parent / "out"))
    assert code == 2 and "name one" in err  # usage: name a session
    assert (
        run("restore", str(tmp_path), "--session", "other", "--to", str(tmp_path.parent / "o"))[0]
        == 0
    )


def test_ls_json(tmp_path: Path) -> None:
    """ls --json gives the records and the high water."""
    make_store(tmp_path, 2)
    code, out, _ = run("ls", "--json", str(tmp_path))
    document = json.loads(out)
    assert code == 0
    assert document["highWater"] == "ckpt-1"
    assert [g["checkpointId"] for g in document["generations"]] == ["ckpt-0", "ckpt-1"]


def test_verify_store_checks_every_generation(tmp_path: Path) -> None:
    """verify STORE exits 0 only when every listed generation verifies, and reports
    temporary and unreferenced files."""
    make_store(tmp_path, 3)
    assert run("verify", str(tmp_path))[0] == 0
    (tmp_path / "tmp-ckpt-9.flysess").write_bytes(b"half")
    (tmp_path / "ckpt-9.flysess").write_bytes(b"stray")
    target = tmp_path / "ckpt-1.flysess"
    data = bytearray(target.read_bytes())
    data[200] ^= 1
    target.write_bytes(bytes(data))
    code, out, err = run("verify", str(tmp_path))
    assert code == 1
    assert "ckpt-1 [store.corrupt] envelope-digest" in err
    assert "tmp-ckpt-9.flysess" in out and "ckpt-9.flysess" in out


def test_verify_beside_a_live_writer_counts_its_spares_as_no_problem(tmp_path: Path) -> None:
    """A live writer keeps rotated-out files as spares (tmp+spare+N): verify says how
    many, once, not a 'temporary' line each, and the store verifies."""
    from storekit import checkpoint

    from coordinator.store import SyncStore

    with SyncStore(tmp_path, keep=1) as writer:
        for index in range(4):
            writer.commit(*checkpoint(index))
        code, out, _ = run("verify", str(tmp_path))
    assert code == 0, out
    assert "spares: 1 (rotated-out files a writer keeps to write over" in out
    assert "temporary" not in out


def test_verify_store_with_invalid_manifest(tmp_path: Path) -> None:
    """A store whose manifest.json is invalid fails with its code."""
    (tmp_path / "manifest.json").write_bytes(b"{}")
    code, _, err = run("verify", str(tmp_path))
    assert code == 1
    assert "store.manifest" in err


def test_every_bench_group_runs_and_reports_baselines() -> None:
    """bench (tiny sizes) prints one JSON object per group, each metric with its
    verdict and, where it has one, its same-run baseline."""
    from coordinator.bench import GROUPS

    assert list(GROUPS) == [
        "envelope",
        "store",
        "runtime",
        "bus",
        "replicate",
        "dashboard",
        "host",
        "restore",
        "soak",
    ]  # fmt: skip  (replicate, dashboard, host, restore, soak: their own test files)
    documents = []
    for group in ("envelope", "store", "runtime"):  # bus: tests/test_bench_bus.py, tiny counts
        code, out, _ = run("bench", group, "--size", "8MiB", "--runs", "1", "--json")
        assert code == 0
        documents += [json.loads(line) for line in out.splitlines() if line.strip()]
    assert [d["group"] for d in documents] == ["envelope", "store", "runtime"]
    for document in documents:
        for item in document["results"]:
            assert isinstance(item["met"], bool)
            if item["baseline"] is not None:
                assert item["ratio"] == pytest.approx(item["ours"] / item["baseline"], rel=1e-3)


def test_demo_shows_every_event_kind_and_restores_the_world(tmp_path: Path) -> None:
    """coordinator demo (embedded NATS) reports every event kind, and the restored
    world equals the world at the restored boundary."""
    code, out, err = run("demo", "--steps", "31", "--store", str(tmp_path / "saves"), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert set(summary["events"]) == set(EVENT_NAMES)
    assert summary["events"]["restored"] == 1
    assert summary["world_identical"] is True
    assert summary["generations"] >= 1
    assert run("verify", str(tmp_path / "saves"))[0] == 0
    # The remote agent's state came from its own process, through the bus, into the file.
    assert summary["remote_participants"] == ["agent-fly-c"]
    assert run("restore", str(tmp_path / "saves"), "--to", str(tmp_path / "out"))[0] == 0
    remote_state = (tmp_path / "out" / "agent-fly-c").read_bytes()
    boundary = json.loads((tmp_path / "out" / "_manifest.json").read_bytes())["sourceScope"]["step"]
    assert len(remote_state) == 4 << 20
    assert remote_state[:8] == int(boundary).to_bytes(8, "little")


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes whose command line or environment holds ``text``."""
    found = []
    for process in Path("/proc").glob("[0-9]*"):
        try:
            command = (process / "cmdline").read_bytes().replace(b"\0", b" ")
            environment = (process / "environ").read_bytes()
        except OSError:
            continue  # it exited meanwhile
        if text.encode() in command + environment:
            found.append(command.decode(errors="replace"))
    return found


def test_ctrl_c_leaves_no_server_and_a_store_that_verifies(tmp_path: Path) -> None:
    """SIGINT mid-demo: the embedded nats-server is gone, the exit is clean (130),
    and the store verifies."""
    import re
    import signal
    import socket

    store = tmp_path / "saves"
    demo = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "demo", "--steps", "100000", "--store", str(store)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert demo.stdout is not None
    port = None
    commits = 0
    for line in demo.stdout:
        found = re.search(r"nats://127\.0\.0\.1:(\d+)", line)
        if found:
            port = int(found[1])
        commits += "committed" in line
        if commits >= 2:
            break
    demo.send_signal(signal.SIGINT)
    _, stderr = demo.communicate(timeout=60)
    assert demo.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert port is not None
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # the server is gone
    assert not processes_mentioning(f"127.0.0.1:{port}")  # nor the remote agent's worker
    assert run("verify", str(store))[0] == 0


def test_restore_writes_every_payload_or_nothing(tmp_path: Path) -> None:
    """restore verifies, writes each payload file and the manifest; a corrupt generation
    is refused and leaves no output and no staging directory."""
    from coordinator.store import SyncStore

    make_store(tmp_path / "store", 2)
    reader = SyncStore(tmp_path / "store", read_only=True)
    with reader, reader.read(reader.select("ckpt-1")) as stored:
        expected = {n: bytes(stored.payload(n)) for n in stored.envelope.names}
    code, out, _ = run("restore", str(tmp_path / "store"), "--to", str(tmp_path / "out"))
    assert code == 0 and "ckpt-1" in out
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()
            if p.name != "_manifest.json"} == expected  # fmt: skip
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_bytes())
    assert manifest["checkpointId"] == "ckpt-1"

    target = tmp_path / "store" / "ckpt-0.flysess"
    data = bytearray(target.read_bytes())
    data[300] ^= 1
    target.write_bytes(bytes(data))
    code, _, err = run(
        "restore", str(tmp_path / "store"), "--checkpoint", "ckpt-0", "--to", str(tmp_path / "bad")
    )
    assert code == 1 and "store.corrupt" in err
    assert not (tmp_path / "bad").exists()
    assert not [p for p in tmp_path.iterdir() if "staging" in p.name]
    assert run("restore", str(tmp_path / "store"), "--to", str(tmp_path / "out"))[0] == 2


def test_demo_can_run_again_on_the_same_store(tmp_path: Path) -> None:
    """Each run has epochs of its own: a second run on the same store just works."""
    store = str(tmp_path / "saves")
    for _ in range(2):
        code, out, err = run("demo", "--steps", "12", "--store", store, "--json")
        assert code == 0, err
        assert json.loads(out)["world_identical"]


@pytest.mark.parametrize(
    "command", ["demo", "watch", "restore", "inspect", "verify", "ls", "schema", "bench"]
)
def test_every_command_has_help_with_an_example(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, _ = run(command, "--help")  # argparse prints help to sys.stdout
    out = capsys.readouterr().out
    assert code == 0
    assert f"coordinator {command}" in out and "Example" in out


@pytest.mark.parametrize("size", ["1000000GiB", "99999999999999999999GiB"])
def test_a_bench_size_beyond_this_machines_memory_is_a_usage_error(
    size: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every bench holds its state in memory: a size past it was a MemoryError or an
    OverflowError traceback (helper-15)."""
    code, _, _ = run("bench", "restore", "--size", size, "--runs", "1")
    assert code == 2
    assert "more than this machine's memory" in capsys.readouterr().err  # (argparse's)


@pytest.mark.parametrize("argv", [["dashboard"], ["demo", "--dashboard", "127.0.0.1:8399"]])
def test_the_dashboard_without_the_web_extra_says_how_to_install_it(
    argv: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pip install .` (the README's first command) leaves out the web extra:
    `coordinator dashboard` ended in a ModuleNotFoundError traceback."""
    import io
    import sys

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # (as if not installed)
    monkeypatch.delitem(sys.modules, "coordinator.dashboard", raising=False)
    monkeypatch.delitem(sys.modules, "coordinator.dashboard._metrics", raising=False)
    out, err = io.StringIO(), io.StringIO()
    assert main(argv, out=out, err=err) == 2
    assert "pip install prometheus_client (" in err.getvalue()  # (helper-70: not 'coordinator[web]',
    assert "coordinator[web]" not in err.getvalue()  # which PyPI has as another project)
    assert "prometheus_client missing" in err.getvalue() and "Traceback" not in err.getvalue()


@pytest.mark.parametrize("as_json", [False, True])
def test_inspect_escapes_bidi_overrides_and_c1_controls(tmp_path: Path, as_json: bool) -> None:
    """helper-55: the manifest's dump (ensure_ascii=False) escaped only what is
    below U+0020: a right-to-left override, the 8-bit CSI and DEL reached the
    terminal raw. Written as JSON escapes now, so --json still parses the same."""
    import json

    from conftest import minimal_manifest

    from coordinator import envelope

    hostile = "ep\u202eevil\x9b2J\x7f\U000e0001"
    payloads = [("p", b"x")]
    manifest = minimal_manifest(payloads, episodeId=hostile, **{"\u202egnp.exe": 1})
    path = tmp_path / "odd.flysess"
    path.write_bytes(envelope.encode(manifest, payloads))
    code, out, _ = run("inspect", *(["--json"] if as_json else []), str(path))
    assert code == 0
    assert not any(c in out for c in "\u202e\x9b\x7f\U000e0001"), repr(out)
    assert "\\u202e" in out and "\\u009b" in out
    if as_json:
        assert json.loads(out)["manifest"]["episodeId"] == hostile

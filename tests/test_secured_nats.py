"""Secured NATS, the way operators run it: every command that talks to NATS with the
`nats` CLI's options and environment (--creds, --user with --password-file or
NATS_PASSWORD, --tlscert/--tlskey/--tlsca, NATS_URL...), against real nats-servers
this file starts: one with TLS (a CA made here, client certificates required) and
users whose permissions are the ones docs/operations.md gives ("Secured NATS"), and
one in operator/JWT mode for a .creds file. No password is ever on a command line
here (nor in any output, nor in the argv of any process the commands start)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from test_events import make

from coordinator.cli import main
from coordinator.connection import add_options, resolve
from coordinator.events import event_id
from coordinator.server import EmbeddedServer

DOCS = Path(__file__).parents[1] / "docs" / "operations.md"
OPENSSL = "/usr/bin/openssl"
# Every secret of this file: none may show up in any output or argv.
PASSWORDS = {name: f"pw-{name}-{secrets.token_hex(8)}" for name in ("writer", "reader", "outsider")}


def snippet(name: str) -> str:
    """A permission set exactly as docs/operations.md gives it (```text name=...```)."""
    found = re.search(rf"```\S* name={name}\n(.*?)```", DOCS.read_text(), re.S)
    assert found is not None, f"docs/operations.md has no snippet {name}"
    return found[1]


def users_config() -> str:
    """The server's users: each with the permissions block the docs give its role."""
    users = "\n".join(
        f"    {{user: {name}, password: {json.dumps(password)}, permissions: {{\n"
        f"{snippet(name)}    }}}}"
        for name, password in PASSWORDS.items()
    )
    return f"authorization {{\n  users = [\n{users}\n  ]\n}}\n"


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any NATS_* of the developer's, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    return {**env, **extra}


def cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "coordinator", *argv], capture_output=True, text=True,
        timeout=timeout, check=False, env=env or clean_env(),
    )  # fmt: skip
    assert_no_secret(done.stdout + done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def assert_no_secret(text: str) -> None:
    for password in PASSWORDS.values():
        assert password not in text, "a password was printed"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# --- a CA, a server and a client certificate, with the openssl CLI -------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path  # the client's
    key: Path
    server_cert: Path
    server_key: Path


def make_pki(folder: Path) -> Pki:
    def openssl(*args: str) -> None:
        subprocess.run([OPENSSL, *args], check=True, capture_output=True, cwd=folder)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=test CA")  # fmt: skip
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}")  # fmt: skip
        extensions = f"extendedKeyUsage={usage}\n"
        if name == "server":
            extensions += "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
        (folder / f"{name}.ext").write_text(extensions)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2",
                "-extfile", f"{name}.ext")  # fmt: skip
    return Pki(
        ca=folder / "ca.pem", cert=folder / "client.pem", key=folder / "client.key",
        server_cert=folder / "server.pem", server_key=folder / "server.key",
    )  # fmt: skip


# --- operator mode: JWTs signed with nkeys (ed25519), as nsc makes them ------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _keypair(prefix: int) -> Any:
    import nkeys

    return nkeys.from_seed(nkeys.encode_seed(secrets.token_bytes(32), prefix))


def _jwt(issuer: Any, subject: str, name: str, nats: dict[str, Any]) -> str:
    """A NATS JWT (v2): header.claims signed by the issuer's ed25519 key."""
    claims: dict[str, Any] = {
        "iat": int(time.time()), "iss": issuer.public_key.decode(), "name": name,
        "sub": subject,
    }  # fmt: skip
    digest = hashlib.new("sha512_256", json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    claims["nats"] = {**nats, "version": 2}
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{head}.{body}.{_b64(issuer.sign(f'{head}.{body}'.encode()))}"


def operator_mode(folder: Path) -> tuple[str, Path]:
    """(the server's configuration, a .creds file of a user of its one account)."""
    import nkeys

    operator = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    system = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    user = _keypair(nkeys.PREFIX_BYTE_USER)
    unlimited = {"subs": -1, "data": -1, "payload": -1, "conn": -1, "imports": -1,
                 "exports": -1, "wildcards": True, "leaf": -1, "mem_storage": -1,
                 "disk_storage": -1, "streams": -1, "consumer": -1}  # fmt: skip
    accounts = {
        account.public_key.decode(): _jwt(
            operator, account.public_key.decode(), "A", {"type": "account", "limits": unlimited}
        ),
        system.public_key.decode(): _jwt(
            operator, system.public_key.decode(), "SYS", {"type": "account"}
        ),
    }
    user_claims = {"type": "user", "subs": -1, "data": -1, "payload": -1}
    user_jwt = _jwt(account, user.public_key.decode(), "U", user_claims)
    creds = folder / "user.creds"
    creds.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
    )
    creds.chmod(0o600)
    preload = ", ".join(f"{key}: {json.dumps(token)}" for key, token in accounts.items())
    config = (
        f"operator: {json.dumps(_jwt(operator, operator.public_key.decode(), 'O', {'type': 'operator'}))}\n"  # noqa: E501
        f"system_account: {system.public_key.decode()}\n"
        f"resolver: MEMORY\nresolver_preload: {{ {preload} }}\n"
    )
    return config, creds


# --- the servers, and a writer's demo on the secured one ---------------------------


@dataclass
class Secured:
    server: EmbeddedServer
    pki: Pki
    folder: Path
    demo: Any  # the writer's `coordinator demo`
    argv_seen: list[str]  # every other process's argv seen while the demo ran

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.server.port}"

    def password_file(self, user: str) -> str:
        path = self.folder / f"{user}.password"
        path.write_text(PASSWORDS[user] + "\n")
        path.chmod(0o600)
        return str(path)

    def tls_env(self, user: str, **extra: str) -> dict[str, str]:
        """The reader's way: everything from the environment, nothing on argv."""
        return clean_env(**{
            "NATS_URL": self.url, "NATS_USER": user, "NATS_PASSWORD": PASSWORDS[user],
            "NATS_CA": str(self.pki.ca), "NATS_CERT": str(self.pki.cert),
            "NATS_KEY": str(self.pki.key), **extra,
        })  # fmt: skip

    def tls_args(self) -> list[str]:
        pki = self.pki
        return ["--tlsca", str(pki.ca), "--tlscert", str(pki.cert), "--tlskey", str(pki.key)]


def _argv_of_others() -> list[str]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as file:
                    found.append(file.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """A nats-server that requires TLS (client certificates too) and a user and
    password, with the docs' writer, reader and outsider permissions; the writer
    has run `coordinator demo` on it (a replicated session `demo`), its password
    from a file, while every process's argv was watched."""
    folder = tmp_path_factory.mktemp("secured")
    pki = make_pki(folder)
    tls = (
        f"tls {{\n  cert_file: {json.dumps(str(pki.server_cert))}\n"
        f"  key_file: {json.dumps(str(pki.server_key))}\n"
        f"  ca_file: {json.dumps(str(pki.ca))}\n  verify: true\n  timeout: 2\n}}\n"
    )
    server = EmbeddedServer(folder / "nats", config=tls + users_config())
    anyio.run(server.start)
    try:
        secure = Secured(server, pki, folder, None, [])
        password_file = secure.password_file("writer")
        command = [sys.executable, "-m", "coordinator", "demo", "--steps", "12", "--json",
                   "--nats", secure.url, "--user", "writer", "--password-file", password_file,
                   *secure.tls_args()]  # fmt: skip
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
        )
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            secure.argv_seen += _argv_of_others()
            time.sleep(0.05)
        stdout, stderr = process.communicate(timeout=30)
        secure.demo = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
        yield secure
    finally:
        anyio.run(server.stop)


@pytest.fixture(scope="module")
def jwt_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedServer, Path]]:
    """A nats-server in operator mode (accounts as JWTs, resolver MEMORY), with
    JetStream, and a .creds file of one of its users."""
    folder = tmp_path_factory.mktemp("jwt")
    config, creds = operator_mode(folder)
    server = EmbeddedServer(folder / "nats", config=config)
    anyio.run(server.start)
    try:
        yield server, creds
    finally:
        anyio.run(server.stop)


# --- the writer ----------------------------------------------------------------------


def test_a_writer_runs_the_demo_with_no_password_on_any_command_line(secured: Secured) -> None:
    """The demo over TLS with the writer's password from a file: it saves,
    replicates and restores as on the embedded server, and no process (the demo's
    own worker included: it gets the connection in its environment) ever had the
    password in its argv. The worker was seen, so the scan saw what it had to."""
    done = secured.demo
    assert done.returncode == 0, done.stderr[-3000:]
    assert_no_secret(done.stdout + done.stderr)
    summary = json.loads(done.stdout)
    assert summary["world_identical"] and summary["events"]["replicated"] >= 1
    assert any("demo-agent" in argv for argv in secured.argv_seen), "the worker was never seen"
    assert not [argv for argv in secured.argv_seen if any(p in argv for p in PASSWORDS.values())]


# --- the read-only user ------------------------------------------------------------


def test_a_reader_replays_the_writers_sessions(secured: Secured) -> None:
    """`watch --replay-only` with the read-only user, everything from NATS_URL,
    NATS_USER, NATS_PASSWORD, NATS_CA, NATS_CERT and NATS_KEY: the demo's session."""
    done = cli("watch", "--replay-only", "--json", env=secured.tls_env("reader"))
    assert done.returncode == 0, done.stderr
    last = json.loads(done.stdout.splitlines()[-1])
    assert last["sessionId"] == "demo" and last["highWater"]
    assert last["replicatedHighWater"] == last["highWater"]


def test_a_reader_restores_the_replicated_session(secured: Secured, tmp_path: Path) -> None:
    """`restore tls://... --session demo` with the read-only user (the password from
    --password-file, TLS from the flags): every payload, verified."""
    target = tmp_path / "restored"
    done = cli("restore", secured.url, "--session", "demo", "--to", str(target), "--user",
               "reader", "--password-file", secured.password_file("reader"),
               *secured.tls_args(), env=clean_env())  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "verified" in done.stdout
    assert (target / "world").stat().st_size == 2 << 20


def test_a_restore_from_a_url_with_its_password_never_prints_it(
    secured: Secured, tmp_path: Path
) -> None:
    """helper-73: `restore nats://user:password@host` printed the URL whole in its
    success line (its failures were redacted)."""
    url = secured.url.replace("://", f"://reader:{PASSWORDS['reader']}@")
    done = cli("restore", url, "--session", "demo", "--to", str(tmp_path / "restored"),
               *secured.tls_args(), env=clean_env())  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "verified" in done.stdout


def test_a_reader_runs_the_dashboard(secured: Secured) -> None:
    """`coordinator dashboard` with the read-only user: /api/overview shows the
    session the writer published."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator", "dashboard", "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=secured.tls_env("reader"),
    )  # fmt: skip
    assert process.stdout is not None
    try:
        line = process.stdout.readline()
        assert line.startswith(f"dashboard: http://127.0.0.1:{port}/"), line
        assert f"following {secured.url};" in line
        sessions: list[Any] = []
        deadline = time.monotonic() + 20
        while "demo" not in sessions and time.monotonic() < deadline:
            url = f"http://127.0.0.1:{port}/api/overview"
            with urllib.request.urlopen(url, timeout=10) as reply:
                overview = json.load(reply)
            sessions = [row.get("sessionId") for row in overview.get("sessions", [])]
            time.sleep(0.1)
        assert "demo" in sessions, overview
        assert overview["beats"] >= 1, overview  # the host's presence: read with the same rights
    finally:
        process.terminate()
        out, err = process.communicate(timeout=30)
    assert_no_secret(line + out + err)
    assert "Traceback" not in err, err


# --- refusals: one line, no secret, nothing shown ----------------------------------


def test_a_user_without_rights_on_a_session_is_refused_and_sees_none_of_it(
    secured: Secured,
) -> None:
    """The outsider may read session `other` only. Replaying or following `demo`,
    following every session, or restoring `demo` is refused in one line naming the
    permission it lacks, with nothing on stdout (nor on disk); its own session reads
    fine (empty here)."""
    env = secured.tls_env("outsider")
    replay = cli("watch", "--replay-only", "--json", "--session", "demo", env=env)
    assert replay.returncode == 1 and replay.stdout == "", replay
    assert len(replay.stderr.strip().splitlines()) == 1, replay.stderr
    assert "[bus.refused] permission denied: user 'outsider' may not publish to" in replay.stderr
    assert "$JS.API.CONSUMER.CREATE.CKPT.*.ckpt.demo.*" in replay.stderr
    follow = cli("watch", "--json", "--session", "demo", env=env, timeout=30)
    assert follow.returncode == 1 and follow.stdout == "", follow
    assert 'may not subscribe to "ckpt.demo.*"' in follow.stderr, follow.stderr
    everything = cli("dashboard", "--listen", f"127.0.0.1:{free_port()}", env=env, timeout=30)
    assert everything.returncode == 1, everything
    assert "coordinator dashboard: FAILED [bus.refused] permission denied" in everything.stderr
    assert 'may not subscribe to "ckpt.>"' in everything.stderr
    target = secured.folder / "outsider-restored"
    started = time.monotonic()
    restore = cli("restore", secured.url, "--session", "demo", "--to", str(target), env=env)
    assert restore.returncode == 1 and not target.exists(), restore
    assert "[bus.refused] permission denied: the server says permissions violation" in (
        restore.stderr
    )
    assert time.monotonic() - started < 4.5  # (not the request's timeout: 5 s)
    own = cli("watch", "--replay-only", "--json", "--session", "other", env=env)
    assert own.returncode == 0 and own.stdout == "", own


def test_the_outsider_reads_its_own_session(secured: Secured) -> None:
    """The same permissions let it read what is published on its session: the
    refusal above is about `demo`, not a user who can read nothing."""
    from coordinator.bus import NatsBus

    event = msgspec.structs.replace(
        make("queued"), session_id="other", event_id=event_id("other", "e1", "c1", "queued")
    )

    async def publish() -> None:
        pki = secured.pki
        import ssl

        context = ssl.create_default_context(cafile=str(pki.ca))
        context.load_cert_chain(str(pki.cert), str(pki.key))
        async with NatsBus(secured.url, user="writer", password=PASSWORDS["writer"],
                           tls=context) as bus:  # fmt: skip
            await bus.publish(event)

    anyio.run(publish)
    done = cli("watch", "--replay-only", "--json", "--session", "other",
               env=secured.tls_env("outsider"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["sessionId"] == "other"


def test_a_wrong_password_is_one_line_at_once(secured: Secured) -> None:
    """A wrong password: `FAILED [bus.refused] ... authorization violation`, in one
    line, without the password, and without waiting out a connect timeout."""
    wrong = f"{PASSWORDS['reader']}-wrong"
    started = time.monotonic()
    done = cli("watch", "--replay-only", env=secured.tls_env("reader", NATS_PASSWORD=wrong))
    assert time.monotonic() - started < 4.5  # (nats-py alone retries until the timeout: 5 s)
    assert done.returncode == 1, done
    assert done.stderr.count("\n") == 1 and wrong not in done.stderr, done.stderr
    assert done.stderr.startswith("coordinator watch: FAILED [bus.refused] the NATS server at ")
    assert "authorization violation" in done.stderr
    in_url = {
        **secured.tls_env("reader"),
        "NATS_URL": secured.url.replace("//", f"//reader:{wrong}@"),
    }
    del in_url["NATS_USER"], in_url["NATS_PASSWORD"]
    done = cli("watch", "--replay-only", env=in_url)  # a URL's own password: redacted too
    assert done.returncode == 1 and "authorization violation" in done.stderr, done.stderr
    assert wrong not in done.stderr and "reader:" not in done.stderr


def test_the_servers_certificate_is_checked(secured: Secured, tmp_path: Path) -> None:
    """Without --tlsca (the system's CAs do not know ours), or with another CA,
    the TLS handshake fails in one line saying so; the password is never sent.
    Without a client certificate, the server's refusal says what it wants."""
    env = secured.tls_env("reader")
    del env["NATS_CA"]
    done = cli("watch", "--replay-only", env=env)
    assert done.returncode == 1, done
    assert "[bus.refused]" in done.stderr and "certificate does not verify" in done.stderr
    other = make_pki(tmp_path)
    done = cli("watch", "--replay-only", env={**env, "NATS_CA": str(other.ca)})
    assert done.returncode == 1 and "certificate does not verify" in done.stderr, done.stderr
    anonymous = {
        k: v for k, v in secured.tls_env("reader").items() if k not in ("NATS_CERT", "NATS_KEY")
    }
    done = cli("watch", "--replay-only", env=anonymous)  # (the server has `verify: true`)
    assert done.returncode == 1 and "wants a client certificate" in done.stderr, done.stderr


def test_tls_asked_of_a_server_without_it_sends_nothing(
    jwt_server: tuple[EmbeddedServer, Path],
) -> None:
    """A tls:// URL to a server that does not require TLS: refused before the
    credentials go out in plain text (nats-py alone would send them)."""
    server, creds = jwt_server
    url = f"tls://127.0.0.1:{server.port}"
    done = cli("watch", "--replay-only", "--nats", url, "--creds", str(creds))
    assert done.returncode == 1, done
    assert "[bus.refused] TLS was asked for" in done.stderr and "does not require it" in done.stderr


# --- a .creds file (operator mode) -----------------------------------------------


def test_a_creds_file_reads_and_writes_in_operator_mode(
    jwt_server: tuple[EmbeddedServer, Path],
) -> None:
    """A .creds file goes straight to nats-py: a host publishes with it, and
    `watch` reads with it, from --creds and from NATS_CREDS."""
    from coordinator.bus import NatsBus

    server, creds = jwt_server
    event = msgspec.structs.replace(
        make("queued"), session_id="jwt-s", event_id=event_id("jwt-s", "e1", "c1", "queued")
    )

    async def publish() -> None:
        async with NatsBus(server.url, user_credentials=str(creds)) as bus:
            await bus.publish(event)

    anyio.run(publish)
    for env, flags in (
        (clean_env(), ["--nats", server.url, "--creds", str(creds)]),
        (clean_env(NATS_URL=server.url, NATS_CREDS=str(creds)), []),
    ):
        done = cli("watch", "--replay-only", "--json", *flags, env=env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.splitlines()[-1])["sessionId"] == "jwt-s"
    seed = creds.read_text().split("-----BEGIN USER NKEY SEED-----\n")[1].split("\n")[0]
    assert seed not in done.stdout + done.stderr
    stranger = _jwt(_keypair(0), "UABC", "U", {"type": "user"})  # an account nobody knows
    unsigned = creds.parent / "unknown.creds"
    unsigned.write_text(creds.read_text().replace(creds.read_text().split("\n")[1], stranger))
    done = cli("watch", "--replay-only", "--nats", server.url, "--creds", str(unsigned))
    assert done.returncode == 1 and "[bus.refused]" in done.stderr, done.stderr


# --- the command line's own checks (in process: no server needed) ---------------------


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["watch", "--creds", "/nonexistent.creds"],
         "[usage] --creds /nonexistent.creds: No such file or directory"),
        (["watch", "--tlscert", "/nonexistent.pem", "--tlskey", "/nonexistent.key"],
         "[usage] --tlscert /nonexistent.pem: No such file or directory"),
        (["watch", "--tlsca", "/nonexistent-ca.pem"],
         "[usage] --tlsca /nonexistent-ca.pem: No such file or directory"),
        (["watch", "--tlscert", "{pem}"], "--tlscert and --tlskey go together"),
        (["watch", "--tlsca", "{text}"], "--tlsca {text}: no CA certificate in it"),
        (["watch", "--creds", "{text}"], "not a NATS credentials file (no user JWT and seed)"),
        (["watch", "--user", "bob"], "user 'bob' needs a password"),
        (["watch", "--password-file", "{text}"], "a password but no user"),
        (["watch", "--nats", "nats://u:p@127.0.0.1:1", "--user", "bob", "--password-file",
          "{text}"], "the URL names a user already"),
        (["demo", "--user", "bob", "--password-file", "{text}"], "--user needs --nats URL"),
        (["restore", "nats://127.0.0.1:1", "--session", "s", "--to", "{out}/r", "--creds",
          "/nonexistent.creds"], "--creds /nonexistent.creds: No such file"),
        (["restore", "{out}", "--to", "{out}/x", "--user", "bob"],
         "--user is for a nats:// source"),
    ],
)  # fmt: skip
def test_a_bad_option_or_file_is_one_usage_line(tmp_path: Path, argv: list[str], line: str) -> None:
    """A missing file, one that is no credentials file or certificate, a user
    without a password: one line, exit 2 (usage), nothing started."""
    text = tmp_path / "text.txt"
    text.write_text("just text\n")
    values = {"pem": str(make_pki(tmp_path).cert), "text": str(text), "out": str(tmp_path / "o")}
    argv = [part.format(**values) for part in argv]
    (tmp_path / "o").mkdir()
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, out=out, err=err)
    assert code == 2, (code, err.getvalue())
    assert line.format(**values) in err.getvalue(), err.getvalue()
    assert err.getvalue().count("\n") == 1 and "Traceback" not in err.getvalue()


def test_the_help_says_where_a_password_should_come_from(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every command that talks to NATS has the `nats` CLI's options, and says that
    a password on the command line is visible in `ps`."""
    for command in ("watch", "dashboard", "demo", "restore"):
        assert main([command, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        for flag in ("--creds", "--user", "--password-file", "--tlscert", "--tlskey", "--tlsca"):
            assert flag in text, (command, flag)
        assert "visible to every local user in `ps`" in text, command
        assert "NATS_PASSWORD" in text and "NATS_CREDS" in text, command


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_options(parser, url_help="url")
    return parser.parse_args(argv)


def test_the_environment_fills_in_what_the_command_line_leaves_out(tmp_path: Path) -> None:
    """NATS_URL, NATS_USER and NATS_PASSWORD as the `nats` CLI reads them; the
    command line's credentials replace the environment's; the URL's default."""
    password_file = tmp_path / "pw"
    password_file.write_text("from-the-file\nsecond line ignored\n")
    env = {"NATS_URL": "nats://h:1", "NATS_USER": "u", "NATS_PASSWORD": "from-env"}
    got = resolve(_parse(), env)
    assert got is not None and got.url == "nats://h:1"
    assert got.options() == {"user": "u", "password": "from-env"}
    assert "from-env" not in repr(got)
    embedded = resolve(_parse("--nats", "nats://u:in-the-url@h:1"), {})
    assert embedded is not None and "in-the-url" not in repr(embedded) + embedded.redacted
    got = resolve(_parse("--password-file", str(password_file)), env)
    assert got is not None and got.options() == {"user": "u", "password": "from-the-file"}
    got = resolve(_parse("--nats", "nats://other:2"), {})
    assert got is not None and got.url == "nats://other:2" and got.options() == {}
    got = resolve(_parse(), {})
    assert got is not None and got.url == "nats://127.0.0.1:4222" and not got.tls
    assert resolve(_parse(), {}, default_url=None) is None  # the demo's embedded server
    restore = resolve(_parse(), env, url="nats://source:3")
    assert restore is not None and restore.url == "nats://source:3"  # not NATS_URL


def test_a_tls_url_or_any_tls_option_means_tls(tmp_path: Path) -> None:
    """tls:// alone (the system's CAs), or nats:// with a TLS option: a context that
    checks the certificate and the name; the worker's environment gives it again."""
    pki = make_pki(tmp_path)
    got = resolve(_parse("--nats", "tls://h:1"), {})
    assert got is not None and got.tls and got.options()["tls"].verify_mode.name == "CERT_REQUIRED"
    got = resolve(_parse("--nats", "nats://h:1", "--tlscert", str(pki.cert), "--tlskey",
                         str(pki.key)), {"NATS_CA": str(pki.ca)})  # fmt: skip
    assert got is not None and got.tls and got.options()["tls"].check_hostname
    assert resolve(_parse("--nats", "nats://h:1"), {}).tls is False  # type: ignore[union-attr]
    env = got.environment()  # what the demo's worker is given: the same connection
    again = resolve(_parse(), env, url=got.url)
    assert again is not None and again.tls and again.tls_ca == str(pki.ca)
    assert again.tls_cert == str(pki.cert) and again.tls_key == str(pki.key)


@pytest.mark.parametrize(
    "url",
    [
        "nats://admin:Kx9@tail-SECRET@h:1",
        "tls://u:p@SECRET@h:1,nats://x:SECRET@h:2",
        "admin:SECRET@h:1",  # (helper-77: no scheme; setup and the dashboard connect so)
        "nats://admin:ab+cd/EfSECRET==@h:1",  # (helper-77: a '/' in a base64 password)
        "nats://admin:a,bSECRET@h:1",
    ],
)
def test_a_password_holding_an_at_sign_is_never_printed(url: str) -> None:
    """helper-75: nats-py splits a URL's user information at its last '@', so a
    password may hold one; every redaction cut at the first, and restore printed
    the rest of the password ('tail-SECRET-4711@127.0.0.1')."""
    from coordinator.bus._nats import _redacted, _scrubbed
    from coordinator.connection import redact

    assert "SECRET" not in redact(url) and "h:" in redact(url), redact(url)
    assert "SECRET" not in _redacted(url.split(","))
    said = _scrubbed(OSError(f"cannot reach {url}"), url.split(","), {})
    assert "SECRET" not in said, said
    from coordinator.bus._nats import server_address
    from coordinator.errors import UsageError

    try:  # (a URL nats-py cannot read: its refusal names the URL, redacted)
        server_address(url.split(",nats://")[0])  # (the first server of a list)
    except UsageError as error:
        assert "SECRET" not in str(error), error
        assert "--password-file" in str(error)  # (the URL shown looks right: say why not)

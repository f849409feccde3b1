"""How the commands reach a secured NATS: the options and environment variables of
the ``nats`` CLI tool, turned into ``nats.connect`` keyword arguments.

``add_options(parser)`` gives a command ``--creds FILE``, ``--user``,
``--password`` / ``--password-file FILE``, ``--tlscert FILE``, ``--tlskey FILE``
and ``--tlsca FILE`` (and ``--nats URL`` where the command takes one);
``resolve(args, ...)`` reads them, with ``NATS_URL``, ``NATS_CREDS``,
``NATS_USER``, ``NATS_PASSWORD``, ``NATS_CERT``, ``NATS_KEY`` and ``NATS_CA``
from the environment for what the command line leaves out, checks every file
once, and returns a ``Connection``; ``Connection.options()`` is what
``NatsBus(url, **options)`` and ``connect`` take.

Rules:

- a credential given on the command line (``--creds``, ``--user``, a password
  option) replaces the environment's credentials; otherwise the environment's
  are used (``NATS_CREDS``, or ``NATS_USER`` with ``NATS_PASSWORD``);
- a password comes from ``--password-file``, ``NATS_PASSWORD`` or, visible to
  every local user in ``ps``, ``--password``;
- a ``tls://`` URL or any TLS option means TLS: the server's certificate is
  checked against ``--tlsca`` (else the system's CAs), and ``--tlscert`` with
  ``--tlskey`` is the client's certificate;
- every mistake (a missing or unreadable file, a file that is no credentials
  file, a certificate that does not load, a user without a password) is one
  ``UsageError`` naming the option and the file, never the secret.

No secret is kept anywhere it could be printed: ``repr`` and ``redacted`` leave
the password out, and a URL's own ``user:password@`` is redacted.
"""

from __future__ import annotations

import argparse
import os
import re
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError

__all__ = ["DEFAULT_URL", "ENVIRONMENT", "Connection", "add_options", "given", "redact", "resolve"]

DEFAULT_URL = "nats://127.0.0.1:4222"
# The `nats` CLI's names. A child process (the demo's worker) gets its connection
# through them, never through its argv, which `ps` shows to everyone.
ENVIRONMENT = (
    "NATS_URL",
    "NATS_CREDS",
    "NATS_USER",
    "NATS_PASSWORD",
    "NATS_CERT",
    "NATS_KEY",
    "NATS_CA",
)
_JWT_HEADER = "-----BEGIN NATS USER JWT-----"
_SEED_HEADER = "BEGIN USER NKEY SEED"

PASSWORD_HELP = (
    "the password, visible to every local user in `ps` while the command runs: prefer "
    "--password-file or NATS_PASSWORD"
)


def add_options(parser: argparse.ArgumentParser, *, url_help: str | None) -> None:
    """The connection options, in a group of their own; ``--nats URL`` too unless
    ``url_help`` is None (``restore``, whose source is the URL)."""
    group = parser.add_argument_group(
        "NATS connection",
        "the `nats` CLI's options; what is left out is taken from NATS_URL, NATS_CREDS, "
        "NATS_USER, NATS_PASSWORD, NATS_CERT, NATS_KEY and NATS_CA",
    )
    if url_help is not None:
        group.add_argument("--nats", metavar="URL", default=None, help=url_help)
    group.add_argument(
        "--creds",
        metavar="FILE",
        default=None,
        help="a NATS credentials file (user JWT and seed), as nsc writes it",
    )
    group.add_argument("--user", default=None, help="the user name")
    group.add_argument("--password", default=None, help=PASSWORD_HELP)
    group.add_argument(
        "--password-file",
        metavar="FILE",
        default=None,
        help="a file holding the password (its first line)",
    )
    group.add_argument(
        "--tlscert",
        metavar="FILE",
        default=None,
        help="the client's certificate (PEM), with --tlskey",
    )
    group.add_argument(
        "--tlskey",
        metavar="FILE",
        default=None,
        help="the client certificate's private key (PEM, unencrypted)",
    )
    group.add_argument("--tlsca", metavar="FILE", default=None,
                       help="the CA certificates that sign the server's (PEM)")  # fmt: skip


@dataclass(frozen=True, repr=False)
class Connection:
    """Where and how to connect. Build it with ``resolve``; ``options()`` for
    nats-py, ``environment()`` for a child process, ``redacted`` for messages."""

    url: str
    user: str | None = None
    password: str | None = None
    creds: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    _context: ssl.SSLContext | None = field(default=None, compare=False)

    def __repr__(self) -> str:  # no password, not even the URL's own
        return (
            f"Connection(url={self.redacted!r}, user={self.user!r}, creds={self.creds!r}, "
            f"tls={self.tls})"
        )

    @property
    def tls(self) -> bool:
        return self._context is not None

    @property
    def redacted(self) -> str:
        """The URL without a ``user:password@`` of its own: for messages."""
        return redact(self.url)

    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.connect``, ``connect`` and ``NatsBus``."""
        options: dict[str, Any] = {}
        if self.creds is not None:
            options["user_credentials"] = self.creds
        if self.user is not None:
            options["user"] = self.user
            options["password"] = self.password
        if self._context is not None:
            options["tls"] = self._context
        return options

    def environment(self) -> dict[str, str]:
        """The ``NATS_*`` variables that make ``resolve`` in a child process give
        this connection (the child's environment, never its argv)."""
        values = {
            "NATS_URL": self.url,
            "NATS_CREDS": self.creds,
            "NATS_USER": self.user,
            "NATS_PASSWORD": self.password,
            "NATS_CERT": self.tls_cert,
            "NATS_KEY": self.tls_key,
            "NATS_CA": self.tls_ca,
        }
        return {name: value for name, value in values.items() if value is not None}


def redact(url: str) -> str:
    """``url`` (or several, comma-separated) without user information: all up to
    the last ``@`` after the scheme, whatever it holds (helper-75, helper-77: a
    password with an ``@`` or a ``/``, a URL given without its scheme)."""
    shown = []
    for one in re.split(r",(?=\w+://)", url):  # (a comma in a password splits nothing)
        head, sep, rest = one.partition("://")
        if not sep:
            head, rest = "", one
        shown.append(head + sep + rest.rpartition("@")[2])
    return ",".join(shown)


def resolve(
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    *,
    url: str | None = None,
    default_url: str | None = DEFAULT_URL,
) -> Connection | None:
    """The connection the command line and the environment describe. ``url``: the
    command's own (``restore``'s source); else ``--nats``, else ``NATS_URL``, else
    ``default_url``. ``None`` if there is no URL (``demo``: its embedded server),
    and then no connection option may be given either."""
    env = os.environ if environ is None else environ
    flags = given(args)
    if url is None:
        url = getattr(args, "nats", None) or env.get("NATS_URL") or default_url
    if url is None:
        if flags:
            raise UsageError(
                f"{flags[0]} needs --nats URL (or NATS_URL): the embedded server has no users"
            )
        return None
    return _resolve(args, env, url, flags)


def given(args: argparse.Namespace) -> list[str]:
    """The connection options on the command line, as their flags."""
    flags = {
        "creds": "--creds",
        "user": "--user",
        "password": "--password",
        "password_file": "--password-file",
        "tlscert": "--tlscert",
        "tlskey": "--tlskey",
        "tlsca": "--tlsca",
    }
    return [flag for name, flag in flags.items() if getattr(args, name, None) is not None]


def _resolve(
    args: argparse.Namespace, env: Mapping[str, str], url: str, given: list[str]
) -> Connection:
    parts = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
    creds, user, password = _credentials(args, env, given)
    if (creds or user) and (parts.username or parts.password):
        raise UsageError("the URL names a user already: give the credentials once")
    if user and password is None:
        raise UsageError(
            f"user {user!r} needs a password: --password-file FILE, NATS_PASSWORD or --password"
        )
    if password is not None and not user:
        raise UsageError("a password but no user: add --user (or NATS_USER)")
    if creds:
        _check_creds(creds, "--creds" if getattr(args, "creds", None) else "NATS_CREDS")
    cert = getattr(args, "tlscert", None) or env.get("NATS_CERT") or None
    key = getattr(args, "tlskey", None) or env.get("NATS_KEY") or None
    ca = getattr(args, "tlsca", None) or env.get("NATS_CA") or None
    context = None
    if parts.scheme == "tls" or cert or key or ca:
        context = _tls_context(cert, key, ca)
    return Connection(
        url=url, user=user, password=password, creds=creds, tls_cert=cert, tls_key=key,
        tls_ca=ca, _context=context,
    )  # fmt: skip


def _credentials(
    args: argparse.Namespace, env: Mapping[str, str], given: list[str]
) -> tuple[str | None, str | None, str | None]:
    """(creds, user, password). The way the command line chooses (``--creds``, or a
    user and password) leaves the environment's other way out."""
    if "--creds" in given:
        if {"--user", "--password", "--password-file"} & set(given):
            raise UsageError("--creds and a user or password: give one of them")
        return args.creds, None, None
    if {"--user", "--password", "--password-file"} & set(given):
        password = _password(args)
        user = args.user or env.get("NATS_USER") or None
        return None, user, password if password is not None else env.get("NATS_PASSWORD") or None
    creds = env.get("NATS_CREDS") or None
    user = env.get("NATS_USER") or None
    password = env.get("NATS_PASSWORD") or None
    if creds and (user or password):
        raise UsageError("NATS_CREDS and NATS_USER/NATS_PASSWORD are both set: unset one")
    return creds, user, password


def _password(args: argparse.Namespace) -> str | None:
    if args.password is not None and args.password_file is not None:
        raise UsageError("--password and --password-file: give one of them")
    if args.password_file is not None:
        text = _read(args.password_file, "--password-file")
        password = text.splitlines()[0] if text else ""
        if not password:
            raise UsageError(f"--password-file {args.password_file}: the file is empty")
        return password
    return args.password if args.password is not None else None


def _read(path: str, option: str) -> str:
    """The text of ``path``, or one ``UsageError`` saying why not (never its content)."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except OSError as error:
        raise UsageError(f"{option} {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{option} {path}: not a text file") from None


def _check_creds(path: str, option: str) -> None:
    """A credentials file holds a user JWT and a seed: nats-py reads it at every
    connection, and would spin for ever on a file with no JWT in it."""
    text = _read(path, option)
    lines = text.splitlines()
    try:
        jwt = lines[lines.index(_JWT_HEADER) + 1].strip()
    except (ValueError, IndexError):
        jwt = ""
    if not jwt or _SEED_HEADER not in text:
        raise UsageError(f"{option} {path}: not a NATS credentials file (no user JWT and seed)")


def _tls_context(cert: str | None, key: str | None, ca: str | None) -> ssl.SSLContext:
    """A client context that checks the server's certificate and name (against
    ``ca``, else the system's CAs), with the client's certificate if given."""
    if (cert is None) != (key is None):
        raise UsageError("--tlscert and --tlskey go together (NATS_CERT and NATS_KEY)")
    for path, option in ((ca, "--tlsca"), (cert, "--tlscert"), (key, "--tlskey")):
        if path is not None:
            _read_bytes(path, option)
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except ssl.SSLError as error:
        raise UsageError(f"--tlsca {ca}: no CA certificate in it ({_reason(error)})") from None
    if cert is not None:
        try:
            context.load_cert_chain(cert, key, password=_no_passphrase)
        except ssl.SSLError as error:
            raise UsageError(
                f"--tlscert {cert} / --tlskey {key}: they do not load as a certificate and "
                f"its key ({_reason(error)})"
            ) from None
    return context


def _read_bytes(path: str, option: str) -> None:
    try:
        with open(path, "rb") as file:
            file.read(1)
    except OSError as error:
        raise UsageError(f"{option} {path}: {error.strerror or error}") from None


def _no_passphrase() -> str:
    raise UsageError("--tlskey: the key is encrypted; give an unencrypted key file")


def _reason(error: ssl.SSLError) -> str:
    return str(error.reason or error.strerror or type(error).__name__).lower().replace("_", " ")

"""Follow checkpoint saves over NATS with nothing but nats-py and json.

    python examples/monitor_subscriber.py --nats nats://127.0.0.1:4222 [--session S] [--once]

This program never imports ``coordinator``: it reads the wire format alone
(docs/bus.md, docs/events.schema.json) and folds the events as docs/events.md
("Folding events into save state") says, rule by rule. It reads the durable state of each
session from the KV bucket CKPT_COMMITTED, replays the stream CKPT (subjects
``ckpt.<session>.<event>``) from the start with an ordered consumer, then
follows it live. Every event prints one line with the session's folded state:
high water and its step, checkpoints in flight, committed, superseded, failures
with their codes, and restores with the steps they abandoned. A jump in a
session's ``seq`` means events were missed: it is reported. ``--once`` exits
when the history is replayed and nothing new has come for ``--idle`` seconds,
printing a final JSON summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import re
from dataclasses import dataclass, field

import nats
import nats.errors
import nats.js.errors

STREAM, BUCKET, PREFIX = "CKPT", "CKPT_COMMITTED", "ckpt"
KINDS = ("captured", "queued", "superseded", "committed", "failed", "restored", "replicated")
FOLDED_IDS, MAX_MISSING, MAX_SEQ = 1024, 4096, 2**53 - 1
MAX_EVENT_ID = 259  # four Ids and three ':' (rule 1)
MAX_IN_FLIGHT = 1024  # a host has a few; beyond, captures are only counted (rule 6)
MAX_NESTING = 512  # objects and arrays within each other (rule 1); no event nests 4
MAX_JUMP, RESYNC = 4096, 16  # rule 3: no gap the bus leaves is longer; a run that re-bases
MAX_TEXT, KEPT = 500, 16  # rule 6: a code or reason is cut; the latest failures and restores


def token(session: str) -> str:
    """A session id as one subject token and KV key: every '.' is written =2E."""
    return session.replace(".", "=2E")


@dataclass
class Session:
    kv: str | None = None  # the high water the KV bucket held when we started
    high_water: str | None = None  # the newest durable checkpoint, from the events
    boundary: str | None = None  # its step (a u64, as a decimal string)
    in_flight: set[str] = field(default_factory=set)  # captured, no terminal event yet
    epochs: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=8))
    closed_out: int = 0  # captures of an older run, ended by the next run's start (rule 5)
    untracked: int = 0  # captures beyond MAX_IN_FLIGHT in flight (rule 6)
    queue_depth: int = 0  # from the latest queued; never more than in flight (rule 6)
    committed: int = 0
    superseded: int = 0
    failed: int = 0
    failures: collections.deque[dict[str, str]] = field(
        default_factory=lambda: collections.deque(maxlen=KEPT)
    )  # the latest failures (rule 6: kept bounded, whatever is published)
    restores: collections.deque[dict] = field(
        default_factory=lambda: collections.deque(maxlen=KEPT)
    )  # what the latest restores installed, and lost
    replicated: int = 0  # generations that reached the replicated tier
    replicated_high_water: str | None = None
    replicated_seq: int = 0
    last_seq: int = 0
    high_water_seq: int = 0  # the seq of the committed that set the high water
    missing: set[int] = field(default_factory=set)  # seqs skipped over, not seen yet
    lost: int = 0  # seqs skipped beyond MAX_MISSING: counted only
    folded: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=FOLDED_IDS)
    )  # this session's latest eventIds (rule 2)
    folded_seqs: collections.deque[int] = field(
        default_factory=lambda: collections.deque(maxlen=FOLDED_IDS)
    )  # ... and the seq each carried (rule 3)
    invalid: int = 0  # messages naming this session that were no events (rule 1)
    contradicting: int = 0  # events contradicting its own sequence (rule 3): not folded
    last_contradiction: str | None = None
    rebased: int = 0  # times its sequence moved to a run of agreeing strays (rule 3)
    stray_seq: int = 0
    stray_run: int = 0

    def contradicts(self, seq: int) -> str | None:
        """Rule 3's first part: why ``seq`` contradicts this session's own sequence
        (it is then counted, not folded), or None. A run of RESYNC agreeing strays
        re-bases the session, and the last of them is folded as a first event."""
        if seq == 0:
            return None
        if seq <= self.last_seq and seq in self.folded_seqs:
            return f"seq {seq} was folded already, under another eventId"
        distance = seq - self.last_seq
        if self.last_seq == 0 or abs(distance) <= MAX_JUMP:
            self.stray_seq = self.stray_run = 0  # its own sequence goes on
            return None
        agrees = self.stray_run > 0 and abs(seq - self.stray_seq) <= MAX_JUMP
        self.stray_run = self.stray_run + 1 if agrees else 1
        self.stray_seq = seq
        if self.stray_run < RESYNC:
            where = "past" if distance > 0 else "before"
            return f"seq {seq} is {abs(distance)} {where} the session's seq {self.last_seq}"
        self.rebased += 1  # the sequence itself moved: begin again from this event
        self.lost += len(self.missing)
        self.missing = set()
        self.last_seq = self.high_water_seq = self.replicated_seq = 0
        self.stray_seq = self.stray_run = 0
        kept = [0 if folded > seq else folded for folded in self.folded_seqs]
        self.folded_seqs = collections.deque(kept, maxlen=FOLDED_IDS)
        return None

    def apply(self, event: dict) -> str:
        """Fold one event in; returns a note for the line (a gap, a failure...)."""
        note, seq, kind, ckpt = "", event["seq"], event["event"], event.get("checkpointId")
        late = 0 < seq < self.last_seq  # rule 3: stored after later ones (a connection drop)
        if late:
            self.missing.discard(seq)
            note = f"  (late: seq {seq} after {self.last_seq})"
        elif seq > 0:  # seq 0: an older version's re-announcement, outside the sequence
            if self.last_seq and seq > self.last_seq + 1:
                skipped = range(max(self.last_seq + 1, seq - MAX_MISSING), seq)
                self.lost += seq - self.last_seq - 1 - len(skipped)
                self.missing.update(skipped)
                if len(self.missing) > MAX_MISSING:  # keep the newest: bounded memory
                    kept = set(sorted(self.missing)[-MAX_MISSING:])
                    self.lost += len(self.missing) - len(kept)
                    self.missing = kept
                note = f"  GAP: missed seq {self.last_seq + 1}..{seq - 1}"
            self.last_seq = seq
        if kind not in KINDS or not fits(event):  # rule 4: its seq counted, no more
            return note + f"  (a kind or body this monitor does not know: {kind})"
        if not late and seq > 0 and kind != "replicated" and event["epoch"] not in self.epochs:
            self.epochs.append(event["epoch"])  # rule 5: a new run; the older ones are over
            self.closed_out += len(self.in_flight)
            self.in_flight.clear()
        if kind == "replicated":  # the replicated tier: never the local high water
            self.replicated += 1
            if self.replicated_high_water is None or (seq > 0 and seq >= self.replicated_seq):
                self.replicated_high_water, self.replicated_seq = ckpt, seq
            return note + f"  to the replicated tier as {event.get('object')}"
        if kind == "captured":
            if late:  # a late one may be over already
                pass
            elif len(self.in_flight) < MAX_IN_FLIGHT or ckpt in self.in_flight:
                self.in_flight.add(ckpt)
            else:
                self.untracked += 1
        elif kind == "queued" and not late:
            self.queue_depth = int(event["queueDepth"])
        elif kind in ("superseded", "committed", "failed"):
            self.in_flight.discard(ckpt)
        self.queue_depth = min(self.queue_depth, len(self.in_flight))  # queued is in flight
        # Only an event after the one that set the high water moves it: never back.
        newest = self.high_water is None or (seq > 0 and seq >= self.high_water_seq)
        if kind == "committed":  # the only event that means saved
            self.committed += 1
            if newest:
                self.high_water, self.boundary = event["highWater"], event["boundary"]
                self.high_water_seq = seq
        elif kind == "superseded":
            self.superseded += 1
            note += f"  by {event['supersededBy']}"
        elif kind == "failed":
            self.failed += 1
            code, reason = event["code"][:MAX_TEXT], event["reason"][:MAX_TEXT]
            self.failures.append({"checkpointId": ckpt, "code": code})
            note += f"  {code}: {reason}"
        elif kind == "restored":  # the high water is the checkpoint restored now
            if newest:
                self.high_water, self.boundary = ckpt, event["boundary"]
                self.high_water_seq = seq
            lost = [event["abandonedFrom"], event["abandonedTo"]]
            self.restores.append({
                "checkpointId": ckpt, "epoch": event["epoch"], "reason": event["reason"][:MAX_TEXT],
                "previousEpoch": event["previousEpoch"],
                "abandoned": lost if lost[0] is not None else None,
            })  # fmt: skip
            note += f"  {event['reason'][:MAX_TEXT]} into {event['epoch']}; abandoned " + (
                f"{event['previousEpoch']} steps {lost[0]}-{lost[1]}" if lost[0] else "nothing"
            )
        return note

    def summary(self) -> dict:
        return {
            "kv": self.kv, "highWater": self.high_water, "boundary": self.boundary,
            "inFlight": sorted(self.in_flight), "untracked": self.untracked,
            "queueDepth": self.queue_depth,
            "closedOut": self.closed_out,
            "committed": self.committed,
            "superseded": self.superseded, "failed": list(self.failures),
            "failedCount": self.failed, "restores": list(self.restores),
            "lastSeq": self.last_seq, "gaps": self.gaps(), "lost": self.lost,
            "replicated": self.replicated, "replicatedHighWater": self.replicated_high_water,
            "invalid": self.invalid, "contradicting": self.contradicting,
            "lastContradiction": self.last_contradiction, "rebased": self.rebased,
        }  # fmt: skip

    def gaps(self) -> list[list[int]]:
        """The missed seqs as [first, last] ranges."""
        ranges: list[list[int]] = []
        for number in sorted(self.missing):
            if ranges and ranges[-1][1] == number - 1:
                ranges[-1][1] = number
            else:
                ranges.append([number, number])
        return ranges


# The fields the fold reads from each kind, and their form (rule 4: a body that does
# not fit is folded like an unknown kind).
ID = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
U64 = re.compile(r"0|[1-9][0-9]{0,19}")
FORMS = {
    "id": lambda v: isinstance(v, str) and ID.fullmatch(v) is not None,
    "u64": lambda v: isinstance(v, str) and U64.fullmatch(v) is not None and int(v) < 2**64,
    "u64?": lambda v: v is None or FORMS["u64"](v),
    "text": lambda v: isinstance(v, str),
    "count": lambda v: is_seq(v),  # an integral number from 0 to 2^53 - 1, as seq
}
FIELDS = {
    "captured": {"checkpointId": "id", "epoch": "id"},
    "queued": {"checkpointId": "id", "epoch": "id", "queueDepth": "count"},
    "superseded": {"checkpointId": "id", "epoch": "id", "supersededBy": "id"},
    "committed": {"checkpointId": "id", "epoch": "id", "highWater": "id", "boundary": "u64"},
    "failed": {"checkpointId": "id", "epoch": "id", "code": "text", "reason": "text"},
    "replicated": {"checkpointId": "id", "epoch": "id"},
    "restored": {"checkpointId": "id", "epoch": "id", "boundary": "u64", "reason": "text",
                 "previousEpoch": "id", "abandonedFrom": "u64?", "abandonedTo": "u64?"},
}  # fmt: skip


def fits(event: dict) -> bool:
    """Every field the fold reads is there, of its form (null only where '?')."""
    forms = FIELDS[event["event"]].items()
    return all(name in event and FORMS[form](event[name]) for name, form in forms)


async def read_durable(js, session: str | None) -> dict[str, dict]:
    """The latest ``committed`` event per session, from the KV bucket (key: the
    session's token)."""
    try:
        kv = await js.key_value(BUCKET)
        # Keys with a '.' (<token>.seq) are the bus's seq reservations, not sessions.
        keys = [token(session)] if session else [k for k in await kv.keys() if "." not in k]
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.NoKeysError):
        return {}
    durable = {}
    for key in keys:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError, ValueError, TypeError):
            event = parse((await kv.get(key)).value)
            named = event.get("sessionId") if isinstance(event, dict) else None
            # Only the session's own key says what it saved: whoever may write one
            # key would otherwise speak for every session.
            if isinstance(named, str) and token(named) == key and isinstance(event.get("highWater"), str):
                durable[named] = event
    return durable


def refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def number(digits: str) -> int | float:
    """An integer as JSON writes it; one longer than Python converts (4300 digits) is
    read as infinite: no seq, no count, and nothing in a field the fold does not read."""
    return int(digits) if len(digits) <= 4300 else float("inf")


def parse(data: bytes) -> object:
    """The JSON value of a message, or None: it must be UTF-8 (no BOM) and JSON
    (no NaN, no lone surrogate, nested at most 512 deep); rule 1 skips the rest."""
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=refuse, parse_int=number)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate fails
    except (ValueError, RecursionError):
        return None
    return value if nesting(value) <= MAX_NESTING else None


def nesting(value: object) -> int:
    """How many objects and arrays deep ``value`` goes (an object of numbers: 1)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest


def is_seq(value: object) -> bool:
    """An integral JSON number from 0 to 2^53 - 1 (1.0 is 1; true is no number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return 0 <= value <= MAX_SEQ and float(value).is_integer()


def is_event(event: object) -> bool:
    """Rule 1: a JSON object with a string event, an Id sessionId, an eventId of at
    most 259 characters and a seq; anything else is no event."""
    if not isinstance(event, dict):
        return False
    session_id, event_id = event.get("sessionId"), event.get("eventId")
    return (
        isinstance(event.get("event"), str)
        and isinstance(session_id, str) and ID.fullmatch(session_id) is not None
        and isinstance(event_id, str) and len(event_id) <= MAX_EVENT_ID
        and is_seq(event.get("seq"))
    )  # fmt: skip


@dataclass
class Monitor:
    sessions: dict[str, Session] = field(default_factory=dict)
    events: int = 0
    duplicates: int = 0
    skipped: int = 0  # messages that were no events (rule 1)

    def receive(self, data: bytes, subject: str) -> None:
        event = parse(data)
        if is_event(event) and subject.split(".")[1:2] != [token(event["sessionId"])]:
            # An event on another session's subject is no event of that session:
            # publish rights on the subjects are the defence (docs/events.md).
            self.skipped += 1
            print(f"skipped an event naming {event['sessionId']} on {subject}")
            return
        if not is_event(event):  # rule 1: counted, and on a session followed, there too
            self.skipped += 1
            named = event.get("sessionId") if isinstance(event, dict) else None
            if isinstance(named, str) and named in self.sessions:
                self.sessions[named].invalid += 1
            print("skipped a message that is not an event")
            return
        kind, session_id, event_id = event["event"], event["sessionId"], event["eventId"]
        event["seq"] = seq = int(event["seq"])
        state = self.sessions.setdefault(session_id, Session())
        if event_id in state.folded:  # rule 2: a re-publication
            self.duplicates += 1
            return
        why = state.contradicts(seq)  # rule 3: not this session's own sequence
        if why is not None:
            state.contradicting += 1
            state.last_contradiction = why
            print(f"{session_id:12} {seq:5} {kind:10} CONTRADICTS its session: {why}")
            return
        state.folded.append(event_id)
        state.folded_seqs.append(seq)
        self.events += kind in KINDS
        note = state.apply(event)
        ckpt = event.get("checkpointId")
        shown = ckpt if isinstance(ckpt, str) else "-"
        print(
            f"{session_id:12} {event['seq']:5} {kind:10} {shown:14} "
            f"hw={state.high_water}@{state.boundary} in-flight={len(state.in_flight)} "
            f"committed={state.committed} superseded={state.superseded} "
            f"failed={state.failed}{note}",
            flush=True,
        )

    def summary(self) -> str:
        sessions = {name: state.summary() for name, state in sorted(self.sessions.items())}
        counts = {"events": self.events, "duplicates": self.duplicates, "skipped": self.skipped}
        return json.dumps({"sessions": sessions, **counts})


async def run(url: str, session: str | None, once: bool, idle: float) -> int:
    if session is not None and not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,63}", session):
        print(f"--session {session!r} is not a session id (a wildcard would follow others)")
        return 2

    async def quiet(error: Exception) -> None:  # nats-py would log a traceback a try
        pass

    try:  # bounded: an unreachable server is one clear line, in about 3 s
        nc = await asyncio.wait_for(
            nats.connect(url, connect_timeout=1, max_reconnect_attempts=1, error_cb=quiet), 3
        )
    except Exception as error:
        print(f"cannot reach NATS at {url} ({type(error).__name__})")
        return 1
    js = nc.jetstream()
    state = Monitor()
    for key, event in (await read_durable(js, session)).items():
        state.sessions[key] = Session(kv=event["highWater"])
        print(f"durable  {key}: {event['highWater']} (step {event['boundary']})")
    subject = f"{PREFIX}.{token(session)}.*" if session else f"{PREFIX}.>"
    try:  # ordered, ephemeral, in-memory consumer; delivers everything from the start
        sub = await js.subscribe(subject, stream=STREAM, ordered_consumer=True)
    except nats.js.errors.NotFoundError:
        print(f"no stream {STREAM} on {url}: nothing has been published yet")
        await nc.close()
        return 1
    info = await sub.consumer_info()  # nothing pending, nothing sent: no history at all
    replayed = info.num_pending == 0 and info.delivered.consumer_seq == 0
    announced = False
    while True:
        if replayed and not once and not announced:
            print("-- history replayed; following live (Ctrl-C to stop) --", flush=True)
            announced = True
        try:
            msg = await sub.next_msg(timeout=idle)
        except nats.errors.TimeoutError:
            if replayed and once:
                break  # the history is replayed and nothing came for `idle` seconds
            continue
        state.receive(msg.data, msg.subject)
        replayed = replayed or msg.metadata.num_pending == 0  # the history's last message
    await nc.close()
    print(state.summary())
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nats", default="nats://127.0.0.1:4222", help="server URL")
    parser.add_argument("--session", help="follow one session (default: all)")
    parser.add_argument("--once", action="store_true", help="replay, wait until idle, exit")
    parser.add_argument("--idle", type=float, default=1.0, help="idle seconds for --once")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(run(args.nats, args.session, args.once, args.idle))
    return 130


if __name__ == "__main__":
    raise SystemExit(main())

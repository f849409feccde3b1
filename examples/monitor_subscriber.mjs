// Follow checkpoint saves over NATS with nothing but nats.js: no coordinator code.
//
//     npm install && node examples/monitor_subscriber.mjs --nats nats://127.0.0.1:4222 [--session S] [--once]
//
// It reads the wire format alone (docs/bus.md, docs/events.schema.json) and folds
// the events as docs/events.md ("Folding events into save state") says, rule by
// rule: the durable state of each session from the KV bucket CKPT_COMMITTED, then
// the stream CKPT (subjects ckpt.<session token>.<event>) replayed from the start
// with an ordered consumer, then followed live. Every event prints one line with
// the session's folded state; a jump in seq is reported as a gap. --once exits
// once the history is replayed and nothing new came for --idle seconds, printing
// a final JSON summary line (the same one examples/monitor_subscriber.py prints).

import { connect } from "nats";

const STREAM = "CKPT";
const BUCKET = "CKPT_COMMITTED";
const PREFIX = "ckpt";
const KINDS = new Set([
  "captured", "queued", "superseded", "committed", "failed", "restored", "replicated",
]);
const FOLDED_IDS = 1024;
const MAX_MISSING = 4096;
const MAX_SEQ = Number.MAX_SAFE_INTEGER; // 2**53 - 1
const MAX_EVENT_ID = 259; // four Ids and three ':' (rule 1), in code points
const MAX_IN_FLIGHT = 1024; // a host has a few; beyond, captures are only counted (rule 6)
const MAX_TEXT = 500; // rule 6: a code or reason is cut, in code points
const KEPT = 16; // the latest failures and restores (rule 6: bounded, whatever is published)
const cut = (text) => [...text].slice(0, MAX_TEXT).join("");
const keep = (list, item) => {
  list.push(item);
  if (list.length > KEPT) list.shift();
};
// Messages are UTF-8: a bad byte or a BOM makes no event (rule 1), as in Python.
const UTF8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true });
// JSON.parse takes what Python's readers refuse: nesting deeper than 512 levels
// (objects and arrays within each other) and lone surrogates. Such a message is no
// event and names no session.
const MAX_DEPTH = 512;
const readable = (value, depth = 0) => {
  if (typeof value === "string") return value.isWellFormed();
  if (value === null || typeof value !== "object") return true;
  return depth < MAX_DEPTH && Object.entries(value).every(
    ([key, item]) => key.isWellFormed() && readable(item, depth + 1),
  );
};
const MAX_JUMP = 4096; // rule 3: no gap the bus leaves is longer ...
const RESYNC = 16; // ... unless this many strays in a row agree: the sequence moved

// The fields the fold reads from each kind, and their form (rule 4: a body that
// does not fit is folded like an unknown kind).
const ID = /^[a-z0-9][a-z0-9._-]{0,63}$/;
const U64 = /^(0|[1-9][0-9]{0,19})$/;
const FORMS = {
  id: (v) => typeof v === "string" && ID.test(v),
  u64: (v) => typeof v === "string" && U64.test(v) && BigInt(v) < 2n ** 64n,
  "u64?": (v) => v === null || FORMS.u64(v),
  text: (v) => typeof v === "string",
  count: (v) => Number.isInteger(v) && v >= 0 && v <= MAX_SEQ, // as seq
};
const FIELDS = {
  captured: { checkpointId: "id", epoch: "id" },
  queued: { checkpointId: "id", epoch: "id", queueDepth: "count" },
  superseded: { checkpointId: "id", epoch: "id", supersededBy: "id" },
  committed: { checkpointId: "id", epoch: "id", highWater: "id", boundary: "u64" },
  failed: { checkpointId: "id", epoch: "id", code: "text", reason: "text" },
  replicated: { checkpointId: "id", epoch: "id" },
  restored: {
    checkpointId: "id", epoch: "id", boundary: "u64", reason: "text",
    previousEpoch: "id", abandonedFrom: "u64?", abandonedTo: "u64?",
  },
};
const fits = (event) =>
  Object.entries(FIELDS[event.event]).every(([name, form]) => FORMS[form](event[name]));

// A session id as one subject token and KV key: every '.' is written =2E.
const token = (session) => session.replaceAll(".", "=2E");

class Session {
  constructor(kv = null) {
    this.kv = kv; // the high water the KV bucket held when we started
    this.highWater = null;
    this.boundary = null;
    this.highWaterSeq = 0;
    this.inFlight = new Set();
    this.queueDepth = 0;
    this.committed = 0;
    this.superseded = 0;
    this.failed = 0;
    this.failures = [];
    this.restores = [];
    this.epoch = null;
    this.epochs = []; // the latest 8 epochs seen
    this.closedOut = 0; // captures of an older run, ended by the next run's start (rule 5)
    this.untracked = 0; // captures beyond MAX_IN_FLIGHT in flight (rule 6)
    this.lastSeq = 0;
    this.missing = new Set();
    this.lost = 0; // seqs skipped beyond MAX_MISSING: counted only
    this.replicated = 0; // generations that reached the replicated tier
    this.replicatedHighWater = null;
    this.replicatedSeq = 0;
    this.folded = []; // the latest FOLDED_IDS eventIds (rule 2) ...
    this.foldedSeqs = []; // ... and the seq each carried (rule 3)
    this.invalid = 0; // messages naming this session that were no events (rule 1)
    this.contradicting = 0; // events contradicting its own sequence (rule 3): not folded
    this.lastContradiction = null;
    this.rebased = 0; // times its sequence moved to a run of agreeing strays (rule 3)
    this.straySeq = 0;
    this.strayRun = 0;
  }

  // Rule 3's first part: why seq contradicts this session's own sequence (it is
  // then counted, not folded), or null. RESYNC agreeing strays in a row re-base
  // the session, and the last of them is folded as a first event.
  contradicts(seq) {
    if (seq === 0) return null;
    if (seq <= this.lastSeq && this.foldedSeqs.includes(seq)) {
      return `seq ${seq} was folded already, under another eventId`;
    }
    const distance = seq - this.lastSeq;
    if (this.lastSeq === 0 || Math.abs(distance) <= MAX_JUMP) {
      this.straySeq = this.strayRun = 0; // its own sequence goes on
      return null;
    }
    const agrees = this.strayRun > 0 && Math.abs(seq - this.straySeq) <= MAX_JUMP;
    this.strayRun = agrees ? this.strayRun + 1 : 1;
    this.straySeq = seq;
    if (this.strayRun < RESYNC) {
      const where = distance > 0 ? "past" : "before";
      return `seq ${seq} is ${Math.abs(distance)} ${where} the session's seq ${this.lastSeq}`;
    }
    this.rebased += 1; // the sequence itself moved: begin again from this event
    this.lost += this.missing.size;
    this.missing = new Set();
    this.lastSeq = this.highWaterSeq = this.replicatedSeq = 0;
    this.straySeq = this.strayRun = 0;
    this.foldedSeqs = this.foldedSeqs.map((folded) => (folded > seq ? 0 : folded));
    return null;
  }

  // Rules 2 and 3 passed: remember the event's id and seq.
  remember(event) {
    this.folded.push(event.eventId);
    this.foldedSeqs.push(event.seq);
    if (this.folded.length > FOLDED_IDS) {
      this.folded.shift();
      this.foldedSeqs.shift();
    }
  }

  // Rules 3-6 of docs/events.md; returns a note for the line.
  apply(event) {
    const { seq, event: kind, checkpointId: ckpt } = event;
    let note = "";
    const late = seq > 0 && seq < this.lastSeq; // rule 3
    if (late) {
      this.missing.delete(seq);
      note = `  (late: seq ${seq} after ${this.lastSeq})`;
    } else if (seq > 0) {
      if (this.lastSeq && seq > this.lastSeq + 1) {
        const first = Math.max(this.lastSeq + 1, seq - MAX_MISSING);
        this.lost += first - (this.lastSeq + 1);
        for (let n = first; n < seq; n++) this.missing.add(n);
        if (this.missing.size > MAX_MISSING) { // keep the newest: bounded memory
          const kept = [...this.missing].sort((a, b) => a - b).slice(-MAX_MISSING);
          this.lost += this.missing.size - kept.length;
          this.missing = new Set(kept);
        }
        note = `  GAP: missed seq ${this.lastSeq + 1}..${seq - 1}`;
      }
      this.lastSeq = seq;
    }
    if (!KINDS.has(kind) || !fits(event)) { // rule 4: its seq counted, no more
      return note + `  (a kind or body this monitor does not know: ${kind})`;
    }
    if (!late && seq > 0 && kind !== "replicated" && !this.epochs.includes(event.epoch)) {
      // rule 5: a new run; the older runs' captures are over
      this.epoch = event.epoch;
      this.epochs = [...this.epochs.slice(-7), event.epoch];
      this.closedOut += this.inFlight.size;
      this.inFlight.clear();
    }
    const newest = this.highWater === null || (seq > 0 && seq >= this.highWaterSeq);
    if (kind === "replicated") { // the replicated tier: never the local high water
      this.replicated += 1;
      if (this.replicatedHighWater === null || (seq > 0 && seq >= this.replicatedSeq)) {
        [this.replicatedHighWater, this.replicatedSeq] = [ckpt, seq];
      }
      return note + `  to the replicated tier as ${event.object}`;
    }
    if (kind === "captured") {
      if (late) {
        // a late one may be over already
      } else if (this.inFlight.size < MAX_IN_FLIGHT || this.inFlight.has(ckpt)) {
        this.inFlight.add(ckpt);
      } else {
        this.untracked += 1;
      }
    } else if (kind === "queued") {
      if (!late) this.queueDepth = event.queueDepth;
    } else if (kind === "restored") {
      const lost = event.abandonedFrom === null ? null : [event.abandonedFrom, event.abandonedTo];
      keep(this.restores, {
        checkpointId: ckpt, epoch: event.epoch, reason: cut(event.reason),
        previousEpoch: event.previousEpoch, abandoned: lost,
      });
      if (newest) [this.highWater, this.boundary, this.highWaterSeq] = [ckpt, event.boundary, seq];
      note += `  ${cut(event.reason)} into ${event.epoch}; abandoned ` +
        (lost ? `${event.previousEpoch} steps ${lost[0]}-${lost[1]}` : "nothing");
    } else {
      this.inFlight.delete(ckpt);
      if (kind === "committed") { // the only event that means saved
        this.committed += 1;
        if (newest) {
          [this.highWater, this.boundary, this.highWaterSeq] = [event.highWater, event.boundary, seq];
        }
      } else if (kind === "superseded") {
        this.superseded += 1;
        note += `  by ${event.supersededBy}`;
      } else {
        this.failed += 1;
        keep(this.failures, { checkpointId: ckpt, code: cut(event.code) });
        note += `  ${cut(event.code)}: ${cut(event.reason)}`;
      }
    }
    this.queueDepth = Math.min(this.queueDepth, this.inFlight.size); // queued is in flight
    return note;
  }

  // The missed seqs as [first, last] ranges.
  gaps() {
    const ranges = [];
    for (const n of [...this.missing].sort((a, b) => a - b)) {
      const last = ranges.at(-1);
      if (last && last[1] === n - 1) last[1] = n;
      else ranges.push([n, n]);
    }
    return ranges;
  }

  summary() {
    return {
      kv: this.kv, highWater: this.highWater, boundary: this.boundary,
      inFlight: [...this.inFlight].sort(), untracked: this.untracked, queueDepth: this.queueDepth,
      closedOut: this.closedOut,
      committed: this.committed,
      superseded: this.superseded, failed: this.failures, failedCount: this.failed,
      restores: this.restores,
      lastSeq: this.lastSeq, gaps: this.gaps(), lost: this.lost,
      replicated: this.replicated, replicatedHighWater: this.replicatedHighWater,
      invalid: this.invalid, contradicting: this.contradicting,
      lastContradiction: this.lastContradiction, rebased: this.rebased,
    };
  }
}

class Monitor {
  constructor() {
    this.sessions = new Map();
    this.events = 0;
    this.duplicates = 0;
    this.skipped = 0;
  }

  receive(data, subject) {
    let event;
    try {
      event = JSON.parse(UTF8.decode(data));
    } catch {
      event = null;
    }
    if (!readable(event)) event = null;
    const object = event !== null && typeof event === "object" && !Array.isArray(event);
    const fields = object && typeof event.event === "string" &&
      typeof event.sessionId === "string" && ID.test(event.sessionId) &&
      typeof event.eventId === "string" && [...event.eventId].length <= MAX_EVENT_ID &&
      Number.isInteger(event.seq) && event.seq >= 0 && event.seq <= MAX_SEQ;
    if (!fields) { // rule 1: counted, and on a session followed, there too
      this.skipped += 1;
      const named = object ? event.sessionId : null;
      if (typeof named === "string" && this.sessions.has(named)) {
        this.sessions.get(named).invalid += 1;
      }
      console.log("skipped a message that is not an event");
      return;
    }
    if (subject.split(".")[1] !== token(event.sessionId)) {
      // An event on another session's subject is no event of that session:
      // publish rights on the subjects are the defence (docs/events.md).
      this.skipped += 1;
      console.log(`skipped an event naming ${event.sessionId} on ${subject}`);
      return;
    }
    if (!this.sessions.has(event.sessionId)) this.sessions.set(event.sessionId, new Session());
    const state = this.sessions.get(event.sessionId);
    if (state.folded.includes(event.eventId)) { // rule 2: a re-publication
      this.duplicates += 1;
      return;
    }
    const why = state.contradicts(event.seq); // rule 3: not this session's own sequence
    if (why !== null) {
      state.contradicting += 1;
      state.lastContradiction = why;
      console.log(`${event.sessionId.padEnd(12)} ${String(event.seq).padStart(5)} ` +
        `${event.event.padEnd(10)} CONTRADICTS its session: ${why}`);
      return;
    }
    state.remember(event);
    const note = state.apply(event);
    if (KINDS.has(event.event)) this.events += 1;
    console.log(
      `${event.sessionId.padEnd(12)} ${String(event.seq).padStart(5)} ${event.event.padEnd(10)} ` +
      `${(typeof event.checkpointId === "string" ? event.checkpointId : "-").padEnd(14)} ` +
      `hw=${state.highWater}@${state.boundary} ` +
      `in-flight=${state.inFlight.size} committed=${state.committed} ` +
      `superseded=${state.superseded} failed=${state.failed}${note}`,
    );
  }

  summary() {
    const sessions = Object.fromEntries(
      [...this.sessions.entries()].sort(([a], [b]) => (a < b ? -1 : 1))
        .map(([name, state]) => [name, state.summary()]),
    );
    return JSON.stringify({
      sessions, events: this.events, duplicates: this.duplicates, skipped: this.skipped,
    });
  }
}

// The latest committed event per session, from the KV bucket (key: the session's token).
async function readDurable(js, session) {
  let kv;
  try {
    kv = await js.views.kv(BUCKET, { bindOnly: true });
  } catch {
    return new Map();
  }
  const keys = [];
  try { // (a view bound to no bucket throws only here)
    if (session) keys.push(token(session));
    else for await (const key of await kv.keys()) if (!key.includes(".")) keys.push(key);
  } catch {
    return new Map();
  }
  const durable = new Map();
  for (const key of keys) {
    let entry;
    try {
      entry = await kv.get(key);
    } catch {
      return durable; // no bucket: nothing durable known yet
    }
    if (!entry || entry.operation !== "PUT") continue;
    let event;
    try {
      event = JSON.parse(UTF8.decode(entry.value));
    } catch {
      continue; // not an event: nothing durable to show for it
    }
    // Only the session's own key says what it saved: whoever may write one key
    // would otherwise speak for every session.
    if (typeof event?.sessionId === "string" && token(event.sessionId) === key &&
      typeof event?.highWater === "string") {
      durable.set(event.sessionId, event);
    }
  }
  return durable;
}

function options(argv) {
  const found = { nats: "nats://127.0.0.1:4222", session: null, once: false, idle: 1.0 };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--once") found.once = true;
    else if (arg === "--nats") found.nats = argv[++i];
    else if (arg === "--session") found.session = argv[++i];
    else if (arg === "--idle") found.idle = Number(argv[++i]);
    else throw new Error(`unknown argument ${arg}`);
  }
  return found;
}

async function main() {
  const args = options(process.argv.slice(2));
  if (args.session !== null && !ID.test(args.session)) {
    console.log(`--session ${JSON.stringify(args.session)} is not a session id`);
    return 2;
  }
  let nc;
  try { // bounded: an unreachable server is one clear line
    nc = await connect({ servers: args.nats, timeout: 3000, maxReconnectAttempts: 1 });
  } catch (error) {
    console.log(`cannot reach NATS at ${args.nats} (${error.code ?? error.message})`);
    return 1;
  }
  const js = nc.jetstream();
  const monitor = new Monitor();
  for (const [session, event] of await readDurable(js, args.session)) {
    monitor.sessions.set(session, new Session(event.highWater));
    console.log(`durable  ${session}: ${event.highWater} (step ${event.boundary})`);
  }
  const subject = args.session ? `${PREFIX}.${token(args.session)}.*` : `${PREFIX}.>`;
  let consumer;
  try { // ordered, ephemeral: delivers everything from the start
    consumer = await js.consumers.get(STREAM, { filterSubjects: [subject] });
  } catch {
    console.log(`no stream ${STREAM} on ${args.nats}: nothing has been published yet`);
    await nc.close();
    return 1;
  }
  const info = await consumer.info();
  let replayed = info.num_pending === 0;
  let announced = false;
  for (;;) {
    if (replayed && !args.once && !announced) {
      console.log("-- history replayed; following live (Ctrl-C to stop) --");
      announced = true;
    }
    const message = await consumer.next({ expires: Math.max(1000, args.idle * 1000) });
    if (message === null) {
      if (replayed && args.once) break; // replayed, and nothing came for `idle` seconds
      continue;
    }
    monitor.receive(message.data, message.subject);
    replayed = replayed || message.info.pending === 0; // the history's last message
  }
  await nc.close();
  console.log(monitor.summary());
  return 0;
}

process.exitCode = await main();

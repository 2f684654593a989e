"""The queue's file: one SQLite file under the server's root (WAL, synchronous=FULL: a job the API accepted
survives kill -9 and a power cut), opened only once it is known to be a bcg queue this server can write, its
tables made or brought up to date. `QueueFile`: its one connection and one lock, shared by the parts of
`store.Store`. Torch-free.
"""

from __future__ import annotations

import errno
import os
import re
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path

from storyboard_cli.errors import BadInput

DB = "queue.sqlite3"
APPLICATION_ID = 0x62636771  # PRAGMA application_id of a bcg queue ("bcgq"): another program's SQLite file is refused
SCHEMA_VERSION = 1  # PRAGMA user_version: a queue written by a newer bcg is refused, not rewritten
KEEP = "the file is the only record of the jobs this server accepted: keep it, never delete or overwrite it"

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, idem_key TEXT UNIQUE, content_hash TEXT NOT NULL, name TEXT NOT NULL, path TEXT NOT NULL,
  out_dir TEXT NOT NULL, priority TEXT NOT NULL, submitted REAL NOT NULL, batch INTEGER NOT NULL,
  canceled INTEGER NOT NULL DEFAULT 0, finished REAL, front REAL);
CREATE TABLE IF NOT EXISTS images (
  id INTEGER PRIMARY KEY, job TEXT NOT NULL REFERENCES jobs(id), ord INTEGER NOT NULL, shot TEXT NOT NULL,
  k INTEGER NOT NULL, seed INTEGER NOT NULL, outputs TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,
  state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, lease TEXT, reason TEXT, cached INTEGER NOT NULL DEFAULT 0,
  done REAL, mix TEXT, cost REAL NOT NULL DEFAULT 1, worker TEXT, leased REAL,
  est REAL NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS images_state ON images(state);
CREATE INDEX IF NOT EXISTS images_job ON images(job);
CREATE INDEX IF NOT EXISTS images_fingerprint ON images(fingerprint, state);
CREATE INDEX IF NOT EXISTS images_done ON images(done);
CREATE INDEX IF NOT EXISTS images_lease ON images(lease) WHERE lease IS NOT NULL;
CREATE TABLE IF NOT EXISTS leases (id TEXT PRIMARY KEY, worker TEXT NOT NULL, job TEXT NOT NULL, expires REAL NOT NULL,
  started REAL, est REAL NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL, kind TEXT NOT NULL,
  data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_job ON events(job, seq);
CREATE TABLE IF NOT EXISTS histograms (name TEXT NOT NULL, label TEXT NOT NULL, bucket INTEGER NOT NULL,
  n INTEGER NOT NULL, PRIMARY KEY (name, label, bucket));
CREATE TABLE IF NOT EXISTS histogram_sums (name TEXT NOT NULL, label TEXT NOT NULL, total REAL NOT NULL,
  PRIMARY KEY (name, label));
CREATE TABLE IF NOT EXISTS workers (id TEXT PRIMARY KEY, name TEXT NOT NULL, seen REAL NOT NULL, ttl REAL NOT NULL,
  gpu TEXT, ready INTEGER NOT NULL DEFAULT 0, first_ready REAL, strikes INTEGER NOT NULL DEFAULT 0, quarantined TEXT,
  warm TEXT);
CREATE TABLE IF NOT EXISTS controls (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS calibration (seq INTEGER PRIMARY KEY AUTOINCREMENT, worker TEXT NOT NULL,
  ratio REAL NOT NULL);
"""
# a queue made before application_id was set holds only these (sqlite_sequence: AUTOINCREMENT's)
QUEUE_TABLES = set(re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", SCHEMA)) | {"sqlite_sequence"}


class QueueUnusable(BadInput):
    """The queue file cannot be this server's queue (damaged, another program's, read-only, of a newer bcg);
    refused before anything was written to it."""


class QueueFile:
    """The queue's one connection and the one lock every transaction holds (`_tx`). `refused`: a transaction was
    refused for want of space (the disk full to the last byte) since the last one that renewed the live leases
    (`_outage_over`): the heartbeats it could not record were not the workers' fault."""

    def __init__(self, root: Path):
        self.db = _open(root)  # raises QueueUnusable
        self.lock = threading.Lock()
        self.refused, self._renewed = False, False
        _migrate(self.db)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _tx(self):
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
                self.db.execute("COMMIT")
                self.refused = self.refused and not self._renewed
            except BaseException as e:
                if self.db.in_transaction:  # a COMMIT refused (a full disk) may leave it open
                    self.db.execute("ROLLBACK")
                self.refused = self.refused or _full(e)
                raise
            finally:
                self._renewed = False

    def _outage_over(self, db, now: float) -> None:
        """Before a transaction judges who is alive (`_forget`, `_expire`): after transactions refused for want of
        space, the time they could not be written counts against no worker, as a server's downtime does not
        (`Store.restarted`): every registration counts as seen now, and every lease as renewed now for its worker's
        ttl. Once this transaction commits, that is done."""
        if not self.refused:
            return
        db.execute("UPDATE workers SET seen = MAX(seen, ?)", (now,))
        db.execute("UPDATE leases SET expires = MAX(expires, ? + COALESCE((SELECT ttl FROM workers w "
                   "WHERE w.id = leases.worker), 0))", (now,))
        self._renewed = True


def _full(e: BaseException) -> bool:
    """Whether a transaction was refused for want of space (SQLite's "database or disk is full", or the OS's)."""
    if isinstance(e, sqlite3.OperationalError):
        return getattr(e, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_FULL
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def _migrate(db: sqlite3.Connection) -> None:
    """The tables made, and a queue of an older bcg brought up to date."""
    db.executescript(SCHEMA)
    columns = {r["name"] for r in db.execute("PRAGMA table_info(images)")}
    if "mix" not in columns:  # a queue of v1
        db.execute("ALTER TABLE images ADD COLUMN mix TEXT")
    if "cost" not in columns:  # before batches were ordered by their work
        db.execute("ALTER TABLE images ADD COLUMN cost REAL NOT NULL DEFAULT 1")
    if "worker" not in columns:  # before the queue page: who rendered an image, and when its lease began
        db.execute("ALTER TABLE images ADD COLUMN worker TEXT")
        db.execute("ALTER TABLE images ADD COLUMN leased REAL")
    if "front" not in {r["name"] for r in db.execute("PRAGMA table_info(jobs)")}:  # before move to front
        db.execute("ALTER TABLE jobs ADD COLUMN front REAL")
    if "est" not in columns:  # before the time estimates (serve/estimates.py)
        db.execute("ALTER TABLE images ADD COLUMN est REAL NOT NULL DEFAULT 0")
    if "started" not in {r["name"] for r in db.execute("PRAGMA table_info(leases)")}:
        db.execute("ALTER TABLE leases ADD COLUMN started REAL")
        db.execute("ALTER TABLE leases ADD COLUMN est REAL NOT NULL DEFAULT 0")
    worker_columns = {r["name"] for r in db.execute("PRAGMA table_info(workers)")}
    if "ttl" in worker_columns and "first_ready" not in worker_columns:  # before the start-up histogram
        db.execute("ALTER TABLE workers ADD COLUMN first_ready REAL")
    if "ttl" in worker_columns and "strikes" not in worker_columns:  # before quarantine
        db.execute("ALTER TABLE workers ADD COLUMN strikes INTEGER NOT NULL DEFAULT 0")
        db.execute("ALTER TABLE workers ADD COLUMN quarantined TEXT")
    if "ttl" in worker_columns and "warm" not in worker_columns:  # before the queue page
        db.execute("ALTER TABLE workers ADD COLUMN warm TEXT")
    if "ttl" not in worker_columns:  # before registration
        db.execute("DROP TABLE workers")  # rows named by the workers themselves: they register again
        db.executescript(SCHEMA)


def _open(root: Path) -> sqlite3.Connection:
    """The queue's connection (WAL, synchronous=FULL, stamped as a bcg queue). What could be someone's data
    is only read until it is known to be a bcg queue this server can write; else QueueUnusable, one line."""
    path = root / DB
    _check_writable(root, path)
    try:
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
    except sqlite3.Error as e:
        raise _unusable(path, e) from None
    try:
        db.row_factory = sqlite3.Row
        _identify(db, path)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")  # a write: a queue that cannot take one fails here
    except sqlite3.Error as e:
        db.close()
        raise _unusable(path, e) from None
    except BaseException:
        db.close()
        raise
    return db


def _check_writable(root: Path, path: Path) -> None:
    """The root folder made, and it and the queue file writable. The mode is read too, not only access():
    root may write a 0444 file, and a file or folder someone made read-only is not the server's to write."""
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QueueUnusable(f"--root {root}: cannot make the folder ({e.strerror or e})") from None
    keep = f"; {KEEP}" if path.exists() else ""
    if not os.access(root, os.W_OK) or not root.stat().st_mode & 0o222:
        raise QueueUnusable(f"--root {root} is read-only: the queue {path} and its journal are written there; "
                            f"make the folder writable, or start on a copy in a writable folder{keep}")
    if path.exists() and (not os.access(path, os.W_OK) or not path.stat().st_mode & 0o222):
        raise QueueUnusable(f"{path} is read-only (mode {path.stat().st_mode & 0o777:o}): every job the server "
                            f"accepts is written there; make it writable (chmod u+w){keep}")


def _identify(db: sqlite3.Connection, path: Path) -> None:
    """Reads (never writes) the file's header and tables: a bcg queue, an empty file, or a queue made before
    the header was stamped pass; another program's database and a newer bcg's queue are refused."""
    tables = sorted(r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
    app_id = db.execute("PRAGMA application_id").fetchone()[0]
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if app_id != APPLICATION_ID and (app_id or not set(tables) <= QUEUE_TABLES):
        shown = ", ".join(t[:40] for t in tables[:3]) + (", ..." if len(tables) > 3 else "")
        owner = f"application id {app_id:#x}, " if app_id else ""
        raise QueueUnusable(f"{path} is not a bcg queue but another program's SQLite database ({owner}tables: "
                            f"{shown or 'none'}); bcg left it untouched: give --root a folder of its own")
    if version > SCHEMA_VERSION:
        raise QueueUnusable(f"{path} is the queue of a newer bcg (schema {version}, this one reads up to "
                            f"{SCHEMA_VERSION}): serve it with that bcg; {KEEP}")


def _unusable(path: Path, e: sqlite3.Error) -> QueueUnusable:
    """SQLite's refusal as the line a person can act on."""
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF  # the primary result code
    if code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT):
        return QueueUnusable(f"{path} is damaged or not a SQLite database ({e}); {KEEP} (`sqlite3 {path} "
                             ".recover` may save its jobs) and start on another --root meanwhile")
    if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM):
        return QueueUnusable(f"{path} cannot be written ({e}): make it and its folder writable; {KEEP}")
    return QueueUnusable(f"{path}: the queue cannot be opened ({e}); {KEEP}")

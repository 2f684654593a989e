"""Where a worker reads the files a leased job names (control images, LoRAs), by their sha256: the server's
blob store when this machine sees it, else its own store under --root, each blob downloaded once. Torch-free."""

from __future__ import annotations

from pathlib import Path

import httpx

from storyboard_cli.job.digests import file_sha256
from storyboard_cli.job.inputs import InputProblem, Inputs
from storyboard_cli.serve.blobs import BlobStore
from storyboard_cli.serve.lease_client import LeaseClient
from storyboard_cli.serve.intake import root_of
from storyboard_cli.serve.wire import LeasedJob


TRIM_GRACE_S = 600.0  # a file used this recently stays whatever --max-inputs-gb says


class InputFiles:
    """Where this worker reads the files a leased job names, by their sha256: the server's blob store when this
    machine sees it (a shared filesystem; each blob's bytes checked once per process), else its own store under
    --root, each blob downloaded once (GET /v1/blobs/{sha256}) and checked as it arrives. `shared` False
    (--upload): the server's filesystem is not used even where it is visible."""

    def __init__(self, client: LeaseClient | None, root: Path, shared: bool = True, max_bytes: int | None = None):
        self.client, self.cache, self.checked, self.shared = client, BlobStore(root), set(), shared
        self.max_bytes = max_bytes  # the most this worker's store keeps (None: no bound)

    def trim(self, keep: set[str]) -> tuple[list[str], int]:
        """Bounds this worker's store to `max_bytes`: the least recently used blobs that `keep` does not name go
        first, none used in the last TRIM_GRACE_S (a lease of another worker on the same --root may be reading it);
        each is downloaded again when a job needs it. Returns (the digests, the bytes) removed."""
        return ([], 0) if self.max_bytes is None else self.cache.trim(self.max_bytes, keep, TRIM_GRACE_S)

    def lease_starts(self, digests: set[str]) -> set[str]:
        """A lease's files in use from now (the store's own: its copies of the server's blobs): each one here counts
        as used now; returns those no longer here (another worker on the same --root removed it), which the jobs
        loaded with them must be loaded again for."""
        if self.shared:
            return set()
        gone = {d for d in digests if not self.cache.has(d)}
        for digest in digests - gone:
            self.cache.touch(digest)
        return gone

    def for_job(self, job: LeasedJob) -> Inputs:
        server = BlobStore(root_of(Path(job.path))) if self.shared else None
        return Inputs(dict(job.inputs), blob=lambda digest, suffix: self.file(digest, suffix, server))

    def file(self, digest: str, suffix: str, server: BlobStore | None) -> Path:
        if server is not None and (digest in self.checked or (server.has(digest) and
                                                              _sha256(server.path(digest)) == digest)):
            self.checked.add(digest)
            try:
                return server.path(digest, suffix)
            except OSError:  # the server's store is read-only here: its named link is made in ours
                self.cache.adopt(server.path(digest))
        elif not self.cache.has(digest):
            self._download(digest)
        return self.cache.path(digest, suffix)

    def _download(self, digest: str) -> None:
        if self.client is None:
            raise InputProblem(f"sha256 {digest[:12]}... is not in the server's store as this machine sees it")
        writer = self.cache.writer(digest, None)
        try:
            with self.client.http.stream("GET", f"/v1/blobs/{digest}") as r:
                if r.status_code != 200:
                    raise InputProblem(f"sha256 {digest[:12]}...: the server answered HTTP {r.status_code}")
                for chunk in r.iter_bytes(1 << 20):
                    writer.write(chunk)
            writer.close()  # checks the digest
        except httpx.HTTPError as e:
            writer.abort()
            raise InputProblem(f"sha256 {digest[:12]}... not downloaded: {e}") from None
        except BaseException:
            writer.abort()
            raise


def _sha256(path: Path) -> str | None:
    try:
        return file_sha256(path)
    except OSError:
        return None

"""Manifest shards: each torchrun worker appends its manifest lines to a file of its own, and the
lines are merged into manifest.jsonl at the end (or, after a dead run, when the next run starts).

One writer per file keeps appends from different machines on a shared file system apart: two
processes appending to one file over NFS can interleave or lose lines; renames and separate files
cannot.
"""

from __future__ import annotations

from pathlib import Path

from storyboard_cli.folder.layout import MANIFEST, SHARDS
from storyboard_cli.folder.outputs import Manifest


def shard_manifest(folder: Path, rank: int) -> Manifest:
    """Worker `rank`'s manifest: the same class and line format, in a folder of its own
    (`.shards/rank<N>/manifest.jsonl`)."""
    shard = folder / SHARDS / f"rank{rank}"
    shard.mkdir(parents=True, exist_ok=True)
    return Manifest(shard)


def merge_shards(folder: Path) -> int:
    """Moves every shard's lines into manifest.jsonl and deletes the shards; returns how many records
    it moved. A shard's line is newer than the manifest's for the same path (it was rendered after the
    manifest was last rewritten), so it wins. Safe after a kill at any point: the manifest is replaced
    atomically before a shard is deleted, and a line cut short is skipped."""
    shards = sorted((folder / SHARDS).glob(f"rank*/{MANIFEST}"))
    moved = 0
    if shards:
        manifest = Manifest(folder)
        for shard in shards:
            records = Manifest(shard.parent).records
            manifest.records.update(records)
            moved += len(records)
        manifest.compact()
        for shard in shards:
            shard.unlink(missing_ok=True)
    # every rank's folder, also of a worker that died before its first line
    for rank in (folder / SHARDS).glob("rank*"):
        try:
            rank.rmdir()
        except OSError:
            pass  # something else in it: left for a person to look at
    try:
        (folder / SHARDS).rmdir()
    except OSError:
        pass
    return moved

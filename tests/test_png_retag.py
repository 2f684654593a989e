"""A deduplicated image copied under another job's metadata: only the text chunks are rewritten, the pixel
data is copied as it is, and the result is what png_bytes would have written."""

import io
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from conftest import write_job
from storyboard_cli.folder.outputs import RetagError, owner, png_bytes, retag_png
from storyboard_cli.job.file import load_job
from storyboard_cli.job.plan import WorkItem, work_items
from storyboard_cli.run.render import RenderOptions, render


def _job(name: str, shot: str) -> str:
    return (f"version: 1\nname: {name}\nmodel: tiny\ndefaults: {{steps: 2, guidance: 5.0, size: 96x64}}\n"
            f"shots: [{shot}]\n")


JOB = _job("first", "{id: a, prompt: a castle on a hill, seed: 7, candidates: 2}")
# another job's shot, its prompt not latin-1: the parameters chunk becomes an iTXt
OTHER = _job("second", '{id: keep, prompt: "a castle on a hill, 城", negative: fog, seed: 7, candidates: 2}')


def _pixel_data(png: bytes) -> bytes:
    """Everything from the first IDAT chunk to the end (its 4-byte length comes before the type)."""
    return png[png.index(b"IDAT") - 4:]


def _decoded(png: bytes) -> tuple[bytes, dict]:
    with Image.open(io.BytesIO(png)) as im:
        return im.tobytes(), dict(im.info)


def _item(**kw) -> WorkItem:
    base = dict(shot="s", k=0, seed=1, prompt="a boat", negative="", width=1024, height=1024, steps=20,
                guidance=5.0, sampler="euler", outputs=("s/s_c0_s1.png",))
    return WorkItem(**(base | kw))


def test_a_rendered_image_retagged_for_another_jobs_item_is_what_png_bytes_writes(tmp_path, tiny_cpu):
    out = tmp_path / "out"
    render(load_job(write_job(tmp_path, JOB)), RenderOptions(out_dir=out), models=tiny_cpu)
    other = load_job(write_job(tmp_path, OTHER, "other.yaml"))
    twins = sorted((out / "a").glob("a_c*.png"))
    items = [owner(item, path) for item in work_items(other) for path in item.outputs]
    assert len(twins) == len(items) == 2
    for twin, item in zip(twins, items):
        data = twin.read_bytes()
        pixels, _ = _decoded(data)
        array = np.frombuffer(pixels, np.uint8).reshape(64, 96, 3)
        expected = png_bytes(array, item, other.model)
        retagged = retag_png(data, item, other.model)
        assert _pixel_data(retagged) == _pixel_data(data)  # the compressed pixels, byte for byte
        assert _decoded(retagged) == _decoded(expected)  # pixels and every text chunk
        assert retagged == expected  # the same zlib wrote the twin: the whole file is identical
        assert b"iTXt" in retagged and b"iTXt" not in data
        assert '"shot": "keep"' in _decoded(retagged)[1]["bcg"]


def _png(width=64, height=48) -> bytes:
    pixels = np.random.default_rng(3).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return png_bytes(pixels, _item(width=width, height=height), "tiny")


def _with_chunk(png: bytes, cid: bytes, body: bytes) -> bytes:
    """`png` with one more chunk before its pixel data."""
    at = png.index(b"IDAT") - 4
    chunk = len(body).to_bytes(4, "big") + cid + body + zlib.crc32(cid + body).to_bytes(4, "big")
    return png[:at] + chunk + png[at:]


def _flip(png: bytes, at: int) -> bytes:
    return png[:at] + bytes([png[at] ^ 0x10]) + png[at + 1:]


def _rgba(png: bytes) -> bytes:
    buf = io.BytesIO()
    with Image.open(io.BytesIO(png)) as im:
        im.convert("RGBA").save(buf, format="PNG")
    return buf.getvalue()


DAMAGED = {
    "a flipped bit in the pixel data": (lambda p: _flip(p, p.index(b"IDAT") + 40), "bad CRC in the b'IDAT'"),
    "a flipped bit in the text": (lambda p: _flip(p, p.index(b"tEXt") + 6), "bad CRC in the b'tEXt'"),
    "cut short": (lambda p: p[:len(p) // 2], "cut short"),
    "no IEND": (lambda p: p[:-12], "cut short"),
    "no signature": (lambda p: p[8:], "no PNG signature"),
    "bytes after IEND": (lambda p: p + b"\0", "after IEND"),
    "a chunk bcg does not write": (lambda p: _with_chunk(p, b"gAMA", (45455).to_bytes(4, "big")), "gAMA"),
    "RGBA": (_rgba, "8-bit RGB"),
}


@pytest.mark.parametrize("damage", DAMAGED, ids=list(DAMAGED))
def test_a_damaged_or_foreign_png_raises(damage):
    make, message = DAMAGED[damage]
    with pytest.raises(RetagError, match=message):
        retag_png(make(_png()), _item(width=64, height=48), "tiny")


def test_a_png_of_another_size_than_the_item_raises():
    with pytest.raises(RetagError, match="64x48 .*not the 1024x1024"):
        retag_png(_png(), _item(), "tiny")


def test_fifty_1024_images_retag_within_a_second():
    """The issue's bound for 50 cached 1024x1024 images, on incompressible pixels (the largest IDAT to check).
    CPU seconds, not wall: on a loaded test machine the wall time measures the other processes."""
    data = _png(1024, 1024)
    items = [_item(shot=f"s{i}", outputs=(f"s{i}/s{i}_c0_s1.png",)) for i in range(50)]
    t0 = time.process_time()
    out = [retag_png(data, item, "tiny") for item in items]
    cpu_s = time.process_time() - t0
    assert cpu_s < 1.0, f"50 retags took {cpu_s:.3f} CPU seconds"
    assert all(_pixel_data(o) == _pixel_data(data) for o in out)
    assert b'"shot": "s7"' in out[7]

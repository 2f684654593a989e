"""Pure tests for planning: bucket choice, padding, dedup, seeds."""

import pytest

from conftest import write_job
from storyboard_cli.job import load_job
from storyboard_cli.plan import bucket_table, cut, make_batches, work_items


@pytest.mark.parametrize("n,buckets,sizes", [
    (1, (1, 2, 4, 8), [1]), (7, (1, 2, 4, 8), [4, 2, 1]), (8, (1, 2, 4, 8), [8]), (13, (1, 2, 4, 8), [8, 4, 1]),
    (3, (2, 4), [2, 2]), (5, (4,), [4, 4]), (1, (4,), [4]), (9, (1, 8), [8, 1]),
])
def test_cut(n, buckets, sizes):
    assert cut(n, buckets) == sizes
    assert sum(sizes) >= n


def _job(tmp_path, shots: str, buckets: str = ""):
    return load_job(write_job(tmp_path, f"version: 1\nmodel: tiny\n{buckets}shots:\n{shots}"))


def test_items_get_seed_plus_k_and_their_own_files(tmp_path):
    job = _job(tmp_path, "  - {id: a, prompt: x, seed: 10, candidates: 3}\n")
    items = work_items(job)
    assert [(i.k, i.seed) for i in items] == [(0, 10), (1, 11), (2, 12)]
    assert items[2].outputs == ("a/a_c2_s12.png",)


def test_identical_requests_render_once(tmp_path):
    job = _job(tmp_path, "  - {id: a, prompt: x, seed: 10, candidates: 2}\n  - {id: b, prompt: x, seed: 11}\n")
    items = work_items(job)
    assert len(items) == 2
    assert items[1].outputs == ("a/a_c1_s11.png", "b/b_c0_s11.png")


def test_groups_by_bucket_key_and_pads_the_last_batch(tmp_path):
    job = _job(tmp_path, "  - {id: a, prompt: x, candidates: 3, size: 512x512}\n"
                         "  - {id: b, prompt: y, candidates: 2, size: 512x512, steps: 20}\n"
                         "  - {id: c, prompt: z, candidates: 2, size: 512x512}\n", "buckets: [4]\n")
    batches = make_batches(work_items(job), job.buckets)
    assert [(b.key.steps, len(b.items), b.size) for b in batches] == [(30, 4, 4), (30, 1, 4), (20, 2, 4)]
    rows = bucket_table(batches)
    first = rows[0]
    assert (first.images, first.batches, first.rows, first.padded_rows) == (5, (4, 4), 16, 6)
    assert first.row_steps == 16 * 30
    assert abs(first.waste - 6 / 16) < 1e-9


def test_control_is_part_of_the_bucket_key(tmp_path, job_dir):
    job = load_job(write_job(job_dir, "version: 1\nmodel: tiny\ncontrolnet: tiny\nshots:\n"
                                      "  - {id: a, prompt: x, candidates: 2}\n"
                                      "  - {id: b, prompt: y, control: {image: control/hero_pose.png}}\n"))
    keys = {b.key for b in make_batches(work_items(job), job.buckets)}
    assert {k.control for k in keys} == {False, True}

"""Property-based: random mutations of a good job never produce a traceback, only a JobError."""

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storyboard_cli.errors import JobError
from storyboard_cli.folder.layout import output_name
from storyboard_cli.job.file import SHOT_KEYS, TOP_KEYS, load_job
from storyboard_cli.job.plan import make_batches, work_items

GOOD = {
    "version": 1, "name": "prop", "model": "tiny",
    "defaults": {"steps": 4, "size": "128x128", "guidance": 5.0},
    "shots": [{"id": "a", "prompt": "a castle", "candidates": 2, "seed": 3},
              {"id": "b", "prompt": "a boat", "size": "portrait", "sampler": "dpmpp_2m"}],
}
values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=True) | st.text(max_size=20)
    | st.sampled_from(["square", "64x64", "1024x1000", "euler", "../x", "control/x.png", "tiny", ""]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6)
keys = st.sampled_from(sorted(set(TOP_KEYS) | set(SHOT_KEYS) | {"image", "scale", "bogus"}))


def _mutations(doc, draw):
    """Set, delete or retype one field somewhere in the document."""
    import copy

    doc = copy.deepcopy(doc)
    target = draw(st.sampled_from(["top", "defaults", "shot0", "shot1", "shots"]))
    shots = doc.get("shots") if isinstance(doc.get("shots"), list) else []
    candidates = {"top": doc, "defaults": doc.get("defaults"), "shot0": shots[0] if shots else None,
                  "shot1": shots[1] if len(shots) > 1 else None}
    container = candidates.get(target)
    if not isinstance(container, dict):
        container = doc
    if target == "shots":
        doc["shots"] = draw(st.lists(values, max_size=3)) if draw(st.booleans()) else shots * 2
        return doc
    key = draw(keys)
    if draw(st.booleans()) and key in container:
        del container[key]
    else:
        container[key] = draw(values)
    return doc


def _check(path):
    try:
        job = load_job(path)
    except JobError as e:
        assert "\n" not in str(e) and str(e).startswith(str(path))
        return
    _assert_plan_invariants(job)


def _assert_plan_invariants(job):
    """A valid job's plan: every image once, image k of a shot at seed + k, batches of a bucket size
    whose rows share a bucket key, padding only where the bucket is larger than what is left."""
    items = work_items(job)
    wanted = {output_name(s.id, k, s.seed + k) for s in job.shots for k in range(s.candidates)}
    outputs = [path for item in items for path in item.outputs]
    assert len(outputs) == len(set(outputs)) == len(wanted) and set(outputs) == wanted
    for item in items:
        assert item.outputs[0] == output_name(item.shot, item.k, item.seed)
    batches = make_batches(items, job.buckets)
    planned = [item for b in batches for item in b.items]
    assert sorted(map(id, planned)) == sorted(map(id, items))  # every item in exactly one batch
    for b in batches:
        assert b.size in job.buckets and 1 <= len(b.items) <= b.size
        assert all(item.key == b.key for item in b.items)
        if b.padding:  # only the last batch of its group, and only when no bucket fits what is left
            assert b is [x for x in batches if x.key == b.key][-1] and len(b.items) < min(job.buckets)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_documents(tmp_path, data):
    doc = GOOD
    for _ in range(data.draw(st.integers(1, 3))):
        doc = _mutations(doc, data.draw)
    path = tmp_path / "job.yaml"
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except (yaml.YAMLError, ValueError):
        return
    path.write_text(text, encoding="utf-8")
    _check(path)


def test_the_good_job_meets_the_plan_invariants(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    _assert_plan_invariants(load_job(path))  # the mutations start from a job that reaches the invariants


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 400), junk=st.binary(max_size=12))
def test_mangled_bytes(tmp_path, cut, junk):
    raw = yaml.safe_dump(GOOD).encode()
    path = tmp_path / "job.yaml"
    path.write_bytes(raw[:cut] + junk + raw[cut:])
    _check(path)

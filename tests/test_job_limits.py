"""The job parser cannot be made to explode, and its messages stay short (issue 30): YAML alias expansion has a
budget, no value of unbounded size reaches a message, `1e6` is a number, a hub id looks like owner/name."""

import json
import subprocess
import sys
import time

import pytest
import yaml
from typer.testing import CliRunner

from conftest import write_job
from storyboard_cli.cli import app
from storyboard_cli.errors import JobError, ModelError
from storyboard_cli.job.file import load_job
from storyboard_cli.job.yaml_loader import MAX_ALIAS_VALUES, short_repr
from storyboard_cli.job.preflight import check_model_path

from helpers.yaml_bombs import alias_bomb

runner = CliRunner()
BUDGET = f"YAML aliases expand to more than {MAX_ALIAS_VALUES} values"
SHORT = 300  # characters: a message quoting a huge value stays about this long at most


def _load_error(tmp_path, text: str) -> str:
    """The JobError loading `text` gives, the job file's path left out (the rest is what the message adds)."""
    path = write_job(tmp_path, text)
    with pytest.raises(JobError) as info:
        load_job(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}:")
    return message.removeprefix(str(path))


# ---------------------------------------------------------------- the alias budget


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path):
    path = write_job(tmp_path, alias_bomb())
    assert len(path.read_bytes()) < 1024
    start = time.perf_counter()
    with pytest.raises(JobError) as info:
        load_job(path)
    assert time.perf_counter() - start < 1.0
    assert str(info.value) == f"{path}:5 shot 's1' field 'prompt': {BUDGET}"


def test_a_merge_key_bomb_is_refused_before_it_is_constructed(tmp_path):
    # merge keys copy the merged pairs while the mapping is built: this one would build 9**8 pairs
    maps = ["&m0 {steps: 2}"] + [f"&m{i} {{<<: [{', '.join([f'*m{i - 1}'] * 9)}]}}" for i in range(1, 9)]
    text = "version: 1\nmodel: tiny\ndefaults:\n  <<: [" + ", ".join(maps) + "]\nshots:\n  - {id: a, prompt: x}\n"
    start = time.perf_counter()
    message = _load_error(tmp_path, text)
    assert time.perf_counter() - start < 1.0
    assert message.endswith(f":4 field 'defaults': {BUDGET}"), message


def test_an_alias_that_holds_itself_is_refused(tmp_path):
    message = _load_error(tmp_path, "version: 1\nmodel: tiny\nshots:\n  - id: s1\n    prompt: &p [x, *p]\n")
    assert message.endswith(":5 shot 's1' field 'prompt': a YAML alias refers to a list or mapping that holds it")


def test_a_job_that_reuses_its_anchors_in_every_shot_loads(tmp_path):
    shots = "".join(f"  - {{<<: *d, id: s{i}, prompt: x}}\n" for i in range(1000))
    job = load_job(write_job(tmp_path, "version: 1\nmodel: tiny\ndefaults: &d {steps: 2, size: 64x64}\n"
                                       f"shots:\n{shots}"))
    assert len(job.shots) == 1000 and {(s.steps, s.width) for s in job.shots} == {(2, 64)}


WRAPPER = """
import json, resource, subprocess, sys, time
start = time.perf_counter()
p = subprocess.run([sys.executable, "-m", "storyboard_cli", "plan", sys.argv[1]], capture_output=True, text=True,
                   timeout=60)
print(json.dumps({"rc": p.returncode, "stderr": p.stderr, "wall_s": time.perf_counter() - start,
                  "peak_rss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""


def test_bcg_plan_on_the_bomb_is_one_line_exit_2_quickly_and_small(tmp_path):
    path = write_job(tmp_path, alias_bomb())
    # a fresh process runs the plan, so that no earlier child counts in its children's peak RSS
    run = subprocess.run([sys.executable, "-c", WRAPPER, str(path)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    lines = got["stderr"].strip().splitlines()
    assert got["rc"] == 2 and len(lines) == 1 and "Traceback" not in got["stderr"], got
    assert lines[0] == f"error: {path}:5 shot 's1' field 'prompt': {BUDGET}"
    assert got["wall_s"] < 10  # Python's start on a loaded machine; the parse itself is timed in-process above
    assert got["peak_rss_kb"] < 100 * 1024, got


# ---------------------------------------------------------------- values in messages


MEGA = "x" * 100_000  # the 1 MB case is the prompt list
LONG_VALUES = {
    "prompt_list": ("prompt: [" + ", ".join(["y" * 1000] * 1000) + "]", "prompt", "must be a string, got a list"),
    "seed_100000_digits": ("prompt: x\n    seed: " + "9" * 100000, "seed", "an integer of 100000 characters"),
    "seed_4000_digits": ("prompt: x\n    seed: " + "9" * 4000, "seed", "an integer of 4000 characters"),
    "sampler": (f"prompt: x\n    sampler: {MEGA}", "sampler", "unknown sampler 'xxx"),
    "size": (f"prompt: x\n    size: {'9' * 100000}x64", "size", "must be 'WxH'"),
    "deepcache": ("prompt: x\n    deepcache: [" + ", ".join(["1"] * 2000) + "]", "deepcache", "got a list"),
    "lora_tag": (f"prompt: x <lora:{MEGA}:1>", "prompt", "unknown LoRA 'xxx"),
    "lora_tag_weight": (f"prompt: x <lora:{MEGA}:1:2>", "prompt", "<lora:xxx"),
    "key": (f"prompt: x\n    ? {MEGA}\n    : 1", "xxx", "unknown key"),  # `? `: a plain key stops at 1024
}


@pytest.mark.parametrize("case", LONG_VALUES, ids=str)
def test_a_huge_value_is_cut_in_its_message(tmp_path, case):
    shot, field, expect = LONG_VALUES[case]
    message = _load_error(tmp_path, f"version: 1\nmodel: tiny\nshots:\n  - id: s1\n    {shot}\n")
    assert len(message) < SHORT and expect in message, message
    assert f"shot 's1' field '{field}" in message, message


TOP_VALUES = {"version": MEGA, "name": MEGA, "buckets": "{" + ", ".join(f"k{i}: 1" for i in range(2000)) + "}",
              "output_dir": "/" + MEGA}


@pytest.mark.parametrize("key", TOP_VALUES, ids=str)
def test_a_huge_top_level_value_is_cut_in_its_message(tmp_path, key):
    fields = {"version": "1", "model": "tiny", key: TOP_VALUES[key]}
    text = "".join(f"{k}: {v}\n" for k, v in fields.items()) + "shots:\n  - {id: s1, prompt: x}\n"
    message = _load_error(tmp_path, text)
    assert len(message) < SHORT and f"field '{key}'" in message, message


def test_a_huge_shot_id_is_cut_in_its_message(tmp_path):
    message = _load_error(tmp_path, f"version: 1\nmodel: tiny\nshots:\n  - id: {MEGA} y\n    prompt: x\n")
    assert len(message) < SHORT and "field 'id': must be 1-64 letters" in message, message


def test_short_repr_never_builds_the_whole_repr():
    nested = ["lol"] * 9
    for _ in range(9):
        nested = [nested] * 9  # 9**10 strings once walked
    loop: list = [1]
    loop.append(loop)
    start = time.perf_counter()
    shown = [short_repr(v) for v in (nested, 10**100000, MEGA, {i: MEGA for i in range(1000)}, loop)]
    assert time.perf_counter() - start < 1.0
    assert all(len(s) <= 80 for s in shown), shown
    assert shown[1] == "<an integer of 100001 digits>"
    assert short_repr("ok") == "'ok'" and short_repr(2.5) == "2.5"


# ---------------------------------------------------------------- YAML 1.2 floats


@pytest.mark.parametrize("text, value", [("1e1", 10.0), ("1E-3", 0.001), ("2.5e+1", 25.0), ("1.5e1", 15.0),
                                         ("+3e0", 3.0), (".5e1", 5.0)])
def test_a_number_with_an_exponent_is_a_number(tmp_path, text, value):
    job = load_job(write_job(tmp_path, f"version: 1\nmodel: tiny\nshots:\n  - {{id: a, prompt: x, guidance: {text}}}\n"))
    assert job.shots[0].guidance == value


def test_control_scale_1e6_is_out_of_range_not_a_string(job_dir):
    path = write_job(job_dir, "version: 1\nmodel: tiny\ncontrolnet: tiny\nshots:\n  - id: a\n    prompt: x\n"
                              "    control: {image: control/hero_pose.png, scale: 1e6}\n")
    with pytest.raises(JobError) as info:
        load_job(path)
    assert str(info.value) == f"{path}:7 shot 'a' field 'control.scale': must be between 0 and 2, got 1e+06"


@pytest.mark.parametrize("text", ["08", "1e", "e5", "1e5x"])
def test_what_yaml_1_1_reads_as_text_without_an_exponent_stays_text(tmp_path, text):
    job = load_job(write_job(tmp_path, f"version: 1\nmodel: tiny\nshots:\n  - {{id: '{text}', prompt: {text}}}\n"))
    assert job.shots[0].prompt == text


def test_only_the_job_loader_reads_yaml_1_2_floats():
    assert yaml.safe_load("1e6") == "1e6"


# ---------------------------------------------------------------- hub ids


@pytest.mark.parametrize("spec", ["stabilityai/stable-diffusion-xl-base-1.0", "madebyollin/sdxl-vae-fp16-fix",
                                  "a/b", "Org_1/name.v2", "diffusers/controlnet-canny-sdxl-1.0"])
def test_a_hub_id_shaped_spec_is_accepted(spec):
    check_model_path(spec, "model")


@pytest.mark.parametrize("spec", ["https://huggingface.co/a/b", "a/../b", "owner/name/extra",
                                  "foo", "a/b.git", "a--b/c", "-a/b", "a/.b", "a /b", "ownér/name", "a/", "x:y"])
def test_what_is_no_preset_path_or_hub_id_is_refused(spec):
    with pytest.raises(ModelError) as info:
        check_model_path(spec, "model")
    assert str(info.value) == (f"model: {spec!r} is not a preset (tiny, sdxl-random), a path or a hub id "
                               f"(owner/name)")


def test_bcg_plan_refuses_a_url_as_a_model(tmp_path):  # a file:// URL: its path is the hint
    path = write_job(tmp_path, "version: 1\nmodel: file:///etc/passwd\nshots:\n  - {id: a, prompt: x}\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [f"error: {path}:2 field 'model': 'file:///etc/passwd' is a URL; give the path itself "
                     f"(/etc/passwd)"], result.output


@pytest.mark.parametrize("model, expect", [
    (f"{MEGA}", "is not a preset"),
    (f"/{MEGA}", "no such file or folder: /xxx"),  # a name too long for the file system
    ("~nosuchuser/x", "no such file or folder: ~nosuchuser/x"),  # a user this machine does not have
], ids=["megabyte", "too_long_for_the_file_system", "unknown_user"])
def test_a_model_that_is_no_file_is_one_short_line(tmp_path, model, expect):
    path = write_job(tmp_path, f"version: 1\nmodel: {model}\nshots:\n  - {{id: a, prompt: x}}\n")
    result = runner.invoke(app, ["plan", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert expect in result.output and len(result.output) < SHORT, result.output[:SHORT]


def test_an_output_dir_of_an_unknown_user_is_one_line(tmp_path):
    message = _load_error(tmp_path, "version: 1\nmodel: tiny\noutput_dir: ~nosuchuser/o\nshots:\n  - {id: a, prompt: x}\n")
    assert message.endswith("field 'output_dir': ~nosuchuser/o: ~nosuchuser names no user of this machine"), message


PLAIN_WORDS = {  # what the file gave, as a person would say it: no Python spelling (None, b'...', datetime.date(...))
    "nothing": ("    sampler:\n", "sampler", "must be a string, got nothing"),
    "binary": ("    sampler: !!binary aGVsbG8=\n", "sampler", "must be a string, got binary data (5 bytes)"),
    "date": ("    seed: 2024-01-02\n", "seed", "must be an integer, got a date (2024-01-02)"),
    "date_time": ("    seed: 2024-01-02 10:30:00\n", "seed", "must be an integer, got a date and time "
                                                             "(2024-01-02 10:30:00)"),
    "boolean": ("    steps: yes\n", "steps", "must be an integer, got a boolean (true)"),
    "list_with_nothing": ("    guidance: [1, ~, 2024-01-02]\n", "guidance", "must be a number, got a list ([1, null, "
                                                                             "2024-01-02])"),
    "size_as_date": ("    size: 2024-01-02\n", "size", "must be 'WxH' or one of square, portrait, landscape, wide, got "
                                                      "a date (2024-01-02)"),
    "deepcache_nothing": ("    deepcache: [~]\n", "deepcache", "must be a mapping like {interval: 3, branch: 0}, or off; "
                                                              "got a list ([null])"),
}


@pytest.mark.parametrize("case", PLAIN_WORDS, ids=str)
def test_a_wrong_value_is_said_in_plain_words(tmp_path, case):
    text, field, expect = PLAIN_WORDS[case]
    message = _load_error(tmp_path, f"version: 1\nmodel: tiny\nshots:\n  - id: s1\n    prompt: x\n{text}")
    assert message.endswith(f"shot 's1' field '{field}': {expect}"), message
    assert not any(python in message for python in ("None", "b'", "datetime", "True")), message


SUB_MAPPINGS = {  # a shot's optional mappings: not a mapping, an unknown key, the key each needs left out (a block
    # mapping's line is its first key's)
    "hires_string": ("    hires: big\n", 6, "hires", "must be a mapping like {scale: 1.5, strength: 0.35, steps: 12}, "
                                                  "or off; got a string ('big')"),
    "hires_unknown": ("    hires:\n      scale: 1.5\n      scael: 2\n", 8, "hires.scael", "unknown key; did you mean "
                                                                                          "'scale'?"),
    "hires_no_scale": ("    hires:\n      strength: 0.3\n", 7, "hires.scale", "missing (the upscale factor, e.g. "
                                                                              "1.5)"),
    "deepcache_no_interval": ("    deepcache: {branch: 1}\n", 6, "deepcache.interval", "missing (the full UNet runs "
                                                                                         "every N-th step)"),
}


@pytest.mark.parametrize("case", SUB_MAPPINGS, ids=str)
def test_a_shots_sub_mapping_names_its_line_and_the_key_at_fault(tmp_path, case):
    text, line, field, expect = SUB_MAPPINGS[case]
    message = _load_error(tmp_path, f"version: 1\nmodel: tiny\nshots:\n  - id: s1\n    prompt: x\n{text}")
    assert message == f":{line} shot 's1' field '{field}': {expect}", message


def test_a_wrong_top_level_value_is_said_in_plain_words(tmp_path):
    message = _load_error(tmp_path, "version: 2024-01-02\nmodel: tiny\nshots:\n  - {id: s1, prompt: x}\n")
    assert message.endswith("field 'version': must be 1, got 2024-01-02"), message
    message = _load_error(tmp_path, "version: 1\nmodel: tiny\nbuckets: [~]\nshots:\n  - {id: s1, prompt: x}\n")
    assert message.endswith("field 'buckets': must be an integer, got nothing"), message

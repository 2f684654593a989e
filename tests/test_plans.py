"""The library calls a step makes, recorded and made again at other rows (engine/kernels/plans.py): which calls scale,
that a scaled call is the call the step makes at those rows, and that a call made ahead is made once per process."""

import json

import pytest
import torch
import torch.nn.functional as F

from storyboard_cli.engine.kernels import plans
from storyboard_cli.engine.kernels.plans import LibraryCall, Operand, Plans, Recorder


def _step(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Two convolutions, the second on channels_last input, and pointwise work between (not recorded)."""
    y = F.conv2d(x, w, padding=1).relu()
    return F.conv2d(y.contiguous(memory_format=torch.channels_last), w2, stride=2)


def _recorded(rows: int, w, w2) -> list[LibraryCall]:
    x = torch.randn(rows, 3, 16, 16)
    with Recorder(rows) as r:
        _step(x, w, w2)
    return r.recorded()


def test_a_steps_convolutions_recorded_at_some_rows_and_scaled_are_what_it_calls_at_others():
    w, w2 = torch.randn(8, 3, 3, 3), torch.randn(4, 8, 1, 1)
    at_two, at_six = _recorded(2, w, w2), _recorded(6, w, w2)
    assert [c.op for c in at_two] == ["aten.convolution.default"] * 2 or \
        [c.op for c in at_two] == ["aten._convolution.default"] * 2, at_two
    assert [c.at(6) for c in at_two] == at_six
    weight = at_two[1].args[1]
    assert isinstance(weight, Operand) and not weight.batched and weight.shape == (4, 8, 1, 1)
    x = at_six[1].args[0]
    assert x.shape == (6, 8, 16, 16) and x.stride == (2048, 1, 128, 8)  # channels_last kept at the new rows
    for call in at_six:
        call.run()  # on uninitialised operands of those layouts


def test_a_call_whose_rows_are_not_its_outermost_dimension_or_do_not_divide_is_not_recorded():
    w = torch.randn(8, 3, 3, 3)
    x = torch.randn(3, 16, 4, 4).permute(1, 0, 2, 3)  # 16 rows inside: dimension 0 strides less than the rest spans
    with Recorder(16) as r:
        F.conv2d(x, w, padding=1)
    with Recorder(3) as r3:
        F.conv2d(torch.randn(4, 3, 4, 4), w)  # 4 rows in a step of 3: not the step's rows
    assert r.recorded() == [] and r3.recorded() == []
    assert Operand.of(torch.empty(2, 3, 4), True).outermost()
    assert not Operand.of(torch.empty(4, 3, 2).transpose(0, 2), True).outermost()


def test_a_runners_plans_record_a_warm_up_once_and_make_each_call_once_per_process(monkeypatch):
    monkeypatch.setattr(plans, "MADE", set())
    w, w2 = torch.randn(8, 3, 3, 3), torch.randn(4, 8, 1, 1)
    p = Plans(enabled=True)
    with p.recording("size", 2):
        _step(torch.randn(2, 3, 16, 16), w, w2)
    with p.recording("size", 4) as again:  # recorded already: nothing records
        _step(torch.randn(4, 3, 16, 16), w, w2)
    assert again is None and len(p.records["size"]) == 2 and {c.rows for c in p.records["size"]} == {2}
    assert p.to_make("size", 2) == []  # the warm-up ran them at its rows
    todo = p.to_make("size", 8)
    assert [c.rows for c in todo] == [8, 8]
    for call in todo:
        plans.make(call)
    assert p.to_make("size", 8) == [] and p.to_make("other", 8) == []
    p.made("size", 16)  # a capture at 16 rows made them there
    assert p.to_make("size", 16) == []
    with pytest.raises(RuntimeError):
        with p.recording("broken", 2):
            _step(torch.randn(2, 3, 16, 16), w, w2)
            raise RuntimeError("the step failed")
    assert "broken" not in p.records  # a step that raised leaves no record: the next warm-up records
    off = Plans(enabled=False)
    with off.recording("size", 2) as nothing:
        _step(torch.randn(2, 3, 16, 16), w, w2)
    assert nothing is None and off.records == {}


def test_a_call_made_ahead_that_fails_leaves_its_plan_to_the_capture(monkeypatch, caplog):
    monkeypatch.setattr(plans, "MADE", set())
    bad = LibraryCall("aten.convolution.default", (Operand((2, 3, 4, 4), (48, 16, 4, 1), torch.float32, "cpu", True),
                                                   Operand((8, 5, 3, 3), (45, 9, 3, 1), torch.float32, "cpu", False),
                                                   None, (1, 1), (0, 0), (1, 1), False, (0, 0), 1), (), 2)
    with caplog.at_level("DEBUG", logger="storyboard_cli.engine.kernels.plans"):
        plans.make(bad)  # channels disagree: the library raises, the piece does not
    assert bad in plans.MADE and "failed" in caplog.text


def test_a_kept_record_is_read_back_by_a_later_process_on_its_own_device_and_rewritten_only_when_it_changes(
        monkeypatch, tmp_path):
    monkeypatch.setattr(plans, "MADE", set())
    w, w2 = torch.randn(8, 3, 3, 3), torch.randn(4, 8, 1, 1)
    files = []

    def where(identity):
        return None if identity == "unnamed" else tmp_path / f"plans-{identity}.json"

    first = Plans(enabled=True, where=where)
    with first.recording("size", 2):
        _step(torch.randn(2, 3, 16, 16), w, w2)
    kept = tmp_path / "plans-size.json"
    assert kept.is_file() and first.kept("size") == first.records["size"]

    monkeypatch.setattr(plans, "MADE", set())  # a later process: no plan made yet
    later = Plans(enabled=True, where=where)
    assert later.records == {} and later.to_make("size", 2) == first.records["size"]
    assert later.to_make("size", 6) == [c.at(6) for c in first.records["size"]]
    monkeypatch.setattr(Plans, "_keep", lambda self, identity, calls: files.append(identity))
    with later.recording("size", 4):  # the same calls at other rows: the file stays as it was
        _step(torch.randn(4, 3, 16, 16), w, w2)
    with later.recording("other", 2):  # none kept: written
        _step(torch.randn(2, 3, 16, 16), w, w2)
    with later.recording("unnamed", 2):  # no file to keep it in: recorded all the same
        _step(torch.randn(2, 3, 16, 16), w, w2)
    assert files == ["other", "unnamed"] and later.records["unnamed"] == first.records["size"]
    monkeypatch.undo()

    kept.write_text('{"calls": [{"op": "aten.convolution.default", "args": [{"operand": [[2]]}]}]}')
    assert Plans(enabled=True, where=where).kept("size") == []  # unreadable: no record, no error
    kept.write_text("not json")
    assert Plans(enabled=True, where=where).kept("size") == []
    assert Plans(enabled=False, where=where).kept("other") == []  # off: nothing read
    def unnameable(identity):
        raise KeyError(identity)

    broken = Plans(enabled=True, where=unnameable)  # a name that cannot be made: recorded, not kept, no error
    with broken.recording("x", 2):
        _step(torch.randn(2, 3, 16, 16), w, w2)
    assert broken.records["x"] == first.records["size"] and broken.kept("x") == []
    nowhere = Plans(enabled=True, where=lambda i: tmp_path / "gone" / "plans-x.json")
    with nowhere.recording("x", 2):  # a cache that cannot be written: recorded, not kept, no error
        _step(torch.randn(2, 3, 16, 16), w, w2)
    assert nowhere.records["x"] == first.records["size"] and not (tmp_path / "gone").exists()


def test_a_recorded_calls_file_form_keeps_every_argument_and_moves_its_operands_to_the_readers_gpu():
    q = Operand((4, 10, 1024, 64), (655360, 64, 640, 1), torch.float16, "cuda:1", True)
    call = LibraryCall("aten._cudnn_attention_forward.default", (q, q, q, None, None, None, None, 1024, 1024, True,
                                                                  0.0, False, False, float("inf"), float("nan")),
                       (("dtype", torch.bfloat16), ("device", torch.device("cuda:1")),
                        ("memory_format", torch.channels_last), ("padding", (1, 1)), ("name", "x")), 2)
    back = LibraryCall.from_json(json.loads(json.dumps(call.to_json())))
    assert back.args[:13] == call.args[:13] and back.kwargs == call.kwargs and back.rows == 2
    assert back.args[13] == float("inf") and back.args[14] != back.args[14]  # nan
    moved = back.on("cuda:0")
    assert moved.args[0].device == "cuda:0" and dict(moved.kwargs)["device"] == torch.device("cuda:0")
    cpu = LibraryCall("aten.convolution.default", (Operand((2, 3), (3, 1), torch.float32, "cpu", True),), (), 2)
    assert cpu.on("cuda:0") == cpu  # another device type: left as it is
    with pytest.raises(ValueError):
        LibraryCall.from_json({"op": "x", "args": [{"dtype": "nn"}], "kwargs": [], "rows": 2})


@pytest.mark.gpu
def test_on_a_gpu_cudnn_attention_and_convolutions_are_recorded_and_made_at_other_rows():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def step(rows: int):
        q = torch.randn(rows, 1024, 10, 64, device="cuda", dtype=torch.float16).transpose(1, 2)
        x = torch.randn(rows, 64, 32, 32, device="cuda", dtype=torch.float16).contiguous(
            memory_format=torch.channels_last)
        w = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, q, q)
        F.conv2d(x, w, padding=1)

    with torch.no_grad():
        with Recorder(2) as r:
            step(2)
        ops = {c.op for c in r.recorded()}
        assert any("cudnn_attention" in op for op in ops) and any("convolution" in op for op in ops), ops
        with Recorder(8) as r8:
            step(8)
        assert [c.at(8) for c in r.recorded()] == r8.recorded()
        for call in r.recorded():
            call.at(16).run()
        torch.cuda.synchronize()


@pytest.mark.gpu
def test_on_a_gpu_a_plain_graph_captured_beside_a_compiled_cache_records_its_calls_and_keeps_no_file(tmp_path):
    """A size without kernels runs a plain graph (its kernels still building, or none for it) in a render whose runner
    has the check ledger: its warm-up's record has no artifact to be named by, so nothing is kept, and its capture
    replays what the eager step computes (before, naming its record raised inside the capture)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from storyboard_cli.engine.eager import EagerEngine
    from storyboard_cli.engine.graph.ledger import CheckLedger
    from storyboard_cli.engine.graph.runner import GraphRunner
    from storyboard_cli.engine.kernels.calls import CompiledKernels
    from storyboard_cli.models.loader import load_sdxl

    from helpers.gpu import assert_rel_close, loop_inputs

    models = load_sdxl("tiny", None, "cuda", torch.float32)
    kernels = CompiledKernels(models, None, root=tmp_path)  # an empty cache: every size plain
    runner = GraphRunner(models, max_batch=2, max_hw=(256, 256), compiled=kernels,
                         ledger=CheckLedger(models, kernels, tmp_path))
    args = loop_inputs(models, 2, 256, 256, False)
    with torch.no_grad():
        got, want = runner.sample(*args), EagerEngine(models).sample(*args)
    stats = runner.stats[runner.shape_key(2, 256, 256, False)]
    assert (stats.key.variant, stats.state) == ("plain", "graph"), stats.reason
    assert runner.plans.records and not list(tmp_path.glob("plans-*.json"))
    assert_rel_close(got, want, 1e-4)

"""The graph runner without a GPU (tests/test_draft_engine.py, test_draft.py): each 'graph' replays its captured step
function on the static buffers."""

from storyboard_cli.engine.graph.keys import ShapeKey
from storyboard_cli.engine.graph.runner import GraphRunner


def cpu_replays(runner: GraphRunner) -> list:
    """The graph runner with each 'graph' replaying its captured step function on the static buffers: the
    buffers, the step counter, the plan's graph choice and the first-replay checks, without a GPU."""
    captured = []

    class Replay:
        def __init__(self, key: ShapeKey):
            self.key = key
            captured.append(key)

        def replay(self):
            runner.stepper(runner.buf.view(self.key))

    runner.capturer = Replay
    return captured


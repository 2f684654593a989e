"""serve/folders.py's Refresher, which rebuilds a job's report and sheet off the request path: a touch that arrives
while the job is being rebuilt (its last batch landing as an earlier batch's rebuild reads the queue) rebuilds it
again, so the report never stays at "running" after the job ends."""

import threading

from storyboard_cli.serve.folders import Refresher


class Recording(Refresher):
    """Each rebuild records the job's state at the time; the first one waits until the test lets it go."""

    def __init__(self, state):
        self.state, self.seen = state, []
        self.reading, self.go = threading.Event(), threading.Event()
        super().__init__(lambda job_id: None)

    def rebuild(self, job_id):
        self.seen.append(self.state["now"])
        self.reading.set()
        self.go.wait(10)


def test_a_touch_during_a_rebuild_rebuilds_the_job_again():
    state = {"now": "running"}
    refresher = Recording(state)
    try:
        refresher.touch("j", now=True)
        assert refresher.reading.wait(10)  # a batch's rebuild has read the job: still running
        state["now"] = "succeeded"  # the last batch lands meanwhile
        refresher.touch("j", now=True)
        refresher.go.set()
        refresher.flush()
        assert refresher.seen == ["running", "succeeded"]
    finally:
        refresher.go.set()
        refresher.close()

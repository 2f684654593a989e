"""`bcg plan`'s output less its time estimate: the estimate reads this machine's GPU and cost table
(tests/test_estimate.py checks it); the rest of the output is pinned byte for byte."""

import json


def without_estimate(stdout: str) -> str:
    """The text less its `time:` line; the JSON less its `estimate` key, printed as `bcg plan --json` prints it."""
    if stdout.startswith("{"):
        data = {k: v for k, v in json.loads(stdout).items() if k != "estimate"}
        return json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    return "".join(line for line in stdout.splitlines(keepends=True) if not line.startswith("time: "))

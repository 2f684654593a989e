"""One line per shape of a `bcg capture --warm --json` record: state, capture seconds, eager and graph ms per step,
the check's reason (what the GPU call scripts print at their end).

    python benchmarks/capture_table.py capture.json
"""

import json
import sys


def main(path: str) -> None:
    try:
        d = json.load(open(path))
    except Exception as e:  # noqa: BLE001 - a cut-off run leaves no JSON: say so, do not fail the script
        print("no capture JSON:", e)
        return
    for r in d["timings"]:
        print(f"{r['shape']:<45} {r['state']:<6} cap {r['capture_s']:.2f}s eager {r['eager_ms'] or 0:.1f} "
              f"graph {r['graph_ms'] or 0:.1f} ms/step  {r['reason'][:70]}")


if __name__ == "__main__":
    main(sys.argv[1])

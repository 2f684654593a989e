"""What `bcg` shows on stderr while it works: a render's progress (a bar on a terminal; elsewhere one line per
batch) and one bar per module being compiled."""

from __future__ import annotations

from contextlib import contextmanager

from rich.text import Text

from storyboard_cli.cli_common import err, styled


@contextmanager
def render_progress(quiet: bool = False):
    """A Rich bar on stderr when it is a terminal; elsewhere (CI, nohup, a pod's log) one plain line per
    batch; nothing with --quiet. A stop request is answered at once in every case."""
    if quiet or not err.is_terminal:
        yield ProgressLines(quiet).on_event
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.fields[shot]}", markup=False, style="bold"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=err, transient=False) as bar:
        task = bar.add_task("render", total=None, shot="loading")

        def on_event(event) -> None:
            if event.kind == "start":
                bar.update(task, total=event.total, completed=0, shot="loading model")
            elif event.kind in ("image", "failed"):
                bar.update(task, completed=event.done, shot=event.shot)
                if event.kind == "failed":
                    bar.console.print(styled("failed:", "yellow", event.message))
            elif event.kind == "batch":
                bar.update(task, shot=f"{event.shot} ({event.message})")
            elif event.kind == "stopping":
                bar.console.print(styled(event.message, "bold yellow"))

        yield on_event


class ProgressLines:
    """Progress for a log: `bcg: 12/40 images, 1.52 images/s, ETA 21 s` after each batch."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.t0: float | None = None

    def on_event(self, event) -> None:
        import time

        if event.kind == "stopping":
            err.print(styled(event.message, "bold yellow"))
        elif self.quiet:
            return
        elif event.kind == "batch" and self.t0 is None:
            self.t0 = time.perf_counter()
        elif event.kind == "progress" and self.t0 is not None:
            rate = event.done / max(time.perf_counter() - self.t0, 1e-9)
            eta = f"{(event.total - event.done) / rate:.0f} s" if rate > 0 else "?"
            err.print(f"bcg: {event.done}/{event.total} images, {rate:.2f} images/s, ETA {eta}")


HEARTBEAT_S = 8.0  # the longest stretch without a progress line during a cold start (a log's reader waits no longer)


class Heartbeat:
    """What a cold start waits for now (stage events, the kernels compiling), said again as a plain line whenever
    HEARTBEAT_S passes without one: a log file under nohup, Slurm or Kubernetes shows progress, not silence."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()
        self.t0 = self.last = self.since = self._now()
        self.stage: tuple[str, float | None] = ("starting", None)  # what it waits for, about how long that takes
        self.compiling: dict[str, tuple[float, float]] = {}  # module -> (elapsed, estimate) while it compiles
        self.done = threading.Event()

    @staticmethod
    def _now() -> float:
        import time

        return time.perf_counter()

    def say(self, line: str) -> None:
        with self.lock:
            err.print(line, markup=False, highlight=False, soft_wrap=True)
            self.last = self._now()

    def begin(self, what: str, estimate_s: float | None) -> None:
        self.stage, self.since = (what, estimate_s), self._now()
        self.say(f"bcg: {what}" + (f" (about {estimate_s:.0f} s left)" if estimate_s else ""))

    def line(self) -> str:
        """The line said when nothing else was: the kernels compiling, or the stage and its time so far and left."""
        now = self._now()
        if self.compiling:
            left = max(max(0.0, est - el) for el, est in self.compiling.values())
            mods = ", ".join(f"{m} {el:.0f}/~{est:.0f} s" for m, (el, est) in sorted(self.compiling.items()))
            return f"bcg: {now - self.t0:.0f} s in: compiling {len(self.compiling)} kernels side by side ({mods}); " \
                   + (f"about {left:.0f} s left" if left else "past the estimate, still compiling")
        what, estimate = self.stage
        spent = now - self.since
        left = f", about {estimate - spent:.0f} s left" if estimate and estimate > spent else ""
        return f"bcg: {now - self.t0:.0f} s in: still {what} ({spent:.0f} s so far{left})"

    def run(self) -> None:
        while not self.done.wait(0.25):
            if self._now() - self.last >= HEARTBEAT_S:
                self.say(self.line())


@contextmanager
def compile_progress(quiet: bool, first: str | None = None):
    """One bar per module being compiled (elapsed against the measured estimate) on a terminal; a line per stage of the
    cold start (weights, builds, load checks, captures, timings: the stage events), and, whenever HEARTBEAT_S passes
    without one, a line saying what it still waits for and the time left; notes as dim lines. `first`: the stage said
    at once (the imports before the first stage event: seconds of a process's start)."""
    import threading

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    beat = Heartbeat()
    ticker = threading.Thread(target=beat.run, name="bcg-progress", daemon=True)
    with Progress(TextColumn("compiling {task.fields[module]}"), BarColumn(), TimeElapsedColumn(),
                  TextColumn("of about {task.fields[estimate]:.0f} s  {task.fields[state]}"), console=err,
                  disable=quiet or not err.is_terminal) as bar:
        tasks: dict[str, int] = {}

        def on_event(event) -> None:
            if isinstance(event, str):
                err.print(Text(event, style="dim"))
                return
            if quiet:
                return
            if event.state == "stage":
                beat.begin(event.module, event.estimate_s)
                return
            if event.module not in tasks:
                tasks[event.module] = bar.add_task("", total=event.estimate_s, module=event.module,
                                                   estimate=event.estimate_s, state="")
                if not err.is_terminal:
                    beat.say(f"bcg: compiling {event.module} (about {event.estimate_s:.0f} s)")
            done = event.state != "compiling"
            bar.update(tasks[event.module], completed=event.estimate_s if done else min(event.elapsed_s,
                                                                                         event.estimate_s),
                       state="" if not done else f"{event.state} in {event.elapsed_s:.0f} s {event.message}")
            if done:
                beat.compiling.pop(event.module, None)
                if not err.is_terminal:
                    beat.say(f"bcg: {event.module} {event.state} in {event.elapsed_s:.0f} s {event.message}".rstrip())
            else:
                beat.compiling[event.module] = (event.elapsed_s, event.estimate_s)

        if not quiet:
            if first:
                beat.begin(first, None)
            ticker.start()
        try:
            yield on_event
        finally:
            beat.done.set()

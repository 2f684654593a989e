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


@contextmanager
def compile_progress(quiet: bool):
    """One bar per module being compiled (elapsed against the measured estimate); notes as dim lines."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("compiling {task.fields[module]}"), BarColumn(), TimeElapsedColumn(),
                  TextColumn("of about {task.fields[estimate]:.0f} s  {task.fields[state]}"), console=err,
                  disable=quiet or not err.is_terminal) as bar:
        tasks: dict[str, int] = {}

        def on_event(event) -> None:
            if isinstance(event, str):
                err.print(Text(event, style="dim"))
                return
            if event.module not in tasks:
                tasks[event.module] = bar.add_task("", total=event.estimate_s, module=event.module,
                                                   estimate=event.estimate_s, state="")
                if not err.is_terminal and not quiet:
                    err.print(f"bcg: compiling {event.module} (about {event.estimate_s:.0f} s)")
            done = event.state != "compiling"
            bar.update(tasks[event.module], completed=event.estimate_s if done else min(event.elapsed_s,
                                                                                         event.estimate_s),
                       state="" if not done else f"{event.state} in {event.elapsed_s:.0f} s {event.message}")
            if done and not err.is_terminal and not quiet:
                err.print(f"bcg: {event.module} {event.state} in {event.elapsed_s:.0f} s {event.message}".rstrip())

        yield on_event
